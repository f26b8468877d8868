"""A LLaMA decoder whose norm placement is chosen by name.

The only thing that differs between Pre-LN, Post-LN, Mix-LN, LayerNorm Scaling (LNS), DeepNorm and LayerScale is
how each sublayer (attention, MLP) is wrapped with its norm and residual. Each wrapping is a small `Residual`
module below; a decoder layer holds two of them and never branches on the variant. Parameter names are exactly
those of `transformers.LlamaForCausalLM`, so weights move freely between the two.

The model is built from a `transformers.LlamaConfig` with three extra attributes:
    norm_type    pre | post | post_pre | lns | deepnorm | layerscale   (case-insensitive; "LNS" works)
    post_num     Mix-LN: layers with 0-based index < post_num are Post-LN, the rest Pre-LN
    init_method  normal | scaled
Optional per-layer attributes (`layer_norm_types`, `layer_depths`, `deepnorm_num_layers`) pin each layer's
placement and LNS depth explicitly; `freeze_layer_plan` writes them, so that a layer keeps what it was trained
with after another layer is removed.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import GenerationMixin, LlamaConfig, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import CausalLMOutput

NORM_TYPES = ("pre", "post", "post_pre", "lns", "deepnorm", "layerscale")
LAYER_PLACEMENTS = ("pre", "post", "lns", "deepnorm", "layerscale")
INIT_METHODS = ("normal", "scaled")
DEFAULT_LAYERSCALE_INIT = 0.1


def _choice(value, valid, what: str) -> str:
    name = str(value).lower()
    if name not in valid:
        raise ValueError(f"unknown {what} {value!r}; valid choices: {', '.join(valid)}")
    return name


# --------------------------------------------------------------------------------------------------------------------
# Which placement and depth each layer gets
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerPlan:
    placements: list[str]  # one of LAYER_PLACEMENTS per layer
    depths: list[int]  # 1-based depth of each layer, used by LNS
    deepnorm_num_layers: int  # the L in DeepNorm's alpha = (2L)^1/4 and beta = (8L)^-1/4
    init_method: str


def layer_plan(config) -> LayerPlan:
    """The per-layer placement and depth implied by the config; validates every value."""
    num_layers = config.num_hidden_layers
    norm_type = _choice(getattr(config, "norm_type", "pre"), NORM_TYPES, "norm_type")
    init_method = _choice(getattr(config, "init_method", "normal"), INIT_METHODS, "init_method")

    placements = getattr(config, "layer_norm_types", None)
    if placements is None:
        if norm_type == "post_pre":
            post_num = getattr(config, "post_num", None)
            if not isinstance(post_num, int) or isinstance(post_num, bool) or not 0 <= post_num <= num_layers:
                raise ValueError(f"post_num={post_num!r} is out of range for post_pre; valid: an int in [0, {num_layers}]")
            placements = ["post"] * post_num + ["pre"] * (num_layers - post_num)
        else:
            placements = [norm_type] * num_layers
    placements = [_choice(p, LAYER_PLACEMENTS, "layer placement") for p in placements]

    depths = list(getattr(config, "layer_depths", None) or range(1, num_layers + 1))
    deepnorm_num_layers = getattr(config, "deepnorm_num_layers", None) or num_layers
    if len(placements) != num_layers or len(depths) != num_layers:
        raise ValueError(
            f"layer_norm_types ({len(placements)}) and layer_depths ({len(depths)}) must both have "
            f"num_hidden_layers={num_layers} entries"
        )
    return LayerPlan(placements, depths, deepnorm_num_layers, init_method)


def freeze_layer_plan(config):
    """Write each layer's placement and depth into the config, so they survive removing a layer."""
    plan = layer_plan(config)
    config.layer_norm_types = list(plan.placements)
    config.layer_depths = list(plan.depths)
    config.deepnorm_num_layers = plan.deepnorm_num_layers
    return config


def build_config(path_or_config, norm_type: str = "pre", post_num: int = 0, init_method: str = "normal", **overrides):
    """Load a model JSON (or copy a config) and set the norm placement; validates by building the layer plan."""
    if isinstance(path_or_config, LlamaConfig):
        config = LlamaConfig.from_dict(path_or_config.to_dict())
    else:
        config = LlamaConfig.from_json_file(str(path_or_config))
    config.norm_type = str(norm_type).lower()
    config.post_num = int(post_num)
    config.init_method = str(init_method).lower()
    for key, value in overrides.items():
        setattr(config, key, value)
    layer_plan(config)
    return config


# --------------------------------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and cast back before the gain, exactly as HF Llama does, so logits match bit for bit.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return self.weight * normed


class RotaryEmbedding(nn.Module):
    """RoPE tables, recomputed per (length, device, dtype); no buffers, so building on the meta device is safe."""

    def __init__(self, head_dim: int, base: float):
        super().__init__()
        self.head_dim = head_dim
        self.base = base
        self._cache: dict = {}

    def forward(self, seq_len: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (seq_len, str(device), dtype)
        if key not in self._cache:
            exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float() / self.head_dim
            inv_freq = 1.0 / (self.base**exponents)
            angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
            angles = torch.cat((angles, angles), dim=-1)
            self._cache = {key: (angles.cos().to(dtype), angles.sin().to(dtype))}
        return self._cache[key]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


# The one place where the attention kernel depends on the device. Measured fwd+bwd on a 2-core AVX-512 CPU
# (docs/notes/faststep.md): under bf16 the CPU flash kernel is 2-3x slower than SDPA's math backend up to 512
# tokens and about even at 1024; in fp32 flash wins. CUDA keeps torch's own choice (flash / cuDNN / efficient).
CPU_MATH_SDPA_MAX_LEN = 512


def sdpa_kernel_for(q: torch.Tensor, seq_len: int):
    """A context restricting SDPA to the kernel measured fastest for this device, compute dtype and length."""
    if q.device.type != "cpu" or seq_len > CPU_MATH_SDPA_MAX_LEN:
        return contextlib.nullcontext()
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else q.dtype
    return sdpa_kernel(SDPBackend.MATH) if dtype in (torch.bfloat16, torch.float16) else contextlib.nullcontext()


class Attention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None):
        batch, seq_len, _ = x.shape
        q = self.q_proj(x).view(batch, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        with sdpa_kernel_for(q, seq_len):
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=self.num_kv_heads != self.num_heads
            )
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq_len, -1))


class MLP(nn.Module):
    """SwiGLU."""

    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# --------------------------------------------------------------------------------------------------------------------
# Norm placements: how one sublayer F and its norm N are combined with the residual stream x
# --------------------------------------------------------------------------------------------------------------------


class PreNorm(nn.Module):
    """x + F(N(x))"""

    def forward(self, x, sublayer, norm):
        return x + sublayer(norm(x))


class ScaledPreNorm(nn.Module):
    """LayerNorm Scaling: x + F(N(x) / sqrt(depth)). The factor is a plain float, so it survives meta-device init."""

    def __init__(self, depth: int):
        super().__init__()
        self.scale = 1.0 / math.sqrt(depth)

    def forward(self, x, sublayer, norm):
        return x + sublayer(norm(x) * self.scale)


class PostNorm(nn.Module):
    """N(x + F(x))"""

    def forward(self, x, sublayer, norm):
        return norm(x + sublayer(x))


class DeepNormResidual(nn.Module):
    """DeepNorm: N(alpha * x + F(x)), alpha = (2L)^(1/4)."""

    def __init__(self, num_layers: int):
        super().__init__()
        self.alpha = (2 * num_layers) ** 0.25

    def forward(self, x, sublayer, norm):
        return norm(self.alpha * x + sublayer(x))


class LayerScaleResidual(nn.Module):
    """LayerScale: x + lambda * F(N(x)), with a learnable per-channel lambda."""

    def __init__(self, hidden_size: int, init_value: float):
        super().__init__()
        self.init_value = init_value
        self.gain = nn.Parameter(torch.full((hidden_size,), init_value))

    def forward(self, x, sublayer, norm):
        return x + self.gain * sublayer(norm(x))


def make_residual(placement: str, config, depth: int, deepnorm_num_layers: int) -> nn.Module:
    builders = {
        "pre": lambda: PreNorm(),
        "lns": lambda: ScaledPreNorm(depth),
        "post": lambda: PostNorm(),
        "deepnorm": lambda: DeepNormResidual(deepnorm_num_layers),
        "layerscale": lambda: LayerScaleResidual(
            config.hidden_size, getattr(config, "layerscale_init", DEFAULT_LAYERSCALE_INIT)
        ),
    }
    return builders[placement]()


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, plan: LayerPlan):
        super().__init__()
        placement, depth = plan.placements[layer_idx], plan.depths[layer_idx]
        self.placement = placement
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_residual = make_residual(placement, config, depth, plan.deepnorm_num_layers)
        self.mlp_residual = make_residual(placement, config, depth, plan.deepnorm_num_layers)
        self._tag_init_std_factors(config, plan)

    def _tag_init_std_factors(self, config, plan: LayerPlan):
        """Mark the linears whose init std is scaled; `_init_weights` reads the tag."""
        if plan.init_method == "scaled":  # GPT-2 / OLMo: residual-branch outputs get std / sqrt(2L)
            for linear in (self.self_attn.o_proj, self.mlp.down_proj):
                linear.init_std_factor = getattr(linear, "init_std_factor", 1.0) / math.sqrt(2 * config.num_hidden_layers)
        if self.placement == "deepnorm":  # DeepNet: value, output and FFN projections get gain beta = (8L)^(-1/4)
            beta = (8 * plan.deepnorm_num_layers) ** -0.25
            for linear in (self.self_attn.v_proj, self.self_attn.o_proj, self.mlp.gate_proj, self.mlp.up_proj,
                           self.mlp.down_proj):
                linear.init_std_factor = getattr(linear, "init_std_factor", 1.0) * beta

    #   x ──► attn_residual(x, Attn, input_layernorm) ──► h ──► mlp_residual(h, MLP, post_attention_layernorm) ──► out
    #
    #   pre         h = x + Attn(N1(x))                     out = h + MLP(N2(h))
    #   lns         h = x + Attn(N1(x) / sqrt(l))           out = h + MLP(N2(h) / sqrt(l))
    #   post        h = N1(x + Attn(x))                     out = N2(h + MLP(h))
    #   deepnorm    h = N1(alpha * x + Attn(x))             out = N2(alpha * h + MLP(h))
    #   layerscale  h = x + lambda1 * Attn(N1(x))           out = h + lambda2 * MLP(N2(h))
    def forward(self, x: torch.Tensor, rope, mask: torch.Tensor | None) -> torch.Tensor:
        h = self.attn_residual(x, lambda y: self.self_attn(y, rope, mask), self.input_layernorm)
        return self.mlp_residual(h, self.mlp, self.post_attention_layernorm)


# --------------------------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------------------------


class LlamaPreTrainedModel(PreTrainedModel):
    config_class = LlamaConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DecoderLayer"]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module):
        # transformers.initialization skips parameters already loaded by from_pretrained.
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std * getattr(module, "init_std_factor", 1.0))
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, RMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, LayerScaleResidual):
            init.constant_(module.gain, module.init_value)


class LlamaModel(LlamaPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        plan = layer_plan(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, getattr(config, "pad_token_id", None))
        self.layers = nn.ModuleList(DecoderLayer(config, i, plan) for i in range(config.num_hidden_layers))
        # Applied after every variant, Post-LN included (as in the reference): it keeps one parameter layout for all.
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary_emb = RotaryEmbedding(head_dim, _rope_theta(config))
        self.gradient_checkpointing = False
        self.post_init()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                output_hidden_states: bool = False):
        x = self.embed_tokens(input_ids)
        rope = self.rotary_emb(input_ids.shape[1], x.device, x.dtype)
        mask = _attention_mask(attention_mask, input_ids.shape[1], x.device)
        hidden_states = [x] if output_hidden_states else None
        for layer in self.layers:
            if self.gradient_checkpointing and self.training:
                x = torch.utils.checkpoint.checkpoint(layer, x, rope, mask, use_reentrant=False)
            else:
                x = layer(x, rope, mask)
            if output_hidden_states:
                hidden_states.append(x)
        x = self.norm(x)
        if output_hidden_states:
            hidden_states[-1] = x  # HF convention: the last entry is the final-normed output
        return x, (tuple(hidden_states) if output_hidden_states else None)


class LlamaForCausalLM(LlamaPreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, output_hidden_states: bool | None = None, **unused):
        # **unused absorbs generation/lm-eval extras (use_cache, past_key_values, ...): this model keeps no KV cache.
        hidden, hidden_states = self.model(input_ids, attention_mask, bool(output_hidden_states))
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            # Shift the labels rather than the logits: slicing the logits would copy them and their gradient.
            targets = F.pad(labels[:, 1:], (0, 1), value=-100).to(logits.device)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits, hidden_states=hidden_states)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        return {"input_ids": input_ids, "attention_mask": attention_mask}


def _rope_theta(config) -> float:
    rope_parameters = getattr(config, "rope_parameters", None) or {}
    return float(rope_parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _attention_mask(attention_mask: torch.Tensor | None, seq_len: int, device) -> torch.Tensor | None:
    """None (pure causal, the fast SDPA path) unless some key is padding; then causal AND key-is-real.

    Under torch.compile the all-real check would break the graph (a data-dependent branch), so a compiled model
    always builds the explicit mask; the trainer passes no mask at all for its right-padded batches.
    """
    if attention_mask is None:
        return None
    if not torch.compiler.is_compiling() and bool(attention_mask.all()):
        return None
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    mask = causal[None, None] & attention_mask[:, None, None, :].bool().to(device)
    # A padding query that sees no real key would give NaN; letting it see itself keeps outputs finite.
    return mask | torch.eye(seq_len, dtype=torch.bool, device=device)[None, None]


LlamaForCausalLM.register_for_auto_class("AutoModelForCausalLM")


# --------------------------------------------------------------------------------------------------------------------
# Export to stock transformers
# --------------------------------------------------------------------------------------------------------------------

EXPORTABLE_PLACEMENTS = ("pre", "lns")


def export_to_hf_llama(model: LlamaForCausalLM):
    """A stock `transformers.LlamaForCausalLM` computing the same function as a pre or lns `model`.

    LNS's 1/sqrt(l) multiplies the norm output after its gain, so it folds exactly into the two gains of layer l.
    """
    from transformers import LlamaForCausalLM as HFLlamaForCausalLM

    placements = [layer.placement for layer in model.model.layers]
    unsupported = sorted(set(placements) - set(EXPORTABLE_PLACEMENTS))
    if unsupported:
        raise ValueError(
            f"norm placement {', '.join(unsupported)} has no stock-HF equivalent (exportable: "
            f"{', '.join(EXPORTABLE_PLACEMENTS)}); load it with AutoModelForCausalLM(..., trust_remote_code=True)"
        )
    config = LlamaConfig.from_dict(model.config.to_dict())
    for key in ("norm_type", "post_num", "init_method", "layer_norm_types", "layer_depths", "deepnorm_num_layers",
                "auto_map", "layerscale_init"):
        if hasattr(config, key):
            delattr(config, key)
    config.architectures = ["LlamaForCausalLM"]
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    for i, layer in enumerate(model.model.layers):
        for norm_name, residual in (("input_layernorm", layer.attn_residual),
                                    ("post_attention_layernorm", layer.mlp_residual)):
            state[f"model.layers.{i}.{norm_name}.weight"] *= getattr(residual, "scale", 1.0)
    hf_model = HFLlamaForCausalLM(config).to(next(model.parameters()).dtype)
    hf_model.load_state_dict(state, strict=True)
    return hf_model.eval()
