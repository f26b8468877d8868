"""utils/memory_estimate.py: the activation formula against the bytes autograd really saves (CPU, tiny config)."""
import pytest

from peft_pretraining.modeling_llama import build_config
from utils.memory_estimate import DTYPES, measure_saved_bytes, saved_activation_bytes


@pytest.mark.parametrize("activation_checkpointing", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_activation_formula_matches_the_saved_tensors_of_a_forward(dtype, activation_checkpointing):
    config = build_config("configs/llama_tiny.json", norm_type="pre")
    measured = measure_saved_bytes(config, dtype, 3, 24, activation_checkpointing)
    assert measured == saved_activation_bytes(config, dtype, 3, 24, activation_checkpointing)
