"""Properties of the quantisation arithmetic: packing never overflows, rounding is unbiased."""

import torch
from hypothesis import given, settings, strategies as st

from netgain.comm import quantize as Q


@settings(max_examples=300, deadline=None)
@given(world_size=st.integers(1, 256), bits=st.integers(2, 8), data=st.data())
def test_packed_sum_never_overflows(world_size, bits, data):
    levels = Q.levels_per_side(bits)
    dtype, width, per_word = Q.word_layout(levels, world_size)
    numel = data.draw(st.integers(1, 3 * per_word + 1))
    # every worker at the extremes or random: the worst case for carries is all at 2 * levels
    kind = data.draw(st.sampled_from(["max", "min", "random"]))
    seed = data.draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    if kind == "max":
        codes = torch.full((world_size, numel), 2 * levels, dtype=torch.int64)
    elif kind == "min":
        codes = torch.zeros((world_size, numel), dtype=torch.int64)
    else:
        codes = torch.randint(0, 2 * levels + 1, (world_size, numel), generator=g)
    words = torch.stack([Q.pack(c, levels, world_size) for c in codes])
    exact = [sum(int(w) for w in column) for column in words.T]  # Python ints cannot wrap
    limit = 2 ** (torch.iinfo(dtype).bits - 1)
    assert all(0 <= v < limit for v in exact), "the SUM would reach the sign bit"
    summed = words.sum(dim=0, dtype=dtype)  # what the native integer allreduce computes
    assert [int(v) for v in summed] == exact
    assert torch.equal(Q.unpack(summed, levels, world_size, numel).to(torch.int64), codes.sum(0))
    assert Q.packed_bits_per_element(levels, world_size) == torch.iinfo(dtype).bits / per_word


@given(world_size=st.integers(1, 127))
def test_int8_codes_never_overflow(world_size):
    levels = 127 // world_size
    assert levels >= 1 and world_size * levels <= 127


def test_int8_rejects_more_workers_than_it_can_hold():
    from netgain.comm.codecs import GlobalQSGD
    import pytest
    with pytest.raises(ValueError, match="127"):
        GlobalQSGD(8, "int8").levels(128)


def test_stochastic_round_is_unbiased():
    g = torch.Generator().manual_seed(0)
    q = torch.full((200_000,), 2.3)
    rounded = Q.stochastic_round(q, g)
    assert set(rounded.unique().tolist()) == {2.0, 3.0}
    assert abs(rounded.mean().item() - 2.3) < 3 * 0.46 / 200_000 ** 0.5


def test_exp_dithering_is_unbiased_and_powers_of_two():
    g = torch.Generator().manual_seed(0)
    top = Q.exp_top_exponent(4)
    for value in (0.3, 0.0123, -0.7, 1e-9):
        x = torch.full((100_000,), value)
        decoded = Q.exp_decode(Q.exp_encode(x, top, 127, g), top)
        nonzero = decoded[decoded != 0].abs()
        assert torch.equal(torch.exp2(torch.log2(nonzero).round()), nonzero)
        assert abs(decoded.mean().item() - value) < 3 * decoded.std().item() / 100_000 ** 0.5 + 1e-12
