"""What a placement costs against Pre-LN at a study's shape: parameters, activation memory and step time.

    python utils/bench/benchmark_placements.py                       # pre, attnres, mhc at the rivals budget's shape
    python utils/bench/benchmark_placements.py --norm_types pre lns mhc --steps 10

Activation memory is what autograd keeps for the backward pass of one forward (the bytes of every tensor it saves,
counted once each through saved_tensors_hooks): exact and the same on any host. Step time is the median of
--steps forward + backward passes after one warm-up, in float32, eager, on this host's threads; on a loaded host it
is noisy, so the ratio to Pre-LN measured in the same process is the number to read.
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


def step_seconds(model, tokens, steps: int) -> float:
    times = []
    for step in range(steps + 1):  # the first is a warm-up
        start = time.perf_counter()
        model(tokens, labels=tokens).loss.backward()
        model.zero_grad(set_to_none=True)
        if step:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(norm_type: str, args) -> dict:
    torch.manual_seed(0)
    model = LlamaForCausalLM(build_config(REPO / args.model_config, norm_type=norm_type)).train()
    tokens = torch.randint(0, model.config.vocab_size, (args.batch_size, args.max_length),
                           generator=torch.Generator().manual_seed(1))
    return {"norm_type": norm_type, "parameters": sum(p.numel() for p in model.parameters()),
            "activation_bytes": saved_activation_bytes(model, tokens),
            "step_seconds": step_seconds(model, tokens, args.steps)}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [measure(norm_type, args) for norm_type in args.norm_types]
    base = next((row for row in rows if row["norm_type"] == "pre"), rows[0])
    print(f"| placement | parameters | activation memory | step time ({args.threads} thread(s), float32, eager) |")
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
