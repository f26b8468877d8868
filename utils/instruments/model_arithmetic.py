"""Counts by formula, shared by the benchmarks, the GPU check and the studies: parameters, model FLOPs per token
(the PaLM convention: 6 N + 12 L H T, N the matmul parameters with the LM head and without the embedding, attention
not halved for causality), the GPUs' dense bf16 peaks and the paper's micro-batches.
"""
from __future__ import annotations


def parameter_count(config) -> int:
    """Every parameter: the decoder layers with their two norms, the untied embedding and LM head, the final norm."""
    h, i, V = config.hidden_size, config.intermediate_size, config.vocab_size
    per_layer = 4 * h * h + 3 * h * i + 2 * h
    return config.num_hidden_layers * per_layer + 2 * V * h + h


# The paper's per-GPU micro-batch (run_<size>.sh --batch_size), sequence length 256.
PAPER_MICRO_BATCH = {"llama_130m.json": 64, "llama_250m.json": 128, "llama_350m.json": 128, "llama_1b.json": 32}
# Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's datasheets, TFLOP/s. The first matching name wins, so
# more specific names come first.
DENSE_BF16_PEAK_TFLOPS = [
    ("H100 PCIe", 756), ("H100 NVL", 835), ("GH200", 989), ("H200", 989), ("H100", 989),  # H100 SXM (HBM3)
    ("B200", 2250), ("A100", 312), ("L40S", 362), ("L4", 121), ("A10", 125),
]


def dense_bf16_peak_tflops(device_name: str) -> float | None:
    return next((peak for name, peak in DENSE_BF16_PEAK_TFLOPS if name in device_name), None)


def model_flops_per_token(config, seq_len: int) -> int:
    hidden, layers = config.hidden_size, config.num_hidden_layers
    matmul_params = layers * (4 * hidden * hidden + 3 * hidden * config.intermediate_size) + hidden * config.vocab_size
    return 6 * matmul_params + 12 * layers * hidden * seq_len
