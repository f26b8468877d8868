"""Probe (not part of the package): bf16 GEMM throughput on this CPU for every matrix product of a training step at
the study shape (2,048 tokens, hidden 128, MLP 352, vocabulary 8,192): forward, input gradient and weight gradient,
each with the operand layouts the step can take. Median of 30 calls.

    python docs/benchmarks/faststep/probe_gemm_shapes.py [threads]
"""
import statistics
import sys
import time

import torch

TOKENS = 2048


def bench(name, a, b, calls=30):
    for _ in range(3):
        torch.mm(a, b)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
    print(f"{name:40s} {tuple(a.shape)}x{tuple(b.shape)}: {median * 1e3:7.3f} ms {flops / median / 1e9:7.1f} GFLOP/s")


def main():
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    bf16 = torch.bfloat16
    for inputs, outputs in [(128, 128), (128, 352), (352, 128), (128, 8192)]:
        x, weight = torch.randn(TOKENS, inputs, dtype=bf16), torch.randn(outputs, inputs, dtype=bf16)
        grad = torch.randn(TOKENS, outputs, dtype=bf16)
        bench(f"forward x @ W.T {inputs}->{outputs}", x, weight.t())
        bench(f"forward, W.T contiguous {inputs}->{outputs}", x, weight.t().contiguous())
        bench(f"input grad dy @ W {inputs}->{outputs}", grad, weight)
        bench(f"weight grad dy.T @ x {inputs}->{outputs}", grad.t(), x)
        bench(f"weight grad, dy.T contiguous {inputs}->{outputs}", grad.t().contiguous(), x)


if __name__ == "__main__":
    main()
