"""Supervised fine-tuning (full or LoRA) on instruction data, then zero-shot evaluation with lm-eval.

    # GPU node, the paper's SFT setting: Commonsense170K from the hub, LoRA, the eight commonsense tasks + MMLU
    python utils/finetune.py --model_path runs/1b_lns/model_100000 --dataset zwhe99/commonsense_170k \
        --output_dir sft/llama_1b_lns
    # offline: a local LLM-Adapters JSON, the multiple-choice task built from the embedded corpus
    python utils/finetune.py --model_path runs/tiny_lns/model_150 --dataset my_instructions.json \
        --output_dir sft/tiny --eval_tasks embedded_next_sentence

Data: LLM-Adapters records (instruction, input, output, answer); only the response tokens carry loss.
Model: one of our checkpoints (config.json has norm_type) or any HF causal LM; --apply_lns adds LayerNorm
Scaling to a stock Llama/Mistral/Qwen2/Qwen3 (peft_pretraining.model.layernorm_scaling).
Outputs under --output_dir: adapter/ (LoRA) or model/ (full), merged/ (LoRA with --save_merged),
checkpoint-<step>/ every --save_every updates, train_metrics.jsonl + train_loss.png, and
results.{json,csv,png} with a markdown table printed at the end.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from peft_pretraining.cli import OneLineErrorParser
from peft_pretraining.data.lm_eval_tasks import (
    EMBEDDED_HELDOUT,
    LOCAL_TASK_BUILDERS,
    NEXT_SENTENCE_TASK,
    build_local_tasks,
)
from peft_pretraining.data.sft_data import (
    IGNORE_INDEX,
    SFTCollator,
    load_instruction_dataset,
    tokenize_dataset,
)
from peft_pretraining.model.layernorm_scaling import (
    apply_layernorm_scaling,
    fold_layernorm_scaling,
    has_layernorm_scaling,
)
from peft_pretraining.training.metrics_file import MetricsFile
from peft_pretraining.training.optimization import build_scheduler
from peft_pretraining.training.plots import plot_loss_curve
from peft_pretraining.training.rng import seed_everything
from peft_pretraining.training.wandb_logging import init_wandb
from utils.instruments.model_io import (
    bad_input,
    hub_is_reachable,
    load_model_and_tokenizer,
    resolve_context_length,
    resolve_device,
)

REPO_ROOT = Path(__file__).resolve().parent.parent

# The paper's SFT evaluation (lm-eval task names); "siqa" is lm-eval's social_iqa.
PAPER_TASKS = ("boolq", "piqa", "social_iqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge", "openbookqa")
TASK_ALIASES = {"siqa": "social_iqa", "arc_e": "arc_easy", "arc_c": "arc_challenge", "obqa": "openbookqa"}
DEFAULT_LORA_TARGETS = "q_proj,k_proj,v_proj,up_proj,down_proj"
ARGS_FILE = "finetune_args.json"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_argument_group("model")
    model.add_argument("--model_path", required=True, help="our checkpoint folder, an HF folder or a hub id")
    model.add_argument("--tokenizer", default=None, help="default: the model's own, else data/tokenizer")
    model.add_argument("--apply_lns", action="store_true",
                       help="add LayerNorm Scaling (1/sqrt(l) after each block norm) to a stock HF decoder")

    data = parser.add_argument_group("data")
    data.add_argument("--dataset", default=None,
                      help="local .json/.jsonl in the LLM-Adapters format, or a hub dataset (zwhe99/commonsense_170k)")
    data.add_argument("--dataset_split", default="train")
    data.add_argument("--max_train_samples", type=int, default=None)
    data.add_argument("--cutoff_len", type=int, default=256, help="max tokens per example (prompt + response)")

    method = parser.add_argument_group("method")
    method.add_argument("--finetune", choices=("lora", "full"), default="lora")
    method.add_argument("--lora_r", type=int, default=32)
    method.add_argument("--lora_alpha", type=int, default=64)
    method.add_argument("--lora_dropout", type=float, default=0.05)
    method.add_argument("--lora_target_modules", default=DEFAULT_LORA_TARGETS,
                        help="comma-separated module names to adapt")

    train = parser.add_argument_group("training")
    train.add_argument("--lr", type=float, default=3e-4)
    train.add_argument("--weight_decay", type=float, default=0.0)
    train.add_argument("--warmup_steps", type=int, default=100, help="capped at a tenth of the updates")
    train.add_argument("--min_lr_ratio", type=float, default=0.0, help="cosine decays to lr * this")
    train.add_argument("--max_grad_norm", type=float, default=1.0, help="0 disables clipping")
    train.add_argument("--batch_size", type=int, default=16, help="examples per optimizer update")
    train.add_argument("--micro_batch_size", type=int, default=4,
                       help="examples per forward pass; batch_size / micro_batch_size = accumulation steps")
    train.add_argument("--num_epochs", type=float, default=3.0)
    train.add_argument("--max_steps", type=int, default=None, help="updates; overrides --num_epochs")
    train.add_argument("--save_every", type=int, default=0, help="checkpoint every N updates (0: final only)")
    train.add_argument("--gradient_checkpointing", action="store_true")
    train.add_argument("--mixed_precision", choices=("auto", "bf16", "no"), default="auto",
                       help="bf16 autocast; auto = bf16 on a CUDA device with bf16, none on CPU")
    train.add_argument("--device", default="auto")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--eval_only", action="store_true", help="skip training, evaluate --model_path as is")
    train.add_argument("--save_merged", action="store_true", help="LoRA: also save the merged full model")

    evaluation = parser.add_argument_group("evaluation (lm-eval)")
    evaluation.add_argument("--eval_tasks", default="auto",
                            help="comma-separated lm-eval tasks; 'paper' = the eight commonsense tasks, "
                                 f"local tasks ({', '.join(LOCAL_TASK_BUILDERS)}) are built from the embedded corpus; "
                                 "'none' = skip; "
                                 "auto = paper,mmlu online and the local task offline")
    evaluation.add_argument("--eval_limit", type=float, default=None, help="examples per task (lm-eval --limit)")
    evaluation.add_argument("--eval_batch_size", type=int, default=16)
    evaluation.add_argument("--max_seq_len", type=int, default=None,
                            help="most tokens lm-eval feeds the model at once (default: the length the model was "
                                 "pretrained at, config train_max_length; for hub models, max_position_embeddings)")
    evaluation.add_argument("--table_metric", choices=("acc", "acc_norm"), default="acc")
    evaluation.add_argument("--mc_corpus", default=str(EMBEDDED_HELDOUT),
                            help=f"passages for {NEXT_SENTENCE_TASK} (.jsonl[.gz] with text, or .txt[.gz])")
    evaluation.add_argument("--mc_examples", type=int, default=500)

    run = parser.add_argument_group("run")
    run.add_argument("--output_dir", required=True)
    run.add_argument("--overwrite", action="store_true", help="allow an --output_dir that already holds results")
    run.add_argument("--wandb_project", default="cod-sft")
    run.add_argument("--run_name", default=None)
    return parser


def resolve_tasks(spec: str, offline: bool) -> list[str]:
    if spec == "none":
        return []
    if spec == "auto":
        spec = NEXT_SENTENCE_TASK if offline else "paper,mmlu"
    tasks = []
    for name in (part.strip() for part in spec.split(",") if part.strip()):
        expanded = PAPER_TASKS if name == "paper" else [TASK_ALIASES.get(name, name)]
        tasks += [task for task in expanded if task not in tasks]
    return tasks


def check_args(args, parser: argparse.ArgumentParser):
    if not args.eval_only and not args.dataset:
        parser.error("--dataset is required unless --eval_only")
    for flag in ("lora_r", "lora_alpha", "batch_size", "micro_batch_size", "cutoff_len", "eval_batch_size",
                 "mc_examples"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag} must be positive, got {getattr(args, flag)}")
    if args.batch_size % args.micro_batch_size:
        parser.error(f"--batch_size {args.batch_size} is not a multiple of --micro_batch_size {args.micro_batch_size}")
    if args.max_steps is not None and args.max_steps <= 0:
        parser.error(f"--max_steps must be positive, got {args.max_steps}")
    if args.max_seq_len is not None and args.max_seq_len < 1:
        parser.error(f"--max_seq_len must be positive, got {args.max_seq_len}")
    if args.eval_limit is not None and not (args.eval_limit > 0 and (args.eval_limit < 1
                                                                     or float(args.eval_limit).is_integer())):
        parser.error(f"--eval_limit must be a whole count or a fraction in (0, 1), got {args.eval_limit:g}")
    if args.num_epochs <= 0:
        parser.error(f"--num_epochs must be positive, got {args.num_epochs}")
    if not 0.0 <= args.lora_dropout < 1.0:
        parser.error(f"--lora_dropout must be in [0, 1), got {args.lora_dropout}")
    if args.lr <= 0 or args.warmup_steps < 0 or args.save_every < 0 or not 0.0 <= args.min_lr_ratio <= 1.0:
        parser.error("--lr must be > 0, --warmup_steps/--save_every >= 0 and --min_lr_ratio in [0, 1]")
    args.lora_target_modules = [name.strip() for name in args.lora_target_modules.split(",") if name.strip()]
    if args.finetune == "lora" and not args.lora_target_modules:
        parser.error("--lora_target_modules is empty")
    # Probed, not only read from the environment: a machine without network and without HF_HUB_OFFLINE would
    # otherwise train first and fail at evaluation.
    offline = args.eval_tasks != "none" and not hub_is_reachable()
    args.eval_tasks = resolve_tasks(args.eval_tasks, offline)
    if NEXT_SENTENCE_TASK in args.eval_tasks and not os.path.isfile(args.mc_corpus):
        parser.error(f"--mc_corpus {args.mc_corpus}: no such file (needed by {NEXT_SENTENCE_TASK})")
    if offline:
        hub_tasks = [task for task in args.eval_tasks if task not in LOCAL_TASK_BUILDERS]
        if hub_tasks:
            parser.error(f"--eval_tasks {','.join(hub_tasks)} need the hub, which is offline here; "
                         f"use --eval_tasks {NEXT_SENTENCE_TASK}")
    output = Path(args.output_dir)
    if (output / ARGS_FILE).exists() and not args.overwrite:
        parser.error(f"--output_dir {output} already holds a fine-tuning run ({ARGS_FILE}); "
                     "pass --overwrite or choose another folder")


# ----------------------------------------------------------------------------- model
def prepare_model(args, parser, device):
    model, tokenizer = load_model_and_tokenizer(args.model_path, dtype=torch.float32, device=device,
                                                tokenizer_path=args.tokenizer)
    if args.apply_lns:
        try:
            apply_layernorm_scaling(model)
        except ValueError as err:
            parser.error(f"--apply_lns: {err}")
    if args.eval_only:
        return model.eval(), tokenizer
    trained = getattr(model.config, "train_max_length", None)
    if trained is not None and args.cutoff_len > trained:
        print(f"[finetune] warning: --cutoff_len {args.cutoff_len} exceeds the context the model was pretrained at "
              f"({trained}); longer examples train positions it never saw (evaluation stays at {trained})")
    if args.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if args.finetune == "lora":
        model = add_lora(model, args, parser)
    return model.train(), tokenizer


def add_lora(model, args, parser):
    from peft import LoraConfig, get_peft_model

    leaf_names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                  if isinstance(module, torch.nn.Linear)}
    unknown = [name for name in args.lora_target_modules if name not in leaf_names]
    if unknown:
        parser.error(f"--lora_target_modules: {', '.join(unknown)} not in the model (linear layers: "
                     f"{', '.join(sorted(leaf_names))})")
    config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                        target_modules=args.lora_target_modules, bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def response_loss_sum(model, batch: dict) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy over response tokens (position t predicts labels[t+1]), and their count.

    Computed here from the logits rather than taken from the model, so accumulation weights every response token
    equally whatever each architecture's loss convention is.
    """
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    targets = batch["labels"][:, 1:]
    loss_sum = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(),
                               ignore_index=IGNORE_INDEX, reduction="sum")
    return loss_sum, int((targets != IGNORE_INDEX).sum())


def autocast_context(args, device):
    use_bf16 = args.mixed_precision == "bf16" or (
        args.mixed_precision == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported())
    if use_bf16:
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def save_model_dir(model, tokenizer, directory: Path):
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


# ----------------------------------------------------------------------------- training
def load_training_data(args, parser):
    """The instruction records, or a one-line error naming --dataset (before any model is loaded or file written)."""
    try:
        return load_instruction_dataset(args.dataset, args.dataset_split, args.max_train_samples)
    except ValueError as err:
        bad_input(parser, str(err))
    except Exception as err:  # datasets' own errors for a file it cannot parse
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
        bad_input(parser, f"--dataset {args.dataset}: cannot be read as instruction records "
                          f"({err.__class__.__name__}: {first_line[:160]})")


def tokenize_training_data(dataset, tokenizer, args, parser):
    tokenized = tokenize_dataset(dataset, tokenizer, args.cutoff_len)
    if len(tokenized) == 0:
        bad_input(parser, f"--dataset {args.dataset}: no example has a response token within --cutoff_len "
                          f"{args.cutoff_len}")
    return tokenized


def train(model, tokenizer, tokenized, args, device, wandb_run) -> dict:
    accumulation = args.batch_size // args.micro_batch_size
    generator = torch.Generator().manual_seed(args.seed)
    loader = torch.utils.data.DataLoader(tokenized.with_format(columns=["input_ids", "labels"]),
                                         batch_size=args.micro_batch_size, shuffle=True, drop_last=False,
                                         collate_fn=SFTCollator(tokenizer.pad_token_id), generator=generator)
    updates_per_epoch = max(1, len(loader) // accumulation)
    total_updates = args.max_steps or max(1, math.ceil(args.num_epochs * updates_per_epoch))
    warmup = min(args.warmup_steps, total_updates // 10)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    scheduler = build_scheduler(optimizer, scheduler_type="cosine", num_training_steps=total_updates,
                                warmup_steps=warmup, min_lr_ratio=args.min_lr_ratio)
    autocast = autocast_context(args, device)
    output = Path(args.output_dir)
    metrics = MetricsFile(str(output / "train_metrics.jsonl"))
    print(f"[finetune] {len(tokenized)} examples, {total_updates} updates of {args.batch_size} "
          f"({accumulation} x {args.micro_batch_size}), warmup {warmup}, "
          f"{sum(p.numel() for p in params):,} trainable parameters")

    def micro_batches():
        while True:  # epochs roll over until the update budget is spent
            yield from loader

    stream = micro_batches()
    model.train()
    progress = tqdm(range(1, total_updates + 1), desc="fine-tuning", unit="update")
    for step in progress:
        batches = [next(stream) for _ in range(accumulation)]
        num_tokens = sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in batches)
        total_loss = 0.0
        for batch in batches:
            batch = {key: value.to(device) for key, value in batch.items()}
            with autocast():
                loss_sum, _ = response_loss_sum(model, batch)
            (loss_sum / num_tokens).backward()
            total_loss += loss_sum.item()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm if args.max_grad_norm > 0 else math.inf)
        lr = scheduler.get_last_lr()[0]  # the lr this update uses
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        row = {"step": step, "loss": total_loss / num_tokens, "lr": lr,
               "grad_norm": float(grad_norm), "response_tokens": num_tokens}
        metrics.write(row)
        if wandb_run is not None:
            wandb_run.log({f"train/{key}": value for key, value in row.items() if key != "step"}, step=step)
        progress.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}")
        if args.save_every and step % args.save_every == 0 and step < total_updates:
            save_model_dir(model, tokenizer, output / f"checkpoint-{step}")
    metrics.close()
    plot_loss_curve(str(output / "train_metrics.jsonl"), str(output / "train_loss.png"),
                    title=f"SFT ({args.finetune}) response-token loss")
    return {"updates": total_updates, "examples": len(tokenized)}


def export_final(model, tokenizer, args):
    """Saves adapters (LoRA) or the model (full); returns the plain model to evaluate.

    LNS hooks are folded into the norm gains before a full model is written, so model/ and merged/ load as
    ordinary HF checkpoints with unchanged outputs. Adapters were trained on the hooked base: reload them onto a
    base with apply_layernorm_scaling (finetune_args.json records apply_lns).
    """
    output = Path(args.output_dir)
    if args.finetune == "lora":
        save_model_dir(model, tokenizer, output / "adapter")
        model = model.merge_and_unload()
    if has_layernorm_scaling(model):
        fold_layernorm_scaling(model)
    if args.finetune == "full":
        save_model_dir(model, tokenizer, output / "model")
    elif args.save_merged:
        save_model_dir(model, tokenizer, output / "merged")
    return model.eval()


# ----------------------------------------------------------------------------- evaluation
def evaluate_tasks(model, tokenizer, args) -> dict:
    """lm-eval's Python API on the in-memory model; returns {task: {metric: value}}."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    task_dir = Path(args.output_dir).resolve() / "lm_eval_tasks"
    max_length = resolve_context_length(model, args.max_seq_len)
    options = {NEXT_SENTENCE_TASK: {"text_file": args.mc_corpus, "num_examples": args.mc_examples, "seed": args.seed,
                                    "tokenizer": tokenizer, "max_choice_tokens": max_length - 1}}
    local_folders = [str(folder) for folder in build_local_tasks(args.eval_tasks, task_dir, options)]
    needs_builtin = any(task not in LOCAL_TASK_BUILDERS for task in args.eval_tasks)
    # Scanning lm-eval's own task tree takes seconds; skip it when every task is one of ours.
    task_manager = TaskManager(include_path=local_folders or None, include_defaults=needs_builtin)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=args.eval_batch_size, max_length=max_length)
    limit = int(args.eval_limit) if args.eval_limit and args.eval_limit >= 1 else args.eval_limit
    output = simple_evaluate(model=lm, tasks=list(args.eval_tasks), task_manager=task_manager, limit=limit,
                             log_samples=False, random_seed=args.seed, numpy_random_seed=args.seed,
                             torch_random_seed=args.seed, fewshot_random_seed=args.seed)
    results = {}
    for task in args.eval_tasks:
        raw = output["results"].get(task) or output.get("groups", {}).get(task) or {}
        results[task] = {key.split(",")[0]: value for key, value in raw.items()
                         if "," in key and isinstance(value, (int, float))}
        results[task]["num_examples"] = output.get("n-samples", {}).get(task, {}).get("effective")
    return results


def write_results(results: dict, args, model_label: str) -> str:
    """results.json (everything), results.csv (one row, a column per task), results.png; returns markdown."""
    output = Path(args.output_dir)
    metric = args.table_metric
    scores = {task: values.get(metric) for task, values in results.items()}
    valid = [value for value in scores.values() if value is not None]
    average = sum(valid) / len(valid) if valid else None
    payload = {"model": model_label, "finetune": None if args.eval_only else args.finetune,
               "apply_lns": args.apply_lns, "table_metric": metric, "average": average, "tasks": results}
    (output / "results.json").write_text(json.dumps(payload, indent=2))

    header, row = ["model"], [model_label]
    for task, values in results.items():
        if scores[task] is not None:
            header.append(task)
            row.append(f"{100 * scores[task]:.2f}")
        else:  # e.g. a perplexity task: its first metric, as is
            other = next((key for key in values if not key.endswith("_stderr") and key != "num_examples"), None)
            header.append(f"{task} ({other})" if other else task)
            row.append(f"{values[other]:.4g}" if other else "")
    header.append(f"average {metric}")
    row.append("" if average is None else f"{100 * average:.2f}")
    (output / "results.csv").write_text(",".join(header) + "\n" + ",".join(row) + "\n")
    plot_results(scores, output / "results.png", f"{model_label}: {metric} (%)")
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header), "| " + " | ".join(row) + " |"])


def plot_results(scores: dict, png_path: Path, title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [name for name, score in scores.items() if score is not None]
    values = [100 * scores[name] for name in names]
    fig, ax = plt.subplots(figsize=(max(4, 1.1 * len(names) + 1), 4))
    bars = ax.bar(names, values, color="tab:blue")
    ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(0, 100)
    ax.set_title(title)
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- main
PREVIOUS_RUN_FILES = (ARGS_FILE, "train_metrics.jsonl", "train_loss.png", "results.json", "results.csv", "results.png")
PREVIOUS_RUN_FOLDERS = ("adapter", "model", "merged")


def clear_previous_run(output: Path, args) -> None:
    """--overwrite: remove what an earlier run wrote here (metrics would otherwise be appended to, and results or
    weights of another configuration left beside the new ones). With --eval_only only the results go: the weights
    may be what is evaluated. A folder holding, or inside, --model_path or --tokenizer is never removed."""
    results = ("results.json", "results.csv", "results.png")
    for name in results if args.eval_only else PREVIOUS_RUN_FILES:
        (output / name).unlink(missing_ok=True)
    if args.eval_only:
        return
    inputs = [Path(path).resolve() for path in (args.model_path, args.tokenizer) if path and Path(path).exists()]
    for folder in [*(output / name for name in PREVIOUS_RUN_FOLDERS), *output.glob("checkpoint-*")]:
        resolved = folder.resolve()
        if folder.is_dir() and not any(resolved == path or resolved in path.parents or path in resolved.parents
                                       for path in inputs):
            shutil.rmtree(folder)


def run(argv=None) -> dict:
    """Everything main() does; returns the evaluated model, tokenizer and results (tests call this)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(args, parser)
    try:
        device = resolve_device(args.device)
    except ValueError as err:
        parser.error(str(err))
    seed_everything(args.seed)
    dataset = None if args.eval_only else load_training_data(args, parser)
    model, tokenizer = prepare_model(args, parser, device)
    tokenized = None if args.eval_only else tokenize_training_data(dataset, tokenizer, args, parser)
    output = Path(args.output_dir)  # written only now, once every input has been read
    if args.overwrite:
        clear_previous_run(output, args)
    output.mkdir(parents=True, exist_ok=True)
    (output / ARGS_FILE).write_text(json.dumps(vars(args), indent=2, default=str))
    model_label = args.run_name or f"{Path(args.model_path).name}{'+lns' if args.apply_lns else ''}"
    summary = {"args": vars(args)}
    wandb_run = init_wandb(project=args.wandb_project, run_name=model_label, config=vars(args), tags=["sft"],
                           run_dir=str(output))
    try:
        if not args.eval_only:
            started = time.time()
            summary["train"] = train(model, tokenizer, tokenized, args, device, wandb_run)
            summary["train"]["seconds"] = time.time() - started
            model = export_final(model, tokenizer, args)
        results = evaluate_tasks(model, tokenizer, args) if args.eval_tasks else {}
        if results:
            table = write_results(results, args, model_label)
            print(table)
            if wandb_run is not None:
                wandb_run.log({f"eval/{task}/{key}": value for task, values in results.items()
                               for key, value in values.items() if isinstance(value, (int, float))})
    finally:
        if wandb_run is not None:
            wandb_run.finish()
    summary.update(model=model, tokenizer=tokenizer, results=results)
    return summary


def main(argv=None):
    run(argv)


if __name__ == "__main__":
    main()
