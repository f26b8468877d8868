"""The compute multiplier (utils/study/multiplier.py): Pre-LN's updates to reach an arm's loss, over the arm's."""
import json
import math

import pytest

from utils.study import multiplier, records, verdicts

A, B, C = 4.0, 60.0, 0.5  # a known loss curve: loss(n) = A + B * n^-C


def curve(n: float) -> float:
    return A + B * n ** -C


def write_run(folder, depth, norm, seed, updates, loss, rate="0.002"):
    flags = ["--model_config", f"runs/x/configs/llama_h64_L{depth}.json", "--max_length", "128", "--batch_size", "16",
             "--lr", rate, "--num_training_steps", str(updates), "--norm_type", norm, "--seed", str(seed)]
    records.write(folder / "runs", f"L{depth}-{norm}-seed{seed}", dict(
        arm=f"L{depth}-{norm}", seed=seed, flags=flags, status="finished", final_eval_loss=loss, last_step=updates))


def test_a_loss_between_budgets_is_interpolated_in_log_updates():
    points = {1000: curve(1000), 4000: curve(4000)}
    needed, how = multiplier.updates_to_reach(points, (curve(1000) + curve(4000)) / 2)
    assert how == "interpolated" and needed == pytest.approx(2000)  # halfway in loss is halfway in ln n


def test_beyond_the_budgets_the_fitted_curve_recovers_a_power_law():
    points = {n: curve(n) for n in (1000, 2000, 4000)}
    assert multiplier.fit_power_law(points, 4000) == pytest.approx((A, B, C), rel=0.02)
    needed, how = multiplier.updates_to_reach(points, curve(9000))
    assert how == "extrapolated" and needed == pytest.approx(9000, rel=0.05)
    needed, how = multiplier.updates_to_reach(points, curve(500))  # above the smallest budget's loss
    assert how == "extrapolated" and needed == pytest.approx(500, rel=0.05)
    needed, how = multiplier.updates_to_reach(points, A - 0.1)
    assert needed is None and "floor" in how
    needed, how = multiplier.updates_to_reach({1000: curve(1000), 2000: curve(2000)}, curve(9000))
    assert needed is None and "fewer than 3" in how


def test_a_curve_without_curvature_is_extrapolated_as_a_line_in_log_updates():
    """Losses falling linearly in ln n leave the power law's exponent at its grid's edge: the extrapolation is the
    line through the last two budgets, and it leaves from Pre-LN's last point exactly."""
    points = {n: 6.0 - 0.1 * math.log(n) for n in (1000, 2000, 4000)}
    needed, how = multiplier.updates_to_reach(points, 6.0 - 0.1 * math.log(16000))
    assert how == "extrapolated" and needed == pytest.approx(16000, rel=1e-6)
    needed, how = multiplier.updates_to_reach(points, points[4000] - 1e-9)  # just past the last budget
    assert needed == pytest.approx(4000, rel=1e-4) and needed > 4000


def test_an_arm_that_reaches_pre_ln_s_loss_at_half_the_updates_is_worth_two(tmp_path):
    """Three seeds, each a little off the curve; the arm at each budget matches Pre-LN at 1.9, 2 and 2.1 times the
    updates."""
    folders = []
    for updates in (1000, 2000, 4000, 8000):
        folder = tmp_path / f"b{updates}"
        folders.append(folder)
        for seed, wobble, worth in ((1, 0.0, 1.9), (2, 0.01, 2.0), (3, -0.01, 2.1)):
            for depth in (6, 12):
                write_run(folder, depth, "pre", seed, updates, curve(updates) + wobble)
                if updates <= 2000:
                    write_run(folder, depth, "lns", seed, updates, curve(worth * updates) + wobble)
    summary = multiplier.write(folders, tmp_path / "out", ["(test)"], vocab=4096)
    rows = summary["arms"]["lns"]["by_budget"]
    for updates in ("1000", "2000"):
        for row in rows[updates]:
            assert row["geomean"] == pytest.approx((1.9 * 2 * 2.1) ** (1 / 3), rel=0.03)
            assert row["words"] == "LNS saves compute" and not row["extrapolated"]
    assert {p.name for p in (tmp_path / "out").iterdir()} == {"multiplier.md", "multiplier.json", "multiplier.csv",
                                                              "multiplier.png"}
    assert json.loads((tmp_path / "out" / "multiplier.json").read_text())["arms"]["lns"]["label"] == "LNS"


def test_folders_that_give_an_arm_two_rates_at_one_budget_are_refused_in_one_line(tmp_path):
    write_run(tmp_path / "a", 6, "pre", 1, 1000, 5.0)
    write_run(tmp_path / "b", 6, "pre", 2, 1000, 4.9, rate="0.004")
    with pytest.raises(SystemExit) as stopped:
        multiplier.main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "out")])
    assert stopped.value.code == 2


@pytest.mark.parametrize("low, high, words", [(-0.1, 0.2, "no saving shown"), (0.05, 0.2, "saves compute"),
                                              (-0.3, -0.1, "Pre-LN is ahead")])
def test_the_words_follow_the_interval(low, high, words):
    verdict = verdicts.Verdict("c", +1, (low + high) / 2, low, high, 3, verdicts.status_for(+1, low, high), "")
    assert words in multiplier.saving_words(verdict, "LNS")
    if low <= 0 <= high:
        assert "saves" not in multiplier.saving_words(verdict, "LNS")
        assert multiplier.trend_words(verdict) == "no trend with depth shown"


def test_each_committed_match_lies_on_pre_ln_s_curve():
    """The committed report's interpolated matches, recomputed: Pre-LN's curve at the updates found gives back the
    arm's own loss, for every seed."""
    folders = [multiplier.REPO / f for f in json.loads(
        (multiplier.DEFAULT_OUT / "multiplier.json").read_text())["folders"]]
    losses, _ = multiplier.read_sweep(folders)
    checked = 0
    for (updates, depth), per_seed in multiplier.cells(losses, "lns").items():
        for seed, cell in per_seed.items():
            if cell["how"] != "interpolated":
                continue
            reference = losses["pre"][depth][seed]
            budgets = sorted(reference)
            low = max(b for b in budgets if b <= cell["pre_updates"])
            high = min(b for b in budgets if b >= cell["pre_updates"])
            share = 0 if high == low else math.log(cell["pre_updates"] / low) / math.log(high / low)
            on_curve = reference[low] + share * (reference[high] - reference[low])
            assert on_curve == pytest.approx(losses["lns"][depth][seed][updates], abs=1e-9)
            checked += 1
    assert checked >= 10


def test_each_arm_at_its_own_rate_reads_the_arms_from_their_own_folders(tmp_path):
    """--arm_folders: Pre-LN's curve from the folders (its rate), LNS from other folders (its own rate); folders
    that give one arm two rates at one budget are refused."""
    for rate, worth in (("0.002", 1.5), ("0.004", 3.0)):
        for updates in (1000, 2000, 4000, 8000):
            for seed, offset in ((1, 0.0), (2, 0.01), (3, 0.02)):
                folder = tmp_path / f"lr{rate}_{updates}"
                write_run(folder, 6, "pre", seed, updates, curve(updates), rate=rate)
                write_run(folder, 6, "lns", seed, updates, curve(worth * updates) + offset, rate=rate)
    shared = [tmp_path / f"lr0.002_{u}" for u in (1000, 2000, 4000, 8000)]
    own = [tmp_path / f"lr0.004_{u}" for u in (1000, 2000)]
    for folder in own:  # an arm's folder need not hold Pre-LN at all
        for path in (folder / "runs").glob("*-pre-*"):
            path.unlink()
    summary = multiplier.write(shared, tmp_path / "out", ["(test)"], vocab=4096, arm_folders=own)
    rows = summary["arms"]["lns"]["by_budget"]["1000"]
    assert rows[0]["geomean"] == pytest.approx(3.0, rel=0.05)  # LNS at 4e-3 against Pre-LN at 2e-3
    assert summary["settings"]["rates"] == {"lns": {1000: 0.004, 2000: 0.004},
                                            "pre": {1000: 0.002, 2000: 0.002, 4000: 0.002, 8000: 0.002}}
    with pytest.raises(ValueError, match="give one rate per arm and budget"):
        multiplier.write([*shared, *own], tmp_path / "out", ["(test)"], vocab=4096)
