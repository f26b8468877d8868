"""Is this model cursed? Every depth instrument on the same tokens, in one report.

    python utils/depth_report.py --model_path runs/smollm2_135m --out docs/analyses/smollm2_135m_depth
    python utils/depth_report.py --model_path runs/pre/model_150 --label Pre-LN \\
        --model_path runs/lns/model_150 --label LNS --out runs/analysis/depth_report

Each model reads the same text (--dataset / --text_file, as the other tools) in windows of its trained context
length (utils/instruments/model_io.resolve_context_length). From those windows:

- one pass of the residual stream (utils/instruments/stream.py) over the first --num_tokens tokens feeds
  the angular distance d(l, 1) and block influence (utils/instruments/angular.py), the variance
  (utils/instruments/variance.py), the residual update ratio ||h_{l+1} - h_l|| / ||h_l|| (each block's update against
  the stream it is added to) and the logit lens (utils/instruments/logit_lens.py): the model's own final norm and LM
  head applied to the stream after every layer, compared with the final layer's next-token distribution
  (KL(final || layer l), top-1 agreement, and each token's prediction depth: the first layer from which its top-1
  token agrees with the final one and stays);
- the removal cost of each layer (utils/instruments/removal_loss.py): the rise of the next-token loss, in nats per
  token, when that layer is removed, over the first --removal_tokens tokens of the same windows;
- block Jacobians ||J - I||_F / sqrt(d) (utils/instruments/jacobian.py) at --jacobian_tokens positions sampled from the
  first of the same windows.

The variance growth is reported both ways, as the studies do (utils/study/measures.py): variance_growth, the last
layer's output variance over the stream leaving layer L // 2, and variance_growth_from_first, last over first.

Writes to --out: report.md (settings, a few sentences per model, each naming its threshold, and the panel),
depth_report.png (a row per measure against relative depth l/L, a line per model), depth_report.json and
depth_report.csv (every number).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from peft_pretraining.cli import OneLineErrorParser
from peft_pretraining.model.model_parts import decoder_layers
from utils.instruments import model_io
from utils.instruments.logit_lens import final_readout
from utils.instruments.measure import NEXT_TOKEN_LOSS, MeasureSettings, measure_model
from utils.study.host import cpu_model_name
from utils.study.measures import CHEAP_REMOVAL_NATS, variance_growth, variance_growth_from_first

# GPU defaults: the paper's 262,144 tokens for the stream measures and the Jacobian tool's 128 tokens; the removal
# sweep runs the model L + 1 times, so it reads a quarter of the stream's tokens.
GPU_STREAM_TOKENS, GPU_REMOVAL_TOKENS, GPU_JACOBIAN_TOKENS = 256 * 1024, 64 * 1024, 128
# CPU defaults, sized so that SmolLM2-135M (30 layers, d = 576) takes at most 10 minutes on 2 cores (docs/analyses.md).
# There, per token, the logit lens costs about 8 forward passes (31 read-outs into 49,152 words), removal 31 forward
# passes, and one Jacobian token (16 probes, up to 256 positions) seconds.
CPU_STREAM_TOKENS, CPU_REMOVAL_TOKENS, CPU_JACOBIAN_TOKENS = 2048, 512, 8
# The report's thresholds. Cheap removal is the study's: the loss rises by less than 1% in perplexity.
NEAR_IDENTITY = 0.1  # a block near the identity: ||J - I||_F / sqrt(d) below this, or an update below 10% of ||x||
SETTLED_KL_NATS = 0.1  # the logit lens has settled from the first layer after which KL(final || layer) stays below
# ----------------------------------------------------------------------------- plain-word summary
def deep_half(values: list[float]) -> list[float]:
    """Layers L//2 .. L-1 (as the study's deep-half measures)."""
    return values[len(values) // 2:]


def settled_from(values: list[float], below: float) -> int | None:
    """The first 1-based depth from which every value stays below `below`; None when the last one does not."""
    depth = None
    for index, value in enumerate(values, start=1):
        depth = (depth or index) if value < below else None
    return depth


def summarise(result: dict) -> dict:
    """The scalar answers of the report: which fraction of layers is cheap to remove, where the lens settles, how much
    of the depth sits near the identity."""
    num_layers = result["num_layers"]
    jacobian = [row["rel_identity_dev"] for row in result["jacobian"]]
    return dict(
        cheap_removal_fraction=float(np.mean([cost < CHEAP_REMOVAL_NATS for cost in result["removal_cost"]])),
        removal_deep=float(np.mean(deep_half(result["removal_cost"]))),
        lens_kl_deep=float(np.mean(deep_half(result["lens_kl"]))),
        relative_prediction_depth=result["prediction_depth_mean"] / num_layers,
        lens_settled_depth=settled_from(result["lens_kl"], SETTLED_KL_NATS),
        near_identity_jacobian_fraction=(float(np.mean([value < NEAR_IDENTITY for value in jacobian])) if jacobian
                                         else None),  # None: no block Jacobian (a stream that is not a running sum)
        near_identity_update_fraction=float(np.mean([ratio < NEAR_IDENTITY for ratio in result["update_ratio"]])),
        jacobian_deep=float(np.mean(deep_half(jacobian))) if jacobian else None,
        update_ratio_deep=float(np.mean(deep_half(result["update_ratio"]))),
        bi_deep=float(np.mean(deep_half(result["block_influence"]))),
        # as the study reports it: over the deeper half (last / the stream leaving layer L // 2), and last / first
        variance_growth=variance_growth(result["variance"]),
        variance_growth_from_first=variance_growth_from_first(result["variance"]),
    )


def layer_list(flags: list[bool], lead: str) -> str:
    """`lead` and the 0-based indices of the true entries as compact ranges ('3-7, 9'); '' when there are none."""
    indices = [index for index, flag in enumerate(flags) if flag]
    ranges = []
    for index in indices:
        if ranges and index == ranges[-1][1] + 1:
            ranges[-1][1] = index
        else:
            ranges.append([index, index])
    return lead + ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges) if ranges else ""


def sentences(result: dict) -> list[str]:
    summary, num_layers = result["summary"], result["num_layers"]
    cheap = [cost < CHEAP_REMOVAL_NATS for cost in result["removal_cost"]]
    jacobian_near = [row["rel_identity_dev"] < NEAR_IDENTITY for row in result["jacobian"]]
    update_near = [ratio < NEAR_IDENTITY for ratio in result["update_ratio"]]
    settled = summary["lens_settled_depth"]
    settled_text = (f"from layer {settled} of {num_layers} on ({settled / num_layers:.0%} of the depth)"
                    if settled and settled < num_layers else "only at the last layer, where it is 0 by definition")
    return [
        f"**Removal.** {sum(cheap)} of {num_layers} layers ({summary['cheap_removal_fraction']:.0%}) are cheap to "
        f"remove: removing one alone raises the loss on these tokens by less than 1% in perplexity "
        f"({CHEAP_REMOVAL_NATS:.4f} nats/token){layer_list(cheap, ': layers ')}. The deep half costs "
        f"{summary['removal_deep']:.4f} nats/token a layer on average"
        f"{' (negative: removing one lowers the loss)' if summary['removal_deep'] < 0 else ''}, from a loss of "
        f"{result['removal_baseline_nats']:.3f}.",
        f"**Logit lens.** A token's top-1 prediction settles (agrees with the final layer's and stays) after layer "
        f"{result['prediction_depth_mean']:.1f} of {num_layers} on average ({summary['relative_prediction_depth']:.0%}"
        f" of the depth; median {result['prediction_depth_median']:.0f}, 90th percentile "
        f"{result['prediction_depth_p90']:.0f}). The KL from the final distribution stays below {SETTLED_KL_NATS} "
        f"nats {settled_text}; over the deep half it averages {summary['lens_kl_deep']:.3f} nats.",
        near_identity_sentence(result, jacobian_near, update_near),
    ]


def near_identity_sentence(result: dict, jacobian_near: list[bool], update_near: list[bool]) -> str:
    summary, num_layers = result["summary"], result["num_layers"]
    adds = (f"({summary['near_identity_update_fraction']:.0%}) add an update smaller than {NEAR_IDENTITY:.0%} of the "
            f"stream they are added to (‖F(x)‖/‖x‖ < {NEAR_IDENTITY}){layer_list(update_near, ': layers ')}")
    if not result["jacobian"]:  # AttnRes, mHC, SiameseNorm: no block maps one stream tensor to the next
        return (f"**Near the identity.** Block Jacobians are {result['jacobian_method']}; {sum(update_near)} of "
                f"{num_layers} blocks {adds}; over the deep half ‖F(x)‖/‖x‖ averages "
                f"{summary['update_ratio_deep']:.3f}.")
    return (f"**Near the identity.** {sum(jacobian_near)} of {num_layers} blocks "
            f"({summary['near_identity_jacobian_fraction']:.0%}) have ‖J − I‖_F/√d below {NEAR_IDENTITY}"
            f"{layer_list(jacobian_near, ': layers ')}, and {sum(update_near)} {adds}; over the deep half "
            f"‖J − I‖_F/√d averages {summary['jacobian_deep']:.3f} and ‖F(x)‖/‖x‖ {summary['update_ratio_deep']:.3f}.")


# ----------------------------------------------------------------------------- outputs
# (key, row title, y scale, whether the values are per block (x = (l+1)/L) or per depth 0..L (x = l/L) or 1..L)
PANEL_ROWS = (
    ("removal_cost", "removal cost (nats/token)", "symlog", "block"),
    ("lens_kl", "logit lens: KL(final ‖ layer) (nats)", "symlog", "after"),
    ("lens_top1_agreement", "logit lens: top-1 agrees with final", "linear", "after"),
    ("settled_fraction", "tokens whose prediction has settled", "linear", "after"),
    ("update_ratio", "update ratio ‖F(x)‖/‖x‖", "log", "block"),
    ("block_influence", "block influence 1 − cos(h_l, h_l+1)", "log", "block"),
    ("variance", "residual variance", "log", "depth"),
    ("jacobian_rel_identity_dev", "‖J − I‖_F / √d", "log", "block"),
)


INDEXED_BY = {"block": "layer (0-based)", "after": "depth after layer (1-based)", "depth": "depth (0 = embeddings)"}


def per_layer(result: dict, key: str) -> list[float]:
    if key == "settled_fraction":
        return np.cumsum(result["prediction_depth_histogram"]).tolist()
    if key == "jacobian_rel_identity_dev":
        return [row["rel_identity_dev"] for row in result["jacobian"]]
    return result[key]


def relative_depths(values: list, kind: str, num_layers: int) -> np.ndarray:
    """x of each value: a block l (0-based) and the stream after it sit at (l+1)/L, the stream at depth l at l/L."""
    start = 0 if kind == "depth" else 1
    return np.arange(start, start + len(values)) / num_layers


def plot_panel(results: list[dict], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(PANEL_ROWS), 1, figsize=(7.5, 2.1 * len(PANEL_ROWS)), sharex=True)
    for ax, (key, row_title, scale, kind) in zip(axes, PANEL_ROWS):
        for result in results:
            values = per_layer(result, key)
            ax.plot(relative_depths(values, kind, result["num_layers"]), values, marker="o", markersize=2.5,
                    linewidth=1.2, label=result["label"])
        if key == "removal_cost":
            ax.axhline(CHEAP_REMOVAL_NATS, color="grey", linestyle=":", linewidth=1)
        if scale == "symlog":  # removal can help (a negative cost) and the lens's last KL is 0
            ax.set_yscale("symlog", linthresh=1e-3)
            if min(min(per_layer(result, key)) for result in results) >= 0:
                ax.set_ylim(bottom=0)
        else:
            ax.set_yscale(scale)
        ax.set_title(row_title, fontsize=9, loc="left")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[-1].set_xlabel(r"relative depth $\ell / L$ (a block at the depth of its output; 0 = embeddings)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def write_csv(results: list[dict], path: Path) -> Path:
    """Long format: one row per (model, measure, layer or depth)."""
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["label", "model_path", "measure", "indexed_by", "index", "relative_depth", "value"])
        for result in results:
            for key, _title, _scale, kind in PANEL_ROWS:
                values = per_layer(result, key)
                for index, (x, value) in enumerate(zip(relative_depths(values, kind, result["num_layers"]), values)):
                    writer.writerow([result["label"], result["model_path"], key, INDEXED_BY[kind],
                                     index + (kind == "after"), f"{x:.6f}", f"{value:.8g}"])
            for key, value in result["summary"].items():
                writer.writerow([result["label"], result["model_path"], key, "summary", "", "",
                                 "" if value is None else value])
    return path


def write_report(results: list[dict], settings: dict, path: Path, panel: Path) -> Path:
    lines = ["# Depth report", "", "Where each model's layers stop mattering, every instrument on the same text "
             "(`utils/depth_report.py`).", "", "## Settings", ""]
    lines += [f"- {name}: {value}" for name, value in settings.items()]
    for result in results:
        lines += ["", f"## {result['label']}", "",
                  f"`{result['model_path']}`: {result['num_layers']} layers, hidden {result['hidden_size']}, "
                  f"windows of {result['max_seq_len']} tokens; {result['num_tokens']:,} tokens for the stream "
                  f"measures, {result['removal_tokens']:,} for removal, {result['jacobian_tokens']} for the Jacobians "
                  f"({result['jacobian_method']}); {result['seconds']:.0f} s.", ""]
        lines += [f"- {sentence}" for sentence in sentences(result)]
    lines += ["", "## Per layer", "", f"![every measure against relative depth]({panel.name})", "",
              "| measure | " + " | ".join(result["label"] for result in results) + " |",
              "|---|" + "---|" * len(results)]
    for key in results[0]["summary"]:
        cells = ["—" if result["summary"][key] is None else f"{result['summary'][key]:.4g}" for result in results]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    path.write_text("\n".join(lines) + "\n")
    return path


# ----------------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_path", action="append", required=True,
                        help="hub id or local folder; repeat for several models (one line each per panel)")
    parser.add_argument("--label", action="append", default=None,
                        help="legend label, one per --model_path in order (default: folder names)")
    parser.add_argument("--out", required=True, help="folder for report.md, depth_report.png, .json and .csv")
    parser.add_argument("--tokenizer", default=None, help="tokenizer for every model (default: each model's own)")
    parser.add_argument("--dtype", default="auto", choices=["auto", *model_io.DTYPES],
                        help="weights dtype; auto = bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    model_io.add_text_arguments(parser, default_num_tokens=GPU_STREAM_TOKENS, cpu_num_tokens=CPU_STREAM_TOKENS)
    parser.add_argument("--removal_tokens", type=int, default=None,
                        help=f"tokens (the first of the same windows) whose loss each removal changes (default: "
                             f"{GPU_REMOVAL_TOKENS:,} on a GPU, {CPU_REMOVAL_TOKENS:,} on a CPU)")
    parser.add_argument("--jacobian_tokens", type=int, default=None,
                        help=f"token positions whose block Jacobians are averaged (default: {GPU_JACOBIAN_TOKENS} on a "
                             f"GPU, {CPU_JACOBIAN_TOKENS} on a CPU)")
    parser.add_argument("--probes", type=int, default=None,
                        help="Jacobians: 0 exact, K >= 2 random probes (default: exact when d <= 512, else 16)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the Jacobian positions and probes")
    model_io.add_threads_argument(parser)
    return parser


def read_config(model_path: str) -> dict:
    config = model_io.read_local_config(model_path)
    if config is None:  # a hub id (check_model_path has asked for it already)
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_path).to_dict()
    return config


def not_causal_reason(config: dict) -> str | None:
    """Why a config is not a decoder-only causal LM, or None. Ours always are."""
    if "norm_type" in config:
        return None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.get("is_encoder_decoder"):
        return "it is an encoder-decoder model"
    architectures = config.get("architectures") or []
    if architectures and not set(architectures) & set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()):
        return f"its architectures ({', '.join(architectures)}) include no causal LM"
    if not architectures and config.get("model_type") not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return f"model_type {config.get('model_type')!r} has no causal LM class"
    return None


def check_text_length(parser, tokenizer, source, max_seq_len: int, num_tokens: int, flag: str) -> None:
    """A text shorter than one window (and than num_tokens) is a one-line error, before any measuring."""
    try:
        total = sum(map(len, model_io.token_windows(tokenizer, model_io.iter_documents(source), max_seq_len,
                                                    num_tokens)))
    except ValueError as err:
        model_io.bad_input(parser, str(err))
    if total < max_seq_len and total < num_tokens:
        model_io.bad_input(parser, f"{flag}: the text has {total} tokens, shorter than the model's {max_seq_len}-"
                                   "token context")


def text_flag(args) -> str:
    return "--text_file" if args.text_file else "--dataset"


def check_args(parser, args) -> tuple[list[tuple[str, str]], torch.device, torch.dtype, tuple]:
    """Every bad input is one line and exit 2 before any model is loaded."""
    model_io.check_positive(parser, args, "batch_size")
    model_io.check_positive_or_none(parser, args, "max_seq_len", "num_tokens", "removal_tokens", "jacobian_tokens")
    if args.probes is not None and (args.probes < 0 or args.probes == 1):
        parser.error(f"--probes: must be 0 (exact) or at least 2 (a standard error needs 2), got {args.probes}")
    labels = args.label or [Path(path.rstrip("/")).name or path for path in args.model_path]
    if len(labels) != len(args.model_path):
        parser.error(f"--label: got {len(labels)} labels for {len(args.model_path)} --model_path")
    if len(set(labels)) != len(labels):
        parser.error(f"--label: labels must be distinct, got {labels}")
    model_io.apply_threads(parser, args)
    device, dtype, source = model_io.resolve_run_settings(parser, args)
    for path in args.model_path:
        model_io.check_model_path(parser, path)
        reason = not_causal_reason(read_config(path))
        if reason:
            model_io.bad_input(parser, f"--model_path: {path} is not a causal LM ({reason})")
    on_cpu = device.type == "cpu"
    model_io.resolve_num_tokens(args, device, "depth_report")
    if args.removal_tokens is None:
        args.removal_tokens = CPU_REMOVAL_TOKENS if on_cpu else GPU_REMOVAL_TOKENS
    if args.jacobian_tokens is None:
        args.jacobian_tokens = CPU_JACOBIAN_TOKENS if on_cpu else GPU_JACOBIAN_TOKENS
    return list(zip(labels, args.model_path)), device, dtype, source


def analyse(parser, args, label: str, model_path: str, device, dtype, source) -> dict:
    started = time.perf_counter()
    model, tokenizer = model_io.load_model_and_tokenizer(model_path, dtype, device, args.tokenizer)
    try:
        layers = decoder_layers(model)
        final_readout(model)
    except ValueError as err:
        model_io.bad_input(parser, f"--model_path: {model_path} is not a decoder the report can read ({err})")
    max_seq_len = model_io.resolve_context_length(model, args.max_seq_len, fallback=model_io.HUB_STREAM_WINDOW)
    longest = max(args.num_tokens, args.removal_tokens)
    check_text_length(parser, tokenizer, source, max_seq_len, longest, text_flag(args))
    measured = measure_model(model, tokenizer, MeasureSettings(
        max_seq_len=max_seq_len, stream_tokens=args.num_tokens, jacobian_tokens=args.jacobian_tokens,
        jacobian_probes=args.probes, source=source, removal=NEXT_TOKEN_LOSS, removal_tokens=args.removal_tokens,
        text_tokens=longest, batch_size=args.batch_size, seed=args.seed), desc=f"{label}: ")
    lens = {key: measured[key] for key in ("lens_kl", "lens_top1_agreement", "prediction_depth_mean",
                                           "prediction_depth_median", "prediction_depth_p90",
                                           "prediction_depth_histogram")}
    result = dict(label=label, model_path=model_path, num_layers=len(layers),
                  hidden_size=model.get_input_embeddings().weight.shape[1], max_seq_len=max_seq_len,
                  removal_tokens=measured["removal_tokens"], jacobian_tokens=measured["jacobian_tokens"],
                  jacobian_method=measured["jacobian_method"], jacobian=measured["jacobian"],
                  num_tokens=measured["num_tokens"], angular_next=measured["angular"][0].tolist(),
                  block_influence=measured["block_influence"].tolist(), variance=measured["variance"].tolist(),
                  update_ratio=measured["update_ratio"], **lens,
                  removal_baseline_nats=measured["removal_baseline_nats"], removal_cost=measured["removal_cost"])
    result["summary"] = summarise(result)
    result["seconds"] = time.perf_counter() - started
    if result["num_tokens"] < args.num_tokens:
        print(f"[depth_report] {label}: the text has only {result['num_tokens']} tokens (asked for {args.num_tokens})",
              file=sys.stderr)
    return result


def main(argv: list[str] | None = None) -> list[dict]:
    parser = build_parser()
    args = parser.parse_args(argv)
    models, device, dtype, source = check_args(parser, args)
    source_name = "C4 en validation" if source[0] == "c4" else os.path.relpath(source[1])
    machine = cpu_model_name() if device.type == "cpu" else torch.cuda.get_device_name(device)
    settings = {"models": ", ".join(f"{label} = `{path}`" for label, path in models), "text": f"`{source_name}`",
                "stream tokens (angular, block influence, variance, update ratio, logit lens)": f"{args.num_tokens:,}",
                "removal tokens (the first of the same windows)": f"{args.removal_tokens:,}",
                "Jacobian tokens (sampled from the same windows)": f"{args.jacobian_tokens}",
                "window": "each model's trained context (--max_seq_len overrides)" if args.max_seq_len is None
                else f"{args.max_seq_len} tokens", "dtype": str(dtype).replace("torch.", ""),
                "device": f"{device.type} ({machine}), torch threads: {torch.get_num_threads()}, load average "
                          f"at the start: {os.getloadavg()[0]:.1f}"}
    print("[depth_report] settings:\n" + "\n".join(f"  {name}: {value}" for name, value in settings.items()),
          file=sys.stderr)
    results = [analyse(parser, args, label, path, device, dtype, source) for label, path in models]
    settings["wall time"] = " + ".join(f"{result['seconds']:.0f} s ({result['label']})" for result in results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    title = f"{', '.join(label for label, _ in models)} on {Path(source_name).name}"
    panel = plot_panel(results, out / "depth_report.png", title)
    (out / "depth_report.json").write_text(json.dumps(dict(settings=settings, models=results), indent=1))
    written = [write_report(results, settings, out / "report.md", panel), panel, out / "depth_report.json",
               write_csv(results, out / "depth_report.csv")]
    for result in results:
        print(f"[depth_report] {result['label']}:\n  " + "\n  ".join(sentences(result)))
    for path in written:
        print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
