"""Run records on disk (utils/study/records.py), and the weight of what the repository tracks (issue 65)."""
import gzip
import json
import shutil
import subprocess

import pytest

from utils.study import records, runs

RECORD = {"arm": "L6-lns", "seed": 1, "final_eval_loss": 4.419912345678901, "eval_curve": [[500, 6.1], [1000, 5.2]],
          "analyses": {"400": {"variance": [1e-300, 2.5, float("1e300")]}}}


def test_a_record_reads_back_equal_and_is_written_the_same_bytes_each_time(tmp_path):
    path = records.write(tmp_path, "L6-lns-seed1", RECORD)
    assert path.name == "L6-lns-seed1.json.gz" and records.read(path) == RECORD
    first = path.read_bytes()
    records.write(tmp_path, "L6-lns-seed1", json.loads(json.dumps(RECORD)))
    assert path.read_bytes() == first  # no timestamp in the gzip header
    assert b"\n" not in gzip.decompress(first) and b" " not in gzip.decompress(first)  # compact


def test_an_older_folder_is_read_as_it_is_and_converted_in_place(tmp_path):
    (tmp_path / "L6-pre-seed1.json").write_text(json.dumps(RECORD, indent=1) + "\n")
    records.write(tmp_path, "L12-pre-seed1", RECORD)
    assert [records.name_of(p) for p in records.paths_in(tmp_path)] == ["L12-pre-seed1", "L6-pre-seed1"]
    assert records.find(tmp_path, "L6-pre-seed1").name == "L6-pre-seed1.json"
    assert records.main(["convert", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["L12-pre-seed1.json.gz", "L6-pre-seed1.json.gz"]
    assert records.read(records.find(tmp_path, "L6-pre-seed1")) == RECORD


def test_a_damaged_record_is_an_error_naming_it_and_a_missing_folder_one_line(tmp_path, capsys):
    path = records.write(tmp_path, "L6-pre-seed1", RECORD)
    path.write_bytes(path.read_bytes()[:20])
    with pytest.raises(records.UnreadableRecord, match="L6-pre-seed1.json.gz: not a readable run record"):
        records.read(path)
    with pytest.raises(records.UnreadableRecord):
        records.read_if_present(path)
    assert records.read_if_present(None) is None  # absent is the one case that is not an error
    with pytest.raises(SystemExit) as stopped:
        records.main(["convert", str(tmp_path / "nowhere")])
    assert stopped.value.code == 2 and "folders: no folder" in capsys.readouterr().err


CORRUPTIONS = {"garbage": lambda data: b"not a record at all", "cut gzip": lambda data: data[:len(data) // 2]}


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_a_corrupt_committed_record_stops_the_report_and_rewrites_nothing(tmp_path, capsys, corruption):
    """Issue 80: a corrupt record used to be skipped, and --report_only rewrote the report as partial, with changed
    numbers. Now the study exits BAD_INPUT with one line naming the file, and every file is as it was."""
    from peft_pretraining.exit_codes import ExitCode
    from utils import depth_sweep

    committed = runs.REPO / "docs/depth_sweep_wikipedia_5000_lr0.002"
    out = tmp_path / "report"
    shutil.copytree(committed, out)
    victim = out / "runs" / "L12-lns-seed2.json.gz"
    victim.write_bytes(CORRUPTIONS[corruption](victim.read_bytes()))
    before = {path: path.read_bytes() for path in out.rglob("*") if path.is_file()}
    code = depth_sweep.main(["--budget", "wikipedia_5000", "--lr", "2e-3", "--dtype", "float32", "--no-compile",
                             "--out", str(out), "--report_only"])
    assert code == ExitCode.BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(victim) in err[0] and "not a readable run record" in err[0]
    assert {path: path.read_bytes() for path in out.rglob("*") if path.is_file()} == before


def tracked_files() -> list:
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=runs.REPO, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [runs.REPO / name for name in listed.decode().split("\0") if name and (runs.REPO / name).is_file()]


def test_the_repository_tracks_at_most_22_mb_and_no_figure_over_160_kb():
    """Issue 65's cap was 20 MB; issue 79's compute-multiplier runs (their records and rate-grid reports) need more,
    so it is 22 MB until the session note's decision on figures for grid reports."""
    files = tracked_files()
    assert sum(path.stat().st_size for path in files) <= 22e6
    assert [path for path in files if path.suffix == ".png" and path.stat().st_size > 160_000] == []
    assert [path for path in files if path.parent.name == "runs" and path.name.endswith(".json")] == []


def test_a_record_s_run_fields_are_typed_and_derived_in_one_place():
    """Issue 80: readers take a run's rate, budget and shape from records.fields, never from its flag strings."""
    flags = ["--model_config", "runs/x/configs/llama_h64_L24.json", "--lr", "0.002", "--num_training_steps", "2400",
             "--warmup_steps", "240", "--batch_size", "16", "--max_length", "128", "--norm_type", "lns", "--seed", "3",
             "--dataset", "wikipedia", "--compile"]
    derived = records.fields({"flags": flags})
    assert (derived.rate, derived.updates, derived.hidden, derived.depth, derived.norm, derived.seed) == \
        (0.002, 2400, 64, 24, "lns", 3)
    assert derived.compiled and derived.dtype == "float32" and derived.device == "cpu"  # the defaults of old records
    assert records.fields({}).rate is None and records.fields({}).device == "cpu"  # a record without flags


def test_no_study_reader_parses_flag_strings():
    """Only records.py reads a record's flags; the runner builds them (runs.with_study_dtype edits its own)."""
    offenders = []
    for path in sorted((runs.REPO / "utils").rglob("*.py")):
        if path.name == "records.py" or "gpu" in path.parts or "bench" in path.parts:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if '["flags"]' in line or ("flags.index(" in line and "train_flags.index" not in line):
                offenders.append(f"{path.relative_to(runs.REPO)}:{number}")
    assert offenders == []
