"""Time the angular analysis on a SmolLM-135M-shaped model (30 layers) with random weights, built locally.

    python utils/bench/benchmark_angular.py                         # 64K tokens of the embedded held-out novel
    python utils/bench/benchmark_angular.py --dtypes bfloat16 --threads 1     # as in docs/benchmarks.md

Prints, per dtype, the wall time and this process's CPU time of the whole analysis (tokenise, forward with hooks,
angular sums) and tokens per second. On a shared machine the wall time includes waiting for the cores; CPU time / 2
is the estimate for 2 dedicated cores. Nothing is downloaded: the architecture is written out below and the
text is tokenised with the repository's tokenizer (its ids fit the 49152-entry embedding).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from peft_pretraining.cli import OneLineErrorParser
from utils.instruments import model_io
from utils.instruments.angular import compute_angular_distances

SMOLLM_135M_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                         num_hidden_layers=30, vocab_size=49152, max_position_embeddings=2048,
                         tie_word_embeddings=True, rms_norm_eps=1e-5, pad_token_id=0)


def benchmark(dtype_name: str, args, tokenizer, device) -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM_135M_SHAPE)).to(device=device, dtype=model_io.DTYPES[dtype_name])
    model.eval()
    num_parameters = sum(parameter.numel() for parameter in model.parameters())
    source = ("file", Path(args.text_file))
    batches = model_io.token_batches(tokenizer, source, args.max_seq_len, args.num_tokens, args.batch_size)
    wall_start, cpu_start = time.perf_counter(), time.process_time()
    matrix, analysed = compute_angular_distances(model, batches, total_tokens=args.num_tokens, device=device)
    wall_s, cpu_s = time.perf_counter() - wall_start, time.process_time() - cpu_start
    print(f"{dtype_name}: SmolLM-135M shape ({num_parameters / 1e6:.1f}M parameters, 30 layers) on {device}, "
          f"{torch.get_num_threads()} threads, batches of {args.batch_size} x {args.max_seq_len}\n"
          f"  angular analysis of {analysed} tokens (tokenise + forward with hooks + maths): {wall_s:.1f} s wall, "
          f"{cpu_s:.1f} s CPU time of this process, {analysed / wall_s:.0f} tokens/s; "
          f"mean d(l, n=1) = {np.nanmean(matrix[0]):.3f}", flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num_tokens", type=int, default=65536)
    parser.add_argument("--max_seq_len", type=int, default=256)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated; each is timed separately")
    parser.add_argument("--device", default="auto")
    model_io.add_threads_argument(parser)
    parser.add_argument("--text_file", default=str(model_io.EMBEDDED_HELDOUT_TEXT))
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    model_io.check_positive(parser, args, "num_tokens", "max_seq_len", "batch_size")
    dtype_names = [name.strip() for name in args.dtypes.split(",") if name.strip()]
    unknown = [name for name in dtype_names if name not in model_io.DTYPES]
    if unknown or not dtype_names:
        parser.error(f"--dtypes: {args.dtypes!r}; choose from {', '.join(model_io.DTYPES)}")
    model_io.apply_threads(parser, args)
    device = model_io.resolve_device(args.device)
    tokenizer = AutoTokenizer.from_pretrained(str(model_io.REPO_TOKENIZER))
    for dtype_name in dtype_names:
        benchmark(dtype_name, args, tokenizer, device)


if __name__ == "__main__":
    main()
