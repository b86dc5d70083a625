"""Gradient codecs: one whole flat bucket -> one payload tensor -> the mean over workers, in place.

A codec declares how its payloads are aggregated (``collective``: allreduce, allgather or ring),
its wire cost (``wire_bits(world_size)``: payload bits per gradient element each rank
contributes, per-bucket tables excluded) and whether its estimate of the mean is unbiased. It
encodes the bucket in one pass (fused.py) and decodes what the collective returns straight into
the bucket's buffer; it never talks to the network itself (collectives.Communicator).

Per-parameter values reach each element through the bucket's Segments, so a codec's result does
not depend on how DDP groups parameters into buckets. Codecs with ``needs_scales`` get
ctx.scales = the global max |g| of every parameter (the hook's header allreduce MAX).
"""

from __future__ import annotations

import functools
import math
import numbers
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import ClassVar, Protocol, runtime_checkable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import fused, kernel
from . import quantize as Q
from .feedback import EF21
from .fused import Segments
from .store import BucketLayout

BITS_RANGE = range(2, 9)


def check_bits(bits: int) -> int:
    check_integer("bits", bits)
    if bits not in BITS_RANGE:
        raise ValueError(f"bits must be in {BITS_RANGE.start}..{BITS_RANGE.stop - 1}, got bits={bits}")
    return bits


def check_integer(name: str, value, least: int | None = None) -> None:
    """An integer (numpy's too, never a bool) of at least `least`, or a ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or (least is not None and value < least):
        raise ValueError(f"{name} must be an integer{'' if least is None else f' >= {least}'}, got {value!r}")


ENCODINGS = ("packed", "int8")
TOPK_SAMPLES = 2048  # per parameter: the top-k threshold is estimated from this many residuals


class NonFiniteGradientError(RuntimeError):
    """A bucket held NaN or Inf on at least one rank; raised on every rank."""


class PlanMismatchError(RuntimeError):
    """Ranks asked for different codecs or hook settings (for a bucket, or for the whole run); raised on every rank."""


@dataclass
class Context:
    """What a codec may use for one bucket in one step (built by the pipeline, or by time_codec)."""

    world_size: int
    segments: Segments
    noise_keys: torch.Tensor             # int32 per parameter: this rank's rounding noise
    shared_keys: torch.Tensor            # int32 per parameter: identical on every rank
    scales: torch.Tensor | None = None   # float32 per parameter: global max |g| (codecs with needs_scales)
    feedback: EF21 | None = None
    tables: dict = field(default_factory=dict)  # per bucket layout: a codec's own index tables
    sent: tuple | None = None            # what this rank sent, for EF21
    layout: "BucketLayout | None" = None  # names, spans and shapes of the bucket's parameters
    carry: dict = field(default_factory=dict)  # a multi-round codec's work from one round to the next
    seconds: dict = field(default_factory=lambda: {"encode_s": 0.0, "decode_s": 0.0})
    synchronize: bool = False            # wait for the device before reading the clock (benchmarks only)

    @classmethod
    def for_step(cls, world_size: int, segments: Segments, seed: int, step: int, rank: int, **fields) -> Context:
        """The context of one bucket at ``step`` on ``rank``: its noise keys are this rank's, its shared keys every rank's."""
        return cls(world_size, segments, fused.step_keys(segments.keys, seed, step, rank),
                   fused.step_keys(segments.keys, seed, step, -1), **fields)

    @contextmanager
    def timed(self, key: str):
        start = time.perf_counter()
        yield
        if self.synchronize:
            torch.cuda.synchronize()
        self.seconds[key] += time.perf_counter() - start

    def table(self, key, build):
        if key not in self.tables:
            self.tables[key] = build()
        return self.tables[key]

    def buffer(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A payload or scratch tensor kept with the bucket layout and reused every step: fresh memory
        costs a page fault per page on CPU (more than the codec's arithmetic) and a sync point on CUDA."""
        return self.table(("buffer", name, numel, dtype), lambda: torch.empty(numel, dtype=dtype, device=device))


def warm(codec: "Codec", x: torch.Tensor, ctx: Context) -> None:
    """Run a stateless ``codec`` once on ``x``, its output dropped, so that its kernels compile in the background
    (kernel.compile_ahead) before a caller runs it hot; ``x`` and ``ctx`` stay as they were. Without the header's
    scales in ``ctx``, this rank's own max |g| per parameter stands in (1 where a parameter is all zeros)."""
    scales = ctx.scales
    if scales is None and codec.needs_scales:
        local = codec.local_scales(x, ctx)
        scales = torch.where(local > 0, local, torch.ones_like(local))
    scratch = replace(ctx, scales=scales, feedback=None, sent=None, carry={})
    with kernel.compile_ahead():
        codec.decode(codec.encode(x, scratch), torch.empty_like(x), scratch)


class Codec:
    name: ClassVar[str]
    collective: ClassVar[str]          # "allreduce" | "allgather" | "ring"
    unbiased: ClassVar[bool]
    needs_scales: ClassVar[bool] = True
    uses_feedback: ClassVar[bool] = False
    relays: ClassVar[bool] = False     # rounds after the first are made by `relay` from the last one's result
    header_entries: ClassVar[int] = 1  # header floats per parameter (`local_scales`)

    @property
    def needs_header(self) -> bool:
        """A header allreduce first: the global scales, or a NaN check before EF21 state is touched."""
        return self.needs_scales or self.uses_feedback

    def wire_bits(self, world_size: int) -> float:
        raise NotImplementedError

    def profile_fields(self, world_size: int) -> dict:
        """The payload's size as the cost model's CodecProfile takes it (low rank adds its rank)."""
        return {"wire_bits": self.wire_bits(world_size)}

    @property
    def convergence(self) -> str:
        """What keeps training on course: "unbiased" (an estimate of the mean with bounded variance),
        "low-rank" (error feedback of a low-rank projection: PowerSGD's accuracy matches SGD's at
        rank >= 2), "rounded" (16-bit casts: each addition rounds to within half a unit in the last place), or
        "biased" (sparsifiers: step time says nothing of their steps to a loss)."""
        return "unbiased" if self.unbiased else "biased"

    def local_scales(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        """This rank's part of the header: max |g| per parameter (NaN/Inf propagate), agreed by MAX."""
        return ctx.segments.absmax(x)

    def scale_params(self, ctx: Context) -> torch.Tensor | None:
        """The parameter of each of `local_scales`' entries (None: one entry per parameter, in order)."""
        return None

    def encode(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        raise NotImplementedError

    def rounds(self, ctx: Context) -> int:
        """Collectives per bucket after the header; more than one: `relay` makes each next payload."""
        return 1

    def relay(self, aggregated: torch.Tensor, ctx: Context) -> tuple[torch.Tensor, "dist.ReduceOp"]:
        """Multi-round codecs: the next round's payload and its allreduce op, from the last round's result."""
        raise NotImplementedError

    def decode(self, aggregated: torch.Tensor, out: torch.Tensor, ctx: Context) -> torch.Tensor:
        """Write the mean over workers into ``out`` (the bucket's buffer) and return it."""
        raise NotImplementedError

    def memory(self, layout, device) -> tuple[EF21, list[tuple[int, int]]]:
        """State kept across steps per bucket layout (codecs with uses_feedback), and each parameter's
        span in its shared buffer. EF21: g_i and g, both the size of the gradient."""
        return EF21(layout.segments.numel, device), layout.spans

    def fill_shared(self, name: str, shared: torch.Tensor) -> None:
        """A parameter's fresh shared state (no earlier layout, no checkpoint): EF21's starts at zero."""

    def params(self) -> dict:
        """The parameters that define the codec (compared across ranks, shown in records)."""
        return {}

    def describe(self) -> str:
        args = ",".join(f"{k}={v}" for k, v in self.params().items())
        return f"{self.name}({args})" if args else self.name

    # a fixed codec is its own Chooser
    def codec_for(self, index: int, numel: int) -> Codec:
        return self

    @property
    def memory_codec(self) -> Codec | None:
        return self if self.uses_feedback else None


class NoCompression(Codec):
    """fp32 allreduce of grad / n in the bucket's own buffer: what DDP does. 32 bits/element, exact."""

    name, collective, unbiased, needs_scales = "none", "allreduce", True, False

    def wire_bits(self, world_size):
        return 32.0

    def encode(self, x, ctx):
        with ctx.timed("encode_s"):
            return x.div_(ctx.world_size)

    def decode(self, aggregated, out, ctx):
        return out if aggregated is out else out.copy_(aggregated)


class Cast(Codec):
    """Divide by n and cast to 16 bits in one pass, allreduce, cast back into the bucket. 16 bits/element.

    Dividing BEFORE the sum keeps fp16 from overflowing where fp32 would not. Round-to-nearest is
    deterministic: biased by at most half a unit in the last place (2^-11 relative for fp16,
    2^-8 for bf16) per addition.
    """

    collective, unbiased, needs_scales = "allreduce", False, False
    convergence = "rounded"  # bench/time_to_accuracy.py: 0.97-0.99x fp32's steps to the target (fp16, bf16)

    def __init__(self, name: str, dtype: torch.dtype):
        self.name, self.dtype = name, dtype

    def wire_bits(self, world_size):
        return 16.0

    def encode(self, x, ctx):
        with ctx.timed("encode_s"):
            return fused.cast_scaled(ctx.buffer("payload", x.numel(), self.dtype, x.device), x, 1.0 / ctx.world_size)

    def decode(self, aggregated, out, ctx):
        with ctx.timed("decode_s"):
            return out.copy_(aggregated)


class GlobalQSGD(Codec):
    """Global-QSGD standard dithering: one global scale per parameter, so integer codes add up in a native SUM.

    encoding="packed": 2^(b-1)-1 levels per sign per worker, offset codes packed into int32/int64
        words with fields wide enough that the SUM of n workers never carries (quantize.word_layout);
        wire bits = word bits / fields per word, e.g. 9.1 at b=8, n<=2; 10.7 at n=3,4.
    encoding="int8" (b=8, the paper's layout): floor(127/n) levels per worker, so the int8 SUM
        stays within +-127 for any n <= 127. Wire: 8 bits/element.
    Unbiased; |error| <= scale / levels per element.
    """

    name, collective, unbiased = "gqsgd", "allreduce", True

    def __init__(self, bits: int = 8, encoding: str = "packed"):
        if encoding not in ENCODINGS:
            raise ValueError(f"encoding={encoding!r} is not one of {ENCODINGS}")
        if encoding == "int8" and bits != 8:
            raise ValueError(f"encoding='int8' is the paper's 8-bit layout: bits must be 8, got bits={bits}; use encoding='packed'")
        self.bits, self.encoding = check_bits(bits), encoding

    def params(self):
        return {"bits": self.bits, "encoding": self.encoding}

    def levels(self, world_size: int) -> int:
        if self.encoding == "packed":
            return Q.levels_per_side(self.bits)
        if world_size > 127:
            raise ValueError(f"encoding='int8' holds at most 127 workers (got world_size={world_size}); use encoding='packed'")
        return 127 // world_size

    def wire_bits(self, world_size):
        if self.encoding == "int8":
            return 8.0
        return Q.packed_bits_per_element(self.levels(world_size), world_size)

    def words(self, world_size: int) -> fused.Words:
        """How this codec's codes sit in the integer words it sends (built once per world size)."""
        return _words(self.encoding, self.levels(world_size), world_size)

    def encode(self, x, ctx):
        with ctx.timed("encode_s"):
            levels, layout = self.levels(ctx.world_size), self.words(ctx.world_size)
            words = fused.round_pack(x, ctx.segments, levels / ctx.scales, ctx.noise_keys, levels, layout,
                                     ctx.buffer("words", layout.count(x.numel()), layout.dtype, x.device))
            return words.view(torch.int8) if self.encoding == "int8" else words  # int8: the SUM runs on bytes

    def decode(self, aggregated, out, ctx):
        with ctx.timed("decode_s"):
            n, levels, layout = ctx.world_size, self.levels(ctx.world_size), self.words(ctx.world_size)
            return fused.unpack_scale_into(out, aggregated.view(layout.dtype), ctx.segments, ctx.scales / (levels * n),
                                           layout, n)


@functools.cache
def _words(encoding: str, levels: int, world_size: int) -> fused.Words:
    if encoding == "int8":
        return fused.Words(torch.int32, 8, 4, 0)
    dtype, width, per_word = Q.word_layout(levels, world_size)
    return fused.Words(dtype, width, per_word, levels)


class Int8Codes(Codec):
    """Codecs whose codes travel as int8 whatever ``bits`` (2^(bits-1)-1 levels per sign): 8 bits/element."""

    def __init__(self, bits: int = 8):
        self.bits, self.levels = check_bits(bits), Q.levels_per_side(bits)

    def params(self):
        return {"bits": self.bits}

    def wire_bits(self, world_size):
        return 8.0


class QSGD(Int8Codes):
    """Classic QSGD: each worker's own scale per parameter, 2^(b-1)-1 levels per sign, stochastic
    rounding. Scales differ per worker, so codes cannot be summed: allgather + decode each.
    Wire: 8 bits/element (int8 codes) + one fp32 scale per parameter; the allgather makes every rank
    receive n such payloads. Unbiased; |error| <= mean_i(scale_i) / levels per element. A NaN/Inf
    gradient travels as its parameter's scale (codes cannot hold it), so every rank decodes NaN there.
    """

    name, collective, unbiased, needs_scales = "qsgd", "allgather", True, False

    def encode(self, x, ctx):
        with ctx.timed("encode_s"):
            s = ctx.segments
            own = s.absmax(x)
            own = torch.where(own == 0, torch.ones_like(own), own)  # NaN/Inf stay: every rank decodes them
            payload = ctx.buffer("payload", x.numel() + 4 * s.count, torch.int8, x.device)
            fused.round_int8(x, s, self.levels / own, ctx.noise_keys, self.levels, payload[: x.numel()])
            payload[x.numel():] = own.view(torch.int8)
            return payload

    def decode(self, aggregated, out, ctx):
        with ctx.timed("decode_s"):
            numel = out.numel()
            factors = aggregated[:, numel:].contiguous().view(torch.float32) / (self.levels * ctx.world_size)
            scratch = ctx.buffer("qsgd decode", numel, torch.float32, out.device)
            return fused.scale_sum_into(out, aggregated[:, :numel], ctx.segments, factors, scratch)


class GlobalQSGDExp(Int8Codes):
    """Global-QSGD exponential dithering: power-of-two levels against the global scale per parameter.

    Sums of powers of two are not powers of two, so a native SUM cannot add the codes: a ring
    reduce-scatter decodes, adds and re-encodes (unbiased stochastic rounding) at every hop, then
    an allgather. b bits give 2^(b-1)-1 exponents per sign. Wire: 8 bits/element (int8 codes).
    Unbiased except when a partial sum exceeds the top level (saturates; see quantize).
    """

    name, collective, unbiased = "gqsgd-exp", "ring", True

    def encode(self, x, ctx):
        with ctx.timed("encode_s"):
            s = ctx.segments
            return fused.exp_encode(x, s, ctx.scales, ctx.noise_keys, Q.exp_top_exponent(ctx.world_size), self.levels,
                                    ctx.buffer("exp codes", x.numel(), torch.int8, x.device))

    def combine(self, a, b, hop_key: int, ctx):
        """Merge two chunks of codes at one ring hop; the noise is keyed by the hop and this rank."""
        with ctx.timed("decode_s"):
            return fused.exp_combine(a, b, ctx.noise_keys[0] ^ hop_key, Q.exp_top_exponent(ctx.world_size), self.levels,
                                     ctx.buffer("exp hop", 2 * a.numel(), torch.float32, a.device))

    def decode(self, aggregated, out, ctx):
        with ctx.timed("decode_s"):
            return fused.scale_into(out, aggregated, ctx.segments, ctx.scales / ctx.world_size,
                                    top=Q.exp_top_exponent(ctx.world_size))


class Sparsifier(Codec):
    """Shared by top-k and random-k: k_p = ceil(ratio * numel_p) coordinates of each parameter's
    EF21 residual grad - g_i, placed in fixed slots (offsets `kofs`) of one payload per bucket."""

    unbiased, uses_feedback = False, True

    def __init__(self, ratio: float = 0.01):
        if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) or not 0.0 < ratio <= 1.0:
            raise ValueError(f"ratio must be a number in (0, 1], got ratio={ratio!r}")
        self.ratio = ratio

    def params(self):
        return {"ratio": self.ratio}

    def k(self, numel: int) -> int:
        return max(1, math.ceil(self.ratio * numel))

    def slots(self, s: Segments) -> dict:
        """k per parameter, the first slot of each parameter and the parameter of every slot."""
        k = torch.clamp(torch.ceil(self.ratio * s.sizes.double()).long(), min=1)
        kofs = k.cumsum(0) - k
        slot_seg = torch.repeat_interleave(torch.arange(s.count, device=k.device), k)
        within = torch.arange(slot_seg.numel(), device=k.device) - kofs[slot_seg]
        return {"k": k, "kofs": kofs, "slot_seg": slot_seg, "within": within, "total": int(k.sum())}


class TopK(Sparsifier):
    """Top-k of each parameter's EF21 residual; supports differ per worker, so allgather (int32
    index + fp32 value per kept element): 64 * ratio bits/element. Biased; EF21 keeps what it drops.

    Selection is a sampled threshold: each parameter's threshold is the (1 - k/numel) quantile of
    TOPK_SAMPLES of its residuals (all of them in smaller parameters, where it is exact up to
    ties); the first k coordinates at or above it are sent, unused slots send a zero.
    """

    name, collective, needs_scales = "topk", "allgather", False

    def wire_bits(self, world_size):
        return 64.0 * self.ratio

    def _tables(self, s: Segments) -> dict:
        tables = self.slots(s)
        samples = torch.clamp(s.sizes, max=TOPK_SAMPLES)
        j = torch.arange(TOPK_SAMPLES, device=s.sizes.device)
        valid = j[None, :] < samples[:, None]
        spread = (j[None, :] * s.sizes[:, None]) // samples[:, None]  # evenly spread inside the parameter
        tables["sample_index"] = torch.where(valid, s.starts.long()[:, None] + spread, 0)
        tables["sample_valid"] = valid
        # rank of the threshold among the sorted samples: the sample fraction k/numel lies above it
        rank = torch.ceil(samples.double() * tables["k"] / s.sizes).long() - 1
        tables["rank"] = torch.clamp(rank, 0)
        tables["top"] = int(tables["rank"].max()) + 1  # only that many of the largest samples are needed
        tables["ends"] = s.starts.long() + s.sizes
        tables["unused"] = F.pad(s.starts.long()[tables["slot_seg"]], (0, 1))  # an unused slot: a zero at its start
        return tables

    def encode(self, x, ctx):
        with ctx.timed("encode_s"):
            s, fb = ctx.segments, ctx.feedback
            t = ctx.table(self.describe(), lambda: self._tables(s))
            sampled = (x[t["sample_index"]] - fb.local[t["sample_index"]]).abs()
            sampled = torch.where(t["sample_valid"], sampled, -1.0).topk(t["top"], dim=1).values
            threshold = sampled.gather(1, t["rank"][:, None]).squeeze(1)
            mask = ctx.buffer("topk candidates", x.numel(), torch.int8, x.device)
            chosen = fused.flag_indices(fused.at_or_above(x, fb.local, s, threshold, mask))
            # the first k picks of each parameter go to its slots, the rest to one spare slot past the end;
            # small-table lookups and index_copy_, no boolean masks (each a nonzero): 16 -> 8 ms at 16M elements
            seg_of = torch.bucketize(chosen, t["ends"], right=True)
            first = torch.searchsorted(chosen, s.starts.long())  # where each parameter's picks begin
            within = torch.arange(chosen.numel(), device=x.device) - first.index_select(0, seg_of)
            total = t["total"]
            slot = torch.where(within < t["k"].index_select(0, seg_of), t["kofs"].index_select(0, seg_of) + within, total)
            index = ctx.buffer("topk index", total + 1, torch.int64, x.device).copy_(t["unused"])
            values = ctx.buffer("topk values", total + 1, torch.float32, x.device).zero_()
            index.index_copy_(0, slot, chosen)
            values.index_copy_(0, slot, x.index_select(0, chosen) - fb.local.index_select(0, chosen))
            ctx.sent = (index[:total], values[:total])
            return torch.cat([index[:total].to(torch.int32), values[:total].view(torch.int32)])

    def decode(self, aggregated, out, ctx):
        with ctx.timed("decode_s"):
            k = aggregated.shape[1] // 2
            index = aggregated[:, :k].reshape(-1).long()
            values = aggregated[:, k:].contiguous().view(torch.float32).reshape(-1) / ctx.world_size
            return ctx.feedback.advance(*ctx.sent, index, values, out)


class RandomK(Sparsifier):
    """Random-k: per parameter and step, a comb of k coordinates (stride numel // k, random offset)
    drawn from keys shared by all ranks, so every worker picks the same coordinates; every
    coordinate is picked with probability k/numel. The values travel as int32 fixed point against
    a global scale per parameter (the header's MAX of the picked |values|; the header also carries each
    parameter's max |g|, so NaN/Inf outside the picks raise too), so the native SUM is
    exact: the mean does not depend on the ring's chunking or the bucket layout. 32 * ratio
    bits/element. Biased (unscaled); EF21 keeps what it drops.
    """

    name, collective, header_entries = "randomk", "allreduce", 2
    FIXED = 1 << 30  # n workers' codes of at most FIXED / n each sum below 2**31

    def wire_bits(self, world_size):
        return 32.0 * self.ratio

    def local_scales(self, x, ctx):
        """Picks the coordinates (shared keys); returns max |picked residual| per parameter (the scale),
        then max |g| per parameter (so NaN/Inf anywhere in the gradient raise, not only in the picks)."""
        s, fb = ctx.segments, ctx.feedback
        t = ctx.table(self.describe(), lambda: self.slots(s))
        offset = (fused.hash32(ctx.shared_keys).long() & 0x7FFFFFFF) % s.sizes  # per parameter
        stride = s.sizes // t["k"]
        seg = t["slot_seg"]
        index = s.starts.long()[seg] + (offset[seg] + t["within"] * stride[seg]) % s.sizes[seg]
        values = x[index].float() - fb.local[index]
        ctx.sent = (index, values)
        picked = torch.zeros(s.count, device=x.device).scatter_reduce(0, seg, values.abs(), "amax")
        return torch.cat([picked, s.absmax(x)])

    def scale_params(self, ctx):
        return torch.arange(ctx.segments.count, device=ctx.segments.sizes.device).repeat(2)

    def encode(self, x, ctx):
        with ctx.timed("encode_s"):
            index, values = ctx.sent
            step = (ctx.scales * (ctx.world_size / self.FIXED))[ctx.tables[self.describe()]["slot_seg"]]
            codes = torch.round(values / step)
            ctx.sent = (index, codes * step)  # what this rank really sent, for EF21
            return codes.to(torch.int32)

    def decode(self, aggregated, out, ctx):
        with ctx.timed("decode_s"):
            step = (ctx.scales / self.FIXED)[ctx.tables[self.describe()]["slot_seg"]]
            return ctx.feedback.advance(*ctx.sent, ctx.sent[0], aggregated.float() * step, out)


class Chooser(Protocol):
    """Which codec a bucket uses this step. A Codec is one (the same codec every bucket and step);
    a Planner picks per bucket and step."""

    @property
    def memory_codec(self) -> Codec | None:
        """The codec whose error-feedback state the store keeps for every bucket (None: stateless)."""

    def codec_for(self, index: int, numel: int) -> Codec: ...

    def describe(self) -> str: ...


@runtime_checkable
class Planner(Chooser, Protocol):
    """A chooser that learns from the run (Kimad's AdaptivePlanner). Its choice is checked bucket by bucket
    across ranks in the header; it sees the link (`attach`), the buckets' errors when it asks for them
    (`wants_errors`, `observe`) and each step's end; its state goes into the hook's checkpoints."""

    def attach(self, communicator) -> None: ...

    def wants_errors(self, step: int) -> bool: ...

    def observe(self, index: int, x: torch.Tensor, ctx: Context, codec: Codec) -> None: ...

    warm: set  # (bucket, option) to run once before the option is tried (`prepare`); empty: nothing to do
    unplanned: Codec  # what a bucket without a plan sends (codec_for), a step or two: its kernels stay eager

    def prepare(self, index: int, x: torch.Tensor, ctx: Context) -> None: ...

    def plain(self, step: int) -> bool: ...

    @property
    def relays(self) -> bool: ...

    def observes(self, step: int) -> bool: ...

    def end_step(self, communicator, step: int, backward_s: float, codec_s: float) -> dict: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...
