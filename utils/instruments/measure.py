"""Every depth instrument on one loaded model, on one held-out text, in one call: measure_model.

    measured = measure_model(model, tokenizer, MeasureSettings(max_seq_len=128, stream_tokens=8192,
                             jacobian_tokens=32, jacobian_probes=8, removal_documents=16))

From the text, in windows of max_seq_len tokens (each opened with the tokenizer's prefix,
utils/instruments/model_io.py):

- one pass of the residual stream over its first stream_tokens tokens (utils/instruments/stream.py): the angular
  distances d(l, n) and block influence, the variance and RMS per depth, the update ratio per block and the logit lens;
- block Jacobians at jacobian_tokens positions sampled from its windows (utils/instruments/jacobian.py);
- the removal cost of each layer, one of two ways (removal=): the layer-removal sweep through lm-eval on the held-out
  file's first removal_documents documents, each document's values kept (utils/instruments/removal_sweep.py; the
  study's), or the rise of the next-token loss on the first removal_tokens tokens of the stream's windows
  (utils/instruments/removal_loss.py; the depth report's, for any causal LM and any text);
- the gains of the model's norms (utils/instruments/norm_gains.py).

Each measure is what its command line computes with the same settings (utils/variance_analysis.py,
utils/angular_analysis.py --logit_lens, utils/jacobian_analysis.py, layer_remove.py --sweep --per_document), number
for number; the model is loaded once and nothing is written. The study's analyses (utils/study/analyse.py) and the
depth report (utils/depth_report.py) call it.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from utils.instruments import model_io
from utils.instruments.jacobian import NO_BLOCK_JACOBIAN, measure_jacobians, sample_tokens, stream_is_a_running_sum
from utils.instruments.norm_gains import norm_gains
from utils.instruments.removal_loss import measure_removal
from utils.instruments.removal_sweep import heldout_removal_sweep
from utils.instruments.stream import measure_stream

HELDOUT_SWEEP, NEXT_TOKEN_LOSS = "heldout_sweep", "next_token_loss"  # the two removal measures


@dataclasses.dataclass(frozen=True)
class MeasureSettings:
    max_seq_len: int  # tokens per window, and the most lm-eval feeds the model at once
    stream_tokens: int  # tokens of the stream pass
    jacobian_tokens: int  # token positions whose block Jacobians are averaged
    jacobian_probes: int | None  # 0: exact; K >= 2: K Gaussian probes per token; None: exact up to d = 512
    removal_documents: int = 0  # documents of the held-out perplexity task in the removal sweep
    text_file: str | None = None  # the held-out text; None: the embedded held-out novel
    source: tuple[str, Path | None] | None = None  # the text as model_io.resolve_text_source names it (C4 or a
    # file), for next_token_loss removal; None: text_file
    removal: str = HELDOUT_SWEEP  # or NEXT_TOKEN_LOSS
    removal_tokens: int = 0  # next_token_loss: the first tokens of the stream's windows whose loss a removal changes
    text_tokens: int | None = None  # the Jacobians sample from the text's first text_tokens tokens (None: as far as
    # they need)
    batch_size: int = 8  # windows per forward pass of the stream
    eval_batch_size: int = 8  # lm-eval's batch size
    tokens_per_window: int = 8  # Jacobian positions sampled per window
    seed: int = 0  # of the Jacobian positions and probes


def text_source(settings: MeasureSettings) -> tuple[str, Path]:
    """The stream's and the Jacobians' text, as utils/instruments/model_io.resolve_text_source names it."""
    if settings.source is not None:
        return settings.source
    return "file", Path(settings.text_file) if settings.text_file else model_io.EMBEDDED_HELDOUT_TEXT


def measure_model(model, tokenizer, settings: MeasureSettings, desc: str = "") -> dict:
    """Every measure of the model (see the module docstring) as one dict: the stream pass's keys (num_tokens,
    angular, block_influence, variance, rms, update_ratio, lens_kl, lens_top1_agreement, prediction_depth_*),
    jacobian (one row per layer, as jacobian.csv and .json hold), jacobian_method, jacobian_tokens, the removal
    measure's keys (heldout_sweep: removal, the sweep's rows as layer_removal.json holds; next_token_loss:
    removal_baseline_nats, removal_cost and removal_tokens) and norm_gains."""
    if settings.removal not in (HELDOUT_SWEEP, NEXT_TOKEN_LOSS):
        raise ValueError(f"removal: {settings.removal!r} is not {HELDOUT_SWEEP!r} or {NEXT_TOKEN_LOSS!r}")
    source = text_source(settings)

    def windows(num_tokens: int):
        return model_io.token_windows(tokenizer, model_io.iter_documents(source), settings.max_seq_len, num_tokens)

    stream_windows = list(windows(settings.stream_tokens))
    measured = measure_stream(model, model_io.padded_batches(stream_windows, settings.batch_size,
                                                             tokenizer.pad_token_id),
                              sum(map(len, stream_windows)), desc=f"{desc}stream")
    if stream_is_a_running_sum(model):
        samples = sample_tokens(windows(settings.text_tokens or sys.maxsize), settings.jacobian_tokens,
                                settings.tokens_per_window, settings.seed)
        jacobian = measure_jacobians(model, samples, settings.jacobian_probes, settings.seed, heatmap=False,
                                     desc=f"{desc}jacobian")
        measured.update(jacobian=jacobian.rows, jacobian_method=jacobian.method, jacobian_tokens=jacobian.num_tokens)
    else:  # a block's Jacobian perturbs its input tensor, which AttnRes, mHC and SiameseNorm do not pass on
        measured.update(jacobian=[], jacobian_method=NO_BLOCK_JACOBIAN, jacobian_tokens=0)
    if settings.removal == HELDOUT_SWEEP:
        measured["removal"] = heldout_removal_sweep(model, tokenizer, settings.max_seq_len, settings.text_file,
                                                    settings.removal_documents, settings.eval_batch_size)
    else:
        removal_windows = list(windows(settings.removal_tokens))
        measured.update(measure_removal(model, list(model_io.padded_batches(
            removal_windows, settings.batch_size, tokenizer.pad_token_id)), desc=f"{desc}removal"),
            removal_tokens=sum(map(len, removal_windows)))
    measured["norm_gains"] = norm_gains(model.state_dict())
    return measured
