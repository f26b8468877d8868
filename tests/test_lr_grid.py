"""The depth sweep's learning-rate grid (issue 47), on the committed Wikipedia records and copies of them retold as
runs at another rate."""
import json
import shutil

import pytest

from tests.analysis_helpers import read_records
from tests.analysis_helpers import write_records as write_folder
from utils.study import lr_grid, records, runs

RECORDS = runs.REPO / "docs/depth_sweep_wikipedia/runs"


def at_rate(record: dict, rate: str, shift: float, seed: int | None = None) -> dict:
    """The record as if trained at `rate`, its last eval loss and held-out documents' losses moved by `shift`."""
    record = json.loads(json.dumps(record))
    record["flags"][record["flags"].index("--lr") + 1] = rate
    record["flags"] = [f.replace("runs/depth_sweep_wikipedia/", f"runs/depth_sweep_wikipedia_lr{rate}/")
                       for f in record["flags"]]
    record["eval_curve"][-1][1] += shift
    last = record["analyses"][str(max(int(s) for s in record["analyses"]))]
    last["removal_document_nats"] = [v + shift for v in last["removal_document_nats"]]
    if seed is not None:
        record["seed"] = seed
        record["flags"][record["flags"].index("--seed") + 1] = str(seed)
    return record


def committed(name: str) -> dict:
    return records.read(records.find(RECORDS, name))


def test_each_point_gets_its_best_rate_and_the_verdicts_compare_points_at_it(tmp_path):
    base = write_folder(tmp_path / "base", {n: committed(n) for n in ("L12-pre-seed1", "L24-pre-seed1",
                                                                       "L12-lns-seed1")})
    low = write_folder(tmp_path / "low", {"L24-pre-seed1": at_rate(committed("L24-pre-seed1"), "0.0005", -0.3),
                                          "L12-pre-seed1": at_rate(committed("L12-pre-seed1"), "0.0005", +0.01)})
    assert lr_grid.main([str(base), str(low), "--out", str(tmp_path / "grid")]) == 0
    summary = json.loads((tmp_path / "grid/lr_grid.json").read_text())
    assert summary["best_rate"] == {"pre": {"12": 0.001, "24": 0.0005}, "lns": {"12": 0.001}}
    assert summary["reference_rate"] == 0.001
    depth = summary["verdicts"]["depth"]
    assert [v["claim"] for v in depth] == [
        "Pre-LN at its best rates: L=24 (lr 0.0005) reaches a lower loss than L=12 (lr 0.001)"]
    # moved by -0.3 on every document: beyond the documents' noise
    assert depth[0]["status"] == "reproduced" and depth[0]["effect"] == pytest.approx(
        lr_grid.compare(lr_grid.read_grid([base]), "L12-pre@0.001", "L24-pre@0.001", "", ("a", "b")).effect - 0.3)
    tuning = summary["verdicts"]["tuning"]
    assert [(v["claim"], v["status"]) for v in tuning] == [
        ("Pre-LN at L=12: lr 0.0005 reaches a lower loss than lr 0.001", "opposite"),
        ("Pre-LN at L=24: lr 0.0005 reaches a lower loss than lr 0.001", "reproduced")]
    text = (tmp_path / "grid/lr_grid.md").read_text()
    assert "| Pre-LN | 24 | **" in text and "0.0005 (the grid's edge)" in text
    assert "| LNS | 12 | not trained | **" in text and "(the only rate trained)" in text
    assert (tmp_path / "grid/lr_grid.png").stat().st_size > 0


def test_a_rate_trained_at_more_seeds_is_judged_on_the_seeds_the_others_have():
    """2e-3 has seeds 1-3, 4e-3 seed 1 only. On seed 1, the seed they share, 2e-3 is lower, though its 3-seed mean
    (4.37) is above 4e-3's 4.35 (its seeds 2-3 are unlucky ones): the choice reads seed 1 alone."""
    rates = {0.002: {1: 4.30, 2: 4.40, 3: 4.41}, 0.004: {1: 4.35}}
    assert lr_grid.best_of(rates, rates) == 0.002
    rates[0.002][1] = 4.38  # now above 4e-3 on seed 1 too
    assert lr_grid.best_of(rates, rates) == 0.004
    assert lr_grid.best_of({0.002: {2: 4.0}, 0.004: {1: 4.1, 3: None}}, (0.002, 0.004)) == 0.002  # no shared seed
    assert lr_grid.best_of({0.002: {1: None}}, (0.002,)) is None


def test_a_rate_tried_at_one_point_only_cannot_decide_a_verdict(tmp_path):
    """L12 trained at 2e-3 too (much better there), L24 only at 1e-3: depth is judged at 1e-3 for both; LNS against
    Pre-LN at L12, where both arms trained both rates, at 2e-3. A pair sharing no rate is not judged."""
    base = write_folder(tmp_path / "base", {n: committed(n) for n in ("L12-pre-seed1", "L24-pre-seed1",
                                                                       "L12-lns-seed1")})
    high = write_folder(tmp_path / "high", {"L12-pre-seed1": at_rate(committed("L12-pre-seed1"), "0.002", -0.3),
                                            "L12-lns-seed1": at_rate(committed("L12-lns-seed1"), "0.002", -0.2)})
    summary = lr_grid.write([base, high], tmp_path / "grid", [])
    assert summary["best_rate"] == {"pre": {"12": 0.002, "24": 0.001}, "lns": {"12": 0.002}}
    (depth,) = summary["verdicts"]["depth"]
    assert depth["claim"] == ("Pre-LN at its best rates: L=24 (lr 0.001) reaches a lower loss than L=12 (lr 0.001) "
                              "(of the rates both trained: 0.001)")
    at_one_rate = lr_grid.compare(lr_grid.read_grid([base]), "L12-pre@0.001", "L24-pre@0.001", "", ("a", "b"))
    assert depth["effect"] == pytest.approx(at_one_rate.effect)
    (versus,) = summary["verdicts"]["lns_vs_pre"]
    assert versus["claim"] == "L=12, each at its best rate: LNS (lr 0.002) reaches a lower loss than Pre-LN (lr 0.002)"

    apart = write_folder(tmp_path / "apart", {"L24-pre-seed1": at_rate(committed("L24-pre-seed1"), "0.0005", 0.0)})
    only_base = write_folder(tmp_path / "only", {"L12-pre-seed1": committed("L12-pre-seed1")})
    assert lr_grid.write([only_base, apart], tmp_path / "grid2", [])["verdicts"]["depth"] == []


def test_with_two_seeds_a_point_is_judged_over_seeds(tmp_path):
    pre = committed("L12-pre-seed1")
    base = write_folder(tmp_path / "base", {"L12-pre-seed1": pre, "L12-pre-seed2": at_rate(pre, "1e-3", 0.02, 2),
                                            "L12-lns-seed1": committed("L12-lns-seed1"),
                                            "L12-lns-seed2": at_rate(committed("L12-lns-seed1"), "1e-3", 0.01, 2)})
    high = write_folder(tmp_path / "high", {"L12-pre-seed1": at_rate(pre, "0.002", -0.05),
                                            "L12-pre-seed2": at_rate(pre, "0.002", -0.03, 2)})
    summary = lr_grid.write([base, high], tmp_path / "grid", [])
    assert summary["best_rate"]["pre"] == {"12": 0.002}
    (versus,) = summary["verdicts"]["lns_vs_pre"]
    assert versus["unit"] == "seeds" and versus["n_pairs"] == 2
    assert "2 seeds)" in (tmp_path / "grid/lr_grid.md").read_text()


def test_each_rate_is_judged_against_its_neighbour_nearer_the_reference(tmp_path):
    """1e-3 is the reference (two points trained it). At L12, 4e-3 is judged against 2e-3 and 5e-4 against 1e-3: a
    step out that stops paying shows even where it still beats the reference."""
    pre = committed("L12-pre-seed1")
    base = write_folder(tmp_path / "base", {"L12-pre-seed1": pre, "L24-pre-seed1": committed("L24-pre-seed1")})
    folders = [base] + [write_folder(tmp_path / rate, {"L12-pre-seed1": at_rate(pre, rate, shift)})
                        for rate, shift in (("0.0005", +0.1), ("0.002", -0.3), ("0.004", -0.2))]
    tuning = lr_grid.write(folders, tmp_path / "grid", [])["verdicts"]["tuning"]
    assert [(v["claim"], v["status"]) for v in tuning] == [
        ("Pre-LN at L=12: lr 0.0005 reaches a lower loss than lr 0.001", "opposite"),
        ("Pre-LN at L=12: lr 0.002 reaches a lower loss than lr 0.001", "reproduced"),
        ("Pre-LN at L=12: lr 0.004 reaches a lower loss than lr 0.002", "opposite")]
    assert tuning[2]["effect"] == pytest.approx(0.1, abs=1e-9)
    assert lr_grid.steps_outward([0.004], 0.001) == []


@pytest.mark.parametrize("change, message", [
    (lambda r: r["flags"].__setitem__(r["flags"].index("--max_length") + 1, "256"), "not one budget's grid"),
    (lambda r: r["analysis_settings"].__setitem__("removal_documents", 4), "not one budget's grid"),
])
def test_a_record_of_another_budget_is_one_line_naming_it(tmp_path, capsys, change, message):
    base = write_folder(tmp_path / "base", {"L12-pre-seed1": committed("L12-pre-seed1")})
    other = at_rate(committed("L24-pre-seed1"), "0.0005", 0.0)
    change(other)
    odd = write_folder(tmp_path / "odd", {"L24-pre-seed1": other})
    with pytest.raises(SystemExit) as exit_info:
        lr_grid.main([str(base), str(odd), "--out", str(tmp_path / "grid")])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "\n" not in err and "odd/runs/L24-pre-seed1.json.gz" in err and message in err
    assert not (tmp_path / "grid").exists()


def test_two_records_of_one_point_and_seed_are_refused(tmp_path, capsys):
    base = write_folder(tmp_path / "base", {"L12-pre-seed1": committed("L12-pre-seed1")})
    again = tmp_path / "again"
    shutil.copytree(base, again)
    with pytest.raises(SystemExit):
        lr_grid.main([str(base), str(again)])
    assert "a second record of L12-pre@0.001 at seed 1" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [(["docs/depth_sweep_wikipedia"], "at least two rates"),
                                           (["docs/depth_sweep_wikipedia", "nowhere"], "nowhere: no run records")])
def test_bad_folders_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit):
        lr_grid.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.e2e
def test_a_quick_depth_sweep_at_another_rate_reads_as_a_grid(tmp_path):
    """As a user runs it: the quick depth sweep at --lr 2e-3 into its own folders, then the grid over it and a
    second folder (its records retold at the budget's rate, to spare CI a second sweep)."""
    import subprocess
    import sys

    fast = tmp_path / "fast"
    subprocess.run([sys.executable, "utils/depth_sweep.py", "--quick", "--dtype", "float32", "--no-compile", "--seeds",
                    "1", "--lr", "2e-3", "--out", str(fast), "--runs_dir", str(tmp_path / "runs")], cwd=runs.REPO,
                   check=True, capture_output=True, text=True)
    records = read_records(fast)
    assert {r["flags"][r["flags"].index("--lr") + 1] for r in records.values()} == {"0.002"}
    assert "Adam, lr 0.002," in (fast / "report.md").read_text()
    base = write_folder(tmp_path / "base", {name: at_rate(r, "1e-3", +0.01) for name, r in records.items()})
    done = subprocess.run([sys.executable, "-m", "utils.study.lr_grid", str(base), str(fast)], cwd=runs.REPO,
                          check=True, capture_output=True, text=True)
    grid = tmp_path / "base_lr_grid"
    assert done.stdout.strip() == str(grid / "lr_grid.md")
    summary = json.loads((grid / "lr_grid.json").read_text())
    assert summary["best_rate"] == {norm: {"2": 0.002, "4": 0.002} for norm in ("pre", "lns")}
    assert len(summary["verdicts"]["depth"]) == 2 and len(summary["verdicts"]["lns_vs_pre"]) == 2
    assert len(summary["verdicts"]["tuning"]) == 4
