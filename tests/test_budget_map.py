"""The token budget x depth map (issue 64), on the committed 10,500-update Wikipedia records and copies of them
retold as a shorter budget with known leads."""
import json

import pytest

from tests.analysis_helpers import read_records
from tests.analysis_helpers import write_records as write_folder
from utils.study import budget_map, runs, sweep, verdicts

SWEEP = runs.REPO / "docs/depth_sweep_wikipedia_lr0.002"
GRID = [runs.REPO / f"docs/depth_sweep_wikipedia{suffix}" for suffix in ("", "_lr0.004", "_lr0.008")]


def committed() -> dict[str, dict]:
    return read_records(SWEEP)


def retold(records: dict[str, dict], updates: int, lead: dict[int, dict[int, float]]) -> dict[str, dict]:
    """The records as a budget of `updates`, each LNS run's loss set to its Pre-LN pair's minus lead[depth][seed]."""
    found = json.loads(json.dumps(records))
    for record in found.values():
        flags = record["flags"]
        flags[flags.index("--num_training_steps") + 1] = str(updates)
        flags[flags.index("--warmup_steps") + 1] = str(updates // 10)
    for name, record in found.items():
        if "-lns-" in name:
            depth, seed = int(name.split("-")[0][1:]), record["seed"]
            pre = found[name.replace("-lns-", "-pre-")]["eval_curve"][-1][1]
            record["eval_curve"][-1][1] = pre - lead[depth][seed]
    return found


# a lead that grows with depth at every seed, by different amounts (so that the seeds do not agree exactly)
GROWING = {6: {1: 0.01, 2: 0.02, 3: 0.00}, 12: {1: 0.05, 2: 0.05, 3: 0.03}, 24: {1: 0.10, 2: 0.08, 3: 0.09}}


def test_a_lead_that_grows_at_the_short_budget_and_shrinks_at_the_long_one_changes_sign(tmp_path):
    short = write_folder(tmp_path / "short", retold(committed(), 2400, GROWING))
    assert budget_map.main([str(short), str(SWEEP), "--out", str(tmp_path / "map")]) == 0
    summary = json.loads((tmp_path / "map/budget_map.json").read_text())
    assert list(summary["budgets"]) == ["2400", "10500"]
    assert summary["budgets"]["2400"]["lead"]["24"] == pytest.approx({"1": 0.10, "2": 0.08, "3": 0.09})
    assert summary["budgets"]["2400"]["slope"]["status"] == verdicts.REPRODUCED
    # the committed sweep: LNS's lead shrinks from L = 6 to 24 over three seeds
    assert summary["budgets"]["10500"]["slope"]["status"] == verdicts.OPPOSITE
    (interaction,) = summary["interactions"]
    assert interaction["sign_change"] and interaction["difference"]["status"] == verdicts.REPRODUCED
    assert "changes sign: it excludes zero upward at 2,400 updates and downward at 10,500" in interaction["words"]
    text = (tmp_path / "map/budget_map.md").read_text()
    assert "rests on L = 6 and 24 only" in text
    assert "| 2,400 (4.9M) | +0.010 [" in text  # the mean of the three seeds' leads at L = 6
    assert (tmp_path / "map/budget_map.png").stat().st_size > 0


def test_a_budget_with_one_depth_waits_outside_the_comparison_between_budgets(tmp_path):
    """A budget one pair into its runs (L = 6 only) has no slope: the other budgets are still compared over the
    depths they share, not over L = 6 alone."""
    short = write_folder(tmp_path / "short", retold(committed(), 2400, GROWING))
    first_pair = {name: record for name, record in retold(committed(), 5000, GROWING).items()
                  if name.startswith("L6-") and record["seed"] == 1}
    middle = write_folder(tmp_path / "middle", first_pair)
    assert budget_map.main([str(short), str(middle), str(SWEEP), "--out", str(tmp_path / "map")]) == 0
    summary = json.loads((tmp_path / "map/budget_map.json").read_text())
    assert [(i["short"], i["long"], i["depths"]) for i in summary["interactions"]] == [(2400, 10500, [6, 12, 24])]
    text = (tmp_path / "map/budget_map.md").read_text()
    assert "Not compared yet (fewer than two depths trained): 5,000 updates." in text


def test_each_pair_of_budgets_is_compared_over_the_depths_both_have(tmp_path):
    """A middle budget with L = 6 and 12 only is compared with each neighbour over those two, while the short and
    long budgets keep L = 6, 12 and 24 between them; each slope over fewer depths than its budget's own is printed
    beside its comparison."""
    short = write_folder(tmp_path / "short", retold(committed(), 2400, GROWING))
    middle_lead = {6: {1: 0.01, 2: 0.02, 3: 0.00}, 12: {1: 0.03, 2: 0.05, 3: 0.01}, 24: GROWING[24]}
    two_depths = {name: record for name, record in retold(committed(), 5000, middle_lead).items()
                  if not name.startswith("L24-")}
    middle = write_folder(tmp_path / "middle", two_depths)
    assert budget_map.main([str(short), str(middle), str(SWEEP), "--out", str(tmp_path / "map")]) == 0
    summary = json.loads((tmp_path / "map/budget_map.json").read_text())
    found = {(i["short"], i["long"]): i for i in summary["interactions"]}
    assert {pair: i["depths"] for pair, i in found.items()} == {
        (2400, 5000): [6, 12], (5000, 10500): [6, 12], (2400, 10500): [6, 12, 24]}
    # the middle budget's own slope is over its own depths: only the other budget's narrowed slope goes beside it
    assert [v["claim"] for v in found[(2400, 5000)]["slopes_over_shared"]] == [
        "2,400 updates: the lead's slope over L = 6, 12"]
    assert [v["claim"] for v in found[(2400, 10500)]["slopes_over_shared"]] == []
    assert found[(2400, 5000)]["difference"]["status"] == verdicts.INSIDE_NOISE  # slopes 0.02 apart at most
    assert found[(2400, 10500)]["sign_change"]


def test_a_budget_narrowed_in_two_comparisons_prints_its_narrowed_slope_once(tmp_path):
    """The short budget also has L = 48, so both of its comparisons narrow it to L = 6, 12, 24: the same slope, shown
    beside the first of them only."""
    deeper = retold(committed(), 2400, GROWING)
    for name in [n for n in deeper if n.startswith("L24-")]:
        copy = json.loads(json.dumps(deeper[name]))
        copy["arm"] = copy["arm"].replace("L24-", "L48-")
        deeper[name.replace("L24-", "L48-")] = copy
    short = write_folder(tmp_path / "short", deeper)
    middle = write_folder(tmp_path / "middle", retold(committed(), 5000, GROWING))
    assert budget_map.main([str(short), str(middle), str(SWEEP), "--out", str(tmp_path / "map")]) == 0
    summary = json.loads((tmp_path / "map/budget_map.json").read_text())
    narrowed = [v["claim"] for i in summary["interactions"] for v in i["slopes_over_shared"]]
    assert narrowed.count("2,400 updates: the lead's slope over L = 6, 12, 24") == 2
    text = (tmp_path / "map/budget_map.md").read_text()
    assert text.count("beside it, 2,400 updates: the lead's slope over L = 6, 12, 24") == 1


def test_the_mid_run_read_comes_from_the_longer_runs_eval_curves(tmp_path):
    short = write_folder(tmp_path / "short", retold(committed(), 2400, GROWING))
    budget_map.write([short, SWEEP], [], tmp_path / "map", [])
    records = committed()
    step, lead = budget_map.curve_lead(records, 24, 2400)
    assert step == 2500
    curve = {name: dict(r["eval_curve"]) for name, r in records.items()}
    assert lead[2] == pytest.approx(curve["L24-pre-seed2"][2500] - curve["L24-lns-seed2"][2500])
    text = (tmp_path / "map/budget_map.md").read_text()
    assert "| update 2,500 | the 10,500-update runs |" in text


def test_each_arm_at_its_best_rate_reads_the_grid_of_the_long_budget(tmp_path):
    short = write_folder(tmp_path / "short", retold(committed(), 2400, GROWING))
    summary = budget_map.write([short, SWEEP], GRID, tmp_path / "map", [])
    assert summary["best_rate_updates"] == 10500
    at = {b["depth"]: b for b in summary["best_rates"]}
    assert 0.008 in at[6]["rates_tried"] and 0.002 in at[24]["rates_tried"]
    for b in summary["best_rates"]:  # each arm at the lowest mean loss of the rates both tried
        assert b["rate_pre"] in b["rates_tried"] and b["rate_lns"] in b["rates_tried"]


@pytest.mark.parametrize("change, message", [
    (lambda r: r["flags"].__setitem__(r["flags"].index("--lr") + 1, "0.004"), "share one rate"),
    (lambda r: r["flags"].__setitem__(r["flags"].index("--max_length") + 1, "64"), "trained or analysed unlike"),
])
def test_folders_of_another_rate_or_sweep_are_one_line_errors(tmp_path, capsys, change, message):
    records = retold(committed(), 2400, GROWING)
    for record in records.values():
        change(record)
    other = write_folder(tmp_path / "other", records)
    with pytest.raises(SystemExit) as stopped:
        budget_map.main([str(SWEEP), str(other), "--out", str(tmp_path / "map")])
    assert stopped.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not (tmp_path / "map").exists()


def test_two_folders_of_one_budget_are_refused(tmp_path, capsys):
    copy = write_folder(tmp_path / "copy", committed())
    with pytest.raises(SystemExit):
        budget_map.main([str(SWEEP), str(copy), "--out", str(tmp_path / "map")])
    assert "a second folder of the 10,500-update budget" in capsys.readouterr().err


def test_a_slope_over_three_depths_evenly_spaced_in_ln_rests_on_the_end_points():
    weights = sweep.slope_weights([6, 12, 24])
    assert weights[12] == pytest.approx(0, abs=1e-12) and weights[24] == pytest.approx(-weights[6])
    assert sweep.resting_depths([6, 12, 24]) == [6, 24]
    assert sweep.resting_depths([6, 12, 24, 48]) == [6, 12, 24, 48]


def test_a_budget_with_one_depth_says_it_has_no_slope_yet(recwarn):
    """A budget one depth into its runs (the 5,000-update map's first pair) names that depth, not an empty list."""
    pending = verdicts.Verdict("c", +1, None, None, None, 1, verdicts.NOT_MEASURABLE, "")
    assert sweep.resting_depths([6]) == [] and sweep.resting_sentence([6]) == ""
    assert sweep.evidence_note(pending, [6]) == "no slope yet: a slope needs two depths, and this has L = 6 only"
    with pytest.raises(ValueError):
        sweep.slope_weights([6])
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_an_interval_that_barely_excludes_zero_is_called_so():
    barely = verdicts.Verdict("c", +1, -0.040, -0.078, -0.002, 3, verdicts.OPPOSITE, "", n_agree=0)
    clear = verdicts.Verdict("c", +1, -0.040, -0.060, -0.020, 3, verdicts.OPPOSITE, "", n_agree=0)
    assert "barely excludes zero" in sweep.evidence_note(barely, [6, 12, 24, 48])
    assert "barely" not in sweep.evidence_note(clear, [6, 12, 24, 48])
    assert "3 of 3 seeds agreeing in sign is p = 0.125" in sweep.evidence_note(clear, [6, 12, 24, 48])


def test_a_seed_without_every_depth_is_left_out_of_the_slope_and_named_missing_not_diverged():
    lead = {6: {1: 0.01, 2: 0.02, 3: 0.0}, 12: {1: 0.05, 2: 0.04, 3: 0.03}, 24: {1: 0.1, 3: 0.09}}
    assert budget_map.seed_depths_note(lead) == "left out of the slope until they have every depth: seed 2 (no L = 24)"
    assert budget_map.seed_depths_note({6: {1: 0.0, 2: 0.1}, 24: {1: 0.2, 2: 0.3}}) == ""
    verdict, slopes = budget_map.lead_slope(lead, [6, 12, 24], "c")
    assert set(slopes) == {1, 3}  # seed 2's slope over L = 6, 12 alone would judge another quantity
    assert verdict.n_pairs == 2
    short = {6: {1: 0.0, 2: 0.0}, 24: {1: 0.1, 2: 0.2}}
    long = {6: {1: 0.0, 2: 0.0}, 24: {1: 0.3}}  # seed 2 still training at L = 24
    slopes_at = {100: budget_map.lead_slope(short, [6, 24], "s")[1], 200: budget_map.lead_slope(long, [6, 24], "l")[1]}
    verdict_at = {100: budget_map.lead_slope(short, [6, 24], "s")[0], 200: budget_map.lead_slope(long, [6, 24], "l")[0]}
    found = budget_map.interaction(100, 200, slopes_at, verdict_at, [6, 24])
    assert "seed 2: missing in 200" in found["difference"].reason
    assert "diverged" not in found["difference"].reason
