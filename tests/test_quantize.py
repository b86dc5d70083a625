"""Properties of the quantisation arithmetic: packed and int8 sums never overflow, dithering is unbiased."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from netgain.comm import fused
from netgain.comm import quantize as Q
from netgain.comm.codecs import Context, GlobalQSGD
from netgain.comm.fused import Segments


def worker_payloads(codec, world_size, numel, kind, seed):
    """Each worker's encoded payload of a gradient at the extremes of the scale (codes +-levels) or random."""
    g = torch.Generator().manual_seed(seed)
    s = Segments.build([numel], [fused.name_key("w")], "cpu")
    scale = torch.ones(1)
    payloads, codes = [], []
    for rank in range(world_size):
        if kind == "random":
            x = torch.rand(numel, generator=g) * 2 - 1
        else:
            x = torch.full((numel,), 1.0 if kind == "max" else -1.0)
        ctx = Context.for_step(world_size, s, seed, 0, rank, scales=scale)
        payloads.append(codec.encode(x, ctx))
        levels = codec.levels(world_size)
        codes.append(fused.round_int8(x, s, levels / scale, ctx.noise_keys, levels,
                                     torch.empty(numel, dtype=torch.int8)).long()
                     if kind == "random" else torch.full((numel,), levels if kind == "max" else -levels))
    return payloads, torch.stack(codes).sum(0), s, scale


@settings(max_examples=120, deadline=None)
@given(world_size=st.integers(1, 256), bits=st.integers(2, 8), data=st.data())
def test_packed_sum_never_overflows_and_decodes_exactly(world_size, bits, data):
    codec = GlobalQSGD(bits, "packed")
    levels = codec.levels(world_size)
    dtype, width, per_word = Q.word_layout(levels, world_size)
    numel = data.draw(st.integers(1, 3 * per_word + 1))
    kind = data.draw(st.sampled_from(["max", "min", "random"]))  # all at +levels: the worst case for carries
    payloads, code_sum, s, scale = worker_payloads(codec, world_size, numel, kind, data.draw(st.integers(0, 2**30)))
    exact = [sum(int(w) for w in column) for column in torch.stack(payloads).T]  # Python ints cannot wrap
    assert all(0 <= v < 2 ** (torch.iinfo(dtype).bits - 1) for v in exact), "the SUM would reach the sign bit"
    summed = torch.stack(payloads).sum(dim=0, dtype=dtype)  # what the native integer allreduce computes
    ctx = Context(world_size, s, s.keys, s.keys, scales=scale)
    decoded = codec.decode(summed, torch.empty(numel), ctx)
    assert torch.equal(decoded, code_sum.float() * (1.0 / (levels * world_size)))
    assert codec.wire_bits(world_size) == torch.iinfo(dtype).bits / per_word


@settings(max_examples=60, deadline=None)
@given(world_size=st.integers(1, 127), kind=st.sampled_from(["max", "min", "random"]))
def test_int8_sum_of_every_worker_stays_in_range(world_size, kind):
    codec = GlobalQSGD(8, "int8")
    payloads, code_sum, s, scale = worker_payloads(codec, world_size, 4099, kind, 0)  # whole rows and a tail
    assert all(p.dtype == torch.int8 for p in payloads)
    wide = torch.stack(payloads).long().sum(0)
    summed = torch.stack(payloads).sum(0, dtype=torch.int8)  # what the native int8 allreduce computes
    assert wide.abs().max() <= 127 and torch.equal(summed.long(), wide)  # the int8 SUM is exact
    ctx = Context(world_size, s, s.keys, s.keys, scales=scale)
    decoded = codec.decode(summed, torch.empty(4099), ctx)
    assert torch.equal(decoded, code_sum.float() * (1.0 / (codec.levels(world_size) * world_size)))


def test_int8_rejects_more_workers_than_it_can_hold():
    with pytest.raises(ValueError, match="127"):
        GlobalQSGD(8, "int8").levels(128)


def test_exp_dithering_is_unbiased_and_powers_of_two():
    top = Q.exp_top_exponent(4)
    noise = fused.uniform(torch.arange(100_000, dtype=torch.int32))
    for value in (0.3, 0.0123, -0.7, 1e-9):
        x = torch.full((100_000,), value)
        decoded = Q.exp_decode(Q.exp_encode(x, top, 127, noise), top)
        nonzero = decoded[decoded != 0].abs()
        assert torch.equal(torch.exp2(torch.log2(nonzero).round()), nonzero)
        assert abs(decoded.mean().item() - value) < 3 * decoded.std().item() / 100_000 ** 0.5 + 1e-12


def _exp_encode_frexp(x, top, exponents, noise):
    """The rounding as first written, with frexp/ldexp: the oracle for exp_encode's exponent-bit arithmetic."""
    mag = x.abs()
    smallest = 2.0 ** (top + 1 - exponents)
    _, exponent = torch.frexp(mag)
    low = torch.where(mag < smallest, torch.zeros_like(mag), torch.ldexp(torch.ones_like(mag), exponent - 1))
    step = torch.where(mag < smallest, torch.full_like(mag, smallest), low)
    rounded = low + step * (noise < (mag - low) / step).to(x.dtype)
    _, exponent = torch.frexp(rounded)
    code = (top + 2 - exponent).clamp(1, exponents)
    return (torch.where(rounded > 0, code, torch.zeros_like(code)) * torch.sign(x)).to(torch.int8)


@pytest.mark.parametrize("top,exponents", [(1, 127), (2, 127), (3, 31), (4, 4), (8, 1)])
def test_exp_codes_match_the_frexp_rounding_on_every_finite_exponent(top, exponents):
    g = torch.Generator().manual_seed(top * 1000 + exponents)
    bits = torch.randint(0, 1 << 31, (1 << 18,), generator=g, dtype=torch.int64)
    bits = bits[(bits >> 23) % 256 != 255].to(torch.int32)  # every finite float32: subnormals, zeros, powers of two
    x = bits.view(torch.float32) * torch.where(torch.rand(bits.numel(), generator=g) < 0.5, -1.0, 1.0)
    x = torch.cat([x, torch.tensor([0.0, -0.0, 2.0 ** top, 2.0 ** (top + 1), -(2.0 ** 126)])])
    below = x.abs() < 2.0 ** 127  # the oracle overflows above (its step doubles past float32's range)
    for noise in (torch.rand(x.numel(), generator=g), torch.zeros(x.numel()), torch.full((x.numel(),), 1 - 2 ** -24)):
        assert torch.equal(Q.exp_encode(x, top, exponents, noise)[below], _exp_encode_frexp(x, top, exponents, noise)[below])
    assert Q.exp_encode(torch.tensor([float("inf"), -3e38]), top, exponents, torch.zeros(2)).tolist() == [1, -1]  # saturate
