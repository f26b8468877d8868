"""What the studies share (`utils/compare_norms.py`, `utils/depth_sweep.py`, `utils/width_sweep.py`).

A study is a list of runs (`RunSpec`: an arm, a seed and the trainer's flags). Each run is one job:

    torchrun_main.py (a subprocess, one thread)  ->  the analysis tools on each dynamics checkpoint  ->  record

Runs and analyses go to the study's --device: the CPU (the default) or a CUDA GPU. The device is part of a record's
identity, as the dtype is: the trainer's --device is in its flags and the analyses' device in its analysis settings
(a record made before the device was recorded was made on the CPU).

The record (`<out>/runs/<arm>-seed<seed>.json`) holds the run's flags, its eval curve, and every analysis at every
analysed checkpoint, as small numbers. Records live beside the report and are committed with it, so a later
invocation (on any machine) reuses finished runs instead of retraining them; checkpoints stay in the runs folder.

The analyses are the repository's own tools, called through their command lines in the analysis subprocess:
utils/variance_analysis.py, utils/angular_analysis.py, utils/jacobian_analysis.py and layer_remove.py --sweep on the
offline held-out task, all inside the trained context length.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import csv
import dataclasses
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
DTYPE_LABELS = {"float32": "float32", "mixed": "mixed precision"}  # the studies' --dtype, as reports name it
DEVICES = ("cpu", "cuda")  # the studies' --device
DEFAULT_DATASET = "embedded"  # a budget's "dataset": embedded (in data/) or wikipedia (outside the repository)
# checkpoints of a run that keep their training state: older ones keep only the weights the analyses read (a third)
RESUMABLE_CHECKPOINTS = 1
RECORD_VERSION = 1
# A layer counts as "cheap to remove" when removing it raises held-out perplexity by less than 1% (0.00995 nats).
CHEAP_REMOVAL_NATS = math.log(1.01)


@dataclasses.dataclass(frozen=True)
class AnalysisSettings:
    """How each analysed checkpoint is measured (part of a record's identity)."""

    max_seq_len: int  # the trained context length: every analysis stays inside it
    stream_tokens: int  # held-out tokens for the variance and angular tools
    jacobian_tokens: int  # held-out tokens whose block Jacobians are averaged
    jacobian_probes: int  # 0: exact Jacobians; K: K random probes per token (unbiased, about d/K times cheaper)
    removal_documents: int  # held-out documents for the layer-removal sweep
    device: str = "cpu"  # where the analyses run; records made before it was recorded ran on the CPU
    heldout: str = "embedded"  # held-out text (a study dataset's validation split); older records used "embedded"


@dataclasses.dataclass(frozen=True)
class RunSpec:
    arm: str  # a name for the configuration, e.g. "pre", "lns_bf16", "L48-lns"
    seed: int
    train_flags: tuple[str, ...]  # torchrun_main.py flags, without --seed, --save_dir and --run_name
    analyse_steps: tuple[int, ...]  # checkpoints to analyse (the trainer saves each of them)
    save_every: int | None = None  # checkpoint interval when it is not set by analyse_steps (a long run that resumes)

    @property
    def name(self) -> str:
        return f"{self.arm}-seed{self.seed}"

    def flags(self) -> list[str]:
        return [*self.train_flags, "--seed", str(self.seed)]


def evenly_spaced_steps(total_steps: int, points: int) -> tuple[int, ...]:
    """`points` checkpoints at equal intervals, the last one at total_steps.

    The interval divides total_steps, so that saving every `interval` steps (save_every_for) writes few checkpoints:
    400 steps at 3 points gives 200, 300, 400 (interval 100), not 133, 266, 400 (which would save every step)."""
    interval = max(d for d in range(1, max(1, total_steps // points) + 1) if total_steps % d == 0)
    if total_steps // interval > 4 * points:
        raise ValueError(f"{total_steps} steps have no divisor near {total_steps // points}: "
                         f"{total_steps // interval} checkpoints would be saved for {points} analysis points")
    return tuple(total_steps - interval * k for k in reversed(range(points)) if total_steps - interval * k > 0)


def save_every_for(steps: tuple[int, ...]) -> int:
    return math.gcd(*steps)


# ------------------------------------------------------------------------------------------------------ command line
def add_study_arguments(parser: argparse.ArgumentParser, budgets: dict,
                        budget_help: str = "named budget (see above)") -> None:
    """The flags the studies share: the named budget, seeds, folders, parallelism, resumption, precision, device."""
    parser.add_argument("--budget", default="default", choices=sorted(budgets), help=budget_help)
    parser.add_argument("--quick", action="store_true", help="same as --budget quick (the CI smoke test)")
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="override the budget's seeds")
    parser.add_argument("--out", default=None, help="report folder (its runs/ subfolder holds the run records)")
    parser.add_argument("--runs_dir", default=None, help="where the training runs and checkpoints go")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once, one thread each (default 2: one per core)")
    parser.add_argument("--max_hours", type=float, default=None,
                        help="start no new run after this many hours; the next invocation continues")
    parser.add_argument("--report_only", action="store_true", help="write the report from the saved records")
    parser.add_argument("--fresh", action="store_true", help="retrain and re-analyse even where records exist")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="train every run with torch.compile (the default; --no-compile trains eager): 1.5x "
                             "the tokens/s per update in mixed precision on a CPU with bf16 instructions, for 1-2 "
                             "minutes of compilation in a configuration's first run and about 10 s in later ones "
                             "(docs/benchmarks.md); compiled and eager runs are distinct records")
    parser.add_argument("--dtype", default="mixed", choices=sorted(DTYPE_LABELS),
                        help="what the runs that are not pure-bf16 arms train in. mixed (the default: bf16 autocast "
                             "over fp32 master weights) is the faster step on a CPU with bf16 instructions "
                             "(avx512_bf16 or AMX) and the slower one without them; float32 computes in fp32 on "
                             "every host, as the committed float32 records did (docs/study.md). The two are "
                             "distinct records")
    parser.add_argument("--device", default="cpu", choices=DEVICES,
                        help="where every run trains and is analysed: cpu (the default) or cuda (one GPU; --jobs "
                             "runs share it). The flags are otherwise the same; CPU and GPU records are distinct, "
                             "and a GPU setting's default folders end in _cuda")


def resolve_study_args(parser: argparse.ArgumentParser, args, budgets: dict) -> None:
    """args.settings (the budget, over the default one), args.out and args.runs_dir; one-line errors for bad values."""
    if args.quick:
        args.budget = "quick"
    args.settings = {**budgets["default"], **budgets[args.budget]}
    if args.jobs < 1:
        parser.error(f"--jobs must be positive, got {args.jobs}")
    if args.max_hours is not None and args.max_hours <= 0:
        parser.error(f"--max_hours must be positive, got {args.max_hours}")
    # one deadline for the whole invocation, however many collect_records calls it makes (the sweep, then its probe)
    args.deadline = None if args.max_hours is None else time.time() + 3600 * args.max_hours
    if args.device == "cuda" and not args.report_only and not cuda_available():  # a GPU's records report anywhere
        parser.error("--device cuda: no CUDA device is visible on this machine")
    if not args.report_only:
        check_dataset(parser, args)
        try:  # before any run trains: without it, every analysis fails after its training (a GPU image lacked it)
            import lm_eval.tasks  # noqa: F401 (the removal analysis goes through lm-eval)
        except ImportError as err:
            parser.error(f"the removal analysis needs lm-eval, which does not import here ({err}); pip install -r "
                         "exp_requirements.txt")
    if args.device == "cpu" and args.dtype == "mixed" and not bf16_instructions():
        print("note: this CPU names no bf16 instructions (avx512_bf16, amx_bf16); --dtype mixed emulates bf16 "
              "products here and trains about 3x slower than --dtype float32 (docs/study.md)", file=sys.stderr)
    # Folders are named from float32 eager, the precision and mode of the records committed before the default
    # became mixed and compiled: those keep their plain names, every other setting gets a suffix.
    variant = (("" if args.dtype == "float32" else f"_{args.dtype}") + ("_compile" if args.compile else "")
               + ("" if args.device == "cpu" else f"_{args.device}"))
    args.out = Path(args.out or REPO / variant_folder(args.settings["out"], variant))
    args.runs_dir = Path(args.runs_dir or REPO / variant_folder(args.settings["runs_dir"], variant))


def parse_study_args(parser: argparse.ArgumentParser, argv, budgets: dict, overrides: tuple[str, ...] = ()):
    """A study's command line, parsed and resolved (resolve_study_args); each flag named in `overrides` that was
    given (--seeds, --depths, --widths: lists) replaces the budget's setting of the same name."""
    args = parser.parse_args(argv)
    resolve_study_args(parser, args, budgets)
    for name in overrides:
        if getattr(args, name):
            args.settings[name] = tuple(getattr(args, name))
    return args


def variant_folder(folder: str, variant: str) -> Path:
    """The budget's default folder for a --dtype or --compile variant ("docs/study" -> "docs/study_mixed";
    "runs/study_quick/report" -> "runs/study_quick_mixed/report"): its runs and records share no file with the
    default's, so a variant neither retrains over nor overwrites the committed records."""
    path = Path(folder)
    if not variant:
        return path
    if path.name == "report":
        return path.parent.with_name(path.parent.name + variant) / "report"
    return path.with_name(path.name + variant)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def analysis_settings(settings: dict, device: str = "cpu") -> AnalysisSettings:
    return AnalysisSettings(**{field.name: settings[field.name if field.name != "max_seq_len" else "max_length"]
                               for field in dataclasses.fields(AnalysisSettings)
                               if field.name not in ("device", "heldout")},
                            device=device, heldout=settings.get("dataset", DEFAULT_DATASET))


def dataset_flags(settings: dict) -> tuple[str, ...]:
    """The trainer's data flags of a budget: its dataset (default the embedded corpus) with the tokenizer of the
    same name."""
    dataset = settings.get("dataset", DEFAULT_DATASET)
    return ("--dataset", dataset, "--tokenizer", dataset)


def heldout_text_flags(heldout: str) -> tuple[list[str], list[str]]:
    """The analyses' held-out text: (flags of the residual-stream tools, flags of layer_remove.py)."""
    if heldout == DEFAULT_DATASET:
        return ["--dataset", "embedded"], []
    from peft_pretraining.wikipedia_corpus import corpus_paths

    validation = str(corpus_paths()[1])
    return ["--text_file", validation], ["--task_text_file", validation]


def check_dataset(parser: argparse.ArgumentParser, args) -> None:
    """A budget on a corpus kept outside the repository needs it before any run trains: one line if it is absent."""
    if args.settings.get("dataset", DEFAULT_DATASET) == DEFAULT_DATASET:
        return
    from peft_pretraining.wikipedia_corpus import corpus_paths

    try:
        corpus_paths()
    except ValueError as error:
        parser.error(f"--budget {args.budget}: {error}")


def collect_records(args, specs: list[RunSpec]) -> tuple[dict[str, dict], list[RunSpec]]:
    """The records of every spec: read back (--report_only), or made by running the jobs that have none."""
    if args.report_only:
        records = saved_records(args, specs)
        return records, [spec for spec in as_trained(args, specs) if spec.name not in records]
    return run_jobs(as_trained(args, specs), analysis_settings(args.settings, args.device), args.runs_dir,
                    args.out / "runs", args.jobs, args.fresh, args.deadline, getattr(args, "keep_checkpoints", True))


def saved_records(args, specs: list[RunSpec]) -> dict[str, dict]:
    """The records already saved for `specs`, matched as the study's --dtype and --compile train them; none trained."""
    return load_records(as_trained(args, specs), analysis_settings(args.settings, args.device), args.out / "runs")


def as_trained(args, specs: list[RunSpec]) -> list[RunSpec]:
    """The specs with the study's --dtype and --compile in their flags, as their runs train. Both are part of the
    flags a record is matched on, so runs that differ in them never stand in for each other."""
    specs = [dataclasses.replace(spec, train_flags=with_study_dtype(spec.train_flags, args.dtype)) for spec in specs]
    if args.compile:
        specs = [dataclasses.replace(spec, train_flags=(*spec.train_flags, "--compile")) for spec in specs]
    return specs


def with_study_dtype(train_flags: tuple[str, ...], dtype: str) -> tuple[str, ...]:
    """The run's flags with its float32 replaced by the study's --dtype; a pure-bf16 arm keeps its bfloat16."""
    at = train_flags.index("--dtype") + 1
    if train_flags[at] != "float32":
        return train_flags
    return (*train_flags[:at], dtype, *train_flags[at + 1:])


def generated_by(script: str, argv: list[str], args) -> str:
    """The report's first words: the command that made its records, and whether --report_only rewrote the text.

    The command always names --dtype and --compile, so that it still says what trained the records when a default
    changes."""
    shown = [a for a in argv if a != "--report_only"]
    if not any(a == "--dtype" or a.startswith("--dtype=") for a in shown):
        shown += ["--dtype", args.dtype]
    if not {"--compile", "--no-compile"} & set(shown):
        shown.append("--compile" if args.compile else "--no-compile")
    command = " ".join(["python", script, *shown])
    rewritten = " (this text rewritten from its saved records with `--report_only`)" if "--report_only" in argv else ""
    return f"Generated by `{command}`{rewritten}"


def sitting_clause(argv: list[str], started: float, reused: int) -> str:
    """What this invocation did, after `generated_by`; nothing for --report_only, which trains nothing."""
    if "--report_only" in argv:
        return "."
    return (f"; this invocation took {(time.time() - started) / 60:.1f} minutes and reused {reused} records of "
            "earlier invocations.")


def run_status(records: dict, expected: int, skipped: list[RunSpec], shown: int = 8) -> str:
    """Complete, or partial with the first `shown` missing runs named."""
    if len(records) == expected:
        return f"**Complete**: all {expected} runs."
    names = [spec.name for spec in skipped]
    if not names:
        listed = "see the runs list"
    elif len(names) <= shown:
        listed = ", ".join(names)
    else:
        listed = f"{', '.join(names[:shown])} and {len(names) - shown} more"
    return (f"**Partial**: {len(records)} of {expected} runs have records; the missing ones ({listed}) run on the "
            "next invocation.")


def run_seconds(record: dict) -> float | None:
    """Training plus analyses, as measured; None for a record made before analyses were timed."""
    if record.get("analysis_seconds") is None:
        return None
    return record["train_seconds"] + record["analysis_seconds"]


def projected_wall_minutes(specs: list[RunSpec], records: dict, lanes: int) -> float | None:
    """Wall time of running `specs` from scratch on `lanes` lanes, each run taking its record's measured time.

    It replays run_jobs's schedule: runs start in spec order, each on the first lane to come free. None when a spec
    has no timed record, since the projection would then be a guess.
    """
    free_at = [0.0] * lanes
    for spec in specs:
        seconds = run_seconds(records[spec.name]) if spec.name in records else None
        if seconds is None:
            return None
        lane = free_at.index(min(free_at))
        free_at[lane] += seconds
    return max(free_at) / 60


def wall_time_sentence(specs: list[RunSpec], records: dict, lanes: int) -> str:
    """What the report says about how long the budget takes from scratch."""
    projected = projected_wall_minutes(specs, records, lanes)
    if projected is None:
        return "The budget's wall time from scratch is projected once every run has a timed record."
    return (f"From scratch, at these records' measured times and in the script's order on {lanes} lanes, "
            f"the {len(specs)} runs take about **{projected:.0f} minutes** of wall time.")


def write_report_files(out: Path, text: str, summary: dict, suffix: str = "") -> Path:
    """report<suffix>.md and summary<suffix>.json in the report folder; returns the report's path."""
    report = out / f"report{suffix}.md"
    report.write_text(text)
    (out / f"summary{suffix}.json").write_text(json.dumps(summary, indent=1, default=str))
    return report


# ------------------------------------------------------------------------------------------------------ one job
def _run_logged(cmd: list[str], log_path: Path, env: dict, append: bool = False) -> int:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("a" if append else "w") as log:
        return subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env).returncode


def _tail(log_path: Path, lines: int = 15) -> str:
    return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])


class JobFailed(RuntimeError):
    pass


class PastDeadline(RuntimeError):
    pass


def _write_json_atomic(path: Path, payload: dict):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=1, allow_nan=True))
    os.replace(tmp, path)


def read_record(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def record_matches(record: dict | None, spec: RunSpec, settings: AnalysisSettings) -> bool:
    return (record is not None and record.get("version") == RECORD_VERSION and record.get("flags") == spec.flags()
            and recorded_settings(record) == dataclasses.asdict(settings)
            and [int(s) for s in record.get("analyses", {})] == checkpointed_steps(record, spec))


def recorded_settings(record: dict) -> dict | None:
    """A record's analysis settings; one made before the device was recorded was analysed on the CPU."""
    settings = record.get("analysis_settings")
    return None if settings is None else {"device": "cpu", "heldout": DEFAULT_DATASET, **settings}


def record_device(record: dict) -> str:
    """Where a record's run trained: its trainer --device (a record without one was made on the CPU)."""
    flags = record.get("flags") or []
    return flags[flags.index("--device") + 1] if "--device" in flags else "cpu"


def checkpointed_steps(record: dict, spec: RunSpec) -> list[int]:
    """The analyse steps the run saved a checkpoint at: up to its last step, which a diverged run never saves."""
    last = record.get("last_step", 0)
    return [s for s in spec.analyse_steps if s < last or (s == last and record.get("status") != "diverged")]


def run_job(spec: RunSpec, settings: AnalysisSettings, runs_dir: Path, records_dir: Path, env: dict,
            fresh: bool = False, deadline: float | None = None, keep_checkpoints: bool = True) -> dict:
    """Train (unless a finished run with these flags exists), analyse its checkpoints, write its record.

    Without keep_checkpoints the run's checkpoints are deleted once its record is written (a GPU sweep's widest
    runs save gigabytes each); the record is all a report reads."""
    record_path = records_dir / f"{spec.name}.json"
    record = read_record(record_path)
    if not fresh and record_matches(record, spec, settings):
        return dict(record, reused="record")
    if deadline is not None and time.time() > deadline:
        raise PastDeadline(spec.name)

    run_dir = runs_dir / spec.name
    flags_file, results_file = run_dir / "study_flags.json", run_dir / "results.json"
    seconds_file = run_dir / "study_seconds.txt"
    same_flags = not fresh and flags_file.is_file() and json.loads(flags_file.read_text()) == spec.flags()
    reuse_training = same_flags and training_ended(results_file)
    log_dir = runs_dir / "logs"
    if not reuse_training:
        from peft_pretraining.run_folder import find_checkpoint

        # an interrupted run with these flags resumes from its last checkpoint; anything else starts over
        checkpoint = find_checkpoint(str(run_dir)) if same_flags else None
        earlier_seconds = interrupted_seconds(run_dir) if checkpoint else 0.0
        if checkpoint is None and run_dir.exists():
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        if checkpoint:
            seconds_file.write_text(f"{earlier_seconds:.1f}\n")  # the time so far survives another interruption
        flags_file.write_text(json.dumps(spec.flags()))  # also marks when this segment started
        started = time.perf_counter()
        save_every = spec.save_every or save_every_for(spec.analyse_steps)
        resume = ["--continue_from", str(run_dir)] if checkpoint else []
        cmd = [sys.executable, "torchrun_main.py", *spec.flags(), "--save_every", str(save_every),
               "--resumable_last", str(RESUMABLE_CHECKPOINTS), "--save_dir", str(run_dir),
               "--run_name", f"study-{spec.name}", *resume]
        code = _run_logged(cmd, log_dir / f"{spec.name}.train.log", env, append=bool(checkpoint))
        if code not in (0, 3):  # 3 = diverged: a result, not a failure
            raise JobFailed(f"training {spec.name} failed ({code}): {' '.join(cmd)}\n"
                            f"{_tail(log_dir / f'{spec.name}.train.log')}")
        seconds_file.write_text(f"{earlier_seconds + time.perf_counter() - started:.1f}\n")

    results = json.loads(results_file.read_text())
    steps = [s for s in spec.analyse_steps if (run_dir / f"model_{s}").is_dir()]
    analyses_file = run_dir / "study_analyses.json"
    analysis_started = time.perf_counter()
    if steps:
        cmd = [sys.executable, str(Path(__file__).resolve()), "analyse", "--run_dir", str(run_dir),
               "--steps", *map(str, steps), "--settings", json.dumps(dataclasses.asdict(settings)),
               "--out_json", str(analyses_file)]
        code = _run_logged(cmd, log_dir / f"{spec.name}.analyse.log", env)
        if code != 0:
            raise JobFailed(f"analysing {spec.name} failed ({code})\n{_tail(log_dir / f'{spec.name}.analyse.log')}")
    analyses = json.loads(analyses_file.read_text()) if steps else {}

    record = dict(version=RECORD_VERSION, arm=spec.arm, seed=spec.seed, flags=spec.flags(),
                  analysis_settings=dataclasses.asdict(settings), status=results["status"],
                  last_step=int(results["step"]), final_eval_loss=results.get("final_eval_loss"),
                  diverged_reason=results.get("diverged_reason"), tokens_seen=results.get("tokens_seen"),
                  train_seconds=float(seconds_file.read_text()), machine=machine_description(settings.device),
                  device=settings.device,
                  analysis_seconds=round(time.perf_counter() - analysis_started, 1),
                  **curves_from_metrics(run_dir / "metrics.jsonl"), analyses=analyses)
    _write_json_atomic(record_path, record)
    if not keep_checkpoints:
        for checkpoint in run_dir.glob("model_*"):
            shutil.rmtree(checkpoint, ignore_errors=True)
    return dict(record, reused="training" if reuse_training else "no")


def training_ended(results_file: Path) -> bool:
    """Whether a run folder's training is over: it finished or diverged. A run stopped by a signal (SIGTERM, the end
    of a session) also writes results.json, with status "stopped", and resumes from its checkpoint instead."""
    return results_file.is_file() and json.loads(results_file.read_text())["status"] != "stopped"


def interrupted_seconds(run_dir: Path) -> float:
    """Training time already spent in a run folder whose trainer was stopped: from the start of its last segment
    (study_flags.json is written then) to its last metrics row, plus the segments before it."""
    metrics, flags = run_dir / "metrics.jsonl", run_dir / "study_flags.json"
    earlier = float((run_dir / "study_seconds.txt").read_text()) if (run_dir / "study_seconds.txt").is_file() else 0.0
    if not metrics.is_file():
        return earlier
    return earlier + max(0.0, metrics.stat().st_mtime - flags.stat().st_mtime)


def curves_from_metrics(metrics_path: Path) -> dict:
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "step" in r]
    train = [(r["step"], r["loss"]) for r in rows if isinstance(r.get("loss"), (int, float))]
    stride = max(1, len(train) // 200)  # keep the record small: about 200 points of the training curve
    speeds = [r["tokens_per_s"] for r in rows if isinstance(r.get("tokens_per_s"), (int, float))]
    return dict(eval_curve=[[r["step"], r["eval_loss"]] for r in rows if r.get("eval_loss") is not None],
                train_curve=[list(p) for p in train[::stride]],
                tokens_per_s_median=float(np.median(speeds[len(speeds) // 10:])) if speeds else None,
                norm_gain_curve=[[r["step"], r["norm_gain_mean"]] for r in rows if r.get("norm_gain_mean")])


def checkpoint_bytes(spec: RunSpec) -> int:
    """The most disk a run's folder takes while it trains: every checkpoint's fp32 weights, and the AdamW state
    (twice the weights) in the newest and in the one being written."""
    from utils.memory_estimate import parameter_count

    flags = spec.flags()
    config = argparse.Namespace(**json.loads((REPO / flags[flags.index("--model_config") + 1]).read_text()))
    steps = int(flags[flags.index("--num_training_steps") + 1])
    checkpoints = steps // (spec.save_every or save_every_for(spec.analyse_steps))
    return 4 * parameter_count(config) * (checkpoints + 2 * 2)


def jobs_the_disk_holds(specs: list[RunSpec], jobs: int, runs_dir: Path) -> int:
    """`jobs`, lowered (with one line saying so) until the runs in flight cannot fill the disk that runs_dir is on."""
    if not specs or jobs == 1:
        return jobs
    runs_dir.mkdir(parents=True, exist_ok=True)
    free, largest = shutil.disk_usage(runs_dir).free, max(checkpoint_bytes(spec) for spec in specs)
    fits = max(1, min(jobs, int(0.9 * free // largest)))
    if fits < jobs:
        print(f"--jobs {jobs} lowered to {fits}: the largest run writes up to {largest / 1e9:.1f} GB of "
              f"checkpoints and {free / 1e9:.0f} GB are free under {runs_dir}", flush=True)
    return fits


def run_jobs(specs: list[RunSpec], settings: AnalysisSettings, runs_dir: Path, records_dir: Path, jobs: int,
             fresh: bool = False, deadline: float | None = None,
             keep_checkpoints: bool = True) -> tuple[dict[str, dict], list[RunSpec]]:
    """Every job, `jobs` at a time, one thread each; returns the records and the specs skipped at the deadline.

    No run starts after `deadline` (a Unix time), so every run that starts also finishes. A job that fails is
    reported after the others have finished; their records are kept.
    """
    from tqdm.auto import tqdm

    jobs = jobs_the_disk_holds(specs, jobs, runs_dir)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
    records, skipped, failures = {}, [], []
    with ThreadPoolExecutor(max_workers=jobs) as pool, \
            tqdm(total=len(specs), desc="runs (train + analyse)", unit="run", dynamic_ncols=True) as bar:
        futures = {pool.submit(run_job, spec, settings, runs_dir, records_dir, env, fresh, deadline,
                               keep_checkpoints): spec for spec in specs}
        for future in as_completed(futures):  # the bar counts reused records at once, not in submission order
            spec = futures[future]
            try:
                records[spec.name] = future.result()
            except PastDeadline:
                skipped.append(spec)
            except JobFailed as err:
                failures.append(str(err))
                tqdm.write(f"FAILED: {err}")
            bar.update(1)
            bar.refresh()  # update() alone skips redraws within mininterval, hiding records reused at once
    if failures:
        raise SystemExit(f"{len(failures)} of {len(specs)} runs failed; the others' records are saved:\n"
                         + "\n\n".join(failures))
    # reports read records in spec order, as before, whatever order the jobs finished in
    return ({spec.name: records[spec.name] for spec in specs if spec.name in records},
            [spec for spec in specs if spec in skipped])


def load_records(specs: list[RunSpec], settings: AnalysisSettings, records_dir: Path) -> dict[str, dict]:
    """The records that exist and match their spec (for --report_only)."""
    found = {}
    for spec in specs:
        record = read_record(records_dir / f"{spec.name}.json")
        if record_matches(record, spec, settings):
            found[spec.name] = dict(record, reused="record")
    return found


# ------------------------------------------------------------------------------------------------------ analyses
def _tool(main, argv: list[str], log) -> None:
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        main(argv)


def norm_gains(checkpoint: Path) -> dict:
    """Mean gain of each decoder layer's norms (both of them, or however many the placement has) and the final norm."""
    from safetensors.torch import load_file

    weights = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        weights.update(load_file(str(shard)))
    per_layer: dict[int, list[float]] = {}
    max_dev = 0.0
    for name, tensor in weights.items():
        parts = name.split(".")
        if len(parts) >= 5 and parts[1] == "layers" and "norm" in parts[3] and parts[-1] == "weight":
            per_layer.setdefault(int(parts[2]), []).append(float(tensor.float().mean()))
            max_dev = max(max_dev, float((tensor.float() - 1).abs().max()))
    final = weights.get("model.norm.weight")
    # max_abs_dev_from_one = 0 means every block-norm gain is still exactly 1.0 (the pure-bf16 trap).
    return dict(per_layer=[float(np.mean(per_layer[i])) for i in sorted(per_layer)],
                final=None if final is None else float(final.float().mean()), max_abs_dev_from_one=max_dev)


def analyse_checkpoint(checkpoint: Path, settings: AnalysisSettings, out_dir: Path, log) -> dict:
    """All instruments on one checkpoint, each through its own command line; returns the per-layer numbers."""
    sys.path.insert(0, str(REPO))
    import layer_remove
    from utils import angular_analysis, jacobian_analysis, variance_analysis

    stream_text, removal_text = heldout_text_flags(settings.heldout)
    text = [*stream_text, "--max_seq_len", str(settings.max_seq_len), "--device", settings.device,
            "--dtype", "float32"]
    _tool(variance_analysis.main, ["--model_paths", str(checkpoint), "--labels", checkpoint.name, *text,
                                   "--num_tokens", str(settings.stream_tokens), "--output_dir",
                                   str(out_dir / "variance")], log)
    variance = json.loads((out_dir / "variance" / "residual_variance.json").read_text())["models"][0]
    _tool(angular_analysis.main, ["--model_path", str(checkpoint), *text, "--num_tokens", str(settings.stream_tokens),
                                  "--output_dir", str(out_dir / "angular")], log)
    angular = json.loads((out_dir / "angular" / "angular_distance.json").read_text())["angular_distance"]
    influence = json.loads((out_dir / "angular" / "block_influence.json").read_text())["block_influence"]
    _tool(jacobian_analysis.main, ["--model_path", str(checkpoint), *text, "--num_tokens",
                                   str(settings.jacobian_tokens), "--probes", str(settings.jacobian_probes),
                                   "--output_dir", str(out_dir / "jacobian")], log)
    with (out_dir / "jacobian" / "jacobian.csv").open() as handle:  # columns fixed by the tool's contract
        jacobian = sorted(csv.DictReader(handle), key=lambda row: int(row["layer"]))
    _tool(layer_remove.main, ["--model_path", str(checkpoint), "--sweep", "--tasks", "heldout_novel_ppl",
                              *removal_text, "--task_max_documents", str(settings.removal_documents),
                              "--device", settings.device,
                              "--dtype", "float32", "--max_seq_len", str(settings.max_seq_len), "--per_document",
                              "--output_dir", str(out_dir / "removal")], log)
    rows = json.loads((out_dir / "removal" / "layer_removal.json").read_text())["rows"]
    baseline = next(r for r in rows if r["removed_layer"] is None)
    removed = sorted((r for r in rows if r["removed_layer"] is not None), key=lambda r: r["removed_layer"])
    return dict(
        variance=[float(v) for v in variance["variance"]],
        angular_next=[None if v is None else float(v) for v in angular[0]],
        angular=angular,
        block_influence=[float(v) for v in influence],
        jacobian_rel_identity_dev=[float(row["rel_identity_dev"]) for row in jacobian],
        jacobian_mean_diag=[float(row["mean_diag"]) if row["mean_diag"] else None for row in jacobian],
        removal_metric=baseline["metric"], removal_baseline=float(baseline["value"]),
        # The loss rise in nats per word: ln(ppl without the layer / ppl with it).
        removal_nats=[math.log(r["value"] / baseline["value"]) for r in removed],
        # Per held-out document (for intervals over documents when an arm has one seed): the intact model's loss in
        # nats per word, and per removed layer the rise in it.
        removal_document_nats=[-loglik / words for loglik, words in baseline["documents"]],
        removal_document_costs=[[(base_loglik - loglik) / words
                                 for (base_loglik, words), (loglik, _) in zip(baseline["documents"], r["documents"])]
                                for r in removed],
        norm_gains=norm_gains(checkpoint),
    )


def _analyse_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="engine.py analyse")  # internal: called by run_job
    parser.add_argument("--run_dir", required=True)
    parser.add_argument("--steps", type=int, nargs="+", required=True)
    parser.add_argument("--settings", required=True)
    parser.add_argument("--out_json", required=True)
    args = parser.parse_args(argv)
    settings = AnalysisSettings(**json.loads(args.settings))
    run_dir = Path(args.run_dir)
    results = {}
    for step in args.steps:
        print(f"analysing {run_dir / f'model_{step}'}", flush=True)
        # The tools' output folders are scratch that the record replaces: an earlier analysis of this checkpoint
        # (a report folder moved or deleted, then the study run again) is redone, not refused by layer_remove.py.
        out_dir = run_dir / "analysis" / f"step_{step}"
        shutil.rmtree(out_dir, ignore_errors=True)
        results[str(step)] = analyse_checkpoint(run_dir / f"model_{step}", settings, out_dir, sys.stdout)
    _write_json_atomic(Path(args.out_json), results)
    return 0


# ------------------------------------------------------------------------------------------------------ summaries
def deep_half(values: list) -> list[float]:
    """The deeper half of per-layer values (layers L//2 .. L-1), finite ones only."""
    tail = values[len(values) // 2:]
    return [float(v) for v in tail if v is not None and math.isfinite(v)]


def summarise_analysis(analysis: dict) -> dict:
    """The scalar measures of one analysed checkpoint."""
    variance = analysis["variance"]
    removal = analysis["removal_nats"]
    gains = analysis["norm_gains"]["per_layer"]
    return dict(
        variance_growth=variance[-1] / variance[1] if len(variance) > 2 and variance[1] > 0 else float("nan"),
        angular_deep=float(np.mean(deep_half(analysis["angular_next"]) or [float("nan")])),
        removal_deep=float(np.mean(deep_half(removal))),
        cheap_removal_fraction=float(np.mean([v < CHEAP_REMOVAL_NATS for v in removal])),
        jacobian_deep=float(np.mean(deep_half(analysis["jacobian_rel_identity_dev"]))),
        norm_gain_mean=float(np.mean(gains)) if gains else float("nan"),
        bi_deep=float(np.mean(deep_half(analysis["block_influence"]) or [float("nan")]))
        if "block_influence" in analysis else float("nan"),
    )


def document_measures(record: dict) -> dict | None:
    """Per-document values at the last analysed step, or None for a run analysed without them:
    heldout_nats, the held-out loss per document (nats/word), and removal_deep, per document the mean loss rise
    over the deeper half of the layers."""
    analyses = record.get("analyses") or {}
    if not analyses or record.get("status") != "finished":
        return None
    analysis = analyses[str(max(int(s) for s in analyses))]
    if "removal_document_costs" not in analysis:
        return None
    deep = analysis["removal_document_costs"][len(analysis["removal_document_costs"]) // 2:]
    return dict(heldout_nats=analysis["removal_document_nats"],
                removal_deep=[float(np.mean(per_layer)) for per_layer in zip(*deep)] if deep else [])


MEASURES = {
    "eval_loss": "eval loss (nats/token)",
    "variance_growth": "variance growth, last layer / first",
    "angular_deep": "deep-half angular distance d(l, l+1)/pi",
    "removal_deep": "deep-half removal cost (nats/word)",
    "cheap_removal_fraction": "fraction of layers with removal cost < 1% ppl",
    "jacobian_deep": "deep-half ‖J − I‖_F / √d",
    "norm_gain_mean": "mean norm gain (all layers)",
    "bi_deep": "deep-half block influence 1 − cos(h_l, h_l+1)",
}


LATER_MEASURES = ("bi_deep",)  # records analysed before a measure existed lack it


def measures_in(records: dict[str, dict]) -> dict[str, str]:
    """MEASURES, less the later ones that no record has, so that no table, plot or verdict shows a measure that
    none of its runs took."""
    found = [measures_at(r) for r in records.values() if r.get("status") == "finished"]
    return {m: title for m, title in MEASURES.items()
            if m not in LATER_MEASURES or any(finite_or_none(f.get(m)) is not None for f in found)}


def measures_at(record: dict, step: int | None = None) -> dict:
    """Every scalar measure of a record at an analysed step (default: its last analysed step)."""
    analyses = record.get("analyses") or {}
    if not analyses:
        return dict(eval_loss=record.get("final_eval_loss"))
    step = step if step is not None else max(int(s) for s in analyses)
    evals = dict((int(s), loss) for s, loss in record.get("eval_curve", []))
    return dict(summarise_analysis(analyses[str(step)]), eval_loss=evals.get(step))


def finite_or_none(value):
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def by_seed(records: dict[str, dict], arm: str, measure: str, step: int | None = None) -> dict[int, float | None]:
    """{seed: value} of one measure for one arm; a diverged run gives None (the verdicts drop its pair)."""
    values = {}
    for record in records.values():
        if record["arm"] != arm:
            continue
        if record["status"] != "finished":
            values[record["seed"]] = None
            continue
        values[record["seed"]] = finite_or_none(measures_at(record, step).get(measure))
    return values


# ------------------------------------------------------------------------------------------------------ plots
def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def finish_grid(fig, axes, panels_used: int, title: str, path: Path) -> Path:
    """Hide the unused panels of a grid, put the legend on the first, title, save and close the figure."""
    for ax in list(axes.flat)[panels_used:]:
        ax.axis("off")
    if axes.flat[0].get_legend_handles_labels()[0]:  # a report with no records yet has nothing to label
        axes.flat[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=140)
    pyplot().close(fig)
    return path


def plot_dynamics(records: dict[str, dict], arms: dict[str, str], path: Path, measures=None) -> Path:
    """Each measure against the training step: one line per arm (mean over seeds), shaded from min to max."""
    plt = pyplot()
    measures = list(measures or measures_in(records))
    cols = 3
    rows = math.ceil(len(measures) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.4 * rows), squeeze=False)
    for ax, measure in zip(axes.flat, measures):
        for arm, label in arms.items():
            arm_records = [r for r in records.values() if r["arm"] == arm and r.get("analyses")]
            steps = sorted({int(s) for r in arm_records for s in r["analyses"]})
            series = [[finite_or_none(measures_at(r, s).get(measure)) if str(s) in r["analyses"] else None
                       for s in steps] for r in arm_records]
            points = [(s, [v[i] for v in series if v[i] is not None]) for i, s in enumerate(steps)]
            points = [(s, vals) for s, vals in points if vals]
            if not points:
                continue
            xs = [s for s, _ in points]
            line, = ax.plot(xs, [np.mean(v) for _, v in points], marker="o", markersize=3, label=label,
                            linestyle="--" if "bf16" in arm else "-")  # pure-bf16 arms often overlap mixed ones
            ax.fill_between(xs, [min(v) for _, v in points], [max(v) for _, v in points], alpha=0.2,
                            color=line.get_color())
        ax.set_title(MEASURES[measure], fontsize=9)
        ax.set_xlabel("update step")
        if measure == "variance_growth":  # early in training the first layer's variance is tiny: ratios in the 1000s
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    return finish_grid(fig, axes, len(measures), "Training dynamics (line: mean over seeds; band: min to max)", path)


def plot_layer_profiles(records: dict[str, dict], arms: dict[str, str], path: Path) -> Path:
    """Per-layer measures at each run's last analysed checkpoint, mean over seeds."""
    import matplotlib.ticker

    plt = pyplot()
    # Layer 0 dwarfs the others in the last two panels: a symmetric log scale keeps the deep layers visible.
    panels = [("variance", "residual variance (0 = embeddings)", "log"), ("angular_next", "d(l, l+1)/pi", "linear"),
              ("jacobian_rel_identity_dev", "‖J − I‖_F / √d", "symlog"),
              ("removal_nats", "removal cost (nats/word)", "symlog")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 3.4))
    for ax, (key, title, scale) in zip(axes, panels):
        for arm, label in arms.items():
            curves = []
            for record in records.values():
                if record["arm"] == arm and record.get("analyses") and record["status"] == "finished":
                    last = max(record["analyses"], key=int)
                    curves.append([np.nan if v is None else v for v in record["analyses"][last][key]])
            if curves:
                width = min(len(c) for c in curves)
                ax.plot(np.nanmean([c[:width] for c in curves], axis=0), marker="o", markersize=2.5, label=label,
                        linestyle="--" if "bf16" in arm else "-")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("layer")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        if scale == "symlog":
            ax.set_yscale("symlog", linthresh=1e-2)
        else:
            ax.set_yscale(scale)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=140)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------------------ report bits
def software_versions() -> str:
    import importlib.metadata as md

    names = ("torch", "transformers", "tokenizers", "datasets", "lm_eval", "numpy", "matplotlib")
    return ", ".join(f"{n} {md.version(n)}" for n in names)


def cpuinfo_field(name: str) -> str | None:
    """The first `name : value` of /proc/cpuinfo ("model name", "flags", ...); None where there is none."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, colon, value = line.partition(":")
            if colon and key.strip() == name:
                return value.strip()
    return None


def cpu_model_name() -> str:
    """The CPU's model name from /proc/cpuinfo, else what the platform module knows."""
    return cpuinfo_field("model name") or platform.processor() or "unknown CPU"


def bf16_instructions() -> list[str]:
    """The CPU's bf16 matrix instructions named in /proc/cpuinfo (none on CPUs whose cpuinfo says "Features")."""
    flags = (cpuinfo_field("flags") or "").split()
    return [flag for flag in ("avx512_bf16", "amx_bf16") if flag in flags]


def records_machines(records: dict[str, dict]) -> str:
    """Where the records were made, as each says (a report rewritten with --report_only may be written elsewhere)."""
    counts = collections.Counter(record.get("machine") for record in records.values())
    made = [f"{machine} ({count} runs)" for machine, count in counts.items() if machine]
    if counts.get(None):
        made.append(f"not recorded for {counts[None]} runs (records made before a record named its machine)")
    return "; ".join(made) or "no records yet"


def machine_description(device: str = "cpu") -> str:
    """The host; with device "cuda", its GPU first."""
    host = (f"{platform.machine()}, {cpu_model_name()}, {os.cpu_count()} cores, bf16 instructions: "
            f"{', '.join(bf16_instructions()) or 'none'}, Python {platform.python_version()}")
    if device != "cuda":
        return host
    import torch

    return f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda}) on {host}"


def embedded_train_tokens() -> int:
    """Tokens in the embedded training split, EOS included (what one epoch of --packing reads, tokenized as the
    trainer does)."""
    from peft_pretraining.dataloader import embedded_split_path, load_tokenizer, read_jsonl_texts, tokenize_documents

    texts = list(read_jsonl_texts(embedded_split_path("train")))
    return sum(len(ids) for ids in tokenize_documents(load_tokenizer("embedded"), texts, max_length=0, packing=True))


def train_split_tokens(settings: dict) -> int:
    """Tokens in a budget's training split, EOS included. The Wikipedia count is stored (measured once, checked by
    tests/test_wikipedia_data.py where the corpus is present): a report is rewritten without the corpus."""
    if settings.get("dataset", DEFAULT_DATASET) == DEFAULT_DATASET:
        return embedded_train_tokens()
    from peft_pretraining.wikipedia_corpus import TRAIN_TOKENS

    return TRAIN_TOKENS

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "analyse":
        sys.exit(_analyse_main(sys.argv[2:]))
    raise SystemExit("usage: engine.py analyse --run_dir DIR --steps N [N ...] --settings JSON --out_json PATH")
