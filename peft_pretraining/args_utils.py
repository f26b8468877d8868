"""Command line of torchrun_main.py: parsing and validation.

Flag names and defaults follow the reference implementation so that published commands keep working.
Every bad value ends in a one-line `parser.error` naming the flag; nothing is created or touched here.
"""
import argparse
import glob
import json
import math
import os
import re

import torch

from peft_pretraining.distributed import DEFAULT_TIMEOUT_MINUTES
from peft_pretraining.modeling_llama import INIT_METHODS, NORM_TYPES

DATASET_EMBEDDED = "embedded"
DEFAULT_HUB_TOKENIZER = "t5-base"
TRAINING_STATE_FILE = "training_state.pt"
CHECKPOINT_PREFIX = "model_"


def default_dtype() -> str:
    """bf16 weights only where bf16 is natively fast: a CUDA device that reports bf16 support.

    On CPU (this machine included) the default is float32: CPU bf16 matmuls are emulated on most chips, and a
    bf16 CPU run would be slower and less accurate for nothing. `--dtype bfloat16` still works there when asked for.
    """
    return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"


def parse_token_count(text: str) -> int:
    """'100M', '1.5B', '20000' -> int (the reference's suffix syntax)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMbB]?)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"expected a number with an optional K/M/B suffix, got {text!r}")
    scale = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9}[match.group(2).lower()]
    return int(float(match.group(1)) * scale)


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but an error is one line (no usage block): `torchrun_main.py: error: --flag ...`, exit code 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(
        description="Pretrain a LLaMA-style model with a chosen norm placement (Curse of Depth reproduction).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    model = p.add_argument_group("model")
    model.add_argument("--model_config", type=str, default=None,
                       help="model JSON, e.g. configs/llama_130m.json (required unless --continue_from)")
    model.add_argument("--norm_type", type=str.lower, default=None, choices=NORM_TYPES,
                       help="norm placement; env NORM_TYPE is read when the flag is absent (default pre)")
    model.add_argument("--post_num", type=int, default=None,
                       help="Mix-LN (post_pre): the first post_num layers are Post-LN; env POST_NUM when absent")
    model.add_argument("--init_method", type=str.lower, default=None, choices=INIT_METHODS, help="default normal")
    model.add_argument("--activation_checkpointing", action="store_true")

    data = p.add_argument_group("data")
    data.add_argument("--dataset", type=str, default="allenai/c4",
                      help=f"hub dataset streamed by name, or '{DATASET_EMBEDDED}' for the offline corpus in data/")
    data.add_argument("--dataset_config", type=str, default=None,
                      help="hub dataset config (default: en for allenai/c4, none otherwise)")
    data.add_argument("--dataset_path", type=str, default=None,
                      help="local .txt/.json/.jsonl file or folder of them (overrides --dataset)")
    data.add_argument("--tokenizer", type=str, default=None,
                      help=f"default '{DEFAULT_HUB_TOKENIZER}'; '{DATASET_EMBEDDED}' (the tokenizer in data/) "
                           f"when --dataset {DATASET_EMBEDDED}")
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
                     help="run folder: metrics.jsonl, results.json, loss_curve.png and model_<step>/ checkpoints "
                          "(default runs/<run_name>-<UTC time>; with --continue_from, the checkpoint's run folder)")
    run.add_argument("--continue_from", type=str, default=None,
                     help="checkpoint folder (model_<step>) or a run folder (its latest checkpoint) to resume")
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
                        help="run the wrapped model through torch.compile (see utils/benchmark_model.py)")
    system.add_argument("--dist_timeout_minutes", type=float, default=DEFAULT_TIMEOUT_MINUTES,
                        help="how long a collective waits for the slowest rank before the run fails (the default "
                             "covers rank 0 writing a 1B checkpoint to a slow disk)")
    system.add_argument("--single_gpu", action="store_true",
                        help="reference compatibility: no DDP wrapper (only valid with one process)")
    return p


def find_checkpoint(path: str) -> str | None:
    """A checkpoint folder itself, or the highest-step model_<step> inside a run folder; None if neither."""
    if os.path.isfile(os.path.join(path, TRAINING_STATE_FILE)):
        return path
    candidates = []
    for sub in glob.glob(os.path.join(path, CHECKPOINT_PREFIX + "*")):
        suffix = os.path.basename(sub)[len(CHECKPOINT_PREFIX):]
        if suffix.isdigit() and os.path.isfile(os.path.join(sub, TRAINING_STATE_FILE)):
            candidates.append((int(suffix), sub))
    return max(candidates)[1] if candidates else None


def run_folder_in_use(path: str) -> bool:
    return os.path.isdir(path) and (
        os.path.exists(os.path.join(path, "metrics.jsonl"))
        or os.path.exists(os.path.join(path, "results.json"))
        or bool(glob.glob(os.path.join(path, CHECKPOINT_PREFIX + "*")))
    )


def _resolve_norm(args, parser, saved: dict):
    """Flag, else environment (NORM_TYPE/POST_NUM, for old scripts), else the resumed checkpoint, else default."""
    if args.norm_type is None and os.environ.get("NORM_TYPE"):
        env = os.environ["NORM_TYPE"]
        # The reference lower-cased NORM_TYPE and then compared it with 'LNS', so LNS silently never ran.
        if env.lower() not in NORM_TYPES:
            parser.error(f"environment NORM_TYPE={env!r} is not one of {', '.join(NORM_TYPES)}")
        args.norm_type = env.lower()
    if args.post_num is None and os.environ.get("POST_NUM", "").strip():
        try:
            args.post_num = int(os.environ["POST_NUM"])
        except ValueError:
            parser.error(f"environment POST_NUM={os.environ['POST_NUM']!r} is not an integer")
    if args.norm_type is None:
        args.norm_type = saved.get("norm_type", "pre")
    if args.post_num is None:
        args.post_num = saved.get("post_num")
    if args.init_method is None:
        args.init_method = saved.get("init_method", "normal")
    if args.norm_type == "post_pre" and args.post_num is None:
        parser.error("--post_num is required with --norm_type post_pre (how many of the first layers are Post-LN)")
    if args.post_num is None:
        args.post_num = 0


def check_args(args, parser, world_size: int):
    """Validate and fill derived values; every failure is parser.error (exit 2, one line naming the flag)."""
    args.dtype = {"bf16": "bfloat16", "fp32": "float32"}.get(args.dtype, args.dtype)

    if args.continue_from is not None:
        checkpoint = find_checkpoint(args.continue_from)
        if checkpoint is None:
            what = "does not exist" if not os.path.exists(args.continue_from) else \
                f"holds no checkpoint ({TRAINING_STATE_FILE} missing)"
            parser.error(f"--continue_from {args.continue_from}: {what}")
        args.continue_from = checkpoint
        for needed in ("config.json", TRAINING_STATE_FILE):
            if not os.path.isfile(os.path.join(checkpoint, needed)):
                parser.error(f"--continue_from {checkpoint}: incomplete checkpoint, {needed} missing")
        if not glob.glob(os.path.join(checkpoint, "*.safetensors")):
            parser.error(f"--continue_from {checkpoint}: incomplete checkpoint, no *.safetensors weights")
    saved_config = {}
    if args.continue_from is not None:
        try:
            with open(os.path.join(args.continue_from, "config.json")) as f:
                saved_config = json.load(f)
        except (OSError, ValueError) as err:
            parser.error(f"--continue_from {args.continue_from}: corrupt config.json ({err})")
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

    if args.dataset_path is not None and not os.path.exists(args.dataset_path):
        parser.error(f"--dataset_path {args.dataset_path}: no such file or folder")
    if args.tokenizer is None:
        args.tokenizer = DATASET_EMBEDDED if args.dataset == DATASET_EMBEDDED else DEFAULT_HUB_TOKENIZER

    for flag in ("batch_size", "max_length", "eval_every", "save_every", "eval_tokens"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag} must be positive, got {getattr(args, flag)}")
    for flag in ("gradient_accumulation", "total_batch_size", "eval_batch_size"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            parser.error(f"--{flag} must be positive, got {getattr(args, flag)}")
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

    # Batch arithmetic: total = micro-batch * accumulation * world size, exactly.
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

    if args.max_train_tokens is not None:
        if args.max_train_tokens <= 0:
            parser.error(f"--max_train_tokens must be positive, got {args.max_train_tokens}")
        args.num_training_steps = math.ceil(args.max_train_tokens / (args.total_batch_size * args.max_length))
    if args.num_training_steps <= 0:
        parser.error(f"--num_training_steps must be positive, got {args.num_training_steps}")
    if not 0 <= args.warmup_steps < args.num_training_steps:
        parser.error(f"--warmup_steps {args.warmup_steps} must be >= 0 and below --num_training_steps "
                     f"{args.num_training_steps}")

    if args.single_gpu and world_size > 1:
        parser.error(f"--single_gpu trains without DDP and needs one process, but world size is {world_size}")
    if args.fsdp and args.single_gpu:
        parser.error("--fsdp and --single_gpu exclude each other")
    if not args.dist_timeout_minutes > 0:
        parser.error(f"--dist_timeout_minutes must be positive, got {args.dist_timeout_minutes}")
    if args.device not in ("auto", "cpu", "cuda"):
        parser.error(f"--device must be auto, cpu or cuda, got {args.device!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")

    if args.run_name is None:
        stem = os.path.splitext(os.path.basename(args.model_config))[0].removeprefix("llama_")
        suffix = f"{args.post_num}" if args.norm_type == "post_pre" else ""
        args.run_name = f"{stem}_{args.norm_type}{suffix}_lr{args.lr:g}"
    if args.save_dir is None and args.continue_from is not None:
        args.save_dir = os.path.dirname(os.path.abspath(args.continue_from))  # keep writing into the same run folder
    if args.save_dir is not None and run_folder_in_use(args.save_dir) and args.continue_from is None:
        parser.error(f"--save_dir {args.save_dir} already holds a run; pass --continue_from to resume it "
                     f"or choose another --save_dir")
    return args


def parse_args(argv=None, world_size: int | None = None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return check_args(args, parser, world_size)
