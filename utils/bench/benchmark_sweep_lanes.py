"""What a CPU sweep run costs: the Wikipedia sweep's trainer, float32, eager against compiled, two lanes of one
thread against one lane of two, at the shapes the compute-multiplier runs train (issue 79).

    python utils/bench/benchmark_sweep_lanes.py                         # hidden 64 and 128 at L = 24
    python utils/bench/benchmark_sweep_lanes.py --hidden 64 --steps 40  # one width, shorter
    python utils/bench/benchmark_sweep_lanes.py --quick                 # seconds: checks that it runs

Each variant trains the sweep's own flags (the Wikipedia corpus, 16 x 128 tokens an update, Adam, float32) for
--steps updates; the figure is the machine's total tokens/s, the median over updates after --warmup (which covers
compilation). "2 x 1" runs two seeds side by side with one thread each, as the sweeps do; "1 x 2" runs one with two
threads. Writes <out>/lanes.csv and lanes.json (default out: runs/benchmark_sweep_lanes); the figures are for the host
named in the JSON, measured on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from peft_pretraining.cli import OneLineErrorParser
from peft_pretraining.training.metrics_file import read_metrics
from utils.study.host import machine_description

REPO = Path(__file__).resolve().parents[2]
BASE_CONFIG = REPO / "configs" / "llama_tiny.json"
HEAD_DIM = 16  # the width sweep's: heads grow with the width


def config_for(hidden: int, layers: int, vocab: int, out: Path) -> Path:
    base = json.loads(BASE_CONFIG.read_text())
    heads = hidden // HEAD_DIM
    config = dict(base, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=heads,
                  intermediate_size=hidden * base["intermediate_size"] // base["hidden_size"],
                  num_hidden_layers=layers, vocab_size=vocab)
    path = out / f"llama_h{hidden}_L{layers}.json"
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path


def trainer_command(config: Path, seed: int, steps: int, compiled: bool, save_dir: Path, dataset: str) -> list[str]:
    return [sys.executable, str(REPO / "torchrun_main.py"), "--model_config", str(config), "--dataset", dataset,
            "--tokenizer", dataset, "--packing", "--max_length", "128", "--batch_size", "16",
            "--total_batch_size", "16",
            "--lr", "2e-3", "--warmup_steps", str(max(1, steps // 10)), "--num_training_steps", str(steps),
            "--eval_every", str(10 * steps), "--eval_tokens", "128", "--grad_clipping", "1.0", "--weight_decay", "0",
            "--optimizer", "adam", "--workers", "0", "--device", "cpu", "--dtype", "float32", "--norm_type", "pre",
            "--seed", str(seed), "--save_dir", str(save_dir), "--save_every", str(10 * steps),
            *(["--compile"] if compiled else [])]


def median_tokens_per_s(save_dir: Path, warmup: int) -> float:
    rows = [row for row in read_metrics(str(save_dir / "metrics.jsonl")) if "tokens_per_s" in row]
    return statistics.median(row["tokens_per_s"] for row in rows[warmup:])


def measure(config: Path, lanes: int, threads: int, compiled: bool, args, out: Path) -> float:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), WANDB_MODE="disabled", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    name = f"{config.stem}_{'compiled' if compiled else 'eager'}_{lanes}x{threads}"
    dirs = [out / name / f"seed{seed}" for seed in range(1, lanes + 1)]
    procs = []
    for seed, save_dir in enumerate(dirs, start=1):
        log = out / f"{name}_seed{seed}.log"
        with open(log, "w") as handle:  # the child keeps its own copy of the descriptor
            procs.append((subprocess.Popen(trainer_command(config, seed, args.steps, compiled, save_dir, args.dataset),
                                           env=env, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO), log))
    for proc, log in procs:
        if proc.wait() != 0:
            sys.exit(f"benchmark_sweep_lanes: {name} failed ({proc.returncode}); see {log}")
    return sum(median_tokens_per_s(save_dir, args.warmup) for save_dir in dirs)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", nargs="+", type=int, default=[64, 128])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--vocab", type=int, default=4096, help="the Wikipedia tokenizer's vocabulary")
    parser.add_argument("--dataset", default="wikipedia", help="wikipedia, or embedded (no corpus needed)")
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    parser.add_argument("--layouts", nargs="+", default=["2x1", "1x2"], choices=["2x1", "1x2"],
                        help="lanes x threads each")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=15, help="updates left out of the median (compilation)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "benchmark_sweep_lanes")
    parser.add_argument("--quick", action="store_true", help="hidden 16, L = 2, 6 updates, the embedded corpus")
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.steps, args.warmup, args.dataset, args.vocab = [16], 2, 6, 2, "embedded", 8192
    if args.warmup >= args.steps:
        parser.error(f"--warmup {args.warmup} leaves no update of --steps {args.steps} to time")
    if any(h % HEAD_DIM for h in args.hidden):
        parser.error(f"--hidden: every width must be a multiple of the head dim {HEAD_DIM}, got {args.hidden}")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for hidden in args.hidden:
        config = config_for(hidden, args.layers, args.vocab, args.out)
        for compiled in (mode == "compiled" for mode in args.modes):
            for lanes, threads in (map(int, layout.split("x")) for layout in args.layouts):
                tokens_per_s = measure(config, lanes, threads, compiled, args, args.out)
                rows.append(dict(hidden=hidden, layers=args.layers, mode="compiled" if compiled else "eager",
                                 layout=f"{lanes} x {threads}", total_tokens_per_s=round(tokens_per_s, 1)))
                print(rows[-1], flush=True)
    with open(args.out / "lanes.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (args.out / "lanes.json").write_text(json.dumps(dict(host=machine_description(), steps=args.steps,
                                                         warmup=args.warmup, rows=rows), indent=2) + "\n")


if __name__ == "__main__":
    main()
