"""Is the data loader fast enough? Loader tokens/s vs training tokens/s, and useful-token fractions.

Loader: the embedded corpus, padding and packing, `--loader_batches` micro-batches of `--batch_size` x `--max_length`
(token slots per second, the rate the trainer consumes them). Training: forward + backward + AdamW step of the
`--config` model in fp32 on this machine, timed after one warm-up step. Target: loader >= 10x training.

    python utils/benchmark_dataloader.py            # defaults: llama_130m, max_length 256, batch 64
"""
import argparse
import json
import pathlib
import sys
import time

import torch
from tqdm import tqdm

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from peft_pretraining import dataloader as data  # noqa: E402


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
    from peft_pretraining.modeling_llama import LlamaForCausalLM, build_config

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/llama_130m.json")
    parser.add_argument("--max_length", type=int, default=256)
    parser.add_argument("--batch_size", type=int, default=64, help="loader micro-batch")
    parser.add_argument("--loader_batches", type=int, default=40)
    parser.add_argument("--num_workers", type=int, default=0)
    parser.add_argument("--train_batch_size", type=int, default=4, help="training micro-batch (CPU: keep it small)")
    parser.add_argument("--train_steps", type=int, default=2)
    parser.add_argument("--output_json", default=None, help="also write the figures to this JSON file")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
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
