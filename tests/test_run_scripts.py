"""The run scripts as a user calls them: exit codes through torchrun, and the GPU tools' refusal on a CPU machine."""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from peft_pretraining.exit_codes import ExitCode

REPO = Path(__file__).resolve().parent.parent
FEW_STEPS = ["--model_config", "configs/llama_tiny.json", "--max_length", "32", "--num_training_steps", "4",
             "--warmup_steps", "0", "--eval_every", "4", "--save_every", "4", "--eval_tokens", "500"]


def run_tiny(*flags, nproc=2, timeout=180):
    env = dict(os.environ, NPROC=str(nproc), PYTHON=sys.executable, OMP_NUM_THREADS="1")
    return subprocess.run(["bash", "run_tiny.sh", "pre", *flags], cwd=REPO, capture_output=True, text=True, env=env,
                          timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.mark.e2e
def test_run_tiny_under_torchrun_exits_2_on_a_bad_flag(tmp_path):
    proc = run_tiny(*FEW_STEPS, "--no_such_flag", "--save_dir", str(tmp_path / "run"))
    assert proc.returncode == ExitCode.BAD_INPUT, proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()


@pytest.mark.e2e
def test_run_tiny_under_torchrun_exits_3_on_divergence_with_results_written(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_tiny(*FEW_STEPS, "--lr", "1e39", "--save_dir", str(run_dir))
    assert proc.returncode == ExitCode.DIVERGED, proc.stderr[-2000:]
    results = json.loads((run_dir / "results.json").read_text())  # rank 0 finished writing before the ranks left
    assert results["status"] == "diverged" and results["step"] < 4


@pytest.mark.e2e
@pytest.mark.parametrize("command", [["bash", "utils/gpu/gpu_smoke.sh", "{out}"],
                                     ["bash", "utils/gpu/gpu_check.sh", "{out}"],
                                     [sys.executable, "utils/bench/benchmark_gpu.py", "--json", "{out}"]])
def test_gpu_tools_refuse_a_machine_without_cuda_in_one_line(command, tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)
    command = [part.format(out=tmp_path / "out") for part in command]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "no CUDA device" in proc.stderr
    assert not (tmp_path / "out").exists()  # nothing written


def test_gpu_check_names_a_recipe_size_it_does_not_know_in_one_line(tmp_path, capsys):
    from utils.gpu import gpu_check

    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main([str(tmp_path / "out"), "--stages", "recipes", "--recipe_sizes", "7b"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1 and "--recipe_sizes" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag, value", [("--steps", "0"), ("--warmup", "-1"), ("--seq_len", "0"),
                                         ("--batch_size", "0"), ("--peak_tflops", "0")])
def test_benchmark_gpu_refuses_bad_counts_before_any_gpu_work(flag, value, monkeypatch, capsys):
    """On a GPU, --steps 0 ended in a traceback (the median of no timings) after every warm-up step, and
    --batch_size 0 silently ran the paper's micro-batch: refused in one line before CUDA is touched."""
    import torch

    from utils.bench import benchmark_gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA H100 80GB HBM3")
    with pytest.raises(SystemExit) as exit_info:
        benchmark_gpu.main(["--configs", "configs/llama_130m.json", "--modes", "eager",
                            "--dtypes", "mixed", flag, value])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1 and flag in err, err[-2000:]


def test_gpu_check_report_reads_the_trainers_rows_and_judges_the_targets(tmp_path):
    """The GPU check's arithmetic, on rows as the trainer writes them: warm-up updates excluded, MFU over every
    position, real tokens beside it, and each target of issue 38 judged from its stage (or '-' when it did not run)."""
    from utils.gpu import gpu_check

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    update_s, real_tokens = [30.0, 9.0, 2.0, 2.0, 2.5, 2.0], 110_000  # compilation in the first two updates
    rows, seen = [], 0
    for step, seconds in enumerate(update_s, start=1):
        seen += real_tokens
        rows.append({"step": step, "loss": 5.0, "tokens_seen": seen, "tokens_per_s": real_tokens / seconds})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rates = gpu_check.trainer_rates(gpu_check.read_rows(run_dir), REPO / "configs/llama_1b.json", peak_tflops=989)
    assert rates["timed_updates"] == 4 and rates["update_s"] == pytest.approx(2.0, abs=1e-3)
    assert rates["positions_per_s"] == round(512 * 256 / 2.0)
    config = argparse.Namespace(**json.loads((REPO / "configs/llama_1b.json").read_text()))
    assert rates["mfu"] == pytest.approx(512 * 256 / 2.0 * gpu_check.model_flops_per_token(config, 256) / 989e12,
                                         abs=1e-3)
    assert rates["tokens_per_s"] == round(real_tokens / 2.0)

    stages = {"env": {"ok": True, "device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0"},
              "recipe_1b_pre": dict(ok=True, **rates),
              "recipe_130m_pre": {"ok": False, "timed_updates": 0},
              "eager_1b": {"ok": True, "rows": [{"config": "llama_1b.json", "compiled": False,
                                                 "tokens_per_s": 50_000}]},
              "bare_steps": {"ok": True, "rows": [{"config": "llama_1b.json", "compiled": True,
                                                   "tokens_per_s": rates["positions_per_s"] * 1.02}]}}
    gpu_check.write_report(tmp_path, stages, "bash utils/gpu/gpu_check.sh out")
    judged = {what: met for what, _, _, met in gpu_check.verdicts(stages)}
    assert judged["run_1b.sh pre: MFU"] == (rates["mfu"] >= 0.5) and judged["run_130m.sh pre: MFU"] is None
    assert judged["eager 1B step: x the 18.6K tok/s of b0de76d"] is True  # 50K / 18.6K = 2.69
    assert judged["run_1b.sh pre: positions/s over the bare compiled step's"] is True  # 1 / 1.02 = 0.98
    report = (tmp_path / "gpu_check.md").read_text()
    assert "| recipe_130m_pre | **FAILED** |" in report and "NVIDIA H100" in report
    assert json.loads((tmp_path / "gpu_check.json").read_text())["stages"]["recipe_1b_pre"]["mfu"] == rates["mfu"]


@pytest.mark.e2e
@pytest.mark.parametrize("given, expected", [(None, "1"), ("3", "3")])
def test_run_tiny_uses_one_thread_unless_told_otherwise(given, expected, tmp_path):
    """Beside other work two threads made the quick start 9x slower (25:56 against 2:53); alone they bought nothing."""
    fake_python = tmp_path / "python"
    fake_python.write_text('#!/usr/bin/env bash\necho "threads=${OMP_NUM_THREADS:-unset}"\n')
    fake_python.chmod(0o755)
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    env.update(PYTHON=str(fake_python), **({} if given is None else {"OMP_NUM_THREADS": given}))
    proc = subprocess.run(["bash", "run_tiny.sh", "LNS"], cwd=REPO, capture_output=True, text=True, env=env,
                          timeout=60, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert f"threads={expected}\n" in proc.stdout


@pytest.mark.e2e
def test_run_tiny_without_a_norm_type_is_bad_input():
    proc = subprocess.run(["bash", "run_tiny.sh"], cwd=REPO, capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "run_tiny.sh: error: usage: bash run_tiny.sh NORM_TYPE [POST_NUM] [extra torchrun_main.py flags]"]


def test_the_chunked_loss_is_the_models_loss(monkeypatch):
    """A --loss the GPU check measures must be the same function before it can be adopted: chunks of 7 tokens (the
    last one short), recomputed in backward, give the model's loss and gradients in fp32, through the model's
    forward as the trainer calls it."""
    import torch

    from peft_pretraining.model import head_losses
    from peft_pretraining.model.modeling_llama import LlamaForCausalLM, build_config

    monkeypatch.setattr(head_losses, "CHUNK_TOKENS", 7)
    torch.manual_seed(0)
    model = LlamaForCausalLM(build_config(REPO / "configs/llama_tiny.json"))
    tokens = torch.randint(3, 1000, (2, 11))
    results = []
    for loss in ("standard", "chunked"):
        model.zero_grad()
        value = model(input_ids=tokens, labels=tokens, head_loss=loss).loss
        value.backward()
        results.append((value.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}))
    (standard, standard_grads), (chunked, chunked_grads) = results
    torch.testing.assert_close(chunked, standard, rtol=1e-6, atol=1e-6)
    for name, grad in standard_grads.items():  # fp32 sums in another order (and over threads): 1e-5 of the largest
        scale = grad.abs().max().item()
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-4, atol=1e-5 * scale,
                                   msg=lambda detail, name=name: f"{name}: {detail}")


def test_the_compute_multiplier_queue_names_an_unknown_step_in_one_line():
    proc = subprocess.run(["bash", "utils/launch/compute_multiplier.sh", "grid_9999"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "compute_multiplier.sh: unknown step 'grid_9999'; one of: plan all grid_2400 wide_grid wide_2400 attnres_2400 "
        "seeds_5_6 budget_1200 wide_5000"]


@pytest.mark.e2e
def test_the_compute_multiplier_queue_plans_one_step_without_training(tmp_path):
    """A step in plan mode prints its runs left as JSON and trains nothing."""
    proc = subprocess.run(["bash", "utils/launch/compute_multiplier.sh", "plan"], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("== ") == 7 and '"left"' in proc.stdout
