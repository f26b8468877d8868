"""Pieces of the training loop that are worth testing on their own.

Optimizer, learning-rate schedule, token-weighted evaluation, gradient norm, RNG capture, metrics file, loss-curve
plot and wandb set-up (checkpoints: checkpointing.py). Distributed code here only uses collectives that are no-ops for a
single process, so every function works with and without torchrun.
"""
import ctypes
import json
import math
import netrc
import os
import random
import re
import secrets
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from peft_pretraining import run_folder

# ----------------------------------------------------------------------------------------------------------------
# Optimizer and schedule
# ----------------------------------------------------------------------------------------------------------------

def build_optimizer(params, name: str, lr: float, weight_decay: float, kernel: str = "fused") -> torch.optim.Optimizer:
    """Adam / AdamW. kernel "fused": torch's fused kernel (each element's update computed in fp32 and rounded once),
    falling back to foreach where the device has none; "foreach": the multi-tensor kernel, as in the reference, whose
    intermediates round to the parameters' dtype. The two differ beyond rounding noise only in pure bf16."""
    params = [p for p in params if p.requires_grad]
    optimizer_class = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]
    if kernel == "fused":
        try:
            return optimizer_class(params, lr=lr, weight_decay=weight_decay, fused=True)
        except (RuntimeError, ValueError):
            pass
    return optimizer_class(params, lr=lr, weight_decay=weight_decay, foreach=True)


def lr_factor(update_index: int, *, scheduler_type: str, num_training_steps: int, warmup_steps: int,
              min_lr_ratio: float) -> float:
    """Multiplier of the peak lr used by the update with 0-based index `update_index`.

    Warmup: updates 0..warmup-1 use (i+1)/warmup, so the first update is not wasted at lr 0 and the last warmup
    update reaches the peak. Decay: cosine (or linear) from the peak down to min_lr_ratio, reached exactly by the
    last update, index num_training_steps-1.
    """
    if update_index < warmup_steps:
        return (update_index + 1) / warmup_steps
    if warmup_steps > 0:  # the peak was used by update warmup-1, so decay starts moving at update warmup
        progress = (update_index - warmup_steps + 1) / (num_training_steps - warmup_steps)
    else:  # no warmup: update 0 uses the peak
        progress = update_index / max(num_training_steps - 1, 1)
    progress = min(progress, 1.0)
    if scheduler_type == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif scheduler_type == "linear":
        shape = 1.0 - progress
    else:
        raise ValueError(f"unknown scheduler {scheduler_type!r}; valid: cosine, linear")
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def build_scheduler(optimizer, *, scheduler_type: str, num_training_steps: int, warmup_steps: int,
                    min_lr_ratio: float, lr: float | None = None, weight_decay: float | None = None,
                    resume_at: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over lr_factor; call scheduler.step() once after each optimizer.step().

    transformers' get_cosine_with_min_lr_schedule_with_warmup starts at lr 0, which is the reference bug we fix.
    resume_at=k positions the schedule so that the next update uses lr_factor(k); lr / weight_decay then overwrite
    the values that a loaded optimizer state carried.
    """
    def factor(update_index):
        return lr_factor(update_index, scheduler_type=scheduler_type, num_training_steps=num_training_steps,
                         warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio)
    if resume_at:
        for group in optimizer.param_groups:
            group["initial_lr"] = lr if lr is not None else group["initial_lr"]
            if weight_decay is not None:
                group["weight_decay"] = weight_decay
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor, last_epoch=resume_at - 1)


RESUME_FLAGS_TO_COMPARE = ("lr", "scheduler", "min_lr_ratio", "warmup_steps", "num_training_steps", "weight_decay",
                           "optimizer", "total_batch_size", "batch_size", "max_length", "packing", "dataset",
                           "dataset_path", "tokenizer", "dtype", "grad_clipping", "seed", "adam_kernel")


def changed_flags(saved_args: dict, new_args: dict) -> dict:
    """{flag: (checkpoint value, current value)} for the flags that shape the trajectory."""
    return {k: (saved_args[k], new_args.get(k)) for k in RESUME_FLAGS_TO_COMPARE
            if k in saved_args and saved_args[k] != new_args.get(k)}


def grad_norm_and_clip(parameters, max_norm: float) -> float:
    """Global L2 norm of the gradients (all shards); clip to max_norm unless it is 0."""
    parameters = [p for p in parameters if p.grad is not None]
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, foreach=True)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in parameters], foreach=True)
    if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor whose value is already the global norm
        norm = norm.full_tensor()
    return float(norm)


# bf16 has 8 significant bits: next to 1.0 its spacing is 2**-7, so an update smaller than half of that rounds away.
BF16_SMALLEST_UPDATE_AT_ONE = 2.0 ** -8


def pure_bf16_note(dtype: str, optimizer: str, lr: float) -> str | None:
    """A one-line start-up note when pure-bf16 weights cannot take Adam's steps (about lr in size) at 1.0, where
    the RMSNorm gains start: they then stay exactly 1.0 for the whole run. None when the setting is fine."""
    if dtype != "bfloat16" or optimizer not in ("adam", "adamw") or lr >= BF16_SMALLEST_UPDATE_AT_ONE:
        return None
    return (f"note: with --dtype bfloat16 the weights are bf16, where an {optimizer} step of about --lr {lr:g} "
            f"(< 2^-8 = {BF16_SMALLEST_UPDATE_AT_ONE:.1e}) rounds away at 1.0, so every RMSNorm gain stays exactly "
            "1.0; --dtype mixed keeps fp32 master weights and lets them train")


# ----------------------------------------------------------------------------------------------------------------
# Norm gains
# ----------------------------------------------------------------------------------------------------------------

def _backbone(model):
    """The decoder backbone of a possibly wrapped model (torch.compile, DDP); FSDP2 wraps in place."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(getattr(model, "module", None), torch.nn.Module):
            model = model.module
        else:
            break
    return model.get_decoder() if hasattr(model, "get_decoder") else model


def _full_mean(weights) -> float:
    """Mean of some (possibly FSDP-sharded DTensor) parameters; collective under FSDP, so every rank calls it."""
    with torch.no_grad():
        full = [w.full_tensor() if hasattr(w, "full_tensor") else w for w in weights]
        return float(torch.cat([w.detach().float().flatten() for w in full]).mean())


def mean_norm_gains(model) -> list[float]:
    """Per decoder layer, the mean of all its norm gains (input_layernorm and post_attention_layernorm, and any
    other submodule named *norm* with a weight). Both RMSNorms start at 1.0."""
    gains = []
    for layer in _backbone(model).layers:
        weights = [module.weight for name, module in layer.named_modules()
                   if "norm" in name.rsplit(".", 1)[-1].lower() and isinstance(getattr(module, "weight", None),
                                                                               torch.Tensor)]
        gains.append(_full_mean(weights) if weights else float("nan"))
    return gains


def final_norm_gain(model) -> float:
    """Mean gain of the final norm (before the LM head)."""
    return _full_mean([_backbone(model).norm.weight])


# ----------------------------------------------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(model, batches, *, device, eval_tokens: int, autocast=nullcontext, lockstep: bool = False,
             show_progress: bool = True) -> dict:
    """Token-weighted mean next-token cross-entropy over this rank's share of the validation tokens, all-reduced.

    loss = (sum of CE over every target token on every rank) / (number of those tokens); ppl = exp(loss).
    `lockstep` keeps ranks running the same number of forwards (FSDP2 all-gathers inside forward): a rank that
    ran out of batches feeds a fully masked copy of its last batch until every rank is done.
    """
    was_training = model.training
    model.eval()
    distributed = dist.is_available() and dist.is_initialized()
    world_size = dist.get_world_size() if distributed else 1
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    token_count = torch.zeros((), dtype=torch.int64, device=device)
    batch_iter = iter(batches)
    last_batch = None
    bar = tqdm(total=eval_tokens, desc="eval", unit="tok", unit_scale=True, leave=False, disable=not show_progress)
    while True:
        batch = next(batch_iter, None)
        if lockstep and distributed:
            has_batch = torch.tensor(int(batch is not None), device=device)
            dist.all_reduce(has_batch, op=dist.ReduceOp.MAX)
            if not has_batch.item():
                break
            if batch is None:
                if last_batch is None:
                    raise RuntimeError("evaluation: this rank received no validation batch at all")
                batch = dict(last_batch, labels=torch.full_like(last_batch["labels"], -100))
        elif batch is None:
            break
        last_batch = batch
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with autocast():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        targets = batch["labels"][:, 1:]
        loss_sum += F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(),
                                    ignore_index=-100, reduction="sum").double()
        counted = (targets != -100).sum()
        token_count += counted
        bar.update(int(counted) * world_size)  # ranks hold near-equal shares; the exact total is all-reduced below
    bar.close()
    if distributed:
        dist.all_reduce(loss_sum)
        dist.all_reduce(token_count)
    model.train(was_training)
    tokens = int(token_count.item())
    if tokens == 0:
        raise RuntimeError("evaluation saw no target tokens: the validation split is empty")
    loss = loss_sum.item() / tokens
    return {"eval_loss": loss, "eval_ppl": math.exp(loss) if loss < 700 else float("inf"), "eval_tokens": tokens}


# ----------------------------------------------------------------------------------------------------------------
# Host memory (CPU runs)
# ----------------------------------------------------------------------------------------------------------------

# glibc's mallopt parameters (malloc.h); the environment variables that set them when the process starts.
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_MALLOC_ENVIRONMENT = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


def keep_freed_host_memory() -> bool:
    """Make glibc keep freed memory for reuse instead of handing it back to the kernel; True if it now does.

    By default every tensor above a threshold (at most 32 MiB) gets fresh pages from mmap and returns them when freed,
    so a CPU step page-faults its logits, their gradient and every other large buffer anew each time: about 20 ms per
    32 MiB on the 2-core hosts, where keeping freed memory made the trainer 8-15% faster (docs/benchmarks.md). The
    cost is resident memory (a study-shaped run: 1.7 GiB peak against 1.2). Results are unchanged: only where memory
    comes from changes.
    Left alone when the environment already sets malloc (those variables win), and where libc is not glibc.
    """
    if any(name in os.environ for name in _MALLOC_ENVIRONMENT):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl builds without mallopt): nothing to tune
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


# ----------------------------------------------------------------------------------------------------------------
# RNG state
# ----------------------------------------------------------------------------------------------------------------

def seed_everything(seed: int):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds CUDA as well


def capture_rng_state() -> dict:
    """Python, numpy, torch CPU and CUDA generators, in types torch.load(weights_only=True) accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    return state


def restore_rng_state(state: dict):
    python_state = state["python"]
    random.setstate((python_state[0], tuple(python_state[1]), python_state[2]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints
# ----------------------------------------------------------------------------------------------------------------

def parameter_checksum(model) -> float:
    """Sum of all parameters in float64: equal on every DDP rank when the replicas are in sync."""
    with torch.no_grad():
        return float(sum(p.detach().double().sum().item() for p in model.parameters()))


def parameters_finite(model, device) -> bool:
    """True when every parameter on every rank (every shard under FSDP2) is finite: a checkpoint must never hold
    the weights of an update that overflowed."""
    with torch.no_grad():
        bad = sum(int((~torch.isfinite(p.to_local() if hasattr(p, "to_local") else p)).any())
                  for p in model.parameters())
    flag = torch.tensor(bad, dtype=torch.int64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(flag)
    return int(flag.item()) == 0


def gather_rank_objects(obj) -> list:
    """Every rank's `obj`, in rank order (a one-element list without torchrun)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


# ----------------------------------------------------------------------------------------------------------------
# Metrics, plot, wandb
# ----------------------------------------------------------------------------------------------------------------

def json_safe(value):
    """NaN/inf are not JSON: write null (the run's status says why); lists element by element."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [json_safe(item) for item in value]
    return value


class MetricsFile:
    """metrics.jsonl: one JSON object per update step, flushed as it is written.

    `resume_step`: the rows past it belong to a trajectory that is about to be replayed (or, at 0, to a run killed
    before its first checkpoint): they move to metrics_superseded.jsonl (appended, so nothing written earlier is
    lost). `notes` says what was moved or dropped.
    """

    def __init__(self, path: str, resume_step: int | None = None):
        self.path = path
        self.notes = []
        if resume_step is not None and os.path.exists(path):
            self._truncate_after(resume_step)
        self._file = open(path, "a")

    def _truncate_after(self, step: int):
        lines, self.notes = run_folder.read_jsonl(self.path)
        kept = [line for line in lines if json.loads(line).get("step", 0) <= step]
        superseded = [line for line in lines if json.loads(line).get("step", 0) > step]
        if superseded:
            with open(os.path.join(os.path.dirname(self.path), "metrics_superseded.jsonl"), "a") as f:
                f.writelines(superseded)
            self.notes.append(f"note: moved {len(superseded)} rows past step {step} of {self.path} to "
                              f"metrics_superseded.jsonl")
        run_folder.write_lines_atomic(self.path, kept)

    def write(self, row: dict):
        self._file.write(json.dumps({k: json_safe(v) for k, v in row.items()}, allow_nan=False) + "\n")
        self._file.flush()

    def sync(self):
        """To disk (fsync): called before each checkpoint, so a checkpoint never outlives its rows."""
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self):
        self._file.close()


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_loss_curve(metrics_path: str, png_path: str, title: str = ""):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None]
    evals = [(r["step"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if train:
        ax.plot(*zip(*train), label="train loss", linewidth=1)
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss", markersize=4)
    ax.set_xlabel("update step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def plot_norm_gains(metrics_path: str, png_path: str, title: str = "") -> str | None:
    """Mean norm gain against depth, one line per evaluation, coloured by update step (the final norm is the last
    point). Returns the path, or None when metrics.jsonl holds no gains."""
    rows = [r for r in read_metrics(metrics_path) if r.get("norm_gain_mean")]
    if not rows:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    steps = [r["step"] for r in rows]
    colours = matplotlib.colors.Normalize(vmin=min(steps), vmax=max(max(steps), min(steps) + 1))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    num_layers = len(rows[-1]["norm_gain_mean"])
    for row in rows:
        gains = list(row["norm_gain_mean"]) + [row.get("final_norm_gain_mean")]
        ax.plot(range(len(gains)), [float("nan") if g is None else g for g in gains], "o-", markersize=3,
                linewidth=1, color=plt.cm.viridis(colours(row["step"])))
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=0.8, label="initial gain 1.0")
    ticks = list(range(0, num_layers, max(1, num_layers // 8))) + [num_layers]
    ax.set_xticks(ticks, [str(t) for t in ticks[:-1]] + ["final"])
    ax.set_xlabel("decoder layer (0-based); last point: final norm")
    ax.set_ylabel("mean RMSNorm gain")
    ax.ticklabel_format(axis="y", useOffset=False)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    bar = fig.colorbar(plt.cm.ScalarMappable(norm=colours, cmap="viridis"), ax=ax, label="update step")
    bar.locator = matplotlib.ticker.MaxNLocator(integer=True)
    bar.update_ticks()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return png_path


def wandb_api_key_available() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def wandb_mode() -> str:
    """WANDB_MODE when set (but online only with an API key); unset: online with a key, offline without one.

    Never a login prompt."""
    mode = os.environ.get("WANDB_MODE", "").strip().lower()
    if mode in ("disabled", "offline", "dryrun"):
        return "disabled" if mode == "disabled" else "offline"
    if mode == "online" or not mode:
        return "online" if wandb_api_key_available() else "offline"
    return "offline"


WANDB_ID_FILE = "wandb_run_id"
_WANDB_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def wandb_run_id(run_dir: str, resume: bool) -> str:
    """The wandb run id of run_dir's history: kept in RUN/wandb_run_id, so that every resume of the folder logs to
    the same wandb run. A fresh start (a new history) draws a new id and replaces the file; a resume reuses the
    file's id (a folder whose earlier legs ran with wandb disabled has none yet: a new one is drawn and kept).
    ValueError naming the file when it holds no valid id."""
    path = os.path.join(run_dir, WANDB_ID_FILE)
    if resume and os.path.exists(path):
        try:
            with open(path) as f:
                run_id = f.read().strip()
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"{path}: cannot be read ({err}); remove it to start a new wandb run") from err
        if not _WANDB_ID.fullmatch(run_id):
            raise ValueError(f"{path}: {run_id[:80]!r} is not a wandb run id; remove it to start a new wandb run")
        return run_id
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    run_id = "".join(secrets.choice(alphabet) for _ in range(8))  # the form wandb's own ids take
    run_folder.write_lines_atomic(path, [run_id + "\n"])
    return run_id


def init_wandb(*, project: str, run_name: str, config: dict, tags, run_dir: str, resume: bool = False):
    """A wandb run writing under run_dir, or None when WANDB_MODE=disabled.

    Its id is the run folder's (wandb_run_id): a resume continues the same wandb run (resume="allow"), online and
    offline (an offline leg is a new RUN/wandb/offline-run-<time>-<id> folder with the same id)."""
    mode = wandb_mode()
    if mode == "disabled":
        return None
    run_id = wandb_run_id(run_dir, resume)
    import wandb
    return wandb.init(project=project, name=run_name, config=config, tags=tags, dir=run_dir, mode=mode,
                      id=run_id, resume="allow",
                      settings=wandb.Settings(init_timeout=120, console="off"))
