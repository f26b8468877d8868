"""Variance and RMS of the residual stream at every depth, over real tokens and hidden channels pooled, in float64.

Depth 0 is the stream entering decoder layer 0 (the embeddings), depth l the stream leaving layer l - 1, before the
final norm. Command line: utils/variance_analysis.py.
"""
from __future__ import annotations

import numpy as np
import torch
from tqdm.auto import tqdm

from utils.instruments import model_io


class StreamStatistics:
    """Running float64 sums of h and h^2 per depth."""

    def __init__(self, num_layers: int):
        self.sums = torch.zeros(num_layers + 1, dtype=torch.float64)
        self.square_sums = torch.zeros(num_layers + 1, dtype=torch.float64)
        self.num_values = 0
        self.num_tokens = 0

    def update(self, states: list[torch.Tensor]) -> None:
        for depth, state in enumerate(states):
            values = state.double()
            self.sums[depth] += values.sum().item()
            self.square_sums[depth] += values.square().sum().item()
        self.num_values += states[0].numel()
        self.num_tokens += states[0].shape[0]

    def result(self) -> dict[str, np.ndarray]:
        if self.num_values == 0:
            raise ValueError("no tokens were analysed")
        mean = self.sums / self.num_values
        mean_square = self.square_sums / self.num_values
        return {"variance": (mean_square - mean.square()).clamp_min(0).numpy(), "rms": mean_square.sqrt().numpy()}


def residual_statistics(model, batches, total_tokens: int | None = None, device=None, desc: str = "variance"):
    """Stream batches through the model; returns ({"variance": [L+1], "rms": [L+1]}, tokens analysed)."""
    stream = model_io.ResidualStream(model)
    device = device if device is not None else next(model.parameters()).device
    statistics = StreamStatistics(stream.num_layers)
    with tqdm(total=total_tokens, unit="tok", desc=desc, dynamic_ncols=True) as bar:
        for input_ids, attention_mask in batches:
            statistics.update(stream(input_ids.to(device), attention_mask.to(device)))
            bar.update(int(attention_mask.sum()))
    return statistics.result(), statistics.num_tokens
