"""CPU-scale study: train every norm placement on the same data and budget, analyse each, write one report.

    python utils/compare_norms.py                  # default budget (about half an hour on 2 CPU cores)
    python utils/compare_norms.py --quick          # smoke test, a few minutes
    python utils/compare_norms.py --steps 600 --seeds 1 2 3 --out docs/study

For each seed and norm type it runs `torchrun_main.py` on the embedded corpus with identical flags (data order and
init follow the seed), then on the first seed's final checkpoints runs the repository's analysis tools as a user would
(utils/variance_analysis.py, utils/angular_analysis.py, layer_remove.py --sweep on the offline held-out task). The
report (markdown + PNGs) states, from the measured numbers, which of the paper's claims hold at this scale.
Runs that already finished under identical flags are reused (their run folder holds the flags); --fresh retrains.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
NORM_TYPES = ("pre", "lns", "post", "post_pre", "deepnorm")
LABELS = {"pre": "Pre-LN", "lns": "LNS", "post": "Post-LN", "post_pre": "Mix-LN", "deepnorm": "DeepNorm"}

# Budgets: the default reproduces the committed report; --quick is the CI smoke test.
BUDGETS = {
    "default": dict(steps=300, warmup=30, batch_size=16, max_length=128, eval_tokens=32_768, seeds=[1, 2],
                    angular_tokens=16_384, removal_documents=32, model_config="llama_tiny_deep.json"),
    "quick": dict(steps=6, warmup=1, batch_size=4, max_length=64, eval_tokens=1_024, seeds=[1],
                  angular_tokens=512, removal_documents=2, model_config="llama_tiny.json"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke-test budget (a few minutes)")
    parser.add_argument("--norm_types", nargs="+", default=list(NORM_TYPES), type=str.lower)
    parser.add_argument("--model_config", default=None,
                        help="default configs/llama_tiny_deep.json (--quick: configs/llama_tiny.json)")
    parser.add_argument("--post_num", type=int, default=None, help="Mix-LN post layers (default: a quarter of L)")
    parser.add_argument("--steps", type=int, help="optimizer updates per run (the budget knob)")
    parser.add_argument("--warmup_steps", type=int)
    parser.add_argument("--batch_size", type=int)
    parser.add_argument("--max_length", type=int)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval_tokens", type=int)
    parser.add_argument("--seeds", nargs="+", type=int)
    parser.add_argument("--dtype", default="mixed", choices=("float32", "bfloat16", "mixed"),
                        help="mixed = bf16 autocast, fp32 weights (about 1.35x faster than float32 on this CPU)")
    parser.add_argument("--angular_tokens", type=int, help="tokens for the angular-distance analysis")
    parser.add_argument("--removal_documents", type=int, help="held-out documents for the layer-removal sweep")
    parser.add_argument("--runs_dir", default=None, help="where the training runs go (default: runs/study[_quick])")
    parser.add_argument("--out", default=None, help="report folder (default: docs/study, or runs/study_quick/report)")
    parser.add_argument("--jobs", type=int, default=2, help="training runs at once (default 2, one per core)")
    parser.add_argument("--fresh", action="store_true", help="retrain even if a finished run with the same flags exists")
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)

    budget = BUDGETS["quick" if args.quick else "default"]
    args.model_config = args.model_config or str(REPO / "configs" / budget["model_config"])
    for key in ("steps", "batch_size", "max_length", "eval_tokens", "seeds", "angular_tokens", "removal_documents"):
        if getattr(args, key) is None:
            setattr(args, key, budget[key])
    if args.warmup_steps is None:
        args.warmup_steps = budget["warmup"] if args.steps == budget["steps"] else max(1, args.steps // 10)
    unknown = sorted(set(args.norm_types) - set(NORM_TYPES) - {"layerscale"})
    if unknown:
        parser.error(f"--norm_types: unknown {', '.join(unknown)}; valid: {', '.join(NORM_TYPES)}, layerscale")
    if not Path(args.model_config).is_file():
        parser.error(f"--model_config: no such file {args.model_config}")
    for key in ("steps", "batch_size", "max_length", "eval_tokens", "angular_tokens", "removal_documents", "jobs"):
        if getattr(args, key) <= 0:
            parser.error(f"--{key} must be positive, got {getattr(args, key)}")
    if args.warmup_steps >= args.steps:
        parser.error(f"--warmup_steps {args.warmup_steps} must be below --steps {args.steps}")
    num_layers = json.loads(Path(args.model_config).read_text())["num_hidden_layers"]
    if args.post_num is None:
        args.post_num = max(1, num_layers // 4)
    if not 0 <= args.post_num <= num_layers:
        parser.error(f"--post_num {args.post_num} outside [0, {num_layers}]")
    default_name = "study_quick" if args.quick else "study"
    args.runs_dir = Path(args.runs_dir or REPO / "runs" / default_name)
    args.out = Path(args.out or (args.runs_dir / "report" if args.quick else REPO / "docs" / "study"))
    return args


def run(cmd: list[str], log_path: Path, env: dict | None = None) -> int:
    """Run a tool as a user would; its output goes to a log file, whose tail is shown if it fails."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        code = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    if code not in (0, 3):  # 3 = diverged, a result rather than a failure
        tail = log_path.read_text().splitlines()[-15:]
        raise SystemExit(f"compare_norms: command failed ({code}): {' '.join(cmd)}\n" + "\n".join(tail))
    return code


# ---------------------------------------------------------------------------------------------------------- training
def train_flags(args, norm_type: str, seed: int) -> list[str]:
    return [
        "--model_config", str(args.model_config), "--norm_type", norm_type, "--post_num", str(args.post_num),
        "--dataset", "embedded", "--tokenizer", "embedded", "--max_length", str(args.max_length),
        "--batch_size", str(args.batch_size), "--total_batch_size", str(args.batch_size),
        "--lr", str(args.lr), "--warmup_steps", str(args.warmup_steps), "--num_training_steps", str(args.steps),
        "--eval_every", str(max(1, args.steps // 6)), "--eval_tokens", str(args.eval_tokens),
        "--save_every", str(args.steps), "--grad_clipping", "1.0", "--weight_decay", "0", "--optimizer", "adam",
        "--dtype", args.dtype, "--seed", str(seed), "--workers", "0", "--device", "cpu",
    ]


def train_one(args, norm: str, seed: int, env: dict) -> dict:
    run_dir = args.runs_dir / f"{norm}-seed{seed}"
    flags = train_flags(args, norm, seed)
    flags_file, results_file = run_dir / "study_flags.json", run_dir / "results.json"
    reusable = (not args.fresh and results_file.is_file() and flags_file.is_file()
                and json.loads(flags_file.read_text()) == flags)
    if not reusable:
        if run_dir.exists():
            shutil.rmtree(run_dir)
        start = time.perf_counter()
        run([sys.executable, "torchrun_main.py", *flags, "--save_dir", str(run_dir),
             "--run_name", f"study-{norm}-seed{seed}"], args.runs_dir / "logs" / f"{norm}-seed{seed}.log", env)
        flags_file.write_text(json.dumps(flags))
        (run_dir / "study_seconds.txt").write_text(f"{time.perf_counter() - start:.1f}\n")
    return dict(json.loads(results_file.read_text()), run_dir=str(run_dir), reused=reusable,
                seconds=float((run_dir / "study_seconds.txt").read_text()))


def train_all(args) -> dict[tuple[str, int], dict]:
    """Every (norm, seed) run; with --jobs > 1, that many at once, one thread each (two 2-thread runs on two
    cores slow each other down far more than two 1-thread runs do)."""
    from concurrent.futures import ThreadPoolExecutor

    from tqdm.auto import tqdm

    env = dict(os.environ, OMP_NUM_THREADS="1") if args.jobs > 1 else None
    jobs = [(norm, seed) for seed in args.seeds for norm in args.norm_types]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {job: pool.submit(train_one, args, *job, env) for job in jobs}
        with tqdm(total=len(jobs), desc="training runs", unit="run", dynamic_ncols=True) as bar:
            for future in futures.values():
                future.add_done_callback(lambda _: bar.update(1))
            return {job: future.result() for job, future in futures.items()}


# ---------------------------------------------------------------------------------------------------------- analyses
def analyse(args, finished: dict[str, str]) -> dict:
    """Run the analysis tools on one checkpoint per norm type, through their command lines, in this process."""
    import contextlib

    from tqdm.auto import tqdm

    sys.path.insert(0, str(REPO))
    import layer_remove
    from utils import angular_analysis, variance_analysis

    analysis_dir = args.out / "analysis"
    logs = args.runs_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    norms = list(finished)
    outputs = {"variance": analysis_dir / "variance", "angular": {}, "removal": {}}
    text = ["--dataset", "embedded", "--num_tokens", str(args.angular_tokens), "--max_seq_len", str(args.max_length)]
    calls = [("variance", variance_analysis.main,
              ["--model_paths", *finished.values(), "--labels", *[LABELS[n] for n in norms], *text,
               "--output_dir", str(outputs["variance"])])]
    for norm in norms:
        outputs["angular"][norm] = analysis_dir / "angular" / norm
        calls.append((f"angular-{norm}", angular_analysis.main,
                      ["--model_path", finished[norm], *text, "--output_dir", str(outputs["angular"][norm])]))
    for norm in norms:
        outputs["removal"][norm] = analysis_dir / "layer_removal" / norm
        calls.append((f"removal-{norm}", layer_remove.main,
                      ["--model_path", finished[norm], "--sweep", "--tasks", "heldout_novel_ppl",
                       "--task_max_documents", str(args.removal_documents), "--output_dir",
                       str(outputs["removal"][norm])]))
    for name, tool_main, tool_argv in tqdm(calls, desc="analyses", unit="tool", dynamic_ncols=True):
        log_path = logs / f"{name}.log"
        try:
            with open(log_path, "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                tool_main(tool_argv)
        except (Exception, SystemExit) as error:
            tail = "\n".join(log_path.read_text().splitlines()[-15:])
            raise SystemExit(f"compare_norms: {name} failed ({error!r}); end of {log_path}:\n{tail}") from error
    return outputs


# ---------------------------------------------------------------------------------------------------------- report
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def read_metrics(run_dir: str) -> list[dict]:
    with open(Path(run_dir) / "metrics.jsonl") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def plot_loss_curves(args, results, path: Path) -> Path:
    plt = _plt()
    fig, (ax_train, ax_eval) = plt.subplots(1, 2, figsize=(12, 4.2))
    seed = args.seeds[0]
    for norm in args.norm_types:
        rows = read_metrics(results[norm, seed]["run_dir"])
        steps = [r["step"] for r in rows if "loss" in r and math.isfinite(r["loss"])]
        losses = [r["loss"] for r in rows if "loss" in r and math.isfinite(r["loss"])]
        window = max(1, len(losses) // 40)
        smooth = np.convolve(losses, np.ones(window) / window, mode="valid") if losses else []
        ax_train.plot(steps[window - 1:], smooth, label=LABELS[norm])
        evals = [(r["step"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None]
        if evals:
            ax_eval.plot(*zip(*evals), marker="o", label=LABELS[norm])
    ax_train.set(title=f"train loss (seed {seed}, moving average)", xlabel="update step", ylabel="loss")
    ax_eval.set(title=f"held-out eval loss (seed {seed})", xlabel="update step", ylabel="loss")
    for ax in (ax_train, ax_eval):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path


def plot_angular_side_by_side(outputs, path: Path) -> tuple[Path, dict]:
    plt = _plt()
    matrices = {norm: np.array(json.loads((out / "angular_distance.json").read_text())["angular_distance"],
                               dtype=float) for norm, out in outputs["angular"].items()}
    vmax = max(np.nanmax(m) for m in matrices.values())
    fig, axes = plt.subplots(1, len(matrices), figsize=(4.2 * len(matrices), 4.2), squeeze=False)
    for ax, (norm, matrix) in zip(axes[0], matrices.items()):
        depth = matrix.shape[1]
        mesh = ax.pcolormesh(np.arange(depth + 1), np.arange(1, depth + 2), np.ma.masked_invalid(matrix),
                             cmap="viridis_r", vmin=0.0, vmax=vmax)
        ax.set(title=LABELS[norm], xlabel=r"layer $\ell$", ylabel=r"distance $n$", aspect="equal")
        ticks = np.arange(0, depth, max(1, depth // 6))
        ax.set_xticks(ticks + 0.5, [str(t) for t in ticks])
        ax.set_yticks(ticks + 1.5, [str(t + 1) for t in ticks])
    fig.colorbar(mesh, ax=axes[0].tolist(), fraction=0.02, label=r"angular distance $d/\pi$")
    fig.savefig(path, dpi=150, bbox_inches="tight")
    plt.close(fig)
    return path, matrices


def plot_removal(outputs, path: Path) -> tuple[Path, dict]:
    plt = _plt()
    drops = {}
    for norm, out in outputs["removal"].items():
        rows = json.loads((out / "layer_removal.json").read_text())["rows"]
        pruned = [r for r in rows if r["removed_layer"] is not None]
        baseline = next(r for r in rows if r["removed_layer"] is None)
        drops[norm] = dict(layers=[r["removed_layer"] for r in pruned], drop=[r["relative_drop"] for r in pruned],
                           metric=baseline["metric"], baseline=baseline["value"])
    fig, axes = plt.subplots(len(drops), 1, figsize=(9, 2.2 * len(drops)), sharex=True, squeeze=False)
    for ax, (norm, d) in zip(axes[:, 0], drops.items()):
        ax.bar(d["layers"], np.array(d["drop"]) * 100, color="tab:red")
        ax.set_ylabel("drop (%)")
        ax.set_title(f"{LABELS[norm]}: baseline {d['metric'].split(',')[0]} = {d['baseline']:.4g}", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    axes[-1, 0].set_xlabel("removed layer index (0-based)")
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path, drops


def _mean_std(values):
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def loss_table(args, results) -> tuple[str, dict]:
    lines = ["| norm type | eval loss (mean ± sd over seeds) | eval ppl | finished / runs | per-seed eval loss |",
             "|---|---|---|---|---|"]
    summary = {}
    for norm in args.norm_types:
        runs = [results[norm, s] for s in args.seeds]
        losses = [r["final_eval_loss"] for r in runs if r["status"] == "finished"]
        ppls = [r["final_eval_ppl"] for r in runs if r["status"] == "finished"]
        per_seed = ", ".join(f"s{s}: {r['final_eval_loss']:.4f}" if r["status"] == "finished"
                             else f"s{s}: diverged at step {r['step']}" for s, r in zip(args.seeds, runs))
        summary[norm] = dict(losses=losses, ppls=ppls, diverged=len(runs) - len(losses))
        lines.append(f"| {LABELS[norm]} | {_mean_std(losses)} | {_mean_std(ppls)} | {len(losses)} / {len(runs)} "
                     f"| {per_seed} |")
    return "\n".join(lines), summary


def claims(summary, variance, matrices, drops) -> list[str]:
    """The paper's claims, judged from the numbers measured here."""
    verdicts = []
    if summary.get("pre", {}).get("losses") and summary.get("lns", {}).get("losses"):
        pre, lns = statistics.mean(summary["pre"]["losses"]), statistics.mean(summary["lns"]["losses"])
        wins = sum(l < p for l, p in zip(summary["lns"]["losses"], summary["pre"]["losses"]))
        verdicts.append(f"**LNS beats Pre-LN in perplexity**: {'reproduced' if lns < pre else 'NOT reproduced'} "
                        f"(mean eval loss LNS {lns:.4f} vs Pre-LN {pre:.4f}, ppl {math.exp(lns):.2f} vs "
                        f"{math.exp(pre):.2f}; LNS lower in {wins} of {len(summary['lns']['losses'])} paired seeds).")
    if "pre" in variance and "lns" in variance:
        growth = {n: variance[n][-1] / variance[n][1] for n in ("pre", "lns")}
        verdicts.append(f"**Pre-LN's variance grows faster with depth**: "
                        f"{'reproduced' if growth['pre'] > growth['lns'] else 'NOT reproduced'} (variance of the "
                        f"stream after the last layer over that after the first: Pre-LN {growth['pre']:.1f}x, "
                        f"LNS {growth['lns']:.1f}x).")
    if "pre" in matrices and "lns" in matrices:
        def deep_next_layer(matrix):
            half = matrix.shape[1] // 2
            return float(np.nanmean(matrix[0, half:]))
        ang = {n: deep_next_layer(matrices[n]) for n in ("pre", "lns")}
        verdicts.append(f"**Deep Pre-LN layers are close to their successor (small angular distance)**: "
                        f"{'reproduced' if ang['pre'] < ang['lns'] else 'NOT reproduced'} (mean d(l, l+1)/pi over the "
                        f"deeper half: Pre-LN {ang['pre']:.4f}, LNS {ang['lns']:.4f}).")
    if "pre" in drops and "lns" in drops:
        def deep_drop(d):
            half = len(d["layers"]) // 2
            return float(np.mean(d["drop"][half:]))
        removal = {n: deep_drop(drops[n]) for n in ("pre", "lns")}
        verdicts.append(f"**Removing a deep Pre-LN layer costs little, a deep LNS layer more**: "
                        f"{'reproduced' if removal['pre'] < removal['lns'] else 'NOT reproduced'} (mean relative "
                        f"perplexity increase when removing one of the deeper half of layers: Pre-LN "
                        f"{removal['pre'] * 100:.2f}%, LNS {removal['lns'] * 100:.2f}%"
                        + ("; both are negative: at this scale removing a deep layer slightly helps either model"
                           if max(removal.values()) < 0 else "") + ").")
    if "post" in summary and summary.get("pre", {}).get("losses"):
        post = summary["post"]
        pre = statistics.mean(summary["pre"]["losses"])
        unstable = post["diverged"] > 0 or (post["losses"] and statistics.mean(post["losses"]) > pre)
        detail = (f"{post['diverged']} of {post['diverged'] + len(post['losses'])} runs diverged"
                  + (f"; mean eval loss of the finished ones {statistics.mean(post['losses']):.4f} vs Pre-LN {pre:.4f}"
                     if post["losses"] else ""))
        verdicts.append(f"**Post-LN is unstable / worse than Pre-LN**: {'reproduced' if unstable else 'NOT reproduced'}"
                        f" ({detail}).")
    return verdicts


def software_versions() -> str:
    import importlib.metadata as md

    names = ("torch", "transformers", "tokenizers", "datasets", "lm_eval", "numpy", "matplotlib")
    return ", ".join(f"{n} {md.version(n)}" for n in names)


def write_report(args, results, outputs, started: float, argv: list[str]) -> Path:
    args.out.mkdir(parents=True, exist_ok=True)
    table, summary = loss_table(args, results)
    loss_png = plot_loss_curves(args, results, args.out / "loss_curves.png")
    variance_json = json.loads((outputs["variance"] / "residual_variance.json").read_text())
    label_to_norm = {v: k for k, v in LABELS.items()}
    variance = {label_to_norm[m["label"]]: m["variance"] for m in variance_json["models"]}
    angular_png, matrices = plot_angular_side_by_side(outputs, args.out / "angular_heatmaps.png")
    removal_png, drops = plot_removal(outputs, args.out / "layer_removal.png")
    variance_png = outputs["variance"] / "residual_variance.png"
    verdicts = claims(summary, variance, matrices, drops)
    summary_json = dict(results={f"{n}-seed{s}": r for (n, s), r in results.items()}, loss_summary=summary,
                        claims=verdicts)
    (args.out / "summary.json").write_text(json.dumps(summary_json, indent=1, default=str))

    config = json.loads(Path(args.model_config).read_text())
    train_seconds = sum(r["seconds"] for r in results.values())
    rel = lambda p: Path(p).resolve().relative_to(args.out.resolve())  # noqa: E731
    analysed_seed = args.seeds[0]
    text = f"""# CPU-scale study: norm placements on a deep, narrow LLaMA

Generated by `python utils/compare_norms.py {' '.join(argv)}` in {(time.time() - started) / 60:.1f} minutes
(the {len(results)} training runs took {train_seconds / 60:.1f} minutes in total, {args.jobs} at a time;
{sum(r["reused"] for r in results.values())} of them were reused from an earlier invocation with identical flags).

- **Model**: `{Path(args.model_config).name}`: {config['num_hidden_layers']} layers, hidden {config['hidden_size']},
  intermediate {config['intermediate_size']}, {config['num_attention_heads']} heads, vocab {config['vocab_size']}.
- **Data**: the embedded Jane Austen corpus (five novels to train, one held out), its 8192-token BPE tokenizer,
  sequences of {args.max_length} tokens, padding (no packing).
- **Training**: {args.steps} Adam updates of {args.batch_size} sequences, lr {args.lr}, {args.warmup_steps} warmup
  steps then cosine to 10%, grad clipping 1.0, dtype {args.dtype}, Mix-LN with post_num={args.post_num}.
  Every norm type sees the same batches in the same order for a given seed. Seeds: {', '.join(map(str, args.seeds))}.
- **Evaluation**: token-weighted cross-entropy over {args.eval_tokens:,} held-out tokens.
- **Analyses** (seed {analysed_seed} checkpoints): residual-stream variance and angular distance over
  {args.angular_tokens:,} held-out tokens; layer removal measured as held-out perplexity (lm-eval
  `heldout_novel_ppl`, {args.removal_documents} documents).
- **Machine**: {platform.machine()}, {platform.processor() or 'unknown CPU'}, {__import__('os').cpu_count()} cores,
  Python {platform.python_version()}; {software_versions()}.

## What the paper claims, and what this run measured

{chr(10).join('- ' + v for v in verdicts)}

## Eval loss per norm type

{table}

## Loss curves

![loss curves]({rel(loss_png)})

## Residual-stream variance per layer

![variance]({rel(variance_png)})

## Angular distance between layer l and l+n

![angular distance]({rel(angular_png)})

## Layer removal: relative increase of held-out perplexity

![layer removal]({rel(removal_png)})

Raw numbers: `summary.json`, and the CSV/JSON files under `analysis/`.
"""
    report = args.out / "report.md"
    report.write_text(text)
    return report


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    started = time.time()
    results = train_all(args)
    first = args.seeds[0]
    finished = {n: results[n, first]["checkpoint"] for n in args.norm_types
                if results[n, first]["status"] == "finished" and results[n, first].get("checkpoint")}
    if not {"pre", "lns"} <= set(finished):
        print("compare_norms: Pre-LN or LNS did not finish; analyses need both", file=sys.stderr)
    outputs = analyse(args, finished)
    report = write_report(args, results, outputs, started, argv)
    print(f"report: {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
