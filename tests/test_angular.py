"""Angular distance: known answers on hand-built models, streaming and padding invariance, hooks against
hidden_states, the command line."""
import gzip
import json
import math

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
from utils.instruments.angular import AngularDistanceAccumulator, compute_angular_distances


def _random_batch(lengths, vocab=8192, seed=0):
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.randint(3, vocab, (len(lengths), width), generator=generator)
    attention_mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        attention_mask[row, :length] = 1
    return input_ids, attention_mask


def _valid(num_layers):
    n = np.arange(1, num_layers + 1)[:, None]
    layer = np.arange(num_layers)[None, :]
    return layer + n <= num_layers


def test_identity_blocks_give_zero():
    model = with_blocks(tiny_hf_llama(), [1.0, 1.0, 1.0, 1.0])
    matrix, _ = compute_angular_distances(model, [_random_batch([7, 5])])
    np.testing.assert_allclose(matrix[_valid(4)], 0.0, atol=1e-7)  # float64 cosines: ~1e-9 from rounding


def test_negating_blocks_alternate_between_one_and_zero():
    # h_l = (-1)^l h_0, so h_l and h_{l+n} point in opposite directions exactly when n is odd.
    model = with_blocks(tiny_hf_llama(), [-1.0] * 5)
    matrix, _ = compute_angular_distances(model, [_random_batch([6, 6, 3])])
    n = np.arange(1, 6)[:, None].repeat(5, axis=1)
    np.testing.assert_allclose(matrix[_valid(5)], (n % 2)[_valid(5)], atol=1e-7)


def test_a_single_negating_block_is_seen_by_every_span_over_it():
    model = with_blocks(tiny_hf_llama(), [1.0, -1.0, 1.0])  # only layer 1 negates
    matrix, _ = compute_angular_distances(model, [_random_batch([4])])
    for n in range(1, 4):
        for layer in range(0, 4 - n):
            spans_layer_1 = layer <= 1 < layer + n
            assert matrix[n - 1, layer] == pytest.approx(1.0 if spans_layer_1 else 0.0, abs=1e-7)


def test_shape_mask_and_range_on_a_real_model():
    model = tiny_hf_llama(num_layers=5)
    matrix, num_tokens = compute_angular_distances(model, [_random_batch([9, 4]), _random_batch([6], seed=1)])
    assert matrix.shape == (5, 5)
    assert num_tokens == 9 + 4 + 6
    assert np.all(np.isnan(matrix[~_valid(5)]))
    valid = matrix[_valid(5)]
    assert np.all((valid > 0) & (valid <= 1))


def test_streamed_padded_batches_match_a_direct_computation():
    """Sums over padded batches equal arccos(cos)/pi averaged over every real token, computed directly."""
    model = tiny_hf_llama(num_layers=3, seed=1)
    lengths = [8, 3, 6, 5]
    input_ids, attention_mask = _random_batch(lengths, seed=2)
    # Reference: each sequence alone (no padding), states from output_hidden_states except the last, which is
    # taken at the input of the final norm, and every pair compared with torch's cosine similarity.
    per_token = []
    with torch.no_grad():
        for row, length in enumerate(lengths):
            sequence = input_ids[row:row + 1, :length]
            states = list(model(sequence, output_hidden_states=True).hidden_states[:-1])
            states.append(_input_of_final_norm(model, sequence))
            stacked = torch.stack([s[0].double() for s in states])  # [L+1, T, H]
            cos = torch.nn.functional.cosine_similarity(stacked[:, None], stacked[None, :], dim=-1)
            per_token.append(torch.arccos(cos.clamp(-1, 1)) / math.pi)  # [L+1, L+1, T]
    mean = torch.cat(per_token, dim=-1).mean(dim=-1)
    expected = np.full((3, 3), np.nan)
    for n in range(1, 4):
        expected[n - 1, : 4 - n] = torch.diagonal(mean, offset=n).numpy()

    batches = [(input_ids[:2], attention_mask[:2]), (input_ids[2:], attention_mask[2:])]
    matrix, num_tokens = compute_angular_distances(model, batches)
    assert num_tokens == sum(lengths)
    np.testing.assert_allclose(matrix, expected, atol=1e-5)


def _input_of_final_norm(model, input_ids):
    captured = {}
    handle = model.model.norm.register_forward_hook(lambda _m, args, _o: captured.setdefault("h", args[0]))
    try:
        model(input_ids)
    finally:
        handle.remove()
    return captured["h"]


@pytest.mark.e2e
@pytest.mark.parametrize("build", [lambda: tiny_hf_llama(4), lambda: tiny_ours("lns", 4)], ids=["hf", "ours"])
def test_hooks_capture_the_stream_before_the_final_norm(build):
    model = build()
    input_ids, attention_mask = _random_batch([6, 4])
    states = model_io.ResidualStream(model)(input_ids, attention_mask)
    with torch.no_grad():
        hidden_states = model(input_ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states
    keep = attention_mask.bool()
    assert len(states) == len(hidden_states) == 5
    for captured, reference in zip(states[:-1], hidden_states[:-1]):
        torch.testing.assert_close(captured, reference[keep].float())
    # hidden_states' last entry is final-normed; the hook gives the raw stream, whose norm differs.
    assert not torch.allclose(states[-1], hidden_states[-1][keep].float(), atol=1e-3)
    torch.testing.assert_close(model.model.norm(states[-1]), hidden_states[-1][keep].float())


def test_accumulator_rejects_the_wrong_number_of_states():
    with pytest.raises(ValueError, match="expected 4 states"):
        AngularDistanceAccumulator(3).update([torch.ones(2, 4)] * 3)


@pytest.mark.e2e
def test_cli_writes_matrix_and_heatmap_offline(tmp_path):
    model_dir = save_with_tokenizer(tiny_ours("lns", 3), tmp_path / "model")
    text = write_jsonl(tmp_path / "text.jsonl", heldout_documents(4))
    out = tmp_path / "out"
    result = run_cli("utils/angular_analysis.py", "--model_path", str(model_dir), "--text_file", str(text),
                     "--num_tokens", "300", "--max_seq_len", "64", "--batch_size", "4", "--output_dir", str(out))
    assert result.returncode == 0, result.stderr
    for name in ("angular_distance.csv", "angular_distance.json", "angular_distance.png", "angular_distance.pdf"):
        assert (out / name).stat().st_size > 0
    payload = json.loads((out / "angular_distance.json").read_text())
    assert payload["num_tokens"] == 300 and payload["num_layers"] == 3
    rows = (out / "angular_distance.csv").read_text().splitlines()
    assert rows[0] == "n,layer_0,layer_1,layer_2" and rows[3].split(",")[1:] == [rows[3].split(",")[1], "", ""]
    influence = json.loads((out / "block_influence.json").read_text())
    assert len(influence["block_influence"]) == 3 and -1 <= influence["spearman"] <= 1
    assert (out / "block_influence.png").stat().st_size > 0
    assert (out / "block_influence.csv").read_text().splitlines()[0] == (
        "layer,block_influence,angular_distance_n1,rank_by_block_influence,rank_by_angular_distance_n1")


@pytest.mark.parametrize("build", [lambda: tiny_hf_llama(3, seed=1), lambda: tiny_ours("lns", 3)], ids=["hf", "ours"])
def test_block_influence_is_shortgpts_measure_computed_directly(build):
    """BI(l) = 1 - mean over tokens of cos(input of layer l, output of layer l), from forward hooks on each decoder
    layer, one unpadded sequence at a time; the tool's padded, batched sums must give the same numbers."""
    from utils.instruments.angular import accumulate

    model = build()
    lengths = [7, 2, 5]
    input_ids, attention_mask = _random_batch(lengths, seed=3)
    layers = model.model.layers
    cosines = [[] for _ in layers]
    with torch.no_grad():
        for row, length in enumerate(lengths):
            seen = {}
            handles = [layer.register_forward_hook(
                lambda _module, args, output, index=index: seen.__setitem__(
                    index, (args[0], output[0] if isinstance(output, tuple) else output)))
                for index, layer in enumerate(layers)]
            try:
                model(input_ids[row:row + 1, :length])
            finally:
                for handle in handles:
                    handle.remove()
            for index, (layer_input, layer_output) in seen.items():
                cosines[index].append(torch.nn.functional.cosine_similarity(
                    layer_input[0].double(), layer_output[0].double(), dim=-1))
    expected = np.array([1 - torch.cat(per_layer).mean().item() for per_layer in cosines])
    accumulator = accumulate(model, [(input_ids[:1], attention_mask[:1]), (input_ids[1:], attention_mask[1:])])
    np.testing.assert_allclose(accumulator.block_influence(), expected, rtol=1e-6, atol=1e-9)
    assert np.all(expected > 0)  # random blocks are far from the identity: the comparison is not of zeros


@pytest.mark.parametrize("flags, named", [(["--num_tokens", "0"], "--num_tokens"),
                                           (["--text_file", "/no/such.txt"], "--text_file"),
                                           (["--dtype", "float8"], "--dtype")])
def test_bad_flags_are_one_line_errors_naming_the_flag(tmp_path, capsys, flags, named):
    from utils.angular_analysis import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--model_path", str(tmp_path), "--output_dir", str(tmp_path / "out"), *flags])
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------- shared helper (utils/instruments/model_io.py)
def test_text_source_rule_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert model_io.resolve_text_source("c4", None) == ("file", model_io.EMBEDDED_HELDOUT_TEXT)  # hub unreachable
    assert model_io.resolve_text_source("embedded", None) == ("file", model_io.EMBEDDED_HELDOUT_TEXT)
    text = tmp_path / "mine.txt"
    text.write_text("one document\n\nstill the same document")
    assert model_io.resolve_text_source("c4", str(text)) == ("file", text)  # --text_file wins
    assert list(model_io.read_documents(text)) == ["one document\n\nstill the same document"]


@pytest.mark.parametrize("name, content", [("plain.txt.gz", b"plain text, not gzip"),
                                           ("cut.jsonl.gz", gzip.compress(b'{"text": "a document"}\n' * 50)[:40])],
                         ids=["not_gzip", "truncated"])
def test_an_unreadable_gz_text_is_a_one_line_error(tmp_path, capsys, name, content):
    text = tmp_path / name
    text.write_bytes(content)
    with pytest.raises(ValueError, match="--text_file"):
        list(model_io.read_documents(text))
    from utils.angular_analysis import main

    model_dir = save_with_tokenizer(tiny_hf_llama(2), tmp_path / "model")
    with pytest.raises(SystemExit) as exit_info:
        main(["--model_path", str(model_dir), "--text_file", str(text), "--num_tokens", "1000",
              "--output_dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2 and "--text_file" in capsys.readouterr().err.strip().splitlines()[-1]


def test_windows_stop_at_exactly_num_tokens_and_never_span_documents():
    tokenizer = model_io.load_tokenizer(str(model_io.REPO_TOKENIZER))
    documents = heldout_documents(3)
    lengths = [len(tokenizer(d, add_special_tokens=False)["input_ids"]) for d in documents]
    windows = list(model_io.token_windows(tokenizer, documents, max_seq_len=64, num_tokens=10**9))
    assert sum(map(len, windows)) == sum(lengths)
    assert len(windows) == sum(-(-length // 64) for length in lengths)  # per-document ceil: no shared windows
    limited = list(model_io.token_windows(tokenizer, documents, max_seq_len=64, num_tokens=150))
    assert sum(map(len, limited)) == 150 and max(map(len, limited)) <= 64
    batches = list(model_io.padded_batches(windows, batch_size=4, pad_id=tokenizer.pad_token_id))
    assert sum(int(mask.sum()) for _, mask in batches) == sum(lengths)


def test_local_checkpoint_without_tokenizer_falls_back_to_the_repository_one(tmp_path, capsys):
    tiny_ours("pre", 2).save_pretrained(tmp_path)
    model, tokenizer = model_io.load_model_and_tokenizer(str(tmp_path))
    assert type(model).__module__ == "peft_pretraining.model.modeling_llama"
    assert len(tokenizer) == 8192 and "using" in capsys.readouterr().err


def test_a_fallback_tokenizer_smaller_than_the_model_vocabulary_is_refused(tmp_path):
    """A 32,128-id model saved without its tokenizer (say t5-base's) must not be read with the 8,192-token one."""
    model = tiny_ours("pre", 2)
    model.resize_token_embeddings(32_128)
    model.save_pretrained(tmp_path)
    with pytest.raises(SystemExit, match="has no tokenizer and embeds 32128 tokens"):
        model_io.load_model_and_tokenizer(str(tmp_path))


@pytest.mark.parametrize("device, expected", [("cpu", 65536), ("cuda", 262144)])
def test_the_default_token_count_is_the_papers_on_a_gpu_and_fits_the_novel_on_a_cpu(device, expected, capsys):
    """262,144 tokens ran out of the held-out novel (about 109K tokens) and took 10 minutes on a CPU."""
    from utils import angular_analysis

    args = angular_analysis.build_parser().parse_args([])
    assert model_io.resolve_num_tokens(args, torch.device(device), "angular") == expected
    assert ("65,536 tokens by default (262,144 on a GPU)" in capsys.readouterr().err) == (device == "cpu")


@pytest.mark.parametrize("path, reason", [("runs/no_such_checkpoint", "runs/ is a local folder"),
                                          ("./no_such", "starts with"), ("a/b/c", "at most one '/'")])
def test_a_missing_local_path_fails_at_once_without_asking_the_hub(path, reason, tmp_path, monkeypatch, capsys):
    """runs/no_such_checkpoint was taken for a hub id: five network retries, 12 lines and 28 s before the error."""
    import transformers

    from utils import angular_analysis

    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained",
                        lambda *args, **kwargs: pytest.fail("asked the hub about a local path"))
    with pytest.raises(SystemExit) as exit_info:
        model_io.check_model_path(angular_analysis.build_parser(), path)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and f"--model_path: {path} does not exist" in error[0] and reason in error[0]
    assert model_io.local_path_reason("Qwen/Qwen3-8B") is None and model_io.local_path_reason("gpt2") is None


def test_the_libraries_example_in_the_docs_runs(tmp_path):
    """docs/analyses.md's "In Python" block, run as written on a saved tiny model (fewer tokens): one pass feeds the
    angular, variance and logit-lens accumulators, whose results have one value per layer or depth."""
    import re
    from pathlib import Path

    docs = (Path(__file__).resolve().parent.parent / "docs" / "analyses.md").read_text()
    section = docs[docs.index("### In Python"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    tiny_ours("lns", 3).save_pretrained(tmp_path)
    code = code.replace('"runs/tiny_lns/model_150"', repr(str(tmp_path))).replace("num_tokens=2048", "num_tokens=96")
    namespace = {}
    exec(compile(code, "docs/analyses.md", "exec"), namespace)
    angular, variance, lens = namespace["angular"], namespace["variance"], namespace["lens"]
    assert angular.num_tokens == 96 and angular.block_influence().shape == (3,)
    assert len(variance.result()["variance"]) == 4 and len(lens.result()["lens_kl"]) == 3
