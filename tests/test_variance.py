"""Residual-stream variance and RMS per depth: shapes, known growth on a hand-built model, agreement with a direct
computation, and the CLI with two models in one figure."""
import csv

import numpy as np
import pytest
import torch

from tests.analysis_helpers import (
    heldout_documents,
    run_cli,
    save_with_tokenizer,
    tiny_hf_llama,
    tiny_ours,
    with_blocks,
    write_jsonl,
)
from utils.instruments import model_io
from utils.instruments.variance import residual_statistics

INPUT_IDS = torch.randint(3, 8192, (3, 10), generator=torch.Generator().manual_seed(0))
ATTENTION_MASK = torch.tensor([[1] * 10, [1] * 7 + [0] * 3, [1] * 4 + [0] * 6])


def test_shapes_and_token_count():
    statistics, num_tokens = residual_statistics(tiny_hf_llama(num_layers=3), [(INPUT_IDS, ATTENTION_MASK)])
    assert num_tokens == 21
    assert statistics["variance"].shape == statistics["rms"].shape == (4,)
    assert np.all(statistics["variance"] > 0) and np.all(statistics["rms"] > 0)


def test_doubling_blocks_give_a_growing_curve():
    model = with_blocks(tiny_hf_llama(), [2.0] * 5)
    statistics, _ = residual_statistics(model, [(INPUT_IDS, ATTENTION_MASK)])
    assert np.all(np.diff(statistics["variance"]) > 0)
    np.testing.assert_allclose(statistics["rms"][1:] / statistics["rms"][:-1], 2.0, rtol=1e-6)
    np.testing.assert_allclose(statistics["variance"][1:] / statistics["variance"][:-1], 4.0, rtol=1e-6)


def test_batched_statistics_match_a_direct_computation():
    model = tiny_ours("pre", num_layers=3)
    batches = [(INPUT_IDS[:1], ATTENTION_MASK[:1]), (INPUT_IDS[1:], ATTENTION_MASK[1:])]
    statistics, _ = residual_statistics(model, batches)
    states = model_io.ResidualStream(model)(INPUT_IDS, ATTENTION_MASK)  # all real tokens at once
    for depth, state in enumerate(states):
        values = state.double()
        # rel 1e-5: batches of other shapes differ by float32 forward noise
        assert statistics["variance"][depth] == pytest.approx(values.var(unbiased=False).item(), rel=1e-5)
        assert statistics["rms"][depth] == pytest.approx(values.square().mean().sqrt().item(), rel=1e-5)


@pytest.mark.e2e
def test_cli_puts_every_model_in_one_table_and_figure(tmp_path):
    pre = save_with_tokenizer(tiny_ours("pre", num_layers=3), tmp_path / "pre")
    lns = save_with_tokenizer(tiny_ours("lns", num_layers=3), tmp_path / "lns")
    text = write_jsonl(tmp_path / "text.jsonl", heldout_documents(3))
    out = tmp_path / "out"
    result = run_cli("utils/variance_analysis.py", "--model_paths", str(pre), str(lns), "--labels", "Pre-LN", "LNS",
                     "--text_file", str(text), "--num_tokens", "200", "--max_seq_len", "64", "--output_dir", str(out))
    assert result.returncode == 0, result.stderr
    with (out / "residual_variance.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [(row["label"], row["depth"]) for row in rows] == [(label, str(d)) for label in ("Pre-LN", "LNS")
                                                              for d in range(4)]
    assert all(float(row["variance"]) > 0 for row in rows)
    assert (out / "residual_variance.png").stat().st_size > 0 and (out / "residual_variance.json").is_file()


def test_mismatched_labels_are_an_error(tmp_path, capsys):
    from utils.variance_analysis import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--model_paths", "a", "b", "--labels", "only-one", "--output_dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2 and "--labels" in capsys.readouterr().err
