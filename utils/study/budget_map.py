"""The token budget × depth map (issue 64): at which budgets does LNS's lead over Pre-LN grow with depth?

One depth sweep per budget, all at one shared rate, read together; and, where a budget also has a learning-rate grid,
each arm at its own best rate beside the shared one:

    python -m utils.study.budget_map docs/depth_sweep_wikipedia_2400_lr0.002 docs/depth_sweep_wikipedia_5000_lr0.002 \\
        docs/depth_sweep_wikipedia_lr0.002 --grid docs/depth_sweep_wikipedia docs/depth_sweep_wikipedia_lr0.004

A budget is a run's number of updates (each a finished run: the cosine fully decayed), read from its records; the
folders must otherwise hold one sweep (same model but its depth, data, batch, schedule shape and analyses). The lead
is Pre-LN − LNS eval loss, paired by seed, so a positive lead is LNS ahead. Per budget the lead's slope against ln L
is fitted per seed and judged over seeds (a Student-t interval); the interaction verdict asks, paired by seed,
whether that slope differs between two budgets over the depths both have. Writes budget_map.md, .json and .png in
--out (default: docs/depth_sweep_wikipedia_budget_map).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from peft_pretraining.cli import OneLineErrorParser
from utils.study import lr_grid, verdicts
from utils.study import records as record_store
from utils.study.measures import by_seed
from utils.study.plots import pyplot, save_figure
from utils.study.runs import REPO
from utils.study.sweep import NORMS, evidence_note, slope_by_seed, slope_verdict

# Flags that differ between the runs of one map: a run's point (its updates and warmup, its depth's config, its
# arm) and its seed. The rate is not among them: the map's folders share one.
PER_RUN_FLAGS = ("--seed", "--norm_type", "--num_training_steps", "--warmup_steps")
DEFAULT_OUT = REPO / "docs/depth_sweep_wikipedia_budget_map"


def updates_of(record: dict) -> int:
    return record_store.fields(record).updates


def read_folder(folder: Path) -> dict[str, dict]:
    """{run name: record} of a folder's Pre-LN and LNS runs (rivals are left out). ValueError naming the file for a
    record that does not read."""
    paths = record_store.paths_in(folder / "runs")
    if not paths:
        raise ValueError(f"{folder}: no run records in {folder / 'runs'}")
    found = {}
    for path in paths:
        record = record_store.read_if_present(path)
        if record is None or "flags" not in record or "arm" not in record:
            raise ValueError(f"{path}: not a readable run record")
        match = lr_grid.ARM.fullmatch(record["arm"])
        if match and match[2] in NORMS:
            found[record_store.name_of(path)] = record
    return found


def read_map(folders: list[Path]) -> tuple[dict[int, dict[str, dict]], float, dict[int, Path]]:
    """({updates: {run name: record}}, the shared rate, {updates: its folder}). ValueError for folders of another
    rate or sweep, or two folders of one budget."""
    budgets, folder_of, shape, rate, first = {}, {}, None, None, None
    for folder in folders:
        records = read_folder(folder)
        steps = {updates_of(r) for r in records.values()}
        if len(steps) != 1:
            raise ValueError(f"{folder}: its records train for {sorted(steps)} updates; a folder holds one budget")
        (updates,) = steps
        if updates in budgets:
            raise ValueError(f"{folder}: a second folder of the {updates:,}-update budget (after {folder_of[updates]})")
        for name, record in records.items():
            record_shape = lr_grid.budget_of(record, PER_RUN_FLAGS)
            if shape is None:
                shape, rate, first = record_shape, lr_grid.rate_of(record), record_store.find(folder / "runs", name)
            elif lr_grid.rate_of(record) != rate:
                raise ValueError(f"{folder}: trained at lr {lr_grid.rate_of(record):g}, {first} at {rate:g}; the "
                                 "map's folders share one rate (give other rates with --grid)")
            elif record_shape != shape:
                raise ValueError(f"{record_store.find(folder / 'runs', name)}: trained or analysed unlike {first} "
                                 "(beyond the budget, the depth, the arm and the seed)")
        budgets[updates], folder_of[updates] = records, folder
    return dict(sorted(budgets.items())), rate, folder_of


def depths_of(records: dict[str, dict]) -> list[int]:
    """The depths at which both arms have a finished run at some seed."""
    found = {norm: {int(lr_grid.ARM.match(r["arm"])[1]) for r in records.values()
                    if lr_grid.ARM.match(r["arm"])[2] == norm and r.get("status") == "finished"} for norm in NORMS}
    return sorted(found["pre"] & found["lns"])


def lead_by_depth(records: dict[str, dict], depths: list[int]) -> dict[int, dict[int, float]]:
    """{depth: {seed: Pre-LN − LNS eval loss}} for the seeds where both arms finished."""
    table = {}
    for depth in depths:
        pre, lns = (by_seed(records, f"L{depth}-{norm}", "eval_loss") for norm in NORMS)
        table[depth] = {seed: pre[seed] - lns[seed] for seed in sorted(pre)
                        if pre[seed] is not None and lns.get(seed) is not None}
    return table


def mean_interval(values: list[float]) -> dict:
    """The mean, and with two values or more its 95% t interval."""
    if len(values) >= 2:
        mean, low, high = verdicts.paired_t_interval(values)
        return dict(mean=mean, low=low, high=high, n=len(values))
    return dict(mean=values[0] if values else None, low=None, high=None, n=len(values))


def interval_text(summary: dict, digits: int = 3) -> str:
    if summary["mean"] is None:
        return "n/a"
    if summary["low"] is None:
        return f"{summary['mean']:+.{digits}f} (1 seed)"
    mean, low, high = (f"{summary[key]:+.{digits}f}" for key in ("mean", "low", "high"))
    return f"{mean} [{low}, {high}] ({summary['n']})"


def at_every_depth(table: dict[int, dict[int, float | None]]) -> dict[int, dict[int, float | None]]:
    """The table without the seeds that lack some depth (still training): a slope over fewer depths than the others'
    would judge another quantity, and the verdicts name a seed left out this way as missing, not as diverged."""
    shared = set.intersection(*(set(per_seed) for per_seed in table.values())) if table else set()
    return {depth: {seed: v for seed, v in per_seed.items() if seed in shared} for depth, per_seed in table.items()}


def lead_slope(lead: dict[int, dict[int, float]], depths: list[int], claim: str) -> tuple[verdicts.Verdict, dict]:
    """The lead's slope against ln L over `depths`, per seed with every one of them, judged over seeds (+1: the lead
    grows with depth); also the per-seed slopes."""
    slopes = slope_by_seed(at_every_depth({d: lead[d] for d in depths}), False)
    return slope_verdict(claim, +1, slopes), slopes


def arm_slopes(records: dict[str, dict], depths: list[int], updates: int) -> dict[str, tuple]:
    """Per arm: does adding layers lower the eval loss at this budget (the slope against ln L, -1: depth pays)?
    (the verdict, the per-seed slopes)."""
    found = {}
    for norm, label in NORMS.items():
        slopes = slope_by_seed(at_every_depth({d: by_seed(records, f"L{d}-{norm}", "eval_loss") for d in depths}),
                               False)
        found[norm] = (slope_verdict(f"{updates:,} updates: {label}'s eval loss falls with depth (slope vs ln L)", -1,
                                     slopes), slopes)
    return found


def arm_losses(records: dict[str, dict], depths: list[int]) -> dict[str, dict[int, dict]]:
    """{norm: {depth: mean [interval] of the eval loss over seeds}}."""
    return {norm: {d: mean_interval([v for v in by_seed(records, f"L{d}-{norm}", "eval_loss").values()
                                     if v is not None]) for d in depths} for norm in NORMS}


def interaction(short: int, long: int, slopes: dict[int, dict[int, float | None]],
                verdict_at: dict[int, verdicts.Verdict], depths: list[int]) -> dict:
    """Does the lead's slope against ln L (over `depths`) differ between two budgets, paired by seed? And does it
    change sign: both budgets' slopes excluding zero, on opposite sides?"""
    verdict = verdicts.judge_seeds(
        f"The lead's slope vs ln L (L = {', '.join(map(str, depths))}) is larger at {short:,} than at {long:,} "
        f"updates ({short:,} − {long:,})", +1, slopes[long], slopes[short], (f"{long:,}", f"{short:,}"))
    a, b = verdict_at[short], verdict_at[long]
    opposite_sides = {a.status, b.status} == {verdicts.REPRODUCED, verdicts.OPPOSITE}
    if opposite_sides:
        upward, downward = (short, long) if a.status == verdicts.REPRODUCED else (long, short)
        words = f"the slope changes sign: it excludes zero upward at {upward:,} updates and downward at {downward:,}"
    elif verdict.status in (verdicts.REPRODUCED, verdicts.OPPOSITE):
        words = ("the slope differs between the budgets beyond noise, but a change of sign is not shown (at least one "
                 "budget's own slope is inside noise or not measurable)")
    elif verdict.status == verdicts.INSIDE_NOISE:
        words = "no change of the slope between the budgets is shown (its difference is inside noise)"
    else:
        words = "not judged: " + verdict.reason
    return dict(short=short, long=long, depths=depths, difference=verdict, sign_change=opposite_sides, words=words)


def best_rate_leads(grid: dict[str, dict]) -> list[dict]:
    """Each depth where both arms trained at some shared rate: each arm at its best of the rates both tried there,
    the lead per seed, and the verdict (with one shared seed, on the held-out articles)."""
    table = lr_grid.points(grid)
    found = []
    for depth in sorted(set(table.get("pre", {})) & set(table.get("lns", {}))):
        chosen = lr_grid.at_shared_best(table, ("pre", depth), ("lns", depth))
        if chosen is None:
            continue
        pre, lns, rate_pre, rate_lns, _ = chosen
        tried = sorted(set(table["pre"][depth]) & set(table["lns"][depth]))
        verdict = lr_grid.compare(grid, pre, lns, f"L={depth}, each arm at its best rate: LNS (lr {rate_lns:g}) "
                                                  f"reaches a lower eval loss than Pre-LN (lr {rate_pre:g})",
                                  ("Pre-LN", "LNS"))
        pre_loss, lns_loss = by_seed(grid, pre, "eval_loss"), by_seed(grid, lns, "eval_loss")
        lead = {seed: pre_loss[seed] - lns_loss[seed] for seed in sorted(pre_loss)
                if pre_loss[seed] is not None and lns_loss.get(seed) is not None}
        found.append(dict(depth=depth, rate_pre=rate_pre, rate_lns=rate_lns, rates_tried=tried, lead=lead,
                          verdict=verdict))
    return found


def seed_depths_note(lead: dict[int, dict[int, float]]) -> str:
    """Which seeds the slope leaves out because they lack some depth (a budget part-way through its seeds), and the
    depths each still lacks; '' when every seed has every depth."""
    seeds = sorted({seed for per_seed in lead.values() for seed in per_seed})
    lacking = {seed: [d for d, per_seed in lead.items() if seed not in per_seed] for seed in seeds}
    lacking = {seed: depths for seed, depths in lacking.items() if depths}
    if not lacking:
        return ""
    return "left out of the slope until they have every depth: " + "; ".join(
        f"seed {seed} (no L = {', '.join(map(str, d))})" for seed, d in lacking.items())


def budget_entry(updates: int, records: dict[str, dict], settings: dict) -> dict:
    depths = depths_of(records)
    lead = lead_by_depth(records, depths)
    verdict, slopes = lead_slope(lead, depths, f"{updates:,} updates: LNS's lead grows with depth (slope of Pre-LN − "
                                               "LNS vs ln L)")
    note = "; ".join(filter(None, [evidence_note(verdict, depths), seed_depths_note(lead)]))
    return dict(updates=updates, tokens=updates * settings["batch"] * settings["length"], depths=depths, lead=lead,
                lead_summary={d: mean_interval(list(lead[d].values())) for d in depths}, slope=verdict,
                slopes=slopes, slope_note=note,
                arm_slopes=arm_slopes(records, depths, updates), losses=arm_losses(records, depths))


def pair_comparison(short: dict, long: dict) -> dict | None:
    """Two budgets compared over the depths both have: each one's slope of the lead over them, and the interaction.
    None when they share fewer than two depths."""
    depths = sorted(set(short["depths"]) & set(long["depths"]))
    if len(depths) < 2:
        return None
    verdict_at, slopes_at = {}, {}
    over = ", ".join(map(str, depths))
    for entry in (short, long):
        verdict_at[entry["updates"]], slopes_at[entry["updates"]] = lead_slope(
            entry["lead"], depths, f"{entry['updates']:,} updates: the lead's slope over L = {over}")
    found = interaction(short["updates"], long["updates"], slopes_at, verdict_at, depths)
    # a budget's slope over fewer depths than its own: printed beside the comparison (its own is in the table)
    found["slopes_over_shared"] = [verdict_at[e["updates"]] for e in (short, long) if e["depths"] != depths]
    return found


def curve_lead(records: dict[str, dict], depth: int, step: int) -> tuple[int, dict]:
    """(the eval step nearest `step`, {seed: Pre-LN − LNS eval loss there}) from the runs' eval curves."""
    curves = {norm: {r["seed"]: dict((int(s), v) for s, v in r.get("eval_curve", [])) for r in records.values()
                     if r["arm"] == f"L{depth}-{norm}" and r.get("status") == "finished"} for norm in NORMS}
    steps = sorted({s for curve in curves["pre"].values() for s in curve})
    if not steps:
        return step, {}
    nearest = min(steps, key=lambda s: (abs(s - step), s))
    return nearest, {seed: curve[nearest] - curves["lns"][seed][nearest]
                     for seed, curve in sorted(curves["pre"].items())
                     if nearest in curve and nearest in curves["lns"].get(seed, {})}


def mid_run_table(budgets: dict[int, dict[str, dict]], entries: dict[int, dict]) -> str:
    lines = ["| read at | from | " + " | ".join(f"lead at L = {d}" for d in sorted(set().union(
        *(e["depths"] for e in entries.values())))) + " |"]
    depths = sorted(set().union(*(e["depths"] for e in entries.values())))
    lines.append("|---|---|" + "---|" * len(depths))
    for short in entries:
        for long in (u for u in entries if u > short):
            cells, read_at = [], None
            for depth in depths:
                if depth not in entries[long]["depths"]:
                    cells.append("not trained")
                    continue
                read_at, lead = curve_lead(budgets[long], depth, short)
                cells.append(interval_text(mean_interval(list(lead.values()))))
            lines.append(f"| update {read_at:,} | the {long:,}-update runs | " + " | ".join(cells) + " |")
        finished = [interval_text(entries[short]["lead_summary"][d]) if d in entries[short]["depths"] else "not trained"
                    for d in depths]
        if short != max(entries):
            lines.append(f"| update {short:,} | the finished {short:,}-update runs | " + " | ".join(finished) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------ output


def plot(entries: dict[int, dict], best: list[dict], best_updates: int | None, path: Path) -> Path:
    """Left: the lead against depth, one line per budget, 95% t intervals over seeds; right: each arm's eval loss
    against depth per budget (solid Pre-LN, dashed LNS)."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for colour, (updates, entry) in zip(colours, entries.items()):
        depths = entry["depths"]
        summary = [entry["lead_summary"][d] for d in depths]
        means = [s["mean"] for s in summary]
        errors = [[s["mean"] - s["low"] if s["low"] is not None else 0 for s in summary],
                  [s["high"] - s["mean"] if s["high"] is not None else 0 for s in summary]]
        seeds = max(s["n"] for s in summary)
        left.errorbar(depths, means, yerr=errors, marker="o", capsize=3, color=colour,
                      label=f"{updates:,} updates ({seeds} seed{'s' * (seeds > 1)})")
        for norm, style in (("pre", "-"), ("lns", "--")):
            losses = [entry["losses"][norm][d]["mean"] for d in depths]
            right.plot(depths, losses, style, marker="o", color=colour, label=f"{NORMS[norm]}, {updates:,}")
    if best:
        depths = [b["depth"] for b in best]
        means = [mean_interval(list(b["lead"].values()))["mean"] for b in best]
        left.plot(depths, means, ":", marker="s", color="0.3",
                  label=f"{best_updates:,} updates, each arm at its best rate")
    left.axhline(0, color="0.5", linewidth=0.8)
    left.set(ylabel="lead: Pre-LN − LNS eval loss (nats)", title="LNS's lead against depth")
    right.set(ylabel="eval loss (nats/token)", title="Each arm's eval loss against depth")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ticks = sorted({d for e in entries.values() for d in e["depths"]})
        ax.set_xticks(ticks, [str(d) for d in ticks])
        ax.set_xlabel("layers L")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return save_figure(fig, path)


def verdict_cell(v: verdicts.Verdict, slopes: dict[int, float | None] | None = None) -> str:
    """A slope verdict in a table cell; without an interval (one seed), each seed's own slope as a sign."""
    if v.effect is not None:
        return f"{v.effect:+.4f} [{v.low:+.4f}, {v.high:+.4f}], {v.n_pairs} seeds: {v.status}"
    signs = [f"seed {seed}: {slope:+.4f}" for seed, slope in (slopes or {}).items() if slope is not None]
    return f"{'; '.join(signs)} (one seed: a sign, no interval)" if signs else v.status


def map_table(entries: dict[int, dict]) -> str:
    depths = sorted({d for e in entries.values() for d in e["depths"]})
    lines = ["| updates (tokens) | " + " | ".join(f"lead at L = {d}" for d in depths)
             + " | slope of the lead vs ln L | depth pays for Pre-LN | depth pays for LNS |",
             "|---|" + "---|" * (len(depths) + 3)]
    for updates, e in entries.items():
        leads = [interval_text(e["lead_summary"][d]) if d in e["depths"] else "not trained" for d in depths]
        pays = [verdict_cell(*e["arm_slopes"][norm]) for norm in NORMS]
        lines.append(f"| {updates:,} ({e['tokens'] / 1e6:.1f}M) | " + " | ".join(leads)
                     + f" | {verdict_cell(e['slope'], e['slopes'])} | " + " | ".join(pays) + " |")
    return "\n".join(lines)


def write(folders: list[Path], grid_folders: list[Path], out: Path, argv: list[str]) -> dict:
    budgets, rate, folder_of = read_map(folders)
    some = next(iter(next(iter(budgets.values())).values()))
    settings = dict(batch=record_store.fields(some).batch, length=record_store.fields(some).length)
    entries = {updates: budget_entry(updates, records, settings) for updates, records in budgets.items()}
    # A budget with fewer than two depths has no slope yet: it waits outside the comparison.
    sloped = {updates: e for updates, e in entries.items() if len(e["depths"]) >= 2}
    waiting = [updates for updates in entries if updates not in sloped]
    # Each pair of budgets over the depths both have, so that a budget still landing its depths narrows only its own
    # comparisons.
    budget_list = list(sloped)
    pairs = list(zip(budget_list, budget_list[1:]))
    if len(budget_list) > 2:
        pairs.append((budget_list[0], budget_list[-1]))
    interactions = [found for a, b in pairs if (found := pair_comparison(sloped[a], sloped[b])) is not None]

    best, best_updates = [], None
    if grid_folders:
        grid_budgets = {updates_of(next(iter(read_folder(f).values()))) for f in grid_folders}
        if len(grid_budgets) != 1 or not grid_budgets <= set(budgets):
            raise ValueError(f"--grid: the folders must hold one of the map's budgets ({', '.join(map(str, budgets))} "
                             f"updates), got {sorted(grid_budgets)}")
        (best_updates,) = grid_budgets
        best = best_rate_leads(lr_grid.read_grid([folder_of[best_updates], *grid_folders]))

    out.mkdir(parents=True, exist_ok=True)
    png = plot(entries, best, best_updates, out / "budget_map.png")
    text = ["# The token budget × depth map: does LNS's lead grow with depth?", "",
            f"Generated by `python -m utils.study.budget_map {' '.join(argv)}` from "
            + ", ".join(f"`{f}`" for f in [*folders, *grid_folders]) + ".", "",
            f"Each budget is a finished run (cosine fully decayed) at lr {rate:g}; only the number of updates changes "
            "between budgets. The lead is Pre-LN − LNS eval loss (nats), paired by seed: positive means LNS is "
            "ahead. Cells give the mean over seeds with its 95% t interval and seed count; the slope is fitted per "
            "seed against ln L and judged over seeds (+: the lead grows with depth, the paper's direction). 'Depth "
            "pays' is each arm's own slope of eval loss against ln L (reproduced: deeper is better).", "",
            map_table(entries), "", f"![the lead and the losses against depth per budget]({png.name})", "",
            "## What each slope rests on", ""]
    text += [f"- {e['slope'].claim}: {e['slope_note'] or 'see the table'}" for e in entries.values()]
    text += ["", "## Does the slope change between budgets? (paired by seed, over the depths both budgets have)", ""]
    if waiting:
        text += [f"Not compared yet (fewer than two depths trained): {', '.join(f'{u:,}' for u in waiting)} "
                 "updates.", ""]
    shown = set()  # a budget's slope over the shared depths, printed at its first comparison only
    for i in interactions:
        text += [f"- {i['difference'].line()}"]
        text += [f"  - {i['words']}"] if i["difference"].status != verdicts.NOT_MEASURABLE else []
        text += [f"  - beside it, {v.line()}" for v in i["slopes_over_shared"] if v.claim not in shown]
        shown |= {v.claim for v in i["slopes_over_shared"]}
    if not interactions:
        text += ["Nothing to compare yet."]
    text += ["", "## A mid-run read is not a finished run", "",
             "The lead read off the longer budgets' eval curves at the shorter budgets' update counts (the nearest "
             "eval), beside the finished shorter runs. Under a cosine schedule a mid-run model still has a high rate, "
             "so the two can differ; only the finished runs are the map.", "", mid_run_table(budgets, entries)]
    text += ["", "## Each arm at its own best rate", ""]
    if best:
        text += [f"At {best_updates:,} updates, where the learning-rate grid trained both arms: each arm at its best "
                 "of the rates both tried at that depth (chosen on the mean eval loss over the seeds every rate has, "
                 "the same validation text the verdict reads, so its interval is somewhat optimistic). The "
                 "shared-rate lead is the table above.",
                 "", "| L | rates tried | Pre-LN's best | LNS's best | lead at the best rates |",
                 "|---|---|---|---|---|"]
        text += [f"| {b['depth']} | {', '.join(f'{r:g}' for r in b['rates_tried'])} | {b['rate_pre']:g} | "
                 f"{b['rate_lns']:g} | {interval_text(mean_interval(list(b['lead'].values())))} |" for b in best]
        text += [""] + [f"- {b['verdict'].line()}" for b in best]
        if len(best) >= 2:
            verdict, _ = lead_slope({b["depth"]: b["lead"] for b in best}, [b["depth"] for b in best],
                                    f"{best_updates:,} updates, each arm at its best rate: the lead grows with depth "
                                    "(slope vs ln L, per seed with every depth at the best rates)")
            left_out = seed_depths_note({b["depth"]: b["lead"] for b in best})
            text += [f"- {verdict.line()}" + (f"; {left_out}" if left_out else "")]
            if verdict.effect is None:
                text += [f"  - seed {seed}'s own slope: {slope:+.4f} (a sign at one seed, not a verdict)"
                         for seed, slope in slope_by_seed(at_every_depth({b["depth"]: b["lead"] for b in best}),
                                                          False).items() if slope is not None]
    else:
        text += ["No learning-rate grid was given (--grid)."]
    (out / "budget_map.md").write_text("\n".join(text) + "\n")
    summary = dict(folders=[str(f) for f in folders], grid_folders=[str(f) for f in grid_folders], rate=rate,
                   budgets={str(u): dict(tokens=e["tokens"], depths=e["depths"],
                                         lead={str(d): {str(s): v for s, v in per.items()}
                                               for d, per in e["lead"].items()},
                                         slope=e["slope"].as_dict(), slope_note=e["slope_note"],
                                         depth_pays={n: v.as_dict() for n, (v, _) in e["arm_slopes"].items()})
                            for u, e in entries.items()},
                   interactions=[dict(i, difference=i["difference"].as_dict(),
                                      slopes_over_shared=[v.as_dict() for v in i["slopes_over_shared"]])
                                 for i in interactions],
                   best_rates=[dict(b, lead={str(s): v for s, v in b["lead"].items()}, verdict=b["verdict"].as_dict())
                               for b in best], best_rate_updates=best_updates)
    (out / "budget_map.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="python -m utils.study.budget_map", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", type=Path, help="depth-sweep report folders, one per budget, one rate")
    parser.add_argument("--grid", nargs="*", type=Path, default=[],
                        help="report folders of other rates at one of the budgets (its learning-rate grid)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where budget_map.md/.json/.png go")
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    if len(set(args.folders)) < 2:
        parser.error("folders: give the report folders of at least two budgets")
    try:
        write(args.folders, args.grid, args.out, argv)
    except ValueError as error:
        parser.error(str(error))
    print(args.out / "budget_map.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
