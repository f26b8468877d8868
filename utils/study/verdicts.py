"""Verdicts on the paper's claims that mean what they say: paired by seed, with an effect and its 95% interval.

A claim compares two arms, ``a`` and ``b`` (for example Pre-LN and LayerNorm Scaling), and says which way ``b - a``
should go (``expected_direction`` +1: b is larger, -1: b is smaller). The evidence is either

- per-seed values, ``{seed: value}`` for each arm (``judge_seeds``). A value that is None or not finite means that
  run diverged or failed. Arms are paired by seed: only seeds present and finite in both arms count, and every seed
  left out is reported with its reason. The effect is the mean over paired seeds of ``b - a`` (or of ``log(b / a)``
  when the claim is about a ratio), with a Student-t 95% interval on the paired differences. With 3 seeds a
  bootstrap interval would be degenerate (it can only resample 3 values, so it takes at most 10 distinct means and
  its percentiles collapse onto the observed extremes); the t interval is the honest small-sample choice, and with
  n = 2 it is wide, as it should be.
- per-document (or per-token) values of a single pair of models on the same documents (``judge_documents``): the
  effect is the mean paired difference with a percentile bootstrap interval over documents.

Statuses:

- ``reproduced``: the interval excludes 0 on the side the paper predicts;
- ``opposite``: the interval excludes 0 on the other side;
- ``inside noise``: the interval contains 0;
- ``not measurable``: fewer than 2 pairs (everything diverged, or the arms share fewer than 2 seeds), or paired
  differences that are all equal (a discrete measure such as k / L), whose t interval would have no width;
- ``not reproduced``: only from ``judge_layer_removal`` (and its per-document twin), when removing a deep layer helps
  both models (see there).

Pure Python and numpy: no torch, no plotting.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Hashable, Mapping, Sequence

import numpy as np

REPRODUCED = "reproduced"
OPPOSITE = "opposite"
INSIDE_NOISE = "inside noise"
NOT_MEASURABLE = "not measurable"
NOT_REPRODUCED = "not reproduced"
STATUSES = (REPRODUCED, OPPOSITE, INSIDE_NOISE, NOT_MEASURABLE, NOT_REPRODUCED)


# ----------------------------------------------------------------------------- pairing
@dataclass
class Pairing:
    """Values of two arms paired by seed. ``dropped`` maps every seed left out to the reason."""
    seeds: list
    a: np.ndarray
    b: np.ndarray
    dropped: dict = field(default_factory=dict)

    def dropped_text(self) -> str:
        return "; ".join(f"seed {seed}: {reason}" for seed, reason in self.dropped.items())


def _usable(value) -> bool:
    return value is not None and math.isfinite(float(value))


def pair_by_seed(a: Mapping[Hashable, float | None], b: Mapping[Hashable, float | None],
                 labels: tuple[str, str] = ("a", "b"), positive_only: bool = False) -> Pairing:
    """Pair two ``{seed: value}`` dicts by seed. A seed counts only when it is present and finite in both arms
    (and, with ``positive_only``, above 0 in both, as a log ratio needs)."""
    seeds, values_a, values_b, dropped = [], [], [], {}
    for seed in sorted(set(a) | set(b), key=lambda key: (str(type(key)), key)):
        reasons = []
        for label, arm in zip(labels, (a, b)):
            if seed not in arm:
                reasons.append(f"missing in {label}")
            elif not _usable(arm[seed]):
                reasons.append(f"diverged or failed in {label} (value {arm[seed]})")
            elif positive_only and float(arm[seed]) <= 0:
                reasons.append(f"{label} value {arm[seed]} is not positive (log ratio)")
        if reasons:
            dropped[seed] = ", ".join(reasons)
            continue
        seeds.append(seed)
        values_a.append(float(a[seed]))
        values_b.append(float(b[seed]))
    return Pairing(seeds, np.asarray(values_a, dtype=float), np.asarray(values_b, dtype=float), dropped)


# ----------------------------------------------------------------------------- intervals
def _t_two_sided_coverage(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with ``df`` degrees of freedom (closed form, Abramowitz & Stegun 26.7.3-4)."""
    theta = math.atan(t / math.sqrt(df))
    cos2 = math.cos(theta) ** 2
    if df % 2 == 1:
        series, term = 0.0, 1.0
        for k in range(1, (df - 1) // 2 + 1):  # 1 + 2/3 c^2 + (2*4)/(3*5) c^4 + ..., (df - 1) / 2 terms
            series += term
            term *= (2 * k) / (2 * k + 1) * cos2
        return 2.0 / math.pi * (theta + math.sin(theta) * math.cos(theta) * series)
    series, term = 0.0, 1.0
    for k in range(1, df // 2 + 1):  # 1 + 1/2 c^2 + (1*3)/(2*4) c^4 + ..., df / 2 terms
        series += term
        term *= (2 * k - 1) / (2 * k) * cos2
    return math.sin(theta) * series


def t_quantile(probability: float, df: int) -> float:
    """The ``probability`` quantile of Student's t (0.5 < probability < 1), found by bisection on the exact CDF."""
    if not 0.5 < probability < 1 or df < 1:
        raise ValueError(f"t_quantile needs 0.5 < probability < 1 and df >= 1, got {probability}, {df}")
    coverage = 2 * probability - 1
    low, high = 0.0, 1.0
    while _t_two_sided_coverage(high, df) < coverage:
        high *= 2
    for _ in range(200):
        middle = (low + high) / 2
        if _t_two_sided_coverage(middle, df) < coverage:
            low = middle
        else:
            high = middle
        if high - low < 1e-12 * max(1.0, high):
            break
    return (low + high) / 2


def paired_t_interval(differences: Sequence[float], alpha: float = 0.05) -> tuple[float, float, float]:
    """(mean, low, high): the Student-t 1 - alpha interval of the mean of paired differences; needs n >= 2."""
    values = np.asarray(differences, dtype=float)
    if values.size < 2:
        raise ValueError(f"a t interval needs at least 2 paired values, got {values.size}")
    mean = float(values.mean())
    half_width = t_quantile(1 - alpha / 2, values.size - 1) * float(values.std(ddof=1)) / math.sqrt(values.size)
    return mean, mean - half_width, mean + half_width


def bootstrap_mean_ci(values: Sequence[float], n_boot: int = 10000, alpha: float = 0.05,
                      seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): the percentile bootstrap 1 - alpha interval of the mean, for large samples (documents,
    tokens). Resamples in chunks so that memory stays bounded whatever the sample size."""
    data = np.asarray(values, dtype=float)
    if data.size < 2:
        raise ValueError(f"a bootstrap interval needs at least 2 values, got {data.size}")
    if not np.all(np.isfinite(data)):
        raise ValueError("bootstrap_mean_ci: the values contain NaN or infinity")
    rng = np.random.default_rng(seed)
    means = np.empty(n_boot)
    chunk = max(1, 2_000_000 // data.size)
    for start in range(0, n_boot, chunk):
        stop = min(n_boot, start + chunk)
        means[start:stop] = data[rng.integers(0, data.size, size=(stop - start, data.size))].mean(axis=1)
    low, high = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    return float(data.mean()), float(low), float(high)


def paired_bootstrap_ci(a: Sequence[float], b: Sequence[float], n_boot: int = 10000, alpha: float = 0.05,
                        seed: int = 0, log_ratio: bool = False) -> tuple[float, float, float]:
    """(mean, low, high) of b - a (or log(b / a)) over values of two models on the same documents, in order."""
    values_a, values_b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if values_a.shape != values_b.shape:
        raise ValueError(f"per-document values must align: {values_a.shape} vs {values_b.shape}")
    return bootstrap_mean_ci(_differences(values_a, values_b, log_ratio), n_boot, alpha, seed)


def _differences(a: np.ndarray, b: np.ndarray, log_ratio: bool) -> np.ndarray:
    return np.log(b / a) if log_ratio else b - a


# ----------------------------------------------------------------------------- verdicts
def status_for(expected_direction: int, low: float, high: float) -> str:
    """reproduced / opposite / inside noise, from the interval of b - a and the direction the paper predicts."""
    if low > 0 or high < 0:
        return REPRODUCED if (low > 0) == (expected_direction > 0) else OPPOSITE
    return INSIDE_NOISE


def _check_direction(expected_direction: int) -> None:
    if expected_direction not in (1, -1):
        raise ValueError(f"expected_direction must be +1 (b > a) or -1 (b < a), got {expected_direction!r}")


@dataclass
class Verdict:
    """One claim, judged. ``effect``, ``low`` and ``high`` are on the scale named by ``scale`` ("difference": b - a;
    "log ratio": log(b / a)); ``n_agree`` counts the pairs whose own sign matches the claim's direction."""
    claim: str
    expected_direction: int
    effect: float | None
    low: float | None
    high: float | None
    n_pairs: int
    status: str
    reason: str
    n_agree: int = 0
    unit: str = "seeds"
    scale: str = "difference"
    dropped: dict = field(default_factory=dict)

    def line(self) -> str:
        """'claim: STATUS — effect +0.123 [95% CI +0.050, +0.200], 3/3 seeds in the claimed direction' (+ reason)."""
        if self.effect is None:
            return f"{self.claim}: {self.status.upper()} — {self.reason}"
        name = "log ratio" if self.scale == "log ratio" else "effect"
        text = (f"{self.claim}: {self.status.upper()} — {name} {self.effect:+.4g} "
                f"[95% CI {self.low:+.4g}, {self.high:+.4g}]")
        if self.scale == "log ratio":
            text += f" (ratio x{math.exp(self.effect):.3g} [{math.exp(self.low):.3g}, {math.exp(self.high):.3g}])"
        text += f", {self.n_agree}/{self.n_pairs} {self.unit} in the claimed direction"
        if self.reason:
            text += f"; {self.reason}"
        return text

    def as_dict(self) -> dict:
        return dict(claim=self.claim, expected_direction=self.expected_direction, effect=self.effect, low=self.low,
                    high=self.high, n_pairs=self.n_pairs, n_agree=self.n_agree, status=self.status,
                    reason=self.reason, unit=self.unit, scale=self.scale,
                    dropped={str(key): value for key, value in self.dropped.items()})


def judge_seeds(claim: str, expected_direction: int, a: Mapping[Hashable, float | None],
                b: Mapping[Hashable, float | None], labels: tuple[str, str] = ("a", "b"), log_ratio: bool = False,
                alpha: float = 0.05) -> Verdict:
    """Judge a claim about ``b - a`` (or ``log(b / a)``) from per-seed values paired by seed."""
    _check_direction(expected_direction)
    pairing = pair_by_seed(a, b, labels, positive_only=log_ratio)
    scale = "log ratio" if log_ratio else "difference"
    dropped_note = f"dropped {pairing.dropped_text()}" if pairing.dropped else ""
    dropped_suffix = f" ({dropped_note})" if dropped_note else ""
    if len(pairing.seeds) < 2:
        reason = (f"only {len(pairing.seeds)} seed(s) finished in both {labels[0]} and {labels[1]}; at least 2 "
                  "paired seeds are needed") + dropped_suffix
        return Verdict(claim, expected_direction, None, None, None, len(pairing.seeds), NOT_MEASURABLE, reason,
                       scale=scale, dropped=pairing.dropped)
    differences = _differences(pairing.a, pairing.b, log_ratio)
    n_agree = int(np.sum(np.sign(differences) == expected_direction))
    if np.ptp(differences) <= 1e-9 * np.abs(differences).max():  # a stepped measure (k / L) can agree exactly
        reason = (f"the {differences.size} seeds agree exactly ({differences[0]:+.4g} each), so the t interval "
                  "has no width; a discrete measure's equal steps are not evidence beyond noise") + dropped_suffix
        return Verdict(claim, expected_direction, None, None, None, len(differences), NOT_MEASURABLE, reason,
                       n_agree, "seeds", scale, pairing.dropped)
    effect, low, high = paired_t_interval(differences, alpha)
    return Verdict(claim, expected_direction, effect, low, high, len(differences),
                   status_for(expected_direction, low, high), dropped_note, n_agree, "seeds", scale, pairing.dropped)


def judge_documents(claim: str, expected_direction: int, a: Sequence[float], b: Sequence[float],
                    log_ratio: bool = False, alpha: float = 0.05, n_boot: int = 10000, seed: int = 0,
                    unit: str = "documents") -> Verdict:
    """Judge a claim about one pair of models from their per-document (or per-token) values on the same documents,
    in the same order, with a percentile bootstrap interval over documents. Documents where either value is not
    finite (or, for a log ratio, not positive) are left out and counted in the reason."""
    _check_direction(expected_direction)
    values_a, values_b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if values_a.shape != values_b.shape or values_a.ndim != 1:
        raise ValueError(f"per-document values must be two aligned 1-D sequences: {values_a.shape} vs {values_b.shape}")
    keep = np.isfinite(values_a) & np.isfinite(values_b)
    if log_ratio:
        keep &= (values_a > 0) & (values_b > 0)
    left_out = int(values_a.size - keep.sum())
    reason = f"{left_out} of {values_a.size} {unit} left out (not finite{' or not positive' if log_ratio else ''})" \
        if left_out else ""
    scale = "log ratio" if log_ratio else "difference"
    if keep.sum() < 2:
        return Verdict(claim, expected_direction, None, None, None, int(keep.sum()), NOT_MEASURABLE,
                       f"fewer than 2 usable {unit}" + (f"; {reason}" if reason else ""), unit=unit, scale=scale)
    effect, low, high = paired_bootstrap_ci(values_a[keep], values_b[keep], n_boot, alpha, seed, log_ratio)
    differences = _differences(values_a[keep], values_b[keep], log_ratio)
    return Verdict(claim, expected_direction, effect, low, high, int(keep.sum()),
                   status_for(expected_direction, low, high), reason,
                   int(np.sum(np.sign(differences) == expected_direction)), unit, scale)


def judge_layer_removal(claim: str, pre_drops: Mapping[Hashable, float | None],
                        lns_drops: Mapping[Hashable, float | None], labels: tuple[str, str] = ("Pre-LN", "LNS"),
                        alpha: float = 0.05) -> Verdict:
    """The paper: removing a deep Pre-LN layer costs less than removing a deep LNS layer (drop > 0 means removal
    hurts, e.g. the relative perplexity increase). Judged as ``lns - pre > 0`` over seeds paired by seed, except that
    when the mean drop is negative for BOTH models (removing a deep layer helps either one), the claim is
    ``not reproduced`` whatever their order: neither model relies on its deep layers, so the order says nothing."""
    verdict = judge_seeds(claim, +1, pre_drops, lns_drops, labels)
    if verdict.status == NOT_MEASURABLE:
        return verdict
    pairing = pair_by_seed(pre_drops, lns_drops, labels)
    return _unordered_when_removal_helps_both(verdict, float(pairing.a.mean()), float(pairing.b.mean()), labels)


def judge_layer_removal_documents(claim: str, pre_drops: Sequence[float], lns_drops: Sequence[float],
                                  labels: tuple[str, str] = ("Pre-LN", "LNS"), **bootstrap) -> Verdict:
    """judge_layer_removal for a single pair of models: per-document drops on the same documents, a bootstrap
    interval over documents, and the same rule when removal helps both models on average."""
    verdict = judge_documents(claim, +1, pre_drops, lns_drops, **bootstrap)
    if verdict.status == NOT_MEASURABLE:
        return verdict
    pre, lns = np.asarray(pre_drops, dtype=float), np.asarray(lns_drops, dtype=float)
    keep = np.isfinite(pre) & np.isfinite(lns)
    return _unordered_when_removal_helps_both(verdict, float(pre[keep].mean()), float(lns[keep].mean()), labels)


def _unordered_when_removal_helps_both(verdict: Verdict, mean_pre: float, mean_lns: float,
                                       labels: tuple[str, str]) -> Verdict:
    if mean_pre < 0 and mean_lns < 0:
        verdict.status = NOT_REPRODUCED
        note = (f"removing a deep layer helps both models (mean drop {labels[0]} {mean_pre:+.4g}, "
                f"{labels[1]} {mean_lns:+.4g}), so their order says nothing about the claim")
        verdict.reason = f"{note}; {verdict.reason}" if verdict.reason else note
    return verdict
