"""The README's results block cannot drift from the reports it cites (issue 46).

Every number with a decimal point in the block must be found in a report that its section or its own paragraph
links to (the report's text or its summary JSON), at the precision the README prints it: an interval "e [l, h]" as a
whole, against the reports' intervals, and any other number against the reports' numbers. A number printed without a
sign matches either sign ("trails by 0.17 [0.14, 0.20]"). A paragraph with numbers that cites no report fails.

Rounding a rounded number can move it (-0.03448 printed as -0.0345, then as -0.035): a report's printed number
stands in only when it is printed with the README's precision or at least two more places; otherwise only the
summary JSON's full-precision value does.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NUMBER = r"[−+-]?\d+\.\d+(?:e[-+]?\d+)?"
INTERVAL = re.compile(rf"({NUMBER})\s*(?:nats\s*)?\[(?:95% CI\s*)?({NUMBER}),\s*({NUMBER})\]")
DECIMAL = re.compile(rf"(?<![\w.]){NUMBER}")
REPORT_LINK = re.compile(r"\]\((docs/[^)#]*report[^)#]*\.md)")


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
    summary = report.with_name("summary" + report.stem[len("report"):] + ".json")

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
    missing += [printed for printed in DECIMAL.findall(rest) if not any(matches(printed, v) for v in numbers)]
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
    reports = ["docs/" + link for link in re.findall(r"\]\(([^)#]*report[^)#]*\.md)", section)]
    return [(part, reports) for part in re.split(r"\n\s*\n|\n(?=- )", section) if DECIMAL.search(part)]


STUDY_SECTIONS = ["What the depth sweep found", "What the width sweep found", "What the Wikipedia pilot found so far"]


@pytest.mark.parametrize("heading", STUDY_SECTIONS)
def test_every_number_in_the_study_sweep_findings_is_in_a_report_they_cite(heading):
    missing = [(paragraph[:60], unmatched(paragraph, reports))
               for paragraph, reports in study_section_paragraphs(heading)]
    assert [entry for entry in missing if entry[1]] == []
