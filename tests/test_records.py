"""Run records on disk (utils/study/records.py), and the weight of what the repository tracks (issue 65)."""
import gzip
import json
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


def test_a_damaged_record_is_a_value_error_and_a_missing_folder_one_line(tmp_path, capsys):
    path = records.write(tmp_path, "L6-pre-seed1", RECORD)
    path.write_bytes(path.read_bytes()[:20])
    with pytest.raises(ValueError):
        records.read(path)
    assert records.read_or_none(path) is None and records.read_or_none(None) is None
    with pytest.raises(SystemExit) as stopped:
        records.main(["convert", str(tmp_path / "nowhere")])
    assert stopped.value.code == 2 and "folders: no folder" in capsys.readouterr().err


def tracked_files() -> list:
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=runs.REPO, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [runs.REPO / name for name in listed.decode().split("\0") if name and (runs.REPO / name).is_file()]


def test_the_repository_tracks_at_most_20_mb_and_no_figure_over_160_kb():
    files = tracked_files()
    assert sum(path.stat().st_size for path in files) <= 20e6
    assert [path for path in files if path.suffix == ".png" and path.stat().st_size > 160_000] == []
    assert [path for path in files if path.parent.name == "runs" and path.name.endswith(".json")] == []
