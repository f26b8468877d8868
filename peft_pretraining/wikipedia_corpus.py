"""The Wikipedia corpus (`--dataset wikipedia`) and its byte-level BPE tokenizer (`--tokenizer wikipedia`).

The text is not in this repository (CC BY-SA 3.0, 37 MB): it is read from ../shared/data/wikipedia beside the
repository, or from the folder that the WIKIPEDIA_DATA_DIR environment variable names. Any folder of the same shape
works: `train/` holding C4-style JSON lines (`{"text": ...}` per line, optionally gzipped, e.g. WikiExtractor output
converted to JSON lines) and `validation.jsonl.gz` beside it.

The tokenizer in data/tokenizer_wikipedia/ is trained on the train split only and is committed; rebuild it
byte-identically with

    python -m peft_pretraining.wikipedia_corpus build-tokenizer
"""
from __future__ import annotations

import gzip
import json
import os
import pathlib
import shutil
import tempfile

from peft_pretraining.cli import OneLineErrorParser
from peft_pretraining.embedded_corpus import DATA_DIR, REPO_ROOT, train_tokenizer

WIKIPEDIA = "wikipedia"  # the --dataset and --tokenizer name
DATA_DIR_VARIABLE = "WIKIPEDIA_DATA_DIR"
DEFAULT_WIKIPEDIA_DIR = REPO_ROOT.parent / "shared" / "data" / "wikipedia"
WIKIPEDIA_TOKENIZER_DIR = DATA_DIR / "tokenizer_wikipedia"
# Hidden 64-128 models: the untied embedding and LM head hold 2 * V * d parameters, so V sets how much of a small
# model is lookup table rather than depth (docs/data.md#the-wikipedia-corpus-and-its-tokenizer).
WIKIPEDIA_VOCAB_SIZE = 4096
# The train split in data/tokenizer_wikipedia's tokens, EOS included (what one pass of --packing reads); measured
# once and stored, so that a report can be rewritten without the corpus (checked where the corpus is present).
TRAIN_TOKENS = 28_718_325
# {(batch_size, max_length): {seed: packed updates before the trainer's stream first repeats an article}}, one
# process, measured with updates_before_repeat (about 79% of the split: see its docstring).
SINGLE_PASS_UPDATES = {(16, 128): {1: 11_076, 2: 11_095, 3: 11_081}}
VALIDATION_FILE = "validation.jsonl.gz"
TRAIN_FOLDER = "train"
SOURCE = ("5,907 English Wikipedia articles (CC BY-SA 3.0), WikiExtractor output of the GitHub repository "
          "jason-feng/wikiVisual (text/AA, commit 1c0fac9), described in shared/data/wikipedia/PROVENANCE.md")


def wikipedia_dir() -> pathlib.Path:
    """The corpus folder: $WIKIPEDIA_DATA_DIR when set, else ../shared/data/wikipedia beside the repository."""
    return pathlib.Path(os.environ.get(DATA_DIR_VARIABLE) or DEFAULT_WIKIPEDIA_DIR)


def absent_message(folder: pathlib.Path) -> str:
    return (f"the Wikipedia corpus is not at {folder}: it is {SOURCE}, kept outside the repository; put it there, "
            f"or set {DATA_DIR_VARIABLE} to any folder of the same shape (train/*.jsonl[.gz] of C4-style "
            f"{{\"text\"}} lines, e.g. converted WikiExtractor output, and {VALIDATION_FILE} beside it)")


def corpus_paths(folder: pathlib.Path | None = None) -> tuple[pathlib.Path, pathlib.Path]:
    """(train folder, validation file) of the corpus; ValueError with absent_message when either is missing."""
    folder = folder or wikipedia_dir()
    train, validation = folder / TRAIN_FOLDER, folder / VALIDATION_FILE
    if not train.is_dir() or not validation.is_file():
        raise ValueError(absent_message(folder))
    return train, validation


def train_files(train: pathlib.Path) -> list[pathlib.Path]:
    """The train shards in name order (the order the tokenizer reads them in)."""
    files = sorted(p for p in train.iterdir() if p.name.removesuffix(".gz").endswith((".jsonl", ".json")))
    if not files:
        raise ValueError(f"{train}: no .jsonl or .jsonl.gz shards")
    return files


def read_train_texts(train: pathlib.Path) -> list[str]:
    texts = []
    for path in train_files(train):
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as handle:
            texts.extend(json.loads(line)["text"] for line in handle if line.strip())
    return texts


def build_tokenizer(train: pathlib.Path, out_dir: pathlib.Path, vocab_size: int = WIKIPEDIA_VOCAB_SIZE):
    """Train the byte-level BPE on the train split (same recipe and special ids as the embedded tokenizer).

    The files are written to a fresh folder first, then moved into out_dir, so that a failed build never leaves a
    half-written tokenizer behind."""
    out_dir = pathlib.Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=out_dir.parent))
    try:
        tokenizer = train_tokenizer(read_train_texts(train), staging, vocab_size=vocab_size)
        out_dir.mkdir(exist_ok=True)
        for path in staging.iterdir():
            os.replace(path, out_dir / path.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return tokenizer


def updates_before_repeat(tokenizer, *, batch_size: int, max_length: int, seed: int,
                          train: pathlib.Path | None = None) -> int:
    """Packed updates of the trainer's stream (one process) before the first document it reads a second time.

    The stream deals the train shards to lanes and reads them round-robin, so a lane holding fewer documents than
    the others starts its second epoch before the pass as a whole is over: a single-pass budget must stay below
    this count, not below the split's token count."""
    from tqdm.auto import tqdm

    from peft_pretraining.dataloader import build_train_stream

    train = train or corpus_paths()[0]
    stream = build_train_stream(dataset=WIKIPEDIA, dataset_path=str(train), tokenizer=tokenizer,
                                max_length=max_length, packing=True, batch_size=batch_size, seed=seed, rank=0,
                                world_size=1)
    try:
        for updates, _ in enumerate(tqdm(stream, desc=f"seed {seed}: updates before a repeat", unit="update")):
            if stream.state_dict()["epoch"] > 0:
                return updates
    finally:
        stream.close()
    raise AssertionError("unreachable: the stream is endless")


def build_parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(prog="python -m peft_pretraining.wikipedia_corpus",
                                description="Rebuild the Wikipedia tokenizer (data/tokenizer_wikipedia/).")
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build-tokenizer", help="train the byte-level BPE on the corpus's train split")
    build.add_argument("--corpus", default=None,
                       help=f"corpus folder (default: ${DATA_DIR_VARIABLE}, else {DEFAULT_WIKIPEDIA_DIR})")
    build.add_argument("--out_dir", default=str(WIKIPEDIA_TOKENIZER_DIR))
    build.add_argument("--vocab_size", type=int, default=WIKIPEDIA_VOCAB_SIZE)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.vocab_size < 260:  # 256 byte symbols and the three special tokens
        parser.error(f"--vocab_size must be at least 260, got {args.vocab_size}")
    try:
        train, _ = corpus_paths(pathlib.Path(args.corpus) if args.corpus else None)
        tokenizer = build_tokenizer(train, pathlib.Path(args.out_dir), args.vocab_size)
    except ValueError as error:
        parser.error(str(error))
    print(f"{len(tokenizer):,} ids written to {args.out_dir}")


if __name__ == "__main__":
    main()
