"""Block Jacobians: known answers on hand-built blocks, agreement with autograd on real layers (ours and HF Llama),
the probe estimate within its standard error, token sampling, and the CLI on our checkpoint and on an HF Llama."""
import copy
import csv
import json
import math

import numpy as np
import pytest
import torch
from torch import nn

from tests.analysis_helpers import (
    heldout_documents,
    repo_tokenizer,
    run_cli,
    save_with_tokenizer,
    tiny_hf_llama,
    tiny_ours,
    with_blocks,
    write_jsonl,
)
from utils import jacobian_analysis
from utils.instruments import model_io
from utils.instruments.jacobian import TokenSample, jacobian_summary, measure_jacobians, sample_tokens
from utils.jacobian_analysis import main

WINDOW = torch.randint(3, 8192, (24,), generator=torch.Generator().manual_seed(0)).tolist()
SAMPLES = [TokenSample(WINDOW, [0, 5, 17, 23])]


class LinearResidualBlock(nn.Module):
    """x + x A^T at every position; with as_tuple, returned in a tuple as decoder layers of transformers < 5 do."""

    def __init__(self, matrix: torch.Tensor, as_tuple: bool = False):
        super().__init__()
        self.register_buffer("matrix", matrix)
        self.as_tuple = as_tuple

    def forward(self, hidden_states, *args, **kwargs):
        output = hidden_states + hidden_states @ self.matrix.T
        return (output,) if self.as_tuple else output


class PreviousTokenBlock(nn.Module):
    """x[t] + B x[t - 1]: depends on another position only, so its same-position Jacobian is the identity."""

    def __init__(self, matrix: torch.Tensor):
        super().__init__()
        self.register_buffer("matrix", matrix)

    def forward(self, hidden_states, *args, **kwargs):
        previous = torch.cat([torch.zeros_like(hidden_states[:, :1]), hidden_states[:, :-1]], dim=1)
        return hidden_states + previous @ self.matrix.T


def _random_matrix(size: int, seed: int) -> torch.Tensor:
    return torch.randn(size, size, generator=torch.Generator().manual_seed(seed)) * 0.3


def test_identity_blocks_give_zero_and_a_doubling_block_gives_one():
    measurement = measure_jacobians(with_blocks(tiny_hf_llama(), [1.0, 1.0, 2.0]), SAMPLES, probes=0)
    rows = measurement.rows
    assert [row["layer"] for row in rows] == [0, 1, 2]
    for row in rows[:2]:
        assert row["rel_identity_dev"] == pytest.approx(0.0, abs=1e-7)
        assert row["mean_diag"] == pytest.approx(1.0) and row["mean_abs_offdiag"] == pytest.approx(0.0, abs=1e-9)
    assert rows[2]["rel_identity_dev"] == pytest.approx(1.0) and rows[2]["mean_diag"] == pytest.approx(2.0)


def test_linear_residual_block_gives_the_norm_of_its_matrix():
    model = tiny_hf_llama()
    hidden = model.config.hidden_size
    matrices = [_random_matrix(hidden, seed) for seed in (1, 2)]
    # The last block's output is only read by the tool (the backbone stops before it), so it may be a tuple.
    model.model.layers = nn.ModuleList([LinearResidualBlock(matrices[0]), LinearResidualBlock(matrices[1], True)])
    measurement = measure_jacobians(model, SAMPLES, probes=0)
    for row, matrix in zip(measurement.rows, matrices):
        off_diagonal = matrix[~torch.eye(hidden, dtype=torch.bool)]
        assert row["rel_identity_dev"] == pytest.approx(matrix.norm().item() / math.sqrt(hidden), rel=1e-5)
        assert row["mean_diag"] == pytest.approx(1 + matrix.diagonal().mean().item(), rel=1e-5)
        assert row["mean_abs_offdiag"] == pytest.approx(off_diagonal.abs().mean().item(), rel=1e-5)
    np.testing.assert_allclose(measurement.heatmaps[1], torch.eye(hidden) + matrices[1], atol=1e-6)


def test_other_positions_are_held_fixed():
    model = tiny_hf_llama()
    model.model.layers = nn.ModuleList([PreviousTokenBlock(_random_matrix(model.config.hidden_size, 3))])
    (row,) = measure_jacobians(model, SAMPLES, probes=0).rows
    assert row["rel_identity_dev"] == pytest.approx(0.0, abs=1e-7)


def _autograd_jacobians(model, window: list[int], position: int, blocks=None) -> list[torch.Tensor]:
    """J of every layer at one position, by torch.autograd.functional.jacobian on the whole window. ``blocks``
    (default: the model's layers) are the layers differentiated, called in their dtype on the model's inputs."""
    stream = model_io.ResidualStream(model)
    blocks = stream.layers if blocks is None else blocks
    calls = {}
    handles = [layer.register_forward_pre_hook(lambda _m, args, kwargs, i=i: calls.__setitem__(i, (args, kwargs)),
                                               with_kwargs=True) for i, layer in enumerate(stream.layers)]
    input_ids = torch.tensor([window])
    with torch.no_grad():
        stream.backbone(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **stream.backbone_kwargs)
    for handle in handles:
        handle.remove()
    jacobians = []
    for index, layer in enumerate(blocks):
        args, kwargs = calls[index]
        dtype = next(layer.parameters()).dtype
        entering = (args[0] if args else kwargs["hidden_states"]).detach().to(dtype)

        def block_at_position(vector, layer=layer, args=args, kwargs=kwargs, entering=entering):
            hidden = entering.clone()
            hidden[0, position] = vector
            output = layer(hidden, *args[1:], **kwargs) if args else layer(**dict(kwargs, hidden_states=hidden))
            return output[0, position]

        jacobians.append(torch.autograd.functional.jacobian(block_at_position, entering[0, position]))
    return jacobians


@pytest.mark.parametrize("build", [lambda: tiny_ours("pre", num_layers=2), lambda: tiny_hf_llama(num_layers=2)],
                         ids=["ours", "hf_llama"])
def test_real_layers_match_autograd_on_the_whole_window(build):
    model = build()
    position = 13  # the tool cuts the window after the token; the reference sees all 24 tokens
    measurement = measure_jacobians(model, [TokenSample(WINDOW, [position])], probes=0)
    for row, jacobian in zip(measurement.rows, _autograd_jacobians(model, WINDOW, position)):
        hidden = jacobian.shape[0]
        assert row["rel_identity_dev"] == pytest.approx(
            (jacobian - torch.eye(hidden)).norm().item() / math.sqrt(hidden), rel=1e-4)
        assert row["mean_diag"] == pytest.approx(jacobian.diagonal().mean().item(), rel=1e-5)
        np.testing.assert_allclose(measurement.heatmaps[row["layer"]], jacobian.numpy(), atol=1e-5)
        assert 0 < row["rel_identity_dev"] < 10


@pytest.mark.e2e
def test_probe_estimate_agrees_with_the_exact_value_within_its_standard_error():
    model = tiny_ours("pre", num_layers=3)
    samples = [TokenSample(WINDOW, [2, 9, 20])]
    exact = measure_jacobians(model, samples, probes=0, heatmap=False).rows
    probed = measure_jacobians(model, samples, probes=24, seed=1, heatmap=False).rows
    for exact_row, probe_row in zip(exact, probed):
        assert probe_row["mean_abs_offdiag"] is None
        assert probe_row["identity_dev_sq_per_d_se"] > 0 and probe_row["mean_diag_se"] > 0
        squared = exact_row["rel_identity_dev"] ** 2
        assert abs(probe_row["identity_dev_sq_per_d"] - squared) < 4 * probe_row["identity_dev_sq_per_d_se"]
        assert abs(probe_row["rel_identity_dev"] - exact_row["rel_identity_dev"]) < 4 * probe_row["rel_identity_dev_se"]
        assert abs(probe_row["mean_diag"] - exact_row["mean_diag"]) < 4 * probe_row["mean_diag_se"]
        assert probe_row["identity_dev_sq_per_d_se"] < 0.5 * squared  # the error bar is informative


def test_probe_heatmap_is_the_exact_leading_block_of_one_token():
    model = tiny_hf_llama(num_layers=2)
    probed = measure_jacobians(model, SAMPLES, probes=4)
    exact = measure_jacobians(model, [TokenSample(WINDOW, [SAMPLES[0].positions[0]])], probes=0)
    assert probed.method == "probes" and sorted(probed.heatmaps) == [0, 1]
    for layer, block in probed.heatmaps.items():
        np.testing.assert_allclose(block, exact.heatmaps[layer][:block.shape[0], :block.shape[1]], atol=1e-6)


@pytest.mark.e2e
def test_small_vector_batches_give_the_same_answer():
    model = tiny_ours("lns", num_layers=2)
    whole = measure_jacobians(model, SAMPLES, probes=0, heatmap=False).rows
    split = measure_jacobians(model, SAMPLES, probes=0, vectors_per_pass=7, heatmap=False).rows
    for a, b in zip(whole, split):
        assert a == pytest.approx(b, rel=1e-5)


def test_bad_probe_count_is_an_error():
    with pytest.raises(ValueError, match="--probes"):
        measure_jacobians(tiny_hf_llama(), SAMPLES, probes=1)


def test_token_sampling():
    windows = [list(range(100, 130)), list(range(200, 210)), list(range(300, 340))]
    samples = sample_tokens(windows, num_tokens=20, tokens_per_window=8, seed=0)
    assert [len(sample.positions) for sample in samples] == [8, 8, 4]
    for sample, window in zip(samples, windows):
        assert sample.window == window and sample.positions == sorted(set(sample.positions))
        assert all(0 <= position < len(window) for position in sample.positions)
    # A text shorter than what is asked: every real token of it is used.
    short = sample_tokens([list(range(12))], num_tokens=100, tokens_per_window=8)
    assert short[0].positions == list(range(12))
    topped_up = sample_tokens(windows[:2], num_tokens=30, tokens_per_window=8)
    assert [len(sample.positions) for sample in topped_up] == [20, 10]


@pytest.mark.e2e
def test_summary_for_the_study_in_process():
    model = tiny_ours("pre", num_layers=3)
    windows = model_io.token_windows(repo_tokenizer(), heldout_documents(2), 32, 10 ** 9)
    rows = jacobian_summary(model, windows, num_tokens=6, tokens_per_window=3, probes=0)
    assert [row["layer"] for row in rows] == [0, 1, 2]
    assert all(set(row) == {"layer", "rel_identity_dev", "mean_diag", "mean_abs_offdiag"} for row in rows)


def _read_csv(path):
    with path.open() as handle:
        reader = csv.reader(handle)
        return next(reader), list(reader)


@pytest.mark.e2e
def test_cli_on_our_checkpoint_uses_the_trained_context(tmp_path):
    model = tiny_ours("lns", num_layers=3)
    model.config.train_max_length = 16
    checkpoint = save_with_tokenizer(model, tmp_path / "lns")
    text = write_jsonl(tmp_path / "text.jsonl", heldout_documents(2))
    out = tmp_path / "out"
    result = run_cli("utils/jacobian_analysis.py", "--model_path", str(checkpoint), "--text_file", str(text),
                     "--num_tokens", "6", "--tokens_per_window", "3", "--output_dir", str(out))
    assert result.returncode == 0, result.stderr
    # Reading our config.json for the tokenizer warned "You are using a model of type `llama_norm_placement` to
    # instantiate a model of type ``" in every analysis tool.
    assert "to instantiate a model of type" not in result.stderr
    header, rows = _read_csv(out / "jacobian.csv")
    assert header == ["layer", "rel_identity_dev", "mean_diag", "mean_abs_offdiag"]
    assert [row[0] for row in rows] == ["0", "1", "2"] and all(float(row[1]) > 0 for row in rows)
    payload = json.loads((out / "jacobian.json").read_text())
    (entry,) = payload["models"]
    assert entry["max_seq_len"] == 16 and entry["num_tokens"] == 6 and entry["method"] == "exact"
    for name in ("jacobian.png", "jacobian_heatmap.png"):
        assert (out / name).stat().st_size > 0


@pytest.mark.e2e
def test_cli_on_an_hf_llama_with_probes_and_two_models(tmp_path):
    first = save_with_tokenizer(tiny_hf_llama(num_layers=2, seed=0), tmp_path / "a")
    second = save_with_tokenizer(tiny_hf_llama(num_layers=2, seed=1), tmp_path / "b")
    text = tmp_path / "short.txt"
    text.write_text("A short text, shorter than one window.")
    out = tmp_path / "out"
    main(["--model_paths", str(first), str(second), "--labels", "A", "B", "--text_file", str(text), "--max_seq_len",
          "64", "--num_tokens", "1000", "--probes", "3", "--output_dir", str(out)])  # in-process: saves a start-up
    tokenizer = repo_tokenizer()
    real_tokens = len(model_io.special_prefix_ids(tokenizer)) + len(tokenizer(text.read_text(),
                                                                               add_special_tokens=False)["input_ids"])
    payload = json.loads((out / "jacobian.json").read_text())
    assert [entry["label"] for entry in payload["models"]] == ["A", "B"]
    assert all(entry["num_tokens"] == real_tokens and entry["method"] == "probes" for entry in payload["models"])
    for label in ("A", "B"):
        header, rows = _read_csv(out / label / "jacobian.csv")
        assert header[0] == "layer" and len(rows) == 2 and all(row[3] == "" for row in rows)
        assert (out / label / "jacobian_heatmap.png").is_file()
    assert (out / "jacobian.png").stat().st_size > 0


@pytest.mark.parametrize("flags, named", [(["--probes", "1"], "--probes"), (["--num_tokens", "0"], "--num_tokens"),
                                          (["--max_seq_len", "0"], "--max_seq_len"),
                                          (["--model_paths", "a", "--labels", "x", "y"], "--labels"),
                                          (["--model_path", "a", "--model_paths", "b"], "--model_paths")])
def test_bad_flags_are_one_line_errors_before_any_work(tmp_path, capsys, flags, named):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        main([*flags, "--dataset", "embedded", "--output_dir", str(out)])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_info.value.code == 2 and named in error
    assert not out.exists()


@pytest.mark.e2e
def test_a_bfloat16_model_is_differentiated_in_float32():
    model = tiny_hf_llama(num_layers=2).to(torch.bfloat16)
    position = 13
    measurement = measure_jacobians(model, [TokenSample(WINDOW, [position])], probes=0)
    # Reference: the bf16 model's own block inputs, the blocks (the same bf16 weights) differentiated in float32.
    float_blocks = copy.deepcopy(model).float().model.layers
    for row, jacobian in zip(measurement.rows, _autograd_jacobians(model, WINDOW, position, float_blocks)):
        hidden = jacobian.shape[0]
        # A block differentiated in bf16 is off by about 1e-3 per entry.
        np.testing.assert_allclose(measurement.heatmaps[row["layer"]], jacobian.numpy(), atol=1e-5)
        assert row["rel_identity_dev"] == pytest.approx(
            (jacobian - torch.eye(hidden)).norm().item() / math.sqrt(hidden), rel=1e-4)


@pytest.mark.parametrize("config_text", ['{"norm_type": "pre", ', '{"norm_type": "no_such_norm"}'],
                         ids=["not_json", "unknown_norm_type"])
def test_a_broken_model_folder_is_a_one_line_error(tmp_path, capsys, config_text):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(config_text)
    with pytest.raises(SystemExit) as exit_info:
        main(["--model_path", str(folder), "--dataset", "embedded", "--output_dir", str(tmp_path / "out")])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_info.value.code == 2 and "--model_path" in error and "config.json" in error
    assert not (tmp_path / "out").exists()


def test_model_path_dot_is_labelled_by_the_folder(tmp_path, monkeypatch):
    checkpoint = save_with_tokenizer(tiny_hf_llama(num_layers=2), tmp_path / "hf_model")
    text = tmp_path / "short.txt"
    text.write_text("A short text.")
    monkeypatch.chdir(checkpoint)
    main(["--model_path", ".", "--text_file", str(text), "--max_seq_len", "16", "--num_tokens", "2",
          "--output_dir", str(tmp_path / "out")])
    (entry,) = json.loads((tmp_path / "out" / "jacobian.json").read_text())["models"]
    assert entry["label"] == "hf_model"


def _figure_of(plot, monkeypatch, *args):
    """The matplotlib figure a plot function builds (kept open instead of closed)."""
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    plot(*args)
    (figure,) = figures
    return figure


def test_the_depth_plot_is_logarithmic_when_layer_0_dwarfs_the_rest(tmp_path, monkeypatch):
    """Layer 0 at 25.1 against at most 0.14 (the tiny LNS run): on a linear axis layers 1..23 all read as zero."""
    assert jacobian_analysis.depth_axis_scale([25.1, 0.14, 0.05, 0.02]) == ("log", 0.0)
    assert jacobian_analysis.depth_axis_scale([0.4, 0.3, 0.25, 0.2]) is None  # comparable values: linear from 0
    assert jacobian_analysis.depth_axis_scale([25.1, 0.0, 0.05, 0.02]) == ("symlog", 0.02)  # an identity block
    rows = [dict(layer=i, rel_identity_dev=value) for i, value in enumerate([25.1, 0.14, 0.05, 0.02])]
    figure = _figure_of(jacobian_analysis.plot_depth, monkeypatch,
                        [dict(label="LNS", method="exact", layers=rows)], tmp_path / "depth.png", "t")
    assert figure.axes[0].get_yscale() == "log"
    flat = [dict(row, rel_identity_dev=0.3) for row in rows]
    figure = _figure_of(jacobian_analysis.plot_depth, monkeypatch,
                        [dict(label="Pre-LN", method="exact", layers=flat)], tmp_path / "flat.png", "t")
    assert figure.axes[0].get_yscale() == "linear"


def test_each_heatmap_panel_has_its_own_colour_scale(tmp_path, monkeypatch):
    """Layer 0 deviating 10,000 times more than the last layer left the last panel blank on a shared scale."""
    generator = np.random.default_rng(0)
    heatmaps = {0: np.eye(16) + generator.normal(size=(16, 16)), 5: np.eye(16) + 1e-4 * generator.normal(size=(16, 16))}
    figure = _figure_of(jacobian_analysis.plot_heatmaps, monkeypatch, heatmaps, tmp_path / "heatmap.png", "t")
    images = [image for ax in figure.axes for image in ax.images]
    assert len(images) == 2 and len(figure.axes) == 4  # two panels, two colour bars
    for image, layer in zip(images, (0, 5)):
        limit = jacobian_analysis.heatmap_limit(heatmaps[layer] - np.eye(16))
        assert image.get_clim() == pytest.approx((-limit, limit))
    assert images[1].get_clim()[1] < 1e-2 * images[0].get_clim()[1]


@pytest.mark.parametrize("device, expected", [("cpu", jacobian_analysis.CPU_NUM_TOKENS),
                                              ("cuda", jacobian_analysis.DEFAULT_NUM_TOKENS)])
def test_the_default_token_count_fits_the_device_and_is_said_on_a_cpu(device, expected, capsys):
    args = jacobian_analysis.build_parser().parse_args([])
    assert model_io.resolve_num_tokens(args, torch.device(device), "jacobian") == expected
    said = capsys.readouterr().err
    assert (f"{expected:,} tokens by default" in said) == (device == "cpu")
    args = jacobian_analysis.build_parser().parse_args(["--num_tokens", "7"])
    assert model_io.resolve_num_tokens(args, torch.device("cpu"), "jacobian") == 7
    assert capsys.readouterr().err == ""  # a count given is used as is, silently
