"""Probe (not part of the package): the output projection and its cross-entropy, chunked over tokens and fused.

The fused version never holds the full (tokens x vocab) logits: for each chunk of rows it computes the logits, the
loss and the gradient of the logits, and from that the chunk's input gradient and its share of the weight gradient,
all in the forward (backward only scales them). The reference is what the model does: one bf16 matmul under
autocast, then cross-entropy in fp32. Both forward + backward, bf16 compute, 2 threads, interleaved repeats.

    python docs/benchmarks/faststep/probe_chunked_linear_cross_entropy.py 2048 128 8192 256            # eager
    python docs/benchmarks/faststep/probe_chunked_linear_cross_entropy.py 2048 128 8192 256 --compile  # compiled
"""
import statistics
import sys
import time

import torch
import torch.nn.functional as F

IGNORE = -100


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk):
        n_valid = (targets != IGNORE).sum().clamp(min=1)
        loss = hidden.new_zeros((), dtype=torch.float32)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, hidden.shape[0], chunk):
            rows, chunk_targets = hidden[start:start + chunk], targets[start:start + chunk]
            logits = (rows @ weight.t()).float()
            valid = chunk_targets != IGNORE
            safe_targets = chunk_targets.clamp(min=0)[:, None]
            loss = loss + ((torch.logsumexp(logits, -1) - logits.gather(1, safe_targets)[:, 0]) * valid).sum()
            grad_logits = torch.softmax(logits, -1)
            grad_logits.scatter_add_(1, safe_targets, -valid[:, None].float())
            grad_logits = (grad_logits * valid[:, None]).to(hidden.dtype)
            grad_hidden[start:start + chunk] = grad_logits @ weight
            grad_weight += (grad_logits.t() @ rows).float()
        ctx.save_for_backward(grad_hidden, grad_weight, n_valid)
        return loss / n_valid

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight, n_valid = ctx.saved_tensors
        scale = grad_loss / n_valid
        return grad_hidden * scale.to(grad_hidden.dtype), grad_weight * scale, None, None


def main():
    tokens, hidden_size, vocab, chunk = (int(value) for value in sys.argv[1:5])
    torch.set_num_threads(2)
    torch.manual_seed(0)
    hidden0, weight0 = torch.randn(tokens, hidden_size), torch.randn(vocab, hidden_size) * 0.02
    targets = torch.randint(0, vocab, (tokens,))
    targets[-5:] = IGNORE

    def reference(hidden, weight):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = F.linear(hidden, weight)
        return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE)

    def fused(hidden, weight):
        return ChunkedLinearCrossEntropy.apply(hidden.to(torch.bfloat16), weight.to(torch.bfloat16), targets, chunk)

    functions = {"reference": reference, "chunked": fused}
    if "--compile" in sys.argv:
        functions = {name: torch.compile(function) for name, function in functions.items()}
    results = {}
    for name, function in functions.items():
        hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
        loss = function(hidden, weight)
        loss.backward()
        results[name] = (loss.item(), hidden.grad, weight.grad)
    print("loss", results["reference"][0], results["chunked"][0])
    for index, what in ((1, "grad hidden"), (2, "grad weight")):
        ref, new = results["reference"][index], results["chunked"][index]
        print(what, "max abs difference / max abs", ((ref - new).abs().max() / ref.abs().max()).item())
    times = {name: [] for name in functions}
    for _ in range(7):
        for name, function in functions.items():
            hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
            start = time.perf_counter()
            for _ in range(3):
                function(hidden, weight).backward()
            times[name].append((time.perf_counter() - start) / 3 * 1e3)
    for name, values in times.items():
        print(f"{name}: ms per forward + backward, median {statistics.median(values):.1f}",
              [round(value, 1) for value in values])


if __name__ == "__main__":
    main()
