"""Gradient codecs: one flat bucket -> one payload tensor -> the mean over workers.

A codec declares how its payloads are aggregated (``collective``: allreduce, allgather or ring),
its wire cost (``wire_bits(world_size)``: payload bits per gradient element each rank
contributes, per-bucket scalars excluded) and whether its estimate of the mean is unbiased. It
encodes on the sending side and decodes what the collective returns; it never talks to the
network itself (see collectives.Link), which keeps every codec a few lines of arithmetic.

Codecs with ``needs_header`` get ctx.scale = the global max |g| of their parameter (one allreduce
MAX per bucket of every parameter's max, plus the non-finite flag and the plan check).
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from . import quantize as Q
from .feedback import EF21

BITS_RANGE = range(2, 9)
ENCODINGS = ("packed", "int8")


@dataclass
class Context:
    """What a codec may use for one bucket in one step (built by the hook, or by time_codec)."""

    world_size: int
    generator: torch.Generator          # this rank's own rounding noise
    shared_seed: int = 0                # identical on every rank for this bucket and step
    scale: float = 0.0                  # global max |g| of this parameter (codecs with needs_header)
    feedback: EF21 | None = None
    sent: tuple | None = None           # (index, values) this rank sent, for EF21
    seconds: dict = field(default_factory=lambda: {"encode_s": 0.0, "decode_s": 0.0})

    @contextmanager
    def timed(self, key: str):
        start = time.perf_counter()
        yield
        self.seconds[key] += time.perf_counter() - start


class Codec:
    name: ClassVar[str]
    collective: ClassVar[str]          # "allreduce" | "allgather" | "ring"
    unbiased: ClassVar[bool]
    needs_header: ClassVar[bool] = True
    uses_feedback: ClassVar[bool] = False

    def wire_bits(self, world_size: int) -> float:
        raise NotImplementedError

    def encode(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, aggregated: torch.Tensor, numel: int, ctx: Context) -> torch.Tensor:
        raise NotImplementedError

    def params(self) -> dict:
        """The parameters that define the codec (compared across ranks, shown in records)."""
        return {}

    def describe(self) -> str:
        args = ",".join(f"{k}={v}" for k, v in self.params().items())
        return f"{self.name}({args})" if args else self.name


class NoCompression(Codec):
    """fp32 allreduce of grad / n: the plain DDP baseline. 32 bits/element, exact."""

    name, collective, unbiased, needs_header = "none", "allreduce", True, False

    def wire_bits(self, world_size):
        return 32.0

    def encode(self, x, ctx):
        with ctx.timed("encode_s"):
            return x / ctx.world_size

    def decode(self, aggregated, numel, ctx):
        return aggregated


class Cast(Codec):
    """Cast to 16 bits, allreduce, cast back. 16 bits/element.

    Divides by n BEFORE the sum so fp16 cannot overflow where fp32 would not. Round-to-nearest
    is deterministic: biased by at most half a unit in the last place (2^-11 relative for fp16,
    2^-8 for bf16) per addition.
    """

    collective, unbiased, needs_header = "allreduce", False, False

    def __init__(self, name: str, dtype: torch.dtype):
        self.name, self.dtype = name, dtype

    def wire_bits(self, world_size):
        return 16.0

    def encode(self, x, ctx):
        with ctx.timed("encode_s"):
            return (x / ctx.world_size).to(self.dtype)

    def decode(self, aggregated, numel, ctx):
        with ctx.timed("decode_s"):
            return aggregated.to(torch.float32)


class Int8Codes(Codec):
    """Codecs whose codes travel as int8 whatever ``bits`` (2^(bits-1)-1 levels per sign): 8 bits/element."""

    def __init__(self, bits: int = 8):
        self.bits, self.levels = bits, Q.levels_per_side(bits)

    def params(self):
        return {"bits": self.bits}

    def wire_bits(self, world_size):
        return 8.0


class QSGD(Int8Codes):
    """Classic QSGD: each worker's own scale (its max |g|), 2^(b-1)-1 levels per sign, stochastic
    rounding. Scales differ per worker, so codes cannot be summed: allgather + decode each.
    Wire: 8 bits/element (int8 codes) + one fp32 scale per parameter; the allgather makes every rank
    receive n such payloads. Unbiased; |error| <= mean_i(scale_i) / levels per element.
    """

    name, collective, unbiased = "qsgd", "allgather", True

    def encode(self, x, ctx):
        with ctx.timed("encode_s"):
            own_scale = x.abs().max().reshape(1)
            step = own_scale / self.levels if own_scale > 0 else torch.ones(1, device=x.device)
            codes = Q.stochastic_round(x / step, ctx.generator).to(torch.int8)
            return torch.cat([codes, own_scale.to(torch.float32).view(torch.int8)])

    def decode(self, aggregated, numel, ctx):
        with ctx.timed("decode_s"):
            codes = aggregated[:, :numel].to(torch.float32)
            scales = aggregated[:, numel:].contiguous().view(torch.float32)  # (n, 1)
            return (codes * (scales / self.levels)).mean(dim=0)


class GlobalQSGD(Codec):
    """Global-QSGD standard dithering: one global scale, so integer codes add up in a native SUM.

    encoding="packed": 2^(b-1)-1 levels per sign per worker, offset codes packed into int32/int64
        words with fields wide enough that the SUM of n workers never carries (quantize.pack);
        wire bits = word bits / fields per word, e.g. 9.1 at b=8, n<=2; 10.7 at n=3,4.
    encoding="int8" (b=8, the paper's layout): floor(127/n) levels per worker, so the int8 SUM
        stays within +-127 for any n <= 127. Wire: 8 bits/element.
    Unbiased; |error| <= scale / levels per element, plus one fp32 header per bucket.
    """

    name, collective, unbiased = "gqsgd", "allreduce", True

    def __init__(self, bits: int = 8, encoding: str = "packed"):
        if encoding not in ENCODINGS:
            raise ValueError(f"encoding={encoding!r} is not one of {ENCODINGS}")
        if encoding == "int8" and bits != 8:
            raise ValueError(f"encoding='int8' is the paper's 8-bit layout: bits must be 8, got bits={bits}; use encoding='packed'")
        self.bits, self.encoding = bits, encoding

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

    def encode(self, x, ctx):
        with ctx.timed("encode_s"):
            levels = self.levels(ctx.world_size)
            codes = Q.stochastic_round(x * (levels / ctx.scale), ctx.generator)
            if self.encoding == "int8":
                return codes.to(torch.int8)
            return Q.pack((codes + levels).to(torch.int32), levels, ctx.world_size)

    def decode(self, aggregated, numel, ctx):
        with ctx.timed("decode_s"):
            n, levels = ctx.world_size, self.levels(ctx.world_size)
            if self.encoding == "int8":
                sums = aggregated.to(torch.float32)
            else:
                sums = (Q.unpack(aggregated, levels, n, numel) - n * levels).to(torch.float32)
            return sums * (ctx.scale / (levels * n))


class GlobalQSGDExp(Int8Codes):
    """Global-QSGD exponential dithering: power-of-two levels against the global scale.

    Sums of powers of two are not powers of two, so a native SUM cannot add the codes: a ring
    reduce-scatter decodes, adds and re-encodes (unbiased stochastic rounding) at every hop, then
    an allgather. b bits give 2^(b-1)-1 exponents per sign. Wire: 8 bits/element (int8 codes).
    Unbiased except when a partial sum exceeds the top level (saturates; see quantize).
    """

    name, collective, unbiased = "gqsgd-exp", "ring", True

    def encode(self, x, ctx):
        with ctx.timed("encode_s"):
            return Q.exp_encode(x / ctx.scale, Q.exp_top_exponent(ctx.world_size), self.levels, ctx.generator)

    def combine(self, a, b, ctx):
        with ctx.timed("decode_s"):
            top = Q.exp_top_exponent(ctx.world_size)
            return Q.exp_encode(Q.exp_decode(a, top) + Q.exp_decode(b, top), top, self.levels, ctx.generator)

    def decode(self, aggregated, numel, ctx):
        with ctx.timed("decode_s"):
            return Q.exp_decode(aggregated, Q.exp_top_exponent(ctx.world_size)) * (ctx.scale / ctx.world_size)


class Sparsifier(Codec):
    """Shared by top-k and random-k: k = ceil(ratio * numel) coordinates of grad - g_i, EF21."""

    unbiased, uses_feedback = False, True

    def __init__(self, ratio: float = 0.01):
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"ratio must be in (0, 1], got ratio={ratio}")
        self.ratio = ratio

    def params(self):
        return {"ratio": self.ratio}

    def k(self, numel: int) -> int:
        return max(1, math.ceil(self.ratio * numel))


class TopK(Sparsifier):
    """Top-k of the EF21 residual; supports differ per worker, so allgather (int32 index + fp32
    value per kept element): 64 * ratio bits/element. Biased; EF21 keeps what it drops."""

    name, collective = "topk", "allgather"

    def wire_bits(self, world_size):
        return 64.0 * self.ratio

    def encode(self, x, ctx):
        with ctx.timed("encode_s"):
            residual = ctx.feedback.residual(x)
            index = residual.abs().topk(self.k(x.numel()), sorted=False).indices
            ctx.sent = (index, residual[index])
            return torch.cat([index.to(torch.int32), residual[index].view(torch.int32)])

    def decode(self, aggregated, numel, ctx):
        with ctx.timed("decode_s"):
            k = aggregated.shape[1] // 2
            index = aggregated[:, :k].reshape(-1).to(torch.int64)
            values = aggregated[:, k:].contiguous().view(torch.float32).reshape(-1) / ctx.world_size
            return ctx.feedback.advance(*ctx.sent, index, values)


class RandomK(Sparsifier):
    """Random-k with a seed shared by all ranks for this bucket and step, so every worker picks the
    same coordinates and the values add up in a native SUM: 32 * ratio bits/element. Biased
    (unscaled); EF21 keeps what it drops."""

    name, collective = "randomk", "allreduce"

    def wire_bits(self, world_size):
        return 32.0 * self.ratio

    def encode(self, x, ctx):
        with ctx.timed("encode_s"):
            shared = torch.Generator(device=x.device).manual_seed(ctx.shared_seed)
            index = torch.randperm(x.numel(), generator=shared, device=x.device)[: self.k(x.numel())]
            values = ctx.feedback.residual(x)[index]
            ctx.sent = (index, values)
            return values / ctx.world_size

    def decode(self, aggregated, numel, ctx):
        with ctx.timed("decode_s"):
            return ctx.feedback.advance(*ctx.sent, ctx.sent[0], aggregated)


def _factories():
    return {
        "none": lambda bits, encoding, ratio: NoCompression(),
        "fp16": lambda bits, encoding, ratio: Cast("fp16", torch.float16),
        "bf16": lambda bits, encoding, ratio: Cast("bf16", torch.bfloat16),
        "qsgd": lambda bits, encoding, ratio: QSGD(bits),
        "gqsgd": lambda bits, encoding, ratio: GlobalQSGD(bits, encoding),
        "gqsgd-exp": lambda bits, encoding, ratio: GlobalQSGDExp(bits),
        "topk": lambda bits, encoding, ratio: TopK(ratio),
        "randomk": lambda bits, encoding, ratio: RandomK(ratio),
    }


CODEC_NAMES = tuple(_factories())


def make_codec(name: str, *, bits: int = 8, encoding: str = "packed", ratio: float = 0.01) -> Codec:
    """Build a codec by name; parameters a codec does not use are ignored."""
    factories = _factories()
    if name not in factories:
        raise ValueError(f"unknown codec {name!r}; choose one of {', '.join(CODEC_NAMES)}")
    if bits not in BITS_RANGE:
        raise ValueError(f"bits must be in {BITS_RANGE.start}..{BITS_RANGE.stop - 1}, got bits={bits}")
    return factories[name](bits, encoding, ratio)


def time_codec(codec: Codec, numel: int, world_size: int, repeats: int = 5, seed: int = 0) -> dict:
    """Median encode and decode seconds for one bucket of ``numel`` on this machine, in-process.

    The aggregated payload is faked as n copies of one worker's payload (a valid input for every
    codec: integer sums stay within their bounds); for the ring codec, decode includes the n - 1
    per-hop combines of one chunk each.
    """
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=generator)
    encode_s, decode_s = [], []
    for _ in range(repeats):
        ctx = Context(world_size, generator, shared_seed=seed, scale=float(x.abs().max()),
                      feedback=EF21(numel) if codec.uses_feedback else None)
        payload = codec.encode(x, ctx)
        if codec.collective == "allreduce":
            aggregated = payload * world_size
        elif codec.collective == "allgather":
            aggregated = payload.expand(world_size, *payload.shape).contiguous()
        else:
            chunk = payload[: math.ceil(numel / world_size)]
            for _ in range(world_size - 1):
                codec.combine(chunk, chunk, ctx)
            aggregated = payload
        codec.decode(aggregated, numel, ctx)
        encode_s.append(ctx.seconds["encode_s"])
        decode_s.append(ctx.seconds["decode_s"])
    return {"encode_s": sorted(encode_s)[repeats // 2], "decode_s": sorted(decode_s)[repeats // 2]}
