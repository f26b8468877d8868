"""Every norm placement against a forward written out here, independently of the placement modules.

The attention and MLP sublayers are the model's own (they are checked against stock HF Llama in test_model.py);
the norms, the residual wiring and every constant (1/sqrt(l), alpha, L^-a, gates) are recomputed below from the raw
parameters. All norm gains, gates and DyT parameters are randomised first, so a gain or gate in the wrong place, a
wrong depth, or a swapped norm changes the logits.
"""
import math

import pytest
import torch

from layer_remove import remove_layer
from peft_pretraining.modeling_llama import NORM_TYPES, LlamaForCausalLM, build_config
from tests.test_model import TINY, random_tokens

POST_NUM = 2
VARIANTS = [(norm_type, {}) for norm_type in NORM_TYPES] + [
    ("completep", {"completep_alpha": 0.5}),
    ("layerscale", {"layerscale_form": "scalar"}),
]


def variant_id(variant):
    norm_type, options = variant
    return "-".join([norm_type, *(f"{k}={v}" for k, v in options.items())])


def randomised_model(norm_type, **options):
    torch.manual_seed(0)
    config = build_config(TINY, norm_type=norm_type, post_num=POST_NUM, initializer_range=0.1, **options)
    model = LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith(("proj.weight", "embed_tokens.weight", "lm_head.weight")):
                p.copy_(torch.rand(p.shape, generator=generator) + 0.5)  # norm gains and biases, gates, DyT alpha
    return model


def rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def dyt(x, module):
    return module.weight * torch.tanh(module.alpha * x) + module.bias


def expected_sublayer(kind, x, branch, norm, residual, depth, num_layers, config):
    """One residual sublayer, written from each method's definition."""
    eps = config.rms_norm_eps
    n = (lambda y: dyt(y, norm)) if kind == "dyt" else (lambda y: rms(y, norm.weight, eps))
    if kind in ("pre", "dyt"):
        return x + branch(n(x))
    if kind == "lns":
        return x + branch(n(x) / math.sqrt(depth))
    if kind == "post":
        return n(x + branch(x))
    if kind == "deepnorm":
        return n((2 * num_layers) ** 0.25 * x + branch(x))
    if kind in ("layerscale", "skipinit"):
        return x + residual.gain * branch(n(x))
    if kind == "completep":
        return x + num_layers ** -getattr(config, "completep_alpha", 1.0) * branch(n(x))
    if kind in ("peri", "peri_lns"):
        scale = 1 / math.sqrt(depth) if kind == "peri_lns" else 1.0
        return x + rms(branch(n(x) * scale), residual.output_norm.weight, eps)
    if kind == "reordered":
        return x + n(branch(x))
    raise AssertionError(f"no reference forward for {kind}")


def expected_logits(model, tokens, kinds, depths, num_layers):
    x = model.model.embed_tokens(tokens)
    rope = model.model.rotary_emb(tokens.shape[1], x.dtype)
    for layer, kind, depth in zip(model.model.layers, kinds, depths):
        attn = lambda y, layer=layer: layer.self_attn(y, rope, None)  # noqa: E731
        x = expected_sublayer(kind, x, attn, layer.input_layernorm, layer.attn_residual, depth, num_layers,
                              model.config)
        x = expected_sublayer(kind, x, layer.mlp, layer.post_attention_layernorm, layer.mlp_residual, depth,
                              num_layers, model.config)
    final = dyt(x, model.model.norm) if "dyt" in kinds else rms(x, model.model.norm.weight, model.config.rms_norm_eps)
    return model.lm_head(final)


def layer_kinds(norm_type, num_layers=4):
    if norm_type == "post_pre":
        return ["post"] * POST_NUM + ["pre"] * (num_layers - POST_NUM)
    return [norm_type] * num_layers


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
@torch.no_grad()
def test_placement_matches_its_written_out_forward(variant):
    norm_type, options = variant
    model = randomised_model(norm_type, **options)
    tokens = random_tokens()
    expected = expected_logits(model, tokens, layer_kinds(norm_type), [1, 2, 3, 4], 4)
    torch.testing.assert_close(model(tokens).logits, expected, rtol=0, atol=2e-5)
    if norm_type != "pre":  # the check can fail: the Pre-LN forward on the same weights is another function
        pre_forward = expected_logits(model, tokens, ["pre"] * 4, [1, 2, 3, 4], 4)
        assert not torch.allclose(model(tokens).logits, pre_forward, atol=1e-3)


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
@torch.no_grad()
def test_removed_layer_keeps_each_layers_placement_and_depth(variant):
    norm_type, options = variant
    model = randomised_model(norm_type, **options)
    kinds = layer_kinds(norm_type)
    remove_layer(model, 1)
    tokens = random_tokens()
    # The survivors keep their original depths 1, 3, 4 and the trained L = 4 (DeepNorm's alpha, CompleteP's L^-a).
    expected = expected_logits(model, tokens, kinds[:1] + kinds[2:], [1, 3, 4], 4)
    torch.testing.assert_close(model(tokens).logits, expected, rtol=0, atol=2e-5)
    rebuilt = LlamaForCausalLM(model.config).eval()  # the frozen config alone rebuilds the same function
    rebuilt.load_state_dict(model.state_dict())
    torch.testing.assert_close(rebuilt(tokens).logits, expected, rtol=0, atol=2e-5)
