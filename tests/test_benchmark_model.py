import json

import pytest

from utils.bench import benchmark_model


@pytest.mark.e2e
def test_quick_model_benchmark_writes_every_variant(tmp_path):
    benchmark_model.main(["--quick", "--sections", "model", "--before", "HEAD", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "benchmark.json").read_text())
    variants = {(row["model"], row["dtype"], row["mode"]) for row in report["model"]}
    assert variants == {(m, d, "eager") for m in benchmark_model.MODELS for d in benchmark_model.DTYPES}
    assert all(row["tokens_per_s_min"] <= row["tokens_per_s_median"] <= row["tokens_per_s_max"]
               for row in report["model"])
    assert "llama_tiny.json float32 eager: ours/hf" in report["ratios"]
    assert (tmp_path / "model.csv").read_text().startswith("config,")


@pytest.mark.parametrize("flag, value", [("--shapes", "configs/llama_tiny.json:2"), ("--before", "no-such-rev"),
                                         ("--repeats", "0"), ("--attention_shapes", "2:2:16")])
def test_bad_flags_exit_2(flag, value, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        benchmark_model.main([flag, value, "--out", str(tmp_path)])
    assert exit_info.value.code == 2 and flag in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.e2e
def test_trainer_runs_with_the_study_flags(tmp_path, monkeypatch):
    """The trainer section times what the study runs: every flag of the study's Pre-LN run (packing, dtype, batch,
    optimizer...) except the budget flags the benchmark sets itself, eager and compiled."""
    commands = []
    real_run = benchmark_model.subprocess.run

    def recording_run(cmd, *args, **kwargs):
        if cmd[:2] != [benchmark_model.sys.executable, "torchrun_main.py"]:
            return real_run(cmd, *args, **kwargs)  # git archive
        commands.append(cmd)
        save_dir = benchmark_model.Path(cmd[cmd.index("--save_dir") + 1])
        save_dir.mkdir(parents=True)
        (save_dir / "metrics.jsonl").write_text("".join(json.dumps({"tokens_per_s": 100.0 + i}) + "\n"
                                                        for i in range(4)))
        return benchmark_model.subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(benchmark_model.subprocess, "run", recording_run)
    benchmark_model.main(["--sections", "trainer", "--before", "HEAD", "--trainer_repeats", "1", "--trainer_steps",
                          "4", "--trainer_warmup", "1", "--trainer_variants", "eager", "compile", "--out",
                          str(tmp_path)])
    study = benchmark_model.study_trainer_flags()
    assert "--packing" in study and "--compile" in study and len(commands) == 4  # before and after, both modes
    assert benchmark_model.flag_value(study, "--dtype") == "mixed"  # the study's defaults (issue 15)
    for cmd, variant in zip(commands, ["eager", "compile"] * 2):
        flags = cmd[2:]
        assert ("--compile" in flags) == (variant == "compile") and flags.count("--compile") <= 1
        assert [f for f in benchmark_model.without_flags(flags, benchmark_model.BENCHMARK_FLAGS) if f != "--compile"] \
            == [f for f in benchmark_model.without_flags(study, benchmark_model.BENCHMARK_FLAGS) if f != "--compile"]
        assert benchmark_model.flag_value(flags, "--dtype") == benchmark_model.flag_value(study, "--dtype")
        assert benchmark_model.flag_value(flags, "--model_config") == benchmark_model.STUDY_CONFIG
    report = json.loads((tmp_path / "benchmark.json").read_text())
    rows = report["trainer"]
    assert [row["tokens_per_s_median"] for row in rows] == [102.0] * 4  # median of 101, 102, 103
    assert [row["as_that_study_runs"] for row in rows] == [False, True] * 2  # the study compiles
    assert report["ratios"]["trainer as its study flags run it: after compile / before compile"] == 1.0


@pytest.mark.e2e
def test_quick_trainer_benchmark_runs_the_real_trainer(tmp_path):
    benchmark_model.main(["--quick", "--sections", "trainer", "--before", "HEAD", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "benchmark.json").read_text())["trainer"]
    assert {row["tree"] for row in rows} == {"before", "after"}
    assert all(row["tokens_per_s_median"] > 0 for row in rows)


@pytest.mark.e2e
def test_quick_layout_benchmark_runs_both_layouts(tmp_path):
    benchmark_model.main(["--quick", "--sections", "layout", "--layout_cores", "2", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "benchmark.json").read_text())
    assert [(row["processes"], row["threads"]) for row in report["layout"]] == [(2, 1), (1, 2)]
    assert {row["variant"] for row in report["layout"]} == {"eager"}  # --quick keeps to eager; the study compiles
    assert all(row["total_tokens_per_s_median"] > 0 for row in report["layout"])
    assert any(key.startswith("layout: ") for key in report["ratios"])
    assert (tmp_path / "layout.csv").read_text().startswith("layout,")


@pytest.mark.e2e
def test_before_flags_own_runs_each_tree_with_its_own_study(tmp_path, monkeypatch):
    """With --before_flags own the before tree trains the study as it ran then: a447e53's study used bf16 autocast
    ("mixed"), padded batches and eager mode; today's uses mixed, packing and --compile."""
    if benchmark_model.subprocess.run(["git", "rev-parse", "--verify", "--quiet", "a447e53^{commit}"],
                                      cwd=benchmark_model.REPO, capture_output=True).returncode != 0:
        pytest.skip("a447e53 is not in this clone's history")
    commands = []
    real_run = benchmark_model.subprocess.run

    def recording_run(cmd, *args, **kwargs):
        if cmd[:2] != [benchmark_model.sys.executable, "torchrun_main.py"]:
            return real_run(cmd, *args, **kwargs)
        commands.append((kwargs["cwd"], cmd))
        save_dir = benchmark_model.Path(cmd[cmd.index("--save_dir") + 1])
        save_dir.mkdir(parents=True)
        (save_dir / "metrics.jsonl").write_text(json.dumps({"tokens_per_s": 10.0}) + "\n" * 3)
        return benchmark_model.subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(benchmark_model.subprocess, "run", recording_run)
    benchmark_model.main(["--sections", "trainer", "--before", "a447e53", "--before_flags", "own",
                          "--trainer_repeats", "1", "--trainer_steps", "2", "--trainer_warmup", "0",
                          "--trainer_variants", "eager", "--out", str(tmp_path)])
    by_tree = {"after" if cwd == benchmark_model.REPO else "before": cmd for cwd, cmd in commands}
    assert benchmark_model.flag_value(by_tree["before"], "--dtype") == "mixed"
    assert "--packing" not in by_tree["before"] and "--packing" in by_tree["after"]
    assert benchmark_model.flag_value(by_tree["after"], "--dtype") == "mixed"
    rows = {row["tree"]: row for row in json.loads((tmp_path / "benchmark.json").read_text())["trainer"]}
    assert rows["before"]["study_flags_of"] == "a447e53" and rows["before"]["dtype"] == "mixed"
    assert rows["before"]["as_that_study_runs"] and not rows["after"]["as_that_study_runs"]  # eager; now compiled
    assert rows["after"]["study_flags_of"] == "working tree" and rows["after"]["packing"] is True


def test_ratios_pair_the_interleaved_repeats():
    """Repeat i of every variant ran under the same load, so ours/hf is also given repeat by repeat: here the
    ratio of medians (2.0) and the median of the paired ratios (1.0) disagree, as a load spike makes them do."""
    def row(model, per_repeat):
        return {"config": "c.json", "dtype": "float32", "model": model, "mode": "compiled",
                "tokens_per_s_median": sorted(per_repeat)[1], "per_repeat": per_repeat}

    out = benchmark_model.ratios([row("ours", [100.0, 200.0, 400.0]), row("hf", [100.0, 400.0, 100.0])], [])
    assert out["c.json float32 compiled: ours/hf"] == 2.0
    assert out["c.json float32 compiled: ours/hf, median of per-repeat ratios (min-max)"] == "1.000 (0.500-4.000)"


def test_fastest_against_fastest_looks_across_dtypes_and_hf_attention():
    """The target compares our fastest configuration with HF's fastest compiled one, whichever dtype and HF attention
    implementation that is; HF's eager-mode rows are not candidates."""
    def row(model, dtype, mode, rate):
        return {"config": "c.json", "dtype": dtype, "model": model, "mode": mode, "tokens_per_s_median": rate,
                "per_repeat": [rate]}

    rows = [row("ours", "float32", "compiled", 300.0), row("ours", "mixed", "compiled", 600.0),
            row("hf", "mixed", "compiled", 350.0), row("hf_eager_attn", "mixed", "compiled", 400.0),
            row("hf", "float32", "compiled", 500.0), row("hf", "mixed", "eager", 900.0)]
    out = benchmark_model.ratios(rows, [])
    assert out["c.json any dtype: ours fastest (mixed compiled) / hf fastest compiled (hf float32)"] == 1.2
    assert out["c.json mixed: ours fastest (mixed compiled) / hf fastest compiled (hf_eager_attn mixed)"] == 1.5
    assert out["c.json float32: ours fastest (float32 compiled) / hf fastest compiled (hf float32)"] == 0.6


@pytest.mark.e2e
def test_quick_attention_section_times_every_kernel(tmp_path):
    benchmark_model.main(["--quick", "--sections", "attention", "--dtypes", "float32", "mixed", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "benchmark.json").read_text())["attention"]
    assert {(row["dtype"], row["kernel"]) for row in rows} == {
        (d, k) for d in ("float32", "mixed") for k in benchmark_model.ATTENTION_KERNELS}
    assert all(0 < row["ms_min"] <= row["ms_median"] <= row["ms_max"] for row in rows)
    assert (tmp_path / "attention.csv").read_text().startswith("shape,")


@pytest.mark.e2e
def test_quick_profile_lists_the_costliest_ops_of_each_variant(tmp_path):
    benchmark_model.main(["--quick", "--sections", "profile", "--dtypes", "float32", "--profile_top", "5",
                          "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "benchmark.json").read_text())["profile"]
    assert len(rows) == 5 and {row["mode"] for row in rows} == {"eager"}
    shares = [row["share"] for row in rows]
    assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1.0
    assert "aten::mm" in {row["op"] for row in rows}  # a training step's matmuls are among its costliest ops
    assert (tmp_path / "profile.csv").read_text().startswith("config,")


@pytest.mark.e2e
def test_compiled_profile_names_inductors_kernels(tmp_path):
    benchmark_model.main(["--sections", "profile", "--shapes", "configs/llama_tiny.json:2:32", "--dtypes", "mixed",
                          "--modes", "compiled", "--steps", "1", "--profile_top", "40", "--out", str(tmp_path)])
    ops = [row["op"] for row in json.loads((tmp_path / "benchmark.json").read_text())["profile"]]
    assert any("cpp_fused" in op for op in ops), ops  # not one opaque compiled graph


@pytest.mark.parametrize("cpuinfo, model_name, bf16_hardware", [
    ("processor\t: 0\nmodel name\t: Some x86 CPU\nflags\t\t: fpu sse2 avx512_bf16 amx_bf16\n", "Some x86 CPU",
     "avx512_bf16, amx_bf16"),
    # aarch64
    ("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd bf16\nCPU implementer\t: 0x41\n", None, "none"),
])
def test_machine_header_reads_cpuinfo_of_any_architecture(tmp_path, monkeypatch, cpuinfo, model_name, bf16_hardware):
    from pathlib import Path

    from utils.study import host

    fake = tmp_path / "cpuinfo"
    fake.write_text(cpuinfo)
    monkeypatch.setattr(host, "Path", lambda path: fake if str(path) == "/proc/cpuinfo" else Path(path))
    assert host.cpuinfo_field("model name") == model_name
    assert f"bf16 hardware: {bf16_hardware}," in benchmark_model.machine()


@pytest.mark.e2e
def test_the_sweep_lanes_benchmark_writes_a_row_per_variant(tmp_path):
    """utils/bench/benchmark_sweep_lanes.py --quick, eager only: both layouts train and are timed."""
    import json

    from utils.bench import benchmark_sweep_lanes

    benchmark_sweep_lanes.main(["--quick", "--modes", "eager", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "lanes.json").read_text())["rows"]
    assert [row["layout"] for row in rows] == ["2 x 1", "1 x 2"]
    assert all(row["total_tokens_per_s"] > 0 for row in rows)
    assert (tmp_path / "lanes.csv").read_text().startswith("hidden,layers,mode,layout,total_tokens_per_s")
