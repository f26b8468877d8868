"""The run folder of torchrun_main.py: one owner at a time, recovery after a crash, one history, no torn files.

- ``locked(run_dir)``: an exclusive ``fcntl.flock`` on RUN/run.lock, held by rank 0 for the whole run, with the
  holder's PID written inside. The kernel drops a flock when its holder dies (kill -9 included), so a lock file left
  behind by a dead process never blocks; ``lock_holder`` probes it without taking it.
- ``recover(run_dir)``: at start-up, removes the temporary folders and files of a save cut short (.model_N.tmp,
  metrics.jsonl.tmp, .results.json.tmp) and restores .model_N.old as model_N when a crash fell between the two
  renames of a re-save.
- ``supersede_after(run_dir, step)``: resuming from step k moves the folder's model_N with N > k (and its results.json)
  into RUN/superseded/, as the metric rows past k go to metrics_superseded.jsonl, so that a run folder only ever holds
  one history and resuming the folder can never pick up the abandoned one.
- ``write_json_atomic``, ``write_lines_atomic``, ``fsync_dir``: temporary file, fsync, rename, then fsync the folder.
- ``read_jsonl``: metrics.jsonl rows, dropping a last line cut short by a crash or a full disk (with a note).
- ``is_no_space``: recognises a full disk however the writer reports it (OSError ENOSPC, safetensors' message, or
  torch's "unexpected pos" on a nearly full disk); the trainer then exits with ExitCode.NO_SPACE.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import json
import os
import re
import shutil
import time

from peft_pretraining.exit_codes import ExitCode

CHECKPOINT_PREFIX = "model_"
LOCK_FILE = "run.lock"
SUPERSEDED_DIR = "superseded"
TRAINING_STATE_FILE = "training_state.pt"
LOCK_WAIT_S = 1.0  # a second process probing the lock holds it for microseconds; do not mistake that for an owner

_CHECKPOINT = re.compile(rf"{CHECKPOINT_PREFIX}(\d+)")
_OLD_CHECKPOINT = re.compile(rf"\.{CHECKPOINT_PREFIX}(\d+)\.old")
_PARTIAL_CHECKPOINT = re.compile(rf"\.{CHECKPOINT_PREFIX}\d+(\.sharded)?\.tmp")  # .sharded.tmp: an FSDP save's shards
_TEMP_FILES = ("metrics.jsonl.tmp", ".results.json.tmp")
_NO_SPACE_MESSAGES = ("no space left on device", "os error 28", "disk quota exceeded")
_TORCH_WRITE_FAILURES = ("unexpected pos", "file write failed", "iostream error")
_NEARLY_FULL_BYTES = 16 * 2**20


class RunFolderBusy(Exception):
    """Another live process holds the run folder's lock."""


class SaveFailed(Exception):
    """Rank 0 could not save a checkpoint (or another file only it writes); raised on every rank with one exit code."""

    def __init__(self, message: str, exit_code: ExitCode):
        super().__init__(message)
        self.exit_code = exit_code


# ----------------------------------------------------------------------------------------------------------------
# Lock
# ----------------------------------------------------------------------------------------------------------------

def _read_pid(fd: int) -> str:
    text = os.pread(fd, 64, 0).decode(errors="replace").strip()
    return text if text.isdigit() else "unknown"


def busy_message(run_dir: str, pid: str) -> str:
    return (f"run folder {run_dir} is in use by process {pid} (lock {os.path.join(run_dir, LOCK_FILE)}); "
            f"wait for it to end or choose another --save_dir")


def lock_holder(run_dir: str) -> str | None:
    """The PID of the live process holding run_dir's lock, or None; takes nothing and writes nothing."""
    try:
        fd = os.open(os.path.join(run_dir, LOCK_FILE), os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None  # nobody holds it (a dead holder's lock went with it); closing the fd releases the probe
    except BlockingIOError:
        return _read_pid(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def locked(run_dir: str):
    """Hold run_dir's exclusive lock for the duration of the block; RunFolderBusy if a live process holds it."""
    fd = os.open(os.path.join(run_dir, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RunFolderBusy(busy_message(run_dir, _read_pid(fd))) from None
                time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        os.fsync(fd)
        yield
    finally:
        os.close(fd)  # releases the lock; the file stays (unlinking it would race with a process opening it)


# ----------------------------------------------------------------------------------------------------------------
# Durable writes
# ----------------------------------------------------------------------------------------------------------------

def fsync_dir(directory: str):
    """Make the renames and creations inside `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_lines_atomic(path: str, lines: list[str], temp_path: str | None = None):
    """Replace `path` by `lines` all at once: a crash or a full disk leaves the old file or the new one, whole."""
    temp_path = temp_path or path + ".tmp"
    try:
        with open(temp_path, "w") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp_path, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temp_path)
        raise
    fsync_dir(os.path.dirname(path) or ".")


def write_json_atomic(path: str | os.PathLike, payload: dict, indent: int = 2):
    """`payload` as JSON in `path` all at once (write_lines_atomic), through the temporary file .<name>.tmp."""
    folder, name = os.path.split(path)
    write_lines_atomic(path, [json.dumps(payload, indent=indent) + "\n"], os.path.join(folder, f".{name}.tmp"))


def read_jsonl(path: str) -> tuple[list[str], list[str]]:
    """(lines, notes): the JSON object lines of `path`, each ending in a newline.

    A last line that is not JSON was cut short by a crash or a full disk: it is dropped, and a note says so. A bad
    line anywhere else is damage, not a crash: ValueError naming the file and the line.
    """
    with open(path) as f:
        numbered = [(number, line) for number, line in enumerate(f, start=1) if line.strip()]
    lines, notes = [], []
    for index, (number, line) in enumerate(numbered):
        try:
            json.loads(line)
        except ValueError:
            if index < len(numbered) - 1:
                raise ValueError(f"{path}: line {number} is not JSON; repair or remove that line") from None
            notes.append(f"note: {path}: dropped the last line ({len(line)} characters), cut short by a crash or "
                         f"a full disk")
            break
        lines.append(line if line.endswith("\n") else line + "\n")
    return lines, notes


# ----------------------------------------------------------------------------------------------------------------
# Start-up recovery and one history per folder
# ----------------------------------------------------------------------------------------------------------------

def recover(run_dir: str) -> list[str]:
    """Undo what a crash in the middle of a save left behind (call with the lock held); returns notes."""
    notes = []
    for name in sorted(os.listdir(run_dir)):
        path = os.path.join(run_dir, name)
        old = _OLD_CHECKPOINT.fullmatch(name)
        if old and os.path.isdir(path):
            final = os.path.join(run_dir, f"{CHECKPOINT_PREFIX}{old.group(1)}")
            if os.path.exists(final):  # the swap finished; only the removal of the old copy was cut short
                shutil.rmtree(path)
                notes.append(f"recovery: removed {name}, an old copy already replaced by {os.path.basename(final)}")
            else:  # killed between the two renames of a re-save: the old copy is the last complete one
                os.rename(path, final)
                notes.append(f"recovery: restored {os.path.basename(final)} from {name}")
    for name in sorted(os.listdir(run_dir)):
        path = os.path.join(run_dir, name)
        if _PARTIAL_CHECKPOINT.fullmatch(name) and os.path.isdir(path):
            shutil.rmtree(path)
            notes.append(f"recovery: removed {name}, a checkpoint whose save was cut short")
        elif name in _TEMP_FILES and os.path.isfile(path):
            os.remove(path)
            notes.append(f"recovery: removed {name}, a rewrite that was cut short")
    if notes:
        fsync_dir(run_dir)
    return notes


def remove_partial_checkpoints(run_dir: str):
    """After a failed save: free the space a half-written .model_N.tmp holds."""
    for name in os.listdir(run_dir):
        if _PARTIAL_CHECKPOINT.fullmatch(name):
            shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)


def checkpoint_steps(run_dir: str) -> list[int]:
    return sorted(int(m.group(1)) for m in map(_CHECKPOINT.fullmatch, os.listdir(run_dir)) if m)


def _free_name(folder: str, name: str) -> str:
    candidate, copy = os.path.join(folder, name), 2
    while os.path.exists(candidate):
        candidate, copy = os.path.join(folder, f"{name}-{copy}"), copy + 1
    return candidate


def supersede_after(run_dir: str, step: int) -> list[str]:
    """Resuming from `step`: move the folder's later checkpoints (and the results of that later history) aside."""
    later = [f"{CHECKPOINT_PREFIX}{s}" for s in checkpoint_steps(run_dir) if s > step]
    if not later:
        return []
    if os.path.exists(os.path.join(run_dir, "results.json")):
        later.append("results.json")
    superseded = os.path.join(run_dir, SUPERSEDED_DIR)
    os.makedirs(superseded, exist_ok=True)
    for name in later:
        os.rename(os.path.join(run_dir, name), _free_name(superseded, name))
    fsync_dir(superseded)
    fsync_dir(run_dir)
    return [f"resuming from step {step}: moved {', '.join(later)} of the later history into {superseded}"]


# ----------------------------------------------------------------------------------------------------------------
# Full disk
# ----------------------------------------------------------------------------------------------------------------

def is_no_space(err: BaseException, folder: str | None = None) -> bool:
    """True when `err` (or what caused it) is a full disk or quota."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        message = str(err).lower()
        if any(text in message for text in _NO_SPACE_MESSAGES):
            return True
        # torch.save reports a failed write without its errno; a nearly full disk says what it was.
        if (folder is not None and any(text in message for text in _TORCH_WRITE_FAILURES)
                and os.path.isdir(folder) and shutil.disk_usage(folder).free < _NEARLY_FULL_BYTES):
            return True
        err = err.__cause__ or err.__context__
    return False


# ----------------------------------------------------------------------------------------------------------------
# Which checkpoint a folder resumes from, and whether it holds a run
# ----------------------------------------------------------------------------------------------------------------

def find_checkpoint(path: str) -> str | None:
    """A checkpoint folder itself, or the highest-step checkpoint of a run folder; None if neither.

    A run folder's checkpoints are its model_<step> folders, and a .model_<step>.old whose model_<step> is missing
    (a crash between the two renames of a re-save; the trainer restores it at start-up). Checkpoints moved into
    superseded/ belong to an abandoned history and are never picked.
    """
    if os.path.isfile(os.path.join(path, TRAINING_STATE_FILE)):
        return path
    candidates = []
    for sub in glob.glob(os.path.join(path, CHECKPOINT_PREFIX + "*")) + glob.glob(os.path.join(path, ".*.old")):
        name = os.path.basename(sub).removeprefix(".").removesuffix(".old")
        suffix = name[len(CHECKPOINT_PREFIX):]
        if sub.endswith(".old") and os.path.exists(os.path.join(path, name)):
            continue
        if name.startswith(CHECKPOINT_PREFIX) and suffix.isdigit() and \
                os.path.isfile(os.path.join(sub, TRAINING_STATE_FILE)):
            candidates.append((int(suffix), sub))
    return max(candidates)[1] if candidates else None


def holds_a_run(path: str) -> bool:
    """A checkpoint or a results.json: a run to resume or a finished one. A folder with only metrics.jsonl is a run
    killed before its first checkpoint: a fresh start may take it over (its rows move to metrics_superseded.jsonl)."""
    return os.path.isdir(path) and (os.path.exists(os.path.join(path, "results.json"))
                                    or find_checkpoint(path) is not None)


def branches_into_another_run(checkpoint: str, save_dir: str) -> bool:
    """--continue_from CHECKPOINT --save_dir SAVE_DIR where SAVE_DIR is not the checkpoint's own run folder and
    already holds a run: writing there would mix that run's history with the branch's. A run killed before its
    first checkpoint counts when its metrics.jsonl has rows up to the branch step; rows only after it are an
    interrupted attempt of this same branch, which the resume moves to metrics_superseded.jsonl."""
    if os.path.realpath(save_dir) == checkpoint_run_folder(checkpoint):
        return False
    return holds_a_run(save_dir) or _has_rows_up_to(os.path.join(save_dir, "metrics.jsonl"), _step_of(checkpoint))


def _step_of(checkpoint: str) -> int | None:
    suffix = os.path.basename(os.path.normpath(checkpoint))[len(CHECKPOINT_PREFIX):]
    return int(suffix) if suffix.isdigit() else None


def _has_rows_up_to(metrics_path: str, step: int | None) -> bool:
    if not os.path.isfile(metrics_path):
        return False
    try:
        lines, _ = read_jsonl(metrics_path)
    except ValueError:
        return True  # a damaged history is still another history
    return any(step is None or json.loads(line).get("step", 0) <= step for line in lines)


def checkpoint_run_folder(checkpoint: str) -> str:
    """The run folder a checkpoint belongs to (its parent), resolved."""
    return os.path.realpath(os.path.dirname(os.path.abspath(checkpoint)))


def branch_refusal(checkpoint: str, save_dir: str) -> str:
    return (f"--save_dir {save_dir} already holds another run, and --continue_from {checkpoint} belongs to "
            f"{checkpoint_run_folder(checkpoint)}; branch into a new --save_dir, or resume "
            f"{save_dir} with --continue_from {save_dir}")
