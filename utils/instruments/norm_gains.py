"""The gains of a decoder's norms: per layer the mean gain of its norms (both of them, or however many its
placement has), the final norm's mean gain, and the largest deviation of any block-norm gain from 1.

Read from a model's state dict (a loaded model, or a checkpoint's tensors), by the names our models and HF Llama
share: model.layers.<i>.<...norm...>.weight and model.norm.weight.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np
import torch


def norm_gains(state_dict: Mapping[str, torch.Tensor]) -> dict:
    per_layer: dict[int, list[float]] = {}
    max_dev = 0.0
    for name in sorted(state_dict):  # by name: one order for a loaded model and for a checkpoint's shards
        parts, tensor = name.split("."), state_dict[name]
        if len(parts) >= 5 and parts[1] == "layers" and "norm" in parts[3] and parts[-1] == "weight":
            per_layer.setdefault(int(parts[2]), []).append(float(tensor.float().mean()))
            max_dev = max(max_dev, float((tensor.float() - 1).abs().max()))
    final = state_dict.get("model.norm.weight")
    # max_abs_dev_from_one = 0 means every block-norm gain is still exactly 1.0 (the pure-bf16 trap).
    return dict(per_layer=[float(np.mean(per_layer[i])) for i in sorted(per_layer)],
                final=None if final is None else float(final.float().mean()), max_abs_dev_from_one=max_dev)


def checkpoint_norm_gains(checkpoint) -> dict:
    """norm_gains of a checkpoint folder's safetensors shards, without building the model."""
    from safetensors.torch import load_file

    weights = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        weights.update(load_file(str(shard)))
    return norm_gains(weights)
