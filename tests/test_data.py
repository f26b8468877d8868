"""Data pipeline: embedded corpus + tokenizer, padding/packing, determinism, sharding, exact resume, eval budget."""
import gzip
import json
import pathlib

import numpy as np
import pytest
import torch

from peft_pretraining.data import dataloader as data
from peft_pretraining.data import embedded_corpus as corpus

REPO = pathlib.Path(__file__).resolve().parent.parent
AUSTEN = REPO.parent / "shared" / "data" / "austen"


@pytest.fixture(scope="module")
def tokenizer():
    return data.load_tokenizer(data.EMBEDDED)


def stream(tokenizer, **overrides):
    kwargs = dict(dataset=data.EMBEDDED, dataset_path=None, tokenizer=tokenizer, max_length=64, packing=False,
                  batch_size=8, seed=0, rank=0, world_size=1, num_workers=0)
    kwargs.update(overrides)
    return data.build_train_stream(**kwargs)


def take(train_stream, n):
    batches = [next(train_stream) for _ in range(n)]
    train_stream.close()
    return batches


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            assert torch.equal(x[key], y[key]), key


def write_jsonl(path, texts):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")


def sentences(n, prefix):
    # Lengths vary so that padding and packing differ; every document is distinct.
    return [f"{prefix} document {i}. " + " ".join(f"word{i}x{j}" for j in range(3 + (i * 7) % 23)) for i in range(n)]


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------------------
def test_embedded_tokenizer_ids_and_round_trip(tokenizer):
    from transformers import AutoTokenizer

    assert len(tokenizer) == corpus.EMBEDDED_VOCAB_SIZE
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    assert (tokenizer.pad_token, tokenizer.eos_token) == ("<pad>", "</s>")
    text = 'It is a truth universally acknowledged -- "Mr. Darcy!" said she ; café, naïve, 1813.\n\n  Tab\there ?!'
    ids = tokenizer(text)["input_ids"]
    assert ids[-1] == tokenizer.eos_token_id  # like t5-base, special tokens mean a trailing </s>
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    held_out = " ".join(data.read_jsonl_texts(data.embedded_split_path("validation"))[:50])
    assert len(held_out) / len(tokenizer(held_out)["input_ids"]) > 3  # a real subword vocabulary, not characters
    direct = AutoTokenizer.from_pretrained(str(data.TOKENIZER_DIR))
    assert direct.pad_token == "<pad>" and direct.eos_token == "</s>"


@pytest.mark.parametrize("partial", [False, True], ids=["missing", "partial_folder"])
def test_tokenizer_is_rebuilt_when_missing(tmp_path, monkeypatch, tokenizer, partial):
    monkeypatch.setattr(data, "TOKENIZER_DIR", tmp_path / "tokenizer")
    if partial:  # tokenizer.json lost, the rest still there: the rebuilt files complete the folder
        (tmp_path / "tokenizer").mkdir()
        (tmp_path / "tokenizer" / "tokenizer_config.json").write_text("{}")
    rebuilt = data.load_tokenizer(data.EMBEDDED)
    assert (tmp_path / "tokenizer" / "tokenizer.json").exists()
    assert rebuilt.get_vocab() == tokenizer.get_vocab()
    assert not list(tmp_path.glob(".tokenizer-*"))  # no staging folder left behind


def test_vocab_check_and_split_names(tokenizer):
    data.check_vocab_covers_tokenizer(corpus.EMBEDDED_VOCAB_SIZE, tokenizer)
    with pytest.raises(ValueError, match="8000"):
        data.check_vocab_covers_tokenizer(8000, tokenizer)
    assert data.embedded_split_path("validation").exists() and data.embedded_split_path("train").exists()
    with pytest.raises(ValueError, match="'test'"):
        data.embedded_split_path("test")


@pytest.mark.e2e
def test_validation_novel_is_held_out():
    def sources(split):
        with gzip.open(data.embedded_split_path(split), "rt", encoding="utf-8") as f:
            return {json.loads(line)["source"] for line in f}

    assert sources("validation") == {corpus.VALIDATION_NOVEL}
    assert len(sources("train")) == 5 and corpus.VALIDATION_NOVEL not in sources("train")
    train = set(data.read_jsonl_texts(data.embedded_split_path("train")))
    assert not train & set(data.read_jsonl_texts(data.embedded_split_path("validation")))


def test_gutenberg_boilerplate_and_headings_are_stripped():
    raw = ("The Project Gutenberg EBook of X\n\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***\n\nCHAPTER I\n\n"
           "First paragraph\nwrapped here.\n\nSecond one.\n\nChapter 2\n\nThird.\n\n"
           "*** END OF THIS PROJECT GUTENBERG EBOOK X ***\n\nLicence text.")
    documents = corpus.split_novel_into_documents(raw, min_chars=40)
    assert documents == ["First paragraph wrapped here.\nSecond one.", "Third."]


# ---------------------------------------------------------------------------------------------------------------
# Padding vs packing
# ---------------------------------------------------------------------------------------------------------------
def test_padding_batches(tokenizer):
    batches = take(stream(tokenizer, max_length=64, batch_size=8), 5)
    for batch in batches:
        ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
        assert ids.shape == labels.shape == mask.shape == (8, 64) and ids.dtype == torch.long
        assert torch.equal(labels == -100, mask == 0)
        assert torch.equal(labels[mask == 1], ids[mask == 1])
        assert (ids[mask == 0] == tokenizer.pad_token_id).all()
        lengths = mask.sum(1)
        assert (mask == (torch.arange(64) < lengths[:, None]).long()).all()  # right padding
        assert (ids[torch.arange(8), lengths - 1] == tokenizer.eos_token_id).all()  # each document ends with EOS


def test_packing_batches_are_full_eos_joined_documents(tokenizer):
    train_stream = stream(tokenizer, max_length=64, batch_size=8, packing=True)
    batches = take(train_stream, 3)
    for batch in batches:
        assert batch["input_ids"].shape == (8, 64)
        assert (batch["attention_mask"] == 1).all() and torch.equal(batch["labels"], batch["input_ids"])
        assert (batch["input_ids"] != tokenizer.pad_token_id).all()
    flat = torch.cat([b["input_ids"].flatten() for b in batches]).numpy()
    assert (flat == tokenizer.eos_token_id).sum() >= 2
    # The packed stream is exactly the epoch-0 documents, each followed by EOS, cut into windows.
    expected = []
    for text in train_stream.source.iter_epoch(0):
        expected.extend(tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])
        if len(expected) >= len(flat):
            break
    assert np.array_equal(flat, np.asarray(expected[: len(flat)]))


def test_useful_token_fraction(tokenizer):
    def useful_fraction(packing):
        batches = take(stream(tokenizer, max_length=256, batch_size=16, packing=packing), 4)
        return sum(int(b["attention_mask"].sum()) for b in batches) / sum(b["input_ids"].numel() for b in batches)

    assert 0 < useful_fraction(packing=False) < 1
    assert useful_fraction(packing=True) == 1


# ---------------------------------------------------------------------------------------------------------------
# Determinism, sharding, workers, resume
# ---------------------------------------------------------------------------------------------------------------
def test_same_seed_same_batches_other_seed_differs(tokenizer):
    first = take(stream(tokenizer, seed=3), 3)
    assert_same_batches(first, take(stream(tokenizer, seed=3), 3))
    other = take(stream(tokenizer, seed=4), 3)
    assert not torch.equal(first[0]["input_ids"], other[0]["input_ids"])


def test_ranks_are_disjoint_and_interleave_to_single_process(tokenizer):
    single = take(stream(tokenizer, batch_size=4), 2)
    rank0 = take(stream(tokenizer, batch_size=4, rank=0, world_size=2), 1)[0]["input_ids"]
    rank1 = take(stream(tokenizer, batch_size=4, rank=1, world_size=2), 1)[0]["input_ids"]
    assert not torch.equal(rank0, rank1)
    interleaved = torch.stack([row for pair in zip(rank0, rank1) for row in pair])
    assert torch.equal(interleaved, torch.cat([b["input_ids"] for b in single]))


@pytest.mark.parametrize("packing", [False, True])
def test_workers_do_not_change_the_stream(tokenizer, packing):
    assert_same_batches(take(stream(tokenizer, packing=packing), 6),
                        take(stream(tokenizer, packing=packing, num_workers=2), 6))


@pytest.mark.parametrize("packing,num_workers", [(False, 0), (True, 0), (False, 2), (True, 2)])
def test_exact_resume_across_epochs(tmp_path, tokenizer, packing, num_workers):
    # A 12-document corpus, so that 12 batches cross at least one epoch boundary.
    write_jsonl(tmp_path / "corpus" / "train.jsonl", sentences(12, "train"))
    kwargs = dict(dataset="local", dataset_path=str(tmp_path / "corpus"), packing=packing, batch_size=4,
                  max_length=32, num_workers=num_workers, seed=7)
    uninterrupted = take(stream(tokenizer, **kwargs), 12)
    first = stream(tokenizer, **kwargs)
    take(first, 5)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = stream(tokenizer, **kwargs)
    resumed.load_state_dict(state)
    assert_same_batches(take(resumed, 7), uninterrupted[5:])
    assert resumed.state_dict()["epoch"] >= 1


def test_embedded_resume_mid_document(tokenizer):
    kwargs = dict(packing=True, max_length=48, batch_size=3)
    uninterrupted = take(stream(tokenizer, **kwargs), 6)
    first = stream(tokenizer, **kwargs)
    take(first, 4)
    state = first.state_dict()
    assert state["token_offset"] > 0  # the next batch starts inside a document
    resumed = stream(tokenizer, **kwargs)
    resumed.load_state_dict(state)
    assert_same_batches(take(resumed, 2), uninterrupted[4:])
    with pytest.raises(ValueError, match="seed"):
        stream(tokenizer, seed=1, **kwargs).load_state_dict(state)


def test_epochs_are_reshuffled(tmp_path, tokenizer):
    write_jsonl(tmp_path / "corpus" / "train.jsonl", sentences(16, "train"))
    batches = take(stream(tokenizer, dataset="local", dataset_path=str(tmp_path / "corpus"), batch_size=16), 2)
    epoch0, epoch1 = (b["input_ids"] for b in batches)
    assert not torch.equal(epoch0, epoch1)
    as_set = lambda t: sorted(map(tuple, t.tolist()))  # noqa: E731
    assert as_set(epoch0) == as_set(epoch1)  # same documents, new order


def test_epochs_are_reshuffled_on_every_rank_of_two(tmp_path, tokenizer):
    # Two files, two ranks: each rank reads one whole file; its second epoch must come in a new order.
    write_jsonl(tmp_path / "corpus" / "part-0.jsonl", sentences(16, "first"))
    write_jsonl(tmp_path / "corpus" / "part-1.jsonl", sentences(16, "second"))
    write_jsonl(tmp_path / "corpus" / "validation.jsonl", sentences(4, "val"))  # no held-out slice of train
    as_set = lambda t: sorted(map(tuple, t.tolist()))  # noqa: E731
    seen = []
    for rank in (0, 1):
        batches = take(stream(tokenizer, dataset="local", dataset_path=str(tmp_path / "corpus"), batch_size=16,
                              rank=rank, world_size=2), 2)
        epoch0, epoch1 = (b["input_ids"] for b in batches)
        assert as_set(epoch0) == as_set(epoch1)  # one epoch per batch: the same documents ...
        assert not torch.equal(epoch0, epoch1), f"rank {rank} replays epoch 0 in epoch 1"  # ... in a new order
        seen.append(as_set(epoch0))
    assert not set(seen[0]) & set(seen[1])  # the ranks' shares are disjoint


def write_shards(folder, shards, documents_per_shard):
    for shard in range(shards):
        texts = sentences(documents_per_shard, f"shard{shard}")
        with gzip.open(folder / f"train-{shard:05d}.jsonl.gz", "wt", encoding="utf-8") as f:
            f.write("".join(json.dumps({"text": t}) + "\n" for t in texts))
    write_jsonl(folder / "validation.jsonl", sentences(4, "val"))
    return folder


@pytest.fixture(scope="module")
def sixteen_shards(tmp_path_factory):
    return write_shards(tmp_path_factory.mktemp("shards"), 16, 20)


@pytest.mark.parametrize("packing", [False, True])
def test_lanes_do_not_depend_on_workers_and_resume_exactly(sixteen_shards, tokenizer, packing):
    kwargs = dict(dataset="local", dataset_path=str(sixteen_shards), packing=packing, batch_size=5, max_length=32,
                  seed=3, rank=1, world_size=2)
    inline = take(stream(tokenizer, num_workers=0, **kwargs), 40)
    assert_same_batches(inline, take(stream(tokenizer, num_workers=4, **kwargs), 40))
    first = stream(tokenizer, num_workers=2, **kwargs)
    take(first, 27)  # 135 documents or more: inside a lane's chunk, several lanes already started
    state = json.loads(json.dumps(first.state_dict()))
    assert state["num_lanes"] == 8 and len(state["lanes"]) == 8  # 8 shards per rank, one per lane
    resumed = stream(tokenizer, num_workers=4, **kwargs)
    resumed.load_state_dict(state)
    assert_same_batches(take(resumed, 13), inline[27:])


READS = None  # a counter shared with DataLoader workers (fork)


def _count_read(example):
    with READS.get_lock():
        READS.value += 1
    return example


def test_each_document_is_read_once_with_workers(sixteen_shards, tokenizer):
    """Documents read from the files per document used: ~1 (workers own lanes), not ~num_workers."""
    import multiprocessing

    import datasets

    global READS
    READS = multiprocessing.Value("l", 0)
    files = sorted(str(p) for p in sixteen_shards.glob("train-*.jsonl.gz"))
    dataset = datasets.load_dataset("json", data_files=files, split="train", streaming=True).map(_count_read)
    source = data.StreamingSource(dataset, seed=0, rank=0, world_size=1)
    train_stream = data.TrainStream(source, tokenizer, max_length=32, packing=False, batch_size=32, num_workers=4)
    used = sum(len(batch["input_ids"]) for batch in take(train_stream, 64))
    assert used == 2048
    assert 1.0 <= READS.value / used < 1.25, READS.value


# ---------------------------------------------------------------------------------------------------------------
# Evaluation budget
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("world_size", [1, 2])
def test_eval_yields_exactly_eval_tokens(tokenizer, packing, world_size):
    eval_tokens = 1001  # odd, and not a multiple of any batch's target count: the last batch must be trimmed
    per_rank = []
    for rank in range(world_size):
        batches = list(data.iter_eval_batches(dataset=data.EMBEDDED, dataset_path=None, tokenizer=tokenizer,
                                              max_length=64, packing=packing, batch_size=8, eval_tokens=eval_tokens,
                                              rank=rank, world_size=world_size))
        assert all(b["input_ids"].shape[1] == 64 for b in batches)
        per_rank.append(sum(data.count_target_tokens(b["labels"]) for b in batches))
    assert sum(per_rank) == eval_tokens
    assert all(tokens > 0 for tokens in per_rank)  # ranks hold whole rows of one eval set, so near (not exactly) equal


def eval_rows(tokenizer, *, packing, rank, world_size, eval_tokens=20_000, batch_size=8):
    """This rank's eval rows as (input_ids, labels, attention_mask) tuples of ints, in the order yielded."""
    batches = data.iter_eval_batches(dataset=data.EMBEDDED, dataset_path=None, tokenizer=tokenizer, max_length=64,
                                     packing=packing, batch_size=batch_size, eval_tokens=eval_tokens, rank=rank,
                                     world_size=world_size)
    rows = []
    for batch in batches:
        assert 0 < len(batch["input_ids"]) <= batch_size
        rows.extend(tuple(tuple(batch[k][i].tolist()) for k in ("input_ids", "labels", "attention_mask"))
                    for i in range(len(batch["input_ids"])))
    return rows


@pytest.mark.parametrize("packing", [False, True])
def test_eval_set_does_not_depend_on_world_size(tokenizer, packing):
    """The ranks split one eval set (world size 1's rows) between them, so eval losses compare across GPU counts."""
    single = eval_rows(tokenizer, packing=packing, rank=0, world_size=1)
    assert sum(sum(label != data.IGNORE_INDEX for label in row[1][1:]) for row in single) == 20_000
    assert len(set(single)) == len(single)  # distinct rows, so disjointness below is a real check
    for world_size in (2, 3):
        per_rank = [eval_rows(tokenizer, packing=packing, rank=r, world_size=world_size) for r in range(world_size)]
        assert all(per_rank)
        for a in range(world_size):
            for b in range(a + 1, world_size):
                assert not set(per_rank[a]) & set(per_rank[b]), (world_size, a, b)
        assert sorted(row for rows in per_rank for row in rows) == sorted(single), world_size
        # Rank r holds rows r, r + W, r + 2W, ... of world size 1's order.
        assert per_rank == [single[r::world_size] for r in range(world_size)], world_size


def test_eval_rank_without_rows_gets_one_masked_row(tokenizer):
    # One packed row of 63 targets holds all 3 eval tokens: rank 0 gets it, ranks 1 and 2 a row with no targets
    # (lockstep FSDP evaluation needs every rank to have a batch).
    rows = [eval_rows(tokenizer, packing=True, rank=r, world_size=3, eval_tokens=3) for r in range(3)]
    assert rows[0] == eval_rows(tokenizer, packing=True, rank=0, world_size=1, eval_tokens=3)
    assert all(len(r) == 1 and set(r[0][1]) == {data.IGNORE_INDEX} for r in rows[1:])


def test_eval_short_split_yields_everything_and_warns(tmp_path, tokenizer):
    texts = sentences(12, "val")
    write_jsonl(tmp_path / "corpus" / "train.jsonl", sentences(5, "train"))
    write_jsonl(tmp_path / "corpus" / "validation.jsonl", texts)
    everything = sum(min(len(tokenizer(t, add_special_tokens=False)["input_ids"]) + 1, 32) - 1 for t in texts)
    with pytest.warns(UserWarning, match="eval_tokens"):
        batches = list(data.iter_eval_batches(dataset="local", dataset_path=str(tmp_path / "corpus"),
                                              tokenizer=tokenizer, max_length=32, packing=False, batch_size=5,
                                              eval_tokens=10 ** 6, rank=0, world_size=1))
    assert sum(data.count_target_tokens(b["labels"]) for b in batches) == everything


# ---------------------------------------------------------------------------------------------------------------
# Local files and the hub code path
# ---------------------------------------------------------------------------------------------------------------
def decoded_documents(tokenizer, batches):
    return {tokenizer.decode(row[mask == 1], skip_special_tokens=True)
            for b in batches for row, mask in zip(b["input_ids"], b["attention_mask"])}


@pytest.mark.e2e
@pytest.mark.filterwarnings("ignore:the validation split gives")
def test_local_jsonl_folder_with_validation_file(tmp_path, tokenizer):
    write_jsonl(tmp_path / "corpus" / "part-0.jsonl", sentences(10, "train"))
    write_jsonl(tmp_path / "corpus" / "my_val.jsonl", sentences(6, "val"))
    train = decoded_documents(tokenizer, take(stream(tokenizer, dataset="local", dataset_path=str(tmp_path / "corpus"),
                                               max_length=512, batch_size=10), 1))
    assert train == set(sentences(10, "train"))
    val = decoded_documents(tokenizer, data.iter_eval_batches(
        dataset="local", dataset_path=str(tmp_path / "corpus"), tokenizer=tokenizer, max_length=512, packing=False,
        batch_size=6, eval_tokens=10 ** 6, rank=0, world_size=1))
    assert val == set(sentences(6, "val"))


@pytest.mark.e2e
def test_local_txt_without_validation_holds_out_a_slice(tmp_path, tokenizer):
    texts = sentences(80, "para")
    (tmp_path / "books").mkdir()
    (tmp_path / "books" / "a.txt").write_text("\n\n".join(texts[:40]) + "\n", encoding="utf-8")
    (tmp_path / "books" / "b.txt").write_text("\n\n".join(texts[40:]) + "\n", encoding="utf-8")
    path = str(tmp_path / "books")
    with pytest.warns(UserWarning):
        val = decoded_documents(tokenizer, data.iter_eval_batches(
            dataset="local", dataset_path=path, tokenizer=tokenizer, max_length=512, packing=False, batch_size=80,
            eval_tokens=10 ** 6, rank=0, world_size=1))
    train_stream = stream(tokenizer, dataset="local", dataset_path=path, max_length=512, batch_size=1)
    train = decoded_documents(tokenizer, take(train_stream, 128))  # two lanes (files), 32 documents at a time
    val, train = {t.strip() for t in val}, {t.strip() for t in train}  # the last paragraph keeps its newline
    assert val and train and not val & train
    assert val | train == set(texts)  # paragraphs are the documents of a .txt file


def test_local_validation_file_naming(tmp_path):
    write_jsonl(tmp_path / "a" / "train.jsonl", ["x"])
    write_jsonl(tmp_path / "a" / "validation.jsonl", ["y"])  # sibling of the file given as --dataset_path
    assert data.resolve_local_splits(str(tmp_path / "a" / "train.jsonl")) == (
        [tmp_path / "a" / "train.jsonl"], [tmp_path / "a" / "validation.jsonl"])
    write_jsonl(tmp_path / "b" / "interval_notes.jsonl", ["x"])  # "interval" is not a validation name
    write_jsonl(tmp_path / "b" / "part.jsonl", ["y"])
    assert data.resolve_local_splits(str(tmp_path / "b")) == (
        [tmp_path / "b" / "interval_notes.jsonl", tmp_path / "b" / "part.jsonl"], None)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "x.txt").write_text("a")
    write_jsonl(tmp_path / "c" / "y.jsonl", ["b"])
    with pytest.raises(ValueError, match="--dataset_path"):
        stream(None, dataset="local", dataset_path=str(tmp_path / "c"))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.jsonl").write_text(json.dumps({"content": "no text field"}) + "\n")
    with pytest.raises(ValueError, match="--dataset_path.*text"):
        stream(None, dataset="local", dataset_path=str(tmp_path / "d"))


@pytest.mark.parametrize("name, validation", [
    ("val.jsonl", True), ("my_val/part.jsonl", True), ("valid.txt", True), ("c4-validation.00000.json.gz", True),
    ("VAL/a.txt", True), ("interval.txt", False), ("valley_of_fear.txt", False), ("train_values.jsonl", False),
    ("evaluation.txt", False)])
def test_validation_file_names_are_whole_words(name, validation):
    assert data._is_validation_name(name) == validation


def test_bad_local_data_is_found_before_or_named_by_a_value_error(tmp_path, tokenizer):
    """Each of these used to pass start-up and then stop a run mid-way with a traceback."""
    write_jsonl(tmp_path / "corpus" / "a.jsonl", sentences(12, "train"))
    write_jsonl(tmp_path / "corpus" / "val.jsonl", sentences(4, "val"))
    (tmp_path / "corpus" / "b.jsonl").write_text("")  # an empty shard: its lane would find no document
    with pytest.warns(UserWarning, match="empty file"):
        assert data.resolve_local_splits(str(tmp_path / "corpus"))[0] == [tmp_path / "corpus" / "a.jsonl"]
        assert len(take(stream(tokenizer, dataset="local", dataset_path=str(tmp_path / "corpus"), batch_size=4),
                        8)) == 8
    records = [{"text": t} for t in sentences(6, "train")] + [{"text": None}]
    (tmp_path / "nulls").mkdir()
    (tmp_path / "nulls" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(ValueError, match="\"text\" is NoneType.*--dataset_path"):
        take(stream(tokenizer, dataset="local", dataset_path=str(tmp_path / "nulls" / "train.jsonl"),
                    batch_size=7), 1)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_bad_data_found_in_a_worker_is_the_same_one_line_error(tmp_path, tokenizer, num_workers):
    """The trainer's default --workers 8 reads in DataLoader workers, which wrap an error in their traceback."""
    records = [{"text": t} for t in sentences(6, "train")] + [{"text": None}]
    (tmp_path / "nulls").mkdir()
    (tmp_path / "nulls" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(ValueError) as error:
        take(stream(tokenizer, dataset="local", dataset_path=str(tmp_path / "nulls" / "train.jsonl"), batch_size=7,
                    num_workers=num_workers), 1)
    assert str(error.value) == "a document's \"text\" is NoneType, not a string (--dataset / --dataset_path)"


@pytest.mark.parametrize("damage", ["not_gzip", "truncated_gzip", "malformed_json"])
@pytest.mark.parametrize("name", ["a.jsonl.gz", "b.jsonl.gz", "val.jsonl.gz"])
def test_an_unreadable_local_file_is_a_one_line_error_naming_it(tmp_path, tokenizer, damage, name):
    corpus = tmp_path / "corpus"
    for good in ("a.jsonl.gz", "b.jsonl.gz", "val.jsonl.gz"):
        texts = sentences(6, good[0])
        (corpus / good).parent.mkdir(exist_ok=True)
        (corpus / good).write_bytes(gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in texts).encode()))
    content = (corpus / name).read_bytes()
    (corpus / name).write_bytes({"not_gzip": b"plain bytes", "truncated_gzip": content[:-12],
                                 "malformed_json": gzip.compress(gzip.decompress(content) + b"{not json\n")}[damage])
    with pytest.raises(ValueError, match=f"^--dataset_path {corpus / name}: cannot be read") as error:
        take(stream(tokenizer, dataset="local", dataset_path=str(corpus), batch_size=8, num_workers=2), 10)
        list(data.iter_eval_batches(dataset="local", dataset_path=str(corpus), tokenizer=tokenizer, max_length=64,
                                    packing=False, batch_size=4, eval_tokens=10 ** 6, rank=0, world_size=1))
    assert "\n" not in str(error.value)


def test_empty_documents_get_no_row_and_a_corpus_of_them_is_an_error(tmp_path, tokenizer):
    texts = [t for pair in zip(sentences(6, "train"), [""] * 6) for t in pair]
    write_jsonl(tmp_path / "corpus" / "train.jsonl", texts)
    write_jsonl(tmp_path / "corpus" / "validation.jsonl", ["", *sentences(2, "val"), ""])
    path = str(tmp_path / "corpus")
    batches = take(stream(tokenizer, dataset="local", dataset_path=path, batch_size=3, max_length=512), 4)
    assert all((batch["attention_mask"].sum(dim=1) >= 2).all() for batch in batches)
    assert decoded_documents(tokenizer, batches) == set(sentences(6, "train"))  # two epochs of the non-empty six
    eval_rows = [row for batch in data.iter_eval_batches(dataset="local", dataset_path=path, tokenizer=tokenizer,
                                                         max_length=64, packing=False, batch_size=4,
                                                         eval_tokens=40, rank=0, world_size=1)
                 for row in batch["attention_mask"]]
    assert all(row.sum() >= 2 for row in eval_rows)
    # Two files are two lanes, each with its own epochs: an all-empty small file must not stop a corpus whose other
    # file has documents, however fast the small one cycles; two all-empty files must.
    write_jsonl(tmp_path / "mixed" / "a.jsonl", ["" if i % 3 == 0 else f"Emma {i} walked." for i in range(300)])
    write_jsonl(tmp_path / "mixed" / "b.jsonl", [""] * 2)
    write_jsonl(tmp_path / "mixed" / "val.jsonl", sentences(2, "val"))
    assert len(take(stream(tokenizer, dataset="local", dataset_path=str(tmp_path / "mixed"), batch_size=8), 60)) == 60
    write_jsonl(tmp_path / "empty" / "train.jsonl", [""] * 5)
    write_jsonl(tmp_path / "empty" / "more.jsonl", [""] * 2)
    write_jsonl(tmp_path / "empty" / "validation.jsonl", [""] * 3)
    with pytest.raises(ValueError, match="no training document holds a target token"):
        take(stream(tokenizer, dataset="local", dataset_path=str(tmp_path / "empty"), batch_size=2), 1)
    with pytest.raises(ValueError, match="validation split holds no target token"):
        next(data.iter_eval_batches(dataset="local", dataset_path=str(tmp_path / "empty"), tokenizer=tokenizer,
                                    max_length=64, packing=False, batch_size=2, eval_tokens=10, rank=0,
                                    world_size=1))


@pytest.mark.e2e
def test_a_stream_saved_with_one_tokenizer_does_not_resume_with_another(tmp_path, tokenizer):
    from utils.offline_fixtures import write_t5_style_tokenizer

    first = stream(tokenizer, packing=True, max_length=48, batch_size=3)
    take(first, 2)
    other = data.load_tokenizer(str(write_t5_style_tokenizer(tmp_path / "t5")))
    with pytest.raises(ValueError, match="vocab"):
        stream(other, packing=True, max_length=48, batch_size=3).load_state_dict(first.state_dict())


def test_a_folder_without_tokenizer_files_names_the_flag(tmp_path):
    (tmp_path / "not_a_tokenizer").mkdir()
    (tmp_path / "not_a_tokenizer" / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="--tokenizer"):
        data.load_tokenizer(str(tmp_path / "not_a_tokenizer"))


def test_missing_local_path_names_the_flag(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="--dataset_path.*nowhere"):
        stream(tokenizer, dataset="local", dataset_path=str(tmp_path / "nowhere"))


@pytest.mark.filterwarnings("ignore:the validation split gives")
def test_hub_code_path_on_a_local_dataset_repo(tmp_path, tokenizer):
    # A local folder is a valid `load_dataset` repo: this runs the exact code GPU users run on allenai/c4.
    write_jsonl(tmp_path / "repo" / "train.jsonl", sentences(20, "train"))
    write_jsonl(tmp_path / "repo" / "validation.jsonl", sentences(8, "val"))
    kwargs = dict(dataset=str(tmp_path / "repo"), dataset_path=None, max_length=512, batch_size=5)
    rank0 = take(stream(tokenizer, rank=0, world_size=2, num_workers=2, **kwargs), 2)
    rank1 = take(stream(tokenizer, rank=1, world_size=2, **kwargs), 2)
    seen0, seen1 = decoded_documents(tokenizer, rank0), decoded_documents(tokenizer, rank1)
    assert seen0 and seen1 and not seen0 & seen1 and seen0 | seen1 == set(sentences(20, "train"))
    val = decoded_documents(tokenizer, data.iter_eval_batches(tokenizer=tokenizer, packing=False, eval_tokens=10 ** 6,
                                                        rank=0, world_size=1, **kwargs))
    assert val == set(sentences(8, "val"))
    with pytest.raises(ValueError, match="--dataset"):
        stream(tokenizer, dataset=str(tmp_path / "no_such_repo"))


# ---------------------------------------------------------------------------------------------------------------
# Build command
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.skipif(not AUSTEN.is_dir(), reason="raw novels not available (they live outside the repository)")
def test_build_command_reproduces_the_shipped_corpus(tmp_path):
    corpus.main(["build-embedded", "--source", str(AUSTEN), "--out_dir", str(tmp_path / "embedded"),
                 "--tokenizer_dir", str(tmp_path / "tokenizer")])
    for split in data.EMBEDDED_SPLITS:
        rebuilt = (tmp_path / "embedded" / f"{split}.jsonl.gz").read_bytes()
        assert rebuilt == data.embedded_split_path(split).read_bytes()
    rebuilt = (tmp_path / "tokenizer" / "tokenizer.json").read_bytes()
    assert rebuilt == (data.TOKENIZER_DIR / "tokenizer.json").read_bytes()


def test_build_command_rejects_a_bad_source(tmp_path, capsys):
    with pytest.raises(SystemExit):
        corpus.main(["build-embedded", "--source", str(tmp_path / "missing")])
    assert "--source" in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [(["--batch_size", "0"], "--batch_size"),
                                        (["--train_steps", "0"], "--train_steps"),
                                        (["--streaming", "--shards", "0"], "--shards"),
                                        (["--streaming", "--workers", "2", "-1"], "--workers"),
                                        (["--streaming", "--documents_per_shard", "3"], "--documents_per_shard")])
def test_benchmark_dataloader_rejects_bad_numbers_in_one_line(argv, flag, capsys):
    from utils.bench.benchmark_dataloader import main

    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2 and flag in capsys.readouterr().err
