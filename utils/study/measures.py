"""The scalar measures a record's analyses are summarised into, and their values per arm and seed."""
from __future__ import annotations

import math

import numpy as np

# A layer counts as "cheap to remove" when removing it raises held-out perplexity by less than 1% (0.00995 nats).
CHEAP_REMOVAL_NATS = math.log(1.01)


def deep_half(values: list) -> list[float]:
    """The deeper half of per-layer values (layers L//2 .. L-1), finite ones only."""
    tail = values[len(values) // 2:]
    return [float(v) for v in tail if v is not None and math.isfinite(v)]


def variance_growth(variance: list[float]) -> float:
    """The stream's variance growth over the deeper half of the layers: the last layer's output variance over the
    variance leaving layer L // 2. Both ends lie past the first blocks, whose jumps vary from run to run (a first
    block that barely moves the stream makes last / first read in the thousands while its successor makes the
    jump), and the deeper half is where the paper places the curse of depth."""
    middle = (len(variance) - 1) // 2
    return variance[-1] / variance[middle] if middle >= 1 and variance[middle] > 0 else float("nan")


def variance_growth_from_first(variance: list[float]) -> float:
    """The older measure, kept beside it: the last layer's output variance over the first layer's."""
    return variance[-1] / variance[1] if len(variance) > 2 and variance[1] > 0 else float("nan")


def summarise_analysis(analysis: dict) -> dict:
    """The scalar measures of one analysed checkpoint."""
    variance = analysis["variance"]
    removal = analysis["removal_nats"]
    gains = analysis["norm_gains"]["per_layer"]
    return dict(
        variance_growth=variance_growth(variance),
        variance_growth_from_first=variance_growth_from_first(variance),
        angular_deep=float(np.mean(deep_half(analysis["angular_next"]) or [float("nan")])),
        removal_deep=float(np.mean(deep_half(removal))),
        cheap_removal_fraction=float(np.mean([v < CHEAP_REMOVAL_NATS for v in removal])),
        # no rows where block Jacobians are not defined (AttnRes, mHC, SiameseNorm)
        jacobian_deep=float(np.mean(deep_half(analysis["jacobian_rel_identity_dev"]) or [float("nan")])),
        norm_gain_mean=float(np.mean(gains)) if gains else float("nan"),
        bi_deep=float(np.mean(deep_half(analysis["block_influence"]) or [float("nan")]))
        if "block_influence" in analysis else float("nan"),
        # Entry l - 1 of lens_kl is the stream after layer l, so the deep half ends with the final layer's 0, as in
        # utils/depth_report.py's lens_kl_deep.
        lens_kl_deep=float(np.mean(deep_half(analysis["lens_kl"]) or [float("nan")]))
        if "lens_kl" in analysis else float("nan"),
        relative_prediction_depth=analysis["prediction_depth_mean"] / len(analysis["lens_kl"])
        if "lens_kl" in analysis else float("nan"),
    )


def document_measures(record: dict) -> dict | None:
    """Per-document values at the last analysed step, or None for a run analysed without them:
    heldout_nats, the held-out loss per document (nats/word), and removal_deep, per document the mean loss rise
    over the deeper half of the layers."""
    analyses = record.get("analyses") or {}
    if not analyses or record.get("status") != "finished":
        return None
    analysis = analyses[str(max(int(s) for s in analyses))]
    if "removal_document_costs" not in analysis:
        return None
    deep = analysis["removal_document_costs"][len(analysis["removal_document_costs"]) // 2:]
    return dict(heldout_nats=analysis["removal_document_nats"],
                removal_deep=[float(np.mean(per_layer)) for per_layer in zip(*deep)] if deep else [])


MEASURES = {
    "eval_loss": "eval loss (nats/token)",
    "variance_growth": "variance growth over the deeper half, last layer / layer L/2",
    "variance_growth_from_first": "variance growth, last layer / first (the older measure)",
    "angular_deep": "deep-half angular distance d(l, l+1)/pi",
    "removal_deep": "deep-half removal cost (nats/word)",
    "cheap_removal_fraction": "fraction of layers with removal cost < 1% ppl",
    "jacobian_deep": "deep-half ‖J − I‖_F / √d",
    "norm_gain_mean": "mean norm gain (all layers)",
    "bi_deep": "deep-half block influence 1 − cos(h_l, h_l+1)",
    "lens_kl_deep": "deep-half logit-lens KL from the final distribution (nats)",
    "relative_prediction_depth": "mean prediction depth / L (logit lens)",
}

# ratios that span orders of magnitude: plotted on a log scale, and fitted as ln(growth) against ln of a swept value
GROWTH_MEASURES = ("variance_growth", "variance_growth_from_first")
# records analysed before a measure existed lack it
LATER_MEASURES = ("bi_deep", "lens_kl_deep", "relative_prediction_depth")


def measures_in(records: dict[str, dict]) -> dict[str, str]:
    """MEASURES, less the later ones that no record has, so that no table, plot or verdict shows a measure that
    none of its runs took."""
    found = [measures_at(r) for r in records.values() if r.get("status") == "finished"]
    return {m: title for m, title in MEASURES.items()
            if m not in LATER_MEASURES or any(finite_or_none(f.get(m)) is not None for f in found)}


def measures_at(record: dict, step: int | None = None) -> dict:
    """Every scalar measure of a record at an analysed step (default: its last analysed step)."""
    analyses = record.get("analyses") or {}
    if not analyses:
        return dict(eval_loss=record.get("final_eval_loss"))
    step = step if step is not None else max(int(s) for s in analyses)
    evals = dict((int(s), loss) for s, loss in record.get("eval_curve", []))
    return dict(summarise_analysis(analyses[str(step)]), eval_loss=evals.get(step))


def finite_or_none(value):
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def by_seed(records: dict[str, dict], arm: str, measure: str, step: int | None = None) -> dict[int, float | None]:
    """{seed: value} of one measure for one arm; a diverged run gives None (the verdicts drop its pair)."""
    values = {}
    for record in records.values():
        if record["arm"] != arm:
            continue
        if record["status"] != "finished":
            values[record["seed"]] = None
            continue
        values[record["seed"]] = finite_or_none(measures_at(record, step).get(measure))
    return values
