"""The command line every study shares: its budget, seeds, folders, parallelism, precision, device and lr."""
from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

from peft_pretraining.exit_codes import ExitCode
from utils.study.host import bf16_instructions
from utils.study.records import UnreadableRecord
from utils.study.runs import DEFAULT_DATASET, REPO, peak_lr

DTYPE_LABELS = {"float32": "float32", "mixed": "mixed precision"}  # the studies' --dtype, as reports name it

DEVICES = ("cpu", "cuda")  # the studies' --device


def add_study_arguments(parser: argparse.ArgumentParser, budgets: dict,
                        budget_help: str = "named budget (see above)") -> None:
    """The flags the studies share: the named budget, seeds, folders, parallelism, resumption, precision, device."""
    parser.add_argument("--budget", default="default", choices=sorted(budgets), help=budget_help)
    parser.add_argument("--quick", action="store_true", help="same as --budget quick (the CI smoke test)")
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="override the budget's seeds")
    parser.add_argument("--out", default=None, help="report folder (its runs/ subfolder holds the run records)")
    parser.add_argument("--runs_dir", default=None, help="where the training runs and checkpoints go")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once, one thread each (default 2: one per core)")
    parser.add_argument("--max_hours", type=float, default=None,
                        help="start no new run after this many hours; the next invocation continues")
    parser.add_argument("--report_only", action="store_true", help="write the report from the saved records")
    parser.add_argument("--plan", action="store_true",
                        help="print what this invocation would train, as JSON, and exit: the runs, those with a "
                             "record, the names of those left, the disk the largest of them writes (bytes) and the "
                             "recorded runs' seconds. Trains nothing and needs no GPU")
    parser.add_argument("--fresh", action="store_true", help="retrain and re-analyse even where records exist")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="train every run with torch.compile (the default; --no-compile trains eager): 1.5x "
                             "the tokens/s per update in mixed precision on a CPU with bf16 instructions, for 1-2 "
                             "minutes of compilation in a configuration's first run and about 10 s in later ones "
                             "(docs/benchmarks.md); compiled and eager runs are distinct records")
    parser.add_argument("--dtype", default="mixed", choices=sorted(DTYPE_LABELS),
                        help="what the runs that are not pure-bf16 arms train in. mixed (the default: bf16 autocast "
                             "over fp32 master weights) is the faster step on a CPU with bf16 instructions "
                             "(avx512_bf16 or AMX) and the slower one without them; float32 computes in fp32 on "
                             "every host, as the committed float32 records did (docs/study.md). The two are "
                             "distinct records")
    parser.add_argument("--device", default="cpu", choices=DEVICES,
                        help="where every run trains and is analysed: cpu (the default) or cuda (one GPU; --jobs "
                             "runs share it). The flags are otherwise the same; CPU and GPU records are distinct, "
                             "and a GPU setting's default folders end in _cuda")
    parser.add_argument("--lr", type=positive_float, default=None,
                        help="the peak learning rate of every run (Adam; default: the budget's, 1e-3). Another rate "
                             "trains into default folders of its own (suffix _lr<rate>), so that the points of an lr "
                             "grid keep their records apart and each gets its own report")


def resolve_study_args(parser: argparse.ArgumentParser, args, budgets: dict) -> None:
    """args.settings (the budget, over the default one), args.out and args.runs_dir; one-line errors for bad values."""
    if args.quick:
        args.budget = "quick"
    args.settings = {**budgets["default"], **budgets[args.budget]}
    rate = ""  # the folder suffix of a rate other than the budget's
    if args.lr is not None and args.lr != float(peak_lr(args.settings)):
        args.settings["lr"] = f"{args.lr:g}"
        rate = f"_lr{args.settings['lr']}"
    if args.jobs < 1:
        parser.error(f"--jobs must be positive, got {args.jobs}")
    if args.max_hours is not None and args.max_hours <= 0:
        parser.error(f"--max_hours must be positive, got {args.max_hours}")
    trains = not (args.report_only or args.plan)
    if args.device == "cuda" and trains and not cuda_available():  # a GPU's records report and plan anywhere
        parser.error("--device cuda: no CUDA device is visible on this machine")
    if trains:
        check_dataset(parser, args)
        try:  # before any run trains: without it, every analysis fails after its training (a GPU image lacked it)
            import lm_eval.tasks  # noqa: F401 (the removal analysis goes through lm-eval)
        except ImportError as err:
            parser.error(f"the removal analysis needs lm-eval, which does not import here ({err}); pip install -r "
                         "exp_requirements.txt")
    # one deadline for the whole invocation, however many collect_records calls it makes (the sweep, then its
    # probe), counted after the lm-eval import above (tens of seconds on a busy machine: not the runs' time)
    args.deadline = None if args.max_hours is None else time.time() + 3600 * args.max_hours
    # Folders are named from float32 eager, the precision and mode of the records committed before the default
    # became mixed and compiled: those keep their plain names, every other setting gets a suffix.
    variant = (("" if args.dtype == "float32" else f"_{args.dtype}") + ("_compile" if args.compile else "")
               + ("" if args.device == "cpu" else f"_{args.device}") + rate)
    args.out = Path(args.out or REPO / variant_folder(args.settings["out"], variant))
    args.runs_dir = Path(args.runs_dir or REPO / variant_folder(args.settings["runs_dir"], variant))


def note_emulated_bf16(args) -> None:
    """A note on stderr where --dtype mixed is emulated on this CPU. Each study calls it last in parse_args, after
    its own checks, so that a bad flag still gets its one line alone."""
    trains = not (args.report_only or args.plan)
    if trains and args.device == "cpu" and args.dtype == "mixed" and not bf16_instructions():
        print("note: this CPU names no bf16 instructions (avx512_bf16, amx_bf16); --dtype mixed emulates bf16 "
              "products here and trains about 3x slower than --dtype float32 (docs/study.md)", file=sys.stderr)


def parse_study_args(parser: argparse.ArgumentParser, argv, budgets: dict, overrides: tuple[str, ...] = ()):
    """A study's command line, parsed and resolved (resolve_study_args); each flag named in `overrides` that was
    given (--seeds, --depths, --widths: lists) replaces the budget's setting of the same name."""
    args = parser.parse_args(argv)
    resolve_study_args(parser, args, budgets)
    for name in overrides:
        if getattr(args, name):
            args.settings[name] = tuple(getattr(args, name))
    return args


def positive_float(text: str) -> float:
    """argparse's type for --lr: a finite number above zero."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def variant_folder(folder: str, variant: str) -> Path:
    """The budget's default folder for a --dtype or --compile variant ("docs/study" -> "docs/study_mixed";
    "runs/study_quick/report" -> "runs/study_quick_mixed/report"): its runs and records share no file with the
    default's, so a variant neither retrains over nor overwrites the committed records."""
    path = Path(folder)
    if not variant:
        return path
    if path.name == "report":
        return path.parent.with_name(path.parent.name + variant) / "report"
    return path.with_name(path.name + variant)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def check_dataset(parser: argparse.ArgumentParser, args) -> None:
    """A budget on a corpus kept outside the repository needs it before any run trains: one line if it is absent."""
    if args.settings.get("dataset", DEFAULT_DATASET) == DEFAULT_DATASET:
        return
    from peft_pretraining.data.wikipedia_corpus import corpus_paths

    try:
        corpus_paths()
    except ValueError as error:
        parser.error(f"--budget {args.budget}: {error}")


def stop_on_unreadable_record(main):
    """A study's main, exiting with one line and ExitCode.BAD_INPUT where a committed record does not read: before
    any report is written or any run trained over it."""
    @functools.wraps(main)
    def checked(argv=None) -> int:
        try:
            return main(argv)
        except UnreadableRecord as error:
            print(f"{error}; nothing was written (restore it with git, or delete it to train the run again)",
                  file=sys.stderr)
            return ExitCode.BAD_INPUT
    return checked

