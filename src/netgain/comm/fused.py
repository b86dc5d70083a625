"""The codecs' per-element arithmetic on a whole flat bucket: one source, compiled or eager.

Every function takes a bucket's flat gradient and its `Segments` (the per-parameter table that
`Segments.build` makes once per bucket layout) and works on all parameters at once: no Python
loop over parameters. Per-parameter values (scales, noise keys) reach each element through its
segment id.

Randomness is counter-based: the stochastic-rounding noise of an element is a hash of its index
inside its parameter, keyed by (seed, parameter, step, rank). It holds no state to checkpoint,
CPU and GPU agree, and it does not depend on how DDP groups parameters into buckets.

`kernel(fn)` runs fn through torch.compile (C++ on CPU, Triton on GPU) where a compiler is
present and NETGAIN_COMPILE is not 0, else eagerly. The maths is integer arithmetic, one float
multiply per value and exact comparisons, so both paths give the same codes bit for bit.
"""

from __future__ import annotations

import functools
import os
import shutil
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

COMPILE_MODES = ("auto", "1", "0")
BLOCK = 1024  # elements per block of the segmented max (blocks inside one parameter reduce densely)
_M1, _M2 = 0x7FEB352D, 0x46CA68B  # odd multipliers < 2**31: int32 products wrap the same everywhere


def compile_enabled(device: torch.device) -> bool:
    """NETGAIN_COMPILE=1 forces torch.compile, 0 forbids it; auto: compile where a compiler exists."""
    mode = os.environ.get("NETGAIN_COMPILE", "auto")
    if mode not in COMPILE_MODES:
        raise ValueError(f"NETGAIN_COMPILE={mode!r} is not one of {COMPILE_MODES}")
    if mode != "auto":
        return mode == "1"
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
        return True
    return device.type == "cpu" and any(shutil.which(cc) for cc in ("cc", "gcc", "g++", "clang"))


def kernel(fn):
    """fn compiled (dynamic shapes: one compile serves every bucket size) or eager, chosen per device."""
    compiled = None

    @functools.wraps(fn)
    def run(*args, **kwargs):
        nonlocal compiled
        if not compile_enabled(args[0].device):
            return fn(*args, **kwargs)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=True)
        return compiled(*args, **kwargs)

    run.eager = fn
    return run


# ---- counter-based noise ----------------------------------------------------------------------


def hash32(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (xor-shift-multiply) on int32; shifts are logical by masking."""
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * _M1
    h = h ^ ((h >> 15) & 0x1FFFF)
    h = h * _M2
    return h ^ ((h >> 16) & 0xFFFF)


def uniform(counter: torch.Tensor) -> torch.Tensor:
    """U[0, 1) with 24 random bits from an int32 counter (exact in float32)."""
    return ((hash32(counter) >> 8) & 0xFFFFFF).to(torch.float32) * (1.0 / (1 << 24))


def name_key(name: str) -> int:
    """A parameter's noise key: a hash of its name, identical on every rank and in every run."""
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def step_keys(keys: torch.Tensor, seed: int, step: int, rank: int) -> torch.Tensor:
    """Per-parameter int32 keys for one (seed, step, rank): a small tensor op, no loop, no sync.

    rank = -1 gives keys shared by every rank (random-k's coordinates).
    """
    mix = zlib.crc32(f"{seed}:{step}:{rank}".encode()) & 0x7FFFFFFF
    return hash32(keys ^ mix)


# ---- the bucket's segment table -------------------------------------------------------------


@dataclass
class Segments:
    """Where each parameter lies in a flat bucket; built once per DDP bucket layout."""

    numel: int
    starts: torch.Tensor       # int32 (P,) first element of each parameter
    sizes: torch.Tensor        # int64 (P,)
    keys: torch.Tensor         # int32 (P,) name_key of each parameter
    seg: torch.Tensor          # int32 (numel,) segment id of every element
    block_owner: torch.Tensor  # int64 (numel // BLOCK,) the parameter a whole block lies in, else P
    edge_index: torch.Tensor   # int64: elements of blocks shared by parameters, and of the tail
    edge_seg: torch.Tensor     # int64: their segment ids

    @property
    def count(self) -> int:
        return self.starts.numel()

    @classmethod
    def build(cls, sizes: list[int], keys: list[int], device) -> "Segments":
        sizes_t = torch.tensor(sizes, dtype=torch.int64, device=device)
        ends = sizes_t.cumsum(0)
        starts = ends - sizes_t
        numel = int(ends[-1])
        seg = torch.repeat_interleave(torch.arange(len(sizes), device=device, dtype=torch.int32), sizes_t)
        blocks = numel // BLOCK
        first = seg[: blocks * BLOCK].view(blocks, BLOCK)
        whole = first[:, 0] == first[:, -1]
        owner = torch.where(whole, first[:, 0].long(), torch.full_like(whole, len(sizes), dtype=torch.int64))
        shared = (~whole).repeat_interleave(BLOCK)
        edge_index = torch.cat([shared.nonzero().flatten(),
                                torch.arange(blocks * BLOCK, numel, device=device)])
        return cls(numel, starts.to(torch.int32), sizes_t,
                   torch.tensor(keys, dtype=torch.int32, device=device), seg, owner,
                   edge_index, seg[edge_index].long())

    def absmax(self, x: torch.Tensor) -> torch.Tensor:
        """max |x| of every parameter (NaN and Inf propagate): dense block maxima plus the shared blocks."""
        out = torch.zeros(self.count + 1, dtype=torch.float32, device=x.device)
        blocks = self.block_owner.numel()
        if blocks:
            out.scatter_reduce_(0, self.block_owner, _block_absmax(x[: blocks * BLOCK]), "amax")
        out.scatter_reduce_(0, self.edge_seg, x[self.edge_index].abs().float(), "amax")
        return out[:-1]


@kernel
def _block_absmax(x: torch.Tensor) -> torch.Tensor:
    return x.view(-1, BLOCK).abs().amax(1).float()


# ---- stochastic rounding against per-parameter scales ---------------------------------------


def _rounded(x, seg, starts, multiplier, noise_keys, levels: int):
    """Unbiased integer codes of x * multiplier[param] in [-levels, levels], as float."""
    index = torch.arange(x.numel(), device=x.device, dtype=torch.int32)
    s = seg.long()
    u = uniform((index - starts[s]) ^ noise_keys[s])
    q = x.float() * multiplier[s]
    low = torch.floor(q)
    return (low + (u < q - low).float()).clamp(-levels, levels)


@kernel
def round_int8(x, seg, starts, multiplier, noise_keys, levels: int) -> torch.Tensor:
    return _rounded(x, seg, starts, multiplier, noise_keys, levels).to(torch.int8)


@kernel
def round_packed(x, seg, starts, multiplier, noise_keys, levels: int, per_word: int, width: int,
                 wide: bool) -> torch.Tensor:
    """Offset codes in [0, 2 levels], `per_word` fields of `width` bits per int32 (int64 if wide) word.

    One field at a time over a (words, per_word) view: the compiler fuses the fields into one pass
    (a reduction over the small axis compiles badly on CPU).
    """
    pad = -x.numel() % per_word
    xs, segs = F.pad(x, (0, pad)).view(-1, per_word), F.pad(seg, (0, pad), value=0).view(-1, per_word)
    first = torch.arange(xs.shape[0], device=x.device, dtype=torch.int32) * per_word
    dtype = torch.int64 if wide else torch.int32
    words = None
    for j in range(per_word):
        s = segs[:, j].long()
        u = uniform((first + j - starts[s]) ^ noise_keys[s])
        q = xs[:, j].float() * multiplier[s]
        low = torch.floor(q)
        field = ((low + (u < q - low).float()).clamp(-levels, levels) + levels).to(dtype) << (width * j)
        words = field if words is None else words | field
    return words


@kernel
def scale_into(out, codes, seg, factor) -> torch.Tensor:
    """out = codes * factor[param], written into the bucket's own buffer (decode in place)."""
    out.copy_(codes.float() * factor[seg.long()])
    return out


@kernel
def unpack_scale_into(out, words, seg, factor, offset: int, per_word: int, width: int) -> torch.Tensor:
    """out = (field sums - offset) * factor[param], from summed packed words, into the bucket's buffer."""
    mask = (1 << width) - 1  # a field (a sum of n codes) fits 31 bits: int32 from here on
    fields = torch.stack([((words >> (width * j)) & mask).to(torch.int32) for j in range(per_word)], dim=1)
    out.copy_((fields.view(-1)[: out.numel()] - offset).float() * factor[seg.long()])
    return out


@kernel
def cast_scaled(x, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return (x * scale).to(dtype)


@kernel
def uniform_noise(x, seg, starts, noise_keys) -> torch.Tensor:
    """The noise of every element (for codecs whose rounding is not a plain multiply-and-floor)."""
    index = torch.arange(x.numel(), device=x.device, dtype=torch.int32)
    s = seg.long()
    return uniform((index - starts[s]) ^ noise_keys[s])


@kernel
def at_or_above(x, local, seg, threshold) -> torch.Tensor:
    """|x - local| >= threshold[param]: the top-k candidates of every parameter's EF21 residual."""
    return (x - local).abs() >= threshold[seg.long()]
