"""Where does the curse of depth begin? Pre-LN against LNS at several depths, with the study's instruments.

    python utils/depth_sweep.py                  # default budget (mixed precision, compiled: the defaults)
    python utils/depth_sweep.py --dtype float32 --no-compile  # the committed float32 records in docs/depth_sweep/
    python utils/depth_sweep.py --budget deep    # adds L=96 to the default's records (resumes across invocations)
    python utils/depth_sweep.py --budget long    # 3x the tokens per run (resumes across invocations)
    python utils/depth_sweep.py --budget rivals  # adds GPAS and BHyT at L=24 and 48 to the default's records
    python utils/depth_sweep.py --budget wikipedia_gpu --device cuda --no-compile --jobs 6  # hidden 768, one GPU
    python utils/depth_sweep.py --budget wikipedia --lr 4e-3 --depths 6 12 24 --arms lns --seeds 2 3  # one arm's seeds
    python utils/depth_sweep.py --overfit_probe  # also find where the corpus overfits at the deepest depth
    python utils/depth_sweep.py --quick          # smoke test (CI)
    python utils/depth_sweep.py --report_only    # rewrite the report from the saved records
    python utils/depth_sweep.py --plan           # the runs left and their disk, as JSON; trains nothing

Every depth uses the same width, data, tokens, schedule and seeds; only the number of layers changes. Each run is
trained, then measured at three points through training with the repository's tools (utils/study/). For each
of the paper's depth predictions the report gives a verdict: the per-seed slope of the measure against ln L, with a
95% interval over seeds. Finished runs leave records in `<out>/runs/`, reused by later invocations.

The token budget must stay below the point where the corpus starts to overfit at the deepest depth. The overfitting
probe measures that point: one LNS run at the deepest depth, trained for many more updates with frequent evals (about
80 minutes at L=48 on one core). It checkpoints as it goes and resumes where an interrupted invocation stopped.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from peft_pretraining.cli import OneLineErrorParser
from peft_pretraining.data.wikipedia_corpus import SINGLE_PASS_UPDATES, TRAIN_TOKENS
from utils.study import cli, measures, plots, report, runs
from utils.study.depth_verdicts import (
    comparative_section,
    comparative_verdicts,
    depth_verdicts,
    gap_verdicts,
    heldout_text,
    lns_own_slopes,
    one_seed_slopes,
    one_seed_text,
    prediction_lines,
    regime,
    rival_verdicts,
    rivals_section,
)
from utils.study.records import derive_fields
from utils.study.runs import RunSpec
from utils.study.sweep import (
    BASE_CONFIG,
    NORMS,
    RIVAL_NORMS,
    Axis,
    measures_table,
    plot_against,
    plot_gap,
    resting_sentence,
    train_flags,
    write_config,
)

REPO = Path(__file__).resolve().parent.parent

# 16 x 128-token updates of the Wikipedia budgets: one pass, below SINGLE_PASS_UPDATES at every seed, and a multiple
# of 1,500 so that the analyses (thirds) fall on the 500-update saves and evals.
WIKIPEDIA_STEPS = 10_500
BUDGETS = {
    "default": dict(depths=(6, 12, 24, 48), steps=400, warmup=40, lr="1e-3", batch_size=16, max_length=128,
                    eval_tokens=32_768, seeds=(1, 2, 3), dynamics_points=3, stream_tokens=8_192,
                    jacobian_tokens=32, jacobian_probes=8, removal_documents=16, out="docs/depth_sweep",
                    runs_dir="runs/depth_sweep",
                    # the overfitting probe: LNS (the placement that reaches the lower loss) at the deepest depth
                    probe_norm="lns", probe_seed=1, probe_steps=3000, probe_warmup=300, probe_eval_every=250),
    "deep": dict(depths=(6, 12, 24, 48, 96), report_suffix="_deep"),
    # GPAS and BHyT beside the default's Pre-LN and LNS at L = 24 and 48 (same records folder)
    "rivals": dict(rival_norms=("gpas", "bhyt"), rival_depths=(24, 48), report_suffix="_rivals"),
    # and AttnRes and mHC beside them (issue 67), in their own report over the same records
    "rivals_2026": dict(rival_norms=("gpas", "bhyt", "attnres", "mhc"), rival_depths=(24, 48),
                        report_suffix="_rivals_2026"),
    # and SiameseNorm beside them (issue 81), in its own report over the same records
    "rivals_siamese": dict(rival_norms=tuple(RIVAL_NORMS), rival_depths=(24, 48), report_suffix="_rivals_siamese"),
    "long": dict(steps=1200, warmup=120, out="docs/depth_sweep_long", runs_dir="runs/depth_sweep_long"),
    # Issue 47: the Wikipedia articles (many authors, 28.7M tokens), at most one pass, where depth may pay. The budget
    # stays below the update at which the stream first repeats an article (wikipedia_corpus.SINGLE_PASS_UPDATES);
    # it saves every 500 updates so that a run stopped mid-way resumes there, and evaluates on 131k held-out tokens
    # every 500. The analyses read 32k validation tokens and 8 whole articles (about 37k tokens) for the removals.
    "wikipedia": dict(dataset="wikipedia", vocab_size=4096, steps=WIKIPEDIA_STEPS, warmup=WIKIPEDIA_STEPS // 10,
                      eval_tokens=131_072, eval_every=500, save_every=500, stream_tokens=32_768, removal_documents=8,
                      first_depths=(12, 24), out="docs/depth_sweep_wikipedia", runs_dir="runs/depth_sweep_wikipedia"),
    "quick": dict(depths=(2, 4), steps=4, warmup=1, batch_size=4, max_length=64, eval_tokens=512, seeds=(1, 2),
                  dynamics_points=2, stream_tokens=256, jacobian_tokens=2, jacobian_probes=0, removal_documents=2,
                  out="runs/depth_sweep_quick/report", runs_dir="runs/depth_sweep_quick", probe_steps=8,
                  probe_warmup=1, probe_eval_every=2, rival_norms=("gpas", "bhyt"), rival_depths=(4,)),
}
# The pilot: seed 1 of the Wikipedia sweep (its records are the sweep's), L = 12 and 24 first: does depth pay?
BUDGETS["wikipedia_pilot"] = dict(BUDGETS["wikipedia"], seeds=(1,), report_suffix="_pilot")
# Issue 64, the budget x depth map: the Wikipedia budget finished at fewer updates (the cosine fully decayed, warmup
# 10%), everything else the same. Each saves at an interval that divides its analysis points (thirds: 800, 1,600 and
# 2,400; 2,500, 3,750 and 5,000), so that a stopped run resumes and every analysed checkpoint exists.
BUDGETS["wikipedia_2400"] = dict(BUDGETS["wikipedia"], steps=2_400, warmup=240, save_every=400, depths=(6, 12, 24, 48),
                                 first_depths=(), out="docs/depth_sweep_wikipedia_2400",
                                 runs_dir="runs/depth_sweep_wikipedia_2400")
BUDGETS["wikipedia_5000"] = dict(BUDGETS["wikipedia"], steps=5_000, warmup=500, save_every=625, depths=(6, 12, 24),
                                 first_depths=(), out="docs/depth_sweep_wikipedia_5000",
                                 runs_dir="runs/depth_sweep_wikipedia_5000")
# Issue 79, what LNS is worth in compute: a shorter budget below 2,400 (so that the multiplier there is bracketed by
# Pre-LN's finished runs), and the map at twice the width (heads of 16 as in the width sweep, its MLP ratio, the
# same vocabulary). Saves at an interval that divides the analysis points (thirds).
BUDGETS["wikipedia_1200"] = dict(BUDGETS["wikipedia_2400"], steps=1_200, warmup=120, save_every=400,
                                 out="docs/depth_sweep_wikipedia_1200", runs_dir="runs/depth_sweep_wikipedia_1200")
WIDE = dict(hidden_size=128, intermediate_size=352, num_attention_heads=8, depths=(6, 12, 24))
BUDGETS["wikipedia_2400_h128"] = dict(BUDGETS["wikipedia_2400"], **WIDE, out="docs/depth_sweep_wikipedia_2400_h128",
                                      runs_dir="runs/depth_sweep_wikipedia_2400_h128")
BUDGETS["wikipedia_5000_h128"] = dict(BUDGETS["wikipedia_5000"], **WIDE, out="docs/depth_sweep_wikipedia_5000_h128",
                                      runs_dir="runs/depth_sweep_wikipedia_5000_h128")
# Attention Residuals (issue 79, at its own best rate: --lr names the folder) and SiameseNorm (issue 81, at the shared
# rate) beside Pre-LN and LNS on the 2,400-update budget, each in its own report over the same records
BUDGETS["wikipedia_2400_attnres"] = dict(BUDGETS["wikipedia_2400"], rival_norms=("attnres",), rival_depths=(6, 12, 24),
                                         report_suffix="_attnres")
BUDGETS["wikipedia_2400_siamese"] = dict(BUDGETS["wikipedia_2400"], rival_norms=("siamese",), rival_depths=(6, 12, 24),
                                         report_suffix="_siamese")
# Issue 68, the paper's width on one GPU: the 130M block shape (hidden 768, 12 heads of 64, MLP 2048) at L = 6, 12
# and 24 on the Wikipedia split. A step is 64 sequences of 256 tokens, the paper's 130M micro-batch (run_130m.sh
# --batch_size 64) without its 8-fold accumulation, so that one pass is some 1,350 updates rather than 170: enough for
# the warmup and the cosine to mean what they do in the CPU sweep. The rate is the paper's 130M one, 1e-3 (chosen at
# 8 times this batch; a smaller batch tolerates no higher rate, and a lower one would leave a one-pass run short of
# updates). bf16 autocast (--dtype mixed) and eager (--no-compile) in the lease call (utils/gpu/gpu_lease.sh).
GPU_BATCH_SIZE, GPU_MAX_LENGTH = 64, 256
# The analyses (thirds) fall on saves and on evals: the update count is a multiple of 3 x GPU_EVAL_EVERY.
GPU_EVAL_EVERY = 150


def single_pass_steps(batch_size: int, max_length: int, multiple: int) -> int:
    """The most updates, a multiple of `multiple`, within one pass over the Wikipedia train split at this batch:
    below the update at which any seed's stream first repeats an article (SINGLE_PASS_UPDATES, measured) and within
    the split's token count (TRAIN_TOKENS)."""
    repeats_at = min(SINGLE_PASS_UPDATES[(batch_size, max_length)].values())
    bound = min(repeats_at, TRAIN_TOKENS // (batch_size * max_length))
    return bound // multiple * multiple


WIKIPEDIA_GPU_STEPS = single_pass_steps(GPU_BATCH_SIZE, GPU_MAX_LENGTH, 3 * GPU_EVAL_EVERY)
# The instruments, held-out articles, eval tokens and clipping are the CPU Wikipedia sweep's; the model, the batch,
# the rate and the length of the run are the GPU's. It saves at the analysis points only (each a few GB at L = 24):
# a run cut between them resumes from the last one, and the runs of a seed are one wave of --jobs 6.
BUDGETS["wikipedia_gpu"] = dict(BUDGETS["wikipedia"], depths=(6, 12, 24), first_depths=(), hidden_size=768,
                                intermediate_size=2048, num_attention_heads=12, batch_size=GPU_BATCH_SIZE,
                                max_length=GPU_MAX_LENGTH, lr="1e-3", steps=WIKIPEDIA_GPU_STEPS,
                                warmup=WIKIPEDIA_GPU_STEPS // 10, eval_every=GPU_EVAL_EVERY,
                                save_every=WIKIPEDIA_GPU_STEPS // 3, out="docs/depth_sweep_wikipedia_gpu",
                                runs_dir="runs/depth_sweep_wikipedia_gpu")
# The same lines at tiny sizes for the CPU rehearsal (gpu_lease.sh rehearse_wikipedia): the Wikipedia corpus and
# tokenizer, two heads of 8, a few updates; its records go to the rehearsal's own folders.
BUDGETS["wikipedia_gpu_quick"] = dict(BUDGETS["wikipedia_gpu"], depths=(2, 4), hidden_size=16, intermediate_size=32,
                                      num_attention_heads=2, batch_size=2, max_length=32, steps=6, warmup=1,
                                      eval_every=2, save_every=2, eval_tokens=256, seeds=(1, 2), stream_tokens=128,
                                      jacobian_tokens=2, jacobian_probes=0, removal_documents=2,
                                      out="runs/depth_sweep_wikipedia_gpu_quick/report",
                                      runs_dir="runs/depth_sweep_wikipedia_gpu_quick")
def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_study_arguments(parser, BUDGETS, budget_help=(
        "named budget (see above). wikipedia_gpu is meant for one GPU (--device cuda --no-compile --jobs 6; "
        "utils/gpu/gpu_lease.sh wikipedia_depth is its lease call): the paper's 130M block shape (hidden 768, 12 heads "
        f"of 64, MLP 2048) at L = 6, 12, 24 on the Wikipedia split, {GPU_BATCH_SIZE} x {GPU_MAX_LENGTH} tokens a "
        f"step (the paper's 130M micro-batch, without its accumulation) for {WIKIPEDIA_GPU_STEPS:,} updates (one "
        "pass: below the first repeated article), lr 1e-3 (the paper's 130M rate), bf16 autocast (--dtype mixed), "
        "the CPU Wikipedia sweep's instruments and held-out articles; each seed's six runs are one wave, and "
        "rerunning the command resumes. wikipedia_gpu_quick: the same at tiny sizes (the CPU rehearsal)"))
    parser.add_argument("--depths", nargs="+", type=int, default=None, help="override the budget's depths")
    parser.add_argument("--first_depths", nargs="+", type=int, default=None,
                        help="train every seed of these depths before the others' (default: the budget's order, "
                             "wikipedia: 12 24). With --max_hours, a session trains one depth while the report "
                             "still covers --depths. The order changes no record or report")
    parser.add_argument("--arms", nargs="+", default=None,
                        help="train only these norm types (pre, lns and the budget's rivals), e.g. the arm whose "
                             "best rate differs; the report still reads every record the sweep has")
    parser.add_argument("--overfit_probe", action="store_true",
                        help="also train the overfitting probe (one long LNS run at the deepest depth; about 80 "
                             "minutes at L=48); without it the report uses the probe's record when there is one")
    parser.add_argument("--estimate", action="store_true",
                        help="print the runs left, their tokens and model FLOPs, the analyses and an estimated time "
                             "(from an assumed GPU rate, not a measurement), and exit; trains nothing and needs no "
                             "GPU (utils/gpu/gpu_lease.sh prints it before training)")
    parser.add_argument("--keep_checkpoints", action=argparse.BooleanOptionalAction, default=None,
                        help="keep each run's checkpoints once its record is written (default: kept on the CPU, "
                             "deleted on a GPU, where wikipedia_gpu's L = 24 runs save gigabytes each)")
    return parser


def parse_args(argv=None):
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--estimate" in argv and "--plan" not in argv:  # an estimate, like a plan, trains nothing and needs no GPU
        argv.append("--plan")
    args = cli.parse_study_args(parser, argv, BUDGETS, ("depths", "seeds"))
    if any(d < 2 for d in args.settings["depths"]):
        parser.error(f"--depths: every depth must be at least 2, got {args.settings['depths']}")
    if len(set(args.settings["depths"])) < 2:
        parser.error("--depths: give at least two different depths (the verdicts are slopes against depth)")
    if args.first_depths and not set(args.first_depths) <= set(args.settings["depths"]):
        parser.error(f"--first_depths: {args.first_depths} are not all among the depths {list(args.settings['depths'])}")
    norms = (*NORMS, *args.settings.get("rival_norms", ()))
    if args.arms and not set(args.arms) <= set(norms):
        parser.error(f"--arms: {', '.join(sorted(set(args.arms) - set(norms)))} is not a norm type of this budget; "
                     f"valid: {', '.join(norms)}")
    if args.keep_checkpoints is None:
        args.keep_checkpoints = args.device == "cpu"
    cli.note_emulated_bf16(args)
    return args


def depth_axis(args) -> Axis:
    return Axis("L", "L", "layers L", "depth", tuple(args.settings["depths"]))


# A budget's model settings over the base config's (wikipedia_gpu's width; every other budget keeps the base's)
MODEL_SETTINGS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads")


def depth_config(args, depth: int) -> str:
    """The base config with `depth` layers, and the budget's vocabulary (its tokenizer's) and width where it sets
    them; the heads are all key-value heads, as in the base."""
    changes = {name: args.settings[name] for name in MODEL_SETTINGS if name in args.settings}
    if "num_attention_heads" in changes:
        changes["num_key_value_heads"] = changes["num_attention_heads"]
    hidden = changes.get("hidden_size", json.loads((REPO / BASE_CONFIG).read_text())["hidden_size"])
    return write_config(args, f"llama_h{hidden}_L{depth}.json", num_hidden_layers=depth, **changes)


def run_specs(args) -> list[RunSpec]:
    s = args.settings
    dynamics = runs.evenly_spaced_steps(s["steps"], s["dynamics_points"])
    rival_depths = [depth for depth in s.get("rival_depths", ()) if depth in s["depths"]]
    specs = []
    first = args.first_depths or s.get("first_depths", ())  # kept out of the settings: a summary records what ran
    for norms, depths in ((NORMS, s["depths"]), (s.get("rival_norms", ()), rival_depths)):  # Pre-LN and LNS first
        # Every seed of the first depths before any other depth (a sweep that may end early has its seeds where
        # they answer its question), then seed by seed; the order is stable within each.
        order = sorted(((seed, depth) for seed in s["seeds"] for depth in depths), key=lambda sd: sd[1] not in first)
        for seed, depth in order:
            base = train_flags(args, depth_config(args, depth), s["steps"], s["warmup"], s.get("eval_every", dynamics[0]))
            for norm in norms:
                specs.append(RunSpec(f"L{depth}-{norm}", seed, (*base, "--norm_type", norm), dynamics,
                                     save_every=s.get("save_every")))
    return specs


def trains_here(args, spec: RunSpec) -> bool:
    """Whether this invocation trains the spec: every spec, or with --arms only those norm types'."""
    return not args.arms or spec.arm.split("-", 1)[1] in args.arms  # "L24-lns" -> "lns"


def collect_records(args, specs: list[RunSpec]) -> tuple[dict[str, dict], list[RunSpec]]:
    """runs.collect_records over the --arms specs; the other arms' saved records join them, so that the report
    covers the whole sweep (their missing runs count as skipped)."""
    if not args.arms or args.report_only:
        return runs.collect_records(args, specs)
    chosen = [spec for spec in specs if trains_here(args, spec)]
    rest = [spec for spec in specs if not trains_here(args, spec)]
    records, skipped = runs.collect_records(args, chosen)
    saved = runs.saved_records(args, rest)
    return {**records, **saved}, skipped + [spec for spec in runs.as_trained(args, rest) if spec.name not in saved]


def probe_spec(args) -> RunSpec:
    """The overfitting probe: the deepest depth, trained far past the sweep's budget with an eval every
    probe_eval_every updates; only its eval curve is used, so no checkpoint is analysed. It saves at every eval
    (keeping the last two), so an interrupted probe resumes."""
    s = args.settings
    depth = max(s["depths"])
    flags = (*train_flags(args, depth_config(args, depth), s["probe_steps"], s["probe_warmup"], s["probe_eval_every"]),
             "--keep_last", "2", "--norm_type", s["probe_norm"])
    return RunSpec(f"overfit-L{depth}-{s['probe_norm']}", s["probe_seed"], flags, (), save_every=s["probe_eval_every"])


def collect_probe(args) -> dict | None:
    """The probe's record: trained with --overfit_probe (unless --report_only), otherwise read back if present."""
    spec = probe_spec(args)
    if args.overfit_probe:  # collect_records only reads records back under --report_only
        records, _ = runs.collect_records(args, [spec])
    else:
        records = runs.saved_records(args, [spec])
    return records.get(spec.name)


# The probe counts the corpus as overfitting once eval perplexity rises by more than 1% after its lowest point;
# a smaller rise is a flat curve (late in a cosine schedule the loss moves by thousandths of a nat).
OVERFIT_RISE_NATS = math.log(1.01)


def overfit_point(probe: dict) -> dict:
    """Where the probe's eval loss is lowest, and whether it rose by more than OVERFIT_RISE_NATS after that (the
    corpus overfits) or not (still improving, or flat at the end: the point lies at or beyond the probe's end)."""
    curve = sorted((int(step), loss) for step, loss in probe["eval_curve"])
    best_step, best_loss = min(curve, key=lambda point: point[1])
    highest_after = max(loss for step, loss in curve if step >= best_step)
    return dict(eval_curve=curve, best_step=best_step, best_loss=best_loss, last_step=curve[-1][0],
                last_loss=curve[-1][1],
                rise_after_best=highest_after - best_loss, overfits=highest_after - best_loss > OVERFIT_RISE_NATS)


def train_loss_between_evals(probe: dict) -> list[float | None]:
    """For each eval, the mean logged training loss since the eval before it (the generalisation gap's other side)."""
    steps = [0] + sorted(int(step) for step, _ in probe["eval_curve"])
    means = []
    for start, end in zip(steps, steps[1:]):
        losses = [loss for step, loss in probe["train_curve"] if start < step <= end]
        means.append(float(np.mean(losses)) if losses else None)
    return means


# ------------------------------------------------------------------------------------------------------ plots


def plot_probe(probe: dict, budget_steps: int, path: Path) -> Path:
    plt = plots.pyplot()
    point = overfit_point(probe)
    fig, ax = plt.subplots(figsize=(6, 3.8))
    train = np.array(probe["train_curve"], dtype=float)
    if len(train):
        ax.plot(train[:, 0], train[:, 1], color="0.7", linewidth=0.8, label="train loss")
    evals = np.array(point["eval_curve"], dtype=float)
    ax.plot(evals[:, 0], evals[:, 1], marker="o", markersize=4, label="eval loss")
    ax.axvline(budget_steps, color="tab:green", linestyle="--", linewidth=1, label=f"sweep budget ({budget_steps})")
    ax.axvline(point["best_step"], color="tab:red", linestyle=":", linewidth=1,
               label=f"lowest eval loss ({point['best_step']})")
    ax.set(xlabel="update step", ylabel="loss (nats)", title=f"Overfitting probe: {probe['arm']}, seed {probe['seed']}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return plots.save_figure(fig, path)


def budget_reason(s: dict) -> str:
    """The report's sentences on why the budget is what it is, for the embedded corpus or a single pass."""
    if s.get("dataset", runs.DEFAULT_DATASET) != runs.DEFAULT_DATASET:
        return ("At most one pass over the training split: the budget stays below the update at which the reader "
                "first repeats an article, so no run sees a training token twice (docs/data.md).")
    return ("The budget was chosen for time (four depths, three seeds). A run whose lowest eval loss is at its last eval\n"
            "  (the table's last column) has not reached the corpus's overfitting point; the overfitting probe above, "
            "once run,\n  finds that point at the deepest setting. For scale, a 24-layer, hidden-128 run on the same "
            "16 × 128 batches began\n  to overfit after about 2,250 steps.")


def probe_section(args, probe: dict | None, out: Path, suffix: str) -> tuple[str, dict | None]:
    """The report's paragraph on the overfitting point, and its summary entry."""
    s = args.settings
    spec = probe_spec(args)
    if probe is None and s.get("dataset", runs.DEFAULT_DATASET) != runs.DEFAULT_DATASET:
        return ("Not needed: the runs see each training token at most once (the budget stays below one pass), so "
                "they cannot overfit by repetition.", None)
    if probe is None:
        return (f"Not measured yet: `python utils/depth_sweep.py --overfit_probe` trains the probe ({spec.arm}, seed "
                f"{spec.seed}, {s['probe_steps']} updates, an eval every {s['probe_eval_every']}).", None)
    if probe.get("status") != "finished":  # its curve stops early: its lowest point says nothing of overfitting
        return (f"The probe ({spec.arm}, seed {spec.seed}) {probe.get('status', 'did not finish')} at step "
                f"{probe.get('last_step', 0):,} of {s['probe_steps']:,}, so it measured no overfitting point.",
                dict(arm=spec.arm, seed=spec.seed, status=probe.get("status"), last_step=probe.get("last_step")))
    point = overfit_point(probe)
    png = plot_probe(probe, s["steps"], out / f"overfit_probe{suffix}.png")
    curve = point["eval_curve"]
    train = train_loss_between_evals(probe)
    table = ("| step | " + " | ".join(str(step) for step, _ in curve) + " |\n|---|" + "---|" * len(curve)
             + "\n| eval loss | " + " | ".join(f"{loss:.3f}" for _, loss in curve) + " |"
             + "\n| train loss, mean since the eval before | "
             + " | ".join("n/a" if t is None else f"{t:.3f}" for t in train) + " |")
    tokens_to_best = point["best_step"] * s["batch_size"] * s["max_length"]
    tokens, epochs = tokens_to_best / 1e6, tokens_to_best / report.train_split_tokens(s)
    if point["overfits"]:
        found = (f"The eval loss is lowest at step **{point['best_step']:,}** ({point['best_loss']:.3f} nats, "
                 f"{tokens:.1f} M tokens, {epochs:.1f} epochs) and rises by {point['rise_after_best']:.3f} nats "
                 f"after it, more than the 1% in perplexity ({OVERFIT_RISE_NATS:.4f} nats) counted as a rise: the "
                 "corpus starts to overfit there.")
    elif point["best_step"] == point["last_step"]:
        found = (f"The eval loss was still falling at the probe's last eval (step {point['last_step']:,}, "
                 f"{point['last_loss']:.3f} nats): the corpus does not overfit within {point['last_step']:,} updates "
                 "at this depth.")
    else:
        found = (f"The eval loss is lowest at step **{point['best_step']:,}** ({point['best_loss']:.3f} nats, "
                 f"{tokens:.1f} M tokens, {epochs:.1f} epochs) and rises by only {point['rise_after_best']:.3f} "
                 f"nats after it, less than the 1% in perplexity ({OVERFIT_RISE_NATS:.4f} nats) counted as a rise: "
                 f"the curve flattens as the learning rate decays, and no overfitting shows within "
                 f"{point['last_step']:,} updates. The point lies at or beyond step {point['best_step']:,}.")
    below = point["best_step"] > s["steps"]
    budget = (f"The sweep's budget of {s['steps']} updates is **{'below' if below else 'NOT below'}** that step"
              + (f", by a factor of {point['best_step'] / s['steps']:.1f}." if below else "."))
    text = f"""The probe trains {spec.arm} (seed {spec.seed}) with the sweep's data, batch and learning rate, for
{point['last_step']:,} updates ({s['probe_warmup']} warmup steps, then cosine to 10% over the whole run), with an eval
every {s['probe_eval_every']}. Its schedule is longer than the sweep's, as a search for the overfitting point must be.
The gap between the training and the eval loss measures how much of the corpus the model has memorised; the eval
loss turning up is the overfitting point itself.

{table}

{found} {budget}

![overfitting probe]({png.name})"""
    return text, dict(point, arm=spec.arm, seed=spec.seed, budget_below=below,
                      train_minutes=round(probe["train_seconds"] / 60, 1))


# ------------------------------------------------------------------------------------------------------ report


def setup_section(args, records, probe: dict | None) -> str:
    """The report's Set-up: the models, the budget and why, the instruments, the seeds, the speed and the machine."""
    s = args.settings
    depths = s["depths"]
    tokens = s["steps"] * s["batch_size"] * s["max_length"]
    train_tokens = report.train_split_tokens(s)
    speeds = {d: [r["tokens_per_s_median"] for r in records.values()
                  if r["arm"].startswith(f"L{d}-") and r.get("tokens_per_s_median")] for d in depths}
    config = json.loads((REPO / depth_config(args, depths[0])).read_text())  # the base with the budget's vocabulary
    return f"""## Set-up

- **Models**: `{BASE_CONFIG}` (hidden {config['hidden_size']}, intermediate {config['intermediate_size']},
  {config['num_attention_heads']} heads, vocab {config['vocab_size']}) with L layers; nothing else changes with L.
- **Budget**: {s['steps']} updates × {s['batch_size']} × {s['max_length']} packed tokens = {tokens / 1e6:.2f} M tokens per
  run at every depth, {tokens / train_tokens:.2f} epochs over the {train_tokens:,}-token training split; Adam, lr {s['lr']},
  {s['warmup']} warmup steps then cosine to 10%, clipping 1.0, {cli.DTYPE_LABELS[args.dtype]} (`--dtype {args.dtype}`, see docs/study.md).
  {budget_reason(s)}
- **Instruments** at steps {', '.join(map(str, runs.evenly_spaced_steps(s['steps'], s['dynamics_points'])))}, inside
  the trained context of {s['max_length']} tokens: variance and angular distance over {s['stream_tokens']:,} held-out
  tokens, block Jacobians at {s['jacobian_tokens']} tokens ({'exact' if not s['jacobian_probes'] else
  f"{s['jacobian_probes']} random probes per token"}), one-layer removal on {s['removal_documents']}
  held-out documents.
- **Seeds**: {', '.join(map(str, s['seeds']))}, paired across norm types and depths.
- **Speed** (median tokens/s per run, one thread, {'torch.compile' if args.compile else 'eager'}, {args.dtype}): {', '.join(f"L={d}: {np.median(v):,.0f}" for d, v in speeds.items() if v)}.
{report.machine_lines({**records, "probe": probe} if probe else records)}
"""


def write_report(args, records, skipped, started, argv, probe: dict | None = None) -> Path:
    specs = run_specs(args)
    frame = report.frame("utils/depth_sweep.py", args, argv, started, records, skipped, len(specs))
    out, s, suffix = frame.out, frame.settings, frame.suffix
    depths = s["depths"]
    axis = depth_axis(args)
    predictions = depth_verdicts(axis, records)
    comparisons = comparative_verdicts(axis, records)
    single = one_seed_slopes(axis, records, comparisons)
    own = lns_own_slopes(axis, records)
    regime_text, regime_summary = regime(axis, records, heldout_text(s))
    gaps = gap_verdicts(axis, records)
    rivals = rival_verdicts(axis, records, s)
    probe_text, probe_summary = probe_section(args, probe, out, suffix)
    resting = f" {resting_sentence(axis.values)}" if resting_sentence(axis.values) else ""
    by_depth_png = plot_against(axis, records, out / f"measures_vs_depth{suffix}.png")
    gap_png = plot_gap(gaps, depths, out / f"loss_gap_vs_depth{suffix}.png")
    dynamics = {}
    for depth in (depths[0], depths[-1]):
        arms = {f"L{depth}-{n}": f"{label}, L={depth}" for n, label in NORMS.items()}
        if any(record.get("arm") in arms for record in records.values()):  # a depth not yet trained: no empty figure
            dynamics[depth] = plots.plot_dynamics(records, arms, out / f"dynamics_L{depth}{suffix}.png")
    text = f"""# Depth sweep: Pre-LN against LNS at L = {', '.join(map(str, depths))}

{frame.opening}
{frame.status} The runs trained for {sum(r['train_seconds'] for r in records.values()) / 60:.0f} minutes in total.
{report.wall_time_sentence(specs, records, args.jobs)}

## The regime: does depth pay?

{regime_text}

## The paper's depth claims, comparatively: LNS against Pre-LN

The paper's mechanism claim is comparative: as models deepen, Pre-LN's deep layers become less effective *than
LNS's*. For each deep-layer measure, the gap LNS − Pre-LN and the log ratio ln(LNS / Pre-LN) are formed per seed at
every depth, and each is fitted per seed against ln L; the verdict is the slope's 95% Student-t interval over seeds,
judged in the direction the paper predicts. The gap and the ratio can disagree: when both arms' values shrink toward
zero as L grows, their gap narrows while their ratio need not move, and only a ratio moving the paper's way means
that LNS's deep layers become relatively more active.{resting}

{comparative_section(comparisons)}{one_seed_text(axis, single) if single else ""}

## Pre-LN's own depth predictions, with LNS's own slope beside each

Each verdict is a slope against ln L, fitted per seed over the depths, with a 95% Student-t interval over seeds.
**reproduced** means the predicted sign AND an interval that excludes zero; **inside noise** means the interval
contains zero; **opposite** means it excludes zero the other way. A Pre-LN slope alone is not the paper's claim
when LNS's own slope goes the same way: the comparative verdicts above are.{resting}

{prediction_lines(axis, records, predictions, own)}

## LNS − Pre-LN eval loss at each depth (paired by seed)

{chr(10).join('- ' + v.line() for v in gaps)}

![loss gap]({frame.rel(gap_png)})
{rivals_section(rivals, s)}
## Every measure against depth (last checkpoint)

![measures against depth]({frame.rel(by_depth_png)})

{measures_table(axis, records)}

"Cheap to remove": removing the layer raises held-out perplexity by less than 1% (ln ratio < {measures.CHEAP_REMOVAL_NATS:.5f}).
Deep = the deeper half of the layers.

## Where the corpus overfits at the deepest setting

{probe_text}

## Dynamics at the shallowest and the deepest setting

{chr(10).join(f'![dynamics L={d}]({frame.rel(p)})' for d, p in dynamics.items())}

{setup_section(args, records, probe)}
Raw numbers: one JSON record per run in `runs/`, and `summary{suffix}.json`.
"""
    summary = dict(budget=args.budget, settings=s, regime=regime_summary,
                   comparative=[c.as_dict() for c in comparisons],
                   **({"comparative_one_seed": single} if single else {}),
                   lns_own_slopes={measure: v.as_dict() for measure, v in own.items()},
                   predictions=[v.as_dict() for v in predictions],
                   gaps=[v.as_dict() for v in gaps], overfit_probe=probe_summary, runs=sorted(records),
                   missing=[spec.name for spec in skipped], **({"rivals": [v.as_dict() for v in rivals]} if rivals else {}))
    return report.write_report_files(out, text, summary, suffix)


# ------------------------------------------------------------------------------------------------------ lease estimate

# The time estimate's assumptions, to be replaced by the first lease's measurements. A rate of 250 TFLOP/s is a
# quarter of the H200's dense bf16 peak: eager bf16 autocast at hidden 768 (run_130m.sh, compiled and pure bf16,
# reached MFU 0.334 there), shared by the wave's processes (time-sliced: their sum, not each). The analyses: the width
# sweep's GPU records (hidden 512, L = 24, five runs side by side) took 143-147 s for three checkpoints each.
ASSUMED_TFLOPS = 250.0
ANALYSIS_SECONDS_PER_CHECKPOINT = 50.0
START_SECONDS = 40.0  # the wave's processes importing torch and reading the tokenizer


def estimate(args) -> dict:
    """--estimate: the runs left, their tokens and model FLOPs, the analyses, and a time estimate from
    ASSUMED_TFLOPS (a wave of --jobs runs shares one GPU: the GPU's work is their sum). Trains nothing."""
    from utils.instruments.model_arithmetic import model_flops_per_token

    specs = run_specs(args)
    left = set(report.plan(args, specs)["left"])
    s = args.settings
    tokens = s["steps"] * s["batch_size"] * s["max_length"]
    rows, flops = [], 0.0
    for spec in specs:
        if spec.name not in left:
            continue
        config = argparse.Namespace(**json.loads((REPO / derive_fields(list(spec.flags())).config).read_text()))
        run_flops = model_flops_per_token(config, s["max_length"]) * tokens
        flops += run_flops
        rows.append(dict(run=spec.name, layers=config.num_hidden_layers, hidden=config.hidden_size,
                         analyses=len(spec.analyse_steps), model_pflops=round(run_flops / 1e15, 1)))
    waves = math.ceil(len(rows) / args.jobs) if rows else 0
    analyses = max((row["analyses"] for row in rows), default=0)
    seconds = (flops / (ASSUMED_TFLOPS * 1e12) + waves * (START_SECONDS + analyses * ANALYSIS_SECONDS_PER_CHECKPOINT))
    return dict(budget=args.budget, device=args.device, runs_left=len(rows), runs=len(specs), jobs=args.jobs,
                waves=waves, updates=s["steps"], tokens_per_run=tokens,
                train_split_tokens=report.train_split_tokens(s), rows=rows,
                estimated_seconds=round(seconds), assumed_tflops=ASSUMED_TFLOPS,
                analysis_seconds_per_checkpoint=ANALYSIS_SECONDS_PER_CHECKPOINT)


def estimate_lines(found: dict) -> str:
    rows = "\n".join(f"  {r['run']}: L = {r['layers']}, hidden {r['hidden']}, {r['model_pflops']} PFLOP, "
                     f"{r['analyses']} analysed checkpoints" for r in found["rows"])
    share = found["tokens_per_run"] / found["train_split_tokens"]
    return (f"plan: {found['budget']} on {found['device']}: {found['runs_left']} of {found['runs']} runs left, "
            f"{found['jobs']} at a time ({found['waves']} wave(s)); {found['updates']:,} updates = "
            f"{found['tokens_per_run'] / 1e6:.1f} M tokens a run ({share:.2f} of the "
            f"{found['train_split_tokens']:,}-token train split)\n{rows}\n"
            f"plan: about {found['estimated_seconds']} s (at {found['assumed_tflops']:g} TFLOP/s and "
            f"{found['analysis_seconds_per_checkpoint']:g} s per analysed checkpoint: an estimate, not a measurement)")


@cli.stop_on_unreadable_record
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    started = time.time()
    if args.estimate:
        print(estimate_lines(estimate(args)), flush=True)
        return 0
    if args.plan:
        specs = [spec for spec in run_specs(args) if trains_here(args, spec)]
        return report.print_plan(args, specs + ([probe_spec(args)] if args.overfit_probe else []))
    records, skipped = collect_records(args, run_specs(args))
    probe = collect_probe(args)
    written = write_report(args, records, skipped, started, argv, probe)
    print(f"report: {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
