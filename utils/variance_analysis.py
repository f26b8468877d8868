"""Variance and RMS of the residual stream at every depth, for one or more models, in one figure.

    python utils/variance_analysis.py --model_paths checkpoints/pre_130m checkpoints/lns_130m --labels Pre-LN LNS

Depth 0 is the stream entering decoder layer 0 (the embeddings), depth l the stream leaving decoder layer l - 1,
captured with forward hooks (utils/instruments/model_io.py), before the final norm. For each depth, over all real
tokens and all hidden channels pooled: variance = E[h^2] - E[h]^2 and rms = sqrt(E[h^2]), accumulated in float64
batch by batch. This is the paper's "output variance per layer" (Pre-LN grows with depth, LayerNorm Scaling keeps it
flat).
"""
from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

import numpy as np

from peft_pretraining.cli import OneLineErrorParser
from utils.instruments import model_io
from utils.instruments.variance import residual_statistics


def save_results(results: list[dict], output_dir: Path, metadata: dict) -> list[Path]:
    output_dir.mkdir(parents=True, exist_ok=True)
    csv_path = output_dir / "residual_variance.csv"
    with csv_path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["label", "model_path", "depth", "variance", "rms"])
        for result in results:
            for depth, (variance, rms) in enumerate(zip(result["variance"], result["rms"])):
                writer.writerow([result["label"], result["model_path"], depth, f"{variance:.8g}", f"{rms:.8g}"])
    json_path = output_dir / "residual_variance.json"
    serialisable = [dict(result, variance=result["variance"].tolist(), rms=result["rms"].tolist())
                    for result in results]
    json_path.write_text(json.dumps(dict(metadata, models=serialisable), indent=1))
    return [csv_path, json_path, plot_results(results, output_dir / "residual_variance.png", metadata.get("text", ""))]


def plot_results(results: list[dict], path: Path, text_name: str) -> Path:
    """All models in one figure: variance (left) and RMS (right) against depth, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for result in results:
        depths = np.arange(len(result["variance"]))
        axes[0].plot(depths, result["variance"], marker="o", markersize=3, label=result["label"])
        axes[1].plot(depths, result["rms"], marker="o", markersize=3, label=result["label"])
    for ax, name in zip(axes, ("variance", "RMS norm")):
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set_xlabel("depth (0 = embeddings, l = after layer l)")
        ax.set_ylabel(f"residual-stream {name}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"Residual stream by depth on {Path(text_name).name}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=200)
    plt.close(fig)
    return path


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_paths", nargs="+", required=True, help="hub ids or local folders, one curve each")
    parser.add_argument("--labels", nargs="+", default=None, help="legend labels (default: folder names)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer for every model (default: each model's own)")
    parser.add_argument("--dtype", default="auto", choices=["auto", *model_io.DTYPES],
                        help="weights dtype; auto = bfloat16 on GPU, float32 on CPU (statistics are float64)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    model_io.add_text_arguments(parser, default_num_tokens=65536)
    model_io.add_threads_argument(parser)
    parser.add_argument("--output_dir", default="runs/analysis/variance", help="where the CSV, JSON and PNG go")
    return parser


def main(argv: list[str] | None = None) -> list[dict]:
    parser = build_parser()
    args = parser.parse_args(argv)
    model_io.check_positive(parser, args, "num_tokens", "batch_size")
    model_io.check_positive_or_none(parser, args, "max_seq_len")
    model_io.apply_threads(parser, args)
    labels = args.labels or [Path(path.rstrip("/")).name for path in args.model_paths]
    if len(labels) != len(args.model_paths):
        parser.error(f"--labels: got {len(labels)} labels for {len(args.model_paths)} models")
    device, dtype, source = model_io.resolve_run_settings(parser, args)
    for model_path in args.model_paths:  # every path, before the first model is analysed
        model_io.check_model_path(parser, model_path, "--model_paths")

    results = []
    for label, model_path in zip(labels, args.model_paths):
        model, tokenizer = model_io.load_model_and_tokenizer(model_path, dtype, device, args.tokenizer)
        max_seq_len = model_io.resolve_context_length(model, args.max_seq_len, fallback=model_io.HUB_STREAM_WINDOW)
        batches = model_io.token_batches(tokenizer, source, max_seq_len, args.num_tokens, args.batch_size)
        try:
            statistics, num_tokens = residual_statistics(model, batches, args.num_tokens, device, desc=label)
        except ValueError as err:  # an empty text
            parser.error(f"--text_file/--dataset: {err}")
        results.append(dict(label=label, model_path=model_path, num_tokens=num_tokens, max_seq_len=max_seq_len,
                            **statistics))
        del model
    source_name = "C4 en validation" if source[0] == "c4" else str(source[1])
    metadata = dict(text=source_name, dtype=str(dtype).replace("torch.", ""),
                    definition="per depth, over all real tokens and channels: variance = E[h^2]-E[h]^2, "
                               "rms = sqrt(E[h^2]); depth 0 = input of layer 0, depth l = output of layer l-1")
    for path in save_results(results, Path(args.output_dir), metadata):
        print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
