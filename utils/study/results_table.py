"""The README's results table: the paper's claims (rows) against the regimes the studies trained in (columns), every
cell read from a committed study's summary JSON, so that the table cannot drift from the reports (issue 65).

    python -m utils.study.results_table           # rewrite the table between its markers in README.md
    python -m utils.study.results_table --check   # exit 1 if README.md's table is not what the summaries give

A cell is the verdict of one claim in one regime, LNS against Pre-LN paired by seed: its status, its effect to two
significant figures, and a link to the report the summary belongs to. Where a regime is a sweep over depth, the
deep-layer claims are read as the paper's mechanism claim is, as the slope against ln L of ln(LNS / Pre-LN) (a ratio
does not move with how the measure itself scales with depth), with the gap's verdict beside it.
"""
from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
from pathlib import Path

from peft_pretraining.cli import OneLineErrorParser
from utils.study import claims, findings, verdicts

REPO = Path(__file__).resolve().parents[2]
START, END = "<!-- results-table:start -->", "<!-- results-table:end -->"

STUDY_300 = "docs/study_mixed_compile/summary.json"
STUDY_1500 = "docs/study_long_mixed_compile/summary.json"
# Block influence and the logit lens: the committed mixed records predate them; the float32 retrains carry them.
STUDY_1500_LENS = "docs/study_long_avx2/summary.json"
DEPTH = "docs/depth_sweep_mixed_compile/summary.json"
DEPTH_LENS = "docs/depth_sweep_avx2/summary.json"
WIDTH = "docs/width_sweep_mixed_compile/summary.json"
# The 10,500-update sweep at 2e-3, and the budget x depth map's shorter budgets beside it (issue 64): finished runs of
# 2,400 and 5,000 updates.
WIKIPEDIA = "docs/depth_sweep_wikipedia_lr0.002/summary.json"
WIKIPEDIA_SHORT = "docs/depth_sweep_wikipedia_2400_lr0.002/summary.json"
WIKIPEDIA_MIDDLE = "docs/depth_sweep_wikipedia_5000_lr0.002/summary.json"
# The 2026 rivals (Attention Residuals, mHC) at 1,500 updates, beside LNS (issue 67); the README's prose reads it.
STUDY_1500_RIVALS_2026 = "docs/study_long_mixed_compile/summary_rivals_2026.json"

LOSS, VARIANCE, ANGULAR, IDENTITY = (claim for claim, *_ in claims.CORE_CLAIMS)
LENS = [claim for claim, *_ in claims.LENS_CLAIMS]
LEAD_PREDICTION = "LNS's advantage (Pre-LN − LNS eval loss) grows with depth"
# the depth sweeps' comparative measures, in the rows' order
COMPARED = {VARIANCE: "variance_growth", ANGULAR: "angular_deep", IDENTITY: "jacobian_deep",
            claims.REMOVAL_CLAIM: "removal_deep", claims.BI_CLAIM[0]: "bi_deep"}
LENS_MEASURES = ["lens_kl_deep", "relative_prediction_depth"]
ROWS = ["LNS reaches a lower eval loss (nats)",
        "Pre-LN's variance grows more with depth (log ratio)",
        "deep Pre-LN layers are closer to their successor (angular distance)",
        "deep Pre-LN blocks are closer to the identity (‖J − I‖/√d)",
        "removing a deep Pre-LN layer costs less (nats/word)",
        "deep Pre-LN layers change the stream less (block influence; the logit lens)",
        "LNS's lead grows with depth (slope of Pre-LN − LNS against ln L)"]
NOT_MEASURED = "—"


def significant(value: float, digits: int = 2) -> str:
    """`value` with its sign and `digits` significant figures, never in exponent notation, with the README's minus."""
    decimals = max(digits - 1 - math.floor(math.log10(abs(value))), 0) if value else digits - 1
    return f"{value:+.{decimals}f}".replace("-", "−")


def rate_text(rate: str) -> str:
    """A learning rate as the docs print it: 2e-3."""
    mantissa, exponent = f"{float(rate):.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def report_of(summary: str) -> str:
    """A summary's report: summary<suffix>.json beside report<suffix>.md."""
    path = Path(summary)
    return str(path.with_name("report" + path.stem[len("summary"):] + ".md"))


class Summaries:
    """The committed summaries under `root` (paths relative to it, as the README links them), each read once."""

    def __init__(self, root: Path):
        self.root, self.cache = root, {}

    def __getitem__(self, name: str) -> dict:
        if name not in self.cache:
            self.cache[name] = json.loads((self.root / name).read_text())
        return self.cache[name]


def find(verdict_list: list[dict], claim: str, where: str) -> dict:
    for verdict in verdict_list:
        if verdict["claim"] == claim or verdict["claim"].startswith(claim):
            return verdict
    raise KeyError(f"{where} has no verdict for {claim!r}")


def cell(verdict: dict, summary: str, note: str = "") -> str:
    status = f"**{verdict['status']}**" if verdict["status"] in (verdicts.REPRODUCED, verdicts.OPPOSITE) else \
        verdict["status"]
    number = "" if verdict["effect"] is None else " " + significant(verdict["effect"])
    return f"[{status}{number}]({report_of(summary)})" + (f" ({note})" if note else "")


def pair_cell(summaries: Summaries, summary: str, claim: str, note: str = "") -> tuple[str, dict]:
    """A 24-layer study's verdict, in its arms with fp32 master weights (not its pure-bf16 pair)."""
    group = next(name for name in summaries[summary]["verdicts"] if "fp32 master weights" in name)
    verdict = find(summaries[summary]["verdicts"][group], claim, summary)
    return cell(verdict, summary, note), verdict


def lens_note(statuses: list[str]) -> str:
    return "lens: " + (statuses[0] if len(set(statuses)) == 1 else ", ".join(statuses))


def widest_cell(summaries: Summaries, claim: str) -> tuple[str, dict]:
    at_width = summaries[WIDTH]["at_width"]
    widest = str(max(summaries[WIDTH]["settings"]["widths"]))
    verdict = find(at_width[widest], claim, WIDTH)
    return cell(verdict, WIDTH), verdict


def deepest_gap_cell(summaries: Summaries, summary: str) -> tuple[str, dict]:
    deepest = max(summaries[summary]["settings"]["depths"])
    verdict = find(summaries[summary]["gaps"], f"L={deepest}: {LOSS}", summary)
    return cell(verdict, summary), verdict


def compared(summaries: Summaries, summary: str, measure: str) -> dict:
    return next(entry for entry in summaries[summary]["comparative"] if entry["measure"] == measure)


def ratio_cell(summaries: Summaries, summary: str, measure: str, note: str = "") -> tuple[str, dict]:
    entry = compared(summaries, summary, measure)
    gap = f"gap: {entry['gap']['status']}"
    return cell(entry["ratio"], summary, f"{gap}; {note}" if note else gap), entry["ratio"]


def depth_column(summaries: Summaries, summary: str, lens_summary: str) -> list[tuple[str, dict] | None]:
    lens = lens_note([compared(summaries, lens_summary, measure)["ratio"]["status"] for measure in LENS_MEASURES])
    prediction = find(summaries[summary]["predictions"], LEAD_PREDICTION, summary)
    return [deepest_gap_cell(summaries, summary),
            *(ratio_cell(summaries, summary, COMPARED[claim]) for claim in (VARIANCE, ANGULAR, IDENTITY,
                                                                            claims.REMOVAL_CLAIM)),
            ratio_cell(summaries, lens_summary, COMPARED[claims.BI_CLAIM[0]], lens),
            (cell(prediction, summary), prediction)]


def wikipedia_column(summaries: Summaries, summary: str) -> tuple[str, list[tuple[str, dict] | None]]:
    """One budget of the Wikipedia sweep at one rate; its own records carry block influence and the lens."""
    settings = summaries[summary]["settings"]
    return (f"Wikipedia, L = {min(settings['depths'])}–{max(settings['depths'])}, {settings['steps']:,} updates at "
            f"lr {rate_text(settings['lr'])}", depth_column(summaries, summary, summary))


def columns(summaries: Summaries) -> list[tuple[str, list[tuple[str, dict] | None]]]:
    """(header, one cell per row, None where the regime does not measure the claim) for each regime."""
    core = [LOSS, VARIANCE, ANGULAR, IDENTITY, claims.REMOVAL_CLAIM]
    lens_1500 = lens_note([pair_cell(summaries, STUDY_1500_LENS, claim)[1]["status"] for claim in LENS])
    depths, widths = (summaries[DEPTH]["settings"]["depths"], summaries[WIDTH]["settings"]["widths"])
    return [
        (f"embedded, {summaries[STUDY_300]['settings']['steps']:,} updates",
         [pair_cell(summaries, STUDY_300, claim) for claim in core] + [None, None]),
        (f"embedded, {summaries[STUDY_1500]['settings']['steps']:,} updates",
         [pair_cell(summaries, STUDY_1500, claim) for claim in core]
         + [pair_cell(summaries, STUDY_1500_LENS, claims.BI_CLAIM[0], lens_1500), None]),
        (f"depth sweep, L = {min(depths)}–{max(depths)}", depth_column(summaries, DEPTH, DEPTH_LENS)),
        (f"width sweep, hidden {min(widths)}–{max(widths)}",
         [widest_cell(summaries, claim) for claim in core] + [None, None]),
        *(wikipedia_column(summaries, summary) for summary in (WIKIPEDIA_SHORT, WIKIPEDIA_MIDDLE, WIKIPEDIA)),
    ]


def build_table(root: Path = REPO) -> str:
    """The markdown between the README's table markers: the table and the line that says how to read its cells."""
    summaries = Summaries(root)
    found = columns(summaries)
    lines = ["| the paper's claim | " + " | ".join(header for header, _ in found) + " |",
             "|---" * (len(found) + 1) + "|"]
    for index, row in enumerate(ROWS):
        lines.append(f"| {row} | " + " | ".join(NOT_MEASURED if cells[index] is None else cells[index][0]
                                               for _, cells in found) + " |")
    seeds = sorted({cells[i][1]["n_pairs"] for _, cells in found for i in range(len(ROWS)) if cells[i]})
    level = round(100 * (1 - inspect.signature(verdicts.paired_t_interval).parameters["alpha"].default))
    layers = json.loads((root / summaries[STUDY_300]["settings"]["model_config"]).read_text())["num_hidden_layers"]
    legend = (
        f"LNS − Pre-LN, paired by seed over {'–'.join(str(n) for n in sorted({seeds[0], seeds[-1]}))} seeds and "
        f"judged by a {level}% Student-t interval: the embedded columns at {layers} layers, the width sweep at "
        f"hidden {max(summaries[WIDTH]['settings']['widths'])}, the depth columns' loss at their deepest model and "
        f"their next five rows as the slope against ln L of ln(LNS / Pre-LN), beside the gap's verdict (the lens: "
        f"its KL, then prediction depth / L). Block influence and the lens at "
        f"{summaries[STUDY_1500]['settings']['steps']:,} updates and in the depth sweep: float32 retrains on a "
        f"second host. {NOT_MEASURED}: not measured.")
    return "\n".join([*lines, "", legend])


def readme_table(readme: str) -> str:
    """The text between the README's table markers."""
    return findings.between(readme, START, END)


def with_table(readme: str, table: str) -> str:
    return findings.replace_between(readme, START, END, table)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="python -m utils.study.results_table", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if README.md's table differs from what the summaries give")
    parser.add_argument("--readme", type=Path, default=REPO / "README.md", help="the README to check or rewrite")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    readme = args.readme.read_text()
    try:
        current = (readme_table(readme), findings.block(readme))
        wanted = (build_table(), findings.readme_findings(Summaries(REPO), REPO))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except (KeyError, FileNotFoundError, StopIteration) as error:  # a summary gone, or one without a verdict read
        print(f"error: {error.args[0] if isinstance(error, KeyError) else error or 'a verdict is missing'}",
              file=sys.stderr)
        return 2
    if args.check:
        if current != wanted:
            print(f"{args.readme}: the results table or findings are not what the summaries give; "
                  "run python -m utils.study.results_table", file=sys.stderr)
            return 1
        return 0
    if current != wanted:
        args.readme.write_text(findings.with_block(with_table(readme, wanted[0]), wanted[1]))
    print(f"{args.readme}: results table and findings {'rewritten' if current != wanted else 'unchanged'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
