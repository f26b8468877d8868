"""Layer removal: pruned logits equal a model built without the layer (HF and ours), per-layer LNS factors and
Mix-LN placements survive, save/load round trip, errors, in-memory undo, CLI, and an offline lm-eval sweep."""
import csv
import json
import math

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from layer_remove import main
from tests.analysis_helpers import (
    heldout_documents,
    run_cli,
    save_with_tokenizer,
    tiny_hf_llama,
    tiny_ours,
    write_jsonl,
)
from utils.instruments import model_io
from utils.instruments.removal import layer_removed, remove_layer

INPUT_IDS = torch.randint(3, 8192, (2, 9), generator=torch.Generator().manual_seed(0))
ATTENTION_MASK = torch.tensor([[1] * 9, [1] * 6 + [0] * 3])


def logits(model):
    with torch.no_grad():
        return model(INPUT_IDS, attention_mask=ATTENTION_MASK).logits


def state_without_layer(model, index):
    """The model's weights with layer `index` dropped and the later layers shifted down."""
    state = {}
    for name, tensor in model.state_dict().items():
        parts = name.split(".")
        if parts[:2] == ["model", "layers"]:
            layer = int(parts[2])
            if layer == index:
                continue
            parts[2] = str(layer - 1 if layer > index else layer)
        state[".".join(parts)] = tensor
    return state


def _hf_config(config_class, num_layers, **extra):
    return config_class(vocab_size=8192, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                        pad_token_id=0, **extra)


HF_CASES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {}),
    # Mixed sliding/full layers with a window shorter than the input, so a wrong layer_types changes the logits.
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"use_sliding_window": True, "sliding_window": 3}),
}


@pytest.mark.e2e
@pytest.mark.parametrize("case", HF_CASES)
@pytest.mark.parametrize("index", [0, 2])
def test_hf_pruned_logits_equal_a_model_built_without_the_layer(case, index):
    config_class, model_class, extra = HF_CASES[case]
    layer_types = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    if case == "qwen3":
        extra = dict(extra, layer_types=layer_types)
    torch.manual_seed(0)
    model = model_class(_hf_config(config_class, 4, **extra)).eval()
    expected_state = state_without_layer(model, index)

    remove_layer(model, index)

    if case == "qwen3":
        extra["layer_types"] = [kind for i, kind in enumerate(layer_types) if i != index]
        assert model.config.layer_types == extra["layer_types"]
    reference = model_class(_hf_config(config_class, 3, **extra)).eval()
    reference.load_state_dict(expected_state)
    assert model.config.num_hidden_layers == 3
    assert [layer.self_attn.layer_idx for layer in model.model.layers] == [0, 1, 2]
    torch.testing.assert_close(logits(model), logits(reference), rtol=0, atol=0)


# A large init makes every sublayer matter, so a wrong factor or placement shows in the logits.
STRONG_INIT = {"initializer_range": 0.3}


def _ours_rebuilt(norm_type, placements, depths, state):
    model = tiny_ours(norm_type, num_layers=len(placements), layer_norm_types=placements, layer_depths=depths,
                      deepnorm_num_layers=4, **STRONG_INIT)
    model.load_state_dict(state)
    return model


def test_lns_layers_keep_their_own_depth_factor():
    model = tiny_ours("lns", num_layers=4, **STRONG_INIT)
    state = state_without_layer(model, 1)
    remove_layer(model, 1)
    assert model.config.layer_depths == [1, 3, 4]
    assert model.config.layer_norm_types == ["lns"] * 3
    expected = _ours_rebuilt("lns", ["lns"] * 3, [1, 3, 4], state)
    torch.testing.assert_close(logits(model), logits(expected), rtol=0, atol=0)
    # A 3-layer LNS model renumbered 1, 2, 3 is a different function: the depth really is kept.
    renumbered = tiny_ours("lns", num_layers=3, **STRONG_INIT)
    renumbered.load_state_dict(state)
    assert not torch.allclose(logits(model), logits(renumbered), atol=1e-2)


def test_mix_ln_layers_keep_their_own_placement():
    model = tiny_ours("post_pre", num_layers=4, post_num=2, **STRONG_INIT)
    state = state_without_layer(model, 0)
    remove_layer(model, 0)
    assert model.config.layer_norm_types == ["post", "pre", "pre"]
    expected = _ours_rebuilt("post_pre", ["post", "pre", "pre"], [2, 3, 4], state)
    torch.testing.assert_close(logits(model), logits(expected), rtol=0, atol=0)
    # Rebuilding with post_num=2 would make the old layer 2 (trained Pre-LN) Post-LN.
    naive = tiny_ours("post_pre", num_layers=3, post_num=2, **STRONG_INIT)
    naive.load_state_dict(state)
    assert not torch.allclose(logits(model), logits(naive), atol=1e-2)


def test_round_trip_through_save_and_load(tmp_path):
    model = tiny_ours("lns", num_layers=4)
    remove_layer(model, 2)
    model.save_pretrained(tmp_path)
    reloaded = model_io.load_model(str(tmp_path))
    assert reloaded.config.num_hidden_layers == 3 and reloaded.config.layer_depths == [1, 2, 4]
    torch.testing.assert_close(logits(reloaded), logits(model), rtol=0, atol=0)
    # What lm_eval's hf backend does with trust_remote_code=True (the command layer_remove prints).
    remote = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True).eval()
    torch.testing.assert_close(logits(remote), logits(model), rtol=0, atol=0)


def test_hf_round_trip(tmp_path):
    model = tiny_hf_llama(num_layers=3)
    remove_layer(model, 1)
    model.save_pretrained(tmp_path)
    reloaded = model_io.load_model(str(tmp_path))
    assert type(reloaded) is LlamaForCausalLM and reloaded.config.num_hidden_layers == 2
    torch.testing.assert_close(logits(reloaded), logits(model), rtol=0, atol=0)


@pytest.mark.parametrize("index", [4, -1])
def test_out_of_range_index_is_an_error(index):
    model = tiny_hf_llama(num_layers=4)
    with pytest.raises(ValueError, match=f"--layer_index: {index} is out of range .* 4 layers"):
        remove_layer(model, index)
    assert len(model.model.layers) == 4 and model.config.num_hidden_layers == 4


def test_in_memory_removal_is_undone():
    model = tiny_ours("lns", num_layers=4)
    before_logits, before_config = logits(model), model.config.to_dict()
    with layer_removed(model, 1):
        assert len(model.model.layers) == 3
        assert not torch.allclose(logits(model), before_logits)
    assert model.config.to_dict() == before_config
    assert [layer.self_attn.layer_idx for layer in model.model.layers] == [0, 1, 2, 3]
    torch.testing.assert_close(logits(model), before_logits, rtol=0, atol=0)


def test_cli_out_of_range_and_occupied_save_path_errors(tmp_path, capsys):
    model_dir = save_with_tokenizer(tiny_hf_llama(num_layers=2), tmp_path / "model")
    with pytest.raises(SystemExit) as exit_info:
        main(["--model_path", str(model_dir), "--layer_index", "2", "--save_path", str(tmp_path / "pruned")])
    assert exit_info.value.code == 2
    assert "--layer_index: 2 is out of range" in capsys.readouterr().err
    assert not (tmp_path / "pruned").exists()
    with pytest.raises(SystemExit):
        main(["--model_path", str(model_dir), "--layer_index", "0", "--save_path", str(model_dir)])
    assert "--save_path" in capsys.readouterr().err
    assert (model_dir / "config.json").is_file()


@pytest.mark.e2e
def test_cli_removes_a_layer_and_prints_the_lm_eval_command(tmp_path):
    model_dir = save_with_tokenizer(tiny_ours("post_pre", num_layers=4, post_num=1), tmp_path / "model")
    save_path = tmp_path / "pruned"
    result = run_cli("layer_remove.py", "--model_path", str(model_dir), "--layer_index", "0",
                     "--save_path", str(save_path))
    assert result.returncode == 0, result.stderr
    # No trained length recorded: lm-eval's own default, max_position_embeddings, is spelled out.
    assert f"lm_eval --model hf --model_args pretrained={save_path.resolve()},dtype=bfloat16,max_length=1024," \
           "trust_remote_code=True " in result.stdout
    # No CUDA here (and the tests run offline): the command that works on this machine comes first.
    assert result.stdout.index("--tasks heldout_novel_ppl") < result.stdout.index("--tasks mmlu")
    config = json.loads((save_path / "config.json").read_text())
    assert config["num_hidden_layers"] == 3
    assert config["layer_norm_types"] == ["pre", "pre", "pre"] and config["layer_depths"] == [2, 3, 4]
    assert (save_path / "tokenizer.json").is_file()


@pytest.mark.e2e
def test_sweep_runs_end_to_end_through_lm_eval_offline(tmp_path):
    model_dir = save_with_tokenizer(tiny_ours("lns", num_layers=2), tmp_path / "model")
    text = write_jsonl(tmp_path / "heldout.jsonl", [document[:500] for document in heldout_documents(3)])
    out = tmp_path / "sweep"
    result = run_cli("layer_remove.py", "--model_path", str(model_dir), "--sweep", "--task_text_file", str(text),
                     "--task_max_documents", "2", "--eval_batch_size", "2", "--output_dir", str(out))
    assert result.returncode == 0, result.stderr
    assert "evaluating the local task heldout_novel_ppl" in result.stderr  # offline default
    # lm-eval's noise, once per evaluation or per layer: the task's metrics now state their aggregation and
    # direction, and HFLM's warning about being handed a model object (which the sweep does on purpose) is dropped.
    assert "is defined, but" not in result.stderr and "is not of type `str`" not in result.stderr
    with (out / "layer_removal.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [row["removed_layer"] for row in rows] == ["baseline", "0", "1"]
    assert {row["metric"] for row in rows} == {"word_perplexity,none"}
    baseline = float(rows[0]["value"])
    for row in rows[1:]:
        value = float(row["value"])
        assert math.isfinite(value) and value > 1 and value != baseline
        assert float(row["drop"]) == pytest.approx(value - baseline)  # lower perplexity is better
    payload = json.loads((out / "layer_removal.json").read_text())
    assert len(payload["rows"]) == 3 and payload["tasks"] == ["heldout_novel_ppl"]
    assert (out / "layer_removal.png").stat().st_size > 0


@pytest.mark.e2e
def test_sweep_per_document_values_add_up_to_the_reported_perplexity(tmp_path):
    model_dir = save_with_tokenizer(tiny_ours("pre", num_layers=2), tmp_path / "model")
    text = write_jsonl(tmp_path / "heldout.jsonl", [document[:400] for document in heldout_documents(3)])
    out = tmp_path / "sweep"
    result = run_cli("layer_remove.py", "--model_path", str(model_dir), "--sweep", "--task_text_file", str(text),
                     "--task_max_documents", "3", "--eval_batch_size", "2", "--per_document", "--output_dir", str(out))
    assert result.returncode == 0, result.stderr
    rows = json.loads((out / "layer_removal.json").read_text())["rows"]
    for row in rows:
        documents = row["documents"]  # [log-likelihood, words] per document, in document order
        assert len(documents) == 3 and all(loglik < 0 < words for loglik, words in documents)
        pooled = math.exp(-sum(loglik for loglik, _ in documents) / sum(words for _, words in documents))
        assert pooled == pytest.approx(row["value"], rel=1e-6)
    assert rows[0]["documents"] != rows[1]["documents"]
    with (out / "layer_removal.csv").open() as handle:
        assert "documents" not in next(csv.DictReader(handle))


@pytest.mark.e2e
def test_a_second_sweep_into_the_same_folder_is_refused_and_a_killed_sweep_keeps_its_rows(tmp_path, monkeypatch,
                                                                                          capsys):
    import layer_remove
    from utils.instruments import removal_sweep

    model_dir = save_with_tokenizer(tiny_ours("lns", num_layers=2), tmp_path / "model")
    text = write_jsonl(tmp_path / "heldout.jsonl", [document[:300] for document in heldout_documents(2)])
    out = tmp_path / "sweep"
    argv = ["--model_path", str(model_dir), "--sweep", "--task_text_file", str(text), "--eval_batch_size", "2",
            "--output_dir", str(out)]
    real_evaluate, calls = removal_sweep.evaluate, []

    def evaluate_then_die(*args, **kwargs):  # the baseline and layer 0 finish; the run dies during layer 1
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(removal_sweep, "evaluate", evaluate_then_die)
    with pytest.raises(KeyboardInterrupt):
        main(argv)
    partial = json.loads((out / layer_remove.PARTIAL_SWEEP).read_text())
    assert [row["removed_layer"] for row in partial["rows"]] == [None, 0] and partial["complete"] is False
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and "--output_dir" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # a resume must be the same sweep
        main([*argv, "--resume", "--max_seq_len", "32"])
    assert exit_info.value.code == 2 and "max_seq_len" in capsys.readouterr().err
    calls.clear()
    monkeypatch.setattr(removal_sweep, "evaluate", lambda *a, **k: calls.append(1) or real_evaluate(*a, **k))
    main([*argv, "--resume"])
    assert len(calls) == 1  # only layer 1: the baseline and layer 0 come from the partial file
    assert not (out / layer_remove.PARTIAL_SWEEP).exists()
    resumed = json.loads((out / "layer_removal.json").read_text())["rows"]
    main([*argv, "--overwrite"])
    fresh = json.loads((out / "layer_removal.json").read_text())["rows"]
    assert [row["removed_layer"] for row in resumed] == [None, 0, 1]
    assert [row["value"] for row in resumed] == pytest.approx([row["value"] for row in fresh], rel=1e-9)


@pytest.mark.parametrize("extra, flag", [(["--layers", "1,1"], "--layers"), (["--layers", ","], "--layers"),
                                         (["--limit", "0"], "--limit"), (["--task_max_documents", "-1"],
                                                                         "--task_max_documents")])
def test_bad_sweep_flags_are_one_line_errors(extra, flag, tmp_path, capsys):
    model_dir = save_with_tokenizer(tiny_hf_llama(num_layers=2), tmp_path / "model")
    with pytest.raises(SystemExit) as exit_info:
        main(["--model_path", str(model_dir), "--sweep", "--tasks", "heldout_novel_ppl",
              "--output_dir", str(tmp_path / "out"), *extra])
    assert exit_info.value.code == 2 and flag in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_saved_with_lns_hooks_is_analysed_and_pruned_with_them(tmp_path):
    """finetune.py's intermediate checkpoints keep the hooks unfolded and say so in their config."""
    from peft_pretraining.model.layernorm_scaling import apply_layernorm_scaling

    hooked = apply_layernorm_scaling(tiny_hf_llama(num_layers=3))
    model_dir = save_with_tokenizer(hooked, tmp_path / "model")
    torch.testing.assert_close(logits(model_io.load_model(str(model_dir))), logits(hooked), rtol=0, atol=1e-6)
    main(["--model_path", str(model_dir), "--layer_index", "1", "--save_path", str(tmp_path / "pruned")])
    pruned = AutoModelForCausalLM.from_pretrained(tmp_path / "pruned").eval()
    with layer_removed(hooked, 1):
        torch.testing.assert_close(logits(pruned), logits(hooked), rtol=0, atol=1e-5)


def test_with_cuda_and_the_hub_the_gpu_mmlu_command_comes_first(tmp_path, monkeypatch, capsys):
    import layer_remove

    model_dir = save_with_tokenizer(tiny_ours("pre", num_layers=2), tmp_path / "model")
    monkeypatch.setattr(layer_remove.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(layer_remove.model_io, "hub_is_reachable", lambda *args, **kwargs: True)
    main(["--model_path", str(model_dir), "--layer_index", "0", "--save_path", str(tmp_path / "pruned"),
          "--device", "cpu"])
    printed = capsys.readouterr().out
    assert printed.index("--tasks mmlu") < printed.index("--tasks heldout_novel_ppl")


def test_only_lm_evals_model_object_warning_is_dropped(caplog):
    import logging

    from utils.instruments.removal_sweep import LM_EVAL_MODEL_OBJECT_WARNING, quiet_lm_eval_model_object_warning

    logger = logging.getLogger("lm_eval.models.huggingface")
    with caplog.at_level(logging.WARNING):
        with quiet_lm_eval_model_object_warning():
            logger.warning(LM_EVAL_MODEL_OBJECT_WARNING + ". Many other model arguments may be ignored.")
            logger.warning("some other warning")
        logger.warning(LM_EVAL_MODEL_OBJECT_WARNING + " (outside the sweep)")
    assert [record.getMessage() for record in caplog.records] == [
        "some other warning", LM_EVAL_MODEL_OBJECT_WARNING + " (outside the sweep)"]


def test_the_heldout_task_states_its_aggregations(tmp_path, caplog):
    """Without aggregation and higher_is_better per metric, lm-eval warned 6 times per evaluation (75 in a sweep)."""
    import logging

    from lm_eval.tasks import get_task_dict

    from peft_pretraining.data import lm_eval_tasks

    text = write_jsonl(tmp_path / "heldout.jsonl", [document[:200] for document in heldout_documents(2)])
    include = lm_eval_tasks.build_local_tasks([lm_eval_tasks.HELDOUT_PERPLEXITY_TASK], tmp_path / "tasks",
                                              {lm_eval_tasks.HELDOUT_PERPLEXITY_TASK: {"text_file": str(text)}})
    manager = lm_eval_tasks.task_manager(include, include_defaults=False)
    with caplog.at_level(logging.WARNING):
        task = get_task_dict([lm_eval_tasks.HELDOUT_PERPLEXITY_TASK], manager)[lm_eval_tasks.HELDOUT_PERPLEXITY_TASK]
    assert not [record for record in caplog.records if "is defined, but" in record.getMessage()]
    assert task.higher_is_better() == {"word_perplexity": False, "byte_perplexity": False, "bits_per_byte": False}


@pytest.mark.e2e
def test_a_fresh_checkpoint_loads_its_tokenizer_with_no_question_and_no_model_type_warning(tmp_path):
    """AutoTokenizer reads the folder's config.json through AutoConfig first. For a model type stock transformers
    does not know, whose auto_map names the checkpoint's code, that asks "Do you wish to run the custom code? [y/N]"
    and then warns "You are using a model of type `llama_norm_placement` to instantiate a model of type ``".
    Importing our model registers its type: the plain call, our tools and AutoModelForCausalLM then ask nothing. Before
    the import, trust_remote_code=True asks nothing, and the checkpoint's copy of our code registers nothing (the model
    without trust_remote_code still asks)."""
    import subprocess
    import sys
    from pathlib import Path

    model_dir = save_with_tokenizer(tiny_ours("lns", num_layers=2), tmp_path / "model")  # what a checkpoint holds
    script = ("import builtins, sys\n"
              f"sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})\n"
              "def prompt(*_):\n    print('PROMPTED', file=sys.stderr)\n    raise EOFError\n"
              "builtins.input = prompt\n"
              "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
              f"path = {str(model_dir)!r}\n"
              "print(type(AutoTokenizer.from_pretrained(path, trust_remote_code=True)).__name__)\n"
              "try:\n    AutoModelForCausalLM.from_pretrained(path)\n"
              "except ValueError as err:\n    print('REFUSED' if 'trust_remote_code' in str(err) else err)\n"
              "print('IMPORT', file=sys.stderr)\n"
              "import peft_pretraining.model.modeling_llama\n"
              "print(type(AutoTokenizer.from_pretrained(path)).__name__)\n"
              "from utils.instruments import model_io\n"
              "print(model_io.load_tokenizer(path).name_or_path == path)\n"  # its own, not the repository's fallback
              "from peft_pretraining.data import dataloader\n"  # the trainer's --tokenizer <checkpoint>
              "print(type(dataloader.load_tokenizer(path)).__name__)\n"
              "print(type(AutoModelForCausalLM.from_pretrained(path)).__module__)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["TokenizersBackend", "REFUSED", "TokenizersBackend", "True", "TokenizersBackend",
                                     "peft_pretraining.model.modeling_llama"]
    before_import, after_import = result.stderr.split("IMPORT")
    assert before_import.count("PROMPTED") == 1  # only the model without trust_remote_code asks
    assert "PROMPTED" not in after_import and "Do you wish" not in after_import
    assert "to instantiate a model of type" not in result.stderr
