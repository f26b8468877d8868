"""Angular distance between the residual stream at layer l and at layer l + n, for every l and n.

    python utils/angular_analysis.py --model_path Qwen/Qwen3-8B                       # paper: C4, 256K tokens
    (--num_tokens defaults to the paper's 262,144 on a GPU and to 65,536 on a CPU)
    python utils/angular_analysis.py --model_path checkpoints/lns_130m --dataset embedded --num_tokens 65536

d(l, n) = mean over all real (non-pad) token positions of arccos(cos(h_l, h_{l+n})) / pi, where h_0 is the
residual stream entering decoder layer 0 and h_l the stream leaving decoder layer l - 1 (forward hooks, see
utils/instruments/model_io.py). Rows of the result are n = 1..L, columns l = 0..L-1; entries with l + n > L do not exist
and are NaN (null in JSON, empty in CSV, masked in the heatmap).

Block influence (ShortGPT, Men et al. 2024), from the same pass: BI(l) = 1 - mean over real tokens of
cos(h_l, h_{l+1}), the input and output of layer l; a block near the identity has BI near 0. Written to
block_influence.csv and .png, with each layer's rank by BI and by d(l, 1) and the Spearman correlation of the two.

With --logit_lens, the logit lens (utils/instruments/logit_lens.py) from the same pass: per layer the KL divergence
of the model's final next-token distribution from its final norm and LM head applied to the stream after that layer,
and their top-1 agreement; per token the prediction depth, the first layer from which the top-1 token agrees with the
final one and stays (its mean, median, 90th percentile and histogram). Written to logit_lens.json.
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

import numpy as np

from peft_pretraining.cli import OneLineErrorParser
from peft_pretraining.model.model_parts import decoder_layers
from utils.instruments import model_io
from utils.instruments.angular import accumulate, ranks, spearman
from utils.instruments.logit_lens import LogitLensAccumulator

PAPER_NUM_TOKENS = 256 * 1024  # the paper's count, the default on a GPU
# The default on a CPU: fits in the embedded held-out novel (about 109K tokens) and takes about a minute for a
# 135M-parameter model on 2 cores (docs/analyses.md#speed).
CPU_NUM_TOKENS = 64 * 1024
def save_block_influence(influence: np.ndarray, adjacent_distance: np.ndarray, output_dir: Path, title: str,
                         metadata: dict) -> tuple[list[Path], float]:
    """block_influence.csv (layer, BI, d(l, 1), both ranks) and a two-panel PNG; returns the Spearman correlation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    output_dir.mkdir(parents=True, exist_ok=True)
    rho = spearman(influence, adjacent_distance)
    csv_path = output_dir / "block_influence.csv"
    with csv_path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["layer", "block_influence", "angular_distance_n1", "rank_by_block_influence",
                         "rank_by_angular_distance_n1"])
        for layer, (bi, d, bi_rank, d_rank) in enumerate(zip(influence, adjacent_distance, ranks(influence),
                                                            ranks(adjacent_distance))):
            writer.writerow([layer, f"{bi:.8f}", f"{d:.8f}", bi_rank, d_rank])
    json_path = output_dir / "block_influence.json"
    json_path.write_text(json.dumps(dict(metadata, block_influence=influence.tolist(),
                                         angular_distance_n1=adjacent_distance.tolist(), spearman=rho), indent=1))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    layers = np.arange(len(influence))
    left.bar(layers, influence, color="tab:blue")
    left.set_xlabel(r"layer $\ell$")
    left.set_ylabel(r"block influence $1 - \cos(h_\ell, h_{\ell+1})$")
    right.scatter(adjacent_distance, influence, s=14)
    for layer in layers:
        right.annotate(str(layer), (adjacent_distance[layer], influence[layer]), fontsize=6)
    right.set_xlabel(r"angular distance $d(\ell, 1)$")
    right.set_ylabel("block influence")
    right.set_title(f"Spearman rank correlation {rho:.3f}", fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    png_path = output_dir / "block_influence.png"
    fig.savefig(png_path, dpi=160, bbox_inches="tight")
    plt.close(fig)
    return [csv_path, json_path, png_path], rho


def save_logit_lens(lens: dict, output_dir: Path, metadata: dict) -> Path:
    """logit_lens.json: the lens's per-layer lists (index l - 1 = the stream after layer l) and prediction depths."""
    path = output_dir / "logit_lens.json"
    definition = ("per layer l = 1..L, over real tokens: mean KL(p_L || p_l) in nats and the fraction with argmax p_l "
                  "= argmax p_L, where p_l = softmax(lm_head(final_norm(h_l))) and p_L is the model's own output; a "
                  "token's prediction depth is the first l from which argmax p_m = argmax p_L for every m >= l")
    path.write_text(json.dumps(dict(metadata, definition=definition, **lens), indent=1))
    return path


def normalize_rows(matrix: np.ndarray) -> np.ndarray:
    """Min-max scale each row over its valid entries (what the reference plotted); constant rows become 0."""
    result = np.full_like(matrix, np.nan)
    for row, values in enumerate(matrix):
        valid = ~np.isnan(values)
        low, high = values[valid].min(), values[valid].max()
        result[row, valid] = 0.0 if high == low else (values[valid] - low) / (high - low)
    return result


def save_matrix(matrix: np.ndarray, output_dir: Path, metadata: dict) -> list[Path]:
    output_dir.mkdir(parents=True, exist_ok=True)
    depth = matrix.shape[1]
    csv_path = output_dir / "angular_distance.csv"
    with csv_path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["n"] + [f"layer_{layer}" for layer in range(depth)])
        for n, values in enumerate(matrix, start=1):
            writer.writerow([n] + ["" if np.isnan(value) else f"{value:.8f}" for value in values])
    json_path = output_dir / "angular_distance.json"
    payload = dict(metadata, rows="n = 1..L (subsequent n-th layer)", columns="l = 0..L-1 (layer index)",
                   angular_distance=[[None if np.isnan(v) else float(v) for v in row] for row in matrix])
    json_path.write_text(json.dumps(payload, indent=1))
    return [csv_path, json_path]


def plot_heatmap(matrix: np.ndarray, output_dir: Path, title: str, row_normalized: bool = False) -> list[Path]:
    """Heatmap like the paper's figure: columns l, rows n (n = 1 at the bottom), invalid region left blank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = normalize_rows(matrix) if row_normalized else matrix
    depth = matrix.shape[1]
    fig, ax = plt.subplots(figsize=(6.5, 5.0))
    mesh = ax.pcolormesh(np.arange(depth + 1), np.arange(1, depth + 2), np.ma.masked_invalid(values),
                         cmap="viridis_r", edgecolors="white", linewidth=0.2,
                         vmin=0.0, vmax=1.0 if row_normalized else None)
    ax.set_aspect("equal")
    ax.set_xlabel(r"Layer index $\ell$")
    ax.set_ylabel(r"Subsequent $n$-th layer")
    step = max(1, round(depth / 8))
    ax.set_xticks(np.arange(0, depth, step) + 0.5, [str(i) for i in range(0, depth, step)])
    ax.set_yticks(np.arange(1, depth + 1, step) + 0.5, [str(i) for i in range(1, depth + 1, step)])
    for side in ax.spines.values():
        side.set_visible(False)
    ax.tick_params(length=0)
    ax.set_title(title, fontsize=10)
    label = "angular distance (row-normalised)" if row_normalized else r"angular distance $d/\pi$"
    fig.colorbar(mesh, ax=ax, fraction=0.046, pad=0.04, label=label)
    fig.tight_layout()
    paths = [output_dir / "angular_distance.png", output_dir / "angular_distance.pdf"]
    for path in paths:
        fig.savefig(path, dpi=200, bbox_inches="tight")
    plt.close(fig)
    return paths


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_io.add_model_arguments(parser)
    model_io.add_text_arguments(parser, default_num_tokens=PAPER_NUM_TOKENS, cpu_num_tokens=CPU_NUM_TOKENS)
    model_io.add_threads_argument(parser)
    parser.add_argument("--output_dir", default="runs/analysis/angular", help="where the CSV, JSON, PNG and PDF go")
    parser.add_argument("--normalize_rows", action="store_true",
                        help="plot each row min-max scaled to [0, 1] as the reference did (files keep raw values)")
    parser.add_argument("--logit_lens", action="store_true",
                        help="also the logit lens, in the same pass: logit_lens.json (KL from the final distribution "
                             "and top-1 agreement per layer, prediction depth per token)")
    return parser


def main(argv: list[str] | None = None) -> np.ndarray:
    parser = build_parser()
    args = parser.parse_args(argv)
    model_io.check_positive(parser, args, "batch_size")
    model_io.check_positive_or_none(parser, args, "max_seq_len", "num_tokens")
    model_io.apply_threads(parser, args)
    device, dtype, source = model_io.resolve_run_settings(parser, args)
    model_io.check_model_path(parser, args.model_path)
    model_io.resolve_num_tokens(args, device, "angular")

    model, tokenizer = model_io.load_model_and_tokenizer(args.model_path, dtype, device, args.tokenizer)
    max_seq_len = model_io.resolve_context_length(model, args.max_seq_len, fallback=model_io.HUB_STREAM_WINDOW)
    batches = model_io.token_batches(tokenizer, source, max_seq_len, args.num_tokens, args.batch_size)
    try:
        lens = [LogitLensAccumulator.of_model(model, len(decoder_layers(model)))] if args.logit_lens else []
    except ValueError as err:  # no final norm or LM head to read the stream out with
        parser.error(f"--logit_lens: {err}")
    try:
        accumulator = accumulate(model, batches, total_tokens=args.num_tokens, device=device, also=lens)
        matrix, num_tokens, influence = accumulator.matrix(), accumulator.num_tokens, accumulator.block_influence()
    except ValueError as err:  # an empty text
        parser.error(f"--text_file/--dataset: {err}")
    if num_tokens < args.num_tokens:
        print(f"[angular] the text has only {num_tokens} tokens (asked for {args.num_tokens})", file=sys.stderr)

    source_name = "C4 en validation" if source[0] == "c4" else str(source[1])
    metadata = dict(model_path=args.model_path, num_layers=matrix.shape[1], num_tokens=num_tokens,
                    text=source_name, max_seq_len=max_seq_len, dtype=str(dtype).replace("torch.", ""),
                    definition="mean over real tokens of arccos(cos(h_l, h_{l+n}))/pi; h_0 = input of layer 0, "
                               "h_l = output of layer l-1 (residual stream, before the final norm)")
    output_dir = Path(args.output_dir)
    written = save_matrix(matrix, output_dir, metadata)
    title = f"{Path(args.model_path.rstrip('/')).name}: {num_tokens} tokens of {Path(source_name).name}"
    written += plot_heatmap(matrix, output_dir, title, row_normalized=args.normalize_rows)
    influence_files, rho = save_block_influence(influence, matrix[0], output_dir, title, metadata)
    written += influence_files
    print(f"[angular] block influence: largest at layers {np.argsort(-influence, kind='stable')[:3].tolist()}, "
          f"smallest at {np.argsort(influence, kind='stable')[:3].tolist()}; Spearman correlation with d(l, 1): "
          f"{rho:.3f}")
    if lens:
        lens_result = lens[0].result()
        written.append(save_logit_lens(lens_result, output_dir, metadata))
        print(f"[angular] logit lens: the top-1 prediction settles after layer "
              f"{lens_result['prediction_depth_mean']:.1f} of {matrix.shape[1]} on average; KL from the final "
              f"distribution after layer 1: {lens_result['lens_kl'][0]:.3f} nats")
    for path in written:
        print(f"wrote {path}")
    return matrix


if __name__ == "__main__":
    main()
