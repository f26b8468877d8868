"""What the depth and width sweeps share: the swept axis, the runs' configs and flags, the per-seed slopes against
ln of the swept value, and the figures and table of every measure against it."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from peft_pretraining.model.modeling_llama import PLACEMENTS
from utils.study import verdicts
from utils.study.measures import GROWTH_MEASURES, MEASURES, by_seed, measures_in
from utils.study.plots import finish_grid, pyplot, save_figure
from utils.study.runs import REPO, dataset_flags, peak_lr

NORMS = {name: PLACEMENTS[name].label for name in ("pre", "lns")}
# Fixes published since the paper, trained at a budget's rival_depths only: GPAS and BHyT (issue 39, `--budget
# rivals`), then AttnRes and mHC, which rebuild the residual stream (issue 67, `--budget rivals_2026`)
RIVAL_NORMS = {name: PLACEMENTS[name].label for name in ("gpas", "bhyt", "attnres", "mhc", "siamese")}
NORM_LABELS = {**NORMS, **RIVAL_NORMS}
# Hidden 64 (head dim 16) keeps a 48-layer run near 20 minutes with its analyses on one core; 128 would make every
# run about four times dearer. Measured per run (train + analyses, two runs side by side; mean of the records in
# docs/depth_sweep/runs): L=6 4.5, L=12 6.5, L=24 9.2, L=48 16.5 run-minutes, so L=96 takes about 35: the four
# depths of the default fit in 2 hours on 2 cores, and L=96 is the `deep` extension, which shares the default's records.
BASE_CONFIG = "configs/llama_tiny.json"


@dataclasses.dataclass(frozen=True)
class Axis:
    """What a sweep varies (depth here, width in utils/width_sweep.py): its values, and how runs and reports name
    them. The run of a norm type at one value is the arm f"{prefix}{value}-{norm}"."""

    prefix: str  # "L": arms L6-pre, L48-lns
    symbol: str  # the verdicts' slopes are against ln(symbol)
    label: str  # the plots' axis label
    noun: str  # "depth"
    values: tuple[int, ...]

    def arm(self, value: int, norm: str) -> str:
        return f"{self.prefix}{value}-{norm}"


def write_config(args, name: str, **changes) -> str:
    """The base config with `changes`, written as `name` under the runs folder; returned relative to the
    repository when possible, so that records made on another machine still match."""
    config = {**json.loads((REPO / BASE_CONFIG).read_text()), **changes}
    path = args.runs_dir / "configs" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2) + "\n")
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def train_flags(args, config: str, steps: int, warmup: int, eval_every: int) -> tuple[str, ...]:
    """The trainer's flags of a sweep run: `config` trained with the budget's data, batch and schedule on the
    study's --device."""
    s = args.settings
    return ("--model_config", config, *dataset_flags(s),
            "--packing", "--max_length", str(s["max_length"]), "--batch_size", str(s["batch_size"]),
            "--total_batch_size", str(s["batch_size"]), "--lr", peak_lr(s), "--warmup_steps", str(warmup),
            "--num_training_steps", str(steps), "--eval_every", str(eval_every), "--eval_tokens",
            str(s["eval_tokens"]), "--grad_clipping", "1.0", "--weight_decay", "0", "--optimizer", "adam",
            "--workers", "0", "--device", args.device, "--dtype", "float32")


def measure_by_value(axis: Axis, records, norm: str, measure: str) -> dict[int, dict[int, float | None]]:
    """{value: {seed: value of the measure}} at each run's last analysed checkpoint."""
    return {v: by_seed(records, axis.arm(v, norm), measure) for v in axis.values}


def slope_by_seed(table: dict[int, dict[int, float | None]], log_values: bool) -> dict[int, float | None]:
    """Per seed, the least-squares slope of the measure (or its log) against ln of the swept value (ln L), over
    the values it has."""
    seeds = sorted({seed for per_seed in table.values() for seed in per_seed})
    slopes = {}
    for seed in seeds:
        points = [(math.log(depth), per_seed.get(seed)) for depth, per_seed in table.items()]
        points = [(x, math.log(y) if log_values else y) for x, y in points
                  if y is not None and (not log_values or y > 0)]
        slopes[seed] = float(np.polyfit(*zip(*points), 1)[0]) if len({x for x, _ in points}) >= 2 else None
    return slopes


# An interval that excludes zero by less than this fraction of its half-width is called "barely" excluding it: a
# small change of one seed would bring zero inside.
BARELY = 0.1


def slope_weights(depths: list[int]) -> dict[int, float]:
    """Each depth's weight in a least-squares slope against ln L (the weights sum to zero). With L = 6, 12, 24, evenly
    spaced in ln L, the middle depth's weight is zero: the slope is (y(24) − y(6)) / ln 4."""
    if len(set(depths)) < 2:
        raise ValueError(f"a slope needs two depths, got {depths}")
    x = np.log(np.asarray(depths, dtype=float))
    centred = x - x.mean()
    return {d: float(w) for d, w in zip(depths, centred / np.sum(centred ** 2))}


def resting_depths(depths: list[int]) -> list[int]:
    """The depths a least-squares slope over `depths` gives a weight to (not ~0); none below two depths."""
    if len(set(depths)) < 2:
        return []
    weights = slope_weights(depths)
    largest = max(abs(w) for w in weights.values())
    return [d for d, w in weights.items() if abs(w) > 1e-9 * largest]


def resting_sentence(values: list[int], symbol: str = "L") -> str:
    """One sentence, when a least-squares slope over `values` gives some of them no weight: which values it rests
    on. '' otherwise."""
    resting = resting_depths(values)
    if not resting or len(resting) == len(values):  # one value has no slope: evidence_note says so per verdict
        return ""
    return (f"With {symbol} = {', '.join(map(str, values))} evenly spaced in ln {symbol}, every slope below rests on "
            f"{symbol} = {' and '.join(map(str, resting))} only: the least-squares fit gives the others no weight.")


def evidence_note(verdict: verdicts.Verdict, values: list[int], sign_test: bool = True, symbol: str = "L",
                  resting: bool = True) -> str:
    """What a slope verdict over the swept `values` rests on, in words: (with `resting`) the values that weigh in it,
    its seeds (with `sign_test`, the one-sided sign test of their agreement), and an interval that excludes zero only
    barely."""
    notes = []
    weighed = resting_depths(values)
    if len(set(values)) < 2:
        notes.append(f"no slope yet: a slope needs two depths, and this has {symbol} = "
                     f"{', '.join(map(str, values)) or 'none'} only")
    elif resting and len(weighed) < len(values):
        notes.append(f"rests on {symbol} = {' and '.join(map(str, weighed))} only (with {len(values)} values evenly "
                     f"spaced in ln {symbol} the others weigh nothing)")
    if verdict.effect is not None and sign_test:
        n, k = verdict.n_pairs, verdict.n_agree
        majority = max(k, n - k)
        p = sum(math.comb(n, i) for i in range(majority, n + 1)) / 2 ** n
        notes.append(f"{k} of {n} seeds go the claim's way; a one-sided sign test of {majority} of {n} seeds "
                     f"agreeing in sign is p = {p:.3g}")
    if verdict.effect is not None:
        nearer = min(abs(verdict.low), abs(verdict.high))
        if verdict.status != verdicts.INSIDE_NOISE and nearer < BARELY * (verdict.high - verdict.low) / 2:
            notes.append("the interval barely excludes zero (by less than a tenth of its half-width)")
    return "; ".join(notes)


def with_evidence(verdict: verdicts.Verdict, values, symbol: str = "L") -> verdicts.Verdict:
    """The slope verdict with evidence_note added to its reason, without the sign test and the values it rests on
    (a report says those once: resting_sentence)."""
    note = evidence_note(verdict, list(values), sign_test=False, symbol=symbol, resting=False)
    if note:
        verdict.reason = f"{verdict.reason}; {note}" if verdict.reason else note
    return verdict


def slope_verdict(claim: str, direction: int, slopes: dict[int, float | None]) -> verdicts.Verdict:
    """The per-seed slopes against zero: a one-sample t interval over seeds (judge_seeds against a zero arm). A seed
    without a slope has fewer than two swept values measured (a sweep part-way through), not a diverged run."""
    fitted = {seed: slope for seed, slope in slopes.items() if slope is not None}
    verdict = verdicts.judge_seeds(claim, direction, {seed: 0.0 for seed in fitted}, fitted, ("zero", "slope"))
    if len(fitted) < 2:  # judge_seeds would name its stand-in zero arm as if it were a run
        verdict.reason = (f"only {len(fitted)} seed{'' if len(fitted) == 1 else 's'} with a slope; an interval over "
                          "seeds needs at least 2")
    unfitted = [str(seed) for seed in slopes if seed not in fitted]
    if unfitted:
        note = f"no slope for seed {', '.join(unfitted)}: fewer than two of the swept values measured"
        verdict.reason = f"{verdict.reason}; {note}" if verdict.reason else note
    return verdict


def paired_differences(axis: Axis, records, measure: str, log_ratio: bool = False) -> dict[int, dict[int, float]]:
    """{value: {seed: LNS − Pre-LN}} (or ln(LNS / Pre-LN)) of a measure, for the seeds where both runs have it."""
    table = {}
    for value in axis.values:
        pre = by_seed(records, axis.arm(value, "pre"), measure)
        lns = by_seed(records, axis.arm(value, "lns"), measure)
        table[value] = {seed: (math.log(lns[seed] / pre[seed]) if log_ratio else lns[seed] - pre[seed])
                        for seed in pre if pre[seed] is not None and lns.get(seed) is not None
                        and (not log_ratio or min(pre[seed], lns[seed]) > 0)}
    return table


def nonpositive_pairs(axis: Axis, records, measure: str) -> dict[int, list[int]]:
    """{value: seeds} where both arms have the measure and one of them is 0 or below: the pairs that
    paired_differences has as a gap but not as a log ratio."""
    gaps = paired_differences(axis, records, measure)
    ratios = paired_differences(axis, records, measure, log_ratio=True)
    left_out = {value: sorted(set(gaps[value]) - set(ratios[value])) for value in gaps}
    return {value: seeds for value, seeds in left_out.items() if seeds}


def plot_against(axis: Axis, records, path: Path) -> Path:
    """Every measure at the last checkpoint against the swept value, one line per norm type."""
    plt = pyplot()
    depths = axis.values
    measures = list(measures_in(records))
    fig, axes = plt.subplots(2, math.ceil(len(measures) / 2), figsize=(4.4 * math.ceil(len(measures) / 2), 7),
                             squeeze=False)
    for ax, measure in zip(axes.flat, measures):
        for norm, label in NORM_LABELS.items():
            table = measure_by_value(axis, records, norm, measure)
            xs, means, errors = [], [], []
            for depth in depths:
                vals = [v for v in table[depth].values() if v is not None]
                if vals:
                    xs.append(depth)
                    means.append(np.mean(vals))
                    errors.append(verdicts.paired_t_interval(vals)[2] - np.mean(vals) if len(vals) > 1 else 0.0)
            if xs:
                ax.errorbar(xs, means, yerr=errors, marker="o", markersize=4, capsize=3, label=label)
        ax.set_xscale("log", base=2)
        if measure in GROWTH_MEASURES:
            ax.set_yscale("log")  # Pre-LN's growth spans orders of magnitude across depths
        ax.set_xticks(depths, [str(d) for d in depths])
        ax.set_title(MEASURES[measure] + (" (log scale)" if measure in GROWTH_MEASURES else ""),
                     fontsize=9)
        ax.set_xlabel(axis.label)
        ax.grid(alpha=0.3)
    return finish_grid(fig, axes, len(measures),
                                 f"Final checkpoint against {axis.noun} (mean over seeds, 95% t-interval)", path)


def plot_gap(gaps: list[verdicts.Verdict], depths, path: Path, xlabel: str = "layers L", noun: str = "depth",
             ylabel: str = "LNS − Pre-LN eval loss (nats)",
             title: str = "LNS's loss gap against {noun} (below 0: LNS better)") -> Path:
    """One verdict per swept value (its effect and interval) against the value."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    points = [(d, v) for d, v in zip(depths, gaps) if v.effect is not None]  # a depth with < 2 pairs has no interval
    if points:
        xs = [d for d, _ in points]
        ax.errorbar(xs, [v.effect for _, v in points],
                    yerr=[[v.effect - v.low for _, v in points], [v.high - v.effect for _, v in points]],
                    marker="o", capsize=3)
    ax.axhline(0, color="black", linewidth=0.7)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(depths), [str(d) for d in depths])
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title.format(noun=noun))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return save_figure(fig, path)


def measures_table(axis: Axis, records) -> str:
    """Markdown: per swept value and norm type, the mean over seeds of every measure (with how many runs it averages
    when some lack it: diverged, or recorded before the measure existed), and each run's best step."""
    shown = measures_in(records)
    rows = []
    for value in axis.values:
        for norm, label in NORM_LABELS.items():
            arm_records = [r for r in records.values() if r["arm"] == axis.arm(value, norm)]
            if not arm_records:
                continue
            cells = [str(value), label, f"{len(arm_records)}"]
            for measure in shown:
                vals = [v for v in by_seed(records, axis.arm(value, norm), measure).values()
                        if v is not None]
                partly = f" ({len(vals)} of {len(arm_records)})" if len(vals) < len(arm_records) else ""
                cells.append(f"{np.mean(vals):.4f}{partly}" if vals else "n/a")
            best = [min(r["eval_curve"], key=lambda p: p[1])[0] for r in arm_records if r["eval_curve"]]
            cells.append(", ".join(map(str, best)))
            rows.append("| " + " | ".join(cells) + " |")
    header = (f"| {axis.symbol} | norm | runs | " + " | ".join(shown.values())
              + " | step of lowest eval loss |\n|" + "---|" * (len(shown) + 4))
    return "\n".join([header, *rows])
