"""The one-command GPU check: `bash utils/gpu_check.sh OUT_DIR` runs this file on one CUDA GPU.

Stages, each under a time limit; a failed stage does not stop the others:
    env          torch, CUDA, the GPU and the pinned packages
    recipes      run_130m.sh and run_1b.sh, pre and lns, as shipped (compiled, pure bf16, one GPU: accumulation 8 and
                 16) for a few updates on the offline stand-ins of C4 and t5-base (utils/offline_fixtures.py)
    eager_1b     the bare eager pure-bf16 1B step (utils/benchmark_gpu.py): the MLP width 5461, padded on CUDA
    bare_steps   the bare compiled step of each recipe at its micro-batch: what the trainer can reach
    fsdp_resume  run_130m.sh --fsdp --dtype mixed --resume auto, stopped by SIGTERM after two updates (a sharded
                 save, exit 5), then the same command again: exit 0, and the loss goes on from where it stopped

Writes OUT_DIR/gpu_check.md (the table, with the targets of issue 38) and OUT_DIR/gpu_check.json, and a log per
stage. Exit code: 0 every stage ran, 1 a stage failed (a target missed is reported, not a failure), 2 no CUDA device.
Trainer rates are medians over the updates after the first RECIPE_WARMUP (compilation). MFU counts every position the
step computes, padding included; tokens/s counts real (non-pad) tokens, as the trainer logs them.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peft_pretraining.cli import OneLineErrorParser  # noqa: E402
from utils.benchmark_gpu import dense_bf16_peak_tflops, model_flops_per_token  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
STAGES = ["recipes", "fsdp_resume", "bare_steps", "micro_batch", "losses", "eager_1b"]
RECIPE_UPDATES = {"130m": 14, "1b": 12}
RECIPE_WARMUP = 2
RECIPE_SEQUENCES, RECIPE_LENGTH = 512, 256  # per update, as every run_*.sh
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
    def __init__(self, out: Path, env: dict, command: str):
        self.out, self.env, self.command, self.stages = out, env, command, {}

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
        write_report(self.out, self.stages, self.command)


def stage_env(check: Check) -> dict:
    import torch

    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "gpus_visible": torch.cuda.device_count()}
    for package in ("transformers", "datasets", "accelerate", "tokenizers", "safetensors"):
        try:
            info[package] = __import__(package).__version__
        except ImportError:
            info[package] = "missing"
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
        run_dir, updates, start = check.out / "runs" / stage, RECIPE_UPDATES[size], time.perf_counter()
        proc = check.run(stage, ["bash", f"run_{size}.sh", norm_type, *data_flags(fixtures),
                                 *(["--batch_size", str(batch)] if batch else []),
                                 "--num_training_steps", str(updates), "--warmup_steps", "1",
                                 "--eval_every", str(updates), "--eval_tokens", "20K", "--save_dir",
                                 str(run_dir)], limit_s=240)
        rows = read_rows(run_dir)
        check.record(stage, ok=proc is not None and proc.returncode == 0, seconds=time.perf_counter() - start,
                     updates=len(rows), **trainer_rates(rows, REPO / "configs" / f"llama_{size}.json", peak))
        shutil.rmtree(run_dir, ignore_errors=True)  # a 1B checkpoint is about 8 GB: none is kept


BENCHMARKS = {  # stage: utils/benchmark_gpu.py flags
    "bare_steps": ["--configs", "configs/llama_130m.json", "configs/llama_1b.json", "--modes", "compiled",
                   "--steps", "8", "--warmup", "3"],
    "micro_batch": ["--configs", "configs/llama_130m.json", "--modes", "compiled", "--batch_size", "128", "256",
                    "--steps", "8", "--warmup", "3"],
    "losses": ["--configs", "configs/llama_130m.json", "--modes", "compiled", "--batch_size", "256", "--losses",
               "chunked", "liger", "--steps", "8", "--warmup", "3"],
    "eager_1b": ["--configs", "configs/llama_1b.json", "--modes", "eager", "--steps", "6", "--warmup", "2"],
}


def stage_benchmark(check: Check, stage: str):
    rows_path, start = check.out / f"{stage}.json", time.perf_counter()
    proc = check.run(stage, [sys.executable, "utils/benchmark_gpu.py", "--dtypes", "bfloat16", *BENCHMARKS[stage],
                             "--json", str(rows_path)], limit_s=200)
    rows = json.loads(rows_path.read_text()) if rows_path.is_file() else []
    check.record(stage, ok=proc is not None and proc.returncode == 0 and all("error" not in r for r in rows),
                 seconds=time.perf_counter() - start, rows=rows)


def stage_fsdp_resume(check: Check, fixtures: Path):
    stage, run_dir, start = "fsdp_resume", check.out / "runs" / "fsdp", time.perf_counter()
    command = ["bash", "run_130m.sh", "pre", *data_flags(fixtures), "--fsdp", "--dtype", "mixed", "--resume", "auto",
               "--num_training_steps", "6", "--warmup_steps", "1", "--eval_every", "6", "--eval_tokens", "20K",
               "--save_dir", str(run_dir)]
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
    steps_continue = [row["step"] for row in rows] == list(range(1, 7)) and 2 <= stopped_at < 6
    ok = (stopped_code == 5 and resumed is not None and resumed.returncode == 0 and steps_continue
          and abs(losses[stopped_at] / losses[stopped_at - 1] - 1) < 0.1)
    check.record(stage, ok=ok, seconds=time.perf_counter() - start, stopped_exit=stopped_code,
                 stopped_after=len(stopped_rows), resumed_exit=None if resumed is None else resumed.returncode, losses=losses)
    shutil.rmtree(run_dir, ignore_errors=True)


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


def write_report(out: Path, stages: dict, command: str):
    env = stages.get("env", {})
    lines = [f"# GPU check: {env.get('device', '?')}, torch {env.get('torch', '?')} (CUDA {env.get('cuda', '?')}), "
             f"transformers {env.get('transformers', '?')}", "", f"`{command}`", "",
             "| stage | ran | details |", "|---|---|---|"]
    for name, stage in stages.items():
        details = ", ".join(f"{k} {v}" for k, v in stage.items() if k not in ("ok", "rows"))
        if "rows" in stage:
            details = "; ".join(f"{r.get('config')} {'compiled' if r.get('compiled') else 'eager'} "
                                f"b{r.get('batch', '?')} {r.get('loss', 'standard')}: "
                                f"{r.get('tokens_per_s', r.get('error'))} tok/s, MFU {r.get('mfu', '-')}, "
                                f"{r.get('peak_memory_gib', '-')} GiB" for r in stage["rows"])
        lines.append(f"| {name} | {'yes' if stage['ok'] else '**FAILED**'} | {details} |")
    lines += ["", "| target (issue 38) | measured | target | met |", "|---|---|---|---|"]
    for what, measured, target, met in verdicts(stages):
        lines.append(f"| {what} | {measured} | {target} | {'-' if met is None else 'yes' if met else 'no'} |")
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    (out / "gpu_check.json").write_text(json.dumps({"command": command, "stages": stages,
                                                    "targets": verdicts(stages)}, indent=2) + "\n")


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
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        parser.exit(2, "gpu_check.sh: error: no CUDA device is visible; this check runs the paper's recipes on a "
                       "GPU (bash run_tiny.sh runs on the CPU)\n")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    command = "bash utils/gpu_check.sh " + " ".join(argv if argv is not None else sys.argv[1:])
    check = Check(out, dict(os.environ, **OFFLINE, NPROC="1"), command)
    info = stage_env(check)
    peak = dense_bf16_peak_tflops(info["device"])
    fixtures = out / "fixtures"
    for kind in ("c4", "t5"):
        check.run("fixtures", [sys.executable, "utils/offline_fixtures.py", kind, str(fixtures / kind)], limit_s=120)
    for stage in STAGES:
        if stage not in args.stages:
            continue
        if stage == "recipes":
            stage_recipes(check, fixtures, peak, args.recipe_sizes, args.micro_batches)
        elif stage == "fsdp_resume":
            stage_fsdp_resume(check, fixtures)
        else:
            stage_benchmark(check, stage)
    shutil.rmtree(out / "runs", ignore_errors=True)
    print((out / "gpu_check.md").read_text(), flush=True)
    return 0 if all(stage["ok"] for stage in check.stages.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
