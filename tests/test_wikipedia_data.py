"""The Wikipedia corpus as a named dataset (issue 47): its tokenizer, the absent-corpus error, the trainer and the
study tools reading it. Most tests use a tiny C4-shaped fixture; the ones marked `needs_corpus` read the real corpus
in ../shared/data/wikipedia and are skipped where it is absent."""
import json
import random

import pytest

from peft_pretraining.data import wikipedia_corpus
from peft_pretraining.data.embedded_corpus import write_jsonl_gz
from tests.conftest import REPO, TINY_RUN, run_trainer

needs_corpus = pytest.mark.skipif(not (wikipedia_corpus.DEFAULT_WIKIPEDIA_DIR / "train").is_dir(),
                                  reason="the Wikipedia corpus is not in ../shared/data/wikipedia")


def fake_article(rng: random.Random, title: str) -> dict:
    """A few paragraphs of made-up words: enough repeated pairs for a BPE to learn merges."""
    syllables = ["an", "ar", "is", "to", "le", "ma", "ri", "on", "que", "st", "ph", "il", "os", "ta", "ne"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(300)]
    paragraphs = [" ".join(rng.choice(words) for _ in range(rng.randint(10, 30))).capitalize() + "."
                  for _ in range(rng.randint(1, 3))]
    return {"text": f"{title}\n" + "\n".join(paragraphs), "title": title, "url": f"https://example.org/{title}"}


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    """A C4-shaped corpus of the real one's layout (train shards of unequal size, validation.jsonl.gz beside them),
    which the tools find through WIKIPEDIA_DATA_DIR. The stream reads 32 articles from a shard at a time, so the
    shards hold several such chunks."""
    rng = random.Random(47)
    folder = tmp_path / "wiki"
    for shard, count in enumerate((96, 96, 48)):
        write_jsonl_gz(folder / "train" / f"wiki_{shard:02d}.jsonl.gz",
                       [fake_article(rng, f"Train{shard}_{n}") for n in range(count)])
    write_jsonl_gz(folder / "validation.jsonl.gz", [fake_article(rng, f"Held{n}") for n in range(4)])
    monkeypatch.setenv(wikipedia_corpus.DATA_DIR_VARIABLE, str(folder))
    return folder


def test_tokenizer_rebuilds_byte_identical(corpus, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    wikipedia_corpus.build_tokenizer(corpus / "train", first, vocab_size=400)
    wikipedia_corpus.main(["build-tokenizer", "--out_dir", str(second), "--vocab_size", "400"])  # the documented CLI
    files = sorted(path.name for path in first.iterdir())
    assert files == sorted(path.name for path in second.iterdir()) and "tokenizer.json" in files
    for name in files:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_tokenizer_is_trained_on_the_train_split_only(corpus, tmp_path):
    tokenizer = wikipedia_corpus.build_tokenizer(corpus / "train", tmp_path / "tok", vocab_size=400)
    assert len(tokenizer) == 400
    assert [tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id] == [0, 1, 2]
    text = "Validation text, unseen: ünïcode & digits 2015."
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text  # byte level: lossless
    assert not any(path.name.startswith(".tokenizer-") for path in tmp_path.iterdir())  # no staging folder left


def test_absent_corpus_is_one_line_naming_its_source_and_the_way_around(tmp_path, monkeypatch, capsys):
    from peft_pretraining.training.args_utils import parse_args

    monkeypatch.setenv(wikipedia_corpus.DATA_DIR_VARIABLE, str(tmp_path / "nowhere"))
    with pytest.raises(SystemExit) as exit_info:
        parse_args([*TINY_RUN, "--dataset", "wikipedia"])
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    assert message.count("\n") == 1 and message.split(": error: ", 1)[1].startswith("--dataset wikipedia: ")
    for needed in (str(tmp_path / "nowhere"), "build-corpus", "CC BY-SA", wikipedia_corpus.DATA_DIR_VARIABLE,
                   "WikiExtractor", "C4-style"):
        assert needed in message, needed


def test_the_named_dataset_reads_the_folder_the_variable_names(corpus):
    from peft_pretraining.training.args_utils import parse_args

    args = parse_args([*TINY_RUN, "--dataset", "wikipedia"])
    assert args.dataset_path == str(corpus / "train") and args.tokenizer == "wikipedia"
    given = parse_args([*TINY_RUN, "--dataset", "wikipedia", "--dataset_path", str(corpus / "train"),
                        "--tokenizer", "embedded"])
    assert given.tokenizer == "embedded"  # an explicit tokenizer wins


def test_committed_tokenizer_loads_by_name():
    from peft_pretraining.data.dataloader import load_tokenizer

    tokenizer = load_tokenizer("wikipedia")
    assert len(tokenizer) == wikipedia_corpus.WIKIPEDIA_VOCAB_SIZE
    assert tokenizer.eos_token_id == 1 and tokenizer.pad_token_id == 0


@pytest.mark.e2e
def test_trainer_trains_and_evaluates_on_the_named_dataset(corpus, tmp_path):
    run = tmp_path / "run"
    result = run_trainer([*TINY_RUN, "--dataset", "wikipedia", "--packing", "--num_training_steps", "3",
                          "--warmup_steps", "1", "--eval_every", "3", "--eval_tokens", "200", "--save_every", "3",
                          "--save_dir", run])
    assert result.returncode == 0, result.stderr[-2000:]
    results = json.loads((run / "results.json").read_text())
    assert results["status"] == "finished" and results["final_eval_loss"] is not None
    assert json.loads((run / "model_3" / "config.json").read_text())["eos_token_id"] == 1

    # The study's analyses of that checkpoint read the corpus's validation articles: the fixture has 4, the embedded
    # held-out novel hundreds, so asking for 10 documents tells the two apart.
    from utils.study import analyse, runs

    settings = runs.AnalysisSettings(max_seq_len=32, stream_tokens=64, jacobian_tokens=2, jacobian_probes=0,
                                       removal_documents=10, heldout="wikipedia")
    analysis = analyse.analyse_checkpoint(run / "model_3", settings)
    assert len(analysis["removal_document_nats"]) == 4
    assert len(analysis["variance"]) == 5  # the embeddings and the 4 layers of the tiny config


def test_updates_before_repeat_stops_where_the_smallest_lane_wraps(corpus):
    from peft_pretraining.data.dataloader import build_train_stream, load_tokenizer

    tokenizer = load_tokenizer("wikipedia")
    settings = dict(batch_size=2, max_length=64, seed=1)
    updates = wikipedia_corpus.updates_before_repeat(tokenizer, **settings)
    # The three shards are three lanes read 32 articles at a time; the 48-article shard wraps after 32 + 32 + 32 +
    # 32 + 32 + 16 = 176 articles, well before the pass of all 240 is over.
    stream = build_train_stream(dataset="wikipedia", dataset_path=str(corpus / "train"), tokenizer=tokenizer,
                                max_length=64, packing=True, batch_size=2, seed=1, rank=0, world_size=1)
    epochs = [stream.state_dict()["epoch"] for _, _ in zip(range(updates + 1), stream)]
    stream.close()
    assert set(epochs[:updates]) == {0} and epochs[updates] == 1
    pass_tokens = sum(len(ids) + 1 for ids in tokenizer(wikipedia_corpus.read_train_texts(corpus / "train"),
                                                        add_special_tokens=False)["input_ids"])
    assert 0 < updates * 2 * 64 < 0.9 * pass_tokens


def test_depth_sweep_budget_refuses_to_start_without_the_corpus(tmp_path, monkeypatch, capsys):
    from utils import depth_sweep

    monkeypatch.setenv(wikipedia_corpus.DATA_DIR_VARIABLE, str(tmp_path / "nowhere"))
    for budget in ("wikipedia", "wikipedia_pilot"):
        with pytest.raises(SystemExit):
            depth_sweep.parse_args(["--budget", budget, "--runs_dir", str(tmp_path / "runs")])
        message = capsys.readouterr().err
        assert message.count("\n") == 1 and f"--budget {budget}: the Wikipedia corpus is not at" in message
    depth_sweep.parse_args(["--budget", "wikipedia", "--report_only"])  # a report needs only the records
    depth_sweep.parse_args(["--budget", "wikipedia", "--plan"])  # and a plan only the records and the flags


def test_depth_sweep_wikipedia_runs_and_analyses_read_the_corpus(corpus, tmp_path):
    from utils import depth_sweep
    from utils.study import analyse, runs

    args = depth_sweep.parse_args(["--budget", "wikipedia", "--dtype", "float32", "--no-compile",
                                   "--runs_dir", str(tmp_path / "runs")])
    s = args.settings
    specs = depth_sweep.run_specs(args)
    assert {spec.arm for spec in specs} == {f"L{d}-{n}" for d in (6, 12, 24, 48) for n in ("pre", "lns")}
    assert {spec.seed for spec in specs} == {1, 2, 3}
    # every seed of L = 12 and 24 (does depth pay?) before any run at L = 6 or 48, then seed by seed
    order = [(spec.arm.split("-")[0], spec.seed) for spec in specs if spec.arm.endswith("-pre")]
    assert order == [(f"L{d}", seed) for seed in (1, 2, 3) for d in (12, 24)] + \
        [(f"L{d}", seed) for seed in (1, 2, 3) for d in (6, 48)]
    # --first_depths reorders the training (one depth per session) and leaves the settings a summary records alone
    reordered = depth_sweep.parse_args(["--budget", "wikipedia", "--dtype", "float32", "--no-compile",
                                        "--runs_dir", str(tmp_path / "runs"), "--depths", "6", "12", "24",
                                        "--first_depths", "6"])
    assert [(spec.arm, spec.seed) for spec in depth_sweep.run_specs(reordered)][:6:2] == \
        [("L6-pre", 1), ("L6-pre", 2), ("L6-pre", 3)]
    assert reordered.settings["first_depths"] == s["first_depths"] == (12, 24)
    for spec in specs:
        flags = spec.flags()
        assert flags[flags.index("--dataset") + 1] == "wikipedia" == flags[flags.index("--tokenizer") + 1]
        config = json.loads((REPO / flags[flags.index("--model_config") + 1]).read_text())  # REPO / an absolute path
        assert config["vocab_size"] == wikipedia_corpus.WIKIPEDIA_VOCAB_SIZE
        # mid-run resume: checkpoints far more often than the analyses, at steps the analyses and evals share
        assert spec.save_every and spec.save_every < min(spec.analyse_steps)
        eval_every = int(flags[flags.index("--eval_every") + 1])
        assert all(step % spec.save_every == 0 and step % eval_every == 0 for step in spec.analyse_steps)
    settings = runs.analysis_settings(s, args.device)
    assert settings.heldout == "wikipedia" and settings.max_seq_len == s["max_length"]
    assert analyse.heldout_text_file(settings.heldout) == str(corpus / "validation.jsonl.gz")
    assert analyse.heldout_text_file("embedded") is None  # the embedded held-out novel
    measured_on = analyse.measure_settings(settings)
    assert measured_on.text_file == str(corpus / "validation.jsonl.gz") and measured_on.max_seq_len == s["max_length"]


def test_wikipedia_budgets_stay_within_one_pass_and_see_enough_tokens():
    from utils import depth_sweep

    for budget in ("wikipedia", "wikipedia_pilot"):
        s = {**depth_sweep.BUDGETS["default"], **depth_sweep.BUDGETS[budget]}
        tokens = s["steps"] * s["batch_size"] * s["max_length"]
        assert tokens >= 5_000_000
        by_seed = wikipedia_corpus.SINGLE_PASS_UPDATES[(s["batch_size"], s["max_length"])]
        assert set(s["seeds"]) <= set(by_seed) and s["steps"] <= min(by_seed[seed] for seed in s["seeds"])
    pilot = {**depth_sweep.BUDGETS["default"], **depth_sweep.BUDGETS["wikipedia_pilot"]}
    full = {**depth_sweep.BUDGETS["default"], **depth_sweep.BUDGETS["wikipedia"]}
    assert pilot["seeds"] == (1,) and {k: v for k, v in pilot.items() if k not in ("seeds", "report_suffix")} == \
        {k: v for k, v in full.items() if k not in ("seeds", "report_suffix")}  # the pilot's records are the sweep's


def test_old_records_still_match_without_a_heldout_setting():
    from utils.study import runs

    settings = runs.AnalysisSettings(128, 8192, 32, 8, 16)
    spec = runs.RunSpec("L6-pre", 1, ("--x",), (200,))
    old = dict(version=runs.RECORD_VERSION, flags=spec.flags(), last_step=200, status="finished",
               analysis_settings={k: v for k, v in settings.__dict__.items() if k not in ("heldout", "device")},
               analyses={"200": {}})
    assert runs.record_matches(old, spec, settings)
    assert not runs.record_matches(old, spec, runs.AnalysisSettings(128, 8192, 32, 8, 16, heldout="wikipedia"))


@needs_corpus
@pytest.mark.e2e
def test_committed_tokenizer_rebuilds_from_the_corpus(tmp_path, monkeypatch):
    monkeypatch.delenv(wikipedia_corpus.DATA_DIR_VARIABLE, raising=False)
    wikipedia_corpus.main(["build-tokenizer", "--out_dir", str(tmp_path / "tok")])
    for path in wikipedia_corpus.WIKIPEDIA_TOKENIZER_DIR.iterdir():
        assert (tmp_path / "tok" / path.name).read_bytes() == path.read_bytes(), path.name


@needs_corpus
@pytest.mark.e2e
def test_single_pass_updates_are_what_the_stream_gives(monkeypatch):
    from peft_pretraining.data.dataloader import load_tokenizer

    monkeypatch.delenv(wikipedia_corpus.DATA_DIR_VARIABLE, raising=False)
    (batch_size, max_length), by_seed = next(iter(wikipedia_corpus.SINGLE_PASS_UPDATES.items()))
    assert wikipedia_corpus.updates_before_repeat(load_tokenizer("wikipedia"), batch_size=batch_size,
                                                  max_length=max_length, seed=1) == by_seed[1]


@needs_corpus
@pytest.mark.e2e
def test_stored_train_token_count_is_the_corpus(monkeypatch):
    from peft_pretraining.data.dataloader import load_tokenizer, tokenize_documents

    monkeypatch.delenv(wikipedia_corpus.DATA_DIR_VARIABLE, raising=False)
    texts = wikipedia_corpus.read_train_texts(wikipedia_corpus.corpus_paths()[0])
    packed = tokenize_documents(load_tokenizer("wikipedia"), texts, max_length=0, packing=True)
    assert sum(len(ids) for ids in packed) == wikipedia_corpus.TRAIN_TOKENS
