"""The width sweep and the studies' --device: what changes with width, the device in every record's identity, the
one-line refusal of a GPU that is not there, the report's answer on crafted records, and --quick end to end."""
import csv
import dataclasses
import json
import shutil
import subprocess
import sys

import pytest

from tests.analysis_helpers import read_records
from utils import compare_norms, depth_sweep, width_sweep
from utils.study import cli, runs, sweep, verdicts

STUDIES = [compare_norms, depth_sweep, width_sweep]


def specs_of(study, args):
    return (compare_norms.run_specs(args, compare_norms.study_arms(args)) if study is compare_norms
            else study.run_specs(args))


def flag(spec, name):
    flags = list(spec.flags() if isinstance(spec, runs.RunSpec) else spec)
    return flags[flags.index(name) + 1]


def config_of(flags) -> dict:
    return json.loads((runs.REPO / flag(flags, "--model_config")).read_text())  # absolute paths stay absolute


def test_width_is_the_only_thing_that_changes(tmp_path):
    args = width_sweep.parse_args(["--runs_dir", str(tmp_path / "runs")])
    specs = width_sweep.run_specs(args)
    assert len(specs) == 18 and args.settings["widths"] == (64, 128, 256)
    assert [spec.arm for spec in specs[:6]] == ["L24-W64-pre", "L24-W64-lns"] * 3  # width-major: whole widths first
    configs, others = {}, set()
    for spec in specs:
        flags = list(spec.flags())
        configs[int(spec.arm.split("-")[1][1:])] = config_of(flags)
        for name in ("--model_config", "--norm_type", "--seed"):
            flags[flags.index(name) + 1] = "*"
        others.add(tuple(flags))
    assert len(others) == 1  # apart from the config, norm and seed, every run has the same flags
    for width, config in configs.items():
        assert config["hidden_size"] == width and config["hidden_size"] // config["num_attention_heads"] == 16
        assert config["num_hidden_layers"] == 24 and config["intermediate_size"] * 4 == width * 11
        assert config["vocab_size"] == 8192
    assert flag(specs[0], "--lr") == "1e-3" and flag(specs[0], "--num_training_steps") == "400"
    deep = width_sweep.parse_args(["--depth", "48", "--runs_dir", str(tmp_path / "runs")])
    assert deep.settings["report_suffix"] == "_L48" and deep.out == args.out  # records beside the 24-layer ones
    assert width_sweep.run_specs(deep)[0].arm == "L48-W64-pre"
    gpu = width_sweep.parse_args(["--budget", "gpu", "--runs_dir", str(tmp_path / "runs")])
    assert gpu.settings["widths"] == (64, 128, 256, 512, 768, 1024) and gpu.settings["report_suffix"] == "_gpu"
    shared = {spec.name: spec for spec in width_sweep.run_specs(gpu)}
    assert all(shared[spec.name] == spec for spec in specs)  # the gpu budget reuses the default's records


@pytest.mark.parametrize("study", STUDIES)
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_device_reaches_every_run_its_analyses_and_its_folders(study, device, tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(cli, "cuda_available", lambda: True)  # no GPU needed: nothing trains
    monkeypatch.setattr(runs, "run_jobs", lambda specs, settings, *rest: (ran.append((specs, settings)),
                                                                                ({}, []))[1])
    args = study.parse_args(["--quick", "--device", device, "--runs_dir", str(tmp_path / "runs")])
    runs.collect_records(args, specs_of(study, args))
    (specs, settings), = ran
    assert specs and {flag(spec, "--device") for spec in specs} == {device} and settings.device == device
    assert args.out.parent.name.endswith("_cuda") == (device == "cuda")  # runs/<study>_quick..._cuda/report
    default = study.parse_args(["--device", device])  # parsing writes nothing
    assert default.out.name.endswith("_cuda") == (device == "cuda")  # a GPU sweep never writes over the CPU records
    assert default.runs_dir.name.endswith("_cuda") == (device == "cuda")


def test_a_record_is_reused_only_on_the_device_it_was_made_on():
    """The device is part of a record's identity, as the dtype is; a record made before the device was recorded
    was made on the CPU, and still stands for a CPU run."""
    cpu_settings = runs.AnalysisSettings(64, 10, 2, 0, 2)
    cuda_settings = dataclasses.replace(cpu_settings, device="cuda")
    assert cpu_settings.device == "cpu"
    cpu = runs.RunSpec("pre", 1, ("--lr", "1e-3", "--device", "cpu"), (2,))
    cuda = runs.RunSpec("pre", 1, ("--lr", "1e-3", "--device", "cuda"), (2,))
    old = dict(version=runs.RECORD_VERSION, flags=cpu.flags(), last_step=2, analyses={"2": {}},
               analysis_settings={k: v for k, v in dataclasses.asdict(cpu_settings).items() if k != "device"})
    assert runs.record_matches(old, cpu, cpu_settings) and runs.record_device(old) == "cpu"
    assert not runs.record_matches(old, cuda, cuda_settings)
    assert not runs.record_matches(old, cpu, cuda_settings)  # CPU training, GPU analyses: another record
    gpu = dict(old, flags=cuda.flags(), analysis_settings=dataclasses.asdict(cuda_settings), device="cuda")
    assert runs.record_matches(gpu, cuda, cuda_settings) and runs.record_device(gpu) == "cuda"
    assert not runs.record_matches(gpu, cpu, cpu_settings)
    assert runs.record_device(dict(old, flags=["--lr", "1e-3"])) == "cpu"


@pytest.mark.parametrize("study", STUDIES)
def test_device_cuda_without_cuda_is_one_line_and_exit_2_before_any_work(study, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "cuda_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        study.parse_args(["--device", "cuda", "--out", str(tmp_path / "report"), "--runs_dir", str(tmp_path / "runs")])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "--device cuda" in error
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("study", STUDIES)
def test_a_gpu_studys_report_is_written_on_a_machine_without_cuda(study, tmp_path, monkeypatch):
    """--report_only trains nothing: a GPU sweep's committed records are reported anywhere."""
    monkeypatch.setattr(cli, "cuda_available", lambda: False)
    args = study.parse_args(["--device", "cuda", "--report_only", "--out", str(tmp_path / "report"),
                             "--runs_dir", str(tmp_path / "runs")])
    assert args.device == "cuda"


@pytest.mark.parametrize("study", STUDIES)
def test_a_study_without_lm_eval_stops_in_one_line_before_training(study, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval.tasks", None)  # as on a machine where lm-eval does not import
    with pytest.raises(SystemExit) as exit_info:
        study.parse_args(["--quick", "--out", str(tmp_path / "report"), "--runs_dir", str(tmp_path / "runs")])
    error = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(error.splitlines()) == 1 and "lm-eval" in error, error
    assert not list(tmp_path.iterdir())
    study.parse_args(["--quick", "--report_only", "--out", str(tmp_path / "report")])  # a report needs no lm-eval


@pytest.mark.e2e
def test_width_sweep_device_cuda_without_cuda_from_the_command_line(tmp_path):
    if cli.cuda_available():
        pytest.skip("this machine has a GPU")
    result = subprocess.run([sys.executable, "utils/width_sweep.py", "--device", "cuda", "--out",
                             str(tmp_path / "report"), "--runs_dir", str(tmp_path / "runs")],
                            cwd=runs.REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and not result.stdout
    assert len(result.stderr.strip().splitlines()) == 1 and "--device cuda" in result.stderr
    assert not list(tmp_path.iterdir())


def crafted_records(identity_gap: dict[int, float], widths=(64, 128, 256), seeds=(1, 2, 3)) -> dict:
    """Finished runs whose deep ‖J − I‖/√d is 0.1 for Pre-LN and 0.1 + identity_gap[width] (+ a little seed
    noise, growing with the width so that the seeds' slopes differ too) for LNS; every other measure crafted alike."""
    records = {}
    for width in widths:
        for seed in seeds:
            noise = 0.001 * (seed - 2) ** 2 * width / 64
            for norm, deep in (("pre", 0.1), ("lns", 0.1 + identity_gap[width] + noise)):
                analysis = dict(variance=[1.0 + k for k in range(9)], angular_next=[0.1] * 8,
                                jacobian_rel_identity_dev=[0.5] * 4 + [deep] * 4, removal_nats=[0.01] * 8,
                                norm_gains=dict(per_layer=[1.0] * 8, final=1.0, max_abs_dev_from_one=0.0))
                arm = f"L24-W{width}-{norm}"
                records[f"{arm}-seed{seed}"] = dict(arm=arm, seed=seed, status="finished", final_eval_loss=5.0,
                                                    eval_curve=[[4, 5.0 - 0.01 * seed]], analyses={"4": analysis},
                                                    flags=["--device", "cpu"])
    return records


@pytest.mark.parametrize("gaps, answer", [
    ({64: -0.04, 128: -0.02, 256: -0.01}, "**shrinks**, but LNS's deep blocks stay closer"),
    ({64: -0.04, 128: -0.0, 256: 0.03}, "**reverses**"),
    ({64: -0.02, 128: -0.02, 256: -0.02}, "**stays**"),
    ({64: -0.01, 128: -0.02, 256: -0.04}, "**grows**"),
])
def test_the_report_answers_whether_the_identity_gap_survives_width(gaps, answer, tmp_path):
    args = width_sweep.parse_args(["--runs_dir", str(tmp_path / "runs")])
    axis = width_sweep.width_axis(args)
    records = crafted_records(gaps)
    at_width = width_sweep.width_verdicts(axis, records)
    slopes = width_sweep.gap_slope_verdicts(axis, records)
    text = width_sweep.identity_answer(axis, at_width, slopes[3], width_sweep.identity_ratio_verdict(axis, records))
    assert answer in text and "at d = 64" in text and "at d = 256" in text
    identity = at_width[64][3]
    assert identity.effect == pytest.approx(gaps[64] + 2 / 3 * 0.001) and identity.n_pairs == 3
    if answer == "**stays**":
        assert slopes[3].status == verdicts.INSIDE_NOISE
    partial = {name: r for name, r in records.items() if "W64" in name}  # one width: no trend to read
    assert width_sweep.identity_answer(axis, width_sweep.width_verdicts(axis, partial),
                                       width_sweep.gap_slope_verdicts(axis, partial)[3],
                                       width_sweep.identity_ratio_verdict(axis, partial)).startswith("Not answerable")


def test_the_identity_answer_names_why_a_slope_over_enough_widths_is_not_measurable(tmp_path):
    """Three widths are measured, but the seeds' slopes agree exactly: the answer says that, not "too few widths"."""
    axis = width_sweep.width_axis(width_sweep.parse_args(["--runs_dir", str(tmp_path / "runs")]))
    records = crafted_records({64: -0.01, 128: -0.02, 256: -0.04})
    equal_slopes = sweep.slope_verdict("identity gap slope", +1, {1: -0.01, 2: -0.01, 3: -0.01})
    text = width_sweep.identity_answer(axis, width_sweep.width_verdicts(axis, records), equal_slopes,
                                       width_sweep.identity_ratio_verdict(axis, records))
    assert text.startswith("Not answerable:") and "agree exactly" in text and "so far" not in text


@pytest.mark.e2e
@pytest.mark.e2e
def test_width_sweep_quick_end_to_end_then_reuses_every_record(tmp_path, monkeypatch):
    """Float32 and eager, as the depth sweep's test: compilation would cost more than the runs."""
    out, runs = tmp_path / "report", tmp_path / "runs"
    argv = ["--quick", "--dtype", "float32", "--no-compile", "--out", str(out), "--runs_dir", str(runs)]
    assert width_sweep.main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["runs"]) == 4 and not summary["missing"]  # 2 widths x 2 norms x 1 seed
    report = (out / "report.md").read_text()
    assert "## Does LNS's deep-block identity gap survive width?" in report and "one learning rate" in report
    for name in ("identity_gap_vs_width.png", "loss_gap_vs_width.png", "measures_vs_width.png",
                 "dynamics_W16_L4.png", "dynamics_W32_L4.png"):
        assert (out / name).stat().st_size > 1000
    rows = list(csv.DictReader((out / "measures.csv").open()))
    assert [(row["width"], row["norm"]) for row in rows] == [("16", "pre"), ("16", "lns"), ("32", "pre"),
                                                             ("32", "lns")]
    assert {row["device"] for row in rows} == {"cpu"} and all(float(row["jacobian_deep"]) > 0 for row in rows)
    record = read_records(out)["L4-W32-lns-seed1"]
    assert record["device"] == "cpu" and record["analysis_settings"]["device"] == "cpu"
    assert "--device" in record["flags"] and record["flags"][record["flags"].index("--device") + 1] == "cpu"
    config = config_of(record["flags"])
    assert config["hidden_size"] == 32 and config["num_attention_heads"] == 4  # head dim 8 in the quick budget
    assert len(record["analyses"][max(record["analyses"], key=int)]["jacobian_rel_identity_dev"]) == 4
    # A second invocation, with the runs folder gone, reuses every record and trains nothing.
    shutil.rmtree(runs)
    assert width_sweep.main(argv) == 0
    assert not (runs / "logs").exists() and "reused 4 records" in (out / "report.md").read_text()
    # The CPU records do not stand in for GPU runs: a GPU report in the same folder finds none of them.
    monkeypatch.setattr(cli, "cuda_available", lambda: True)
    written = (out / "summary.json").read_bytes()
    with pytest.raises(SystemExit) as exit_info:
        width_sweep.main([*argv, "--device", "cuda", "--report_only"])
    assert exit_info.value.code == 2 and (out / "summary.json").read_bytes() == written
