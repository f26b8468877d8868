"""`build-corpus`: the Wikipedia corpus from its public WikiExtractor source (issue 65). Most tests build from a tiny
WikiExtractor-shaped source they write themselves; the e2e ones build from the real source, folder text/AA of
jason-feng/wikiVisual at commit 1c0fac9 named by $WIKIPEDIA_SOURCE, and compare with ../shared/data/wikipedia."""
import gzip
import html
import json
import os
import pathlib
import random

import pytest

from peft_pretraining.data import wikipedia_corpus

SOURCE_VARIABLE = "WIKIPEDIA_SOURCE"
SHORT = wikipedia_corpus.MIN_ARTICLE_CHARS


def paragraph(rng: random.Random) -> str:
    words = ["".join(rng.choice("aeiourstlnmp") for _ in range(rng.randint(2, 9))) for _ in range(40)]
    return " ".join(words).capitalize() + "."


def doc_lines(page_id: int, title: str, body: list[str], title_line: str | None = None) -> list[str]:
    """One article as WikiExtractor writes it: the header with XML-escaped attributes, the title line, the body."""
    return [f'<doc id="{page_id}" url="http://en.wikipedia.org/wiki?curid={page_id}" title="{html.escape(title)}">',
            title if title_line is None else title_line, "", *body, "", "</doc>"]


def write_source(folder: pathlib.Path, files: dict[str, list[list[str]]]) -> pathlib.Path:
    folder.mkdir(parents=True)
    for name, docs in files.items():
        (folder / name).write_text("".join(line + "\n" for doc in docs for line in doc), encoding="utf-8")
    return folder


# The article that exercises the text rules: trailing whitespace (spaces, a tab, a no-break space), a run of blank
# and whitespace-only lines, an indented line whose indent stays.
RULES_BODY = ["First paragraph, long enough: " + "word " * 40 + "end.  ", "", "", "", "  Indented line\xa0", "   ",
              "", "Heading.", "Last line.\t"]
RULES_TEXT = "First paragraph, long enough: " + "word " * 40 + "end.\n\n  Indented line\n\nHeading.\nLast line."


@pytest.fixture
def source(tmp_path):
    """Three files of long articles with a few special ones among them. File wiki_02 holds the lowest page ids, so
    file order and id order differ."""
    rng = random.Random(65)
    long_body = lambda: [paragraph(rng) for _ in range(3)]  # noqa: E731
    specials = {
        5: doc_lines(5, "Rules", RULES_BODY),
        # a title WikiExtractor escaped twice on its title line: the line is not the title, so it stays
        7: doc_lines(7, "Dungeons & Dragons", long_body(), title_line="Dungeons &amp; Dragons"),
        # 199 characters of text: left out, though with its title line it would be over 200
        9: doc_lines(9, "A title long enough to carry a short article over the limit", ["s" * (SHORT - 1)]),
        11: doc_lines(11, "Exactly at the limit", ["e" * SHORT]),
        # 199 characters and more than 200 bytes: the limit counts characters
        13: doc_lines(13, "Accents", ["é" * (SHORT - 1)]),
    }
    plain = {page_id: doc_lines(page_id, f"Article {page_id}", long_body()) for page_id in range(20, 120, 2)}
    ids = sorted([*specials, *plain])
    docs = {**specials, **plain}
    files = {"wiki_00": [docs[i] for i in ids[10:30]], "wiki_01": [docs[i] for i in ids[30:]],
             "wiki_02": [docs[i] for i in ids[:10]]}
    return write_source(tmp_path / "text" / "AA", files)


def read_records(path: pathlib.Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


def read_corpus(folder: pathlib.Path) -> dict[str, list[dict]]:
    """{file path relative to the corpus folder: its records} for every file of a built corpus."""
    return {str(path.relative_to(folder)): read_records(path) for path in sorted(folder.rglob("*.jsonl.gz"))}


def page_id(record: dict) -> int:
    return int(record["url"].rsplit("=", 1)[1])


def test_article_text_drops_the_title_line_trailing_whitespace_and_blank_runs():
    assert wikipedia_corpus.article_text(["Rules", "", *RULES_BODY, ""], "Rules") == RULES_TEXT
    # only a first line that is the title goes
    assert wikipedia_corpus.article_text(["Intro", "Rules"], "Rules") == "Intro\nRules"


def test_build_keeps_the_long_articles_with_their_title_and_url(source, tmp_path):
    counts = wikipedia_corpus.build_corpus(source, tmp_path / "wiki")
    records = {page_id(r): r for rs in read_corpus(tmp_path / "wiki").values() for r in rs}
    assert set(records) == {5, 7, 11, *range(20, 120, 2)}  # 9 and 13 are under the limit
    assert counts["articles"] == len(records) + 2 and counts["kept"] == len(records)
    assert records[5] == {"text": RULES_TEXT, "title": "Rules", "url": "http://en.wikipedia.org/wiki?curid=5"}
    assert records[7]["title"] == "Dungeons & Dragons"  # the header's attribute, unescaped
    assert records[7]["text"].startswith("Dungeons &amp; Dragons\n\n")
    assert len(records[11]["text"]) == SHORT
    assert all(not r["text"].startswith(r["title"]) for i, r in records.items() if i != 7)


def test_every_20th_article_in_id_order_is_held_out_and_the_rest_dealt_to_ten_files(source, tmp_path):
    wikipedia_corpus.build_corpus(source, tmp_path / "wiki")
    corpus = read_corpus(tmp_path / "wiki")
    train_names = [f"train/wiki_{shard:02d}.jsonl.gz" for shard in range(wikipedia_corpus.TRAIN_SHARDS)]
    assert sorted(corpus) == sorted([*train_names, "validation.jsonl.gz"])
    ids = sorted(page_id(r) for rs in corpus.values() for r in rs)
    validation = [page_id(r) for r in corpus["validation.jsonl.gz"]]
    assert validation == ids[19::20] and validation
    train = [i for i in ids if i not in validation]
    for shard, name in enumerate(train_names):
        assert [page_id(r) for r in corpus[name]] == train[shard::10], name


def test_a_rebuild_is_byte_identical_and_the_trainer_reads_it(source, tmp_path):
    first, second = tmp_path / "first" / "wiki", tmp_path / "second"
    wikipedia_corpus.build_corpus(source, first)
    second.mkdir()  # an empty folder is fine
    wikipedia_corpus.main(["build-corpus", "--source", str(source), "--out", str(second)])  # the documented CLI
    files = sorted(path.relative_to(first) for path in first.rglob("*") if path.is_file())
    assert files == sorted(path.relative_to(second) for path in second.rglob("*") if path.is_file())
    for name in files:
        data = (first / name).read_bytes()
        assert data == (second / name).read_bytes(), name
        assert data[4:8] == bytes(4)  # mtime 0
        assert data[10:].startswith(name.name.removesuffix(".gz").encode() + b"\0")  # the file's name, as gzip(1)
    assert first.stat().st_mode & 0o777 == 0o755  # not the private mode of a temporary folder
    train, validation = wikipedia_corpus.corpus_paths(first)
    assert len(wikipedia_corpus.read_train_texts(train)) + len(read_records(validation)) == \
        sum(len(rs) for rs in read_corpus(first).values())
    assert not [path for path in tmp_path.rglob(".wikipedia-*")]  # no staging folder left


@pytest.mark.parametrize("case", ["missing source", "no wiki files", "out not empty", "unclosed doc", "not utf-8"])
def test_bad_input_is_one_line_and_touches_nothing(case, source, tmp_path, capsys):
    out = tmp_path / "out"
    argv_source, expected = source, "--source "
    if case == "missing source":
        argv_source = tmp_path / "nowhere"
    elif case == "no wiki files":
        argv_source = tmp_path / "empty"
        argv_source.mkdir()
    elif case == "out not empty":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
        expected = "--out "
    elif case == "unclosed doc":
        with (source / "wiki_01").open("a", encoding="utf-8") as handle:
            handle.write('<doc id="999" url="u" title="Open">\nOpen\n')
        expected = "wiki_01: the <doc> at line"
    else:
        (source / "wiki_01").write_bytes((source / "wiki_01").read_bytes() + "é".encode("latin-1"))
        expected = "wiki_01 is not UTF-8"
    with pytest.raises(SystemExit) as exit_info:
        wikipedia_corpus.main(["build-corpus", "--source", str(argv_source), "--out", str(out)])
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    assert message.count("\n") == 1 and expected in message.split(": error: ", 1)[1]
    if case == "out not empty":
        assert [path.name for path in out.iterdir()] == ["keep.txt"]
    else:
        assert not out.exists()
    assert not [path for path in tmp_path.rglob(".wikipedia-*")]


def test_too_few_articles_for_a_validation_article_is_one_line(tmp_path, capsys):
    rng = random.Random(1)
    folder = write_source(tmp_path / "AA", {"wiki_00": [doc_lines(i, f"A{i}", [paragraph(rng)] * 3)
                                                        for i in range(wikipedia_corpus.VALIDATION_EVERY - 1)]})
    with pytest.raises(SystemExit):
        wikipedia_corpus.main(["build-corpus", "--source", str(folder), "--out", str(tmp_path / "out")])
    assert "fewer than the" in capsys.readouterr().err and not (tmp_path / "out").exists()


# The real source against the shared corpus: both must be here.
real_source = pathlib.Path(os.environ.get(SOURCE_VARIABLE, "/nonexistent"))
needs_source_and_corpus = pytest.mark.skipif(
    not (real_source / "wiki_00").is_file() or not (wikipedia_corpus.DEFAULT_WIKIPEDIA_DIR / "train").is_dir(),
    reason=f"needs ${SOURCE_VARIABLE} (text/AA of jason-feng/wikiVisual at 1c0fac9) and ../shared/data/wikipedia")


@pytest.fixture(scope="module")
def built_from_the_public_source(tmp_path_factory):
    out = tmp_path_factory.mktemp("public") / "wikipedia"
    wikipedia_corpus.build_corpus(real_source, out)
    return out


@needs_source_and_corpus
@pytest.mark.e2e
def test_the_public_source_gives_the_shared_corpus_record_for_record(built_from_the_public_source):
    built, shared = read_corpus(built_from_the_public_source), read_corpus(wikipedia_corpus.DEFAULT_WIKIPEDIA_DIR)
    assert sorted(built) == sorted(shared)
    for name, records in shared.items():
        assert len(built[name]) == len(records), name
        for index, (ours, theirs) in enumerate(zip(built[name], records)):
            assert ours == theirs, f"{name} record {index} ({theirs['title']})"


@needs_source_and_corpus
@pytest.mark.e2e
def test_the_public_source_gives_the_shared_corpus_byte_for_byte(built_from_the_public_source):
    shared = wikipedia_corpus.DEFAULT_WIKIPEDIA_DIR
    for path in sorted(shared.rglob("*.jsonl.gz")):
        name = path.relative_to(shared)
        # beyond the records, this depends on zlib's deflate (1.2.13 here): a different build may cut otherwise
        assert (built_from_the_public_source / name).read_bytes() == path.read_bytes(), name
