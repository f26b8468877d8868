"""How many processes a GPU recipe starts, and whether it compiles: the decision behind run_130m.sh ... run_1b.sh.

    python utils/gpu/gpu_processes.py SCRIPT RECIPE_PROCESSES -- TRAINER_FLAGS...

prints "PROCESSES COMPILE" (COMPILE is 1 or 0) on stdout and the reason on stderr; a machine or NPROC that cannot run
the recipe is one line on stderr and exit 2, before any rank starts. TRAINER_FLAGS are the script's flags followed by
the user's, so a user's --batch_size or --device counts.

- NPROC unset: the recipe's process count or the visible GPUs, whichever is fewer, lowered further if needed until
  the total batch divides evenly. The trainer then keeps --total_batch_size through gradient accumulation, so a
  1-GPU run of the 8-GPU 1B recipe is the same run (accumulation 16 instead of 2).
- NPROC set: used as given; more than the visible GPUs is refused.
- No CUDA device: refused, pointing to run_tiny.sh, unless --device cpu is passed (tests and debugging with a tiny
  --model_config); a CPU run starts NPROC processes (default 1) and does not compile, as the trainer's CPU defaults.
- Compiled by default on CUDA (2-3x the eager step, the same math; docs/benchmarks.md); --no_compile opts out.
"""
import argparse
import os
import sys


class RecipeRefused(Exception):
    """One line for the user; exit 2."""


def plan_processes(*, recipe_processes: int, requested: int | None, visible_gpus: int, batch_size: int,
                   total_batch_size: int, device: str) -> tuple[int, str]:
    """(processes, why) for a recipe, or RecipeRefused."""
    if device == "cpu":
        return requested or 1, "--device cpu"
    if visible_gpus == 0:
        raise RecipeRefused("no CUDA device is visible; the paper's recipes need GPUs (for a CPU run: bash "
                            "run_tiny.sh NORM_TYPE, or pass --device cpu with a small --model_config)")
    if requested is not None:
        if requested > visible_gpus:
            raise RecipeRefused(f"NPROC={requested}: only {visible_gpus} CUDA device(s) are visible")
        return requested, f"NPROC={requested}"
    processes = min(recipe_processes, visible_gpus)
    while processes > 1 and total_batch_size % (batch_size * processes) != 0:
        processes -= 1  # e.g. 3 GPUs cannot share 512 sequences in micro-batches of 32
    accumulation = total_batch_size // (batch_size * processes)
    why = (f"recipe {recipe_processes}, {visible_gpus} GPU(s) visible; {batch_size} x accumulation {accumulation} x "
           f"{processes} keeps the total batch of {total_batch_size}")
    return processes, why


def read_trainer_flags(flags: list[str]) -> argparse.Namespace:
    """The flags that decide the plan; the last occurrence wins, as in the trainer."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--batch_size", type=int)
    parser.add_argument("--total_batch_size", type=int)
    parser.add_argument("--device", default="auto")
    known, _ = parser.parse_known_args(flags)
    return known


def requested_processes() -> int | None:
    text = os.environ.get("NPROC", "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise RecipeRefused(f"NPROC={text!r}: expected a positive process count")
    return int(text)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    script, recipe_processes, separator, *flags = argv
    assert separator == "--", "usage: gpu_processes.py SCRIPT RECIPE_PROCESSES -- FLAGS..."
    trainer = read_trainer_flags(flags)
    try:
        requested = requested_processes()
        if trainer.device == "cpu":
            visible_gpus = 0
        else:
            import torch  # only here: --device cpu and a bad NPROC answer without loading torch

            visible_gpus = torch.cuda.device_count()
        processes, why = plan_processes(recipe_processes=int(recipe_processes), requested=requested,
                                        visible_gpus=visible_gpus, batch_size=trainer.batch_size,
                                        total_batch_size=trainer.total_batch_size, device=trainer.device)
    except RecipeRefused as refusal:
        print(f"{script}: error: {refusal}", file=sys.stderr)
        return 2
    print(f"{script}: processes={processes} ({why})", file=sys.stderr)
    print(processes, int(trainer.device != "cpu"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
