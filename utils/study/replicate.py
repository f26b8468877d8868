"""Which verdicts of a study survive a second run of it: two report folders of one study, side by side.

A replicate is the same study trained again, with the same flags and settings, usually on another host. Float kernels
round differently from host to host, and a deep model amplifies the difference over its updates (docs/study.md), so
a replicate says how much of a report is the study and how much is its one set of runs.

    python -m utils.study.replicate docs/depth_sweep docs/depth_sweep_avx2
    python -m utils.study.replicate docs/depth_sweep_mixed_compile elsewhere --suffix _rivals   # summary_rivals.json

The two must be the same study: the same budget and settings, and every run both hold trained with the same flags
(a --dtype or --compile makes another study) and analysed with the same settings. Every verdict of the two summaries
is matched by where it sits (its section, its measure, its claim). Where both measured it in the same units, a
verdict *keeps its status* when it is the same in both (reproduced, inside noise, opposite, not reproduced); the table
also says whether the two 95% intervals overlap. A verdict judged over seeds in one and over one seed's documents in
the other (a replicate part-way through) is listed apart, not compared. So is a verdict that only one of them could
measure (a measure the other's records predate), and so are verdicts only one summary holds. Per run of the summary:
its status and eval loss in both, and the scalar measures that moved most, in relative terms (values of at least
0.01) and in absolute terms. Writes replication<suffix>.md and .json in the replicate's folder, or in --out.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from peft_pretraining.cli import OneLineErrorParser
from utils.study import records as record_store
from utils.study.host import records_machines
from utils.study.measures import MEASURES, finite_or_none, measures_at
from utils.study.runs import recorded_settings
from utils.study.verdicts import NOT_MEASURABLE

# Settings that say where a report goes or in which order its runs train, not what it measured.
WHERE_SETTINGS = ("out", "runs_dir", "report_suffix", "first_depths")
# Below this size a relative difference says little (a removal cost is a small difference of two log-likelihoods).
RELATIVE_FLOOR = 0.01


def verdicts_in(node, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], dict]:
    """{where: verdict} for every verdict (a dict with a claim and a status) in a summary; a list item is named by
    its measure or its claim, so that a verdict's place does not depend on the order of a list."""
    if isinstance(node, dict):
        if "claim" in node and "status" in node:
            return {path: node}
        found = {}
        for key, value in node.items():
            found.update(verdicts_in(value, (*path, str(key))))
        return found
    if isinstance(node, list):
        found = {}
        for index, item in enumerate(node):
            name = (item.get("measure") or item.get("claim")) if isinstance(item, dict) else None
            found.update(verdicts_in(item, (*path, name or str(index))))
        return found
    return {}


def interval_text(verdict: dict) -> str:
    if verdict.get("effect") is None:
        return f"{verdict['status']} ({verdict.get('reason') or 'not judged'})"
    return (f"{verdict['effect']:+.4g} [{verdict['low']:+.4g}, {verdict['high']:+.4g}], "
            f"{verdict['n_agree']}/{verdict['n_pairs']} {verdict['unit']}: {verdict['status']}")


def overlap(a: dict, b: dict) -> bool:
    return a["low"] <= b["high"] and b["low"] <= a["high"]


def read_report(folder: Path, which: str, suffix: str, parser: argparse.ArgumentParser
                ) -> tuple[dict, dict[str, dict]]:
    """The summary and the records of the runs it lists."""
    summary_path = folder / f"summary{suffix}.json"
    if not summary_path.is_file():
        parser.error(f"{which}: no report in {folder} (its {summary_path.name} is missing)")
    summary = read_json(summary_path, which, parser)
    records = {}
    for name in summary.get("runs", []):
        path = record_store.find(folder / "runs", name)
        if path is not None:
            records[name] = read_json(path, which, parser)
    return summary, records


def read_json(path: Path, which: str, parser: argparse.ArgumentParser) -> dict:
    """A report's summary or record; one line naming the file if it is not JSON (a half-written or damaged file)."""
    try:
        return record_store.read(path)
    except ValueError as error:
        parser.error(f"{which}: {path} is not readable JSON ({error})")


def settings_difference(original: dict, replicate: dict) -> str | None:
    """The first setting that makes the two reports different studies, or None."""
    if original.get("budget") != replicate.get("budget"):
        return f"budget: {original.get('budget')!r} against {replicate.get('budget')!r}"
    a, b = original.get("settings", {}), replicate.get("settings", {})
    for key in sorted(set(a) | set(b)):
        if key not in WHERE_SETTINGS and a.get(key) != b.get(key):
            return f"setting {key}: {a.get(key)!r} against {b.get(key)!r}"
    return None


def training_flags(record: dict) -> list[str]:
    """A record's flags, its model config named by file only (a sweep writes its configs into its runs folder)."""
    return list(record_store.setup_key(record, ())) if record.get("flags") else []


def runs_difference(original: dict[str, dict], replicate: dict[str, dict]) -> str | None:
    """The first run whose training flags or analysis settings differ between the two (a dtype or --compile is a
    different study), or None; two reports without a run in common are different studies too."""
    common = sorted(set(original) & set(replicate))
    if not common:
        return "no run in common"
    for name in common:
        a, b = training_flags(original[name]), training_flags(replicate[name])
        if a != b:
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            first_different = (a if len(a) > at else b)[at]
            start = at - 1 if at > 0 and not first_different.startswith("--") else at  # the flag with its value
            return (f"run {name}'s flags: {' '.join(a[start:start + 2]) or 'none'} against "
                    f"{' '.join(b[start:start + 2]) or 'none'}")
        if recorded_settings(original[name]) != recorded_settings(replicate[name]):
            return f"run {name}'s analysis settings"
    return None


def largest_differences(original: dict, replicate: dict) -> dict:
    """Of the scalar measures both runs have (the eval loss aside, shown on its own): the largest relative difference
    among values of at least RELATIVE_FLOOR, the largest absolute one, and how many were compared."""
    a, b = measures_at(original), measures_at(replicate)
    relative, absolute, compared = (0.0, None), (0.0, None), 0
    for measure in MEASURES:
        x, y = finite_or_none(a.get(measure)), finite_or_none(b.get(measure))
        if measure == "eval_loss" or x is None or y is None:
            continue
        compared += 1
        size = max(abs(x), abs(y))
        absolute = max(absolute, (abs(x - y), measure), key=lambda pair: pair[0])
        if size >= RELATIVE_FLOOR:
            relative = max(relative, (abs(x - y) / size, measure), key=lambda pair: pair[0])
    return dict(compared=compared, relative=relative[0], relative_measure=relative[1], absolute=absolute[0],
                absolute_measure=absolute[1])


def run_rows(original: dict[str, dict], replicate: dict[str, dict]) -> list[dict]:
    """Per run of either summary: its status in each, its eval loss in each, and where both finished, the measures
    that moved most."""
    rows = []
    for name in sorted(set(original) | set(replicate)):
        a, b = original.get(name), replicate.get(name)
        row = dict(run=name, status=[(a or {}).get("status", "absent"), (b or {}).get("status", "absent")],
                   eval_loss=[(a or {}).get("final_eval_loss"), (b or {}).get("final_eval_loss")])
        if row["status"] == ["finished", "finished"]:
            row.update(largest_differences(a, b))
        rows.append(row)
    return rows


def section(where: tuple[str, ...], verdict: dict) -> str:
    """Where a verdict sits, less its claim (a list item named by its claim): 'comparative / bi_deep / ratio'."""
    return " / ".join(part for part in where if part != verdict["claim"])


def compare_reports(original: dict, replicate: dict) -> dict:
    """Verdicts both measured (rows), verdicts measured in one only, and verdicts one summary lacks."""
    in_original, in_replicate = verdicts_in(original), verdicts_in(replicate)
    compared, measured_in_one, judged_apart, seen = [], [], [], set()
    for where in [w for w in in_original if w in in_replicate]:
        a, b = in_original[where], in_replicate[where]
        same_verdict = json.dumps([a, b], sort_keys=True)  # a summary may hold one verdict twice (per arm, and overall)
        if same_verdict in seen:
            continue
        seen.add(same_verdict)
        entry = dict(where=section(where, a), claim=a["claim"], original=a, replicate=b)
        measurable = (a["status"] != NOT_MEASURABLE, b["status"] != NOT_MEASURABLE)
        if all(measurable) and (a.get("unit"), a.get("scale")) != (b.get("unit"), b.get("scale")):
            judged_apart.append(entry)  # e.g. over seeds in one, over one seed's documents in the other
        elif all(measurable):
            compared.append(dict(entry, same_status=a["status"] == b["status"],
                                 intervals_overlap=overlap(a, b)))
        elif any(measurable):
            measured_in_one.append(dict(entry, measured_in="original" if measurable[0] else "replicate"))
    return dict(rows=compared, measured_in_one=measured_in_one, judged_apart=judged_apart,
                only_in_replicate=[dict(where=section(w, v), verdict=v)
                                   for w, v in in_replicate.items() if w not in in_original],
                only_in_original=[dict(where=section(w, v), verdict=v)
                                  for w, v in in_original.items() if w not in in_replicate])


def difference_text(row: dict, kind: str) -> str:
    measure = row[f"{kind}_measure"]
    return f"{row[kind]:.1e} ({MEASURES[measure]})" if measure else "0"


def report_text(args, comparison: dict, runs: list[dict], machines: tuple[str, str]) -> str:
    rows = comparison["rows"]
    kept = sum(row["same_status"] for row in rows)
    suffix = f" --suffix {args.suffix}" if args.suffix else ""
    lines = [f"# Replication: {args.original} against {args.replicate}", "",
             f"Generated by `python -m utils.study.replicate {args.original} {args.replicate}{suffix}`.", "",
             f"- Original, {args.original}: {machines[0]}.",
             f"- Replicate, {args.replicate}: {machines[1]}.", "",
             f"**{kept} of the {len(rows)} verdicts that both measured keep their status**, and their 95% intervals "
             f"overlap for {sum(row['intervals_overlap'] for row in rows)} of them.", ""]
    changed = [row for row in rows if not row["same_status"]]
    if changed:
        lines += ["Changed status:", ""]
        lines += [f"- {row['claim']} ({row['where']}): {row['original']['status']} → {row['replicate']['status']}"
                  for row in changed]
        lines.append("")
    lines += ["## Every verdict both measured", "",
              "| where | claim | original | replicate | same status | intervals overlap |", "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['where']} | {row['claim']} | {interval_text(row['original'])} | "
                     f"{interval_text(row['replicate'])} | {'yes' if row['same_status'] else '**no**'} | "
                     f"{'yes' if row['intervals_overlap'] else '**no**'} |")
    if comparison["measured_in_one"]:
        lines += ["", "## Verdicts only one of them could measure", "",
                  "Measured in one, not measurable in the other (its records lack the measure, or too few of its "
                  "runs finished).", ""]
        lines += [f"- {item['where']}: {item['claim']}: {interval_text(item[item['measured_in']])} "
                  f"(only the {item['measured_in']})" for item in comparison["measured_in_one"]]
    if comparison["judged_apart"]:
        lines += ["", "## Verdicts judged in different units", "",
                  "Both measured, but over different units (over seeds in one, over one seed's held-out documents in "
                  "the other, where an arm has a single finished seed): their statuses and intervals are not "
                  "compared.", ""]
        lines += [f"- {item['where']}: {item['claim']}: {interval_text(item['original'])} (original); "
                  f"{interval_text(item['replicate'])} (replicate)" for item in comparison["judged_apart"]]
    for key, title in (("only_in_replicate", "Verdicts only the replicate's summary holds"),
                       ("only_in_original", "Verdicts only the original's summary holds")):
        if comparison[key]:
            lines += ["", f"## {title}", ""]
            lines += [f"- {item['where']}: {item['verdict']['claim']}: {interval_text(item['verdict'])}"
                      for item in comparison[key]]
    lines += ["", "## Each run in both", "",
              f"Where both runs finished, of their scalar measures at the last analysed step (the eval loss aside) "
              f"the one that moved most in relative terms (values of at least {RELATIVE_FLOOR:g}) and the one that "
              f"moved most in absolute terms.", "",
              "| run | status | eval loss, original | eval loss, replicate | difference | largest relative | "
              "largest absolute |", "|---|---|---|---|---|---|---|"]
    for row in runs:
        status = row["status"][0] if row["status"][0] == row["status"][1] else " → ".join(row["status"])
        a, b = row["eval_loss"]
        losses = [f"{loss:.4f}" if loss is not None else "n/a" for loss in (a, b)]
        gap = f"{b - a:+.1e}" if a is not None and b is not None else "n/a"
        moved = ([difference_text(row, "relative"), difference_text(row, "absolute")] if row.get("compared")
                 else ["n/a", "n/a"])
        lines.append(f"| {row['run']} | {status} | {losses[0]} | {losses[1]} | {gap} | {moved[0]} | {moved[1]} |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="python -m utils.study.replicate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("original", help="the first report's folder (its summary<suffix>.json and runs/)")
    parser.add_argument("replicate", help="the second report's folder, the same study trained again")
    parser.add_argument("--suffix", default="",
                        help="which of the folders' reports: '' (summary.json), or a budget's suffix such as _rivals")
    parser.add_argument("--out", help="where replication<suffix>.md and .json go (default: the replicate's folder)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    original, original_records = read_report(Path(args.original), "original", args.suffix, parser)
    replicate, replicate_records = read_report(Path(args.replicate), "replicate", args.suffix, parser)
    difference = settings_difference(original, replicate) or runs_difference(original_records, replicate_records)
    if difference:
        parser.error(f"replicate: {args.replicate} is not the same study as {args.original} ({difference})")
    comparison = compare_reports(original, replicate)
    runs = run_rows(original_records, replicate_records)
    out = Path(args.out or args.replicate)
    out.mkdir(parents=True, exist_ok=True)
    text = report_text(args, comparison, runs, (records_machines(original_records),
                                                records_machines(replicate_records)))
    (out / f"replication{args.suffix}.md").write_text(text)
    (out / f"replication{args.suffix}.json").write_text(json.dumps(dict(comparison, runs=runs), indent=1))
    print(f"{sum(row['same_status'] for row in comparison['rows'])} of the {len(comparison['rows'])} verdicts both "
          f"measured keep their status; written to {out / f'replication{args.suffix}.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
