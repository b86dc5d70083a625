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
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in model.module.parameters()]).clone()


def backward_with_nan_on_rank_one(model, rank):
    """Step 1's backward, with a NaN in parameter b's gradient on rank 1."""
    model.zero_grad()
    loss = model(1, rank)
    if rank == 1:
        loss = loss + model.module.b[0, 0] * float("nan")
    loss.backward()


def nan_on_rank_one(rank, world_size, policy, codec="gqsgd", options=None):
    model = ddp(Layers())
    state = comm.register(model, codec, min_compress_numel=0, nonfinite=policy, **(options or {}))
    try:
        model(0, rank).backward()  # a clean step first
        backward_with_nan_on_rank_one(model, rank)
        return bool(torch.isfinite(grads(model)).all())
    finally:
        state.close()  # the buckets after the failing one still complete on every rank


@pytest.mark.parametrize("world_size,codec,options", [(2, "gqsgd", {}), (3, "gqsgd", {}), (2, "topk", {}), (2, "randomk", {}), (3, "fp16", {}),
                                                      (2, "none", {}), (2, "qsgd", {}), (3, "qsgd", {"bits": 4}),
                                                      (2, "lowrank", {"warmup_steps": 0}),
                                                      (3, "lowrank", {"factors": "fp32", "warmup_steps": 0})])
def test_nan_raises_nonfinite_gradient_error_on_every_rank(world_size, codec, options):
    results = run(nan_on_rank_one, world_size, "raise", codec, options)
    assert all(status == "error" and message.startswith("NonFiniteGradientError: ") and "(parameters: b" in message
               and "overflowed float32" not in message for status, message in results), results


def nan_after_a_plan(rank, world_size, plain):
    """auto: three clean steps (its plan is made after DDP's rebuild), then a NaN on rank 1 at a step that
    measures nothing, every bucket sent as bf16 (on every rank: a plan, as the loaded loopback may not make
    it), which carries a header of flags alone (no scales); plain: a settled plan's step, with no header."""
    model, state = auto_sending_bf16(rank, plain)
    try:
        backward_with_nan_on_rank_one(model, rank)
    finally:
        state.close()


def auto_sending_bf16(rank, plain, codec="bf16"):
    """auto after three clean steps, every bucket sent as ``codec`` from now on (and planned so: `relays` reads the
    plan); plain: with no header."""
    model = ddp(Layers())
    state = comm.register(model, "auto", min_compress_numel=0, replan_every=50)
    for step in range(3):
        model.zero_grad()
        model(step, rank).backward()
    option = next(option for option in state.chooser.options if option.describe() == codec)
    state.chooser.codec_for = lambda index, numel: option
    state.chooser.plan = {index: (numel, option) for index, (numel, _) in state.chooser.plan.items()}
    state.chooser.plain = lambda step: plain
    return model, state


@pytest.mark.parametrize("plain", [False, True], ids=["header", "plain"])
def test_nan_raises_on_every_rank_under_auto_between_its_measurements(plain):
    results = run(nan_after_a_plan, 2, plain)
    assert all(status == "error" and message.startswith("NonFiniteGradientError: ") and "(parameters: b" in message
               for status, message in results), results


def plans_differ_on_rank_one(rank, world_size, codec):
    """auto: three clean steps, then rank 1 believes it runs another plan; its steps go on with no header
    (plain), so only the planner's agreement of the plan's signature can see it. Low rank's steps run on the
    pipeline's thread, bf16's from DDP's: the error reaches DDP's caller as its class either way."""
    model, state = auto_sending_bf16(rank, plain=True, codec=codec)
    assert state.chooser.plan and state.chooser.relays == codec.startswith("lowrank")
    try:
        if rank == 1:
            state.chooser._plan_key = ("another plan",)
        for step in range(3, 3 + comm.adaptive.AGREE_EVERY):
            model.zero_grad()
            model(step, rank).backward()
    finally:
        state.close()


@pytest.mark.parametrize("codec", ["bf16", "lowrank(rank=4,factors=fp32)"])
def test_a_plan_mismatch_between_ranks_raises_on_every_rank_at_the_agreement(codec):
    results = run(plans_differ_on_rank_one, 2, codec)
    assert all(status == "error" and message.startswith("PlanMismatchError: ") and "ran different plans" in message
               for status, message in results), results


def fp16_overflow_on_rank_one(rank, world_size):
    model = ddp(Layers())
    state = comm.register(model, "fp16", min_compress_numel=0)
    try:
        model.zero_grad()
        loss = model(1, rank)
        (loss + (model.module.b[0, 0] * 1e6 if rank == 1 else 0.0)).backward()  # finite, past fp16's range
    finally:
        state.close()


def test_a_finite_gradient_past_fp16s_range_is_named_as_an_overflow():
    results = run(fp16_overflow_on_rank_one, 2)
    assert all(status == "error" and "overflowed fp16 (largest 65504)" in message for status, message in results), results


def lowrank_state_after_nan(rank, world_size):
    """Low rank with fp32 factors has no header: NaN is caught on round 1's sum, before any state is written."""
    model = ddp(Layers())
    state = comm.register(model, comm.LowRankConfig(rank=2, factors="fp32"), min_compress_numel=0, warmup_steps=0)
    try:
        model(0, rank).backward()
        before = state.store.local_state(), state.store.shared_state()  # residuals, warm-start Qs
        try:
            backward_with_nan_on_rank_one(model, rank)
        except comm.NonFiniteGradientError:
            pass
        else:
            return "no error"
        state.close()  # every bucket of the step is settled
        after = state.store.local_state(), state.store.shared_state()
        return all(torch.equal(value, now[name]) for old, now in zip(before, after) for name, value in old.items())
    finally:
        state.close()


def test_lowrank_fp32_nan_leaves_its_state_untouched():
    assert run(lowrank_state_after_nan, 2) == [("ok", True), ("ok", True)]


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


ALL_CODECS = [name for name in comm.CODEC_NAMES]


def every_pair_mismatched(rank, world_size):
    """For every pair of codecs (header codec or not, fixed or adaptive) rank 0 asks for one, rank 1 the other."""
    raised = []
    for i, first in enumerate(ALL_CODECS):
        for second in ALL_CODECS[i + 1:]:
            try:
                comm.register(ddp(Layers()), first if rank == 0 else second)
                raised.append(None)
            except comm.PlanMismatchError as error:
                raised.append(str(error))
    return raised


def test_mismatched_codecs_raise_plan_mismatch_on_every_rank_for_every_pair():
    results = run(every_pair_mismatched, 2)
    pairs = len(ALL_CODECS) * (len(ALL_CODECS) - 1) // 2
    for status, raised in results:
        assert status == "ok" and len(raised) == pairs and all(r and "differs between ranks" in r for r in raised)


def direct_state_mismatched(rank, world_size):
    """A CommState built directly (no register): the configs are compared at the first bucket."""
    model = ddp(Layers())
    model.register_comm_hook(comm.CommState("gqsgd" if rank == 0 else "fp16", min_compress_numel=0), comm.hook)
    try:
        model(0, rank).backward()
    except comm.PlanMismatchError as error:
        return f"PlanMismatchError: {error}"


def test_directly_built_state_raises_plan_mismatch_as_that_class():
    results = run(direct_state_mismatched, 2)
    assert all(status == "ok" and value.startswith("PlanMismatchError") for status, value in results), results


class WithUnused(Layers):
    """Layers plus a parameter the forward never uses (DDP's find_unused_parameters)."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Parameter(torch.zeros(700))


def mode_model(mode):
    model = WithUnused() if mode == "find_unused_parameters" else Layers()
    return model.to(torch.bfloat16) if mode == "bf16" else model


def mode_run(rank, world_size, codec, mode):
    """4 steps in a DDP mode; per step the decoded mean and this rank's codec state (EF21's g_i, low rank's
    residual e_i; none for gqsgd), flat in parameter order."""
    model = mode_model(mode)
    wrapped = DDP(model, bucket_cap_mb=0.012, find_unused_parameters=mode == "find_unused_parameters",
                  static_graph=mode == "static_graph")
    state = comm.register(wrapped, codec, min_compress_numel=0)
    try:
        steps = []
        for step in range(4):
            wrapped.zero_grad()
            if mode == "no_sync":
                with wrapped.no_sync():
                    wrapped(step, rank + 10).backward()
            wrapped(step, rank).backward()
            kept = state.store.local_state()
            steps.append((grads(wrapped).float(), torch.cat([kept.get(n, torch.zeros(p.numel())).float().reshape(-1)
                                                             for n, p in model.named_parameters()])))
        return steps, [h["buckets"] for h in state.history], state.last_step["raw_bytes"]
    finally:
        state.close()


def mode_gradient(mode, step, rank):
    """A rank's true gradient in `mode`, without DDP: what the hook must have been given."""
    model = mode_model(mode)
    if mode == "no_sync":
        model(step, rank + 10).backward()  # accumulated locally first, as under no_sync
    model(step, rank).backward()
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in model.parameters()]).float()


@pytest.mark.parametrize("codec", ["gqsgd", "topk", "lowrank"])
@pytest.mark.parametrize("mode", ["find_unused_parameters", "static_graph", "no_sync", "bf16"])
def test_ddp_modes_work(codec, mode):
    """Every step's decoded mean against the ranks' true gradients (computed here without DDP), within
    what the codec may change: gqsgd one rounding level of the largest |g|, unbiased; top-k the mean of
    the ranks' g_i, each moved by at most 1% of its parameter's grad - g_i, the largest, exactly; low rank
    the true mean plus what the residuals gave back less what they took in, within its factors' rounding."""
    from netgain.comm.quantize import levels_per_side

    results = run(mode_run, 2, codec, mode)
    assert all(status == "ok" for status, _ in results), results
    (steps, buckets, raw), (steps_1, _, _) = (value for _, value in results)
    assert len(buckets) == 4 and all(b >= 1 for b in buckets)  # the hook ran on every synced step
    shapes = [p.shape for p in mode_model(mode).parameters()]
    sizes = [p.numel() for p in mode_model(mode).parameters()]
    assert raw == sum(sizes) * (2 if mode == "bf16" else 4)  # raw bytes in the bucket's own dtype
    eps = 2.0 ** -8 if mode == "bf16" else 2.0 ** -23  # the decoded mean's own rounding, relative
    before, errors = (torch.zeros(sum(sizes)),) * 2, []
    for step, ((got, kept_0), (got_1, kept_1)) in enumerate(zip(steps, steps_1)):
        assert torch.equal(got, got_1) and torch.isfinite(got).all()
        true, kept = [mode_gradient(mode, step, rank) for rank in (0, 1)], (kept_0, kept_1)
        mean, scale = (true[0] + true[1]) / 2, max(t.abs().max() for t in true)
        if codec == "gqsgd":
            assert (got - mean).abs().max() <= scale / levels_per_side(8) * (1 + 1e-5) + 2 * eps * scale
            errors.append(got - mean)
        elif codec == "topk":
            assert torch.allclose(got, (kept[0] + kept[1]) / 2, rtol=2 * eps, atol=2 * eps * scale)
            for rank in (0, 1):
                x, sent = true[rank] - before[rank], kept[rank] != before[rank]
                assert torch.allclose(kept[rank][sent] - before[rank][sent], x[sent], rtol=1e-5, atol=1e-6)
                for x_p, sent_p in zip(x.split(sizes), sent.split(sizes)):
                    assert sent_p.sum() <= -(-sent_p.numel() // 100)  # 1% of the parameter, rounded up
                    if sent_p.any():  # the largest |grad - g_i| (the threshold is sampled: above the 90th percentile)
                        assert x_p[sent_p].abs().min() >= x_p.abs().quantile(0.9)
        else:  # vectors ride with the factors' 8-bit codes, no residual: one level; matrices: P Q^T's code of Q,
            # whose rounding is no rank's residual, at most sqrt(rank) levels of Q's scale, the largest column
            # norm of a rank's M_i = g_i + e_i (P's columns are orthonormal)
            took = (before[0] - kept[0] + before[1] - kept[1]) / 2
            rounding = 4 * eps * (scale + took.abs().max())
            m = [(t + b).split(sizes) for t, b in zip(true, before)]
            for i, (drift, shape) in enumerate(zip((got - mean - took).split(sizes), shapes)):
                if len(shape) == 1:
                    level = scale / levels_per_side(8)
                else:
                    q_scale = max(m_i[i].reshape(shape[0], -1).norm(dim=0).max() for m_i in m)
                    level = comm.LowRankConfig().rank ** 0.5 * q_scale / levels_per_side(8)
                assert drift.abs().max() <= level + rounding
        before = kept
    if errors:  # unbiased: the mean error within 3 standard errors of zero
        flat = torch.cat(errors)
        assert flat.mean().abs() <= 3 * flat.std() / flat.numel() ** 0.5


@pytest.mark.parametrize("kwargs,match", [({"codec": "zip"}, "choose one of auto, none, fp16"),
                                          ({"codec": "gqsgd", "bits": 9}, "bits must be in 2..8"),
                                          ({"codec": "topk", "ratio": 0.0}, "ratio must be a number in"),
                                          ({"codec": "gqsgd", "encoding": "int4"}, "encoding='int4'"),
                                          ({"codec": "gqsgd", "bits": 4, "encoding": "int8"}, "bits must be 8")])
def test_bad_arguments_name_allowed_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        comm.make_codec(kwargs.pop("codec"), **kwargs)


@pytest.mark.parametrize("build,match", [
    (lambda: comm.GlobalQSGDConfig(bits=9), "bits must be in 2..8"),
    (lambda: comm.GlobalQSGDConfig(bits=4.0), "bits must be an integer, got 4.0"),
    (lambda: comm.KimadConfig(bits=(4.0,)), "bits must be an integer, got 4.0"),
    (lambda: comm.LowRankConfig(bits=4.0), "bits must be an integer, got 4.0"),
    (lambda: comm.GlobalQSGDConfig(encoding="int4"), r"encoding='int4' is not one of \('packed', 'int8'\)"),
    (lambda: comm.TopKConfig(ratio=1.5), r"ratio must be a number in \(0, 1\]"),
    (lambda: comm.CastConfig("fp8"), r"dtype='fp8' is not one of \('fp16', 'bf16'\)"),
    (lambda: comm.KimadConfig(mode="kimad++"), r"mode='kimad\+\+' is not one of"),
    (lambda: comm.KimadConfig(budget_ms=float("inf")), "budget_ms must be > 0 and finite"),
    (lambda: comm.KimadConfig(budget_ms="5"), "budget_ms must be a number, got '5'"),
    (lambda: comm.KimadConfig(max_error="0.1"), "max_error must be a number, got '0.1'"),
    (lambda: comm.CommConfig(nonfinite="skip"), r"nonfinite='skip' is not one of \('raise', 'uncompressed'\)"),
    (lambda: comm.CommConfig(warmup_steps=-1), "warmup_steps must be an integer >= 0, got -1"),
    (lambda: comm.CommConfig(warmup_steps=1.5), "warmup_steps must be an integer >= 0, got 1.5"),
    (lambda: comm.CommConfig(min_compress_numel=float("nan")), "min_compress_numel must be an integer >= 0"),
    (lambda: comm.CommConfig(seed=1.5), "seed must be an integer, got 1.5"),
    (lambda: comm.CommConfig(skip_1d="no"), "skip_1d must be True or False, got 'no'"),
    (lambda: comm.CommConfig(own_group="x"), "own_group must be True or False"),
    (lambda: comm.KimadConfig(replan_every=1.5), "replan_every must be an integer >= 1, got 1.5"),
    (lambda: comm.RandomKConfig(ratio=True), r"ratio must be a number in \(0, 1\], got ratio=True"),
    (lambda: comm.TopKConfig(ratio="0.1"), r"ratio must be a number in \(0, 1\], got ratio='0.1'"),
    (lambda: comm.comm_config("zip"), "choose one of auto, none, fp16"),
])
def test_typed_configs_name_the_argument_and_the_allowed_values(build, match):
    with pytest.raises(ValueError, match=match):
        build()


class FakeBucket:
    """What the hook reads of a DDP bucket: its flat buffer and its parameters' gradient views in it, in order."""

    def __init__(self, buffer, params):
        self._buffer, self._params = buffer, params
        self._grads = [v.view_as(p) for v, p in zip(buffer.split([p.numel() for p in params]), params)]

    def buffer(self):
        return self._buffer

    def index(self):
        return 0

    def parameters(self):
        return self._params

    def gradients(self):
        return self._grads


def test_a_rebuilt_bucket_at_the_old_address_gets_a_layout_of_its_own():
    """DDP's rebuild after the first step reorders a bucket's parameters, and its new buffer may land at the old
    one's address (the allocator's choice, rank by rank): that bucket's layout is built anew, not reused."""
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))
    state = comm.CommState("gqsgd", param_names={id(a): "a", id(b): "b"})
    buffer = torch.zeros(7)
    first, rebuilt = state._layout(FakeBucket(buffer, [a, b])), state._layout(FakeBucket(buffer, [b, a]))
    assert first.names == ["a", "b"] and first.spans == [(0, 3), (3, 4)]
    assert rebuilt.names == ["b", "a"] and rebuilt.spans == [(0, 4), (4, 3)]
    assert state._layout(FakeBucket(buffer, [b, a])) is rebuilt  # unchanged: reused


def test_low_rank_starts_after_powersgds_two_uncompressed_steps_unless_told():
    assert comm.CommConfig(comm.LowRankConfig()).warmup_steps == comm.comm_config("lowrank").warmup_steps == 2
    assert comm.comm_config("lowrank", warmup_steps=0).warmup_steps == 0
    assert comm.CommConfig().warmup_steps == comm.comm_config("topk").warmup_steps == 0
    assert comm.default_warmup_steps("ddp-powersgd") == 0  # PyTorch's hook enforces its own 2


def test_configs_by_name_and_by_object_agree():
    assert comm.comm_config("gqsgd", bits=4, warmup_steps=3) == comm.CommConfig(comm.GlobalQSGDConfig(bits=4), warmup_steps=3)
    assert comm.comm_config("kimad+", budget_ms=50.0, bits=8).codec == comm.KimadConfig("kimad+", budget_ms=50.0)
    with pytest.raises(TypeError, match="put them in the config"):
        comm.comm_config(comm.TopKConfig(), ratio=0.5)


def test_an_argument_no_codec_takes_raises_and_kimads_own_pass_through():
    """A typo must not fall back to a default silently; another codec's option is ignored, as the CLI's flags are."""
    for typo in ({"bitz": 4}, {"warmup_step": 10}, {"budget": 5}):
        with pytest.raises(TypeError, match=f"unknown codec or hook argument.*{next(iter(typo))}.*the codec or hook arguments are"):
            comm.comm_config("gqsgd", **typo)
    assert comm.comm_config("topk", bits=4).codec == comm.TopKConfig()
    assert comm.comm_config("kimad+", bits=(4, 8), max_error=0.5, topk_ratios=[0.1]).codec == comm.KimadConfig(
        "kimad+", bits=(4, 8), max_error=0.5, topk_ratios=(0.1,))


def test_register_refuses_a_model_that_is_not_ddp():
    with pytest.raises(TypeError, match="needs a torch.nn.parallel.DistributedDataParallel model, got Linear"):
        comm.register(torch.nn.Linear(2, 2), "gqsgd")


def train(rank, world_size, codec, steps, warmup=0, resume_from=None, save_at=None):
    """Run `steps` backward passes, optionally from a saved state; rank 0 alone returns the state saved
    at the end, or after step ``save_at`` (the run goes on: saving must not change what follows)."""
    model = ddp(Layers())
    state = comm.register(model, codec, min_compress_numel=0, warmup_steps=warmup, seed=3, replan_every=2)
    first = 0
    if resume_from is not None:
        saved = torch.load(io.BytesIO(resume_from), weights_only=True)  # a checkpoint is data, never code
        state.load_state_dict(saved)
        taken = state.planner.state_dict() if state.planner is not None else {}
        assert taken == saved["chooser"], "a rank did not take the saved planner state exactly"
        first = saved["step"]
    out, buffer = [], io.BytesIO()
    for step in range(first, first + steps):
        model.zero_grad()
        model(step, rank).backward()
        out.append(grads(model))
        if step + 1 == (save_at or first + steps):
            torch.save(state.state_dict(), buffer)  # collective: every rank takes part, rank 0 writes
    state.close()
    return out, buffer.getvalue() if rank == 0 else None, state.last_step, state.history


# the ring of gqsgd-exp cuts chunks across parameters, so its rounding noise follows DDP's bucket
# layout, which differs in the first step after a restart: it resumes statistically, not bitwise
RESUMABLE = ["topk", "randomk", "gqsgd", "qsgd", "lowrank"]


def train_each(rank, world_size, steps, saved=None, save_at=None):
    return {codec: train(rank, world_size, codec, steps, 0, saved[codec] if saved else None, save_at)
            for codec in RESUMABLE + ["kimad+"]}


@pytest.mark.parametrize("world_size", [2, 3])
def test_rank_zero_checkpoint_resumes_every_rank_exactly(world_size):
    """6 steps straight (rank 0 alone saving the state after step 3) equal 3 steps resumed from that
    state in fresh processes."""
    straight = run(train_each, world_size, 6, None, 3)
    saved = {codec: straight[0][1][codec][1] for codec in RESUMABLE + ["kimad+"]}
    second_half = run(train_each, world_size, 3, saved)
    for rank in range(world_size):
        for codec in RESUMABLE:
            expected = straight[rank][1][codec][0][3:]
            resumed = second_half[rank][1][codec][0]
            assert all(torch.equal(a, b) for a, b in zip(expected, resumed)), (codec, rank)
    # kimad+: the plan is re-measured, but what the ranks had agreed (link, compute time, the overruns behind
    # the margin) carries over exactly to every rank (train compares it right after loading)
    kimad = torch.load(io.BytesIO(saved["kimad+"]), weights_only=True)
    assert kimad["chooser"]["bandwidth"] > 0 and kimad["step"] == 3 and kimad["chooser"]["overruns"]
    assert second_half[0][1]["kimad+"][3][0]["step"] == 3


def load_elsewhere(rank, world_size, blob):
    state = comm.register(ddp(Layers()), "topk", min_compress_numel=0, seed=3, replan_every=2)
    state.load_state_dict(torch.load(io.BytesIO(blob), weights_only=True))


def train_topk_and_randomk(rank, world_size):
    return [train(rank, world_size, codec, 1)[1] for codec in ("topk", "randomk")]


def test_loading_onto_another_world_size_or_codec_raises():
    saved, blob = run(train_topk_and_randomk, 2)[0][1]
    results = run(load_elsewhere, 3, saved)
    assert all(status == "error" and "2 ranks, this run has 3" in message for status, message in results), results
    results = run(load_elsewhere, 2, blob)
    assert all(status == "error" and "config differs in" in message for status, message in results), results


def test_warmup_then_statistics():
    (status, (out, _, last, history)), _ = run(train, 2, "gqsgd", 3, 2)
    assert status == "ok"
    assert [h["step"] for h in history] == [0, 1, 2]
    assert history[0]["wire_bytes"] == history[0]["raw_bytes"]  # warm-up: uncompressed fp32
    assert last["compression_ratio"] > 2.5  # 8-bit packed at n=2 ~ 9.1 bits/element + headers
    assert {r["codec"] for r in last["per_bucket"]} == {"gqsgd(bits=8,encoding=packed)"}
    for key in ("wire_bytes", "raw_bytes", "encode_s", "decode_s", "comm_s"):
        assert last[key] == pytest.approx(sum(r[key] for r in last["per_bucket"])) and last[key] > 0
    assert last["buckets"] == len(last["per_bucket"])
    # the wait after DDP hands over its last bucket holds all of that bucket's work, one part after another
    final = last["per_bucket"][-1]
    assert final["encode_s"] + final["comm_s"] + final["decode_s"] <= last["wait_s"]


def test_state_pickles_without_process_group():
    state = comm.CommState(comm.TopKConfig(), warmup_steps=2)
    clone = pickle.loads(pickle.dumps(state))
    assert clone.config == comm.CommConfig(comm.TopKConfig(0.01), warmup_steps=2) and clone.describe() == "topk(ratio=0.01)"

