"""Angular distance between the residual stream at every pair of depths, and block influence, over real tokens.

d(l, n) = mean over real (non-pad) token positions of arccos(cos(h_l, h_{l+n})) / pi, where h_0 is the stream
entering decoder layer 0 and h_l the stream leaving layer l - 1 (utils/instruments/model_io.ResidualStream). Block
influence (ShortGPT, Men et al. 2024) from the same pass: BI(l) = 1 - mean over real tokens of cos(h_l, h_{l+1}).
Command line: utils/angular_analysis.py.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from tqdm.auto import tqdm

from utils.instruments import model_io

# Bytes of float64 cosine work per chunk of tokens; bounds memory whatever the model size.
_CHUNK_BYTES = 256 * 1024 * 1024


class AngularDistanceAccumulator:
    """Running sums of angular distances over tokens for every pair of depths.

    States arrive in float32; their dot products are accumulated in float64, because arccos is ill-conditioned
    near cos = 1 (where deep Pre-LN layers live) and float32 rounding there alone would read as ~1e-4 * pi.
    """

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.angle_sums = torch.zeros(num_layers + 1, num_layers + 1, dtype=torch.float64)
        self.adjacent_cosine_sums = torch.zeros(num_layers, dtype=torch.float64)  # cos(h_l, h_{l+1}), for BI
        self.num_tokens = 0

    def update(self, states: list[torch.Tensor]) -> None:
        if len(states) != self.num_layers + 1:
            raise ValueError(f"expected {self.num_layers + 1} states, got {len(states)}")
        num_tokens, hidden = states[0].shape
        depth = self.num_layers + 1
        chunk = max(1, _CHUNK_BYTES // (8 * depth * hidden))
        for start in range(0, num_tokens, chunk):
            stop = min(start + chunk, num_tokens)
            # One float64 copy, token-major, then one Gram matrix per token: dot products of float32 values are
            # exact in float64, so cos = G_lm / sqrt(G_ll G_mm) keeps its precision near 1.
            stacked = torch.empty(stop - start, depth, hidden, dtype=torch.float64, device=states[0].device)
            for index, state in enumerate(states):
                stacked[:, index] = state[start:stop]
            gram = stacked @ stacked.transpose(1, 2)  # [tokens, L+1, L+1]
            norms = gram.diagonal(dim1=1, dim2=2).sqrt().clamp_min(1e-300)
            cosines = (gram / (norms[:, :, None] * norms[:, None, :])).clamp_(-1.0, 1.0)
            self.angle_sums += (torch.arccos(cosines) / math.pi).sum(dim=0).cpu()
            self.adjacent_cosine_sums += cosines.diagonal(offset=1, dim1=1, dim2=2).sum(dim=0).cpu()
        self.num_tokens += num_tokens

    def matrix(self) -> np.ndarray:
        """[n - 1, l] = mean angular distance between depth l and depth l + n; NaN where l + n > L."""
        if self.num_tokens == 0:
            raise ValueError("no tokens were analysed")
        depth = self.num_layers
        means = (self.angle_sums / self.num_tokens).numpy()
        result = np.full((depth, depth), np.nan)
        for n in range(1, depth + 1):
            result[n - 1, : depth + 1 - n] = np.diagonal(means, offset=n)
        return result

    def block_influence(self) -> np.ndarray:
        """[l] = 1 - mean cosine between the input and the output of layer l (ShortGPT's BI)."""
        if self.num_tokens == 0:
            raise ValueError("no tokens were analysed")
        return 1.0 - (self.adjacent_cosine_sums / self.num_tokens).numpy()


def accumulate(model, batches, total_tokens: int | None = None, device=None, also=()) -> AngularDistanceAccumulator:
    """Stream batches of (input_ids, attention_mask) through the model, summing over their real tokens. `also`:
    further accumulators of the stream (the logit lens), fed the same states in the same pass."""
    stream = model_io.ResidualStream(model)
    device = device if device is not None else next(model.parameters()).device
    accumulator = AngularDistanceAccumulator(stream.num_layers)
    with tqdm(total=total_tokens, unit="tok", desc="angular distance", dynamic_ncols=True) as bar:
        for input_ids, attention_mask in batches:
            states = stream(input_ids.to(device), attention_mask.to(device))
            for each in (accumulator, *also):
                each.update(states)
            bar.update(int(attention_mask.sum()))
    return accumulator


def compute_angular_distances(model, batches, total_tokens: int | None = None, device=None) -> tuple[np.ndarray, int]:
    """(matrix, tokens analysed): see AngularDistanceAccumulator.matrix."""
    accumulator = accumulate(model, batches, total_tokens, device)
    return accumulator.matrix(), accumulator.num_tokens


def ranks(values: np.ndarray) -> np.ndarray:
    """1 = the largest value (the layer that changes the stream most); ties keep layer order."""
    order = np.argsort(-values, kind="stable")
    result = np.empty(len(values), dtype=int)
    result[order] = np.arange(1, len(values) + 1)
    return result


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation (Pearson's on the ranks)."""
    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])
