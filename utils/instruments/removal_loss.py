"""Removal cost as a next-token loss: the mean cross-entropy of the intact model on given windows, and its rise (nats
per token) with each decoder layer removed in turn (utils/instruments/removal.layer_removed). Cheaper than the lm-eval
sweep (utils/instruments/removal_sweep.py) and per token rather than per word; utils/depth_report.py reports it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from peft_pretraining.model.model_parts import decoder_layers
from utils.instruments.removal import layer_removed


@torch.inference_mode()
def next_token_loss(model, batches) -> float:
    """Mean next-token cross-entropy (nats/token) over every real token that has a real successor."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for input_ids, attention_mask in batches:
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1].float()
        scored = (attention_mask[:, 1:] * attention_mask[:, :-1]).bool()
        total += F.cross_entropy(logits[scored], input_ids[:, 1:][scored], reduction="sum").item()
        count += int(scored.sum())
    if count == 0:
        raise ValueError("no token has a successor to predict")
    return total / count


def measure_removal(model, batches: list, desc: str = "removal") -> dict:
    """The loss with every layer, and its rise (nats/token) with each layer removed in turn."""
    baseline = next_token_loss(model, batches)
    costs = []
    for layer in tqdm(range(len(decoder_layers(model))), unit="layer", desc=desc, dynamic_ncols=True):
        with layer_removed(model, layer):
            costs.append(next_token_loss(model, batches) - baseline)
    return dict(removal_baseline_nats=baseline, removal_cost=costs)
