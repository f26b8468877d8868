"""The upstream repository's import path, `from peft_pretraining.modeling_llama import LlamaForCausalLM`: the model
itself lives in peft_pretraining/model/modeling_llama.py (the file every checkpoint carries); this re-exports it."""
from peft_pretraining.model.modeling_llama import (  # noqa: F401
    LlamaForCausalLM,
    LlamaModel,
    NormPlacementConfig,
    build_config,
)
