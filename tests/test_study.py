"""The study machinery: pure helpers on crafted numbers, then the depth sweep end to end in its quick mode."""
import dataclasses
import json
import math
import os
import pathlib
import shutil
import threading
import time

import numpy as np
import pytest
import tqdm.auto

from tests.analysis_helpers import read_records
from utils import compare_norms, depth_sweep, width_sweep
from utils.study import analyse, claims, cli, depth_verdicts, host, measures, report, runs, sweep, verdicts
from utils.study import records as record_store

# Zero-mean per-seed noise for crafted records: paired differences that agree exactly at every seed are not
# measurable (their t interval has no width), so a fixture that wants a verdict must vary across seeds.
SEED_NOISE = {1: +1.0, 2: 0.0, 3: -1.0}


def study_pair_verdicts(records, pre: str, lns: str):
    """The study's verdicts of arm `lns` against arm `pre`, labelled as its report labels them."""
    return claims.pair_verdicts(records, pre, lns, compare_norms.arm_labels(pre, lns))


def test_evenly_spaced_steps_end_at_the_last_step_and_share_a_save_interval():
    steps = runs.evenly_spaced_steps(1200, 5)
    assert steps == (240, 480, 720, 960, 1200)
    assert runs.save_every_for(steps) == 240
    assert runs.evenly_spaced_steps(300, 5) == (60, 120, 180, 240, 300)  # the CPU study's budget
    # 400 / 3 is not whole: the interval must divide 400, or the gcd (the save interval) would be 1 step
    assert runs.evenly_spaced_steps(400, 3) == (200, 300, 400)
    assert runs.save_every_for(runs.evenly_spaced_steps(400, 3)) == 100
    with pytest.raises(ValueError, match="no divisor"):
        runs.evenly_spaced_steps(401, 3)
    assert runs.evenly_spaced_steps(7, 2)[-1] == 7
    assert all(s % runs.save_every_for(runs.evenly_spaced_steps(7, 2)) == 0
               for s in runs.evenly_spaced_steps(7, 2))


def crafted_analysis(num_layers=8, removal=None):
    return dict(
        variance=[1.0 * (k + 1) for k in range(num_layers + 1)],  # last / first = (L+1)/2; last / L/2 = (L+1)/(L/2+1)
        angular_next=[0.1 * k for k in range(num_layers)],
        jacobian_rel_identity_dev=[0.5] * (num_layers // 2) + [0.1] * (num_layers // 2),
        removal_nats=removal if removal is not None else [0.5] * (num_layers // 2) + [0.001] * (num_layers // 2),
        norm_gains=dict(per_layer=[1.0] * num_layers, final=1.0, max_abs_dev_from_one=0.0),
    )


def test_summarise_analysis_reads_the_deep_half():
    summary = measures.summarise_analysis(crafted_analysis())
    assert summary["variance_growth"] == pytest.approx(9 / 5)  # the stream leaving layer 4 of 8 has variance 5
    assert summary["variance_growth_from_first"] == pytest.approx(9 / 2)
    # Entry l is d(l, l+1), the change made by layer l (0-based): the deep half is layers 4..7, the last included,
    # the same layers as the Jacobian and removal measures.
    assert summary["angular_deep"] == pytest.approx((0.4 + 0.5 + 0.6 + 0.7) / 4)
    assert summary["jacobian_deep"] == pytest.approx(0.1)
    assert summary["removal_deep"] == pytest.approx(0.001)
    assert summary["cheap_removal_fraction"] == pytest.approx(0.5)  # 0.001 < ln(1.01), 0.5 is not


def test_the_variance_growth_does_not_hinge_on_the_first_block():
    """A first block that barely moves the stream (its successor makes the jump) inflates last / first a
    thousandfold; the growth over the deeper half reads the same as in a run whose first block made the jump."""
    jump_late = [0.025, 0.03, 120, 130, 140, 150, 160]
    jump_early = [0.025, 100, 120, 130, 140, 150, 160]
    assert measures.variance_growth_from_first(jump_late) > 1000 * measures.variance_growth_from_first(jump_early) / 2
    assert measures.variance_growth(jump_late) == measures.variance_growth(jump_early) == pytest.approx(160 / 130)


def test_slope_by_seed_recovers_a_known_slope_and_skips_missing_depths():
    table = {d: {1: 2.0 * math.log(d) + 1.0, 2: -1.0 * math.log(d), 3: None if d == 8 else 0.5} for d in (2, 4, 8)}
    slopes = sweep.slope_by_seed(table, log_values=False)
    assert slopes[1] == pytest.approx(2.0)
    assert slopes[2] == pytest.approx(-1.0)
    assert slopes[3] == pytest.approx(0.0)  # fitted on the two depths it has
    logged = sweep.slope_by_seed({d: {1: d ** 1.5} for d in (2, 4, 8)}, log_values=True)
    assert logged[1] == pytest.approx(1.5)


def test_by_seed_gives_none_for_a_diverged_run():
    finished = dict(arm="pre", seed=1, status="finished", final_eval_loss=5.0, eval_curve=[[10, 5.0]],
                    analyses={"10": crafted_analysis()})
    diverged = dict(arm="pre", seed=2, status="diverged", final_eval_loss=None, eval_curve=[], analyses={})
    values = measures.by_seed({"a": finished, "b": diverged}, "pre", "eval_loss")
    assert values == {1: 5.0, 2: None}


def test_record_matches_only_identical_flags_and_settings():
    settings = runs.AnalysisSettings(max_seq_len=64, stream_tokens=10, jacobian_tokens=2, jacobian_probes=0,
                                          removal_documents=2)
    spec = runs.RunSpec("pre", 1, ("--lr", "1e-3"), (2, 4))
    record = dict(version=runs.RECORD_VERSION, flags=spec.flags(), analysis_settings=dataclasses.asdict(settings),
                  last_step=4, analyses={"2": {}, "4": {}})
    assert runs.record_matches(record, spec, settings)
    assert not runs.record_matches(record, runs.RunSpec("pre", 1, ("--lr", "2e-3"), (2, 4)), settings)
    assert not runs.record_matches(record, spec, runs.AnalysisSettings(64, 20, 2, 0, 2))
    assert not runs.record_matches(dict(record, analyses={"4": {}}), spec, settings)


def test_a_run_that_diverged_at_an_analysed_step_keeps_its_record():
    """A diverged run saves no checkpoint at the step it diverged at (torchrun_main.py), so its record has no analysis
    there; the record is still its run's, reused and reported rather than counted as missing."""
    settings = runs.AnalysisSettings(64, 10, 2, 0, 2)
    spec = runs.RunSpec("pre", 1, ("--lr", "1e-3"), (2, 4, 6))
    record = dict(version=runs.RECORD_VERSION, flags=spec.flags(), analysis_settings=dataclasses.asdict(settings),
                  status="diverged", last_step=4, analyses={"2": {}})
    assert runs.record_matches(record, spec, settings)
    assert not runs.record_matches(dict(record, analyses={"2": {}, "4": {}}), spec, settings)
    assert runs.record_matches(dict(record, last_step=5, analyses={"2": {}, "4": {}}), spec, settings)
    assert not runs.record_matches(dict(record, status="finished"), spec, settings)


@pytest.mark.e2e
def test_a_diverged_run_is_not_redone_by_the_next_invocation(tmp_path):
    """End to end: a run that diverges at its first analysed step is reused from its record, and --report_only
    finds it."""
    args = depth_sweep.parse_args(["--quick", "--dtype", "float32", "--no-compile", "--out", str(tmp_path / "report"),
                                   "--runs_dir", str(tmp_path / "runs")])
    config = depth_sweep.depth_config(args, 2)
    flags = (*sweep.train_flags(args, config, 2, 1, 1), "--norm_type", "pre", "--divergence_loss", "0.5")
    spec, settings = runs.RunSpec("pre", 1, flags, (1, 2)), runs.analysis_settings(args.settings)
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", HF_HUB_OFFLINE="1")
    first = runs.run_job(spec, settings, args.runs_dir, tmp_path / "records", env)
    assert first["status"] == "diverged" and first["last_step"] == 1 and first["analyses"] == {}
    assert runs.run_job(spec, settings, args.runs_dir, tmp_path / "records", env)["reused"] == "record"
    assert list(runs.load_records([spec], settings, tmp_path / "records")) == ["pre-seed1"]


def test_a_report_whose_pure_bf16_runs_diverged_before_their_checkpoint_is_written(tmp_path):
    """Pure-bf16 runs that diverged before the end have no analysed checkpoint, so no norm gains to report."""
    shutil.copytree(runs.REPO / "docs/study_mixed_compile/runs", tmp_path / "runs")
    for arm in ("pre_bf16", "lns_bf16"):
        record = record_store.read(record_store.find(tmp_path / "runs", f"{arm}-seed1"))
        record.update(status="diverged", last_step=150, final_eval_loss=None, analyses={},
                      eval_curve=[point for point in record["eval_curve"] if point[0] < 150])
        record_store.write(tmp_path / "runs", f"{arm}-seed1", record)
    assert compare_norms.main(["--report_only", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "report.md").read_text()
    assert "**Complete**: all 11 runs." in report and "Norm gains in the pure-bf16 runs" not in report
    assert "Pure bf16 raises LNS's eval loss over mixed precision: NOT MEASURABLE" in report


def test_run_jobs_counts_reused_records_at_once_and_returns_spec_order(tmp_path, monkeypatch):
    """A reused record finishes at once and counts on the bar while an earlier-submitted run still trains; the
    records and the deadline's skips come back in spec order whatever order the jobs finished in."""
    release = threading.Event()
    finished = []

    def fake_run_job(spec, *args):
        if spec.arm == "slow":
            assert release.wait(10), "the bar did not count the reused record while a run was still training"
        elif spec.arm == "late":
            raise runs.PastDeadline()
        finished.append(spec.name)
        return {"name": spec.name}

    bar_counts = []  # what had finished each time the progress bar was redrawn

    class RecordingBar:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, n):
            pass

        def refresh(self):  # tqdm's update() alone may skip the redraw; what the user sees is what refresh() draws
            bar_counts.append(list(finished))
            if "reused-seed1" in finished:
                release.set()  # the slow run ends only after the bar has counted the reused record

    monkeypatch.setattr(runs, "run_job", fake_run_job)
    monkeypatch.setattr(runs, "jobs_the_disk_holds", lambda specs, jobs, runs_dir: jobs)  # the specs are fakes
    monkeypatch.setattr(tqdm.auto, "tqdm", RecordingBar)
    specs = [runs.RunSpec(arm, 1, (), (1,)) for arm in ("slow", "late", "reused")]
    settings = runs.AnalysisSettings(8, 8, 1, 0, 1)
    records, skipped = runs.run_jobs(specs, settings, tmp_path, tmp_path, jobs=3)
    assert finished == ["reused-seed1", "slow-seed1"]
    assert ["reused-seed1"] in bar_counts and len(bar_counts) == 3
    assert list(records) == ["slow-seed1", "reused-seed1"]
    assert [spec.name for spec in skipped] == ["late-seed1"]


def test_compare_norms_budgets_give_each_group_its_seeds():
    def seeds_of(argv):
        specs = compare_norms.run_specs(args := compare_norms.parse_args(argv), compare_norms.study_arms(args))
        found = {}
        for spec in specs:
            found.setdefault(spec.arm, []).append(spec.seed)
        return found

    default = seeds_of([])
    assert default["pre"] == default["lns"] == [1, 2, 3]
    assert default["pre_bf16"] == default["lns_bf16"] == [1]
    assert default["post"] == default["post_pre"] == default["deepnorm"] == [1]
    assert "peri" not in default
    rivals = seeds_of(["--budget", "rivals"])
    assert rivals["post"] == rivals["peri"] == rivals["pre_embed_ref"] == [1, 2, 3]
    assert rivals["pre_bf16"] == rivals["lns_bf16"] == [1, 2]
    assert all(seeds == [4] for seeds in seeds_of(["--seeds", "4"]).values())
    long_rivals = seeds_of(["--budget", "long_rivals"])
    assert long_rivals["pre"] == long_rivals["post"] == long_rivals["skipinit"] == [1, 2, 3]
    assert "pre_bf16" not in long_rivals
    assert seeds_of(["--budget", "long_rivals", "--arms", "pre", "skipinit"]).keys() == {"pre", "skipinit"}
    recent = ("gpas", "lns_gpas", "bhyt", "hybridnorm")  # issue 39: the long rivals budget and the smoke test
    assert all(long_rivals[arm] == [1, 2, 3] for arm in recent)
    assert all(seeds_of(["--quick"])[arm] == [1] for arm in recent)
    assert not set(recent) & (default.keys() | rivals.keys())


def test_long_rivals_reuses_the_long_studys_pre_ln_and_lns_records():
    """The rivals join the long study as arms: the same records folder, and Pre-LN and LNS runs identical to `long`'s,
    so their records are reused rather than trained again."""
    def specs_of(budget):
        args = compare_norms.parse_args(["--budget", budget])
        return args, {spec.name: spec for spec in compare_norms.run_specs(args, compare_norms.study_arms(args))}

    long_args, long_specs = specs_of("long")
    rivals_args, rivals_specs = specs_of("long_rivals")
    assert rivals_args.out == long_args.out and rivals_args.runs_dir == long_args.runs_dir
    assert set(long_specs) < set(rivals_specs)
    assert all(rivals_specs[name] == spec for name, spec in long_specs.items())
    assert "--num_training_steps" in (flags := rivals_specs["skipinit-seed1"].train_flags)
    assert flags[flags.index("--num_training_steps") + 1] == "1500"


def test_a_sitting_with_arms_reports_every_arm_the_study_has_records_for(tmp_path):
    """`--arms` picks what a sitting trains, not what its report shows: the committed long-rivals records of the arms
    left out stay in the report, and an arm short of a seed makes the report partial."""
    shutil.copytree(runs.REPO / "docs/study_long_mixed_compile/runs", tmp_path / "runs")
    record_store.find(tmp_path / "runs", "skipinit-seed3").unlink()
    for arm in ("peri", "gpas", "lns_gpas", "bhyt", "hybridnorm"):  # arms with no records at all, whatever is committed
        for record in (tmp_path / "runs").glob(f"{arm}-seed*.json*"):
            record.unlink()
    assert compare_norms.main(["--budget", "long_rivals", "--arms", "pre", "lns", "--report_only",
                               "--out", str(tmp_path)]) == 0
    report = (tmp_path / "report_rivals.md").read_text()
    for label in ("| Post-LN |", "| Mix-LN |", "| DeepNorm |", "| SkipInit |", "| LayerScale (per channel, 0.1) |"):
        assert label in report
    assert "**Partial**" in report and "skipinit-seed3" in report
    skipinit_row = next(line for line in report.splitlines() if line.startswith("| SkipInit |"))
    assert "| 2/3 (1 not yet run) |" in skipinit_row  # the budget's seeds, not only the recorded ones
    assert "| Peri-LN |" not in report  # no records, so not in the report, but named as still to train
    status = next(line for line in report.splitlines() if "no records yet" in line)
    assert "The budget's other 5 arms have no records yet (Peri-LN, GPAS, LNS + GPAS, BHyT, HybridNorm; 15 runs)" \
        in status
    assert {"peri", "gpas", "bhyt"} <= set(status.split("`--arms ")[1].split("`")[0].split())


def test_budget_evidence_counts_only_runs_that_reached_the_end():
    """A diverged run's last eval is its lowest only because training stopped there: it is not "still improving"."""
    def record(arm, seed, status, curve):
        return dict(arm=arm, seed=seed, status=status, eval_curve=curve)

    records = {"pre-seed1": record("pre", 1, "finished", [[60, 6.0], [120, 5.8]]),
               "pre-seed2": record("pre", 2, "diverged", [[60, 6.1]]),
               "lns-seed1": record("lns", 1, "diverged", [[60, 6.0]])}
    assert compare_norms.budget_evidence(records) == ["| Pre-LN | 120 | 120 | 1/1 |"]


def test_projected_wall_time_replays_the_two_lane_schedule():
    specs = [runs.RunSpec(arm, 1, (), (4,)) for arm in ("a", "b", "c", "d")]
    minutes = {"a": 30, "b": 10, "c": 10, "d": 20}
    records = {f"{arm}-seed1": dict(train_seconds=60 * m - 60, analysis_seconds=60) for arm, m in minutes.items()}
    # lane 1: a (0-30); lane 2: b (0-10), c (10-20), d (20-40): 40 minutes, not the 35 of an even split
    assert report.projected_wall_minutes(specs, records, 2) == pytest.approx(40)
    assert report.projected_wall_minutes(specs, records, 1) == pytest.approx(70)
    untimed = dict(records, **{"d-seed1": dict(train_seconds=100, analysis_seconds=None)})
    assert report.projected_wall_minutes(specs, untimed, 2) is None
    assert "projected once" in report.wall_time_sentence(specs, untimed, 2)


def test_precision_section_shows_a_one_seed_bf16_effect_as_a_point_estimate():
    def record(arm, seed, loss, growth):
        analysis = dict(crafted_analysis(), variance=[1.0] * 8 + [growth])  # growth = last / first block
        return dict(arm=arm, seed=seed, status="finished", final_eval_loss=loss, eval_curve=[[4, loss]],
                    analyses={"4": analysis})

    records = {}
    for seed in (1, 2, 3):
        records[f"pre-seed{seed}"] = record("pre", seed, 5.0 + 0.01 * seed, 4.0 + 0.1 * SEED_NOISE[seed])
        records[f"lns-seed{seed}"] = record("lns", seed, 4.8 + 0.02 * seed, 2.0)
    records["pre_bf16-seed1"] = record("pre_bf16", 1, 5.3, 4.0)
    records["lns_bf16-seed1"] = record("lns_bf16", 1, 5.4, 2.0)  # bf16 reverses the loss gap at this seed
    differences = compare_norms.one_seed_differences(records, "pre_bf16", "lns_bf16")
    assert differences[0] == pytest.approx(0.1)
    assert differences[1] == pytest.approx(math.log(2.0 / 4.0))
    section = compare_norms.precision_section(records, study_pair_verdicts(records, "pre", "lns"),
                                              study_pair_verdicts(records, "pre_bf16", "lns_bf16"))
    loss_row = next(line for line in section.splitlines() if line.startswith("| LNS reaches a lower eval loss"))
    assert "+0.1000 (one seed, no interval)" in loss_row and loss_row.endswith("| differs |")
    variance_row = next(line for line in section.splitlines() if line.startswith("| Pre-LN's residual variance"))
    assert variance_row.endswith("| same |")
    assert "seed 1: +0.2900 (one seed, no interval)" in section  # Pre-LN's bf16 cost: 5.30 - 5.01
    del records["lns_bf16-seed1"]  # no bf16 pair: nothing to compare, so no row may say the signs differ
    section = compare_norms.precision_section(records, study_pair_verdicts(records, "pre", "lns"),
                                              study_pair_verdicts(records, "pre_bf16", "lns_bf16"))
    claim_rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert claim_rows and all(line.endswith("| n/a |") for line in claim_rows), claim_rows


def test_depth_sweep_budgets_share_records_and_keep_their_own_files(tmp_path):
    runs = ["--runs_dir", str(tmp_path / "runs")]  # run_specs writes each depth's config there
    default, deep = depth_sweep.parse_args(runs), depth_sweep.parse_args(["--budget", "deep", *runs])
    assert len(default.settings["depths"]) >= 4 and 96 not in default.settings["depths"]
    assert deep.settings["depths"][-1] == 96 and deep.out == default.out
    assert deep.settings["report_suffix"] and not default.settings.get("report_suffix")
    shared = {spec.name: spec for spec in depth_sweep.run_specs(deep)}
    assert all(shared[spec.name] == spec for spec in depth_sweep.run_specs(default))  # same flags: records reused


def test_gap_plot_of_a_partial_sweep_skips_depths_without_an_interval(tmp_path):
    one_seed = verdicts.judge_seeds("gap", -1, {1: 5.0}, {1: 4.9})  # one pair: no effect, no interval
    three = verdicts.judge_seeds("gap", -1, {1: 5.0, 2: 5.1, 3: 5.2}, {1: 4.9, 2: 5.0, 3: 5.05})
    assert one_seed.effect is None and three.effect is not None
    path = sweep.plot_gap([one_seed, three], (6, 12), tmp_path / "gap.png")
    assert path.stat().st_size > 1000


def test_a_one_seed_sweep_reports_each_seeds_own_comparative_slopes():
    """The Wikipedia pilot (one seed): no comparison is measurable over seeds, so the report gives seed 1's own
    slopes of the gap and the ratio, computed here from the records by hand; a second seed makes them verdicts."""
    args = depth_sweep.parse_args(["--budget", "wikipedia_pilot", "--dtype", "float32", "--no-compile",
                                   "--report_only"])
    axis = depth_sweep.depth_axis(args)
    records = {name: record for name, record in read_records(runs.REPO / "docs/depth_sweep_wikipedia").items()
               if name.endswith("-seed1")}
    values = {(r["arm"], "jacobian_deep"): measures.measures_at(r)["jacobian_deep"] for r in records.values()}
    single = depth_verdicts.one_seed_slopes(axis, records, depth_verdicts.comparative_verdicts(axis, records))
    jacobian = next(s for s in single if s["measure"] == "jacobian_deep")
    both = [d for d in axis.values if (f"L{d}-pre", "jacobian_deep") in values and (f"L{d}-lns", "jacobian_deep")
            in values]
    assert jacobian["values"] == both and jacobian["seed"] == 1 and len(both) >= 2
    gaps = [values[(f"L{d}-lns", "jacobian_deep")] - values[(f"L{d}-pre", "jacobian_deep")] for d in both]
    assert jacobian["gap_slope"] == pytest.approx(np.polyfit(np.log(both), gaps, 1)[0])
    text = depth_verdicts.one_seed_text(axis, single)
    assert "With one seed there is no interval" in text and f"{jacobian['gap_slope']:+.4g}" in text
    second = {name.replace("seed1", "seed2"): dict(r, seed=2) for name, r in records.items()}
    records.update(second)
    assert depth_verdicts.one_seed_slopes(axis, records, depth_verdicts.comparative_verdicts(axis, records)) == []


def test_a_probe_that_did_not_finish_measures_no_overfitting_point(tmp_path):
    """A diverged probe's curve stops early: its last eval is not 'still falling', and an empty curve is no crash."""
    args = depth_sweep.parse_args(["--quick", "--out", str(tmp_path / "report"), "--runs_dir", str(tmp_path / "runs")])
    for curve in ([[2, 5.0], [4, 4.8]], []):
        probe = dict(arm="overfit-L4-lns", seed=1, status="diverged", last_step=5, eval_curve=curve,
                     train_curve=[[1, 5.2], [5, float("nan")]], train_seconds=6.0)
        text, summary = depth_sweep.probe_section(args, probe, tmp_path, "")
        assert "diverged at step 5" in text and "no overfitting point" in text and "still falling" not in text
        assert summary["status"] == "diverged" and "best_step" not in summary


@pytest.mark.parametrize("study, argv, flag", [(depth_sweep, ["--depths", "4"], "--depths"),
                                               (depth_sweep, ["--depths", "4", "8", "--first_depths", "6"],
                                                "--first_depths"),
                                               (depth_sweep, ["--arms", "lns", "gpas"], "--arms: gpas"),
                                               (width_sweep, ["--widths", "64"], "--widths"),
                                               (compare_norms, ["--arms", "nosuch"], "--arms: unknown nosuch")])
def test_a_studys_bad_input_is_one_line_even_where_bf16_is_emulated(study, argv, flag, capsys, monkeypatch):
    """The emulated-bf16 note (printed for the default --dtype mixed on a CPU without bf16 instructions) comes
    after the study's own checks, so that a bad flag's line stands alone on any host."""
    monkeypatch.setattr(cli, "bf16_instructions", lambda: [])
    with pytest.raises(SystemExit) as exit_info:
        study.parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and err.count("\n") == 1, err


@pytest.mark.parametrize("instructions, notes", [([], 1), (["avx512_bf16"], 0)])
def test_a_mixed_run_notes_emulated_bf16_once_and_only_where_the_cpu_lacks_it(instructions, notes, capsys,
                                                                              monkeypatch, tmp_path):
    monkeypatch.setattr(cli, "bf16_instructions", lambda: instructions)
    depth_sweep.parse_args(["--quick", "--dtype", "mixed", "--runs_dir", str(tmp_path / "runs")])
    assert capsys.readouterr().err.count("emulates bf16") == notes
    depth_sweep.parse_args(["--quick", "--dtype", "mixed", "--plan", "--runs_dir", str(tmp_path / "runs")])
    assert "emulates bf16" not in capsys.readouterr().err  # a plan trains nothing: no note


def test_depth_sweep_arms_trains_only_those_and_reports_the_rest_of_the_sweep(tmp_path, monkeypatch):
    """--arms lns: only LNS runs train; the other arms' saved records join them, and their unsaved runs count as
    skipped."""
    args = depth_sweep.parse_args(["--quick", "--arms", "lns", "--out", str(tmp_path / "report"),
                                   "--runs_dir", str(tmp_path / "runs")])
    trained, read = [], []

    def fake_collect(args, specs):
        trained.extend(spec.name for spec in specs)
        return {spec.name: dict(arm=spec.arm, seed=spec.seed) for spec in specs}, []

    def fake_saved(args, specs):
        read.extend(spec.name for spec in specs)
        return {spec.name: dict(arm=spec.arm, seed=spec.seed) for spec in specs if spec.seed == 1}

    monkeypatch.setattr(depth_sweep.runs, "collect_records", fake_collect)
    monkeypatch.setattr(depth_sweep.runs, "saved_records", fake_saved)
    records, skipped = depth_sweep.collect_records(args, depth_sweep.run_specs(args))
    assert trained and all("-lns-" in name for name in trained)
    assert any("-pre-" in name for name in read) and not any("-lns-" in name for name in read)  # and the rivals
    assert set(records) == set(trained) | {name for name in read if name.endswith("seed1")}
    assert sorted(spec.name for spec in skipped) == sorted(name for name in read if not name.endswith("seed1"))


@pytest.mark.e2e
def test_depth_sweep_quick_end_to_end_then_reuses_every_record(tmp_path):
    """In float32 and eager, the quick path everywhere alike (CI's smoke run of compare_norms takes the defaults)."""
    out, runs = tmp_path / "report", tmp_path / "runs"
    float32_eager = ["--dtype", "float32", "--no-compile"]
    assert depth_sweep.main(["--quick", *float32_eager, "--overfit_probe", "--out", str(out), "--runs_dir",
                             str(runs)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["runs"]) == 12 and not summary["missing"]  # 2 depths x 2 norms x 2 seeds, GPAS and BHyT at L4
    # per rival at L4: loss against Pre-LN and LNS, the identity gap, the variance against Pre-LN and LNS
    assert len(summary["rivals"]) == 2 * 5 and "## GPAS and BHyT at L = 4" in (out / "report.md").read_text()
    probe = summary["overfit_probe"]  # the probe: L4 (the deepest), eval every 2 of 8 updates
    assert probe["arm"] == "overfit-L4-lns" and [step for step, _ in probe["eval_curve"]] == [2, 4, 6, 8]
    assert (out / "overfit_probe.png").stat().st_size > 1000
    statuses = {"reproduced", "opposite", "inside noise", "not measurable", "not reproduced"}
    assert summary["predictions"] and all(p["status"] in statuses for p in summary["predictions"])
    report = (out / "report.md").read_text()
    assert "LNS − Pre-LN eval loss" in report and "95%" in report
    for png in ("measures_vs_depth.png", "loss_gap_vs_depth.png"):
        assert (out / png).stat().st_size > 1000
    record = read_records(out)["L4-lns-seed1"]
    assert record["machine"] == host.machine_description()
    assert f"**Machine** of the runs: {record['machine']} (13 runs)." in report  # the probe too
    analysed = record["analyses"][max(record["analyses"], key=int)]
    assert len(analysed["jacobian_rel_identity_dev"]) == 4 and len(analysed["removal_nats"]) == 4
    assert len(analysed["block_influence"]) == 4  # the angular tool's block influence reaches the record
    assert len(analysed["lens_kl"]) == 4 and 1 <= analysed["prediction_depth_mean"] <= 4  # and its logit lens
    assert len(analysed["removal_document_nats"]) == 2 and len(analysed["removal_document_costs"]) == 4  # 2 documents
    assert len(measures.document_measures(record)["removal_deep"]) == 2
    # A record made before block influence and the logit lens gets them back from its checkpoints, measured again
    # (the same host and code: every shared value agrees exactly), and the other records are left as they are.
    from utils.study import backfill

    record_path = record_store.path_for(out / "runs", "L4-lns-seed1")
    older = record_store.read(record_path)
    for analysis in older["analyses"].values():
        for later in ("block_influence", "lens_kl", "lens_top1_agreement", "prediction_depth_mean"):
            del analysis[later]
    record_store.write(out / "runs", "L4-lns-seed1", older)
    others = {path.name: path.read_bytes() for path in (out / "runs").iterdir() if path != record_path}
    assert backfill.main(["--into", str(out / "runs"), "--reanalyse", str(runs)]) == 0
    restored = record_store.read(record_path)
    assert restored["analyses"] == record["analyses"]
    [entry] = restored["backfilled"]
    assert entry["max_absolute_difference"] == 0 and entry["values_compared"] > 50
    assert {path.name: path.read_bytes() for path in (out / "runs").iterdir() if path != record_path} == others
    # A second invocation, with the runs folder gone, reuses the committed records and trains nothing.
    shutil.rmtree(runs)
    assert depth_sweep.main(["--quick", *float32_eager, "--out", str(out), "--runs_dir", str(runs)]) == 0
    assert not (runs / "logs").exists()
    report = (out / "report.md").read_text()
    assert "reused 12 records" in report and "| step | 2 | 4 | 6 | 8 |" in report  # the probe's record too
    assert "--dtype float32 --no-compile" in report  # the command, as given
    # The float32 records do not stand in for mixed-precision runs: a mixed report finds none of them.
    # Same report folder, so the float32 records are there to be (wrongly) matched.
    # It refuses in one line (exit 2) rather than write an empty report over the float32 one.
    written = (out / "summary.json").read_bytes()
    with pytest.raises(SystemExit) as exit_info:
        depth_sweep.main(["--quick", "--dtype", "mixed", "--no-compile", "--report_only", "--out", str(out),
                          "--runs_dir", str(runs)])
    assert exit_info.value.code == 2 and (out / "summary.json").read_bytes() == written


def test_max_hours_is_one_deadline_for_the_sweep_and_its_probe(tmp_path, monkeypatch):
    """--max_hours counts from the start of the invocation: the overfitting probe, collected after the sweep, starts
    under the same deadline, not under one that begins when the sweep's runs end."""
    clock = [1000.0]
    deadlines = []

    def fake_run_jobs(specs, settings, runs_dir, records_dir, jobs, fresh, deadline, *rest):
        deadlines.append(deadline)
        clock[0] += 2 * 3600  # the runs take two hours
        return {}, []

    monkeypatch.setattr(runs.time, "time", lambda: clock[0])
    monkeypatch.setattr(runs, "run_jobs", fake_run_jobs)
    monkeypatch.setattr(depth_sweep, "write_report", lambda *args, **kwargs: tmp_path / "report.md")
    assert depth_sweep.main(["--quick", "--max_hours", "1", "--overfit_probe", "--out", str(tmp_path / "report"),
                             "--runs_dir", str(tmp_path / "runs")]) == 0
    assert deadlines == [1000.0 + 3600] * 2


def test_overfit_point_finds_the_lowest_eval_and_whether_the_loss_rose_after_it():
    rising = depth_sweep.overfit_point(dict(eval_curve=[[250, 5.0], [500, 4.6], [750, 4.7], [1000, 4.9]]))
    assert rising["best_step"] == 500 and rising["overfits"] and rising["rise_after_best"] == pytest.approx(0.3)
    falling = depth_sweep.overfit_point(dict(eval_curve=[[500, 4.6], [250, 5.0]]))  # order does not matter
    assert falling["best_step"] == 500 and not falling["overfits"]
    flat = depth_sweep.overfit_point(dict(eval_curve=[[250, 5.0], [500, 4.6], [750, 4.601]]))  # under 1% in ppl
    assert flat["best_step"] == 500 and not flat["overfits"]
    probe = dict(eval_curve=[[4, 5.0], [8, 4.0]], train_curve=[[1, 6.0], [3, 5.0], [5, 4.0], [7, 3.0], [8, 2.0]])
    assert depth_sweep.train_loss_between_evals(probe) == [5.5, 3.0]


@pytest.mark.e2e
@pytest.mark.parametrize("stopped_by", ["a kill", "a signal"])
def test_an_interrupted_run_resumes_from_its_last_checkpoint(stopped_by, tmp_path, monkeypatch):
    """Killed, a run leaves no results.json; stopped by SIGTERM (a session's end), the trainer saves, writes
    results.json with status "stopped" and exits 5. Either way the next invocation continues the run from its last
    checkpoint instead of analysing the partial model as if it had finished."""
    monkeypatch.setattr(runs, "RESUMABLE_CHECKPOINTS", 2)  # model_6 stays resumable once model_8 is gone
    args = depth_sweep.parse_args(["--quick", "--out", str(tmp_path / "report"), "--runs_dir", str(tmp_path / "runs")])
    spec, settings = depth_sweep.probe_spec(args), runs.analysis_settings(args.settings)
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", HF_HUB_OFFLINE="1")
    whole = runs.run_job(spec, settings, args.runs_dir, tmp_path / "records", env)
    # Make the folder look like a run interrupted after its step-6 checkpoint: no step-8 checkpoint.
    run_dir = args.runs_dir / spec.name
    results = json.loads((run_dir / "results.json").read_text())
    if stopped_by == "a kill":
        (run_dir / "results.json").unlink()
    else:
        (run_dir / "results.json").write_text(json.dumps(dict(results, status="stopped", step=6,
                                                              final_eval_loss=None, stop_signal="SIGTERM")))
    shutil.rmtree(run_dir / "model_8")
    record_store.path_for(tmp_path / "records", spec.name).unlink()
    resumed = runs.run_job(spec, settings, args.runs_dir, tmp_path / "records", env)
    assert "resumed from" in (args.runs_dir / "logs" / f"{spec.name}.train.log").read_text()
    assert resumed["status"] == "finished" and resumed["last_step"] == 8 and resumed["reused"] == "no"
    assert [step for step, _ in resumed["eval_curve"]] == [2, 4, 6, 8]  # rows past step 6 replaced, not repeated
    assert resumed["final_eval_loss"] == pytest.approx(whole["final_eval_loss"], abs=1e-5)
    assert resumed["train_seconds"] > 0


def test_one_seed_pairs_are_judged_over_held_out_documents():
    def record(arm, seed, document_nats, deep_costs):
        analysis = dict(crafted_analysis(), removal_document_nats=document_nats,
                        removal_document_costs=[[0.5] * len(document_nats)] * 4 + [deep_costs] * 4)
        return dict(arm=arm, seed=seed, status="finished", final_eval_loss=5.0, eval_curve=[[4, 5.0]],
                    analyses={"4": analysis})

    pre_nats = [5.0, 5.2, 4.9, 5.1, 5.3, 5.0]
    records = {"pre_bf16-seed1": record("pre_bf16", 1, pre_nats, [0.01] * 6),
               "lns_bf16-seed1": record("lns_bf16", 1, [n - 0.2 for n in pre_nats],
                                        [0.03, 0.02, 0.04, 0.03, 0.02, 0.03])}
    found = study_pair_verdicts(records, "pre_bf16", "lns_bf16")
    loss, removal = found[0], found[-1]
    assert loss.unit == "documents" and loss.n_pairs == 6
    assert loss.effect == pytest.approx(-0.2) and loss.status == verdicts.REPRODUCED
    assert "bootstrap over 6 held-out documents" in loss.reason
    assert removal.unit == "documents" and removal.effect == pytest.approx(0.17 / 6 - 0.01)
    assert removal.status == verdicts.REPRODUCED
    assert all(v.status == verdicts.NOT_MEASURABLE for v in found[1:-1])  # no per-token values: still one seed
    # Removal that helps both models on every document is "not reproduced", whatever the order.
    records["pre_bf16-seed1"] = record("pre_bf16", 1, pre_nats, [-0.03] * 6)
    records["lns_bf16-seed1"] = record("lns_bf16", 1, pre_nats, [-0.01, -0.02, -0.01, -0.015, -0.01, -0.02])
    assert study_pair_verdicts(records, "pre_bf16", "lns_bf16")[-1].status == verdicts.NOT_REPRODUCED
    # A run analysed before per-document values existed keeps the one-seed "not measurable".
    del records["lns_bf16-seed1"]["analyses"]["4"]["removal_document_costs"]
    assert study_pair_verdicts(records, "pre_bf16", "lns_bf16")[0].status == verdicts.NOT_MEASURABLE


def test_per_arm_table_sets_every_arm_against_pre_ln_and_lns(tmp_path):
    def record(arm, seed, loss, document_nats):
        analysis = dict(crafted_analysis(), removal_document_nats=document_nats,
                        removal_document_costs=[[0.01] * len(document_nats)] * 8)
        return dict(arm=arm, seed=seed, status="finished", final_eval_loss=loss, eval_curve=[[4, loss]],
                    analyses={"4": analysis})

    nats = [5.0, 5.2, 4.9, 5.1, 5.3, 5.0]
    records = {f"{arm}-seed{seed}": record(arm, seed, loss + 0.01 * seed + 0.001 * SEED_NOISE[seed] * (arm == "lns"),
                                           [n + loss - 5 for n in nats])
               for arm, loss in (("pre", 5.0), ("lns", 4.8)) for seed in (1, 2, 3)}
    records["skipinit-seed1"] = record("skipinit", 1, 4.5, [n - 0.5 for n in nats])  # one seed: over documents
    arms = [compare_norms.ARM_BY_NAME[name] for name in ("pre", "lns", "skipinit")]
    header, _, pre, lns, skipinit = compare_norms.per_arm_table(records, arms).splitlines()
    assert "eval loss − Pre-LN" in header and "eval loss − LNS" in header
    assert "-0.2000" in lns and "3/3 (reproduced)" in lns  # LNS against Pre-LN, over seeds
    assert skipinit.count("documents (reproduced)") == 2  # against Pre-LN (-0.5) and LNS (-0.3), over documents
    assert "-0.5000" in skipinit and "-0.3000" in skipinit
    assert compare_norms.plot_per_arm(records, arms, tmp_path / "per_arm.png").stat().st_size > 1000


@pytest.mark.parametrize("study", [compare_norms, depth_sweep])
@pytest.mark.parametrize("compile_flag", [False, True])
def test_compile_flag_reaches_every_run_and_its_record_identity(study, compile_flag, tmp_path, monkeypatch):
    """--compile trains every run compiled, and it is part of the flags a record is matched on."""
    ran = []
    monkeypatch.setattr(runs, "run_jobs", lambda specs, *rest: (ran.extend(specs), ({}, []))[1])
    argv = ["--quick", "--out", str(tmp_path / "report"), "--runs_dir", str(tmp_path / "runs")]
    args = study.parse_args(argv + ["--compile" if compile_flag else "--no-compile"])
    specs = (compare_norms.run_specs(args, compare_norms.study_arms(args)) if study is compare_norms
             else depth_sweep.run_specs(args))
    runs.collect_records(args, specs)
    assert ran and all(("--compile" in spec.flags()) == compile_flag for spec in ran)
    assert all("--compile" not in spec.flags() for spec in specs)  # the caller's specs are left as they were


@pytest.mark.parametrize("study", [compare_norms, depth_sweep])
@pytest.mark.parametrize("dtype", ["float32", "mixed"])
def test_dtype_flag_reaches_every_run_but_the_pure_bf16_arms(study, dtype, tmp_path, monkeypatch):
    """--dtype sets what every run with fp32 master weights trains in; a pure-bf16 arm keeps bfloat16."""
    ran = []
    monkeypatch.setattr(runs, "run_jobs", lambda specs, *rest: (ran.extend(specs), ({}, []))[1])
    argv = ["--budget", "default", "--out", str(tmp_path / "report"), "--runs_dir", str(tmp_path / "runs")]
    args = study.parse_args(argv + ["--dtype", dtype])
    specs = (compare_norms.run_specs(args, compare_norms.study_arms(args)) if study is compare_norms
             else depth_sweep.run_specs(args))
    runs.collect_records(args, specs)

    def trained_in(spec):
        flags = spec.flags()
        return flags[flags.index("--dtype") + 1]

    assert ran and {trained_in(spec) for spec in ran if not spec.arm.endswith("_bf16")} == {dtype}
    if study is compare_norms:
        assert {trained_in(spec) for spec in ran if spec.arm.endswith("_bf16")} == {"bfloat16"}
    assert {trained_in(spec) for spec in specs} <= {"float32", "bfloat16"}  # the caller's specs are left as they were


def test_a_bad_study_dtype_is_a_one_line_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        compare_norms.parse_args(["--dtype", "bfloat16"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "--dtype" in error and "bfloat16" in error


def test_precision_section_names_the_study_dtype():
    records = {f"{arm}-seed{seed}": dict(arm=arm, seed=seed, status="finished", final_eval_loss=5.0 - 0.1 * seed,
                                         eval_curve=[[10, 5.0]], analyses={"10": crafted_analysis()})
               for arm in ("pre", "lns", "pre_bf16", "lns_bf16") for seed in (1, 2)}
    found = [study_pair_verdicts(records, "pre", "lns"), study_pair_verdicts(records, "pre_bf16", "lns_bf16")]
    text = compare_norms.precision_section(records, *found, "mixed precision")
    assert "mixed precision effect" in text and "pure bf16 minus mixed precision" in text and "float32" not in text


@pytest.mark.parametrize("study", [compare_norms, depth_sweep])
def test_the_studies_default_to_mixed_precision_compiled(study):
    """Issue 15: the study trains on the fast path unless told otherwise."""
    args = study.parse_args([])
    assert args.dtype == "mixed" and args.compile


@pytest.mark.parametrize("study, budget, flags, out, runs_dir", [
    (compare_norms, "default", [], "docs/study_mixed_compile", "runs/study_mixed_compile"),
    (compare_norms, "default", ["--dtype", "float32", "--no-compile"], "docs/study", "runs/study"),
    (compare_norms, "default", ["--no-compile"], "docs/study_mixed", "runs/study_mixed"),
    (compare_norms, "long", [], "docs/study_long_mixed_compile", "runs/study_long_mixed_compile"),
    (compare_norms, "long", ["--dtype", "float32", "--no-compile"], "docs/study_long", "runs/study_long"),
    (compare_norms, "long_rivals", [], "docs/study_long_mixed_compile", "runs/study_long_mixed_compile"),
    (compare_norms, "quick", ["--dtype", "float32"], "runs/study_quick_compile/report", "runs/study_quick_compile"),
    (depth_sweep, "default", [], "docs/depth_sweep_mixed_compile", "runs/depth_sweep_mixed_compile"),
    (depth_sweep, "default", ["--dtype", "float32", "--no-compile"], "docs/depth_sweep", "runs/depth_sweep"),
    (depth_sweep, "default", ["--dtype", "float32", "--no-compile", "--lr", "0.001"], "docs/depth_sweep",
     "runs/depth_sweep"),
    (depth_sweep, "wikipedia", ["--dtype", "float32", "--no-compile", "--lr", "5e-4"],
     "docs/depth_sweep_wikipedia_lr0.0005", "runs/depth_sweep_wikipedia_lr0.0005"),
    (compare_norms, "default", ["--lr", "2e-3"], "docs/study_mixed_compile_lr0.002",
     "runs/study_mixed_compile_lr0.002"),
    (width_sweep, "default", ["--dtype", "float32", "--no-compile", "--lr", "2e-3"], "docs/width_sweep_lr0.002",
     "runs/width_sweep_lr0.002"),
])
def test_a_dtype_or_compile_variant_gets_its_own_default_folders(study, budget, flags, out, runs_dir):
    """A variant's runs are other records: by default they go beside the committed ones, never over them; the
    committed float32, eager records keep their plain folders."""
    args = study.parse_args(["--budget", budget, *flags, "--report_only"])  # named as a training command names them
    assert args.out == runs.REPO / out and args.runs_dir == runs.REPO / runs_dir


@pytest.mark.parametrize("study", [compare_norms, depth_sweep, width_sweep])
def test_an_lr_other_than_the_budgets_reaches_every_run(study):
    """Issue 47's lr grid: --lr is the peak rate of every run the study trains; the budget's rate is the default."""
    def rates(argv):
        specs = study.run_specs(study.parse_args(["--quick", *argv]), *(
            [compare_norms.ARMS] if study is compare_norms else []))
        return {spec.train_flags[spec.train_flags.index("--lr") + 1] for spec in specs}

    assert rates([]) == {"1e-3"}
    assert rates(["--lr", "2e-3"]) == {"0.002"}


@pytest.mark.parametrize("value, message", [("0", "must be a positive number, got 0"), ("-0.001", "got -0.001"),
                                            ("inf", "got inf"), ("fast", "not a number: 'fast'")])
def test_a_bad_lr_is_one_line_naming_the_flag(value, message, capsys):
    with pytest.raises(SystemExit):
        depth_sweep.parse_args(["--lr", value])
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "error: argument --lr:" in err and message in err


@pytest.mark.parametrize("argv, command", [
    ([], "python utils/compare_norms.py --dtype mixed --compile`"),
    (["--budget", "long", "--no-compile"], "python utils/compare_norms.py --budget long --no-compile --dtype mixed`"),
    (["--dtype", "float32", "--no-compile", "--report_only"],
     "python utils/compare_norms.py --dtype float32 --no-compile` (this text rewritten"),
    (["--dtype=float32"], "python utils/compare_norms.py --dtype=float32 --compile`"),
])
def test_a_report_names_the_precision_and_mode_it_was_trained_in(argv, command):
    """The report's command stays true when a default changes: it always names --dtype and --compile."""
    line = report.generated_by("utils/compare_norms.py", argv, compare_norms.parse_args(argv))
    assert line.startswith(f"Generated by `{command}")


def test_only_a_sitting_that_ran_reports_its_duration():
    """--report_only trains nothing: its header says so instead of timing the rewrite."""
    started = time.time() - 90
    assert report.sitting_clause(["--report_only"], started, reused=11) == "."
    clause = report.sitting_clause(["--max_hours", "1"], started, reused=4)
    assert clause.startswith("; this invocation took 1.5 minutes") and "reused 4 records" in clause


def test_a_report_names_the_machines_its_records_were_made_on():
    """--report_only may rewrite a report elsewhere: its machine line comes from the records, not the writer."""
    records = {"a": dict(machine="Xeon"), "b": dict(machine="EPYC"), "c": dict(machine="Xeon"), "d": {}}
    line = host.records_machines(records)
    assert line.startswith("Xeon (2 runs); EPYC (1 runs); not recorded for 1 runs")
    assert host.records_machines({}) == "no records yet"


def test_the_overfit_probe_is_found_again_in_the_default_setting(tmp_path, monkeypatch):
    """A later invocation without --overfit_probe reads back the probe that --overfit_probe trained, in the mixed,
    compiled default as in float32."""
    def fake_run_jobs(specs, settings, runs_dir, records_dir, *rest):
        records_dir.mkdir(parents=True, exist_ok=True)
        records = {}
        for spec in specs:
            records[spec.name] = dict(version=runs.RECORD_VERSION, arm=spec.arm, seed=spec.seed,
                                      flags=spec.flags(), analysis_settings=dataclasses.asdict(settings),
                                      status="finished", last_step=8, analyses={}, eval_curve=[[8, 5.0]])
            record_store.write(records_dir, spec.name, records[spec.name])
        return records, []

    monkeypatch.setattr(runs, "run_jobs", fake_run_jobs)
    folders = ["--quick", "--out", str(tmp_path / "report"), "--runs_dir", str(tmp_path / "runs")]
    trained = depth_sweep.collect_probe(depth_sweep.parse_args([*folders, "--overfit_probe"]))
    assert "--compile" in trained["flags"] and trained["flags"][trained["flags"].index("--dtype") + 1] == "mixed"
    assert depth_sweep.collect_probe(depth_sweep.parse_args(folders))["flags"] == trained["flags"]


def test_jobs_are_lowered_until_the_runs_in_flight_fit_on_the_disk(tmp_path, monkeypatch, capsys):
    """On a GPU, 18 hidden-1024 runs side by side filled a 64 GiB disk with checkpoints (session 29)."""
    spec = runs.RunSpec("wide", 1, ("--model_config", "configs/llama_130m.json", "--num_training_steps", "400"),
                             analyse_steps=(200, 300, 400))
    narrow = runs.RunSpec("narrow", 1, ("--model_config", "configs/llama_tiny.json", "--num_training_steps",
                                             "400"), analyse_steps=(200, 300, 400))
    largest = runs.checkpoint_bytes(spec)
    assert largest > runs.checkpoint_bytes(narrow) > 0
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(runs.shutil, "disk_usage", lambda path: usage._replace(free=int(2.5 * largest)))
    assert runs.jobs_the_disk_holds([narrow, spec], 6, tmp_path) == 2
    assert "--jobs 6 lowered to 2" in capsys.readouterr().out
    monkeypatch.setattr(runs.shutil, "disk_usage", lambda path: usage._replace(free=100 * largest))
    assert runs.jobs_the_disk_holds([narrow, spec], 6, tmp_path) == 6
    assert capsys.readouterr().out == ""


def test_depth_sweep_rivals_train_at_their_depths_and_are_judged_against_pre_ln_and_lns(tmp_path):
    """GPAS and BHyT (issue 39) join the depth sweep at L = 24 and 48 only, after every Pre-LN and LNS run; the
    verdicts pair them by seed with Pre-LN and LNS in eval loss, and with Pre-LN in the deep blocks' identity gap."""
    args = depth_sweep.parse_args(["--budget", "rivals", "--out", str(tmp_path / "report"),
                                   "--runs_dir", str(tmp_path / "runs")])
    arms = [spec.arm for spec in depth_sweep.run_specs(args)]
    assert sorted({arm for arm in arms if not arm.endswith(("-pre", "-lns"))}) == \
        ["L24-bhyt", "L24-gpas", "L48-bhyt", "L48-gpas"]
    assert arms.index("L24-gpas") > max(i for i, arm in enumerate(arms) if arm.endswith(("-pre", "-lns")))
    default = depth_sweep.parse_args(["--out", str(tmp_path / "report"), "--runs_dir", str(tmp_path / "runs")])
    assert all(arm.endswith(("-pre", "-lns")) for arm in (s.arm for s in depth_sweep.run_specs(default)))

    def record(arm, seed, loss, deep_gap, growth_factor):
        analysis = dict(crafted_analysis(), jacobian_rel_identity_dev=[0.5] * 4 + [deep_gap] * 4)
        analysis["variance"][-1] *= growth_factor
        return dict(arm=arm, seed=seed, status="finished", final_eval_loss=loss, eval_curve=[[4, loss]],
                    analyses={"4": analysis})

    records = {}
    for seed in (1, 2, 3):
        for arm, loss, gap, rival in (("pre", 5.0, 0.10, 0), ("lns", 4.9, 0.08, 0), ("gpas", 4.8, 0.20, 1),
                                      ("bhyt", 5.2, 0.10, 2)):
            for depth in (24, 48):  # the rivals' noise is zero-mean over seeds, and larger at L = 48
                noise = 0.001 * SEED_NOISE[seed] * rival * (1 if depth == 24 else 3)
                records[f"L{depth}-{arm}-seed{seed}"] = record(f"L{depth}-{arm}", seed, loss + 0.01 * seed + noise,
                                                               gap + 0.001 * seed * (arm == "gpas"),
                                                               math.exp(10 * noise))
    found = {v.claim: v for v in depth_verdicts.rival_verdicts(depth_sweep.depth_axis(args), records, args.settings)}
    assert len(found) == 2 * 2 * 5 + 2  # per depth and rival: loss vs Pre-LN and LNS, identity gap, variance x2
    growth = found["BHyT gains on LNS from L=24 to L=48 (change in BHyT − LNS eval loss)"]
    assert growth.effect == pytest.approx(0.0) and growth.n_pairs == 3  # the crafted losses ignore depth
    variance = found["L=48: GPAS holds the variance growth below LNS's (log ratio)"]
    assert variance.scale == "log ratio" and variance.effect == pytest.approx(0.0)
    gpas_loss = found["L=48: GPAS reaches a lower eval loss than Pre-LN (GPAS − Pre-LN)"]
    assert gpas_loss.effect == pytest.approx(-0.2) and gpas_loss.status == verdicts.REPRODUCED
    bhyt_loss = found["L=24: BHyT reaches a lower eval loss than LNS (BHyT − LNS)"]
    assert bhyt_loss.effect == pytest.approx(0.3) and bhyt_loss.status == verdicts.OPPOSITE
    gpas_identity = next(v for claim, v in found.items() if claim.startswith("L=24: GPAS's deep blocks"))
    assert gpas_identity.effect == pytest.approx(0.102) and gpas_identity.status == verdicts.REPRODUCED
    assert "## GPAS and BHyT at L = 24, 48" in depth_verdicts.rivals_section(list(found.values()), args.settings)
    assert depth_verdicts.rival_verdicts(depth_sweep.depth_axis(default), records, default.settings) == []


def test_a_rival_without_block_jacobians_is_judged_by_block_influence_and_the_others_by_their_jacobian(tmp_path):
    """AttnRes and mHC pass no running sum, so their records have no block Jacobian (issue 67): the depth sweep judges
    their deep blocks against Pre-LN's by block influence, while GPAS and BHyT keep the ‖J − I‖ claim."""
    args = depth_sweep.parse_args(["--budget", "rivals_2026", "--out", str(tmp_path / "report"),
                                   "--runs_dir", str(tmp_path / "runs")])
    records = {}
    for seed in (1, 2, 3):
        for arm, influence in (("pre", 0.010), ("lns", 0.010), ("gpas", 0.010), ("bhyt", 0.010), ("attnres", 0.030),
                               ("mhc", 0.005)):
            noise = 0.001 * SEED_NOISE[seed] * (arm in ("attnres", "mhc"))  # zero-mean over seeds
            analysis = dict(crafted_analysis(), block_influence=[0.1] * 4 + [influence + noise] * 4)
            if arm in ("attnres", "mhc"):
                analysis["jacobian_rel_identity_dev"] = []
            for depth in (24, 48):
                records[f"L{depth}-{arm}-seed{seed}"] = dict(
                    arm=f"L{depth}-{arm}", seed=seed, status="finished", final_eval_loss=5.0 + 0.01 * seed,
                    eval_curve=[[4, 5.0]], analyses={"4": analysis})
    found = {v.claim: v for v in depth_verdicts.rival_verdicts(depth_sweep.depth_axis(args), records, args.settings)}
    attnres = found["L=48: AttnRes's deep blocks change the stream more than Pre-LN's (AttnRes − Pre-LN deep block "
                    "influence)"]
    assert attnres.effect == pytest.approx(0.020) and attnres.status == verdicts.REPRODUCED and attnres.n_pairs == 3
    mhc = found["L=24: mHC's deep blocks change the stream more than Pre-LN's (mHC − Pre-LN deep block influence)"]
    assert mhc.effect == pytest.approx(-0.005) and mhc.status == verdicts.OPPOSITE
    assert not any("identity" in claim for claim in found if "AttnRes" in claim or "mHC" in claim)
    gpas = found["L=24: GPAS's deep blocks stay farther from the identity than Pre-LN's (GPAS − Pre-LN deep "
                 "‖J − I‖/√d)"]
    assert gpas.n_pairs == 3


def test_block_influence_is_the_fifth_measure_where_the_records_have_it():
    """Records analysed before block influence existed lack it: no column, panel or verdict then; with it, its own
    verdict row (LNS against Pre-LN, paired by seed)."""
    def record(arm, seed, influence=None):
        analysis = dict(crafted_analysis(), **({"block_influence": influence} if influence else {}))
        return dict(arm=arm, seed=seed, status="finished", final_eval_loss=5.0, eval_curve=[[4, 5.0]],
                    analyses={"4": analysis})

    old = {f"{arm}-seed{seed}": record(arm, seed) for arm in ("pre", "lns") for seed in (1, 2, 3)}
    assert "bi_deep" not in measures.measures_in(old) and "jacobian_deep" in measures.measures_in(old)
    assert not any("block influence" in v.claim for v in study_pair_verdicts(old, "pre", "lns"))
    new = {f"{arm}-seed{seed}": record(arm, seed, [0.3] * 4 + [base + 0.01 * seed + jitter * SEED_NOISE[seed]] * 4)
           for arm, base, jitter in (("pre", 0.02, 0.0), ("lns", 0.05, 0.001)) for seed in (1, 2, 3)}
    assert measures.by_seed(new, "lns", "bi_deep")[2] == pytest.approx(0.07)  # the deeper half only
    influence = study_pair_verdicts(new, "pre", "lns")[-1]
    assert "block influence" in influence.claim and influence.effect == pytest.approx(0.03)
    assert influence.status == verdicts.REPRODUCED
    assert "deep block influence" in compare_norms.per_arm_table(new, [compare_norms.ARM_BY_NAME["lns"]])
    assert "deep block influence" not in compare_norms.per_arm_table(old, [compare_norms.ARM_BY_NAME["lns"]])


def test_the_depth_sweep_predicts_block_influence_only_from_pre_lns_own_records(tmp_path):
    """A rival's records with block influence do not make a Pre-LN prediction out of Pre-LN records without it."""
    args = depth_sweep.parse_args(["--quick", "--out", str(tmp_path / "report"), "--runs_dir", str(tmp_path / "runs")])

    def record(arm, seed, depth, influence):
        analysis = dict(crafted_analysis(), **({"block_influence": [0.1 / depth] * 4} if influence else {}))
        return dict(arm=arm, seed=seed, status="finished", final_eval_loss=5.0 + seed / 100, eval_curve=[[4, 5.0]],
                    analyses={"4": analysis})

    def claims(pre_has_it):
        records = {f"L{d}-{norm}-seed{seed}": record(f"L{d}-{norm}", seed, d, norm != "pre" or pre_has_it)
                   for d in (2, 4) for norm in ("pre", "lns", "gpas") for seed in (1, 2)}
        return [v.claim for v in depth_verdicts.depth_verdicts(depth_sweep.depth_axis(args), records)]

    assert not any("block influence" in claim for claim in claims(pre_has_it=False))
    assert any("block influence" in claim for claim in claims(pre_has_it=True))


def lens_record(arm, seed, lens_kl=None, prediction_depth_mean=None):
    """A crafted record of 8 layers, with the logit lens's fields only when given (older records lack them)."""
    lens = dict(lens_kl=lens_kl, lens_top1_agreement=[0.5] * 7 + [1.0],
                prediction_depth_mean=prediction_depth_mean) if lens_kl else {}
    return dict(arm=arm, seed=seed, status="finished", final_eval_loss=5.0, eval_curve=[[4, 5.0]],
                analyses={"4": dict(crafted_analysis(), **lens)})


def test_the_logit_lens_measures_and_verdicts_appear_where_the_records_have_them():
    """Issue 50: the lens's deep-half KL and relative prediction depth summarise a record's lens; records analysed
    before the lens existed give neither measure nor verdict, and the verdicts before them are unchanged."""
    old = {f"{arm}-seed{seed}": lens_record(arm, seed) for arm in ("pre", "lns") for seed in (1, 2, 3)}
    assert not {"lens_kl_deep", "relative_prediction_depth"} & set(measures.measures_in(old))
    old_verdicts = study_pair_verdicts(old, "pre", "lns")
    assert not any("prediction" in v.claim for v in old_verdicts)

    def lens_kl(deep, seed):  # the deep half (layers 4..7) ends with the final layer's 0
        return [2.0] * 4 + [deep + 0.01 * seed] * 3 + [0.0]

    new = {f"{arm}-seed{seed}": lens_record(arm, seed, lens_kl(deep + jitter * SEED_NOISE[seed], seed),
                                            depth + 0.1 * seed + jitter * SEED_NOISE[seed])
           for arm, deep, depth, jitter in (("pre", 0.2, 3.0, 0.0), ("lns", 0.6, 5.0, 0.01)) for seed in (1, 2, 3)}
    assert measures.by_seed(new, "lns", "lens_kl_deep")[2] == pytest.approx((3 * 0.62 + 0.0) / 4)
    assert measures.by_seed(new, "pre", "relative_prediction_depth")[1] == pytest.approx(3.1 / 8)
    found = study_pair_verdicts(new, "pre", "lns")
    assert [v.claim for v in found[:len(old_verdicts)]] == [v.claim for v in old_verdicts]
    kl, depth = found[len(old_verdicts):]
    assert "logit-lens KL" in kl.claim and kl.effect == pytest.approx(0.3) and kl.status == verdicts.REPRODUCED
    assert "prediction depth" in depth.claim and depth.effect == pytest.approx(2 / 8)
    assert depth.status == verdicts.REPRODUCED
    opposite = {name: dict(record, arm={"pre": "lns", "lns": "pre"}[record["arm"]]) for name, record in new.items()}
    assert {v.status for v in study_pair_verdicts(opposite, "pre", "lns")[len(old_verdicts):]} == {verdicts.OPPOSITE}


def test_the_depth_sweep_compares_the_logit_lens_only_where_the_records_have_it():
    axis = sweep.Axis("L", "L", "layers L", "depth", (6, 12, 24, 48))
    wobble = {1: 1.0, 2: 1.02, 3: 0.97}
    records = depth_records(lambda norm, depth, seed: 0.1, lambda norm, depth, seed: 5.0)
    assert not {"lens_kl_deep", "relative_prediction_depth"} & {
        c.measure for c in depth_verdicts.comparative_verdicts(axis, records)}
    for record in records.values():  # Pre-LN's prediction settles ever earlier with depth, LNS's stays near 0.8 L
        depth, norm, seed = int(record["arm"].split("-")[0][1:]), record["arm"].split("-")[1], record["seed"]
        # each seed's own slope of the log ratio is 1 + 0.01 SEED_NOISE: 1 on average over the seeds
        settles_at = (0.8 * depth ** (0.01 * SEED_NOISE[seed]) if norm == "lns" else 3.0 / depth) * wobble[seed]
        # LNS's deep lens KL drifts with ln L one way at seed 1 and the other at seed 3: no slope on average
        deep_kl = 0.5 + (0.01 * SEED_NOISE[seed] * math.log(depth) if norm == "lns" else 0.0)
        record["analyses"]["4"].update(lens_kl=[0.5] * 4 + [deep_kl] * 3 + [0.0], prediction_depth_mean=settles_at * 8)
    found = {c.measure: c for c in depth_verdicts.comparative_verdicts(axis, records)}
    assert found["relative_prediction_depth"].ratio.effect == pytest.approx(1.0)  # ln(0.8 / (3 / L)) = ln L + const
    assert found["relative_prediction_depth"].ratio.status == verdicts.REPRODUCED
    assert found["lens_kl_deep"].gap.effect == pytest.approx(0.0, abs=1e-12)


@pytest.mark.e2e
def test_the_logit_lens_reaches_the_record_from_a_real_checkpoint(tmp_path):
    """The study's analysis of a (tiny, untrained) checkpoint, in process: the angular tool's lens reaches the
    analysis, and the measures summarise it."""
    from tests.analysis_helpers import save_with_tokenizer, tiny_ours

    checkpoint = save_with_tokenizer(tiny_ours("pre", 3, seed=1), tmp_path / "model_4")
    settings = runs.AnalysisSettings(max_seq_len=32, stream_tokens=64, jacobian_tokens=1, jacobian_probes=0,
                                     removal_documents=2)
    analysis = analyse.analyse_checkpoint(checkpoint, settings)
    assert len(analysis["lens_kl"]) == len(analysis["lens_top1_agreement"]) == 3
    assert analysis["lens_kl"][-1] == pytest.approx(0.0, abs=1e-6) and analysis["lens_top1_agreement"][-1] == 1.0
    assert 1.0 <= analysis["prediction_depth_mean"] <= 3.0
    summary = measures.summarise_analysis(analysis)
    assert summary["lens_kl_deep"] == pytest.approx(analysis["lens_kl"][1] / 2) and summary["lens_kl_deep"] > 0
    assert summary["relative_prediction_depth"] == pytest.approx(analysis["prediction_depth_mean"] / 3)
    record = dict(arm="pre", seed=1, status="finished", final_eval_loss=5.0, eval_curve=[[4, 5.0]],
                  analyses={"4": analysis})
    assert {"lens_kl_deep", "relative_prediction_depth"} <= set(measures.measures_in({"pre-seed1": record}))


@pytest.mark.parametrize("budget, named, not_named", [
    ("long", ["Pre-LN and LNS"], ["pure-bf16", "DeepNorm", "rivals", "GPAS"]),
    ("default", ["Pre-LN and LNS", "1 for the pure-bf16 arms", "1 for Post-LN, Mix-LN and DeepNorm"], ["GPAS"]),
    ("long_rivals", ["1, 2, 3 for Post-LN", "1, 2, 3 for GPAS"], ["pure-bf16"]),
])
def test_a_reports_seed_line_names_only_the_arms_its_budget_trains(budget, named, not_named):
    sentence = compare_norms.seeds_sentence(compare_norms.parse_args(["--budget", budget]).settings, "mixed precision")
    assert all(part in sentence for part in named) and not any(part in sentence for part in not_named)


def depth_records(jacobian_deep, eval_loss, depths=(6, 12, 24, 48), seeds=(1, 2, 3)):
    """Crafted depth-sweep records: jacobian_deep(norm, depth, seed) sets the deep half's ‖J − I‖/√d and
    eval_loss(norm, depth, seed) the final loss."""
    records = {}
    for norm in ("pre", "lns"):
        for depth in depths:
            for seed in seeds:
                deep = jacobian_deep(norm, depth, seed)
                analysis = dict(crafted_analysis(), jacobian_rel_identity_dev=[0.5] * 4 + [deep] * 4)
                loss = eval_loss(norm, depth, seed)
                records[f"L{depth}-{norm}-seed{seed}"] = dict(arm=f"L{depth}-{norm}", seed=seed, status="finished",
                                                              final_eval_loss=loss, eval_curve=[[4, loss]],
                                                              analyses={"4": analysis})
    return records


def test_comparative_depth_verdicts_tell_a_narrowing_gap_from_a_growing_ratio():
    """Issue 46: the primary depth verdicts compare the arms. When both arms' deep measure shrinks in proportion
    (the ratio fixed), the gap LNS − Pre-LN narrows toward zero, which is not LNS's deep layers becoming
    relatively more active: the gap's slope is reproduced, the ratio's is not. When LNS's measure holds while
    Pre-LN's shrinks, both are."""
    axis = sweep.Axis("L", "L", "layers L", "depth", (6, 12, 24, 48))
    wobble = {1: 1.0, 2: 1.02, 3: 0.97}  # per-seed noise, so that intervals are not degenerate

    def loss(norm, depth, seed):
        return 5.0 + 0.1 * math.log(depth) * wobble[seed] - (0.05 if norm == "lns" else 0.0)

    def shrinking_in_proportion(norm, depth, seed):  # LNS at half of Pre-LN, with noise in the ratio
        return (0.5 * (1 + 0.05 * math.sin(depth * seed)) if norm == "lns" else 1.0) * wobble[seed] / depth

    proportional = depth_records(shrinking_in_proportion, loss)
    jacobian = next(c for c in depth_verdicts.comparative_verdicts(axis, proportional) if c.measure == "jacobian_deep")
    assert jacobian.gap.status == verdicts.REPRODUCED and jacobian.gap.effect > 0
    assert jacobian.ratio.status == verdicts.INSIDE_NOISE and abs(jacobian.ratio.effect) < 0.05
    assert "the relative change is open" in jacobian.reading()

    diverging = depth_records(lambda norm, depth, seed: wobble[seed] * (
        0.3 * depth ** (0.01 * SEED_NOISE[seed]) if norm == "lns" else 3.0 / depth), loss)  # ratio slopes 1 ± 0.01
    jacobian = next(c for c in depth_verdicts.comparative_verdicts(axis, diverging) if c.measure == "jacobian_deep")
    assert (jacobian.gap.status, jacobian.ratio.status) == (verdicts.REPRODUCED, verdicts.REPRODUCED)
    assert jacobian.ratio.effect == pytest.approx(1.0)  # ln(0.3 / (3 / L)) = ln L + const
    # block influence only in Pre-LN's records: reported, not measurable, with the reason
    for name, record in diverging.items():
        if name.split("-")[1] == "pre":
            record["analyses"]["4"]["block_influence"] = [0.3] * 8
    influence = next(c for c in depth_verdicts.comparative_verdicts(axis, diverging) if c.measure == "bi_deep")
    assert influence.gap.status == verdicts.NOT_MEASURABLE and "LNS's records" in influence.gap.reason

    # a value of 0 or below has no log: the ratio's slope is fitted without that pair, and the report says so
    with_a_zero = depth_records(lambda norm, depth, seed: 0.0 if (norm, depth, seed) == ("pre", 6, 1) else
                                shrinking_in_proportion(norm, depth, seed), loss)
    jacobian = next(c for c in depth_verdicts.comparative_verdicts(axis, with_a_zero) if c.measure == "jacobian_deep")
    assert "leaves out the pairs where a value is 0 or below (L = 6: seed 1)" in jacobian.ratio.reason
    assert "ratio: " in depth_verdicts.comparative_section([jacobian]) and not jacobian.gap.reason
    assert "| not measurable |" in depth_verdicts.comparative_section([influence])

    words, summary = depth_verdicts.regime(axis, diverging, "the held-out novel")
    assert words.startswith("**Depth does not pay here**") and summary["depth_pays"] == {"pre": False, "lns": False}
    assert summary["lowest_at"] == {"pre": 6, "lns": 6}
    words, summary = depth_verdicts.regime(axis, depth_records(lambda *key: 0.1, lambda n, d, s: loss(n, 96 // d, s)),
                                        "the held-out novel")
    assert words.startswith("**Depth pays here**") and summary["lowest_at"] == {"pre": 48, "lns": 48}


@pytest.mark.e2e
@pytest.mark.parametrize("script", ["compare_norms", "depth_sweep", "width_sweep"])
def test_a_study_runs_again_into_a_new_report_folder_over_the_same_runs(script, tmp_path):
    """Issue 46: a report folder moved or deleted, then the study run again over the same runs folder. The second
    invocation reuses the training and redoes the analysis cleanly (it was refused: layer_remove.py found its own
    earlier sweep), and the analysis gives the same numbers. Each study script's first quick run, as a user runs it."""
    from utils import width_sweep

    study = {"compare_norms": compare_norms, "depth_sweep": depth_sweep, "width_sweep": width_sweep}[script]
    runs_dir = tmp_path / "runs"

    def first_spec_into(report):
        args = study.parse_args(["--quick", "--dtype", "float32", "--no-compile", "--out", str(report),
                                 "--runs_dir", str(runs_dir)])
        specs = study.run_specs(args, study.study_arms(args)) if study is compare_norms else study.run_specs(args)
        records, skipped = runs.collect_records(args, specs[:1])
        assert not skipped
        return next(iter(records.values()))

    first = first_spec_into(tmp_path / "a")
    again = first_spec_into(tmp_path / "b")
    assert (first["reused"], again["reused"]) == ("no", "training")
    assert again["analyses"] == first["analyses"] and again["final_eval_loss"] == first["final_eval_loss"]


@pytest.mark.parametrize("script", ["compare_norms", "depth_sweep", "width_sweep"])
def test_every_study_redoes_an_analysis_folder_left_by_an_earlier_invocation(script, tmp_path, monkeypatch):
    """The mechanism of the test above, in process and in the fast tier: the analyses write no files of their own
    (measure_model keeps every measure in memory; layer_remove.py once refused its own earlier sweep), so a second
    invocation analyses every checkpoint again and writes the same steps."""
    from utils import width_sweep

    study = {"compare_norms": compare_norms, "depth_sweep": depth_sweep, "width_sweep": width_sweep}[script]
    args = study.parse_args(["--quick", "--out", str(tmp_path / "report"), "--runs_dir", str(tmp_path / "runs")])
    specs = study.run_specs(args, study.study_arms(args)) if study is compare_norms else study.run_specs(args)
    settings = runs.analysis_settings(args.settings)
    run_dir = tmp_path / "runs" / specs[0].name
    for step in specs[0].analyse_steps:
        (run_dir / f"model_{step}").mkdir(parents=True)

    analysed = []

    def fake_analysis(checkpoint, analysis_settings):
        analysed.append(checkpoint.name)
        return {"checkpoint": checkpoint.name}

    monkeypatch.setattr(analyse, "analyse_checkpoint", fake_analysis)
    command = ["--run_dir", str(run_dir), "--steps", *map(str, specs[0].analyse_steps), "--settings",
               json.dumps(dataclasses.asdict(settings)), "--out_json", str(run_dir / "study_analyses.json")]
    for _ in range(2):
        assert analyse.main(command) == 0
    assert set(json.loads((run_dir / "study_analyses.json").read_text())) == {str(s) for s in specs[0].analyse_steps}
    assert analysed == [f"model_{step}" for step in specs[0].analyse_steps] * 2


def test_a_single_pass_budget_reports_no_overfitting_probe_and_says_why(tmp_path):
    """The Wikipedia budget sees each token at most once: its report does not ask for the Austen corpus's
    overfitting probe, and its set-up explains the budget by the single pass, not by the embedded corpus."""
    args = depth_sweep.parse_args(["--budget", "wikipedia", "--report_only", "--out", str(tmp_path / "report"),
                                   "--runs_dir", str(tmp_path / "runs")])
    text, summary = depth_sweep.probe_section(args, None, tmp_path, "")
    assert text.startswith("Not needed") and summary is None
    assert "one pass" in depth_sweep.budget_reason(args.settings)
    embedded = depth_sweep.parse_args(["--report_only", "--out", str(tmp_path / "e"), "--runs_dir", str(tmp_path)])
    assert depth_sweep.probe_section(embedded, None, tmp_path, "")[0].startswith("Not measured yet")
    assert "2,250 steps" in depth_sweep.budget_reason(embedded.settings)


@pytest.mark.parametrize("script", ["compare_norms", "depth_sweep", "width_sweep"])
def test_every_study_plans_what_is_left_without_training(script, tmp_path, capsys):
    """--plan prints the runs left as JSON and trains nothing: a record saved for the first run moves it from left
    to recorded, and the largest run's disk is that of one of the runs left."""
    from utils import width_sweep

    study = {"compare_norms": compare_norms, "depth_sweep": depth_sweep, "width_sweep": width_sweep}[script]
    argv = ["--quick", "--dtype", "float32", "--no-compile", "--out", str(tmp_path / "report"), "--runs_dir",
            str(tmp_path / "runs"), "--plan"]
    args = study.parse_args(argv)
    specs = runs.as_trained(args, study.run_specs(args, study.study_arms(args)) if study is compare_norms
                            else study.run_specs(args))

    def plan() -> dict:
        assert study.main(argv) == 0
        return json.loads(capsys.readouterr().out)

    before = plan()
    assert before["runs"] == len(specs) and before["recorded"] == 0
    assert before["left"] == [spec.name for spec in specs] and before["recorded_run_seconds"] == []
    assert before["largest_run_bytes"] == max(runs.checkpoint_bytes(spec) for spec in specs)
    assert not any((tmp_path / "runs" / spec.name).exists() for spec in specs)  # (model configs may be written)
    first = specs[0]
    record = dict(version=runs.RECORD_VERSION, arm=first.arm, seed=first.seed, flags=list(first.flags()),
                  analysis_settings=dataclasses.asdict(runs.analysis_settings(args.settings, args.device)),
                  status="finished", last_step=max(first.analyse_steps), train_seconds=60.0, analysis_seconds=4.6,
                  analyses={str(step): {} for step in first.analyse_steps})
    record_store.write(tmp_path / "report" / "runs", first.name, record)
    after = plan()
    assert after["recorded"] == 1 and after["left"] == before["left"][1:] and after["recorded_run_seconds"] == [65]
    argv.append("--fresh")  # every run retrains
    assert plan()["left"] == before["left"]


def _record_pair():
    """A committed record made before block influence, and a retrain of the same run that has it, its numbers off
    in the last digits as another host's kernels leave them."""
    committed = dict(version=1, arm="L6-lns", seed=1, flags=["--seed", "1"], status="finished", last_step=400,
                     tokens_seen=819200, analysis_settings={"max_seq_len": 128}, final_eval_loss=5.5,
                     train_curve=[[1, 9.0258], [3, 9.0267]], train_seconds=180.0,
                     analyses={"400": {"variance": [1.0, 2.5], "angular_next": [0.25, None], "removal_nats": [1e-5]}})
    retrained = json.loads(json.dumps(committed))
    retrained.update(final_eval_loss=5.5 * (1 + 3e-7), train_seconds=412.0, machine="elsewhere")
    retrained["analyses"]["400"].update(variance=[1.0, 2.5 * (1 - 2e-6)], removal_nats=[1e-5 + 5e-7],
                                        block_influence=[0.3, 0.01])
    return committed, retrained


def test_a_backfill_adds_what_the_record_lacks_and_keeps_what_it_has(tmp_path, capsys):
    from utils.study import backfill

    committed, retrained = _record_pair()
    for folder, record in (("into", committed), ("retrained", retrained)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "L6-lns-seed1.json").write_text(json.dumps(record, indent=1) + "\n")
    command = ["--into", str(tmp_path / "into"), "--retrained", str(tmp_path / "retrained")]
    assert backfill.main(command) == 0
    assert not (tmp_path / "into" / "L6-lns-seed1.json").exists()  # rewritten in the current format
    merged = record_store.read(record_store.path_for(tmp_path / "into", "L6-lns-seed1"))
    assert merged["analyses"]["400"]["block_influence"] == [0.3, 0.01]
    assert merged["analyses"]["400"]["variance"] == [1.0, 2.5] and merged["final_eval_loss"] == 5.5
    assert merged["train_seconds"] == 180.0 and "machine" not in merged
    [info] = merged["backfilled"]
    assert info["measures"] == ["block_influence"] and info["machine"] == "elsewhere"
    assert info["values_compared"] == 7  # the eval loss, 2 of the curve, 2 variances, 1 angular, 1 removal cost
    assert info["max_relative_difference"] == pytest.approx(5e-7 / 1.05e-5, rel=1e-3)  # a small value: within atol
    assert info["max_absolute_difference"] == pytest.approx(5e-6, rel=1e-3)
    stored = record_store.path_for(tmp_path / "into", "L6-lns-seed1").read_bytes()
    assert backfill.main(command) == 0  # nothing new
    assert record_store.path_for(tmp_path / "into", "L6-lns-seed1").read_bytes() == stored
    assert "added block_influence" in capsys.readouterr().out
    retrained["analyses"]["400"]["lens_kl"] = [0.5, 0.0]  # a later instrument: a second entry, the first kept
    (tmp_path / "retrained" / "L6-lns-seed1.json").write_text(json.dumps(retrained))
    assert backfill.main(command) == 0
    merged = record_store.read(record_store.path_for(tmp_path / "into", "L6-lns-seed1"))
    assert [entry["measures"] for entry in merged["backfilled"]] == [["block_influence"], ["lens_kl"]]


@pytest.mark.parametrize("change, named", [
    (lambda r: r["analyses"]["400"].update(variance=[1.0, 2.6]), "analyses.400.variance[1]"),
    (lambda r: r["analyses"]["400"].update(removal_nats=[1e-5 + 3e-5]), "analyses.400.removal_nats[0]"),  # > atol
    (lambda r: r["analyses"]["400"].update(variance={"a": 1.0, "b": 2.5}), "analyses.400.variance"),
    (lambda r: r["analyses"]["400"].update(angular_next=[0.25, 0.1]), "analyses.400.angular_next[1]"),
    (lambda r: r["analyses"]["400"].pop("variance"), "analyses.400.variance"),
    (lambda r: r.update(flags=["--seed", "2"]), "flags"),
    (lambda r: r.update(final_eval_loss=float("nan")), "final_eval_loss"),
    (lambda r: r.update(analysis_settings={"max_seq_len": 256}), "analysis_settings"),
])
def test_a_retrain_that_is_not_the_same_run_is_refused_and_nothing_is_written(change, named, tmp_path, capsys):
    """Beside a retrain that agrees (L6-lns-seed1, read first), one that does not (L6-lns-seed2): a one-line error
    naming the second and its value, and neither record written."""
    from utils.study import backfill

    (tmp_path / "into").mkdir()
    (tmp_path / "retrained").mkdir()
    for seed in (1, 2):
        committed, retrained = _record_pair()
        committed["seed"] = retrained["seed"] = seed
        if seed == 2:
            change(retrained)
        (tmp_path / "into" / f"L6-lns-seed{seed}.json").write_text(json.dumps(committed, indent=1) + "\n")
        (tmp_path / "retrained" / f"L6-lns-seed{seed}.json").write_text(json.dumps(retrained))
    before = {path.name: path.read_text() for path in (tmp_path / "into").iterdir()}
    with pytest.raises(SystemExit) as exit_info:
        backfill.main(["--into", str(tmp_path / "into"), "--retrained", str(tmp_path / "retrained")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--retrained: L6-lns-seed2.json" in err and named in err, err
    assert {path.name: path.read_text() for path in (tmp_path / "into").iterdir()} == before


def test_the_regime_judges_each_step_of_depth_where_the_slope_cannot_see_the_middle():
    """Over L = 6, 12, 24 (evenly spaced in ln L) a least-squares slope reads only the end points. Here L = 12 is
    best for both arms: the slope is inside noise, and the steps say that depth pays from 6 to 12 and costs from 12
    to 24, each paired by seed."""
    axis = sweep.Axis("L", "L", "layers L", "depth", (6, 12, 24))
    bowl = {6: 4.50, 12: 4.40, 24: 4.50}
    records = depth_records(lambda *key: 0.1, lambda norm, depth, seed: bowl[depth] + 0.01 * SEED_NOISE[seed] * (
        depth % 5), depths=(6, 12, 24))
    text, summary = depth_verdicts.regime(axis, records, "the held-out novel")
    assert summary["slopes"]["pre"]["status"] == verdicts.INSIDE_NOISE
    steps = {v["claim"]: v["status"] for v in summary["steps"]}
    assert steps == {f"{label}: L={b} reaches a lower eval loss than L={a} (L={b} − L={a})": status
                     for label in ("Pre-LN", "LNS")
                     for (a, b), status in (((6, 12), verdicts.REPRODUCED), ((12, 24), verdicts.OPPOSITE))}
    assert "Each step, paired by seed" in text and text.count("3/3 seeds") == 2
    one_seed = {name: record for name, record in records.items() if record["seed"] == 1}
    assert "steps" not in depth_verdicts.regime(axis, one_seed, "the held-out novel")[1]


def test_a_one_seed_sweep_judges_depth_and_the_gap_on_the_held_out_documents():
    """The Wikipedia pilot has one seed per run: the regime's slopes over seeds are not measurable, so each arm is
    judged between consecutive recorded depths, and LNS against Pre-LN at each depth, on the per-document held-out
    loss the runs' analyses share (a bootstrap over documents, said to hold the documents' noise, not the seed's).
    With several seeds nothing is added (the committed reports stay as they are)."""
    axis = sweep.Axis("L", "L", "layers L", "depth", (6, 12, 24))
    documents = [7.0 + 2.0 * index / 7 for index in range(8)]

    def per_document(norm, depth):  # deeper is better for LNS at every document; Pre-LN gets worse from 12 to 24
        change = {6: 0.0, 12: -0.05, 24: -0.09 if norm == "lns" else +0.03}[depth]
        return [value + change + 0.01 * math.sin(7 * index + depth) - (0.02 if norm == "lns" else 0.0)
                for index, value in enumerate(documents)]

    records = depth_records(lambda *key: 0.1, lambda norm, depth, seed: 4.5, depths=(6, 12, 24), seeds=(1,))
    for name, record in records.items():
        depth, norm = int(name.split("-")[0][1:]), name.split("-")[1]
        record["analyses"]["4"].update(removal_document_nats=per_document(norm, depth),
                                       removal_document_costs=[[0.01] * 8] * 8)
    del records["L6-pre-seed1"]  # an arm compares the depths it has: Pre-LN 12 against 24 only
    text, summary = depth_verdicts.regime(axis, records, "the held-out Wikipedia articles")
    assert text.startswith("**Not judged over seeds**")
    found = {v["claim"]: v for v in summary["documents"]}
    assert list(found) == ["Pre-LN: L=24 reaches a lower held-out loss than L=12 (L=24 − L=12)",
                           "LNS: L=12 reaches a lower held-out loss than L=6 (L=12 − L=6)",
                           "LNS: L=24 reaches a lower held-out loss than L=12 (L=24 − L=12)",
                           "L=12: LNS reaches a lower held-out loss than Pre-LN (LNS − Pre-LN)",
                           "L=24: LNS reaches a lower held-out loss than Pre-LN (LNS − Pre-LN)"]
    assert found["Pre-LN: L=24 reaches a lower held-out loss than L=12 (L=24 − L=12)"]["status"] == verdicts.OPPOSITE
    assert found["LNS: L=24 reaches a lower held-out loss than L=12 (L=24 − L=12)"]["status"] == verdicts.REPRODUCED
    assert all(v["unit"] == "documents" and v["n_pairs"] == 8 for v in found.values())
    assert "the held-out Wikipedia articles" in text and "not the seed's" in text
    # Three seeds, every run with per-document values, and one depth where a single seed finished: the slopes are
    # measurable, so nothing is judged on documents, not even that depth's pair.
    three_seeds = depth_records(lambda *key: 0.1, lambda norm, depth, seed: 4.5 + 0.01 * seed * depth,
                                depths=(6, 12, 24))
    for name, record in three_seeds.items():
        record["analyses"]["4"].update(removal_document_nats=documents, removal_document_costs=[[0.01] * 8] * 8)
    for seed in (2, 3):
        three_seeds[f"L24-pre-seed{seed}"]["status"] = "diverged"
    text, summary = depth_verdicts.regime(axis, three_seeds, "the held-out novel")
    assert summary["slopes"]["lns"]["status"] != verdicts.NOT_MEASURABLE
    assert "documents" not in summary and "held-out documents" not in text


def test_a_reanalysis_backfills_the_records_whose_checkpoints_remain(tmp_path, monkeypatch, capsys):
    """--reanalyse measures each record's analysed checkpoints again (here a stand-in for the analysis adds block
    influence); a record whose run folder lacks a checkpoint is named and left as it is."""
    from utils.study import backfill

    committed, _ = _record_pair()
    committed["analysis_settings"] = dict(max_seq_len=128, stream_tokens=64, jacobian_tokens=2, jacobian_probes=0,
                                          removal_documents=2)
    (tmp_path / "into").mkdir()
    for seed in (1, 2):
        (tmp_path / "into" / f"L6-lns-seed{seed}.json").write_text(json.dumps(dict(committed, seed=seed), indent=1))
    (tmp_path / "runs" / "L6-lns-seed1" / "model_400").mkdir(parents=True)  # seed 2's checkpoints are gone
    measured = []

    def analyse_run(run_dir, steps, settings, log_path, env, analyses_name):
        measured.append((run_dir.name, steps, settings.max_seq_len, env["OMP_NUM_THREADS"]))
        return {"400": dict(committed["analyses"]["400"], block_influence=[0.2, 0.05])}

    monkeypatch.setattr(runs, "analyse_run", analyse_run)
    assert backfill.main(["--into", str(tmp_path / "into"), "--reanalyse", str(tmp_path / "runs")]) == 0
    assert measured == [("L6-lns-seed1", [400], 128, "1")]
    first = record_store.read(record_store.find(tmp_path / "into", "L6-lns-seed1"))
    assert first["analyses"]["400"]["block_influence"] == [0.2, 0.05] and first["final_eval_loss"] == 5.5
    second = record_store.read(record_store.find(tmp_path / "into", "L6-lns-seed2"))
    assert "block_influence" not in second["analyses"]["400"]
    assert "L6-lns-seed2.json: no checkpoints" in capsys.readouterr().err


def test_a_measure_some_runs_lack_says_how_many_runs_it_averages():
    """Part-way through a backfill, or where a seed diverged, the table's mean is over fewer runs than the row has."""
    axis = sweep.Axis("L", "L", "layers L", "depth", (6, 12))
    records = depth_records(lambda *key: 0.1, lambda norm, depth, seed: 4.5, depths=(6, 12))
    records["L6-pre-seed2"]["analyses"]["4"]["block_influence"] = [0.3] * 8
    rows = {tuple(row.split(" | ")[:2]): row for row in sweep.measures_table(axis, records).splitlines()}
    assert "| 0.3000 (1 of 3) |" in rows[("| 6", "Pre-LN")]
    assert "(1 of 3)" not in rows[("| 12", "Pre-LN")] and "| n/a |" in rows[("| 12", "Pre-LN")]


def _replicate_of(original, folder):
    """A copy of a committed report folder: the same study trained again, its runs and summary as written."""
    shutil.copytree(original, folder, ignore=shutil.ignore_patterns("*.png", "*.md"))
    return json.loads((folder / "summary.json").read_text())


def _edit_record(folder, name, edit):
    record = record_store.read(record_store.find(folder / "runs", name))
    edit(record)
    record_store.write(folder / "runs", name, record)


def test_a_replicate_says_which_verdicts_keep_their_status_and_how_far_each_run_moved(tmp_path, capsys):
    from utils.study import replicate

    original = pathlib.Path("docs/depth_sweep_mixed_compile")  # its Pre-LN records alone have BI
    summary = _replicate_of(original, tmp_path / "again")
    moved = summary["comparative"][1]["gap"]  # the angular gap's slope: reproduced in the committed report
    assert moved["status"] == verdicts.REPRODUCED
    moved.update(low=-0.001, status=verdicts.INSIDE_NOISE)
    bi = next(item for item in summary["comparative"] if item["measure"] == "bi_deep")
    assert bi["gap"]["status"] == verdicts.NOT_MEASURABLE  # the committed LNS records predate block influence
    bi["gap"] = dict(moved, claim=bi["gap"]["claim"])  # the replicate's records have it
    summary["predictions"].append(dict(moved, claim="a claim the original does not make"))
    apart = summary["comparative"][0]["ratio"]  # judged over one seed's documents: not compared with seeds
    apart.update(unit="documents", effect=apart["effect"] * 3, status=verdicts.INSIDE_NOISE)
    # its runs folder elsewhere: the settings and each sweep config's path say so, and do not make another study
    summary["settings"].update(out="elsewhere", runs_dir="elsewhere/runs")
    (tmp_path / "again" / "summary.json").write_text(json.dumps(summary))
    for name in summary["runs"]:
        def elsewhere(record):
            at = record["flags"].index("--model_config") + 1
            record["flags"][at] = record["flags"][at].replace("runs/depth_sweep_mixed_compile/", "elsewhere/runs/")
            assert record["flags"][at].startswith("elsewhere/runs/configs/")
        _edit_record(tmp_path / "again", name, elsewhere)
    _edit_record(tmp_path / "again", "L48-pre-seed1", lambda record: record.update(
        final_eval_loss=record["final_eval_loss"] + 0.015))
    _edit_record(tmp_path / "again", "L6-lns-seed3", lambda record: record.update(status="diverged"))

    assert replicate.main([str(original), str(tmp_path / "again")]) == 0
    result = json.loads((tmp_path / "again" / "replication.json").read_text())
    committed = replicate.verdicts_in(json.loads((original / "summary.json").read_text()))
    measured = [v for v in committed.values() if v["status"] != verdicts.NOT_MEASURABLE]
    # the copy's runs are the original's: every verdict is compared, but the one judged in other units
    assert len(result["rows"]) == len(measured) - 1
    assert [item["where"] for item in result["judged_apart"]] == [
        f"comparative / {summary['comparative'][0]['measure']} / ratio"]
    assert [row["where"] for row in result["rows"] if not row["same_status"]] == ["comparative / angular_deep / gap"]
    assert all(row["intervals_overlap"] for row in result["rows"])
    assert [(item["where"], item["measured_in"]) for item in result["measured_in_one"]] == \
        [("comparative / bi_deep / gap", "replicate")]
    assert [item["verdict"]["claim"] for item in result["only_in_replicate"]] == ["a claim the original does not make"]
    by_run = {row["run"]: row for row in result["runs"]}
    assert set(by_run) == set(summary["runs"])  # the summary's runs: the overfit probe's record is not one of them
    assert by_run["L48-pre-seed1"]["eval_loss"][1] - by_run["L48-pre-seed1"]["eval_loss"][0] == pytest.approx(0.015)
    assert by_run["L6-lns-seed3"]["status"] == ["finished", "diverged"] and "compared" not in by_run["L6-lns-seed3"]
    unchanged = [row for name, row in by_run.items() if name not in ("L48-pre-seed1", "L6-lns-seed3")]
    assert all(row["compared"] >= 5 and row["relative"] == 0 == row["absolute"] for row in unchanged)
    text = (tmp_path / "again" / "replication.md").read_text()
    n = len(measured) - 1
    assert f"**{n - 1} of the {n} verdicts that both measured keep their status**" in text
    assert "## Verdicts judged in different units" in text
    assert "comparative / angular_deep / gap): reproduced → inside noise" in text
    assert "| L6-lns-seed3 | finished → diverged |" in text
    assert f"{n - 1} of the {n} verdicts both measured keep their status" in capsys.readouterr().out


def test_a_replicate_counts_a_verdict_its_summary_holds_twice_once(tmp_path):
    """compare_norms' summary holds LNS − Pre-LN's eval loss among the verdicts and again per arm: one claim."""
    from utils.study import replicate

    _replicate_of(pathlib.Path("docs/study_long"), tmp_path / "again")
    assert replicate.main(["docs/study_long", str(tmp_path / "again")]) == 0
    rows = json.loads((tmp_path / "again" / "replication.json").read_text())["rows"]
    claims = [row["claim"] for row in rows]
    assert claims.count("LNS reaches a lower eval loss than Pre-LN") == 1 and len(claims) == len(set(claims))
    assert all(row["same_status"] for row in rows)


def test_a_replicate_compares_a_budgets_own_summary(tmp_path):
    from utils.study import replicate

    assert replicate.main(["docs/depth_sweep_mixed_compile", "docs/depth_sweep_mixed_compile", "--suffix", "_rivals",
                           "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "replication_rivals.json").read_text())
    assert result["rows"] and all(row["same_status"] for row in result["rows"])
    assert any(row["run"].startswith("L48-bhyt") for row in result["runs"])


def test_a_replicate_of_another_study_is_refused_in_one_line(tmp_path, capsys):
    from utils.study import replicate

    summary = _replicate_of(pathlib.Path("docs/depth_sweep"), tmp_path / "other")
    summary["settings"]["steps"] = 800
    (tmp_path / "other" / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(SystemExit) as stopped:
        replicate.main(["docs/depth_sweep", str(tmp_path / "other")])
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "is not the same study" in error[0] and "setting steps: 400 against 800" in error[0]
    assert not (tmp_path / "other" / "replication.md").exists()
    summary["settings"]["steps"] = 400  # the same settings, but one run trained in another precision
    (tmp_path / "other" / "summary.json").write_text(json.dumps(summary))
    _edit_record(tmp_path / "other", "L6-pre-seed2",
                 lambda record: record["flags"].__setitem__(record["flags"].index("float32"), "mixed"))
    with pytest.raises(SystemExit):
        replicate.main(["docs/depth_sweep", str(tmp_path / "other")])
    assert "run L6-pre-seed2's flags: --dtype float32 against --dtype mixed" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        replicate.main(["docs/depth_sweep", str(tmp_path / "absent")])
    error = capsys.readouterr().err
    assert "replicate: no report in" in error and "summary.json is missing" in error
    record_path = record_store.find(tmp_path / "other" / "runs", "L6-pre-seed2")
    record_path.write_bytes(record_path.read_bytes()[:100])  # a damaged record: one line naming it, no traceback
    with pytest.raises(SystemExit):
        replicate.main(["docs/depth_sweep", str(tmp_path / "other")])
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and f"replicate: {record_path} is not readable JSON" in error[0]


def test_a_seed_without_a_slope_is_a_sweep_part_way_through_not_a_diverged_run():
    verdict = sweep.slope_verdict("falls", -1, {1: None, 2: -0.1, 3: -0.2})
    assert verdict.n_pairs == 2 and "diverged" not in verdict.reason  # judged on the two seeds that have a slope
    assert verdict.reason.endswith("no slope for seed 1: fewer than two of the swept values measured")
    assert sweep.slope_verdict("falls", -1, {1: -0.3, 2: -0.1, 3: -0.2}).reason == ""
    one = sweep.slope_verdict("falls", -1, {1: -0.1, 2: None})
    assert one.status == "not measurable" and "zero" not in one.reason  # no stand-in arm named as a run
    assert one.reason.startswith("only 1 seed with a slope; an interval over seeds needs at least 2")


def test_the_default_depth_sweep_trains_seed_by_seed_in_its_depths_order(tmp_path):
    args = depth_sweep.parse_args(["--runs_dir", str(tmp_path / "runs")])
    order = [(spec.seed, spec.arm) for spec in depth_sweep.run_specs(args)]
    assert order == [(seed, f"L{depth}-{norm}") for seed in args.settings["seeds"]
                     for depth in args.settings["depths"] for norm in ("pre", "lns")]
