"""Run records on disk: one gzipped, unindented JSON file per run, `<folder>/<run name>.json.gz`.

A record holds a run's flags, curves and every analysis; the reports read nothing else, so records are most of what
the repository stores. Gzipped compact JSON is about a third of the indented size; floats keep their full repr, so
a report rebuilt from a stored record is byte-identical to one rebuilt from the record in memory. The gzip header
carries no timestamp, so writing the same record twice gives the same bytes.

Folders written before this format hold `<run name>.json` records; they are read as they are, and

    python -m utils.study.records convert docs/study/runs ...

rewrites them in place (each is read back and compared before its old file is removed).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import re
import sys
from pathlib import Path

from peft_pretraining.cli import OneLineErrorParser

SUFFIX = ".json.gz"
OLD_SUFFIX = ".json"


def path_for(folder: Path, name: str) -> Path:
    """Where the record of run `name` is written."""
    return Path(folder) / f"{name}{SUFFIX}"


def find(folder: Path, name: str) -> Path | None:
    """The stored record of run `name`: its current file, else one in the older format, else None."""
    for path in (path_for(folder, name), Path(folder) / f"{name}{OLD_SUFFIX}"):
        if path.is_file():
            return path
    return None


def name_of(path: Path) -> str:
    """The run name of a record file, in either format."""
    name = Path(path).name
    return name[:-len(SUFFIX)] if name.endswith(SUFFIX) else Path(name).stem


def paths_in(folder: Path) -> list[Path]:
    """Every record in `folder`, sorted by run name; where a run has both formats, the current one."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = {name_of(path): path for path in folder.glob(f"*{OLD_SUFFIX}")}
    found.update({name_of(path): path for path in folder.glob(f"*{SUFFIX}")})
    return [found[name] for name in sorted(found)]


class UnreadableRecord(ValueError):
    """A record file that exists but does not read (garbage, a gzip cut short, a JSON error). It is an error, never
    an absent record: taken for absent, a report would silently drop the run and a sweep would train it again."""


def read(path: Path) -> dict:
    """A record; UnreadableRecord, naming the file, if it does not read."""
    path = Path(path)
    try:
        data = path.read_bytes()
        if path.name.endswith(SUFFIX):
            data = gzip.decompress(data)
        record = json.loads(data)
    except (OSError, EOFError, ValueError) as error:  # gzip, UTF-8 and JSON errors are ValueErrors or OSErrors
        raise UnreadableRecord(f"{path}: not a readable run record ({type(error).__name__}: {error})") from error
    if not isinstance(record, dict):
        raise UnreadableRecord(f"{path}: not a readable run record (a JSON {type(record).__name__}, not an object)")
    return record


def read_if_present(path: Path | None) -> dict | None:
    """The record at `path`, None where there is none (`find` gave None); UnreadableRecord if it does not read."""
    return read(path) if path is not None else None


@dataclasses.dataclass(frozen=True)
class RunFields:
    """What a run trained, as typed fields: the one place a record's trainer flags are read (issue 80). The flags
    stay the record's one source (the trainer's own command line, so that a run is reproduced from it); every
    reader takes its fields from here."""
    norm: str | None  # None: a flag the record's command line left out
    seed: int | None
    rate: float | None
    updates: int | None
    warmup: int | None
    batch: int | None
    length: int | None
    config: str  # the model config the run trained, as its flags name it ("" if none)
    hidden: int | None  # the config's hidden size where its name carries it (llama_h64_L24.json)
    depth: int | None  # its number of layers, likewise
    dtype: str
    compiled: bool
    device: str
    dataset: str


CONFIG_NAME = re.compile(r"llama_h(\d+)_L(\d+)\.json$")
# what a record made before its command line named them was trained with; any other flag it lacks is None
FLAG_DEFAULTS = {"--device": "cpu", "--dtype": "float32"}


def derive_fields(flags: list[str]) -> RunFields:
    """RunFields from a trainer command line (the flags a record keeps)."""
    def value(name: str, cast=str):
        text = flags[flags.index(name) + 1] if name in flags[:-1] else FLAG_DEFAULTS.get(name)
        return None if text is None else cast(text)

    config = value("--model_config") or ""
    shape = CONFIG_NAME.search(config)
    return RunFields(norm=value("--norm_type"), seed=value("--seed", int), rate=value("--lr", float),
                     updates=value("--num_training_steps", int), warmup=value("--warmup_steps", int),
                     batch=value("--batch_size", int), length=value("--max_length", int), config=config,
                     hidden=int(shape[1]) if shape else None, depth=int(shape[2]) if shape else None,
                     dtype=value("--dtype"), compiled="--compile" in flags, device=value("--device"),
                     dataset=value("--dataset"))


def fields(record: dict) -> RunFields:
    """A record's RunFields, from its flags (a record made before them had none: every field None but the defaults)."""
    return derive_fields(record.get("flags") or [])


def setup_key(record: dict, varying: tuple[str, ...]) -> tuple:
    """What a record shares with every other run of one study: its trainer flags without the `varying` ones (and
    their values), its model config named without folder or depth."""
    flags, kept = record["flags"], []
    for index, flag in enumerate(flags):
        if flag in varying or (index and flags[index - 1] in varying):
            continue
        kept.append(re.sub(r"_L\d+(?=\.json$)", "", Path(flag).name) if index and flags[index - 1] == "--model_config"
                    else flag)
    return tuple(kept)


def encode(record: dict) -> bytes:
    return gzip.compress(json.dumps(record, separators=(",", ":")).encode(), compresslevel=9, mtime=0)


def write(folder: Path, name: str, record: dict) -> Path:
    """Write run `name`'s record atomically (a kill mid-write leaves the old record) and drop an older-format copy."""
    path = path_for(folder, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(encode(record))
    os.replace(partial, path)
    Path(folder, f"{name}{OLD_SUFFIX}").unlink(missing_ok=True)
    return path


def convert(folder: Path) -> int:
    """Rewrite a folder's older-format records in the current one; returns how many. A record whose compact copy
    does not read back equal is left as it was (ValueError)."""
    converted = 0
    for path in sorted(Path(folder).glob(f"*{OLD_SUFFIX}")):
        record = read(path)
        data = encode(record)
        if json.loads(gzip.decompress(data)) != record:
            raise ValueError(f"{path}: its compact copy does not read back equal; left as it is")
        write(folder, name_of(path), record)
        converted += 1
    return converted


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="python -m utils.study.records", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineErrorParser)
    convert_parser = commands.add_parser("convert", help="rewrite <name>.json records as <name>.json.gz")
    convert_parser.add_argument("folders", nargs="+", type=Path, help="folders of run records (a report's runs/)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for folder in args.folders:
        if not folder.is_dir():
            parser.error(f"folders: no folder {folder}")
    for folder in args.folders:
        try:
            count = convert(folder)
        except (OSError, ValueError) as error:
            print(f"convert: {error}", file=sys.stderr)
            return 1
        print(f"{folder}: {count} record(s) converted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
