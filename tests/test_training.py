"""Trainer: schedule, evaluation, CLI errors, and torchrun_main.py run end to end as a user would (subprocess).

Everything uses configs/llama_tiny.json on the embedded corpus, CPU, float32, a few steps of 4 x 32 tokens.
"""
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from peft_pretraining.data.dataloader import build_train_stream, count_target_tokens, iter_eval_batches, load_tokenizer
from peft_pretraining.exit_codes import ExitCode
from peft_pretraining.model.modeling_llama import LlamaForCausalLM, build_config
from peft_pretraining.training import args_utils
from peft_pretraining.training.checkpointing import drop_training_state, prune_checkpoints
from peft_pretraining.training.evaluation import evaluate
from peft_pretraining.training.optimization import build_scheduler, lr_factor
from tests.conftest import ONE_THREAD, TINY_RUN, run_trainer

REPO = Path(__file__).resolve().parent.parent
TINY = [*TINY_RUN, "--eval_tokens", "1000"]
STEPS = 6  # the shared run trains 2 * STEPS updates, evaluating and saving every STEPS
SHARED_RUN = [*TINY, "--lr", "3e-3", "--warmup_steps", "2", "--num_training_steps", str(2 * STEPS),
              "--eval_every", str(STEPS), "--save_every", str(STEPS)]



def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def tree_hashes(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("train") / "run"
    proc = run_trainer([*SHARED_RUN, "--save_dir", str(run_dir)])
    assert proc.returncode == ExitCode.FINISHED, proc.stderr[-3000:]
    return run_dir, proc


# --------------------------------------------------------------------------------------------------------------
# End to end
# --------------------------------------------------------------------------------------------------------------

@pytest.mark.e2e
def test_compile_flag_trains_like_eager(shared_run, tmp_path):
    eager_dir, _ = shared_run
    flags = [*TINY, "--lr", "3e-3", "--warmup_steps", "2", "--num_training_steps", "3", "--eval_every", "3",
             "--save_every", "3", "--compile", "--save_dir", str(tmp_path / "run")]
    proc = run_trainer(flags, env=dict(os.environ, TORCH_LOGS="recompiles"), timeout=600)
    assert proc.returncode == ExitCode.FINISHED, proc.stderr[-3000:]
    # One compilation serves every update: a recompile costs seconds per run (it once came from the RoPE cache).
    assert "Recompiling function" not in proc.stderr, proc.stderr[-3000:]
    compiled = [r["loss"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    eager = [r["loss"] for r in read_jsonl(eager_dir / "metrics.jsonl")][:1]
    # Same data and init: the first update's loss matches (later ones differ by the other run's longer schedule).
    assert len(compiled) == 3 and compiled[0] == pytest.approx(eager[0], rel=1e-4)
    assert all(math.isfinite(loss) for loss in compiled)


@pytest.mark.e2e
def test_tiny_run_lowers_eval_loss_and_fills_the_run_folder(shared_run):
    run_dir, proc = shared_run
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 2 * STEPS + 1))
    for row in rows:
        assert {"step", "loss", "lr", "grad_norm", "tokens_seen", "tokens_per_s"} <= row.keys()
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [STEPS, 2 * STEPS]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    assert evals[-1]["eval_ppl"] == pytest.approx(math.exp(evals[-1]["eval_loss"]))
    # The logged lr is the schedule's formula, update by update (first update not at lr 0).
    expected_lrs = [3e-3 * lr_factor(i, scheduler_type="cosine", num_training_steps=2 * STEPS, warmup_steps=2,
                                     min_lr_ratio=0.1) for i in range(2 * STEPS)]
    assert [r["lr"] for r in rows] == pytest.approx(expected_lrs)

    results = json.loads((run_dir / "results.json").read_text())
    assert results["status"] == "finished" and results["step"] == 2 * STEPS
    assert results["final_eval_loss"] == evals[-1]["eval_loss"]
    assert results["eval_tokens"] == 1000
    assert results["tokens_seen"] == rows[-1]["tokens_seen"]
    # tokens_seen counts the non-pad tokens of exactly the batches trained on (same stream rebuilt here).
    stream = build_train_stream(dataset="embedded", dataset_path=None, tokenizer=load_tokenizer("embedded"),
                                max_length=32, packing=False, batch_size=4, seed=1, rank=0, world_size=1)
    per_step = [int(next(stream)["attention_mask"].sum()) for _ in range(2 * STEPS)]
    assert [r["tokens_seen"] for r in rows] == [sum(per_step[:i + 1]) for i in range(2 * STEPS)]
    assert (run_dir / "loss_curve.png").stat().st_size > 1000
    for step in (STEPS, 2 * STEPS):
        checkpoint = run_dir / f"model_{step}"
        for name in ("config.json", "model.safetensors", "tokenizer.json", "training_state.pt"):
            assert (checkpoint / name).is_file(), name
    assert not list(run_dir.glob(".model_*"))  # no temporary folders left behind
    assert str(run_dir / "results.json") in proc.stdout and str(run_dir / "loss_curve.png") in proc.stdout


@pytest.mark.e2e
def test_checkpoint_is_a_loadable_hf_model(shared_run):
    run_dir, _ = shared_run
    model = LlamaForCausalLM.from_pretrained(run_dir / f"model_{2 * STEPS}")
    saved = load_file(run_dir / f"model_{2 * STEPS}" / "model.safetensors")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    assert model.config.norm_type == "pre"


@pytest.mark.e2e
def test_resume_is_bit_exact(shared_run, tmp_path):
    run_dir, _ = shared_run
    resumed = tmp_path / "resumed"
    proc = run_trainer([*SHARED_RUN, "--continue_from", str(run_dir / f"model_{STEPS}"), "--save_dir", str(resumed)])
    assert proc.returncode == ExitCode.FINISHED, proc.stderr[-3000:]
    full, second_half = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(resumed / "metrics.jsonl")
    assert [r["step"] for r in second_half] == list(range(STEPS + 1, 2 * STEPS + 1))
    for key in ("loss", "grad_norm", "lr", "tokens_seen"):
        assert [r[key] for r in second_half] == [r[key] for r in full[STEPS:]], key
    assert second_half[-1]["eval_loss"] == full[-1]["eval_loss"]
    uninterrupted = load_file(run_dir / f"model_{2 * STEPS}" / "model.safetensors")
    after_resume = load_file(resumed / f"model_{2 * STEPS}" / "model.safetensors")
    assert uninterrupted.keys() == after_resume.keys()
    assert all(torch.equal(uninterrupted[k], after_resume[k]) for k in uninterrupted)


def fake_checkpoint(run_dir: Path, step: int, complete: bool = True) -> Path:
    folder = run_dir / f"model_{step}"
    folder.mkdir(parents=True)
    if complete:
        (folder / "training_state.pt").write_bytes(b"state")
    return folder


def test_keep_last_prunes_only_older_complete_checkpoints(tmp_path):
    for step in (2, 4, 6, 12):
        fake_checkpoint(tmp_path, step)
    fake_checkpoint(tmp_path, 5, complete=False)  # an unfinished folder is not a checkpoint: left alone
    assert prune_checkpoints(str(tmp_path), 6, None) == []  # the default keeps everything
    assert prune_checkpoints(str(tmp_path), 7, 1) == []  # model_7 was not written: nothing is removed
    removed = prune_checkpoints(str(tmp_path), 6, 2)
    assert removed == [str(tmp_path / "model_2")]
    # model_12 is from a trajectory this run replaced by resuming earlier: neither counted nor removed.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model_12", "model_4", "model_5", "model_6"]
    assert prune_checkpoints(str(tmp_path), 6, 1) == [str(tmp_path / "model_4")]


@pytest.mark.e2e
def test_keep_last_in_a_run(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_trainer([*TINY, "--num_training_steps", "3", "--warmup_steps", "0", "--save_every", "1",
                     "--eval_every", "100", "--eval_tokens", "200", "--keep_last", "2", "--save_dir", str(run_dir)])
    assert proc.returncode == ExitCode.FINISHED, proc.stderr[-3000:]
    assert sorted(p.name for p in run_dir.glob("model_*")) == ["model_2", "model_3"]


def test_resumable_last_slims_only_older_complete_checkpoints(tmp_path):
    for step in (2, 4, 6, 12):
        fake_checkpoint(tmp_path, step)
    (tmp_path / "model_2" / "sharded").mkdir()  # an FSDP2 checkpoint's optimizer shards go too
    fake_checkpoint(tmp_path, 5, complete=False)
    assert drop_training_state(str(tmp_path), 6, None) == []
    assert drop_training_state(str(tmp_path), 7, 1) == []  # model_7 was not written: nothing is touched
    assert drop_training_state(str(tmp_path), 6, 2) == [str(tmp_path / "model_2")]
    assert not (tmp_path / "model_2" / "training_state.pt").exists() and not (tmp_path / "model_2/sharded").exists()
    assert (tmp_path / "model_2").is_dir()  # the folder, with its weights, stays
    assert all((tmp_path / f"model_{step}" / "training_state.pt").exists() for step in (4, 6, 12))
    assert drop_training_state(str(tmp_path), 6, 1) == [str(tmp_path / "model_4")]


@pytest.mark.e2e
def test_resumable_last_in_a_run_keeps_old_weights_and_resumes_from_the_newest(tmp_path):
    run_dir = tmp_path / "run"
    flags = [*TINY, "--warmup_steps", "0", "--save_every", "1", "--eval_every", "100", "--eval_tokens", "200",
             "--resumable_last", "1", "--save_dir", str(run_dir)]
    proc = run_trainer([*flags, "--num_training_steps", "3"])
    assert proc.returncode == ExitCode.FINISHED, proc.stderr[-3000:]
    assert [(run_dir / f"model_{step}" / "training_state.pt").exists() for step in (1, 2, 3)] == [False, False, True]
    slimmed = LlamaForCausalLM.from_pretrained(run_dir / "model_1")  # what the analyses read still loads
    assert torch.isfinite(next(slimmed.parameters())).all()
    proc = run_trainer([*flags, "--num_training_steps", "4", "--resume", "auto"])
    assert proc.returncode == ExitCode.FINISHED, proc.stderr[-3000:]
    assert "model_3" in proc.stdout + proc.stderr  # resumed from the one checkpoint that kept its training state
    assert [(run_dir / f"model_{step}" / "training_state.pt").exists() for step in (3, 4)] == [False, True]


# --------------------------------------------------------------------------------------------------------------
# Divergence
# --------------------------------------------------------------------------------------------------------------

@pytest.mark.e2e
def test_post_ln_with_a_huge_lr_diverges_cleanly(tmp_path):
    run_dir = tmp_path / "post"
    proc = run_trainer([*TINY, "--norm_type", "post", "--lr", "1e3", "--warmup_steps", "0", "--grad_clipping", "0",
                     "--num_training_steps", "20", "--eval_every", "100", "--save_dir", str(run_dir)])
    assert proc.returncode == ExitCode.DIVERGED, proc.stderr[-3000:]
    results = json.loads((run_dir / "results.json").read_text())
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert results["status"] == "diverged" and "non-finite" in results["diverged_reason"]
    assert results["step"] == rows[-1]["step"] < 20
    assert [r["step"] for r in rows] == list(range(1, results["step"] + 1))  # every step so far is kept
    assert rows[-1]["diverged"] == results["diverged_reason"]
    assert (run_dir / "loss_curve.png").is_file()
    assert not list(run_dir.glob("model_*"))


@pytest.mark.e2e
def test_a_diverging_resume_keeps_checkpoints_and_metrics(shared_run, tmp_path):
    source, _ = shared_run
    run_dir = tmp_path / "copy"
    shutil.copytree(source, run_dir)
    checkpoints_before = {p.name: tree_hashes(p) for p in run_dir.glob("model_*")}
    old_rows = read_jsonl(run_dir / "metrics.jsonl")
    # The spike rule: any loss above 0.01 counts as divergence, so the first resumed update diverges.
    proc = run_trainer([*SHARED_RUN, "--continue_from", str(run_dir / f"model_{STEPS}"), "--divergence_loss", "0.01"])
    assert proc.returncode == ExitCode.DIVERGED, proc.stderr[-3000:]
    # Resuming from step STEPS supersedes the later checkpoint: it moves, unchanged, into superseded/.
    kept = {p.name: tree_hashes(p) for p in [*run_dir.glob("model_*"), *run_dir.glob("superseded/model_*")]}
    assert kept == checkpoints_before and (run_dir / "superseded" / f"model_{2 * STEPS}").is_dir()
    results = json.loads((run_dir / "results.json").read_text())
    assert results["status"] == "diverged" and results["step"] == STEPS + 1
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert rows[:STEPS] == old_rows[:STEPS] and rows[STEPS]["step"] == STEPS + 1 and "diverged" in rows[STEPS]
    assert read_jsonl(run_dir / "metrics_superseded.jsonl") == old_rows[STEPS:]


# --------------------------------------------------------------------------------------------------------------
# Schedule and evaluation (in process)
# --------------------------------------------------------------------------------------------------------------

def _lrs(scheduler_type, lr, steps, warmup, min_ratio, resume_at=0):
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=lr)
    if resume_at:
        optimizer.param_groups[0]["initial_lr"] = lr
    scheduler = build_scheduler(optimizer, scheduler_type=scheduler_type, num_training_steps=steps,
                                warmup_steps=warmup, min_lr_ratio=min_ratio, lr=lr, resume_at=resume_at)
    used = []
    for _ in range(steps - resume_at):
        used.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return used


@pytest.mark.parametrize("scheduler_type", ["cosine", "linear"])
def test_schedule_warmup_peak_and_floor(scheduler_type):
    lr, steps, warmup, min_ratio = 1e-3, 40, 8, 0.1
    used = _lrs(scheduler_type, lr, steps, warmup, min_ratio)
    assert len(used) == steps  # exactly num_training_steps updates
    assert used[0] == pytest.approx(lr / warmup)  # the first update learns
    assert used[warmup - 1] == pytest.approx(lr)  # the end of warmup is the peak
    assert used[-1] == pytest.approx(min_ratio * lr)  # the last update is the floor
    assert all(a < b for a, b in zip(used[:warmup - 1], used[1:warmup]))
    assert all(a >= b for a, b in zip(used[warmup - 1:], used[warmup:]))
    halfway = warmup - 1 + (steps - warmup) // 2  # decay progress exactly 1/2 here
    middle = 0.5 * (1 + math.cos(math.pi / 2)) if scheduler_type == "cosine" else 0.5
    assert used[halfway] == pytest.approx(lr * (min_ratio + (1 - min_ratio) * middle))


def test_schedule_without_warmup_starts_at_the_peak_and_resumes_in_place():
    used = _lrs("cosine", 2e-3, 10, 0, 0.1)
    assert used[0] == pytest.approx(2e-3) and used[-1] == pytest.approx(2e-4)
    full = _lrs("cosine", 1e-3, 30, 5, 0.1)
    assert _lrs("cosine", 1e-3, 30, 5, 0.1, resume_at=12) == pytest.approx(full[12:])


def test_evaluation_is_token_weighted_over_exactly_eval_tokens():
    torch.manual_seed(0)
    tokenizer = load_tokenizer("embedded")
    model = LlamaForCausalLM(build_config(REPO / "configs/llama_tiny.json"))
    eval_tokens = 777  # not a multiple of the batch: the last batch is trimmed
    batches = list(iter_eval_batches(dataset="embedded", dataset_path=None, tokenizer=tokenizer, max_length=32,
                                     packing=False, batch_size=4, eval_tokens=eval_tokens, rank=0, world_size=1))
    result = evaluate(model, batches, device=torch.device("cpu"), eval_tokens=eval_tokens, show_progress=False)
    assert result["eval_tokens"] == eval_tokens
    # Independent recomputation: the model's per-batch mean loss weighted by that batch's target count.
    with torch.no_grad():
        weighted = sum(model(**b).loss.double() * count_target_tokens(b["labels"]) for b in batches)
    assert result["eval_loss"] == pytest.approx(float(weighted) / eval_tokens, rel=1e-6)
    assert result["eval_ppl"] == pytest.approx(math.exp(result["eval_loss"]))


# --------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------

BASE = ["--model_config", "configs/llama_tiny.json", "--batch_size", "4"]


@pytest.mark.parametrize("extra, flag", [
    (["--optimizer", "sgd"], "--optimizer"),
    (["--norm_type", "bogus"], "--norm_type"),
    (["--model_config", "configs/does_not_exist.json"], "--model_config"),
    (["--dataset_path", "/nonexistent/corpus"], "--dataset_path"),
    (["--total_batch_size", "10"], "--total_batch_size"),
    (["--gradient_accumulation", "2", "--total_batch_size", "16"], "--gradient_accumulation"),
    (["--continue_from", "/nonexistent/checkpoint"], "--continue_from"),
    (["--warmup_steps", "50", "--num_training_steps", "50"], "--warmup_steps"),
    (["--norm_type", "post_pre"], "--post_num"),
    (["--keep_last", "0"], "--keep_last"),
    (["--resumable_last", "0"], "--resumable_last"),
    (["--layerscale_form", "vector"], "--layerscale_form"),
    (["--completep_alpha", "nan"], "--completep_alpha"),
    (["--embed_init_std", "0"], "--embed_init_std"),
    (["--deepnorm_init", "xavier"], "--deepnorm_init"),
    # nan passes a `<= 0` check and inf an upper-bound-free one: each float flag must be finite
    (["--lr", "nan"], "--lr"),
    (["--lr", "inf"], "--lr"),
    (["--lr", "0"], "--lr"),
    (["--grad_clipping", "nan"], "--grad_clipping"),
    (["--weight_decay", "nan"], "--weight_decay"),
    (["--divergence_loss", "nan"], "--divergence_loss"),
    (["--divergence_loss", "-1"], "--divergence_loss"),
    (["--divergence_loss", "0"], "--divergence_loss"),
    (["--min_lr_ratio", "inf"], "--min_lr_ratio"),
    (["--layerscale_init", "-inf"], "--layerscale_init"),
    (["--dist_timeout_minutes", "inf"], "--dist_timeout_minutes"),
    (["--dist_timeout_minutes", "1e300"], "--dist_timeout_minutes"),  # finite, but a traceback from timedelta
    (["--dist_timeout_minutes", "1e12"], "--dist_timeout_minutes"),  # overflows torch's deadline
    (["--seed", "-1"], "--seed"),  # numpy seeds are 0 .. 2**32 - 1
    (["--seed", str(2**32)], "--seed"),
    (["--save_dir", "{tmp}/file"], "--save_dir"),  # an existing regular file
    (["--save_dir", "{tmp}/file/run"], "--save_dir"),  # a path that cannot be created under it
])
def test_bad_values_are_one_line_errors_naming_the_flag(extra, flag, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(REPO)
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(SystemExit) as exit_info:
        args_utils.parse_args([*BASE, *[arg.format(tmp=tmp_path) for arg in extra]], world_size=1)
    assert exit_info.value.code == ExitCode.BAD_INPUT
    message = capsys.readouterr().err.strip()
    assert len(message.splitlines()) == 1 and flag in message, message
    assert [p.name for p in tmp_path.iterdir()] == ["file"]  # nothing created


def test_environment_norm_type_is_case_insensitive_and_flags_win(monkeypatch):
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("NORM_TYPE", "LNS")
    monkeypatch.setenv("POST_NUM", "3")
    args = args_utils.parse_args(BASE, world_size=1)
    assert (args.norm_type, args.post_num) == ("lns", 3)
    assert args_utils.parse_args([*BASE, "--norm_type", "Post_Pre"], world_size=1).norm_type == "post_pre"
    monkeypatch.setenv("NORM_TYPE", "cod")  # the paper's uploaded code's name for LNS
    assert args_utils.parse_args(BASE, world_size=1).norm_type == "lns"
    monkeypatch.setenv("NORM_TYPE", "lnsx")
    with pytest.raises(SystemExit):
        args_utils.parse_args(BASE, world_size=1)


def test_batch_arithmetic_and_token_budget(monkeypatch):
    monkeypatch.chdir(REPO)
    args = args_utils.parse_args([*BASE, "--total_batch_size", "32"], world_size=2)
    assert args.gradient_accumulation == 32 // (4 * 2)
    args = args_utils.parse_args([*BASE, "--total_batch_size", "512", "--max_train_tokens", "1.5M",
                                  "--warmup_steps", "0"], world_size=1)
    assert args.num_training_steps == math.ceil(1_500_000 / (512 * 256))  # tokens, not sequences


def test_token_counts_with_a_suffix_are_exact(monkeypatch):
    """--eval_tokens 8.2M is 8,200,000 tokens (in floats it was 8,199,999: one token short of what was asked)."""
    monkeypatch.chdir(REPO)
    args = args_utils.parse_args([*BASE, "--eval_tokens", "8.2M", "--max_train_tokens", "2.01M", "--max_length", "10",
                                  "--warmup_steps", "0"], world_size=1)
    assert args.eval_tokens == 8_200_000
    assert args.num_training_steps == 2_010_000 // (4 * 10)
    counts = {"1.005K": 1_005, "4.35M": 4_350_000, "1.1B": 1_100_000_000, ".5k": 500, "20000": 20_000}
    assert {text: args_utils.parse_token_count(text) for text in counts} == counts


@pytest.mark.e2e
def test_corrupt_checkpoint_is_a_clear_error_and_creates_nothing(shared_run, tmp_path):
    run_dir, _ = shared_run
    broken = tmp_path / "broken"
    shutil.copytree(run_dir / f"model_{STEPS}", broken)
    state = (broken / "training_state.pt").read_bytes()
    (broken / "training_state.pt").write_bytes(state[: len(state) // 2])
    out = tmp_path / "out"
    proc = run_trainer([*SHARED_RUN, "--continue_from", str(broken), "--save_dir", str(out)])
    assert proc.returncode == ExitCode.BAD_INPUT
    error_lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(error_lines) == 1 and "--continue_from" in error_lines[0] and "corrupt" in error_lines[0]
    assert not out.exists()


@pytest.mark.e2e
def test_max_length_beyond_the_models_positions_is_a_one_line_error(tmp_path):
    out = tmp_path / "out"
    proc = run_trainer([*TINY, "--max_length", "1025", "--save_dir", str(out)])
    assert proc.returncode == ExitCode.BAD_INPUT
    error_lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(error_lines) == 1 and "--max_length 1025" in error_lines[0], proc.stderr[-2000:]
    assert "max_position_embeddings 1024" in error_lines[0]
    assert not out.exists()


@pytest.mark.e2e
def test_wandb_without_api_key_runs_offline_without_prompting(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path), WANDB_DIR=str(tmp_path / "wandb_dir"), WANDB_CONFIG_DIR=str(tmp_path / "cfg"),
               WANDB_CACHE_DIR=str(tmp_path / "cache"), WANDB_DATA_DIR=str(tmp_path / "data"))
    run_dir = tmp_path / "run"
    flags = [*TINY, "--warmup_steps", "0", "--eval_every", "100", "--eval_tokens", "200", "--save_every", "2"]
    proc = run_trainer([*flags, "--num_training_steps", "2", "--save_dir", str(run_dir)], env=env, timeout=180)
    assert proc.returncode == ExitCode.FINISHED, proc.stderr[-3000:]
    assert list((run_dir / "wandb").glob("offline-run-*")), "expected an offline wandb run inside the run folder"

    # A resume of the folder continues the same wandb run (the id kept in RUN/wandb_run_id), not a second one.
    proc = run_trainer([*flags, "--num_training_steps", "3", "--continue_from", str(run_dir)], env=env, timeout=180)
    assert proc.returncode == ExitCode.FINISHED, proc.stderr[-3000:]
    legs = sorted(leg.name for leg in (run_dir / "wandb").glob("offline-run-*"))  # offline-run-<time>-<id>
    assert len(legs) == 2 and len({leg.rsplit("-", 1)[1] for leg in legs}) == 1, legs
    assert legs[0].endswith("-" + (run_dir / "wandb_run_id").read_text().strip())


@pytest.mark.e2e
def test_paper_script_passes_norm_post_num_and_extra_flags(tmp_path):
    """bash run_130m.sh LNS 3 <overrides>: torchrun, one process, pure bf16 weights as in the paper."""
    env = dict(os.environ, **ONE_THREAD, NPROC="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    run_dir = tmp_path / "script"
    proc = subprocess.run(
        ["bash", "run_130m.sh", "LNS", "3", *TINY, "--dtype", "bfloat16", "--batch_size", "2",
         "--total_batch_size", "2", "--num_training_steps", "2", "--warmup_steps", "1", "--eval_tokens", "200",
         "--save_dir", str(run_dir)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    assert proc.returncode == ExitCode.FINISHED, proc.stderr[-3000:]
    results = json.loads((run_dir / "results.json").read_text())
    assert (results["norm_type"], results["post_num"], results["status"]) == ("lns", 3, "finished")
    assert read_jsonl(run_dir / "metrics.jsonl")[0]["lr"] == pytest.approx(1e-3)  # the script's lr, warmup 1
    weights = load_file(run_dir / "model_2" / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}


def test_vocab_is_resized_up_to_cover_the_tokenizer(tmp_path, monkeypatch):
    import torchrun_main

    tokenizer = load_tokenizer("embedded")
    config_json = json.loads((REPO / "configs/llama_tiny.json").read_text())
    config_json["vocab_size"] = len(tokenizer) - 100  # like the paper configs (32000) against t5-base (32100 ids)
    small = tmp_path / "small_vocab.json"
    small.write_text(json.dumps(config_json))
    monkeypatch.chdir(REPO)
    args = args_utils.parse_args(["--model_config", str(small), "--batch_size", "4", "--dataset", "embedded"],
                                 world_size=1)
    messages = []
    config = torchrun_main.build_model_config(args, tokenizer, messages.append)
    assert config.vocab_size == math.ceil(len(tokenizer) / 64) * 64 >= len(tokenizer)
    assert len(messages) == 1 and str(config.vocab_size) in messages[0]


# --------------------------------------------------------------------------------------------------------------
# Baselines and rivals: each trains through torchrun_main.main (in process) and is recorded in the checkpoint
# --------------------------------------------------------------------------------------------------------------

BASELINE_ARMS = {
    "skipinit": ["--norm_type", "skipinit"],
    "depth_scaled": ["--init_method", "depth_scaled"],
    "layerscale_scalar": ["--norm_type", "layerscale", "--layerscale_form", "scalar"],
    "peri": ["--norm_type", "peri"],
    "peri_lns": ["--norm_type", "peri_lns"],
    "reordered": ["--norm_type", "reordered"],
    "dyt": ["--norm_type", "dyt"],
    "completep_half": ["--norm_type", "completep", "--completep_alpha", "0.5"],
    "cod": ["--norm_type", "cod"],
    "deepnorm_reference": ["--norm_type", "deepnorm", "--deepnorm_init", "reference"],
    "embed_init": ["--embed_init_std", "0.632"],
}
TWO_STEPS = [*TINY, "--lr", "3e-3", "--warmup_steps", "0", "--num_training_steps", "2", "--eval_every", "2",
             "--eval_tokens", "200", "--save_every", "2"]


def train_in_process(extra, run_dir, monkeypatch):
    import torchrun_main

    monkeypatch.chdir(REPO)
    monkeypatch.delenv("NORM_TYPE", raising=False)
    monkeypatch.delenv("POST_NUM", raising=False)
    return torchrun_main.main([*TWO_STEPS, *extra, "--save_dir", str(run_dir)])


# One arm in the fast tier, every arm in the end-to-end tier: each trains the whole trainer in process.
@pytest.mark.parametrize("arm", [pytest.param(arm, marks=() if arm == "skipinit" else pytest.mark.e2e)
                                 for arm in BASELINE_ARMS])
def test_each_baseline_trains_and_its_checkpoint_rebuilds_it(arm, tmp_path, monkeypatch):
    from utils.instruments import model_io

    extra = BASELINE_ARMS[arm]
    run_dir = tmp_path / "run"
    assert train_in_process(extra, run_dir, monkeypatch) == ExitCode.FINISHED
    results = json.loads((run_dir / "results.json").read_text())
    assert results["status"] == "finished" and math.isfinite(results["final_eval_loss"])
    assert all(math.isfinite(row["loss"]) for row in read_jsonl(run_dir / "metrics.jsonl"))
    saved = json.loads((run_dir / "model_2" / "config.json").read_text())
    for flag, value in zip(extra[::2], extra[1::2]):
        recorded = saved[flag.removeprefix("--")]
        assert (recorded == "lns" if value == "cod" else str(recorded) == value), (flag, recorded)
    assert all(option in saved for option in args_utils.MODEL_OPTIONS)
    # The analysis tools rebuild the trained function from the checkpoint alone.
    model = model_io.load_model(str(run_dir / "model_2"))
    state = load_file(str(run_dir / "model_2" / "model.safetensors"))
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in state.items())


def test_resume_refuses_a_different_baseline_option(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    assert train_in_process(["--norm_type", "completep"], run_dir, monkeypatch) == ExitCode.FINISHED
    capsys.readouterr()
    code = train_in_process(["--continue_from", str(run_dir / "model_2"), "--num_training_steps", "4",
                             "--completep_alpha", "0.5"], run_dir, monkeypatch)
    assert code == ExitCode.BAD_INPUT
    error = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(error) == 1 and "--completep_alpha" in error[0]


def test_a_rival_that_spikes_stops_as_diverged(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    code = train_in_process(["--norm_type", "peri", "--divergence_loss", "0.01"], run_dir, monkeypatch)
    assert code == ExitCode.DIVERGED
    results = json.loads((run_dir / "results.json").read_text())
    assert results["status"] == "diverged" and results["step"] == 1 and not list(run_dir.glob("model_*"))


def test_a_checkpoint_config_saying_cod_resumes_as_lns(tmp_path):
    import torchrun_main

    config = build_config(REPO / "configs" / "llama_tiny.json", norm_type="lns")
    saved = dict(config.to_dict(), norm_type="cod")
    (tmp_path / "config.json").write_text(json.dumps(saved))
    args = args_utils.build_parser().parse_args(["--batch_size", "1", "--model_config", "unused"])
    torchrun_main.check_checkpoint_matches(args, config, str(tmp_path))  # no BadInput: cod is lns
    config.norm_type = "pre"
    with pytest.raises(torchrun_main.BadInput, match="--norm_type"):
        torchrun_main.check_checkpoint_matches(args, config, str(tmp_path))


def write_corpus(folder: Path, train_texts: list[str]) -> Path:
    folder.mkdir(parents=True)
    for name, texts in (("train", train_texts), ("validation", ["Emma walked to the village and back again."] * 4)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return folder


def test_empty_documents_do_not_stop_a_run(tmp_path, monkeypatch):
    """An empty document is EOS alone: no target. At batch size 1 its micro-batch's mean loss used to be NaN, and the
    run stopped as diverged. The loader now gives it no row."""
    texts = ["Mr. Knightley walked in the garden at Hartfield.", ""] * 8
    corpus = write_corpus(tmp_path / "corpus", texts)
    run_dir = tmp_path / "run"
    extra = ["--dataset_path", str(corpus), "--tokenizer", "embedded", "--batch_size", "1", "--total_batch_size", "2"]
    assert train_in_process(extra, run_dir, monkeypatch) == ExitCode.FINISHED
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert len(rows) == 2 and all(math.isfinite(row["loss"]) for row in rows)
    assert json.loads((run_dir / "results.json").read_text())["status"] == "finished"


def test_training_data_without_any_target_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    corpus = write_corpus(tmp_path / "corpus", [""] * 8)
    extra = ["--dataset_path", str(corpus), "--tokenizer", "embedded"]
    assert train_in_process(extra, tmp_path / "run", monkeypatch) == ExitCode.BAD_INPUT
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "error: no training document holds a target token" in errors[0], errors


@pytest.mark.e2e
def test_the_adam_kernel_is_a_flag_and_a_resume_keeps_this_runs_choice():
    """In pure bf16 the reference's foreach kernel rounds its intermediates to bf16, the fused one rounds once: the
    weights part after a few steps. A loaded checkpoint's param groups must not bring back the kernel it used."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from peft_pretraining.training.checkpointing import load_optimizer_state
    from peft_pretraining.training.optimization import build_optimizer

    tokens = torch.randint(0, 8192, (2, 16), generator=torch.Generator().manual_seed(0))
    trained = {}
    for kernel in ("fused", "foreach"):
        torch.manual_seed(0)
        model = LlamaForCausalLM(build_config(REPO / "configs" / "llama_tiny.json")).to(torch.bfloat16)
        optimizer = build_optimizer(model.parameters(), "adam", 3e-3, 0.0, kernel)
        assert optimizer.param_groups[0]["fused" if kernel == "fused" else "foreach"]
        for _ in range(3):
            model(tokens, labels=tokens).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        trained[kernel] = (model, optimizer)
    fused_weights = torch.cat([p.flatten() for p in trained["fused"][0].parameters()])
    foreach_weights = torch.cat([p.flatten() for p in trained["foreach"][0].parameters()])
    assert (fused_weights != foreach_weights).float().mean() > 0.01

    model, optimizer = trained["fused"]
    saved = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    resumed = build_optimizer(model.parameters(), "adam", 3e-3, 0.0, "foreach")
    load_optimizer_state(model, resumed, saved)
    assert resumed.param_groups[0]["foreach"] and not resumed.param_groups[0]["fused"]
    assert resumed.state[next(model.parameters())]["step"] == 3
