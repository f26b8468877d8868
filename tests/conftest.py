"""Every test runs offline and without a wandb account; the trainer helpers that many test files share."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parent.parent
# One intra-op thread per process: CPU float reductions then have one fixed order whatever the machine's load
# (bit-exact comparisons between processes), and a busy shared machine is not slowed by threads waiting on each other.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# The tiny model on the embedded corpus, on the CPU in fp32. A test adds its schedule, evaluation and saves; a later
# flag overrides an earlier one.
TINY_RUN = ["--model_config", "configs/llama_tiny.json", "--dataset", "embedded", "--max_length", "32",
            "--batch_size", "4", "--workers", "0", "--dtype", "float32", "--device", "cpu"]


def run_trainer(args, env=None, timeout=240, launcher=(sys.executable,)) -> subprocess.CompletedProcess:
    """torchrun_main.py in a process of its own (or under `launcher`, e.g. torchrun), from the repository root, one
    thread per process, output captured."""
    env = dict(env if env is not None else os.environ, **ONE_THREAD)
    return subprocess.run([*launcher, "torchrun_main.py", *[str(arg) for arg in args]], cwd=REPO,
                          capture_output=True, text=True, env=env, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.fixture
def one_rank_group(monkeypatch):
    """A test that builds a one-rank process group in process (init_distributed without torchrun) starts from no
    rank variables, and whatever group it creates is torn down after it."""
    import torch.distributed as dist

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
