"""The lm_head and its next-token loss, computed three ways: the same function, different speed and memory.

    standard  the model's own: the full logits of a micro-batch, upcast to fp32 (2.1 GB at 130M, micro-batch 64)
    chunked   CHUNK_TOKENS tokens of logits at a time, each chunk recomputed in backward, so the fp32 logits of a
              micro-batch never exist at once
    liger     liger-kernel's fused linear + cross-entropy (Triton, CUDA only; `pip install liger-kernel`)

The trainer takes `--loss` (default standard); utils/gpu/gpu_check.py's `losses` stage measures the three on a GPU and
names the fastest whose loss is within LOSS_TOLERANCE of the fp32 loss. tests/test_run_scripts.py checks chunked
against standard on the CPU.
"""
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

HEAD_LOSSES = ("standard", "chunked", "liger")
CHUNK_TOKENS = 8192
# Relative distance from the fp32 model's loss within which a loss counts as the same function in bf16 (bf16 keeps
# 8 significant bits, about 4e-3 relative; the pure-bf16 standard loss is itself that far from fp32).
LOSS_TOLERANCE = 1e-2


def next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """Labels shifted by one (-100, ignored, after each row's last token): the model's convention."""
    return F.pad(labels[:, 1:], (0, 1), value=-100)


def liger_import_error() -> str | None:
    """Why liger-kernel cannot be used here, or None."""
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError as err:
        return f"liger-kernel does not import ({err})"
    return None


def _summed_chunk_loss(hidden, weight, targets):
    return F.cross_entropy(F.linear(hidden, weight).float(), targets, ignore_index=-100, reduction="sum")


def head_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, how: str,
              chunk_tokens: int | None = None) -> torch.Tensor:
    """The mean next-token cross-entropy of F.linear(hidden, weight) against `labels`, without full fp32 logits."""
    hidden = hidden.flatten(0, 1)
    targets = next_token_targets(labels).to(hidden.device).flatten()
    if how == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        return LigerFusedLinearCrossEntropyLoss(ignore_index=-100)(weight, hidden, targets)
    if how != "chunked":
        raise ValueError(f"head_loss: {how!r} is not chunked or liger (standard is the model's own forward)")
    chunk = chunk_tokens or CHUNK_TOKENS
    total = sum(checkpoint(_summed_chunk_loss, hidden[start:start + chunk], weight, targets[start:start + chunk],
                           use_reentrant=False)
                for start in range(0, hidden.shape[0], chunk))
    return total / (targets != -100).sum()
