"""The run scripts as a user calls them: exit codes through torchrun, and the GPU tools' refusal on a CPU machine."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FEW_STEPS = ["--model_config", "configs/llama_tiny.json", "--max_length", "32", "--num_training_steps", "4",
             "--warmup_steps", "0", "--eval_every", "4", "--save_every", "4", "--eval_tokens", "500"]


def run_tiny(*flags, nproc=2, timeout=180):
    env = dict(os.environ, NPROC=str(nproc), PYTHON=sys.executable, OMP_NUM_THREADS="1")
    return subprocess.run(["bash", "run_tiny.sh", "pre", *flags], cwd=REPO, capture_output=True, text=True, env=env,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def test_run_tiny_under_torchrun_exits_2_on_a_bad_flag(tmp_path):
    proc = run_tiny(*FEW_STEPS, "--no_such_flag", "--save_dir", str(tmp_path / "run"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def test_run_tiny_under_torchrun_exits_3_on_divergence_with_results_written(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_tiny(*FEW_STEPS, "--lr", "1e39", "--save_dir", str(run_dir))
    assert proc.returncode == 3, proc.stderr[-2000:]
    results = json.loads((run_dir / "results.json").read_text())  # rank 0 finished writing before the ranks left
    assert results["status"] == "diverged" and results["step"] < 4


@pytest.mark.parametrize("command", [["bash", "utils/gpu_smoke.sh", "{out}"],
                                     [sys.executable, "utils/benchmark_gpu.py", "--json", "{out}"]])
def test_gpu_tools_refuse_a_machine_without_cuda_in_one_line(command, tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)
    command = [part.format(out=tmp_path / "out") for part in command]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "no CUDA device" in proc.stderr
    assert not (tmp_path / "out").exists()  # nothing written


@pytest.mark.parametrize("flag, value", [("--steps", "0"), ("--warmup", "-1"), ("--seq_len", "0"),
                                         ("--batch_size", "0"), ("--peak_tflops", "0")])
def test_benchmark_gpu_refuses_bad_counts_before_any_gpu_work(flag, value, monkeypatch, capsys):
    """On a GPU, --steps 0 ended in a traceback (the median of no timings) after every warm-up step, and
    --batch_size 0 silently ran the paper's micro-batch: refused in one line before CUDA is touched."""
    import torch

    from utils import benchmark_gpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA H100 80GB HBM3")
    with pytest.raises(SystemExit) as exit_info:
        benchmark_gpu.main(["--configs", "configs/llama_130m.json", "--modes", "eager",
                            "--dtypes", "mixed", flag, value])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1 and flag in err, err[-2000:]
