"""Two CPU ranks through torchrun (gloo): DDP and FSDP2 against a single process with the same total batch.

The embedded corpus gives rank r the documents r, r + 2, ... of the single-process order, so a 2 x 4 DDP update sees
the same 8 documents as a 1 x 8 update; with max_length 32 every document fills its row, so the per-rank mean
losses average to the single-process mean. What remains is float summation order: the losses must agree within
LOSS_RTOL (measured differences are ~1e-5 relative). With padding the rows hold different numbers of targets; the
last test checks that an update still weighs every target token the same, however its rows are split.
"""
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import run_trainer

pytestmark = pytest.mark.e2e  # every test here starts a process

REPO = Path(__file__).resolve().parent.parent
STEPS = 4
COMMON = ["--model_config", "configs/llama_tiny.json", "--dataset", "embedded", "--max_length", "32",
          "--workers", "0", "--eval_tokens", "1000", "--dtype", "float32", "--device", "cpu", "--lr", "3e-3",
          "--warmup_steps", "1", "--num_training_steps", str(STEPS), "--eval_every", str(STEPS),
          "--save_every", str(STEPS // 2), "--total_batch_size", "8"]
LOSS_RTOL = 1e-3


def launch(launcher, args, timeout=300):
    proc = run_trainer(args, timeout=timeout, launcher=launcher)  # one thread per rank: 2 ranks on 2 cores
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def torchrun(nproc):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def losses(run_dir):
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line)["loss"] for line in f]


@pytest.fixture(scope="module")
def single_process_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single") / "run"
    launch([sys.executable], [*COMMON, "--batch_size", "8", "--save_dir", str(run_dir)])
    return run_dir


def test_ddp_two_ranks_stay_identical_and_match_one_process(single_process_run, tmp_path):
    run_dir = tmp_path / "ddp"
    proc = launch(torchrun(2), [*COMMON, "--batch_size", "4", "--save_dir", str(run_dir)])
    assert "wrap=ddp" in proc.stdout + proc.stderr
    for step in (STEPS // 2, STEPS):
        state = json.loads((run_dir / f"model_{step}" / "training_state.json").read_text())
        checksums = state["rank_param_checksums"]
        assert len(checksums) == 2 and checksums[0] == checksums[1], checksums
    assert losses(run_dir) == pytest.approx(losses(single_process_run), rel=LOSS_RTOL)
    results = json.loads((run_dir / "results.json").read_text())
    assert results["eval_tokens"] == 1000  # the two ranks' shares add up to exactly --eval_tokens


def test_fsdp2_two_ranks_match_one_process_and_resume_exactly(single_process_run, tmp_path):
    run_dir = tmp_path / "fsdp"
    proc = launch(torchrun(2), [*COMMON, "--batch_size", "4", "--fsdp", "--save_dir", str(run_dir)])
    assert "wrap=fsdp2" in proc.stdout + proc.stderr
    assert losses(run_dir) == pytest.approx(losses(single_process_run), rel=LOSS_RTOL)
    # The gathered checkpoint is a plain full HF state dict, close to the single-process weights.
    sharded = load_file(run_dir / f"model_{STEPS}" / "model.safetensors")
    single = load_file(single_process_run / f"model_{STEPS}" / "model.safetensors")
    assert sharded.keys() == single.keys()
    assert all(torch.allclose(sharded[k], single[k], atol=1e-3) for k in single)

    # Each rank wrote its own shard of model + optimizer state; training_state.pt holds no optimizer state.
    halfway = run_dir / f"model_{STEPS // 2}"
    assert sorted(p.name for p in (halfway / "sharded").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert torch.load(halfway / "training_state.pt", weights_only=True)["optimizer"] is None
    assert not list(run_dir.glob(".model_*"))  # no staging folders left behind
    # The HF export names our model class, not the FSDP wrapper class (whose torch sources were copied in before).
    assert json.loads((halfway / "config.json").read_text())["auto_map"] == {
        "AutoConfig": "modeling_llama.NormPlacementConfig", "AutoModelForCausalLM": "modeling_llama.LlamaForCausalLM"}
    assert not list(halfway.glob("_fsdp*"))

    resumed = tmp_path / "fsdp_resumed"
    launch(torchrun(2), [*COMMON, "--batch_size", "4", "--fsdp", "--save_dir", str(resumed),
                         "--continue_from", str(halfway)])
    assert losses(resumed) == losses(run_dir)[STEPS // 2:]
    uninterrupted = load_file(run_dir / f"model_{STEPS}" / "model.safetensors")
    after_resume = load_file(resumed / f"model_{STEPS}" / "model.safetensors")
    assert all(torch.equal(uninterrupted[k], after_resume[k]) for k in uninterrupted)  # bit-exact on CPU


def test_a_padded_update_does_not_depend_on_how_its_rows_are_split(tmp_path):
    """max_length 256 pads every row, so micro-batches and ranks hold different numbers of targets (a mean per
    micro-batch, averaged, would weigh them unequally: grad norms then differed by 0.7%). One process 1 x 8,
    accumulation 4 x 2 and two ranks 2 x 4 see the same 8 documents and must take the same update."""
    padded = [*COMMON, "--max_length", "256", "--num_training_steps", "2", "--eval_every", "2", "--save_every", "2"]
    rows = {}
    for name, launcher, batch in (("one", [sys.executable], "8"), ("accumulated", [sys.executable], "4"),
                                  ("ranks", torchrun(2), "4")):
        launch(launcher, [*padded, "--batch_size", batch, "--save_dir", str(tmp_path / name)])
        with open(tmp_path / name / "metrics.jsonl") as f:
            rows[name] = [json.loads(line) for line in f]
    for name in ("accumulated", "ranks"):
        for row, reference in zip(rows[name], rows["one"], strict=True):
            assert row["tokens_seen"] == reference["tokens_seen"]
            assert row["loss"] == pytest.approx(reference["loss"], rel=1e-5), name
            assert row["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5), name
