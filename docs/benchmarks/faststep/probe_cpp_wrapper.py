"""Probe (not part of the package): does inductor's C++ wrapper (`cpp_wrapper=True`, kernels called from C++
instead of Python) speed up the compiled mixed step? Study shape (llama_tiny_deep, 16 x 128), bf16 autocast over
fp32 weights, 2 threads, interleaved repeats of 3 steps in one process; the step is utils/bench/benchmark_model.py's.

    python docs/benchmarks/faststep/probe_cpp_wrapper.py base,cppwrap 5
"""
import statistics
import sys
import time
from pathlib import Path

import torch
import torch._inductor.config as inductor_config

from peft_pretraining.training.optimization import build_optimizer
from utils.bench.benchmark_model import autocast_for, build_models, make_step

REPO = Path(__file__).resolve().parents[3]


def main():
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["base", "cppwrap"]
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    torch.set_num_threads(2)
    steps = {}
    for name in names:
        model = build_models(REPO / "configs/llama_tiny_deep.json", ["ours"], None)["ours"]
        tokens = torch.randint(0, model.config.vocab_size, (16, 128), generator=torch.Generator().manual_seed(0))
        inner = make_step(torch.compile(model, dynamic=False), build_optimizer(model.parameters(), "adam", 1e-4, 0.0),
                          tokens, autocast_for("mixed"))

        def step(inner=inner, patch={"cpp_wrapper": name == "cppwrap"}):
            with inductor_config.patch(patch):  # compiled under it on the first call
                inner()

        step()
        step()
        steps[name] = step
    # Interleaved: repeat r of every variant runs before repeat r + 1 of any.
    rounds = [{name: tokens_per_s(step) for name, step in steps.items()} for _ in range(repeats)]
    for name in steps:
        values = [measured[name] for measured in rounds]
        print(name, round(statistics.median(values), 1), [round(v) for v in values])


def tokens_per_s(step, calls: int = 3) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        step()
    return calls * 16 * 128 / (time.perf_counter() - start)


if __name__ == "__main__":
    main()
