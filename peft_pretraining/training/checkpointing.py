"""Checkpoints: model_<step>/ written atomically and read back on resume, sharded FSDP2 state, memory-mapped loading,
pruning old saves, and the trainer's Checkpointer, which owns both the resume and the save.
(Which checkpoint a run folder resumes from: run_folder.find_checkpoint.)

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

from peft_pretraining.training.distributed import gather_rank_objects
from peft_pretraining.training.rng import capture_rng_state, restore_rng_state
from peft_pretraining.training.run_folder import CHECKPOINT_PREFIX, TRAINING_STATE_FILE, fsync_dir

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


# ----------------------------------------------------------------------------------------------------------------
# What a resume compares, and what a DDP save checks
# ----------------------------------------------------------------------------------------------------------------

RESUME_FLAGS_TO_COMPARE = ("lr", "scheduler", "min_lr_ratio", "warmup_steps", "num_training_steps", "weight_decay",
                           "optimizer", "total_batch_size", "batch_size", "max_length", "packing", "dataset",
                           "dataset_path", "tokenizer", "dtype", "grad_clipping", "seed", "adam_kernel")


def changed_flags(saved_args: dict, new_args: dict) -> dict:
    """{flag: (checkpoint value, current value)} for the flags that shape the trajectory."""
    return {k: (saved_args[k], new_args.get(k)) for k in RESUME_FLAGS_TO_COMPARE
            if k in saved_args and saved_args[k] != new_args.get(k)}


def parameter_checksum(model) -> float:
    """Sum of all parameters in float64: equal on every DDP rank when the replicas are in sync."""
    with torch.no_grad():
        return float(sum(p.detach().double().sum().item() for p in model.parameters()))


# ----------------------------------------------------------------------------------------------------------------
# The trainer's checkpoints, both ways
# ----------------------------------------------------------------------------------------------------------------

class Checkpointer:
    """What a run resumes from and what it saves.

    Resuming: --continue_from's training state is read once, at start-up, and restored piece by piece as the
    trainer builds each object (weights, data position, optimizer, schedule position, RNGs), then released.
    Saving: every rank gathers its part (shards, RNG, data position), then rank 0 writes model_<step>/ atomically,
    prunes (--keep_last) and slims (--resumable_last) the older checkpoints.
    """

    def __init__(self, resume_from: str | None, *, rank: int, world_size: int, fsdp: bool, keep_last: int | None,
                 resumable_last: int | None, log):
        self.resume_from = resume_from
        self.rank, self.world_size, self.fsdp = rank, world_size, fsdp
        self.keep_last, self.resumable_last = keep_last, resumable_last
        self.log = log
        self.resume_state = self._read_resume_state() if resume_from is not None else None

    # ---- resume, in the order the trainer builds what it restores ----------------------------------------------
    def _read_resume_state(self) -> dict:
        state = load_training_state(self.resume_from)
        if state["world_size"] != self.world_size:
            raise CheckpointError(f"--continue_from {self.resume_from}: saved with world size {state['world_size']}, "
                                  f"this run has {self.world_size} (the data position is per rank)")
        return state

    @property
    def resume_step(self) -> int | None:
        return self.resume_state["update_step"] if self.resume_state is not None else None

    @property
    def sharded(self) -> bool:
        """FSDP2 state: the weights come from sharded/ after wrapping, not from the safetensors."""
        return self.resume_state is not None and bool(self.resume_state.get("sharded"))

    def load_weights(self, model):
        if self.resume_state is not None and not self.sharded:
            load_model_weights(self.resume_from, model)

    def load_data_position(self, stream):
        if self.resume_state is not None:
            stream.load_state_dict(self.resume_state["data"][self.rank])

    def load_optimizer(self, train_model, optimizer):
        """The optimizer state (and, for sharded state, the weights: this rank's shards)."""
        if self.sharded:
            try:
                with keeping_adam_kernel(optimizer):
                    load_sharded(self.resume_from, train_model, optimizer)
            except ShardedLoadError as err:
                raise CheckpointError(str(err)) from err
        elif self.resume_state is not None:
            load_optimizer_state(train_model, optimizer, self.resume_state["optimizer"])

    def resume_position(self) -> tuple[int, int]:
        """(update step, tokens seen) of the checkpoint; (0, 0) for a fresh start."""
        if self.resume_state is None:
            return 0, 0
        return self.resume_state["update_step"], self.resume_state["tokens_seen"]

    def load_rng(self, args):
        """Last: after everything that draws random numbers. Then the checkpoint's state is released (the
        optimizer's is memory-mapped), and the flags that differ from the checkpoint's run are noted."""
        if self.resume_state is None:
            return
        state, self.resume_state = self.resume_state, None
        restore_rng_state(state["rng"][self.rank])
        self.log(f"resumed from {self.resume_from}: update step {state['update_step']}, tokens seen "
                 f"{state['tokens_seen']}")
        for flag, (saved, now) in changed_flags(state.get("args", {}), vars(args)).items():
            self.log(f"note: --{flag} is {now!r} now, {saved!r} in the checkpoint's run (using {now!r})")

    # ---- save: gathered on every rank, written by rank 0 -----------------------------------------------------
    def gather(self, run_dir: str, step: int, *, model, train_model, optimizer, stream) -> dict:
        """Collective: this step's state from every rank (FSDP2: each rank's shards are written here already)."""
        if self.fsdp:  # each rank writes its own shards; rank 0 gathers the model weights for the HF export
            sharded_dir = save_sharded(run_dir, step, train_model, optimizer)
            model_state, optimizer_state = full_model_state(train_model), None
        else:
            sharded_dir = None
            model_state, optimizer_state = full_state_dicts(train_model, optimizer)
        return {
            "sharded_dir": sharded_dir, "model_state": model_state, "optimizer_state": optimizer_state,
            "rng": gather_rank_objects(capture_rng_state()),
            "data": gather_rank_objects(stream.state_dict()),
            # DDP replicas must be bit-identical; every rank's checksum makes a silent desync visible.
            "checksums": gather_rank_objects(parameter_checksum(model)) if not self.fsdp else None,
        }

    def write(self, run_dir: str, step: int, gathered: dict, *, export_model, tokenizer, scheduler,
              tokens_seen: int, args) -> str:
        """Rank 0: model_<step>/ from what gather() returned, made durable, then the older checkpoints pruned and
        slimmed. Returns the checkpoint's folder."""
        checksums = gathered["checksums"]
        if checksums is not None and len(set(checksums)) > 1:
            self.log(f"WARNING: ranks' parameters differ at step {step}: checksums {checksums}")
        path = save_checkpoint(
            run_dir, step, hf_model=export_model, model_state=gathered["model_state"], tokenizer=tokenizer,
            training_state={"update_step": step, "tokens_seen": tokens_seen, "world_size": self.world_size,
                            "optimizer": gathered["optimizer_state"], "scheduler": scheduler.state_dict(),
                            "rng": gathered["rng"], "data": gathered["data"], "args": vars(args),
                            "rank_param_checksums": checksums, "sharded": self.fsdp},
            sharded_dir=gathered["sharded_dir"])
        fsync_dir(run_dir)  # the rename into model_<step> survives a power loss
        self.log(f"checkpoint: {path}")
        for removed in prune_checkpoints(run_dir, step, self.keep_last):
            self.log(f"removed {removed} (--keep_last {self.keep_last})")
        for slimmed in drop_training_state(run_dir, step, self.resumable_last):
            self.log(f"dropped the training state of {slimmed} (--resumable_last {self.resumable_last})")
        return path
