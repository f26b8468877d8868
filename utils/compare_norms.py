"""CPU-scale study: Pre-LN against LNS (and the other placements) on one data set and budget, with every instrument.

    python utils/compare_norms.py                      # default budget: 45 minutes on 2 CPU cores with bf16
                                                       #   instructions (mixed precision, compiled: the defaults;
                                                       #   without them, --dtype float32 is about 3x faster)
    python utils/compare_norms.py --dtype float32 --no-compile  # the committed float32 records in docs/study/
    python utils/compare_norms.py --budget rivals      # + every other baseline and rival, a second pure-bf16 seed,
                                                       #   Post-LN, Mix-LN and DeepNorm at 3 seeds (resumes)
    python utils/compare_norms.py --budget long        # Pre-LN vs LNS at 5x the steps (resumes across calls)
    python utils/compare_norms.py --budget long_rivals --arms pre lns skipinit layerscale
                                                       # chosen rivals at 5x the steps, beside the long Pre-LN and
                                                       #   LNS records (all 48 new runs: about 9 hours on 2 cores)
    python utils/compare_norms.py --budget rivals_2026 # + AttnRes and mHC (issue 67), beside the rivals' records
    python utils/compare_norms.py --quick              # smoke test (CI), a few minutes
    python utils/compare_norms.py --report_only        # rewrite the report from the saved records
    python utils/compare_norms.py --plan               # the runs left and their disk, as JSON; trains nothing

Each run trains `torchrun_main.py` on the embedded corpus (same data order and init for a given seed across arms),
then the analysis tools measure its checkpoints: the core arms at five points through training (the dynamics), the
others at the end. Each finished run leaves a small record in `<out>/runs/`; records are committed with the report, so
a later invocation reuses them (`--max_hours` stops starting new runs after a deadline; the next call continues).
Verdicts compare arms seed by seed (utils/study/verdicts.py) and print each effect with its 95% interval.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

from peft_pretraining.cli import OneLineErrorParser
from peft_pretraining.model.modeling_llama import PLACEMENTS
from utils.study import cli, measures, plots, report, runs, verdicts
from utils.study.claims import CORE_CLAIMS, effect_text, loss_verdict, pair_verdicts, verdict_lines
from utils.study.measures import by_seed
from utils.study.runs import RunSpec

REPO = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    label: str
    flags: tuple[str, ...]  # --norm_type and anything else that sets this arm apart
    group: str  # core | precision | norms | rivals
    dtype: str = "float32"  # replaced by the study's --dtype; a pure-bf16 arm says "bfloat16"


def study_dtype_reason(dtype: str) -> str:
    """The report's sentence on what the study's own arms train in, and why."""
    if dtype == "mixed":
        return ("Our own arms train in mixed precision (--dtype mixed, the default): bf16 autocast over fp32 master "
                "weights and fp32 Adam state, the faster step on a CPU with bf16 instructions (docs/study.md).")
    return ("Our own arms train in float32 (--dtype float32): fp32 master weights as with --dtype mixed, and fp32 "
            "compute, the same on every host. On a CPU without bf16 instructions it is also the fastest: measured "
            "there, one thread, llama_tiny_deep, 16 x 128 packed tokens, float32 1,417 tokens/s, mixed 484, pure "
            "bfloat16 about 540 (torchrun_main.py ... --dtype {float32,mixed,bfloat16}, median of the updates after "
            "warm-up). On a CPU with bf16 instructions --dtype mixed is faster (docs/study.md).")


def placement_arm(name: str, group: str, norm_type: str | None = None, detail: str = "", flags: tuple[str, ...] = (),
                  label: str | None = None, dtype: str = "float32") -> Arm:
    """An arm training the row `norm_type` of PLACEMENTS (default: the arm's name), labelled as the row is, plus
    `detail` (its settings), unless `label` names the arm otherwise."""
    norm_type = norm_type or name
    return Arm(name, label or PLACEMENTS[norm_type].label + detail, ("--norm_type", norm_type, *flags), group, dtype)


REFERENCE_EMBED_STD = math.sqrt(2 / 5)  # the uploaded reference code's embedding init (5d4dd11)
EMBED_REF = ("--embed_init_std", f"{REFERENCE_EMBED_STD:.6f}")
ARMS = [
    placement_arm("pre", "core"),
    placement_arm("lns", "core"),
    placement_arm("pre_bf16", "precision", "pre", ", pure bf16", dtype="bfloat16"),
    placement_arm("lns_bf16", "precision", "lns", ", pure bf16", dtype="bfloat16"),
    placement_arm("post", "norms"),
    placement_arm("post_pre", "norms"),  # --post_num added from the depth
    placement_arm("deepnorm", "norms"),
    placement_arm("layerscale", "rivals", detail=" (per channel, 0.1)"),
    placement_arm("layerscale_scalar", "rivals", "layerscale", " (scalar, 1e-3)", ("--layerscale_form", "scalar")),
    placement_arm("skipinit", "rivals"),
    placement_arm("scaled_init", "rivals", "pre", flags=("--init_method", "scaled"), label="Scaled init"),
    placement_arm("depth_scaled_init", "rivals", "pre", flags=("--init_method", "depth_scaled"),
                  label="Depth-scaled init"),
    placement_arm("lns_scaled_init", "rivals", "lns", " + scaled init", ("--init_method", "scaled")),
    placement_arm("peri", "rivals"),
    placement_arm("peri_lns", "rivals"),
    placement_arm("reordered", "rivals"),
    placement_arm("dyt", "rivals"),
    placement_arm("completep", "rivals", detail=" (alpha = 1)"),
    placement_arm("pre_embed_ref", "rivals", "pre", ", embed std 0.632", EMBED_REF),
    placement_arm("lns_embed_ref", "rivals", "lns", ", embed std 0.632", EMBED_REF),
    # the fixes published since the paper (issue 39): the long rivals budget and the quick smoke test train them
    placement_arm("gpas", "recent"),
    placement_arm("lns_gpas", "recent"),
    placement_arm("bhyt", "recent"),
    placement_arm("hybridnorm", "recent"),
    # residual streams that are not a running sum (issue 67): only the *_2026 budgets train them, so that the
    # committed reports of the other budgets keep their arms
    placement_arm("attnres", "streams", detail=" (Block, 8 blocks)"),
    placement_arm("mhc", "streams", detail=" (n = 4)"),
    # SiameseNorm (issue 81): two streams sharing every block; only the *_siamese budgets train it
    placement_arm("siamese", "siamese"),
]
ARM_BY_NAME = {arm.name: arm for arm in ARMS}
SEED_KEYS = {"core": "seeds", "precision": "precision_seeds", "norms": "norms_seeds", "rivals": "seeds",
             "recent": "recent_seeds", "streams": "stream_seeds", "siamese": "siamese_seeds"}

# The budgets. Chosen for statistical power within the time limit, not tuned to the paper (see the report).
LONG_BUDGET = dict(steps=1500, warmup=75, groups=("core",), out="docs/study_long", runs_dir="runs/study_long")
BUDGETS = {
    "default": dict(model_config="configs/llama_tiny_deep.json", steps=300, warmup=30, batch_size=16,
                    max_length=128, eval_tokens=65_536, seeds=(1, 2, 3), dynamics_points=5,
                    groups=("core", "precision", "norms"), precision_seeds=(1,), norms_seeds=(1,), stream_tokens=8_192,
                    jacobian_tokens=32, jacobian_probes=8, removal_documents=16, out="docs/study",
                    runs_dir="runs/study"),
    # the default budget plus the rivals, a second pure-bf16 seed (an interval for the precision verdicts), and
    # Post-LN, Mix-LN and DeepNorm at every seed (same records folder as the default; its own report_rivals.md)
    "rivals": dict(groups=("core", "precision", "norms", "rivals"), precision_seeds=(1, 2), norms_seeds=(1, 2, 3),
                   report_suffix="_rivals"),
    "long": LONG_BUDGET,
    # the long budget plus Post-LN, Mix-LN, DeepNorm and the rivals at every seed (same records folder as `long`,
    # whose Pre-LN and LNS records it reuses; its own report_rivals.md). `--arms` picks a few: each run is long.
    "long_rivals": {**LONG_BUDGET, "groups": ("core", "norms", "rivals", "recent"), "norms_seeds": (1, 2, 3),
                    "recent_seeds": (1, 2, 3),
                    "report_suffix": "_rivals"},
    # the rivals budgets plus AttnRes and mHC, in their own report (report_rivals_2026.md) beside the same records
    "rivals_2026": dict(groups=("core", "precision", "norms", "rivals", "streams"), precision_seeds=(1, 2),
                        norms_seeds=(1, 2, 3), stream_seeds=(1, 2, 3), report_suffix="_rivals_2026"),
    "long_rivals_2026": {**LONG_BUDGET, "groups": ("core", "norms", "rivals", "recent", "streams"),
                         "norms_seeds": (1, 2, 3), "recent_seeds": (1, 2, 3), "stream_seeds": (1, 2, 3),
                         "report_suffix": "_rivals_2026"},
    # the 2026 rivals plus SiameseNorm (issue 81), in their own report (report_rivals_siamese.md), same records
    "long_rivals_siamese": {**LONG_BUDGET, "groups": ("core", "norms", "rivals", "recent", "streams", "siamese"),
                            "norms_seeds": (1, 2, 3), "recent_seeds": (1, 2, 3), "stream_seeds": (1, 2, 3),
                            "siamese_seeds": (1, 2, 3), "report_suffix": "_rivals_siamese"},
    "quick": dict(model_config="configs/llama_tiny.json", steps=6, warmup=1, batch_size=4, max_length=64,
                  eval_tokens=1_024, seeds=(1, 2), precision_seeds=(1, 2), norms_seeds=(1, 2), dynamics_points=2,
                  groups=("core", "precision", "norms", "recent"), recent_seeds=(1,), stream_seeds=(1,), siamese_seeds=(1,),
                  stream_tokens=512, jacobian_tokens=4, jacobian_probes=0, removal_documents=2,
                  out="runs/study_quick/report", runs_dir="runs/study_quick"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_study_arguments(parser, BUDGETS)
    parser.add_argument("--arms", nargs="+", default=None,
                        help=f"train only these arms (of {', '.join(ARM_BY_NAME)}); the report also keeps the "
                             "budget's other arms that already have records")
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    cli.resolve_study_args(parser, args, BUDGETS)
    if args.seeds:
        for key in SEED_KEYS.values():
            args.settings[key] = tuple(args.seeds)
    unknown = sorted(set(args.arms or ()) - set(ARM_BY_NAME))
    if unknown:
        parser.error(f"--arms: unknown {', '.join(unknown)}; valid: {', '.join(ARM_BY_NAME)}")
    cli.note_emulated_bf16(args)
    return args


# ------------------------------------------------------------------------------------------------------ the runs
def budget_arms(args) -> list[Arm]:
    return [arm for arm in ARMS if arm.group in args.settings["groups"]]


def study_arms(args) -> list[Arm]:
    chosen = budget_arms(args)
    return [arm for arm in chosen if arm.name in args.arms] if args.arms else chosen


def with_saved_arms(args, arms: list[Arm], records: dict, skipped: list[RunSpec]):
    """Add the budget's other arms that already have records, so that a sitting with --arms reports everything the
    study has so far instead of only its own arms; their missing seeds count as not yet run."""
    chosen = {arm.name for arm in arms}
    others = [arm for arm in budget_arms(args) if arm.name not in chosen]
    other_specs = run_specs(args, others)
    saved = runs.saved_records(args, other_specs)
    with_records = {record["arm"] for record in saved.values()}
    reported = [arm for arm in ARMS if arm.name in chosen or arm.name in with_records]
    missing = [spec for spec in runs.as_trained(args, other_specs)
               if spec.name not in saved and spec.arm in with_records]
    return reported, {**records, **saved}, skipped + missing


def run_specs(args, arms: list[Arm]) -> list[RunSpec]:
    s = args.settings
    num_layers = json.loads((REPO / s["model_config"]).read_text())["num_hidden_layers"]
    dynamics = runs.evenly_spaced_steps(s["steps"], s["dynamics_points"])
    base = ("--model_config", s["model_config"], "--dataset", "embedded", "--tokenizer", "embedded", "--packing",
            "--max_length", str(s["max_length"]), "--batch_size", str(s["batch_size"]), "--total_batch_size",
            str(s["batch_size"]), "--lr", runs.peak_lr(s), "--warmup_steps", str(s["warmup"]),
            "--num_training_steps", str(s["steps"]), "--eval_every", str(dynamics[0]), "--eval_tokens",
            str(s["eval_tokens"]), "--grad_clipping", "1.0", "--weight_decay", "0", "--optimizer", "adam", "--workers",
            "0", "--device", args.device)
    specs = []
    # the core first: a partial study answers it first
    for group in ("core", "precision", "norms", "rivals", "recent", "streams", "siamese"):
        group_arms = [a for a in arms if a.group == group]
        for seed in s[SEED_KEYS[group]] if group_arms else ():  # seed-major: the pairs of a seed finish together
            for arm in group_arms:
                extra = ("--post_num", str(max(1, num_layers // 4))) if arm.name == "post_pre" else ()
                steps = dynamics if group == "core" else (s["steps"],)  # the dynamics: the core Pre-LN and LNS arms
                specs.append(RunSpec(arm.name, seed, (*base, *arm.flags, *extra, "--dtype", arm.dtype), steps))
    return specs


# ------------------------------------------------------------------------------------------------------ verdicts


GROUP_NAMES = {"core": "the {fp32} Pre-LN and LNS arms", "precision": "the pure-bf16 arms",
               "norms": "Post-LN, Mix-LN and DeepNorm", "rivals": "the rivals",
               "recent": "GPAS, LNS + GPAS, BHyT and HybridNorm", "streams": "AttnRes and mHC",
               "siamese": "SiameseNorm"}


def seeds_sentence(settings: dict, fp32_label: str) -> str:
    """"Seeds 1, 2, 3 for ...; 1 for ...", naming only the groups the budget trains."""
    return "Seeds " + "; ".join(f"{', '.join(map(str, settings[SEED_KEYS[group]]))} for "
                                f"{GROUP_NAMES[group].format(fp32=fp32_label)}" for group in settings["groups"])


def arm_labels(a: str, b: str) -> tuple[str, str]:
    return ARM_BY_NAME[a].label, ARM_BY_NAME[b].label


PER_ARM_COLUMNS = {"angular_deep": "deep d(l,l+1)", "removal_deep": "deep removal cost", "jacobian_deep": "deep J dev",
                   "bi_deep": "deep block influence", "variance_growth": "variance growth"}


def per_arm_verdicts(records, arms: list[Arm]) -> dict[str, dict[str, verdicts.Verdict]]:
    """{arm: {reference: its eval loss against the reference}}, against Pre-LN and LNS where they have records
    (Pre-LN against LNS is the study's first verdict, so it is left out here)."""
    references = [name for name in ("pre", "lns") if any(r["arm"] == name for r in records.values())]
    return {arm.name: {reference: loss_verdict(records, reference, arm.name, f"{arm.label} reaches a lower eval loss "
                                               f"than {ARM_BY_NAME[reference].label}",
                                               arm_labels(reference, arm.name))
                       for reference in references if arm.name != reference and (arm.name, reference) != ("pre", "lns")}
            for arm in arms}


def per_arm_table(records, arms: list[Arm], planned_seeds: dict[str, int] | None = None) -> str:
    """One row per arm: eval loss, its paired effect against Pre-LN and against LNS, and the deep-layer measures.

    `planned_seeds` (arm -> the budget's seed count) lets a partial study count an arm's unrun seeds; without it an
    arm's seeds are the ones it has records for."""
    references = [name for name in ("pre", "lns") if any(r["arm"] == name for r in records.values())]
    against = per_arm_verdicts(records, arms)
    taken = measures.measures_in(records)  # a later measure only where some record has it
    columns = {m: title for m, title in PER_ARM_COLUMNS.items() if m in taken}
    rows = []
    for arm in arms:
        per_seed = by_seed(records, arm.name, "eval_loss")
        finished = [v for v in per_seed.values() if v is not None]
        diverged = sum(1 for r in records.values() if r["arm"] == arm.name and r["status"] != "finished")
        planned = max(len(per_seed), (planned_seeds or {}).get(arm.name, 0))
        notes = []
        if diverged:
            notes.append(f"{diverged} diverged")
        if planned > len(per_seed):
            notes.append(f"{planned - len(per_seed)} not yet run")
        cells = [arm.label, f"{sum(finished) / len(finished):.4f}" if finished else "n/a",
                 f"{len(finished)}/{planned}" + (f" ({', '.join(notes)})" if notes else "")]
        for reference in references:
            if arm.name == reference:
                cells.append("(reference)")
            elif reference == "lns" and arm.name == "pre":
                cells.append("(see LNS against Pre-LN)")
            else:
                cells.append(effect_text(against[arm.name][reference]))
        for measure in columns:
            measured = [x for x in by_seed(records, arm.name, measure).values() if x is not None]
            cells.append(f"{sum(measured) / len(measured):.4f}" if measured else "n/a")
        rows.append("| " + " | ".join(cells) + " |")
    header = " | ".join(f"eval loss − {ARM_BY_NAME[r].label} [95% CI], agreeing" for r in references)
    return (f"| arm | eval loss (mean) | finished/seeds | {header} | {' | '.join(columns.values())} |\n|"
            + "---|" * (3 + len(references) + len(columns)) + "\n" + "\n".join(rows))


def plot_per_arm(records, arms: list[Arm], path: Path) -> Path:
    """Each arm's eval loss and deep-layer measures at its last checkpoint: a dot per seed, a bar (a tick for the loss)
    at the mean."""
    plt = plots.pyplot()
    panels = [("eval_loss", "eval loss (nats/token)"), ("angular_deep", "deep d(l, l+1)"),
              ("removal_deep", "deep removal cost (nats/word)"), ("jacobian_deep", "deep ‖J − I‖/√d")]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 0.9 + 0.32 * len(arms)), sharey=True)
    rows = range(len(arms))
    for ax, (measure, title) in zip(axes, panels):
        for row, arm in zip(rows, arms):
            seeds = [v for v in by_seed(records, arm.name, measure).values() if v is not None and math.isfinite(v)]
            if not seeds:
                continue
            color = "tab:blue" if arm.name in ("pre", "lns") else "0.6"
            if measure == "eval_loss":  # no bar: the losses differ by tenths of a nat on a scale that starts near 5
                ax.plot(sum(seeds) / len(seeds), row, "|", color=color, markersize=14, markeredgewidth=2.5)
            else:
                ax.barh(row, sum(seeds) / len(seeds), color=color, height=0.6)
            ax.plot(seeds, [row] * len(seeds), "k.", markersize=4)
        ax.set_title(title, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(list(rows), [arm.label for arm in arms], fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle("Every arm at its last checkpoint (bar or tick: mean over seeds; dots: seeds)", fontsize=10)
    fig.tight_layout()
    return plots.save_figure(fig, path)


def one_seed_differences(records, pre: str, lns: str) -> list[float | None]:
    """Per claim of pair_verdicts, LNS minus Pre-LN (a log ratio where the claim uses one) when exactly one seed
    pairs the two arms: a point estimate with no interval, so that a one-seed arm still shows its sign."""
    claimed = [(measure, log_ratio) for _, measure, _, log_ratio in CORE_CLAIMS] + [("removal_deep", False)]
    found = []
    for measure, log_ratio in claimed:
        a, b = by_seed(records, pre, measure), by_seed(records, lns, measure)
        pairs = [(a[s], b[s]) for s in a if s in b and a[s] is not None and b[s] is not None]
        if len(pairs) != 1 or (log_ratio and min(pairs[0]) <= 0):
            found.append(None)
            continue
        x, y = pairs[0]
        found.append(math.log(y / x) if log_ratio else y - x)
    return found


def precision_section(records, fp32: list[verdicts.Verdict], bf16: list[verdicts.Verdict],
                      fp32_label: str = "float32") -> str:
    """Each claim's effect in both precisions side by side, then what pure bf16 does to each norm type's loss.
    fp32_label names the precision of the arms with fp32 master weights (float32 or mixed precision)."""
    single = one_seed_differences(records, "pre_bf16", "lns_bf16")
    one_seed_note = (" With one pure-bf16 seed, the loss and removal claims are judged over held-out documents and "
                     "the others are point estimates; `--budget rivals` adds a second seed and gives seed intervals "
                     "(report_rivals.md).") if any(p is not None for p in single) else ""
    rows = []
    for a, b, point in zip(fp32, bf16, single):
        b_effect = b.effect if b.effect is not None else point
        b_text = effect_text(b) if b.effect is not None or point is None else f"{point:+.4f} (one seed, no interval)"
        if a.effect is None or b_effect is None:
            sign = "n/a"  # nothing to compare; "differs" would claim a disagreement
        else:
            sign = "same" if (a.effect > 0) == (b_effect > 0) else "differs"
        rows.append(f"| {a.claim} | {effect_text(a)} | {b_text} | {sign} |")
    cost = [loss_verdict(records, arm, f"{arm}_bf16", f"Pure bf16 raises {label}'s eval loss over {fp32_label}",
                         arm_labels(arm, f"{arm}_bf16"), +1)
            for arm, label in (("pre", "Pre-LN"), ("lns", "LNS"))]
    cost_lines = []
    for v, arm in zip(cost, ("pre", "lns")):
        if v.effect is None:
            a, b = by_seed(records, arm, "eval_loss"), by_seed(records, f"{arm}_bf16", "eval_loss")
            pairs = {s: b[s] - a[s] for s in b if a.get(s) is not None and b[s] is not None}
            if pairs:
                cost_lines.append(f"- {v.claim}: " + ", ".join(f"seed {s}: {d:+.4f}" for s, d in pairs.items())
                                  + " (one seed, no interval)")
                continue
        cost_lines.append(f"- {v.line()}")
    return ("### Does precision change the conclusions?\n\n"
            "The table puts each claim's effect in both precisions side by side; the last column says whether their "
            f"signs agree.{one_seed_note}\n\n"
            f"| claim (LNS − Pre-LN) | {fp32_label} effect [95% CI], seeds agreeing | pure bf16 effect [95% CI], "
            "seeds agreeing | sign |\n|---|---|---|---|\n" + "\n".join(rows)
            + f"\n\nWhat pure bf16 costs each norm type (pure bf16 minus {fp32_label}, paired by seed; here "
            "\"reproduced\" means the stated direction with an interval that excludes zero):\n\n"
            + "\n".join(cost_lines))


# ------------------------------------------------------------------------------------------------------ report
def budget_evidence(records) -> list[str]:
    """Is the budget past the corpus's overfitting point? The step of each run's lowest eval loss says."""
    lines = []
    for arm in sorted({r["arm"] for r in records.values()}):
        # a diverged run's curve stops at its divergence, not at the budget's end: it says nothing of overfitting
        runs = [r for r in records.values() if r["arm"] == arm and r["eval_curve"] and r["status"] == "finished"]
        if not runs:
            continue
        best = [min(r["eval_curve"], key=lambda p: p[1])[0] for r in runs]
        last = [r["eval_curve"][-1][0] for r in runs]
        falling = sum(best_step == last_step for best_step, last_step in zip(best, last))
        lines.append(f"| {ARM_BY_NAME[arm].label} | {', '.join(map(str, best))} | {last[0]} | {falling}/{len(runs)} |")
    return lines


def pair_sections(records, present: set[str], fp32_label: str) -> tuple[list[str], dict[str, list]]:
    """The verdicts of Pre-LN against LNS in each precision that has both arms, as report sections, and by
    precision; with both precisions, the section comparing them."""
    sections = []
    all_verdicts = {}
    if {"pre", "lns"} <= present:
        found = pair_verdicts(records, "pre", "lns", arm_labels("pre", "lns"))
        all_verdicts[f"{fp32_label} (fp32 master weights)"] = found
        sections.append(f"### Pre-LN vs LNS, {fp32_label} (fp32 master weights)\n\n"
                        + verdict_lines(found))
    if {"pre_bf16", "lns_bf16"} <= present:
        found = pair_verdicts(records, "pre_bf16", "lns_bf16", arm_labels("pre_bf16", "lns_bf16"))
        all_verdicts["pure bf16 (the paper's setting)"] = found
        sections.append("### Pre-LN vs LNS, pure bf16 weights and Adam state (the paper's setting)\n\n"
                        + verdict_lines(found))
        frozen = [r for r in records.values() if r["arm"] in ("pre_bf16", "lns_bf16") and r.get("analyses")]
        devs = [max(a["norm_gains"]["max_abs_dev_from_one"] for a in r["analyses"].values()) for r in frozen]
        if devs:  # runs that diverged before their first analysed checkpoint have no gains to read
            sections.append(f"- Norm gains in the pure-bf16 runs: the largest |gain - 1| over every block norm and "
                            f"every analysed checkpoint is {max(devs):.3g} over {len(devs)} runs "
                            f"({'every gain stayed exactly 1.0' if max(devs) == 0 else 'the gains moved'}).")
    if len(all_verdicts) == 2:
        sections.append(precision_section(records, *all_verdicts.values(), fp32_label))
    return sections, all_verdicts


def setup_section(args, records, fp32_label: str) -> str:
    """The report's Set-up: the model, the data and budget, the training, the evaluation, the instruments, the speed
    and the machine."""
    s = args.settings
    steps_info = runs.evenly_spaced_steps(s["steps"], s["dynamics_points"])
    tokens = s["steps"] * s["batch_size"] * s["max_length"]
    train_tokens = report.embedded_train_tokens()
    epochs = tokens / train_tokens
    speeds = [r["tokens_per_s_median"] for r in records.values() if r.get("tokens_per_s_median")]
    config = json.loads((REPO / s["model_config"]).read_text())
    return f"""## Set-up

- **Model**: `{s['model_config']}`: {config['num_hidden_layers']} layers, hidden {config['hidden_size']},
  intermediate {config['intermediate_size']}, {config['num_attention_heads']} heads, vocab {config['vocab_size']}.
- **Data**: the embedded Jane Austen corpus (five novels to train, *Persuasion* held out), packed into windows of
  {s['max_length']} tokens. {s['steps']} updates × {s['batch_size']} × {s['max_length']} = {tokens / 1e6:.2f} M tokens
  per run = {epochs:.2f} epochs over the {train_tokens:,}-token training split.
- **Training**: Adam, lr {runs.peak_lr(s)}, {s['warmup']} warmup steps then cosine to 10%, grad clipping 1.0, no weight decay;
  {fp32_label}{' unless the arm says pure bf16' if 'precision' in s['groups'] else ''}. {study_dtype_reason(args.dtype)}
  {seeds_sentence(s, fp32_label)}: a seed fixes the init and the data order, identical across arms.
- **Evaluation**: token-weighted cross-entropy over {s['eval_tokens']:,} held-out tokens, every {steps_info[0]} steps.
- **Instruments**, at steps {', '.join(map(str, steps_info))} for the Pre-LN and LNS arms and at the end for the
  others, all inside the trained context of {s['max_length']} tokens: residual variance and angular distance over
  {s['stream_tokens']:,} held-out tokens; block Jacobians at {s['jacobian_tokens']} held-out tokens
  ({'exact' if not s['jacobian_probes'] else f"{s['jacobian_probes']} random probes per token, unbiased"}); removal of
  each layer in turn (layer_remove.py --sweep, {s['removal_documents']} documents); the norm gains.
- **Speed**: median {statistics.median(speeds) if speeds else float('nan'):,.0f} tokens/s per run
  (one thread per run, {args.jobs} runs at a time, {'torch.compile' if args.compile else 'eager'}, {args.dtype}).
{report.machine_lines(records)}
"""


def write_report(args, arms: list[Arm], records: dict, skipped: list[RunSpec], started: float, argv) -> Path:
    specs = run_specs(args, arms)
    frame = report.frame("utils/compare_norms.py", args, argv, started, records, skipped, len(specs))
    out, s, suffix = frame.out, frame.settings, frame.suffix
    labels = {a.name: a.label for a in arms}
    present = {a.name for a in arms if any(r["arm"] == a.name for r in records.values())}
    core = {n: labels[n] for n in ("pre", "lns", "pre_bf16", "lns_bf16") if n in present}
    figures = {}
    if core:
        figures["dynamics"] = plots.plot_dynamics(records, core, out / f"dynamics{suffix}.png")
        figures["profiles"] = plots.plot_layer_profiles(records, core, out / f"layer_profiles{suffix}.png")
    fp32_label = cli.DTYPE_LABELS[args.dtype]
    sections, all_verdicts = pair_sections(records, present, fp32_label)
    table_arms = [a for a in arms if a.name in present and a.group != "precision"]
    table, per_arm, embedding_init = "", {}, {}
    if "pre" in present:
        png = plot_per_arm(records, table_arms, out / f"per_arm{suffix}.png")
        planned = {arm.name: len(s[SEED_KEYS[arm.group]]) for arm in table_arms}
        table = per_arm_table(records, table_arms, planned) + f"\n\n![every arm]({png.name})"
        per_arm = {arm: {reference: v.as_dict() for reference, v in against.items()}
                   for arm, against in per_arm_verdicts(records, table_arms).items()}
    if {"pre_embed_ref", "lns_embed_ref", "pre", "lns"} <= present:
        gap_ref = verdicts.judge_seeds("LNS reaches a lower eval loss than Pre-LN with the reference's embedding "
                                       "std 0.632", -1, by_seed(records, "pre_embed_ref", "eval_loss"),
                                       by_seed(records, "lns_embed_ref", "eval_loss"), ("Pre-LN", "LNS"))
        sections.append("### Embedding init (std 0.02 against the uploaded reference code's 0.632)\n\n"
                        f"- {gap_ref.line()}\n- (with std 0.02, see the first verdict above)")
        embedding_init = {"embedding_init_std_0.632": gap_ref.as_dict()}

    train_minutes = sum(r["train_seconds"] for r in records.values()) / 60
    timed = [r for r in records.values() if r.get("analysis_seconds") is not None]
    analysis_minutes = sum(r["analysis_seconds"] for r in timed) / 60
    run_minutes = train_minutes + analysis_minutes
    by_group: dict[str, float] = {}
    for r in records.values():
        group = ARM_BY_NAME[r["arm"]].group
        by_group[group] = by_group.get(group, 0.0) + (r["train_seconds"] + (r.get("analysis_seconds") or 0)) / 60
    group_minutes = ", ".join(f"{group} {minutes:.0f}" for group, minutes in by_group.items())
    status = frame.status
    unstarted = [arm for arm in budget_arms(args) if arm not in arms]
    if unstarted:  # a sitting with --arms: "complete" covers only the arms that have records
        unstarted_runs = len(run_specs(args, unstarted))
        subject = "other arm has" if len(unstarted) == 1 else f"other {len(unstarted)} arms have"
        status += (f" The budget's {subject} no records yet "
                   f"({', '.join(arm.label for arm in unstarted)}; {unstarted_runs} runs): "
                   f"`--arms {' '.join(arm.name for arm in unstarted)}` trains them.")
    figure_lines = "\n\n".join(f"![{name}]({frame.rel(path)})" for name, path in figures.items())
    text = f"""# CPU-scale study: does the curse of depth appear, and does LNS lift it?

{frame.opening}
{status} The {len(records)} runs trained for {train_minutes:.0f} minutes and were analysed for
{analysis_minutes:.0f} minutes ({len(timed)} runs timed), one thread each, {args.jobs} at a time: {run_minutes:.0f} run-minutes, by group
{group_minutes}. {report.wall_time_sentence(specs, records, args.jobs)}

## Verdicts

A verdict compares two arms seed by seed (only seeds where both finished form a pair). The effect is the mean
paired difference (LNS minus Pre-LN unless stated), with a 95% Student-t interval over the pairs. **reproduced**
means the claim's direction (the paper's, for the paper's claims) AND an interval that excludes zero;
**opposite** means an interval that excludes zero the other way; **inside noise** means the interval contains
zero. A removal claim where removing a deep layer helps both models (negative costs) is never counted as
reproduced.

{(chr(10) * 2).join(sections) or 'No pair of arms has records yet.'}

## Per-arm results (last checkpoint)

{table}

Deep = the deeper half of the layers. Removal cost = ln(perplexity without the layer / with it) on
{s['removal_documents']} held-out documents, nats per word. An effect counted in documents comes from an arm with one
seed: it is the held-out novel's loss per word (not the trainer's eval loss per token), with a bootstrap interval over
the documents, which holds the documents' noise and not the seed's. In the "against" columns, **reproduced** means the
arm's loss is lower than the reference's with an interval that excludes zero, **opposite** that it is higher.

## Dynamics and per-layer profiles

{figure_lines}

{setup_section(args, records, fp32_label)}
### Is the budget long enough, and not past overfitting?

The step at which each run's eval loss was lowest, against its last eval step (a run whose lowest eval loss is at
its last eval is still improving, so the budget has not reached the corpus's overfitting point):

| arm | step of lowest eval loss, per seed | last eval step | runs still improving |
|---|---|---|---|
{chr(10).join(budget_evidence(records))}

Raw numbers: one JSON record per run in `runs/` (flags, eval curve, every analysis at every analysed checkpoint).
"""
    summary = dict(budget=args.budget, settings=s, verdicts={k: [v.as_dict() for v in vs]
                                                             for k, vs in all_verdicts.items()},
                   runs=sorted(records), missing=[spec.name for spec in skipped],
                   arms_without_records=[arm.name for arm in unstarted],
                   **({"per_arm_eval_loss": per_arm} if per_arm else {}), **embedding_init)
    return report.write_report_files(out, text, summary, suffix)


@cli.stop_on_unreadable_record
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    started = time.time()
    arms = study_arms(args)
    specs = run_specs(args, arms)
    if args.plan:
        return report.print_plan(args, specs)
    records, skipped = runs.collect_records(args, specs)
    if args.arms:
        arms, records, skipped = with_saved_arms(args, arms, records, skipped)
    written = write_report(args, arms, records, skipped, started, argv)
    print(f"report: {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
