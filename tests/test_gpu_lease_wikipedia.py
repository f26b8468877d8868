"""Issue 68's lease call: the wikipedia_gpu budget's arithmetic, the travel check, the corpus as it travels, and
`bash utils/gpu/gpu_lease.sh rehearse_wikipedia OUT` end to end (the GPU call's lines at tiny sizes on the CPU)."""
import gzip
import json
import os
import shlex
import subprocess
import tarfile
from pathlib import Path

import pytest

from peft_pretraining.data import wikipedia_corpus
from utils import depth_sweep
from utils.gpu import gpu_carry

REPO = Path(__file__).resolve().parent.parent


def settings(budget):
    return {**depth_sweep.BUDGETS["default"], **depth_sweep.BUDGETS[budget]}


def test_the_gpu_budget_is_one_pass_over_the_train_split():
    s = settings("wikipedia_gpu")
    tokens_per_update = s["batch_size"] * s["max_length"]
    assert (s["batch_size"], s["max_length"]) == (64, 256)
    repeats_at = min(wikipedia_corpus.SINGLE_PASS_UPDATES[(64, 256)][seed] for seed in s["seeds"])
    assert s["steps"] == 1350 == depth_sweep.single_pass_steps(64, 256, 450)
    # the most whole multiples of the analysis interval before any seed's stream repeats an article
    assert s["steps"] <= repeats_at < s["steps"] + 450
    assert s["steps"] * tokens_per_update <= wikipedia_corpus.TRAIN_TOKENS
    assert s["warmup"] == s["steps"] // 10 and s["lr"] == "1e-3"
    # the analyses (thirds) fall on saves and evals, so a resumed run has every analysed checkpoint
    from utils.study import runs

    points = runs.evenly_spaced_steps(s["steps"], s["dynamics_points"])
    assert points == (450, 900, 1350)
    assert all(p % s["save_every"] == 0 and p % s["eval_every"] == 0 for p in points)


def test_single_pass_steps_is_bounded_by_the_token_count_too(monkeypatch):
    monkeypatch.setitem(depth_sweep.SINGLE_PASS_UPDATES, (1000, 1000), {1: 10 ** 9})
    assert depth_sweep.single_pass_steps(1000, 1000, 7) == wikipedia_corpus.TRAIN_TOKENS // 10 ** 6 // 7 * 7


def test_the_gpu_budget_has_the_papers_block_shape_and_the_cpu_sweeps_instruments(tmp_path):
    gpu, cpu = settings("wikipedia_gpu"), settings("wikipedia")
    for name in ("dataset", "vocab_size", "eval_tokens", "stream_tokens", "jacobian_tokens", "jacobian_probes",
                 "removal_documents", "dynamics_points", "seeds"):
        assert gpu[name] == cpu[name], name
    args = depth_sweep.parse_args(["--budget", "wikipedia_gpu", "--device", "cuda", "--plan",
                                   "--runs_dir", str(tmp_path)])
    assert not args.keep_checkpoints  # a GPU's checkpoints are deleted once the record is written
    config = json.loads((REPO / depth_sweep.depth_config(args, 24)).read_text())
    assert (config["hidden_size"], config["intermediate_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["num_hidden_layers"], config["vocab_size"]) == \
        (768, 2048, 12, 12, 24, 4096)
    assert config["hidden_size"] // config["num_attention_heads"] == 64
    specs = depth_sweep.run_specs(args)
    assert [spec.name for spec in specs[:6]] == [f"L{d}-{n}-seed1" for d in (6, 12, 24) for n in ("pre", "lns")]


def test_the_other_budgets_keep_their_configs(tmp_path):
    args = depth_sweep.parse_args(["--budget", "wikipedia", "--plan", "--runs_dir", str(tmp_path)])
    path = depth_sweep.depth_config(args, 12)
    base = json.loads((REPO / "configs/llama_tiny.json").read_text())
    assert Path(path).name == "llama_h64_L12.json"
    assert (REPO / path).read_text() == json.dumps({**base, "num_hidden_layers": 12, "vocab_size": 4096},
                                                   indent=2) + "\n"


def test_the_lease_line_is_a_valid_sweep_of_the_gpu_budget(tmp_path):
    script = (REPO / "utils/gpu/gpu_lease.sh").read_text()
    start = script.index("sweep=(--budget wikipedia_gpu ")
    line = script[start:script.index(")", start)].removeprefix("sweep=(")
    flags = shlex.split(line.replace("\\\n", " "))
    args = depth_sweep.parse_args([*flags, "--plan", "--runs_dir", str(tmp_path)])
    assert args.budget == "wikipedia_gpu" and args.device == "cuda" and args.dtype == "mixed"
    assert not args.compile and args.jobs == 6 and args.settings["seeds"] == (1,)
    assert len(depth_sweep.run_specs(args)) == 6  # one wave: seed 1's six runs


def git_repo(path: Path) -> Path:
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    (path / ".gitignore").write_text("/ignored/\n/.lease/\n")
    return path


def test_the_travel_check_counts_the_tree_and_what_is_carried_and_fails_above_the_limit(tmp_path):
    repo = git_repo(tmp_path / "repo")
    (repo / "tracked.bin").write_bytes(b"x" * (2 * gpu_carry.MIB))
    subprocess.run(["git", "-C", str(repo), "add", "tracked.bin", ".gitignore"], check=True)
    (repo / "untracked.bin").write_bytes(b"x" * gpu_carry.MIB)  # not ignored: it travels
    (repo / "ignored").mkdir()
    (repo / "ignored" / "big.bin").write_bytes(b"x" * (8 * gpu_carry.MIB))  # ignored and not carried: stays
    (repo / ".lease").mkdir()
    (repo / ".lease" / "corpus.bin").write_bytes(b"x" * gpu_carry.MIB)
    parts = gpu_carry.travel_bytes(repo, [".lease"])
    assert parts["tree"] == 3 * gpu_carry.MIB + len("/ignored/\n/.lease/\n")
    assert parts[".lease"] == gpu_carry.MIB
    assert gpu_carry.check_travel(repo, [".lease"], limit_mib=4.5)[0]
    fits, line = gpu_carry.check_travel(repo, [".lease"], limit_mib=3.5)
    assert not fits and "\n" not in line and "above the limit of 3.5 MiB" in line
    assert gpu_carry.main(["travel", "--repo", str(repo), "--carry", ".lease", "--limit_mib", "3.5"]) == 1
    assert gpu_carry.main(["travel", "--repo", str(repo), "--carry", ".lease", "--limit_mib", "60"]) == 0


def test_a_bad_travel_flag_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu_carry.main(["travel", "--limit_mib", "0"])
    assert exit_info.value.code == 2 and "--limit_mib" in capsys.readouterr().err


def read_corpus(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): gzip.decompress(p.read_bytes()) for p in sorted(folder.rglob("*.gz"))}


def test_the_corpus_travels_as_text_and_unpacks_to_the_same_files(tmp_path):
    source = gpu_carry.write_rehearsal_corpus(tmp_path / "source")
    archive = tmp_path / "corpus.tar.xz"
    gpu_carry.pack_corpus(source, archive)
    first = archive.read_bytes()
    gpu_carry.pack_corpus(source, archive)
    assert archive.read_bytes() == first  # deterministic: a re-prepared lease carries the same bytes
    gpu_carry.unpack_corpus(archive, tmp_path / "unpacked")
    assert read_corpus(tmp_path / "unpacked") == read_corpus(source)
    train, validation = wikipedia_corpus.corpus_paths(tmp_path / "unpacked")
    assert [p.name for p in wikipedia_corpus.train_files(train)] == ["wiki_00.jsonl.gz", "wiki_01.jsonl.gz",
                                                                     "wiki_02.jsonl.gz"]


def test_the_estimate_counts_the_runs_tokens_and_time(tmp_path, capsys):
    argv = ["--budget", "wikipedia_gpu", "--device", "cuda", "--no-compile", "--jobs", "6", "--runs_dir",
            str(tmp_path), "--out", str(tmp_path / "report"), "--estimate"]
    found = depth_sweep.estimate(depth_sweep.parse_args(argv))  # no GPU needed, as for --plan
    assert found["runs"] == found["runs_left"] == 18 and found["waves"] == 3
    assert found["tokens_per_run"] == 1350 * 64 * 256
    assert [row["layers"] for row in found["rows"][:6]] == [6, 6, 12, 12, 24, 24]
    assert 0 < found["estimated_seconds"] and "plan: about" in depth_sweep.estimate_lines(found)
    assert depth_sweep.main(argv) == 0 and "18 of 18 runs left" in capsys.readouterr().out


@pytest.mark.e2e
def test_the_wikipedia_lease_call_rehearses_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(["bash", "utils/gpu/gpu_lease.sh", "rehearse_wikipedia", str(out)], cwd=REPO,
                          capture_output=True, text=True, env=env, timeout=1200, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "gpu_carry travel:" in proc.stdout and "plan: about" in proc.stdout
    call = out / "wikipedia_depth"  # what a GPU call's $OUT would hold
    files = sorted(p.name for p in call.iterdir() if p.is_file())
    assert len(files) <= 8 and {"plan.txt", "wikipedia_depth.log", "wikipedia_gpu.tgz", "logs.tgz"} <= set(files)
    with tarfile.open(call / "wikipedia_gpu.tgz") as tarball:
        names = tarball.getnames()
    records = sorted(Path(n).name for n in names if "/runs/" in n and n.endswith(".json.gz"))
    # one wave: seed 1's four runs (--seeds 1, as on the GPU)
    assert records == sorted(f"L{d}-{n}-seed1.json.gz" for d in (2, 4) for n in ("pre", "lns")), records
    assert not [n for n in names if "model_" in n or n.endswith(".safetensors")]  # never a checkpoint
    assert any(n.endswith("report.md") for n in names)
