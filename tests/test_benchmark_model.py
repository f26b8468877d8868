import json

import pytest

from utils import benchmark_model


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
                                         ("--repeats", "0")])
def test_bad_flags_exit_2(flag, value, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        benchmark_model.main([flag, value, "--out", str(tmp_path)])
    assert exit_info.value.code == 2 and flag in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
