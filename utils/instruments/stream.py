"""One pass of the residual stream (utils/instruments/model_io.ResidualStream) feeding every per-depth accumulator at
once: the angular distances and block influence, the variance and RMS, the logit lens and the update ratio
||h_{l+1} - h_l|| / ||h_l|| of each block. The same states in the same pass give the numbers each would give alone.
"""
from __future__ import annotations

import torch
from tqdm.auto import tqdm

from utils.instruments import model_io
from utils.instruments.angular import AngularDistanceAccumulator
from utils.instruments.logit_lens import LogitLensAccumulator
from utils.instruments.variance import StreamStatistics


class UpdateRatioAccumulator:
    """Mean over real tokens of ||h_{l+1} - h_l|| / ||h_l||: how large block l's update is against the stream it is
    added to (0 for an identity block). Accumulated in float64."""

    def __init__(self, num_layers: int):
        self.sums = torch.zeros(num_layers, dtype=torch.float64)
        self.num_tokens = 0

    def update(self, states: list[torch.Tensor]) -> None:
        for layer in range(len(states) - 1):
            before, after = states[layer].double(), states[layer + 1].double()
            ratios = (after - before).norm(dim=-1) / before.norm(dim=-1).clamp_min(1e-300)
            self.sums[layer] += ratios.sum().cpu()
        self.num_tokens += states[0].shape[0]

    def result(self) -> list[float]:
        if self.num_tokens == 0:
            raise ValueError("no tokens were analysed")
        return (self.sums / self.num_tokens).tolist()


def measure_stream(model, batches, total_tokens: int | None = None, desc: str = "stream", logit_lens: bool = True,
                   update_ratio: bool = True) -> dict:
    """Stream batches of (input_ids, attention_mask) through the model once; returns num_tokens, angular (the matrix
    of AngularDistanceAccumulator.matrix), block_influence, variance and rms (depths 0..L), with logit_lens the
    lens's results (LogitLensAccumulator.result) and with update_ratio the update ratio of each block."""
    stream = model_io.ResidualStream(model)
    device = next(model.parameters()).device
    angular, statistics = AngularDistanceAccumulator(stream.num_layers), StreamStatistics(stream.num_layers)
    lens = LogitLensAccumulator.of_model(model, stream.num_layers) if logit_lens else None
    updates = UpdateRatioAccumulator(stream.num_layers) if update_ratio else None
    accumulators = [each for each in (angular, statistics, updates, lens) if each is not None]
    with tqdm(total=total_tokens, unit="tok", desc=desc, dynamic_ncols=True) as bar:
        for input_ids, attention_mask in batches:
            states = stream(input_ids.to(device), attention_mask.to(device))
            for accumulator in accumulators:
                accumulator.update(states)
            bar.update(int(attention_mask.sum()))
    moments = statistics.result()
    result = dict(num_tokens=angular.num_tokens, angular=angular.matrix(), block_influence=angular.block_influence(),
                  variance=moments["variance"], rms=moments["rms"])
    if updates is not None:
        result["update_ratio"] = updates.result()
    if lens is not None:
        result.update(lens.result())
    return result
