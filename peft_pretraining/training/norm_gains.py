"""The mean RMSNorm gain per decoder layer and of the final norm, as the trainer logs them at each evaluation."""
import torch

from peft_pretraining.model.model_parts import backbone, decoder_layers


def _full_mean(weights) -> float:
    """Mean of some (possibly FSDP-sharded DTensor) parameters; collective under FSDP, so every rank calls it."""
    with torch.no_grad():
        full = [w.full_tensor() if hasattr(w, "full_tensor") else w for w in weights]
        return float(torch.cat([w.detach().float().flatten() for w in full]).mean())


def mean_norm_gains(model) -> list[float]:
    """Per decoder layer, the mean of all its norm gains (input_layernorm and post_attention_layernorm, and any
    other submodule named *norm* with a weight). Both RMSNorms start at 1.0."""
    gains = []
    for layer in decoder_layers(model):
        weights = [module.weight for name, module in layer.named_modules()
                   if "norm" in name.rsplit(".", 1)[-1].lower() and isinstance(getattr(module, "weight", None),
                                                                               torch.Tensor)]
        gains.append(_full_mean(weights) if weights else float("nan"))
    return gains


def final_norm_gain(model) -> float:
    """Mean gain of the final norm (before the LM head)."""
    return _full_mean([backbone(model).norm.weight])
