"""Block Jacobians: how far each decoder block is from the identity map (the paper's mechanism for the curse of depth).

    python utils/jacobian_analysis.py --model_path checkpoints/pre_130m --dataset embedded --num_tokens 256
    python utils/jacobian_analysis.py --model_paths runs/pre runs/lns --labels Pre-LN LNS --num_tokens 128
    python utils/jacobian_analysis.py --model_path Qwen/Qwen3-8B --max_seq_len 256 --probes 16     # large d

For block l and token position t, J_l(t) = d x_{l+1}[t] / d x_l[t] is the d x d Jacobian of the residual stream
leaving the block with respect to the stream entering it, at the same position, with every other position held
fixed. Per layer the tool reports, over sampled real tokens t:

- rel_identity_dev = sqrt(mean_t ||J(t) - I||_F^2) / sqrt(d): the root-mean-square over tokens of
  ||J - I||_F / ||I||_F (0 for an identity block; ||A||_F / sqrt(d) for a block computing x + A x);
- mean_diag = mean_t trace(J(t)) / d;
- mean_abs_offdiag = mean_t of the mean |J_ij(t)| over i != j (exact method only; empty with probes).

How: a forward pre-hook on every decoder layer captures the layer's actual call (for our models
``layer(x, rope, mask)``, for HF Llama/Qwen/Mistral ``layer(hidden_states, attention_mask=...,
position_embeddings=...)``) and calls the layer again, in float32, with x as a leaf of autograd. A row c^T J(t) is
the gradient of <y[t], c> with respect to x[t]; the other positions of x are inputs too, but their gradients are not
read, which is what "held fixed" means. The window is cut after the token (the blocks are causal), and all the
vectors c of a token share one forward pass of the block and run as batched backward passes (is_grads_batched).

- exact (default when d <= 512, or --probes 0): c runs over the d basis vectors, so the rows are J itself.
- probes (default when d > 512, or --probes K): K Gaussian vectors v per token and layer. ||(J - I)^T v||^2 is an
  unbiased estimate of ||J - I||_F^2 and v^T J v of trace(J) (Hutchinson); the standard errors over the probes are
  in the JSON. mean_abs_offdiag has no such estimate and is left empty.

Tokens: windows of --max_seq_len tokens are read from the text (default length: the context the checkpoint was
trained at), and --tokens_per_window positions are sampled uniformly from each window until --num_tokens tokens are
taken; when the text runs out first, more positions of the windows already read are added, so a text shorter than
one window has every real token used.

Outputs in --output_dir: jacobian.csv (layer,rel_identity_dev,mean_diag,mean_abs_offdiag; one row per 0-based
layer), jacobian_heatmap.png (J - I of the first and the last layer), jacobian.json (values, standard errors and
metadata of every model) and jacobian.png (rel_identity_dev against depth, every model in one figure). With several
models the per-model CSV and heatmap go to --output_dir/<label>/.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

from peft_pretraining.cli import OneLineErrorParser
from utils.instruments import model_io
from utils.instruments.jacobian import (
    DEFAULT_PROBES,
    EXACT_MAX_HIDDEN,
    NO_BLOCK_JACOBIAN,
    measure_jacobians,
    sample_tokens,
    stream_is_a_running_sum,
)

CSV_COLUMNS = ("layer", "rel_identity_dev", "mean_diag", "mean_abs_offdiag")
DEFAULT_MODEL = "Qwen/Qwen3-8B"
DEFAULT_NUM_TOKENS = 128  # tokens whose Jacobians are averaged, on a GPU
# On a CPU: exact Jacobians of the 24-layer tiny model (d = 128) cost 0.5 s per token on an idle 2-core machine and
# 2.5 s beside other work, so 128 tokens took 1 to 5 minutes; 32 take a quarter of that.
CPU_NUM_TOKENS = 32
DEPTH_LOG_RATIO = 20  # jacobian.png turns logarithmic when the largest value exceeds 20x the median


# ----------------------------------------------------------------------------- outputs
def _format(value) -> str:
    return "" if value is None else f"{value:.8g}"


def write_csv(rows: list[dict], path: Path) -> Path:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(CSV_COLUMNS)
        for row in rows:
            writer.writerow([row["layer"]] + [_format(row[column]) for column in CSV_COLUMNS[1:]])
    return path


def plot_depth(results: list[dict], path: Path, title: str) -> Path:
    """rel_identity_dev against layer index, one line per model (error bars: +-1 standard error with probes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(6.5, 4))
    every_value = []
    for result in results:
        layers = [row["layer"] for row in result["layers"]]
        values = [row["rel_identity_dev"] for row in result["layers"]]
        errors = [row.get("rel_identity_dev_se") for row in result["layers"]]
        every_value += values
        ax.errorbar(layers, values, yerr=errors if None not in errors else None, marker="o", markersize=3,
                    capsize=2, label=f"{result['label']} ({result['method']})")
    scale = depth_axis_scale(every_value)
    if scale is None:
        ax.set_ylim(bottom=0)
    elif scale[0] == "log":
        ax.set_yscale("log", nonpositive="clip")
    else:
        ax.set_yscale("symlog", linthresh=scale[1])
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel(r"layer $\ell$ (0-based)")
    ax.set_ylabel(r"$\|J_\ell - I\|_F / \sqrt{d}$ (RMS over tokens)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=200)
    plt.close(fig)
    return path


def depth_axis_scale(values: Sequence[float]) -> tuple[str, float] | None:
    """The y scale of the depth plot: None (linear, from 0) unless the largest value is more than
    DEPTH_LOG_RATIO times the median of the positive ones, as layer 0 often is (25 against at most 0.14 on a tiny
    LNS model, where a linear axis shows layers 1..L-1 as zero). Then ("log", 0) when every value is positive, else
    ("symlog", smallest positive value), so that an exact identity block (0) stays on the axis."""
    finite = [value for value in values if value is not None and math.isfinite(value)]
    positive = sorted(value for value in finite if value > 0)
    if not positive or positive[-1] <= DEPTH_LOG_RATIO * positive[len(positive) // 2]:
        return None
    return ("log", 0.0) if len(positive) == len(finite) else ("symlog", positive[0])


def plot_heatmaps(heatmaps: dict[int, np.ndarray], path: Path, title: str) -> Path:
    """J - I of the first and the last layer side by side, each on its own symmetric colour scale (layer 0 often
    deviates a hundred times more than the last layer, whose panel would be blank on a shared scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = sorted(heatmaps)
    deviations = {layer: heatmaps[layer] - np.eye(*heatmaps[layer].shape) for layer in layers}
    fig, axes = plt.subplots(1, len(layers), figsize=(5.6 * len(layers), 4.4), squeeze=False, layout="constrained")
    for ax, layer in zip(axes[0], layers):
        limit = heatmap_limit(deviations[layer])
        image = ax.imshow(deviations[layer], cmap="RdBu_r", vmin=-limit, vmax=limit, interpolation="nearest")
        ax.set_title(f"layer {layer}: J - I", fontsize=10)
        ax.set_xlabel("input channel j")
        ax.set_ylabel("output channel i")
        fig.colorbar(image, ax=ax, label="J_ij - delta_ij (clipped at 99th pct)")
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=150, bbox_inches="tight")
    plt.close(fig)
    return path


def heatmap_limit(deviation: np.ndarray) -> float:
    """The colour limit of one heatmap panel: the 99th percentile of |J - I| (1.0 for an exact identity)."""
    return float(np.quantile(np.abs(deviation), 0.99)) or 1.0


# ----------------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_io.add_model_arguments(parser)
    parser.add_argument("--model_paths", nargs="+", default=None,
                        help="several hub ids or local folders, one curve each in jacobian.png "
                             "(instead of --model_path)")
    parser.add_argument("--labels", nargs="+", default=None,
                        help="legend labels for --model_paths (default: folder names)")
    model_io.add_text_arguments(parser, default_num_tokens=DEFAULT_NUM_TOKENS, cpu_num_tokens=CPU_NUM_TOKENS)
    model_io.add_threads_argument(parser)
    parser.add_argument("--tokens_per_window", type=int, default=8, help="token positions sampled per text window")
    parser.add_argument("--probes", type=int, default=None,
                        help=f"0: exact Jacobians; K >= 2: K random probes per token (unbiased estimate with standard "
                             f"error); default: exact when the hidden size is at most {EXACT_MAX_HIDDEN}, else "
                             f"{DEFAULT_PROBES} probes")
    parser.add_argument("--seed", type=int, default=0, help="seed of the token sampling and the probes")
    parser.add_argument("--output_dir", default="runs/analysis/jacobian", help="where the CSV, JSON and PNGs go")
    parser.set_defaults(model_path=None, max_seq_len=None, batch_size=None)
    for action in parser._actions:  # the shared flags' help, with this tool's meaning
        if action.dest == "max_seq_len":
            action.help = ("tokens per window (default: the context length the checkpoint was trained at; "
                           f"{model_io.HUB_STREAM_WINDOW}, or its max_position_embeddings if smaller, for a hub model "
                           "that records none)")
        elif action.dest == "batch_size":
            action.help = ("Jacobian rows or probes per batched backward pass; lower it if memory runs out "
                           "(default: as many as keep one batched gradient under 2^25 floats)")
        elif action.dest == "model_path":
            action.help = f"hub id or local folder (default: {DEFAULT_MODEL})"
    return parser


def parse_and_check(argv: list[str] | None):
    """Parse the flags; every bad value is a one-line error (exit 2) before any model is loaded."""
    parser = build_parser()
    args = parser.parse_args(argv)
    model_io.check_positive(parser, args, "tokens_per_window")
    for name in ("max_seq_len", "batch_size", "num_tokens"):  # optional: None means automatic
        if getattr(args, name) is not None:
            model_io.check_positive(parser, args, name)
    if args.probes is not None and (args.probes < 0 or args.probes == 1):
        parser.error(f"--probes: must be 0 (exact) or at least 2 (a standard error needs 2), got {args.probes}")
    if args.model_paths and args.model_path:
        parser.error("--model_paths: give either --model_path or --model_paths, not both")
    paths = args.model_paths or [args.model_path or DEFAULT_MODEL]
    if args.labels and not args.model_paths:
        parser.error("--labels: only with --model_paths")
    labels = args.labels or [_default_label(path) for path in paths]
    if len(labels) != len(paths):
        parser.error(f"--labels: got {len(labels)} labels for {len(paths)} models")
    if len(set(labels)) != len(labels) or any("/" in label or label in ("", ".", "..") for label in labels):
        parser.error(f"--labels: labels name output folders, so they must be distinct and contain no '/': {labels}")
    model_io.apply_threads(parser, args)
    device, dtype, source = model_io.resolve_run_settings(parser, args)
    for path in paths:  # every path, before the first model is analysed
        model_io.check_model_path(parser, path, "--model_paths" if args.model_paths else "--model_path")
    model_io.resolve_num_tokens(args, device, "jacobian")
    return parser, args, list(zip(labels, paths)), device, dtype, source


def _default_label(path: str) -> str:
    """The folder's name; for '.' or '..' the name of the folder they stand for."""
    name = Path(path.rstrip("/")).name
    return Path(path).resolve().name if name in ("", ".", "..") else name


def main(argv: list[str] | None = None) -> list[dict]:
    parser, args, models, device, dtype, source = parse_and_check(argv)
    output_dir = Path(args.output_dir)
    source_name = "C4 en validation" if source[0] == "c4" else str(source[1])
    results = []
    for label, model_path in models:
        model, tokenizer = model_io.load_model_and_tokenizer(model_path, dtype, device, args.tokenizer)
        if not stream_is_a_running_sum(model):
            parser.error(f"{model_path}: block Jacobians are {NO_BLOCK_JACOBIAN}")
        max_seq_len = model_io.resolve_context_length(model, args.max_seq_len, fallback=model_io.HUB_STREAM_WINDOW)
        try:
            windows = model_io.token_windows(tokenizer, model_io.iter_documents(source), max_seq_len, sys.maxsize)
            samples = sample_tokens(windows, args.num_tokens, args.tokens_per_window, args.seed)
            measurement = measure_jacobians(model, samples, args.probes, args.seed, args.batch_size, desc=label)
        except ValueError as err:  # an empty text, or a window too short for the tokenizer's prefix
            parser.error(f"--text_file/--dataset: {err}")
        if measurement.num_tokens < args.num_tokens:
            print(f"[jacobian] {label}: the text has only {measurement.num_tokens} tokens (asked for "
                  f"{args.num_tokens})", file=sys.stderr)
        folder = output_dir if len(models) == 1 else output_dir / label
        folder.mkdir(parents=True, exist_ok=True)
        written = [write_csv(measurement.rows, folder / "jacobian.csv")]
        written.append(plot_heatmaps(measurement.heatmaps, folder / "jacobian_heatmap.png",
                                     f"{label}: {measurement.heatmap_note}"))
        results.append(dict(label=label, model_path=model_path, num_tokens=measurement.num_tokens,
                            hidden_size=measurement.hidden_size, max_seq_len=max_seq_len, method=measurement.method,
                            probes=measurement.probes, heatmap=measurement.heatmap_note, layers=measurement.rows))
        for path in written:
            print(f"wrote {path}")
        del model

    metadata = dict(text=source_name, tokens_per_window=args.tokens_per_window, seed=args.seed,
                    dtype=str(dtype).replace("torch.", ""), jacobian_dtype="float32",
                    definition="J_l(t) = d x_{l+1}[t] / d x_l[t] (same position, other positions fixed); "
                               "rel_identity_dev = sqrt(mean_t ||J-I||_F^2 / d); mean_diag = mean_t tr(J)/d; "
                               "mean_abs_offdiag = mean_t mean_{i!=j} |J_ij| (exact only). With probes: "
                               "||(J-I)^T v||^2 and v^T J v over Gaussian v, standard errors over the probes.")
    json_path = output_dir / "jacobian.json"
    json_path.write_text(json.dumps(dict(metadata, models=results), indent=1))
    title = f"{', '.join(label for label, _ in models)} on {Path(source_name).name}"
    for path in (json_path, plot_depth(results, output_dir / "jacobian.png", title)):
        print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
