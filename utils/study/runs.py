"""A study's runs: each is one job that trains, analyses and writes its record.

A study is a list of runs (`RunSpec`: an arm, a seed and the trainer's flags). Each run is one job:

    torchrun_main.py (a subprocess, one thread)  ->  utils/study/analyse.py on each dynamics checkpoint  ->  record

Runs and analyses go to the study's --device: the CPU (the default) or a CUDA GPU. The device is part of a record's
identity, as the dtype is: the trainer's --device is in its flags and the analyses' device in its analysis settings
(a record made before the device was recorded was made on the CPU).

The record (`<out>/runs/<arm>-seed<seed>.json.gz`, records.py) holds the run's flags, its eval curve, and every analysis
at every analysed checkpoint, as small numbers. Records live beside the report and are committed with it, so a later
invocation (on any machine) reuses finished runs instead of retraining them; checkpoints stay in the runs folder.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import numpy as np

from peft_pretraining.exit_codes import ExitCode
from utils.study import records as record_store
from utils.study.host import machine_description

REPO = Path(__file__).resolve().parents[2]

DEFAULT_DATASET = "embedded"  # a budget's "dataset": embedded (in data/) or wikipedia (outside the repository)
# A budget's peak learning rate ("lr") unless --lr says otherwise; compare_norms' and width_sweep's budgets leave it
# out, so that their committed summaries, which list the settings, stay as they were.
DEFAULT_LR = "1e-3"


def peak_lr(settings: dict) -> str:
    """A study's peak learning rate: its budget's (or --lr's), else DEFAULT_LR."""
    return settings.get("lr", DEFAULT_LR)

# checkpoints of a run that keep their training state: older ones keep only the weights the analyses read (a third)
RESUMABLE_CHECKPOINTS = 1

RECORD_VERSION = 1


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


def collect_records(args, specs: list[RunSpec]) -> tuple[dict[str, dict], list[RunSpec]]:
    """The records of every spec: read back (--report_only), or made by running the jobs that have none."""
    if args.report_only:
        records = saved_records(args, specs)
        if not records:  # an empty report would look like a study; a committed one is named in the registry
            print(f"--report_only: no record in {args.out / 'runs'} matches this command's settings, so there is no "
                  "report to write; `python -m utils.study.registry list` names the committed studies and their "
                  "commands", file=sys.stderr)
            sys.exit(ExitCode.BAD_INPUT)
        return records, [spec for spec in as_trained(args, specs) if spec.name not in records]
    for spec in specs:  # an unreadable record stops the study before anything trains over it
        record_store.read_if_present(record_store.find(args.out / "runs", spec.name))
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
    return record_store.fields(record).device


def checkpointed_steps(record: dict, spec: RunSpec) -> list[int]:
    """The analyse steps the run saved a checkpoint at: up to its last step, which a diverged run never saves."""
    last = record.get("last_step", 0)
    return [s for s in spec.analyse_steps if s < last or (s == last and record.get("status") != "diverged")]


def run_job(spec: RunSpec, settings: AnalysisSettings, runs_dir: Path, records_dir: Path, env: dict,
            fresh: bool = False, deadline: float | None = None, keep_checkpoints: bool = True) -> dict:
    """Train (unless a finished run with these flags exists), analyse its checkpoints, write its record.

    Without keep_checkpoints the run's checkpoints are deleted once its record is written (a GPU sweep's widest
    runs save gigabytes each); the record is all a report reads."""
    record = record_store.read_if_present(record_store.find(records_dir, spec.name))
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
        from peft_pretraining.training.run_folder import find_checkpoint

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
    analysis_started = time.perf_counter()
    analyses = analyse_run(run_dir, steps, settings, log_dir / f"{spec.name}.analyse.log", env) if steps else {}

    record = dict(version=RECORD_VERSION, arm=spec.arm, seed=spec.seed, flags=spec.flags(),
                  analysis_settings=dataclasses.asdict(settings), status=results["status"],
                  last_step=int(results["step"]), final_eval_loss=results.get("final_eval_loss"),
                  diverged_reason=results.get("diverged_reason"), tokens_seen=results.get("tokens_seen"),
                  train_seconds=float(seconds_file.read_text()), machine=machine_description(settings.device),
                  device=settings.device,
                  analysis_seconds=round(time.perf_counter() - analysis_started, 1),
                  **curves_from_metrics(run_dir / "metrics.jsonl"), analyses=analyses)
    record_store.write(records_dir, spec.name, record)
    if not keep_checkpoints:
        for checkpoint in run_dir.glob("model_*"):
            shutil.rmtree(checkpoint, ignore_errors=True)
    return dict(record, reused="training" if reuse_training else "no")


def analyse_run(run_dir: Path, steps: list[int], settings: AnalysisSettings, log_path: Path, env: dict,
                analyses_name: str = "study_analyses.json") -> dict:
    """Every instrument on the run's checkpoints at `steps` (utils/study/analyse.py, a process of its own): the
    record's `analyses`, also kept in the run folder's `analyses_name`."""
    analyses_file = run_dir / analyses_name
    cmd = [sys.executable, "-m", "utils.study.analyse", "--run_dir", str(run_dir), "--steps", *map(str, steps),
           "--settings", json.dumps(dataclasses.asdict(settings)), "--out_json", str(analyses_file)]
    code = _run_logged(cmd, log_path, env)
    if code != 0:
        raise JobFailed(f"analysing {run_dir.name} failed ({code})\n{_tail(log_path)}")
    return json.loads(analyses_file.read_text())


def job_env() -> dict:
    """A job's environment: one thread, offline, no wandb."""
    return dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                TRANSFORMERS_OFFLINE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")


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
    from utils.instruments.model_arithmetic import parameter_count

    run = record_store.derive_fields(list(spec.flags()))
    config = argparse.Namespace(**json.loads((REPO / run.config).read_text()))
    steps = run.updates
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
    env = job_env()
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
        record = record_store.read_if_present(record_store.find(records_dir, spec.name))
        if record_matches(record, spec, settings):
            found[spec.name] = dict(record, reused="record")
    return found
