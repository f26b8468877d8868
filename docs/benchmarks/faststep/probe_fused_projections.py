"""Probe (not part of the package): would one GEMM for q/k/v, or one for gate/up, speed up the compiled mixed step?

The fused variants concatenate the projection weights on every forward, so the parameters and checkpoints stay as
they are; only the number and shape of the matrix products change. Study shape (llama_tiny_deep, 16 x 128), bf16
autocast over fp32 weights, torch.compile, 2 threads, interleaved repeats of 3 steps in one process.

    python docs/benchmarks/faststep/probe_fused_projections.py base,qkv,mlp,both 5
"""
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from peft_pretraining.model import modeling_llama
from peft_pretraining.training.optimization import build_optimizer

REPO = Path(__file__).resolve().parents[3]

separate_attention = modeling_llama.Attention.forward
separate_mlp = modeling_llama.MLP.forward


def fused_qkv_attention(self, x, rope, mask):
    batch, seq_len, _ = x.shape
    weight = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
    q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
    q, k, v = F.linear(x, weight).split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(batch, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
    k = k.view(batch, seq_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
    v = v.view(batch, seq_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
    cos, sin = rope
    q, k = modeling_llama.apply_rope(q, cos, sin), modeling_llama.apply_rope(k, cos, sin)
    out = modeling_llama.plain_attention(q, k, v, mask)  # the CPU bf16 path at 128 tokens, as in the model
    return self.o_proj(out.transpose(1, 2).reshape(batch, seq_len, -1))


def fused_gate_up_mlp(self, x):
    gate, up = F.linear(x, torch.cat([self.gate_proj.weight, self.up_proj.weight])).chunk(2, dim=-1)
    return self.down_proj(F.silu(gate) * up)


VARIANTS = {"base": (separate_attention, separate_mlp), "qkv": (fused_qkv_attention, separate_mlp),
            "mlp": (separate_attention, fused_gate_up_mlp), "both": (fused_qkv_attention, fused_gate_up_mlp)}


class Active:
    """The forwards the model calls now; each step sets them, so each compiled model keeps its own variant."""
    attention, mlp = separate_attention, separate_mlp


modeling_llama.Attention.forward = lambda self, *args: Active.attention(self, *args)
modeling_llama.MLP.forward = lambda self, *args: Active.mlp(self, *args)


def main():
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(VARIANTS)
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    torch.set_num_threads(2)
    config = modeling_llama.build_config(REPO / "configs/llama_tiny_deep.json", norm_type="pre")
    tokens = torch.randint(0, config.vocab_size, (16, 128), generator=torch.Generator().manual_seed(0))
    steps = {}
    for name in names:
        torch.manual_seed(0)
        model = modeling_llama.LlamaForCausalLM(config).train()
        optimizer = build_optimizer(model.parameters(), "adam", 1e-4, 0.0)
        compiled = torch.compile(model)

        def step(compiled=compiled, model=model, optimizer=optimizer, name=name):
            Active.attention, Active.mlp = VARIANTS[name]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = compiled(input_ids=tokens, labels=tokens).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.item()

        start = time.perf_counter()
        print(name, "first loss", step(), f"(compiled in {time.perf_counter() - start:.0f} s)", flush=True)
        step()
        steps[name] = step
    rates = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(3):
                step()
            rates[name].append(16 * 128 * 3 / (time.perf_counter() - start))
    for name, values in rates.items():
        print(f"{name}: tokens/s median {statistics.median(values):.1f} min {min(values):.1f} max {max(values):.1f}",
              [round(value) for value in values])


if __name__ == "__main__":
    main()
