"""Typed, validated configurations of `netgain.align.compress`: which compressor, which cost model, which sizes.

Each compressor config checks its arguments by building its compressor (one place states the allowed
values); `AlignConfig` checks the rest, naming the argument and what it accepts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..cost.kernels import GPUS, AnalyticCost
from .compressor import Compressor
from .lowrank import ASVD
from .prune import Pruner, parse_layers
from .svdllm import SVDLLM

VARIANTS = ("raw", "round-nearest", "round-down", "gac")  # the sizes `compress` can apply
COSTS = ("measured",) + tuple(sorted(GPUS))


class _BuiltToValidate:
    """A compressor config is checked by building its compressor, whose constructor states the allowed values."""

    def __post_init__(self):
        self.build()


@dataclass(frozen=True)
class ASVDConfig(_BuiltToValidate):
    """Activation-aware SVD (`lowrank.ASVD`): input channels scaled by mean |x| ** alpha."""

    alpha: float = 0.5

    def build(self) -> Compressor:
        return ASVD(alpha=self.alpha)


@dataclass(frozen=True)
class SVDLLMConfig(_BuiltToValidate):
    """SVD-LLM (`svdllm.SVDLLM`): whitening by the Cholesky factor of the input covariance, `jitter` x its
    mean diagonal added where it is not positive definite."""

    jitter: float = 1e-6

    def build(self) -> Compressor:
        return SVDLLM(jitter=self.jitter)


@dataclass(frozen=True)
class PrunerConfig(_BuiltToValidate):
    """Structured pruning (`prune.Pruner`) of MLP channels and, with `heads`, whole KV groups.

    importance: one of prune.IMPORTANCE; scope: one of prune.SCOPES; layers: 'START:END' (END exclusive) or None for all.
    """

    importance: str = "taylor"
    scope: str = "uniform"
    layers: str | None = None
    heads: bool = True

    def build(self) -> Compressor:
        return Pruner(self.importance, self.scope, parse_layers(self.layers), heads=self.heads)


COMPRESSORS = (ASVDConfig, SVDLLMConfig, PrunerConfig)


@dataclass(frozen=True)
class AlignConfig:
    """What `compress` does: the compressor, its parameter ratio, and how GAC re-selects sizes.

    cost: "measured" (kernels timed on the model's device, cached), an analytic preset name
    (a100, h100, h200), or any cost object with gemm(m, k, n) such as `MeasuredCost(...)`.
    tokens: the prefill length GAC's cost model prices. variant: the sizes `compress` applies.
    """

    compressor: ASVDConfig | SVDLLMConfig | PrunerConfig = field(default_factory=SVDLLMConfig)
    param_ratio: float = 0.85
    cost: object = "measured"
    tokens: int = 512
    multiple: int = 8
    steps: int = 4
    tolerance: float = 0.03
    variant: str = "gac"

    def __post_init__(self):
        if not isinstance(self.compressor, COMPRESSORS):
            raise ValueError(f"compressor must be one of {', '.join(c.__name__ for c in COMPRESSORS)}, got {self.compressor!r}")
        if not (isinstance(self.param_ratio, (int, float)) and 0 < self.param_ratio <= 1):
            raise ValueError(f"param_ratio must be in (0, 1], got {self.param_ratio!r}")
        if isinstance(self.cost, str) and self.cost not in COSTS or not isinstance(self.cost, str) and not hasattr(self.cost, "gemm"):
            raise ValueError(f"cost must be one of {', '.join(COSTS)} or a cost object with gemm(m, k, n) "
                             f"(MeasuredCost, AnalyticCost), got {self.cost!r}")
        for name in ("tokens", "multiple", "steps"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"tolerance must be in [0, 1), got {self.tolerance!r}")
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {self.variant!r}")

    def cost_model(self, dtype: str = "float32"):
        """The cost object: as given, an analytic preset, or kernels measured on this device in `dtype`."""
        if not isinstance(self.cost, str):
            return self.cost
        if self.cost == "measured":
            from ..cost.profile import MeasuredCost

            return MeasuredCost("auto", dtype)
        return AnalyticCost(self.cost)

