"""Pure quantisation arithmetic shared by the codecs: no process groups, no state.

Level counts, the packed word layout (fields wide enough that a native integer SUM never
carries) and exponential dithering; the per-element rounding of the other codecs is in fused.py.
"""

from __future__ import annotations

import math

import torch


def levels_per_side(bits: int) -> int:
    """Non-negative levels a signed ``bits``-bit code can hold on each side of zero: 2**(bits-1) - 1."""
    return (1 << (bits - 1)) - 1


# ---- packed offset codes: n workers' codes summed by one native integer SUM -------------------

# A word never uses its sign bit, so the integer SUM of packed words can never overflow.
WORD_TYPES = ((torch.int32, 31), (torch.int64, 63))


def field_width(levels: int, world_size: int) -> int:
    """Bits per field so that the sum of ``world_size`` offset codes in [0, 2*levels] never carries."""
    return max(1, (2 * levels * world_size).bit_length())


def word_layout(levels: int, world_size: int) -> tuple[torch.dtype, int, int]:
    """(word dtype, field width, fields per word) with the fewest wire bits per element.

    int32 unless int64 packs strictly denser (e.g. 9-bit fields: 3 per int32 = 10.7 bits/element,
    7 per int64 = 9.1). Raises when a field does not fit even an int64 word.
    """
    width = field_width(levels, world_size)
    best = None
    for dtype, usable in WORD_TYPES:
        per_word = usable // width
        if per_word and (best is None or (usable + 1) / per_word < (best[1] + 1) / best[2]):
            best = (dtype, usable, per_word)
    if best is None:
        raise ValueError(
            f"world_size={world_size} with {levels} levels per side needs {width}-bit fields, "
            f"wider than a 63-bit word; use fewer bits"
        )
    return best[0], width, best[2]


def packed_bits_per_element(levels: int, world_size: int) -> float:
    dtype, _, per_word = word_layout(levels, world_size)
    return torch.iinfo(dtype).bits / per_word


# ---- exponential (power-of-two) dithering ----------------------------------------------------


def exp_top_exponent(world_size: int) -> int:
    """Largest power of two a code can hold, relative to the global max |g| = 1.

    A ring partial sum of n values each <= 1 is <= n; one spare doubling covers stochastic
    rounding up. Larger magnitudes saturate (clamped to the top level; astronomically rare).
    """
    return math.ceil(math.log2(world_size)) + 1


def exp_smallest(top: int, exponents: int) -> float:
    """The smallest power-of-two level, 2**(top + 1 - exponents) (>= 2**-125 for exponents <= 127: a normal float)."""
    return 2.0 ** (top + 1 - exponents)


def exp_encode(x: torch.Tensor, top: int, exponents: int, noise: torch.Tensor,
               smallest: float | None = None) -> torch.Tensor:
    """Round |x| unbiasedly to a neighbouring power of two; return int8 codes.

    Code c != 0 means sign(c) * 2**(top + 1 - |c|); c = 0 means zero. ``exponents`` codes per sign
    cover 2**top down to 2**(top + 1 - exponents); below that, values round to 0 or the smallest
    level with the probability that keeps the mean. ``noise``: U[0, 1), one per element.
    The power of two at or below |x| is read from its float32 exponent bits (integer arithmetic and
    exact power-of-two multiplies: torch.compile fuses it into one pass, where frexp falls back).
    Magnitudes from 2**(top + 1) up, inf included, saturate at the top level.
    Compiled callers pass ``smallest`` = `exp_smallest` (top, exponents): computed inside a kernel from
    symbolic ints, the power became a scalar std::pow per vector of 8 (3.1 against 0.6 ms per million).
    """
    mag = x.abs().float()
    smallest = exp_smallest(top, exponents) if smallest is None else smallest
    biased = mag.view(torch.int32) >> 23  # 2 ** (biased - 127) <= mag < 2 ** (biased - 126)
    tiny = mag < smallest
    inverse = ((254 - biased).clamp(min=0) << 23).view(torch.float32)  # 2 ** (127 - biased)
    up = (noise < torch.where(tiny, mag * (1.0 / smallest), mag * inverse - 1.0)).to(torch.int32)
    code = torch.where(tiny, up * exponents, (top + 128 - biased - up).clamp(1, exponents))  # clamp(1): saturate
    return (code * torch.sign(x)).to(torch.int8)


def exp_decode(codes: torch.Tensor, top: int) -> torch.Tensor:
    """The values of exp_encode's codes. 2**(top + 1 - |c|) is built from its float32 exponent bits (a
    normal float for |c| <= 127): exp2 cost 1.3 ms per million elements compiled, 1 thread."""
    c = codes.to(torch.float32)
    mag = ((top + 128 - c.abs()).to(torch.int32) << 23).view(torch.float32)
    return torch.where(c == 0, torch.zeros_like(c), torch.sign(c) * mag)
