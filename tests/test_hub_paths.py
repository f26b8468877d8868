"""The paper's hub inputs exercised offline: a folder with allenai/c4's layout and a T5-style tokenizer, both made by
utils/offline_fixtures.py from the embedded corpus and read through the same calls as the hub names."""
import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import pytest

from peft_pretraining.data.dataloader import build_train_stream, load_tokenizer
from utils.offline_fixtures import C4_CONFIG, T5_EXTRA_IDS, T5_VOCAB_SIZE, write_c4_layout, write_t5_style_tokenizer

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def c4_folder(tmp_path_factory):
    return write_c4_layout(tmp_path_factory.mktemp("c4"), train_shards=4, validation_shards=2)


@pytest.fixture(scope="module")
def t5_folder(tmp_path_factory):
    return write_t5_style_tokenizer(tmp_path_factory.mktemp("t5"))


def test_c4_folder_has_the_hub_layout_and_fields(c4_folder):
    names = sorted(p.name for p in (c4_folder / "en").iterdir())
    assert names == [f"c4-train.{i:05d}-of-00004.json.gz" for i in range(4)] + \
                    [f"c4-validation.{i:05d}-of-00002.json.gz" for i in range(2)]
    for split, shards in (("train", 4), ("validation", 2)):
        stream = datasets.load_dataset(str(c4_folder), C4_CONFIG, split=split, streaming=True)
        assert stream.num_shards == shards
        assert sorted(stream.features) == ["text", "timestamp", "url"]
        assert isinstance(next(iter(stream))["text"], str)


def test_t5_style_tokenizer_loads_like_t5_base(t5_folder):
    tokenizer = load_tokenizer(str(t5_folder))  # AutoTokenizer.from_pretrained, as for "t5-base"
    assert type(tokenizer).__name__ == "T5Tokenizer"
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    assert tokenizer.bos_token_id is None and len(tokenizer) == T5_VOCAB_SIZE + T5_EXTRA_IDS
    ids = tokenizer("Emma Woodhouse, handsome, clever, and rich").input_ids
    assert ids[-1] == 1 and 2 not in ids  # EOS appended, as t5-base does; no unknown pieces in corpus text
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Emma Woodhouse, handsome, clever, and rich"


def test_c4_stream_gives_each_rank_its_own_documents(c4_folder, t5_folder):
    tokenizer = load_tokenizer(str(t5_folder))
    firsts = [next(build_train_stream(dataset=str(c4_folder), dataset_config=C4_CONFIG, dataset_path=None,
                                      tokenizer=tokenizer, max_length=32, packing=False, batch_size=4, seed=1,
                                      rank=rank, world_size=2))["input_ids"] for rank in range(2)]
    assert not (firsts[0] == firsts[1]).all()


@pytest.mark.e2e
def test_trainer_runs_on_the_c4_folder_with_the_t5_style_tokenizer_on_two_gloo_ranks(c4_folder, t5_folder, tmp_path):
    run_dir = tmp_path / "run"
    flags = ["--model_config", "configs/llama_tiny.json", "--dataset", str(c4_folder), "--dataset_config", C4_CONFIG,
             "--tokenizer", str(t5_folder), "--max_length", "64", "--batch_size", "4", "--workers", "0",
             "--eval_tokens", "2000", "--device", "cpu", "--dtype", "float32", "--lr", "3e-3", "--warmup_steps", "1",
             "--num_training_steps", "3", "--eval_every", "3", "--save_every", "3", "--save_dir", str(run_dir)]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "torchrun_main.py", *flags], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((run_dir / "results.json").read_text())
    assert results["status"] == "finished" and results["eval_tokens"] == 2000
    config = json.loads((run_dir / "model_3" / "config.json").read_text())
    assert (config["pad_token_id"], config["eos_token_id"]) == (0, 1)  # the checkpoint records t5's special ids
    assert type(load_tokenizer(str(run_dir / "model_3"))).__name__ == "T5Tokenizer"


def test_a_fixture_folder_that_is_a_file_is_a_one_line_error(tmp_path, capsys):
    from utils.offline_fixtures import main

    (tmp_path / "a_file").write_text("x")
    with pytest.raises(SystemExit) as exit:
        main(["c4", str(tmp_path / "a_file")])
    assert exit.value.code == 2 and "out_dir" in capsys.readouterr().err
