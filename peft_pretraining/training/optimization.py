"""The optimizer, its learning-rate schedule and the numbers of one update: the gradient norm (clipped), whether the
weights stayed finite, and whether pure-bf16 weights can take Adam's steps at all."""
import math

import torch
import torch.distributed as dist


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
