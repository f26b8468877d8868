"""Norm gains: logged per layer at every evaluation, and frozen at exactly 1.0 by pure-bf16 weights at a small lr."""
import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from peft_pretraining.training import metrics_file, norm_gains, optimization
from tests.analysis_helpers import tiny_ours
from tests.conftest import TINY_RUN, run_trainer

REPO = Path(__file__).resolve().parent.parent
NUM_LAYERS = json.loads((REPO / "configs" / "llama_tiny.json").read_text())["num_hidden_layers"]


def train(run_dir: Path, dtype: str, lr: str, steps: int, eval_every: int) -> subprocess.CompletedProcess:
    proc = run_trainer([*TINY_RUN, "--eval_tokens", "200", "--dtype", dtype, "--optimizer", "adamw", "--lr", lr,
                        "--warmup_steps", "1", "--num_training_steps", steps, "--eval_every", eval_every,
                        "--save_every", steps, "--save_dir", run_dir])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def eval_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [row for row in rows if "eval_loss" in row]


def checkpoint_norms(checkpoint: Path) -> dict:
    return {name: tensor.float() for name, tensor in load_file(checkpoint / "model.safetensors").items()
            if "norm" in name}


@pytest.mark.e2e
def test_mixed_precision_logs_every_layers_mean_gain_and_plots_it(tmp_path):
    run_dir = tmp_path / "mixed"
    proc = train(run_dir, "mixed", "3e-3", steps=4, eval_every=2)
    assert "--dtype mixed" not in proc.stdout + proc.stderr  # no bf16 note for mixed precision
    rows = eval_rows(run_dir)
    assert [row["step"] for row in rows] == [2, 4]
    assert all(len(row["norm_gain_mean"]) == NUM_LAYERS for row in rows)
    norms = checkpoint_norms(run_dir / "model_4")  # saved right after the step-4 evaluation
    expected = [torch.cat([norms[f"model.layers.{i}.input_layernorm.weight"],
                           norms[f"model.layers.{i}.post_attention_layernorm.weight"]]).mean().item()
                for i in range(NUM_LAYERS)]
    assert rows[-1]["norm_gain_mean"] == pytest.approx(expected, abs=1e-7)
    assert rows[-1]["final_norm_gain_mean"] == pytest.approx(norms["model.norm.weight"].mean().item(), abs=1e-7)
    assert any(gain != 1.0 for gain in expected)  # fp32 master weights let the gains train
    assert (run_dir / "norm_gains.png").stat().st_size > 1000


@pytest.mark.e2e
def test_pure_bf16_at_lr_1e_3_prints_one_note_and_the_gains_stay_exactly_one(tmp_path):
    run_dir = tmp_path / "bf16"
    proc = train(run_dir, "bfloat16", "1e-3", steps=2, eval_every=2)
    notes = [line for line in (proc.stdout + proc.stderr).splitlines() if "--dtype mixed" in line]
    assert len(notes) == 1 and "bfloat16" in notes[0]
    assert all(gain == 1.0 for gain in eval_rows(run_dir)[-1]["norm_gain_mean"])
    assert all(bool((tensor == 1.0).all()) for tensor in checkpoint_norms(run_dir / "model_2").values())


def test_the_note_threshold_is_where_bf16_rounds_an_update_away_at_one():
    one = torch.ones((), dtype=torch.bfloat16)
    threshold = optimization.BF16_SMALLEST_UPDATE_AT_ONE
    assert one + 0.99 * threshold == one and one + 1.01 * threshold != one
    for optimizer in ("adam", "adamw"):
        assert optimization.pure_bf16_note("bfloat16", optimizer, 0.99 * threshold) is not None
        assert optimization.pure_bf16_note("bfloat16", optimizer, 1.01 * threshold) is None
    assert optimization.pure_bf16_note("mixed", "adam", 1e-3) is None
    assert optimization.pure_bf16_note("float32", "adam", 1e-3) is None


def test_mean_norm_gains_reads_through_a_wrapper():
    model = tiny_ours("lns", num_layers=3)
    with torch.no_grad():
        for index, layer in enumerate(model.model.layers):
            layer.input_layernorm.weight.fill_(index)
            layer.post_attention_layernorm.weight.fill_(index + 2)
        model.model.norm.weight.fill_(0.5)

    class Wrapper(torch.nn.Module):  # DistributedDataParallel keeps the model at .module
        def __init__(self, module):
            super().__init__()
            self.module = module

    assert norm_gains.mean_norm_gains(Wrapper(model)) == [1.0, 2.0, 3.0]
    assert norm_gains.final_norm_gain(Wrapper(model)) == 0.5


def test_a_layer_without_norms_is_logged_as_null(tmp_path):
    metrics = metrics_file.MetricsFile(str(tmp_path / "metrics.jsonl"))
    metrics.write({"step": 1, "norm_gain_mean": [1.0, float("nan")]})
    metrics.close()
    assert metrics_file.read_metrics(str(tmp_path / "metrics.jsonl")) == [{"step": 1, "norm_gain_mean": [1.0, None]}]
