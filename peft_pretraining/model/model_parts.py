"""Finding the parts of a model, whatever wraps it: the model itself, its decoder backbone and layer list, and
whether it is one of this repository's models. Used by the trainer (norm gains), LayerNorm Scaling and the tools."""
from torch import nn


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside torch.compile (`_orig_mod`), DDP (`.module`) and peft (`get_base_model`) wrappers; FSDP2
    wraps in place, so its model is the model."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
        elif callable(getattr(model, "get_base_model", None)):
            model = model.get_base_model()
        else:
            return model


def backbone(model: nn.Module) -> nn.Module:
    """The decoder backbone (``model.model`` for Llama, Qwen2/3, Mistral and ours; a bare backbone is its own)."""
    model = unwrap(model)
    return model.get_decoder() if hasattr(model, "get_decoder") else model


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The list of decoder blocks; ValueError when the backbone holds none."""
    layers = getattr(backbone(model), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: no decoder layer list found at get_decoder().layers")
    return layers


def is_our_config(config) -> bool:
    """One of this repository's models (peft_pretraining.model.modeling_llama): its config names a norm_type.
    `config` is a model's config or a config.json read as a dict."""
    norm_type = config.get("norm_type") if isinstance(config, dict) else getattr(config, "norm_type", None)
    return norm_type is not None
