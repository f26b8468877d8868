"""A depth sweep's learning-rate grid: at each depth and arm, the eval loss at every rate trained, the best rate, and
the depth and LNS verdicts again with each point at its best rate.

One rate for every depth can favour the shallow models (a deeper Pre-LN stack may want a smaller rate) or one arm
(LNS shrinks what each block adds, which can act like a smaller rate). A grid answers both: it is a depth sweep
trained at several rates, each rate in its own report folder (`utils/depth_sweep.py --lr` names them), read together:

    python utils/depth_sweep.py --budget wikipedia_pilot --dtype float32 --no-compile --lr 5e-4 --depths 24 12
    python -m utils.study.lr_grid docs/depth_sweep_wikipedia docs/depth_sweep_wikipedia_lr0.0005

The folders must hold one budget: every record trained with the same flags but --lr (and its seed and folders) and
analysed with the same settings. A point's best rate is the one with the lowest eval loss (mean over its seeds);
the verdicts then compare points at their best rates on the held-out loss, paired by seed, or with one shared seed
on the held-out documents of the removal analysis. The documents are validation articles, as are the eval tokens
that chose the rates, so an interval at the best rates is somewhat optimistic. A best rate at the edge of the rates
a point trained may lie beyond the grid; the table marks it. Two points are compared each at its best of the rates
both trained, so a rate tried at one point only (a wider search there) cannot decide a verdict. Writes lr_grid.md,
.json and .png in --out (default: the first folder's name with _lr_grid).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from peft_pretraining.cli import OneLineErrorParser
from utils.study import claims, verdicts
from utils.study import records as record_store
from utils.study.measures import by_seed
from utils.study.plots import pyplot, save_figure
from utils.study.runs import recorded_settings
from utils.study.sweep import NORMS

ARM = re.compile(r"L(\d+)-(\w+)")
# Flags that differ between the runs of one grid: the grid point (its rate and arm) and the seed.
PER_RUN_FLAGS = ("--lr", "--seed", "--norm_type")


def rate_of(record: dict) -> float:
    return record_store.fields(record).rate


def budget_of(record: dict, per_run: tuple[str, ...] = PER_RUN_FLAGS) -> tuple:
    """What a record shares with every other record of its grid: its flags without the `per_run` ones (the rate,
    the arm and the seed), its config's name without its folder and depth (llama_h64_L12.json: llama_h64.json),
    and its analysis settings."""
    return record_store.setup_key(record, per_run), json.dumps(recorded_settings(record), sort_keys=True)


def point_name(depth: int, norm: str, rate: float) -> str:
    return f"L{depth}-{norm}@{rate:g}"


def read_grid(folders: list[Path]) -> dict[str, dict]:
    """{run name: record} of the Pre-LN and LNS runs the folders' runs/ hold, each arm renamed to its grid point
    (L12-pre trained at 5e-4: L12-pre@0.0005). ValueError, naming the file, for an unreadable record or one of
    another budget, and for two records of one point and seed."""
    grid, budget, first = {}, None, None
    for folder in folders:
        paths = record_store.paths_in(folder / "runs")
        if not paths:
            raise ValueError(f"{folder}: no run records in {folder / 'runs'}")
        for path in paths:
            record = record_store.read_if_present(path)
            if record is None or "flags" not in record or "arm" not in record:
                raise ValueError(f"{path}: not a readable run record")
            match = ARM.fullmatch(record["arm"])
            if match is None or match[2] not in NORMS:
                continue  # a rival placement's run: the grid compares Pre-LN and LNS
            if budget is None:
                budget, first = budget_of(record), path
            elif budget_of(record) != budget:
                raise ValueError(f"{path}: trained or analysed unlike {first} (beyond the rate, the arm and the "
                                 "seed): the folders are not one budget's grid")
            arm = point_name(int(match[1]), match[2], rate_of(record))
            name = f"{arm}-seed{record['seed']}"
            if name in grid:
                raise ValueError(f"{path}: a second record of {arm} at seed {record['seed']}")
            grid[name] = dict(record, arm=arm)
    return grid


def points(grid: dict[str, dict]) -> dict[str, dict[int, dict[float, dict[int, float | None]]]]:
    """{norm: {depth: {rate: {seed: eval loss}}}}, sorted by depth and rate."""
    found = {}
    for record in grid.values():
        depth, norm = ARM.match(record["arm"]).groups()
        found.setdefault(norm, {}).setdefault(int(depth), {}).setdefault(rate_of(record), {})
    for norm, depths in found.items():
        for depth, rates in depths.items():
            for rate in rates:
                rates[rate] = by_seed(grid, point_name(depth, norm, rate), "eval_loss")
    return {norm: {depth: dict(sorted(found[norm][depth].items())) for depth in sorted(found[norm])}
            for norm in NORMS if norm in found}


def mean_loss(per_seed: dict[int, float | None]) -> float | None:
    values = [v for v in per_seed.values() if v is not None]
    return float(np.mean(values)) if values else None


def best_of(rates: dict[float, dict[int, float | None]], allowed) -> float | None:
    """The rate, of those in `allowed`, with the lowest mean eval loss over the seeds finished at each of them, so
    that a rate trained at more seeds is not judged on other seeds than the rest (seed noise is as large as some rate
    effects); each rate's own seeds when they share none. None when none of them finished."""
    finished = {rate: {seed: loss for seed, loss in per_seed.items() if loss is not None}
                for rate, per_seed in rates.items() if rate in allowed}
    finished = {rate: losses for rate, losses in finished.items() if losses}
    if not finished:
        return None
    shared = set.intersection(*(set(losses) for losses in finished.values()))
    means = {rate: float(np.mean([loss for seed, loss in losses.items() if not shared or seed in shared]))
             for rate, losses in finished.items()}
    return min(means, key=means.get)


def best_rates(table) -> dict[str, dict[int, float]]:
    """{norm: {depth: the rate of the lowest mean eval loss (best_of)}} over the points with a finished run."""
    best = {}
    for norm, depths in table.items():
        for depth, rates in depths.items():
            if (chosen := best_of(rates, rates)) is not None:
                best.setdefault(norm, {})[depth] = chosen
    return best


def at_shared_best(table, point_a: tuple[str, int], point_b: tuple[str, int]) -> tuple | None:
    """Two (norm, depth) points, each at its best of the rates both trained, so that neither is favoured by a rate
    the other never tried: (grid name of a, of b, rate of a, rate of b, a note naming the shared rates when the two
    grids differ). None when they share no rate at which both finished."""
    (norm_a, depth_a), (norm_b, depth_b) = point_a, point_b
    rates_a, rates_b = table[norm_a][depth_a], table[norm_b][depth_b]
    shared = sorted(set(rates_a) & set(rates_b))
    rate_a, rate_b = best_of(rates_a, shared), best_of(rates_b, shared)
    if rate_a is None or rate_b is None:
        return None
    note = "" if set(rates_a) == set(rates_b) else (
        " (of the rates both trained: " + ", ".join(f"{rate:g}" for rate in shared) + ")")
    return point_name(depth_a, norm_a, rate_a), point_name(depth_b, norm_b, rate_b), rate_a, rate_b, note


def compare(grid: dict[str, dict], a: str, b: str, claim: str, labels: tuple[str, str]) -> verdicts.Verdict:
    """b's loss below a's: the eval loss paired by seed, or with one shared seed the held-out documents' loss."""
    return claims.loss_verdict(grid, a, b, claim, labels,
                               documents_what="the loss per word (nats; not the trainer's eval loss)")


def grid_verdicts(grid, table) -> dict[str, list[verdicts.Verdict]]:
    """Each point at its best of the rates it shares with the other: each arm between consecutive depths and LNS
    against Pre-LN at each depth; and at each point, each rate it trained against its neighbour one step nearer the
    reference rate (the most common one, the budget's)."""
    found = {"depth": [], "lns_vs_pre": [], "tuning": []}
    for norm, label in NORMS.items():
        depths = sorted(table.get(norm, {}))
        for shallow, deep in zip(depths, depths[1:]):
            if chosen := at_shared_best(table, (norm, shallow), (norm, deep)):
                a, b, rate_a, rate_b, note = chosen
                found["depth"].append(compare(grid, a, b, f"{label} at its best rates: L={deep} (lr {rate_b:g}) "
                                              f"reaches a lower loss than L={shallow} (lr {rate_a:g}){note}", (a, b)))
    for depth in sorted(set(table.get("pre", {})) & set(table.get("lns", {}))):
        if chosen := at_shared_best(table, ("pre", depth), ("lns", depth)):
            a, b, rate_a, rate_b, note = chosen
            found["lns_vs_pre"].append(compare(grid, a, b, f"L={depth}, each at its best rate: LNS (lr {rate_b:g}) "
                                               f"reaches a lower loss than Pre-LN (lr {rate_a:g}){note}", (a, b)))
    reference = reference_rate(table)
    for norm, depths in table.items():
        for depth, rates in depths.items():
            for rate, inner in steps_outward(sorted(rates), reference):
                a, b = point_name(depth, norm, inner), point_name(depth, norm, rate)
                found["tuning"].append(compare(grid, a, b, f"{NORMS[norm]} at L={depth}: lr {rate:g} reaches a "
                                                           f"lower loss than lr {inner:g}", (a, b)))
    return found


def steps_outward(rates: list[float], reference: float) -> list[tuple[float, float]]:
    """Each rate with its neighbour one step nearer the reference: whether each step out along the grid still pays
    (4e-3 is judged against 2e-3, not 1e-3). Nothing where the point never trained the reference."""
    if reference not in rates:
        return []
    at = rates.index(reference)
    return [(rates[i], rates[i + 1]) for i in range(at)] + [(rates[i], rates[i - 1]) for i in range(at + 1, len(rates))]


def reference_rate(table) -> float:
    """The rate most points trained at (the budget's); the smallest of a tie."""
    counts = Counter(rate for depths in table.values() for rates in depths.values() for rate in rates)
    return min(counts, key=lambda rate: (-counts[rate], rate))


def loss_cell(per_seed: dict[int, float | None]) -> str:
    values = [v for v in per_seed.values() if v is not None]
    if not values:
        return "diverged" if per_seed else "n/a"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    mean, low, high = verdicts.paired_t_interval(values)
    return f"{mean:.3f} [{low:.3f}, {high:.3f}] ({len(values)} seeds)"


def table_text(table, best) -> str:
    rates = sorted({rate for depths in table.values() for rates in depths.values() for rate in rates})
    lines = ["| arm | L | " + " | ".join(f"lr {rate:g}" for rate in rates) + " | best rate |",
             "|---|---|" + "---|" * (len(rates) + 1)]
    for norm, depths in table.items():
        for depth, trained in depths.items():
            cells = []
            for rate in rates:
                cell = loss_cell(trained[rate]) if rate in trained else "not trained"
                cells.append(f"**{cell}**" if best.get(norm, {}).get(depth) == rate else cell)
            chosen = best.get(norm, {}).get(depth)
            edge = chosen is not None and len(trained) > 1 and chosen in (min(trained), max(trained))
            where = "n/a" if chosen is None else f"{chosen:g}" + (" (the grid's edge)" if edge else "")
            if chosen is not None and len(trained) == 1:
                where += " (the only rate trained)"
            lines.append(f"| {NORMS[norm]} | {depth} | " + " | ".join(cells) + f" | {where} |")
    return "\n".join(lines)


def plot(table, path: Path) -> Path:
    """Eval loss against depth, one panel per arm, one line per rate (mean over seeds)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(table), figsize=(5 * len(table), 3.8), squeeze=False, sharey=True)
    rates = sorted({rate for depths in table.values() for rates in depths.values() for rate in rates})
    for ax, (norm, depths) in zip(axes.flat, table.items()):
        for rate in rates:
            xs = [(d, mean_loss(r[rate])) for d, r in depths.items() if rate in r and mean_loss(r[rate]) is not None]
            if xs:
                ax.plot(*zip(*xs), marker="o", label=f"lr {rate:g}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(depths), [str(d) for d in sorted(depths)])
        ax.set_title(NORMS[norm], fontsize=10)
        ax.set_xlabel("layers L")
        ax.legend(fontsize=8)
    axes.flat[0].set_ylabel("eval loss (nats/token)")
    fig.suptitle("Eval loss against depth at each learning rate", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def write(folders: list[Path], out: Path, argv: list[str]) -> dict:
    grid = read_grid(folders)
    table = points(grid)
    best = best_rates(table)
    found = grid_verdicts(grid, table)
    out.mkdir(parents=True, exist_ok=True)
    plot(table, out / "lr_grid.png")
    sections = {"depth": "## Does depth pay once each depth has its best rate?",
                "lns_vs_pre": "## Does LNS still lead once each arm has its best rate?",
                "tuning": "## Each step out from the reference rate, point by point"}
    text = ["# Learning-rate grid of a depth sweep", "",
            f"Generated by `python -m utils.study.lr_grid {' '.join(argv)}` from {len(grid)} run records in "
            + ", ".join(f"`{folder}`" for folder in folders) + ".", "",
            "Eval loss (nats/token) at the last update, per arm, depth and peak learning rate; the lowest of each "
            "row in bold. A point's best rate is chosen on this loss. The verdicts below compare two points each at "
            "its best of the rates both trained, so that neither gains from a rate the other never tried (the choice "
            "and the test read overlapping validation text, so their intervals are somewhat optimistic).", "",
            table_text(table, best), "", "![eval loss against depth at each rate](lr_grid.png)"]
    for key, heading in sections.items():
        text += ["", heading, ""]
        text += [f"- {v.line()}" for v in found[key]] or ["Nothing to compare yet."]
    (out / "lr_grid.md").write_text("\n".join(text) + "\n")
    summary = dict(folders=[str(f) for f in folders], reference_rate=reference_rate(table),
                   eval_loss={norm: {str(d): {f"{r:g}": {str(s): v for s, v in per_seed.items()}
                                             for r, per_seed in rates.items()} for d, rates in depths.items()}
                              for norm, depths in table.items()},
                   best_rate={norm: {str(d): rate for d, rate in depths.items()} for norm, depths in best.items()},
                   verdicts={key: [v.as_dict() for v in vs] for key, vs in found.items()})
    (out / "lr_grid.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="python -m utils.study.lr_grid", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", type=Path, help="report folders of one depth sweep at several --lr")
    parser.add_argument("--out", type=Path, default=None, help="where lr_grid.md/.json/.png go")
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    if len(set(args.folders)) < 2:
        parser.error("folders: give the report folders of at least two rates")
    out = args.out or args.folders[0].with_name(args.folders[0].name + "_lr_grid")
    try:
        write(args.folders, out, argv)
    except ValueError as error:
        parser.error(str(error))
    print(out / "lr_grid.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
