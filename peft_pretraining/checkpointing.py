"""Checkpoints: model_<step>/ written atomically and read back on resume, sharded FSDP2 state, memory-mapped loading,
pruning old saves. (Which checkpoint a run folder resumes from: run_folder.find_checkpoint.)

A checkpoint folder model_<step>/ always holds an HF export (config.json, model.safetensors, tokenizer files) that
the analyses and lm-eval read, and training_state.pt. What resumes the run differs:
  * DDP / one process: the safetensors weights and the full optimizer state inside training_state.pt;
  * FSDP2: sharded/, written with torch.distributed.checkpoint (DCP): every rank writes and later reads only its
    own shards of the model and the optimizer state, as torchtitan does. The HF export beside it is gathered on
    rank 0 (model weights only) at every save, so intermediate checkpoints stay readable by the analyses.
"""
import contextlib
import glob
import json
import os
import shutil
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from peft_pretraining.run_folder import CHECKPOINT_PREFIX, TRAINING_STATE_FILE

CHECKPOINT_FORMAT = 1
SHARDED_DIR = "sharded"  # DCP files inside a checkpoint folder: .metadata and one __<rank>_0.distcp per rank


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from; the message names the folder and the bad file."""


class ShardedLoadError(RuntimeError):
    """The sharded state of a checkpoint is missing, incomplete or does not fit the model."""


class ShardedSaveError(RuntimeError):
    """DCP could not write the shards (its CheckpointException, a BaseException, re-raised as an Exception so that
    the trainer's handlers see it: a full disk on any rank then exits 4 like any other save)."""


# ----------------------------------------------------------------------------------------------------------------
# Sharded (FSDP2) state
# ----------------------------------------------------------------------------------------------------------------

def _sharded_state(model, optimizer) -> dict:
    """This rank's shards of model and optimizer state (DTensors under FSDP2), keyed by parameter names."""
    for group in optimizer.param_groups:  # build_scheduler resets it on resume; present so that it is saved/loaded
        group.setdefault("initial_lr", group["lr"])
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def sharded_staging_dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, f".{CHECKPOINT_PREFIX}{step}.{SHARDED_DIR}.tmp")


def save_sharded(run_dir: str, step: int, model, optimizer) -> str:
    """Collective: every rank writes its shards into a staging folder, which save_checkpoint moves into place."""
    staging = sharded_staging_dir(run_dir, step)
    if dist.get_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    dist.barrier()
    try:
        dcp.save(_sharded_state(model, optimizer), checkpoint_id=staging)  # files are fsynced by DCP's writer
    except CheckpointException as err:  # raised on every rank, with every rank's failure in its message
        if dist.get_rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)  # the partial shards; earlier checkpoints are untouched
        raise ShardedSaveError(f"writing {staging}: {err}") from err
    return staging


def load_sharded(checkpoint: str, model, optimizer) -> None:
    """Collective: every rank reads only the pieces of sharded/ that its own shards need (any world size)."""
    directory = os.path.join(checkpoint, SHARDED_DIR)
    if not os.path.isfile(os.path.join(directory, ".metadata")):
        raise ShardedLoadError(f"--continue_from {checkpoint}: {SHARDED_DIR}/.metadata missing")
    try:
        metadata = dcp.FileSystemReader(directory).read_metadata()
    except Exception as err:
        raise ShardedLoadError(f"--continue_from {checkpoint}: corrupt {SHARDED_DIR}/.metadata ({err})") from err
    needed = sorted({item.relative_path for item in metadata.storage_data.values()})
    missing = [name for name in needed if not os.path.isfile(os.path.join(directory, name))]
    if missing:
        raise ShardedLoadError(f"--continue_from {checkpoint}: {SHARDED_DIR}/ lacks {', '.join(missing)}")
    state = _sharded_state(model, optimizer)
    try:
        dcp.load(state, checkpoint_id=directory)
    except (Exception, CheckpointException) as err:  # DCP gathers per-rank failures into a BaseException subclass
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else err.__class__.__name__
        raise ShardedLoadError(f"--continue_from {checkpoint}: cannot read {SHARDED_DIR}/ "
                               f"({first_line[:200]})") from err
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def full_model_state(model) -> dict:
    """Collective: the unsharded model weights on rank 0's CPU (other ranks get an empty dict), for the HF export."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# ----------------------------------------------------------------------------------------------------------------
# Full-format (DDP) loading without extra copies
# ----------------------------------------------------------------------------------------------------------------

def copy_safetensors_into(model, checkpoint: str) -> list[str]:
    """Copy the checkpoint's weights into the model tensor by tensor from memory-mapped files.

    Peak extra memory is one tensor, not a second full state dict per rank; returns the model keys not found.
    """
    targets = model.state_dict()
    found = set()
    with torch.no_grad():
        for path in sorted(glob.glob(os.path.join(checkpoint, "*.safetensors"))):
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name not in targets:
                        raise KeyError(f"unexpected weight {name!r} in {os.path.basename(path)}")
                    tensor = f.get_tensor(name)
                    if tensor.shape != targets[name].shape:
                        raise ValueError(f"{name}: shape {tuple(tensor.shape)} in the checkpoint, "
                                         f"{tuple(targets[name].shape)} in the model")
                    targets[name].copy_(tensor)
                    found.add(name)
    return sorted(set(targets) - found)


# ----------------------------------------------------------------------------------------------------------------
# Retention
# ----------------------------------------------------------------------------------------------------------------

def complete_checkpoints(run_dir: str) -> list[tuple[int, str]]:
    """(step, folder) of the finished checkpoints in a run folder (a training-state file present), by step."""
    found = []
    for path in glob.glob(os.path.join(run_dir, CHECKPOINT_PREFIX + "*")):
        suffix = os.path.basename(path)[len(CHECKPOINT_PREFIX):]
        if suffix.isdigit() and os.path.isfile(os.path.join(path, TRAINING_STATE_FILE)):
            found.append((int(suffix), path))
    return sorted(found)


def older_than_the_newest(run_dir: str, just_saved_step: int, newest: int | None) -> list[str]:
    """The complete checkpoints before the one just saved, less the newest - 1 nearest it; none when newest is None
    or the just-saved checkpoint is not complete. Later steps (a trajectory replaced by resuming earlier) are left
    out."""
    checkpoints = dict(complete_checkpoints(run_dir))
    if newest is None or just_saved_step not in checkpoints:
        return []
    earlier = [path for step, path in sorted(checkpoints.items()) if step < just_saved_step]
    return earlier[: max(len(earlier) - (newest - 1), 0)]


def prune_checkpoints(run_dir: str, just_saved_step: int, keep_last: int | None) -> list[str]:
    """After a successful save: keep the checkpoint just written and the keep_last - 1 newest before it.

    Checkpoints of a later step than the one just saved belong to a trajectory this run replaced by resuming
    earlier; they are neither counted nor removed. keep_last None keeps everything. Returns the removed folders.
    """
    doomed = older_than_the_newest(run_dir, just_saved_step, keep_last)
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def drop_training_state(run_dir: str, just_saved_step: int, resumable_last: int | None) -> list[str]:
    """After a successful save: the checkpoint just written and the resumable_last - 1 newest before it keep their
    training state; older ones lose training_state.pt and sharded/ (the optimizer, two to three times the weights)
    and keep their HF export, which the analyses and lm-eval read. They are no longer resumable, so find_checkpoint
    and --keep_last no longer count them. None keeps every training state. Returns the folders slimmed."""
    slimmed = older_than_the_newest(run_dir, just_saved_step, resumable_last)
    for path in slimmed:
        os.remove(os.path.join(path, TRAINING_STATE_FILE))  # first: a folder without it is never resumed from
        shutil.rmtree(os.path.join(path, SHARDED_DIR), ignore_errors=True)
    return slimmed


# ----------------------------------------------------------------------------------------------------------------
# Full checkpoints: model_<step>/ written atomically by rank 0, and read back on resume
# ----------------------------------------------------------------------------------------------------------------

def checkpoint_dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, f"{CHECKPOINT_PREFIX}{step}")


def full_state_dicts(model, optimizer) -> tuple[dict, dict]:
    """Unsharded model and optimizer state on CPU (collective under FSDP2; keys are parameter names)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options), get_optimizer_state_dict(model, optimizer, options=options)


def _fsync_tree(directory: str):
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(run_dir: str, step: int, *, hf_model, model_state: dict, tokenizer, training_state: dict,
                    sharded_dir: str | None = None) -> str:
    """Write model_<step>/ atomically (rank 0 only): build it under a temporary name, then rename into place.

    A kill at any point leaves either the old folder or the new one, never a half-written checkpoint under the
    final name; the previous checkpoints are not touched. `sharded_dir` (FSDP2: the ranks' DCP files, already
    written) is moved in as model_<step>/sharded.
    """
    final = checkpoint_dir(run_dir, step)
    tmp = os.path.join(run_dir, f".{CHECKPOINT_PREFIX}{step}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    hf_model.save_pretrained(tmp, state_dict=model_state)  # safetensors + config.json (+ modeling code)
    tokenizer.save_pretrained(tmp)
    if sharded_dir is not None:
        os.rename(sharded_dir, os.path.join(tmp, SHARDED_DIR))
    torch.save(dict(training_state, format=CHECKPOINT_FORMAT), os.path.join(tmp, TRAINING_STATE_FILE))
    summary = {k: training_state.get(k) for k in ("update_step", "tokens_seen", "world_size", "rank_param_checksums")}
    summary["saved_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with open(os.path.join(tmp, "training_state.json"), "w") as f:
        json.dump(summary, f, indent=2)
    _fsync_tree(tmp)
    if os.path.exists(final):  # same step saved by an earlier run: swap, then drop the old copy
        old = os.path.join(run_dir, f".{CHECKPOINT_PREFIX}{step}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    return final


def _short(err: Exception) -> str:
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{err.__class__.__name__}: {first_line[:160]}"


def load_model_weights(checkpoint: str, model) -> None:
    """Copy the safetensors weights into `model` from memory-mapped files (no second full copy in RAM)."""
    if not glob.glob(os.path.join(checkpoint, "*.safetensors")):
        raise CheckpointError(f"--continue_from {checkpoint}: no *.safetensors weights")
    try:
        missing = copy_safetensors_into(model, checkpoint)
    except (KeyError, ValueError) as err:
        raise CheckpointError(f"--continue_from {checkpoint}: weights do not fit the model ({_short(err)})") from err
    except Exception as err:  # safetensors raises its own error types for truncated/garbled files
        raise CheckpointError(f"--continue_from {checkpoint}: corrupt weights ({_short(err)})") from err
    if missing:
        raise CheckpointError(f"--continue_from {checkpoint}: weights do not fit the model (missing {missing[:3]})")


def load_training_state(checkpoint: str) -> dict:
    path = os.path.join(checkpoint, TRAINING_STATE_FILE)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # the optimizer state stays on disk
    except FileNotFoundError as err:
        raise CheckpointError(f"--continue_from {checkpoint}: {TRAINING_STATE_FILE} missing") from err
    except Exception as err:  # truncated zip, garbage bytes, unpickling error
        raise CheckpointError(f"--continue_from {checkpoint}: corrupt {TRAINING_STATE_FILE} ({_short(err)})") from err
    needed = ("format", "update_step", "tokens_seen", "world_size", "optimizer", "scheduler", "rng", "data")
    missing = [k for k in needed if k not in state]
    if missing:
        raise CheckpointError(f"--continue_from {checkpoint}: {TRAINING_STATE_FILE} lacks {', '.join(missing)}")
    if state["format"] != CHECKPOINT_FORMAT:
        raise CheckpointError(f"--continue_from {checkpoint}: checkpoint format {state['format']}, "
                              f"this code reads {CHECKPOINT_FORMAT}")
    return state


@contextlib.contextmanager
def keeping_adam_kernel(optimizer):
    """Around loading a checkpoint's optimizer state: the saved param groups replace the optimizer's own, kernel
    choice included, and torch places each `step` counter for the saved kernel. Keep this run's (--adam_kernel): the
    fused kernel wants `step` on the parameters' device, foreach on the CPU."""
    kernels = [{key: group[key] for key in ("fused", "foreach") if key in group} for group in optimizer.param_groups]
    yield
    for group, kernel in zip(optimizer.param_groups, kernels, strict=True):
        group.update(kernel)
        for param in group["params"]:
            step = optimizer.state.get(param, {}).get("step")
            if torch.is_tensor(step):
                on_device = group.get("fused") or group.get("capturable")
                optimizer.state[param]["step"] = step.to(param.device if on_device else "cpu")


def load_optimizer_state(model, optimizer, optimizer_state: dict):
    for group in optimizer.param_groups:  # the saved groups carry the scheduler's key; build_scheduler resets it
        group.setdefault("initial_lr", group["lr"])
    options = StateDictOptions(full_state_dict=True)
    with keeping_adam_kernel(optimizer):
        set_optimizer_state_dict(model, optimizer, optim_state_dict=optimizer_state, options=options)
