"""Which verdicts of a study survive a second run of it: two report folders of one study, side by side.

A replicate is the same study trained again, with the same flags and settings, usually on another host. Float kernels
round differently from host to host, and a deep model amplifies the difference over its updates (docs/study.md), so
a replicate says how much of a report is the study and how much is its one set of runs.

    python -m utils.study.replicate docs/depth_sweep docs/depth_sweep_avx2

Every verdict in the two summary.json files is matched by where it sits (its section, its measure, its claim). A
verdict *keeps its status* when it is reproduced, inside noise or opposite in both; the table also says whether the
two 95% intervals overlap. Beside the verdicts, each run's eval loss in both, and the largest relative difference
over its scalar measures. The two must be the same study: the same budget and settings, and every run both hold
trained with the same flags (a --dtype or --compile makes another study) and analysed with the same settings.
Verdicts that only the replicate has (a measure its records carry and the original's do
not) are listed apart. Writes replication.md and replication.json in the replicate's folder, or in --out.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from peft_pretraining.cli import OneLineErrorParser
from utils.study.host import records_machines
from utils.study.measures import MEASURES, finite_or_none, measures_at
from utils.study.runs import recorded_settings

# Where a report's output goes, not what it measured: free to differ between the two.
WHERE_SETTINGS = ("out", "runs_dir")


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
            name = item.get("measure") or item.get("claim") if isinstance(item, dict) else None
            found.update(verdicts_in(item, (*path, name or str(index))))
        return found
    return {}


def interval_text(verdict: dict) -> str:
    if verdict.get("effect") is None:
        return f"{verdict['status']} ({verdict.get('reason') or 'not judged'})"
    if verdict.get("low") is None:  # a point estimate
        return f"{verdict['effect']:+.4g}, no interval: {verdict['status']}"
    return (f"{verdict['effect']:+.4g} [{verdict['low']:+.4g}, {verdict['high']:+.4g}], "
            f"{verdict['n_agree']}/{verdict['n_pairs']} {verdict['unit']}: {verdict['status']}")


def overlap(a: dict, b: dict) -> bool | None:
    if a.get("low") is None or b.get("low") is None:
        return None
    return a["low"] <= b["high"] and b["low"] <= a["high"]


def read_report(folder: Path, flag: str, parser: argparse.ArgumentParser) -> tuple[dict, dict[str, dict]]:
    summary_path = folder / "summary.json"
    if not summary_path.is_file():
        parser.error(f"{flag}: no report in {folder} (its summary.json is missing)")
    records = {path.stem: json.loads(path.read_text()) for path in sorted((folder / "runs").glob("*.json"))}
    return json.loads(summary_path.read_text()), records


def settings_difference(original: dict, replicate: dict) -> str | None:
    """The first setting that makes the two reports different studies, or None."""
    if original.get("budget") != replicate.get("budget"):
        return f"budget: {original.get('budget')!r} against {replicate.get('budget')!r}"
    a, b = original.get("settings", {}), replicate.get("settings", {})
    for key in sorted(set(a) | set(b)):
        if key not in WHERE_SETTINGS and a.get(key) != b.get(key):
            return f"setting {key}: {a.get(key)!r} against {b.get(key)!r}"
    return None


def runs_difference(original: dict[str, dict], replicate: dict[str, dict]) -> str | None:
    """The first run whose training flags or analysis settings differ between the two (a dtype or --compile is a
    different study), or None; two reports without a run in common are different studies too."""
    common = sorted(set(original) & set(replicate))
    if not common:
        return "no run in common"
    for name in common:
        a, b = original[name].get("flags", []), replicate[name].get("flags", [])
        if a != b:
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return f"run {name}'s flags: {' '.join(a[at:at + 2]) or 'none'} against {' '.join(b[at:at + 2]) or 'none'}"
        if recorded_settings(original[name]) != recorded_settings(replicate[name]):
            return f"run {name}'s analysis settings"
    return None


def run_rows(original: dict[str, dict], replicate: dict[str, dict]) -> list[dict]:
    """Per run that both finished: its eval loss in each, and its scalar measure that differs most, relatively."""
    rows = []
    for name in sorted(set(original) & set(replicate)):
        a, b = original[name], replicate[name]
        if a.get("status") != "finished" or b.get("status") != "finished":
            continue
        ours, theirs = measures_at(a), measures_at(b)
        largest = (0.0, None)
        for measure in MEASURES:
            x, y = finite_or_none(ours.get(measure)), finite_or_none(theirs.get(measure))
            if x is not None and y is not None and max(abs(x), abs(y)) > 0:
                largest = max(largest, (abs(x - y) / max(abs(x), abs(y)), measure), key=lambda pair: pair[0])
        rows.append(dict(run=name, eval_loss=[a.get("final_eval_loss"), b.get("final_eval_loss")],
                         largest_relative_difference=largest[0], measure=largest[1]))
    return rows


def section(where: tuple[str, ...], verdict: dict) -> str:
    """Where a verdict sits, less its claim (a list item named by its claim): 'comparative / bi_deep / ratio'."""
    return " / ".join(part for part in where if part != verdict["claim"])


def compare_reports(original: dict, replicate: dict) -> dict:
    ours, theirs = verdicts_in(original), verdicts_in(replicate)
    rows = []
    for where in [w for w in ours if w in theirs]:
        a, b = ours[where], theirs[where]
        rows.append(dict(where=section(where, a), claim=a["claim"], original=a, replicate=b,
                         same_status=a["status"] == b["status"], intervals_overlap=overlap(a, b)))
    return dict(rows=rows,
                only_in_replicate=[dict(where=section(w, v), verdict=v) for w, v in theirs.items() if w not in ours],
                only_in_original=[dict(where=section(w, v), verdict=v) for w, v in ours.items() if w not in theirs])


def report_text(args, comparison: dict, runs: list[dict], machines: tuple[str, str]) -> str:
    rows = comparison["rows"]
    kept = sum(row["same_status"] for row in rows)
    lines = [f"# Replication: {args.original} against {args.replicate}", "",
             f"Generated by `python -m utils.study.replicate {args.original} {args.replicate}`.", "",
             f"- Original, {args.original}: {machines[0]}.",
             f"- Replicate, {args.replicate}: {machines[1]}.", "",
             f"**{kept} of {len(rows)} verdicts keep their status**; the intervals overlap for "
             f"{sum(bool(row['intervals_overlap']) for row in rows)} of them.", ""]
    changed = [row for row in rows if not row["same_status"]]
    if changed:
        lines += ["Changed status:", ""]
        lines += [f"- {row['claim']} ({row['where']}): {row['original']['status']} → {row['replicate']['status']}"
                  for row in changed]
        lines.append("")
    lines += ["## Every verdict in both", "",
              "| where | claim | original | replicate | same status | intervals overlap |", "|---|---|---|---|---|---|"]
    for row in rows:
        overlapping = {True: "yes", False: "**no**", None: "n/a"}[row["intervals_overlap"]]
        lines.append(f"| {row['where']} | {row['claim']} | {interval_text(row['original'])} | "
                     f"{interval_text(row['replicate'])} | {'yes' if row['same_status'] else '**no**'} | "
                     f"{overlapping} |")
    for key, title in (("only_in_replicate", "Verdicts only the replicate has"),
                       ("only_in_original", "Verdicts only the original has")):
        if comparison[key]:
            lines += ["", f"## {title}", ""]
            lines += [f"- {item['where']}: {item['verdict']['claim']}: {interval_text(item['verdict'])}"
                      for item in comparison[key]]
    lines += ["", "## Each run in both", "",
              "The eval loss of each run that finished in both, and of its scalar measures the one that differs most "
              "in relative terms.", "",
              "| run | eval loss, original | eval loss, replicate | difference | largest relative difference |",
              "|---|---|---|---|---|"]
    for row in runs:
        a, b = row["eval_loss"]
        largest = (f"{row['largest_relative_difference']:.1e} ({MEASURES[row['measure']]})" if row["measure"]
                   else "0")
        lines.append(f"| {row['run']} | {a:.4f} | {b:.4f} | {b - a:+.1e} | {largest} |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="python -m utils.study.replicate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("original", help="the first report's folder (its summary.json and runs/)")
    parser.add_argument("replicate", help="the second report's folder, the same study trained again")
    parser.add_argument("--out", help="where replication.md and .json go (default: the replicate's folder)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    original, original_records = read_report(Path(args.original), "original", parser)
    replicate, replicate_records = read_report(Path(args.replicate), "replicate", parser)
    difference = settings_difference(original, replicate) or runs_difference(original_records, replicate_records)
    if difference:
        parser.error(f"replicate: {args.replicate} is not the same study as {args.original} ({difference})")
    comparison = compare_reports(original, replicate)
    runs = run_rows(original_records, replicate_records)
    out = Path(args.out or args.replicate)
    out.mkdir(parents=True, exist_ok=True)
    text = report_text(args, comparison, runs, (records_machines(original_records),
                                                records_machines(replicate_records)))
    (out / "replication.md").write_text(text)
    (out / "replication.json").write_text(json.dumps(dict(comparison, runs=runs), indent=1))
    print(f"{sum(row['same_status'] for row in comparison['rows'])} of {len(comparison['rows'])} verdicts keep "
          f"their status; written to {out / 'replication.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
