"""What a compressor hands to GAC: independently sized units, each with a proposed size and a value curve.

A unit is one thing whose size a compressor chooses: the rank of a factorised Linear, or (for a
pruner) the width of an MLP or the head count of an attention block. GAC, the naive rounding
baselines and the report only need to know, for any size, how many parameters the unit holds and
which GEMMs it runs; they never look inside the compressor. By convention ``size == full`` means
"leave the unit as it was" (a dense Linear, an unpruned MLP).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence


@dataclass(frozen=True)
class Unit:
    """A compressible unit: subclasses say how parameters and GEMMs depend on the size."""

    name: str
    proposed: int  # the compressor's own size d*
    full: int  # the size that means "unchanged"
    score: float  # importance s_i: value of one parameter kept (GAC's linear fallback when `error` is empty)
    # the compressor's predicted loss at every size 0..full, where it knows one (error[full] = 0)
    error: tuple[float, ...] = field(default=(), repr=False, compare=False, kw_only=True)

    def params(self, size: int) -> int:
        raise NotImplementedError

    def gemms(self, size: int, tokens: int) -> list[tuple[int, int, int]]:
        """The (M, K, N) products this unit runs for `tokens` tokens at this size."""
        raise NotImplementedError

    def gain(self, size: int) -> float:
        """What moving from the proposed size to `size` is worth (GAC maximises the sum).

        The drop in the compressor's predicted loss where it gave `error`, else GAC's linearisation
        s_i (|W(size)| - |W*|).
        """
        if self.error:
            return self.error[self.proposed] - self.error[size]
        return self.score * (self.params(size) - self.params(self.proposed))


def check_propose(fitted: bool, param_ratio: float) -> None:
    """The checks every `Compressor.propose` starts with: fitted first, ratio in (0, 1]."""
    if not fitted:
        raise RuntimeError("call fit(model, batches) before propose()")
    if not 0 < param_ratio <= 1:
        raise ValueError(f"param_ratio must be in (0, 1], got {param_ratio}")


def total_params(units: Sequence[Unit], sizes: Mapping[str, int]) -> int:
    return sum(u.params(sizes[u.name]) for u in units)


def aligned_fraction(units: Sequence[Unit], sizes: Mapping[str, int], multiple: int) -> float:
    """Share of units whose size is a multiple of `multiple` (unchanged units count with their full size)."""
    return sum(sizes[u.name] % multiple == 0 for u in units) / len(units)


def proposed_sizes(units: Sequence[Unit]) -> dict[str, int]:
    return {u.name: u.proposed for u in units}


def full_sizes(units: Sequence[Unit]) -> dict[str, int]:
    return {u.name: u.full for u in units}
