"""Is the data loader fast enough? Loader tokens/s vs training tokens/s, and useful-token fractions.

Loader: the embedded corpus, padding and packing, `--loader_batches` micro-batches of `--batch_size` x `--max_length`
(token slots per second, the rate the trainer consumes them). Training: forward + backward + AdamW step of the
`--config` model in fp32 on this machine, timed after one warm-up step. Target: loader >= 10x training.

    python utils/bench/benchmark_dataloader.py            # defaults: llama_130m, max_length 256, batch 64

Streaming reader (`--streaming`): on a local fixture of `--shards` jsonl.gz shards made in a temporary folder,
documents read from the files per document used over one epoch (read amplification) for several `--workers`, and the
time from `load_state_dict` at a late position (`--resume_at` of the epoch) to the first batch. `--compare_with OLD.py`
runs the same measurements with another version of peft_pretraining/data/dataloader.py, interleaved with this one:

    git show <commit>:peft_pretraining/data/dataloader.py > /tmp/dataloader_old.py
    python utils/bench/benchmark_dataloader.py --streaming --compare_with /tmp/dataloader_old.py
"""
import argparse
import gzip
import importlib.util
import json
import multiprocessing
import pathlib
import statistics
import tempfile
import time

import torch
from tqdm import tqdm

from peft_pretraining.cli import OneLineErrorParser
from peft_pretraining.data import dataloader as data


def measure_loader(tokenizer, *, packing: bool, max_length: int, batch_size: int, batches: int,
                   num_workers: int) -> dict:
    stream = data.build_train_stream(dataset=data.EMBEDDED, dataset_path=None, tokenizer=tokenizer,
                                     max_length=max_length, packing=packing, batch_size=batch_size, seed=0, rank=0,
                                     world_size=1, num_workers=num_workers)
    started = time.perf_counter()
    first = next(stream)  # includes start-up (reading the corpus, starting workers)
    startup_s = time.perf_counter() - started
    slots, useful = first["input_ids"].numel(), int(first["attention_mask"].sum())
    started = time.perf_counter()
    for _ in tqdm(range(batches), desc=f"loader ({'packing' if packing else 'padding'})", leave=False):
        batch = next(stream)
        slots += batch["input_ids"].numel()
        useful += int(batch["attention_mask"].sum())
    elapsed = time.perf_counter() - started
    stream.close()
    return {"tokens_per_s": batches * batch_size * max_length / elapsed, "startup_s": startup_s,
            "useful_fraction": useful / slots}


def measure_training(config_path: str, *, max_length: int, batch_size: int, steps: int, vocab_limit: int) -> dict:
    from peft_pretraining.model.modeling_llama import LlamaForCausalLM, build_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(build_config(config_path, norm_type="pre"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    input_ids = torch.randint(0, vocab_limit, (batch_size, max_length))

    def step():
        loss = model(input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up: allocations, AdamW state
    started = time.perf_counter()
    for _ in tqdm(range(steps), desc="training steps", leave=False):
        step()
    elapsed = time.perf_counter() - started
    return {"tokens_per_s": steps * batch_size * max_length / elapsed,
            "parameters": sum(p.numel() for p in model.parameters()), "seconds_per_step": elapsed / steps}


# ----------------------------------------------------------------------------------------------------------------
# Streaming reader: read amplification and resume time
# ----------------------------------------------------------------------------------------------------------------
READS = None  # documents produced by the files, shared with DataLoader workers (fork)


def _count_read(example):
    with READS.get_lock():
        READS.value += 1
    return example


def write_fixture(folder: pathlib.Path, shards: int, documents_per_shard: int) -> list[str]:
    """C4-like shards: jsonl.gz records with text, timestamp and url; ~100-word documents of varying length."""
    files = []
    for shard in range(shards):
        path = folder / f"c4-train.{shard:05d}-of-{shards:05d}.json.gz"
        with gzip.open(path, "wt", encoding="utf-8") as f:
            for i in range(documents_per_shard):
                words = " ".join(f"w{shard}_{i}_{j}" for j in range(40 + (i * 37) % 120))
                row = {"text": f"Document {i} of shard {shard}. {words}", "timestamp": "2019-04-25T12:00:00Z",
                       "url": f"https://example.com/{shard}/{i}"}
                f.write(json.dumps(row) + "\n")
        files.append(str(path))
    return files


def load_dataloader_module(path: str | None):
    if path is None:
        return data
    spec = importlib.util.spec_from_file_location("dataloader_compared", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _streaming_train_stream(module, files, tokenizer, *, num_workers: int, batch_size: int, max_length: int):
    import datasets

    dataset = datasets.load_dataset("json", data_files=files, split="train", streaming=True)
    dataset = dataset.select_columns(["text"]).map(_count_read)
    source = module.StreamingSource(dataset, seed=0, rank=0, world_size=1)
    return module.TrainStream(source, tokenizer, max_length=max_length, packing=False, batch_size=batch_size,
                              num_workers=num_workers)


def measure_read_amplification(module, files, tokenizer, *, num_workers: int, skip_batches: int, batches: int,
                               batch_size: int, max_length: int) -> float:
    """Documents read per document used over `batches` batches after the first `skip_batches`.

    Starting after a warm-up leaves out the fixed read-ahead (shuffle buffers or blocks, prefetched chunks), which
    is negligible in a real run; what remains is the steady-state cost of every document used.
    """
    stream = _streaming_train_stream(module, files, tokenizer, num_workers=num_workers, batch_size=batch_size,
                                     max_length=max_length)
    for _ in range(skip_batches):
        next(stream)
    reads_before = READS.value
    for _ in range(batches):
        next(stream)
    reads = READS.value - reads_before
    stream.close()
    return reads / (batches * batch_size)


def measure_resume(module, files, tokenizer, state: dict, *, num_workers: int, batch_size: int,
                   max_length: int) -> dict:
    """Seconds from a fresh stream + load_state_dict to the first batch, and documents read meanwhile."""
    READS.value = 0
    started = time.perf_counter()
    stream = _streaming_train_stream(module, files, tokenizer, num_workers=num_workers, batch_size=batch_size,
                                     max_length=max_length)
    stream.load_state_dict(state)
    next(stream)
    seconds = time.perf_counter() - started
    stream.close()
    return {"seconds": seconds, "documents_read": READS.value}


def run_streaming(args) -> None:
    global READS
    READS = multiprocessing.Value("l", 0)
    tokenizer = data.load_tokenizer(data.EMBEDDED)
    versions = {"this": data}
    if args.compare_with:
        versions["compared"] = load_dataloader_module(args.compare_with)
    total = args.shards * args.documents_per_shard
    late_batches = int(total * args.resume_at) // args.batch_size
    epoch_batches = total // args.batch_size
    figures = {name: {"read_amplification": {}, "resume": []} for name in versions}
    with tempfile.TemporaryDirectory() as folder:
        files = write_fixture(pathlib.Path(folder), args.shards, args.documents_per_shard)
        states = {}
        for name, module in versions.items():  # the late position, reached once per version (workers 0)
            stream = _streaming_train_stream(module, files, tokenizer, num_workers=0, batch_size=args.batch_size,
                                             max_length=args.max_length)
            for _ in tqdm(range(late_batches), desc=f"{name}: to the late position", leave=False):
                next(stream)
            states[name] = json.loads(json.dumps(stream.state_dict()))
            stream.close()
        for _ in tqdm(range(args.repeats), desc="repeats", leave=False):
            for workers in args.workers:
                for name, module in versions.items():
                    ratio = measure_read_amplification(module, files, tokenizer, num_workers=workers,
                                                       skip_batches=epoch_batches // 2, batches=epoch_batches,
                                                       batch_size=args.batch_size, max_length=args.max_length)
                    figures[name]["read_amplification"].setdefault(str(workers), []).append(ratio)
            for name, module in versions.items():
                figures[name]["resume"].append(measure_resume(module, files, tokenizer, states[name],
                                                              num_workers=args.resume_workers,
                                                              batch_size=args.batch_size, max_length=args.max_length))
    print(f"fixture: {args.shards} shards x {args.documents_per_shard} documents; batch {args.batch_size} x "
          f"{args.max_length}; {args.repeats} repeats (median, min-max); torch threads {torch.get_num_threads()}")
    for name in versions:
        label = "this version" if name == "this" else f"compared ({args.compare_with})"
        for workers, ratios in figures[name]["read_amplification"].items():
            print(f"{label:>40s}: workers {workers}: {statistics.median(ratios):.3f} documents read per document "
                  f"used ({min(ratios):.3f}-{max(ratios):.3f}; one epoch of documents used after half an epoch)")
        seconds = [r["seconds"] for r in figures[name]["resume"]]
        print(f"{label:>40s}: resume at {args.resume_at:.0%} of the epoch ({late_batches * args.batch_size} "
              f"documents in), workers {args.resume_workers}: {statistics.median(seconds):.2f} s to the first batch "
              f"({min(seconds):.2f}-{max(seconds):.2f}), {figures[name]['resume'][0]['documents_read']} documents read")
    if args.output_json:
        pathlib.Path(args.output_json).write_text(json.dumps({"args": vars(args), "figures": figures}, indent=2))


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/llama_130m.json")
    parser.add_argument("--max_length", type=int, default=256)
    parser.add_argument("--batch_size", type=int, default=64, help="loader micro-batch")
    parser.add_argument("--loader_batches", type=int, default=40)
    parser.add_argument("--num_workers", type=int, default=0)
    parser.add_argument("--train_batch_size", type=int, default=4, help="training micro-batch (CPU: keep it small)")
    parser.add_argument("--train_steps", type=int, default=2)
    parser.add_argument("--output_json", default=None, help="also write the figures to this JSON file")
    streaming = parser.add_argument_group("streaming reader (--streaming)")
    streaming.add_argument("--streaming", action="store_true", help="measure the streaming reader instead")
    streaming.add_argument("--shards", type=int, default=16)
    streaming.add_argument("--documents_per_shard", type=int, default=2000)
    streaming.add_argument("--workers", type=int, nargs="+", default=[0, 2, 4])
    streaming.add_argument("--resume_at", type=float, default=0.9, help="fraction of the epoch used before resuming")
    streaming.add_argument("--resume_workers", type=int, default=2)
    streaming.add_argument("--repeats", type=int, default=3)
    streaming.add_argument("--compare_with", default=None,
                           help="another version of peft_pretraining/data/dataloader.py")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag in ("max_length", "batch_size", "loader_batches", "train_batch_size", "train_steps", "shards",
                 "documents_per_shard", "repeats"):
        minimum = 2 if flag == "max_length" else 1
        if getattr(args, flag) < minimum:
            parser.error(f"--{flag} must be >= {minimum}, got {getattr(args, flag)}")
    for flag, counts in (("num_workers", [args.num_workers]), ("workers", args.workers),
                         ("resume_workers", [args.resume_workers])):
        if min(counts) < 0:
            parser.error(f"--{flag} must be >= 0, got {getattr(args, flag)}")
    if args.streaming and args.shards * args.documents_per_shard < args.batch_size:
        parser.error(f"--shards x --documents_per_shard ({args.shards * args.documents_per_shard} documents) must "
                     f"fill one --batch_size {args.batch_size}")
    if args.streaming:
        if args.compare_with and not pathlib.Path(args.compare_with).is_file():
            parser.error(f"--compare_with {args.compare_with}: no such file")
        if not 0 < args.resume_at < 1:
            parser.error(f"--resume_at must be in (0, 1), got {args.resume_at}")
        run_streaming(args)
        return
    if not pathlib.Path(args.config).is_file():
        parser.error(f"--config {args.config}: no such file")

    tokenizer = data.load_tokenizer(data.EMBEDDED)
    loader = {mode: measure_loader(tokenizer, packing=mode == "packing", max_length=args.max_length,
                                   batch_size=args.batch_size, batches=args.loader_batches,
                                   num_workers=args.num_workers) for mode in ("padding", "packing")}
    training = measure_training(args.config, max_length=args.max_length, batch_size=args.train_batch_size,
                                steps=args.train_steps, vocab_limit=len(tokenizer))
    print(f"device: cpu, torch threads {torch.get_num_threads()}, max_length {args.max_length}")
    for mode, figures in loader.items():
        print(f"loader {mode:8s}: {figures['tokens_per_s']:12,.0f} tokens/s (batch {args.batch_size}, "
              f"{args.num_workers} workers, start-up {figures['startup_s']:.2f} s), "
              f"useful (non-pad) fraction {figures['useful_fraction']:.3f}")
    print(f"training {args.config} ({training['parameters'] / 1e6:.1f}M params, fp32, batch {args.train_batch_size}): "
          f"{training['tokens_per_s']:,.0f} tokens/s ({training['seconds_per_step']:.2f} s/step)")
    for mode, figures in loader.items():
        ratio = figures["tokens_per_s"] / training["tokens_per_s"]
        print(f"loader/training ratio ({mode}): {ratio:,.0f}x  [{'OK' if ratio >= 10 else 'BELOW'} target >= 10x]")
    if args.output_json:
        pathlib.Path(args.output_json).write_text(json.dumps({"args": vars(args), "loader": loader,
                                                              "training": training}, indent=2))


if __name__ == "__main__":
    main()
