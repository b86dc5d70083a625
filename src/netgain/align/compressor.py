"""The one interface every compressor GAC wraps: fit, propose, apply are its own; select and round_sizes are GAC's.

A compressor says which of its units GAC may re-size (`resizable`: every unit for low-rank; the
pruner's MLP widths, since head counts are already multiples of head_dim). GAC re-selects those
under their own proposed parameter count and the rest stay as proposed, so callers never switch
modules by method.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from torch import nn

from . import gac
from .phases import Phases
from .units import Unit, proposed_sizes


class Compressor:
    """Base of ASVD, SVD-LLM and the pruner: calibrate, propose sized units, rebuild at any sizes."""

    method = ""  # the name recorded in a saved model's manifest

    def __init__(self):
        self.phases = Phases()  # where fitting (and the pipeline after it) spent its time

    def fit(self, model: nn.Module, batches, progress: bool = False) -> None:
        raise NotImplementedError

    def propose(self, param_ratio: float) -> list[Unit]:
        raise NotImplementedError

    def apply(self, model: nn.Module, sizes: Mapping[str, int]) -> None:
        raise NotImplementedError

    def resizable(self, units: Sequence[Unit]) -> list[Unit]:
        """The units GAC and the rounding baselines may re-size (all, unless a compressor says otherwise)."""
        return list(units)

    def select(self, units: Sequence[Unit], cost, tokens: int, **options) -> dict[str, int]:
        """GAC's sizes (`gac.select` options) for the resizable units; the others as proposed."""
        sizes = proposed_sizes(units)
        sizes.update(gac.select(self.resizable(units), cost, tokens, **options))
        return sizes

    def round_sizes(self, units: Sequence[Unit], multiple: int = 8, mode: str = "nearest") -> dict[str, int]:
        """The naive baseline (`gac.round_sizes`) on the resizable units; the others as proposed."""
        sizes = proposed_sizes(units)
        sizes.update(gac.round_sizes(self.resizable(units), multiple, mode))
        return sizes
