"""Every evaluation tool stays inside the context the model was trained at.

A model trained by torchrun_main.py at --max_length 32 records train_max_length=32 in its config.json; the removal
sweep (lm-eval, offline held-out task), single removal, the angular and variance tools and the SFT evaluation must
then never feed it more than 32 positions, on texts long enough that they would without the rule. A forward
pre-hook on every embedding layer records the sequence length of each forward.
"""
import json
from pathlib import Path

import pytest
import torch

import layer_remove
from peft_pretraining.model.llama_export import export_to_hf_llama
from tests.analysis_helpers import heldout_documents, save_with_tokenizer, tiny_hf_llama, tiny_ours, write_jsonl
from tests.conftest import TINY_RUN, run_trainer
from utils import angular_analysis, finetune, variance_analysis
from utils.instruments import model_io

REPO = Path(__file__).resolve().parent.parent
TRAINED_LENGTH = 32


@pytest.fixture(scope="module")
def trained_checkpoint(tmp_path_factory) -> Path:
    """Two updates of the tiny model at --max_length 32, saved the way every run saves."""
    run_dir = tmp_path_factory.mktemp("context") / "run"
    proc = run_trainer([*TINY_RUN, "--max_length", TRAINED_LENGTH, "--batch_size", "2", "--eval_tokens", "64",
                        "--lr", "1e-3", "--warmup_steps", "1", "--num_training_steps", "2", "--eval_every", "2",
                        "--save_every", "2", "--save_dir", run_dir])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir / "model_2"


@pytest.fixture(scope="module")
def long_text(tmp_path_factory) -> Path:
    """Three held-out documents of well over 32 tokens each."""
    return write_jsonl(tmp_path_factory.mktemp("text") / "heldout.jsonl",
                       [document[:1500] for document in heldout_documents(4)[1:]])


@pytest.fixture
def forward_lengths():
    """Sequence length of every embedding forward while the test runs (any model, however it was loaded)."""
    lengths = []

    def record(module, args):
        if isinstance(module, torch.nn.Embedding):
            lengths.append(args[0].shape[-1])

    handle = torch.nn.modules.module.register_module_forward_pre_hook(record)
    yield lengths
    handle.remove()


def assert_inside_trained_context(lengths):
    assert lengths, "no forward pass was recorded"
    assert max(lengths) == TRAINED_LENGTH, sorted(set(lengths))  # never more, and the text did fill whole windows


@pytest.mark.e2e
def test_trainer_records_the_trained_length_in_the_checkpoint(trained_checkpoint):
    config = json.loads((trained_checkpoint / "config.json").read_text())
    assert config["train_max_length"] == TRAINED_LENGTH
    assert config["max_position_embeddings"] > TRAINED_LENGTH  # so the default would have gone past it


@pytest.mark.e2e
def test_removal_sweep_through_lm_eval_stays_inside(trained_checkpoint, long_text, tmp_path, forward_lengths,
                                                    capsys):
    layer_remove.main(["--model_path", str(trained_checkpoint), "--sweep", "--tasks", "heldout_novel_ppl",
                       "--task_text_file", str(long_text), "--layers", "1", "--eval_batch_size", "4",
                       "--output_dir", str(tmp_path / "sweep")])
    assert_inside_trained_context(forward_lengths)
    assert "[context] 32 tokens per window: the model was trained at that length" in capsys.readouterr().out
    assert json.loads((tmp_path / "sweep" / "layer_removal.json").read_text())["max_seq_len"] == TRAINED_LENGTH


@pytest.mark.e2e
def test_single_removal_keeps_the_length_and_prints_it_for_lm_eval(trained_checkpoint, tmp_path, capsys):
    save_path = tmp_path / "pruned"
    layer_remove.main(["--model_path", str(trained_checkpoint), "--layer_index", "1", "--save_path", str(save_path)])
    assert json.loads((save_path / "config.json").read_text())["train_max_length"] == TRAINED_LENGTH
    assert f"max_length={TRAINED_LENGTH}" in capsys.readouterr().out


@pytest.mark.e2e
def test_angular_tool_stays_inside(trained_checkpoint, long_text, tmp_path, forward_lengths):
    angular_analysis.main(["--model_path", str(trained_checkpoint), "--text_file", str(long_text),
                           "--num_tokens", "300", "--batch_size", "4", "--output_dir", str(tmp_path / "angular")])
    assert_inside_trained_context(forward_lengths)
    assert json.loads((tmp_path / "angular" / "angular_distance.json").read_text())["max_seq_len"] == TRAINED_LENGTH


@pytest.mark.e2e
def test_variance_tool_stays_inside(trained_checkpoint, long_text, tmp_path, forward_lengths):
    variance_analysis.main(["--model_paths", str(trained_checkpoint), "--text_file", str(long_text),
                            "--num_tokens", "300", "--batch_size", "4", "--output_dir", str(tmp_path / "variance")])
    assert_inside_trained_context(forward_lengths)


@pytest.mark.e2e
def test_finetune_evaluation_stays_inside(trained_checkpoint, tmp_path, forward_lengths):
    finetune.run(["--model_path", str(trained_checkpoint), "--eval_only", "--eval_tasks", "heldout_novel_ppl",
                  "--eval_limit", "2", "--eval_batch_size", "4", "--output_dir", str(tmp_path / "sft")])
    assert_inside_trained_context(forward_lengths)


@pytest.mark.e2e
def test_max_seq_len_overrides_and_warns_past_the_trained_length(trained_checkpoint, long_text, tmp_path,
                                                                 forward_lengths, capsys):
    angular_analysis.main(["--model_path", str(trained_checkpoint), "--text_file", str(long_text),
                           "--num_tokens", "300", "--max_seq_len", "48", "--output_dir", str(tmp_path / "angular")])
    assert max(forward_lengths) == 48
    assert "--max_seq_len 48 exceeds the trained context 32" in capsys.readouterr().out


def test_hub_model_without_a_recorded_length_uses_max_position_embeddings(tmp_path, capsys):
    model = tiny_hf_llama()
    assert model_io.resolve_context_length(model, None) == model.config.max_position_embeddings
    assert f"[context] {model.config.max_position_embeddings} tokens per window: the model records no trained " \
           "length, so its max_position_embeddings" in capsys.readouterr().out
    # Through a tool's command line too.
    model_dir = save_with_tokenizer(model, tmp_path / "hub_like")
    layer_remove.main(["--model_path", str(model_dir), "--layer_index", "0", "--save_path", str(tmp_path / "pruned")])
    assert f"max_length={model.config.max_position_embeddings}" in capsys.readouterr().out


def test_stream_tools_keep_their_256_window_for_hub_models(tmp_path, capsys):
    """Hub models record no trained length: the angular tool keeps its old 256-token windows (not 1024)."""
    model = tiny_hf_llama()
    assert model_io.resolve_context_length(model, None, fallback=model_io.HUB_STREAM_WINDOW) == 256
    assert "256 tokens per window: the model records no trained length, so this tool's default" in \
        capsys.readouterr().out


def test_stream_tools_never_pass_a_hub_models_max_position_embeddings(tmp_path, long_text, forward_lengths):
    """A hub model whose max_position_embeddings is below the 256-token default is read at its own maximum."""
    model = tiny_hf_llama()
    model.config.max_position_embeddings = TRAINED_LENGTH
    assert model_io.resolve_context_length(model, None, fallback=model_io.HUB_STREAM_WINDOW) == TRAINED_LENGTH
    model_dir = save_with_tokenizer(model, tmp_path / "short_context")
    angular_analysis.main(["--model_path", str(model_dir), "--text_file", str(long_text), "--num_tokens", "300",
                           "--batch_size", "4", "--output_dir", str(tmp_path / "angular")])
    assert_inside_trained_context(forward_lengths)


@pytest.mark.e2e
def test_resolve_context_length_reads_a_config_dict(trained_checkpoint):
    config = model_io.read_local_config(trained_checkpoint)
    assert model_io.resolve_context_length(config, None, log=lambda line: None) == TRAINED_LENGTH


def test_resolve_context_length_rejects_a_non_positive_request():
    with pytest.raises(ValueError, match="--max_seq_len"):
        model_io.resolve_context_length(tiny_hf_llama(), 0)


def test_export_to_hf_llama_keeps_the_trained_length():
    model = tiny_ours("lns", num_layers=2)
    model.config.train_max_length = TRAINED_LENGTH
    assert export_to_hf_llama(model).config.train_max_length == TRAINED_LENGTH


@pytest.mark.e2e
def test_a_fine_tuned_model_keeps_the_trained_length(trained_checkpoint, tmp_path):
    records = [{"instruction": f"Name colour {i}.", "input": "", "output": f"colour {i}", "answer": f"{i}"}
               for i in range(4)]
    data = tmp_path / "instructions.jsonl"
    data.write_text("".join(json.dumps(record) + "\n" for record in records))
    finetune.run(["--model_path", str(trained_checkpoint), "--dataset", str(data), "--finetune", "full",
                  "--max_steps", "1", "--batch_size", "4", "--micro_batch_size", "4", "--eval_tasks", "none",
                  "--output_dir", str(tmp_path / "sft")])
    assert json.loads((tmp_path / "sft" / "model" / "config.json").read_text())["train_max_length"] == TRAINED_LENGTH
