"""Token-weighted evaluation loss over the validation batches, the same on every rank."""
import math
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm


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
