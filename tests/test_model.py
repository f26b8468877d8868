import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers import LlamaForCausalLM as HFLlamaForCausalLM

from peft_pretraining.model.llama_export import EXPORTABLE_PLACEMENTS, export_to_hf_llama
from peft_pretraining.model.modeling_llama import (
    DEFAULT_LAYERSCALE_INIT,
    INIT_METHODS,
    NORM_TYPES,
    LlamaForCausalLM,
    build_config,
    freeze_layer_plan,
)

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "llama_tiny.json"
TINY_DEEP = REPO / "configs" / "llama_tiny_deep.json"


def tiny_model(norm_type="pre", post_num=2, init_method="normal", seed=0, **overrides):
    torch.manual_seed(seed)
    config = build_config(TINY, norm_type=norm_type, post_num=post_num, init_method=init_method, **overrides)
    return LlamaForCausalLM(config).eval()


def random_tokens(batch=2, length=24, vocab=8192, seed=1):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.e2e
@pytest.mark.parametrize("init_method", INIT_METHODS)
@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_every_variant_trains(norm_type, init_method):
    model = tiny_model(norm_type, init_method=init_method).train()
    if norm_type == "skipinit":  # a zero gate passes no gradient into its branch by design: open the gates first
        open_gates(model)
    if norm_type == "mhc":  # phi = 0 passes no gradient into the gating factors by design: move phi first
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("phi"):
                    p.normal_(0.0, 0.02)
    tokens = random_tokens()
    out = model(tokens, labels=tokens, output_hidden_states=True)
    assert torch.isfinite(out.loss)
    assert out.logits.shape == (*tokens.shape, model.config.vocab_size)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    out.loss.backward()
    dead = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    if norm_type == "attnres":  # the first sublayer's one source (the embedding) takes all the weight, whatever q
        dead.remove("model.layers.0.attn_residual.query")
    assert dead == [], f"parameters without gradient under {norm_type}: {dead}"


def open_gates(model, seed=0):
    """Random non-zero LayerScale/SkipInit gates, so that a gate folded or dropped by mistake shows."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("residual.gain"):
                p.copy_(torch.rand(p.shape, generator=generator) + 0.5)


def test_parameter_names_match_hf():
    ours = tiny_model("pre")
    theirs = HFLlamaForCausalLM(LlamaConfig.from_json_file(str(TINY)))
    assert set(ours.state_dict()) == set(theirs.state_dict())


def hf_copy(model, gain_scales=None):
    """A stock HF Llama with our weights; gain_scales[i] multiplies both norm gains of layer i."""
    hf = HFLlamaForCausalLM(LlamaConfig.from_json_file(str(TINY))).eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for i, scale in enumerate(gain_scales or []):
        state[f"model.layers.{i}.input_layernorm.weight"] *= scale
        state[f"model.layers.{i}.post_attention_layernorm.weight"] *= scale
    hf.load_state_dict(state)
    return hf


def test_pre_matches_hf_llama():
    model = tiny_model("pre")
    tokens = random_tokens()
    torch.testing.assert_close(model(tokens).logits, hf_copy(model)(tokens).logits, rtol=0, atol=1e-5)


def test_lns_matches_hf_llama_with_folded_gains():
    model = tiny_model("lns")
    tokens = random_tokens()
    scales = [1 / math.sqrt(depth) for depth in range(1, model.config.num_hidden_layers + 1)]
    torch.testing.assert_close(model(tokens).logits, hf_copy(model, scales)(tokens).logits, rtol=0, atol=1e-5)


def test_lns_differs_from_pre_on_same_weights():
    pre, lns = tiny_model("pre"), tiny_model("lns")
    lns.load_state_dict(pre.state_dict())
    tokens = random_tokens()
    assert not torch.allclose(pre(tokens).logits, lns(tokens).logits, atol=1e-4)


def test_norm_type_is_case_insensitive():
    model = tiny_model("LNS")
    assert [layer.placement for layer in model.model.layers] == ["lns"] * 4


def reference_forward(model, tokens, post_layers):
    """Hand-written Mix-LN forward: Post-LN in layers < post_layers, Pre-LN after them."""
    x = model.model.embed_tokens(tokens)
    rope = model.model.rotary_emb(tokens.shape[1], x.dtype)
    for i, layer in enumerate(model.model.layers):
        attn = lambda y: layer.self_attn(y, rope, None)  # noqa: E731
        if i < post_layers:
            x = layer.input_layernorm(x + attn(x))
            x = layer.post_attention_layernorm(x + layer.mlp(x))
        else:
            x = x + attn(layer.input_layernorm(x))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(model.model.norm(x))


@pytest.mark.parametrize("post_num", [0, 1, 3, 4])
def test_mix_ln_structure(post_num):
    # A large init std makes every sublayer matter, so a wrong placement in any layer shows in the logits.
    model = tiny_model("post_pre", post_num=post_num, initializer_range=0.2)
    tokens = random_tokens()
    torch.testing.assert_close(model(tokens).logits, reference_forward(model, tokens, post_num), rtol=0, atol=1e-5)
    other = reference_forward(model, tokens, post_num + 1 if post_num < 4 else post_num - 1)
    assert not torch.allclose(model(tokens).logits, other, atol=1e-4)


@pytest.mark.parametrize("num_layers", [4, 24])
def test_deepnorm_constants_follow_depth(num_layers):
    config = build_config(TINY, norm_type="deepnorm", num_hidden_layers=num_layers, hidden_size=128,
                          intermediate_size=352)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    alpha, beta = (2 * num_layers) ** 0.25, (8 * num_layers) ** -0.25
    layer = model.model.layers[0]
    assert layer.attn_residual.alpha == pytest.approx(alpha)
    assert layer.mlp_residual.alpha == pytest.approx(alpha)
    std = config.initializer_range
    for linear in (layer.self_attn.v_proj, layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj,
                   layer.mlp.down_proj):
        assert linear.weight.std().item() == pytest.approx(std * beta, rel=0.1)
    for linear in (layer.self_attn.q_proj, layer.self_attn.k_proj):
        assert linear.weight.std().item() == pytest.approx(std, rel=0.1)


def test_scaled_init_shrinks_residual_outputs():
    model = tiny_model("pre", init_method="scaled")
    layer, std = model.model.layers[0], model.config.initializer_range
    expected = std / math.sqrt(2 * model.config.num_hidden_layers)
    assert layer.self_attn.o_proj.weight.std().item() == pytest.approx(expected, rel=0.1)
    assert layer.mlp.down_proj.weight.std().item() == pytest.approx(expected, rel=0.1)
    assert layer.self_attn.q_proj.weight.std().item() == pytest.approx(std, rel=0.1)


def test_layerscale_starts_at_documented_value():
    model = tiny_model("layerscale", layerscale_init=0.25)
    gains = torch.cat([p for n, p in model.named_parameters() if n.endswith("residual.gain")])
    assert gains.numel() == 2 * 4 * model.config.hidden_size and torch.all(gains == 0.25)


def residual_variance_growth(norm_type):
    """Variance of the residual stream after the last block over that after the first, at std-0.02 init."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(build_config(TINY_DEEP, norm_type=norm_type)).eval()
    stream = []
    hooks = [layer.register_forward_hook(lambda m, i, o: stream.append(o.float().var().item()))
             for layer in model.model.layers]
    with torch.no_grad():
        model(random_tokens(batch=4, length=64))
    for hook in hooks:
        hook.remove()
    return stream[-1] / stream[0]


def test_variance_grows_faster_under_pre_than_lns():
    pre_growth, lns_growth = residual_variance_growth("pre"), residual_variance_growth("lns")
    assert pre_growth > 1 and lns_growth > 1
    assert pre_growth > 2 * lns_growth, (pre_growth, lns_growth)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(norm_type="prenorm"), "norm_type"),
        (dict(norm_type="post_pre", post_num=5), "post_num"),
        (dict(norm_type="post_pre", post_num=-1), "post_num"),
        (dict(init_method="xavier"), "init_method"),
    ],
)
def test_bad_values_raise(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment) as error:
        build_config(TINY, **kwargs)
    bad_value = str(next(iter(v for k, v in kwargs.items() if k in ("post_num", "init_method") or v == "prenorm")))
    assert bad_value in str(error.value)


@pytest.mark.parametrize("key, value", [("tie_word_embeddings", True), ("hidden_act", "gelu"),
                                        ("attention_bias", True), ("mlp_bias", True), ("attention_dropout", 0.1),
                                        ("rope_parameters", {"rope_type": "linear", "factor": 2.0,
                                                             "rope_theta": 10000.0})])
def test_llama_features_the_model_does_not_implement_are_refused(key, value):
    """Silently ignored, each would train a different model than its config says (e.g. an untied head)."""
    with pytest.raises(ValueError, match="is not implemented by this model"):
        build_config(TINY, **{key: value})


@pytest.mark.parametrize("name", ["position_ids", "inputs_embeds"])
def test_inputs_that_would_change_the_result_are_refused(name):
    model, tokens = tiny_model(), random_tokens()
    with pytest.raises(ValueError, match=f"{name} is not supported"):
        model(tokens, **{name: torch.zeros(2, 24, dtype=torch.long)})


def test_unknown_norm_type_lists_choices():
    with pytest.raises(ValueError) as error:
        build_config(TINY, norm_type="sandwich_xl")
    assert all(name in str(error.value) for name in NORM_TYPES)


# Pre-LN and LNS in the fast tier, every placement in the end-to-end tier.
@pytest.mark.parametrize("norm_type", [pytest.param(norm, marks=() if norm in ("pre", "lns") else pytest.mark.e2e)
                                       for norm in NORM_TYPES])
def test_save_and_load_round_trip(norm_type, tmp_path):
    model = tiny_model(norm_type)
    model.save_pretrained(tmp_path)
    tokens = random_tokens()
    expected = model(tokens).logits
    ours = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(ours(tokens).logits, expected, rtol=0, atol=0)
    auto = AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True).eval()
    torch.testing.assert_close(auto(tokens).logits, expected, rtol=0, atol=0)
    # Our import registered our model type, so the plain call builds our class; stock Llama would take the same
    # parameter names and compute Pre-LN. A process without our import refuses it (test_layer_remove).
    plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(plain) is LlamaForCausalLM
    torch.testing.assert_close(plain(tokens).logits, expected, rtol=0, atol=0)


@pytest.mark.e2e
def test_a_checkpoint_loads_where_this_repository_is_not_importable(tmp_path):
    """With trust_remote_code=True the checkpoint's copy of the model file is all a loader needs (lm-eval elsewhere):
    transformers refuses a copy that imports a package it cannot find."""
    model = tiny_model("lns")
    model.save_pretrained(tmp_path / "checkpoint")
    tokens = random_tokens()
    torch.save({"tokens": tokens, "logits": model(tokens).logits}, tmp_path / "expected.pt")
    script = ("import sys, torch\n"
              "sys.modules['peft_pretraining'] = None  # not importable, even where it is installed\n"
              "from transformers import AutoModelForCausalLM\n"
              "model = AutoModelForCausalLM.from_pretrained('checkpoint', trust_remote_code=True).eval()\n"
              "expected = torch.load('expected.pt')\n"
              "print(torch.equal(model(expected['tokens']).logits, expected['logits']))\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.stdout.strip() == "True", result.stderr[-2000:]


def test_a_model_built_from_a_stock_config_saves_its_own_model_type(tmp_path):
    """However the config was made, a saved checkpoint of ours names its own type, never plain "llama"."""
    model = LlamaForCausalLM(LlamaConfig.from_json_file(str(TINY)))
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "llama_norm_placement" and saved["auto_map"]["AutoConfig"].endswith("Config")


def test_rope_tables_are_rebuilt_where_no_checkpoint_holds_them(tmp_path):
    """The RoPE tables are non-persistent buffers: not saved, refilled after from_pretrained and after a build on
    the meta device (the trainer's sharded resume), and they cover max_position_embeddings and no more."""
    model = tiny_model()
    fresh = model.model.rotary_emb.compute_tables()
    assert not [name for name in model.state_dict() if "rotary" in name]
    model.save_pretrained(tmp_path)
    loaded = LlamaForCausalLM.from_pretrained(tmp_path).model.rotary_emb
    assert torch.equal(loaded.cos, fresh[0]) and torch.equal(loaded.sin, fresh[1])
    with torch.device("meta"):
        on_meta = LlamaForCausalLM(model.config)
    on_meta.to_empty(device="cpu")
    rope = on_meta.model.rotary_emb
    rope.cos.fill_(float("nan")), rope.sin.fill_(float("nan"))
    rope.reset_tables()
    assert torch.equal(rope.cos, fresh[0]) and torch.equal(rope.sin, fresh[1])
    limit = model.config.max_position_embeddings
    assert rope.cos.shape[0] == limit
    with pytest.raises(ValueError, match=f"max_position_embeddings {limit}"):
        model(random_tokens(batch=1, length=limit + 1))


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_export_to_stock_hf(norm_type, tmp_path):
    model = tiny_model(norm_type, initializer_range=0.1)
    open_gates(model)
    if norm_type not in EXPORTABLE_PLACEMENTS:
        with pytest.raises(ValueError, match="trust_remote_code"):
            export_to_hf_llama(model)
        return
    export_to_hf_llama(model).save_pretrained(tmp_path)
    assert "auto_map" not in (tmp_path / "config.json").read_text()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is HFLlamaForCausalLM
    tokens = random_tokens()
    torch.testing.assert_close(loaded(tokens).logits, model(tokens).logits, rtol=0, atol=1e-5)


def test_a_config_with_the_old_name_of_depth_scaling_num_layers_keeps_its_l(tmp_path):
    """`deepnorm_num_layers` was the name of CompleteP's and DeepNorm's L: configs and checkpoints with it load."""
    values = {**json.loads(TINY.read_text()), "deepnorm_num_layers": 8}
    (tmp_path / "config.json").write_text(json.dumps(values))
    config = build_config(tmp_path / "config.json", norm_type="completep")
    assert config.depth_scaling_num_layers == 8 and "deepnorm_num_layers" not in config.to_dict()
    assert LlamaForCausalLM(config).model.layers[0].attn_residual.multiplier == 8**-1.0


def test_frozen_plan_keeps_layer_factors_after_removal():
    model = tiny_model("lns")
    config = freeze_layer_plan(LlamaConfig.from_dict(model.config.to_dict()))
    del config.layer_norm_types[1], config.layer_depths[1]
    config.num_hidden_layers = 3
    pruned = LlamaForCausalLM(config)
    assert [layer.attn_residual.scale for layer in pruned.model.layers] == pytest.approx([1.0, 3**-0.5, 4**-0.5])


@pytest.mark.e2e
def test_export_cli(tmp_path):
    model = tiny_model("lns")
    model.save_pretrained(tmp_path / "ckpt")
    cmd = [sys.executable, str(REPO / "utils" / "export_hf.py"), "--checkpoint", str(tmp_path / "ckpt"),
           "--out", str(tmp_path / "hf")]
    subprocess.run(cmd, check=True, cwd=tmp_path, capture_output=True)
    tokens = random_tokens()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    torch.testing.assert_close(loaded(tokens).logits, model(tokens).logits, rtol=0, atol=1e-5)
    again = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
    assert again.returncode != 0 and "--out" in again.stderr.strip().splitlines()[-1]
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "no_weights").mkdir()
    (tmp_path / "no_weights" / "config.json").write_text((tmp_path / "ckpt" / "config.json").read_text())
    for flag, value, out in (("--out", "a_file", "a_file"), ("--checkpoint", "no_weights", "hf2")):
        bad = [sys.executable, str(REPO / "utils" / "export_hf.py"), "--checkpoint",
               str(tmp_path / ("ckpt" if flag == "--out" else value)), "--out", str(tmp_path / out)]
        result = subprocess.run(bad, cwd=tmp_path, capture_output=True, text=True)
        assert result.returncode == 2 and flag in result.stderr.strip().splitlines()[-1], result.stderr[-500:]


# A running sum, and streams of their own: AttnRes's tuple, mHC's copies, SiameseNorm's two streams.
@pytest.mark.e2e
@pytest.mark.parametrize("norm_type", ["lns", "attnres", "mhc", "siamese"])
def test_activation_checkpointing_gives_the_same_gradients(norm_type):
    tokens = random_tokens()
    grads = []
    for checkpointing in (False, True):
        model = tiny_model(norm_type).train()
        if checkpointing:
            model.activation_checkpointing_enable()
            assert model.model.gradient_checkpointing
        model(tokens, labels=tokens).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-6)


def test_cod_is_an_alias_of_lns(tmp_path):
    assert build_config(TINY, norm_type="COD").norm_type == "lns"
    lns = tiny_model("lns")
    lns.config.norm_type = "cod"  # a checkpoint config written by the paper's uploaded code's naming
    lns.save_pretrained(tmp_path)
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert [layer.placement for layer in reloaded.model.layers] == ["lns"] * 4
    tokens = random_tokens()
    torch.testing.assert_close(reloaded(tokens).logits, lns(tokens).logits, rtol=0, atol=0)


@pytest.mark.parametrize("form", ["channel", "scalar"])
def test_layerscale_forms_and_defaults(form):
    model = tiny_model("layerscale", layerscale_form=form)
    gains = [p for n, p in model.named_parameters() if n.endswith("residual.gain")]
    size = model.config.hidden_size if form == "channel" else 1
    assert len(gains) == 2 * 4 and all(g.shape == (size,) for g in gains)
    assert all(torch.all(g == DEFAULT_LAYERSCALE_INIT[form]) for g in gains)


def test_skipinit_starts_every_block_as_the_identity():
    model = tiny_model("skipinit", initializer_range=0.2)
    hidden = model(random_tokens(), output_hidden_states=True).hidden_states
    for before, after in zip(hidden[:-2], hidden[1:-1]):
        torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_depth_scaled_init_follows_each_layers_depth():
    model = LlamaForCausalLM(build_config(TINY_DEEP, init_method="depth_scaled"))
    std = model.config.initializer_range
    for depth, layer in enumerate(model.model.layers, start=1):
        for linear in (layer.self_attn.o_proj, layer.mlp.down_proj):
            assert linear.weight.std().item() == pytest.approx(std / math.sqrt(2 * depth), rel=0.1)
        for linear in (layer.self_attn.q_proj, layer.mlp.up_proj, layer.mlp.gate_proj):
            assert linear.weight.std().item() == pytest.approx(std, rel=0.1)


def test_deepnorm_reference_init_is_xavier_with_the_references_gains():
    config = build_config(TINY, norm_type="deepnorm", deepnorm_init="reference", num_hidden_layers=6)
    torch.manual_seed(0)
    layer = LlamaForCausalLM(config).model.layers[0]
    gain = (8 * 6) ** 0.25
    for linear, expected_gain in ((layer.self_attn.q_proj, 1.0), (layer.self_attn.k_proj, 1.0),
                                  (layer.self_attn.v_proj, gain), (layer.self_attn.o_proj, gain),
                                  (layer.mlp.gate_proj, gain), (layer.mlp.up_proj, gain), (layer.mlp.down_proj, gain)):
        fan_out, fan_in = linear.weight.shape
        xavier_std = expected_gain * math.sqrt(2 / (fan_in + fan_out))
        assert linear.weight.std().item() == pytest.approx(xavier_std, rel=0.1)


@pytest.mark.parametrize("embed_init_std", [None, math.sqrt(2 / 5)])
def test_embedding_init_std(embed_init_std):
    model = tiny_model("pre", embed_init_std=embed_init_std)
    expected = model.config.initializer_range if embed_init_std is None else embed_init_std
    assert model.model.embed_tokens.weight.std().item() == pytest.approx(expected, rel=0.05)
    assert model.lm_head.weight.std().item() == pytest.approx(model.config.initializer_range, rel=0.05)


def test_the_pad_row_starts_at_zero_and_stays_frozen_like_hf():
    model = tiny_model("pre")
    hf = HFLlamaForCausalLM(LlamaConfig.from_json_file(str(TINY)))
    pad_id = model.config.pad_token_id
    assert model.model.embed_tokens.padding_idx == hf.model.embed_tokens.padding_idx == pad_id
    assert not model.model.embed_tokens.weight[pad_id].any() and not hf.model.embed_tokens.weight[pad_id].any()


def test_a_pad_that_is_also_eos_still_trains_the_eos_embedding():
    """A tokenizer without a pad token pads with EOS. EOS ends every document, so it must not be the frozen row."""
    model = tiny_model("pre", pad_token_id=1, eos_token_id=1)
    assert model.model.embed_tokens.padding_idx is None
    tokens = torch.tensor([[5, 6, 1, 7, 8, 1]])  # packed: EOS is an input between documents
    model(tokens, labels=tokens).loss.backward()
    assert model.model.embed_tokens.weight.grad[1].abs().sum() > 0


def test_dyt_replaces_every_norm_with_the_documented_alpha0():
    model = tiny_model("dyt", dyt_alpha_init=[0.7, 0.3])
    layer = model.model.layers[0]
    assert layer.input_layernorm.alpha.item() == pytest.approx(0.7)
    assert layer.post_attention_layernorm.alpha.item() == pytest.approx(0.3)
    assert model.model.norm.alpha.item() == pytest.approx(0.3)
    assert not any(isinstance(m, type(tiny_model("pre").model.norm)) for m in model.modules())


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(norm_type="layerscale", layerscale_form="vector"), "layerscale_form"),
    (dict(norm_type="completep", completep_alpha=float("nan")), "completep_alpha"),
    (dict(norm_type="deepnorm", deepnorm_init="xavier"), "deepnorm_init"),
    (dict(embed_init_std=-1.0), "embed_init_std"),
])
def test_bad_option_values_raise(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        build_config(TINY, **kwargs)


def test_the_model_tells_transformers_that_its_attention_is_sdpa(tmp_path):
    """`_supports_sdpa`: our attention always calls F.scaled_dot_product_attention. Without the flag transformers
    records attn_implementation "eager" for it, and a request for "sdpa" (attn_implementation="sdpa", or a config
    that already carries it from an earlier model) is a ValueError at construction."""
    model = tiny_model("lns")
    assert model.config._attn_implementation == "sdpa"
    assert LlamaForCausalLM(model.config).config._attn_implementation == "sdpa"  # a config that carries "sdpa"
    model.save_pretrained(tmp_path)
    loaded = LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa")
    assert loaded.config._attn_implementation == "sdpa"


@pytest.mark.e2e
def test_export_copies_the_tokenizer_without_a_question_or_a_model_type_warning(tmp_path):
    from transformers import AutoTokenizer

    from peft_pretraining.data.dataloader import TOKENIZER_DIR

    tiny_model("lns").save_pretrained(tmp_path / "ckpt")
    AutoTokenizer.from_pretrained(str(TOKENIZER_DIR)).save_pretrained(tmp_path / "ckpt")
    result = subprocess.run([sys.executable, str(REPO / "utils" / "export_hf.py"), "--checkpoint",
                             str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")],
                            cwd=tmp_path, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "to instantiate a model of type" not in result.stderr and "custom code" not in result.stderr
    assert (tmp_path / "hf" / "tokenizer.json").is_file()


def test_upstream_import_path_builds_our_model():
    """`from peft_pretraining.modeling_llama import LlamaForCausalLM`, the upstream repository's path, in a fresh
    interpreter (a cached module would hide a broken path): it is our model, and it builds an LNS model."""
    code = ("from peft_pretraining.modeling_llama import LlamaForCausalLM, build_config\n"
            "import peft_pretraining.model.modeling_llama as ours\n"
            "assert LlamaForCausalLM is ours.LlamaForCausalLM\n"
            f"model = LlamaForCausalLM(build_config({str(TINY)!r}, norm_type='lns'))\n"
            "print(model.config.norm_type)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "lns"
