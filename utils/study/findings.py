"""The studies' findings in words no stronger than their intervals (issue 80).

A verdict is *reproduced*, *opposite* or *not shown*. The words that say more (lower, grows, shrinks, beats, saves,
pays, every seed) are printed here only, and only when the interval supports them: an interval that holds zero
renders as "not shown", whatever its mean. A count of seeds always carries its sign-test p. Every number comes from a
committed summary, through one formatter (`effect`).

    python -m utils.study.results_table          # rewrites the README's findings and its claims table
    python -m utils.study.results_table --check  # exit 1 where either is not what the summaries give
"""
from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

from utils.study import records as record_store
from utils.study import verdicts
from utils.study.host import cpu_of
from utils.study.sweep import NORMS

REPRODUCED, OPPOSITE, NOT_SHOWN, NOT_MEASURABLE = "reproduced", "opposite", "not shown", "not measurable"
START, END = "<!-- findings:start -->", "<!-- findings:end -->"


def status(verdict: dict) -> str:
    """reproduced / opposite / not shown (the interval holds zero) / not measurable."""
    return {verdicts.REPRODUCED: REPRODUCED, verdicts.OPPOSITE: OPPOSITE, verdicts.INSIDE_NOISE: NOT_SHOWN}.get(
        verdict["status"], NOT_MEASURABLE)


def clear_side(verdict: dict | None) -> int:
    """+1 where the interval lies above zero, -1 below, 0 where it holds zero or there is none."""
    if not verdict or verdict.get("low") is None:
        return 0
    return 1 if verdict["low"] > 0 else -1 if verdict["high"] < 0 else 0


def number(value: float, digits: int = 2) -> str:
    """`value` with its sign and `digits` significant figures, never in exponent notation, with a typographic minus."""
    decimals = max(digits - 1 - math.floor(math.log10(abs(value))), 0) if value else digits - 1
    return f"{value:+.{decimals}f}".replace("-", "−")


def effect(verdict: dict | None, ratio: bool = False) -> str:
    """The one way an effect is printed: its mean and 95% interval, "−0.23 [−0.30, −0.16]"; a log ratio read as a
    ratio, "×1.20 [1.18, 1.21]"; a mean without an interval (one seed) alone, marked so."""
    if not verdict or verdict.get("effect") is None:
        return "not measurable"
    if verdict.get("low") is None:
        mean = f"×{math.exp(verdict['effect']):.2f}" if ratio else number(verdict["effect"])
        return f"{mean} (one seed, no interval)"
    if ratio:
        mean, low, high = (math.exp(verdict[key]) for key in ("effect", "low", "high"))
        return f"×{mean:.2f} [{low:.2f}, {high:.2f}]"
    return f"{number(verdict['effect'])} [{number(verdict['low'])}, {number(verdict['high'])}]"


def sign_test_p(agree: int, n: int) -> float:
    """Two-sided exact sign test: the chance of a split at least this uneven among n seeds under no effect."""
    extreme = max(agree, n - agree)
    return min(1.0, 2 * sum(math.comb(n, k) for k in range(extreme, n + 1)) / 2 ** n)


def seeds(verdict: dict | None, positive: str, negative: str) -> str:
    """"3 of 3 seeds <side>, sign test p = 0.25": the seeds on the mean's side (`positive` above zero, `negative`
    below), with the two-sided sign test's p."""
    if not verdict or verdict.get("effect") is None:
        return "no seeds to count"
    n = verdict["n_pairs"]
    agree = verdict["n_agree"] if verdict["effect"] * verdict["expected_direction"] > 0 else n - verdict["n_agree"]
    side = positive if verdict["effect"] > 0 else negative
    return f"{agree} of {n} seeds {side}, sign test p = {sign_test_p(agree, n):.2g}"


def word(verdict: dict, above: str, below: str, neither: str = NOT_SHOWN) -> str:
    """`above` where the interval lies above zero, `below` where below, else `neither`."""
    return {1: above, -1: below, 0: neither}[clear_side(verdict)]


# ----------------------------------------------------------------------------------------------- the README
def _verdict(summary: dict, claim: str) -> dict:
    group = next(name for name in summary["verdicts"] if "fp32 master weights" in name)
    return next(v for v in summary["verdicts"][group] if v["claim"].startswith(claim))


def _gap(summary: dict, depth: int, claim: str) -> dict:
    return next(v for v in summary["gaps"] if v["claim"].startswith(f"L={depth}: {claim}"))


def _pays(slopes: dict) -> str:
    """Where depth pays: the arms whose eval loss falls with depth beyond noise ({arm: slope verdict vs ln L})."""
    falls = [arm for arm, v in slopes.items() if clear_side(v) == -1]
    rises = [arm for arm, v in slopes.items() if clear_side(v) == 1]
    if falls:
        return f"depth pays for {' and '.join(NORMS[a] for a in falls)}"
    if len(rises) == len(slopes):
        return "adding layers raises both arms' loss"
    return "depth is not shown to pay for either arm"


def _hosts(folder: Path, runs: list[str]) -> str:
    """The CPU models the runs were trained on, as their records name them."""
    return " and ".join(sorted({cpu_of(record_store.read(record_store.find(folder, run))) for run in runs}))


def readme_findings(summaries, root: Path) -> str:
    """The README's answers, one paragraph per question a user asks, each number with its interval and regime."""
    from utils.study import results_table as table  # the summaries' paths live with the table that reads them

    short, long_ = summaries[table.WIKIPEDIA_SHORT], summaries[table.WIKIPEDIA]
    budget_map = summaries["docs/depth_sweep_wikipedia_budget_map/budget_map.json"]
    worth = summaries["docs/compute_multiplier/multiplier.json"]["arms"]["lns"]
    embedded = _verdict(summaries[table.STUDY_1500], "LNS reaches a lower eval loss")
    deep_short, deep_long = max(short["settings"]["depths"]), max(long_["settings"]["depths"])
    loss_short = _gap(short, deep_short, table.LOSS)
    loss_long = _gap(long_, deep_long, table.LOSS)
    steps_short, steps_long = short["settings"]["steps"], long_["settings"]["steps"]

    def lower(v: dict) -> str:
        return word(v, "Pre-LN reaches the lower loss", "LNS reaches the lower loss", "a difference is not shown")

    embedded_steps = summaries[table.STUDY_1500]["settings"]["steps"]
    embedded_regime = _pays(summaries[table.DEPTH]["regime"]["slopes"])
    train = (f"**Does LNS train better?** On the embedded corpus (Austen, 24 layers, {embedded_steps:,} updates; in "
             f"the embedded depth sweep {embedded_regime}), {lower(embedded)}: {effect(embedded)} nats LNS − Pre-LN "
             f"({seeds(embedded, 'favour Pre-LN', 'favour LNS')}). On Wikipedia (hidden 64, lr "
             f"{table.rate_text(short['settings']['lr'])} for both, one pass) {lower(loss_short)} at "
             f"{steps_short:,} updates (L = {deep_short}: {effect(loss_short)}), where "
             f"{_pays(budget_map['budgets'][str(steps_short)]['depth_pays'])}; at {steps_long:,} updates, where "
             f"{_pays(budget_map['budgets'][str(steps_long)]['depth_pays'])}, {lower(loss_long)} (L = {deep_long}: "
             f"{effect(loss_long)}).")

    rows_short = {r["depth"]: r for r in worth["by_budget"].get(str(steps_short), []) if r["geomean"] is not None}
    rows_long = {r["depth"]: r for r in worth["by_budget"].get(str(steps_long), []) if r["geomean"] is not None}
    trend_short, trend_long = (worth["trends"].get(str(u), {}).get("verdict") for u in (steps_short, steps_long))

    def saves(row: dict) -> str:
        return word(row["verdict"], "LNS saves compute", "Pre-LN is ahead", "no saving is shown")

    def trend(v: dict | None) -> str:
        return word(v, "grows with depth", "shrinks with depth", "no trend with depth is shown")

    question = "**What is it worth in compute, and does that grow with depth?**"
    if rows_short and rows_long:
        shallow, deep, longest_depth = min(rows_short), max(rows_short), max(rows_long)
        compute = (f"{question} At {steps_short:,} updates Pre-LN needs "
                   f"{effect(rows_short[deep]['verdict'], ratio=True)} of LNS's updates to reach its loss at "
                   f"L = {deep} ({saves(rows_short[deep])}) and {effect(rows_short[shallow]['verdict'], ratio=True)} "
                   f"at L = {shallow}: the multiplier {trend(trend_short)} (slope of its log against ln L "
                   f"{effect(trend_short)}, {seeds(trend_short, 'grow', 'shrink')}). At {steps_long:,} updates "
                   f"{saves(rows_long[longest_depth])} at L = {longest_depth} "
                   f"({effect(rows_long[longest_depth]['verdict'], ratio=True)}) and {trend(trend_long)} "
                   f"({effect(trend_long)}).")
    else:
        compute = f"{question} Not measurable yet: the multiplier's report has no cell at these budgets."

    identity = [cells[3][1] for _, cells in table.columns(summaries)]
    variance = [cells[1][1] for _, cells in table.columns(summaries)]
    count = {s: sum(status(v) == s for v in identity) for s in (REPRODUCED, OPPOSITE)}
    held = {s: sum(status(v) == s for v in variance) for s in (REPRODUCED, OPPOSITE)}
    layers = (f"**Does it fix the deep layers?** Not by the paper's mechanism: deep Pre-LN blocks being closer to the "
              f"identity than LNS's is {OPPOSITE} in {count[OPPOSITE]} of the table's {len(identity)} regimes and "
              f"{REPRODUCED} in {count[REPRODUCED]}, though LNS holding the variance growth down is {REPRODUCED} in "
              f"{held[REPRODUCED]} of {len(variance)} (the table below).")

    rivals = summaries[table.STUDY_1500_RIVALS_2026]
    attnres, mhc = (rivals["per_arm_eval_loss"][arm]["lns"] for arm in ("attnres", "mhc"))
    deep_rivals = summaries["docs/depth_sweep_mixed_compile/summary_rivals_2026.json"]
    deepest = max(deep_rivals["settings"]["depths"])
    attnres_deep = next(v for v in deep_rivals["rivals"] if v["claim"].startswith(f"L={deepest}: AttnRes")
                        and "lower eval loss than LNS" in v["claim"])
    runs = root / "docs/study_long_mixed_compile/runs"

    def against(v: dict) -> str:
        return word(v, "trails LNS", "beats LNS", "is not shown to differ from LNS")

    newest = (f"**How does it compare with the newest fixes?** On the embedded corpus at "
              f"{rivals['settings']['steps']:,} updates Attention Residuals {against(attnres)} ({effect(attnres)} "
              f"nats, {seeds(attnres, 'behind LNS', 'ahead of LNS')}) and mHC {against(mhc)} ({effect(mhc)}, "
              f"{seeds(mhc, 'behind LNS', 'ahead of LNS')}); "
              f"both were trained on {_hosts(runs, ['attnres-seed1', 'mhc-seed1'])}, LNS on "
              f"{_hosts(runs, ['lns-seed1'])}. In the depth sweep at L = {deepest} Attention Residuals "
              f"{against(attnres_deep)} ({effect(attnres_deep)}).")
    return "\n\n".join(wrap(paragraph) for paragraph in (train, compute, layers, newest))


def wrap(paragraph: str, width: int = 120) -> str:
    """A rendered paragraph (or "- " bullet) at the repository's line width; markdown reads it the same."""
    indent = "  " if paragraph.startswith("- ") else ""
    return textwrap.fill(paragraph, width, subsequent_indent=indent, break_long_words=False,
                         break_on_hyphens=False)


def between(text: str, start: str, end: str) -> str:
    """The text between two markers; ValueError naming them where either is missing."""
    if start not in text or end not in text:
        raise ValueError(f"no {start} ... {end} markers")
    return text.split(start, 1)[1].split(end, 1)[0].strip("\n")


def replace_between(text: str, start: str, end: str, body: str) -> str:
    before, rest = text.split(start, 1)
    return f"{before}{start}\n{body}\n{end}{rest.split(end, 1)[1]}"


def block(readme: str) -> str:
    return between(readme, START, END)


def with_block(readme: str, text: str) -> str:
    return replace_between(readme, START, END, text)


def words_in(text: str) -> int:
    return len([w for w in text.replace("**", "").split() if any(c.isalpha() for c in w)])


def load(path: Path) -> dict:
    return json.loads(path.read_text())
