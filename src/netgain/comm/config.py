"""Typed, validated configs: the config says what, the hook does how (as torchao's quantize_).

    netgain.comm.register(ddp, GlobalQSGDConfig(bits=4))
    netgain.comm.register(ddp, CommConfig(TopKConfig(ratio=0.01), warmup_steps=10))
    netgain.comm.register(ddp, "gqsgd", bits=4, warmup_steps=10)   # by name, as the CLI does

Every codec config builds a chooser (codecs.Chooser): what the pipeline asks which codec a bucket
uses this step; a fixed codec's config builds the codec, auto's and Kimad's an AdaptivePlanner. The whole CommConfig is compared
across ranks before the first bucket is sent.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, field
from typing import ClassVar, Union

import torch

from .adaptive import MAX_ERROR, AdaptivePlanner
from .calibrate import codec_profile
from .codecs import (Cast, Codec, GlobalQSGD, GlobalQSGDExp, NoCompression, QSGD, RandomK, TopK,
                     check_integer)
from .lowrank import LowRank
from ..cost import network
from ..cost.kernels import GPU

NONFINITE_POLICIES = ("raise", "uncompressed")
CAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class _FixedConfig:
    """A fixed codec's config: its fields are the codec's arguments, which the codec itself validates."""
    codec: ClassVar[type]

    def __post_init__(self):
        self.build()

    def build(self):
        return self.codec(**dataclasses.asdict(self))


@dataclass(frozen=True)
class NoCompressionConfig(_FixedConfig):
    """fp32 allreduce of the mean, as DDP does without a hook."""
    codec: ClassVar[type] = NoCompression


@dataclass(frozen=True)
class CastConfig:
    """Divide by n, cast to fp16 or bf16, allreduce."""
    dtype: str = "fp16"

    def __post_init__(self):
        if self.dtype not in CAST_DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {tuple(CAST_DTYPES)}")

    def build(self):
        return Cast(self.dtype, CAST_DTYPES[self.dtype])


@dataclass(frozen=True)
class QSGDConfig(_FixedConfig):
    """Classic QSGD (own scale per worker, allgather): a baseline for Global-QSGD."""
    bits: int = 8
    codec: ClassVar[type] = QSGD


@dataclass(frozen=True)
class GlobalQSGDConfig(_FixedConfig):
    """Global-QSGD: one global scale per parameter, integer codes summed by a native allreduce."""
    bits: int = 8
    encoding: str = "packed"
    codec: ClassVar[type] = GlobalQSGD


@dataclass(frozen=True)
class GlobalQSGDExpConfig(_FixedConfig):
    """Global-QSGD with power-of-two levels (ring reduce with re-encoding)."""
    bits: int = 8
    codec: ClassVar[type] = GlobalQSGDExp


@dataclass(frozen=True)
class TopKConfig(_FixedConfig):
    """Top-k of each parameter's EF21 residual (allgather of index + value)."""
    ratio: float = 0.01
    codec: ClassVar[type] = TopK


@dataclass(frozen=True)
class RandomKConfig(_FixedConfig):
    """Random-k with coordinates shared by all ranks (allreduce), EF21."""
    ratio: float = 0.01
    codec: ClassVar[type] = RandomK


@dataclass(frozen=True)
class LowRankConfig(_FixedConfig):
    """PowerSGD-style rank-r factors with error feedback; factors in fp32 or as Global-QSGD codes.

    Starts after 2 uncompressed steps unless CommConfig.warmup_steps says otherwise, as PowerSGD
    must: the random warm start loses the first, largest gradients (measured: 1.19x PowerSGD's time
    to target with them, 1.05x without, bench/results/time_to_accuracy_1gbit_3w_warmup_seeds.md).
    """
    rank: int = 4
    factors: str = "gqsgd"
    bits: int = 8
    codec: ClassVar[type] = LowRank
    default_warmup_steps: ClassVar[int] = 2


@dataclass(frozen=True)
class KimadConfig:
    """Kimad: re-plan each bucket's codec to fit a communication time budget at the measured bandwidth.

    mode: "kimad" (one option for all buckets) or "kimad+" (a knapsack per bucket). budget_ms:
    the time target per step (None: the measured backward time, so communication hides under it).
    max_error: an option is admissible only if the error it adds to the averaged gradient is at
    most this fraction of the gradient's energy (what keeps the plan from collapsing onto top-k).
    bits: the Global-QSGD widths offered (empty: no quantized option, only none, top-k and low rank).
    topk_ratios: top-k (EF21) options (None: 0.001, 0.01, 0.1, or none with low rank). lowrank_rank:
    adds low rank at this rank, 8-bit Global-QSGD factors, as an option (in place of top-k: a bucket
    keeps one error-feedback memory); admitted by error feedback, not by max_error.
    """
    mode: str = "kimad+"
    budget_ms: float | None = None
    replan_every: int = 10
    bits: tuple[int, ...] = (2, 3, 4, 5, 6, 7, 8)
    topk_ratios: tuple[float, ...] | None = None
    lowrank_rank: int | None = None
    max_error: float = MAX_ERROR

    def __post_init__(self):
        for name in ("budget_ms", "max_error") if self.budget_ms is not None else ("max_error",):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"{name} must be a number, got {value!r}")
        if self.budget_ms is not None and not 0 < self.budget_ms < float("inf"):
            raise ValueError(f"budget_ms must be > 0 and finite (or None for the measured backward time), got {self.budget_ms}")
        self.build()  # the planner checks mode and replan_every, its option codecs their bits and ratios

    def build(self):
        return AdaptivePlanner(self.mode, time_budget_s=None if self.budget_ms is None else self.budget_ms / 1e3,
                               replan_every=self.replan_every, bits=self.bits, topk_ratios=self.topk_ratios,
                               lowrank_rank=self.lowrank_rank, max_error=self.max_error)


@dataclass(frozen=True)
class AutoConfig:
    """auto, the default: per bucket, the option with the least predicted communication plus codec time
    at the link measured in this run (Kimad's monitor and knapsack; see netgain.comm.adaptive).

    Options: none, bf16, fp16 (where max |g| stays far below its range), Global-QSGD at ``bits`` (each within max_error of the gradient's energy, as
    Kimad's), and low rank at ``rank`` with fp32 and with 8-bit factors (error feedback, as PowerSGD
    users accept); replan_every: steps between the measurements of the options' errors (a pass over each
    bucket per option, which Kimad's 10 made about 10% of a lab step on 2 cores; the link is re-planned
    whenever it moves, regardless).
    """
    rank: int = 4
    bits: tuple[int, ...] = (8, 4)
    replan_every: int = 50
    max_error: float = MAX_ERROR

    def __post_init__(self):
        if isinstance(self.max_error, bool) or not isinstance(self.max_error, numbers.Real):
            raise ValueError(f"max_error must be a number, got {self.max_error!r}")
        self.build()  # the planner and its option codecs check the rest

    def build(self):
        return AdaptivePlanner("auto", replan_every=self.replan_every, bits=self.bits, lowrank_rank=self.rank,
                               max_error=self.max_error)


CodecConfig = Union[NoCompressionConfig, CastConfig, QSGDConfig, GlobalQSGDConfig, GlobalQSGDExpConfig,
                    TopKConfig, RandomKConfig, LowRankConfig, KimadConfig, AutoConfig]
PLANNED_CONFIGS = (KimadConfig, AutoConfig)
# codecs without per-rank state: what runs where that state would have to be kept per fragment (netgain.sync);
# EF21 (topk, randomk), low rank's memory and the planners' measurements are per rank
STATELESS_CONFIGS = (NoCompressionConfig, CastConfig, QSGDConfig, GlobalQSGDConfig, GlobalQSGDExpConfig)
CODEC_CONFIGS = {"auto": AutoConfig, "none": NoCompressionConfig, "fp16": CastConfig, "bf16": CastConfig, "qsgd": QSGDConfig,
                 "gqsgd": GlobalQSGDConfig, "gqsgd-exp": GlobalQSGDExpConfig, "topk": TopKConfig,
                 "randomk": RandomKConfig, "lowrank": LowRankConfig, "kimad": KimadConfig, "kimad+": KimadConfig}
CODEC_NAMES = tuple(CODEC_CONFIGS)
FIXED_CODEC_NAMES = tuple(name for name, config in CODEC_CONFIGS.items() if config not in PLANNED_CONFIGS)
CODEC_FIELDS = {f.name for cls in set(CODEC_CONFIGS.values()) for f in dataclasses.fields(cls)} - {"dtype", "mode"}


@dataclass(frozen=True)
class CommConfig:
    """A codec and how the hook applies it.

    warmup_steps: uncompressed steps first (None: the codec's default, default_warmup_steps; resolved
    here, so dataclasses.replace with another codec keeps this one's number).
    min_compress_numel: smaller buckets go uncompressed.
    skip_1d: 1-D gradients (biases, norm weights) go exact in fp32, as PowerSGD does.
    nonfinite: "raise" NonFiniteGradientError on every rank, or send such a bucket "uncompressed".
    seed: keys the counter-based rounding noise and random-k's coordinates.
    own_group: run the hook's collectives on a process group of its own (made by register), so
    DDP's find_unused_parameters and other users of the default group never meet them.
    """
    codec: CodecConfig = field(default_factory=AutoConfig)
    warmup_steps: int | None = None
    min_compress_numel: int = 1024
    skip_1d: bool = False
    nonfinite: str = "raise"
    seed: int = 0
    own_group: bool = True

    def __post_init__(self):
        if not isinstance(self.codec, tuple(CODEC_CONFIGS.values())):
            raise TypeError(f"codec must be one of {', '.join(c.__name__ for c in set(CODEC_CONFIGS.values()))}, "
                            f"got {type(self.codec).__name__}")
        if self.nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite={self.nonfinite!r} is not one of {NONFINITE_POLICIES}")
        if self.warmup_steps is None:
            object.__setattr__(self, "warmup_steps", default_warmup_steps(self.codec))
        for name, least in (("warmup_steps", 0), ("min_compress_numel", 0), ("seed", None)):
            check_integer(name, getattr(self, name), least)
        for name in ("skip_1d", "own_group"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    def describe(self) -> dict:
        """Every field, the codec's type included: what ranks compare."""
        return {"codec_type": type(self.codec).__name__, **dataclasses.asdict(self)}


def default_warmup_steps(codec: "CodecConfig | str") -> int:
    """Uncompressed steps a codec (config or name) starts after when not told: 2 for low rank, else 0."""
    config_type = CODEC_CONFIGS.get(codec) if isinstance(codec, str) else type(codec)
    return getattr(config_type, "default_warmup_steps", 0)


def codec_config(name: str, **params) -> CodecConfig:
    """The codec config for a name from CODEC_NAMES. Options another codec takes are ignored (one set of
    options drives any codec name, as the CLI's flags do; a fixed codec's int ``bits`` is not Kimad's
    tuple of widths); a name no codec takes raises TypeError (a typo must not fall back to a default)."""
    if name not in CODEC_CONFIGS:
        raise ValueError(f"unknown codec {name!r}; choose one of {', '.join(CODEC_NAMES)}")
    _refuse_unknown(params, CODEC_FIELDS, "codec")
    cls = CODEC_CONFIGS[name]
    if cls is CastConfig:
        return CastConfig(name)
    if cls in PLANNED_CONFIGS:
        params = {**params, "mode": name} if cls is KimadConfig else dict(params)
        params["bits"] = tuple(params["bits"]) if isinstance(params.get("bits"), (tuple, list)) else None
        params["topk_ratios"] = tuple(params["topk_ratios"]) if params.get("topk_ratios") is not None else None
    fields = {f.name for f in dataclasses.fields(cls)}
    return cls(**{key: value for key, value in params.items() if key in fields and value is not None})


def make_codec(name: str, **params) -> Codec:
    """The codec of a fixed codec's name, with codec_config's rules for the options (auto's and Kimad's
    names plan a codec per bucket and build none)."""
    if name not in FIXED_CODEC_NAMES and name in CODEC_CONFIGS:
        raise ValueError(f"{name!r} plans a codec per bucket; make_codec builds one of {', '.join(FIXED_CODEC_NAMES)}")
    return codec_config(name, **params).build()


# every fixed codec at the settings a user would try first: what `netgain model` weighs and benchmarks time
SETTINGS = (("none", {}), ("fp16", {}), ("bf16", {}), ("qsgd", {"bits": 8}), ("gqsgd", {"bits": 8, "encoding": "int8"}),
            ("gqsgd", {"bits": 8}), ("gqsgd", {"bits": 4}), ("gqsgd", {"bits": 2}), ("gqsgd-exp", {"bits": 8}),
            ("topk", {"ratio": 0.01}), ("randomk", {"ratio": 0.01}), ("lowrank", {"rank": 4, "factors": "fp32"}),
            ("lowrank", {"rank": 4}))


def candidate_profiles(world_size: int, cost: "str | GPU", shapes: list[tuple[int, ...]] | None = None,
                       threads: int | None = None) -> list[tuple[network.CodecProfile, str]]:
    """(profile, convergence) of every codec in SETTINGS that runs at ``world_size``: what `netgain model`
    weighs; ``shapes``, ``threads``: what to calibrate on, and with (see codec_profile)."""
    out = []
    for name, params in SETTINGS:
        codec = make_codec(name, **params)
        try:
            out.append((codec_profile(codec, world_size, cost, threads=threads, shapes=shapes), codec.convergence))
        except ValueError:  # e.g. gqsgd int8 holds at most 127 workers
            continue
    return out


def _refuse_unknown(params: dict, known: set[str], what: str) -> None:
    unknown = sorted(set(params) - known)
    if unknown:
        raise TypeError(f"unknown {what} argument(s) {unknown}; the {what} arguments are {', '.join(sorted(known))}")


def comm_config(config: "CodecConfig | CommConfig | str", **kwargs) -> CommConfig:
    """A CommConfig from a config object or a codec name plus keyword arguments (codec and hook fields)."""
    hook_fields = {f.name for f in dataclasses.fields(CommConfig)} - {"codec"}
    options = {key: value for key, value in kwargs.items() if key in hook_fields}
    rest = {key: value for key, value in kwargs.items() if key not in hook_fields}
    if isinstance(config, str):
        _refuse_unknown(rest, CODEC_FIELDS | hook_fields, "codec or hook")
        return CommConfig(codec_config(config, **rest), **options)
    if rest:
        raise TypeError(f"unexpected arguments {sorted(rest)} with a config object; put them in the config")
    if isinstance(config, CommConfig):
        return dataclasses.replace(config, **options) if options else config
    return CommConfig(config, **options)
