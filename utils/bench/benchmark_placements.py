"""What a placement costs against Pre-LN at a study's shape: parameters, activation memory and step time.

    python utils/bench/benchmark_placements.py                       # pre, attnres, mhc at the rivals budget's shape
    python utils/bench/benchmark_placements.py --norm_types pre lns mhc --steps 10
    python utils/bench/benchmark_placements.py --norm_types pre siamese --steps 12 --interleave  # on a loaded host

Activation memory is what autograd keeps for the backward pass of one forward (the bytes of every tensor it saves,
counted once each through saved_tensors_hooks): exact and the same on any host. Step time is the median of
--steps forward + backward passes after one warm-up, in float32, eager, on this host's threads; on a loaded host it
is noisy, so the ratio to Pre-LN measured in the same process is the number to read. With --interleave every
placement is built first and their steps alternate (the order reversed each round), so load from other processes
falls on all of them alike; each step time is then the median over the rounds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from peft_pretraining.cli import OneLineErrorParser
from peft_pretraining.model.modeling_llama import LlamaForCausalLM, build_config, norm_types

REPO = Path(__file__).resolve().parents[2]


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_config", default="configs/llama_tiny_deep.json",
                        help="the rivals budget's model (utils/compare_norms.py)")
    parser.add_argument("--norm_types", nargs="+", default=["pre", "attnres", "mhc"], choices=norm_types())
    parser.add_argument("--batch_size", type=int, default=16, help="the rivals budget's batch")
    parser.add_argument("--max_length", type=int, default=128, help="the rivals budget's window")
    parser.add_argument("--steps", type=int, default=5, help="timed forward + backward passes per placement")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the studies run one per run)")
    parser.add_argument("--interleave", action="store_true",
                        help="time the placements' steps in turn rather than one placement after another")
    return parser


def saved_activation_bytes(model, tokens) -> int:
    """Bytes of the tensors autograd saves for backward in one forward (each storage counted once)."""
    seen, total = set(), 0

    def pack(tensor):
        nonlocal total
        key = (tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += key[1]
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(tokens, labels=tokens).loss
    del loss
    return total


def one_step(model, tokens) -> float:
    start = time.perf_counter()
    model(tokens, labels=tokens).loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def step_seconds(model, tokens, steps: int) -> float:
    times = [one_step(model, tokens) for _ in range(steps + 1)]
    return statistics.median(times[1:])  # the first is a warm-up


def interleaved_step_seconds(models: list, tokens, steps: int) -> list[float]:
    """The median step time of each model, their steps taken in turn, the order reversed every round."""
    times = [[] for _ in models]
    for step in range(steps + 1):  # the first round is a warm-up
        order = list(enumerate(models)) if step % 2 else list(enumerate(models))[::-1]
        for index, model in order:
            seconds = one_step(model, tokens)
            if step:
                times[index].append(seconds)
    return [statistics.median(each) for each in times]


def build(norm_type: str, args):
    torch.manual_seed(0)
    return LlamaForCausalLM(build_config(REPO / args.model_config, norm_type=norm_type)).train()


def measure(model, tokens) -> dict:
    return {"norm_type": model.config.norm_type, "parameters": sum(p.numel() for p in model.parameters()),
            "activation_bytes": saved_activation_bytes(model, tokens)}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    vocab_size = build_config(REPO / args.model_config).vocab_size
    tokens = torch.randint(0, vocab_size, (args.batch_size, args.max_length),
                           generator=torch.Generator().manual_seed(1))
    if args.interleave:
        models = [build(norm_type, args) for norm_type in args.norm_types]
        rows = [measure(model, tokens) for model in models]
        for row, seconds in zip(rows, interleaved_step_seconds(models, tokens, args.steps)):
            row["step_seconds"] = seconds
    else:  # one model alive at a time
        rows = []
        for norm_type in args.norm_types:
            model = build(norm_type, args)
            rows.append({**measure(model, tokens), "step_seconds": step_seconds(model, tokens, args.steps)})
    base = next((row for row in rows if row["norm_type"] == "pre"), rows[0])
    timing = f"{args.threads} thread(s), float32, eager{', interleaved' if args.interleave else ''}"
    print(f"| placement | parameters | activation memory | step time ({timing}) |")
    print("|---|---|---|---|")
    for row in rows:
        ratio = {key: row[key] / base[key] for key in ("parameters", "activation_bytes", "step_seconds")}
        print(f"| {row['norm_type']} | {row['parameters'] / 1e6:.3f} M ({ratio['parameters']:.3f}x) | "
              f"{row['activation_bytes'] / 2**20:.0f} MiB ({ratio['activation_bytes']:.2f}x) | "
              f"{row['step_seconds']:.2f} s ({ratio['step_seconds']:.2f}x) |")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
