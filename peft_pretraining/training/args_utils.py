"""Command line of torchrun_main.py: parsing and validation.

Flag names and defaults follow the reference implementation so that published commands keep working.
Every bad value ends in a one-line `parser.error` naming the flag; nothing is created or touched here.
"""
import argparse
import fractions
import glob
import json
import math
import os
import re

import torch

from peft_pretraining.cli import OneLineErrorParser
from peft_pretraining.data.wikipedia_corpus import WIKIPEDIA, corpus_paths
from peft_pretraining.model.head_losses import HEAD_LOSSES, liger_import_error
from peft_pretraining.model.modeling_llama import (
    INIT_METHODS,
    NORM_TYPE_ALIASES,
    canonical_norm_type,
    norm_type_choices,
    placement_settings,
)
from peft_pretraining.training import run_folder
from peft_pretraining.training.distributed import DEFAULT_TIMEOUT_MINUTES
from peft_pretraining.training.run_folder import SUPERSEDED_DIR


def model_options() -> tuple[str, ...]:
    """Model options recorded in the checkpoint config: resume takes them from there and refuses a different value.
    Each placement's settings are among them (a row of PLACEMENTS lists its own)."""
    return ("norm_type", "post_num", "init_method", *placement_settings(), "embed_init_std")


MODEL_OPTIONS = model_options()  # as the rows ship; the trainer calls model_options()
DATASET_EMBEDDED = "embedded"
DEFAULT_HUB_TOKENIZER = "t5-base"
# About two years. torch counts a collective's deadline in int64 nanoseconds from now, which overflows near 1.5e8
# minutes (a connect timeout in the past, or a hang); Python's timedelta refuses values above 1.4e12.
MAX_DIST_TIMEOUT_MINUTES = 1_000_000


def default_dtype() -> str:
    """bf16 weights only where bf16 is natively fast: a CUDA device that reports bf16 support.

    On CPU (this machine included) the default is float32: CPU bf16 matmuls are emulated on most chips, and a
    bf16 CPU run would be slower and less accurate for nothing. `--dtype bfloat16` still works there when asked for.
    """
    return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"


def parse_token_count(text: str) -> int:
    """'100M', '1.5B', '20000' -> int (the reference's suffix syntax). Exact decimal arithmetic: in floats '8.2M'
    would be 8199999 tokens."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMbB]?)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"expected a number with an optional K/M/B suffix, got {text!r}")
    scale = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9}[match.group(2).lower()]
    return int(fractions.Fraction(match.group(1)) * scale)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(
        description="Pretrain a LLaMA-style model with a chosen norm placement (Curse of Depth reproduction).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    model = p.add_argument_group("model")
    model.add_argument("--model_config", type=str, default=None,
                       help="model JSON, e.g. configs/llama_130m.json (required unless --continue_from)")
    aliases = ", ".join(f"{alias} = {name}" for alias, name in NORM_TYPE_ALIASES.items())
    model.add_argument("--norm_type", type=str.lower, default=None, choices=norm_type_choices(),
                       help=f"norm placement ({aliases}); env NORM_TYPE is read when the flag is absent (default pre)")
    model.add_argument("--post_num", type=int, default=None,
                       help="Mix-LN (post_pre): the first post_num layers are Post-LN; env POST_NUM when absent")
    model.add_argument("--init_method", type=str.lower, default=None, choices=INIT_METHODS,
                       help="default normal; scaled: o_proj/down_proj std / sqrt(2L); depth_scaled: std / sqrt(2l)")
    for setting in placement_settings().values():  # each placement's own settings, from its row
        kind = dict(type=str.lower, choices=setting.choices) if setting.choices else dict(
            type=int if setting.integer else float)
        model.add_argument(f"--{setting.key}", default=None, nargs=setting.count if setting.count > 1 else None,
                           help=setting.help_text(), **kind)
    model.add_argument("--embed_init_std", type=float, default=None,
                       help="std of the embedding init (default: the config's initializer_range, 0.02; the "
                            "paper's uploaded code used sqrt(2/5) = 0.632)")
    model.add_argument("--activation_checkpointing", action="store_true")

    data = p.add_argument_group("data")
    data.add_argument("--dataset", type=str, default="allenai/c4",
                      help=f"hub dataset streamed by name, '{DATASET_EMBEDDED}' for the offline corpus in data/, or "
                           f"'{WIKIPEDIA}' for the Wikipedia articles in ../shared/data/wikipedia (or "
                           "$WIKIPEDIA_DATA_DIR; docs/data.md)")
    data.add_argument("--dataset_config", type=str, default=None,
                      help="hub dataset config (default: en for allenai/c4, none otherwise)")
    data.add_argument("--dataset_path", type=str, default=None,
                      help="local .txt/.json/.jsonl file or folder of them (overrides --dataset)")
    data.add_argument("--tokenizer", type=str, default=None,
                      help=f"default '{DEFAULT_HUB_TOKENIZER}'; '{DATASET_EMBEDDED}' (the tokenizer in data/) "
                           f"when --dataset {DATASET_EMBEDDED}, '{WIKIPEDIA}' (data/tokenizer_wikipedia/) when "
                           f"--dataset {WIKIPEDIA}")
    data.add_argument("--max_length", type=int, default=256)
    data.add_argument("--packing", action="store_true",
                      help="concatenate documents with EOS into full windows (default: truncate + pad each document)")
    data.add_argument("--workers", type=int, default=8, help="DataLoader worker processes per rank")

    batch = p.add_argument_group("batch")
    batch.add_argument("--batch_size", type=int, required=True, help="micro-batch size per process")
    batch.add_argument("--gradient_accumulation", type=int, default=None)
    batch.add_argument("--total_batch_size", type=int, default=None,
                       help="sequences per update = batch_size * gradient_accumulation * world_size")

    optim = p.add_argument_group("optimisation")
    optim.add_argument("--optimizer", type=str.lower, default="adam", choices=("adam", "adamw"))
    optim.add_argument("--adam_kernel", type=str.lower, default="fused", choices=("fused", "foreach"),
                       help="fused: each update computed in fp32, rounded once (default); foreach: the reference's "
                            "kernel, whose intermediates round to bf16 under --dtype bfloat16")
    optim.add_argument("--lr", type=float, default=1e-4)
    optim.add_argument("--scheduler", type=str.lower, default="cosine", choices=("cosine", "linear"))
    optim.add_argument("--min_lr_ratio", type=float, default=0.1)
    optim.add_argument("--weight_decay", type=float, default=0.0)
    optim.add_argument("--warmup_steps", type=int, default=1_000)
    optim.add_argument("--num_training_steps", type=int, default=10_000, help="number of optimizer updates")
    optim.add_argument("--max_train_tokens", type=parse_token_count, default=None,
                       help="overrides --num_training_steps: ceil(tokens / (total_batch_size * max_length)); "
                            "counts token positions, padding included; K/M/B suffixes allowed")
    optim.add_argument("--grad_clipping", type=float, default=1.0, help="max global grad norm; 0 disables")
    optim.add_argument("--divergence_loss", type=float, default=None,
                       help="also treat a training loss above this value as divergence (off by default)")

    run = p.add_argument_group("evaluation, checkpoints, logging")
    run.add_argument("--eval_every", type=int, default=2_000)
    run.add_argument("--eval_tokens", type=parse_token_count, default=10_000_000,
                     help="evaluate on exactly this many non-pad target tokens of the validation split")
    run.add_argument("--eval_batch_size", type=int, default=None, help="default: --batch_size")
    run.add_argument("--save_every", type=int, default=10_000)
    run.add_argument("--save_dir", type=str, default=None,
                     help="run folder: metrics.jsonl, results.json, loss_curve.png, norm_gains.png and model_<step>/ "
                          "checkpoints "
                          "(default runs/<run_name>-<UTC time>; with --continue_from, the checkpoint's run folder)")
    run.add_argument("--keep_last", type=int, default=None,
                     help="after each successful save, delete all but the newest N resumable checkpoints (default: "
                          "keep all)")
    run.add_argument("--resumable_last", type=int, default=None,
                     help="after each successful save, keep the training state (optimizer, data position) only in the "
                          "newest N checkpoints; older ones keep their weights for the analyses and lm-eval, at a "
                          "third of the disk, but cannot be resumed from (default: every checkpoint resumable)")
    run.add_argument("--continue_from", type=str, default=None,
                     help="checkpoint folder (model_<step>) or a run folder (its latest checkpoint) to resume")
    run.add_argument("--resume", type=str.lower, default=None, choices=("auto",),
                     help="auto: resume --save_dir's latest checkpoint if it has one, else start there afresh; the "
                          "same command serves a job's first launch and its requeues (default --save_dir: "
                          "runs/<run_name>)")
    run.add_argument("--run_name", type=str, default=None)
    run.add_argument("--tags", type=str, default=None, help="comma-separated wandb tags")
    run.add_argument("--wandb_project", type=str, default="cod")
    run.add_argument("--seed", type=int, default=1)

    system = p.add_argument_group("system")
    system.add_argument("--dtype", type=str.lower, default=default_dtype(),
                        choices=("bfloat16", "bf16", "float32", "fp32", "mixed"),
                        help="bfloat16: pure bf16 weights and optimizer state (the paper); mixed: bf16 autocast "
                             "with fp32 master weights and optimizer state; float32")
    system.add_argument("--device", type=str, default="auto", help="auto | cpu | cuda")
    system.add_argument("--fsdp", action="store_true", help="shard with FSDP2 fully_shard instead of DDP")
    system.add_argument("--compile", action="store_true",
                        help="run the wrapped model through torch.compile (the paper's GPU recipes pass it; see "
                             "utils/bench/benchmark_model.py)")
    system.add_argument("--loss", type=str.lower, default="standard", choices=HEAD_LOSSES,
                        help="how the lm_head's loss is computed, the same function each way "
                             "(peft_pretraining/model/head_losses.py): standard (full logits), chunked (a chunk of "
                             "logits at a time, recomputed in backward) or liger (liger-kernel, CUDA only). Standard "
                             "until utils/gpu/gpu_check.sh's losses stage has measured them on a GPU")
    system.add_argument("--no_compile", dest="compile", action="store_false",
                        help="eager, overriding an earlier --compile (run_*.sh compile by default on CUDA)")
    system.add_argument("--dist_timeout_minutes", type=float, default=DEFAULT_TIMEOUT_MINUTES,
                        help="how long a collective waits for the slowest rank before the run fails (the default "
                             "covers rank 0 writing a 1B checkpoint to a slow disk)")
    system.add_argument("--single_gpu", action="store_true",
                        help="accepted for the reference's scripts; changes nothing, since one process never "
                             "gets a DDP wrapper (an error with more than one)")
    return p


def check_save_dir(save_dir: str) -> str | None:
    """Why --save_dir cannot become a run folder (one line), or None. Creates nothing: an existing non-folder, or an
    existing component of its path that is not a folder or not writable (makedirs would fail there). Other failures
    (a read-only filesystem, a full disk) are found when the trainer creates the folder, also in one line."""
    path = os.path.abspath(save_dir)
    if os.path.isdir(path):
        return None
    if os.path.lexists(path):
        return f"--save_dir {save_dir}: exists and is not a folder"
    existing = os.path.dirname(path)
    while not os.path.lexists(existing):  # the deepest part of the path that exists ("/" always does)
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"--save_dir {save_dir}: cannot be created, {existing} is not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"--save_dir {save_dir}: cannot be created, no permission to write in {existing}"
    return None


def _resolve_norm(args, parser, saved: dict):
    """Flag, else environment (NORM_TYPE/POST_NUM, for old scripts), else the resumed checkpoint, else default."""
    if args.norm_type is None and os.environ.get("NORM_TYPE"):
        # The reference lower-cased NORM_TYPE and then compared it with 'LNS', so its LNS branch never ran.
        try:
            args.norm_type = canonical_norm_type(os.environ["NORM_TYPE"])
        except ValueError:
            parser.error(f"environment NORM_TYPE={os.environ['NORM_TYPE']!r} is not one of "
                         f"{', '.join(norm_type_choices())}")
    if args.post_num is None and os.environ.get("POST_NUM", "").strip():
        try:
            args.post_num = int(os.environ["POST_NUM"])
        except ValueError:
            parser.error(f"environment POST_NUM={os.environ['POST_NUM']!r} is not an integer")
    if args.norm_type is None:
        args.norm_type = saved.get("norm_type", "pre")
    args.norm_type = canonical_norm_type(args.norm_type)
    if args.post_num is None:
        args.post_num = saved.get("post_num")
    for option, default in {"init_method": "normal", "embed_init_std": None}.items():
        if getattr(args, option) is None:
            setattr(args, option, saved.get(option, default))
    resolve_placement_settings(args, parser, saved)
    if args.embed_init_std is not None and not (math.isfinite(args.embed_init_std) and args.embed_init_std > 0):
        parser.error(f"--embed_init_std must be a positive number, got {args.embed_init_std}")
    if args.norm_type == "post_pre" and args.post_num is None:
        parser.error("--post_num is required with --norm_type post_pre (how many of the first layers are Post-LN)")
    if args.post_num is None:
        args.post_num = 0


def resolve_placement_settings(args, parser, saved: dict):
    """Each placement setting: the flag, else the checkpoint's (kept only under the same value of the setting it
    depends on: a saved LayerScale init belongs to its form), else its default; checked by its row."""
    resolved = {}
    for key, setting in placement_settings().items():
        value = getattr(args, key)
        if value is None:
            depends_on = setting.depends_on
            same = depends_on is None or saved.get(depends_on, placement_settings()[depends_on].default_for(
                resolved)) == resolved[depends_on]
            value = saved.get(key) if same and saved.get(key) is not None else setting.default_for(resolved)
        try:
            resolved[key] = setting.check(value)
        except ValueError as error:
            parser.error(f"--{key}: {error}")
        setattr(args, key, resolved[key])


def check_saved_config(parser, path: str, saved: dict):
    """The norm settings a checkpoint's config.json hands to this run must be valid values."""
    if not isinstance(saved, dict):
        parser.error(f"--continue_from: {path} is not a JSON object (it holds a {type(saved).__name__})")
    for key, valid in (("norm_type", norm_type_choices()), ("init_method", INIT_METHODS)):
        if key in saved and str(saved[key]).lower() not in valid:
            parser.error(f"--continue_from: {path} has an unknown {key} {saved[key]!r} (valid: {', '.join(valid)})")
    post_num = saved.get("post_num")
    if post_num is not None and (not isinstance(post_num, int) or isinstance(post_num, bool)):
        parser.error(f"--continue_from: {path} has post_num {post_num!r}, not an integer")


def resolve_resume_auto(args, parser):
    """--resume auto: --continue_from --save_dir when it holds a checkpoint; else a fresh start into it."""
    if args.continue_from is not None:
        parser.error("--resume auto and --continue_from exclude each other (--resume auto finds the checkpoint in "
                     "--save_dir)")
    if args.save_dir is None:
        if args.run_name is None:
            parser.error("--resume auto needs --save_dir, or --run_name for runs/<run_name>: a requeued job must "
                         "find the same folder")
        args.save_dir = os.path.join("runs", args.run_name)
    if os.path.isdir(args.save_dir) and run_folder.find_checkpoint(args.save_dir) is not None:
        args.continue_from = args.save_dir


def _check_numbers(args, parser):
    """Finite floats, the seed's range, a positive --divergence_loss; --dtype's short names spelled out."""
    args.dtype = {"bf16": "bfloat16", "fp32": "float32"}.get(args.dtype, args.dtype)
    for action in parser._actions:  # nan passes every range check below (nan <= 0 is False), inf most of them
        value = getattr(args, action.dest, None)
        if action.type is float and value is not None and not math.isfinite(value):
            parser.error(f"{action.option_strings[0]} must be a finite number, got {value}")
    if not 0 <= args.seed < 2**32:
        parser.error(f"--seed must be between 0 and 2**32 - 1 (numpy's seed range), got {args.seed}")
    if args.divergence_loss is not None and not args.divergence_loss > 0:  # a cross-entropy is never below 0
        parser.error(f"--divergence_loss must be positive (it would stop every run at its first update), got "
                     f"{args.divergence_loss:g}")


def _resolve_checkpoint(args, parser):
    """--resume auto and --continue_from: the checkpoint itself (a run folder's newest), complete."""
    if args.resume == "auto":
        resolve_resume_auto(args, parser)
    if args.continue_from is not None:
        checkpoint = run_folder.find_checkpoint(args.continue_from)
        if checkpoint is None and os.path.isfile(os.path.join(args.continue_from, "metrics.jsonl")):
            parser.error(f"--continue_from {args.continue_from}: the run stopped before its first checkpoint, so "
                         f"there is nothing to resume; start it again with --save_dir {args.continue_from} and "
                         f"without --continue_from")
        if checkpoint is None:
            what = "does not exist" if not os.path.exists(args.continue_from) else \
                f"holds no checkpoint ({run_folder.TRAINING_STATE_FILE} missing)"
            parser.error(f"--continue_from {args.continue_from}: {what}")
        args.continue_from = checkpoint
        for needed in ("config.json", run_folder.TRAINING_STATE_FILE):
            if not os.path.isfile(os.path.join(checkpoint, needed)):
                parser.error(f"--continue_from {checkpoint}: incomplete checkpoint, {needed} missing")
        if not glob.glob(os.path.join(checkpoint, "*.safetensors")):
            parser.error(f"--continue_from {checkpoint}: incomplete checkpoint, no *.safetensors weights")


def _resolve_model(args, parser):
    """The norm placement (the checkpoint's, unless overridden) and --model_config (the checkpoint's by default),
    read and checked against --post_num."""
    saved_config = {}
    if args.continue_from is not None:
        try:
            with open(os.path.join(args.continue_from, "config.json")) as f:
                saved_config = json.load(f)
        except (OSError, ValueError) as err:
            parser.error(f"--continue_from: {os.path.join(args.continue_from, 'config.json')} cannot be read as "
                         f"JSON ({err})")
        check_saved_config(parser, os.path.join(args.continue_from, "config.json"), saved_config)
    _resolve_norm(args, parser, saved_config)

    if args.model_config is None:
        if args.continue_from is None:
            parser.error("--model_config is required (e.g. configs/llama_130m.json)")
        args.model_config = os.path.join(args.continue_from, "config.json")
    if not os.path.isfile(args.model_config):
        parser.error(f"--model_config {args.model_config}: file not found")
    try:
        with open(args.model_config) as f:
            model_json = json.load(f)
        num_layers = int(model_json["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        parser.error(f"--model_config {args.model_config}: not a model config JSON ({err.__class__.__name__}: {err})")
    if not 0 <= args.post_num <= num_layers:
        parser.error(f"--post_num {args.post_num}: must be between 0 and num_hidden_layers={num_layers}")


def _resolve_data(args, parser):
    """--dataset_path exists (a named local corpus: its train folder); --tokenizer defaults to the dataset's own."""
    if args.dataset_path is not None and not os.path.exists(args.dataset_path):
        parser.error(f"--dataset_path {args.dataset_path}: no such file or folder")
    if args.dataset == WIKIPEDIA and args.dataset_path is None:  # a named local corpus: its train folder
        try:
            args.dataset_path = str(corpus_paths()[0])
        except ValueError as error:
            parser.error(f"--dataset {WIKIPEDIA}: {error}")
    if args.tokenizer is None:
        args.tokenizer = (args.dataset if args.dataset in (DATASET_EMBEDDED, WIKIPEDIA) else DEFAULT_HUB_TOKENIZER)


def _check_ranges(args, parser):
    """Counts, rates and retention flags within their ranges."""
    for flag in ("batch_size", "max_length", "eval_every", "save_every", "eval_tokens"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag} must be positive, got {getattr(args, flag)}")
    for flag in ("gradient_accumulation", "total_batch_size", "eval_batch_size"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            parser.error(f"--{flag} must be positive, got {getattr(args, flag)}")
    if args.keep_last is not None and args.keep_last < 1:
        parser.error(f"--keep_last must be >= 1 (the newest checkpoint is always kept), got {args.keep_last}")
    if args.resumable_last is not None and args.resumable_last < 1:
        parser.error(f"--resumable_last must be >= 1 (the newest checkpoint always resumes), got {args.resumable_last}")
    if args.workers < 0:
        parser.error(f"--workers must be >= 0, got {args.workers}")
    if args.lr <= 0:
        parser.error(f"--lr must be positive, got {args.lr}")
    if not 0 <= args.min_lr_ratio <= 1:
        parser.error(f"--min_lr_ratio must be in [0, 1], got {args.min_lr_ratio}")
    if args.grad_clipping < 0:
        parser.error(f"--grad_clipping must be >= 0 (0 disables), got {args.grad_clipping}")
    if args.weight_decay < 0:
        parser.error(f"--weight_decay must be >= 0, got {args.weight_decay}")


def _resolve_batch_sizes(args, parser, world_size: int):
    """Batch arithmetic: total = micro-batch x accumulation x world size, exactly; --eval_batch_size defaults to
    --batch_size."""
    per_step = args.batch_size * world_size
    if args.gradient_accumulation is None and args.total_batch_size is None:
        args.gradient_accumulation = 1
    if args.gradient_accumulation is None:
        if args.total_batch_size % per_step != 0:
            parser.error(f"--total_batch_size {args.total_batch_size} is not divisible by --batch_size "
                         f"{args.batch_size} x world size {world_size}")
        args.gradient_accumulation = args.total_batch_size // per_step
    if args.total_batch_size is None:
        args.total_batch_size = per_step * args.gradient_accumulation
    if per_step * args.gradient_accumulation != args.total_batch_size:
        parser.error(f"--total_batch_size {args.total_batch_size} != --batch_size {args.batch_size} x "
                     f"--gradient_accumulation {args.gradient_accumulation} x world size {world_size}")
    if args.eval_batch_size is None:
        args.eval_batch_size = args.batch_size


def _resolve_run_length(args, parser):
    """--num_training_steps (or --max_train_tokens in tokens) and --warmup_steps below it."""
    if args.max_train_tokens is not None:
        if args.max_train_tokens <= 0:
            parser.error(f"--max_train_tokens must be positive, got {args.max_train_tokens}")
        args.num_training_steps = math.ceil(args.max_train_tokens / (args.total_batch_size * args.max_length))
    if args.num_training_steps <= 0:
        parser.error(f"--num_training_steps must be positive, got {args.num_training_steps}")
    if not 0 <= args.warmup_steps < args.num_training_steps:
        parser.error(f"--warmup_steps {args.warmup_steps} must be >= 0 and below --num_training_steps "
                     f"{args.num_training_steps}")


def _check_devices(args, parser, world_size: int):
    """Wrapping, timeout and device flags that this machine and world size can honour."""
    if args.single_gpu and world_size > 1:
        parser.error(f"--single_gpu trains without DDP and needs one process, but world size is {world_size}")
    if args.fsdp and args.single_gpu:
        parser.error("--fsdp and --single_gpu exclude each other")
    if not 0 < args.dist_timeout_minutes <= MAX_DIST_TIMEOUT_MINUTES:
        parser.error(f"--dist_timeout_minutes must be positive and at most {MAX_DIST_TIMEOUT_MINUTES:,}, got "
                     f"{args.dist_timeout_minutes:g}")
    if args.device not in ("auto", "cpu", "cuda"):
        parser.error(f"--device must be auto, cpu or cuda, got {args.device!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    if args.loss == "liger":
        if args.device == "cpu" or not torch.cuda.is_available():
            parser.error("--loss liger: liger-kernel's fused loss runs on CUDA only (chunked saves the same memory "
                         "on the CPU)")
        if liger_import_error():
            parser.error(f"--loss liger: {liger_import_error()}; pip install liger-kernel")


def _resolve_run_folder(args, parser):
    """--run_name, and --save_dir (the checkpoint's run folder by default): usable, not locked, and not holding
    another run."""
    if args.run_name is None:
        stem = os.path.splitext(os.path.basename(args.model_config))[0].removeprefix("llama_")
        suffix = f"{args.post_num}" if args.norm_type == "post_pre" else ""
        args.run_name = f"{stem}_{args.norm_type}{suffix}_lr{args.lr:g}"
    if args.save_dir is None and args.continue_from is not None:
        args.save_dir = os.path.dirname(os.path.abspath(args.continue_from))  # keep writing into the same run folder
        if os.path.basename(args.save_dir) == SUPERSEDED_DIR:
            parser.error(f"--continue_from {args.continue_from}: a superseded checkpoint; pass a new --save_dir "
                         f"to branch from it")
    unusable = check_save_dir(args.save_dir) if args.save_dir is not None else None
    if unusable is not None:
        parser.error(unusable)
    if args.save_dir is not None:
        holder = run_folder.lock_holder(args.save_dir)
        if holder is not None:
            parser.error(run_folder.busy_message(args.save_dir, holder))
    if args.save_dir is not None and args.continue_from is None and run_folder.holds_a_run(args.save_dir):
        if run_folder.find_checkpoint(args.save_dir) is None:
            parser.error(f"--save_dir {args.save_dir} already holds a run that ended without a checkpoint "
                         f"(results.json); choose another --save_dir")
        parser.error(f"--save_dir {args.save_dir} already holds a run; pass --continue_from {args.save_dir} to "
                     f"resume it or choose another --save_dir")
    if args.save_dir is not None and args.continue_from is not None and \
            run_folder.branches_into_another_run(args.continue_from, args.save_dir):
        parser.error(run_folder.branch_refusal(args.continue_from, args.save_dir))


def check_args(args, parser, world_size: int):
    """Validate and fill derived values; every failure is parser.error (exit 2, one line naming the flag)."""
    _check_numbers(args, parser)
    _resolve_checkpoint(args, parser)
    _resolve_model(args, parser)
    _resolve_data(args, parser)
    _check_ranges(args, parser)
    _resolve_batch_sizes(args, parser, world_size)
    _resolve_run_length(args, parser)
    _check_devices(args, parser, world_size)
    _resolve_run_folder(args, parser)
    return args


def parse_args(argv=None, world_size: int | None = None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return check_args(args, parser, world_size)
