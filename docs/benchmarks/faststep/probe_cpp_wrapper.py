"""Probe (not part of the package): does inductor's C++ wrapper (`cpp_wrapper=True`, kernels called from C++
instead of Python) speed up the compiled mixed step? Study shape (llama_tiny_deep, 16 x 128), bf16 autocast over
fp32 weights, 2 threads, interleaved repeats of 3 steps in one process.

    python docs/benchmarks/faststep/probe_cpp_wrapper.py base,cppwrap 5
"""
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch._inductor.config as inductor_config  # noqa: E402

from peft_pretraining import modeling_llama  # noqa: E402
from peft_pretraining.training_utils import build_optimizer  # noqa: E402


def main():
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["base", "cppwrap"]
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    torch.set_num_threads(2)
    config = modeling_llama.build_config(REPO / "configs/llama_tiny_deep.json", norm_type="pre")
    tokens = torch.randint(0, config.vocab_size, (16, 128), generator=torch.Generator().manual_seed(0))
    steps = {}
    for name in names:
        torch.manual_seed(0)
        model = modeling_llama.LlamaForCausalLM(config).train()
        optimizer = build_optimizer(model.parameters(), "adam", 1e-4, 0.0)
        patch = {"cpp_wrapper": name == "cppwrap"}
        compiled = torch.compile(model, dynamic=False)

        def step(compiled=compiled, model=model, optimizer=optimizer, patch=patch):
            with inductor_config.patch(patch):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = compiled(input_ids=tokens, labels=tokens).loss
                loss.backward()
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step()  # compiles
        step()
        steps[name] = step
    rates = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            for _ in range(3):
                step()
            rates[name].append(3 * tokens.numel() / (time.perf_counter() - start))
    for name, values in rates.items():
        print(name, round(statistics.median(values), 1), [round(v) for v in values])


if __name__ == "__main__":
    main()
