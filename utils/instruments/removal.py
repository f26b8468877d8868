"""Removing a decoder layer from a causal LM, for good (remove_layer) or for the length of a block (layer_removed).

The remaining layers' attention ``layer_idx`` is renumbered (the KV cache is indexed by it) and the config's
``num_hidden_layers`` and per-layer lists follow; our models first pin each layer's placement and LNS depth
(``freeze_layer_plan``), so every remaining layer keeps what it was trained with. Command line: layer_remove.py.
"""
from __future__ import annotations

import contextlib
import copy

from peft_pretraining.model.model_parts import decoder_layers, is_our_config

# Config attributes holding one entry per layer; the removed layer's entry is dropped.
PER_LAYER_CONFIG_KEYS = ("layer_types", "layer_norm_types", "layer_depths")
# Config attributes a removal may change, snapshotted so an in-memory removal can be undone exactly.
_RESTORED_CONFIG_KEYS = ("num_hidden_layers", "depth_scaling_num_layers", *PER_LAYER_CONFIG_KEYS)


def check_layer_index(layer_index: int, num_layers: int) -> None:
    if num_layers < 2:
        raise ValueError(f"--layer_index: the model has {num_layers} layer; removing it would leave none")
    if not 0 <= layer_index < num_layers:
        raise ValueError(f"--layer_index: {layer_index} is out of range for a model with {num_layers} layers "
                         f"(valid: 0..{num_layers - 1})")


def _renumber_layers(layers) -> None:
    """Give every module of layer i that carries a ``layer_idx`` (attention, KV-cache users) the index i."""
    for new_index, layer in enumerate(layers):
        for module in layer.modules():
            if isinstance(getattr(module, "layer_idx", None), int):
                module.layer_idx = new_index


def remove_layer(model, layer_index: int):
    """Remove decoder layer ``layer_index`` (0-based) in place; returns the removed module."""
    layers = decoder_layers(model)
    check_layer_index(layer_index, len(layers))
    config = model.config
    if is_our_config(config):
        from peft_pretraining.model.modeling_llama import freeze_layer_plan

        freeze_layer_plan(config)  # pin every layer's placement and depth before the positions shift
    for key in PER_LAYER_CONFIG_KEYS:
        values = getattr(config, key, None)
        if isinstance(values, (list, tuple)) and len(values) == len(layers):
            setattr(config, key, [value for index, value in enumerate(values) if index != layer_index])
    removed = layers[layer_index]
    del layers[layer_index]
    config.num_hidden_layers = len(layers)
    _renumber_layers(layers)
    return removed


@contextlib.contextmanager
def layer_removed(model, layer_index: int):
    """Remove a layer for the duration of the block, then put the model and its config back as they were."""
    layers = decoder_layers(model)
    saved = {key: copy.deepcopy(getattr(model.config, key)) for key in _RESTORED_CONFIG_KEYS
             if hasattr(model.config, key)}
    removed = remove_layer(model, layer_index)
    try:
        yield model
    finally:
        layers.insert(layer_index, removed)
        _renumber_layers(layers)
        for key in _RESTORED_CONFIG_KEYS:
            if key in saved:
                setattr(model.config, key, saved[key])
            elif hasattr(model.config, key):
                delattr(model.config, key)
