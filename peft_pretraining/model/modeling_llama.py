"""A LLaMA decoder whose norm placement is chosen by name.

The only thing that differs between Pre-LN, Post-LN, Mix-LN, LayerNorm Scaling (LNS), DeepNorm, LayerScale, SkipInit,
Peri-LN, output-norm (OLMo 2), DyT, CompleteP, GPAS, BHyT and HybridNorm is how each sublayer (attention, MLP) is
wrapped with its norm and residual, and which norm that is (HybridNorm also normalises q, k and v inside attention).
Each wrapping is a small module below, and PLACEMENTS (one row per placement) says which modules a layer of each
placement gets; a decoder layer holds two of them and never branches on the variant.
Parameter names are those of `transformers.LlamaForCausalLM` plus, where a variant needs more (Peri-LN's output
norms, gates, DyT's alpha and bias, BHyT's lam, HybridNorm's q_norm/k_norm as in Qwen3 and v_norm), names under the
placement module, the norm or the attention, so weights move freely.

The model is built from a `NormPlacementConfig` (a `transformers.LlamaConfig` under its own model_type, below) with
extra attributes (all optional, defaults in brackets). A placement's own settings are `Setting`s in its row (the
trainer's flags of the same names are built from them); they are listed here too:
    norm_type         a row of PLACEMENTS, case-insensitive; "cod" (the uploaded code's name) is an alias of "lns" [pre]
    post_num          Mix-LN: layers with 0-based index < post_num are Post-LN, the rest Pre-LN [0]
    init_method       normal | scaled | depth_scaled [normal]
    layerscale_form   channel (one gain per channel) | scalar (one gain per sublayer) [channel]
    layerscale_init   initial LayerScale gain [0.1 for channel, 0.001 for scalar]
    completep_alpha   CompleteP: each branch is multiplied by L^-alpha [1.0]
    deepnorm_init     deepnet (std 0.02 * (8L)^-1/4) | reference (the authors' Xavier init) [deepnet]
    embed_init_std    std of the embedding init [initializer_range]
    dyt_alpha_init    DyT's alpha0 as [attention norms, MLP and final norms] [0.8, 0.2]
    bhyt_lambda_init  BHyT's lambda0 as [attention norm, MLP norm] [2.0, 1.0] (the authors' pretraining setting)
    bhyt_kappa        BHyT's kappa: the tanh input has RMS lambda/kappa [10.0]
    train_max_length  written by the trainer; BHyT's T in c = ||W_V^T W_O^T||_F^2 / (T d) [max_position_embeddings]
GPAS's gate starts at 0 and HybridNorm's q/k/v norms are RMSNorms over each head (gain 1, eps rms_norm_eps): neither
has a setting. Sources and every departure from the authors' code: docs/differences.md.
Optional per-layer attributes (`layer_norm_types`, `layer_depths`, `depth_scaling_num_layers`, formerly
`deepnorm_num_layers`) pin each layer's placement, LNS depth and the L of DeepNorm and CompleteP explicitly;
`freeze_layer_plan` writes them, so that a layer keeps what it was trained with after another layer is removed.
Export to stock `transformers.LlamaForCausalLM`: `peft_pretraining/model/llama_export.py`, outside the copy of this file
that every checkpoint carries.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, LlamaConfig, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import CausalLMOutput

NORM_TYPE_ALIASES = {"cod": "lns"}  # "cod" is LNS's name in the paper's uploaded code (commit 5d4dd11)
INIT_METHODS = ("normal", "scaled", "depth_scaled")
LAYERSCALE_FORMS = ("channel", "scalar")
DEFAULT_LAYERSCALE_FORM = "channel"
DEFAULT_LAYERSCALE_INIT = {"channel": 0.1, "scalar": 0.001}  # ours (Touvron et al.) | the reference's scalar branch
DEEPNORM_INITS = ("deepnet", "reference")
DEFAULT_DEEPNORM_INIT = "deepnet"
DEFAULT_COMPLETEP_ALPHA = 1.0
# DyT's alpha0 for LLaMA (Zhu et al. 2025): larger before attention than before the MLP and at the final norm;
# 0.8 / 0.2 is the paper's setting for its smallest LLaMA (7B).
DEFAULT_DYT_ALPHA_INIT = (0.8, 0.2)
# BHyT (Byun et al. 2026), from the authors' pretraining script and config: lambda0 2.0 before attention, 1.0 before
# the MLP (learnable), kappa 10, a plain RMSNorm at the end (their last_layer_lam 0).
DEFAULT_BHYT_LAMBDA_INIT = (2.0, 1.0)
DEFAULT_BHYT_KAPPA = 10.0


class NormPlacementConfig(LlamaConfig):
    """LlamaConfig plus the attributes above, under a model_type of its own. With "llama", a checkpoint of ours would
    load into stock `transformers.LlamaForCausalLM` without `trust_remote_code` and, its parameter names being the
    same, silently compute Pre-LN; with this type, loading it without `trust_remote_code=True` is an error."""
    model_type = "llama_norm_placement"
    # The key's old name: configs and checkpoints written before the rename still read and write it.
    attribute_map = {**LlamaConfig.attribute_map, "deepnorm_num_layers": "depth_scaling_num_layers"}

    def __post_init__(self, **kwargs):
        kwargs.pop("model_type", None)  # the class's own, not the "llama" of a JSON or config it was built from
        super().__post_init__(**kwargs)

    def __delattr__(self, key):  # transformers maps the old name on get and set only
        super().__delattr__(self.attribute_map.get(key, key))


def as_norm_placement_config(config) -> NormPlacementConfig:
    """`config` itself if it is a NormPlacementConfig, otherwise a NormPlacementConfig with the same values."""
    return config if isinstance(config, NormPlacementConfig) else NormPlacementConfig.from_dict(config.to_dict())


def canonical_norm_type(value) -> str:
    """The one place a norm type is made canonical: lower-cased, aliases resolved ("COD" -> "lns"); ValueError
    naming every choice for a name that is no row of PLACEMENTS."""
    name = str(value).lower()
    name = NORM_TYPE_ALIASES.get(name, name)
    if name not in PLACEMENTS:
        raise ValueError(f"unknown norm_type {value!r}; valid choices: {', '.join(norm_type_choices())}")
    return name


def norm_types() -> tuple[str, ...]:
    """Every norm type: the rows of PLACEMENTS, read at each call (a row added later is one)."""
    return tuple(PLACEMENTS)


def norm_type_choices() -> tuple[str, ...]:
    return (*norm_types(), *NORM_TYPE_ALIASES)


def layer_placements() -> tuple[str, ...]:
    """The rows a single layer can be built from (not the mixes, such as post_pre)."""
    return tuple(name for name, row in PLACEMENTS.items() if row.residuals is not None)


def _choice(value, valid, what: str, aliases: dict | None = None) -> str:
    name = str(value).lower()
    name = (aliases or {}).get(name, name)
    if name not in valid:
        raise ValueError(f"unknown {what} {value!r}; valid choices: {', '.join((*valid, *(aliases or {})))}")
    return name


@dataclass(frozen=True)
class Setting:
    """One setting of a placement: a config key, the trainer's flag of the same name (`--<key>`), its default and
    its check. A resumed run takes the checkpoint's value unless the flag says otherwise."""
    key: str
    help: str
    default: object = None  # a value, or a function of the settings resolved before this one
    choices: tuple[str, ...] = ()  # a choice (lower-cased); otherwise a number
    minimum: float | None = None  # a number at least this
    positive: bool = False  # a number above 0
    count: int = 1  # numbers per value: 2 for a pair, written as a list
    integer: bool = False  # a whole number (kept as an int)
    depends_on: str | None = None  # the setting whose value decides this one's default: a saved value is kept
    #                                only under the same value of that one

    def default_for(self, resolved: dict):
        return self.default(resolved) if callable(self.default) else self.default

    def check(self, value):
        """The canonical value (lower-cased choice, float, or list of floats); ValueError naming the key."""
        if self.choices:
            return _choice(value, self.choices, self.key)
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        if len(values) != self.count or not all(self._valid_number(v) for v in values):
            bound = " > 0" if self.positive else f" >= {self.minimum}" if self.minimum is not None else ""
            what = f"{self.count} finite numbers{bound}" if self.count > 1 else f"a finite number{bound}"
            raise ValueError(f"{self.key}={value!r} is not {what}")
        if self.integer:
            return int(values[0])
        return [float(v) for v in values] if self.count > 1 else float(values[0])

    def _valid_number(self, v) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return False
        if self.integer and float(v) != int(v):
            return False
        return not ((self.minimum is not None and v < self.minimum) or (self.positive and v <= 0))

    def help_text(self) -> str:
        return self.help if callable(self.default) else f"{self.help} (default {self.default})"


def placement_settings() -> dict[str, Setting]:
    """Every row's settings by key, in the rows' order (a setting shared by rows is listed once)."""
    found = {}
    for row in PLACEMENTS.values():
        for setting in row.settings:
            found.setdefault(setting.key, setting)
    return found


def resolve_settings(config) -> dict:
    """Every placement setting's value for `config` (its own, else the default), checked."""
    resolved = {}
    for key, setting in placement_settings().items():
        value = getattr(config, key, None)
        resolved[key] = setting.check(setting.default_for(resolved) if value is None else value)
    return resolved


def _number(config, key: str, default: float, minimum: float | None = None) -> float:
    value = getattr(config, key, None)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
            minimum is not None and value < minimum):
        bound = f" >= {minimum}" if minimum is not None else ""
        raise ValueError(f"{key}={value!r} is not a finite number{bound}")
    return float(value)


# --------------------------------------------------------------------------------------------------------------------
# Which placement and depth each layer gets
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerPlan:
    placements: list[str]  # one of layer_placements() per layer
    depths: list[int]  # 1-based depth of each layer, used by LNS and depth-scaled init
    depth_scaling_num_layers: int  # the L of DeepNorm's alpha and beta and CompleteP's L^-alpha (kept after removal)
    init_method: str
    final_norm: str  # "dyt" or "rms"
    embed_init_std: float
    train_max_length: int  # the trained context length (BHyT's T)
    settings: dict  # every placement setting by key (resolve_settings), checked


# LlamaConfig features this model does not implement, with the values it does: anything else is an error, not
# a silent ignore (an untied head under tie_word_embeddings=true, SiLU under hidden_act="gelu").
IMPLEMENTED_LLAMA_FEATURES = {"tie_word_embeddings": (False,), "hidden_act": ("silu", "swish"),
                              "attention_bias": (False,), "mlp_bias": (False,), "attention_dropout": (0.0,),
                              "pretraining_tp": (1,)}


def check_llama_features(config) -> None:
    for key, implemented in IMPLEMENTED_LLAMA_FEATURES.items():
        value = getattr(config, key, implemented[0])
        if value not in implemented:
            raise ValueError(f"{key}={value!r} is not implemented by this model (it supports "
                             f"{' or '.join(map(repr, implemented))})")
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"rope_type={rope_type!r} is not implemented by this model (it supports 'default' RoPE)")


def layer_plan(config) -> LayerPlan:
    """The per-layer placement and depth implied by the config; validates every value."""
    check_llama_features(config)
    num_layers = config.num_hidden_layers
    norm_type = canonical_norm_type(getattr(config, "norm_type", "pre"))
    init_method = _choice(getattr(config, "init_method", "normal"), INIT_METHODS, "init_method")
    row = PLACEMENTS[norm_type]
    placements = getattr(config, "layer_norm_types", None)
    if placements is None:
        placements = row.mix(config) if row.mix is not None else [norm_type] * num_layers
    placements = [_choice(p, layer_placements(), "layer placement", NORM_TYPE_ALIASES) for p in placements]
    if row.stream is not None and set(placements) != {norm_type}:
        raise ValueError(f"norm_type {norm_type} changes the residual stream itself: every layer must be "
                         f"{norm_type}, got {sorted(set(placements))}")

    depths = list(getattr(config, "layer_depths", None) or range(1, num_layers + 1))
    depth_scaling_num_layers = getattr(config, "depth_scaling_num_layers", None) or num_layers
    if len(placements) != num_layers or len(depths) != num_layers:
        raise ValueError(
            f"layer_norm_types ({len(placements)}) and layer_depths ({len(depths)}) must both have "
            f"num_hidden_layers={num_layers} entries"
        )
    return LayerPlan(
        placements, depths, depth_scaling_num_layers, init_method, final_norm=row.final_norm,
        embed_init_std=_number(config, "embed_init_std", config.initializer_range, minimum=0.0),
        train_max_length=int(getattr(config, "train_max_length", None) or config.max_position_embeddings),
        settings=resolve_settings(config),
    )


def mix_ln_layers(config) -> list[str]:
    """Mix-LN: layers with 0-based index < post_num are Post-LN, the rest Pre-LN."""
    num_layers, post_num = config.num_hidden_layers, getattr(config, "post_num", None)
    if not isinstance(post_num, int) or isinstance(post_num, bool) or not 0 <= post_num <= num_layers:
        raise ValueError(f"post_num={post_num!r} is out of range for post_pre; valid: an int in [0, {num_layers}]")
    return ["post"] * post_num + ["pre"] * (num_layers - post_num)


def freeze_layer_plan(config):
    """Write each layer's placement and depth into the config, so they survive removing a layer."""
    plan = layer_plan(config)
    config.layer_norm_types = list(plan.placements)
    config.layer_depths = list(plan.depths)
    config.depth_scaling_num_layers = plan.depth_scaling_num_layers
    return config


def build_config(path_or_config, norm_type: str = "pre", post_num: int = 0, init_method: str = "normal", **overrides):
    """Load a model JSON (or copy a config) and set the norm placement; validates by building the layer plan."""
    if isinstance(path_or_config, LlamaConfig):
        config = NormPlacementConfig.from_dict(path_or_config.to_dict())
    else:
        config = NormPlacementConfig.from_json_file(str(path_or_config))
    config.norm_type = canonical_norm_type(norm_type)
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

    def reset_parameters(self):
        init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and cast back before the gain, exactly as HF Llama does, so logits match bit for bit.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return self.weight * normed


class RotaryEmbedding(nn.Module):
    """RoPE's cos and sin tables for positions 0 .. max_positions - 1, computed once and kept as non-persistent
    buffers (not in checkpoints). Tables built inside forward are index arithmetic that torch.compile inlines into
    every consumer: inductor then evaluated cos and sin for every element of q and k in every layer, forward and
    backward, about 10% of the compiled CPU step (docs/benchmarks.md)."""

    def __init__(self, head_dim: int, base: float, max_positions: int):
        super().__init__()
        self.head_dim, self.base, self.max_positions = head_dim, base, max_positions
        cos, sin = self.compute_tables()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def compute_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device="cpu").float() / self.head_dim
        inv_freq = 1.0 / (self.base**exponents)
        angles = torch.outer(torch.arange(self.max_positions, device="cpu", dtype=torch.float32), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    @torch.no_grad()
    def reset_tables(self):
        """Refills the tables in place, as after to_empty() from the meta device: they are in no checkpoint.
        Computed on the CPU, as at construction, so that a sharded resume on GPU gets the same bits as the fresh run
        (CUDA's cos and sin may differ in the last place)."""
        cos, sin = self.compute_tables()
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def reset_parameters(self):  # the model's init entry point; the tables are this module's only state
        self.reset_tables()

    def forward(self, seq_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if seq_len > self.max_positions:
            raise ValueError(f"sequence length {seq_len} exceeds the model's max_position_embeddings "
                             f"{self.max_positions}")
        return self.cos[:seq_len].to(dtype), self.sin[:seq_len].to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


# The one place where the attention kernel depends on the device. Measured fwd+bwd on 2-core AVX-512 CPUs
# (docs/benchmarks.md, `benchmark_model.py --sections attention`): in bf16 up to 256 tokens, plain matmuls with an
# fp32 softmax are as fast as SDPA's math backend or faster, and 1.5-2.5x faster than its CPU flash kernel; at 512
# flash wins, and in fp32 flash wins. CUDA keeps SDPA with torch's own choice (flash / cuDNN / efficient).
CPU_PLAIN_ATTENTION_MAX_LEN = 256


def uses_plain_attention(q: torch.Tensor, seq_len: int) -> bool:
    """Whether attention runs as plain matmuls (CPU, bf16/fp16 compute, short sequences) rather than through SDPA."""
    if q.device.type != "cpu" or seq_len > CPU_PLAIN_ATTENTION_MAX_LEN:
        return False
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else q.dtype
    return dtype in (torch.bfloat16, torch.float16)


def plain_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k^T / sqrt(head_dim), causal or `mask`) v, the function SDPA computes; softmax in fp32 or wider."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` consecutive query heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    # The mask is added as 0 / -inf rather than applied with masked_fill: same scores, but an addition's backward
    # passes the gradient straight through where masked_fill's masks it again (about 10% of the eager bf16 step).
    if mask is None:
        bias = torch.full((q.shape[-2], k.shape[-2]), float("-inf"), dtype=scores.dtype, device=q.device).triu(1)
    else:
        bias = torch.zeros(mask.shape, dtype=scores.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    softmax_dtype = torch.promote_types(scores.dtype, torch.float32)  # at least fp32
    probs = torch.softmax(scores + bias, dim=-1, dtype=softmax_dtype)
    return torch.matmul(probs.to(v.dtype), v)


class Attention(nn.Module):
    """Causal multi-head (or grouped-query) attention with RoPE. With `qkv_norm` (HybridNorm) each head's q, k and v
    pass through an RMSNorm over head_dim before RoPE (q_norm and k_norm as in Qwen3 and OLMo, v_norm added)."""

    def __init__(self, config, layer_idx: int, qkv_norm: bool = False):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.qkv_norm = qkv_norm
        if qkv_norm:
            self.q_norm, self.k_norm, self.v_norm = (RMSNorm(self.head_dim, config.rms_norm_eps) for _ in range(3))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None):
        batch, seq_len, _ = x.shape
        q = self.q_proj(x).view(batch, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.qkv_norm:
            q, k, v = self.q_norm(q), self.k_norm(k), self.v_norm(v)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if uses_plain_attention(q, seq_len):
            out = plain_attention(q, k, v, mask)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=self.num_kv_heads != self.num_heads
            )
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq_len, -1))


# The one place where the MLP's GEMM shapes depend on the device. On CUDA a bf16 GEMM with a width that is not a
# multiple of 8 misses the tensor-core kernels: the 1B config's intermediate_size 5461 made each eager MLP GEMM about
# 8x slower on an H100 (docs/benchmarks.md). Such a width is padded with zero units, at compute time only, to a
# multiple of MLP_PAD_MULTIPLE: weights, checkpoints and the HF export keep the config's width. torch.compile pads
# such shapes itself, so compiled code takes the plain path.
MLP_PAD_DEVICES = ("cuda",)
MLP_PAD_MULTIPLE = 64


def mlp_pad_units(intermediate_size: int) -> int:
    """Zero units that bring a width that is not a multiple of 8 up to a multiple of MLP_PAD_MULTIPLE (else 0)."""
    if intermediate_size % 8 == 0:
        return 0
    return -intermediate_size % MLP_PAD_MULTIPLE


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.pad_units = mlp_pad_units(config.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pad_units and x.device.type in MLP_PAD_DEVICES and not torch.compiler.is_compiling() \
                and self._projections_are_plain():
            return self._padded_forward(x)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def _projections_are_plain(self) -> bool:
        """Padding reads the weights directly, so it steps aside for anything that wraps or hooks a projection
        (LoRA, forward hooks): those then see the plain calls."""
        return all(type(linear) is nn.Linear and not linear._forward_hooks and not linear._forward_pre_hooks
                   for linear in (self.gate_proj, self.up_proj, self.down_proj))

    def _padded_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The same function: a zero unit's gate and up are 0, silu(0) * 0 = 0, and its zero down column adds 0;
        the gradient of the padding is dropped by F.pad's backward."""
        rows, columns = (0, 0, 0, self.pad_units), (0, self.pad_units)
        gate = F.linear(x, F.pad(self.gate_proj.weight, rows))
        up = F.linear(x, F.pad(self.up_proj.weight, rows))
        return F.linear(F.silu(gate) * up, F.pad(self.down_proj.weight, columns))


# --------------------------------------------------------------------------------------------------------------------
# Norm placements: how one sublayer F and its norm N are combined with the residual stream x
# --------------------------------------------------------------------------------------------------------------------


class PreNorm(nn.Module):
    """x + F(N(x))"""

    def forward(self, x, sublayer, norm):
        return x + sublayer(norm(x))

    def stock_llama_factors(self) -> tuple[float, torch.Tensor | float]:
        """(factor on the block norm's gain, factor on the branch output's rows) that turn this sublayer into stock
        Llama's x + F(N(x)); llama_export.py folds them into the weights."""
        return 1.0, 1.0


class ScaledPreNorm(nn.Module):
    """LayerNorm Scaling: x + F(N(x) / sqrt(depth)). The factor is a plain float, so it survives meta-device init."""

    def __init__(self, depth: int):
        super().__init__()
        self.scale = 1.0 / math.sqrt(depth)

    def forward(self, x, sublayer, norm):
        return x + sublayer(norm(x) * self.scale)

    def stock_llama_factors(self):  # the factor follows the norm's gain, so it folds into that gain exactly
        return self.scale, 1.0


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


class GatedPreNorm(nn.Module):
    """x + g * F(N(x)) with a learnable gain g: LayerScale (per channel, or one scalar per sublayer) and SkipInit
    (one scalar, initialised to 0 so that every block starts as the identity)."""

    def __init__(self, size: int, init_value: float):
        super().__init__()
        self.init_value = init_value
        self.gain = nn.Parameter(torch.full((size,), float(init_value)))

    def reset_parameters(self):
        init.constant_(self.gain, self.init_value)

    def forward(self, x, sublayer, norm):
        return x + self.gain * sublayer(norm(x))

    def stock_llama_factors(self):
        return 1.0, self.gain.detach()[:, None]


class DepthScaledBranch(nn.Module):
    """CompleteP / depth-muP: x + L^-alpha * F(N(x)); a plain float, like the LNS factor."""

    def __init__(self, num_layers: int, alpha: float):
        super().__init__()
        self.multiplier = float(num_layers) ** -alpha

    def forward(self, x, sublayer, norm):
        return x + self.multiplier * sublayer(norm(x))

    def stock_llama_factors(self):
        return 1.0, self.multiplier


class PeriNorm(nn.Module):
    """Peri-LN: x + N_out(F(N(x) * scale)); scale = 1 (peri) or LNS's 1/sqrt(depth) on the inner norm (peri_lns)."""

    def __init__(self, output_norm: nn.Module, scale: float = 1.0):
        super().__init__()
        self.output_norm = output_norm
        self.scale = scale

    def forward(self, x, sublayer, norm):
        return x + self.output_norm(sublayer(norm(x) * self.scale))


class OutputNorm(nn.Module):
    """OLMo 2's reordered norm: x + N(F(x)); the block norm moves to the branch output."""

    def forward(self, x, sublayer, norm):
        return x + norm(sublayer(x))


class DyT(nn.Module):
    """Dynamic Tanh (Zhu et al., CVPR 2025), a drop-in for a norm: weight * tanh(alpha * x) + bias, alpha a scalar."""

    def __init__(self, hidden_size: int, alpha_init: float):
        super().__init__()
        self.alpha_init = alpha_init
        self.alpha = nn.Parameter(torch.full((1,), float(alpha_init)))
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))

    def reset_parameters(self):
        init.constant_(self.alpha, self.alpha_init)
        init.ones_(self.weight)
        init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * torch.tanh(self.alpha * x) + self.bias


class GradientPreservingScale(nn.Module):
    """GPAS (Chen et al. 2025) around another placement: y = inner(x, F, N), then y - silu(g) * stopgrad(y).

    The forward value is (1 - silu(g)) * y, so the residual stream shrinks, but d out / d y is the identity: the
    gradient reaching the layers below is not shrunk (g itself gets -silu'(g) * y). As in the authors' code, one gate
    per decoder layer serves both sublayers, and it starts at 0, where silu(0) = 0 leaves the inner placement as is.
    The attention-side module owns `gate`; the MLP-side one reads it from there at every call (the owner is kept in a
    tuple, outside the module tree, so the parameter is saved once and FSDP's unsharded copy is the one read).
    """

    def __init__(self, inner: nn.Module, gate_owner: "GradientPreservingScale | None" = None):
        super().__init__()
        self.inner = inner
        if gate_owner is None:
            self.gate = nn.Parameter(torch.zeros(1))
        self._gate_owner = (self if gate_owner is None else gate_owner,)

    def reset_parameters(self):
        if self._gate_owner[0] is self:
            init.zeros_(self.gate)

    def forward(self, x, sublayer, norm):
        y = self.inner(x, sublayer, norm)
        return y - F.silu(self._gate_owner[0].gate) * y.detach()


class NormedStreamResidual(nn.Module):
    """HybridNorm's MLP sublayer: y = N(x), y + F(y). The norm sits on the residual stream itself, as in Post-LN, but
    before the branch is added (the authors' OLMo config: ffn_norm with ffn_residual_after_norm)."""

    def forward(self, x, sublayer, norm):
        y = norm(x)
        return y + sublayer(y)


# The authors' code adds 1e-6 to BHyT's variance whatever rms_norm_eps says.
BHYT_EPS = 1e-6


class BHyT(nn.Module):
    """Bounded hyperbolic tangent (Byun et al. 2026), a block norm: weight * tanh(lam * x / (kappa * sqrt(var + eps))).

    This one, before attention, uses the exact var = mean(x^2) over channels, so the tanh input has RMS lam / kappa
    (0.2 by default) whatever the scale of x: it stays in tanh's non-saturating range however the stream grows.
    It keeps var for the layer's BHyTApproximated, which does not recompute it. lam is learnable, one scalar per norm.
    """

    def __init__(self, hidden_size: int, lam_init: float, kappa: float):
        super().__init__()
        self.lam_init, self.kappa = lam_init, kappa
        self.lam = nn.Parameter(torch.full((1,), float(lam_init)))
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.layer_input_variance = None

    def reset_parameters(self):
        init.constant_(self.lam, self.lam_init)
        init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        self.layer_input_variance = variance
        return self.bounded_tanh(x, variance)

    def bounded_tanh(self, x: torch.Tensor, variance: torch.Tensor) -> torch.Tensor:
        inverse_scale = torch.rsqrt(variance + BHYT_EPS) / self.kappa  # statistics in fp32, as in the authors' code
        return self.weight * torch.tanh(self.lam * (x * inverse_scale.to(x.dtype)))


class BHyTApproximated(BHyT):
    """BHyT before the MLP. The variance of h = x + Attn(BHyT(x)) is not computed but approximated from the layer
    input's: var(h) ~ var(x) + c * (lam_attn / kappa)^2, c = ||W_V^T W_O^T||_F^2 / (T d) (T the trained context
    length, d the width; lam_attn without gradient; c from the current weights, without gradient)."""

    def __init__(self, hidden_size: int, lam_init: float, kappa: float, input_norm: BHyT, attention: nn.Module,
                 seq_len: int):
        super().__init__(hidden_size, lam_init, kappa)
        self.seq_len = seq_len
        self._layer = (input_norm, attention)  # read at each call, outside the module tree (saved once)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        input_norm, attention = self._layer
        input_variance, input_norm.layer_input_variance = input_norm.layer_input_variance, None
        c = self.value_output_norm(attention) / (self.seq_len * h.shape[-1])
        variance = input_variance + c * (input_norm.lam.detach().float() / self.kappa) ** 2
        return self.bounded_tanh(h, variance)

    @staticmethod
    def value_output_norm(attention) -> torch.Tensor:
        """||W_V^T W_O^T||_F^2 in fp32, each key/value head repeated for the query heads it serves."""
        with torch.autocast(attention.o_proj.weight.device.type, enabled=False):
            w_v = attention.v_proj.weight.detach().float().view(attention.num_kv_heads, attention.head_dim, -1)
            w_v = w_v.repeat_interleave(attention.num_heads // attention.num_kv_heads, dim=0).flatten(0, 1)
            return (attention.o_proj.weight.detach().float() @ w_v).pow(2).sum()


class ResidualSum(nn.Module):
    """The residual stream of every placement but AttnRes, mHC and SiameseNorm: one tensor, the running sum the
    layers add to. A stream module's `begin` turns the embedding into the stream, `layer_output` is what
    output_hidden_states (and so every analysis tool) reads as a layer's output, and `end` is what the final norm
    gets."""

    def begin(self, x):
        return x

    def layer_output(self, stream):
        return stream

    def end(self, stream):
        return stream


# --------------------------------------------------------------------------------------------------------------------
# Residual streams that are not a running sum: Attention Residuals, mHC and SiameseNorm
# --------------------------------------------------------------------------------------------------------------------


def depth_attention(query: torch.Tensor, sources, eps: float) -> torch.Tensor:
    """AttnRes's aggregation: sum_j softmax_j(q . rms(v_j)) v_j over the sources v_j (each batch x tokens x d).
    The keys are RMS-normalised without a gain: a gain g would only reparametrise q (q . (g * k) = (q * g) . k)."""
    values = torch.stack(tuple(sources), dim=-2)
    keys = F.rms_norm(values.float(), (values.shape[-1],), eps=eps)
    weights = torch.softmax(keys @ query.float(), dim=-1)  # over the sources, in fp32
    return (weights.to(values.dtype).unsqueeze(-1) * values).sum(-2)


class DepthAttentionResidual(nn.Module):
    """Block Attention Residuals (Moonshot AI 2026), one sublayer: its input is depth_attention over the embedding,
    the completed blocks' sums and the current block's partial sum, with this sublayer's pseudo-query; its output
    F(N(input)) is added to the partial sum of its block. The stream is (completed sources, partial sum, the partial
    sum's block): a block closes when a sublayer of the next block arrives, so a removed layer only takes its own
    outputs out of its block's sum."""

    def __init__(self, hidden_size: int, block: int, eps: float):
        super().__init__()
        self.block, self.eps = block, eps
        self.query = nn.Parameter(torch.zeros(hidden_size))  # zero: uniform weights over the sources at the start

    def reset_parameters(self):
        init.zeros_(self.query)

    def forward(self, stream, sublayer, norm):
        sources, partial, partial_block = stream
        if partial is not None and partial_block != self.block:
            sources, partial = (*sources, partial), None
        inputs = sources if partial is None else (*sources, partial)
        output = sublayer(norm(depth_attention(self.query, inputs, self.eps)))
        return sources, output if partial is None else partial + output, self.block


class AttentionResidualStream(nn.Module):
    """AttnRes's stream: starts as the embedding alone; what the final norm gets, and what a layer's output is for
    output_hidden_states, is depth_attention over every source with the model's own output pseudo-query (the stream
    the final norm would read if the model stopped after that layer)."""

    def __init__(self, config, plan: LayerPlan):
        super().__init__()
        self.eps = config.rms_norm_eps
        self.query = nn.Parameter(torch.zeros(config.hidden_size))

    def reset_parameters(self):
        init.zeros_(self.query)

    def begin(self, x):
        return (x,), None, None

    def end(self, stream):
        sources, partial, _ = stream
        return depth_attention(self.query, sources if partial is None else (*sources, partial), self.eps)

    def layer_output(self, stream):
        return self.end(stream)


def attnres_block(layer: LayerContext, side: int) -> int:
    """The block of a sublayer (side 0 attention, 1 MLP) from its trained depth and the trained L: 2L sublayers in
    `attnres_blocks` blocks of ceil(2L / blocks) consecutive sublayers (kept after a layer is removed)."""
    sublayers = 2 * layer.plan.depth_scaling_num_layers
    size = math.ceil(sublayers / int(layer.plan.settings["attnres_blocks"]))
    return (2 * (layer.depth - 1) + side) // size


def attnres_residuals(layer: LayerContext):
    return tuple(DepthAttentionResidual(layer.config.hidden_size, attnres_block(layer, side), layer.config.rms_norm_eps)
                 for side in (0, 1))


def sinkhorn(logits: torch.Tensor, iterations: int) -> torch.Tensor:
    """exp(logits) scaled towards a doubly stochastic matrix (last two dims) by Sinkhorn-Knopp in the log domain, in
    fp32: each iteration normalises the columns, then the rows. Ending on the rows makes every row sum to 1 to
    rounding (so n equal copies stay equal: a mix of them is the same vector); the columns sum to 1 within what the
    iterations have converged to."""
    log_p = logits.float()
    for _ in range(iterations):
        log_p = log_p - log_p.logsumexp(-2, keepdim=True)
        log_p = log_p - log_p.logsumexp(-1, keepdim=True)
    return log_p.exp()


MHC_ALPHA_INIT = 0.01  # the dynamic maps' gating factors start small: the maps start as their static parts
MHC_PRE_OWN, MHC_PRE_OTHER = 1.0, -1.0  # pre's static logits: each sublayer leans on one copy, so the copies differ
MHC_RES_OFF_DIAGONAL = -4.0  # res's static logits: near the identity (0.95 on the diagonal at n = 4)


class ManifoldHyperConnection(nn.Module):
    """mHC (DeepSeek 2026), one sublayer on the n copies X (batch x tokens x n x d):
    X' = H_res X + H_post^T F(N(H_pre X)). From x = rms(vec(X)) (no gain: phi would absorb it),
    H_pre = sigmoid(a_pre * x phi_pre + b_pre), H_post = 2 sigmoid(a_post * x phi_post + b_post) and
    H_res = Sinkhorn(a_res * mat(x phi_res) + b_res): dynamic parts (phi, zero at the start, and the scalars a)
    plus static biases b. With phi = 0 and equal copies the layer is Pre-LN's x + F(N(x)) on each copy (N absorbs
    the scale of H_pre X; H_res's rows sum to 1; H_post = 1)."""

    def __init__(self, hidden_size: int, streams: int, iterations: int, own_stream: int, eps: float):
        super().__init__()
        self.streams, self.iterations, self.own_stream, self.eps = streams, iterations, own_stream, eps
        n = streams
        self.phi = nn.Parameter(torch.zeros(2 * n + n * n, n * hidden_size))  # rows: pre, post, res
        self.alpha = nn.Parameter(torch.full((3,), MHC_ALPHA_INIT))  # pre, post, res
        self.pre_bias = nn.Parameter(self.pre_bias_init())
        self.post_bias = nn.Parameter(torch.zeros(n))
        self.res_bias = nn.Parameter(self.res_bias_init())

    def pre_bias_init(self) -> torch.Tensor:
        bias = torch.full((self.streams,), MHC_PRE_OTHER)
        bias[self.own_stream] = MHC_PRE_OWN
        return bias

    def res_bias_init(self) -> torch.Tensor:
        return torch.full((self.streams, self.streams), MHC_RES_OFF_DIAGONAL).fill_diagonal_(0.0)

    def reset_parameters(self):
        init.zeros_(self.phi)
        init.constant_(self.alpha, MHC_ALPHA_INIT)
        init.copy_(self.pre_bias, self.pre_bias_init())
        init.zeros_(self.post_bias)
        init.copy_(self.res_bias, self.res_bias_init())

    def maps(self, stream: torch.Tensor):
        """(H_pre, H_post, H_res) per token: (..., n), (..., n), (..., n, n), in fp32."""
        n = self.streams
        flat = stream.flatten(-2).float()
        dynamic = F.rms_norm(flat, (flat.shape[-1],), eps=self.eps) @ self.phi.float().T
        pre, post, res = dynamic.split([n, n, n * n], dim=-1)
        h_pre = torch.sigmoid(self.alpha[0] * pre + self.pre_bias)
        h_post = 2 * torch.sigmoid(self.alpha[1] * post + self.post_bias)
        h_res = sinkhorn(self.alpha[2] * res.unflatten(-1, (n, n)) + self.res_bias, self.iterations)
        return h_pre, h_post, h_res

    def forward(self, stream, sublayer, norm):
        h_pre, h_post, h_res = (h.to(stream.dtype) for h in self.maps(stream))
        output = sublayer(norm((h_pre.unsqueeze(-1) * stream).sum(-2)))
        return h_res @ stream + h_post.unsqueeze(-1) * output.unsqueeze(-2)


class HyperConnectionStream(nn.Module):
    """mHC's stream: n copies of the embedding; a layer's output (output_hidden_states) and the final norm's input
    are the mean of the copies."""

    def __init__(self, config, plan: LayerPlan):
        super().__init__()
        self.streams = int(plan.settings["mhc_streams"])

    def begin(self, x):
        return x.unsqueeze(-2).expand(*x.shape[:-1], self.streams, x.shape[-1])

    def end(self, stream):
        return stream.mean(-2)

    def layer_output(self, stream):
        return self.end(stream)


def mhc_residuals(layer: LayerContext):
    streams, iterations = int(layer.plan.settings["mhc_streams"]), int(layer.plan.settings["mhc_sinkhorn_iterations"])
    return tuple(ManifoldHyperConnection(layer.config.hidden_size, streams, iterations,
                                         (2 * (layer.depth - 1) + side) % streams, layer.config.rms_norm_eps)
                 for side in (0, 1))


class SiameseResidual(nn.Module):
    """SiameseNorm (Li, Han et al., ICML 2026), one sublayer on the two streams (X, Y), which share its F:
    Xn = N_X(X); O = F(N(Xn + N_Y(Y))); X' = Xn + O / sqrt(2l); Y' = Y + O. Y is Pre-LN's running sum (its identity
    path carries the gradient); X is Post-LN's normalised stream (N_X re-normalises it before each sublayer, so it
    stays bounded), with the authors' 1/sqrt(2l) on its branch, l the trained depth (kept after a layer is removed).
    N is the block norm, on the fused input."""

    def __init__(self, config, depth: int):
        super().__init__()
        self.post_norm, self.pre_norm = rms_norm(config), rms_norm(config)  # N_X, N_Y
        self.post_branch_scale = 1.0 / math.sqrt(2 * depth)

    def forward(self, stream, sublayer, norm):
        post, pre = stream
        post = self.post_norm(post)
        output = sublayer(norm(post + self.pre_norm(pre)))
        return post + self.post_branch_scale * output, pre + output


class SiameseStream(nn.Module):
    """SiameseNorm's streams: both start as the embedding; the final norm reads N_X'(X) + N_Y'(Y), two norms of this
    module's own, and so does a layer's output (output_hidden_states): what the final norm would read if the model
    stopped there."""

    def __init__(self, config, plan: LayerPlan):
        super().__init__()
        self.post_norm, self.pre_norm = rms_norm(config), rms_norm(config)

    def begin(self, x):
        return x, x

    def end(self, stream):
        post, pre = stream
        return self.post_norm(post) + self.pre_norm(pre)

    def layer_output(self, stream):
        return self.end(stream)


def siamese_residuals(layer: LayerContext):
    return tuple(SiameseResidual(layer.config, layer.depth) for _ in range(2))


def rms_norm(config) -> RMSNorm:
    return RMSNorm(config.hidden_size, config.rms_norm_eps)


# --------------------------------------------------------------------------------------------------------------------
# The placements: one row each
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerContext:
    """What a row of PLACEMENTS reads while one decoder layer is built."""
    config: LlamaConfig
    plan: LayerPlan
    depth: int  # 1-based; LNS's l
    attention: Attention  # built before the norms and residuals (BHyT's MLP-side norm reads its weights)


def rms_block_norms(layer: LayerContext) -> tuple[nn.Module, nn.Module]:
    """(input_layernorm, post_attention_layernorm) as in stock Llama."""
    return rms_norm(layer.config), rms_norm(layer.config)


def dyt_block_norms(layer: LayerContext):
    attn_alpha, other_alpha = layer.plan.settings["dyt_alpha_init"]
    return DyT(layer.config.hidden_size, attn_alpha), DyT(layer.config.hidden_size, other_alpha)


def bhyt_block_norms(layer: LayerContext):
    (attn_lambda, mlp_lambda), kappa = layer.plan.settings["bhyt_lambda_init"], layer.plan.settings["bhyt_kappa"]
    before_attention = BHyT(layer.config.hidden_size, attn_lambda, kappa)
    before_mlp = BHyTApproximated(layer.config.hidden_size, mlp_lambda, kappa, before_attention, layer.attention,
                                  layer.plan.train_max_length)
    return before_attention, before_mlp


def hybridnorm_block_norms(layer: LayerContext):
    return nn.Identity(), rms_norm(layer.config)  # no norm before attention: its q, k and v norms take that place


def each_sublayer(make: Callable[[LayerContext], nn.Module]):
    """(attn_residual, mlp_residual): the same placement module, one instance per sublayer."""
    return lambda layer: (make(layer), make(layer))


def gpas_around(inner: Callable[[LayerContext], nn.Module]):
    """GPAS around `inner` on both sublayers, with one gate per layer: the attention side owns it."""
    def residuals(layer: LayerContext):
        attention_side = GradientPreservingScale(inner(layer))
        return attention_side, GradientPreservingScale(inner(layer), attention_side)
    return residuals


def layerscale_gate(layer: LayerContext) -> GatedPreNorm:
    size = layer.config.hidden_size if layer.plan.settings["layerscale_form"] == "channel" else 1
    return GatedPreNorm(size, layer.plan.settings["layerscale_init"])


def deepnorm_branch_init(decoder_layer: DecoderLayer, plan: LayerPlan):
    """Tags the value, output and MLP projections (and under the reference init q and k) for `_init_weights`."""
    attention, mlp = decoder_layer.self_attn, decoder_layer.mlp
    value_output_mlp = (attention.v_proj, attention.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    if plan.settings["deepnorm_init"] == "deepnet":  # DeepNet: value, output and FFN projections get beta = (8L)^(-1/4)
        _scale_init_std(value_output_mlp, (8 * plan.depth_scaling_num_layers) ** -0.25)
    else:  # the reference code: Xavier-normal, gain (8L)^(+1/4) on v, o and the MLP, gain 1 on q and k
        for linear in value_output_mlp:
            linear.init_xavier_gain = (8 * plan.depth_scaling_num_layers) ** 0.25
        for linear in (attention.q_proj, attention.k_proj):
            linear.init_xavier_gain = 1.0


@dataclass(frozen=True)
class Placement:
    """One row of PLACEMENTS: the label the studies print, the modules a decoder layer of this placement is built
    from, its settings (each a config key and a trainer flag) and whether it exports to stock Llama. A row whose
    `mix` is set builds no layer itself: it names another row for each layer (Mix-LN)."""
    label: str
    residuals: Callable[[LayerContext], tuple[nn.Module, nn.Module]] | None  # (attn_residual, mlp_residual)
    block_norms: Callable[[LayerContext], tuple[nn.Module, nn.Module]] = rms_block_norms
    qkv_norm: bool = False  # an RMSNorm on each head's q, k and v inside attention
    final_norm: str = "rms"  # the model's last norm ("rms" or "dyt") when norm_type names this row
    branch_init: Callable[[DecoderLayer, LayerPlan], None] | None = None  # tags linears whose init is not the usual
    exports_to_stock_llama: bool = False  # llama_export.py folds its residuals' stock_llama_factors into the weights
    settings: tuple[Setting, ...] = ()
    mix: Callable[[LlamaConfig], list[str]] | None = None  # the row of each layer, for a row that mixes rows
    # The residual stream when it is not the running sum x (ResidualSum): a module of the backbone that starts it
    # from the embedding, reads "a layer's output" from it (output_hidden_states) and ends it into the final norm.
    stream: Callable[[LlamaConfig, LayerPlan], nn.Module] | None = None


DEEPNORM_INIT = Setting("deepnorm_init", "deepnorm: deepnet (std * (8L)^-1/4) or reference (the authors' Xavier "
                        "gains)", DEFAULT_DEEPNORM_INIT, choices=DEEPNORM_INITS)
LAYERSCALE_FORM = Setting("layerscale_form", "layerscale: one gain per channel or one scalar per sublayer",
                          DEFAULT_LAYERSCALE_FORM, choices=LAYERSCALE_FORMS)
LAYERSCALE_INIT = Setting("layerscale_init", "initial LayerScale gain (default: " + ", ".join(
    f"{v} for {k}" for k, v in DEFAULT_LAYERSCALE_INIT.items()) + ")",
    lambda resolved: DEFAULT_LAYERSCALE_INIT[resolved["layerscale_form"]], depends_on="layerscale_form")
DYT_ALPHA_INIT = Setting("dyt_alpha_init", "dyt: alpha0 before attention, and before the MLP and at the final norm",
                         list(DEFAULT_DYT_ALPHA_INIT), positive=True, count=2)
COMPLETEP_ALPHA = Setting("completep_alpha", "completep: branches are multiplied by L^-alpha (0.5 is depth-muP)",
                          DEFAULT_COMPLETEP_ALPHA, minimum=0.0)
BHYT_LAMBDA_INIT = Setting("bhyt_lambda_init", "bhyt: lambda0 before attention and before the MLP",
                           list(DEFAULT_BHYT_LAMBDA_INIT), positive=True, count=2)
BHYT_KAPPA = Setting("bhyt_kappa", "bhyt: kappa, the tanh input has RMS lambda/kappa", DEFAULT_BHYT_KAPPA,
                     minimum=1e-6)

#   x ──► attn_residual(x, Attn, input_layernorm) ──► h ──► mlp_residual(h, MLP, post_attention_layernorm) ──► out
#
#   pre         h = x + Attn(N1(x))                     out = h + MLP(N2(h))
#   post        h = N1(x + Attn(x))                     out = N2(h + MLP(h))
#   post_pre    post for the first post_num layers, pre after (Mix-LN)
#   lns         h = x + Attn(N1(x) / sqrt(l))           out = h + MLP(N2(h) / sqrt(l))
#   deepnorm    h = N1(alpha * x + Attn(x))             out = N2(alpha * h + MLP(h))
#   layerscale  h = x + g1 * Attn(N1(x))                out = h + g2 * MLP(N2(h))      g per channel or scalar
#   skipinit    h = x + g1 * Attn(N1(x))                out = h + g2 * MLP(N2(h))      scalar g, starts at 0
#   peri        h = x + O1(Attn(N1(x)))                 out = h + O2(MLP(N2(h)))  O: residual.output_norm
#   peri_lns    h = x + O1(Attn(N1(x) / sqrt(l)))       out = h + O2(MLP(N2(h) / sqrt(l)))
#   reordered   h = x + N1(Attn(x))                     out = h + N2(MLP(h))
#   dyt         as pre, with every norm (the final one too) DyT(x) = w * tanh(alpha * x) + b
#   completep   h = x + L^-a * Attn(N1(x))              out = h + L^-a * MLP(N2(h))
#   gpas        h = G(x + Attn(N1(x)))                  out = G(h + MLP(N2(h)))   G(y) = y - silu(g) * sg(y), one g
#   lns_gpas    h = G(x + Attn(N1(x) / sqrt(l)))        out = G(h + MLP(N2(h) / sqrt(l)))
#   bhyt        as pre, N(y) = w * tanh(lam * y / (kappa * s)); s = rms(x) in N1, in N2 rms(x) with Attn's share
#   hybridnorm  h = x + Attn_qkvnorm(x)                 out = N2(h) + MLP(N2(h))
#   attnres     each sublayer: y = F(N(sum_j softmax_j(q . rms(b_j)) b_j)) over the embedding and the block sums b_j
#   mhc         X (n copies): X' = H_res X + H_post^T F(N(H_pre X)), H_res doubly stochastic (Sinkhorn)
#   siamese     (X, Y): Xn = N_X(X), O = F(N(Xn + N_Y(Y))), X' = Xn + O / sqrt(2l), Y' = Y + O; final N(N_X(X) + N_Y(Y))
ATTNRES_BLOCKS = Setting("attnres_blocks", "attnres: the 2L sublayers are cut into this many blocks of consecutive "
                         "sublayers (Block AttnRes); 2L or more is Full AttnRes", 8, minimum=1, integer=True)
MHC_STREAMS = Setting("mhc_streams", "mhc: copies n of the residual stream", 4, minimum=1, integer=True)
MHC_SINKHORN_ITERATIONS = Setting("mhc_sinkhorn_iterations", "mhc: Sinkhorn-Knopp iterations (columns then rows)",
                                  20, minimum=1, integer=True)
PLACEMENTS = {
    "pre": Placement("Pre-LN", each_sublayer(lambda layer: PreNorm()), exports_to_stock_llama=True),
    "post": Placement("Post-LN", each_sublayer(lambda layer: PostNorm())),
    "post_pre": Placement("Mix-LN", None, mix=mix_ln_layers),
    "lns": Placement("LNS", each_sublayer(lambda layer: ScaledPreNorm(layer.depth)), exports_to_stock_llama=True),
    "deepnorm": Placement("DeepNorm", each_sublayer(lambda layer: DeepNormResidual(
        layer.plan.depth_scaling_num_layers)), branch_init=deepnorm_branch_init, settings=(DEEPNORM_INIT,)),
    "layerscale": Placement("LayerScale", each_sublayer(layerscale_gate), exports_to_stock_llama=True,
                            settings=(LAYERSCALE_FORM, LAYERSCALE_INIT)),
    "skipinit": Placement("SkipInit", each_sublayer(lambda layer: GatedPreNorm(1, 0.0)), exports_to_stock_llama=True),
    "peri": Placement("Peri-LN", each_sublayer(lambda layer: PeriNorm(rms_norm(layer.config)))),
    "peri_lns": Placement("Peri-LN + LNS", each_sublayer(lambda layer: PeriNorm(rms_norm(layer.config),
                                                                                  1.0 / math.sqrt(layer.depth)))),
    "reordered": Placement("Output norm (OLMo 2)", each_sublayer(lambda layer: OutputNorm())),
    "dyt": Placement("DyT", each_sublayer(lambda layer: PreNorm()), block_norms=dyt_block_norms, final_norm="dyt",
                     settings=(DYT_ALPHA_INIT,)),
    "completep": Placement("CompleteP", each_sublayer(lambda layer: DepthScaledBranch(
        layer.plan.depth_scaling_num_layers, layer.plan.settings["completep_alpha"])), exports_to_stock_llama=True,
        settings=(COMPLETEP_ALPHA,)),
    "gpas": Placement("GPAS", gpas_around(lambda layer: PreNorm())),
    "lns_gpas": Placement("LNS + GPAS", gpas_around(lambda layer: ScaledPreNorm(layer.depth))),
    "bhyt": Placement("BHyT", each_sublayer(lambda layer: PreNorm()), block_norms=bhyt_block_norms,
                      settings=(BHYT_LAMBDA_INIT, BHYT_KAPPA)),
    "hybridnorm": Placement("HybridNorm", lambda layer: (PreNorm(), NormedStreamResidual()),
                            block_norms=hybridnorm_block_norms, qkv_norm=True),
    # Attention Residuals, Block AttnRes (Moonshot AI, arXiv 2603.15031): each sublayer (attention and MLP are
    # separate sources) reads a softmax over depth of the embedding and the blocks' sums, with a pseudo-query of its
    # own (zero: uniform weights at the start) on RMS-normalised keys; the block norm N stays before the sublayer
    # (x_in = N(AttnRes(...))); the final norm reads the same aggregation with the model's output query.
    "attnres": Placement("AttnRes", attnres_residuals, stream=AttentionResidualStream, settings=(ATTNRES_BLOCKS,)),
    # mHC (DeepSeek, arXiv 2512.24880): n copies of the stream, mixed by a Sinkhorn-projected H_res, with pre and
    # post maps around each sublayer, dynamic plus static (ManifoldHyperConnection); the copies' mean is the output.
    "mhc": Placement("mHC", mhc_residuals, stream=HyperConnectionStream,
                     settings=(MHC_STREAMS, MHC_SINKHORN_ITERATIONS)),
    # SiameseNorm (Li, Han et al., arXiv 2602.08064): a Post-LN-like stream X and a Pre-LN-like stream Y share every
    # sublayer, which reads the block norm of N_X(X) + N_Y(Y); the authors' post-pre form (their ViT and DiT code).
    "siamese": Placement("SiameseNorm", siamese_residuals, stream=SiameseStream),
}
# The rows as they ship, for tests and tools that list them once; code that must see a row added later (a test's
# toy row) calls norm_types(), norm_type_choices() and layer_placements().
NORM_TYPES = norm_types()
NORM_TYPE_CHOICES = norm_type_choices()
LAYER_PLACEMENTS = layer_placements()


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, plan: LayerPlan):
        super().__init__()
        self.placement, depth = plan.placements[layer_idx], plan.depths[layer_idx]
        row = PLACEMENTS[self.placement]
        # Registered in this order: the order of `_init_weights`'s random draws and of the state dict.
        self.self_attn = Attention(config, layer_idx, qkv_norm=row.qkv_norm)
        self.mlp = MLP(config)
        layer = LayerContext(config, plan, depth, self.self_attn)
        self.input_layernorm, self.post_attention_layernorm = row.block_norms(layer)
        self.attn_residual, self.mlp_residual = row.residuals(layer)
        self._tag_init_std_factors(config, plan, depth)
        if row.branch_init is not None:  # after the init method's tags: the factors multiply in this order
            row.branch_init(self, plan)

    def _tag_init_std_factors(self, config, plan: LayerPlan, depth: int):
        """Mark the residual-branch outputs whose init the init method scales; `_init_weights` reads the tags."""
        outputs = (self.self_attn.o_proj, self.mlp.down_proj)
        if plan.init_method == "scaled":  # GPT-2 / OLMo: residual-branch outputs get std / sqrt(2L)
            _scale_init_std(outputs, 1 / math.sqrt(2 * config.num_hidden_layers))
        if plan.init_method == "depth_scaled":  # torchtitan's depth_init: std / sqrt(2l), l the 1-based depth
            _scale_init_std(outputs, 1 / math.sqrt(2 * depth))

    def forward(self, x: torch.Tensor, rope, mask: torch.Tensor | None) -> torch.Tensor:
        h = self.attn_residual(x, lambda y: self.self_attn(y, rope, mask), self.input_layernorm)
        return self.mlp_residual(h, self.mlp, self.post_attention_layernorm)


def _scale_init_std(linears, factor: float):
    for linear in linears:
        linear.init_std_factor = getattr(linear, "init_std_factor", 1.0) * factor


# --------------------------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------------------------


class LlamaPreTrainedModel(PreTrainedModel):
    config_class = NormPlacementConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DecoderLayer"]
    _supports_sdpa = True  # our attention is F.scaled_dot_product_attention; HF records "sdpa" and accepts it by name

    @torch.no_grad()
    def _init_weights(self, module):
        # transformers.initialization, here and in every reset_parameters, skips what from_pretrained loaded.
        # Linear and Embedding are torch's, with torch's reset_parameters: their init is written here.
        if isinstance(module, nn.Linear):
            factor = getattr(module, "init_std_factor", 1.0)
            if hasattr(module, "init_xavier_gain"):
                init.xavier_normal_(module.weight, gain=module.init_xavier_gain * factor)
            else:
                init.normal_(module.weight, mean=0.0, std=self.config.initializer_range * factor)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=layer_plan(self.config).embed_init_std)
            # As in HF: the pad row starts at zero. Slicing drops the "already loaded" flag, so check it here.
            if module.padding_idx is not None and not getattr(module.weight, "_is_hf_initialized", False):
                init.zeros_(module.weight[module.padding_idx])
        elif hasattr(module, "reset_parameters"):  # ours: every module with parameters or tables owns its init
            module.reset_parameters()


def frozen_pad_id(config) -> int | None:
    """The embedding row that never trains (`padding_idx`): the pad id, unless it is also EOS, which ends every
    document (a tokenizer without a pad token pads with EOS): freezing it would freeze a real input token."""
    pad_id, eos_id = getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None)
    return None if pad_id in (eos_id if isinstance(eos_id, (list, tuple)) else [eos_id]) else pad_id


class LlamaModel(LlamaPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        plan = layer_plan(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, frozen_pad_id(config))
        self.layers = nn.ModuleList(DecoderLayer(config, i, plan) for i in range(config.num_hidden_layers))
        # Applied after every variant, Post-LN included (as in the reference): it keeps one parameter layout for all.
        self.norm = (DyT(config.hidden_size, plan.settings["dyt_alpha_init"][1]) if plan.final_norm == "dyt"
                     else rms_norm(config))
        stream = PLACEMENTS[canonical_norm_type(getattr(config, "norm_type", "pre"))].stream
        # The running sum has no parameters, so a model of every other placement keeps stock Llama's state dict.
        self.residual_stream = ResidualSum() if stream is None else stream(config, plan)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary_emb = RotaryEmbedding(head_dim, _rope_theta(config), config.max_position_embeddings)
        self.gradient_checkpointing = False
        self.post_init()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                output_hidden_states: bool = False):
        x = self.embed_tokens(input_ids)
        rope = self.rotary_emb(input_ids.shape[1], x.dtype)
        mask = _attention_mask(attention_mask, input_ids.shape[1], x.device)
        stream = self.residual_stream.begin(x)
        hidden_states = [self.residual_stream.layer_output(stream)] if output_hidden_states else None
        for layer in self.layers:
            if self.gradient_checkpointing and self.training:
                stream = torch.utils.checkpoint.checkpoint(layer, stream, rope, mask, use_reentrant=False)
            else:
                stream = layer(stream, rope, mask)
            if output_hidden_states:
                hidden_states.append(self.residual_stream.layer_output(stream))
        x = self.norm(self.residual_stream.end(stream))
        if output_hidden_states:
            hidden_states[-1] = x  # HF convention: the last entry is the final-normed output
        return x, (tuple(hidden_states) if output_hidden_states else None)


class LlamaForCausalLM(LlamaPreTrainedModel, GenerationMixin):
    def __init__(self, config):
        config = as_norm_placement_config(config)  # so that what it saves never reads as stock Llama
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
                labels: torch.Tensor | None = None, output_hidden_states: bool | None = None,
                head_loss: str = "standard", **unused):
        # **unused absorbs generation/lm-eval extras (use_cache, past_key_values, ...): this model keeps no KV cache.
        # Inputs that would change the result are refused rather than dropped.
        for name in ("inputs_embeds", "position_ids"):
            if unused.get(name) is not None:
                raise ValueError(f"{name} is not supported: pass input_ids; positions are 0 .. T-1 in every row")
        hidden, hidden_states = self.model(input_ids, attention_mask, bool(output_hidden_states))
        if labels is not None and head_loss != "standard":  # the trainer's --loss: the same loss, no full logits
            # In a try: transformers then does not require peft_pretraining to load a checkpoint's copy of this file.
            try:
                from peft_pretraining.model.head_losses import head_loss as loss_without_logits
            except ImportError as error:
                raise ValueError(f"head_loss={head_loss!r} needs this repository's peft_pretraining") from error
            return CausalLMOutput(loss=loss_without_logits(hidden, self.lm_head.weight, labels, head_loss),
                                  hidden_states=hidden_states)
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


NormPlacementConfig.register_for_auto_class()  # save_pretrained writes auto_map and copies this file beside the weights
LlamaForCausalLM.register_for_auto_class("AutoModelForCausalLM")
# A process that imported this module knows our model type: AutoConfig, AutoTokenizer and AutoModelForCausalLM read
# our checkpoints with this code and ask no custom-code question. Elsewhere the checkpoint's copy of this file needs
# trust_remote_code=True, and that copy registers nothing: trusting one checkpoint must not silence the question for
# the next.
if __package__ == "peft_pretraining.model":
    AutoConfig.register(NormPlacementConfig.model_type, NormPlacementConfig, exist_ok=True)
    AutoModelForCausalLM.register(NormPlacementConfig, LlamaForCausalLM, exist_ok=True)

