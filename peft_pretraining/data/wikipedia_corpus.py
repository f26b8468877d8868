"""The Wikipedia corpus (`--dataset wikipedia`): built from its public source, read, and its byte-level BPE tokenizer
(`--tokenizer wikipedia`).

The text is not in this repository (CC BY-SA 3.0, 37 MB): it is read from ../shared/data/wikipedia beside the
repository, or from the folder that the WIKIPEDIA_DATA_DIR environment variable names. Any folder of the same shape
works: `train/` holding C4-style JSON lines (`{"text": ...}` per line, optionally gzipped) and `validation.jsonl.gz`
beside it. Build it from the WikiExtractor output it comes from (folder text/AA of the GitHub repository
jason-feng/wikiVisual at commit 1c0fac9; docs/data.md says how to get it) with

    python -m peft_pretraining.wikipedia_corpus build-corpus --source .../wikiVisual/text/AA --out DIR

The tokenizer in data/tokenizer_wikipedia/ is trained on the train split only and is committed; rebuild it
byte-identically with

    python -m peft_pretraining.wikipedia_corpus build-tokenizer
"""
from __future__ import annotations

import gzip
import html
import json
import os
import pathlib
import re
import shutil
import tempfile
from typing import Iterator

from peft_pretraining.cli import OneLineErrorParser
from peft_pretraining.data.embedded_corpus import DATA_DIR, REPO_ROOT, train_tokenizer

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
SINGLE_PASS_UPDATES = {(16, 128): {1: 11_076, 2: 11_095, 3: 11_081},
                       (64, 256): {1: 1_384, 2: 1_386, 3: 1_385}}  # depth_sweep's wikipedia_gpu (2026-12-02)
VALIDATION_FILE = "validation.jsonl.gz"
TRAIN_FOLDER = "train"
SOURCE = ("5,907 English Wikipedia articles (CC BY-SA 3.0), WikiExtractor output of the GitHub repository "
          "jason-feng/wikiVisual (text/AA, commit 1c0fac9)")
# The build from WikiExtractor output: the source's files, the articles kept and how they are split.
SOURCE_FILES = "wiki_*"
MIN_ARTICLE_CHARS = 200  # shorter articles are left out, counted in characters of the text that would be kept
VALIDATION_EVERY = 20  # the 20th, 40th, ... article in page-id order is held out whole
TRAIN_SHARDS = 10
_DOC_HEADER = re.compile(r'<doc id="(\d+)" url="([^"]*)" title="([^"]*)">')
_DOC_END = "</doc>"
_BLANK_RUN = re.compile(r"\n{3,}")


def wikipedia_dir() -> pathlib.Path:
    """The corpus folder: $WIKIPEDIA_DATA_DIR when set, else ../shared/data/wikipedia beside the repository."""
    return pathlib.Path(os.environ.get(DATA_DIR_VARIABLE) or DEFAULT_WIKIPEDIA_DIR)


def absent_message(folder: pathlib.Path) -> str:
    return (f"the Wikipedia corpus is not at {folder}: it is {SOURCE}, kept outside the repository; build it there "
            f"with `python -m peft_pretraining.wikipedia_corpus build-corpus --source <wikiVisual>/text/AA --out "
            f"{folder}` (docs/data.md), or set {DATA_DIR_VARIABLE} to any folder of the same shape "
            f"(train/*.jsonl[.gz] of C4-style {{\"text\"}} lines and {VALIDATION_FILE} beside it)")


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


def article_text(lines: list[str], title: str) -> str:
    """An article's text from its lines inside `<doc>`: the first line dropped when it repeats the title, trailing
    whitespace removed from every line, each run of blank lines made one blank line, the ends stripped."""
    if lines and lines[0] == title:
        lines = lines[1:]
    return _BLANK_RUN.sub("\n\n", "\n".join(line.rstrip() for line in lines)).strip()


def read_wikiextractor_file(path: pathlib.Path) -> Iterator[tuple[int, dict]]:
    """(page id, {"text", "title", "url"}) for each `<doc id= url= title=>` ... `</doc>` article of one file.

    The header's attributes are XML-escaped, so the title is unescaped before it is compared with the first line."""
    header, lines = None, []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            line = line.removesuffix("\n")
            opening = _DOC_HEADER.fullmatch(line)
            if opening:
                if header:
                    raise ValueError(f"{path.name}:{number}: a <doc> opens before line {header[0]}'s is closed")
                header, lines = (number, opening), []
            elif line == _DOC_END:
                if not header:
                    raise ValueError(f"{path.name}:{number}: {_DOC_END} without a <doc> header before it")
                page_id, url, title = header[1].groups()
                title = html.unescape(title)
                yield int(page_id), {"text": article_text(lines, title), "title": title, "url": html.unescape(url)}
                header = None
            elif header:
                lines.append(line)
            elif line.strip():
                raise ValueError(f"{path.name}:{number}: text outside <doc> ... {_DOC_END}")
    if header:
        raise ValueError(f"{path.name}: the <doc> at line {header[0]} is never closed")


def split_articles(records: list[dict]) -> tuple[list[list[dict]], list[dict]]:
    """(train shards, validation) of the articles in page-id order: every VALIDATION_EVERY-th article is held out,
    and the rest are dealt in turn to TRAIN_SHARDS shards (article k of the train split to shard k % TRAIN_SHARDS)."""
    validation = records[VALIDATION_EVERY - 1::VALIDATION_EVERY]
    train = [record for index, record in enumerate(records, 1) if index % VALIDATION_EVERY]
    return [train[shard::TRAIN_SHARDS] for shard in range(TRAIN_SHARDS)], validation


def write_corpus_file(path: pathlib.Path, records: list[dict]) -> None:
    """JSON lines in a byte-reproducible gzip: mtime 0, the file's own name (without .gz) in the header, level 9,
    and the whole text compressed in one call, since zlib's output also depends on how its input is cut."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    with gzip.GzipFile(path, mode="wb", compresslevel=9, mtime=0) as compressed:
        compressed.write(text.encode("utf-8"))


def train_shard_name(shard: int) -> str:
    return f"wiki_{shard:02d}.jsonl.gz"


def build_corpus(source: pathlib.Path, out: pathlib.Path) -> dict:
    """Write the corpus (train/wiki_00..09.jsonl.gz and validation.jsonl.gz) from WikiExtractor output.

    Every file is byte-reproducible. The files are written to a fresh folder beside `out` and moved into place at
    the end, so a failed build leaves nothing behind; `out` must be new or empty."""
    from tqdm.auto import tqdm

    source, out = pathlib.Path(source), pathlib.Path(out)
    if not source.is_dir():
        raise ValueError(f"--source {source}: no such folder (give the folder text/AA of jason-feng/wikiVisual)")
    files = sorted(path for path in source.glob(SOURCE_FILES) if path.is_file())
    if not files:
        raise ValueError(f"--source {source}: no WikiExtractor {SOURCE_FILES} files (give the folder text/AA of "
                         "jason-feng/wikiVisual)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out}: exists and is not an empty folder; the corpus is only written to a new or "
                         "empty folder, so that nothing already there is overwritten")
    articles = []
    # leave=False: a bad file's error is then the only line left on the terminal
    with tqdm(files, desc="reading WikiExtractor files", unit="file", leave=False) as bar:
        for path in bar:
            try:
                articles.extend(read_wikiextractor_file(path))
            except UnicodeDecodeError as error:
                raise ValueError(f"--source {source}: {path.name} is not UTF-8 text ({error})") from error
            except ValueError as error:
                raise ValueError(f"--source {source}: {error}") from error
    articles.sort(key=lambda article: article[0])
    kept = [record for _, record in articles if len(record["text"]) >= MIN_ARTICLE_CHARS]
    if len(kept) < VALIDATION_EVERY:
        raise ValueError(f"--source {source}: {len(kept)} articles of at least {MIN_ARTICLE_CHARS} characters, "
                         f"fewer than the {VALIDATION_EVERY} needed to hold out one for validation")
    shards, validation = split_articles(kept)
    outputs = {pathlib.Path(TRAIN_FOLDER, train_shard_name(shard)): records for shard, records in enumerate(shards)}
    outputs[pathlib.Path(VALIDATION_FILE)] = validation
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=".wikipedia-", dir=out.parent))
    try:
        staging.chmod(0o755)  # mkdtemp's folder is private; the corpus is an ordinary folder
        for name, records in tqdm(outputs.items(), desc="writing the corpus", unit="file"):
            write_corpus_file(staging / name, records)
        if out.exists():
            out.rmdir()
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {"articles": len(articles), "kept": len(kept), "train": len(kept) - len(validation),
            "validation": len(validation)}


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

    from peft_pretraining.data.dataloader import build_train_stream

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
                                description="Build the Wikipedia corpus from its public source, or rebuild its "
                                            "tokenizer (data/tokenizer_wikipedia/).")
    commands = parser.add_subparsers(dest="command", required=True)
    corpus = commands.add_parser("build-corpus", help="convert WikiExtractor output into the corpus",
                                 description="Convert WikiExtractor output (folder text/AA of the GitHub repository "
                                             "jason-feng/wikiVisual at commit 1c0fac9) into the corpus.")
    corpus.add_argument("--source", required=True, help="the folder of WikiExtractor wiki_* files")
    corpus.add_argument("--out", default=None,
                        help=f"a new or empty folder (default: ${DATA_DIR_VARIABLE}, else {DEFAULT_WIKIPEDIA_DIR}, "
                             "where the trainer looks)")
    build = commands.add_parser("build-tokenizer", help="train the byte-level BPE on the corpus's train split")
    build.add_argument("--corpus", default=None,
                       help=f"corpus folder (default: ${DATA_DIR_VARIABLE}, else {DEFAULT_WIKIPEDIA_DIR})")
    build.add_argument("--out_dir", default=str(WIKIPEDIA_TOKENIZER_DIR))
    build.add_argument("--vocab_size", type=int, default=WIKIPEDIA_VOCAB_SIZE)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "build-corpus":
        out = pathlib.Path(args.out) if args.out else wikipedia_dir()
        try:
            counts = build_corpus(pathlib.Path(args.source), out)
        except ValueError as error:
            parser.error(str(error))
        print(f"{counts['kept']:,} of {counts['articles']:,} articles kept (the rest under {MIN_ARTICLE_CHARS} "
              f"characters): {counts['train']:,} train in {TRAIN_SHARDS} files, {counts['validation']:,} validation, "
              f"written to {out}")
        return
    if args.vocab_size < 260:  # 256 byte symbols and the three special tokens
        parser.error(f"--vocab_size must be at least 260, got {args.vocab_size}")
    try:
        train, _ = corpus_paths(pathlib.Path(args.corpus) if args.corpus else None)
        tokenizer = build_tokenizer(train, pathlib.Path(args.out_dir), args.vocab_size)
    except ValueError as error:
        parser.error(str(error))
    print(f"{len(tokenizer):,} ids written to {args.out_dir}")

