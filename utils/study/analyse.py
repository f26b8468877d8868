"""Every instrument on one checkpoint: the analysis subprocess of a study's job (`runs.run_job`).

Each checkpoint is loaded once, in float32 on the study's analysis device, and measured by
utils/instruments/measure.measure_model on the held-out text, inside the trained context length; its measures become
the record's analysis of that step (analysis_record). Internal: `python -m utils.study.analyse --run_dir DIR --steps
N [N ...] --settings JSON --out_json PATH`, from the repository root.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from peft_pretraining.training.run_folder import write_json_atomic
from utils.instruments import model_io
from utils.instruments.measure import MeasureSettings, measure_model
from utils.study.runs import DEFAULT_DATASET, AnalysisSettings


def heldout_text_file(heldout: str) -> str | None:
    """The analyses' held-out text: None for the embedded novel, else the study dataset's validation split."""
    if heldout == DEFAULT_DATASET:
        return None
    from peft_pretraining.data.wikipedia_corpus import corpus_paths

    return str(corpus_paths()[1])


def measure_settings(settings: AnalysisSettings) -> MeasureSettings:
    return MeasureSettings(max_seq_len=settings.max_seq_len, stream_tokens=settings.stream_tokens,
                           jacobian_tokens=settings.jacobian_tokens, jacobian_probes=settings.jacobian_probes,
                           removal_documents=settings.removal_documents, text_file=heldout_text_file(settings.heldout))


def eight_digits(value: float) -> float:
    """The Jacobian measures as records have always held them: the 8 significant digits of jacobian.csv, which the
    analyses once read back, so that a record made now equals one made before."""
    return float(f"{value:.8g}")


def analysis_record(measured: dict) -> dict:
    """The per-layer numbers a record keeps of one checkpoint, from measure_model's measures."""
    rows = measured["removal"]
    baseline = next(r for r in rows if r["removed_layer"] is None)
    removed = sorted((r for r in rows if r["removed_layer"] is not None), key=lambda r: r["removed_layer"])
    angular = [[None if math.isnan(v) else float(v) for v in row] for row in measured["angular"]]
    jacobian = sorted(measured["jacobian"], key=lambda row: row["layer"])
    return dict(
        variance=[float(v) for v in measured["variance"]],
        angular_next=angular[0],
        angular=angular,
        block_influence=[float(v) for v in measured["block_influence"]],
        # The logit lens after layers 1..L: KL from the final next-token distribution, top-1 agreement with it
        lens_kl=[float(v) for v in measured["lens_kl"]],
        lens_top1_agreement=[float(v) for v in measured["lens_top1_agreement"]],
        prediction_depth_mean=float(measured["prediction_depth_mean"]),
        jacobian_rel_identity_dev=[eight_digits(row["rel_identity_dev"]) for row in jacobian],
        jacobian_mean_diag=[None if row["mean_diag"] is None else eight_digits(row["mean_diag"]) for row in jacobian],
        removal_metric=baseline["metric"], removal_baseline=float(baseline["value"]),
        # The loss rise in nats per word: ln(ppl without the layer / ppl with it).
        removal_nats=[math.log(r["value"] / baseline["value"]) for r in removed],
        # Per held-out document (for intervals over documents when an arm has one seed): the intact model's loss in
        # nats per word, and per removed layer the rise in it.
        removal_document_nats=[-loglik / words for loglik, words in baseline["documents"]],
        removal_document_costs=[[(base_loglik - loglik) / words
                                 for (base_loglik, words), (loglik, _) in zip(baseline["documents"], r["documents"])]
                                for r in removed],
        norm_gains=measured["norm_gains"],
    )


def analyse_checkpoint(checkpoint: Path, settings: AnalysisSettings) -> dict:
    """Every instrument on one checkpoint, loaded once; returns the record's per-layer numbers."""
    device = model_io.resolve_device(settings.device)
    model, tokenizer = model_io.load_model_and_tokenizer(str(checkpoint), torch.float32, device)
    return analysis_record(measure_model(model, tokenizer, measure_settings(settings), desc=f"{checkpoint.name}: "))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m utils.study.analyse")  # internal: called by run_job
    parser.add_argument("--run_dir", required=True)
    parser.add_argument("--steps", type=int, nargs="+", required=True)
    parser.add_argument("--settings", required=True, help="the AnalysisSettings as JSON")
    parser.add_argument("--out_json", required=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = AnalysisSettings(**json.loads(args.settings))
    run_dir = Path(args.run_dir)
    results = {}
    for step in args.steps:
        print(f"analysing {run_dir / f'model_{step}'}", flush=True)
        results[str(step)] = analyse_checkpoint(run_dir / f"model_{step}", settings)
    write_json_atomic(args.out_json, results, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
