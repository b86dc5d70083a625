"""The DDP hook's contract: clear errors on every rank (never a hang), statistics, warm-up,
and checkpoints that restore error feedback and RNG exactly, across DDP bucket rebuilds."""

import io
import pickle

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import netgain.comm as comm

from distributed import run


class Layers(torch.nn.Module):
    """Several parameters; loss = sum_p <p, data_p> makes every gradient a known tensor."""

    def __init__(self, a=3000, b=(40, 50), c=2500):
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(a))
        self.b = torch.nn.Parameter(torch.zeros(b))
        self.c = torch.nn.Parameter(torch.zeros(c))

    def forward(self, step, rank):
        g = torch.Generator().manual_seed(1000 * step + rank)
        return sum((p * torch.randn(p.shape, generator=g)).sum() for p in (self.a, self.b, self.c))


def ddp(model):
    return DDP(model, bucket_cap_mb=0.012)  # several buckets, rebuilt after the first step


def grads(model):
    return torch.cat([p.grad.reshape(-1) for p in model.module.parameters()]).clone()


def nan_on_rank_one(rank, world_size, policy):
    model = ddp(Layers())
    state = comm.register(model, "gqsgd", min_compress_numel=0, nonfinite=policy)
    try:
        model(0, rank).backward()  # a clean step first
        model.zero_grad()
        loss = model(1, rank)
        if rank == 1:
            loss = loss + model.module.b[0, 0] * float("nan")
        loss.backward()
        return bool(torch.isfinite(grads(model)).all())
    finally:
        state.close()  # the buckets after the failing one still complete on every rank


@pytest.mark.parametrize("world_size", [2, 3])
def test_nan_raises_on_every_rank(world_size):
    results = run(nan_on_rank_one, world_size, "raise")
    assert all(status == "error" and "NaN/Inf" in message and "b" in message for status, message in results), results


def test_nan_sent_uncompressed_when_asked():
    results = run(nan_on_rank_one, 2, "uncompressed")
    assert results == [("ok", False), ("ok", False)]  # NaN reaches the optimizer (e.g. a GradScaler skips the step)


def skip_1d_step(rank, world_size, codec, nan_in_a=False):
    model = ddp(Layers())
    state = comm.register(model, codec, bits=2, min_compress_numel=0, skip_1d=True)
    try:
        loss = model(0, rank)
        if nan_in_a and rank == 1:
            loss = loss + model.module.a[0] * float("nan")
        loss.backward()
        return grads(model)
    finally:
        state.close()


def true_mean(world_size):
    expected = Layers()
    for rank in range(world_size):
        expected(0, rank).backward()
    return torch.cat([p.grad.reshape(-1) / world_size for p in expected.parameters()])


@pytest.mark.parametrize("codec", ["gqsgd", "fp16"])  # a checked (per-parameter) codec and a plain cast
def test_skip_1d_sends_1d_gradients_exactly(codec):
    results = run(skip_1d_step, 3, codec)
    assert all(status == "ok" for status, _ in results), results
    got, expected = results[0][1], true_mean(3)
    a, b = slice(0, 3000), slice(3000, 5000)
    assert torch.allclose(got[a], expected[a], atol=1e-6) and torch.allclose(got[5000:], expected[5000:], atol=1e-6)
    assert not torch.equal(got[b], expected[b])  # the 2-D parameter still went through the codec
    assert all(torch.equal(value, got) for _, value in results)


def test_skip_1d_nan_in_an_exact_gradient_raises_on_every_rank():
    results = run(skip_1d_step, 2, "gqsgd", True)
    assert all(status == "error" and "NaN/Inf" in message for status, message in results), results


def mismatched(rank, world_size):
    comm.register(ddp(Layers()), "gqsgd" if rank == 0 else "qsgd")


def test_config_mismatch_raises_on_every_rank():
    results = run(mismatched, 2)
    assert all(status == "error" and "differs between ranks" in message for status, message in results), results


@pytest.mark.parametrize("kwargs,match", [({"codec": "zip"}, "choose one of none, fp16"),
                                          ({"codec": "gqsgd", "bits": 9}, "bits must be in 2..8"),
                                          ({"codec": "topk", "ratio": 0.0}, "ratio must be in"),
                                          ({"codec": "gqsgd", "encoding": "int4"}, "encoding='int4'"),
                                          ({"codec": "gqsgd", "bits": 4, "encoding": "int8"}, "bits must be 8")])
def test_bad_arguments_name_allowed_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        comm.make_codec(kwargs.pop("codec"), **kwargs)


def train(rank, world_size, codec, steps, warmup=0, resume_from=None):
    """Run `steps` backward passes; optionally start from a serialized CommState."""
    model = ddp(Layers())
    state = comm.register(model, codec, min_compress_numel=0, warmup_steps=warmup, seed=3)
    first = 0
    if resume_from is not None:
        saved = torch.load(io.BytesIO(resume_from), weights_only=False)
        state.load_state_dict(saved)
        first = saved["step"]
    out = []
    for step in range(first, first + steps):
        model.zero_grad()
        model(step, rank).backward()
        out.append(grads(model))
    buffer = io.BytesIO()
    torch.save(state.state_dict(), buffer)
    return out, buffer.getvalue(), state.last_step, state.history


# the ring of gqsgd-exp cuts chunks across parameters, so its rounding noise follows DDP's bucket
# layout, which differs in the first step after a restart: it resumes statistically, not bitwise
RESUMABLE = ["topk", "randomk", "gqsgd", "qsgd"]


def train_each(rank, world_size, steps, saved=None):
    return {codec: train(rank, world_size, codec, steps, 0, saved[rank][codec] if saved else None)
            for codec in RESUMABLE}


def test_resume_restores_feedback_and_rng_exactly():
    """Training 6 steps straight equals 3 steps, a checkpoint, and 3 steps in fresh processes."""
    straight = run(train_each, 2, 6)
    first_half = run(train_each, 2, 3)
    saved = [{codec: value[codec][1] for codec in RESUMABLE} for _, value in first_half]
    second_half = run(train_each, 2, 3, saved)
    for rank in range(2):
        for codec in RESUMABLE:
            expected = straight[rank][1][codec][0][3:]
            resumed = second_half[rank][1][codec][0]
            assert all(torch.equal(a, b) for a, b in zip(expected, resumed)), codec


def test_warmup_then_statistics():
    (status, (out, _, last, history)), _ = run(train, 2, "gqsgd", 3, 2)
    assert status == "ok"
    assert [h["step"] for h in history] == [0, 1, 2]
    assert history[0]["wire_bytes"] == history[0]["raw_bytes"]  # warm-up: uncompressed fp32
    assert last["compression_ratio"] > 2.5  # 8-bit packed at n=2 ~ 9.1 bits/element + headers
    assert {r["codec"] for r in last["per_bucket"]} == {"gqsgd(bits=8,encoding=packed)"}
    for key in ("wire_bytes", "raw_bytes", "encode_s", "decode_s", "comm_s", "wait_s"):
        assert last[key] >= 0


def test_state_pickles_without_process_group():
    state = comm.CommState(comm.TopKConfig(), warmup_steps=2)
    clone = pickle.loads(pickle.dumps(state))
    assert clone.config == comm.CommConfig(comm.TopKConfig(0.01), warmup_steps=2) and clone.describe() == "topk(ratio=0.01)"
