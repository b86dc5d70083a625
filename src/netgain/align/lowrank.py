"""Activation-aware low-rank compression of the Linears in a causal LM's decoder layers (ASVD; SVD-LLM in svdllm.py).

Each weight W (out x in) is factorised after a whitening S of its input, W S = U diag(sigma) V^T;
the truncated product is folded back into two Linears, in -> r (sqrt(sigma) V^T S^-1) and
r -> out (U sqrt(sigma)). ASVD's S is diagonal: the calibration activations' mean magnitude per input
channel to the power alpha. The full SVD is kept, so any rank can be cut again without recomputing
(GAC re-selects ranks after the fact).

Per-layer ratios come from ASVD's grid, rank = floor(params * ratio / (in + out)). ASVD measures
each layer's sensitivity as calibration perplexity per ratio (a forward pass each) and binary-searches
a common threshold; here sensitivity is predicted for every rank at once from one calibration
forward/backward pass, as the truncation's second-order loss increase under the output's empirical
Fisher (`loss_curve`, nats per token). In those comparable units the multi-choice knapsack
(`netgain.plan`) picks the grid ratios that minimise the summed increase under the global budget
directly, where a common threshold would leave layers at unequal marginal cost.
The units carry that curve, so GAC values any rank by it rather than by a linear slope.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Mapping

import torch
from torch import nn

from ..plan import Option, solve
from .calibrate import loss_backward
from .compressor import Compressor
from .phases import bar
from .units import Unit, check_propose

# the per-layer parameter ratios the allocation chooses from (1.0 = keep the layer dense)
RATIO_GRID = tuple(round(0.1 + 0.05 * i, 2) for i in range(18)) + (1.0,)
ALLOCATION_RESOLUTION = 2000  # budget steps of the allocation knapsack
SLOPE_WINDOW = 8  # ranks either side of a proposal for its linear score (a diagnostic: GAC uses the curve)


class LowRankLinear(nn.Module):
    """Two Linears in -> rank -> out standing in for one Linear."""

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = False):
        super().__init__()
        if type(rank) is not int or not 1 <= rank <= min(in_features, out_features):
            raise ValueError(f"rank must be an integer in [1, {min(in_features, out_features)}], got {rank!r}")
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.down = nn.Linear(in_features, rank, bias=False)
        self.up = nn.Linear(rank, out_features, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x))

    def spec(self) -> dict:
        """What `netgain.align.load` needs to build this module again."""
        return {
            "kind": "lowrank",
            "in_features": self.in_features,
            "out_features": self.out_features,
            "rank": self.rank,
            "bias": self.up.bias is not None,
        }

    @classmethod
    def from_spec(cls, spec: Mapping) -> "LowRankLinear":
        return cls(spec["in_features"], spec["out_features"], spec["rank"], spec["bias"])


@dataclass(frozen=True)
class LowRankUnit(Unit):
    """A Linear factorised at rank `size`; size == full (= min(in, out)) keeps the dense Linear."""

    in_features: int
    out_features: int

    def params(self, size: int) -> int:
        if size == self.full:
            return self.in_features * self.out_features
        return size * (self.in_features + self.out_features)

    def gemms(self, size: int, tokens: int) -> list[tuple[int, int, int]]:
        if size == self.full:
            return [(tokens, self.in_features, self.out_features)]
        return [(tokens, self.in_features, size), (tokens, size, self.out_features)]


def decoder_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The Linears inside the decoder layers (attention and MLP projections), by module name."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and ".layers." in f".{name}"
    }


def rank_for_ratio(in_features: int, out_features: int, ratio: float) -> int:
    """ASVD's rank for a parameter ratio: floor(params * ratio / (in + out)), at least 1."""
    return max(1, math.floor(in_features * out_features * ratio / (in_features + out_features)))


def install(model: nn.Module, ranks: Mapping[str, int]) -> dict[str, LowRankLinear]:
    """Replace the named Linears by LowRankLinear modules of the given ranks, weights left UNINITIALISED
    (callers copy factors in or load them; initialising 8B-sized layers only to overwrite them is slow)."""
    installed = {}
    for name, rank in ranks.items():
        old = model.get_submodule(name)
        with torch.device("meta"):
            new = LowRankLinear(old.in_features, old.out_features, rank, bias=old.bias is not None)
        new = new.to_empty(device=old.weight.device).to(old.weight.dtype)
        model.set_submodule(name, new)
        installed[name] = new
    return installed


class LowRank(Compressor):
    """What ASVD and SVD-LLM share: calibration, the whitened SVD of every Linear, the loss-curve rank
    allocation and the rebuild; a subclass says how it whitens (`factorise`)."""

    def __init__(self):
        super().__init__()
        self.factors: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # name -> U, sigma, V^T S^-1
        self.curves: dict[str, torch.Tensor] = {}  # name -> predicted loss increase at rank 0..full
        self.shapes: dict[str, tuple[int, int]] = {}

    def factorise(self, weight: torch.Tensor, inputs: _Inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """U, sigma and M = V^T S^-1 of W S = U diag(sigma) V^T (float32, on the CPU)."""
        raise NotImplementedError

    def fit(self, model: nn.Module, batches, progress: bool = False) -> None:
        """Calibrate on token-id batches (input statistics, output Fisher), then factorise every Linear.

        Linears that read the same tensor (q, k and v; gate and up) share one `_Inputs`: its |x| and
        x x^T are accumulated once per batch, not once per reader (`phases` says what each step took)."""
        linears = decoder_linears(model)
        if not linears:
            raise ValueError("model has no nn.Linear inside decoder layers ('.layers.' in the module name)")
        batches = list(batches)
        stats = {name: _Calibration(m.out_features) for name, m in linears.items()}
        last: list = [None, None]  # the tensor the previous Linear read, and its statistics
        statistics_s = [0.0]

        def record_input(name: str, features: int):
            def hook(module, args):
                start = time.perf_counter()
                if args[0] is last[0]:  # another reader of the same tensor: recorded already
                    inputs = last[1]
                else:
                    inputs = stats[name].inputs or _Inputs(features)
                    inputs.record(args[0])
                stats[name].inputs, last[:] = inputs, (args[0], inputs)
                statistics_s[0] += time.perf_counter() - start

            return hook

        handles = [m.register_forward_pre_hook(record_input(name, m.in_features)) for name, m in linears.items()]
        handles += [m.register_forward_hook(stats[name].watch_output) for name, m in linears.items()]
        # gradients w.r.t. activations only: no weight is trainable, the embedding output is the leaf
        handles.append(model.get_input_embeddings().register_forward_hook(lambda m, a, out: out.detach().requires_grad_()))
        start = time.perf_counter()
        try:
            with bar(len(batches), "calibration passes", progress) as passes:
                loss_backward(model, batches, progress=passes)
        finally:
            for h in handles:
                h.remove()
            last[:] = None, None
        self.phases.add("forward/backward passes", time.perf_counter() - start - statistics_s[0])
        self.phases.add("activation statistics", statistics_s[0])
        if not all(c.inputs is not None for c in stats.values()):
            raise ValueError("calibration batches never reached some decoder Linears (no batches given?)")
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # threaded LAPACK SVD spins for seconds when cores are shared; these are small
        try:
            with bar(len(linears), "SVDs and loss curves", progress, unit="Linear") as done:
                for name, module in linears.items():
                    calibration = stats.pop(name)  # free each covariance once its last reader is done
                    with self.phases.timed("SVDs"):
                        u, sigma, m = self.factorise(module.weight.detach().float().cpu(), calibration.inputs)
                    self.factors[name] = (u, sigma, m)
                    with self.phases.timed("loss curves"):
                        self.curves[name] = loss_curve(u, sigma, m, calibration.inputs.covariance(), calibration.fisher())
                    self.shapes[name] = (module.in_features, module.out_features)
                    done.update(1)
        finally:
            torch.set_num_threads(threads)

    def truncation_error(self, name: str, rank: int) -> float:
        """Predicted increase of the mean per-token loss (nats) when this Linear keeps `rank` components."""
        return float(self.curves[name][rank])

    def propose(self, param_ratio: float) -> list[LowRankUnit]:
        """Per-layer grid ranks that minimise the summed predicted loss under the global parameter ratio."""
        check_propose(bool(self.factors), param_ratio)
        names = sorted(self.factors)
        budget = param_ratio * sum(self.shapes[n][0] * self.shapes[n][1] for n in names)
        groups = [[self._option(n, ratio) for ratio in RATIO_GRID] for n in names]
        try:
            solution = solve(groups, budget, resolution=ALLOCATION_RESOLUTION)
        except ValueError:
            raise ValueError(f"param_ratio {param_ratio} is below what the smallest grid ratio {RATIO_GRID[0]} reaches") from None
        return [self._unit(n, g[c].label) for n, g, c in zip(names, groups, solution.choice)]

    def _option(self, name: str, ratio: float) -> Option:
        """One allocation choice: the grid ratio's rank, its parameters, minus its predicted loss."""
        in_f, out_f = self.shapes[name]
        full = min(in_f, out_f)
        rank = full if ratio == 1.0 else min(rank_for_ratio(in_f, out_f, ratio), full)
        params = LowRankUnit(name, rank, full, 0.0, in_f, out_f).params(rank)
        return Option(params, -self.truncation_error(name, rank), rank)

    def _unit(self, name: str, rank: int) -> LowRankUnit:
        in_f, out_f = self.shapes[name]
        full = min(in_f, out_f)
        curve = self.curves[name]
        low, high = max(0, rank - SLOPE_WINDOW), min(full, rank + SLOPE_WINDOW)  # the curve's slope around the rank
        score = float(curve[low] - curve[high]) / ((high - low) * (in_f + out_f))
        return LowRankUnit(name, rank, full, score, in_f, out_f, error=tuple(curve.tolist()))

    @torch.no_grad()
    def apply(self, model: nn.Module, sizes: Mapping[str, int]) -> None:
        """Rebuild the named Linears of `model` (the one that was fitted, or a copy) at the given ranks."""
        ranks = {}
        for name, rank in sizes.items():
            if name not in self.factors:
                raise KeyError(f"{name!r} was not fitted; known layers: {len(self.factors)} decoder Linears")
            in_f, out_f = self.shapes[name]
            if not 1 <= rank <= min(in_f, out_f):
                raise ValueError(f"rank for {name} must be in [1, {min(in_f, out_f)}], got {rank}")
            if rank < min(in_f, out_f):
                ranks[name] = rank
        biases = {name: model.get_submodule(name).bias for name in ranks}
        for name, module in install(model, ranks).items():
            u, sigma, m = self.factors[name]
            r = module.rank
            root = sigma[:r].sqrt()
            dtype = module.down.weight.dtype
            module.down.weight.copy_((root[:, None] * m[:r]).to(dtype))
            module.up.weight.copy_((u[:, :r] * root[None, :]).to(dtype))
            if biases[name] is not None:
                module.up.bias.copy_(biases[name])


class ASVD(LowRank):
    """Activation-aware SVD: S = diag(mean |x| ** alpha) (see the module docstring)."""

    method = "asvd"

    def __init__(self, alpha: float = 0.5):
        if not 0 <= alpha <= 1:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        super().__init__()
        self.alpha = alpha

    def factorise(self, weight, inputs):
        scale = inputs.mean_abs().clamp_min(1e-6).pow(self.alpha).float()
        u, sigma, vt = torch.linalg.svd(weight * scale[None, :], full_matrices=False)
        return u, sigma, vt / scale[None, :]


class _Inputs:
    """Running |x| and x x^T of one input tensor over the calibration tokens, shared by every Linear
    that reads it; `cached` keeps what is derived from them once (SVD-LLM's Cholesky factor)."""

    def __init__(self, features: int):
        self.abs_sum = torch.zeros(features, dtype=torch.float64)
        self.gram = torch.zeros(features, features, dtype=torch.float64)
        self.count = 0
        self.derived: dict = {}

    def record(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float().cpu()
        self.abs_sum += x.abs().sum(0)
        self.gram += x.T @ x
        self.count += x.shape[0]

    def mean_abs(self) -> torch.Tensor:
        return self.abs_sum / self.count

    def covariance(self) -> torch.Tensor:
        return self.gram / self.count

    def cached(self, key: str, derive):
        if key not in self.derived:
            self.derived[key] = derive()
        return self.derived[key]


class _Calibration:
    """What one Linear saw: its input's statistics (`_Inputs`, maybe shared) and the squared gradient of
    the per-token loss w.r.t. its output (the diagonal empirical Fisher)."""

    def __init__(self, out_features: int):
        self.inputs: _Inputs | None = None
        self.grad_sq = torch.zeros(out_features, dtype=torch.float64)

    def watch_output(self, module, args, output) -> None:
        """Forward hook: record the gradient that reaches this (batch, seq, out) output."""
        # the loss is a mean over batch x (seq - 1) next-token predictions: scale to the per-token loss
        predictions = output.shape[0] * (output.shape[1] - 1)

        def record_grad(grad):  # returns None: the gradient flows on unchanged
            self.grad_sq += (grad.detach().float().cpu() * predictions).reshape(-1, grad.shape[-1]).pow(2).sum(0)

        if output.requires_grad:
            output.register_hook(record_grad)

    def fisher(self) -> torch.Tensor:
        return self.grad_sq / self.inputs.count


def loss_curve(u, sigma, m, covariance, fisher) -> torch.Tensor:
    """Predicted increase of the mean per-token loss at every rank 0..k of W = U diag(sigma) M (M = V^T S^-1).

    Dropping components j >= r changes the output by dy = sum_j u_j sigma_j (m_j^T x); to second
    order the loss rises by E[dy^T diag(F) dy] / 2 with F the output's Fisher diagonal. With C = E[x x^T]
    that is half the sum of G[r:, r:], G_jk = sigma_j sigma_k (u_j^T diag(F) u_k)(m_j^T C m_k).
    This is what makes errors of different layers comparable (ASVD measures perplexity per layer instead).
    """
    m, u = m.double(), u.double()
    gram = (sigma.double()[:, None] * sigma.double()[None, :]) * ((u * fisher[:, None]).T @ u) * (m @ covariance @ m.T)
    per_component = 2 * gram.triu().sum(1) - gram.diagonal()  # row j's share of the sum over the dropped block
    dropped = per_component.flip(0).cumsum(0).flip(0)  # dropped[r] = sum over G[r:, r:]
    return torch.cat([dropped, dropped.new_zeros(1)]) / 2
