"""Every instrument on one checkpoint: the analysis subprocess of a study's job (`runs.run_job`).

The analyses are the repository's own tools, called through their command lines: utils/variance_analysis.py,
utils/angular_analysis.py (with the logit lens), utils/jacobian_analysis.py and layer_remove.py --sweep on the
held-out text, all inside the trained context length. Internal: `python -m utils.study.analyse --run_dir DIR
--steps N [N ...] --settings JSON --out_json PATH`, from the repository root.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np

from peft_pretraining.run_folder import write_json_atomic
from utils.study.runs import DEFAULT_DATASET, AnalysisSettings


def heldout_text_flags(heldout: str) -> tuple[list[str], list[str]]:
    """The analyses' held-out text: (flags of the residual-stream tools, flags of layer_remove.py)."""
    if heldout == DEFAULT_DATASET:
        return ["--dataset", "embedded"], []
    from peft_pretraining.wikipedia_corpus import corpus_paths

    validation = str(corpus_paths()[1])
    return ["--text_file", validation], ["--task_text_file", validation]


def _tool(main, argv: list[str], log) -> None:
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        main(argv)


def norm_gains(checkpoint: Path) -> dict:
    """Mean gain of each decoder layer's norms (both of them, or however many the placement has) and the final norm."""
    from safetensors.torch import load_file

    weights = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        weights.update(load_file(str(shard)))
    per_layer: dict[int, list[float]] = {}
    max_dev = 0.0
    for name, tensor in weights.items():
        parts = name.split(".")
        if len(parts) >= 5 and parts[1] == "layers" and "norm" in parts[3] and parts[-1] == "weight":
            per_layer.setdefault(int(parts[2]), []).append(float(tensor.float().mean()))
            max_dev = max(max_dev, float((tensor.float() - 1).abs().max()))
    final = weights.get("model.norm.weight")
    # max_abs_dev_from_one = 0 means every block-norm gain is still exactly 1.0 (the pure-bf16 trap).
    return dict(per_layer=[float(np.mean(per_layer[i])) for i in sorted(per_layer)],
                final=None if final is None else float(final.float().mean()), max_abs_dev_from_one=max_dev)


def analyse_checkpoint(checkpoint: Path, settings: AnalysisSettings, out_dir: Path, log) -> dict:
    """All instruments on one checkpoint, each through its own command line; returns the per-layer numbers."""
    import layer_remove
    from utils import angular_analysis, jacobian_analysis, variance_analysis

    stream_text, removal_text = heldout_text_flags(settings.heldout)
    text = [*stream_text, "--max_seq_len", str(settings.max_seq_len), "--device", settings.device,
            "--dtype", "float32"]
    _tool(variance_analysis.main, ["--model_paths", str(checkpoint), "--labels", checkpoint.name, *text,
                                   "--num_tokens", str(settings.stream_tokens), "--output_dir",
                                   str(out_dir / "variance")], log)
    variance = json.loads((out_dir / "variance" / "residual_variance.json").read_text())["models"][0]
    _tool(angular_analysis.main, ["--model_path", str(checkpoint), *text, "--num_tokens", str(settings.stream_tokens),
                                  "--logit_lens", "--output_dir", str(out_dir / "angular")], log)
    angular = json.loads((out_dir / "angular" / "angular_distance.json").read_text())["angular_distance"]
    influence = json.loads((out_dir / "angular" / "block_influence.json").read_text())["block_influence"]
    lens = json.loads((out_dir / "angular" / "logit_lens.json").read_text())
    _tool(jacobian_analysis.main, ["--model_path", str(checkpoint), *text, "--num_tokens",
                                   str(settings.jacobian_tokens), "--probes", str(settings.jacobian_probes),
                                   "--output_dir", str(out_dir / "jacobian")], log)
    with (out_dir / "jacobian" / "jacobian.csv").open() as handle:  # columns fixed by the tool's contract
        jacobian = sorted(csv.DictReader(handle), key=lambda row: int(row["layer"]))
    _tool(layer_remove.main, ["--model_path", str(checkpoint), "--sweep", "--tasks", "heldout_novel_ppl",
                              *removal_text, "--task_max_documents", str(settings.removal_documents),
                              "--device", settings.device,
                              "--dtype", "float32", "--max_seq_len", str(settings.max_seq_len), "--per_document",
                              "--output_dir", str(out_dir / "removal")], log)
    rows = json.loads((out_dir / "removal" / "layer_removal.json").read_text())["rows"]
    baseline = next(r for r in rows if r["removed_layer"] is None)
    removed = sorted((r for r in rows if r["removed_layer"] is not None), key=lambda r: r["removed_layer"])
    return dict(
        variance=[float(v) for v in variance["variance"]],
        angular_next=[None if v is None else float(v) for v in angular[0]],
        angular=angular,
        block_influence=[float(v) for v in influence],
        # The logit lens after layers 1..L: KL from the final next-token distribution, top-1 agreement with it
        lens_kl=[float(v) for v in lens["lens_kl"]],
        lens_top1_agreement=[float(v) for v in lens["lens_top1_agreement"]],
        prediction_depth_mean=float(lens["prediction_depth_mean"]),
        jacobian_rel_identity_dev=[float(row["rel_identity_dev"]) for row in jacobian],
        jacobian_mean_diag=[float(row["mean_diag"]) if row["mean_diag"] else None for row in jacobian],
        removal_metric=baseline["metric"], removal_baseline=float(baseline["value"]),
        # The loss rise in nats per word: ln(ppl without the layer / ppl with it).
        removal_nats=[math.log(r["value"] / baseline["value"]) for r in removed],
        # Per held-out document (for intervals over documents when an arm has one seed): the intact model's loss in
        # nats per word, and per removed layer the rise in it.
        removal_document_nats=[-loglik / words for loglik, words in baseline["documents"]],
        removal_document_costs=[[(base_loglik - loglik) / words
                                 for (base_loglik, words), (loglik, _) in zip(baseline["documents"], r["documents"])]
                                for r in removed],
        norm_gains=norm_gains(checkpoint),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m utils.study.analyse")  # internal: called by run_job
    parser.add_argument("--run_dir", required=True)
    parser.add_argument("--steps", type=int, nargs="+", required=True)
    parser.add_argument("--settings", required=True)
    parser.add_argument("--out_json", required=True)
    args = parser.parse_args(argv)
    settings = AnalysisSettings(**json.loads(args.settings))
    run_dir = Path(args.run_dir)
    results = {}
    for step in args.steps:
        print(f"analysing {run_dir / f'model_{step}'}", flush=True)
        # The tools' output folders are scratch that the record replaces: an earlier analysis of this checkpoint
        # (a report folder moved or deleted, then the study run again) is redone, not refused by layer_remove.py.
        out_dir = run_dir / "analysis" / f"step_{step}"
        shutil.rmtree(out_dir, ignore_errors=True)
        results[str(step)] = analyse_checkpoint(run_dir / f"model_{step}", settings, out_dir, sys.stdout)
    write_json_atomic(args.out_json, results, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
