"""metrics.jsonl: one JSON row per update step, written by rank 0 and read back by the plots and the tools."""
import json
import math
import os

from peft_pretraining.training import run_folder


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
