"""Remove one decoder layer from a causal LM and save it, or sweep: remove each layer in turn and evaluate.

    python layer_remove.py --model_path Qwen/Qwen3-8B --layer_index 20 --save_path pruned/qwen3_8b_minus_20
    python layer_remove.py --model_path checkpoints/lns_130m --sweep                  # lm-eval, mmlu online
    python layer_remove.py --model_path checkpoints/lns_130m --sweep --tasks heldout_novel_ppl   # offline

Works on HF Llama, Qwen2/Qwen3 and Mistral models and on our checkpoints. The attention ``layer_idx`` of the
remaining layers is renumbered (the KV cache is indexed by it) and the config's ``num_hidden_layers`` and
``layer_types`` follow. For our models each remaining layer keeps what it was trained with: its own LNS factor
1/sqrt(l) (l = its original depth) and its own Mix-LN placement (post or pre). The config records this through
``layer_norm_types`` / ``layer_depths`` (``freeze_layer_plan``), so the saved model reloads the same way. The
removal and the sweep are library code (utils/instruments/removal.py, removal_sweep.py); this is their command line.
"""
from __future__ import annotations

import argparse
import csv
import json
import shlex
import sys
import tempfile
from pathlib import Path

import torch

from peft_pretraining.cli import OneLineErrorParser
from peft_pretraining.data import lm_eval_tasks
from peft_pretraining.model.layernorm_scaling import fold_layernorm_scaling, has_layernorm_scaling
from peft_pretraining.model.model_parts import is_our_config
from utils.instruments import model_io
from utils.instruments.removal import check_layer_index, remove_layer
from utils.instruments.removal_sweep import check_metric_reported, sweep


def lm_eval_command(model_path: str | Path, our_checkpoint: bool, max_length: int, tasks: str = "mmlu",
                    gpu: bool = True) -> str:
    """The lm-eval CLI call for a saved model (ours needs trust_remote_code to load our class); max_length keeps
    lm-eval inside the context the model was trained at."""
    model_args = (f"pretrained={Path(model_path).resolve()},dtype={'bfloat16' if gpu else 'float32'},"
                  f"max_length={max_length}")
    if our_checkpoint:
        model_args += ",trust_remote_code=True"
    device = "--device cuda:0 --batch_size auto" if gpu else "--device cpu --batch_size 8"
    return f"lm_eval --model hf --model_args {shlex.quote(model_args)} --tasks {tasks} {device}"


# ----------------------------------------------------------------------------- sweep
PARTIAL_SWEEP = "layer_removal.partial.json"


# What a resumed sweep must share with the killed one for its rows to belong in one table.
RESUME_MUST_MATCH = ("model_path", "tasks", "limit", "max_seq_len", "metric", "per_document", "layers")


def save_partial_sweep(rows: list[dict], higher_is_better: dict, output_dir: Path, metadata: dict) -> None:
    """The rows measured so far, replaced atomically after each evaluation; save_sweep removes the file."""
    output_dir.mkdir(parents=True, exist_ok=True)
    staging = output_dir / f".{PARTIAL_SWEEP}.tmp"
    staging.write_text(json.dumps(dict(metadata, rows=rows, higher_is_better=higher_is_better, complete=False),
                                  indent=1))
    staging.replace(output_dir / PARTIAL_SWEEP)


def save_sweep(rows: list[dict], output_dir: Path, metadata: dict) -> list[Path]:
    output_dir.mkdir(parents=True, exist_ok=True)
    csv_path = output_dir / "layer_removal.csv"
    with csv_path.open("w", newline="") as handle:
        # the per-document values (--per_document) stay in the JSON
        writer = csv.DictWriter(handle, fieldnames=[key for key in rows[0] if key != "documents"],
                                extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({key: "baseline" if key == "removed_layer" and value is None else value
                             for key, value in row.items()})
    json_path = output_dir / "layer_removal.json"
    json_path.write_text(json.dumps(dict(metadata, rows=rows), indent=1))
    model_name = Path(str(metadata.get("model_path", "")).rstrip("/")).name
    written = [csv_path, json_path, plot_sweep(rows, output_dir / "layer_removal.png", model_name)]
    (output_dir / PARTIAL_SWEEP).unlink(missing_ok=True)
    return written


def plot_sweep(rows: list[dict], path: Path, title: str) -> Path:
    """One bar per removed layer (its drop), one panel per task, like the paper's layer-pruning figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    tasks = list(dict.fromkeys(row["task"] for row in rows))
    fig, axes = plt.subplots(len(tasks), 1, figsize=(max(6.0, 0.25 * len(rows) / len(tasks) + 2), 3.2 * len(tasks)),
                             squeeze=False)
    for ax, task in zip(axes[:, 0], tasks):
        task_rows = [row for row in rows if row["task"] == task]
        baseline = next(row for row in task_rows if row["removed_layer"] is None)
        pruned = [row for row in task_rows if row["removed_layer"] is not None]
        drops = [row["drop"] for row in pruned]
        ax.bar([row["removed_layer"] for row in pruned], drops,
               color=["tab:red" if drop > 0 else "tab:blue" for drop in drops])
        ax.axhline(0.0, color="black", linewidth=0.6)
        magnitudes = sorted(abs(drop) for drop in drops if drop)
        if magnitudes and magnitudes[-1] > 50 * magnitudes[len(magnitudes) // 2]:
            # One layer (typically the first) dwarfs the rest: a symmetric log scale keeps the others visible.
            ax.set_yscale("symlog", linthresh=magnitudes[len(magnitudes) // 2])
        metric = baseline["metric"].split(",")[0]
        ax.set_ylabel(f"drop in {metric}\n(positive = worse)")
        ax.set_xlabel("removed layer index $\\ell$")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set_title(f"{title}: {task}, baseline {metric} = {baseline['value']:.4g}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=200)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_io.add_model_arguments(parser, default_model=None)
    for action in parser._actions:  # the shared --dtype, with this tool's meaning of auto
        if action.dest == "dtype":
            action.help = ("weights dtype; auto = bfloat16 on GPU, float32 on CPU for --sweep, and the checkpoint's "
                           "own dtype for a saved pruned model")
    parser.add_argument("--layer_index", type=int, default=None, help="0-based index of the layer to remove")
    parser.add_argument("--save_path", default=None, help="new (or empty) folder for the pruned model")
    parser.add_argument("--sweep", action="store_true",
                        help="remove each layer in turn (in memory) and evaluate with lm-eval, plus the baseline")
    parser.add_argument("--tasks", default=None,
                        help="comma-separated lm-eval tasks for --sweep; default mmlu when the hub is reachable, "
                             f"else the local {lm_eval_tasks.HELDOUT_PERPLEXITY_TASK}")
    parser.add_argument("--metric", default=None, help="metric to tabulate (default: each task's first metric)")
    parser.add_argument("--layers", default=None, help="comma-separated layer indices to sweep (default: all)")
    model_io.add_context_argument(parser)
    parser.add_argument("--limit", type=float, default=None, help="lm-eval limit per task (testing only)")
    parser.add_argument("--eval_batch_size", type=int, default=8, help="lm-eval batch size")
    parser.add_argument("--bootstrap_iters", type=int, default=0,
                        help="lm-eval bootstrap iterations for stderr (0 = skip; the sweep compares point values)")
    parser.add_argument("--task_text_file", default=None,
                        help=f"text for {lm_eval_tasks.HELDOUT_PERPLEXITY_TASK} (default: embedded held-out novel)")
    parser.add_argument("--task_max_documents", type=int, default=None,
                        help=f"keep only the first N documents in {lm_eval_tasks.HELDOUT_PERPLEXITY_TASK}")
    parser.add_argument("--per_document", action="store_true",
                        help="also keep each document's metric value in layer_removal.json (for intervals over "
                             "documents); off by default, since it makes lm-eval keep every sample")
    parser.add_argument("--output_dir", default="runs/analysis/layer_removal", help="where the sweep table and plot go")
    parser.add_argument("--overwrite", action="store_true", help="replace the sweep already in --output_dir")
    parser.add_argument("--resume", action="store_true",
                        help=f"finish the killed sweep in --output_dir ({PARTIAL_SWEEP}): its layers are not redone")
    return parser


def _check_save_path(parser, save_path: str, model_path: str) -> Path:
    path = Path(save_path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        parser.error(f"--save_path: {save_path} already exists and is not empty; choose a new folder")
    if Path(model_path).exists() and path.resolve() == Path(model_path).resolve():
        parser.error("--save_path: must differ from --model_path")
    return path


def _read_config(parser, model_path: str):
    """The model's config (a dict for a local folder) without loading its weights."""
    model_io.check_model_path(parser, model_path)
    local = model_io.read_local_config(model_path)
    if local is not None:
        return local
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError) as err:
        parser.error(f"--model_path: cannot read the config of {model_path!r} ({str(err).splitlines()[0]})")


def _config_num_layers(parser, model_path: str) -> int:
    config = _read_config(parser, model_path)
    return int(config["num_hidden_layers"] if isinstance(config, dict) else config.num_hidden_layers)


def run_single(parser, args, device, dtype) -> None:
    if args.layer_index is None or args.save_path is None:
        parser.error("--layer_index and --save_path are required unless --sweep is given")
    save_path = _check_save_path(parser, args.save_path, args.model_path)
    try:
        check_layer_index(args.layer_index, _config_num_layers(parser, args.model_path))
    except ValueError as err:
        parser.error(str(err))
    model, tokenizer = model_io.load_model_and_tokenizer(args.model_path, dtype, device, args.tokenizer)
    max_length = model_io.resolve_context_length(model, args.max_seq_len)
    if has_layernorm_scaling(model):  # hooks would be re-attached by position on reload: fold each original depth in
        fold_layernorm_scaling(model)
    remove_layer(model, args.layer_index)
    model.save_pretrained(save_path)
    tokenizer.save_pretrained(save_path)
    ours = is_our_config(model.config)
    print(f"removed layer {args.layer_index}; saved a {model.config.num_hidden_layers}-layer model to {save_path}")
    task_dir = f"{save_path.resolve()}_tasks"
    offline = ("offline on a CPU, from the repository root (held-out perplexity task built from the embedded novel):",
               f"python -m peft_pretraining.lm_eval_tasks --output_dir {task_dir} && "
               f"{lm_eval_command(save_path, ours, max_length, lm_eval_tasks.HELDOUT_PERPLEXITY_TASK, gpu=False)} "
               f"--include_path {task_dir}")
    online = ("on a GPU with the hub reachable (mmlu):", lm_eval_command(save_path, ours, max_length))
    # The command that works here comes first: mmlu needs the hub and the GPU command needs CUDA.
    works_here = torch.cuda.is_available() and model_io.hub_is_reachable()
    print("evaluate it with:")
    for heading, command in (online, offline) if works_here else (offline, online):
        print(f"  {heading}\n    {command}")


def run_sweep(parser, args, device, dtype) -> list[dict]:
    if args.layer_index is not None or args.save_path is not None:
        parser.error("--sweep evaluates every layer in memory; drop --layer_index and --save_path")
    output_dir = Path(args.output_dir)
    earlier = [name for name in ("layer_removal.json", PARTIAL_SWEEP) if (output_dir / name).exists()]
    if args.resume and args.overwrite:
        parser.error("--resume and --overwrite: pick one")
    if args.resume and PARTIAL_SWEEP not in earlier:
        parser.error(f"--resume: no unfinished sweep ({PARTIAL_SWEEP}) in --output_dir {output_dir}")
    if earlier and not (args.overwrite or args.resume):
        parser.error(f"--output_dir {output_dir} already holds a sweep ({earlier[0]}); pass --overwrite (or --resume "
                     "for an unfinished one) or choose another folder")
    if args.tasks is None:
        online = model_io.hub_is_reachable()
        args.tasks = "mmlu" if online else lm_eval_tasks.HELDOUT_PERPLEXITY_TASK
        if not online:
            print(f"[layer_remove] the hub is not reachable; evaluating the local task {args.tasks}", file=sys.stderr)
    tasks = [task.strip() for task in args.tasks.split(",") if task.strip()]
    if not tasks:
        parser.error("--tasks: give at least one task")
    try:
        layer_indices = None if args.layers is None else [int(i) for i in args.layers.split(",") if i.strip()]
    except ValueError:
        parser.error(f"--layers: {args.layers!r} is not a comma-separated list of integers")
    if layer_indices is not None and (not layer_indices or len(set(layer_indices)) != len(layer_indices)):
        parser.error(f"--layers: {args.layers!r} must name at least one layer, each once")
    if args.limit is not None and not args.limit > 0:
        parser.error(f"--limit must be positive (a count, or a fraction below 1), got {args.limit:g}")
    if args.task_max_documents is not None and args.task_max_documents < 1:
        parser.error(f"--task_max_documents must be at least 1, got {args.task_max_documents}")
    num_layers = _config_num_layers(parser, args.model_path)
    for index in layer_indices or []:
        try:
            check_layer_index(index, num_layers)
        except ValueError as err:
            parser.error(str(err).replace("--layer_index", "--layers"))

    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    with tempfile.TemporaryDirectory(prefix="lm_eval_tasks_") as task_dir:
        options = {lm_eval_tasks.HELDOUT_PERPLEXITY_TASK: {"text_file": args.task_text_file,
                                                          "max_documents": args.task_max_documents}}
        if lm_eval_tasks.NEXT_SENTENCE_TASK in tasks:  # its choices must fit the window the model is scored in
            try:
                window = model_io.resolve_context_length(_read_config(parser, args.model_path), args.max_seq_len,
                                                         log=lambda *_: None)
            except ValueError as err:
                parser.error(str(err))
            options[lm_eval_tasks.NEXT_SENTENCE_TASK] = {
                "tokenizer": model_io.load_tokenizer(args.model_path, args.tokenizer), "max_choice_tokens": window - 1}
        try:
            include_paths = lm_eval_tasks.build_local_tasks(tasks, task_dir, options)
        except ValueError as err:
            parser.error(f"--task_text_file: {err}")
        # Indexing lm-eval's own task tree takes seconds: only when a task is not one of ours.
        manager = lm_eval_tasks.task_manager(
            include_paths, include_defaults=any(task not in lm_eval_tasks.LOCAL_TASK_BUILDERS for task in tasks))
        unknown = [task for task in tasks if task not in manager.all_tasks]
        if unknown:
            parser.error(f"--tasks: unknown lm-eval task(s) {', '.join(unknown)}")
        if args.metric is not None:
            try:
                check_metric_reported(tasks, manager, args.metric)
            except ValueError as err:
                model_io.bad_input(parser, str(err))
        model, tokenizer = model_io.load_model_and_tokenizer(args.model_path, dtype, device, args.tokenizer)
        max_length = model_io.resolve_context_length(model, args.max_seq_len)
        metadata = dict(model_path=args.model_path, tasks=tasks, limit=args.limit, num_layers=num_layers,
                        max_seq_len=max_length, metric=args.metric, per_document=args.per_document,
                        layers=layer_indices,
                        drop="performance lost when the layer is removed (positive = worse)")
        done = None
        if args.resume:
            done = json.loads((output_dir / PARTIAL_SWEEP).read_text())
            for key in RESUME_MUST_MATCH:
                if done.get(key) != metadata[key]:
                    parser.error(f"--resume: the unfinished sweep has {key}={done.get(key)!r}, this command "
                                 f"{metadata[key]!r}")
        try:
            rows = sweep(model, tokenizer, tasks, manager, max_length, metric=args.metric,
                         batch_size=args.eval_batch_size, limit=limit, bootstrap_iters=args.bootstrap_iters,
                         layer_indices=layer_indices, per_document=args.per_document, done=done,
                         on_rows=lambda rows, directions: save_partial_sweep(rows, directions, output_dir, metadata))
        except ValueError as err:
            parser.error(str(err))
    for path in save_sweep(rows, output_dir, metadata):
        print(f"wrote {path}")
    return rows


def main(argv: list[str] | None = None):
    parser = build_parser()
    args = parser.parse_args(argv)
    model_io.check_positive(parser, args, "eval_batch_size")
    model_io.check_positive_or_none(parser, args, "max_seq_len")
    try:
        device = model_io.resolve_device(args.device)
        dtype = model_io.resolve_dtype(args.dtype, device)
    except ValueError as err:
        parser.error(str(err))
    if args.sweep:
        return run_sweep(parser, args, device, dtype)
    # A saved pruned model keeps the checkpoint's own dtype unless --dtype says otherwise.
    return run_single(parser, args, device, "auto" if args.dtype == "auto" else dtype)


if __name__ == "__main__":
    main()
