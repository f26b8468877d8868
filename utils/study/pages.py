"""Study pages whose answer, set-up and rebuild commands are rendered from the committed summaries (issue 80).

A page is: its question and caveats, written by hand without numbers; and three blocks between markers, rewritten
here: the answer (every number with its interval, words only as findings.py allows them), the set-up (from the
summaries' settings and the records' hosts) and how to rebuild it (the registry's commands).

    python -m utils.study.pages          # rewrite every rendered block
    python -m utils.study.pages --check  # exit 1 where a page's block is not what the summaries give
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from peft_pretraining.cli import OneLineErrorParser
from utils.study import records as record_store
from utils.study import registry
from utils.study.budget_map import mean_interval
from utils.study.findings import between, effect, replace_between, seeds, word, wrap
from utils.study.host import cpu_of
from utils.study.results_table import rate_text
from utils.study.runs import REPO
from utils.study.sweep import NORMS

BLOCKS = ("answer", "setup", "rebuild")


class Summaries:
    """Committed JSON under the repository, each read once."""

    def __init__(self, root: Path = REPO):
        self.root, self.cache = root, {}

    def __getitem__(self, name: str) -> dict:
        if name not in self.cache:
            self.cache[name] = json.loads((self.root / name).read_text())
        return self.cache[name]


def pays(slopes: dict) -> str:
    """Where depth pays at a budget: the arms whose eval loss falls with depth beyond noise, with the slope."""
    parts = []
    for arm, v in slopes.items():
        verb = word(v, "adding layers raises its loss", "depth pays", "depth is not shown to pay")
        parts.append(f"for {NORMS[arm]} {verb} ({effect(v)})")
    return "; ".join(parts)


def hosts(folders: list[str], root: Path) -> str:
    """The CPUs and precisions the folders' records were trained with, with run counts."""
    found = Counter()
    for folder in folders:
        for path in record_store.paths_in(root / folder / "runs"):
            record = record_store.read(path)
            run = record_store.fields(record)
            found[f"{cpu_of(record)}, {run.dtype}{', compiled' if run.compiled else ', eager'}"] += 1
    return "; ".join(f"{what} ({n} runs)" for what, n in found.most_common())


# ----------------------------------------------------------------------------------------- the Wikipedia study
MAP = "docs/depth_sweep_wikipedia_budget_map/budget_map.json"
WORTH = "docs/compute_multiplier/multiplier.json"
LONGEST = "docs/depth_sweep_wikipedia_lr0.002/summary.json"


def wikipedia_answer(s: Summaries) -> str:
    budget_map, worth = s[MAP], s[WORTH]["arms"]["lns"]
    longest = s[LONGEST]
    lines = []
    for updates, budget in budget_map["budgets"].items():
        depths = budget["depths"]
        spread = mean_interval(list(budget["lead"][str(max(depths))].values()))
        lead = dict(effect=spread["mean"], low=spread["low"], high=spread["high"])
        slope = budget["slope"]
        rows = {r["depth"]: r for r in worth["by_budget"].get(updates, []) if r["geomean"] is not None}
        trend = worth["trends"].get(updates, {}).get("verdict") or {}
        lead_words = word(lead, "LNS ahead", "Pre-LN ahead", "a difference not shown") if lead["low"] is not None \
            else "one seed"
        text = (f"- **{int(updates):,} updates** ({budget['tokens'] / 1e6:.1f}M tokens, L = "
                f"{', '.join(map(str, depths))}): {pays(budget['depth_pays'])}. LNS's lead over Pre-LN at "
                f"L = {max(depths)} is {effect(lead)} nats ({lead_words}); the lead "
                f"{word(slope, 'grows with depth', 'shrinks with depth', 'is not shown to change with depth')} "
                f"(slope against ln L {effect(slope)}"
                + (f", {seeds(slope, 'grow', 'shrink')})." if slope.get("effect") is not None else ")."))
        if rows:
            deepest = max(rows)
            measured = trend.get("effect") is not None
            text += (f" Pre-LN needs {effect(rows[deepest]['verdict'], ratio=True)} of LNS's updates to match it at "
                     f"L = {deepest}; the multiplier "
                     + (f"{word(trend, 'grows with depth', 'shrinks with depth', 'is not shown to change with depth')}"
                        f" ({effect(trend)})." if measured else "has no trend yet."))
        lines.append(text)
    for pair in budget_map["interactions"]:
        v = pair["difference"]
        which = word(v, "larger at the shorter budget", "larger at the longer budget", "a difference is not shown")
        lines.append(f"- The lead's slope over L = {', '.join(map(str, pair['depths']))} at {pair['short']:,} against "
                     f"{pair['long']:,} updates: {which} ({effect(v)}, "
                     f"{seeds(v, 'larger at the shorter', 'larger at the longer')}).")
    compared = {entry["measure"]: entry for entry in longest["comparative"]}
    variance, identity = compared["variance_growth"]["ratio"], compared["jacobian_deep"]["ratio"]
    angular = compared["angular_deep"]["ratio"]
    variance_words = word(variance, "is larger", "is smaller (the paper's way)", "is not shown to differ")
    identity_words = word(identity, "away from the identity (the paper's way)",
                          "toward the identity (against the paper)", "in no direction shown")
    angular_words = word(angular, "grows", "shrinks (against the paper)", "shows no trend")
    lines.append(f"- **The mechanism, at {longest['settings']['steps']:,} updates:** LNS's variance growth relative to "
                 f"Pre-LN's {variance_words} ({effect(variance)}, log ratio); with depth, LNS's deep blocks relative "
                 f"to Pre-LN's move {identity_words} (slope of the log ratio of ‖J − I‖ {effect(identity)}) and their "
                 f"angular distance {angular_words} ({effect(angular)}).")
    best = budget_map.get("best_rates") or []
    if best:
        deepest = max(best, key=lambda b: b["depth"])
        v = deepest["verdict"]
        lower = word(v, "Pre-LN reaches the lower loss", "LNS reaches the lower loss", "a difference is not shown")
        lines.append(f"- **Each arm at its own best rate** ({budget_map['best_rate_updates']:,} updates, "
                     f"rates chosen on the eval text): at L = {deepest['depth']} Pre-LN at {deepest['rate_pre']:g} "
                     f"and LNS at {deepest['rate_lns']:g}, {lower} ({effect(v)} {over(v)}).")
    return "\n".join(lines)


def over(verdict: dict) -> str:
    """What an interval is over: seeds, or (one seed) held-out articles, whose noise is not the seed's."""
    if verdict["unit"] == "documents":
        return f"nats per word over {verdict['n_pairs']} held-out articles: the articles' noise, not the seed's"
    return f"nats over {verdict['n_pairs']} seeds"


def wikipedia_setup(s: Summaries) -> str:
    budget_map, longest = s[MAP], s[LONGEST]["settings"]
    folders = budget_map["folders"]
    budgets = ", ".join(f"{int(u):,}" for u in budget_map["budgets"])
    return "\n".join([
        f"- **Corpus:** English Wikipedia, 5,907 articles ([data](data.md#the-wikipedia-corpus-and-its-tokenizer)), "
        f"a {longest['vocab_size']:,}-token BPE vocabulary, read in one pass; evaluated on the first "
        f"{longest['eval_tokens']:,} validation tokens, analysed on the first validation articles.",
        f"- **Model:** LLaMA blocks at hidden 64 (4 heads of 16, MLP 176), L = "
        f"{', '.join(map(str, sorted({d for b in budget_map['budgets'].values() for d in b['depths']})))}.",
        f"- **Budgets:** {budgets} updates of {longest['batch_size']} × {longest['max_length']} tokens, each a "
        f"finished run: warmup 10% of it, cosine to 10% of the peak.",
        f"- **Rate:** lr {rate_text(budget_map['rate'])} for both arms, Adam, no weight decay, clipping 1.0; a "
        f"grid of other rates, at fewer seeds, beside the longest budget ({', '.join(budget_map['grid_folders'])}).",
        f"- **Seeds:** {', '.join(map(str, longest['seeds']))}, paired across arms; intervals are Student-t over "
        "seeds.",
        f"- **Hosts and precision:** {hosts(folders, REPO)}.",
    ])


# ----------------------------------------------------------------------------------------- the rivals
RIVALS_SHORT = "docs/study/summary_rivals_2026.json"  # 300 updates, float32 eager, every rival but the 1,500-only
RIVALS_LONG = "docs/study_long_mixed_compile/summary_rivals_2026.json"  # 1,500 updates, mixed compiled
DEPTH_RIVALS = ("docs/depth_sweep_mixed_compile/summary_rivals.json",
                "docs/depth_sweep_mixed_compile/summary_rivals_2026.json")


def against_lns(verdict: dict | None) -> str:
    if verdict is None:
        return "—"
    return f"{word(verdict, 'trails', 'beats', 'not shown')} {effect(verdict)}"


def depth_rival_verdicts(s: Summaries) -> dict[str, dict[int, dict]]:
    """{rival label: {depth: its eval loss against LNS's}} from the depth sweep's rival reports."""
    found = {}
    for summary in DEPTH_RIVALS:
        for v in s[summary]["rivals"]:
            head, _, rest = v["claim"].partition(": ")
            if rest.endswith("(" + rest.split(" reaches")[0] + " − LNS)") and " lower eval loss than LNS" in rest:
                found.setdefault(rest.split(" reaches")[0], {})[int(head.removeprefix("L="))] = v
    return found


def label_of(summaries: list[dict], arm: str) -> str:
    """An arm's label, as its verdict against LNS names it ("AttnRes (Block, 8 blocks) reaches ...")."""
    verdict = next(s["per_arm_eval_loss"][arm]["lns"] for s in summaries if arm in s["per_arm_eval_loss"])
    return verdict["claim"].split(" reaches a lower eval loss than ")[0]


def rivals_answer(s: Summaries) -> str:
    short, long_ = s[RIVALS_SHORT], s[RIVALS_LONG]
    arms = [a for a in long_["per_arm_eval_loss"] if a not in ("pre", "lns")]
    arms += [a for a in short["per_arm_eval_loss"] if a not in ("pre", "lns") and a not in arms]
    deep = depth_rival_verdicts(s)
    depths = sorted({d for per in deep.values() for d in per})
    steps = (short["settings"]["steps"], long_["settings"]["steps"])
    lines = [f"| arm | {steps[0]:,} updates | {steps[1]:,} updates | "
             + " | ".join(f"depth sweep, L = {d}" for d in depths) + " |", "|---" * (3 + len(depths)) + "|"]
    tally = Counter()
    for arm in arms:
        label = label_of([long_, short], arm)
        cells = [against_lns(summary["per_arm_eval_loss"].get(arm, {}).get("lns")) for summary in (short, long_)]
        prefix = label.split(" (")[0].split(",")[0]
        cells += [against_lns(next((per[d] for name, per in deep.items() if name.startswith(prefix) and d in per),
                                   None)) for d in depths]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
        verdict = long_["per_arm_eval_loss"].get(arm, {}).get("lns")
        if verdict is not None:
            tally[word(verdict, "trail", "beat", "not shown")] += 1
    count = (f"At {steps[1]:,} updates, of {sum(tally.values())} arms against LNS, {tally['beat']} beat it, "
             f"{tally['trail']} trail it and {tally['not shown']} are not shown to differ.")
    return "\n".join([count, "", *lines])


def rivals_setup(s: Summaries) -> str:
    short, long_ = s[RIVALS_SHORT]["settings"], s[RIVALS_LONG]["settings"]
    return "\n".join([
        "- **Corpus:** the embedded corpus (Austen's novels, about 0.8M training tokens, seen over several epochs), "
        "where adding layers raises the loss ([the depth sweep](depth_sweep_study.md)).",
        f"- **Model:** `{long_['model_config']}`, {long_['batch_size']} × {long_['max_length']} tokens an update.",
        f"- **Budgets:** {short['steps']:,} updates (float32, eager) and {long_['steps']:,} updates (mixed precision, "
        f"compiled), seeds {', '.join(map(str, long_['seeds']))}; the depth sweep's rivals at its own budget.",
        "- **Rate:** lr 1e-3 for every arm, not tuned per arm.",
        f"- **Hosts and precision:** {hosts(['docs/study', 'docs/study_long_mixed_compile'], REPO)}.",
    ])


# ----------------------------------------------------------------------------------------- the page table
PAGES = {
    "docs/wikipedia_study.md": dict(answer=wikipedia_answer, setup=wikipedia_setup,
                                    rebuild=(registry.WIKIPEDIA, registry.BUDGET_MAP)),
    "docs/rivals_study.md": dict(answer=rivals_answer, setup=rivals_setup, rebuild=(registry.CPU_STUDY,)),
}


def rebuild_block(groups: tuple[str, ...]) -> str:
    lines = ["```bash"]
    for study in registry.STUDIES:
        if study.group in groups:
            lines.append(f"{study.command}   # {study.name}")
    return "\n".join([*lines, "```"])


def render(page: str, s: Summaries) -> dict[str, str]:
    spec = PAGES[page]
    return dict(answer=wrapped(spec["answer"](s)), setup=wrapped(spec["setup"](s)),
                rebuild=rebuild_block(spec["rebuild"]))


def wrapped(text: str) -> str:
    """Each bullet or paragraph at the line width; table rows and blank lines as they are."""
    return "\n".join(line if line.startswith("|") or not line else wrap(line) for line in text.split("\n"))


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def block_of(text: str, name: str) -> str:
    return between(text, *markers(name))


def with_block(text: str, name: str, body: str) -> str:
    return replace_between(text, *markers(name), body)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="python -m utils.study.pages", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 where a block is stale")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    summaries, stale = Summaries(), []
    for page in PAGES:
        path = REPO / page
        text = path.read_text()
        wanted = render(page, summaries)
        try:
            current = {name: block_of(text, name) for name in BLOCKS}
        except ValueError as error:
            print(f"{page}: {error}", file=sys.stderr)
            return 2
        if current == wanted:
            continue
        stale.append(page)
        if not args.check:
            for name, body in wanted.items():
                text = with_block(text, name, body)
            path.write_text(text)
    if args.check and stale:
        print(f"{', '.join(stale)}: rendered blocks are stale; run python -m utils.study.pages", file=sys.stderr)
        return 1
    print(f"{len(stale)} page(s) {'stale' if args.check else 'rewritten'}, {len(PAGES) - len(stale)} unchanged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
