"""The GPU lease rehearsed on the CPU: `bash utils/gpu/gpu_lease.sh rehearse OUT` runs both prepared device calls
through the same script lines (utils/gpu/gpu_check.py --rehearse: every stage's commands at tiny sizes; the width
sweep's call at the quick budget's tiny widths), so that a lease never fails for a reason the CPU could have caught."""
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from utils.gpu import gpu_check

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.e2e
def test_the_gpu_lease_rehearses_every_stage_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(["bash", "utils/gpu/gpu_lease.sh", "rehearse", str(out)], cwd=REPO, capture_output=True,
                          text=True, env=env, timeout=1200, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((out / "check" / "gpu_check.json").read_text())
    stages = report["stages"]
    recipes = {f"recipe_{size}_{norm}" for size in gpu_check.RECIPE_UPDATES for norm in ("pre", "lns")}
    recipes |= {"recipe_130m_pre_b128", "recipe_130m_pre_b256"}
    assert set(stages) == {"env", "fixtures", *recipes, *gpu_check.STAGES[1:], "width_sweep_plan"}
    assert report["rehearsal"] and not report["targets"]
    assert all(stage["ok"] for stage in stages.values()), {k: v for k, v in stages.items() if not v["ok"]}
    assert all(stages[name]["timed_updates"] == 1 for name in recipes)  # the trainer's rows reached trainer_rates
    assert stages["fsdp_resume"]["stopped_exit"] == 5 and stages["fsdp_resume"]["resumed_exit"] == 0
    assert [row["batch"] for row in stages["micro_batch"]["rows"]] == [2, 4, 8]  # 64, 128, 256 over 32
    losses = stages["losses"]
    assert losses["choice"] in ("standard", "chunked") and losses["skipped"].startswith("liger: ")
    assert {row["loss"] for row in losses["rows"]} == {"standard", "chunked"}
    plan = stages["width_sweep_plan"]
    assert plan["runs"] == 18 and plan["left"] == 18 - plan["recorded"] and 1 <= plan["jobs"] <= 6
    assert "seconds per stage" in proc.stdout
    with tarfile.open(out / "width_sweep" / "width_sweep_gpu.tgz") as tarball:  # the records, as a GPU call's
        records = [name for name in tarball.getnames() if "/runs/" in name and name.endswith(".json.gz")]
    assert len(records) == 4, records  # hidden 16 and 32, Pre-LN and LNS, seed 1


def test_the_width_sweep_plan_reads_the_flags_of_the_lease_call():
    """gpu_check's width_sweep_plan counts the records that utils/gpu/gpu_lease.sh width_sweep would reuse: a record
    matches only the same flags (its model config lives under --runs_dir), so the two must agree."""
    script = (REPO / "utils/gpu/gpu_lease.sh").read_text()
    line = next(line for line in script.splitlines() if line.strip().startswith("sweep=("))
    assert line.strip().removeprefix("sweep=(").removesuffix(")").split() == gpu_check.WIDTH_SWEEP


def test_a_benchmark_row_that_fails_is_recorded_and_the_others_still_measure(tmp_path, monkeypatch):
    """A loss that fails on the GPU (liger under compile, say) must not cost the stage its other rows."""
    from utils.bench import benchmark_gpu

    def measure(config_path, *, loss, **settings):
        if loss == "chunked":
            raise RuntimeError("a kernel\nthat fails")
        return {"config": Path(config_path).name, "loss": loss, "tokens_per_s": 1, "model_tflops_per_s": 0.0,
                "first_loss": 9.0}

    monkeypatch.setattr(benchmark_gpu, "measure", measure)
    monkeypatch.setattr(benchmark_gpu, "fp32_loss", lambda *args, **kwargs: 9.0)
    rows_path = tmp_path / "rows.json"
    benchmark_gpu.main(["--device", "cpu", "--configs", "configs/llama_tiny.json", "--batch_size", "1",
                        "--modes", "eager", "--dtypes", "bfloat16", "--losses", "standard", "chunked",
                        "--json", str(rows_path)])
    rows = json.loads(rows_path.read_text())
    assert [row["loss"] for row in rows] == ["standard", "chunked"]
    assert "error" not in rows[0] and rows[0]["fp32_loss"] == 9.0
    assert rows[1]["error"] == "RuntimeError: a kernel that fails"
    assert gpu_check.fastest(rows) == rows[0]


def test_the_loss_choice_is_the_fastest_within_tolerance_of_fp32():
    rows = [{"loss": "standard", "tokens_per_s": 10, "first_loss": 10.40, "fp32_loss": 10.38},
            {"loss": "chunked", "tokens_per_s": 12, "first_loss": 10.41, "fp32_loss": 10.38},
            {"loss": "liger", "tokens_per_s": 15, "first_loss": 10.90, "fp32_loss": 10.38},  # 5% off: not the same
            {"loss": "liger", "error": "out of memory"}]
    assert gpu_check.loss_choice(rows) == "chunked"
    assert gpu_check.loss_choice(rows[2:]) is None
