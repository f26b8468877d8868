"""What a depth sweep's records say, LNS against Pre-LN: the paper's predictions as slopes against ln L, the
comparative verdicts (the gap and the ratio of each deep-layer measure against ln L), the regime (does depth pay?),
and each rival against both arms. utils/depth_sweep.py trains the runs and writes these into its report."""
from __future__ import annotations

import dataclasses

import numpy as np

from peft_pretraining.model.modeling_llama import PLACEMENTS
from utils.study import claims, measures, runs, verdicts
from utils.study.sweep import (
    NORMS,
    RIVAL_NORMS,
    Axis,
    measure_by_value,
    nonpositive_pairs,
    paired_differences,
    slope_by_seed,
    slope_verdict,
    with_evidence,
)

PREDICTIONS = [
    # (the paper's prediction, norm type, measure, expected sign of d(measure)/d(ln L), log-transform the measure)
    ("Pre-LN's variance growth rises with depth", "pre", "variance_growth", +1, True),
    ("Pre-LN's deep layers become more similar to their successor with depth", "pre", "angular_deep", -1, False),
    ("Pre-LN's deep blocks move toward the identity with depth", "pre", "jacobian_deep", -1, False),
    ("Removing a deep Pre-LN layer costs less with depth", "pre", "removal_deep", -1, False),
    ("More Pre-LN layers are cheap to remove with depth", "pre", "cheap_removal_fraction", +1, False),
    ("Pre-LN's deep layers change the stream less with depth (block influence)", "pre", "bi_deep", -1, False),
]
# The paper's mechanism claim is comparative: as models deepen, Pre-LN's deep layers become less effective *than
# LNS's*. Per deep-layer measure, the direction in which LNS − Pre-LN (and ln(LNS / Pre-LN)) should move with ln L:
# +1 where a larger value means a more active deep layer (a later-settling logit lens among them), -1 for the
# variance growth and the cheap-to-remove fraction.
COMPARATIVE = {"variance_growth": -1, "angular_deep": +1, "jacobian_deep": +1, "removal_deep": +1,
               "cheap_removal_fraction": -1, "bi_deep": +1, "lens_kl_deep": +1, "relative_prediction_depth": +1}

def measure_slope_verdicts(axis: Axis, records, predictions) -> list[verdicts.Verdict]:
    """Per prediction (claim, norm, measure, direction, log), the per-seed slopes of the measure against ln of the
    swept value, judged against zero."""
    return [with_evidence(slope_verdict(f"{claim} (slope of {'ln ' if log_values else ''}the measure vs ln "
                                        f"{axis.symbol})", direction,
                                        slope_by_seed(measure_by_value(axis, records, norm, measure), log_values)),
                          axis.values, axis.symbol)
            for claim, norm, measure, direction, log_values in predictions]


def measured_for(axis: Axis, records, norm: str) -> dict[str, str]:
    """The measures that a norm type's own runs took: block influence only in records analysed since it was added,
    so a prediction about Pre-LN is left out while only the rivals' records have it."""
    arms = {axis.arm(value, norm) for value in axis.values}
    return measures.measures_in({name: r for name, r in records.items() if r.get("arm") in arms})


def measured_predictions(axis: Axis, records) -> list[tuple]:
    return [p for p in PREDICTIONS if p[2] in measured_for(axis, records, p[1])]


def depth_verdicts(axis: Axis, records) -> list[verdicts.Verdict]:
    """Each Pre-LN prediction the records measured, as the per-seed slope of its measure against ln L, then the slope
    of LNS's advantage in eval loss."""
    gap = {depth: {seed: -difference for seed, difference in per_seed.items()}  # Pre-LN − LNS: the advantage
           for depth, per_seed in paired_differences(axis, records, "eval_loss").items()}
    return [*measure_slope_verdicts(axis, records, measured_predictions(axis, records)),
            with_evidence(slope_verdict("LNS's advantage (Pre-LN − LNS eval loss) grows with depth (slope vs ln L)",
                                        +1, slope_by_seed(gap, False)), axis.values)]


def lns_own_slopes(axis: Axis, records) -> dict[str, verdicts.Verdict]:
    """Per measure of a Pre-LN prediction, LNS's own slope of it, judged in the same direction: a Pre-LN-only slope
    is not the paper's claim when LNS's own slope goes the same way."""
    lns_measures = measured_for(axis, records, "lns")
    return {measure: with_evidence(slope_verdict(f"LNS's own slope of {'ln ' if log_values else ''}the same measure",
                                                 direction, slope_by_seed(measure_by_value(axis, records, "lns",
                                                                                           measure), log_values)),
                                   axis.values, axis.symbol)
            for _, _, measure, direction, log_values in measured_predictions(axis, records)
            if measure in lns_measures}


def prediction_lines(axis: Axis, records, predictions: list[verdicts.Verdict], own: dict) -> str:
    """The Pre-LN verdicts (depth_verdicts, in measured_predictions' order, then the loss gap's), each with LNS's
    own slope of the same measure under it."""
    predicted = [measure for _, _, measure, _, _ in measured_predictions(axis, records)]
    lines = []
    for index, verdict in enumerate(predictions):
        lines.append("- " + verdict.line())
        if index < len(predicted) and predicted[index] in own:
            lines.append("  - " + own[predicted[index]].line())
    return "\n".join(lines)


@dataclasses.dataclass
class Comparison:
    """One deep-layer measure judged comparatively: the slope against ln of the swept value of the paired gap
    LNS − Pre-LN, and of the log ratio ln(LNS / Pre-LN), per seed, with 95% t intervals over seeds."""
    measure: str
    gap: verdicts.Verdict
    ratio: verdicts.Verdict

    def reading(self) -> str:
        """Which reading the two slopes support, in words. "The paper's way" is the measure's expected direction; it
        says nothing of which arm is ahead (LNS may trail Pre-LN at every depth while the gap narrows)."""
        gap, ratio = self.gap.status, self.ratio.status
        if verdicts.NOT_MEASURABLE in (gap, ratio):
            return "not measurable"
        if (gap, ratio) == (verdicts.REPRODUCED, verdicts.REPRODUCED):
            return "the gap and the ratio both move the paper's way with depth"
        if gap == verdicts.REPRODUCED and ratio == verdicts.OPPOSITE:
            return ("the gap moves the paper's way but the ratio moves against it: the paper's reading holds in "
                    "absolute terms only, and in relative terms LNS moves away from it")
        if gap == verdicts.REPRODUCED:
            return "the gap moves the paper's way; the ratio's slope is inside noise, so the relative change is open"
        if ratio == verdicts.REPRODUCED:
            return ("the ratio moves the paper's way; the gap's slope "
                    f"{'moves against it' if gap == verdicts.OPPOSITE else 'is inside noise'}")
        if (gap, ratio) == (verdicts.OPPOSITE, verdicts.OPPOSITE):
            return "the gap and the ratio both move against the paper"
        if verdicts.OPPOSITE in (gap, ratio):
            return f"the {'gap' if gap == verdicts.OPPOSITE else 'ratio'} moves against the paper, the other is " \
                   "inside noise"
        return "neither the gap's nor the ratio's slope excludes zero"

    def as_dict(self) -> dict:
        return dict(measure=self.measure, gap=self.gap.as_dict(), ratio=self.ratio.as_dict(), reading=self.reading())


def comparative_verdicts(axis: Axis, records) -> list[Comparison]:
    """The primary depth verdicts: per deep-layer measure both arms took, the slopes against ln of the swept value
    of the paired gap and of the log ratio. A measure only one arm took is reported as not measurable."""
    pre, lns = measured_for(axis, records, "pre"), measured_for(axis, records, "lns")
    found = []
    for measure, direction in COMPARATIVE.items():
        if measure not in pre and measure not in lns:
            continue
        name = measures.MEASURES[measure]
        gap_claim = f"LNS − Pre-LN in {name}: slope vs ln {axis.symbol}"
        ratio_claim = f"ln(LNS / Pre-LN) in {name}: slope vs ln {axis.symbol}"
        if measure not in pre or measure not in lns:
            lacking = "LNS's" if measure not in lns else "Pre-LN's"
            reason = f"{lacking} records predate this measure, so there is no pair to compare"
            found.append(Comparison(measure, *(verdicts.Verdict(claim, direction, None, None, None, 0,
                                                                verdicts.NOT_MEASURABLE, reason)
                                               for claim in (gap_claim, ratio_claim))))
            continue
        ratio = with_evidence(slope_verdict(ratio_claim, direction, slope_by_seed(
            paired_differences(axis, records, measure, log_ratio=True), False)), axis.values, axis.symbol)
        left_out = nonpositive_pairs(axis, records, measure)
        if left_out:
            note = ("the log ratio leaves out the pairs where a value is 0 or below (" + "; ".join(
                f"{axis.symbol} = {value}: seed{'s' * (len(seeds) > 1)} {', '.join(map(str, seeds))}"
                for value, seeds in left_out.items())
                + ")")
            ratio.reason = f"{ratio.reason}; {note}" if ratio.reason else note
        found.append(Comparison(
            measure,
            with_evidence(slope_verdict(gap_claim, direction,
                                        slope_by_seed(paired_differences(axis, records, measure), False)),
                          axis.values, axis.symbol),
            ratio))
    return found


def one_seed_slopes(axis: Axis, records, comparisons: list[Comparison]) -> list[dict]:
    """When no comparison has two seeds (a pilot): per measure and seed, that seed's own slopes of the gap
    and of the log ratio against ln of the swept value, over the values it has. No interval: a sign at one seed."""
    if any(c.gap.n_pairs >= 2 or c.ratio.n_pairs >= 2 for c in comparisons):
        return []
    found = []
    for c in comparisons:
        gaps = paired_differences(axis, records, c.measure)
        gap_slopes = slope_by_seed(gaps, False)
        ratio_slopes = slope_by_seed(paired_differences(axis, records, c.measure, log_ratio=True), False)
        for seed, gap in gap_slopes.items():
            if gap is None:
                continue
            ratio = ratio_slopes.get(seed)
            found.append(dict(measure=c.measure, seed=seed, values=[v for v in axis.values if seed in gaps[v]],
                              gap_slope=gap, ratio_slope=ratio, expected_direction=c.gap.expected_direction))
    return found


def one_seed_text(axis: Axis, slopes: list[dict]) -> str:
    """one_seed_slopes as a table, each slope's sign read against the paper's direction."""
    def way(slope: float | None, direction: int) -> str:
        if slope is None:
            return "n/a"
        reading = "the paper's way" if slope * direction > 0 else "against" if slope else "flat"
        return f"{slope:+.4g} ({reading})"

    rows = [f"| measure | seed | {axis.symbol} | slope of the gap | slope of ln(LNS / Pre-LN) |",
            "|---|---|---|---|---|"]
    rows += [f"| {measures.MEASURES[s['measure']]} | {s['seed']} | {', '.join(map(str, s['values']))} | "
             f"{way(s['gap_slope'], s['expected_direction'])} | {way(s['ratio_slope'], s['expected_direction'])} |"
             for s in slopes]
    return ("\n\nWith one seed there is no interval. Each seed's own slopes against ln "
            f"{axis.symbol}, over the values it has, and which way each moves (the paper's way or against it): a "
            "sign at one seed, not a verdict.\n\n" + "\n".join(rows))


def comparative_section(comparisons: list[Comparison]) -> str:
    rows = ["| measure | slope of the gap LNS − Pre-LN | slope of ln(LNS / Pre-LN) | which reading |",
            "|---|---|---|---|"]
    for c in comparisons:
        cells = [measures.MEASURES[c.measure]]
        for v in (c.gap, c.ratio):
            cells.append(v.status if v.effect is None else
                         f"{v.effect:+.4g} [{v.low:+.4g}, {v.high:+.4g}], {v.n_agree}/{v.n_pairs} seeds: {v.status}")
        rows.append("| " + " | ".join([*cells, c.reading()]) + " |")
    notes = []
    for c in comparisons:
        if c.gap.effect is None:
            notes.append(f"- {measures.MEASURES[c.measure]}: {c.gap.reason}")
            continue
        notes += [f"- {measures.MEASURES[c.measure]}, {kind}: {v.reason}" for kind, v in (("gap", c.gap),
                                                                                         ("ratio", c.ratio))
                  if v.reason]
    return "\n".join(rows + ([""] + notes if notes else []))


def arm_loss_verdicts(axis: Axis, records) -> dict[str, verdicts.Verdict]:
    """Per arm, does adding layers lower the eval loss? The per-seed slope of the eval loss against ln of the swept
    value, judged against zero (direction -1: depth helps)."""
    return {norm: with_evidence(slope_verdict(f"{label}'s eval loss falls with {axis.noun} (slope vs ln "
                                              f"{axis.symbol})", -1,
                                              slope_by_seed(measure_by_value(axis, records, norm, "eval_loss"), False)),
                                axis.values, axis.symbol)
            for norm, label in NORMS.items()}


def step_verdicts(axis: Axis, records) -> list[verdicts.Verdict]:
    """Per arm, each step between consecutive swept values, paired by seed: does the larger value reach a lower eval
    loss? The slope against ln of the value weighs the end points most (with three values evenly spaced in ln, as
    6, 12, 24, the middle one not at all), so the steps show where depth stops paying."""
    s = axis.symbol
    return [verdicts.judge_seeds(f"{label}: {s}={b} reaches a lower eval loss than {s}={a} ({s}={b} − {s}={a})", -1,
                                 measures.by_seed(records, axis.arm(a, norm), "eval_loss"),
                                 measures.by_seed(records, axis.arm(b, norm), "eval_loss"), (f"{s}={a}", f"{s}={b}"))
            for norm, label in NORMS.items() for a, b in zip(axis.values, axis.values[1:])]


def heldout_text(settings: dict) -> str:
    """The analyses' held-out text, in words."""
    dataset = settings.get("dataset", runs.DEFAULT_DATASET)
    return "the held-out novel" if dataset == runs.DEFAULT_DATASET else f"the held-out {dataset.capitalize()} articles"


def document_verdicts(axis: Axis, records) -> list[verdicts.Verdict]:
    """Each arm between consecutive recorded depths, and LNS against Pre-LN at each depth, judged on the held-out
    documents every run's analysis reads, for the pairs of runs that share exactly one seed (see regime)."""
    s = axis.symbol
    pairs = []
    for norm, label in NORMS.items():
        recorded = [v for v in axis.values
                    if any(x is not None for x in measures.by_seed(records, axis.arm(v, norm), "eval_loss").values())]
        pairs += [(axis.arm(a, norm), axis.arm(b, norm),
                   f"{label}: {s}={b} reaches a lower held-out loss than {s}={a} ({s}={b} − {s}={a})")
                  for a, b in zip(recorded, recorded[1:])]
    pairs += [(axis.arm(v, "pre"), axis.arm(v, "lns"),
               f"{s}={v}: LNS reaches a lower held-out loss than Pre-LN (LNS − Pre-LN)") for v in axis.values]
    found = []
    for a, b, claim in pairs:
        documents = claims.one_shared_seed_documents(records, a, b)
        if documents is not None:
            verdict = verdicts.judge_documents(claim, -1, documents[0]["heldout_nats"], documents[1]["heldout_nats"])
            found.append(claims.documents_note(verdict, "the loss per word (nats; not the trainer's eval loss)"))
    return found


def regime(axis: Axis, records, heldout: str) -> tuple[str, dict]:
    """The regime the sweep lives in, in words and as a table: eval loss against the swept value per arm (mean
    [95% t interval] over seeds), where each arm's loss is lowest, and the slope verdicts of arm_loss_verdicts.
    When neither arm's slope is measurable (one seed, as in a pilot), also the comparisons of document_verdicts."""
    slopes = arm_loss_verdicts(axis, records)
    header = "| arm | " + " | ".join(f"{axis.symbol} = {v}" for v in axis.values) + " | lowest at | slope vs ln " \
        f"{axis.symbol} |\n|---|" + "---|" * (len(axis.values) + 2)
    rows, lowest = [], {}
    for norm, label in NORMS.items():
        cells, means = [label], {}
        for value in axis.values:
            vals = [v for v in measures.by_seed(records, axis.arm(value, norm), "eval_loss").values() if v is not None]
            if len(vals) >= 2:
                mean, low, high = verdicts.paired_t_interval(vals)
                cells.append(f"{mean:.3f} [{low:.3f}, {high:.3f}]")
            else:
                cells.append(f"{vals[0]:.3f}" if vals else "n/a")
            if vals:
                means[value] = float(np.mean(vals))
        lowest[norm] = min(means, key=means.get) if means else None
        v = slopes[norm]
        cells += [f"{axis.symbol} = {lowest[norm]}" if lowest[norm] else "n/a",
                  v.status if v.effect is None else f"{v.effect:+.3f} [{v.low:+.3f}, {v.high:+.3f}]: {v.status}"]
        rows.append("| " + " | ".join(cells) + " |")
    helps = {norm: v.status for norm, v in slopes.items()}
    unjudged = all(v.n_pairs < 2 for v in slopes.values())
    if all(status == verdicts.REPRODUCED for status in helps.values()):
        words = ("**Depth pays here**: adding layers lowers both arms' eval loss, the regime of the paper's models.")
    elif all(status == verdicts.OPPOSITE for status in helps.values()):
        words = ("**Depth does not pay here**: adding layers raises both arms' eval loss, the opposite of the "
                 "regime of the paper's models (where a deeper model reaches a lower loss). A deep layer that the "
                 "loss does not need may be near the identity for reasons unrelated to the curse of depth, so every "
                 "conclusion of this report holds for this regime only.")
    elif unjudged:
        words = (f"**Not judged over seeds**: a slope of the eval loss against ln {axis.symbol} needs two seeds at "
                 "two values or more.")
    else:
        words = ("**Mixed regime**: adding layers does not move both arms' eval loss the same way beyond noise ("
                 + "; ".join(f"{NORMS[n]}: {status}" for n, status in helps.items()) + "), so the regime of the "
                 "paper's models (more depth, lower loss) is not shown here.")
    summary = dict(slopes={norm: v.as_dict() for norm, v in slopes.items()}, lowest_at=lowest,
                   depth_pays={norm: status == verdicts.REPRODUCED for norm, status in helps.items()})
    text = words + "\n\n" + "\n".join([header, *rows])
    if unjudged:
        documents = document_verdicts(axis, records)
        if documents:
            text += (f"\n\nWith one seed per run, the runs are compared on the same held-out documents ({heldout}, "
                     "whole documents that every run's removal analysis reads at its last checkpoint):\n\n"
                     + "\n".join(f"- {v.line()}" for v in documents))
            summary["documents"] = [v.as_dict() for v in documents]
    else:
        steps = step_verdicts(axis, records)
        text += ("\n\nEach step, paired by seed (eval loss; the slope weighs the end points most, so a step can "
                 "disagree with it):\n\n" + "\n".join(f"- {v.line()}" for v in steps))
        summary["steps"] = [v.as_dict() for v in steps]
    return text, summary


def gap_verdicts(axis: Axis, records) -> list[verdicts.Verdict]:
    return [verdicts.judge_seeds(f"{axis.symbol}={value}: LNS reaches a lower eval loss than Pre-LN (LNS − Pre-LN)",
                                 -1, measures.by_seed(records, axis.arm(value, "pre"), "eval_loss"),
                                 measures.by_seed(records, axis.arm(value, "lns"), "eval_loss"), ("Pre-LN", "LNS"))
            for value in axis.values]


def rival_verdicts(axis: Axis, records, s: dict) -> list[verdicts.Verdict]:
    """At each rival depth, each rival against Pre-LN and LNS in eval loss, and against Pre-LN in how far its deep
    blocks stay from the identity (the fixes' claim: farther than Pre-LN's; by block influence where the stream is
    not a running sum), paired by seed."""
    found = []
    for depth in (d for d in s.get("rival_depths", ()) if d in s["depths"]):
        for norm in s.get("rival_norms", ()):
            label, rival = RIVAL_NORMS[norm], axis.arm(depth, norm)
            for baseline in ("pre", "lns"):
                found.append(verdicts.judge_seeds(
                    f"L={depth}: {label} reaches a lower eval loss than {NORMS[baseline]} "
                    f"({label} − {NORMS[baseline]})", -1,
                    measures.by_seed(records, axis.arm(depth, baseline), "eval_loss"),
                    measures.by_seed(records, rival, "eval_loss"), (NORMS[baseline], label)))
            # A block Jacobian needs a running-sum stream; AttnRes and mHC's blocks are judged by block influence
            claim, measure = ((f"stay farther from the identity than Pre-LN's ({label} − Pre-LN deep ‖J − I‖/√d)",
                               "jacobian_deep") if PLACEMENTS[norm].stream is None else
                              (f"change the stream more than Pre-LN's ({label} − Pre-LN deep block influence)",
                               "bi_deep"))
            pre = measures.by_seed(records, axis.arm(depth, "pre"), measure)
            found.append(verdicts.judge_seeds(f"L={depth}: {label}'s deep blocks {claim}", +1, pre,
                                              measures.by_seed(records, rival, measure), ("Pre-LN", label)))
            for baseline in ("pre", "lns"):  # each fix claims to keep the stream's variance in check
                found.append(verdicts.judge_seeds(
                    f"L={depth}: {label} holds the variance growth below {NORMS[baseline]}'s (log ratio)", -1,
                    measures.by_seed(records, axis.arm(depth, baseline), "variance_growth"),
                    measures.by_seed(records, rival, "variance_growth"), (NORMS[baseline], label), log_ratio=True))
    depths = [d for d in s.get("rival_depths", ()) if d in s["depths"]]
    for norm in s.get("rival_norms", ()) if len(depths) >= 2 else ():
        label = RIVAL_NORMS[norm]
        shallow, deep = (gap_to_lns(axis, records, depth, norm) for depth in (depths[0], depths[-1]))
        found.append(verdicts.judge_seeds(
            f"{label} gains on LNS from L={depths[0]} to L={depths[-1]} (change in {label} − LNS eval loss)", -1,
            shallow, deep, (f"L={depths[0]}", f"L={depths[-1]}")))
    return found


def gap_to_lns(axis: Axis, records, depth: int, norm: str) -> dict[int, float]:
    """{seed: eval loss of `norm` − LNS's} at one depth, for the seeds where both runs finished."""
    lns = measures.by_seed(records, axis.arm(depth, "lns"), "eval_loss")
    rival = measures.by_seed(records, axis.arm(depth, norm), "eval_loss")
    return {seed: loss - lns[seed] for seed, loss in rival.items() if loss is not None and lns.get(seed) is not None}


def rivals_section(rivals: list[verdicts.Verdict], s: dict) -> str:
    if not rivals:
        return ""
    names = " and ".join(RIVAL_NORMS[n] for n in s["rival_norms"])
    return (f"\n## {names} at L = {', '.join(map(str, s['rival_depths']))} (paired by seed)\n\n"
            + "\n".join("- " + v.line() for v in rivals) + "\n")
