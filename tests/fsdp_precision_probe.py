"""Run under torchrun (2 gloo ranks) by tests/test_distributed_setup.py: which dtypes FSDP2 uses for --dtype X.

Prints {dtype: dtypes seen} for each --dtype value given, from rank 0: the dtypes of the all-gather and
reduce-scatter buffers, of a block's weight during forward (the compute dtype), and of the sharded weight the
optimizer updates and of its gradient.
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from peft_pretraining.model.modeling_llama import LlamaForCausalLM, build_config
from peft_pretraining.training.distributed import wrap_model

REPO = Path(__file__).resolve().parent.parent


def record_dtypes_of(collective: str, seen: dict):
    """FSDP2 calls torch.distributed.<collective>(output, input, ...) at run time: wrap it to record the dtype."""
    original = getattr(dist, collective)

    def recorded(output, input, *args, **kwargs):
        seen.setdefault(collective, set()).add(str(input.dtype))
        return original(output, input, *args, **kwargs)

    setattr(dist, collective, recorded)


def dtypes_seen(dtype: str) -> dict:
    torch.manual_seed(0)
    model = LlamaForCausalLM(build_config(REPO / "configs/llama_tiny.json", norm_type="pre"))
    if dtype == "bfloat16":  # as torchrun_main.py does before wrapping
        model = model.to(torch.bfloat16)
    seen = {}
    originals = {name: getattr(dist, name) for name in ("all_gather_single", "reduce_scatter_single")}
    for collective in originals:
        record_dtypes_of(collective, seen)
    wrap_model(model, argparse.Namespace(fsdp=True, dtype=dtype), dist.get_world_size(), torch.device("cpu"))
    probe = model.model.layers[0].mlp.up_proj
    probe.register_forward_pre_hook(lambda module, inputs: seen.update(compute={str(module.weight.dtype)}))
    tokens = torch.randint(0, model.config.vocab_size, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "mixed"):  # as torchrun_main.py does
        loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    seen.update(sharded={str(probe.weight.dtype)}, sharded_grad={str(probe.weight.grad.dtype)})
    for name, original in originals.items():
        setattr(dist, name, original)
    return {key: sorted(value) for key, value in seen.items()}


def main():
    dist.init_process_group("gloo")
    report = {dtype: dtypes_seen(dtype) for dtype in sys.argv[1:]}
    if dist.get_rank() == 0:
        print(json.dumps(report), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
