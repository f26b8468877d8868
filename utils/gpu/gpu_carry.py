"""What a GPU lease carries: the helpers of utils/gpu/gpu_lease.sh's Wikipedia call (its plan is depth_sweep.py
--estimate).

    python -m utils.gpu.gpu_carry travel [--carry .lease] [--limit_mib 60]   # the bytes that would travel; fails above
    python -m utils.gpu.gpu_carry pack_corpus --out .lease/wikipedia.tar.xz     # the corpus as text, xz-compressed
    python -m utils.gpu.gpu_carry unpack_corpus --archive .lease/wikipedia.tar.xz --out /tmp/wikipedia
    python -m utils.gpu.gpu_carry rehearsal_corpus --out DIR                    # a tiny corpus of the same shape (CI)

A call of the device tool sends the working tree (tracked files and untracked files git does not ignore, and a
shared/ folder inside the checkout) and the paths its `carry` names, 64 MiB in all (/work/.library/device/README.md).
`travel` sums those bytes as the tool would and exits 1 with one line above the limit (60 MiB by default: room for
the tool's own rounding and for a file added after the check).

The corpus travels as text: its JSON lines, decompressed and packed into one xz tarball (xz finds the repeats across
articles that the per-file gzip of the corpus cannot). Packed token ids (uint16) would be about 8% smaller (on
shard wiki_00: 2.58 MB of xz'd ids against 2.80 MB of xz'd JSON lines, docs/gpu.md), but the trainer reads text, and
a reader of pre-tokenized shards is a change to the data loader that the saving does not pay for while the total
fits. Unpacked on the device, each file is written under its own name again, gzipped, so that the trainer reads the
same shards in the same order.
"""
from __future__ import annotations

import argparse
import gzip
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

from peft_pretraining.cli import OneLineErrorParser

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20
TRAVEL_LIMIT_MIB = 60  # below the tool's 64 MiB
CORPUS_ARCHIVE = "wikipedia.tar.xz"



def git_files(repo: Path) -> list[Path]:
    """The files a call sends from the checkout: tracked, and untracked that git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                            check=True, capture_output=True).stdout.decode().split("\0")
    return [repo / name for name in dict.fromkeys(listed) if name]


def path_bytes(path: Path) -> int:
    """A file's bytes, or the sum over the files under a folder; a link counts as itself, not what it points to."""
    if path.is_symlink() or path.is_file():
        return path.lstat().st_size
    if path.is_dir():
        return sum(p.lstat().st_size for p in path.rglob("*") if p.is_symlink() or p.is_file())
    return 0


def travel_bytes(repo: Path, carry: list[str]) -> dict[str, int]:
    """{part: bytes} of what a call would send: the tree, shared/ inside the checkout, and each carried path."""
    tree = [p for p in git_files(repo) if p.is_symlink() or p.is_file()]  # a deleted tracked file is not sent
    parts = {"tree": sum(p.lstat().st_size for p in tree)}
    if (repo / "shared").is_dir():
        parts["shared/"] = path_bytes(repo / "shared")
    for name in carry:
        parts[name] = path_bytes(repo / name)
    return parts


def check_travel(repo: Path, carry: list[str], limit_mib: float = TRAVEL_LIMIT_MIB) -> tuple[bool, str]:
    """(fits, one line): the total that would travel against the limit, with each part."""
    parts = travel_bytes(repo, carry)
    total = sum(parts.values())
    listed = ", ".join(f"{name} {size / MIB:.1f}" for name, size in parts.items())
    if total > limit_mib * MIB:
        return False, (f"gpu_carry travel: {total / MIB:.1f} MiB would travel ({listed}), above the limit of "
                       f"{limit_mib:g} MiB: shrink the tree or carry less")
    return True, f"gpu_carry travel: {total / MIB:.1f} MiB would travel ({listed}), within {limit_mib:g} MiB"


def corpus_files(folder: Path) -> list[Path]:
    """The corpus's files, relative to its folder, in name order: train/*.jsonl[.gz] and the validation file."""
    from peft_pretraining.data.wikipedia_corpus import corpus_paths, train_files

    train, validation = corpus_paths(folder)
    return [p.relative_to(folder) for p in (*train_files(train), validation)]


def pack_corpus(folder: Path, archive: Path) -> int:
    """Every corpus file, decompressed, into one xz tarball (deterministic: fixed times and owners). Its bytes."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    partial = archive.with_name(archive.name + ".part")
    with tarfile.open(partial, "w:xz", preset=9) as tar:
        for name in corpus_files(folder):
            path = folder / name
            data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
            info = tarfile.TarInfo(str(name.with_suffix("") if path.suffix == ".gz" else name))
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    partial.replace(archive)
    return archive.stat().st_size


def unpack_corpus(archive: Path, out: Path) -> list[Path]:
    """The tarball's files written under `out`, each gzipped again under its name with .gz (the corpus's names;
    level 1: the device reads them once). Only plain files inside `out` are written."""
    written = []
    with tarfile.open(archive, "r:xz") as tar:
        for member in tar:
            target = (out / f"{member.name}.gz").resolve()
            if not member.isfile() or out.resolve() not in target.parents:
                raise ValueError(f"--archive {archive}: {member.name!r} is not a plain file inside the corpus")
            target.parent.mkdir(parents=True, exist_ok=True)
            with gzip.GzipFile(target, mode="wb", compresslevel=1, mtime=0) as handle:
                handle.write(tar.extractfile(member).read())
            written.append(target)
    return written


def write_rehearsal_corpus(out: Path, shards: int = 3, articles_per_shard: int = 40) -> Path:
    """A tiny corpus of the Wikipedia corpus's shape (train/wiki_NN.jsonl.gz, validation.jsonl.gz) cut from the
    embedded novels' records, for the CPU rehearsal: offline, and the same on every machine."""
    from peft_pretraining.data.embedded_corpus import EMBEDDED_DIR, write_jsonl_gz
    from peft_pretraining.data.wikipedia_corpus import TRAIN_FOLDER, VALIDATION_FILE, train_shard_name

    def first_texts(split: str, count: int) -> list[str]:  # read directly: the loader's imports take seconds
        with gzip.open(EMBEDDED_DIR / f"{split}.jsonl.gz", "rt", encoding="utf-8") as handle:
            return [json.loads(line)["text"] for line, _ in zip(handle, range(count))]

    texts = first_texts("train", shards * articles_per_shard)
    for shard in range(shards):
        write_jsonl_gz(out / TRAIN_FOLDER / train_shard_name(shard), [{"text": t} for t in texts[shard::shards]])
    write_jsonl_gz(out / VALIDATION_FILE, [{"text": t} for t in first_texts("validation", 8)])
    return out


def build_parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(prog="python -m utils.gpu.gpu_carry", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    travel = commands.add_parser("travel", help="the bytes a device call would send; exit 1 above the limit")
    travel.add_argument("--carry", nargs="*", default=[], help="ignored paths the call carries (relative to --repo)")
    travel.add_argument("--limit_mib", type=float, default=TRAVEL_LIMIT_MIB,
                        help=f"fail above this many MiB (default {TRAVEL_LIMIT_MIB})")
    travel.add_argument("--repo", default=str(REPO), help="the checkout (default: this one)")
    pack = commands.add_parser("pack_corpus", help="the Wikipedia corpus as one xz tarball of its text")
    pack.add_argument("--corpus", default=None, help="corpus folder (default: $WIKIPEDIA_DATA_DIR, else "
                                                     "../shared/data/wikipedia)")
    pack.add_argument("--out", required=True, help="the tarball to write")
    unpack = commands.add_parser("unpack_corpus", help="the tarball back into a corpus folder")
    unpack.add_argument("--archive", required=True)
    unpack.add_argument("--out", required=True, help="the corpus folder to write (WIKIPEDIA_DATA_DIR then)")
    rehearsal = commands.add_parser("rehearsal_corpus", help="a tiny corpus of the same shape (the CPU rehearsal)")
    rehearsal.add_argument("--out", required=True, help="a corpus folder to write")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "travel":
        if args.limit_mib <= 0:
            parser.error(f"--limit_mib must be positive, got {args.limit_mib:g}")
        if not (Path(args.repo) / ".git").exists():
            parser.error(f"--repo {args.repo}: not a git checkout")
        fits, line = check_travel(Path(args.repo), args.carry, args.limit_mib)
        print(line, flush=True)
        return 0 if fits else 1
    if args.command == "pack_corpus":
        from peft_pretraining.data.wikipedia_corpus import wikipedia_dir

        folder = Path(args.corpus) if args.corpus else wikipedia_dir()
        try:
            size = pack_corpus(folder, Path(args.out))
        except ValueError as error:
            parser.error(f"--corpus: {error}")
        print(f"gpu_carry pack_corpus: {args.out}: {size / MIB:.1f} MiB", flush=True)
        return 0
    if args.command == "rehearsal_corpus":
        print(f"gpu_carry rehearsal_corpus: {write_rehearsal_corpus(Path(args.out))}", flush=True)
        return 0
    if not Path(args.archive).is_file():
        parser.error(f"--archive {args.archive}: no such file (bash utils/gpu/gpu_lease.sh prepare_wikipedia makes it)")
    try:
        written = unpack_corpus(Path(args.archive), Path(args.out))
    except ValueError as error:
        parser.error(str(error))
    print(f"gpu_carry unpack_corpus: {len(written)} files under {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
