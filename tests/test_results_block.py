"""The README's results block and the study pages cannot drift from the reports they cite (issues 46, 65, 80).

The README's results table and its findings are written by `utils/study/results_table.py` (the findings through
`utils/study/findings.py`) from the studies' summary JSON; the README must hold exactly what they write, and the
findings' words must follow the intervals they print.

Every number with a decimal point in a study page's opening and findings sections must be found in a report that its
section or its own paragraph links to (the report's text, its summary JSON, or what its run records give: a run's
measures, an arm's means, and any two arms' paired interval), at the precision the page prints it: an interval
"e [l, h]" as a whole, against the reports' intervals, and any other number against the reports' numbers. A number
printed without a sign matches either sign ("trails by 0.17 [0.14, 0.20]"). A paragraph with numbers that cites no
report fails.

Rounding a rounded number can move it (-0.03448 printed as -0.0345, then as -0.035): a report's printed number
stands in only when it is printed with the page's precision or at least two more places; otherwise only the
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

from tests.analysis_helpers import read_records
from utils.study import findings, measures, pages, results_table, verdicts

REPO = Path(__file__).resolve().parents[1]
NUMBER = r"[−+-]?\d+\.\d+(?:e[-+]?\d+)?"
INTERVAL = re.compile(rf"({NUMBER})\s*(?:nats\s*)?\[(?:95% CI\s*)?({NUMBER}),\s*({NUMBER})\]")
DECIMAL = re.compile(rf"(?<![\w.]){NUMBER}")


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
    # a study report's summary<suffix>.json; an lr grid's lr_grid.json, a budget map's budget_map.json
    summary = report.with_suffix(".json") if report.stem in ("lr_grid", "budget_map") else report.with_name(
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
    for record in read_records(runs_dir.parent).values():
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


# Perplexities that the rivals' page quotes from the papers (LNS's Table 4 at 130M and 250M, BHyT's at 1B), not ours.
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


README = REPO / "README.md"


def test_the_readme_table_is_what_the_summaries_give():
    assert results_table.readme_table(README.read_text()) == results_table.build_table(), \
        "run python -m utils.study.results_table"


def rendered(summaries=None) -> str:
    return findings.readme_findings(summaries or results_table.Summaries(REPO), REPO)


def one_line(text: str) -> str:
    """Rendered text as one line (it is wrapped at 120 columns, and a phrase may wrap)."""
    return " ".join(text.split())


def test_the_readme_findings_are_what_the_summaries_give():
    assert findings.block(README.read_text()) == rendered(), "run python -m utils.study.results_table"


HOLDS_ZERO = dict(claim="c", expected_direction=1, effect=0.02, low=-0.01, high=0.05, n_pairs=3, n_agree=3,
                  status=verdicts.INSIDE_NOISE)


def test_an_interval_that_holds_zero_renders_as_not_shown():
    assert findings.word(HOLDS_ZERO, "grows", "shrinks") == findings.NOT_SHOWN
    assert findings.status(HOLDS_ZERO) == findings.NOT_SHOWN
    assert findings.word(dict(HOLDS_ZERO, low=0.01), "grows", "shrinks") == "grows"
    assert findings.word(dict(HOLDS_ZERO, effect=-0.02, low=-0.05, high=-0.01), "grows", "shrinks") == "shrinks"
    assert findings.effect(HOLDS_ZERO) == "+0.020 [−0.010, +0.050]"
    assert findings.effect(dict(HOLDS_ZERO, effect=math.log(1.2), low=0.0, high=math.log(1.5)), ratio=True) == \
        "×1.20 [1.00, 1.50]"


@pytest.mark.parametrize("agree, n, p", [(3, 3, 0.25), (0, 3, 0.25), (5, 5, 0.0625), (2, 3, 1.0), (4, 5, 0.375)])
def test_a_count_of_seeds_carries_its_sign_test_p(agree, n, p):
    assert findings.sign_test_p(agree, n) == pytest.approx(p)
    verdict = dict(HOLDS_ZERO, n_agree=agree, n_pairs=n)
    assert findings.seeds(verdict, "grow", "shrink") == f"{agree} of {n} seeds grow, sign test p = {p:.2g}"


def test_the_findings_follow_their_intervals():
    """Move an interval across zero in a summary and the words change with it: AttnRes no longer beats LNS once its
    interval holds zero; the multiplier no longer grows with depth once its slope's interval holds zero."""
    summaries = results_table.Summaries(REPO)
    text = one_line(rendered(summaries))
    assert "Attention Residuals beats LNS" in text and "the multiplier grows with depth" in text
    summaries[results_table.STUDY_1500_RIVALS_2026]["per_arm_eval_loss"]["attnres"]["lns"]["high"] = 0.01
    trend = summaries["docs/compute_multiplier/multiplier.json"]["arms"]["lns"]["trends"]["2400"]["verdict"]
    trend["low"] = -0.01
    text = one_line(rendered(summaries))
    assert "Attention Residuals is not shown to differ from LNS (−0.063 [−0.12, +0.010]" in text
    assert "grows with depth" not in text and "Attention Residuals beats" not in text


def test_the_findings_are_at_most_300_words():
    """Issue 80: one plain sentence per question a user asks; a newcomer answers them in three minutes."""
    assert findings.words_in(findings.block(README.read_text())) <= 300


def test_the_table_follows_its_summaries(tmp_path):
    """A verdict that changes in a summary changes its cell, and only the cell of that claim and regime."""
    wanted = [getattr(results_table, name) for name in dir(results_table) if name.isupper() and
              isinstance(getattr(results_table, name), str) and getattr(results_table, name).endswith(".json")]
    for name in wanted:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text((REPO / name).read_text())
    config = json.loads((REPO / results_table.STUDY_300).read_text())["settings"]["model_config"]
    (tmp_path / config).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / config).write_text((REPO / config).read_text())
    assert results_table.build_table(tmp_path) == results_table.build_table()

    summary = json.loads((tmp_path / results_table.WIDTH).read_text())
    widest = str(max(summary["settings"]["widths"]))
    identity = next(v for v in summary["at_width"][widest] if v["claim"] == results_table.IDENTITY)
    assert identity["status"] == verdicts.OPPOSITE
    identity.update(status=verdicts.REPRODUCED, effect=0.5)
    (tmp_path / results_table.WIDTH).write_text(json.dumps(summary))
    before, after = results_table.build_table().splitlines(), results_table.build_table(tmp_path).splitlines()
    changed = [(old, new) for old, new in zip(before, after) if old != new]
    assert len(changed) == 1 and "closer to the identity" in changed[0][0]
    assert "[**reproduced** +0.50](docs/width_sweep_mixed_compile/report.md)" in changed[0][1]
    assert "[**opposite**" in changed[0][1].split("+0.50")[0]  # the 1,500-update column before it keeps its own


def test_the_check_mode_fails_on_a_stale_readme_and_names_it(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(README.read_text())
    assert results_table.main(["--check", "--readme", str(readme)]) == 0
    readme.write_text(README.read_text().replace("**opposite** −0.015", "**opposite** −0.016", 1))
    assert results_table.main(["--check", "--readme", str(readme)]) == 1
    assert str(readme) in capsys.readouterr().err
    assert results_table.main(["--readme", str(readme)]) == 0
    assert readme.read_text() == README.read_text()


@pytest.mark.parametrize("value, printed", [(-0.198, "−0.20"), (-0.0037, "−0.0037"), (0.0891, "+0.089"),
                                            (-1.34, "−1.3"), (85.3, "+85"), (1e-5, "+0.000010")])
def test_a_cell_prints_two_significant_figures_without_exponents(value, printed):
    assert results_table.significant(value) == printed


def test_the_check_catches_a_drifted_interval():
    report = "docs/width_sweep_mixed_compile/report.md"
    intervals, _ = report_evidence(REPO / report)
    effect, low, high = next(interval for interval in intervals if isinstance(interval[0], float))
    honest = f"{effect:+.3f} [{low:+.3f}, {high:+.3f}]"
    assert unmatched(honest, [report]) == []
    drifted = f"{effect:+.3f} [{low - 0.002:+.3f}, {high:+.3f}]"
    assert unmatched(drifted, [report]) == [drifted]
    assert unmatched("grows by 12.345 nats", [report]) == ["12.345"]


def study_section_paragraphs(page: str, heading: str | None) -> list[tuple[str, list[str]]]:
    """A study page's section under `heading` (None: the page's opening, before its first section): each paragraph
    with every report the section links to."""
    text = (REPO / "docs" / page).read_text()
    section = text.split("\n## ")[0] if heading is None else text.split(f"\n## {heading}\n")[1].split("\n## ")[0]
    reports = ["docs/" + link for link in re.findall(r"\]\(([^)#]*(?:report|lr_grid|budget_map)[^)#]*\.md)", section)]
    reports += re.findall(r"`(docs/[^`]*report[^`]*\.md)`", section)  # a report named in code, not linked
    return [(part, reports) for part in re.split(r"\n\s*\n|\n(?=- )", section) if DECIMAL.search(part)]


STUDY_SECTIONS = [
    ("cpu_study.md", None), ("cpu_study.md", "What the study found"),
    ("depth_sweep_study.md", None), ("depth_sweep_study.md", "What the depth sweep found"),
    ("width_sweep_study.md", None), ("width_sweep_study.md", "What the width sweep found"),
]


@pytest.mark.parametrize("page, heading", STUDY_SECTIONS, ids=[f"{page}:{heading or 'opening'}"
                                                               for page, heading in STUDY_SECTIONS])
def test_every_number_in_the_study_pages_findings_is_in_a_report_they_cite(page, heading):
    missing = [(paragraph[:60], unmatched(paragraph, reports))
               for paragraph, reports in study_section_paragraphs(page, heading)]
    assert [entry for entry in missing if entry[1]] == []


def test_the_check_computes_arm_pairs_from_the_records_and_catches_a_drifted_one():
    """A paragraph may set two arms side by side that no report table pairs (Peri-LN + LNS against Peri-LN): the
    check computes that interval from the records, to the printed digit."""
    report, study = "docs/study/report_rivals.md", read_records(REPO / "docs/study")
    effect, low, high = verdicts.paired_t_interval(
        [peri_lns - peri for peri_lns, peri in zip(*(
            [study[f"{arm}-seed{seed}"]["final_eval_loss"]
             for seed in (1, 2, 3)] for arm in ("peri_lns", "peri")))])
    honest = f"{effect:+.3f} [{low:+.4f}, {high:+.3f}]"
    assert unmatched(honest, [report]) == []
    drifted = f"{effect:+.3f} [{low + 0.001:+.4f}, {high:+.3f}]"
    assert unmatched(drifted, [report]) == [drifted]


@pytest.mark.parametrize("page", list(pages.PAGES))
def test_a_rendered_page_is_what_the_summaries_give_and_its_caveats_hold_no_number(page):
    """Issue 80: a study page's answer, set-up and rebuild commands are rendered; what is written by hand (the
    question and the caveats) carries no number, so no number on the page can drift from its summary."""
    text = (REPO / page).read_text()
    assert {name: pages.block_of(text, name) for name in pages.BLOCKS} == pages.render(page, pages.Summaries()), \
        "run python -m utils.study.pages"
    caveats = re.sub(r"\]\([^)]*\)", "]", text.split("\n## Caveats\n")[1].split("\n## ")[0])
    question = text.split("\n## ")[0]
    assert re.findall(r"\d", caveats + question) == []


def test_the_rendered_wikipedia_answer_follows_its_intervals():
    """Move the longest budget's lead slope into an interval that holds zero: the page stops saying it shrinks."""
    summaries = pages.Summaries()
    assert "the lead shrinks with depth" in pages.wikipedia_answer(summaries)
    summaries[pages.MAP]["budgets"]["10500"]["slope"]["high"] = 0.001
    assert "the lead shrinks with depth" not in pages.wikipedia_answer(summaries)

