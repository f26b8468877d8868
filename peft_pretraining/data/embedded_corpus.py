"""The embedded Jane Austen corpus and its tokenizer: where they live and how they are built from the raw novels.

`build_embedded_corpus` writes data/embedded/{train,validation}.jsonl.gz (byte-reproducible) and trains the
byte-level BPE tokenizer in data/tokenizer/ on the train split. Reading the corpus for training and evaluation is
`peft_pretraining.data.dataloader`'s job; its documented `build-embedded` command runs this module's `main`.
"""
from __future__ import annotations

import argparse
import gzip
import io
import json
import pathlib
import re
from typing import Iterable

from peft_pretraining.cli import OneLineErrorParser

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
DATA_DIR = REPO_ROOT / "data"
EMBEDDED_DIR = DATA_DIR / "embedded"
TOKENIZER_DIR = DATA_DIR / "tokenizer"
DEFAULT_AUSTEN_SOURCE = REPO_ROOT.parent / "shared" / "data" / "austen"

VALIDATION_NOVEL = "persuasion"  # held out whole, so validation text never overlaps training text
EMBEDDED_VOCAB_SIZE = 8192
PAD_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "</s>", "<unk>"  # ids 0, 1, 2 as in t5-base
SPECIAL_TOKENS = [PAD_TOKEN, EOS_TOKEN, UNK_TOKEN]
MIN_DOCUMENT_CHARS = 700  # paragraphs of a chapter are grouped until a document has at least this many characters

_GUTENBERG_START = re.compile(r"^\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", re.IGNORECASE | re.MULTILINE)
_GUTENBERG_END = re.compile(r"^\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG.*$", re.IGNORECASE | re.MULTILINE)
_HEADING = re.compile(r"^(chapter|volume)\s+[\divxlc]+\.?$", re.IGNORECASE)


def strip_gutenberg_boilerplate(text: str) -> str:
    """Keep only the text between Project Gutenberg START/END markers when they are present."""
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end():]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    return text


def split_novel_into_documents(text: str, min_chars: int = MIN_DOCUMENT_CHARS) -> list[str]:
    """Unwrap paragraphs and group consecutive paragraphs of one chapter into documents of >= min_chars.

    Chapter/volume headings close the current document and are dropped, so no document spans two chapters;
    the last document of a chapter may be shorter than min_chars (that variety is what padding has to handle).
    """
    text = strip_gutenberg_boilerplate(text.replace("\r\n", "\n"))
    documents, current = [], []

    def close():
        if current:
            documents.append("\n".join(current))
            current.clear()

    for block in re.split(r"\n\s*\n", text):
        paragraph = " ".join(line.strip() for line in block.strip().splitlines())
        paragraph = re.sub(r" {2,}", " ", paragraph)
        if not paragraph:
            continue
        if _HEADING.match(paragraph):
            close()
            continue
        current.append(paragraph)
        if sum(len(p) for p in current) >= min_chars:
            close()
    close()
    return documents


def write_jsonl_gz(path: pathlib.Path, records: Iterable[dict]) -> None:
    """Byte-reproducible gzip (mtime 0, no file name in the header)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
        with io.TextIOWrapper(gz, encoding="utf-8", newline="\n") as out:
            for record in records:
                out.write(json.dumps(record, ensure_ascii=False) + "\n")


def build_embedded_corpus(source: str | pathlib.Path, out_dir: str | pathlib.Path = EMBEDDED_DIR,
                          tokenizer_dir: str | pathlib.Path | None = TOKENIZER_DIR) -> dict:
    """Write out_dir/{train,validation}.jsonl.gz from the six *.txt.gz novels and train the tokenizer on train."""
    source, out_dir = pathlib.Path(source), pathlib.Path(out_dir)
    novels = sorted(source.glob("*.txt.gz"))
    if not novels:
        raise ValueError(f"--source {source}: no *.txt.gz novels found")
    names = [p.name[: -len(".txt.gz")] for p in novels]
    if VALIDATION_NOVEL not in names:
        raise ValueError(f"--source {source}: the validation novel {VALIDATION_NOVEL}.txt.gz is missing")
    splits: dict[str, list[dict]] = {"train": [], "validation": []}
    for name, path in zip(names, novels):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            documents = split_novel_into_documents(f.read())
        split = "validation" if name == VALIDATION_NOVEL else "train"
        splits[split].extend({"text": doc, "source": name} for doc in documents)
    for split, records in splits.items():
        write_jsonl_gz(out_dir / f"{split}.jsonl.gz", records)
    summary = {split: {"documents": len(rows), "characters": sum(len(row["text"]) for row in rows)}
               for split, rows in splits.items()}
    if tokenizer_dir is not None:
        train_tokenizer([r["text"] for r in splits["train"]], tokenizer_dir)
    return summary


def train_tokenizer(texts: list[str], out_dir: str | pathlib.Path, vocab_size: int = EMBEDDED_VOCAB_SIZE):
    """Byte-level BPE (lossless round trip, no unknown characters), saved as a PreTrainedTokenizerFast directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(texts, trainer=trainer)
    if backend.get_vocab_size() != vocab_size:
        raise ValueError(f"tokenizer training produced {backend.get_vocab_size()} ids, expected {vocab_size}")
    eos_id = backend.token_to_id(EOS_TOKEN)
    # Mirror t5-base: encoding with special tokens appends </s>.
    backend.post_processor = processors.TemplateProcessing(single=f"$A {EOS_TOKEN}",
                                                           pair=f"$A {EOS_TOKEN} $B {EOS_TOKEN}",
                                                           special_tokens=[(EOS_TOKEN, eos_id)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN,
                                        unk_token=UNK_TOKEN, model_max_length=1024)
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


# ----------------------------------------------------------------------------------------------------------------
# CLI (run as `python -m peft_pretraining.dataloader`, the documented command)
# ----------------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="python -m peft_pretraining.dataloader",
                                description="Data pipeline: the embedded Jane Austen corpus and its tokenizer, local "
                                            "files, and hub datasets (C4).")
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build-embedded", help="rebuild data/embedded/* and data/tokenizer/ from the novels")
    build.add_argument("--source", default=str(DEFAULT_AUSTEN_SOURCE), help="folder with the six *.txt.gz novels")
    build.add_argument("--out_dir", default=str(EMBEDDED_DIR))
    build.add_argument("--tokenizer_dir", default=str(TOKENIZER_DIR))
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not pathlib.Path(args.source).is_dir():
        parser.error(f"--source {args.source}: not a directory")
    try:
        summary = build_embedded_corpus(args.source, args.out_dir, args.tokenizer_dir)
    except ValueError as error:
        parser.error(str(error))
    print(json.dumps(summary, indent=2))
