"""measure_model: every instrument on one loaded model. Its measures equal each instrument run alone; the study's
record of a checkpoint made through it equals the record made through the tools' command lines and their files (the
analyses before measure_model); lm-eval's environment report, skipped in the sweep, changes no number."""
from __future__ import annotations

import contextlib
import csv
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.analysis_helpers import heldout_documents, repo_tokenizer, save_with_tokenizer, tiny_ours, write_jsonl
from utils.instruments import measure, model_io, removal_sweep
from utils.instruments.angular import accumulate
from utils.instruments.jacobian import measure_jacobians, sample_tokens
from utils.instruments.logit_lens import LogitLensAccumulator
from utils.instruments.norm_gains import checkpoint_norm_gains, norm_gains
from utils.instruments.variance import residual_statistics
from utils.study import analyse
from utils.study.runs import AnalysisSettings

SETTINGS = measure.MeasureSettings(max_seq_len=16, stream_tokens=48, jacobian_tokens=2, jacobian_probes=0,
                                   removal_documents=2, batch_size=2)


def perturbed(model, seed: int = 0):
    """Norm gains away from 1, so that the norm-gain measures are not all 1."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
    return model


def test_each_measure_is_its_instrument_alone(monkeypatch):
    model, tokenizer = perturbed(tiny_ours("lns", num_layers=2)), repo_tokenizer()
    monkeypatch.setattr(measure, "heldout_removal_sweep", lambda *args: [])  # lm-eval: the record test below
    measured = measure.measure_model(model, tokenizer, SETTINGS)

    source = ("file", model_io.EMBEDDED_HELDOUT_TEXT)

    def batches():
        return model_io.token_batches(tokenizer, source, SETTINGS.max_seq_len, SETTINGS.stream_tokens, 2)

    statistics, num_tokens = residual_statistics(model, batches())
    lens = LogitLensAccumulator.of_model(model, 2)
    angular = accumulate(model, batches(), also=[lens])
    assert measured["num_tokens"] == num_tokens == angular.num_tokens == SETTINGS.stream_tokens
    np.testing.assert_array_equal(measured["variance"], statistics["variance"])
    np.testing.assert_array_equal(measured["rms"], statistics["rms"])
    np.testing.assert_array_equal(measured["angular"], angular.matrix())
    np.testing.assert_array_equal(measured["block_influence"], angular.block_influence())
    assert {key: measured[key] for key in lens.result()} == lens.result()
    assert len(measured["update_ratio"]) == 2
    windows = model_io.token_windows(tokenizer, model_io.iter_documents(source), SETTINGS.max_seq_len, sys.maxsize)
    jacobian = measure_jacobians(model, sample_tokens(windows, 2), probes=0, heatmap=False)
    assert measured["jacobian"] == jacobian.rows and measured["jacobian_tokens"] == 2
    assert measured["norm_gains"] == norm_gains(model.state_dict()) and measured["removal"] == []
    assert measured["norm_gains"]["max_abs_dev_from_one"] > 0


def test_norm_gains_of_a_loaded_model_are_those_of_its_checkpoint(tmp_path):
    checkpoint = save_with_tokenizer(perturbed(tiny_ours("post_pre", num_layers=3, post_num=1)), tmp_path / "model")
    loaded = model_io.load_model(str(checkpoint), dtype=torch.float32)
    gains = norm_gains(loaded.state_dict())
    assert gains == checkpoint_norm_gains(checkpoint) and len(gains["per_layer"]) == 3


def record_through_the_tools(checkpoint: Path, settings: AnalysisSettings, out_dir: Path) -> dict:
    """A checkpoint's record as the study made it before measure_model: each tool's command line (in process), its
    files read back (embedded held-out text)."""
    import layer_remove
    from utils import angular_analysis, jacobian_analysis, variance_analysis

    text = ["--dataset", "embedded", "--max_seq_len", str(settings.max_seq_len), "--device", "cpu", "--dtype",
            "float32"]
    variance_analysis.main(["--model_paths", str(checkpoint), *text, "--num_tokens", str(settings.stream_tokens),
                            "--output_dir", str(out_dir / "variance")])
    angular_analysis.main(["--model_path", str(checkpoint), *text, "--num_tokens", str(settings.stream_tokens),
                           "--logit_lens", "--output_dir", str(out_dir / "angular")])
    jacobian_analysis.main(["--model_path", str(checkpoint), *text, "--num_tokens", str(settings.jacobian_tokens),
                            "--probes", str(settings.jacobian_probes), "--output_dir", str(out_dir / "jacobian")])
    layer_remove.main(["--model_path", str(checkpoint), "--sweep", "--tasks", "heldout_novel_ppl",
                       "--task_max_documents", str(settings.removal_documents), "--device", "cpu", "--dtype",
                       "float32", "--max_seq_len", str(settings.max_seq_len), "--per_document",
                       "--output_dir", str(out_dir / "removal")])
    variance = json.loads((out_dir / "variance" / "residual_variance.json").read_text())["models"][0]
    angular = json.loads((out_dir / "angular" / "angular_distance.json").read_text())["angular_distance"]
    influence = json.loads((out_dir / "angular" / "block_influence.json").read_text())["block_influence"]
    lens = json.loads((out_dir / "angular" / "logit_lens.json").read_text())
    with (out_dir / "jacobian" / "jacobian.csv").open() as handle:
        jacobian = sorted(csv.DictReader(handle), key=lambda row: int(row["layer"]))
    rows = json.loads((out_dir / "removal" / "layer_removal.json").read_text())["rows"]
    baseline = next(r for r in rows if r["removed_layer"] is None)
    removed = sorted((r for r in rows if r["removed_layer"] is not None), key=lambda r: r["removed_layer"])
    return dict(
        variance=[float(v) for v in variance["variance"]],
        angular_next=[None if v is None else float(v) for v in angular[0]], angular=angular,
        block_influence=[float(v) for v in influence], lens_kl=[float(v) for v in lens["lens_kl"]],
        lens_top1_agreement=[float(v) for v in lens["lens_top1_agreement"]],
        prediction_depth_mean=float(lens["prediction_depth_mean"]),
        jacobian_rel_identity_dev=[float(row["rel_identity_dev"]) for row in jacobian],
        jacobian_mean_diag=[float(row["mean_diag"]) if row["mean_diag"] else None for row in jacobian],
        removal_metric=baseline["metric"], removal_baseline=float(baseline["value"]),
        removal_nats=[math.log(r["value"] / baseline["value"]) for r in removed],
        removal_document_nats=[-loglik / words for loglik, words in baseline["documents"]],
        removal_document_costs=[[(base_loglik - loglik) / words
                                 for (base_loglik, words), (loglik, _) in zip(baseline["documents"], r["documents"])]
                                for r in removed],
        norm_gains=checkpoint_norm_gains(checkpoint),
    )


@pytest.mark.e2e
@pytest.mark.parametrize("probes", [0, 4])
def test_a_checkpoints_record_is_the_one_the_tools_made(tmp_path, probes):
    """Bit for bit: the same numbers, lists and keys, in exact Jacobians and with probes."""
    checkpoint = save_with_tokenizer(perturbed(tiny_ours("lns", num_layers=3), seed=probes), tmp_path / "model_4")
    settings = AnalysisSettings(max_seq_len=32, stream_tokens=160, jacobian_tokens=3, jacobian_probes=probes,
                                removal_documents=2)
    before = record_through_the_tools(checkpoint, settings, tmp_path / "tools")
    after = analyse.analyse_checkpoint(checkpoint, settings)
    assert list(after) == list(before) and json.dumps(after) == json.dumps(before)
    assert after == before


def test_the_sweep_skips_lm_evals_environment_report_and_changes_no_number(tmp_path, monkeypatch):
    from peft_pretraining.data import lm_eval_tasks

    model, tokenizer = tiny_ours("pre", num_layers=2), repo_tokenizer()
    text = write_jsonl(tmp_path / "heldout.jsonl", [document[:200] for document in heldout_documents(2)])
    task = lm_eval_tasks.HELDOUT_PERPLEXITY_TASK
    include = lm_eval_tasks.build_local_tasks([task], tmp_path / "tasks", {task: {"text_file": str(text)}})
    manager = lm_eval_tasks.task_manager(include, include_defaults=False)
    reports = []
    import torch.utils.collect_env

    monkeypatch.setattr(torch.utils.collect_env, "get_pretty_env_info", lambda: reports.append(1) or "env")

    def scores():
        return removal_sweep.evaluate(model, tokenizer, [task], manager, batch_size=2, limit=None, bootstrap_iters=0,
                                      max_length=32, per_document=True)

    skipped = scores()
    assert reports == []
    monkeypatch.setattr(removal_sweep, "without_environment_report", contextlib.nullcontext)
    assert scores() == skipped and reports == [1]  # the report, made as before, was all the skip left out
