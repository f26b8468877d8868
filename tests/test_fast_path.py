"""The fast training step computes what the plain path computes.

Fast path: the trainer drops the attention mask of a right-padded batch (SDPA's is_causal), and on CPU under bf16
the model computes attention as plain matmuls instead of SDPA. Reference: stock HF Llama with eager attention, given
the padding mask, with identical weights. On CPU the trainer also keeps freed host memory for reuse, so a step does
not page-fault its large buffers anew; that changes no number, and its test counts page faults.
"""
import contextlib
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlamaForCausalLM

from peft_pretraining.data.dataloader import IGNORE_INDEX
from peft_pretraining.model import modeling_llama
from peft_pretraining.model.modeling_llama import LlamaForCausalLM, build_config
from torchrun_main import causal_mask_suffices

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "llama_tiny.json"


def batch(padded: bool) -> dict:
    tokens = torch.randint(3, 8192, (3, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(tokens)
    if padded:  # right padding as the data loader makes it: pad id 0, no label on pads
        for row, length in enumerate((20, 13, 6)):
            mask[row, length:] = 0
        tokens = tokens.masked_fill(mask == 0, 0)
    return {"input_ids": tokens, "attention_mask": mask, "labels": tokens.masked_fill(mask == 0, IGNORE_INDEX)}


def loss_and_grads(model, inputs, dtype):
    model.zero_grad(set_to_none=True)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "mixed" else contextlib.nullcontext()
    with autocast:
        loss = model(**inputs).loss
    loss.backward()
    return loss.detach().float(), {name: p.grad for name, p in model.named_parameters()}


def relative_error(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def models(init=0.1):
    """Ours and stock HF Llama with eager attention (HF's explicit softmax(QK^T)V, not SDPA), same weights.

    A larger init than 0.02 makes attention far from uniform, so a mask or kernel mistake shows in the numbers.
    """
    torch.manual_seed(0)
    ours = LlamaForCausalLM(build_config(TINY, initializer_range=init)).train()
    reference_config = LlamaConfig.from_json_file(str(TINY))
    reference_config._attn_implementation = "eager"
    reference = HFLlamaForCausalLM(reference_config).train()
    reference.load_state_dict(ours.state_dict())
    return ours, reference


def errors(loss, grads, ref_loss, ref_grads) -> dict:
    """Relative errors of the loss, of all gradients together, and of the worst single parameter's gradient."""
    flat = torch.cat([grads[name].flatten() for name in ref_grads])
    ref_flat = torch.cat([ref_grads[name].flatten() for name in ref_grads])
    return {"loss": relative_error(loss, ref_loss), "all_grads": relative_error(flat, ref_flat),
            "worst_grad": max(relative_error(grads[name], ref_grads[name]) for name in ref_grads)}


def without_mask(inputs: dict) -> dict:
    assert causal_mask_suffices(inputs)
    return {k: v for k, v in inputs.items() if k != "attention_mask"}  # what the trainer does with such a batch


@pytest.mark.e2e
@pytest.mark.parametrize("padded", [True, False], ids=["right_padded", "unpadded"])
def test_fast_path_matches_reference_in_fp32(padded):
    ours, reference = models()
    inputs = batch(padded)
    fast = errors(*loss_and_grads(ours, without_mask(inputs), "float32"), *loss_and_grads(reference, inputs, "float32"))
    assert max(fast.values()) < 1e-5, fast


@pytest.mark.e2e
@pytest.mark.parametrize("padded", [True, False], ids=["right_padded", "unpadded"])
def test_fast_path_matches_reference_under_bf16_autocast(padded):
    """Against the fp32 result, the fast path under autocast errs no more than HF's own autocast step does."""
    ours, reference = models()
    inputs = batch(padded)
    truth = loss_and_grads(reference, inputs, "float32")
    fast = errors(*loss_and_grads(ours, without_mask(inputs), "mixed"), *truth)
    hf_autocast = errors(*loss_and_grads(reference, inputs, "mixed"), *truth)
    for key in fast:
        assert fast[key] <= 1.5 * hf_autocast[key] + 2e-3, (key, fast, hf_autocast)
    assert fast["worst_grad"] < 5e-2, fast


@pytest.mark.e2e
def test_the_comparison_sees_a_missing_mask():
    """Dropping the mask of a left-padded batch would change the loss: real tokens would then see pads."""
    ours, _ = models()
    with torch.no_grad():  # a pad row that carries values (ours starts at zero, which makes pads nearly invisible)
        ours.model.embed_tokens.weight[ours.config.pad_token_id].normal_(0.0, 0.1)
    inputs = batch(padded=True)
    left = {k: v.flip(1) for k, v in inputs.items()}
    assert not causal_mask_suffices(left)
    with_mask, _ = loss_and_grads(ours, left, "float32")
    without_mask, _ = loss_and_grads(ours, {k: v for k, v in left.items() if k != "attention_mask"}, "float32")
    assert relative_error(without_mask, with_mask) > 1e-3


def test_causal_mask_suffices_only_for_right_padding_without_pad_labels():
    inputs = batch(padded=True)
    assert causal_mask_suffices(inputs)
    assert causal_mask_suffices(batch(padded=False))
    assert not causal_mask_suffices({k: v.flip(1) for k, v in inputs.items()})  # left padding
    holes = dict(inputs, attention_mask=inputs["attention_mask"].clone())
    holes["attention_mask"][0, 5] = 0  # a pad between real tokens
    assert not causal_mask_suffices(holes)
    assert not causal_mask_suffices(dict(inputs, labels=inputs["input_ids"]))  # pads carry labels


@pytest.mark.parametrize("with_mask", [True, False])
def test_padded_positions_stay_finite(with_mask):
    model = LlamaForCausalLM(build_config(TINY)).eval()
    inputs = batch(padded=True)
    if not with_mask:
        del inputs["attention_mask"]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(**inputs)
    assert torch.isfinite(out.logits).all() and torch.isfinite(out.loss)


@pytest.mark.e2e
@pytest.mark.parametrize("norm_type", modeling_llama.NORM_TYPES)
def test_compiled_model_has_no_graph_break(norm_type):
    """Every placement, in fp32 (SDPA: the kernel CUDA runs) and under bf16 autocast (CPU's plain attention), with and
    without the padding mask: run_*.sh compile by default on CUDA."""
    config = build_config(TINY, norm_type=norm_type, post_num=1 if norm_type == "post_pre" else 0)
    config.num_hidden_layers = 2
    model = LlamaForCausalLM(config).train()
    inputs = batch(padded=True)
    for autocast in (contextlib.nullcontext(), torch.autocast("cpu", dtype=torch.bfloat16)):
        for kwargs in (inputs, {k: v for k, v in inputs.items() if k != "attention_mask"}):
            torch._dynamo.reset()
            with autocast:
                explanation = torch._dynamo.explain(model)(**kwargs)
            assert explanation.graph_break_count == 0, explanation.break_reasons


@pytest.mark.parametrize("width, pad", [(5461, 43), (2048, 0), (2736, 0), (173, 19), (64, 0)])
def test_mlp_pads_only_widths_that_miss_the_gemm_alignment(width, pad):
    assert modeling_llama.mlp_pad_units(width) == pad
    assert (width + pad) % (modeling_llama.MLP_PAD_MULTIPLE if pad else 8) == 0


def test_padded_mlp_computes_the_unpadded_function(monkeypatch):
    """The 1B width (5461) is padded with zero units on CUDA; forced on here, outputs and every weight's gradient
    equal the unpadded MLP's to fp32 rounding, and the weights keep the config's shape."""
    config = build_config(TINY)
    config.hidden_size, config.intermediate_size = 48, 173
    mlp = modeling_llama.MLP(config)
    for linear in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        torch.nn.init.normal_(linear.weight, std=0.2)
    x = torch.randn(4, 9, 48, generator=torch.Generator().manual_seed(1), requires_grad=True)

    def output_and_grads():
        mlp.zero_grad()
        x.grad = None
        out = mlp(x)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return [out.detach(), x.grad] + [p.grad for p in mlp.parameters()]

    plain = output_and_grads()
    padded_calls = []
    monkeypatch.setattr(modeling_llama, "MLP_PAD_DEVICES", ("cpu",))
    monkeypatch.setattr(mlp, "_padded_forward", lambda h: padded_calls.append(1) or
                        modeling_llama.MLP._padded_forward(mlp, h))
    padded = output_and_grads()
    assert padded_calls, "the padded path did not run"
    assert [p.shape for p in mlp.parameters()] == [(173, 48), (173, 48), (48, 173)]
    for want, got in zip(plain, padded):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_padded_mlp_steps_aside_for_hooks(monkeypatch):
    """A hook (or LoRA's wrapper) on a projection must see its call: the padded path reads weights directly."""
    config = build_config(TINY)
    config.hidden_size, config.intermediate_size = 48, 173
    mlp = modeling_llama.MLP(config)
    monkeypatch.setattr(modeling_llama, "MLP_PAD_DEVICES", ("cpu",))
    seen = []
    mlp.up_proj.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    mlp(torch.randn(2, 3, 48))
    assert seen == [(2, 3, 173)]


@pytest.mark.e2e
def test_compiled_step_reads_the_rope_tables_instead_of_computing_them():
    """Tables computed inside forward are inlined by inductor into every q and k kernel, forward and backward, so
    cos and sin ran per element in every layer (about 10% of the compiled CPU step). The step must load them."""
    from torch._inductor.utils import run_and_get_code

    model = LlamaForCausalLM(build_config(TINY, num_hidden_layers=1)).train()
    compiled = torch.compile(model)
    tokens = batch(padded=False)["input_ids"]

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = compiled(input_ids=tokens, labels=tokens).loss
        loss.backward()

    _, generated = run_and_get_code(step)
    assert len(generated) == 2  # forward and backward
    computed = sorted({call for code in generated for call in re.findall(r"\b(?:cos|sin)\b", code)})
    assert not computed, f"the compiled step computes {computed}"


@pytest.mark.e2e
@pytest.mark.parametrize("dtype, expected_kernel", [("mixed", "plain"), ("float32", "flash")])
def test_cpu_attention_kernel_follows_dtype(dtype, expected_kernel):
    model = LlamaForCausalLM(build_config(TINY)).train()
    inputs = {k: v for k, v in batch(padded=False).items() if k != "attention_mask"}
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "mixed" else contextlib.nullcontext()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile, autocast:
        model(**inputs).loss.backward()
    ops = {event.key for event in profile.key_averages()}
    used_sdpa = any("scaled_dot_product" in op for op in ops)
    used_flash = any("flash_attention" in op for op in ops)
    assert used_flash == (expected_kernel == "flash"), sorted(op for op in ops if "attention" in op)
    assert used_sdpa == (expected_kernel != "plain"), sorted(op for op in ops if "attention" in op)


@pytest.mark.parametrize("num_kv_heads", [4, 2])
@pytest.mark.parametrize("masked", [False, True])
def test_plain_attention_is_sdpa(num_kv_heads, masked):
    """The CPU bf16 path computes SDPA's function: in fp64, with and without a padding mask, with grouped KV heads."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 9, 8, dtype=torch.float64, generator=generator)
    k, v = (torch.randn(2, num_kv_heads, 9, 8, dtype=torch.float64, generator=generator) for _ in range(2))
    mask = None
    if masked:
        keep = torch.ones(2, 9, dtype=torch.bool)
        keep[1, :3] = False  # left padding, so rows of the second sequence differ from the causal-only result
        mask = modeling_llama._attention_mask(keep, 9, "cpu")
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=num_kv_heads != 4)
    torch.testing.assert_close(modeling_llama.plain_attention(q, k, v, mask), expected, rtol=1e-12, atol=1e-12)


REUSE_PROBE = """
import resource, sys, torch
from peft_pretraining.training.host_memory import keep_freed_host_memory
from peft_pretraining.model.modeling_llama import LlamaForCausalLM, build_config
kept = keep_freed_host_memory() if sys.argv[1] == "keep" else None
torch.manual_seed(0)
model = LlamaForCausalLM(build_config("configs/llama_tiny.json"))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
tokens = torch.randint(0, 8192, (8, 128))  # fp32 logits of 32 MiB: glibc mmaps them whatever its threshold
faults = []
for step in range(int(sys.argv[2])):
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start)
print(kept, sum(faults[-8:]))  # the steady state: the last 8 steps
"""


def reuse_probe(mode: str, steps: int = 16, **env) -> tuple[str, int]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    result = subprocess.run([sys.executable, "-c", REUSE_PROBE, mode, str(steps)], capture_output=True, text=True,
                            cwd=REPO, env={**environment, **env, "OMP_NUM_THREADS": "1"}, check=True)
    kept, faults = result.stdout.split()
    return kept, int(faults)


@pytest.mark.e2e
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator only")
def test_freed_host_memory_is_reused_without_new_page_faults():
    _, faults_by_default = reuse_probe("system")
    logits_pages = 8 * 128 * 8192 * 4 // 4096
    if faults_by_default < 8 * logits_pages:
        pytest.skip(f"this host page-faults little by default ({faults_by_default} in 8 steps): nothing to compare")
    kept, faults_kept = reuse_probe("keep")
    assert kept == "True"
    # Steady-state steps: by default each page-faults its logits (and more) anew; with freed memory kept, the heap
    # settles after a few steps and later steps reuse it.
    assert faults_kept < faults_by_default / 8, (faults_kept, faults_by_default)
    # The environment's malloc settings win: the function then leaves the allocator as it is.
    kept, _ = reuse_probe("keep", steps=0, MALLOC_TRIM_THRESHOLD_="131072")
    assert kept == "False"
