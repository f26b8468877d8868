"""LayerNorm Scaling (LNS) for Hugging Face pre-norm decoders.

LNS multiplies the output of each decoder layer's two block norms (``input_layernorm`` and
``post_attention_layernorm``) by 1/sqrt(l), l being the 1-based layer index; the final norm is
left alone. Here the factor is attached as a forward hook on each norm module instead of a
replacement module, so parameter names, the state dict and ``save_pretrained`` output stay exactly
those of the unpatched model and nothing new is trained.

A hook is runtime state, so a reloaded checkpoint comes back *without* it. ``config.layernorm_scaling``
is set while the hooks are on, and :func:`reapply_layernorm_scaling_from_config` restores them after
``from_pretrained``. For inference or export, :func:`fold_layernorm_scaling` multiplies the factor
into the norm gains, giving a plain model with identical outputs that loads anywhere.

Typical use::

    model = AutoModelForCausalLM.from_pretrained(name)
    apply_layernorm_scaling(model)   # train as usual; LoRA/peft, Trainer, accelerate all work
    fold_layernorm_scaling(model)    # optional: bake the factors in before sharing the weights
"""
from __future__ import annotations

import math

import torch
from torch import nn

from peft_pretraining.model.model_parts import decoder_layers, is_our_config, unwrap
from peft_pretraining.model.modeling_llama import canonical_norm_type

# "llama_norm_placement" is this repository's model (peft_pretraining.model.modeling_llama); only its Pre-LN takes
# hooks.
SUPPORTED_MODEL_TYPES = ("llama", "llama_norm_placement", "mistral", "qwen2", "qwen3")
BLOCK_NORM_NAMES = ("input_layernorm", "post_attention_layernorm")
CONFIG_FLAG = "layernorm_scaling"


class DepthScale:
    """Forward hook multiplying a module's output by a fixed factor.

    A small class (not a lambda) so that patched models can be deep-copied and pickled.
    """

    def __init__(self, scale: float):
        self.scale = float(scale)

    def __call__(self, module: nn.Module, inputs, output: torch.Tensor) -> torch.Tensor:
        return output * self.scale

    def __repr__(self) -> str:
        return f"DepthScale({self.scale:.6g})"


def _model_type(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None)


def _checked_decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer list of a supported model (causal LM or bare backbone), after checks."""
    model = unwrap(model)
    model_type = _model_type(model)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"LayerNorm Scaling supports model types {', '.join(SUPPORTED_MODEL_TYPES)}; "
            f"got model_type={model_type!r} ({type(model).__name__})"
        )
    # Of this repository's models, only the plain Pre-LN placement matches HF's layer layout.
    if is_our_config(model.config) and canonical_norm_type(model.config.norm_type) != "pre":
        raise ValueError(
            f"apply_layernorm_scaling needs a Pre-LN model; this model has norm_type={model.config.norm_type!r} "
            "(for LNS pretraining use norm_type='lns' directly)"
        )
    layers = decoder_layers(model)
    for index, layer in enumerate(layers):
        for name in BLOCK_NORM_NAMES:
            if not isinstance(getattr(layer, name, None), nn.Module):
                raise ValueError(f"decoder layer {index} of {type(model).__name__} has no {name} module")
    return layers


def _block_norms(model: nn.Module):
    """Yields (1-based depth, norm module) for every block norm, in layer order."""
    for index, layer in enumerate(_checked_decoder_layers(model)):
        for name in BLOCK_NORM_NAMES:
            yield index + 1, getattr(layer, name)


def _lns_hooks(norm: nn.Module) -> dict:
    return {key: hook for key, hook in norm._forward_hooks.items() if isinstance(hook, DepthScale)}


def _set_config_flag(model: nn.Module, value: bool) -> None:
    config = unwrap(model).config
    if value:
        setattr(config, CONFIG_FLAG, True)
    elif hasattr(config, CONFIG_FLAG):
        delattr(config, CONFIG_FLAG)


def has_layernorm_scaling(model: nn.Module) -> bool:
    """True when LNS hooks are attached anywhere in the model (never raises, whatever the architecture)."""
    return any(_lns_hooks(module) for module in model.modules())


def apply_layernorm_scaling(model: nn.Module) -> nn.Module:
    """Scales each decoder layer's block-norm outputs by 1/sqrt(l) in place; returns the model.

    Works on LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM (and their
    bare backbones or peft wrappers). Qwen3's per-head q_norm/k_norm are not block norms and are left
    untouched. Raises ValueError for other architectures or when LNS is already applied.
    """
    norms = list(_block_norms(model))
    if any(_lns_hooks(norm) for _, norm in norms):
        raise ValueError("LayerNorm Scaling is already applied to this model")
    for depth, norm in norms:
        norm.register_forward_hook(DepthScale(1.0 / math.sqrt(depth)))
    _set_config_flag(model, True)
    return model


def remove_layernorm_scaling(model: nn.Module) -> nn.Module:
    """Detaches the hooks added by :func:`apply_layernorm_scaling`; the model is then exactly the original."""
    norms = list(_block_norms(model))
    if not any(_lns_hooks(norm) for _, norm in norms):
        raise ValueError("LayerNorm Scaling is not applied to this model (nothing to remove)")
    for _, norm in norms:
        for key in _lns_hooks(norm):
            del norm._forward_hooks[key]
    _set_config_flag(model, False)
    return model


@torch.no_grad()
def fold_layernorm_scaling(model: nn.Module) -> nn.Module:
    """Multiplies each block norm's gain (and bias, if any) by its LNS factor and removes the hooks.

    RMSNorm/LayerNorm outputs are linear in their affine parameters, so the folded model computes the
    same function with no hooks and no extra config: it can be saved and loaded as a plain HF model.
    """
    norms = list(_block_norms(model))
    if not any(_lns_hooks(norm) for _, norm in norms):
        raise ValueError("LayerNorm Scaling is not applied to this model (nothing to fold)")
    for _, norm in norms:
        hooks = _lns_hooks(norm)
        if not hooks:
            continue
        if not isinstance(getattr(norm, "weight", None), torch.Tensor):
            raise ValueError(f"cannot fold into {type(norm).__name__}: it has no weight (gain) tensor")
        scale = math.prod(hook.scale for hook in hooks.values())
        norm.weight.mul_(scale)
        if isinstance(getattr(norm, "bias", None), torch.Tensor):
            norm.bias.mul_(scale)
        for key in hooks:
            del norm._forward_hooks[key]
    _set_config_flag(model, False)
    return model


def reapply_layernorm_scaling_from_config(model: nn.Module) -> bool:
    """After ``from_pretrained``: re-attaches the hooks if the saved config says LNS was on.

    Returns True when hooks were attached. Models never patched, or folded, are left unchanged.
    """
    config = getattr(unwrap(model), "config", None)
    if not getattr(config, CONFIG_FLAG, False) or has_layernorm_scaling(model):
        return False
    apply_layernorm_scaling(model)
    return True
