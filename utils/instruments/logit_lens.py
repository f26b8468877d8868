"""The logit lens: the model's own final norm and LM head applied to the residual stream after every layer, compared
with the final layer's next-token distribution. Per depth, KL(final || depth l) and the top-1 agreement; per token,
the prediction depth, the first layer from which its top-1 token agrees with the final one and stays.

Fed the states of utils/instruments/model_io.ResidualStream by utils/depth_report.py and by utils/angular_analysis.py
--logit_lens (in the same pass as their other measures), and through the latter by the study's analyses.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

# Floats of one [tokens, vocab] slab of the logit lens; bounds its memory whatever the vocabulary.
LENS_CHUNK_FLOATS = 1 << 24


def final_readout(model):
    """The model's own way from the residual stream to logits: its final norm, then its LM head."""
    norm = getattr(model.get_decoder(), "norm", None)
    head = model.get_output_embeddings()
    if norm is None or head is None:
        raise ValueError(f"{type(model).__name__}: no final norm at get_decoder().norm or no LM head")
    dtype = head.weight.dtype

    def readout(states: torch.Tensor) -> torch.Tensor:
        return head(norm(states.to(dtype))).float()

    return readout


class LogitLensAccumulator:
    """Running sums of the logit lens at depths 1..L (the stream after each layer) over real tokens.

    KL(final || depth l) = sum_v p_L(v) (log p_L(v) - log p_l(v)), where p_l = softmax(head(norm(h_l))); p_L is the
    model's own next-token distribution. A token's prediction depth is the first l from which argmax p_m equals
    argmax p_L for every m >= l (L when only the final layer has it)."""

    def __init__(self, readout, num_layers: int, vocab_size: int):
        self.readout = readout
        self.num_layers = num_layers
        self.chunk = max(1, LENS_CHUNK_FLOATS // vocab_size)
        self.kl_sums = torch.zeros(num_layers, dtype=torch.float64)
        self.agreement_sums = torch.zeros(num_layers, dtype=torch.float64)
        self.prediction_depths: list[torch.Tensor] = []
        self.num_tokens = 0

    @classmethod
    def of_model(cls, model, num_layers: int) -> LogitLensAccumulator:
        """The lens of a model through its own final norm and LM head, over its whole vocabulary."""
        return cls(final_readout(model), num_layers, model.get_output_embeddings().weight.shape[0])

    @torch.inference_mode()
    def update(self, states: list[torch.Tensor]) -> None:
        for start in range(0, states[0].shape[0], self.chunk):
            final = F.log_softmax(self.readout(states[-1][start:start + self.chunk]), dim=-1)
            final_top1, final_probs = final.argmax(-1), final.exp()
            agreements = []
            for depth in range(1, self.num_layers + 1):
                lens = F.log_softmax(self.readout(states[depth][start:start + self.chunk]), dim=-1)
                self.kl_sums[depth - 1] += (final_probs * (final - lens)).sum(-1).double().sum().cpu()
                agreements.append(lens.argmax(-1) == final_top1)
            agree = torch.stack(agreements)  # [L, tokens]
            self.agreement_sums += agree.double().sum(1).cpu()
            # How many of the last depths agree without a break; the final one always does.
            agreeing_tail = agree.flip(0).long().cumprod(0).sum(0)
            self.prediction_depths.append((self.num_layers + 1 - agreeing_tail).cpu())
            self.num_tokens += agree.shape[1]

    def result(self) -> dict:
        if self.num_tokens == 0:
            raise ValueError("no tokens were analysed")
        depths = torch.cat(self.prediction_depths).numpy()
        return dict(lens_kl=(self.kl_sums / self.num_tokens).tolist(),
                    lens_top1_agreement=(self.agreement_sums / self.num_tokens).tolist(),
                    prediction_depth_mean=float(depths.mean()),
                    prediction_depth_median=float(np.median(depths)),
                    prediction_depth_p90=float(np.quantile(depths, 0.9)),
                    # [l - 1] = fraction of tokens whose prediction depth is l
                    prediction_depth_histogram=(np.bincount(depths, minlength=self.num_layers + 1)[1:]
                                                / len(depths)).tolist())
