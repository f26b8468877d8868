"""Does the deep-layer finding survive width? Pre-LN against LNS at several widths, with the study's instruments.

    python utils/width_sweep.py                   # hidden 64, 128, 256 at 24 layers, on the CPU (mixed, compiled)
    python utils/width_sweep.py --depth 48        # the same widths at 48 layers (records beside the 24-layer ones)
    python utils/width_sweep.py --budget gpu --device cuda   # adds hidden 512, 768, 1024: meant for one GPU
    python utils/width_sweep.py --quick           # smoke test (CI)
    python utils/width_sweep.py --report_only     # rewrite the report from the saved records
    python utils/width_sweep.py --plan            # the runs left and their disk, as JSON; trains nothing

Only the width changes. The head dim stays fixed (16, as in the depth sweep's hidden-64 model), so the number of heads
grows with the width; the MLP stays 2.75 times the width; the depth (24 layers by default), the tokens, the schedule,
the data, the seeds and the learning rate (1e-3 at every width, no per-width scaling) are the same at every width.
Each run is the depth sweep's run (utils/depth_sweep.py: the same budget and instruments, measured at three points
through training), and the report judges, at each width, the study's claims about LNS − Pre-LN (paired by seed, 95%
Student-t intervals), and, as the depth sweep does for depth, each effect's per-seed slope against ln(width) with a
95% interval over seeds. Its question: as the width grows, does LNS's deep-block identity gap (LNS − Pre-LN in deep
‖J − I‖/√d, negative at hidden 64 and 128) shrink, stay or reverse?

The runs go in width order (every seed of the narrowest width first), so that a sweep stopped by --max_hours has
whole widths. Finished runs leave records in `<out>/runs/`, reused by later invocations; `--device cuda` runs and
analyses on one GPU, in folders of its own (a CPU record never stands in for a GPU one).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from peft_pretraining.cli import OneLineErrorParser
from utils.study import claims, cli, measures, plots, report, runs, sweep, verdicts
from utils.study.runs import RunSpec
from utils.study.sweep import NORMS, Axis

REPO = Path(__file__).resolve().parent.parent

# The depth sweep's budget and instruments (400 updates of 16 x 128 packed tokens, lr 1e-3, analyses at 200, 300 and
# 400), at 24 layers. On the project's 2-core CPU (mixed precision, compiled) the runs take about 5 (hidden 64), 7
# (128) and 17 (256) run-minutes, so the default's 18 runs fit in about 1.5 hours on two lanes of an idle machine.
# The `gpu` budget adds 512, 768 and 1024 (36 runs; hidden 1024 at 24 layers is about 0.3 B parameters), for one
# GPU: on one H100, six such runs side by side took 41-50 s each (hidden 64 to 512, eager), bound by kernel launches
# and the GPU's time-slicing between processes rather than by FLOPs.
BUDGETS = {
    "default": dict(widths=(64, 128, 256), depth=24, head_dim=16, steps=400, warmup=40, batch_size=16,
                    max_length=128, eval_tokens=32_768, seeds=(1, 2, 3), dynamics_points=3, stream_tokens=8_192,
                    jacobian_tokens=32, jacobian_probes=8, removal_documents=16, out="docs/width_sweep",
                    runs_dir="runs/width_sweep"),
    "gpu": dict(widths=(64, 128, 256, 512, 768, 1024), report_suffix="_gpu"),
    # one seed, so that CI trains four runs: its verdicts are the one-seed ones (over held-out documents, or not
    # measurable); the statistics are tested on crafted records (tests/test_width_sweep.py)
    "quick": dict(widths=(16, 32), depth=4, head_dim=8, steps=4, warmup=1, batch_size=4, max_length=64,
                  eval_tokens=512, seeds=(1,), dynamics_points=2, stream_tokens=256, jacobian_tokens=2,
                  jacobian_probes=0, removal_documents=2, out="runs/width_sweep_quick/report",
                  runs_dir="runs/width_sweep_quick"),
}
# The study's claims about LNS − Pre-LN (utils/compare_norms.py), each with the paper's sign: (claim, measure,
# expected direction of LNS − Pre-LN, compared as a log ratio)
CLAIMS = [*claims.CORE_CLAIMS, (claims.REMOVAL_CLAIM, "removal_deep", +1, False)]
SHORT = {"eval_loss": "eval loss", "variance_growth": "variance growth (log ratio)",
         "angular_deep": "deep d(l, l+1)/π", "jacobian_deep": "deep ‖J − I‖/√d",
         "removal_deep": "deep removal cost (nats/word)"}
IDENTITY = "jacobian_deep"  # the question's measure: the deep blocks' distance from the identity


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_study_arguments(parser, BUDGETS, budget_help=(
        "default: hidden 64, 128, 256 (about 2 hours on a 2-core CPU); gpu: adds 512, 768 and 1024 and is meant "
        "for one GPU (--budget gpu --device cuda --jobs 6: 36 runs, meant to fit in about 8 minutes on one H100; "
        "their training took about 5 minutes there, the analyses are not yet timed, so give it --max_hours and "
        "rerun the same command to resume); quick: the CI smoke test"))
    parser.add_argument("--widths", nargs="+", type=int, default=None, help="override the budget's widths")
    parser.add_argument("--depth", type=int, default=None,
                        help="layers at every width (default 24; 48 is the other setting the report is meant for). "
                             "Its records share the folder, its report is report_L<depth>.md")
    parser.add_argument("--keep_checkpoints", action=argparse.BooleanOptionalAction, default=None,
                        help="keep each run's checkpoints once its record is written (default: kept on the CPU, "
                             "deleted on a GPU, where the widest runs save gigabytes each)")
    return parser


def parse_args(argv=None):
    args = cli.parse_study_args(parser := build_parser(), argv, BUDGETS, ("widths", "seeds"))
    s = args.settings
    if args.depth is not None:
        if args.depth < 2:
            parser.error(f"--depth must be at least 2, got {args.depth}")
        if args.depth != s["depth"]:
            s["report_suffix"] = s.get("report_suffix", "") + f"_L{args.depth}"
        s["depth"] = args.depth
    bad = [w for w in s["widths"] if w < s["head_dim"] or w % s["head_dim"]]
    if bad:
        parser.error(f"--widths: every width must be a positive multiple of the head dim {s['head_dim']}, got {bad}")
    if len(set(s["widths"])) < 2:
        parser.error("--widths: give at least two different widths (the verdicts are slopes against width)")
    s["widths"] = tuple(sorted(set(s["widths"])))
    if args.keep_checkpoints is None:
        args.keep_checkpoints = args.device == "cpu"
    cli.note_emulated_bf16(args)
    return args


def width_axis(args) -> Axis:
    depth = args.settings["depth"]
    return Axis(f"L{depth}-W", "d", "hidden width d", "width", tuple(args.settings["widths"]))


def width_config(args, width: int) -> dict:
    """The depth sweep's base config at `width`: heads of the budget's head dim, MLP in the base's proportion."""
    base = json.loads((REPO / sweep.BASE_CONFIG).read_text())
    heads = width // args.settings["head_dim"]
    return dict(hidden_size=width, intermediate_size=width * base["intermediate_size"] // base["hidden_size"],
                num_attention_heads=heads, num_key_value_heads=heads, num_hidden_layers=args.settings["depth"])


def parameters(args, width: int) -> tuple[int, int]:
    """(block parameters, all parameters) of the model at `width`."""
    config = width_config(args, width)
    vocab = json.loads((REPO / sweep.BASE_CONFIG).read_text())["vocab_size"]
    block = 4 * width * width + 3 * width * config["intermediate_size"] + 2 * width
    blocks = config["num_hidden_layers"] * block
    return blocks, blocks + 2 * vocab * width + width


def run_specs(args) -> list[RunSpec]:
    s = args.settings
    axis = width_axis(args)
    dynamics = runs.evenly_spaced_steps(s["steps"], s["dynamics_points"])
    specs = []
    for width in axis.values:  # width-major: a sweep stopped early has whole widths
        changes = width_config(args, width)
        config = sweep.write_config(args, f"llama_w{width}_hd{s['head_dim']}_L{s['depth']}.json", **changes)
        base = sweep.train_flags(args, config, s["steps"], s["warmup"], dynamics[0])
        for seed in s["seeds"]:
            for norm in NORMS:
                specs.append(RunSpec(axis.arm(width, norm), seed, (*base, "--norm_type", norm), dynamics))
    return specs


# ------------------------------------------------------------------------------------------------------ statistics
def width_verdicts(axis: Axis, records) -> dict[int, list[verdicts.Verdict]]:
    """At each width, the study's claims about LNS − Pre-LN, paired by seed."""
    return {w: claims.pair_verdicts(records, axis.arm(w, "pre"), axis.arm(w, "lns"), ("Pre-LN", "LNS"))
            for w in axis.values}


def gap_slope_verdicts(axis: Axis, records) -> list[verdicts.Verdict]:
    """Per claim, the per-seed slope of LNS − Pre-LN against ln(width), judged against zero with the claim's sign:
    "reproduced" means the effect moves toward the paper's sign as the width grows."""
    found = []
    for claim, measure, direction, log_ratio in CLAIMS:
        slopes = sweep.slope_by_seed(sweep.paired_differences(axis, records, measure, log_ratio), False)
        what = "ln(LNS / Pre-LN)" if log_ratio else "LNS − Pre-LN"
        found.append(sweep.slope_verdict(f"{SHORT[measure]}: {what} moves toward the paper's sign with width "
                                               f"(slope vs ln {axis.symbol})", direction, slopes))
    return found


def identity_ratio_verdict(axis: Axis, records) -> verdicts.Verdict:
    """The identity gap as a ratio, scale-free across widths: slope of ln(LNS / Pre-LN) deep ‖J − I‖/√d."""
    slopes = sweep.slope_by_seed(sweep.paired_differences(axis, records, IDENTITY, True), False)
    return sweep.slope_verdict(f"{SHORT[IDENTITY]}: ln(LNS / Pre-LN) moves toward the paper's sign with width "
                                     f"(slope vs ln {axis.symbol})", +1, slopes)


def interval_text(values: list[float | None]) -> str:
    """The mean of per-seed values with its 95% Student-t interval ("n/a" with none; no interval with one)."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if len(values) < 2:
        return f"{values[0]:+.4g} (one seed)" if values else "n/a"
    shown = lambda x: f"{0.0 if abs(x) < 1e-12 else x:+.4g}"  # noqa: E731  (a constant's slope: rounding, not -4e-16)
    mean, low, high = verdicts.paired_t_interval(values)
    return f"{shown(mean)} [{shown(low)}, {shown(high)}]"


def measure_slopes_table(axis: Axis, records) -> str:
    """Per measure and norm type, the mean per-seed slope against ln(width) with its 95% interval (descriptive:
    the paper makes no width prediction)."""
    rows = [f"| measure | Pre-LN: slope vs ln {axis.symbol} | LNS: slope vs ln {axis.symbol} |", "|---|---|---|"]
    for measure, title in measures.measures_in(records).items():
        log_values = measure in measures.GROWTH_MEASURES
        cells = [interval_text(list(sweep.slope_by_seed(
            sweep.measure_by_value(axis, records, norm, measure), log_values).values())) for norm in NORMS]
        rows.append(f"| {'ln ' if log_values else ''}{title} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def claims_table(axis: Axis, at_width: dict[int, list[verdicts.Verdict]], slopes: list[verdicts.Verdict]) -> str:
    """Claims down, widths across: LNS − Pre-LN [95% CI] (status), then the slope against ln(width)."""
    rows = ["| claim (LNS − Pre-LN) | " + " | ".join(f"{axis.symbol} = {w}" for w in axis.values)
            + f" | slope vs ln {axis.symbol} |", "|---" * (len(axis.values) + 2) + "|"]
    for i, (_, measure, _, _) in enumerate(CLAIMS):
        cells = [claims.effect_text(at_width[w][i]) for w in axis.values]
        rows.append(f"| {SHORT[measure]} | " + " | ".join(cells) + f" | {claims.effect_text(slopes[i])} |")
    return "\n".join(rows)


def identity_answer(axis: Axis, at_width: dict[int, list[verdicts.Verdict]], slope: verdicts.Verdict,
                    ratio: verdicts.Verdict) -> str:
    """The question in one paragraph: as the width grows, does LNS's deep-block identity gap shrink, stay or
    reverse? Read from the widest width's verdict and the gap's slope against ln(width)."""
    index = [measure for _, measure, _, _ in CLAIMS].index(IDENTITY)
    judged = [(w, at_width[w][index]) for w in axis.values if at_width[w][index].effect is not None]
    if len(judged) < 2:
        return ("Not answerable yet: the identity gap needs at least two widths with two paired seeds each "
                f"({len(judged)} so far).")
    if slope.effect is None:
        return f"Not answerable: the identity gap's slope against ln {axis.symbol} is not measurable ({slope.reason})."
    (narrow, first), (wide, last) = judged[0], judged[-1]
    if last.status == verdicts.REPRODUCED:
        answer = "**reverses**: at the widest width LNS's deep blocks are *further* from the identity than Pre-LN's"
    elif slope.status == verdicts.REPRODUCED:
        answer = ("**shrinks**" + (" to within noise" if last.status == verdicts.INSIDE_NOISE else
                                   ", but LNS's deep blocks stay closer to the identity at the widest width"))
    elif slope.status == verdicts.OPPOSITE:
        answer = "**grows**: LNS's deep blocks fall further behind Pre-LN's in distance from the identity"
    else:
        answer = "**stays**: the slope's interval contains zero"
    return (f"As the width grows from {narrow} to {wide}, LNS's deep-block identity gap {answer}. LNS − Pre-LN in "
            f"deep ‖J − I‖/√d is {first.effect:+.4f} [{first.low:+.4f}, {first.high:+.4f}] at {axis.symbol} = "
            f"{narrow} ({first.status}) and {last.effect:+.4f} [{last.low:+.4f}, {last.high:+.4f}] at {axis.symbol}"
            f" = {wide} ({last.status}); its per-seed slope against ln {axis.symbol} is {slope.effect:+.4f} "
            f"[{slope.low:+.4f}, {slope.high:+.4f}], and that of ln(LNS / Pre-LN), which does not depend on how "
            "the measure's scale moves with width, "
            + ("n/a" if ratio.effect is None else f"{ratio.effect:+.3f} [{ratio.low:+.3f}, {ratio.high:+.3f}]")
            + " (95% intervals over seeds; a positive slope moves toward the paper)."
            + {verdicts.OPPOSITE: " As a ratio, the gap grows with width.",
               verdicts.REPRODUCED: " As a ratio, the gap shrinks with width."}.get(ratio.status, ""))


# ------------------------------------------------------------------------------------------------------ report
def write_csv(axis: Axis, records, path: Path) -> Path:
    """One row per run: its width, norm, seed, status, device, times and every measure at its last checkpoint."""
    shown = measures.measures_in(records)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["width", "norm", "seed", "status", "device", "train_seconds", "analysis_seconds",
                         *shown])
        for width in axis.values:
            for norm in NORMS:
                for record in sorted((r for r in records.values() if r["arm"] == axis.arm(width, norm)),
                                     key=lambda r: r["seed"]):
                    at_last = measures.measures_at(record) if record["status"] == "finished" else {}
                    writer.writerow([width, norm, record["seed"], record["status"], runs.record_device(record),
                                     record.get("train_seconds"), record.get("analysis_seconds"),
                                     *(measures.finite_or_none(at_last.get(m)) for m in shown)])
    return path


def setup_section(args, records, run_minutes: dict[int, list[float]], speeds: dict[int, list[float]]) -> str:
    """The report's Set-up: the models at each width (with their measured run-minutes and speed), the budget, the
    instruments, the seeds and the machine."""
    s = args.settings
    widths = width_axis(args).values
    tokens = s["steps"] * s["batch_size"] * s["max_length"]
    train_tokens = report.embedded_train_tokens()
    config_rows = "\n".join(
        f"| {w} | {width_config(args, w)['num_attention_heads']} | {s['head_dim']} | "
        f"{width_config(args, w)['intermediate_size']} | {parameters(args, w)[0] / 1e6:.2f} M | "
        f"{parameters(args, w)[1] / 1e6:.2f} M | "
        + (f"{np.mean(run_minutes[w]):.1f} ({len(run_minutes[w])} runs)" if run_minutes[w] else "n/a") + " | "
        + (f"{np.median(speeds[w]):,.0f}" if speeds[w] else "n/a") + " |" for w in widths)
    return f"""## Set-up

- **Models**: `{sweep.BASE_CONFIG}` at {s['depth']} layers and width d; the head dim stays {s['head_dim']}, so the
  heads grow with d, and the MLP is {width_config(args, widths[0])['intermediate_size'] / widths[0]:.2f} d. Nothing
  else changes with d:

  | d | heads | head dim | MLP | block parameters | all parameters | run-minutes (mean) | tokens/s (median) |
  |---|---|---|---|---|---|---|---|
{chr(10).join('  ' + row for row in config_rows.splitlines())}
- **Budget**: the depth sweep's. {s['steps']} updates × {s['batch_size']} × {s['max_length']} packed tokens =
  {tokens / 1e6:.2f} M tokens per run at every width, {tokens / train_tokens:.2f} epochs over the {train_tokens:,}-token
  training split; Adam, **one learning rate, {runs.peak_lr(s)}, at every width** (no µP-style per-width rate: a wider model may
  be further from its best rate, which the report does not correct for), {s['warmup']} warmup steps then cosine to
  10%, clipping 1.0, {cli.DTYPE_LABELS[args.dtype]} (`--dtype {args.dtype}`), {'compiled' if args.compile else 'eager'}.
- **Instruments** at steps {', '.join(map(str, runs.evenly_spaced_steps(s['steps'], s['dynamics_points'])))}, inside
  the trained context of {s['max_length']} tokens: variance and angular distance over {s['stream_tokens']:,} held-out
  tokens, block Jacobians at {s['jacobian_tokens']} tokens ({'exact' if not s['jacobian_probes'] else
  f"{s['jacobian_probes']} random probes per token"}; ‖J − I‖_F/√d is normalised by the width), one-layer removal
  on {s['removal_documents']} held-out documents.
- **Seeds**: {', '.join(map(str, s['seeds']))}, paired across norm types and widths.
{report.machine_lines(records)}
"""


def write_report(args, records, skipped, started, argv) -> Path:
    specs = run_specs(args)
    frame = report.frame("utils/width_sweep.py", args, argv, started, records, skipped, len(specs))
    out, s, suffix = frame.out, frame.settings, frame.suffix
    axis = width_axis(args)
    widths = axis.values
    at_width = width_verdicts(axis, records)
    slopes = gap_slope_verdicts(axis, records)
    ratio = identity_ratio_verdict(axis, records)
    index = {measure: i for i, (_, measure, _, _) in enumerate(CLAIMS)}
    identity_png = sweep.plot_gap(
        [at_width[w][index[IDENTITY]] for w in widths], widths, out / f"identity_gap_vs_width{suffix}.png",
        axis.label, "width", "LNS − Pre-LN deep ‖J − I‖/√d",
        "LNS's deep identity gap against {noun} (below 0: LNS closer to I)")
    loss_png = sweep.plot_gap([at_width[w][index["eval_loss"]] for w in widths], widths,
                                    out / f"loss_gap_vs_width{suffix}.png", axis.label, "width")
    by_width_png = sweep.plot_against(axis, records, out / f"measures_vs_width{suffix}.png")
    dynamics = {w: plots.plot_dynamics(records, {axis.arm(w, n): f"{label}, d={w}" for n, label in NORMS.items()},
                                           out / f"dynamics_W{w}_L{s['depth']}{suffix}.png")
                for w in (widths[0], widths[-1])}
    csv_path = write_csv(axis, records, out / f"measures{suffix}.csv")

    at = {w: [r for r in records.values() if r["arm"] in (axis.arm(w, "pre"), axis.arm(w, "lns"))] for w in widths}
    run_minutes = {w: [report.run_seconds(r) / 60 for r in at[w] if report.run_seconds(r) is not None]
                   for w in widths}
    speeds = {w: [r["tokens_per_s_median"] for r in at[w] if r.get("tokens_per_s_median")] for w in widths}
    devices = sorted({runs.record_device(r) for r in records.values()}) or [args.device]
    cpu_minutes = sum(m for v in run_minutes.values() for m in v)
    text = f"""# Width sweep: Pre-LN against LNS at d = {', '.join(map(str, widths))}, L = {s['depth']}

{frame.opening}
{frame.status} The runs took {cpu_minutes:.0f} run-minutes in all (training and analyses, each run on one
{'thread' if devices == ['cpu'] else 'device'}; device: {', '.join(devices)}).
{report.wall_time_sentence(specs, records, args.jobs)}

## Does LNS's deep-block identity gap survive width?

{identity_answer(axis, at_width, slopes[index[IDENTITY]], ratio)}

![identity gap]({frame.rel(identity_png)})

## The study's claims at each width (LNS − Pre-LN, paired by seed)

Each cell is LNS − Pre-LN at the last checkpoint, with a 95% Student-t interval over seeds, the seeds that agree
with the paper's sign, and the verdict (**reproduced**: the paper's sign and an interval that excludes zero;
**opposite**: an interval that excludes zero the other way; **inside noise** otherwise). The last column is the
per-seed slope of that difference against ln d, with a 95% interval over seeds: **reproduced** there means the
effect moves toward the paper's sign as the width grows, **opposite** away from it.

{claims_table(axis, at_width, slopes)}

- {ratio.line()}

![loss gap]({frame.rel(loss_png)})

## Every measure against width (last checkpoint)

The per-seed slope of each measure against ln d, with a 95% interval over seeds (the paper predicts nothing here;
the variance growth is fitted on its log).

{measure_slopes_table(axis, records)}

![measures against width]({frame.rel(by_width_png)})

{sweep.measures_table(axis, records)}

"Cheap to remove": removing the layer raises held-out perplexity by less than 1% (ln ratio < {measures.CHEAP_REMOVAL_NATS:.5f}).
Deep = the deeper half of the layers. Per run: `{csv_path.name}`.

## Dynamics at the narrowest and the widest setting

{chr(10).join(f'![dynamics d={w}]({frame.rel(p)})' for w, p in dynamics.items())}

{setup_section(args, records, run_minutes, speeds)}
Raw numbers: one JSON record per run in `runs/`, `{csv_path.name}` and `summary{suffix}.json`.
"""
    summary = dict(budget=args.budget, device=args.device, settings=s,
                   at_width={str(w): [v.as_dict() for v in found] for w, found in at_width.items()},
                   slopes=[v.as_dict() for v in slopes], identity_ratio_slope=ratio.as_dict(),
                   run_minutes=round(cpu_minutes, 1), runs=sorted(records), missing=[spec.name for spec in skipped])
    return report.write_report_files(out, text, summary, suffix)


@cli.stop_on_unreadable_record
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args, started = parse_args(argv), time.time()
    if args.plan:
        return report.print_plan(args, run_specs(args))
    print(f"report: {write_report(args, *runs.collect_records(args, run_specs(args)), started, argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
