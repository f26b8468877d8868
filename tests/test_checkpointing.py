"""Checkpoint helpers in one process: DCP sharded state round trip and refusal, mmap weight copy, pruning lives in
test_training.py. The two-rank FSDP2 save/resume runs in test_distributed.py."""
import contextlib

import pytest
import torch
from safetensors.torch import save_file

from peft_pretraining.training import checkpointing


def tiny_model_and_optimizer(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def save_sharded_alone(folder, model, optimizer):
    import torch.distributed.checkpoint as dcp

    dcp.save(checkpointing._sharded_state(model, optimizer), checkpoint_id=str(folder / checkpointing.SHARDED_DIR))


def test_sharded_state_round_trip_and_missing_shard(tmp_path):
    model, optimizer = tiny_model_and_optimizer(0)
    save_sharded_alone(tmp_path, model, optimizer)
    other, other_optimizer = tiny_model_and_optimizer(1)
    checkpointing.load_sharded(str(tmp_path), other, other_optimizer)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
    saved, loaded = optimizer.state_dict()["state"], other_optimizer.state_dict()["state"]
    assert all(torch.equal(saved[i]["exp_avg_sq"], loaded[i]["exp_avg_sq"]) for i in saved)

    for shard in (tmp_path / checkpointing.SHARDED_DIR).glob("*.distcp"):
        shard.unlink()
    with pytest.raises(checkpointing.ShardedLoadError, match="lacks __0_0.distcp"):
        checkpointing.load_sharded(str(tmp_path), other, other_optimizer)


def test_a_failed_sharded_save_is_an_exception_the_trainer_handles(tmp_path, monkeypatch):
    """DCP raises CheckpointException, a BaseException, which `except Exception` misses: a full disk during an FSDP
    save would end in a traceback instead of exit 4. It comes back as ShardedSaveError, recognised as no space."""
    import errno

    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from peft_pretraining.training import run_folder

    def full_disk(*args, **kwargs):
        failure = _wrap_exception(OSError(errno.ENOSPC, "No space left on device"))  # as DCP records rank 1's
        raise CheckpointException("save failed", {1: failure})

    monkeypatch.setattr(checkpointing.dcp, "save", full_disk)
    monkeypatch.setattr(checkpointing.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(checkpointing.dist, "barrier", lambda: None)
    model, optimizer = tiny_model_and_optimizer(0)
    with pytest.raises(checkpointing.ShardedSaveError) as error:
        checkpointing.save_sharded(str(tmp_path), 2, model, optimizer)
    assert isinstance(error.value, Exception) and run_folder.is_no_space(error.value, str(tmp_path))
    assert list(tmp_path.iterdir()) == []  # the staging folder of the partial shards is gone


def test_weights_are_copied_from_safetensors_and_mismatches_refused(tmp_path):
    model, _ = tiny_model_and_optimizer(0)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "model.safetensors")
    other, _ = tiny_model_and_optimizer(1)
    assert checkpointing.copy_safetensors_into(other, str(tmp_path)) == []
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
    save_file({"0.weight": torch.zeros(8, 5)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="0.weight"):
        checkpointing.copy_safetensors_into(other, str(tmp_path))


def test_a_sharded_resume_keeps_this_runs_adam_kernel(tmp_path):
    """DCP's set_state_dict replaces the param groups with the saved ones, kernel flags included; the trainer loads
    inside keeping_adam_kernel, as it does for the full state dict."""
    from peft_pretraining.training.checkpointing import keeping_adam_kernel
    from peft_pretraining.training.optimization import build_optimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    fused = build_optimizer(model.parameters(), "adam", 1e-2, 0.0, "fused")
    model(torch.randn(3, 4)).sum().backward()
    fused.step()
    fused.zero_grad(set_to_none=True)  # as at a resume: DCP sets up an empty optimizer's state only without grads
    save_sharded_alone(tmp_path, model, fused)
    for keep in (False, True):
        foreach = build_optimizer(model.parameters(), "adam", 1e-2, 0.0, "foreach")
        with keeping_adam_kernel(foreach) if keep else contextlib.nullcontext():
            checkpointing.load_sharded(str(tmp_path), model, foreach)
        group = foreach.param_groups[0]
        assert bool(group["foreach"]) == keep and bool(group["fused"]) != keep  # without it, the checkpoint's kernel
        assert foreach.state[next(model.parameters())]["step"].device.type == "cpu"
