"""The one-command GPU check: `bash utils/gpu/gpu_check.sh OUT_DIR` runs this file on one CUDA GPU.

Stages, each under a time limit; a failed stage does not stop the others:
    env          torch, CUDA, the GPU, the pinned packages, lm-eval and liger-kernel, the free disk
    fixtures     the offline stand-ins of C4 and t5-base (utils/offline_fixtures.py)
    recipes      run_130m.sh and run_1b.sh, pre and lns, as shipped (compiled, pure bf16, one GPU: accumulation 8 and
                 16) for a few updates on the offline stand-ins of C4 and t5-base (utils/offline_fixtures.py)
    fsdp_resume  run_130m.sh --fsdp --dtype mixed --resume auto, stopped by SIGTERM after two updates (a sharded
                 save, exit 5), then the same command again: exit 0, and the loss goes on from where it stopped
    bare_steps   the bare compiled step of each recipe at its micro-batch: what the trainer can reach
    micro_batch  the bare compiled 130M step at micro-batch 64, 128 and 256: the fastest that fits is the choice
    losses       the bare compiled 130M step with --loss standard, chunked and liger at the chosen micro-batch: the
                 choice is the fastest whose loss is within head_losses.LOSS_TOLERANCE of the fp32 model's (liger is
                 skipped, with the reason, where it does not import)
    eager_1b     the bare eager pure-bf16 1B step (utils/bench/benchmark_gpu.py): the MLP width 5461, padded on CUDA
    width_sweep_plan  always, last: the width sweep's GPU runs left, the disk its widest run writes, the jobs the disk
                 holds (utils/gpu/gpu_lease.sh width_sweep is that call)

Writes OUT_DIR/gpu_check.md (the table, with the targets of issue 38) and OUT_DIR/gpu_check.json after every stage
(a call cut at its limit keeps what finished), and a log per stage; prints each stage's seconds at the end.
Exit code: 0 every stage ran, 1 a stage failed (a target missed is reported, not a failure), 2 no CUDA device.
Trainer rates are medians over the updates after the first RECIPE_WARMUP (compilation). MFU counts every position the
step computes, padding included; tokens/s counts real (non-pad) tokens, as the trainer logs them.

--rehearse runs every stage's commands on the CPU instead, with the same flags followed by REHEARSAL's (a tiny model,
the total batch and every micro-batch divided by 32, a few updates, eager bare steps): what a GPU call would fail on
for a reason the CPU can see (a missing package, a flag, a path) fails here first. Its numbers mean nothing.
"""
import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from peft_pretraining.cli import OneLineErrorParser
from peft_pretraining.model.head_losses import LOSS_TOLERANCE, liger_import_error
from utils.instruments.model_arithmetic import PAPER_MICRO_BATCH, dense_bf16_peak_tflops, model_flops_per_token

REPO = Path(__file__).resolve().parents[2]
STAGES = ["recipes", "fsdp_resume", "bare_steps", "micro_batch", "losses", "eager_1b"]
RECIPE_UPDATES = {"130m": 14, "1b": 12}
RECIPE_MICRO_BATCH = {"130m": 64, "1b": 32}  # run_130m.sh, run_1b.sh --batch_size
RECIPE_WARMUP = 2
RECIPE_SEQUENCES, RECIPE_LENGTH = 512, 256  # per update, as every run_*.sh
FSDP_UPDATES = 6
# --rehearse: every micro-batch and the total batch are divided by REHEARSAL_SHRINK, so accumulation is the GPU's
REHEARSAL_SHRINK = 32
# float32: this project's CPU has no bf16 instructions, so bf16 is emulated there (docs/study.md: mixed about 3x
# slower than float32); the recipes' pure-bf16 path is the GPU's own
REHEARSAL_TRAINER = ["--device", "cpu", "--model_config", "configs/llama_tiny.json", "--max_length", "32",
                     "--total_batch_size", str(RECIPE_SEQUENCES // REHEARSAL_SHRINK), "--workers", "0",
                     "--eval_tokens", "512", "--dtype", "float32"]
REHEARSAL_UPDATES = 3  # the first two are the warm-up, as on the GPU
REHEARSAL_FSDP_UPDATES = 12  # tiny updates are fast: room for the SIGTERM to land before the last
REHEARSAL_BENCHMARK = ["--device", "cpu", "--configs", "configs/llama_tiny.json", "--seq_len", "32", "--steps", "1",
                       "--warmup", "1", "--modes", "eager"]
EAGER_1B_BEFORE = 18_600  # tokens/s of the eager pure-bf16 1B step at b0de76d, H100 (issue 38)
TARGETS = {"mfu_1b": 0.50, "mfu_130m": 0.40, "eager_1b_speedup": 2.5, "trainer_share_of_bare_step": 0.95}
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled",
           "PYTHONUNBUFFERED": "1"}


def read_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def trainer_rates(rows: list[dict], config_path: Path, peak_tflops: float | None) -> dict:
    """Median real tokens/s, positions/s and MFU over the updates after the warm-up."""
    timed = []
    for before, row in zip(rows, rows[1:]):
        if row["step"] > RECIPE_WARMUP:
            real_tokens = row["tokens_seen"] - before["tokens_seen"]
            timed.append((row["tokens_per_s"], real_tokens / row["tokens_per_s"]))
    if not timed:
        return {"timed_updates": 0}
    update_s = statistics.median(seconds for _, seconds in timed)
    positions_per_s = RECIPE_SEQUENCES * RECIPE_LENGTH / update_s
    with open(config_path) as f:
        config = argparse.Namespace(**json.load(f))
    rates = {"timed_updates": len(timed), "update_s": round(update_s, 3),
             "tokens_per_s": round(statistics.median(rate for rate, _ in timed)),
             "positions_per_s": round(positions_per_s)}
    if peak_tflops:
        rates["mfu"] = round(positions_per_s * model_flops_per_token(config, RECIPE_LENGTH) / 1e12 / peak_tflops, 3)
    return rates


class Check:
    def __init__(self, out: Path, env: dict, command: str, rehearse: bool):
        self.out, self.env, self.command, self.rehearse, self.stages = out, env, command, rehearse, {}

    def run(self, stage: str, command: list[str], limit_s: int) -> subprocess.CompletedProcess | None:
        """Run one command of a stage, its output appended to OUT/<stage>.log; None when it ran past its limit."""
        start = time.perf_counter()
        with open(self.out / f"{stage}.log", "a") as log:
            log.write(f"$ {' '.join(command)}\n")
            log.flush()
            try:
                proc = subprocess.run(command, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                      timeout=limit_s, stdin=subprocess.DEVNULL)
            except subprocess.TimeoutExpired:
                proc = None
        print(f"gpu_check: {stage}: {'timed out' if proc is None else f'exit {proc.returncode}'} after "
              f"{time.perf_counter() - start:.0f} s: {' '.join(command[:3])} ...", flush=True)
        return proc

    def record(self, stage: str, ok: bool, seconds: float, **details):
        """Keep a stage's result and rewrite the report, so that a call cut at its limit still brings back the
        stages that finished."""
        self.stages[stage] = dict(ok=ok, seconds=round(seconds), **details)
        write_report(self.out, self.stages, self.command, self.rehearse)


def stage_env(check: Check) -> dict:
    import torch

    device = f"CPU rehearsal ({platform.machine()})" if check.rehearse else torch.cuda.get_device_name()
    info = {"device": device, "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "gpus_visible": torch.cuda.device_count()}
    for package in ("transformers", "datasets", "accelerate", "tokenizers", "safetensors", "lm_eval"):
        try:
            info[package] = __import__(package).__version__
        except ImportError:
            info[package] = "missing"
    info["liger_kernel"] = liger_import_error() or "imports"
    info["disk_free_gb"] = round(shutil.disk_usage(check.out).free / 1e9)
    check.record("env", ok=True, seconds=0, **info)
    print("gpu_check: " + ", ".join(f"{k} {v}" for k, v in info.items()), flush=True)
    return info


def stage_recipes(check: Check, fixtures: Path, peak: float | None, sizes: list[str], micro_batches: list[int]):
    """Each recipe as shipped, 1B first (never run on a GPU before this check), then the 130M recipe's Pre-LN at
    larger micro-batches (the total batch of 512 kept through accumulation)."""
    runs = [(size, norm_type, None) for size in sorted(sizes, reverse=True) for norm_type in ("pre", "lns")]
    runs += [("130m", "pre", batch) for batch in micro_batches if "130m" in sizes]
    for size, norm_type, batch in runs:
        stage = f"recipe_{size}_{norm_type}" + (f"_b{batch}" if batch else "")
        updates = REHEARSAL_UPDATES if check.rehearse else RECIPE_UPDATES[size]
        run_dir, start = check.out / "runs" / stage, time.perf_counter()
        rehearsal = ([*REHEARSAL_TRAINER, "--batch_size", str((batch or RECIPE_MICRO_BATCH[size]) // REHEARSAL_SHRINK)]
                     if check.rehearse else [])
        proc = check.run(stage, ["bash", f"run_{size}.sh", norm_type, *data_flags(fixtures),
                                 *(["--batch_size", str(batch)] if batch else []),
                                 "--num_training_steps", str(updates), "--warmup_steps", "1",
                                 "--eval_every", str(updates), "--eval_tokens", "20K", "--save_dir",
                                 str(run_dir), *rehearsal], limit_s=240)
        rows = read_rows(run_dir)
        check.record(stage, ok=proc is not None and proc.returncode == 0, seconds=time.perf_counter() - start,
                     updates=len(rows), **trainer_rates(rows, REPO / "configs" / f"llama_{size}.json", peak))
        shutil.rmtree(run_dir, ignore_errors=True)  # a 1B checkpoint is about 8 GB: none is kept


BENCHMARKS = {  # stage: utils/bench/benchmark_gpu.py flags (micro_batch and losses add their --batch_size)
    "bare_steps": ["--configs", "configs/llama_130m.json", "configs/llama_1b.json", "--modes", "compiled",
                   "--steps", "8", "--warmup", "3"],
    "micro_batch": ["--configs", "configs/llama_130m.json", "--modes", "compiled", "--steps", "8", "--warmup", "3"],
    "losses": ["--configs", "configs/llama_130m.json", "--modes", "compiled", "--steps", "8", "--warmup", "3"],
    "eager_1b": ["--configs", "configs/llama_1b.json", "--modes", "eager", "--steps", "6", "--warmup", "2"],
}
MICRO_BATCHES = [64, 128, 256]  # the micro_batch stage's; the recipe keeps 64 until a GPU has measured them
LOSSES = ["standard", "chunked", "liger"]


def fastest(rows: list[dict]) -> dict | None:
    return max((row for row in rows if "tokens_per_s" in row), key=lambda row: row["tokens_per_s"], default=None)


def loss_choice(rows: list[dict]) -> str | None:
    """The fastest --loss whose first loss is within LOSS_TOLERANCE of the fp32 model's on the same tokens."""
    within = [row for row in rows if "fp32_loss" in row
              and abs(row["first_loss"] - row["fp32_loss"]) <= LOSS_TOLERANCE * abs(row["fp32_loss"])]
    return fastest(within)["loss"] if within else None


def stage_benchmark(check: Check, stage: str):
    flags, details = list(BENCHMARKS[stage]), {}
    if stage == "micro_batch":
        flags += ["--batch_size", *map(str, MICRO_BATCHES)]
    if stage == "losses":
        chosen = fastest(check.stages.get("micro_batch", {}).get("rows", []))
        details["batch"] = (chosen["batch"] * (REHEARSAL_SHRINK if check.rehearse else 1) if chosen
                            else RECIPE_MICRO_BATCH["130m"])
        losses = [loss for loss in LOSSES if loss != "liger" or not (check.rehearse or liger_import_error())]
        if losses != LOSSES:  # a missing package is named, not a failed stage: the other losses still measure
            details["skipped"] = "liger: " + ("liger-kernel runs on CUDA only" if check.rehearse
                                              else liger_import_error())
        flags += ["--batch_size", str(details["batch"]), "--losses", *losses]
    if check.rehearse:  # tiny micro-batches, the GPU's divided as the recipes' are
        flags = rehearsal_benchmark_flags(flags)
    rows_path, start = check.out / f"{stage}.json", time.perf_counter()
    proc = check.run(stage, [sys.executable, "utils/bench/benchmark_gpu.py", "--dtypes", "bfloat16", *flags,
                             "--json", str(rows_path)], limit_s=200)
    rows = json.loads(rows_path.read_text()) if rows_path.is_file() else []
    if stage == "micro_batch" and fastest(rows):
        details["choice"] = f"micro-batch {fastest(rows)['batch']}"
    if stage == "losses":
        details["choice"] = loss_choice(rows)
    # a micro-batch that does not fit is a measurement (the choice is the fastest that fits), not a failure
    ok = proc is not None and proc.returncode == 0 and all(r.get("error", "out of memory") == "out of memory"
                                                           for r in rows)
    check.record(stage, ok=ok, seconds=time.perf_counter() - start, **details, rows=rows)


def rehearsal_benchmark_flags(flags: list[str]) -> list[str]:
    """A benchmark stage's flags for the CPU: its own, then REHEARSAL_BENCHMARK's (last wins), every micro-batch
    divided by REHEARSAL_SHRINK (the paper's micro-batch where the stage names none)."""
    sizes = [name for name in flags[flags.index("--configs") + 1:] if name.endswith(".json")]
    if "--batch_size" in flags:
        at = flags.index("--batch_size") + 1
        end = next((i for i in range(at, len(flags)) if flags[i].startswith("--")), len(flags))
        batches, flags = flags[at:end], flags[:at - 1] + flags[end:]
    else:
        batches = [str(PAPER_MICRO_BATCH[Path(name).name]) for name in sizes[:1]]
    return [*flags, *REHEARSAL_BENCHMARK, "--batch_size", *(str(max(1, int(b) // REHEARSAL_SHRINK)) for b in batches)]


def stage_fsdp_resume(check: Check, fixtures: Path):
    stage, run_dir, start = "fsdp_resume", check.out / "runs" / "fsdp", time.perf_counter()
    updates = REHEARSAL_FSDP_UPDATES if check.rehearse else FSDP_UPDATES
    rehearsal = ([*REHEARSAL_TRAINER, "--batch_size", str(RECIPE_MICRO_BATCH["130m"] // REHEARSAL_SHRINK)]
                 if check.rehearse else [])
    command = ["bash", "run_130m.sh", "pre", *data_flags(fixtures), "--fsdp", "--dtype", "mixed", "--resume", "auto",
               "--num_training_steps", str(updates), "--warmup_steps", "1", "--eval_every", str(updates),
               "--eval_tokens", "20K", "--save_dir", str(run_dir), *rehearsal]
    with open(check.out / f"{stage}.log", "a") as log:
        first = subprocess.Popen(command, cwd=REPO, env=check.env, stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 180
        while first.poll() is None and len(read_rows(run_dir)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        first.send_signal(signal.SIGTERM)
        try:
            stopped_code = first.wait(timeout=120)
        except subprocess.TimeoutExpired:
            first.kill()
            stopped_code = None
    stopped_rows = read_rows(run_dir)
    resumed = check.run(stage, command, limit_s=180)
    rows = read_rows(run_dir)
    losses, stopped_at = [row["loss"] for row in rows], len(stopped_rows)
    steps_continue = [row["step"] for row in rows] == list(range(1, updates + 1)) and 2 <= stopped_at < updates
    ok = (stopped_code == 5 and resumed is not None and resumed.returncode == 0 and steps_continue
          and abs(losses[stopped_at] / losses[stopped_at - 1] - 1) < 0.1)
    check.record(stage, ok=ok, seconds=time.perf_counter() - start, stopped_exit=stopped_code,
                 stopped_after=len(stopped_rows), resumed_exit=None if resumed is None else resumed.returncode,
                 losses=losses)
    shutil.rmtree(run_dir, ignore_errors=True)


# The second call of a lease: utils/gpu/gpu_lease.sh width_sweep (keep these flags the same as its own)
WIDTH_SWEEP = ["--budget", "gpu", "--device", "cuda", "--widths", "512", "768", "1024", "--runs_dir", "/tmp/width_runs",
               "--no-compile", "--jobs", "6"]
DEVICE_DISK_GB = 64 * 2**30 / 1e9  # the lent machine's disk


def stage_width_sweep_plan(check: Check):
    """What the width sweep's GPU call has left (utils/width_sweep.py --plan, which reads records and needs no GPU):
    runs without a committed record, the disk the largest writes, and the jobs that the disk lets run at once (each
    run's seconds where a GPU record has them)."""
    start, command = time.perf_counter(), [sys.executable, "utils/width_sweep.py", *WIDTH_SWEEP, "--plan"]
    proc = subprocess.run(command, cwd=REPO, env=check.env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    (check.out / "width_sweep_plan.log").write_text(f"$ {' '.join(command)}\n{proc.stderr}")
    if proc.returncode != 0:
        check.record("width_sweep_plan", ok=False, seconds=time.perf_counter() - start, exit=proc.returncode,
                     error=(proc.stderr.strip().splitlines() or ["no message"])[-1])
        return
    plan = json.loads(proc.stdout)
    disk = DEVICE_DISK_GB * 1e9 if check.rehearse else shutil.disk_usage(check.out).free
    jobs = max(1, min(6, int(0.9 * disk // plan["largest_run_bytes"])))
    left = len(plan["left"])
    check.record("width_sweep_plan", ok=True, seconds=time.perf_counter() - start, runs=plan["runs"],
                 recorded=plan["recorded"], left=left, largest_run_gb=round(plan["largest_run_bytes"] / 1e9, 1),
                 disk_gb=round(disk / 1e9), jobs=jobs, waves=-(-left // jobs),
                 recorded_run_seconds=plan["recorded_run_seconds"])


def data_flags(fixtures: Path) -> list[str]:
    return ["--dataset", str(fixtures / "c4"), "--dataset_config", "en", "--tokenizer", str(fixtures / "t5"),
            "--workers", "8"]


def verdicts(stages: dict) -> list[tuple[str, str, str, bool | None]]:
    """(what, measured, target, met) rows of the targets of issue 38."""
    rows = []
    for size, key in (("1b", "mfu_1b"), ("130m", "mfu_130m")):
        for norm_type in ("pre", "lns"):
            mfu = stages.get(f"recipe_{size}_{norm_type}", {}).get("mfu")
            rows.append((f"run_{size}.sh {norm_type}: MFU", "-" if mfu is None else f"{mfu:.3f}", f">= {TARGETS[key]}",
                         None if mfu is None else mfu >= TARGETS[key]))
    eager = next((r for r in stages.get("eager_1b", {}).get("rows", []) if "tokens_per_s" in r), None)
    speedup = eager["tokens_per_s"] / EAGER_1B_BEFORE if eager else None
    rows.append(("eager 1B step: x the 18.6K tok/s of b0de76d", "-" if speedup is None else f"{speedup:.2f}x",
                 f">= {TARGETS['eager_1b_speedup']}x", None if speedup is None else
                 speedup >= TARGETS["eager_1b_speedup"]))
    bare = {r["config"]: r["tokens_per_s"] for r in stages.get("bare_steps", {}).get("rows", []) if "tokens_per_s" in r}
    for size in RECIPE_UPDATES:
        for norm_type in ("pre", "lns"):
            trainer = stages.get(f"recipe_{size}_{norm_type}", {}).get("positions_per_s")
            step = bare.get(f"llama_{size}.json")
            share = trainer / step if trainer and step and norm_type == "pre" else None  # the bare step is Pre-LN
            if norm_type == "pre":
                rows.append((f"run_{size}.sh pre: positions/s over the bare compiled step's",
                             "-" if share is None else f"{share:.3f}", f">= {TARGETS['trainer_share_of_bare_step']}",
                             None if share is None else share >= TARGETS["trainer_share_of_bare_step"]))
    return rows


def write_report(out: Path, stages: dict, command: str, rehearse: bool = False):
    env = stages.get("env", {})
    lines = [f"# GPU check: {env.get('device', '?')}, torch {env.get('torch', '?')} (CUDA {env.get('cuda', '?')}), "
             f"transformers {env.get('transformers', '?')}", "", f"`{command}`", "",
             "| stage | ran | details |", "|---|---|---|"]
    for name, stage in stages.items():
        details = ", ".join(f"{k} {v}" for k, v in stage.items() if k not in ("ok", "rows"))
        details += "".join(f"; {r.get('config')} {'compiled' if r.get('compiled') else 'eager'} "
                           f"b{r.get('batch', '?')} {r.get('loss', 'standard')}: "
                           f"{r.get('tokens_per_s', r.get('error'))} tok/s, MFU {r.get('mfu', '-')}, "
                           f"{r.get('peak_memory_gib', '-')} GiB"
                           + (f", loss {r['first_loss']} (fp32 {r['fp32_loss']})" if "fp32_loss" in r else "")
                           for r in stage.get("rows", []))
        lines.append(f"| {name} | {'yes' if stage['ok'] else '**FAILED**'} | {details} |")
    targets = [] if rehearse else verdicts(stages)
    if rehearse:
        lines += ["", "A rehearsal on the CPU (`--rehearse`): every stage's commands ran at tiny sizes; its numbers "
                      "mean nothing and no target is judged."]
    else:
        lines += ["", "| target (issue 38) | measured | target | met |", "|---|---|---|---|"]
    for what, measured, target, met in targets:
        lines.append(f"| {what} | {measured} | {target} | {'-' if met is None else 'yes' if met else 'no'} |")
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    (out / "gpu_check.json").write_text(json.dumps({"command": command, "rehearsal": rehearse, "stages": stages,
                                                    "targets": targets}, indent=2) + "\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="gpu_check.sh", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", help="where the report, the JSON and the stage logs go")
    parser.add_argument("--stages", nargs="+", default=STAGES, choices=STAGES,
                        help="which stages run, always in the order of the default (most wanted first)")
    parser.add_argument("--micro_batches", nargs="*", type=int, default=[128, 256],
                        help="the 130M recipe's Pre-LN is also run at these micro-batches (default: 128 256)")
    parser.add_argument("--recipe_sizes", nargs="+", default=list(RECIPE_UPDATES), choices=list(RECIPE_UPDATES),
                        help="which recipes the recipes stage runs (default: all; 130m alone takes about 2 minutes)")
    parser.add_argument("--rehearse", action="store_true",
                        help="run every stage's commands on the CPU at tiny sizes: what a GPU call would fail on")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    import torch

    if not args.rehearse and not torch.cuda.is_available():
        parser.exit(2, "gpu_check.sh: error: no CUDA device is visible; this check runs the paper's recipes on a "
                       "GPU (bash run_tiny.sh runs on the CPU)\n")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    command = "bash utils/gpu/gpu_check.sh " + " ".join(argv if argv is not None else sys.argv[1:])
    # one thread per process in a rehearsal: on a busy 2-core CI machine two were 3 to 10 times slower
    threads = {"OMP_NUM_THREADS": "1"} if args.rehearse else {}
    check = Check(out, dict(os.environ, **OFFLINE, **threads, NPROC="1"), command, args.rehearse)
    info = stage_env(check)
    peak = None if args.rehearse else dense_bf16_peak_tflops(info["device"])
    fixtures, start = out / "fixtures", time.perf_counter()
    made = [check.run("fixtures", [sys.executable, "utils/offline_fixtures.py", kind, str(fixtures / kind)],
                      limit_s=120) for kind in ("c4", "t5")]
    check.record("fixtures", ok=all(proc is not None and proc.returncode == 0 for proc in made),
                 seconds=time.perf_counter() - start)
    for stage in STAGES:
        if stage not in args.stages:
            continue
        if stage == "recipes":
            stage_recipes(check, fixtures, peak, args.recipe_sizes, args.micro_batches)
        elif stage == "fsdp_resume":
            stage_fsdp_resume(check, fixtures)
        else:
            stage_benchmark(check, stage)
    stage_width_sweep_plan(check)
    shutil.rmtree(out / "runs", ignore_errors=True)
    print((out / "gpu_check.md").read_text(), flush=True)
    print("gpu_check: seconds per stage: " + ", ".join(f"{name} {stage['seconds']}"
                                                      for name, stage in check.stages.items()), flush=True)
    return 0 if all(stage["ok"] for stage in check.stages.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
