"""Learning rates chosen on text the verdicts never read (issue 79).

A rate chosen on the eval tokens that then judge the arms makes the best-rate verdicts optimistic. Here each arm's
rate is chosen on the *selection text*: Wikipedia validation rows 5,120 to 6,143 (packed windows of the run's
length, file order, about 130k target tokens). The eval set reads the first 131,072 target tokens (about 1,030
rows) and the analyses the first articles, so no verdict reads a selection token.

    python -m utils.study.rate_choice evaluate docs/depth_sweep_wikipedia_2400_lr0.004 \\
        --runs_dir runs/depth_sweep_wikipedia_2400_lr0.004     # adds the selection loss to each finished record
    python -m utils.study.rate_choice report docs/depth_sweep_wikipedia_2400_lr0.001 docs/...lr0.002_avx2 ...

`evaluate` loads each finished run's final checkpoint (kept on the CPU), measures its loss on the selection text
and stores it in the run's record as `selection` (rows, tokens, loss); a record that has it is left alone.
`report` reads one budget's folders at several rates and, per arm and depth, names the rate with the lowest
selection loss (mean over the seeds every rate has), marking a best rate at the edge of the grid. Writes
rate_choice.md and .json in --out.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tqdm import tqdm

from peft_pretraining.cli import OneLineErrorParser
from utils.study import lr_grid
from utils.study import records as record_store
from utils.study.results_table import rate_text
from utils.study.runs import REPO

FIRST_ROW, ROWS = 5_120, 1_024
DEFAULT_OUT = REPO / "docs/depth_sweep_wikipedia_2400_rate_choice"


def selection_loss(checkpoint: Path, max_length: int) -> dict:
    """The loss of a checkpoint on the selection text, token-weighted, in float32 on the CPU."""
    import torch

    from peft_pretraining.data.dataloader import iter_validation_row_batches
    from peft_pretraining.data.wikipedia_corpus import corpus_paths
    from peft_pretraining.training.evaluation import evaluate
    from utils.instruments import model_io

    model, tokenizer = model_io.load_model_and_tokenizer(str(checkpoint), torch.float32, "cpu")
    batches = iter_validation_row_batches(dataset="wikipedia", dataset_path=str(corpus_paths()[0]),
                                          tokenizer=tokenizer, max_length=max_length, packing=True, batch_size=16,
                                          first_row=FIRST_ROW, rows=ROWS)
    result = evaluate(model, batches, device="cpu", eval_tokens=ROWS * (max_length - 1), show_progress=False)
    return dict(first_row=FIRST_ROW, rows=ROWS, tokens=result["eval_tokens"], loss=result["eval_loss"])


def evaluate_folder(folder: Path, runs_dir: Path, arms: list[str] | None = None) -> list[str]:
    """Adds `selection` to every finished record of the folder (of the norm types `arms`, default all) that lacks
    it; returns what it did, a line a run. SystemExit naming the run where its final checkpoint is gone."""
    done = []
    for path in tqdm(record_store.paths_in(folder / "runs"), desc="selection text", unit="run"):
        record = record_store.read(path)
        name = record_store.name_of(path)
        if arms and record_store.fields(record).norm not in arms:
            continue
        if record.get("status") != "finished" or "selection" in record:
            done.append(f"{name}: {'kept' if 'selection' in record else 'not finished, skipped'}")
            continue
        checkpoint = runs_dir / name / f"model_{record['last_step']}"
        if not checkpoint.is_dir():
            raise SystemExit(f"--runs_dir: {checkpoint} is missing; the selection loss needs the run's final "
                             "checkpoint (train it again with the study's command, which keeps it on the CPU)")
        record["selection"] = selection_loss(checkpoint, record_store.fields(record).length)
        record_store.write(folder / "runs", name, record)
        done.append(f"{name}: {record['selection']['loss']:.4f}")
    return done


def choose(folders: list[Path]) -> dict:
    """{arm: {depth: {rates: {rate: mean selection loss}, best, at_edge, seeds}}} over the seeds every rate has.
    ValueError, naming the file, for a record of another budget (beyond the rate, the arm and the seed)."""
    losses, budget, first = {}, None, None
    for folder in folders:
        for path in record_store.paths_in(folder / "runs"):
            record = record_store.read(path)
            match = lr_grid.ARM.fullmatch(record.get("arm", ""))
            if match is None or "selection" not in record:
                continue
            if budget is None:
                budget, first = lr_grid.budget_of(record), path
            elif lr_grid.budget_of(record) != budget:
                raise ValueError(f"{path}: trained or analysed unlike {first} (beyond the rate, the arm and the "
                                 "seed): the folders are not one budget's grid")
            losses.setdefault(match[2], {}).setdefault(int(match[1]), {}).setdefault(
                record_store.fields(record).rate, {})[record["seed"]] = record["selection"]["loss"]
    chosen = {}
    for arm, by_depth in sorted(losses.items()):
        for depth, by_rate in sorted(by_depth.items()):
            seeds = sorted(set.intersection(*(set(per_seed) for per_seed in by_rate.values())))
            if not seeds:
                continue
            means = {rate: sum(by_rate[rate][s] for s in seeds) / len(seeds) for rate in sorted(by_rate)}
            best = min(means, key=means.get)
            chosen.setdefault(arm, {})[depth] = dict(rates=means, best=best, seeds=seeds,
                                                     at_edge=len(means) < 3 or best in (min(means), max(means)))
    return chosen


def report_lines(chosen: dict, argv: list[str]) -> list[str]:
    rates = sorted({rate for by_depth in chosen.values() for c in by_depth.values() for rate in c["rates"]})
    lines = ["# Each arm's learning rate, chosen on text the verdicts never read", "",
             f"Generated by `python -m utils.study.rate_choice {' '.join(argv)}`. The selection loss is the final "
             f"checkpoint's loss on Wikipedia validation rows {FIRST_ROW:,}–{FIRST_ROW + ROWS - 1:,} (the eval "
             "set and the analyses read the first rows only). Mean over the seeds every rate has; the best is bold, "
             "and a best at the edge of the rates tried is marked: the optimum may lie beyond the grid.", "",
             "| arm | L | seeds | " + " | ".join(f"lr {rate_text(r)}" for r in rates) + " | best |",
             "|---|---|---|" + "---|" * (len(rates) + 1)]
    for arm, by_depth in chosen.items():
        for depth, c in by_depth.items():
            cells = [("—" if r not in c["rates"] else
                      (f"**{c['rates'][r]:.4f}**" if r == c["best"] else f"{c['rates'][r]:.4f}")) for r in rates]
            best = rate_text(c["best"]) + (" (edge of the grid)" if c["at_edge"] else " (bracketed)")
            lines.append(f"| {arm} | {depth} | {', '.join(map(str, c['seeds']))} | " + " | ".join(cells)
                         + f" | {best} |")
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="python -m utils.study.rate_choice", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineErrorParser)
    evaluate = commands.add_parser("evaluate", help="add the selection loss to a folder's finished records")
    evaluate.add_argument("folder", type=Path, help="a depth-sweep report folder (its runs/ holds the records)")
    evaluate.add_argument("--runs_dir", type=Path, required=True, help="where its runs' checkpoints are")
    evaluate.add_argument("--arms", nargs="+", default=None,
                          help="only these norm types' records (a rival's grid in a folder of older records)")
    report = commands.add_parser("report", help="the best rate per arm and depth over a budget's rate folders")
    report.add_argument("folders", nargs="+", type=Path)
    report.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    folders = [args.folder] if args.command == "evaluate" else args.folders
    for folder in folders:
        if not (folder / "runs").is_dir():
            parser.error(f"{folder}: no runs/ folder of records")
    try:
        if args.command == "evaluate":
            print("\n".join(evaluate_folder(args.folder, args.runs_dir, args.arms)))
            return 0
        chosen = choose(args.folders)
    except ValueError as error:  # an unreadable record, or folders of two budgets
        parser.error(str(error))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rate_choice.md").write_text("\n".join(report_lines(chosen, argv)) + "\n")
    (args.out / "rate_choice.json").write_text(json.dumps(
        {arm: {str(d): dict(c, rates={f"{r:g}": v for r, v in c["rates"].items()}) for d, c in by_depth.items()}
         for arm, by_depth in chosen.items()}, indent=1) + "\n")
    print(args.out / "rate_choice.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
