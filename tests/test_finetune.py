"""SFT on a tiny instruction set with tiny models: response-only loss, LoRA and full fine-tuning, local lm-eval task."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from peft_pretraining.data.lm_eval_tasks import NEXT_SENTENCE_TASK, next_sentence_items
from peft_pretraining.data.sft_data import IGNORE_INDEX, SFTCollator, format_prompt, tokenize_example
from peft_pretraining.model import modeling_llama as ours
from peft_pretraining.model.layernorm_scaling import apply_layernorm_scaling
from utils import finetune

TOKENIZER = "data/tokenizer"
COLOURS = ["red", "green", "blue", "yellow", "purple", "orange"]
THINGS = ["apple", "leaf", "sky", "sun", "plum", "carrot"]


def _records():
    records = []
    for index, (thing, colour) in enumerate(zip(THINGS * 3, COLOURS * 3)):
        option = (index % 2) + 1
        records.append({
            "instruction": f"Which colour is the {thing}? Answer format: option1/option2",
            "input": "" if index % 3 else f"Option1: {colour} Option2: grey",
            "output": f"the correct answer is option{option}",
            "answer": f"option{option}",
        })
    return records


@pytest.fixture(scope="module")
def instruction_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("sft_data") / "instructions.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in _records()))
    return str(path)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER)


def _tiny_config_overrides():
    return dict(num_hidden_layers=2, max_position_embeddings=256)


@pytest.fixture(scope="module")
def hf_llama_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.from_pretrained("configs/llama_tiny.json", **_tiny_config_overrides()))
    path = tmp_path_factory.mktemp("hf_llama")
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def our_lns_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = ours.LlamaForCausalLM(ours.build_config("configs/llama_tiny.json", norm_type="lns", train_max_length=128,
                                                    **_tiny_config_overrides()))
    path = tmp_path_factory.mktemp("our_lns")
    model.save_pretrained(path)
    return str(path)


def _fixed_batch(tokenizer):
    examples = [tokenize_example(record, tokenizer, 128) for record in _records()[:4]]
    return SFTCollator(tokenizer.pad_token_id)(examples)


@torch.no_grad()
def _response_loss(model, batch):
    model.eval()
    loss_sum, count = finetune.response_loss_sum(model, batch)
    return float(loss_sum) / count


def test_prompt_tokens_are_masked(tokenizer):
    record = _records()[0]
    example = tokenize_example(record, tokenizer, 512)
    prompt_length = len(tokenizer(format_prompt(record), add_special_tokens=False)["input_ids"])
    assert "### Input:" in format_prompt(record) and "### Input:" not in format_prompt(_records()[1])
    assert example["labels"][:prompt_length] == [IGNORE_INDEX] * prompt_length
    response = example["labels"][prompt_length:]
    assert IGNORE_INDEX not in response and response[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(response[:-1]) == record["output"]
    assert example["input_ids"][prompt_length:] == response
    # Truncation inside the prompt leaves no response token; padding is masked and ignored.
    assert tokenize_example(record, tokenizer, 5)["num_response_tokens"] == 0
    batch = SFTCollator(tokenizer.pad_token_id)([example, tokenize_example(_records()[1], tokenizer, 512)])
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape
    assert ((batch["attention_mask"] == 0) <= (batch["labels"] == IGNORE_INDEX)).all()


@pytest.mark.e2e
def test_lora_with_lns_on_hf_llama(tmp_path, hf_llama_dir, instruction_file, tokenizer):
    batch = _fixed_batch(tokenizer)
    base = apply_layernorm_scaling(AutoModelForCausalLM.from_pretrained(hf_llama_dir))
    loss_before = _response_loss(base, batch)
    out = tmp_path / "lora"
    summary = finetune.run([
        "--model_path", hf_llama_dir, "--tokenizer", TOKENIZER, "--apply_lns", "--dataset", instruction_file,
        "--finetune", "lora", "--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0",
        "--lr", "2e-2", "--max_steps", "8", "--batch_size", "4", "--micro_batch_size", "2", "--warmup_steps", "1",
        "--save_every", "4", "--save_merged", "--eval_tasks", f"{NEXT_SENTENCE_TASK},heldout_novel_ppl",
        "--mc_examples", "6", "--eval_limit", "4",
        "--eval_batch_size", "8", "--output_dir", str(out),
    ])
    merged = summary["model"]
    loss_after = _response_loss(merged, batch)
    assert loss_after < loss_before - 0.5, (loss_before, loss_after)

    # Adapters (and the intermediate checkpoint) reload onto an LNS base and match the merged model.
    from peft import PeftModel

    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    assert (out / "checkpoint-4" / "adapter_config.json").is_file()
    reloaded_base = apply_layernorm_scaling(AutoModelForCausalLM.from_pretrained(hf_llama_dir))
    adapter_model = PeftModel.from_pretrained(reloaded_base, out / "adapter").eval()
    with torch.no_grad():
        adapter_logits = adapter_model(input_ids=batch["input_ids"]).logits
        merged_logits = merged(input_ids=batch["input_ids"]).logits
        saved_merged_logits = AutoModelForCausalLM.from_pretrained(out / "merged").eval()(
            input_ids=batch["input_ids"]).logits
        with adapter_model.disable_adapter():
            base_logits = adapter_model(input_ids=batch["input_ids"]).logits
    assert not torch.allclose(adapter_logits, base_logits, atol=1e-3)  # the adapters did change the model
    torch.testing.assert_close(merged_logits, adapter_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(saved_merged_logits, adapter_logits, atol=1e-4, rtol=1e-4)

    # The local multiple-choice task (and the held-out perplexity one) ran end to end through lm-eval.
    results = json.loads((out / "results.json").read_text())
    accuracy = results["tasks"][NEXT_SENTENCE_TASK]["acc"]
    assert 0.0 <= accuracy <= 1.0 and results["tasks"][NEXT_SENTENCE_TASK]["num_examples"] == 4
    assert results["tasks"]["heldout_novel_ppl"]["word_perplexity"] > 1.0
    header, row = (out / "results.csv").read_text().splitlines()
    assert header.split(",") == ["model", NEXT_SENTENCE_TASK, "heldout_novel_ppl (word_perplexity)", "average acc"]
    assert float(row.split(",")[1]) == pytest.approx(100 * accuracy, abs=0.01)
    assert float(row.split(",")[-1]) == pytest.approx(100 * accuracy, abs=0.01)
    assert (out / "results.png").stat().st_size > 0 and (out / "train_loss.png").stat().st_size > 0
    assert len((out / "train_metrics.jsonl").read_text().splitlines()) == 8

    # A second run into the same folder is refused before anything is touched.
    adapter_bytes = (out / "adapter" / "adapter_model.safetensors").read_bytes()
    with pytest.raises(SystemExit):
        finetune.run(["--model_path", hf_llama_dir, "--dataset", instruction_file, "--eval_tasks", "none",
                      "--output_dir", str(out)])
    assert (out / "adapter" / "adapter_model.safetensors").read_bytes() == adapter_bytes


@pytest.mark.e2e
def test_full_finetune_of_our_checkpoint(tmp_path, our_lns_dir, instruction_file, tokenizer, capsys):
    batch = _fixed_batch(tokenizer)
    loss_before = _response_loss(ours.LlamaForCausalLM.from_pretrained(our_lns_dir), batch)
    out = tmp_path / "full"
    summary = finetune.run([
        "--model_path", our_lns_dir, "--tokenizer", TOKENIZER, "--dataset", instruction_file, "--finetune", "full",
        "--lr", "3e-3", "--max_steps", "10", "--batch_size", "4", "--micro_batch_size", "4", "--warmup_steps", "0",
        "--eval_tasks", "none", "--output_dir", str(out),
    ])
    # --cutoff_len defaults to 256, past the 128 tokens this checkpoint records as its pretraining length
    assert "--cutoff_len 256 exceeds the context the model was pretrained at (128)" in capsys.readouterr().out
    loss_after = _response_loss(summary["model"], batch)
    assert loss_after < loss_before - 0.5, (loss_before, loss_after)
    reloaded = ours.LlamaForCausalLM.from_pretrained(out / "model").eval()
    assert reloaded.config.norm_type == "lns"
    assert _response_loss(reloaded, batch) == pytest.approx(loss_after, abs=1e-5)


def test_bad_flags_fail_with_the_flag_name(tmp_path, hf_llama_dir, instruction_file, capsys):
    common = ["--model_path", hf_llama_dir, "--tokenizer", TOKENIZER, "--dataset", instruction_file,
              "--eval_tasks", "none", "--output_dir", str(tmp_path / "bad")]
    for extra, flag in [(["--lora_target_modules", "qkv_proj"], "--lora_target_modules"),
                        (["--batch_size", "6", "--micro_batch_size", "4"], "--batch_size"),
                        (["--eval_tasks", "piqa"], "--eval_tasks"),  # the hub is offline in tests
                        (["--eval_limit", "0"], "--eval_limit"), (["--eval_limit", "1.5"], "--eval_limit")]:
        with pytest.raises(SystemExit):
            finetune.run(common + extra)  # argparse: the later --eval_tasks wins
        assert flag in capsys.readouterr().err
    bad_records = tmp_path / "bad.jsonl"
    bad_records.write_text(json.dumps({"question": "?", "answer": "x"}) + "\n")
    with pytest.raises(SystemExit) as exit_info:  # checked before the model loads or any file is written
        finetune.run(["--model_path", hf_llama_dir, "--tokenizer", TOKENIZER, "--dataset", str(bad_records),
                      "--eval_tasks", "none", "--output_dir", str(tmp_path / "bad2")])
    assert exit_info.value.code == 2 and "instruction, output" in capsys.readouterr().err
    assert not (tmp_path / "bad2").exists()


def test_next_sentence_items():
    passages = ["One two three four. Five six seven eight. Nine ten eleven twelve.",
                "Alpha beta gamma delta. Epsilon zeta eta theta.",
                "Red green blue cyan. Magenta yellow black white.",
                "North south east west. Up down left right."]
    examples = next_sentence_items(passages, num_examples=50, num_choices=3, seed=1)
    assert len(examples) == 5  # every (passage, sentence >= 2nd) pair, once
    for example in examples:
        answer = example["choices"][example["label"]]
        source = next(p for p in passages if example["context"] in p)
        assert source.index(example["context"]) + len(example["context"]) + 1 == source.index(answer)
        assert len(set(example["choices"])) == 3
        assert all(choice not in source for i, choice in enumerate(example["choices"]) if i != example["label"])
    assert examples == next_sentence_items(passages, num_examples=50, num_choices=3, seed=1)
    # Three texts, but the other two hold one distinct sentence between them: an error, not an endless draw.
    with pytest.raises(ValueError, match="too few distinct sentences"):
        next_sentence_items([passages[0], "The same four words.", "The same four words."], num_examples=5,
                            num_choices=3)


def test_next_sentence_choices_fit_the_window_they_are_scored_in(tmp_path, tokenizer):
    """The held-out novel has sentences of over 200 tokens; lm-eval refuses a choice longer than its window, so a
    model trained at 128 tokens could not be scored until choices were limited to the window."""
    from peft_pretraining.data.lm_eval_tasks import build_next_sentence_task

    def longest_choice(folder):
        items = [json.loads(line) for line in next(folder.glob("*.jsonl")).read_text().splitlines()]
        return len(items), max(len(tokenizer.encode(" " + c, add_special_tokens=False))
                               for item in items for c in item["choices"])

    unfiltered = build_next_sentence_task(tmp_path / "all")
    _, unlimited = longest_choice(unfiltered)
    count, limited = longest_choice(build_next_sentence_task(tmp_path / "fit", tokenizer=tokenizer,
                                                             max_choice_tokens=127))
    assert unlimited > 127 >= limited and count == 500
    # A window every chosen sentence already fits gives the unfiltered items, draw for draw.
    wide = build_next_sentence_task(tmp_path / "wide", tokenizer=tokenizer, max_choice_tokens=unlimited)
    assert next(wide.glob("*.jsonl")).read_text() == next(unfiltered.glob("*.jsonl")).read_text()


def test_offline_auto_tasks_are_decided_by_probing_the_hub(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(finetune, "hub_is_reachable", lambda: False)  # no network, no flag set
    parser = finetune.build_parser()
    args = parser.parse_args(["--model_path", "unused", "--eval_only", "--eval_tasks", "auto",
                              "--output_dir", "unused_output"])
    finetune.check_args(args, parser)
    assert args.eval_tasks == [NEXT_SENTENCE_TASK]


@pytest.mark.e2e
def test_overwrite_replaces_the_earlier_run(tmp_path, hf_llama_dir, instruction_file):
    out = tmp_path / "run"
    argv = ["--model_path", hf_llama_dir, "--tokenizer", TOKENIZER, "--dataset", instruction_file, "--finetune",
            "full", "--max_steps", "3", "--batch_size", "4", "--micro_batch_size", "4", "--eval_tasks", "none",
            "--output_dir", str(out)]
    finetune.run(argv)
    (out / "results.json").write_text("{}")  # as an earlier run with evaluation would have left
    finetune.run([*argv, "--overwrite"])
    assert len((out / "train_metrics.jsonl").read_text().splitlines()) == 3
    assert not (out / "results.json").exists()
    # Re-evaluating the trained model into its own folder must not delete it.
    finetune.run(["--model_path", str(out / "model"), "--tokenizer", TOKENIZER, "--eval_only", "--eval_tasks",
                  NEXT_SENTENCE_TASK, "--mc_examples", "8", "--output_dir", str(out), "--overwrite"])
    assert (out / "model" / "config.json").is_file() and (out / "train_metrics.jsonl").is_file()
    assert (out / "results.json").is_file()


@pytest.mark.parametrize("flag", ["HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"])
def test_each_offline_flag_alone_means_the_hub_is_not_used(flag, monkeypatch):
    from utils.instruments import model_io

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(flag, "1")
    monkeypatch.setattr(model_io.urllib.request, "urlopen", lambda *a, **k: None)  # as if the network answered
    assert not model_io.hub_is_reachable()


@pytest.mark.e2e
def test_export_of_a_checkpoint_saved_with_lns_hooks_folds_them(tmp_path, hf_llama_dir):
    import subprocess
    import sys

    hooked = apply_layernorm_scaling(LlamaForCausalLM.from_pretrained(hf_llama_dir)).eval()
    hooked.save_pretrained(tmp_path / "hooked")  # config says layernorm_scaling: true, gains unfolded
    ours_config = ours.build_config("configs/llama_tiny.json", **_tiny_config_overrides())
    ours_model = ours.LlamaForCausalLM(ours_config)
    ours_model.load_state_dict(hooked.state_dict())
    apply_layernorm_scaling(ours_model).save_pretrained(tmp_path / "ours_hooked")
    result = subprocess.run([sys.executable, "utils/export_hf.py", "--checkpoint", str(tmp_path / "ours_hooked"),
                             "--out", str(tmp_path / "exported")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
    tokens = torch.randint(3, 8192, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported(tokens).logits, hooked(tokens).logits, rtol=0, atol=1e-5)
    assert "layernorm_scaling" not in json.loads((tmp_path / "exported" / "config.json").read_text())
