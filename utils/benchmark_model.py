"""Training-step throughput of our model against `transformers.LlamaForCausalLM` on the same config.

Both models live in one process and are timed in interleaved repeats (ours, HF, ours, HF, ...) so that drifts in
machine load hit both alike; the median over repeats is reported. One step is forward + backward + Adam step.

    python utils/benchmark_model.py                                   # tiny and 130M, fp32 and bf16
    python utils/benchmark_model.py --configs configs/llama_tiny_deep.json --dtypes bfloat16 --repeats 5
    python utils/benchmark_model.py --compile                         # also try torch.compile on ours

It prints tokens/s, achieved GFLOP/s (6 * params * tokens, plus attention) and that figure as a fraction of a large
square GEMM measured in the same run and dtype.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from transformers import LlamaConfig  # noqa: E402
from transformers import LlamaForCausalLM as HFLlamaForCausalLM  # noqa: E402

from peft_pretraining.modeling_llama import LlamaForCausalLM, build_config  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def gemm_gflops(dtype, size=2048, repeats=5):
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times) / 1e9


def train_step_flops(config, batch, seq_len):
    """6 N T for the matmuls (N without embeddings) plus causal attention scores and values."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    per_layer = 4 * hidden * hidden + 3 * hidden * config.intermediate_size
    matmul_params = layers * per_layer + hidden * config.vocab_size
    tokens = batch * seq_len
    attention = 6 * layers * seq_len * hidden * tokens  # 2 matmuls, causal halves them, x3 for fwd+bwd
    return 6 * matmul_params * tokens + attention


def make_step(model, optimizer, tokens):
    def step():
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def time_steps(step, steps):
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def benchmark(config_path, dtype, batch, seq_len, repeats, steps, compile_ours):
    config = build_config(config_path, norm_type="pre")
    torch.manual_seed(0)
    ours = LlamaForCausalLM(config).to(dtype).train()
    theirs = HFLlamaForCausalLM(LlamaConfig.from_json_file(str(config_path))).to(dtype).train()
    theirs.load_state_dict(ours.state_dict())
    runner = torch.compile(ours) if compile_ours else ours
    tokens = torch.randint(0, config.vocab_size, (batch, seq_len))
    steps_by_name = {
        "ours": make_step(runner, torch.optim.Adam(ours.parameters(), lr=1e-4, foreach=True), tokens),
        "hf": make_step(theirs, torch.optim.Adam(theirs.parameters(), lr=1e-4, foreach=True), tokens),
    }
    for step in steps_by_name.values():  # warm-up (and compilation)
        step()
    seconds = {name: [] for name in steps_by_name}
    for _ in range(repeats):
        for name, step in steps_by_name.items():
            seconds[name].append(time_steps(step, steps))
    flops = train_step_flops(config, batch, seq_len)
    peak = gemm_gflops(dtype)
    row = {"config": Path(config_path).name, "dtype": str(dtype).replace("torch.", ""), "batch": batch,
           "seq_len": seq_len, "compile": compile_ours, "gemm_gflops": round(peak, 1)}
    for name, values in seconds.items():
        median = statistics.median(values)
        row[f"{name}_tokens_per_s"] = round(batch * seq_len / median, 1)
        row[f"{name}_gflops"] = round(flops / median / 1e9, 1)
        row[f"{name}_gemm_fraction"] = round(flops / median / 1e9 / peak, 3)
    row["speedup_vs_hf"] = round(row["ours_tokens_per_s"] / row["hf_tokens_per_s"], 3)
    return row


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+",
                        default=[str(REPO / "configs/llama_tiny.json"), str(REPO / "configs/llama_130m.json")])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--batch_size", type=int, default=None, help="default: 16 for tiny configs, 2 otherwise")
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=None, help="steps per timed repeat; default 5 tiny, 1 otherwise")
    parser.add_argument("--compile", action="store_true", help="run ours through torch.compile")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    return parser


def main():
    parser = build_parser()
    args = parser.parse_args()
    for path in args.configs:
        if not Path(path).is_file():
            parser.error(f"--configs: no such file {path}")

    rows = []
    for path in args.configs:
        tiny = "tiny" in Path(path).name
        for dtype_name in args.dtypes:
            row = benchmark(path, getattr(torch, dtype_name), args.batch_size or (16 if tiny else 2), args.seq_len,
                            args.repeats, args.steps or (5 if tiny else 1), args.compile)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
