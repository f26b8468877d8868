"""Distributed set-up kept out of the model (as in torchtitan): process group, DDP / FSDP2 wrapping, gradient sync,
and the exit code handed to the run scripts.

Dtypes by wrapper and --dtype (what the forward/backward computes in, what the optimizer updates, what is reduced):

    --dtype     DDP (or one process)                          FSDP2 (--fsdp)
    float32     fp32 everywhere                               fp32 everywhere
    bfloat16    bf16 weights, grads, Adam state; bf16         bf16 weights, grads, Adam state; bf16 all-gather
                all-reduce (the paper's pure-bf16 recipe)     and reduce-scatter
    mixed       fp32 weights + Adam state, bf16 autocast      fp32 sharded weights + Adam state; bf16 all-gather and
                compute, fp32 grads and all-reduce            compute (MixedPrecisionPolicy), fp32 reduce-scatter
"""
import contextlib
import datetime
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

DEFAULT_TIMEOUT_MINUTES = 60
EXIT_CODE_DIR_ENV = "TRAINER_EXIT_CODE_DIR"


def init_distributed(args):
    """Always a process group: torchrun's env:// rendezvous, or a one-process group so collectives are no-ops.

    Every collective waits at most --dist_timeout_minutes for the slowest rank (e.g. rank 0 writing a checkpoint).
    """
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = "cpu:gloo,cuda:nccl" if use_cuda else "gloo"
    timeout = datetime.timedelta(minutes=args.dist_timeout_minutes)
    if "RANK" in os.environ:
        dist.init_process_group(backend=backend, device_id=device if use_cuda else None, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), device


def fsdp_mixed_precision(dtype: str):
    """--dtype mixed under FSDP2: bf16 all-gather and compute over fp32 sharded master weights, fp32 grad reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if dtype == "mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()  # parameters are already in the training dtype


def wrap_model(model, args, world_size: int, device):
    """DDP, FSDP2 (one shard group per block + root), or nothing."""
    if args.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world_size,))
        mp_policy = fsdp_mixed_precision(args.dtype)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)
        return model
    if world_size > 1:
        # the only buffers are the RoPE tables, the same on every rank: synced once at init, not every forward
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                       forward_sync_buffers=False)
    return model


def grad_sync(model, is_last_micro_batch: bool):
    """Skip the gradient all-reduce on every micro-batch but the last one of an update."""
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper hides the DDP / FSDP2 module
    if isinstance(model, DistributedDataParallel):
        return contextlib.nullcontext() if is_last_micro_batch else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(is_last_micro_batch)
    return contextlib.nullcontext()


def broadcast_from_rank0(values: list) -> None:
    """dist.broadcast_object_list from rank 0, then a barrier, on every rank: no rank leaves while another still
    waits on the broadcast (see leave_process_group for what may still be pending after it)."""
    dist.broadcast_object_list(values, src=0)
    dist.barrier()


# How long the main thread gives up the GIL before the process group goes (see leave_process_group).
GLOO_WORKER_GRACE_S = 0.1


def leave_process_group() -> None:
    """Destroy the process group once gloo's worker threads have finished their last collective.

    A gloo worker thread frees a collective's tensors after the collective has returned, and freeing a tensor made
    in Python needs the GIL. Destroying the group (here, or in the garbage collection that frees DDP's reducer at
    exit) joins those threads while holding the GIL, so a worker still waiting for the GIL deadlocks the exit. That
    happened in about 1 of 15 runs of tests/test_faults.py's rank-0 save failure, where every rank exits right after
    a broadcast; a barrier after the broadcast made it rarer, not impossible, because gloo has two worker threads.
    Sleeping releases the GIL, so a waiting worker frees its tensors first; no collective runs after this."""
    time.sleep(GLOO_WORKER_GRACE_S)
    dist.destroy_process_group()


def report_exit_code(code: int) -> int:
    """Leave this rank's exit code where the run script finds it after torchrun returns.

    torchrun turns any failed rank into its own exit code 1, so run_*.sh set TRAINER_EXIT_CODE_DIR (a fresh local
    folder per node) and read the codes back: the trainer's own codes (2 bad input, 3 diverged, 4 disk full)
    survive, on every node of a multi-node run.
    """
    folder = os.environ.get(EXIT_CODE_DIR_ENV)
    if folder:
        with open(os.path.join(folder, f"rank{os.environ.get('RANK', '0')}"), "w") as f:
            f.write(f"{code}\n")
    return code


def gather_rank_objects(obj) -> list:
    """Every rank's `obj`, in rank order (a one-element list without torchrun)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered
