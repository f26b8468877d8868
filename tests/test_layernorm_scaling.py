"""apply/remove/fold LayerNorm Scaling on tiny random HF decoders (built from configs, nothing downloaded)."""
import copy
import math

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from peft_pretraining.model import modeling_llama as ours
from peft_pretraining.model.layernorm_scaling import (
    apply_layernorm_scaling,
    fold_layernorm_scaling,
    has_layernorm_scaling,
    reapply_layernorm_scaling_from_config,
    remove_layernorm_scaling,
)

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)
BLOCK_NORMS = ("input_layernorm", "post_attention_layernorm")


def _randomize_norm_gains(model):
    """Non-unit gains everywhere so a misplaced or missing factor changes the logits."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.empty(param.shape).uniform_(0.5, 1.5, generator=generator))
    return model


def _tiny(model_cls, config_cls, **extra):
    torch.manual_seed(0)
    return _randomize_norm_gains(model_cls(config_cls(**TINY, **extra)).eval())


@pytest.fixture
def tokens():
    return torch.randint(0, TINY["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(2))


@torch.no_grad()
def _logits(model, tokens):
    return model(tokens).logits


def _manually_scaled_copy(model):
    """Reference: multiply each block norm gain by 1/sqrt(l) by hand, independently of the package."""
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for index, layer in enumerate(reference.model.layers):
            for name in BLOCK_NORMS:
                getattr(layer, name).weight.mul_(1.0 / math.sqrt(index + 1))
    return reference


def test_patched_hf_llama_matches_our_lns_model(tokens):
    config = ours.build_config("configs/llama_tiny.json", norm_type="lns", num_hidden_layers=3)
    torch.manual_seed(0)
    lns_model = _randomize_norm_gains(ours.LlamaForCausalLM(config)).eval()
    hf_model = LlamaForCausalLM(LlamaConfig.from_pretrained("configs/llama_tiny.json", num_hidden_layers=3)).eval()
    hf_model.load_state_dict(lns_model.state_dict())
    tokens = tokens % config.vocab_size

    expected = _logits(lns_model, tokens)
    assert not torch.allclose(_logits(hf_model, tokens), expected, atol=1e-4)  # the test can fail
    apply_layernorm_scaling(hf_model)
    torch.testing.assert_close(_logits(hf_model, tokens), expected, atol=1e-5, rtol=1e-5)


def test_names_unchanged_no_parameters_and_survives_save_pretrained(tmp_path, tokens):
    model = _tiny(LlamaForCausalLM, LlamaConfig)
    names_before = list(model.state_dict())
    count_before = sum(p.numel() for p in model.parameters())
    apply_layernorm_scaling(model)
    assert list(model.state_dict()) == names_before
    assert sum(p.numel() for p in model.parameters()) == count_before
    scaled = _logits(model, tokens)

    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert list(reloaded.state_dict()) == names_before
    assert reapply_layernorm_scaling_from_config(reloaded)
    torch.testing.assert_close(_logits(reloaded, tokens), scaled, atol=0, rtol=0)
    torch.testing.assert_close(_logits(copy.deepcopy(model), tokens), scaled, atol=0, rtol=0)


@pytest.mark.e2e
def test_remove_restores_original_and_fold_is_exact(tmp_path, tokens):
    model = _tiny(LlamaForCausalLM, LlamaConfig)
    original = _logits(model, tokens)
    apply_layernorm_scaling(model)
    scaled = _logits(model, tokens)
    torch.testing.assert_close(scaled, _logits(_manually_scaled_copy(_tiny(LlamaForCausalLM, LlamaConfig)), tokens),
                               atol=1e-5, rtol=1e-5)

    remove_layernorm_scaling(model)
    assert not has_layernorm_scaling(model)
    torch.testing.assert_close(_logits(model, tokens), original, atol=0, rtol=0)

    apply_layernorm_scaling(model)
    fold_layernorm_scaling(model)
    assert not has_layernorm_scaling(model)
    torch.testing.assert_close(_logits(model, tokens), scaled, atol=1e-5, rtol=1e-5)
    # A folded export is a plain HF model: it reloads with the same outputs and nothing to re-apply.
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert not reapply_layernorm_scaling_from_config(reloaded)
    torch.testing.assert_close(_logits(reloaded, tokens), scaled, atol=1e-5, rtol=1e-5)


@pytest.mark.e2e
@pytest.mark.parametrize(
    "model_cls, config_cls",
    [(MistralForCausalLM, MistralConfig), (Qwen2ForCausalLM, Qwen2Config), (Qwen3ForCausalLM, Qwen3Config)],
    ids=["mistral", "qwen2", "qwen3"],
)
def test_other_decoders(model_cls, config_cls, tokens):
    model = _tiny(model_cls, config_cls)
    expected = _logits(_manually_scaled_copy(model), tokens)
    assert not torch.allclose(_logits(model, tokens), expected, atol=1e-4)
    apply_layernorm_scaling(model)
    torch.testing.assert_close(_logits(model, tokens), expected, atol=1e-5, rtol=1e-5)

    # Only the block norms are touched: Qwen3's per-head q_norm/k_norm and the final norm keep no hook.
    hooked = {name for name, module in model.named_modules() if module._forward_hooks}
    assert hooked == {f"model.layers.{i}.{norm}" for i in range(TINY["num_hidden_layers"]) for norm in BLOCK_NORMS}
    attention_norms_before = {n: p.clone() for n, p in model.named_parameters() if "q_norm" in n or "k_norm" in n}
    assert (len(attention_norms_before) > 0) == (model_cls is Qwen3ForCausalLM)
    fold_layernorm_scaling(model)
    torch.testing.assert_close(_logits(model, tokens), expected, atol=1e-5, rtol=1e-5)
    for name, param in model.named_parameters():
        if name in attention_norms_before:
            assert torch.equal(param, attention_norms_before[name])


def test_errors():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32))
    with pytest.raises(ValueError, match="gpt2"):
        apply_layernorm_scaling(gpt2)

    lns_model = ours.LlamaForCausalLM(ours.build_config("configs/llama_tiny.json", norm_type="lns"))
    with pytest.raises(ValueError, match="norm_type='lns'"):
        apply_layernorm_scaling(lns_model)

    model = _tiny(LlamaForCausalLM, LlamaConfig)
    with pytest.raises(ValueError, match="not applied"):
        remove_layernorm_scaling(model)
    with pytest.raises(ValueError, match="not applied"):
        fold_layernorm_scaling(model)
    apply_layernorm_scaling(model)
    with pytest.raises(ValueError, match="already applied"):
        apply_layernorm_scaling(model)
