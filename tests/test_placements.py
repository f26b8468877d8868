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

from peft_pretraining.model import modeling_llama
from peft_pretraining.model.modeling_llama import NORM_TYPES, LlamaForCausalLM, build_config
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
    ("attnres", {"attnres_blocks": 3}),  # blocks of 3 sublayers: a block's sum spans two layers
    ("mhc", {"mhc_streams": 2, "mhc_sinkhorn_iterations": 5}),
]
# the stream itself is not a running sum: written out a whole model at a time
STREAM_KINDS = ("attnres", "mhc", "siamese")
# fp32 rounding, amplified by AttnRes's softmax over depth, peaked under the randomised queries (measured up to
# 1.6e-4 with logits of size 4; the same in float64 apart from our fp32 norms): a wiring error moves them by > 1e-3.
ATOL = {"attnres": 3e-4}
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
            if name.endswith("residual.phi"):  # mHC's dynamic maps: small enough that sigmoid and Sinkhorn still bend
                p.copy_(0.02 * (torch.rand(p.shape, generator=generator) - 0.5))
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


def rms_normalised(v, eps):
    return v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps)


def expected_attnres_logits(model, tokens, depths, num_layers):
    """Block AttnRes from its equations: sublayer s (attention and MLP each count) of block b = s // S reads
    h = sum_j a_j v_j, a = softmax_j(q_s . v_j / rms(v_j)), over v = [embedding, the sum of each block so far]; its
    output F(N(h)) joins its block's sum. S = ceil(2L / blocks); the final norm reads the same with the output query."""
    config, eps = model.config, model.config.rms_norm_eps
    embedding = model.model.embed_tokens(tokens)
    rope = model.model.rotary_emb(tokens.shape[1], embedding.dtype)
    size = math.ceil(2 * num_layers / (getattr(config, "attnres_blocks", None) or 8))
    block_sums = {}

    def aggregate(query):
        sources = [embedding] + [block_sums[b] for b in sorted(block_sums)]
        logits = torch.stack([(query * rms_normalised(v, eps)).sum(-1) for v in sources])
        weights = torch.exp(logits - logits.max(0).values)
        weights = weights / weights.sum(0)
        return sum(w.unsqueeze(-1) * v for w, v in zip(weights, sources))

    for layer, depth in zip(model.model.layers, depths):
        attention = lambda y, layer=layer: layer.self_attn(y, rope, None)  # noqa: E731
        sublayers = ((layer.attn_residual, attention, layer.input_layernorm),
                     (layer.mlp_residual, layer.mlp, layer.post_attention_layernorm))
        for side, (residual, branch, norm) in enumerate(sublayers):
            block = (2 * (depth - 1) + side) // size
            output = branch(rms(aggregate(residual.query), norm.weight, eps))
            block_sums[block] = block_sums.get(block, 0) + output
    final = aggregate(model.model.residual_stream.query)
    return model.lm_head(rms(final, model.model.norm.weight, eps))


def plain_sinkhorn(logits, iterations):
    """Sinkhorn-Knopp on exp(logits): divide by the column sums, then by the row sums, `iterations` times."""
    p = torch.exp(logits)
    for _ in range(iterations):
        p = p / p.sum(-2, keepdim=True)
        p = p / p.sum(-1, keepdim=True)
    return p


def expected_mhc_maps(residual, copies, eps, iterations):
    """mHC's maps from the paper's equations: x = vec(X) / rms, then sigmoid, 2 sigmoid and Sinkhorn of
    alpha * (x phi) + b."""
    n = len(copies)
    x = rms_normalised(torch.cat(copies, dim=-1), eps)
    dynamic = x @ residual.phi.T
    pre = torch.sigmoid(residual.alpha[0] * dynamic[..., :n] + residual.pre_bias)
    post = 2 * torch.sigmoid(residual.alpha[1] * dynamic[..., n:2 * n] + residual.post_bias)
    res_logits = residual.alpha[2] * dynamic[..., 2 * n:].reshape(*dynamic.shape[:-1], n, n) + residual.res_bias
    return pre, post, plain_sinkhorn(res_logits, iterations)


def expected_mhc_logits(model, tokens):
    """mHC from its equations on a list of n copies: X'_i = sum_j H_res[i, j] X_j + H_post[i] F(N(sum_j H_pre[j] X_j));
    the final norm reads the mean of the copies."""
    config, eps = model.config, model.config.rms_norm_eps
    n = getattr(config, "mhc_streams", None) or 4
    iterations = getattr(config, "mhc_sinkhorn_iterations", None) or 20
    x = model.model.embed_tokens(tokens)
    rope = model.model.rotary_emb(tokens.shape[1], x.dtype)
    copies = [x] * n
    for layer in model.model.layers:
        attention = lambda y, layer=layer: layer.self_attn(y, rope, None)  # noqa: E731
        sublayers = ((layer.attn_residual, attention, layer.input_layernorm),
                     (layer.mlp_residual, layer.mlp, layer.post_attention_layernorm))
        for residual, branch, norm in sublayers:
            pre, post, res = expected_mhc_maps(residual, copies, eps, iterations)
            output = branch(rms(sum(pre[..., j:j + 1] * copies[j] for j in range(n)), norm.weight, eps))
            copies = [sum(res[..., i, j:j + 1] * copies[j] for j in range(n)) + post[..., i:i + 1] * output
                      for i in range(n)]
    return model.lm_head(rms(sum(copies) / n, model.model.norm.weight, eps))


def expected_siamese_logits(model, tokens, depths):
    """SiameseNorm from its equations, on a Post-LN stream X and a Pre-LN stream Y that both start as the embedding:
    each sublayer of layer l normalises X (X <- N_X(X)), reads O = F(N(X + N_Y(Y))) and adds O / sqrt(2l) to X and
    O to Y; the final norm reads N_X'(X) + N_Y'(Y), with norms of the model's own."""
    eps = model.config.rms_norm_eps
    post = pre = model.model.embed_tokens(tokens)
    rope = model.model.rotary_emb(tokens.shape[1], post.dtype)
    for layer, depth in zip(model.model.layers, depths):
        attention = lambda y, layer=layer: layer.self_attn(y, rope, None)  # noqa: E731
        sublayers = ((layer.attn_residual, attention, layer.input_layernorm),
                     (layer.mlp_residual, layer.mlp, layer.post_attention_layernorm))
        for residual, branch, norm in sublayers:
            post = rms(post, residual.post_norm.weight, eps)
            output = branch(rms(post + rms(pre, residual.pre_norm.weight, eps), norm.weight, eps))
            post, pre = post + output / math.sqrt(2 * depth), pre + output
    return model.lm_head(rms(siamese_end(model, post, pre), model.model.norm.weight, eps))


def siamese_end(model, post, pre):
    """What SiameseNorm's final norm reads, N_X'(X) + N_Y'(Y): also what a layer's output is."""
    stream, eps = model.model.residual_stream, model.config.rms_norm_eps
    return rms(post, stream.post_norm.weight, eps) + rms(pre, stream.pre_norm.weight, eps)


def expected_logits(model, tokens, kinds, depths, num_layers):
    if kinds[0] == "attnres":
        return expected_attnres_logits(model, tokens, depths, num_layers)
    if kinds[0] == "mhc":
        return expected_mhc_logits(model, tokens)
    if kinds[0] == "siamese":
        return expected_siamese_logits(model, tokens, depths)
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
    torch.testing.assert_close(model(tokens).logits, expected, rtol=0, atol=ATOL.get(norm_type, 2e-5))
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
    atol = ATOL.get(norm_type, 2e-5)
    torch.testing.assert_close(model(tokens).logits, expected, rtol=0, atol=atol)
    rebuilt = LlamaForCausalLM(model.config).eval()  # the frozen config alone rebuilds the same function
    rebuilt.load_state_dict(model.state_dict())
    torch.testing.assert_close(rebuilt(tokens).logits, expected, rtol=0, atol=atol)


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
    from peft_pretraining.training import args_utils
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


# --------------------------------------------------------------------------------------------------------------------
# AttnRes, mHC and SiameseNorm: the mixing matrix, the start, what a layer's output is, and a whole run
# --------------------------------------------------------------------------------------------------------------------

# After 20 iterations from the model's logits the column sums are within 1e-4 of 1 (measured: below 1e-6 at the
# randomised weights, the slowest case here); the rows end each iteration normalised, so they are exact to rounding.
SINKHORN_COLUMN_TOLERANCE = 1e-4


@torch.no_grad()
def test_mhc_residual_matrix_is_doubly_stochastic():
    model = randomised_model("mhc")
    residual = model.model.layers[1].mlp_residual
    stream = torch.randn(2, 5, 4, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    _, _, h_res = residual.maps(stream)
    assert h_res.shape == (2, 5, 4, 4) and bool((h_res >= 0).all())
    torch.testing.assert_close(h_res.sum(-1), torch.ones(2, 5, 4), rtol=0, atol=1e-6)
    torch.testing.assert_close(h_res.sum(-2), torch.ones(2, 5, 4), rtol=0, atol=SINKHORN_COLUMN_TOLERANCE)
    assert not torch.allclose(h_res, torch.eye(4).expand_as(h_res), atol=0.05)  # it does mix the copies


@torch.no_grad()
def test_mhc_starts_as_pre_ln():
    """phi = 0 and n equal copies: each copy is Pre-LN's stream. Only the block norms' eps sees H_pre's scale
    (sum of pre < n), so eps is made negligible here (with 1e-6 against an embedding of std 0.02 it is 2e-3)."""
    torch.manual_seed(0)
    pre = LlamaForCausalLM(build_config(TINY, norm_type="pre", rms_norm_eps=1e-12)).eval()
    mhc = LlamaForCausalLM(build_config(TINY, norm_type="mhc", rms_norm_eps=1e-12)).eval()
    mhc.load_state_dict(pre.state_dict(), strict=False)
    tokens = random_tokens()
    torch.testing.assert_close(mhc(tokens).logits, pre(tokens).logits, rtol=0, atol=1e-5)


@torch.no_grad()
def test_siamese_forgets_the_post_streams_scale_and_passes_the_pre_stream_on_unchanged():
    """SiameseNorm's split: a layer reads its Post-LN stream X only through N_X, so X's scale is forgotten (X and
    100 X give the same layer output), and adds to its Pre-LN stream Y without normalising it: with the branch
    outputs at zero, Y passes through exactly (the identity path) while X comes out normalised, N_X2(N_X1(X))."""
    model = randomised_model("siamese")
    layer, eps = model.model.layers[1], model.config.rms_norm_eps
    post, rope = layer_inputs(model, seed=2)
    pre, _ = layer_inputs(model, scale=5.0, seed=3)
    torch.testing.assert_close(layer((100 * post, pre), rope, None), layer((post, pre), rope, None), rtol=0,
                               atol=1e-5)
    layer.self_attn.o_proj.weight.zero_()
    layer.mlp.down_proj.weight.zero_()
    new_post, new_pre = layer((post, pre), rope, None)
    assert torch.equal(new_pre, pre)
    normalised_twice = rms(rms(post, layer.attn_residual.post_norm.weight, eps), layer.mlp_residual.post_norm.weight,
                           eps)
    torch.testing.assert_close(new_post, normalised_twice, rtol=0, atol=1e-6)


@pytest.mark.parametrize("norm_type", STREAM_KINDS)
@torch.no_grad()
def test_a_layers_output_is_what_the_model_would_end_on_there(norm_type):
    """output_hidden_states (and so every instrument) reads layer l's output as the stream the final norm would get
    if the model stopped after layer l: AttnRes's output query over the sources so far, mHC's mean of the copies,
    SiameseNorm's N_X'(X) + N_Y'(Y). Removing the layers after l gives the same logits. Before the first layer that
    is the embedding, except for SiameseNorm, whose final norm reads its two streams through norms of their own."""
    model = randomised_model(norm_type)
    tokens = random_tokens()
    hidden = model(tokens, output_hidden_states=True).hidden_states
    embedding = model.model.embed_tokens(tokens)
    start = siamese_end(model, embedding, embedding) if norm_type == "siamese" else embedding
    torch.testing.assert_close(hidden[0], start, rtol=0, atol=1e-6)
    for kept in (1, 2, 3):
        truncated = randomised_model(norm_type)
        for index in range(truncated.config.num_hidden_layers - 1, kept - 1, -1):
            remove_layer(truncated, index)
        torch.testing.assert_close(model.lm_head(model.model.norm(hidden[kept])), truncated(tokens).logits,
                                   rtol=0, atol=2e-5)


@pytest.mark.parametrize("norm_type", STREAM_KINDS)
@torch.no_grad()
def test_every_instrument_reads_a_stream_placements_layer_outputs(norm_type):
    """The instruments read the stream through model_io.ResidualStream, whose hooks ask the model for a layer's
    output: its states are output_hidden_states' at every depth (the last one before the final norm), pad tokens
    dropped. From them each measure covers every depth (L + 1) or block (L) with finite numbers, the logit lens after
    the last layer is the model's own distribution (KL 0, top-1 agreement 1), removing any layer changes the loss,
    and the norm gains have a row per layer."""
    from utils.instruments.model_io import ResidualStream
    from utils.instruments.norm_gains import norm_gains
    from utils.instruments.removal_loss import measure_removal
    from utils.instruments.stream import measure_stream

    model = randomised_model(norm_type)
    num_layers = model.config.num_hidden_layers
    tokens, mask = random_tokens(), torch.ones(2, 24, dtype=torch.long)
    mask[1, -5:] = 0  # a right-padded row
    states = ResidualStream(model)(tokens, mask)
    hidden = model(tokens, attention_mask=mask, output_hidden_states=True).hidden_states
    real = mask.bool()
    for depth in range(num_layers):
        torch.testing.assert_close(states[depth], hidden[depth][real], rtol=0, atol=1e-6)
    torch.testing.assert_close(model.model.norm(states[-1]), hidden[-1][real], rtol=0, atol=1e-6)

    measured = measure_stream(model, [(tokens, mask)])
    per_depth = {key: measured[key] for key in ("variance", "rms")}
    per_block = {key: measured[key] for key in ("block_influence", "update_ratio", "lens_kl", "lens_top1_agreement")}
    assert all(len(values) == num_layers + 1 for values in per_depth.values())
    assert all(len(values) == num_layers for values in per_block.values())
    assert all(math.isfinite(v) for values in (*per_depth.values(), *per_block.values()) for v in values)
    assert measured["lens_kl"][-1] == pytest.approx(0.0, abs=1e-5) and measured["lens_top1_agreement"][-1] == 1.0
    removal = measure_removal(model, [(tokens, mask)])
    assert len(removal["removal_cost"]) == num_layers and all(abs(cost) > 1e-4 for cost in removal["removal_cost"])
    assert len(norm_gains(model.state_dict())["per_layer"]) == num_layers


@pytest.mark.e2e
@pytest.mark.parametrize("norm_type", STREAM_KINDS)
def test_stream_placement_trains_saves_resumes_and_loads(norm_type, tmp_path, monkeypatch):
    """Four updates through the trainer, saving at 2 and 4; a resume from update 2 repeats updates 3 and 4 bit for bit
    (losses, gradient norms, weights); the checkpoint loads with trust_remote_code; export to stock Llama is refused
    in one line."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from peft_pretraining.exit_codes import ExitCode
    from peft_pretraining.model.llama_export import export_to_hf_llama
    from tests.test_training import read_jsonl, train_in_process

    run_dir, resumed_dir = tmp_path / "run", tmp_path / "resumed"
    four_updates = ["--norm_type", norm_type, "--num_training_steps", "4"]
    assert train_in_process(four_updates, run_dir, monkeypatch) == ExitCode.FINISHED
    assert train_in_process([*four_updates, "--continue_from", str(run_dir / "model_2")], resumed_dir,
                            monkeypatch) == ExitCode.FINISHED
    results = json.loads((resumed_dir / "results.json").read_text())
    assert results["status"] == "finished" and results["step"] == 4 and math.isfinite(results["final_eval_loss"])
    uninterrupted, resumed = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(resumed_dir / "metrics.jsonl")
    assert [row["step"] for row in resumed] == [3, 4]
    for key in ("loss", "grad_norm"):
        assert [row[key] for row in resumed] == [row[key] for row in uninterrupted[2:]], key
    weights, resumed_weights = (load_file(path / "model_4" / "model.safetensors") for path in (run_dir, resumed_dir))
    assert weights.keys() == resumed_weights.keys()
    assert all(torch.equal(weights[name], resumed_weights[name]) for name in weights)
    loaded = AutoModelForCausalLM.from_pretrained(run_dir / "model_4", trust_remote_code=True).eval()
    assert loaded.config.norm_type == norm_type
    tokens = random_tokens()
    with torch.no_grad():
        assert torch.isfinite(loaded(tokens).logits).all()
    with pytest.raises(ValueError, match="no stock-HF equivalent") as error:
        export_to_hf_llama(loaded)
    assert "\n" not in str(error.value)


@pytest.mark.e2e
@pytest.mark.parametrize("norm_type", STREAM_KINDS)
def test_angular_analysis_and_layer_removal_run_on_a_stream_placement(norm_type, tmp_path):
    from tests.analysis_helpers import heldout_documents, run_cli, save_with_tokenizer, write_jsonl

    model_dir = save_with_tokenizer(randomised_model(norm_type), tmp_path / "model")
    text = write_jsonl(tmp_path / "text.jsonl", heldout_documents(4))
    result = run_cli("utils/angular_analysis.py", "--model_path", str(model_dir), "--text_file", str(text),
                     "--num_tokens", "200", "--max_seq_len", "64", "--batch_size", "4", "--output_dir",
                     str(tmp_path / "angular"))
    assert result.returncode == 0, result.stderr[-2000:]
    result = run_cli("layer_remove.py", "--model_path", str(model_dir), "--layer_index", "1", "--save_path",
                     str(tmp_path / "removed"))
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.e2e  # the removal sweep goes through lm-eval: tens of seconds
@pytest.mark.parametrize("norm_type", STREAM_KINDS)
def test_the_studys_measures_skip_block_jacobians_where_the_stream_is_no_running_sum(norm_type, tmp_path, capsys):
    """A block Jacobian perturbs the tensor a block passes on, which AttnRes, mHC and SiameseNorm do not pass: the
    study's one measurement call records none (its other measures still run), and jacobian_analysis.py says so in
    one line."""
    from tests.analysis_helpers import save_with_tokenizer
    from utils import jacobian_analysis
    from utils.instruments import model_io
    from utils.instruments.jacobian import NO_BLOCK_JACOBIAN, stream_is_a_running_sum
    from utils.instruments.measure import MeasureSettings, measure_model

    assert stream_is_a_running_sum(randomised_model("pre"))
    model_dir = save_with_tokenizer(randomised_model(norm_type), tmp_path / "model")
    model, tokenizer = model_io.load_model_and_tokenizer(str(model_dir))
    assert not stream_is_a_running_sum(model)
    measured = measure_model(model, tokenizer, MeasureSettings(max_seq_len=32, stream_tokens=64, jacobian_tokens=2,
                                                               jacobian_probes=0, removal_documents=1))
    assert measured["jacobian"] == [] and measured["jacobian_method"] == NO_BLOCK_JACOBIAN
    assert len(measured["variance"]) == model.config.num_hidden_layers + 1
    with pytest.raises(SystemExit) as stop:
        jacobian_analysis.main(["--model_path", str(model_dir), "--output_dir", str(tmp_path / "jacobian")])
    assert stop.value.code == 2
    assert "not a running sum" in capsys.readouterr().err
