"""What LNS is worth in compute (issue 79): how many updates Pre-LN needs to reach LNS's final eval loss, over LNS's.

    python -m utils.study.multiplier docs/depth_sweep_wikipedia_2400_lr0.002 docs/depth_sweep_wikipedia_5000_lr0.002 \\
        docs/depth_sweep_wikipedia_lr0.002

The folders are one depth sweep at several budgets (a budget is a finished run: warmup and cosine scaled to it), one
rate. For each budget B, depth L and seed s, the arm's final eval loss is located on Pre-LN's curve of finished
runs of the same depth and seed: its final eval loss against ln(updates) at the map's budgets, linear between two
budgets. Below Pre-LN's loss at its largest budget (or above it at its smallest) the curve is a fitted
a + b * n^-c through all of the seed's budgets, and the cell is marked extrapolated; a loss under the fit's floor a,
or a seed with fewer than three budgets to fit, has no multiplier there. The multiplier is the updates Pre-LN needs
over B: above 1 the arm saves compute, below 1 Pre-LN is ahead.

Per cell: the geometric mean over seeds with its 95% t interval (on ln of the multiplier, paired by seed). Per
budget: does the multiplier grow with depth (the slope of ln multiplier against ln L per seed, judged over seeds)?
Each arm beside Pre-LN in the folders (LNS; any rival with records at those budgets, Attention Residuals among them)
gets its own table. Tokens per parameter use every parameter, embeddings included. Writes multiplier.md, .json, .csv
and .png in --out (default: docs/compute_multiplier).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from pathlib import Path

import numpy as np

from peft_pretraining.cli import OneLineErrorParser
from utils.study import lr_grid, verdicts
from utils.study import records as record_store
from utils.study.budget_map import at_every_depth
from utils.study.plots import pyplot, save_figure
from utils.study.results_table import rate_text
from utils.study.runs import REPO
from utils.study.sweep import BASE_CONFIG, slope_by_seed, slope_verdict

DEFAULT_OUT = REPO / "docs/compute_multiplier"
REFERENCE = "pre"
ARM_LABELS = {"pre": "Pre-LN", "lns": "LNS", "attnres": "Attention Residuals", "mhc": "mHC", "siamese": "SiameseNorm",
              "gpas": "GPAS", "bhyt": "BHyT"}
EXPONENTS = np.geomspace(0.02, 4.0, 400)  # the fit's c, searched on a grid (a, b by least squares at each)


# ------------------------------------------------------------------------------------------- Pre-LN's curve
def fit_power_law(points: dict[int, float], anchor: int) -> tuple[float, float, float] | None:
    """(a, b, c) of loss = a + b * n^-c, b > 0, through the point at budget `anchor` exactly (the end of the curve
    that the extrapolation leaves from) and least squares over the others; None with fewer than 3 points or no
    falling fit. c is searched on EXPONENTS; a c at its lower edge is a loss falling linearly in ln n, the limit
    `updates_to_reach` then uses instead."""
    if len(points) < 3:
        return None
    n = np.array(sorted(points), dtype=float)
    loss = np.array([points[k] for k in sorted(points)])
    best = None
    for c in EXPONENTS:
        x = n ** -c - anchor ** -c  # loss - loss(anchor) = b * x
        b = float(x @ (loss - points[anchor]) / (x @ x))
        error = float(np.sum((b * x - (loss - points[anchor])) ** 2))
        if b > 0 and (best is None or error < best[0]):
            best = (error, points[anchor] - b * anchor ** -c, b, float(c))
    return None if best is None else best[1:]


def log_linear_updates(points: dict[int, float], ends: tuple[int, int], target: float) -> float | None:
    """Where the line through two budgets' losses, in ln updates, reaches `target` (None if it does not fall)."""
    low, high = ends
    slope = (points[high] - points[low]) / (math.log(high) - math.log(low))
    return None if slope >= 0 else math.exp(math.log(high) + (target - points[high]) / slope)


def updates_to_reach(points: dict[int, float], target: float) -> tuple[float | None, str]:
    """(updates, how) at which Pre-LN's curve of finished runs {updates: final eval loss} reaches `target`: how is
    "interpolated" (linear in ln updates between two budgets), "extrapolated" (beyond the budgets: the power law
    through the nearer end budget, or, where the fit finds no curvature, the line in ln updates through the two
    nearest budgets), or why there is none."""
    budgets = sorted(points)
    for low, high in zip(budgets, budgets[1:]):
        if points[low] >= target >= points[high] and points[low] > points[high]:
            fraction = (points[low] - target) / (points[low] - points[high])
            return math.exp(math.log(low) + fraction * (math.log(high) - math.log(low))), "interpolated"
    beyond = target < points[budgets[-1]]
    anchor = budgets[-1] if beyond else budgets[0]
    fit = fit_power_law(points, anchor)
    if fit is None:
        return None, f"outside Pre-LN's {len(budgets)} budget(s) and fewer than 3 to fit a curve"
    a, b, c = fit
    if c == EXPONENTS[0]:
        needed = log_linear_updates(points, tuple(budgets[-2:]) if beyond else tuple(budgets[:2]), target)
        return (needed, "extrapolated") if needed else (None, "Pre-LN's curve does not fall at its end")
    if target <= a:
        return None, f"below the floor of Pre-LN's fitted curve ({a:.3f})"
    return (b / (target - a)) ** (1 / c), "extrapolated"


# ------------------------------------------------------------------------------------------- the records
def read_sweep(folders: list[Path], norms: set[str] | None = None) -> tuple[dict, dict]:
    """({norm: {depth: {seed: {updates: final eval loss}}}}, the settings: batch, length, hidden and the rates as
    {norm: {updates: rate}}), for the finished runs of `norms` (default every arm). ValueError, naming the file, for
    a record of another sweep (batch, length or width), or a second rate for one arm at one budget."""
    losses, settings, rates = {}, None, {}
    for folder in folders:
        paths = record_store.paths_in(folder / "runs")
        if not paths:
            raise ValueError(f"{folder}: no run records in {folder / 'runs'}")
        for path in paths:
            record = record_store.read(path)
            match = lr_grid.ARM.fullmatch(record.get("arm", ""))
            if match is None or record.get("status") != "finished" or (norms and match[2] not in norms):
                continue
            run = record_store.fields(record)
            shape = dict(batch=run.batch, length=run.length, hidden=run.hidden)
            if settings is None:
                settings, first = shape, path
            elif shape != settings:
                raise ValueError(f"{path}: trained at {shape}, {first} at {settings}; one sweep")
            depth, norm = int(match[1]), match[2]
            if rates.setdefault(norm, {}).setdefault(run.updates, run.rate) != run.rate:
                raise ValueError(f"{path}: {norm} at {run.updates:,} updates trained at lr {run.rate:g} and at "
                                 f"{rates[norm][run.updates]:g}; give one rate per arm and budget")
            losses.setdefault(norm, {}).setdefault(depth, {}).setdefault(record["seed"], {})[
                run.updates] = record["final_eval_loss"]
    return losses, dict(settings or {}, rates={norm: dict(sorted(r.items())) for norm, r in sorted(rates.items())})


def read(folders: list[Path], arm_folders: list[Path]) -> tuple[dict, dict]:
    """Every arm from `folders`; or, with `arm_folders`, Pre-LN's curve from `folders` and the other arms from
    `arm_folders` (each arm at its own rate). ValueError where the two are not one sweep, or Pre-LN has no run."""
    losses, settings = read_sweep(folders, {REFERENCE} if arm_folders else None)
    if arm_folders:
        arms, arm_settings = read_sweep(arm_folders)
        arms.pop(REFERENCE, None)
        arm_settings["rates"].pop(REFERENCE, None)
        shape, arm_shape = ({k: v for k, v in x.items() if k != "rates"} for x in (settings, arm_settings))
        if shape and arm_shape and shape != arm_shape:
            raise ValueError(f"--arm_folders: another sweep than the folders' ({arm_shape} against {shape})")
        losses = {**losses, **arms}
        settings = dict(settings, rates={**settings["rates"], **arm_settings["rates"]})
    if REFERENCE not in losses:
        raise ValueError(f"{', '.join(map(str, folders))}: no finished Pre-LN run to measure against")
    return losses, settings


def rates_text(rates: dict[str, dict[int, float]]) -> str:
    """"lr 2e-3 for every arm", or each arm's rate per budget where they differ."""
    every = {rate for per in rates.values() for rate in per.values()}
    if len(every) == 1:
        return f"lr {rate_text(every.pop())} for every arm"
    return "; ".join(f"{ARM_LABELS.get(norm, norm)} at "
                     + ", ".join(f"lr {rate_text(rate)} ({updates:,} updates)" for updates, rate in per.items())
                     for norm, per in rates.items())


def parameters(hidden: int, depth: int, vocab: int) -> int:
    """Every parameter of the sweep's model (untied embeddings and head, the base config's MLP ratio), as a
    Pre-LN or LNS model has them."""
    base = json.loads((REPO / BASE_CONFIG).read_text())
    intermediate = hidden * base["intermediate_size"] // base["hidden_size"]
    return depth * (4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden) + 2 * vocab * hidden + hidden


# ------------------------------------------------------------------------------------------- the multiplier
def cells(losses: dict, arm: str) -> dict[tuple[int, int], dict[int, dict]]:
    """{(updates, depth): {seed: {multiplier, how, pre_updates}}} for `arm` against Pre-LN, paired by seed."""
    found = {}
    for depth, per_seed in sorted(losses.get(arm, {}).items()):
        for seed, curve in sorted(per_seed.items()):
            reference = losses[REFERENCE].get(depth, {}).get(seed)
            if not reference:
                continue
            for updates, loss in sorted(curve.items()):
                needed, how = updates_to_reach(reference, loss)
                found.setdefault((updates, depth), {})[seed] = dict(
                    multiplier=None if needed is None else needed / updates, how=how, pre_updates=needed)
    return dict(sorted(found.items()))


def judge_cell(updates: int, depth: int, per_seed: dict[int, dict], label: str) -> verdicts.Verdict:
    """The multiplier over seeds: ln of it paired by seed, +1: the arm saves compute."""
    measured = {seed: v["multiplier"] for seed, v in per_seed.items() if v["multiplier"] is not None}
    return verdicts.judge_seeds(f"{updates:,} updates, L = {depth}: Pre-LN needs more updates than {label} to reach "
                                f"{label}'s eval loss", +1, {seed: 1.0 for seed in measured}, measured,
                                ("Pre-LN's own budget", "Pre-LN's updates needed"), log_ratio=True)


def depth_trend(table: dict[tuple[int, int], dict[int, dict]], updates: int, label: str) -> verdicts.Verdict | None:
    """Does the multiplier grow with depth at this budget? The slope of ln multiplier against ln L, per seed with
    every depth."""
    depths = sorted(d for u, d in table if u == updates
                    and any(v["multiplier"] for v in table[(u, d)].values()))  # a depth with no match has no say
    if len(depths) < 2:
        return None
    per_depth = {d: {s: math.log(v["multiplier"]) for s, v in table[(updates, d)].items() if v["multiplier"]}
                 for d in depths}
    slopes = slope_by_seed(at_every_depth(per_depth), False)
    return slope_verdict(f"{updates:,} updates: {label}'s multiplier grows with depth (slope of ln multiplier vs "
                         f"ln L, L = {', '.join(map(str, depths))})", +1, slopes)


def ratio_text(verdict: verdicts.Verdict) -> str:
    """×m [low, high] (n seeds), the geometric mean and its interval; one seed: its own value."""
    if verdict.effect is None:
        return "n/a"
    mean, low, high = (math.exp(v) for v in (verdict.effect, verdict.low, verdict.high))
    return f"×{mean:.2f} [{low:.2f}, {high:.2f}] ({verdict.n_pairs})"


def saving_words(verdict: verdicts.Verdict, label: str) -> str:
    """The verdict in words the interval supports, and nothing stronger."""
    if verdict.status == verdicts.REPRODUCED:
        return f"{label} saves compute"
    if verdict.status == verdicts.OPPOSITE:
        return f"Pre-LN is ahead of {label}"
    if verdict.status == verdicts.INSIDE_NOISE:
        return "no saving shown (the interval holds ×1)"
    return "not measurable"


def trend_words(verdict: verdicts.Verdict | None) -> str:
    if verdict is None or verdict.effect is None:
        return "not measurable (fewer than two depths or seeds)"
    return {verdicts.REPRODUCED: "grows with depth", verdicts.OPPOSITE: "shrinks with depth",
            verdicts.INSIDE_NOISE: "no trend with depth shown"}[verdict.status]


def one_seed_text(per_seed: dict[int, dict]) -> str:
    """Each seed's multiplier; where no seed has one, the reason once."""
    reasons = {v["how"] for v in per_seed.values() if not v["multiplier"]}
    if len(reasons) == 1 and not any(v["multiplier"] for v in per_seed.values()):
        return f"none: {reasons.pop()}"
    return "; ".join(f"seed {s}: ×{v['multiplier']:.2f}" if v["multiplier"] else f"seed {s}: none ({v['how']})"
                     for s, v in per_seed.items())


# ------------------------------------------------------------------------------------------- output
def plot(summaries: dict[str, dict], path: Path) -> Path:
    """Left: the multiplier against depth, a line per budget (and arm); right: against tokens per parameter."""
    plt = pyplot()
    fig, (by_depth, by_ratio) = plt.subplots(1, 2, figsize=(10, 3.8))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = {"lns": "-", "attnres": "--", "mhc": ":", "siamese": "-."}
    for arm, summary in summaries.items():
        for colour, (updates, rows) in zip(colours, summary["by_budget"].items()):
            rows = [r for r in rows if r["geomean"] is not None]
            if not rows:
                continue
            low = [r["geomean"] - r["low"] if r["low"] else 0 for r in rows]
            high = [r["high"] - r["geomean"] if r["high"] else 0 for r in rows]
            label = f"{summary['label']}, {int(updates):,} updates"
            depths, ratios = [r["depth"] for r in rows], [r["tokens_per_parameter"] for r in rows]
            for ax, x in ((by_depth, depths), (by_ratio, ratios)):
                ax.errorbar(x, [r["geomean"] for r in rows], yerr=[low, high], marker="o", capsize=3, color=colour,
                            linestyle=styles.get(arm, "-"), label=label)
                for r, xx in zip(rows, x):
                    if r["extrapolated"]:
                        ax.plot([xx], [r["geomean"]], marker="o", markersize=11, fillstyle="none", color=colour)
    depths = sorted({r["depth"] for s in summaries.values() for rows in s["by_budget"].values() for r in rows
                     if r["geomean"] is not None})
    for ax, xlabel in ((by_depth, "layers L"), (by_ratio, "tokens per parameter (all parameters)")):
        ax.axhline(1, color="0.5", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        low, high = ax.get_ylim()
        ticks = [t for t in (0.5, 0.67, 0.8, 0.9, 1, 1.1, 1.25, 1.5, 2, 3, 4) if low <= t <= high]
        ax.set_yticks(ticks, [f"×{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.set(xlabel=xlabel, ylabel="updates Pre-LN needs / the arm's")
        ax.grid(alpha=0.3)
    by_depth.set_xticks(depths, [str(d) for d in depths])
    ratio_ticks = [t for t in (1, 2, 5, 10, 20, 50) if any(
        0.7 * t <= r["tokens_per_parameter"] <= 1.4 * t for s in summaries.values() for rows in s["by_budget"].values()
        for r in rows)]
    by_ratio.set_xticks(ratio_ticks, [str(t) for t in ratio_ticks])
    if by_depth.get_legend_handles_labels()[0]:
        by_depth.legend(fontsize=7)
    by_depth.set_title("Compute multiplier against depth")
    by_ratio.set_title("... against tokens per parameter")
    fig.suptitle("Ringed: some seed extrapolated past Pre-LN's budgets. Bars: 95% t over seeds", fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


def summarise(losses: dict, settings: dict, arm: str, vocab: int) -> dict:
    label = ARM_LABELS.get(arm, arm)
    table = cells(losses, arm)
    by_budget, trends = {}, {}
    for (updates, depth), per_seed in table.items():
        verdict = judge_cell(updates, depth, per_seed, label)
        params = parameters(settings["hidden"], depth, vocab)
        by_budget.setdefault(str(updates), []).append(dict(
            depth=depth, per_seed={str(s): v for s, v in per_seed.items()}, verdict=verdict.as_dict(),
            geomean=None if verdict.effect is None else math.exp(verdict.effect),
            low=None if verdict.low is None else math.exp(verdict.low),
            high=None if verdict.high is None else math.exp(verdict.high),
            extrapolated=any(v["how"] == "extrapolated" for v in per_seed.values()),
            parameters=params, tokens_per_parameter=updates * settings["batch"] * settings["length"] / params,
            ratio=ratio_text(verdict), words=saving_words(verdict, label), one_seed=one_seed_text(per_seed)))
    for updates in by_budget:
        trend = depth_trend(table, int(updates), label)
        trends[updates] = dict(verdict=None if trend is None else trend.as_dict(), words=trend_words(trend),
                               line=None if trend is None else trend.line())
    return dict(arm=arm, label=label, by_budget=by_budget, trends=trends)


def table_lines(summary: dict) -> list[str]:
    depths = sorted({r["depth"] for rows in summary["by_budget"].values() for r in rows})
    lines = ["| updates | " + " | ".join(f"L = {d}" for d in depths) + " | does it grow with depth? |",
             "|---|" + "---|" * (len(depths) + 1)]
    for updates, rows in summary["by_budget"].items():
        row = {r["depth"]: r for r in rows}
        cells_ = [("—" if d not in row else
                   (row[d]["ratio"] + (" †" if row[d]["extrapolated"] else "") if row[d]["geomean"] is not None
                    else row[d]["one_seed"])) for d in depths]
        lines.append(f"| {int(updates):,} | " + " | ".join(cells_) + f" | {summary['trends'][updates]['words']} |")
    return lines


def write(folders: list[Path], out: Path, argv: list[str], vocab: int, arm_folders: list[Path] = ()) -> dict:
    losses, settings = read(folders, list(arm_folders))
    arms = [arm for arm in losses if arm != REFERENCE]
    summaries = {arm: summarise(losses, settings, arm, vocab) for arm in arms}
    out.mkdir(parents=True, exist_ok=True)
    png = plot(summaries, out / "multiplier.png")
    text = ["# What LNS is worth in compute: the updates Pre-LN needs to match it", "",
            f"Generated by `python -m utils.study.multiplier {' '.join(argv)}`. Hidden {settings['hidden']}, "
            f"{rates_text(settings['rates'])}, {settings['batch']} × {settings['length']} tokens an update, each "
            "budget a finished run (warmup 10% and the cosine scaled to it).", "",
            "A cell is the updates Pre-LN needs to reach the arm's final eval loss, over the arm's own updates: the "
            "geometric mean over seeds with its 95% t interval (on the log, paired by seed) and the seed count. "
            "Above ×1 the arm saves compute; below, Pre-LN is ahead. † marks a cell where some seed's match lies "
            "outside Pre-LN's trained budgets, read from a fitted curve.", ""]
    for arm, summary in summaries.items():
        text += [f"## {summary['label']} against Pre-LN", "", *table_lines(summary), ""]
        for updates, rows in summary["by_budget"].items():
            for r in rows:
                if r["geomean"] is not None:
                    text.append(f"- {int(updates):,} updates, L = {r['depth']}: {r['words']}, {r['ratio']}; "
                                f"{r['tokens_per_parameter']:.1f} tokens per parameter; per seed: {r['one_seed']}")
            line = summary["trends"][updates]["line"]
            if line:
                text.append(f"- {line}")
        text.append("")
    text += [f"![the multiplier against depth and tokens per parameter]({png.name})", ""]
    (out / "multiplier.md").write_text("\n".join(text))
    summary = dict(folders=[str(f) for f in folders], settings=settings, vocab=vocab, arms=summaries)
    (out / "multiplier.json").write_text(json.dumps(summary, indent=1) + "\n")
    with open(out / "multiplier.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["arm", "updates", "depth", "seed", "multiplier", "how", "pre_updates_needed",
                         "tokens_per_parameter"])
        for arm, s in summaries.items():
            for updates, rows in s["by_budget"].items():
                for r in rows:
                    for seed, v in r["per_seed"].items():
                        writer.writerow([arm, updates, r["depth"], seed, v["multiplier"], v["how"], v["pre_updates"],
                                         r["tokens_per_parameter"]])
    return summary


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="python -m utils.study.multiplier", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", type=Path,
                        help="depth-sweep report folders of one sweep at several budgets, one rate per arm and budget")
    parser.add_argument("--arm_folders", nargs="*", type=Path, default=[],
                        help="the other arms' records from these folders instead (each arm at its own best rate); "
                             "Pre-LN's curve still comes from the folders")
    parser.add_argument("--vocab", type=int, default=4096, help="the tokenizer's vocabulary (Wikipedia: 4096)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where multiplier.md/.json/.csv/.png go")
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    for folder in [*args.folders, *args.arm_folders]:
        if not (folder / "runs").is_dir():
            parser.error(f"folders: {folder} has no runs/ folder of records")
    try:
        write(args.folders, args.out, argv, args.vocab, args.arm_folders)
    except ValueError as error:
        parser.error(str(error))
    print(args.out / "multiplier.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
