"""The depth report: the logit lens, the update ratio and the removal cost against direct computations, on a stock
HF Llama and on ours; its files; its one-line errors."""
import copy
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.analysis_helpers import (
    heldout_documents,
    run_cli,
    save_with_tokenizer,
    tiny_hf_llama,
    tiny_ours,
    with_blocks,
    write_jsonl,
)
from utils.depth_report import main
from utils.instruments import model_io
from utils.instruments.jacobian import jacobian_summary
from utils.instruments.logit_lens import LogitLensAccumulator
from utils.instruments.removal import remove_layer
from utils.instruments.removal_loss import measure_removal
from utils.instruments.stream import measure_stream

MODELS = [lambda: tiny_hf_llama(3, seed=1), lambda: tiny_ours("lns", 3, seed=1)]


def _random_batch(lengths, vocab=8192, seed=0):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (len(lengths), max(lengths)), generator=generator)
    attention_mask = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for row, length in enumerate(lengths):
        attention_mask[row, :length] = 1
    return input_ids, attention_mask


def _split(input_ids, attention_mask):
    """Two padded batches, so that sums across batches are tested too."""
    return [(input_ids[:1], attention_mask[:1]), (input_ids[1:], attention_mask[1:])]


@pytest.mark.parametrize("build", MODELS, ids=["hf", "ours"])
def test_logit_lens_matches_a_direct_computation(build):
    """Direct path: each sequence alone, unpadded; the states of output_hidden_states (raw up to the last layer), read
    out with the final norm and LM head, against the model's own logits as the final distribution."""
    model = build()
    lengths = [9, 3, 6]
    input_ids, attention_mask = _random_batch(lengths, seed=4)
    num_layers = len(model.model.layers)
    kl, agree, depths = [], [], []
    with torch.no_grad():
        for row, length in enumerate(lengths):
            output = model(input_ids[row:row + 1, :length], output_hidden_states=True)
            final = F.log_softmax(output.logits[0].double(), dim=-1)
            lenses = [F.log_softmax(model.lm_head(model.model.norm(state))[0].double(), dim=-1)
                      for state in output.hidden_states[1:-1]] + [final]
            kl.append(torch.stack([F.kl_div(lens, final, log_target=True, reduction="none").sum(-1)
                                   for lens in lenses]))  # KL(final || lens), [L, tokens]
            same = torch.stack([lens.argmax(-1) == final.argmax(-1) for lens in lenses])
            agree.append(same)
            for token in range(length):
                depth = num_layers
                while depth > 1 and bool(same[depth - 2, token]):
                    depth -= 1
                depths.append(depth)
    result = measure_stream(model, _split(input_ids, attention_mask))
    np.testing.assert_allclose(result["lens_kl"], torch.cat(kl, 1).mean(1).numpy(), rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(result["lens_top1_agreement"], torch.cat(agree, 1).double().mean(1).numpy())
    assert result["prediction_depth_mean"] == pytest.approx(np.mean(depths))
    np.testing.assert_allclose(result["prediction_depth_histogram"],
                               np.bincount(depths, minlength=num_layers + 1)[1:] / len(depths))
    assert result["lens_kl"][-1] == pytest.approx(0.0, abs=1e-6) and result["lens_kl"][0] > 1e-3
    assert len(set(depths)) > 1  # tokens settle at different depths: the comparison is not of constants


def test_prediction_depth_is_where_the_top1_agrees_and_stays():
    """Logits given directly (the readout is the identity): the final top-1 is token 1 for every position."""
    tops = [[0, 1, 1, 1],   # agrees from depth 2 on -> 2
            [1, 0, 1, 1],   # agrees at depth 1, then breaks -> 3
            [1, 1, 1, 1],   # -> 1
            [0, 0, 0, 1]]   # -> 4
    states = [torch.zeros(4, 3)] + [F.one_hot(torch.tensor(column), 3).float() * 5 for column in zip(*tops)]
    lens = LogitLensAccumulator(lambda h: h, num_layers=4, vocab_size=3)
    lens.update(states)
    result = lens.result()
    assert result["prediction_depth_histogram"] == [0.25, 0.25, 0.25, 0.25]
    assert result["prediction_depth_mean"] == pytest.approx((2 + 3 + 1 + 4) / 4)
    assert result["lens_top1_agreement"] == [0.5, 0.5, 0.75, 1.0]
    assert result["lens_kl"][-1] == 0.0 and result["lens_kl"][0] > 0


def test_update_ratio_has_known_answers_on_scaling_blocks():
    # A block multiplying the stream by c adds (c - 1) x: its update ratio is |c - 1| for every token.
    model = with_blocks(tiny_hf_llama(), [2.0, 0.5, 1.0, -1.0])
    result = measure_stream(model, [_random_batch([5, 3])])
    np.testing.assert_allclose(result["update_ratio"], [1.0, 0.5, 0.0, 2.0], atol=1e-12)


@pytest.mark.parametrize("build", MODELS, ids=["hf", "ours"])
def test_update_ratio_matches_hooks_on_each_layer(build):
    """||output - input|| / ||input|| of each decoder layer, by hooks on it, one unpadded sequence at a time."""
    model = build()
    lengths = [7, 2, 5]
    input_ids, attention_mask = _random_batch(lengths, seed=3)
    ratios = [[] for _ in model.model.layers]
    with torch.no_grad():
        for row, length in enumerate(lengths):
            seen = {}
            handles = [layer.register_forward_hook(
                lambda _module, args, output, index=index: seen.__setitem__(
                    index, (args[0], output[0] if isinstance(output, tuple) else output)))
                for index, layer in enumerate(model.model.layers)]
            try:
                model(input_ids[row:row + 1, :length])
            finally:
                for handle in handles:
                    handle.remove()
            for index, (before, after) in seen.items():
                ratios[index].append((after[0] - before[0]).double().norm(dim=-1) / before[0].double().norm(dim=-1))
    expected = [torch.cat(per_layer).mean().item() for per_layer in ratios]
    result = measure_stream(model, _split(input_ids, attention_mask))
    np.testing.assert_allclose(result["update_ratio"], expected, rtol=1e-5)


@pytest.mark.e2e
@pytest.mark.parametrize("build", MODELS, ids=["hf", "ours"])
def test_removal_cost_is_the_loss_of_the_pruned_model(build):
    """Against a copy with the layer really removed (remove_layer), scored one sequence at a time by the model's own
    loss."""
    model = build()
    lengths = [8, 4, 6]
    input_ids, attention_mask = _random_batch(lengths, seed=5)

    def token_mean_loss(network):
        with torch.no_grad():
            losses = [network(input_ids[row:row + 1, :length], labels=input_ids[row:row + 1, :length]).loss.item()
                      * (length - 1) for row, length in enumerate(lengths)]
        return sum(losses) / sum(length - 1 for length in lengths)

    result = measure_removal(model, _split(input_ids, attention_mask))
    assert result["removal_baseline_nats"] == pytest.approx(token_mean_loss(model), rel=1e-5)
    for layer in range(3):
        pruned = copy.deepcopy(model)
        remove_layer(pruned, layer)
        assert result["removal_cost"][layer] == pytest.approx(token_mean_loss(pruned) - token_mean_loss(model),
                                                              rel=1e-3, abs=1e-5)
    assert any(abs(cost) > 1e-3 for cost in result["removal_cost"])


@pytest.mark.e2e
def test_two_models_one_report_offline(tmp_path):
    ours = tiny_ours("lns", 3)
    ours.config.train_max_length = 32
    paths = [str(save_with_tokenizer(ours, tmp_path / "ours")),
             str(save_with_tokenizer(tiny_hf_llama(4), tmp_path / "hf"))]
    text = write_jsonl(tmp_path / "text.jsonl", heldout_documents(2))
    out = tmp_path / "report"
    result = run_cli("utils/depth_report.py", "--model_path", paths[0], "--label", "LNS", "--model_path", paths[1],
                     "--label", "HF", "--text_file", str(text), "--num_tokens", "96", "--removal_tokens", "64",
                     "--jacobian_tokens", "2", "--max_seq_len", "32", "--out", str(out), "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert "settings:" in result.stderr.split("LNS: stream")[0]  # stated before the work starts
    payload = json.loads((out / "depth_report.json").read_text())
    assert [model["num_layers"] for model in payload["models"]] == [3, 4]
    assert [model["num_tokens"] for model in payload["models"]] == [96, 96]
    assert (out / "depth_report.png").stat().st_size > 10_000
    report = (out / "report.md").read_text()
    assert "## LNS" in report and "## HF" in report and "![" in report
    for threshold in ("less than 1% in perplexity", "stays below 0.1 nats", "below 0.1", "smaller than 10%"):
        assert threshold in report
    rows = (out / "depth_report.csv").read_text().splitlines()
    assert rows[0] == "label,model_path,measure,indexed_by,index,relative_depth,value"
    assert sum(row.startswith("HF,") and ",lens_kl," in row for row in rows) == 4


def test_the_report_measures_through_measure_model_as_each_instrument_alone(tmp_path):
    """The report's numbers (through utils/instruments/measure.measure_model, issue 66) equal each instrument run
    alone on the same windows, as the report measured before: the stream over the first --num_tokens tokens, the
    removal loss over the first --removal_tokens, the Jacobians sampled from the windows of the longer of the two."""
    model = tiny_ours("lns", 3, seed=2)
    model.config.train_max_length = 16
    path = save_with_tokenizer(model, tmp_path / "ours")
    text = write_jsonl(tmp_path / "text.jsonl", heldout_documents(3))
    [result] = main(["--model_path", str(path), "--text_file", str(text), "--num_tokens", "80", "--removal_tokens",
                     "48", "--jacobian_tokens", "50", "--probes", "0", "--batch_size", "3", "--out",
                     str(tmp_path / "report"), "--device", "cpu"])
    loaded, tokenizer = model_io.load_model_and_tokenizer(str(path), torch.float32, torch.device("cpu"))
    windows = list(model_io.token_windows(tokenizer, model_io.read_documents(text), 16, 80))
    removal_windows = list(model_io.token_windows(tokenizer, model_io.read_documents(text), 16, 48))
    alone = measure_stream(loaded, model_io.padded_batches(windows, 3, tokenizer.pad_token_id))
    removal = measure_removal(loaded, list(model_io.padded_batches(removal_windows, 3, tokenizer.pad_token_id)))
    jacobian = jacobian_summary(loaded, windows, 50, probes=0, seed=0)
    assert result["angular_next"] == alone["angular"][0].tolist() and result["lens_kl"] == alone["lens_kl"]
    assert result["variance"] == alone["variance"].tolist() and result["update_ratio"] == alone["update_ratio"]
    assert result["removal_cost"] == removal["removal_cost"] and result["removal_tokens"] == 48
    assert result["jacobian"] == jacobian and result["jacobian_tokens"] == 50 and result["jacobian_method"] == "exact"
    # 8 positions a window, 5 windows: the Jacobians come back to these windows rather than read the text's next ones
    everything = list(model_io.token_windows(tokenizer, model_io.read_documents(text), 16, 10 ** 9))
    assert len(windows) * 8 < 50 and len(everything) > len(windows)


@pytest.mark.parametrize("norm_type", ["attnres", "mhc", "siamese"])
def test_a_stream_that_is_not_a_running_sum_is_reported_without_block_jacobians(tmp_path, norm_type, recwarn):
    """AttnRes, mHC and SiameseNorm pass no stream tensor from block to block: the report says the Jacobians are not
    defined and keeps every other measure."""
    model = tiny_ours(norm_type, 3, seed=1)
    model.config.train_max_length = 16
    path = save_with_tokenizer(model, tmp_path / norm_type)
    text = write_jsonl(tmp_path / "text.jsonl", heldout_documents(2))
    out = tmp_path / "report"
    [result] = main(["--model_path", str(path), "--text_file", str(text), "--num_tokens", "48", "--removal_tokens",
                     "32", "--jacobian_tokens", "2", "--out", str(out), "--device", "cpu"])
    assert result["jacobian"] == [] and result["summary"]["jacobian_deep"] is None
    assert len(result["removal_cost"]) == 3 and len(result["update_ratio"]) == 3
    report = (out / "report.md").read_text()
    assert "Block Jacobians are not defined: the residual stream is not a running sum" in report
    assert "| jacobian_deep | — |" in report
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


@pytest.mark.parametrize("case, named", [("missing", "--model_path"), ("not causal", "--model_path"),
                                         ("short text", "--text_file")])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, case, named):
    model_dir = save_with_tokenizer(tiny_hf_llama(2), tmp_path / "model")
    text = write_jsonl(tmp_path / "text.jsonl", ["A short text."])
    if case == "missing":
        model_dir = tmp_path / "no_such_model"
    elif case == "not causal":
        model_dir = tmp_path / "bert"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"]}))
    with pytest.raises(SystemExit) as exit_info:
        main(["--model_path", str(model_dir), "--text_file", str(text), "--max_seq_len", "64",
              "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error:" in error and named in error
    assert not (tmp_path / "out").exists()


def test_the_angular_tools_logit_lens_is_the_depth_reports(tmp_path):
    """Two paths, one answer: the angular tool's --logit_lens (its own batches, the study's path) and the depth report,
    on the same tokens of the same text. Without the flag the angular tool writes exactly what it wrote before."""
    from utils import angular_analysis

    model_dir = str(save_with_tokenizer(tiny_ours("lns", 3, seed=1), tmp_path / "model"))
    text = ["--text_file", str(write_jsonl(tmp_path / "text.jsonl", heldout_documents(2))), "--num_tokens", "96",
            "--max_seq_len", "32", "--device", "cpu"]
    with_lens, without = tmp_path / "with_lens", tmp_path / "without"
    # batches of 2 windows, the depth report's of 8: the sums hold across batching
    angular_analysis.main(["--model_path", model_dir, *text, "--batch_size", "2", "--output_dir", str(with_lens),
                           "--logit_lens"])
    angular_analysis.main(["--model_path", model_dir, *text, "--batch_size", "2", "--output_dir", str(without)])
    report = main(["--model_path", model_dir, *text, "--removal_tokens", "32", "--jacobian_tokens", "1",
                   "--out", str(tmp_path / "report")])[0]
    lens = json.loads((with_lens / "logit_lens.json").read_text())
    assert lens["num_tokens"] == report["num_tokens"] == 96
    np.testing.assert_allclose(lens["lens_kl"], report["lens_kl"], rtol=1e-5, atol=1e-8)
    for key in ("lens_top1_agreement", "prediction_depth_histogram"):
        np.testing.assert_allclose(lens[key], report[key])
    for key in ("prediction_depth_mean", "prediction_depth_median", "prediction_depth_p90"):
        assert lens[key] == pytest.approx(report[key])
    # random weights: the lenses differ from the final distribution, and tokens settle at different depths
    assert min(lens["lens_kl"][:-1]) > 1e-4 and max(lens["prediction_depth_histogram"]) < 1
    assert not (without / "logit_lens.json").exists()
    for name in ("angular_distance.json", "angular_distance.csv", "block_influence.json", "block_influence.csv"):
        assert (without / name).read_bytes() == (with_lens / name).read_bytes()


def test_the_variance_growth_is_reported_both_ways_as_the_studies_do():
    from utils.depth_report import summarise
    from utils.study import measures

    variance = [0.5, 1.0, 2.0, 4.0, 8.0, 16.0]  # depths 0..5 of a 5-layer model
    result = dict(num_layers=5, variance=variance, removal_cost=[0.1] * 5, lens_kl=[1.0, 0.5, 0.2, 0.05, 0.0],
                  prediction_depth_mean=3.0, jacobian=[dict(rel_identity_dev=0.2)] * 5, update_ratio=[0.3] * 5,
                  block_influence=[0.1] * 5)
    summary = summarise(result)
    assert summary["variance_growth"] == measures.variance_growth(variance) == 16.0 / 2.0  # over the stream after 2
    assert summary["variance_growth_from_first"] == measures.variance_growth_from_first(variance) == 16.0
