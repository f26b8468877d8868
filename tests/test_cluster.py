"""What GPU clusters do to long runs, on CPU: a scheduler's SIGTERM, a requeue with the same command
(--resume auto), running out of memory, and the paper's recipes on fewer GPUs than they were written for."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import torchrun_main
from peft_pretraining.exit_codes import ExitCode
from peft_pretraining.model.modeling_llama import LlamaForCausalLM
from tests.conftest import ONE_THREAD, TINY_RUN
from utils.gpu import gpu_processes

REPO = Path(__file__).resolve().parent.parent
STEPS = 60
SCHEDULE = ["--warmup_steps", "2", "--num_training_steps", str(STEPS), "--eval_every", "1000", "--save_every", "1000",
            "--eval_tokens", "500"]
RUN = ["--model_config", "configs/llama_tiny.json", "--max_length", "32", "--batch_size", "4", *SCHEDULE]  # run_tiny.sh


def read_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def run_tiny(run_dir: Path, nproc: int, *extra) -> subprocess.Popen:
    """bash run_tiny.sh as a job script would start it, with the one command used for every launch and requeue."""
    env = dict(os.environ, **ONE_THREAD, NPROC=str(nproc), PYTHON=sys.executable,
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    return subprocess.Popen(["bash", "run_tiny.sh", "pre", *RUN, "--total_batch_size", str(4 * nproc),
                             "--save_dir", str(run_dir), "--resume", "auto", *extra],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)


def finish(proc: subprocess.Popen, timeout=300) -> tuple[int, str]:
    """The exit code, and what the run printed (its log lines go to stdout, errors to stderr)."""
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out + err


def wait_for_rows(run_dir: Path, proc: subprocess.Popen, count: int):
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if (run_dir / "metrics.jsonl").is_file() and len(read_rows(run_dir)) >= count:
            return
        time.sleep(0.02)
    raise AssertionError(f"no {count} rows before the run ended: {finish(proc)}")


@pytest.mark.parametrize("nproc, stop_signal", [(1, signal.SIGTERM), (2, signal.SIGUSR1)])
@pytest.mark.e2e
def test_a_stop_signal_saves_and_the_same_command_resumes_exactly(nproc, stop_signal, tmp_path):
    """The signal goes to the job's script (as `kill` or SLURM's --signal=B:USR1 sends it); with two ranks it
    reaches them through torchrun. Every rank finishes its update, the run saves, says so in results.json and
    exits 5; the same command then finishes the run, and (one process) ends with the uninterrupted run's weights."""
    run_dir = tmp_path / "run"
    proc = run_tiny(run_dir, nproc)
    wait_for_rows(run_dir, proc, 3)
    proc.send_signal(stop_signal)
    code, err = finish(proc)
    assert code == ExitCode.STOPPED, err[-3000:]
    results = json.loads((run_dir / "results.json").read_text())
    stopped_at = results["step"]
    assert results["status"] == "stopped" and 3 <= stopped_at < STEPS, results
    assert results["checkpoint"] == str(run_dir / f"model_{stopped_at}") and Path(results["checkpoint"]).is_dir()
    assert [row["step"] for row in read_rows(run_dir)] == list(range(1, stopped_at + 1))

    code, err = finish(run_tiny(run_dir, nproc))  # the requeued job: the same command
    assert code == ExitCode.FINISHED, err[-3000:]
    assert f"resumed from {run_dir / f'model_{stopped_at}'}" in err
    assert json.loads((run_dir / "results.json").read_text())["status"] == "finished"
    assert [row["step"] for row in read_rows(run_dir)] == list(range(1, STEPS + 1))
    if nproc == 1:
        code, err = finish(run_tiny(tmp_path / "uninterrupted", nproc))
        assert code == ExitCode.FINISHED, err[-3000:]
        expected = load_file(tmp_path / "uninterrupted" / f"model_{STEPS}" / "model.safetensors")
        got = load_file(run_dir / f"model_{STEPS}" / "model.safetensors")
        assert all(torch.equal(expected[name], got[name]) for name in expected)
        losses = [row["loss"] for row in read_rows(tmp_path / "uninterrupted")]
        assert [row["loss"] for row in read_rows(run_dir)] == losses

    code, err = finish(run_tiny(run_dir, nproc))  # requeued once more after the run finished: nothing to do
    assert code == ExitCode.FINISHED and "already finished" in err, err[-3000:]


IN_PROCESS = [*TINY_RUN, *SCHEDULE, "--save_every", "2"]


def test_out_of_memory_is_one_line_naming_the_fix_and_keeps_the_last_checkpoint(tmp_path, monkeypatch, capsys):
    """A CUDA out-of-memory error in the third update, simulated: exit 6, one line that names a smaller
    --batch_size with the same total and --activation_checkpointing, and the checkpoint of step 2 intact."""
    real_forward, calls = LlamaForCausalLM.forward, []

    def forward(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3 and self.training:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "forward", forward)
    run_dir = tmp_path / "run"
    code = torchrun_main.main([*IN_PROCESS, "--save_dir", str(run_dir)])
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # not the progress bars
    assert code == ExitCode.OUT_OF_MEMORY
    assert len(err) == 1 and err[0].startswith("torchrun_main.py: error: out of memory"), err
    assert "--batch_size 2 keeps --total_batch_size 4" in err[0] and "--activation_checkpointing" in err[0]
    assert str(run_dir / "model_2") in err[0]
    assert sorted(p.name for p in run_dir.glob("model_*")) == ["model_2"]
    LlamaForCausalLM.from_pretrained(run_dir / "model_2")  # loads: nothing saved was touched


@pytest.mark.parametrize("flags, message", [
    (["--continue_from", "x"], "--resume auto and --continue_from exclude each other"),
    (["--run_name", None], "--resume auto needs --save_dir"),
])
def test_resume_auto_refuses_what_a_requeue_could_not_repeat(flags, message, capsys):
    argv = [*IN_PROCESS, "--resume", "auto", *flags]
    if None in argv:  # no --run_name at all: drop the flag the test names
        index = argv.index("--run_name")
        del argv[index:index + 2]
    with pytest.raises(SystemExit) as exit_info:
        torchrun_main.args_utils.parse_args(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == ExitCode.BAD_INPUT and len(err) == 1 and message in err[0], err


def test_resume_auto_without_a_save_dir_uses_runs_run_name(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # runs/ is relative to where the job starts
    args = torchrun_main.args_utils.parse_args([*IN_PROCESS, "--model_config", str(REPO / "configs/llama_tiny.json"),
                                                "--resume", "auto", "--run_name", "job"])
    assert args.save_dir == os.path.join("runs", "job") and args.continue_from is None


# ---------------------------------------------------------------------------------------------------------------
# The paper's recipes: process count, compile, refusals
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe, visible, batch, processes", [
    (8, 1, 32, 1), (8, 8, 32, 8), (8, 16, 32, 8), (8, 3, 32, 2), (8, 6, 32, 4), (4, 2, 128, 2), (1, 8, 64, 1)])
def test_a_recipe_uses_what_is_visible_and_keeps_the_total_batch(recipe, visible, batch, processes):
    got, why = gpu_processes.plan_processes(recipe_processes=recipe, requested=None, visible_gpus=visible,
                                            batch_size=batch, total_batch_size=512, device="auto")
    assert got == processes and 512 % (batch * got) == 0
    assert f"accumulation {512 // (batch * got)}" in why


@pytest.mark.parametrize("requested, visible, device, message", [
    (9, 8, "auto", "NPROC=9: only 8 CUDA device(s) are visible"),
    (None, 0, "auto", "run_tiny.sh"),
    (2, 0, "cuda", "no CUDA device"),
])
def test_a_recipe_refuses_what_the_machine_cannot_run(requested, visible, device, message):
    with pytest.raises(gpu_processes.RecipeRefused, match=re.escape(message)):
        gpu_processes.plan_processes(recipe_processes=8, requested=requested, visible_gpus=visible, batch_size=32,
                                     total_batch_size=512, device=device)


def test_a_recipe_compiles_on_cuda_and_not_on_the_cpu(monkeypatch, capsys):
    flags = ["--batch_size", "32", "--total_batch_size", "512"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert gpu_processes.main(["run_1b.sh", "8", "--", *flags]) == 0
    assert capsys.readouterr().out.split() == ["1", "1"]
    assert gpu_processes.main(["run_1b.sh", "8", "--", *flags, "--batch_size", "16", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.split() == ["1", "0"]  # the user's flags come last and win


@pytest.mark.e2e
@pytest.mark.parametrize("script, env", [("run_1b.sh", {}), ("run_130m.sh", {"NPROC": "2"}),
                                         ("run_350m.sh", {"NPROC": "0"})])
def test_gpu_recipes_on_a_machine_without_cuda_are_one_line_and_exit_2(script, env):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", **env,
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run(["bash", script, "LNS", "6"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(f"{script}: error: ")
    assert not (REPO / "runs" / "1b_lns_lr5e-4").exists()


@pytest.mark.e2e
def test_a_recipe_without_arguments_is_a_usage_line():
    proc = subprocess.run(["bash", "run_130m.sh"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "run_130m.sh: error: usage: bash run_130m.sh NORM_TYPE [POST_NUM] [extra torchrun_main.py flags]")
