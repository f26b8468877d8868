"""peft_pretraining/training/distributed.py: gradient sync under torch.compile, the collective timeout, FSDP2 precision.

In-process tests use a one-rank gloo group (as torchrun_main.py does without torchrun); the FSDP2 dtypes need two
ranks, launched through torchrun on gloo.
"""
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from peft_pretraining.training import args_utils
from peft_pretraining.training.distributed import DEFAULT_TIMEOUT_MINUTES, grad_sync, init_distributed

REPO = Path(__file__).resolve().parent.parent
TINY = ["--model_config", "configs/llama_tiny.json", "--dataset", "embedded", "--batch_size", "4", "--device", "cpu"]


def default_group_timeout() -> datetime.timedelta:
    return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout


def test_compiled_ddp_model_skips_the_all_reduce_on_accumulation_micro_batches(one_rank_group):
    init_distributed(args_utils.parse_args(TINY))
    ddp = DistributedDataParallel(torch.nn.Linear(4, 4))
    compiled = torch.compile(ddp)  # the trainer's --compile: not itself a DistributedDataParallel
    with grad_sync(compiled, is_last_micro_batch=False):
        assert not ddp.require_backward_grad_sync  # inside DDP.no_sync()
    assert ddp.require_backward_grad_sync
    with grad_sync(compiled, is_last_micro_batch=True):
        assert ddp.require_backward_grad_sync


@pytest.mark.parametrize("flags, minutes", [([], DEFAULT_TIMEOUT_MINUTES), (["--dist_timeout_minutes", "7.5"], 7.5)])
def test_dist_timeout_reaches_the_process_group(one_rank_group, flags, minutes):
    init_distributed(args_utils.parse_args([*TINY, *flags]))
    assert default_group_timeout() == datetime.timedelta(minutes=minutes)


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_dist_timeout_must_be_positive(value, capsys):
    with pytest.raises(SystemExit) as exit:
        args_utils.parse_args([*TINY, "--dist_timeout_minutes", value])
    assert exit.value.code == 2
    assert "--dist_timeout_minutes" in capsys.readouterr().err


# --dtype: (all-gather and compute, gradient reduce-scatter, sharded master weights and their gradients)
FSDP_DTYPES = {"mixed": ("torch.bfloat16", "torch.float32", "torch.float32"),
               "bfloat16": ("torch.bfloat16", "torch.bfloat16", "torch.bfloat16"),  # the paper's pure bf16
               "float32": ("torch.float32", "torch.float32", "torch.float32")}


@pytest.mark.e2e
def test_fsdp2_precision_by_dtype_on_two_gloo_ranks():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "tests/fsdp_precision_probe.py", *FSDP_DTYPES], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=180, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for dtype, (gathered, reduced, master) in FSDP_DTYPES.items():
        seen = report[dtype]
        assert seen["all_gather_single"] == [gathered] and seen["compute"] == [gathered], dtype
        assert seen["reduce_scatter_single"] == [reduced], dtype
        assert seen["sharded"] == [master] and seen["sharded_grad"] == [master], dtype
