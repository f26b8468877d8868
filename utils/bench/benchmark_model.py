"""Training-step throughput: our model now, our model at a git revision ("before"), and transformers' Llama.

Five sections; all but profile print the median and the spread (min-max) of every figure:

* model: one step = forward + loss + backward + grad clipping 1.0 + fused Adam, on random tokens (no padding).
  Each model runs eager and through torch.compile, in fp32 and under bf16 autocast with fp32 weights ("mixed").
  All variants of one (config, dtype) live in one process and are timed in interleaved repeats, so drifts in
  machine load hit them alike. "before" is `peft_pretraining/model/modeling_llama.py` read from `--before`; "hf" is
  transformers' Llama with its default SDPA attention, "hf_eager_attn" the same with attn_implementation="eager"
  (attention in plain torch ops, which inductor can fuse): both are candidates for HF's fastest.
* trainer: the real `torchrun_main.py` on the embedded corpus with the CPU study's own flags (its Pre-LN seed-1 run
  of `utils/compare_norms.py`, dtype and packing included; data loading included) but a short budget, the
  current tree against the tree of `--before` (extracted with `git archive`), runs alternating before/after; the
  figure is the median of the per-update tokens_per_s in metrics.jsonl after the first `--trainer_warmup` updates.
  Both trees train today's study flags, or with `--before_flags own` each tree its own study's flags (the study as
  it ran then against the study as it runs now). Each tree runs eager and compiled (`--trainer_variants`), whatever
  its study's own mode; a row says whether its mode is the study's, and a ratio compares those two rows.
* layout (asked for by name): the same trainer runs, `--layout_cores` of them side by side with one thread each (as
  the study runs them), against one after another with `--layout_cores` threads each; the figure is the machine's
  total tokens/s. They run in the study's own mode if `--trainer_variants` has it, else in the first variant.
* profile: where our model's step spends its time, op by op (torch.profiler, self CPU time), at the first of
  --shapes, for each of --dtypes and --modes; a compiled step is listed kernel by kernel (inductor's generated
  kernels carry names such as cpp_fused_..._silu_...).
* attention: causal attention alone, forward + backward, as plain matmuls (the model's CPU bf16 path) against SDPA's
  math and flash backends, at --attention_shapes, for each of --dtypes: the evidence for the model's kernel choice.

The in-process sections run with freed host memory kept for reuse, as the trainer runs on CPU
(`host_memory.keep_freed_host_memory`); the header says whether it took effect.

    python utils/bench/benchmark_model.py              # model and trainer, study shape and 130M (long on 2 cores)
    python utils/bench/benchmark_model.py --sections trainer --trainer_repeats 3
    python utils/bench/benchmark_model.py --sections trainer --before b036de4 --before_flags own  # the study then, now
    python utils/bench/benchmark_model.py --sections layout --trainer_steps 20 --trainer_repeats 3
    python utils/bench/benchmark_model.py --sections profile --shapes configs/llama_tiny_deep.json:16:128 \
        --dtypes float32
    OMP_NUM_THREADS=1 python utils/bench/benchmark_model.py --sections attention --dtypes mixed float32 --steps 10 \
        --repeats 7
    python utils/bench/benchmark_model.py --quick      # a tiny smoke run, seconds

Writes <out>/model.csv, trainer.csv, layout.csv, profile.csv, attention.csv and benchmark.json (default out:
runs/benchmark_model).
"""

import argparse
import contextlib
import csv
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlamaForCausalLM

from peft_pretraining.cli import OneLineErrorParser
from peft_pretraining.model import modeling_llama
from peft_pretraining.training.host_memory import keep_freed_host_memory
from peft_pretraining.training.optimization import build_optimizer
from utils.study.host import bf16_instructions, cpu_model_name

REPO = Path(__file__).resolve().parents[2]

STUDY_CONFIG = "configs/llama_tiny_deep.json"
MODELS = ("ours", "before", "hf", "hf_eager_attn")
HF_MODELS = ("hf", "hf_eager_attn")
DTYPES = ("float32", "mixed")
TRAINER_VARIANTS = {"eager": [], "compile": ["--compile"]}  # in place of the study's own --compile, if it has one
# Flags the benchmark sets itself; every other trainer flag is the study's (study_trainer_flags).
BENCHMARK_FLAGS = ("--model_config", "--dtype", "--num_training_steps", "--warmup_steps", "--eval_every",
                   "--eval_tokens", "--save_every", "--save_dir")


# ---------------------------------------------------------------------------------------------------- helpers
def load_model_module(revision: str):
    """peft_pretraining/model/modeling_llama.py as it was at `revision` (peft_pretraining/modeling_llama.py before the
    package was split into rooms), imported as a separate module."""
    for where in ("peft_pretraining/model/modeling_llama.py", "peft_pretraining/modeling_llama.py"):
        shown = subprocess.run(["git", "show", f"{revision}:{where}"], cwd=REPO, capture_output=True, text=True)
        if shown.returncode == 0:
            break
    shown.check_returncode()
    source = shown.stdout
    path = Path(tempfile.mkdtemp(prefix="modeling_before_")) / "modeling_llama_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("modeling_llama_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def machine() -> str:
    return (f"{cpu_model_name()}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"threads {torch.get_num_threads()}, bf16 hardware: {', '.join(bf16_instructions()) or 'none'}, "
            f"load average {os.getloadavg()[0]:.1f}")


def autocast_for(dtype: str):
    if dtype == "mixed":
        return lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext


# ---------------------------------------------------------------------------------------------------- model section
def build_models(config_path: Path, names, before_module):
    torch.manual_seed(0)
    ours = modeling_llama.LlamaForCausalLM(modeling_llama.build_config(config_path, norm_type="pre"))
    models = {"ours": ours}
    if "before" in names:
        models["before"] = before_module.LlamaForCausalLM(before_module.build_config(config_path, norm_type="pre"))
    for name in set(names) & set(HF_MODELS):
        hf_config = LlamaConfig.from_json_file(str(config_path))
        hf_config._attn_implementation = "sdpa" if name == "hf" else "eager"
        models[name] = HFLlamaForCausalLM(hf_config)
    for model in models.values():
        model.load_state_dict(ours.state_dict())
        model.train()
    return {name: models[name] for name in names}


def make_step(model, optimizer, tokens, autocast):
    params = [p for p in model.parameters()]

    def step():
        with autocast():
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def bench_models(config_path: Path, dtype: str, *, names, modes, batch, seq_len, repeats, steps, before_module,
                 compile_mode):
    """{(model, mode): [tokens/s per repeat]} for one config and dtype, interleaved."""
    models = build_models(config_path, names, before_module)
    autocast = autocast_for(dtype)
    tokens = torch.randint(0, models["ours"].config.vocab_size, (batch, seq_len),
                           generator=torch.Generator().manual_seed(0))
    steps_by_variant = {}
    for name, model in models.items():
        optimizer = build_optimizer(model.parameters(), "adam", 1e-4, 0.0)
        for mode in modes:
            runner = torch.compile(model, mode=compile_mode) if mode == "compiled" else model
            steps_by_variant[(name, mode)] = make_step(runner, optimizer, tokens, autocast)
    for variant, step in tqdm(steps_by_variant.items(), desc=f"warm-up {config_path.name} {dtype}", leave=False):
        step()  # compiles; a second call settles allocations
        step()
    rates = {variant: [] for variant in steps_by_variant}
    for _ in tqdm(range(repeats), desc=f"repeats {config_path.name} {dtype}", leave=False):
        for variant, step in steps_by_variant.items():
            start = time.perf_counter()
            for _ in range(steps):
                step()
            rates[variant].append(batch * seq_len * steps / (time.perf_counter() - start))
    return rates


def model_section(args, before_module) -> list[dict]:
    rows = []
    for shape in args.shapes:
        config_name, batch, seq_len = shape.split(":")
        config_path = REPO / config_name if not Path(config_name).is_file() else Path(config_name)
        for dtype in args.dtypes:
            rates = bench_models(config_path, dtype, names=args.models, modes=args.modes, batch=int(batch),
                                 seq_len=int(seq_len), repeats=args.repeats, steps=args.steps,
                                 before_module=before_module, compile_mode=args.compile_mode)
            for (name, mode), values in rates.items():
                stats = spread(values)
                rows.append({"config": config_path.name, "batch": int(batch), "seq_len": int(seq_len),
                             "dtype": dtype, "model": name, "mode": mode,
                             **{f"tokens_per_s_{k}": round(v, 1) for k, v in stats.items() if k != "n"},
                             "repeats": stats["n"], "per_repeat": [round(v, 1) for v in values]})
    return rows


# ---------------------------------------------------------------------------------------------------- profile section
def profile_section(args) -> list[dict]:
    """Where our step's time goes: torch.profiler over --steps steps (after two warm-up steps) at the first of
    --shapes, for each of --dtypes and --modes; the --profile_top ops with the most self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    config_name, batch, seq_len = args.shapes[0].split(":")
    config_path = REPO / config_name if not Path(config_name).is_file() else Path(config_name)
    rows = []
    for dtype in args.dtypes:
        for mode in args.modes:
            model = build_models(config_path, ["ours"], None)["ours"]
            tokens = torch.randint(0, model.config.vocab_size, (int(batch), int(seq_len)),
                                   generator=torch.Generator().manual_seed(0))
            runner = torch.compile(model, mode=args.compile_mode) if mode == "compiled" else model
            step = make_step(runner, build_optimizer(model.parameters(), "adam", 1e-4, 0.0), tokens,
                             autocast_for(dtype))
            # Inductor's kernels record themselves by name, so fused element-wise work shows kernel by kernel
            # instead of as one "Call CompiledFxGraph".
            with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):
                step()  # compiles
                step()
                with profile(activities=[ProfilerActivity.CPU]) as profiler:
                    for _ in range(args.steps):
                        step()
            events = profiler.key_averages()
            total = sum(event.self_cpu_time_total for event in events)
            for event in sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:args.profile_top]:
                rows.append({"config": config_path.name, "batch": int(batch), "seq_len": int(seq_len),
                             "dtype": dtype, "mode": mode, "op": event.key[:70],
                             "self_ms_per_step": round(event.self_cpu_time_total / 1e3 / args.steps, 1),
                             "share": round(event.self_cpu_time_total / total, 3),
                             "calls_per_step": round(event.count / args.steps, 1)})
    return rows


# ---------------------------------------------------------------------------------------------------- attention section
ATTENTION_KERNELS = ("plain", "sdpa_math", "sdpa_flash")


def attention_section(args) -> list[dict]:
    """The evidence for the model's CPU kernel choice: causal attention alone, forward + backward, as plain matmuls
    (the model's CPU bf16 path) and through SDPA restricted to its math or flash backend, for each of --dtypes and
    --attention_shapes (B:H:T:D), --repeats interleaved repeats of --steps calls each."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def kernel_call(kernel, q, k, v):
        if kernel == "plain":
            return modeling_llama.plain_attention(q, k, v, None)
        backend = SDPBackend.MATH if kernel == "sdpa_math" else SDPBackend.FLASH_ATTENTION
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    rows = []
    for shape in args.attention_shapes:
        b, h, t, d = (int(x) for x in shape.split(":"))
        generator = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(b, h, t, d, generator=generator, requires_grad=True) for _ in range(3))
        for dtype in args.dtypes:
            autocast = autocast_for(dtype)

            def call(kernel):
                with autocast():
                    out = kernel_call(kernel, q, k, v)
                out.float().sum().backward()

            times = {kernel: [] for kernel in ATTENTION_KERNELS}
            for kernel in ATTENTION_KERNELS:
                call(kernel)  # warm-up
            for _ in tqdm(range(args.repeats), desc=f"attention {shape} {dtype}", leave=False):
                for kernel in ATTENTION_KERNELS:
                    start = time.perf_counter()
                    for _ in range(args.steps):
                        call(kernel)
                    times[kernel].append((time.perf_counter() - start) / args.steps * 1e3)
            for kernel, values in times.items():
                stats = spread(values)
                rows.append({"shape": shape, "dtype": dtype, "kernel": kernel,
                             **{f"ms_{key}": round(value, 2) for key, value in stats.items() if key != "n"},
                             "repeats": stats["n"]})
    return rows


# ---------------------------------------------------------------------------------------------------- trainer section
# Prints the Pre-LN seed-1 run's flags, as it trains, from the compare_norms.py of the tree it runs in. Before the
# study machinery (97bc166) one function, train_flags, gave a run's flags; a tree of any age can be asked.
STUDY_FLAGS_SNIPPET = """
import json, sys
sys.path.insert(0, ".")
from utils import compare_norms as study
if hasattr(study, "run_specs"):
    args = study.parse_args(["--arms", "pre", "--seeds", "1"])
    specs = study.run_specs(args, study.study_arms(args))
    # utils/study/runs.py; utils/study/engine.py, then utils/study_lib.py before
    study_runs = getattr(study, "runs", None) or getattr(study, "engine", None) or study.study_lib
    if hasattr(study_runs, "as_trained"):  # since the studies' defaults became mixed precision, compiled
        specs = study_runs.as_trained(args, specs)
    flags = specs[0].flags()
else:
    flags = study.train_flags(study.parse_args([]), "pre", 1)
print(json.dumps(list(flags)))
"""


def study_trainer_flags(tree: Path = REPO) -> list[str]:
    """The flags of the CPU study's Pre-LN seed-1 run (default budget) as `tree`'s utils/compare_norms.py gives them,
    so the benchmark cannot drift from the study."""
    result = subprocess.run([sys.executable, "-c", STUDY_FLAGS_SNIPPET], cwd=tree, capture_output=True, text=True,
                            env=trainer_env(1))
    if result.returncode != 0:
        raise SystemExit(f"benchmark_model: could not read the study's flags in {tree}:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.splitlines()[-1])


def without_flags(flags: list[str], names) -> list[str]:
    """`flags` minus each flag in `names` and its value (each of `names` takes exactly one value)."""
    kept, i = [], 0
    while i < len(flags):
        if flags[i] in names:
            i += 2
            continue
        kept.append(flags[i])
        i += 1
    return kept


def flag_value(flags: list[str], name: str) -> str:
    return flags[flags.index(name) + 1]


def extract_revision(revision: str) -> Path:
    target = Path(tempfile.mkdtemp(prefix="trainer_before_"))
    archive = subprocess.run(["git", "archive", "--format=tar", revision], cwd=REPO, capture_output=True,
                             check=True).stdout
    archive_path = target / "tree.tar"
    archive_path.write_bytes(archive)
    with tarfile.open(archive_path) as tar:
        tar.extractall(target / "tree", filter="data")
    return target / "tree"


def trainer_dtype(args, study_flags: list[str]) -> str:
    """--trainer_dtype, else the dtype of the study whose flags these are."""
    return args.trainer_dtype or flag_value(study_flags, "--dtype")


def trainer_command(args, extra_flags: list[str], out_dir: Path, study_flags: list[str] | None = None) -> list[str]:
    """The study's run with the benchmark's budget; `study_flags` default to the working tree's study."""
    study_flags = args.study_flags if study_flags is None else study_flags
    study_flags = [flag for flag in study_flags if flag != "--compile"]  # extra_flags say whether it compiles
    return [sys.executable, "torchrun_main.py", *without_flags(study_flags, BENCHMARK_FLAGS),
            "--model_config", args.trainer_config, "--dtype", trainer_dtype(args, study_flags),
            "--num_training_steps", str(args.trainer_steps), "--warmup_steps", "1", "--eval_every", str(10**6),
            "--save_every", str(10**6), "--eval_tokens", "256", "--save_dir", str(out_dir), *extra_flags]


def trainer_env(threads: int) -> dict:
    return dict(os.environ, OMP_NUM_THREADS=str(threads), WANDB_MODE="disabled", HF_HUB_OFFLINE="1",
                HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


def trainer_rate(args, out_dir: Path) -> float:
    """Median of the per-update tokens_per_s in the run's metrics.jsonl, after the warm-up updates."""
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return statistics.median([row["tokens_per_s"] for row in rows if "tokens_per_s" in row][args.trainer_warmup:])


def run_trainer(tree: Path, args, extra_flags: list[str], out_dir: Path, study_flags: list[str]) -> dict:
    start = time.perf_counter()
    result = subprocess.run(trainer_command(args, extra_flags, out_dir, study_flags), cwd=tree,
                            env=trainer_env(args.trainer_threads), capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"benchmark_model: trainer failed in {tree}:\n{result.stderr[-2000:]}")
    return {"tokens_per_s": trainer_rate(args, out_dir), "wall_s": wall}


def trainer_section(args) -> list[dict]:
    trees = {"before": extract_revision(args.before), "after": REPO}
    # "same": both trees train the working tree's study (isolates the code); "own": each its own study's flags.
    flags = {"after": args.study_flags,
             "before": study_trainer_flags(trees["before"]) if args.before_flags == "own" else args.study_flags}
    variants = [(tree, variant) for tree in trees for variant in args.trainer_variants]
    results = {variant: [] for variant in variants}
    with tempfile.TemporaryDirectory(prefix="trainer_runs_") as runs:
        progress = tqdm(total=args.trainer_repeats * len(variants), desc="trainer runs", leave=False)
        for repeat in range(args.trainer_repeats):
            for tree, variant in variants:
                out_dir = Path(runs) / f"{tree}-{variant}-{repeat}"
                results[(tree, variant)].append(run_trainer(trees[tree], args, TRAINER_VARIANTS[variant], out_dir,
                                                            flags[tree]))
                progress.update(1)
        progress.close()
    rows = []
    for (tree, variant), runs_of_variant in results.items():
        stats = spread([r["tokens_per_s"] for r in runs_of_variant])
        rows.append({"tree": tree, "revision": args.before if tree == "before" else "working tree",
                     "variant": variant, "config": Path(args.trainer_config).name,
                     "dtype": trainer_dtype(args, flags[tree]),
                     "packing": "--packing" in flags[tree],
                     "study_flags_of": "working tree" if flags[tree] is args.study_flags else args.before,
                     "as_that_study_runs": ("--compile" in flags[tree]) == (variant == "compile"),
                     "threads": args.trainer_threads, "steps": args.trainer_steps,
                     **{f"tokens_per_s_{k}": round(v, 1) for k, v in stats.items() if k != "n"},
                     "wall_s_median": round(statistics.median(r["wall_s"] for r in runs_of_variant), 1),
                     "repeats": stats["n"], "per_repeat": [round(r["tokens_per_s"], 1) for r in runs_of_variant]})
    return rows


# ---------------------------------------------------------------------------------------------------- layout section
def layout_variant(args) -> str:
    """The study's own mode, if --trainer_variants has it (--quick keeps to eager), else the first of them."""
    study = "compile" if "--compile" in args.study_flags else "eager"
    return study if study in args.trainer_variants else args.trainer_variants[0]


def run_side_by_side(args, out_dirs: list[Path], threads: int) -> dict:
    """The runs of `out_dirs` started together, `threads` threads each; the total of their rates."""
    mode_flags = TRAINER_VARIANTS[layout_variant(args)]
    procs = [subprocess.Popen(trainer_command(args, mode_flags, out_dir), cwd=REPO, env=trainer_env(threads),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for out_dir in out_dirs]
    errors = [proc.communicate()[1] for proc in procs]
    for proc, err in zip(procs, errors):
        if proc.returncode != 0:
            raise SystemExit(f"benchmark_model: trainer failed in the layout section:\n{err[-2000:]}")
    return {"tokens_per_s": sum(trainer_rate(args, out_dir) for out_dir in out_dirs)}


def layout_section(args) -> list[dict]:
    """How the study should share the cores among its runs (utils/study/runs.py runs --jobs runs of one thread each).

    `--layout_cores` runs side by side with one thread each, against the same runs one after another with
    `--layout_cores` threads each. The figure is the machine's total training throughput: the sum of the
    side-by-side runs' rates, against one multi-threaded run's rate (every run trains the same tokens)."""
    cores = args.layout_cores
    layouts = {f"{cores} x 1 thread, side by side": (cores, 1), f"1 x {cores} threads, one after another": (1, cores)}
    results = {name: [] for name in layouts}
    with tempfile.TemporaryDirectory(prefix="layout_runs_") as runs:
        progress = tqdm(total=args.trainer_repeats * len(layouts), desc="layout runs", leave=False)
        for repeat in range(args.trainer_repeats):
            for index, (name, (side_by_side, threads)) in enumerate(layouts.items()):
                out_dirs = [Path(runs) / f"{index}-{repeat}-{lane}" for lane in range(side_by_side)]
                results[name].append(run_side_by_side(args, out_dirs, threads))
                progress.update(1)
        progress.close()
    rows = []
    for name, measured in results.items():
        processes, threads = layouts[name]
        stats = spread([r["tokens_per_s"] for r in measured])
        rows.append({"layout": name, "processes": processes, "threads": threads,
                     "config": Path(args.trainer_config).name, "dtype": trainer_dtype(args, args.study_flags),
                     "variant": layout_variant(args), "steps": args.trainer_steps,
                     **{f"total_tokens_per_s_{k}": round(v, 1) for k, v in stats.items() if k != "n"},
                     "repeats": stats["n"], "per_repeat": [round(r["tokens_per_s"], 1) for r in measured]})
    return rows


# ---------------------------------------------------------------------------------------------------- report
def ratios(model_rows, trainer_rows, layout_rows=()) -> dict:
    out = {}
    by_key = {(r["config"], r["dtype"], r["model"], r["mode"]): r for r in model_rows}
    for (config, dtype, model, mode), row in by_key.items():
        if model != "ours":
            continue
        for other in ("before", *HF_MODELS):
            if (config, dtype, other, mode) in by_key:
                other_row = by_key[(config, dtype, other, mode)]
                out[f"{config} {dtype} {mode}: ours/{other}"] = round(
                    row["tokens_per_s_median"] / other_row["tokens_per_s_median"], 3)
                # Repeats are interleaved, so repeat i of both ran under the same load: their ratio is paired.
                paired = [a / b for a, b in zip(row["per_repeat"], other_row["per_repeat"])]
                out[f"{config} {dtype} {mode}: ours/{other}, median of per-repeat ratios (min-max)"] = (
                    f"{statistics.median(paired):.3f} ({min(paired):.3f}-{max(paired):.3f})")
    for config in sorted({r["config"] for r in model_rows}):
        ours = [r for r in model_rows if r["config"] == config and r["model"] == "ours"]
        hf = [r for r in model_rows if r["config"] == config and r["model"] in HF_MODELS and r["mode"] == "compiled"]
        if not (ours and hf):
            continue
        # The targets compare fastest with fastest: per dtype, and over every dtype and mode measured.
        for dtype in sorted({r["dtype"] for r in ours} | {None}, key=str):
            best_ours = max((r for r in ours if dtype in (None, r["dtype"])), key=lambda r: r["tokens_per_s_median"])
            candidates = [r for r in hf if dtype in (None, r["dtype"])]
            if not candidates:
                continue
            best_hf = max(candidates, key=lambda r: r["tokens_per_s_median"])
            scope = "any dtype" if dtype is None else dtype
            out[f"{config} {scope}: ours fastest ({best_ours['dtype']} {best_ours['mode']}) / hf fastest compiled "
                f"({best_hf['model']} {best_hf['dtype']})"] = round(
                best_ours["tokens_per_s_median"] / best_hf["tokens_per_s_median"], 3)
    before = {r["variant"]: r["tokens_per_s_median"] for r in trainer_rows if r["tree"] == "before"}
    as_its_study = {r["tree"]: r for r in trainer_rows if r.get("as_that_study_runs")}
    if len(as_its_study) == 2:
        after_row, before_row = as_its_study["after"], as_its_study["before"]
        out[f"trainer as its study flags run it: after {after_row['variant']} / before {before_row['variant']}"] = \
            round(after_row["tokens_per_s_median"] / before_row["tokens_per_s_median"], 3)
    for r in trainer_rows:
        for variant, rate in before.items():
            if r["tree"] == "after":
                out[f"trainer after {r['variant']} / before {variant}"] = round(r["tokens_per_s_median"] / rate, 3)
    if len(layout_rows) == 2:
        side_by_side, one_after_another = layout_rows
        out[f"layout: {side_by_side['layout']} / {one_after_another['layout']}"] = round(
            side_by_side["total_tokens_per_s_median"] / one_after_another["total_tokens_per_s_median"], 3)
    return out


def print_table(rows, columns):
    if not rows:
        return
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(str(r[c]).ljust(w) for c, w in zip(columns, widths)))


def write_csv(path: Path, rows):
    rows = [{k: v for k, v in row.items() if k != "per_repeat"} for row in rows]
    if rows:
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", nargs="+", default=["model", "trainer"],
                        choices=["model", "trainer", "layout", "profile", "attention"],
                        help="layout (not in the default): the study's runs side by side, one thread each, against "
                             "one after another with all threads; profile (not in the default): where our step's "
                             "time goes, by op")
    parser.add_argument("--before", default="main", help="git revision whose model and trainer are 'before'")
    parser.add_argument("--shapes", nargs="+", default=[f"{STUDY_CONFIG}:16:128", "configs/llama_130m.json:1:256"],
                        help="config:batch:seq_len for the model section")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    parser.add_argument("--compile_mode", default=None, help="torch.compile mode (default: torch's default)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timed repeats per variant")
    parser.add_argument("--steps", type=int, default=1, help="steps per timed repeat")
    parser.add_argument("--attention_shapes", nargs="+", default=["16:4:128:32", "1:12:256:64", "4:4:512:32"],
                        help="B:H:T:D shapes for the attention section (default: the study's, 130M's, 512 tokens)")
    parser.add_argument("--profile_top", type=int, default=12, help="ops listed per variant by the profile section")
    parser.add_argument("--trainer_config", default=STUDY_CONFIG)
    parser.add_argument("--trainer_dtype", default=None, choices=["float32", "bfloat16", "mixed"],
                        help="default: the study's own dtype (mixed unless the study says otherwise; see "
                             "utils/compare_norms.py)")
    parser.add_argument("--before_flags", default="same", choices=["same", "own"],
                        help="trainer section: 'same' runs the before tree with today's study flags (the code's "
                             "speed alone); 'own' with the flags of its own utils/compare_norms.py, dtype and "
                             "packing included (the study as it ran at --before)")
    parser.add_argument("--trainer_steps", type=int, default=12)
    parser.add_argument("--trainer_warmup", type=int, default=2, help="updates left out of the trainer's median")
    parser.add_argument("--trainer_repeats", type=int, default=3)
    parser.add_argument("--trainer_threads", type=int, default=1, help="OMP_NUM_THREADS of each trainer run")
    parser.add_argument("--trainer_variants", nargs="+", default=list(TRAINER_VARIANTS), choices=TRAINER_VARIANTS,
                        help="eager or compiled (--compile), whatever the study's own mode; each run for both "
                             "trees, and each row says whether its mode is the study's")
    parser.add_argument("--layout_cores", type=int, default=2,
                        help="cores the layout section shares out (the study's --jobs; this machine has 2)")
    parser.add_argument("--out", default=str(REPO / "runs" / "benchmark_model"))
    parser.add_argument("--quick", action="store_true", help="tiny config and budget: checks that everything runs")
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    args.study_flags = study_trainer_flags()
    if args.quick:
        args.shapes, args.modes, args.repeats, args.steps = ["configs/llama_tiny.json:2:32"], ["eager"], 1, 1
        args.trainer_config, args.trainer_steps, args.trainer_warmup = "configs/llama_tiny.json", 3, 1
        args.trainer_repeats, args.trainer_variants = 1, ["eager"]
        args.attention_shapes = ["2:2:16:8"]
    for shape in args.shapes:
        parts = shape.split(":")
        if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
            parser.error(f"--shapes {shape!r}: expected config:batch:seq_len")
        if not (REPO / parts[0]).is_file() and not Path(parts[0]).is_file():
            parser.error(f"--shapes {shape!r}: no such config {parts[0]}")
    for shape in args.attention_shapes:
        parts = shape.split(":")
        if len(parts) != 4 or not all(part.isdigit() and int(part) > 0 for part in parts):
            parser.error(f"--attention_shapes {shape!r}: expected four positive integers B:H:T:D")
    for name in ("repeats", "steps", "profile_top", "trainer_steps", "trainer_repeats", "trainer_threads",
                 "layout_cores"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)}: must be at least 1")
    if args.trainer_warmup >= args.trainer_steps:
        parser.error(f"--trainer_warmup {args.trainer_warmup}: must be below --trainer_steps {args.trainer_steps}")
    if subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{args.before}^{{commit}}"], cwd=REPO,
                      capture_output=True).returncode != 0:
        parser.error(f"--before {args.before!r}: not a git revision of {REPO}")
    return args


def main(argv=None):
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    before_module = load_model_module(args.before) if "before" in args.models else None
    # As the trainer does on CPU; it serves every model of a section alike.
    host_memory = "freed memory kept for reuse" if keep_freed_host_memory() else "allocator as configured"
    header = {"machine": machine(), "host_memory": host_memory,
              "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
              "before": args.before, "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    print(f"machine: {header['machine']}; host memory: {host_memory}", flush=True)
    model_rows = model_section(args, before_module) if "model" in args.sections else []
    trainer_rows = trainer_section(args) if "trainer" in args.sections else []
    layout_rows = layout_section(args) if "layout" in args.sections else []
    profile_rows = profile_section(args) if "profile" in args.sections else []
    attention_rows = attention_section(args) if "attention" in args.sections else []
    summary = ratios(model_rows, trainer_rows, layout_rows)
    print("\nmodel step (tokens/s; median, min-max over interleaved repeats)")
    print_table(model_rows, ["config", "batch", "seq_len", "dtype", "model", "mode", "tokens_per_s_median",
                             "tokens_per_s_min", "tokens_per_s_max"])
    print("\ntrainer (tokens/s from metrics.jsonl; median over runs of the per-run median)")
    print_table(trainer_rows, ["tree", "variant", "study_flags_of", "as_that_study_runs", "dtype", "packing",
                               "threads", "tokens_per_s_median", "tokens_per_s_min", "tokens_per_s_max",
                               "wall_s_median"])
    print("\nlayout (total training tokens/s of the machine; median over repeats, min-max)")
    print_table(layout_rows, ["layout", "dtype", "variant", "total_tokens_per_s_median", "total_tokens_per_s_min",
                              "total_tokens_per_s_max"])
    print("\nprofile (our step; self CPU time per step, share of the step's total)")
    print_table(profile_rows, ["dtype", "mode", "op", "self_ms_per_step", "share", "calls_per_step"])
    print("\nattention alone (ms per forward + backward; median, min-max over interleaved repeats)")
    print_table(attention_rows, ["shape", "dtype", "kernel", "ms_median", "ms_min", "ms_max"])
    print("\nratios")
    for key, value in summary.items():
        print(f"  {key}: {value}")
    write_csv(out / "model.csv", model_rows)
    write_csv(out / "trainer.csv", trainer_rows)
    write_csv(out / "layout.csv", layout_rows)
    write_csv(out / "profile.csv", profile_rows)
    write_csv(out / "attention.csv", attention_rows)
    (out / "benchmark.json").write_text(json.dumps({**header, "model": model_rows, "trainer": trainer_rows,
                                                    "layout": layout_rows, "profile": profile_rows,
                                                    "attention": attention_rows, "ratios": summary}, indent=2))
    print(f"\nwrote {out / 'benchmark.json'}")


if __name__ == "__main__":
    main()
