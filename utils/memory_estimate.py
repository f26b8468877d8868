"""GPU memory of one training process: weights, gradients, Adam state and activations, by formula.

    python utils/memory_estimate.py                          # 1B at micro-batch 32 x 256 on one 80 GB GPU
    python utils/memory_estimate.py --config configs/llama_130m.json --batch_size 64
    python utils/memory_estimate.py --check configs/llama_130m.json --batch_size 2   # formula vs a CPU measurement

Activations are what autograd saves for backward in this repository's model (Pre-LN), counted per token and layer:

  per layer  pure dtype (p = 4 fp32, 2 bf16):  2 norms x (fp32 input 4h + rstd 4 + normed p*h + gain output p*h)
             + attention q, k, v, output 4p*h + logsumexp 4a + MLP gate, silu, up, product 4p*i
             mixed (fp32 residual, bf16 autocast): 2 norms x (4h + 4 + 4h) + bf16 input copies of the 5 input
             projections 5 x 2h + attention 4 x 2h + 4a + MLP 4 x 2i; plus the bf16 weight copies, 2 bytes a parameter
  head       final norm as above + lm_head input + fp32 log-softmax of the logits 4V + targets
  loss peak  the logits and their fp32 gradient exist together for a moment: 2 x 4V per token on top
  with activation checkpointing every layer keeps only its input (residual dtype: 2 bytes bf16, else 4) and one
  layer is recomputed at a time.

Model state: pure bf16 keeps weights, gradients and both Adam moments in bf16 (8 bytes a parameter); mixed and fp32
keep them in fp32 (16 bytes a parameter). Not counted: the RoPE tables (cos and sin for max_position_embeddings
positions, a buffer of the model, 0.5 MB at 1B; the layers save views of it, no copies), the CUDA context (~0.5 GB,
outside PyTorch's allocator), cuBLAS workspaces and allocator fragmentation (typically a few hundred MB to a few GB)
- hence the headroom column.

--check measures the saved-for-backward bytes of a real forward on CPU (saved_tensors_hooks, each storage once) and
prints them beside the formula. CUDA attention kernels save the same tensors (q, k, v, output, logsumexp).
"""
import argparse
import json
from pathlib import Path
from unittest import mock

import torch

from peft_pretraining.cli import OneLineErrorParser
from peft_pretraining.model import modeling_llama
from peft_pretraining.model.modeling_llama import LlamaForCausalLM, build_config
from utils.instruments.model_arithmetic import parameter_count

REPO = Path(__file__).resolve().parent.parent
GB = 1e9
DTYPES = ("bfloat16", "mixed", "float32")


def layer_bytes_per_token(config, dtype: str) -> int:
    h, i, a = config.hidden_size, config.intermediate_size, config.num_attention_heads
    if dtype == "mixed":
        return 2 * (4 * h + 4 + 4 * h) + 5 * 2 * h + 4 * 2 * h + 4 * a + 4 * 2 * i
    p = 2 if dtype == "bfloat16" else 4
    return 2 * (4 * h + 4 + 2 * p * h) + 4 * p * h + 4 * a + 4 * p * i


def head_bytes_per_token(config, dtype: str) -> int:
    h, V = config.hidden_size, config.vocab_size
    if dtype == "mixed":
        final_norm, lm_head_input = 4 * h + 4 + 4 * h, 2 * h
    else:
        p = 2 if dtype == "bfloat16" else 4
        final_norm, lm_head_input = 4 * h + 4 + p * h, p * h
    return final_norm + lm_head_input + 4 * V + 2 * 8  # + input ids and targets (int64)


def matmul_weight_count(config) -> int:
    h, i = config.hidden_size, config.intermediate_size
    return config.num_hidden_layers * (4 * h * h + 3 * h * i) + config.vocab_size * h


def saved_activation_bytes(config, dtype: str, batch: int, seq_len: int, activation_checkpointing: bool) -> int:
    """What the formula says autograd holds for backward after the forward (the model's own tensors excluded)."""
    tokens = batch * seq_len
    residual = 2 if dtype == "bfloat16" else 4
    if activation_checkpointing:
        layers = config.num_hidden_layers * residual * config.hidden_size * tokens
        weight_copies = 2 * config.vocab_size * config.hidden_size if dtype == "mixed" else 0  # lm_head only
    else:
        layers = config.num_hidden_layers * layer_bytes_per_token(config, dtype) * tokens
        weight_copies = 2 * matmul_weight_count(config) if dtype == "mixed" else 0
    return layers + head_bytes_per_token(config, dtype) * tokens + weight_copies


def estimate(config, dtype: str, batch: int, seq_len: int, activation_checkpointing: bool) -> dict:
    tokens = batch * seq_len
    n = parameter_count(config)
    state_bytes = 2 if dtype == "bfloat16" else 4
    row = {"dtype": dtype, "activation_checkpointing": activation_checkpointing, "params": n,
           "weights_gb": n * state_bytes / GB, "grads_gb": n * state_bytes / GB, "adam_gb": 2 * n * state_bytes / GB,
           "activations_gb": saved_activation_bytes(config, dtype, batch, seq_len, activation_checkpointing) / GB}
    if activation_checkpointing:  # the layer being recomputed during backward
        row["activations_gb"] += layer_bytes_per_token(config, dtype) * tokens / GB
    row["loss_peak_gb"] = 2 * 4 * config.vocab_size * tokens / GB
    row["total_gb"] = sum(row[k] for k in ("weights_gb", "grads_gb", "adam_gb", "activations_gb", "loss_peak_gb"))
    return row


def _training_model(config, dtype: str, activation_checkpointing: bool):
    """The model as the trainer runs it in `dtype` (seeded, so both measurements see the same weights)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    model.train()
    if activation_checkpointing:
        model.activation_checkpointing_enable()
    return model


def measure_saved_bytes(config, dtype: str, batch: int, seq_len: int, activation_checkpointing: bool) -> int:
    """Bytes autograd saves for backward in one forward on CPU, each storage counted once, the model's parameters and
    buffers (the RoPE tables, which layers save as views) excluded.

    Attention runs on SDPA's flash kernel, as on a GPU: the CPU's bf16 choice (plain matmuls) would also save the
    attention probabilities, which the GPU estimate rightly leaves out."""
    model = _training_model(config, dtype, activation_checkpointing)
    own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in own:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    tokens = torch.randint(0, config.vocab_size, (batch, seq_len))
    gpu_kernel = mock.patch.object(modeling_llama, "CPU_PLAIN_ATTENTION_MAX_LEN", 0)
    with gpu_kernel, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "mixed"):
            loss = model(input_ids=tokens, labels=tokens).loss
    del loss
    return sum(saved.values()) - 4  # the scalar loss itself


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(key)).split()[1]) * 1024


def measure_step_peak_rss(config, dtype: str, batch: int, seq_len: int, activation_checkpointing: bool) -> int:
    """Peak RSS growth over the weights during a steady training step on CPU (Linux): the second step, Adam state
    already allocated, gradients set to None between steps as in the trainer. Run once per process."""
    model = _training_model(config, dtype, activation_checkpointing)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=False)  # no foreach temporaries
    tokens = torch.randint(0, config.vocab_size, (batch, seq_len))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "mixed"):
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    weights_only = _status_bytes("VmRSS")
    step()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM, the peak RSS
    step()
    return _status_bytes("VmHWM") - weights_only


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "configs/llama_1b.json"))
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--gpu_gb", type=float, default=80.0)
    parser.add_argument("--check", metavar="CONFIG", help="compare the activation formula with a CPU measurement")
    parser.add_argument("--check_rss", nargs=2, metavar=("CONFIG", "DTYPE"),
                        help="compare the formula's peak (all but the weights) with the peak RSS of a CPU step; "
                             "add --activation_checkpointing; one measurement per process")
    parser.add_argument("--activation_checkpointing", action="store_true")
    return parser


def load_config(parser, path: str):
    """The model config at `path` (Pre-LN), or a one-line error naming the file."""
    try:
        return build_config(path, norm_type="pre")
    except (OSError, ValueError, TypeError) as err:
        parser.error(f"{path}: not a model config JSON ({err.__class__.__name__}: {err})")


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    for path in (args.config, args.check, args.check_rss and args.check_rss[0]):
        if path is not None and not Path(path).is_file():
            parser.error(f"no such config {path}")
    for flag in ("batch_size", "seq_len", "gpu_gb"):
        if not getattr(args, flag) > 0:
            parser.error(f"--{flag} must be positive, got {getattr(args, flag)}")

    if args.check:
        config = load_config(parser, args.check)
        for dtype in DTYPES:
            for checkpointing in (False, True):
                measured = measure_saved_bytes(config, dtype, args.batch_size, args.seq_len, checkpointing)
                predicted = saved_activation_bytes(config, dtype, args.batch_size, args.seq_len, checkpointing)
                print(json.dumps({"config": Path(args.check).name, "batch": args.batch_size, "seq_len": args.seq_len,
                                  "dtype": dtype, "activation_checkpointing": checkpointing,
                                  "measured_saved_bytes": measured, "formula_saved_bytes": predicted,
                                  "ratio": round(measured / predicted, 4)}), flush=True)
        return

    if args.check_rss:
        config_path, dtype = args.check_rss
        if dtype not in DTYPES:
            parser.error(f"--check_rss: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        config = load_config(parser, config_path)
        measured = measure_step_peak_rss(config, dtype, args.batch_size, args.seq_len, args.activation_checkpointing)
        row = estimate(config, dtype, args.batch_size, args.seq_len, args.activation_checkpointing)
        predicted = (row["total_gb"] - row["weights_gb"]) * GB
        print(json.dumps({"config": Path(config_path).name, "batch": args.batch_size, "seq_len": args.seq_len,
                          "dtype": dtype, "activation_checkpointing": args.activation_checkpointing,
                          "measured_peak_rss_growth_gb": round(measured / GB, 3),
                          "formula_grads_adam_activations_loss_peak_gb": round(predicted / GB, 3),
                          "ratio": round(measured / predicted, 3)}), flush=True)
        return

    config = load_config(parser, args.config)
    print(f"{Path(args.config).name}: {parameter_count(config) / 1e9:.3f} B parameters, micro-batch "
          f"{args.batch_size} x {args.seq_len} tokens, one {args.gpu_gb:g} GB GPU (GB = 1e9 bytes)")
    print(f"{'dtype':9} {'act.ckpt':8} {'weights':>8} {'grads':>8} {'adam':>8} {'activ.':>8} {'loss pk':>8} "
          f"{'total':>8} {'headroom':>9}")
    for dtype in ("bfloat16", "mixed"):
        for checkpointing in (False, True):
            row = estimate(config, dtype, args.batch_size, args.seq_len, checkpointing)
            print(f"{dtype:9} {'yes' if checkpointing else 'no':8} {row['weights_gb']:8.1f} {row['grads_gb']:8.1f} "
                  f"{row['adam_gb']:8.1f} {row['activations_gb']:8.1f} {row['loss_peak_gb']:8.1f} "
                  f"{row['total_gb']:8.1f} {args.gpu_gb - row['total_gb']:9.1f}")


if __name__ == "__main__":
    main()
