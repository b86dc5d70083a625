"""The codecs' per-element arithmetic on a whole flat bucket: one source, compiled or eager.

Every function takes a bucket's flat gradient and its `Segments` (the per-parameter table that
`Segments.build` makes once per bucket layout) and works on all parameters at once: no Python
loop over parameters. Per-parameter values (scales, noise keys) reach each element through its
segment id.

Randomness is counter-based: the stochastic-rounding noise of an element is a hash of its index
inside its parameter, keyed by (seed, parameter, step, rank). It holds no state to checkpoint,
CPU and GPU agree, and it does not depend on how DDP groups parameters into buckets.

Each kernel runs compiled or eagerly, with the same bits either way (kernel.py says how).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import quantize as Q
from .kernel import COMPILE_OPTIONS, kernel

ROW = 1024  # elements per row of a bucket's segment table (Segments)
# Packed words of a bucket with fewer rows than this are all side words (`Words.main`): the packed row path
# costs about ten compiled calls an encode + decode (two int32 halves, their join, one call per field), which
# beats per-element gathers only from about 100 rows (gqsgd 8-bit packed, 2 workers, 1 thread, encode + decode,
# rows / per-element: 16K elements 3.83x, 65K 1.70x, 262K 0.57x, 1M 0.34x with 1 parameter; 2.33x, 1.34x,
# 0.55x, 0.21x with 8; medians of 3 interleaved rounds, in one process, CPU only). The other codecs' row paths
# are one call a pass and keep their rows: per element they ran 1.7-3.4x slower at 65K elements in 8 parameters
# (qsgd 0.29x, gqsgd-exp 0.38x, top-k 0.58x; bench/results/codec_ab_small_buckets.md).
MIN_PACKED_ROWS = 100
# A kernel that packs fields computes every field's codes as one expression over (fields, rows, ROW) and
# ORs its slices together: dynamo traces the rounding once, not once per field (a restarted job's compile,
# warm cache, 4M elements, 2 threads: 2-bit 8.8-11.4 -> 2.6-3.2 s, packed 8-bit 5.8 -> 3.4-4.3 s). Inductor
# would store that expression (more than 50 ops, several users) and read each field back (3.5 against 1.0 ms
# per million); never realizing keeps the one pass.
PACK_OPTIONS = {**COMPILE_OPTIONS, "realize_opcount_threshold": 1 << 20, "realize_acc_reads_threshold": 1 << 20}
_M1, _M2 = 0x7FEB352D, 0x46CA68B  # odd multipliers < 2**31: int32 products wrap the same everywhere


# ---- counter-based noise ----------------------------------------------------------------------


def hash32(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (xor-shift-multiply) on int32; shifts are logical by masking. In place on a copy and one
    scratch tensor: run eagerly on a large bucket each temporary is fresh memory, and in a long-lived process (the lab's
    workers, a second run) eager gqsgd's first step on 6.9 M elements spent 0.96 s of 2.8 in its 4 hashes (a profile)."""
    t = h >> 16
    t &= 0xFFFF
    h = h ^ t
    h *= _M1
    t.copy_(h)
    t >>= 15
    t &= 0x1FFFF
    h ^= t
    h *= _M2
    t.copy_(h)
    t >>= 16
    t &= 0xFFFF
    h ^= t
    return h


def uniform(counter: torch.Tensor) -> torch.Tensor:
    """U[0, 1) with 24 random bits from an int32 counter (exact in float32)."""
    h = hash32(counter)
    h >>= 8
    h &= 0xFFFFFF
    u = h.to(torch.float32)
    u *= 1.0 / (1 << 24)
    return u


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
    """Where each parameter lies in a flat bucket; built once per DDP bucket layout.

    The bucket's head is seen as rows of ROW elements. A row holds at most two parameters in
    almost every bucket: the first up to column `split`, the second from there. Kernels read such
    a row's per-parameter values once per row (a broadcast the compiler vectorises) instead of
    gathering them per element. The few rows that cut three or more parameters, and the tail
    after the last whole row, are `fix`: those elements go through the per-element path. A bucket
    whose rows mostly cut three or more parameters (a low-rank factor's columns of a few hundred
    elements) has no rows: every element is `fix`, and each codec pass is one per-element kernel
    instead of row kernels that would skip most of their rows.
    """

    numel: int
    starts: torch.Tensor       # int32 (P,) first element of each parameter
    sizes: torch.Tensor        # int64 (P,)
    keys: torch.Tensor         # int32 (P,) name_key of each parameter
    seg: torch.Tensor          # int32 (numel,) segment id of every element
    first: torch.Tensor        # int64 (rows,) a row's first parameter (P in a fix row)
    second: torch.Tensor       # int64 (rows,) the parameter from column `split` on (P in a fix row)
    split: torch.Tensor        # int32 (rows,) first column of `second` (ROW when the row has one parameter)
    base_first: torch.Tensor   # int32 (rows,) index inside `first` of the row's column 0
    base_second: torch.Tensor  # int32 (rows,) index inside `second` of the row's column 0
    fix: torch.Tensor          # int64: elements of rows with three or more parameters, and of the tail
    fix_seg: torch.Tensor      # int64: their segment ids
    column: torch.Tensor       # float32 (ROW,) 0..ROW-1: a loaded column vectorises, an in-kernel arange does not (INT_LOADS)
    cache: dict = field(default_factory=dict, repr=False, compare=False)  # index tables kernels derive from these, scratch

    @property
    def count(self) -> int:
        return self.starts.numel()

    @property
    def rows(self) -> int:
        return self.first.numel()

    @classmethod
    def build(cls, sizes: list[int], keys: list[int], device) -> "Segments":
        sizes_t = torch.tensor(sizes, dtype=torch.int64, device=device)
        ends = sizes_t.cumsum(0)
        starts = ends - sizes_t
        numel, count = int(ends[-1]), len(sizes)
        seg = torch.repeat_interleave(torch.arange(count, device=device, dtype=torch.int32), sizes_t)
        rows = numel // ROW
        head = seg[: rows * ROW].view(rows, ROW)
        a, b = head[:, 0].long(), head[:, -1].long()  # a row's ends only: the whole head in int64 was 8 bytes an element
        two = b - a <= 1
        if 2 * int(two.sum()) < rows:  # mostly fix rows: no rows at all (a sync, once per layout)
            rows, a, b, two = 0, a[:0], b[:0], two[:0]
        origin = torch.arange(rows, device=device) * ROW
        fix_rows = (~two).repeat_interleave(ROW)
        fix = torch.cat([fix_rows.nonzero().flatten(), torch.arange(rows * ROW, numel, device=device)])
        dummy = torch.full_like(a, count)
        return cls(numel, starts.to(torch.int32), sizes_t, torch.tensor(keys, dtype=torch.int32, device=device), seg,
                   first=torch.where(two, a, dummy), second=torch.where(two, b, dummy),
                   split=torch.where(two & (b > a), starts[b] - origin, ROW).to(torch.int32),
                   base_first=(origin - starts[a]).to(torch.int32), base_second=(origin - starts[b]).to(torch.int32),
                   fix=fix, fix_seg=seg[fix].long(), column=torch.arange(ROW, device=device, dtype=torch.float32))

    def per_row(self, values: torch.Tensor, pad: float = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """A per-parameter table as (first, second) per row: two gathers of `rows` entries (`pad` in fix rows,
        whose elements the per-element path writes)."""
        padded = F.pad(values, (0, 1), value=pad)
        return padded[self.first], padded[self.second]

    def absmax(self, x: torch.Tensor) -> torch.Tensor:
        """max |x| of every parameter (NaN and Inf propagate): two maxima per row plus the fix elements."""
        out = torch.zeros(self.count + 1, dtype=torch.float32, device=x.device)
        if self.rows:
            high = _row_absmax(_rows(x, self), self.split, self.column)
            out.scatter_reduce_(0, self.first, high[:, 0], "amax")
            out.scatter_reduce_(0, self.second, high[:, 1], "amax")
        if self.fix.numel():
            out.scatter_reduce_(0, self.fix_seg, _abs_elements(x, self.fix), "amax")
        return out[:-1]


@kernel
def _abs_elements(x, index) -> torch.Tensor:
    return x[index].abs().float()


@kernel
def _row_absmax(x2d, split, column) -> torch.Tensor:
    second = column >= split[:, None]
    a = x2d.abs().float()
    zero = torch.zeros((), dtype=torch.float32, device=x2d.device)
    return torch.stack([torch.where(second, zero, a).amax(1), torch.where(second, a, zero).amax(1)], 1)


# ---- stochastic rounding against per-parameter scales ---------------------------------------


def _pick(second, first_values, second_values):
    """Each element's value from its row's (first, second) pair: one broadcast per row, no gather."""
    return torch.where(second, second_values[..., None], first_values[..., None])


def _row_codes(x, split, column, base_first, base_second, mult_first, mult_second, key_first, key_second,
               levels: int):
    """`_round` of rows x (..., ROW) whose per-parameter values come from per-row tables (...)."""
    second = column >= split[..., None]  # the element lies in the row's second parameter
    return _round(x, _pick(second, base_first, base_second) + column.to(torch.int32),
                  _pick(second, mult_first, mult_second), _pick(second, key_first, key_second), levels)


def _round(x, inside, multiplier, key, levels: int):
    """Unbiased integer codes of x * multiplier in [-levels, levels], as float; `inside`: each
    element's index inside its parameter, the counter of its noise."""
    q = x.float() * multiplier
    low = torch.floor(q)
    q -= low  # in place, as hash32
    low += uniform(inside ^ key) < q
    return low.clamp_(-levels, levels)


@kernel
def _round_rows(out2d, x2d, split, column, base_first, base_second, mult_first, mult_second, key_first, key_second,
                levels: int) -> torch.Tensor:
    return out2d.copy_(_row_codes(x2d, split, column, base_first, base_second, mult_first, mult_second, key_first,
                                  key_second, levels))


@kernel
def _round_elements(x, index, seg, starts, multiplier, noise_keys, levels: int) -> torch.Tensor:
    """int8 codes of the elements x[index] (the gather inside the kernel: no pass of its own)."""
    return _element_codes(x, index, seg, starts, multiplier, noise_keys, levels).to(torch.int8)


def _element_codes(x, index, seg, starts, multiplier, noise_keys, levels: int):
    return _round(x[index], index.to(torch.int32) - starts[seg], multiplier[seg], noise_keys[seg], levels)


def round_int8(x: torch.Tensor, s: Segments, multiplier: torch.Tensor, noise_keys: torch.Tensor, levels: int,
               out: torch.Tensor) -> torch.Tensor:
    """``out`` (int8, numel) = codes in [-levels, levels] of x * multiplier[param], stochastically rounded."""
    if s.rows:
        (m1, m2), (k1, k2) = s.per_row(multiplier), s.per_row(noise_keys)
        _round_rows(_rows(out, s), _rows(x, s), s.split, s.column, s.base_first, s.base_second, m1, m2, k1, k2, levels)
    if s.fix.numel():
        out[s.fix] = _round_elements(x, s.fix, s.fix_seg, s.starts, multiplier, noise_keys, levels)
    return out


def _rows(t: torch.Tensor, s: Segments) -> torch.Tensor:
    return t[: s.rows * ROW].view(s.rows, ROW)


# ---- codes packed into integer words, straight from the gradient ---------------------------


@dataclass(frozen=True)
class Words:
    """How codes sit in integer words: ``per_word`` fields of ``width`` bits; a field holds
    (code + offset) & mask. Planar: field j of the first ``main`` words holds elements [j main, (j+1) main),
    so every field is a run of whole rows of the bucket; the elements after them (and those of rows that
    cut three or more parameters) are `side` elements, written and read one by one.

    gqsgd packed: offset = levels, fields never carry under an integer SUM of the words.
    gqsgd int8: 4 fields of 8 bits, offset 0, two's-complement bytes: the SUM runs on the words' bytes as int8.
    """

    dtype: torch.dtype
    width: int
    per_word: int
    offset: int  # added to a code before it is masked into its field; 0: two's-complement fields

    @property
    def mask(self) -> int:
        return (1 << self.width) - 1

    def main(self, s: "Segments") -> int:
        """Words whose fields are whole rows of the bucket's row tables: a multiple of ROW (none under MIN_PACKED_ROWS)."""
        return s.rows // self.per_word * ROW if s.rows >= MIN_PACKED_ROWS else 0

    def count(self, numel: int) -> int:
        return -(-numel // self.per_word)

    def halves(self, s: "Segments") -> torch.Tensor:
        """Scratch for the (low, high) int32 halves of int64 main words, (2, main // ROW, ROW); one per layout."""
        key = ("halves", self.per_word, self.width, self.main(s))
        if key not in s.cache:
            s.cache[key] = torch.empty(2, key[-1] // ROW, ROW, dtype=torch.int32, device=s.seg.device)
        return s.cache[key]

    def side(self, s: "Segments") -> tuple[torch.Tensor, ...]:
        """(element, word, shift, segment id) of the side elements: those of fix rows inside the main words,
        then the tail, planar over the words after the main ones. Built once per layout."""
        key = ("side", self.per_word, self.width, self.main(s))
        if key not in s.cache:
            main = key[-1]
            inside = s.fix[s.fix < self.per_word * main]
            tail = torch.arange(self.per_word * main, s.numel, device=s.seg.device)
            rest = -(-tail.numel() // self.per_word)
            word = torch.cat([inside % max(main, 1), main + (tail - self.per_word * main) % max(rest, 1)])
            field = torch.cat([inside // max(main, 1), (tail - self.per_word * main) // max(rest, 1)])
            index = torch.cat([inside, tail])
            s.cache[key] = (index, word, field * self.width, s.seg[index].long())
        return s.cache[key]


def _pack_graph(half2d, x3d, *tables_and_fields):
    """_round_pack_rows's variant: its fields, unrolled, and its ints (levels, offset, mask, width, shift),
    on which the graph's guards fall."""
    return (x3d.shape[0], *tables_and_fields[-5:])


@kernel(options=PACK_OPTIONS, variant=_pack_graph)
def _round_pack_rows(half2d, x3d, split, column, base_first, base_second, mult_first, mult_second, key_first,
                     key_second, levels: int, offset: int, mask: int, width: int, shift: int) -> torch.Tensor:
    """32 bits of every word: fields from rows x3d[j] (per-row tables viewed (fields, rows)), field j
    shifted left by shift + width * j (right where negative: the high half's first field may straddle
    bit 32); the rounding and the packing in one pass, no code stored in between, bits past 31 drop out.
    int64 words are two such halves, each its own call, joined by `_join_halves`: AVX2 has no int64
    conversions, per-field int64 maths ran 3-6x slower, and both halves in one kernel made inductor
    store every field and read it back (4.0 against 1.0 ms per million elements at 64M, 1 thread)."""
    codes = _row_codes(x3d, split, column, base_first, base_second, mult_first, mult_second, key_first, key_second,
                       levels).to(torch.int32)
    values, out = (codes + offset) & mask, None  # 0 <= value < 2**width
    for j in range(x3d.shape[0]):
        at = shift + width * j
        out = _or(out, values[j] << at if at >= 0 else values[j] >> -at)
    return half2d.copy_(out)


@kernel
def _join_halves(words2d, halves_bits) -> torch.Tensor:
    """int64 words from their (low, high) int32 halves, given as float bits (INT_LOADS)."""
    halves = halves_bits.view(torch.int32)
    return words2d.copy_((halves[1].to(torch.int64) << 32) | (halves[0].to(torch.int64) & 0xFFFFFFFF))


def _or(a, b):
    return b if a is None else a | b


def round_pack(x: torch.Tensor, s: Segments, multiplier: torch.Tensor, noise_keys: torch.Tensor, levels: int,
               layout: Words, out: torch.Tensor) -> torch.Tensor:
    """``out`` (layout.count words) = codes in [-levels, levels] of x * multiplier[param], stochastically
    rounded and packed as ``layout`` says; the same codes as `round_int8`, in one pass over x."""
    main, per_word = layout.main(s), layout.per_word
    if main:
        rows = main // ROW
        tables = [t[: per_word * rows].view(per_word, rows) for t in
                  (s.split, s.base_first, s.base_second, *s.per_row(multiplier), *s.per_row(noise_keys))]
        words, x3d, width = out[:main].view(rows, ROW), x[: per_word * main].view(per_word, rows, ROW), layout.width
        if layout.dtype == torch.int32:  # (target, its fields, their shift): every field of the word
            parts = [(words, slice(None), 0)]
        else:  # the fields below bit 32, and those reaching past it (the straddling one in both)
            halves = layout.halves(s)
            parts = [(halves[0], slice(0, -(-32 // width)), 0),
                     (halves[1], slice(32 // width, None), width * (32 // width) - 32)]
        for target, fields, shift in parts:
            _round_pack_rows(target, x3d[fields], tables[0][fields], s.column, *(t[fields] for t in tables[1:]),
                             levels, layout.offset, layout.mask, width, shift)
        if layout.dtype == torch.int64:
            _join_halves(words, halves.view(torch.float32))
    out[main:] = sum(layout.offset << (layout.width * j) for j in range(per_word))  # every field holds code 0
    index, word, shift, seg = layout.side(s)
    if index.numel():  # their fields hold code 0 (multiplier 0 in fix rows): add the difference
        out.index_add_(0, word, _field_deltas(x, index, seg, shift, s.starts, multiplier, noise_keys, levels,
                                              layout.offset, layout.mask, out.dtype))
    return out


@kernel
def _field_deltas(x, index, seg, shift, starts, multiplier, noise_keys, levels: int, offset: int, mask: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """What the elements x[index] add to words whose fields at ``shift`` hold code 0: rounding and field in one pass."""
    codes = _element_codes(x, index, seg, starts, multiplier, noise_keys, levels).to(torch.int64)
    return ((((codes + offset) & mask) - offset) << shift).to(dtype)


@kernel
def _unpack_rows(out2d, bits2d, offset: int, mask: int, sign: int, shift: int, split, column, factor_first,
                 factor_second) -> torch.Tensor:
    """One field of every word (one call per field: 2-9x faster than all fields in one kernel)."""
    words2d = bits2d.view(torch.int32 if bits2d.dtype == torch.float32 else torch.int64)  # INT_LOADS
    fields = ((words2d >> shift) & mask).to(torch.int32)
    return out2d.copy_(_field_values(fields, offset, sign).float() * _pick(column >= split[:, None], factor_first, factor_second))


def _field_values(fields, offset: int, sign: int):
    """The sum of codes a field holds: less the summed offsets, or (sign = the top bit) two's complement."""
    return fields - offset - ((fields & sign) << 1)


def unpack_scale_into(out: torch.Tensor, words: torch.Tensor, s: Segments, factor: torch.Tensor, layout: Words,
                      summands: int) -> torch.Tensor:
    """out = (sum of the codes in a field) * factor[param] from words laid out by ``layout`` (each field the
    integer SUM of ``summands`` workers' codes), into the bucket's buffer."""
    main, per_word = layout.main(s), layout.per_word
    offset, sign = summands * layout.offset, 0 if layout.offset else 1 << (layout.width - 1)
    if main:
        rows = main // ROW
        f1, f2 = s.per_row(factor)
        bits = words[:main].view(torch.float32 if words.dtype == torch.int32 else torch.float64).view(rows, ROW)
        for j in range(per_word):
            field = slice(j * rows, (j + 1) * rows)
            _unpack_rows(out[j * main: (j + 1) * main].view(rows, ROW), bits, offset, layout.mask, sign,
                         layout.width * j, s.split[field], s.column, f1[field], f2[field])
    index, word, shift, seg = layout.side(s)
    if index.numel():
        out[index] = _unpack_elements(words, word, shift, seg, factor, offset, layout.mask, sign, out.dtype)
    return out


@kernel
def _unpack_elements(words, word, shift, seg, factor, offset: int, mask: int, sign: int, dtype: torch.dtype) -> torch.Tensor:
    """The values of the fields at (word, shift), each times its parameter's factor: the gathers inside the kernel."""
    fields = (words[word].to(torch.int64) >> shift) & mask
    return (_field_values(fields, offset, sign).float() * factor[seg]).to(dtype)


def _values(codes: torch.Tensor, top: int | None) -> torch.Tensor:
    """The numbers codes stand for: themselves, or (top given) gqsgd-exp's powers of two."""
    return codes.float() if top is None else Q.exp_decode(codes, top)


@kernel
def _scale_rows(out2d, codes2d, split, column, factor_first, factor_second, top: int | None) -> torch.Tensor:
    return out2d.copy_(_values(codes2d, top) * _pick(column >= split[:, None], factor_first, factor_second))


def scale_into(out: torch.Tensor, codes: torch.Tensor, s: Segments, factor: torch.Tensor,
               top: int | None = None) -> torch.Tensor:
    """out = value(codes) * factor[param], decoded in the bucket's own buffer; ``top``: the codes are
    power-of-two codes (`quantize.exp_encode`) with that top exponent. The int8 codes are cast into ``out``
    first (INT_LOADS: two passes over floats beat one over int8), then the kernel works in place."""
    if s.rows:
        f1, f2 = s.per_row(factor)
        head = _rows(out, s).copy_(_rows(codes, s))
        _scale_rows(head, head, s.split, s.column, f1, f2, top)
    if s.fix.numel():
        out[s.fix] = _scale_elements(codes, s.fix, s.fix_seg, factor, top, out.dtype)
    return out


@kernel
def _scale_elements(codes, index, seg, factor, top: int | None, dtype: torch.dtype) -> torch.Tensor:
    return (_values(codes[index], top) * factor[seg]).to(dtype)


@kernel
def _scale_add_rows(out2d, values2d, split, column, factor_first, factor_second) -> torch.Tensor:
    return out2d.copy_(out2d + values2d * _pick(column >= split[:, None], factor_first, factor_second))


def scale_sum_into(out: torch.Tensor, codes: torch.Tensor, s: Segments, factors: torch.Tensor,
                   scratch: torch.Tensor) -> torch.Tensor:
    """out = sum over workers w of codes[w] * factors[w, param]: codes (n, numel) that each carry their own
    scales (QSGD's allgather), summed into the bucket's buffer. Worker 0 decodes by `scale_into`; each other
    worker's int8 codes are cast into ``scratch`` (numel floats) and added in (INT_LOADS: 2.3 -> 1.4 ms per
    million at n = 2, 4M elements, 1 thread). The few fix elements are summed over every worker last."""
    scale_into(out, codes[0], s, factors[0])
    for w in range(1, codes.shape[0] if s.rows else 0):
        values = _rows(scratch, s).copy_(_rows(codes[w], s))
        _scale_add_rows(_rows(out, s), values, s.split, s.column, *s.per_row(factors[w]))
    if s.fix.numel():
        out[s.fix] = _scale_sum_elements(codes, s.fix, s.fix_seg, factors, out.dtype)
    return out


@kernel
def _scale_sum_elements(codes, index, seg, factors, dtype: torch.dtype) -> torch.Tensor:
    """Every worker's codes (n, numel) at ``index``, each times its own factor of the element's parameter, summed."""
    return (codes[:, index].float() * factors[:, seg]).sum(0).to(dtype)


@kernel
def cast_scaled(out, x, scale: float) -> torch.Tensor:
    return out.copy_(x * scale)


# ---- exponential dithering (gqsgd-exp): codes are not summable, every ring hop re-encodes --------


def noise_at(index, seg, starts, noise_keys) -> torch.Tensor:
    """The noise of the bucket's elements at ``index`` (int32), of parameters ``seg`` (for codecs whose
    rounding is not a plain multiply-and-floor; inside their kernels, so it costs no pass of its own)."""
    return uniform((index - starts[seg]) ^ noise_keys[seg])


@kernel
def _exp_rows(out2d, x2d, split, column, base_first, base_second, scale_first, scale_second, key_first, key_second,
              top: int, exponents: int, smallest: float) -> torch.Tensor:
    second = column >= split[:, None]
    noise = uniform((_pick(second, base_first, base_second) + column.to(torch.int32)) ^ _pick(second, key_first, key_second))
    return out2d.copy_(Q.exp_encode(x2d / _pick(second, scale_first, scale_second), top, exponents, noise, smallest))


@kernel
def _exp_elements(x, index, seg, starts, scales, noise_keys, top: int, exponents: int, smallest: float) -> torch.Tensor:
    return Q.exp_encode(x[index] / scales[seg], top, exponents, noise_at(index.to(torch.int32), seg, starts, noise_keys), smallest)


def exp_encode(x: torch.Tensor, s: Segments, scales: torch.Tensor, noise_keys: torch.Tensor, top: int, exponents: int,
               out: torch.Tensor) -> torch.Tensor:
    """``out`` (int8) = power-of-two codes of x / scales[param], each element's noise keyed by its
    parameter: one pass, the scales and keys read once per row (per-element gathers kept the loop from
    vectorising), the fix elements one by one."""
    if s.rows:
        (c1, c2), (k1, k2) = s.per_row(scales, pad=1.0), s.per_row(noise_keys)
        _exp_rows(_rows(out, s), _rows(x, s), s.split, s.column, s.base_first, s.base_second, c1, c2, k1, k2, top, exponents,
                  Q.exp_smallest(top, exponents))
    if s.fix.numel():
        out[s.fix] = _exp_elements(x, s.fix, s.fix_seg, s.starts, scales, noise_keys, top, exponents,
                                   Q.exp_smallest(top, exponents))
    return out


def exp_combine(a, b, key, top: int, exponents: int, scratch: torch.Tensor) -> torch.Tensor:
    """One ring hop: decode two chunks of codes, add, re-encode with noise keyed by (hop, rank); the int8
    chunks reach the kernel cast into ``scratch`` (2, chunk floats, reused: INT_LOADS)."""
    floats = scratch.view(2, -1)
    return _exp_combine(floats[0].copy_(a), floats[1].copy_(b), key, top, exponents, Q.exp_smallest(top, exponents))


@kernel
def _exp_combine(a, b, key, top: int, exponents: int, smallest: float) -> torch.Tensor:
    counter = torch.arange(a.numel(), device=a.device, dtype=torch.int32) ^ key
    return Q.exp_encode(Q.exp_decode(a, top) + Q.exp_decode(b, top), top, exponents, uniform(counter), smallest)



@kernel
def _at_or_above_rows(out2d, x2d, local2d, split, column, threshold_first, threshold_second) -> torch.Tensor:
    above = (x2d - local2d).abs() >= _pick(column >= split[:, None], threshold_first, threshold_second)
    return out2d.copy_(torch.where(above, 1.0, 0.0).to(torch.int8))


def at_or_above(x: torch.Tensor, local: torch.Tensor, s: Segments, threshold: torch.Tensor,
                out: torch.Tensor) -> torch.Tensor:
    """``out`` (int8) = 1 where |x - local| >= threshold[param], else 0: the top-k candidates of
    every parameter's EF21 residual. The thresholds are read once per row, and the kernel stores int8
    converted from a float 0/1: inductor's C++ stores of a bool do not vectorise, and an integer 0/1
    converts to int8 by way of int64 (16M elements, 1 thread, ms per million: bool 4.6, int 1.23,
    float 0.60, against 0.37 for an fp32 -> fp16 copy)."""
    if s.rows:
        t1, t2 = s.per_row(threshold)
        _at_or_above_rows(_rows(out, s), _rows(x, s), _rows(local, s), s.split, s.column, t1, t2)
    if s.fix.numel():
        out[s.fix] = _at_or_above_elements(x, local, s.fix, s.fix_seg, threshold)
    return out


@kernel
def _at_or_above_elements(x, local, index, seg, threshold) -> torch.Tensor:
    return torch.where((x[index] - local[index]).abs() >= threshold[seg], 1.0, 0.0).to(torch.int8)


def flag_indices(flags: torch.Tensor) -> torch.Tensor:
    """Indices (int64, ascending) of the nonzero bytes of ``flags`` (int8 0/1).

    On a CPU a sparse mask is searched by 64-bit words first and then only inside the words that hold a
    flag: `nonzero` over every byte costs 1.3 ms per million on one thread, this about half of it. ``flags``
    starts at an 8-byte boundary (a buffer of its own). On a GPU each `nonzero` waits for the host: one."""
    if flags.device.type != "cpu":
        return flags.nonzero().squeeze(1)
    head = flags.numel() // 8 * 8
    words = flags[:head].view(torch.int64).nonzero().squeeze(1)
    inside = flags[:head].view(-1, 8).index_select(0, words).nonzero()
    found = words[inside[:, 0]] * 8 + inside[:, 1]
    tail = flags[head:].nonzero().squeeze(1) + head
    return torch.cat([found, tail]) if tail.numel() else found
