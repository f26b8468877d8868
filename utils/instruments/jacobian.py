"""Block Jacobians: how far each decoder block is from the identity map, measured by re-calling the block.

For block l and position t, J_l(t) = d x_{l+1}[t] / d x_l[t], with every other position held fixed. A forward
pre-hook captures each layer's actual call and calls it again in float32 with x a leaf of autograd; a row c^T J(t)
is the gradient of <y[t], c> with respect to x[t], and all the vectors c of one token run as batched backward passes
(is_grads_batched). Exact: c runs over the d basis vectors. Probes: K Gaussian vectors v, where ||(J - I)^T v||^2 is
an unbiased estimate of ||J - I||_F^2 and v^T J v of trace(J) (Hutchinson). Per layer, over the sampled tokens:
rel_identity_dev = sqrt(mean_t ||J(t) - I||_F^2) / sqrt(d), mean_diag = mean_t trace(J(t)) / d and
mean_abs_offdiag (exact only). Command line and outputs: utils/jacobian_analysis.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np
import torch
from torch import nn
from torch.func import functional_call
from tqdm.auto import tqdm

from utils.instruments import model_io

EXACT_MAX_HIDDEN = 512  # above this hidden size the default is the probe estimate
DEFAULT_PROBES = 16
PROBE_HEATMAP_SIZE = 64  # with probes, the heatmap shows the leading block of J of one token, computed exactly
JACOBIAN_DTYPE = torch.float32  # the re-called block runs in float32 whatever the model's dtype


# ----------------------------------------------------------------------------- which tokens
@dataclass
class TokenSample:
    """One window of token ids and the sorted positions in it whose Jacobians are measured."""
    window: list[int]
    positions: list[int]


def sample_tokens(windows: Iterable[list[int]], num_tokens: int, tokens_per_window: int = 8,
                  seed: int = 0) -> list[TokenSample]:
    """Take up to ``tokens_per_window`` random positions from each window until ``num_tokens`` are taken. When the
    windows run out first, add further positions of the windows already read (round robin), so that a short text
    has all its tokens used."""
    rng = np.random.default_rng(seed)
    orders: list[np.ndarray] = []
    taken: list[int] = []
    samples_windows: list[list[int]] = []
    total = 0
    for window in windows:
        if not window:
            continue
        order = rng.permutation(len(window))
        count = min(len(window), tokens_per_window, num_tokens - total)
        samples_windows.append(list(window))
        orders.append(order)
        taken.append(count)
        total += count
        if total >= num_tokens:
            break
    while total < num_tokens and any(count < len(order) for count, order in zip(taken, orders)):
        for index, order in enumerate(orders):
            if total < num_tokens and taken[index] < len(order):
                taken[index] += 1
                total += 1
    return [TokenSample(window, sorted(int(p) for p in order[:count]))
            for window, order, count in zip(samples_windows, orders, taken)]


# ----------------------------------------------------------------------------- vector-Jacobian products
class _StopForward(Exception):
    """Raised by the last hook that is needed, so that the rest of the backbone is not run."""


NO_BLOCK_JACOBIAN = "not defined: the residual stream is not a running sum (docs/training.md#norm-placements)"


def stream_is_a_running_sum(model) -> bool:
    """Whether each block maps the residual stream x to x + F(x), so that its Jacobian is defined: true of any HF
    causal LM and of every placement here but those with a stream of their own (AttnRes, mHC, SiameseNorm)."""
    from peft_pretraining.model.modeling_llama import ResidualSum

    stream = getattr(getattr(model, "model", None), "residual_stream", None)
    return stream is None or isinstance(stream, ResidualSum)


def _to_jacobian_dtype(value):
    if isinstance(value, torch.Tensor):
        return value.to(JACOBIAN_DTYPE) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_to_jacobian_dtype(item) for item in value)
    if isinstance(value, dict):
        return {key: _to_jacobian_dtype(item) for key, item in value.items()}
    return value


class BlockVectorJacobian:
    """Computes products c^T J_l(t) for every decoder layer l at one token position t, for many vectors c.

    ``run(window, position, cotangents, consume)`` feeds the window cut after ``position`` (the blocks are causal,
    so nothing after it matters). For every layer, ``cotangents(layer)`` gives the vectors c as ``[m, d]`` and
    ``consume(layer, c, g)`` receives ``g = c^T J`` (``[m, d]``, float32). The m products share one forward pass of
    the block and run as batched backward passes (``is_grads_batched``) of at most ``vectors_per_pass`` vectors;
    by default as many as keep one batched gradient under ``element_budget`` floats.
    """

    def __init__(self, model: nn.Module, vectors_per_pass: int | None = None, element_budget: int = 2 ** 25):
        stream = model_io.ResidualStream(model)  # the same backbone, layer list and call as the other analyses
        self.backbone, self.layers, self.backbone_kwargs = stream.backbone, stream.layers, stream.backbone_kwargs
        self.hidden_size = model.get_input_embeddings().embedding_dim
        self.device = next(model.parameters()).device
        self.vectors_per_pass, self.element_budget = vectors_per_pass, element_budget
        self._inside_hook = False

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def run(self, window: Sequence[int], position: int, cotangents: Callable[[int], torch.Tensor],
            consume: Callable[[int, torch.Tensor, torch.Tensor], None], layers: Sequence[int] | None = None) -> None:
        wanted = set(range(self.num_layers) if layers is None else layers)
        input_ids = torch.as_tensor([list(window[:position + 1])], device=self.device)

        def hook_for(index: int):
            def pre_hook(module, args, kwargs):
                if self._inside_hook or index not in wanted:
                    return None
                vectors = cotangents(index).to(self.device, JACOBIAN_DTYPE)
                consume(index, vectors, self._vector_jacobian(module, args, kwargs, position, vectors))
                if index == max(wanted):
                    raise _StopForward
                return None
            return pre_hook

        handles = [layer.register_forward_pre_hook(hook_for(index), with_kwargs=True)
                   for index, layer in enumerate(self.layers)]
        try:
            with torch.no_grad():
                self.backbone(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **self.backbone_kwargs)
        except _StopForward:
            pass
        finally:
            for handle in handles:
                handle.remove()

    def _vector_jacobian(self, module, args, kwargs, position: int, vectors: torch.Tensor) -> torch.Tensor:
        """Call the block again in float32 on the captured inputs, with x as a leaf, and return c^T J at position."""
        hidden = args[0] if args else kwargs["hidden_states"]
        x = hidden.detach().to(JACOBIAN_DTYPE).requires_grad_(True)
        kwargs = _to_jacobian_dtype(kwargs)
        if args:
            args = (x, *_to_jacobian_dtype(args[1:]))
        else:
            kwargs["hidden_states"] = x
        weights = {name: tensor.detach().to(JACOBIAN_DTYPE) if tensor.is_floating_point() else tensor
                   for name, tensor in [*module.named_parameters(), *module.named_buffers()]}
        at_once = self.vectors_per_pass or max(1, self.element_budget // x.numel())
        products = []
        self._inside_hook = True
        try:
            with torch.enable_grad():
                output = functional_call(module, weights, args, kwargs)
                output = output[0] if isinstance(output, (tuple, list)) else output  # transformers < 5 returns tuples
                for start in range(0, len(vectors), at_once):
                    chunk = vectors[start:start + at_once]
                    # Full-size output gradients, zero except at the position: no indexing op in the graph, whose
                    # backward would be looped over the vectors instead of batched.
                    output_gradients = torch.zeros(len(chunk), *output.shape, dtype=JACOBIAN_DTYPE, device=x.device)
                    output_gradients[:, 0, position] = chunk
                    (gradient,) = torch.autograd.grad(output, x, grad_outputs=output_gradients, is_grads_batched=True,
                                                      retain_graph=start + at_once < len(vectors))
                    products.append(gradient[:, 0, position])
        finally:
            self._inside_hook = False
        return torch.cat(products)


# ----------------------------------------------------------------------------- statistics
class JacobianStatistics:
    """Per layer and sampled token, sums over the vectors c of ||g - c||^2, <g, c> and sum|g| - |<g, c>| (g = c^T J),
    and of their squares for the probe standard errors. Exact vectors (c = e_i) give ||J - I||_F^2, trace J and the
    sum of |off-diagonal| entries; Gaussian probes give unbiased estimates of the first two."""

    def __init__(self, num_layers: int, num_tokens: int, hidden_size: int, probes: int,
                 heatmap_layers: Sequence[int] = ()):
        self.hidden_size, self.probes = hidden_size, probes
        shape = (num_layers, num_tokens)
        self.deviation = torch.zeros(shape, dtype=torch.float64)
        self.deviation_squares = torch.zeros(shape, dtype=torch.float64)
        self.trace = torch.zeros(shape, dtype=torch.float64)
        self.trace_squares = torch.zeros(shape, dtype=torch.float64)
        self.off_diagonal = torch.zeros(shape, dtype=torch.float64)
        self.jacobian_sums = {layer: torch.zeros(hidden_size, hidden_size, dtype=torch.float64)
                              for layer in heatmap_layers} if probes == 0 else {}

    def add(self, layer: int, token: int, vectors: torch.Tensor, products: torch.Tensor) -> None:
        """``vectors`` and ``products`` are ``[m, d]``; in the exact method, vectors is the identity, products J."""
        deviation = (products - vectors).square().sum(dim=1).double()
        projection = (products * vectors).sum(dim=1).double()
        off_diagonal = products.abs().sum(dim=1).double() - projection.abs()
        for target, values in ((self.deviation, deviation), (self.deviation_squares, deviation.square()),
                               (self.trace, projection), (self.trace_squares, projection.square()),
                               (self.off_diagonal, off_diagonal)):
            target[layer, token] = values.sum().item()
        if layer in self.jacobian_sums:
            self.jacobian_sums[layer] += products.double().cpu()

    def rows(self) -> list[dict]:
        d = self.hidden_size
        result = []
        for layer in range(self.deviation.shape[0]):
            if self.probes == 0:
                row = dict(layer=layer, rel_identity_dev=math.sqrt(self.deviation[layer].mean().item() / d),
                           mean_diag=self.trace[layer].mean().item() / d,
                           mean_abs_offdiag=self.off_diagonal[layer].mean().item() / (d * (d - 1)) if d > 1 else 0.0)
            else:
                squared, squared_se = self._probe_mean(self.deviation[layer], self.deviation_squares[layer])
                trace, trace_se = self._probe_mean(self.trace[layer], self.trace_squares[layer])
                rel = math.sqrt(max(squared, 0.0) / d)
                row = dict(layer=layer, rel_identity_dev=rel, mean_diag=trace / d, mean_abs_offdiag=None,
                           rel_identity_dev_se=squared_se / d / (2 * rel) if rel > 0 else None,  # delta method
                           mean_diag_se=trace_se / d, identity_dev_sq_per_d=squared / d,
                           identity_dev_sq_per_d_se=squared_se / d)
            result.append(row)
        return result

    def _probe_mean(self, sums: torch.Tensor, square_sums: torch.Tensor) -> tuple[float, float]:
        """Mean over tokens of the per-token probe mean, and its standard error from the probes' spread."""
        k = self.probes
        means = sums / k
        variances = ((square_sums - k * means.square()) / (k - 1)).clamp_min(0)
        return means.mean().item(), math.sqrt(variances.sum().item() / k) / means.numel()

    def mean_jacobians(self, num_tokens: int) -> dict[int, np.ndarray]:
        return {layer: (total / num_tokens).numpy() for layer, total in self.jacobian_sums.items()}


# ----------------------------------------------------------------------------- measurement
@dataclass
class JacobianMeasurement:
    rows: list[dict]
    num_tokens: int
    hidden_size: int
    method: str
    probes: int
    heatmaps: dict[int, np.ndarray] = field(default_factory=dict)
    heatmap_note: str = ""


def resolve_probes(probes: int | None, hidden_size: int) -> int:
    """0 = exact; None = exact up to EXACT_MAX_HIDDEN, else DEFAULT_PROBES."""
    if probes is None:
        return 0 if hidden_size <= EXACT_MAX_HIDDEN else DEFAULT_PROBES
    if probes == 1 or probes < 0:
        raise ValueError(f"--probes: must be 0 (exact) or at least 2 (a standard error needs 2), got {probes}")
    return probes


def measure_jacobians(model: nn.Module, samples: Sequence[TokenSample], probes: int | None = None, seed: int = 0,
                      vectors_per_pass: int | None = None, heatmap: bool = True,
                      desc: str = "jacobian") -> JacobianMeasurement:
    """Block-Jacobian statistics of every decoder layer over the sampled tokens (see the module docstring).

    ``probes``: None (exact when d <= 512, else 16 probes), 0 (exact) or K >= 2 (Gaussian probes).
    ``vectors_per_pass`` bounds the vectors of one batched backward pass, hence memory (default: automatic)."""
    engine = BlockVectorJacobian(model, vectors_per_pass)
    d = engine.hidden_size
    probes = resolve_probes(probes, d)
    tokens = [(sample.window, position) for sample in samples for position in sample.positions]
    if not tokens:
        raise ValueError("no tokens were analysed")
    heatmap_layers = sorted({0, engine.num_layers - 1}) if heatmap else []
    statistics = JacobianStatistics(engine.num_layers, len(tokens), d, probes, heatmap_layers)
    generator = torch.Generator().manual_seed(seed)
    basis = torch.eye(d, dtype=JACOBIAN_DTYPE)

    def cotangents(_layer: int) -> torch.Tensor:
        return basis if probes == 0 else torch.randn(probes, d, generator=generator, dtype=JACOBIAN_DTYPE)

    for token, (window, position) in enumerate(tqdm(tokens, unit="tok", desc=desc, dynamic_ncols=True)):
        engine.run(window, position, cotangents,
                   lambda layer, vectors, products: statistics.add(layer, token, vectors, products))

    measurement = JacobianMeasurement(statistics.rows(), len(tokens), d, "exact" if probes == 0 else "probes", probes)
    if heatmap and probes == 0:
        measurement.heatmaps = statistics.mean_jacobians(len(tokens))
        measurement.heatmap_note = f"token mean of J over {len(tokens)} tokens"
    elif heatmap:
        measurement.heatmaps, measurement.heatmap_note = _leading_block(engine, *tokens[0], heatmap_layers)
    return measurement


def _leading_block(engine: BlockVectorJacobian, window: Sequence[int], position: int, layers: list[int]):
    """The exact leading k x k block of J at one token, for the heatmap when d is too large for all of J."""
    size = min(engine.hidden_size, PROBE_HEATMAP_SIZE)
    blocks: dict[int, np.ndarray] = {}

    def consume(layer, _vectors, products):
        blocks[layer] = products[:, :size].double().cpu().numpy()

    engine.run(window, position, lambda _layer: torch.eye(size, engine.hidden_size), consume, layers)
    return blocks, f"leading {size}x{size} block of J at one token (position {position})"


def jacobian_summary(model: nn.Module, windows: Iterable[list[int]], num_tokens: int = 128,
                     tokens_per_window: int = 8, probes: int | None = None, seed: int = 0,
                     desc: str = "jacobian") -> list[dict]:
    """In-process entry point: windows of token ids (as from ``model_io.token_windows``) in,
    one dict per layer out: ``layer, rel_identity_dev, mean_diag, mean_abs_offdiag`` (+ ``*_se`` with probes)."""
    samples = sample_tokens(windows, num_tokens, tokens_per_window, seed)
    return measure_jacobians(model, samples, probes, seed, heatmap=False, desc=desc).rows
