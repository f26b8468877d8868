"""Data pipeline: the embedded Jane Austen corpus and its tokenizer, local files, and hub datasets (C4).

Training data comes out of `build_train_stream(...)` as an endless, deterministic, rank-sharded, resumable stream
of micro-batches; evaluation data comes out of `iter_eval_batches(...)` with an exact target-token budget.

Stream order (the same for any num_workers):
  * embedded corpus: epoch e is a permutation of all documents seeded by (seed, e); rank r takes positions r, r + W,
    r + 2W, ... of it, so the union over ranks is exactly the single-process order. Documents are grouped into
    chunks of `CHUNK_DOCUMENTS`; DataLoader worker w tokenizes chunks w, w + N, ... (every worker walks the
    in-memory list) and the DataLoader hands chunks back round-robin, i.e. in their original order;
  * streaming datasets (local files, C4): split by rank first (whole shards when they divide evenly), then this
    rank's shards are dealt to up to MAX_LANES lanes that each shuffle and loop over their own shards
    (`StreamingSource`); the stream takes CHUNK_DOCUMENTS documents from each lane in turn. A DataLoader worker
    owns whole lanes, so every document is read once;
  * the main process turns tokens into rows: padding (one document per row, truncated, right-padded) or packing
    (documents joined with EOS and cut into full windows).
The stream position (`TrainStream.state_dict()`) says where every lane is, so resuming rebuilds the readers there and
the next batch is exactly the one that would have come next.

The embedded corpus and its tokenizer are built by `peft_pretraining.data.embedded_corpus`, whose CLI is the documented
`python -m peft_pretraining.dataloader build-embedded --source /path/to/austen` (the entry point
peft_pretraining/dataloader.py): it rebuilds data/embedded/* and data/tokenizer/ from the raw novels.
"""
from __future__ import annotations

import functools
import gzip
import itertools
import json
import logging
import math
import os
import pathlib
import re
import shutil
import signal
import tempfile
import warnings
import zlib
from typing import Iterator

import numpy as np
import torch

# write_jsonl_gz is not used here: tools import it from here.
from peft_pretraining.data.embedded_corpus import (  # noqa: F401
    EMBEDDED_DIR,
    TOKENIZER_DIR,
    train_tokenizer,
    write_jsonl_gz,
)
from peft_pretraining.data.wikipedia_corpus import WIKIPEDIA, WIKIPEDIA_TOKENIZER_DIR

logger = logging.getLogger(__name__)

EMBEDDED = "embedded"  # the --dataset value meaning the shipped corpus
EMBEDDED_SPLITS = ("train", "validation")

HUB_DEFAULT_CONFIGS = {"allenai/c4": "en", "c4": "en"}
LOCAL_EXTENSIONS = {".txt": "text", ".json": "json", ".jsonl": "json"}
LOCAL_VALIDATION_EVERY = 20  # without a "val" file, documents whose crc32(text) % 20 == 0 are the validation split
SHUFFLE_BLOCK = 2_048  # documents of one shard permuted together (streaming sources)
MAX_LANES = 8  # shard readers per rank (streaming sources): the most DataLoader workers that can share them
READ_BATCH = 256  # documents per `datasets` read; shuffle blocks are whole read batches
CHUNK_DOCUMENTS = 32
IGNORE_INDEX = -100


# ----------------------------------------------------------------------------------------------------------------
# Embedded corpus files and the tokenizer
# ----------------------------------------------------------------------------------------------------------------
def read_jsonl_texts(path: pathlib.Path) -> list[str]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def embedded_split_path(split: str) -> pathlib.Path:
    if split not in EMBEDDED_SPLITS:
        raise ValueError(f"unknown split {split!r} for the embedded corpus (expected one of {EMBEDDED_SPLITS})")
    return EMBEDDED_DIR / f"{split}.jsonl.gz"


def load_tokenizer(name_or_path: str):
    """'embedded' -> data/tokenizer (rebuilt from the shipped train split if missing); 'wikipedia' ->
    data/tokenizer_wikipedia; else AutoTokenizer."""
    from transformers import AutoTokenizer

    if name_or_path == EMBEDDED:
        if not (TOKENIZER_DIR / "tokenizer.json").exists():
            logger.warning("data/tokenizer is missing: training it on %s", embedded_split_path("train"))
            # Every rank may get here at once: each trains into its own folder, and the first rename wins.
            staging = pathlib.Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=TOKENIZER_DIR.parent))
            train_tokenizer(read_jsonl_texts(embedded_split_path("train")), staging)
            try:
                staging.rename(TOKENIZER_DIR)
            except OSError:  # another rank's folder is in place, or a partial old one, which the new files complete
                if not (TOKENIZER_DIR / "tokenizer.json").exists():
                    for path in staging.iterdir():
                        os.replace(path, TOKENIZER_DIR / path.name)
                shutil.rmtree(staging, ignore_errors=True)
        tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    else:
        import peft_pretraining.model.modeling_llama  # noqa: F401 (registers our model type: a checkpoint of ours asks nothing)

        if name_or_path == WIKIPEDIA:
            if not (WIKIPEDIA_TOKENIZER_DIR / "tokenizer.json").exists():
                raise ValueError(f"--tokenizer {WIKIPEDIA}: {WIKIPEDIA_TOKENIZER_DIR} is missing; rebuild it with "
                                 "python -m peft_pretraining.wikipedia_corpus build-tokenizer")
            name_or_path = str(WIKIPEDIA_TOKENIZER_DIR)

        try:
            tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        except (OSError, ValueError) as error:  # ValueError: a folder without tokenizer files
            raise ValueError(f"--tokenizer {name_or_path!r} could not be loaded ({error}); use --tokenizer embedded "
                             "offline") from error
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"--tokenizer {name_or_path!r} has neither a pad nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def check_vocab_covers_tokenizer(vocab_size: int, tokenizer) -> None:
    if len(tokenizer) > vocab_size:
        raise ValueError(f"the model vocab_size {vocab_size} is smaller than the tokenizer "
                         f"{getattr(tokenizer, 'name_or_path', '')!r} with {len(tokenizer)} ids; ids >= {vocab_size} "
                         "would index past the embedding (resize the vocabulary or pick a matching tokenizer)")


VOCAB_MULTIPLE = 64


def vocab_size_covering(tokenizer) -> int:
    """The tokenizer's id count rounded up to a multiple of VOCAB_MULTIPLE (matmul-friendly shapes): the vocabulary
    the trainer gives a model whose config is smaller than its tokenizer (t5-base's 32100 ids -> 32128)."""
    return math.ceil(len(tokenizer) / VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def count_target_tokens(labels) -> int:
    """Positions the loss is computed on: the model predicts labels[:, t + 1] from position t."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


# ----------------------------------------------------------------------------------------------------------------
# Document sources
# ----------------------------------------------------------------------------------------------------------------
class EmbeddedSource:
    """In-memory documents; epoch e is a permutation seeded by (seed, e), rank r takes every W-th position."""

    def __init__(self, texts: list[str], *, seed: int, rank: int, world_size: int, shuffle: bool = True):
        self.texts, self.seed, self.rank, self.world_size, self.shuffle = texts, seed, rank, world_size, shuffle

    def iter_epoch(self, epoch: int, start: int = 0) -> Iterator[str]:
        order = np.arange(len(self.texts))
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.texts))
        for index in order[self.rank:: self.world_size][start:]:
            yield self.texts[index]


class StreamingSource:
    """A `datasets` streaming split (local files or hub), read shard by shard; never fully pre-tokenized.

    Split by rank first: whole shards when num_shards % world_size == 0 (rank r gets shards r, r + W, ..., the
    assignment `split_dataset_by_node` makes), else every W-th document of every shard. This rank's shards are then
    dealt to `num_lanes` = min(shards, MAX_LANES) lanes (shard k of the rank to lane k % num_lanes). A lane loops
    over its shards forever; in lane epoch e it visits them in an order seeded by (seed, rank, lane, e) and permutes
    each block of about `block_size` consecutive documents of a shard with a generator seeded by the block's
    coordinates, so a lane position is a few integers plus the `datasets` state at the block's start.
    Evaluation reads the whole split in file order (`iter_epoch` of a world-size-1 source) on every rank.
    """

    def __init__(self, dataset, *, seed: int, rank: int, world_size: int, block_size: int = SHUFFLE_BLOCK,
                 text_field: str = "text", files: list[str] | None = None):
        if block_size < 1:
            raise ValueError(f"shuffle block size must be >= 1, got {block_size}")
        self.dataset, self.seed, self.rank, self.world_size = dataset, seed, rank, world_size
        self.block_size, self.text_field = block_size, text_field
        self.files = files  # local files, one per shard: an unreadable one is named in a one-line error
        total = dataset.num_shards
        self.whole_shards = total % world_size == 0
        self.shard_ids = list(range(rank, total, world_size)) if self.whole_shards else list(range(total))
        self.num_lanes = min(len(self.shard_ids), MAX_LANES)

    def iter_epoch(self, epoch: int = 0, start: int = 0) -> Iterator[str]:
        """This rank's documents in file order (evaluation)."""
        from datasets.distributed import split_dataset_by_node

        dataset = self.dataset
        if self.world_size > 1:
            dataset = split_dataset_by_node(dataset, rank=self.rank, world_size=self.world_size)
        if self.files is not None and self.world_size == 1:  # file by file, to name one that cannot be read
            batches = (batch for shard_id in range(dataset.num_shards)
                       for batch in self._read(self._open_shard(shard_id), shard_id))
        else:
            # .iter() (unlike __iter__) does not re-shard by DataLoader worker.
            batches = dataset.iter(batch_size=READ_BATCH)
        for position, text in enumerate(t for batch in batches for t in batch[self.text_field]):
            if position >= start:
                yield text

    def _open_shard(self, shard_id: int):
        from datasets.distributed import split_dataset_by_node

        shard = self.dataset.shard(num_shards=self.dataset.num_shards, index=shard_id)
        if not self.whole_shards:
            shard = split_dataset_by_node(shard, rank=self.rank, world_size=self.world_size)
        return shard

    def _read(self, dataset, shard_id: int):
        """dataset.iter(batch_size=READ_BATCH); a local file that cannot be read is a one-line error naming it."""
        try:
            yield from dataset.iter(batch_size=READ_BATCH)
        except _read_errors() as error:
            if self.files is None:
                raise
            raise _unreadable(self.files[shard_id], error) from error

    def lane_documents(self, lane: int, state: dict | None = None) -> Iterator[tuple[dict, str]]:
        """Endless (state, text) pairs of one lane; passing a yielded `state` back resumes at that document.

        The state is {"epoch", "shard" (index in the epoch's shard order), "block" (in that shard), "start"
        (`IterableDataset.state_dict()` at the block's first document, None at the shard's start), "taken"}.
        Resuming re-reads the shard up to the block start (datasets skips it at the Arrow level) and the block.
        """
        shards = self.shard_ids[lane:: self.num_lanes]
        state = state or {"epoch": 0, "shard": 0, "block": 0, "start": None, "taken": 0}
        epoch, shard_index, block, start, taken = (state[k] for k in ("epoch", "shard", "block", "start", "taken"))
        while True:
            order = np.random.default_rng([self.seed, self.rank, lane, epoch]).permutation(len(shards))
            found = shard_index > 0 or block > 0
            while shard_index < len(shards):
                dataset = self._open_shard(shards[order[shard_index]])
                if start is not None:
                    dataset.load_state_dict(start)
                batches = self._read(dataset, shards[order[shard_index]])
                while True:
                    texts = []
                    for batch in batches:  # whole read batches, so that a block starts where state_dict() points
                        texts.extend(batch[self.text_field])
                        if len(texts) >= self.block_size:
                            break
                    if not texts:
                        break
                    found = True
                    permutation = np.random.default_rng(
                        [self.seed, self.rank, lane, epoch, shard_index, block]).permutation(len(texts))
                    for i in range(taken, len(texts)):
                        yield ({"epoch": epoch, "shard": shard_index, "block": block, "start": start, "taken": i},
                               texts[permutation[i]])
                    start, block, taken = dataset.state_dict(), block + 1, 0
                shard_index, block, start = shard_index + 1, 0, None
            if not found:
                raise ValueError(f"rank {self.rank} of world_size {self.world_size} has no documents in lane {lane} "
                                 "of its shard of the training split (--dataset / --dataset_path)")
            epoch, shard_index = epoch + 1, 0


@functools.cache
def _read_errors() -> tuple:
    import datasets.table
    import pyarrow

    # A corrupt or truncated gzip, invalid UTF-8, a malformed JSON line, records whose columns differ.
    return OSError, EOFError, UnicodeDecodeError, pyarrow.ArrowException, datasets.table.CastError


def _unreadable(file, error: BaseException) -> ValueError:
    return ValueError(f"--dataset_path {file}: cannot be read ({type(error).__name__}: {' '.join(str(error).split())})")


def _local_kind(path: pathlib.Path) -> str | None:
    """'text' / 'json' builder for a supported file name (a trailing .gz is allowed), else None."""
    suffixes = [s for s in path.suffixes if s != ".gz"]
    return LOCAL_EXTENSIONS.get(suffixes[-1].lower()) if suffixes else None


def _local_files(path: pathlib.Path) -> list[pathlib.Path]:
    """Supported files under path. Empty files are left out: each file is a shard, and a shard with no document
    would stop training when its turn came."""
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and _local_kind(p) and not p.name.startswith("."))
    empty = [f for f in files if f.stat().st_size == 0]
    if empty:
        warnings.warn(f"--dataset_path {path}: skipping {len(empty)} empty file(s): {[f.name for f in empty][:5]}",
                      stacklevel=2)
    return [f for f in files if f not in empty]


def _local_builder(files: list[pathlib.Path], dataset_path: str) -> str:
    kinds = {_local_kind(f) for f in files}
    if None in kinds or len(kinds) != 1:
        raise ValueError(f"--dataset_path {dataset_path}: expected only .txt or only .json/.jsonl files (optionally "
                         f".gz), found {sorted(f.name for f in files)[:5]}")
    return kinds.pop()


# A word "val", "valid" or "validation" in the path: "val.jsonl", "my_val/", "c4-validation.json.gz"; not "interval",
# "valley_of_fear.txt" or "train_values.jsonl".
_VALIDATION_NAME = re.compile(r"(^|[^a-z])val(id(ation)?)?([^a-z]|$)", re.IGNORECASE)


def _is_validation_name(name: str) -> bool:
    return bool(_VALIDATION_NAME.search(name))


def resolve_local_splits(dataset_path: str) -> tuple[list[pathlib.Path], list[pathlib.Path] | None]:
    """(train files, validation files or None = hold out crc32(text) % LOCAL_VALIDATION_EVERY == 0).

    Validation files are, in order of preference: files under dataset_path whose relative path contains "val";
    a sibling file/folder of dataset_path whose name contains "val".
    """
    path = pathlib.Path(dataset_path)
    if not path.exists():
        raise ValueError(f"--dataset_path {dataset_path}: no such file or directory")
    files = _local_files(path)
    if not files:
        raise ValueError(f"--dataset_path {dataset_path}: no .txt/.json/.jsonl files found")
    if path.is_dir():
        val = [f for f in files if _is_validation_name(f.relative_to(path).as_posix())]
        train = [f for f in files if f not in val]
        if val and train:
            return train, val
    siblings = sorted(p for p in path.parent.iterdir() if p != path and _is_validation_name(p.name)
                      and (p.is_dir() or _local_kind(p)))
    val = [f for s in siblings for f in _local_files(s)]
    return files, (val or None)


def _open_local_split(dataset_path: str, split: str):
    import datasets

    train_files, val_files = resolve_local_splits(dataset_path)
    files = train_files if split == "train" or val_files is None else val_files
    builder = _local_builder(files, dataset_path)
    kwargs = {"sample_by": "paragraph"} if builder == "text" else {}
    try:  # both read the first file
        dataset = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train", streaming=True,
                                        **kwargs)
        first = next(iter(dataset.take(1)), None)
    except _read_errors() as error:
        raise _unreadable(files[0], error) from error
    if first is not None and not isinstance(first.get("text"), str):
        raise ValueError(f"--dataset_path {dataset_path}: records need a string \"text\" field, found keys "
                         f"{sorted(first)}")
    if val_files is None:
        dataset = dataset.filter(functools.partial(_in_validation_slice, expected=split != "train"))
    return dataset.select_columns(["text"]), [str(f) for f in files]


def _require_text(text) -> None:
    """Only the first record's "text" is checked when a source opens; a later null or number is found here."""
    if not isinstance(text, str):
        raise ValueError(f"a document's \"text\" is {type(text).__name__}, not a string (--dataset / --dataset_path)")


def _in_validation_slice(example: dict, expected: bool) -> bool:
    """The held-out slice of a local corpus without a validation file: stable under any reordering of documents."""
    _require_text(example["text"])
    return (zlib.crc32(example["text"].encode("utf-8")) % LOCAL_VALIDATION_EVERY == 0) == expected


def _open_hub_split(dataset: str, config: str | None, split: str):
    import datasets

    config = config if config is not None else HUB_DEFAULT_CONFIGS.get(dataset)
    try:
        stream = datasets.load_dataset(dataset, config, split=split, streaming=True)
    except Exception as error:  # offline, unknown name, missing split: all surface as one clear message
        raise ValueError(f"--dataset {dataset!r} (config {config!r}, split {split!r}) could not be opened: {error}. "
                         "Offline, use --dataset embedded or --dataset_path") from error
    if stream.column_names is not None and "text" not in stream.column_names:
        raise ValueError(f"--dataset {dataset!r} (config {config!r}, split {split!r}) has no \"text\" column: "
                         f"{stream.column_names}")
    return stream.select_columns(["text"])


def _make_source(*, dataset: str, dataset_path: str | None, split: str, seed: int, rank: int, world_size: int,
                 shuffle: bool, dataset_config: str | None = None, block_size: int = SHUFFLE_BLOCK):
    """Training (shuffle=True) or evaluation (file order) documents of one rank."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"invalid rank {rank} for world_size {world_size}")
    if dataset == EMBEDDED and dataset_path is None:
        texts = read_jsonl_texts(embedded_split_path(split))
        return EmbeddedSource(texts, seed=seed, rank=rank, world_size=world_size, shuffle=shuffle)
    files = None
    if dataset_path is not None:
        stream, files = _open_local_split(dataset_path, split)
    else:
        stream = _open_hub_split(dataset, dataset_config, split)
    return StreamingSource(stream, seed=seed, rank=rank, world_size=world_size, block_size=block_size, files=files)


# ----------------------------------------------------------------------------------------------------------------
# Tokenization (optionally in DataLoader workers) and batching
# ----------------------------------------------------------------------------------------------------------------
def tokenize_documents(tokenizer, texts: list[str], max_length: int, packing: bool) -> list[np.ndarray]:
    """Each document -> its ids followed by EOS; with padding, truncated so that ids + EOS fit in max_length."""
    eos = tokenizer.eos_token_id
    for text in texts:
        _require_text(text)
    if packing:
        encoded = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    else:
        encoded = tokenizer(texts, add_special_tokens=False, truncation=True, max_length=max_length - 1,
                            verbose=False)["input_ids"]
    return [np.asarray(ids + [eos], dtype=np.int64) for ids in encoded]


class _TokenizedChunks(torch.utils.data.IterableDataset):
    """Endless (epoch, first document index, token arrays) chunks from a position onwards.

    Worker w of N tokenizes chunks w, w + N, ...; the DataLoader returns workers' items round-robin, so the chunk
    order is the same for every num_workers. Every worker reads the documents it skips (cheap next to tokenizing).
    """

    def __init__(self, source, tokenizer, *, max_length: int, packing: bool, epoch: int, document: int):
        self.source, self.tokenizer, self.max_length, self.packing = source, tokenizer, max_length, packing
        self.epoch, self.document = epoch, document

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        epoch, start, chunk_id = self.epoch, self.document, 0
        while True:
            texts, first, seen = [], start, 0
            for seen, text in enumerate(self.source.iter_epoch(epoch, start), start=1):
                texts.append(text)
                if len(texts) == CHUNK_DOCUMENTS:
                    yield from self._emit(chunk_id, worker, num_workers, epoch, first, texts)
                    chunk_id, first, texts = chunk_id + 1, first + len(texts), []
            if texts:
                yield from self._emit(chunk_id, worker, num_workers, epoch, first, texts)
                chunk_id += 1
            if seen == 0 and start == 0:
                raise ValueError(f"rank {self.source.rank} of world_size {self.source.world_size} has no documents "
                                 "in its shard of the training split")
            epoch, start = epoch + 1, 0

    def _emit(self, chunk_id, worker, num_workers, epoch, first, texts):
        if chunk_id % num_workers == worker:
            yield epoch, first, tokenize_documents(self.tokenizer, texts, self.max_length, self.packing)


class _LaneChunks(torch.utils.data.IterableDataset):
    """Endless (lane, lane state, documents to drop from it, token arrays) pieces of a streaming source.

    Piece k comes from lane (first_lane + k) % L and holds CHUNK_DOCUMENTS documents (the first piece of each lane
    after a resume finishes the chunk that was in progress). Worker w of N (N divides L) reads the lanes at
    positions w, w + N, ... of that rotation, so every lane is read by exactly one process, and the DataLoader's
    round-robin over workers returns the pieces in stream order whatever N is.
    """

    def __init__(self, source, tokenizer, *, max_length: int, packing: bool, first_lane: int, lanes: list):
        self.source, self.tokenizer, self.max_length, self.packing = source, tokenizer, max_length, packing
        self.first_lane, self.lanes = first_lane, lanes

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        count = self.source.num_lanes
        mine = [(self.first_lane + worker + num_workers * i) % count for i in range(count // num_workers)]
        pieces = [self._pieces(lane) for lane in mine]
        while True:
            for lane_pieces in pieces:
                yield next(lane_pieces)

    def _pieces(self, lane: int):
        state, skip = self.lanes[lane]["at"], self.lanes[lane]["skip"]
        documents = self.source.lane_documents(lane, state)
        for _ in range(skip):
            next(documents)
        pairs = [next(documents) for _ in range(CHUNK_DOCUMENTS - skip % CHUNK_DOCUMENTS)]
        yield lane, state, skip, self._tokenize(pairs)
        while True:
            pairs = [next(documents) for _ in range(CHUNK_DOCUMENTS)]
            yield lane, pairs[0][0], 0, self._tokenize(pairs)

    def _tokenize(self, pairs):
        """Token arrays, each with its document's lane epoch."""
        arrays = tokenize_documents(self.tokenizer, [text for _, text in pairs], self.max_length, self.packing)
        return [(tokens, state["epoch"]) for tokens, (state, _) in zip(arrays, pairs)]


def _keep_as_is(item):
    return item


class _WorkerError:
    """A ValueError raised in a DataLoader worker, sent as an item: the DataLoader would wrap it in a traceback."""

    def __init__(self, message: str):
        self.message = message


class _ErrorsAsItems(torch.utils.data.IterableDataset):
    """The chunks of a worker, ending with a _WorkerError if reading them raised a ValueError."""

    def __init__(self, chunks):
        self.chunks = chunks

    def __iter__(self):
        try:
            yield from self.chunks
        except ValueError as error:
            yield _WorkerError(str(error))


def _leave_stop_signals_to_the_trainer(worker_id: int):
    """A scheduler may signal every process of a job: a worker killed by SIGTERM or SIGUSR1 would crash the trainer,
    which is finishing its update to save. Workers end when the trainer closes the loader (or exits)."""
    for stop_signal in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(stop_signal, signal.SIG_IGN)


def _raise_worker_errors(items):
    """Re-raise a worker's ValueError with its own one-line message (bad data names the flag, as without workers)."""
    for item in items:
        if isinstance(item, _WorkerError):
            raise ValueError(item.message)
        yield item


def _require_eos(tokenizer) -> None:
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no EOS token; documents are "
                         "terminated with EOS")


def _rows_to_batch(rows: list[np.ndarray], max_length: int, pad_id: int) -> dict:
    input_ids = np.full((len(rows), max_length), pad_id, dtype=np.int64)
    attention_mask = np.zeros((len(rows), max_length), dtype=np.int64)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = row
        attention_mask[i, : len(row)] = 1
    input_ids, attention_mask = torch.from_numpy(input_ids), torch.from_numpy(attention_mask)
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


class _DocumentOrderReader:
    """Documents of an `EmbeddedSource` in epoch order; position {"epoch", "document", "token_offset"}.

    A cursor is (epoch, index of the document in this rank's epoch order).
    """

    num_lanes = 1

    def __init__(self, source):
        self.source = source
        self.description = {}  # nothing beyond the stream's own description to check on resume

    def start_position(self) -> dict:
        return {"epoch": 0, "document": 0, "token_offset": 0}

    def position_from_state(self, state: dict) -> dict:
        return {key: int(state[key]) for key in ("epoch", "document", "token_offset")}

    def effective_workers(self, num_workers: int) -> int:
        return num_workers

    def documents(self, position: dict, load, **tokenizing):
        """(tokens, cursor) from `position` on; `load` runs the chunks in this process or in DataLoader workers."""
        chunks = _TokenizedChunks(self.source, epoch=position["epoch"], document=position["document"], **tokenizing)
        for epoch, first, arrays in load(chunks):
            for offset, tokens in enumerate(arrays):
                yield tokens, (epoch, first + offset)

    def position_after(self, cursor) -> dict:
        epoch, index = cursor
        return {"epoch": epoch, "document": index + 1, "token_offset": 0}

    def position_at(self, cursor, token_offset: int) -> dict:
        epoch, index = cursor
        return {"epoch": epoch, "document": index, "token_offset": token_offset}

    def lane_and_epoch(self, cursor) -> tuple[int, int]:
        return 0, cursor[0]


class _LaneReader:
    """Documents of a `StreamingSource`, CHUNK_DOCUMENTS from each lane in turn; position {"lane" (the lane the next
    document comes from), "lanes" (per lane: "at", a lane state, and "skip", documents already used after it),
    "epoch" (the lane epoch of the last document read, for information), "token_offset"}.

    A cursor is (lane, whether the document ends its piece, lane epoch). The positions describe the most recently
    read document, so they are taken before the next one is read.
    """

    def __init__(self, source):
        self.source, self.num_lanes = source, source.num_lanes
        self.description = {"num_lanes": source.num_lanes}
        self._progress = None  # per lane: the piece being read and how many of its documents were taken

    def start_position(self) -> dict:
        return {"lane": 0, "lanes": [{"at": None, "skip": 0} for _ in range(self.num_lanes)], "epoch": 0,
                "token_offset": 0}

    def position_from_state(self, state: dict) -> dict:
        if "lanes" not in state:
            raise ValueError("cannot resume the data stream: the checkpoint's position has no lanes (it was "
                             "written for the embedded corpus or by the reader before lanes)")
        return {"lane": int(state["lane"]), "lanes": [dict(lane) for lane in state["lanes"]],
                "epoch": int(state["epoch"]), "token_offset": int(state["token_offset"])}

    def effective_workers(self, num_workers: int) -> int:
        """The largest divisor of the lane count <= num_workers (each worker owns whole lanes)."""
        return max((n for n in range(1, num_workers + 1) if self.num_lanes % n == 0), default=0)

    def documents(self, position: dict, load, **tokenizing):
        lanes = [dict(lane) for lane in position["lanes"]]
        self._progress = lanes
        chunks = _LaneChunks(self.source, first_lane=position["lane"], lanes=[dict(lane) for lane in lanes],
                             **tokenizing)
        for lane, at, skip, arrays in load(chunks):
            lanes[lane] = {"at": at, "skip": skip}
            for index, (tokens, epoch) in enumerate(arrays):
                lanes[lane]["skip"] = skip + index + 1
                yield tokens, (lane, index == len(arrays) - 1, epoch)

    def position_after(self, cursor) -> dict:
        lane, last_of_piece, epoch = cursor
        lanes = [dict(entry) for entry in self._progress]
        next_lane = (lane + 1) % len(lanes) if last_of_piece else lane
        return {"lane": next_lane, "lanes": lanes, "epoch": epoch, "token_offset": 0}

    def position_at(self, cursor, token_offset: int) -> dict:
        position = self.position_after(cursor)
        lane = cursor[0]
        position["lane"] = lane
        position["lanes"][lane]["skip"] -= 1
        position["token_offset"] = token_offset
        return position

    def lane_and_epoch(self, cursor) -> tuple[int, int]:
        return cursor[0], cursor[2]


def _padded_batches(documents, reader, *, batch_size: int, max_length: int, pad_id: int):
    """(batch, position after it): one document per row, right-padded; empty documents get no row."""
    # Per lane (each with its own epochs): the epoch where its current run of empty documents began.
    empty_since, lane_epoch = {}, {}
    while True:
        rows, cursor = [], None
        for tokens, cursor in documents:
            lane, lane_epoch[lane] = reader.lane_and_epoch(cursor)
            if len(tokens) < 2:  # an empty document: EOS alone, nothing to predict; its row would be padding
                empty_since.setdefault(lane, lane_epoch[lane])
                # Every lane has read a whole epoch of empty documents: nothing will ever fill a row.
                if len(empty_since) == reader.num_lanes and all(lane_epoch[key] >= start + 2
                                                                for key, start in empty_since.items()):
                    raise ValueError("no training document holds a target token: every document is empty "
                                     "(--dataset / --dataset_path)")
                continue
            empty_since.pop(lane, None)
            rows.append(tokens)
            if len(rows) == batch_size:
                break
        yield _rows_to_batch(rows, max_length, pad_id), reader.position_after(cursor)


def _packed_batches(documents, reader, *, batch_size: int, max_length: int, token_offset: int):
    """(batch, position after it): documents joined end to end and cut into full rows; the first document starts
    token_offset tokens in (the tokens used before a resume)."""
    skip = token_offset
    buffer = np.empty(batch_size * max_length, dtype=np.int64)
    current = None  # (tokens, cursor, next offset)
    while True:
        filled = 0
        while filled < len(buffer):
            if current is None or current[2] == len(current[0]):
                tokens, cursor = next(documents)
                current = (tokens, cursor, skip)
                skip = 0
            tokens, cursor, offset = current
            take = min(len(buffer) - filled, len(tokens) - offset)
            buffer[filled: filled + take] = tokens[offset: offset + take]
            filled += take
            current = (tokens, cursor, offset + take)
        tokens, cursor, offset = current
        position = reader.position_after(cursor) if offset == len(tokens) else reader.position_at(cursor, offset)
        input_ids = torch.from_numpy(buffer.reshape(batch_size, max_length).copy())
        yield {"input_ids": input_ids, "labels": input_ids.clone(),
               "attention_mask": torch.ones_like(input_ids)}, position


class TrainStream:
    """Endless micro-batches for one rank; `state_dict()` / `load_state_dict()` resume exactly.

    The reader of the source (`_DocumentOrderReader` for the embedded corpus, `_LaneReader` for streaming sources)
    defines the position; its "token_offset" counts the tokens of the next document that were already used (packing).
    """

    def __init__(self, source, tokenizer, *, max_length: int, packing: bool, batch_size: int, num_workers: int = 0,
                 description: dict | None = None):
        if max_length < 2:
            raise ValueError(f"--max_length must be >= 2, got {max_length}")
        if batch_size < 1:
            raise ValueError(f"--batch_size must be >= 1, got {batch_size}")
        if num_workers < 0:
            raise ValueError(f"--workers must be >= 0, got {num_workers}")
        _require_eos(tokenizer)
        self.source, self.tokenizer = source, tokenizer
        self.max_length, self.packing, self.batch_size, self.num_workers = max_length, packing, batch_size, num_workers
        self.reader = _LaneReader(source) if isinstance(source, StreamingSource) else _DocumentOrderReader(source)
        self.description = {**(description or {}), **self.reader.description}
        self.position = self.reader.start_position()
        self.batches_yielded = 0
        self._batches = None
        if self.effective_workers != num_workers:
            logger.warning("%d DataLoader workers requested, %d used: each worker reads whole lanes and the %d lanes "
                           "of rank %d must divide evenly among them", num_workers, self.effective_workers,
                           source.num_lanes, source.rank)

    @property
    def effective_workers(self) -> int:
        return self.reader.effective_workers(self.num_workers)

    # --- iteration -------------------------------------------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self._batches is None:
            self._batches = self._generate()
        batch, position = next(self._batches)
        self.position = position
        self.batches_yielded += 1
        return batch

    def _loader(self, chunks):
        if self.effective_workers == 0:
            return chunks
        return _raise_worker_errors(torch.utils.data.DataLoader(_ErrorsAsItems(chunks), batch_size=None,
                                                                num_workers=self.effective_workers,
                                                                collate_fn=_keep_as_is,
                                                                worker_init_fn=_leave_stop_signals_to_the_trainer))

    def _generate(self):
        """(batch, position after it) from the current position on."""
        documents = self.reader.documents(self.position, self._loader, tokenizer=self.tokenizer,
                                          max_length=self.max_length, packing=self.packing)
        if self.packing:
            return _packed_batches(documents, self.reader, batch_size=self.batch_size, max_length=self.max_length,
                                   token_offset=self.position["token_offset"])
        return _padded_batches(documents, self.reader, batch_size=self.batch_size, max_length=self.max_length,
                               pad_id=self.tokenizer.pad_token_id)

    def close(self) -> None:
        """Stop DataLoader workers (they also stop when the stream is garbage-collected)."""
        if self._batches is not None:
            self._batches.close()
            self._batches = None

    # --- resume ----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {**self.position, "batches_yielded": self.batches_yielded, **self.description}

    def load_state_dict(self, state: dict) -> None:
        for key, value in self.description.items():
            if key in state and state[key] != value:
                raise ValueError(f"cannot resume the data stream: it was saved with {key}={state[key]!r}, "
                                 f"now {key}={value!r}")
        self.close()
        self.position = self.reader.position_from_state(state)
        self.batches_yielded = int(state.get("batches_yielded", 0))


def build_train_stream(*, dataset: str, dataset_path: str | None, tokenizer, max_length: int, packing: bool,
                       batch_size: int, seed: int, rank: int, world_size: int, num_workers: int = 0,
                       dataset_config: str | None = None) -> TrainStream:
    source = _make_source(dataset=dataset, dataset_path=dataset_path, split="train", seed=seed, rank=rank,
                          world_size=world_size, shuffle=True, dataset_config=dataset_config, block_size=SHUFFLE_BLOCK)
    description = {"dataset": dataset if dataset_path is None else f"path:{dataset_path}", "seed": seed, "rank": rank,
                   "world_size": world_size, "max_length": max_length, "packing": packing,
                   "dataset_config": dataset_config, "vocab": len(tokenizer), "eos_id": tokenizer.eos_token_id}
    return TrainStream(source, tokenizer, max_length=max_length, packing=packing, batch_size=batch_size,
                       num_workers=num_workers, description=description)


# ----------------------------------------------------------------------------------------------------------------
# Evaluation batches
# ----------------------------------------------------------------------------------------------------------------
def _eval_rows(source, tokenizer, max_length: int, packing: bool) -> Iterator[np.ndarray]:
    """Validation rows in file order: one truncated document per row, or EOS-joined windows (last one partial)."""
    texts = source.iter_epoch(0)
    pending = np.empty(0, dtype=np.int64)
    while True:
        chunk = [text for _, text in zip(range(CHUNK_DOCUMENTS), texts)]
        if not chunk:
            break
        arrays = tokenize_documents(tokenizer, chunk, max_length, packing)
        if not packing:
            yield from (array for array in arrays if len(array) >= 2)  # an empty document has no target
            continue
        pending = np.concatenate([pending, *arrays])
        while len(pending) >= max_length:
            yield pending[:max_length]
            pending = pending[max_length:]
    if packing and len(pending) > 1:
        yield pending


def iter_eval_batches(*, dataset: str, dataset_path: str | None, tokenizer, max_length: int, packing: bool,
                      batch_size: int, eval_tokens: int, rank: int, world_size: int,
                      dataset_config: str | None = None) -> Iterator[dict]:
    """This rank's share of the eval set: validation rows holding exactly eval_tokens target tokens in all.

    The eval set does not depend on world_size: it is what a single process evaluates, the validation split's rows
    in file order (`_eval_rows`, read unsharded) batched by batch_size until eval_tokens target tokens, the last batch
    trimmed by setting the surplus labels (the last ones in row-major order) to -100. Rank r keeps rows r, r + W,
    r + 2W, ... of it (in that order, rebatched by batch_size), so the ranks' rows are disjoint, their union is the
    world-size-1 set, and the all-reduced token-weighted loss is the same for any W; at W = 1 the batches are exactly
    the single-process ones. Every rank therefore reads and tokenizes the whole eval set (bounded by eval_tokens, not
    the split) and drops the rows of other ranks. A rank left without rows (fewer rows than ranks) yields one fully
    masked row, so lockstep evaluation still has a batch to run. If the split runs out first, everything is used and
    a warning says so (the caller reports the real count).
    """
    if eval_tokens < 0:
        raise ValueError(f"--eval_tokens must be >= 0, got {eval_tokens}")
    if batch_size < 1 or max_length < 2:
        raise ValueError(f"invalid eval batch_size={batch_size} / max_length={max_length}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"invalid rank {rank} for world_size {world_size}")
    _require_eos(tokenizer)
    source = _make_source(dataset=dataset, dataset_path=dataset_path, split="validation", seed=0, rank=0,
                          world_size=1, shuffle=False, dataset_config=dataset_config)
    batches = _eval_set_batches(source, tokenizer, max_length, batch_size, eval_tokens, packing)
    if world_size == 1:
        yield from batches
        return
    whole = list(batches)  # every rank holds the whole eval set (bounded by eval_tokens), then keeps its rows
    if not whole:
        return
    rows = {key: torch.cat([batch[key] for batch in whole]) for key in whole[0]}
    mine = {key: value[rank::world_size] for key, value in rows.items()}
    if len(mine["input_ids"]) == 0:  # fewer rows than ranks: lockstep evaluation still needs a batch to run
        placeholder = {key: value[:1].clone() for key, value in rows.items()}
        placeholder["labels"].fill_(IGNORE_INDEX)
        yield placeholder
        return
    for start in range(0, len(mine["input_ids"]), batch_size):
        yield {key: value[start:start + batch_size].contiguous() for key, value in mine.items()}


def iter_validation_row_batches(*, dataset: str, dataset_path: str | None, tokenizer, max_length: int,
                                packing: bool, batch_size: int, first_row: int, rows: int,
                                dataset_config: str | None = None) -> Iterator[dict]:
    """Validation rows first_row .. first_row + rows - 1 in file order (the rows the eval set starts from), batched:
    text that an eval of fewer than first_row rows never reads (the studies choose learning rates on it)."""
    _require_eos(tokenizer)
    source = _make_source(dataset=dataset, dataset_path=dataset_path, split="validation", seed=0, rank=0,
                          world_size=1, shuffle=False, dataset_config=dataset_config)
    selected = itertools.islice(_eval_rows(source, tokenizer, max_length, packing), first_row, first_row + rows)
    while batch_rows := list(itertools.islice(selected, batch_size)):
        yield _rows_to_batch(batch_rows, max_length, tokenizer.pad_token_id)


def _eval_set_batches(source, tokenizer, max_length: int, batch_size: int, eval_tokens: int,
                      packing: bool) -> Iterator[dict]:
    """The whole eval set as a single process sees it: batches of rows until exactly eval_tokens target tokens."""
    rows = _eval_rows(source, tokenizer, max_length, packing)
    yielded = 0
    while yielded < eval_tokens:
        batch_rows = [row for _, row in zip(range(batch_size), rows)]
        if not batch_rows:
            if yielded == 0:
                raise ValueError("the validation split holds no target token: no validation document, or only empty "
                                 "ones (--dataset / --dataset_path)")
            warnings.warn(f"the validation split gives only {yielded} target tokens, fewer than --eval_tokens "
                          f"{eval_tokens}", stacklevel=3)
            return
        batch = _rows_to_batch(batch_rows, max_length, tokenizer.pad_token_id)
        targets = count_target_tokens(batch["labels"])
        if yielded + targets > eval_tokens:
            _trim_targets(batch, targets - (eval_tokens - yielded))
            targets = eval_tokens - yielded
        yielded += targets
        yield batch


def _trim_targets(batch: dict, surplus: int) -> None:
    """Set the last `surplus` target labels (row-major, positions >= 1) to -100, then drop rows left without any."""
    target = batch["labels"][:, 1:] != IGNORE_INDEX
    flat = target.flatten().nonzero().squeeze(1)
    drop = flat[len(flat) - surplus:]
    rows, cols = drop // target.shape[1], drop % target.shape[1] + 1
    batch["labels"][rows, cols] = IGNORE_INDEX
    keep = (batch["labels"][:, 1:] != IGNORE_INDEX).any(dim=1)
    keep[0] = True
    for key in batch:
        batch[key] = batch[key][keep]

