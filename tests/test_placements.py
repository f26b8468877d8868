"""Every norm placement against a forward written out here, independently of the placement modules.

The attention and MLP sublayers are the model's own (they are checked against stock HF Llama in test_model.py);
the norms, the residual wiring and every constant (1/sqrt(l), alpha, L^-a, gates) are recomputed below from the raw
parameters. All norm gains, gates and DyT parameters are randomised first, so a gain or gate in the wrong place, a
wrong depth, or a swapped norm changes the logits. GPAS, BHyT and HybridNorm couple a layer's two sublayers (a shared
gate, a shared statistic, q/k/v norms inside attention), so they are written out a whole layer at a time, HybridNorm's
attention included. Below them, the property that defines each of the three.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from peft_pretraining import modeling_llama
from peft_pretraining.modeling_llama import NORM_TYPES, LlamaForCausalLM, build_config
from tests.test_model import TINY, random_tokens
from utils.instruments.removal import remove_layer

POST_NUM = 2
VARIANTS = [(norm_type, {}) for norm_type in NORM_TYPES] + [
    ("completep", {"completep_alpha": 0.5}),
    ("layerscale", {"layerscale_form": "scalar"}),
    # T = 1 makes BHyT's attention term in the MLP norm's variance as large as the input's, so leaving it out shows;
    # two key/value heads check that each one counts once per query head it serves.
    ("bhyt", {"train_max_length": 1}),
    ("bhyt", {"train_max_length": 1, "num_key_value_heads": 2}),
]
LAYER_COUPLED = ("gpas", "lns_gpas", "bhyt", "hybridnorm")


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
    gain = getattr(norm, "weight", 1.0)  # HybridNorm has no norm before attention; "pre" on its weights then uses 1
    n = (lambda y: dyt(y, norm)) if kind == "dyt" else (lambda y: rms(y, gain, eps))
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


def silu(g):
    return g / (1 + torch.exp(-g))


def bhyt(x, norm, variance, kappa=10.0):
    """Byun et al.: w * tanh(lambda * x / (kappa * sqrt(var + 1e-6)))."""
    return norm.weight * torch.tanh(norm.lam * x / (kappa * torch.sqrt(variance + 1e-6)))


def value_output_norm(attention, config):
    """||W_V^T W_O^T||_F^2, the value weights of each query head's key/value head stacked head by head."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // heads
    w_v = attention.v_proj.weight
    stacked = torch.cat([w_v[(h * kv_heads // heads) * head_dim:][:head_dim] for h in range(heads)])
    return torch.linalg.matrix_norm(stacked.T @ attention.o_proj.weight.T) ** 2


def qkv_normed_attention(attention, x, rope, config):
    """Causal softmax attention with each head's q, k and v RMS-normalised (their own gains) before RoPE."""
    batch, length, _ = x.shape
    heads, eps = config.num_attention_heads, config.rms_norm_eps
    head_dim = config.hidden_size // heads
    cos, sin = rope

    def heads_of(projection, norm):
        return rms((x @ projection.weight.T).view(batch, length, heads, head_dim).transpose(1, 2), norm.weight, eps)

    def rotate(y):
        half = head_dim // 2
        return y * cos + torch.cat((-y[..., half:], y[..., :half]), dim=-1) * sin

    q, k = rotate(heads_of(attention.q_proj, attention.q_norm)), rotate(heads_of(attention.k_proj, attention.k_norm))
    v = heads_of(attention.v_proj, attention.v_norm)
    scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
    scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, length, -1)
    return out @ attention.o_proj.weight.T


def expected_layer(kind, x, layer, rope, depth, config):
    """A whole decoder layer of GPAS, LNS + GPAS, BHyT or HybridNorm, from the papers' equations."""
    eps = config.rms_norm_eps
    attn = lambda y: layer.self_attn(y, rope, None)  # noqa: E731
    n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
    if kind in ("gpas", "lns_gpas"):  # one gate g per layer; forward value y - silu(g) * y after each sublayer
        gate = silu(layer.attn_residual.gate)
        scale = 1 / math.sqrt(depth) if kind == "lns_gpas" else 1.0
        h = x + attn(rms(x, n1.weight, eps) * scale)
        h = h - gate * h
        out = h + layer.mlp(rms(h, n2.weight, eps) * scale)
        return out - gate * out
    if kind == "bhyt":  # exact statistics before attention; before the MLP var(x) + c * (lambda_1 / kappa)^2
        input_variance = x.pow(2).mean(-1, keepdim=True)
        h = x + attn(bhyt(x, n1, input_variance))
        seq_len = getattr(config, "train_max_length", None) or config.max_position_embeddings
        c = value_output_norm(layer.self_attn, config) / (seq_len * config.hidden_size)
        return h + layer.mlp(bhyt(h, n2, input_variance + c * (n1.lam / 10.0) ** 2))
    if kind == "hybridnorm":  # no norm before attention, q/k/v norms inside it; the MLP's norm on the stream
        h = x + qkv_normed_attention(layer.self_attn, x, rope, config)
        y = rms(h, n2.weight, eps)
        return y + layer.mlp(y)
    raise AssertionError(f"no reference layer for {kind}")


def expected_logits(model, tokens, kinds, depths, num_layers):
    x = model.model.embed_tokens(tokens)
    rope = model.model.rotary_emb(tokens.shape[1], x.dtype)
    for layer, kind, depth in zip(model.model.layers, kinds, depths):
        if kind in LAYER_COUPLED:
            x = expected_layer(kind, x, layer, rope, depth, model.config)
            continue
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


# --------------------------------------------------------------------------------------------------------------------
# The property that defines GPAS, BHyT and HybridNorm
# --------------------------------------------------------------------------------------------------------------------


def layer_inputs(model, scale=1.0, seed=2):
    x = torch.randn(2, 12, model.config.hidden_size, generator=torch.Generator().manual_seed(seed)) * scale
    return x, model.model.rotary_emb(12, x.dtype)


@pytest.mark.parametrize("norm_type", ["gpas", "lns_gpas"])
def test_gpas_scales_activations_but_passes_their_gradient_unscaled(norm_type):
    """y - silu(g) * stopgrad(y): the value shrinks by 1 - silu(g), yet every gradient below the gate (the layer input,
    the attention weights, the norm gain) is the one without the gate. A gate without the stop-gradient, or a plain
    (1 - silu(g)) * y, would scale them all by 1 - silu(g) (0.27 at g = 1). The MLP sublayer uses the same gate."""
    model = randomised_model(norm_type)
    layer = model.model.layers[0]
    gated = layer.attn_residual
    with torch.no_grad():
        gated.gate.fill_(1.0)
    x, rope = layer_inputs(model)
    x.requires_grad_(True)
    attn = lambda y: layer.self_attn(y, rope, None)  # noqa: E731
    with_gate = gated(x, attn, layer.input_layernorm)
    without_gate = gated.inner(x, attn, layer.input_layernorm)
    keep = 1 - silu(torch.tensor(1.0))
    torch.testing.assert_close(with_gate, keep * without_gate)

    cotangent = torch.randn(with_gate.shape, generator=torch.Generator().manual_seed(3))
    below = [x, *layer.self_attn.parameters(), layer.input_layernorm.weight]
    grads_with = torch.autograd.grad(with_gate, below, cotangent, retain_graph=True)
    grads_without = torch.autograd.grad(without_gate, below, cotangent, retain_graph=True)
    for name, got, expected in zip(["x", *(n for n, _ in layer.self_attn.named_parameters()), "norm"], grads_with,
                                   grads_without):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7, msg=f"gradient of {name} was scaled")
    (gate_grad,) = torch.autograd.grad(with_gate, gated.gate, cotangent)
    sigmoid = torch.sigmoid(torch.tensor(1.0))
    d_silu = sigmoid * (1 + 1.0 * (1 - sigmoid))
    torch.testing.assert_close(gate_grad, -d_silu * (without_gate * cotangent).sum().reshape(1), rtol=1e-5, atol=0)

    # One gate per layer: the MLP sublayer has none of its own and scales by the attention side's.
    assert [name for name, _ in layer.mlp_residual.named_parameters()] == []
    h = without_gate.detach()
    torch.testing.assert_close(layer.mlp_residual(h, layer.mlp, layer.post_attention_layernorm),
                               keep * layer.mlp_residual.inner(h, layer.mlp, layer.post_attention_layernorm))


def tanh_input(norm, x):
    """What BHyT feeds its tanh, read back from the output with the gain at 1."""
    with torch.no_grad():
        norm.weight.fill_(1.0)
        return torch.atanh(norm(x).double())


@pytest.mark.e2e
def test_bhyt_bounds_the_tanh_input_whatever_the_scale_of_the_stream():
    """BHyT's bound: before attention the tanh input has RMS lambda / kappa over the channels of every token, so every
    entry is within lambda * sqrt(d) / kappa, for a residual stream of any scale (deep Pre-LN streams grow by orders
    of magnitude): the norm's output does not change with that scale. DyT, the same tanh without the data-driven
    bound, saturates instead."""
    model = randomised_model("bhyt")
    norm = model.model.layers[0].input_layernorm
    lam, kappa, width = norm.lam.item(), 10.0, model.config.hidden_size
    reference = None
    for scale in (0.1, 1.0, 1e3):
        x, _ = layer_inputs(model, scale)
        argument = tanh_input(norm, x)
        token_rms = argument.pow(2).mean(-1).sqrt()
        torch.testing.assert_close(token_rms, torch.full_like(token_rms, lam / kappa), rtol=1e-4, atol=0)
        assert argument.abs().max() <= lam * math.sqrt(width) / kappa
        reference = argument if reference is None else reference
        torch.testing.assert_close(argument, reference, rtol=1e-4, atol=1e-6)
    dyt_norm = randomised_model("dyt").model.layers[0].input_layernorm
    with torch.no_grad():
        saturated = dyt_norm(layer_inputs(model, 1e3)[0] / dyt_norm.weight)  # weight * tanh(alpha x) + bias
    assert ((saturated - dyt_norm.bias).abs() / dyt_norm.weight.abs() > 0.999).float().mean() > 0.9


def captured_qkv(model, x, rope, monkeypatch):
    captured, sdpa = {}, F.scaled_dot_product_attention

    def recording_sdpa(q, k, v, **kwargs):
        captured.update(q=q, k=k, v=v)
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(modeling_llama.F, "scaled_dot_product_attention", recording_sdpa)
    with torch.no_grad():
        out = model.model.layers[0].self_attn(x, rope, None)
    monkeypatch.undo()
    return out, captured


def test_hybridnorm_normalises_q_k_and_v(monkeypatch):
    """Every head's q, k and v reaching the attention kernel has RMS 1 over head_dim (gains at their init, 1; RoPE
    rotates pairs of q and k, keeping that norm), though no norm precedes the attention: the sublayer's output is the
    same for a stream 100 times larger. Pre-LN's attention, fed the same raw stream, has neither property."""
    model = LlamaForCausalLM(build_config(TINY, norm_type="hybridnorm", initializer_range=0.1)).eval()
    x, rope = layer_inputs(model, scale=3.0)
    out, qkv = captured_qkv(model, x, rope, monkeypatch)
    for name, tensor in qkv.items():
        head_rms = tensor.pow(2).mean(-1).sqrt()
        torch.testing.assert_close(head_rms, torch.ones_like(head_rms), rtol=1e-4, atol=0, msg=f"{name} not normed")
    larger, _ = captured_qkv(model, 100 * x, rope, monkeypatch)
    torch.testing.assert_close(larger, out, rtol=1e-4, atol=1e-6)

    pre = LlamaForCausalLM(build_config(TINY, norm_type="pre", initializer_range=0.1)).eval()
    pre_out, pre_qkv = captured_qkv(pre, x, rope, monkeypatch)
    assert not torch.allclose(pre_qkv["v"].pow(2).mean(-1).sqrt(), torch.ones(1), rtol=0.1)
    assert not torch.allclose(captured_qkv(pre, 100 * x, rope, monkeypatch)[0], pre_out, rtol=1e-2)


# --------------------------------------------------------------------------------------------------------------------
# A placement is one class and one row: a toy row reaches the trainer's flags, the model and a study arm
# --------------------------------------------------------------------------------------------------------------------


class ToyScaledBranch(torch.nn.Module):
    """x + s * F(N(x)), s the toy row's one setting."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, x, sublayer, norm):
        return x + self.scale * sublayer(norm(x))


@pytest.fixture
def toy_row(monkeypatch):
    """The toy placement's row, in PLACEMENTS for one test (monkeypatch removes it after)."""
    scale = modeling_llama.Setting("toy_scale", "toy: the branch multiplier", 0.5, positive=True)
    row = modeling_llama.Placement("Toy branch", modeling_llama.each_sublayer(
        lambda layer: ToyScaledBranch(layer.plan.settings["toy_scale"])), settings=(scale,))
    monkeypatch.setitem(modeling_llama.PLACEMENTS, "toy", row)
    return row


def test_a_toy_row_reaches_the_trainer_the_model_and_a_study(toy_row):
    from peft_pretraining import args_utils
    from utils import compare_norms

    parser = args_utils.build_parser()
    choices = next(action.choices for action in parser._actions if action.dest == "norm_type")
    assert "toy" in choices
    args = args_utils.parse_args(["--model_config", "configs/llama_tiny.json", "--batch_size", "1",
                                  "--norm_type", "Toy", "--toy_scale", "0.25"], world_size=1)
    assert (args.norm_type, args.toy_scale) == ("toy", 0.25) and "toy_scale" in args_utils.model_options()
    with pytest.raises(SystemExit):
        args_utils.parse_args(["--model_config", "configs/llama_tiny.json", "--batch_size", "1",
                               "--norm_type", "toy", "--toy_scale", "-1"], world_size=1)

    torch.manual_seed(0)
    model = LlamaForCausalLM(build_config(TINY, norm_type="toy", toy_scale=0.25)).eval()
    tokens = random_tokens()
    with torch.no_grad():
        x = model.model.embed_tokens(tokens)
        rope = model.model.rotary_emb(tokens.shape[1], x.dtype)
        eps = model.config.rms_norm_eps
        for layer in model.model.layers:
            x = x + 0.25 * layer.self_attn(rms(x, layer.input_layernorm.weight, eps), rope, None)
            x = x + 0.25 * layer.mlp(rms(x, layer.post_attention_layernorm.weight, eps))
        expected = model.lm_head(rms(x, model.model.norm.weight, eps))
        torch.testing.assert_close(model(tokens).logits, expected, rtol=0, atol=2e-5)

    arm = compare_norms.placement_arm("toy", "rivals", detail=" (s = 0.25)", flags=("--toy_scale", "0.25"))
    assert arm.label == "Toy branch (s = 0.25)"
    study = compare_norms.parse_args(["--budget", "quick"])
    (spec,) = [s for s in compare_norms.run_specs(study, [arm]) if s.seed == study.settings["seeds"][0]]
    trained = args_utils.build_parser().parse_args(list(spec.train_flags))
    assert (trained.norm_type, trained.toy_scale) == ("toy", 0.25)


def placement_table_rows(text: str) -> dict[str, list[str]]:
    """{norm type: its lines} of the docs' placement table, found by the `--norm_type X` in the flag column."""
    table = text.split("## Norm placements", 1)[1].split("\n\n| method |", 1)[1].split("\n\n", 1)[0]
    found = {}
    for line in table.splitlines()[2:]:
        flag = line.split(" | ")[1]
        name = flag.split("--norm_type ", 1)[1].split()[0].strip("`")
        found.setdefault(name, []).append(line)
    return found


def test_the_docs_placement_table_has_every_row_and_its_settings():
    """docs/training.md's table: one line (or more) per row of PLACEMENTS, no line for a name that is no row; each
    row's first line names its label, and every setting of the row has its flag in the row's lines."""
    text = (modeling_llama.__file__.rsplit("/peft_pretraining/", 1)[0] + "/docs/training.md")
    documented = placement_table_rows(open(text).read())
    assert sorted(documented) == sorted(modeling_llama.PLACEMENTS)
    for name, row in modeling_llama.PLACEMENTS.items():
        assert row.label in documented[name][0].split(" | ")[0], (name, row.label)
        for setting in row.settings:
            assert any(f"--{setting.key}" in line for line in documented[name]), (name, setting.key)
