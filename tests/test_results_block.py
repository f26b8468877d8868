"""The README's results block cannot drift from the reports it cites (issue 46).

Every number with a decimal point in the block, and in docs/study.md's findings sections, must be found in a report
that its section or its own paragraph links to (the report's text, its summary JSON, or what its run records give:
a run's measures, an arm's means, and any two arms' paired interval), at the precision the README prints it: an
interval "e [l, h]" as a whole, against the reports' intervals, and any other number against the reports' numbers.
A number printed without a sign matches either sign ("trails by 0.17 [0.14, 0.20]"). A paragraph with numbers that
cites no report fails.

Rounding a rounded number can move it (-0.03448 printed as -0.0345, then as -0.035): a report's printed number
stands in only when it is printed with the README's precision or at least two more places; otherwise only the
summary JSON's full-precision value does.
"""
from __future__ import annotations

import functools
import itertools
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from utils.study import measures, verdicts

REPO = Path(__file__).resolve().parents[1]
NUMBER = r"[−+-]?\d+\.\d+(?:e[-+]?\d+)?"
INTERVAL = re.compile(rf"({NUMBER})\s*(?:nats\s*)?\[(?:95% CI\s*)?({NUMBER}),\s*({NUMBER})\]")
DECIMAL = re.compile(rf"(?<![\w.]){NUMBER}")
REPORT_LINK = re.compile(r"\]\((docs/[^)#]*(?:report|lr_grid)[^)#]*\.md)")


def parse(number: str) -> float:
    return float(number.replace("−", "-"))


def places(printed: str) -> int:
    return len(printed.replace("−", "-").lstrip("+-").split(".")[1].split("e")[0])


def matches(printed: str, value: float | str) -> bool:
    """`value` printed at `printed`'s precision is `printed` (either sign when `printed` has none). A `value` given as
    printed text counts only at the same precision or at least two more places (see the module's docstring)."""
    if isinstance(value, str):
        if "e" in value or places(value) not in (places(printed), *range(places(printed) + 2, 99)):
            return False
        value = parse(value)
    target = parse(printed)
    if printed[0] not in "−+-":
        value, target = abs(value), abs(target)
    return f"{value:.{places(printed)}f}" == f"{target:.{places(printed)}f}"


def report_evidence(report: Path) -> tuple[list[tuple], list]:
    """(intervals, numbers) of a report: as printed in its markdown, and at full precision from its summary JSON."""
    text = report.read_text()
    intervals = INTERVAL.findall(text)
    numbers = DECIMAL.findall(text)
    # a study report's summary<suffix>.json; an lr grid's lr_grid.json
    summary = report.with_suffix(".json") if report.stem == "lr_grid" else report.with_name(
        "summary" + report.stem[len("report"):] + ".json")

    def walk(node):
        if isinstance(node, dict):
            if all(isinstance(node.get(key), (int, float)) for key in ("effect", "low", "high")):
                intervals.append((node["effect"], node["low"], node["high"]))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
        elif isinstance(node, float):
            numbers.append(node)

    if summary.is_file():
        walk(json.loads(summary.read_text()))
    more_intervals, more_numbers = records_evidence(report.parent / "runs")
    return intervals + more_intervals, numbers + more_numbers


@functools.cache
def records_evidence(runs_dir: Path) -> tuple[list[tuple], list]:
    """What a paragraph may compute from a report's run records beyond its printed tables, at full precision: each
    run's measures and eval losses, each arm's mean of the measures, and for every two arms the paired 95% t interval
    of each measure's difference (and log ratio), either way round, over their common seeds and over the first two."""
    by_arm: dict[str, dict[int, dict]] = {}
    curves = []
    for path in sorted(runs_dir.glob("*.json")) if runs_dir.is_dir() else []:
        record = json.loads(path.read_text())
        if record.get("status") == "finished" and "arm" in record:
            by_arm.setdefault(record["arm"], {})[record.get("seed")] = dict(
                measures.measures_at(record), eval_loss=record["final_eval_loss"])
            curves.append(record.get("eval_curve") or [])
    numbers, intervals = [loss for curve in curves for _, loss in curve], []
    for runs in by_arm.values():
        for name in {name for values in runs.values() for name in values}:
            values = [v[name] for v in runs.values() if isinstance(v.get(name), float) and math.isfinite(v[name])]
            numbers += values + ([float(np.mean(values))] if values else [])
    for a, b in itertools.permutations(by_arm, 2):
        common = sorted(set(by_arm[a]) & set(by_arm[b]))
        for seeds in {tuple(common), tuple(common[:2])} if len(common) >= 2 else ():  # all, and a study part-way
            for name in by_arm[a][seeds[0]]:
                pairs = [(by_arm[a][s].get(name), by_arm[b][s].get(name)) for s in seeds]
                if all(isinstance(x, float) and isinstance(y, float) for x, y in pairs):
                    intervals.append(verdicts.paired_t_interval([x - y for x, y in pairs]))
                    if all(x > 0 and y > 0 for x, y in pairs):
                        intervals.append(verdicts.paired_t_interval([math.log(x / y) for x, y in pairs]))
    return intervals, numbers


def results_paragraphs(readme: str) -> list[tuple[str, list[str]]]:
    """(paragraph, the reports it may cite): its own links and those of its section's first paragraph."""
    block = readme.split("<!-- results:start -->")[1].split("<!-- results:end -->")[0]
    found = []
    for section in re.split(r"\n(?=\*\*)", block.strip()):
        parts = re.split(r"\n\s*\n|\n(?=- )", section)
        section_links = REPORT_LINK.findall(parts[0])
        found += [(part, section_links + REPORT_LINK.findall(part)) for part in parts]
    return found


# Perplexities that docs/study.md quotes from the papers (LNS's Table 4 at 130M and 250M, BHyT's at 1B), not ours.
PAPERS_NUMBERS = {"25.80", "25.76", "20.79", "20.35", "16.47", "17.26", "17.75"}


def unmatched(paragraph: str, reports: list[str]) -> list[str]:
    intervals, numbers = [], []
    for report in reports:
        more_intervals, more_numbers = report_evidence(REPO / report)
        intervals += more_intervals
        numbers += more_numbers
    missing = []
    for printed in INTERVAL.findall(paragraph):
        if not any(all(matches(p, v) for p, v in zip(printed, interval)) for interval in intervals):
            missing.append("{} [{}, {}]".format(*printed))
    rest = INTERVAL.sub(" ", paragraph)
    rest = re.sub(r"\]\([^)]*\)", "]", rest)  # link targets
    missing += [printed for printed in DECIMAL.findall(rest)
                if printed not in PAPERS_NUMBERS and not any(matches(printed, v) for v in numbers)]
    return missing


PARAGRAPHS = [(text, links) for text, links in results_paragraphs((REPO / "README.md").read_text())
              if DECIMAL.search(re.sub(r"\]\([^)]*\)", "]", text))]


@pytest.mark.parametrize("paragraph, reports", PARAGRAPHS, ids=[text[:40] for text, _ in PARAGRAPHS])
def test_every_number_in_the_readme_results_is_in_a_report_it_cites(paragraph, reports):
    assert reports, f"a results paragraph with numbers cites no report: {paragraph[:80]!r}"
    assert unmatched(paragraph, reports) == [], f"not in {reports}"


def test_the_check_catches_a_drifted_interval():
    report = "docs/width_sweep_mixed_compile/report.md"
    intervals, _ = report_evidence(REPO / report)
    effect, low, high = next(interval for interval in intervals if isinstance(interval[0], float))
    honest = f"{effect:+.3f} [{low:+.3f}, {high:+.3f}]"
    assert unmatched(honest, [report]) == []
    drifted = f"{effect:+.3f} [{low - 0.002:+.3f}, {high:+.3f}]"
    assert unmatched(drifted, [report]) == [drifted]
    assert unmatched("grows by 12.345 nats", [report]) == ["12.345"]


def study_section_paragraphs(heading: str) -> list[tuple[str, list[str]]]:
    """docs/study.md's section under `heading`: each paragraph with every report the section links to."""
    text = (REPO / "docs" / "study.md").read_text()
    section = text.split(f"\n## {heading}\n")[1].split("\n## ")[0]
    reports = ["docs/" + link for link in re.findall(r"\]\(([^)#]*(?:report|lr_grid)[^)#]*\.md)", section)]
    reports += re.findall(r"`(docs/[^`]*report[^`]*\.md)`", section)  # a report named in code, not linked
    return [(part, reports) for part in re.split(r"\n\s*\n|\n(?=- )", section) if DECIMAL.search(part)]


STUDY_SECTIONS = ["What the study found", "What the rivals extension found", "What the depth sweep found",
                  "What the width sweep found", "What the Wikipedia depth sweep found"]


@pytest.mark.parametrize("heading", STUDY_SECTIONS)
def test_every_number_in_the_study_sweep_findings_is_in_a_report_they_cite(heading):
    missing = [(paragraph[:60], unmatched(paragraph, reports))
               for paragraph, reports in study_section_paragraphs(heading)]
    assert [entry for entry in missing if entry[1]] == []


def test_the_check_computes_arm_pairs_from_the_records_and_catches_a_drifted_one():
    """A paragraph may set two arms side by side that no report table pairs (Peri-LN + LNS against Peri-LN): the
    check computes that interval from the records, to the printed digit."""
    report = "docs/study/report_rivals.md"
    effect, low, high = verdicts.paired_t_interval(
        [peri_lns - peri for peri_lns, peri in zip(*(
            [json.loads((REPO / "docs/study/runs" / f"{arm}-seed{seed}.json").read_text())["final_eval_loss"]
             for seed in (1, 2, 3)] for arm in ("peri_lns", "peri")))])
    honest = f"{effect:+.3f} [{low:+.4f}, {high:+.3f}]"
    assert unmatched(honest, [report]) == []
    drifted = f"{effect:+.3f} [{low + 0.001:+.4f}, {high:+.3f}]"
    assert unmatched(drifted, [report]) == [drifted]
