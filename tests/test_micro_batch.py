"""The micro-batch and --loss are speed choices, not changes of run: one update of the trainer's own step
(Run.train_step) at accumulation 8, 2 and 1, the total batch of 8 sequences kept, and with the chunked loss, gives
the same loss and the same gradients to float summation order. The GPU check (utils/gpu/gpu_check.py, stages micro_batch
and losses) measures which is fastest."""
import contextlib

import pytest
import torch
import torch.distributed as dist

import torchrun_main
from peft_pretraining.model import head_losses
from peft_pretraining.training import args_utils
from peft_pretraining.training.distributed import init_distributed

TOTAL = 8
RTOL = 1e-5  # fp32 summation order; rows are padded, so a plain mean of micro-batch means is off by far more


def one_update(tmp_path, micro_batch: int, extra=()) -> tuple[float, dict[str, torch.Tensor]]:
    """The loss and the gradients of the first update, taken by the trainer's Run at --batch_size micro_batch."""
    args = args_utils.parse_args([
        "--model_config", "configs/llama_tiny.json", "--dataset", "embedded", "--max_length", "256", "--workers", "0",
        "--dtype", "float32", "--device", "cpu", "--total_batch_size", str(TOTAL), "--batch_size", str(micro_batch),
        "--num_training_steps", "2", "--warmup_steps", "1", "--eval_every", "2", "--eval_tokens", "1000",
        "--save_dir", str(tmp_path / f"b{micro_batch}"), *extra])
    rank, world_size, device = init_distributed(args)
    try:
        with contextlib.ExitStack() as on_exit:
            run = torchrun_main.Run(args, rank, world_size, device, on_exit)
            assert args.gradient_accumulation == TOTAL // micro_batch
            update = run.train_step()
            grads = {name: p.grad.clone() for name, p in run.model.named_parameters()}
    finally:
        dist.destroy_process_group()
    return update.loss, grads


@pytest.mark.e2e
def test_one_update_is_the_same_at_accumulation_8_2_and_1_and_with_the_chunked_loss(one_rank_group, tmp_path,
                                                                                   monkeypatch):
    monkeypatch.setattr(head_losses, "CHUNK_TOKENS", 300)  # 2,048 tokens a micro-batch: 7 chunks, the last short
    reference_loss, reference_grads = one_update(tmp_path, TOTAL)
    for micro_batch, loss_flag in ((1, "standard"), (4, "standard"), (TOTAL, "chunked")):  # accumulation 8, 2, 1
        loss, grads = one_update(tmp_path / loss_flag, micro_batch, ["--loss", loss_flag])
        assert loss == pytest.approx(reference_loss, rel=RTOL), (micro_batch, loss_flag)
        for name, grad in grads.items():  # element-wise, tiny gradients differ in their last bits: per tensor
            difference = (grad - reference_grads[name]).norm() / reference_grads[name].norm()
            assert difference < RTOL, f"micro-batch {micro_batch}, --loss {loss_flag}, {name}: {difference:.2e}"


def test_the_liger_loss_off_cuda_is_one_line_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        args_utils.parse_args(["--model_config", "configs/llama_tiny.json", "--dataset", "embedded",
                               "--batch_size", "2", "--device", "cpu", "--loss", "liger"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1 and "--loss liger" in err, err
