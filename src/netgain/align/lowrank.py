"""ASVD-style activation-aware low-rank compression of the Linears in a causal LM's decoder layers.

Each weight W (out x in) is scaled by the calibration activations' mean magnitude per input
channel to the power alpha, W S = U diag(sigma) V^T; the truncated product is folded back into two
Linears, in -> r (sqrt(sigma) V^T S^-1) and r -> out (U sqrt(sigma)). The full SVD is kept, so
any rank can be cut again without recomputing (GAC re-selects ranks after the fact).

Per-layer ratios follow ASVD: each layer takes the smallest parameter ratio from a grid whose
sensitivity stays under a common threshold, and a binary search on the threshold meets the global
parameter ratio; rank = floor(params * ratio / (in + out)). The sensitivity here is the share of
the scaled spectrum's energy that truncation drops (a cheap proxy that needs no extra forward
passes, where ASVD measures calibration perplexity per layer and ratio). The units carry that
error curve, so GAC can value any rank by it rather than by a linear slope.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import torch
from torch import nn

from .units import Unit, check_propose

# the per-layer parameter ratios the allocation chooses from (1.0 = keep the layer dense)
RATIO_GRID = tuple(round(0.1 + 0.05 * i, 2) for i in range(18)) + (1.0,)


class LowRankLinear(nn.Module):
    """Two Linears in -> rank -> out standing in for one Linear."""

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = False):
        super().__init__()
        if not 1 <= rank:
            raise ValueError(f"rank must be >= 1, got {rank}")
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
    """A Linear factorised at rank `size`; size == full (= min(in, out)) keeps the dense Linear.

    `error[r]`, when given, is the compressor's error at rank r (r = 0..full, error[full] = 0); GAC
    then values a rank by the exact error difference instead of the linear s_i * parameters.
    """

    in_features: int
    out_features: int
    error: tuple[float, ...] = field(default=(), repr=False, compare=False)

    def gain(self, size: int) -> float:
        if not self.error:
            return super().gain(size)
        return self.error[self.proposed] - self.error[size]

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


class ASVD:
    """Activation-aware SVD compressor (see the module docstring); implements `units.Compressor`."""

    def __init__(self, alpha: float = 0.5):
        if not 0 <= alpha <= 1:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        self.alpha = alpha
        self.factors: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.shapes: dict[str, tuple[int, int]] = {}

    @torch.inference_mode()
    def fit(self, model: nn.Module, batches, progress=None) -> None:
        """Run calibration batches (token id tensors) to get activation scales, then SVD every Linear."""
        linears = decoder_linears(model)
        if not linears:
            raise ValueError("model has no nn.Linear inside decoder layers ('.layers.' in the module name)")
        sums = {name: torch.zeros(m.in_features, dtype=torch.float64) for name, m in linears.items()}
        counts = dict.fromkeys(linears, 0)

        def hook(name):
            def record(module, args):
                x = args[0].detach().reshape(-1, args[0].shape[-1])
                sums[name] += x.abs().double().sum(0).cpu()
                counts[name] += x.shape[0]

            return record

        handles = [m.register_forward_pre_hook(hook(name)) for name, m in linears.items()]
        try:
            decoder = model.get_decoder()  # the LM head's logits are not needed
            for ids in batches:
                decoder(input_ids=ids.to(model.device), use_cache=False)
                if progress is not None:
                    progress.update(1)
        finally:
            for h in handles:
                h.remove()
        if not all(counts.values()):
            raise ValueError("calibration batches never reached some decoder Linears (no batches given?)")
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # threaded LAPACK SVD spins for seconds when cores are shared; these are small
        try:
            for name, module in linears.items():
                scale = (sums[name] / counts[name]).clamp_min(1e-6).pow(self.alpha).float()
                weight = module.weight.detach().float().cpu()
                u, sigma, vt = torch.linalg.svd(weight * scale[None, :], full_matrices=False)
                self.factors[name] = (u, sigma, vt, scale)
                self.shapes[name] = (module.in_features, module.out_features)
                if progress is not None:
                    progress.update(1)
        finally:
            torch.set_num_threads(threads)

    def truncation_error(self, name: str, rank: int) -> float:
        """Share of the activation-scaled spectrum's energy lost by keeping `rank` components."""
        energy = self.factors[name][1].double().pow(2)
        return float(energy[rank:].sum() / energy.sum())

    def propose(self, param_ratio: float) -> list[LowRankUnit]:
        """Per-layer ranks meeting the global parameter ratio, with each layer's marginal-error score."""
        check_propose(bool(self.factors), param_ratio)
        names = sorted(self.factors)
        dense = {n: self.shapes[n][0] * self.shapes[n][1] for n in names}
        budget = param_ratio * sum(dense.values())
        options = {n: [self._option(n, r) for r in RATIO_GRID] for n in names}  # (error, params, rank)

        def allocate(threshold: float) -> dict[str, tuple[float, int, int]]:
            return {n: next(o for o in options[n] if o[0] <= threshold) for n in names}

        if sum(o[1] for o in allocate(1.0).values()) > budget:
            raise ValueError(f"param_ratio {param_ratio} is below what the smallest grid ratio {RATIO_GRID[0]} reaches")
        low, high = 0.0, 1.0  # threshold 1 admits the smallest ratio everywhere; 0 keeps all dense
        for _ in range(60):
            mid = (low + high) / 2
            if sum(o[1] for o in allocate(mid).values()) <= budget:
                high = mid
            else:
                low = mid
        chosen = allocate(high)
        return [self._unit(n, chosen[n][2]) for n in names]

    def _option(self, name: str, ratio: float) -> tuple[float, int, int]:
        in_f, out_f = self.shapes[name]
        full = min(in_f, out_f)
        rank = full if ratio == 1.0 else min(rank_for_ratio(in_f, out_f, ratio), full)
        params = in_f * out_f if rank == full else rank * (in_f + out_f)
        return (self.truncation_error(name, rank) if rank < full else 0.0), params, rank

    def _unit(self, name: str, rank: int) -> LowRankUnit:
        in_f, out_f = self.shapes[name]
        energy = self.factors[name][1].double().pow(2)
        full = min(in_f, out_f)
        at = min(rank, full - 1)  # the next component a rank increase would recover
        score = float(energy[at] / energy.sum()) / (in_f + out_f)
        kept = torch.cat([torch.zeros(1, dtype=energy.dtype), energy[:full].cumsum(0)]) / energy.sum()
        error = tuple((1.0 - kept).clamp_min(0.0).tolist())  # share lost at rank 0..full
        return LowRankUnit(name, rank, full, score, in_f, out_f, error[:-1] + (0.0,))

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
            u, sigma, vt, scale = self.factors[name]
            r = module.rank
            root = sigma[:r].sqrt()
            dtype = module.down.weight.dtype
            module.down.weight.copy_((root[:, None] * vt[:r] / scale[None, :]).to(dtype))
            module.up.weight.copy_((u[:, :r] * root[None, :]).to(dtype))
            if biases[name] is not None:
                module.up.bias.copy_(biases[name])
