"""The trainer's update step on one CUDA GPU: tokens/s, MFU and peak memory (CPU figures:
utils/bench/benchmark_model.py).

    python utils/bench/benchmark_gpu.py        # 130M and 1B, paper micro-batch, eager + compiled, pure bf16 and mixed
    python utils/bench/benchmark_gpu.py --configs configs/llama_1b.json --batch_size 16 --modes eager --dtypes mixed
    python utils/bench/benchmark_gpu.py --peak_tflops 400                # a GPU missing from the table below
    python utils/bench/benchmark_gpu.py --configs configs/llama_130m.json --losses standard chunked liger \
        --batch_size 64 128
    python utils/bench/benchmark_gpu.py --device cpu --configs configs/llama_tiny.json --batch_size 2   # a rehearsal

--losses compares the trainer's --loss ways of computing the lm_head and its loss
(peft_pretraining/model/head_losses.py: standard, chunked, liger; the same function). With more than one, every row
also carries the loss of its first step (`first_loss`) and that of the same model and tokens in fp32 (`fp32_loss`), so
that the fastest loss within head_losses.LOSS_TOLERANCE of fp32 can be adopted. Several --batch_size values measure a
larger micro-batch (the trainer keeps the total batch through accumulation).

--device cpu runs the same code on the CPU, for utils/gpu/gpu_check.py's rehearsal only: its times and memory mean
nothing, and it has no MFU.

One step is what torchrun_main.py does per update at accumulation 1: forward (under bf16 autocast for mixed),
backward, global grad norm, fused Adam step. The model is the trainer's (Pre-LN; --norm_type picks another).

MFU = model FLOPs per second / the GPU's dense bf16 peak, with model FLOPs per token = 6 * N + 12 * L * H * T
(N: parameters of every matmul, lm_head included, embedding excluded; L layers, H hidden size, T sequence length:
the PaLM convention, attention not halved for causality). The peak is looked up by device name and printed.
"""
import argparse
import itertools
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from peft_pretraining.cli import OneLineErrorParser
from peft_pretraining.model.head_losses import HEAD_LOSSES, liger_import_error
from peft_pretraining.model.modeling_llama import NORM_TYPES, LlamaForCausalLM, build_config
from peft_pretraining.training import optimization
from utils.instruments.model_arithmetic import PAPER_MICRO_BATCH, dense_bf16_peak_tflops, model_flops_per_token

REPO = Path(__file__).resolve().parents[2]
def random_tokens(config, batch: int, seq_len: int, device) -> torch.Tensor:
    """The same tokens for every row of a config and micro-batch, whatever loss or precision the row measures."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, config.vocab_size, (batch, seq_len), generator=generator).to(device)


def fp32_loss(config_path, *, batch: int, seq_len: int, norm_type: str, device) -> float:
    """The loss of the measured model at its initialisation, in fp32 with full logits: what --losses are held to."""
    config = build_config(config_path, norm_type=norm_type)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device)
    tokens = random_tokens(config, batch, seq_len, device)
    with torch.no_grad():
        return model(input_ids=tokens, labels=tokens).loss.item()


def measure(config_path, *, dtype: str, compiled: bool, batch: int, seq_len: int, steps: int, warmup: int,
            norm_type: str, activation_checkpointing: bool, loss: str = "standard", device_type: str = "cuda") -> dict:
    device = torch.device(device_type)
    config = build_config(config_path, norm_type=norm_type)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    model = model.to(device).train()
    if activation_checkpointing:
        model.activation_checkpointing_enable()
    def loss_of(tokens):  # the trainer's forward and --loss
        return model(input_ids=tokens, labels=tokens, head_loss=loss).loss

    runner = torch.compile(loss_of) if compiled else loss_of
    optimizer = optimization.build_optimizer(model.parameters(), "adam", 1e-4, 0.0)
    tokens = random_tokens(config, batch, seq_len, device)
    on_cuda = device.type == "cuda"
    synchronize = torch.cuda.synchronize if on_cuda else lambda: None

    def step() -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "mixed"):
            step_loss = runner(tokens)
        step_loss.backward()
        optimization.grad_norm_and_clip(model.parameters(), 0.0)  # the trainer logs it every update
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return step_loss.detach()

    first_loss = step().item()  # at the initial weights, as fp32_loss; also the first warm-up step
    for _ in range(warmup - 1):  # compilation, cuBLAS heuristics, allocator growth
        step()
    synchronize()
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        synchronize()
        seconds.append(time.perf_counter() - start)
    median = statistics.median(seconds)
    tokens_per_s = batch * seq_len / median
    return {"config": Path(config_path).name, "dtype": dtype, "compiled": compiled, "batch": batch, "loss": loss,
            "seq_len": seq_len, "activation_checkpointing": activation_checkpointing,
            "step_ms_median": round(median * 1e3, 2), "step_ms_min": round(min(seconds) * 1e3, 2),
            "step_ms_max": round(max(seconds) * 1e3, 2), "tokens_per_s": round(tokens_per_s),
            "model_tflops_per_s": round(tokens_per_s * model_flops_per_token(config, seq_len) / 1e12, 1),
            "first_loss": round(first_loss, 5),
            "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if on_cuda else None}


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+",
                        default=[str(REPO / "configs/llama_130m.json"), str(REPO / "configs/llama_1b.json")])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "mixed"], choices=["bfloat16", "mixed"])
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    parser.add_argument("--batch_size", type=int, nargs="+", default=None,
                        help="micro-batches to measure (default: the paper's micro-batch per config)")
    parser.add_argument("--losses", nargs="+", default=["standard"], choices=HEAD_LOSSES)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (the first gives first_loss)")
    parser.add_argument("--norm_type", default="pre", choices=NORM_TYPES)
    parser.add_argument("--activation_checkpointing", action="store_true")
    parser.add_argument("--peak_tflops", type=float, default=None,
                        help="the GPU's dense bf16 peak, for a GPU missing from the built-in table")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: the same code on the CPU, for utils/gpu/gpu_check.sh --rehearse (no MFU, no memory)")
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)

    def fail(message: str):
        parser.exit(2, f"benchmark_gpu.py: error: {message}\n")

    for flag, value, least in (("steps", args.steps, 1), ("warmup", args.warmup, 1), ("seq_len", args.seq_len, 1),
                               ("batch_size", min(args.batch_size or [1]), 1)):
        if value is not None and value < least:
            parser.error(f"--{flag} must be at least {least}, got {value}")
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        parser.error(f"--peak_tflops must be positive, got {args.peak_tflops}")
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("no CUDA device is visible; this benchmark measures the GPU step "
             "(utils/bench/benchmark_model.py runs on CPU)")
    if "liger" in args.losses and (args.device == "cpu" or liger_import_error()):
        fail("--losses liger: " + (liger_import_error() or "liger-kernel runs on CUDA only, not with --device cpu"))
    for path in args.configs:
        if not Path(path).is_file():
            fail(f"--configs: no such file {path}")
        if args.batch_size is None and Path(path).name not in PAPER_MICRO_BATCH:
            fail(f"--configs {path}: no paper micro-batch known for it, pass --batch_size")
    if args.device == "cpu":
        device_name, peak = f"CPU ({platform.processor() or platform.machine()})", args.peak_tflops
        print(f"device: {device_name}; a rehearsal of the GPU benchmark: its times mean nothing", flush=True)
    else:
        device_name = torch.cuda.get_device_name()
        peak = args.peak_tflops or dense_bf16_peak_tflops(device_name)
        if peak is None:
            fail(f"no dense bf16 peak known for {device_name!r}; pass --peak_tflops")
        print(f"device: {device_name}; MFU against a dense bf16 peak of {peak:g} TFLOP/s"
              f"{' (--peak_tflops)' if args.peak_tflops else ''}", flush=True)

    rows = []
    for path in args.configs:
        for batch in args.batch_size or [PAPER_MICRO_BATCH[Path(path).name]]:
            reference = (fp32_loss(path, batch=batch, seq_len=args.seq_len, norm_type=args.norm_type,
                                   device=torch.device(args.device)) if len(args.losses) > 1 else None)
            for dtype, mode, loss in itertools.product(args.dtypes, args.modes, args.losses):
                try:
                    row = measure(path, dtype=dtype, compiled=mode == "compiled", batch=batch, seq_len=args.seq_len,
                                  steps=args.steps, warmup=args.warmup, norm_type=args.norm_type,
                                  activation_checkpointing=args.activation_checkpointing, loss=loss,
                                  device_type=args.device)
                    row["mfu"] = round(row["model_tflops_per_s"] / peak, 3) if peak else None
                    if reference is not None:
                        row["fp32_loss"] = round(reference, 5)
                except Exception as err:  # out of memory, or a loss that fails on this GPU: the other rows go on
                    error = "out of memory" if isinstance(err, torch.OutOfMemoryError) else \
                        f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
                    row = {"config": Path(path).name, "dtype": dtype, "compiled": mode == "compiled",
                           "batch": batch, "loss": loss, "error": error}
                if args.device == "cuda":
                    torch.cuda.empty_cache()
                row.update(device=device_name, peak_tflops=peak)
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.json:  # after every row: a call cut at its limit keeps the rows measured
                    Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
