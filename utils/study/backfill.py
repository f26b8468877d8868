"""Measures a committed record predates, added from a re-analysis of its checkpoints or a retrain of the same run.

A record made before an instrument joined the study (block influence, the logit lens, per-document removal costs)
lacks its values. Where the run's checkpoints are still in its runs folder, --reanalyse measures them again with
today's instruments and the record's analysis settings. Where they are gone, retraining the run with the same flags
into a scratch report folder (the study's `--out`) makes a record that has them (--retrained). Either way this adds
the missing values to the committed record and keeps every value it already holds, so no committed number changes.
The other record is used only where it is the same run: its flags, analysis settings and status must be the
record's, and every number both hold (the curves, the eval loss, every analysis) must agree:
|a - b| <= rtol * max(|a|, |b|) + atol. Another host's float kernels may round differently: an AVX2 host retraining
the float32 depth sweep that an AVX-512 host made agreed to about 1e-5 relative, and to about 1e-5 in absolute
terms on values near zero such as a removal cost, a small difference of two log-perplexities (docs/study.md).

    python -m utils.study.backfill --into docs/depth_sweep/runs --retrained runs/depth_sweep_bi_report/runs
    python -m utils.study.backfill --into docs/depth_sweep_wikipedia/runs --reanalyse runs/depth_sweep_wikipedia

Each record that gains values also gains an entry in `backfilled`: the measures added, the machine that measured
them, and the largest relative and absolute differences over the values compared. Records with nothing to add, or
without checkpoints or a retrain, are left as they are. One that disagrees is a one-line error naming the record and
the value, and nothing is written.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from peft_pretraining.cli import OneLineErrorParser
from utils.study import records as record_store
from utils.study import runs
from utils.study.host import machine_description

# What a run is: these must be equal for a retrain to stand in for the record.
IDENTITY = ("version", "arm", "seed", "flags", "status", "last_step", "tokens_seen")
# The numbers both records hold, compared within the tolerance (analyses: every measure the record has).
COMPARED = ("final_eval_loss", "eval_curve", "train_curve", "norm_gain_curve", "analyses")


class Disagreement(ValueError):
    def __init__(self, where: str, committed, other, detail: str = ""):
        super().__init__(f"{where}: the record's {committed!r}, the other's {other!r}{detail}")


@dataclasses.dataclass
class Agreement:
    compared: int = 0  # numbers compared
    relative: float = 0.0  # the largest relative difference
    absolute: float = 0.0  # the largest absolute difference

    def add(self, other: Agreement) -> Agreement:
        return Agreement(self.compared + other.compared, max(self.relative, other.relative),
                         max(self.absolute, other.absolute))


def compare(committed, retrained, where: str, rtol: float, atol: float) -> Agreement:
    """How closely the retrain's values match those `committed` holds; Disagreement beyond the tolerance, or where
    the two differ in shape or in a value that is not a float."""
    if isinstance(committed, (dict, list)):
        if isinstance(committed, dict) and isinstance(retrained, dict):
            pairs = [(value, retrained.get(key), f"{where}.{key}" if where else key)
                     for key, value in committed.items()]
        elif isinstance(committed, list) and isinstance(retrained, list) and len(committed) == len(retrained):
            pairs = [(a, b, f"{where}[{index}]") for index, (a, b) in enumerate(zip(committed, retrained))]
        else:
            raise Disagreement(where, committed, retrained)
        total = Agreement()
        for a, b, inner in pairs:
            total = total.add(compare(a, b, inner, rtol, atol))
        return total
    if isinstance(committed, float) and isinstance(retrained, (int, float)) and not isinstance(retrained, bool):
        if not (math.isfinite(committed) and math.isfinite(retrained)):  # NaN or inf agrees only with itself
            if not (committed == retrained or math.isnan(committed) and math.isnan(retrained)):
                raise Disagreement(where, committed, retrained)
            return Agreement(1)
        absolute = abs(committed - retrained)
        if absolute > rtol * max(abs(committed), abs(retrained)) + atol:
            raise Disagreement(where, committed, retrained, f" (over --rtol {rtol:g} with --atol {atol:g})")
        relative = 0.0 if absolute == 0 else absolute / max(abs(committed), abs(retrained))
        return Agreement(1, relative, absolute)
    if committed != retrained:
        raise Disagreement(where, committed, retrained)
    return Agreement()


def backfilled(committed: dict, retrained: dict, rtol: float, atol: float) -> dict | None:
    """The committed record with the analyses' measures it lacks taken from the retrain; None when it lacks none."""
    for key in IDENTITY:
        if committed.get(key) != retrained.get(key):
            raise Disagreement(key, committed.get(key), retrained.get(key))
    if runs.recorded_settings(committed) != runs.recorded_settings(retrained):
        raise Disagreement("analysis_settings", committed.get("analysis_settings"), retrained.get("analysis_settings"))
    agreement = compare({key: committed[key] for key in COMPARED if key in committed}, retrained, "", rtol, atol)
    record = json.loads(json.dumps(committed))
    added: set[str] = set()
    for step, analysis in record["analyses"].items():
        missing = {key: value for key, value in retrained["analyses"][step].items() if key not in analysis}
        analysis.update(missing)
        added |= set(missing)
    if not added:
        return None
    record["backfilled"] = [*committed.get("backfilled", []), dict(
        measures=sorted(added), machine=retrained.get("machine"), values_compared=agreement.compared,
        max_relative_difference=agreement.relative, max_absolute_difference=agreement.absolute)]
    return record


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="python -m utils.study.backfill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--into", required=True, help="the committed records' folder (<report>/runs)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--retrained", help="the retrain's records' folder (<scratch report>/runs)")
    source.add_argument("--reanalyse", help="the runs folder that still holds the records' runs and their checkpoints "
                                            "(each record's run in <folder>/<arm>-seed<seed>)")
    parser.add_argument("--rtol", type=float, default=1e-4,
                        help="relative part of the difference allowed between a number of the record and the retrain's")
    parser.add_argument("--atol", type=float, default=1e-5,
                        help="absolute part of it: |a - b| <= rtol * max(|a|, |b|) + atol. The default is a tenth of "
                             "the last digit the reports print of a removal cost, which is a small difference of two "
                             "large log-likelihoods and so carries their rounding")
    return parser


def reanalysed(record: dict, run_dir: Path) -> dict:
    """The record with its analyses measured again on the run's checkpoints, with its own analysis settings."""
    settings = runs.AnalysisSettings(**runs.recorded_settings(record))
    analyses = runs.analyse_run(run_dir, [int(step) for step in record["analyses"]], settings,
                                run_dir / "reanalysis.log", runs.job_env(), "reanalysis.json")
    return dict(record, analyses=analyses, machine=machine_description(settings.device))


def candidates(args, into: Path) -> list[tuple[Path, dict]]:
    """(committed record's path, the same run's record to take measures from), for every record that has one."""
    found = []
    if args.retrained:
        for path in record_store.paths_in(Path(args.retrained)):
            committed = record_store.find(into, record_store.name_of(path))
            if committed is not None:
                found.append((committed, record_store.read(path)))
        return found
    from tqdm.auto import tqdm

    for path in tqdm(record_store.paths_in(into), desc="re-analysing", unit="run", dynamic_ncols=True):
        record, run_dir = record_store.read(path), Path(args.reanalyse) / record_store.name_of(path)
        if record.get("analyses") and all((run_dir / f"model_{step}").is_dir() for step in record["analyses"]):
            found.append((path, reanalysed(record, run_dir)))
        else:
            print(f"{path.name}: no checkpoints in {run_dir} for its analysed steps; left as it is", file=sys.stderr)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    into = Path(args.into)
    for flag, folder in (("--into", into), ("--retrained", args.retrained), ("--reanalyse", args.reanalyse)):
        if folder is not None and not Path(folder).is_dir():
            parser.error(f"{flag}: no folder {folder}")
    for flag, value in (("--rtol", args.rtol), ("--atol", args.atol)):
        if not value >= 0:
            parser.error(f"{flag} must be zero or positive, got {value}")
    source = "--retrained" if args.retrained else "--reanalyse"
    updates = {}
    for path, other in candidates(args, into):
        try:
            record = backfilled(record_store.read(path), other, args.rtol, args.atol)
        except Disagreement as error:
            parser.error(f"{source}: {path.name} is not the same run as its record: {error}")
        if record is not None:
            updates[path] = record
    for path, record in updates.items():  # only once every candidate has been checked
        record_store.write(path.parent, record_store.name_of(path), record)
        info = record["backfilled"][-1]
        print(f"{path}: added {', '.join(info['measures'])} ({info['values_compared']} values agree, at most "
              f"{info['max_relative_difference']:.1e} relative and {info['max_absolute_difference']:.1e} absolute)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
