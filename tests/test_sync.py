"""netgain.sync: DiLoCo's arithmetic, unbiased pseudo-gradient codes, exact resume, errors on every rank.

Each distributed test is one spawn of 2 or 3 gloo ranks (tests/distributed.py). Gradients are set by
hand or come from data seeded by (rank, step), and the codecs' noise is counter-based, so every
number here is the same in every run.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist

from netgain.comm import GlobalQSGDConfig
from netgain.sync import NonFiniteGradientError, PlanMismatchError, SyncConfig, wrap

from compiles import compile_every_call, record_compiles
from distributed import mse_step, run, shard_state, sharded_mlp


class Two(torch.nn.Module):
    """Two 2-element parameters, a and b, whose gradients the tests set by hand."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
        self.b = torch.nn.Parameter(torch.tensor([0.0, 0.0]))


# rank -> the constant gradients of a and b; the inner SGD's lr is 0.25
GRADS = {0: ([1.0, 2.0], [2.0, -2.0]), 1: ([3.0, 0.0], [0.0, 2.0])}


def _hand_run(rank, steps, **options):
    """``steps`` inner SGD steps at the constant gradients GRADS[rank]; (a, b) after each step."""
    model = Two()
    outer = wrap(model, torch.optim.SGD(model.parameters(), lr=0.25), SyncConfig(codec="none", **options))
    after = []
    try:
        for _ in range(steps):
            model.a.grad, model.b.grad = (torch.tensor(g) for g in GRADS[rank])
            outer.step()
            after.append((model.a.detach().clone(), model.b.detach().clone()))
    finally:
        outer.close()
    return after


def hand_checked(rank, world_size):
    return {"diloco": _hand_run(rank, 4, period=2), "streaming": _hand_run(rank, 5, period=2, fragments=2, overlap_steps=1),
            "mix": _hand_run(rank, 2, period=2, fragments=2, overlap_steps=1, mix=0.5)}


def test_the_outer_step_is_diloco_arithmetic_on_a_hand_checked_example():
    (s0, r0), (s1, r1) = run(hand_checked, 2)
    assert s0 == s1 == "ok", (r0, r1)
    close = lambda t, values: torch.allclose(t, torch.tensor(values), atol=1e-5)  # noqa: E731

    # DiLoCo, period 2: a's pseudo-gradients after 2 steps of lr 0.25 are [0.5, 1] and [1.5, 0], mean
    # [1, 0.5]; momentum m = [1, 0.5], Nesterov update = mean + 0.9 m = [1.9, 0.95], a = [1, -2] - 0.7 * that
    a1, _ = r0["diloco"][0]
    assert close(a1, [0.75, -2.5]) and close(r1["diloco"][0][0], [0.25, -2.0])  # step 1: local, each rank its own
    for r in (r0, r1):
        assert close(r["diloco"][1][0], [-0.33, -2.665])
        # the second sync: the same mean; m = 0.9 m + mean = [1.9, 0.95], update = mean + 0.9 m = [2.71, 1.355]
        assert close(r["diloco"][3][0], [-0.33 - 0.7 * 2.71, -2.665 - 0.7 * 1.355])

    # Two fragments (a due at even steps, b at odd ones), each average applied one step after its launch.
    # b: launched at step 1 (pseudo-gradients [0.5, -0.5] and [0, 0.5], mean [0.25, 0]), applied at step 2:
    # b = -0.7 * 1.9 * [0.25, 0]; launched again at 3 from there, applied at 4 with m = [0.475, 0].
    # a: launched at step 2 (mean [1, 0.5] as above), applied at step 3, its step-3 progress dropped (mix 0);
    # launched at 4 after one step from the new a (mean [0.5, 0.25]), applied at 5 with m = [1.4, 0.7].
    for r in (r0, r1):
        streaming = r["streaming"]
        assert close(streaming[1][1], [-0.3325, 0.0])
        assert close(streaming[2][0], [-0.33, -2.665])
        assert close(streaming[3][1], [-0.3325 - 0.7 * (0.25 + 0.9 * 0.475), 0.0])
        assert close(streaming[4][0], [-0.33 - 0.7 * (0.5 + 0.9 * 1.4), -2.665 - 0.7 * (0.25 + 0.9 * 0.7)])
    assert not torch.equal(r0["streaming"][1][0], r1["streaming"][1][0])  # a is local at step 2, in flight
    # mix 0.5: b at step 2 is half its local value ([-1, 1] on rank 0, [0, -1] on rank 1), half the global one
    assert close(r0["mix"][1][1], [(-1 - 0.3325) / 2, 0.5]) and close(r1["mix"][1][1], [-0.3325 / 2, -0.5])


def against_periodic_averaging(rank, world_size):
    """The same data through netgain.sync at outer lr 1, no momentum, and through PyTorch's periodic averaging."""
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    torch.manual_seed(0)
    ours = _mlp()
    theirs = _mlp()
    theirs.load_state_dict(ours.state_dict())  # the same start on every rank (wrap gives ours rank 0's)
    outer = wrap(ours, torch.optim.SGD(ours.parameters(), lr=0.1),
                 period=4, codec="none", outer_lr=1.0, outer_momentum=0.0, nesterov=False)
    # PyTorch's averager counts its first step as step 0: warmup_steps=period-1 averages after steps 4, 8, 12
    averaged = PostLocalSGDOptimizer(torch.optim.SGD(theirs.parameters(), lr=0.1),
                                     PeriodicModelAverager(period=4, warmup_steps=3))
    try:
        _train(ours, outer, rank, 0, 12)
        _train(theirs, averaged, rank, 0, 12)
    finally:
        outer.close()
    return max(float((p - q).abs().max()) for p, q in zip(ours.parameters(), theirs.parameters()))


def test_outer_lr_one_without_momentum_is_pytorchs_periodic_averaging():
    for status, value in run(against_periodic_averaging, 2):
        assert status == "ok" and value < 1e-6, value  # the same up to fp32 rounding (Δ, then global - mean Δ)


def unbiased(rank, world_size, syncs, bits):
    """Each sync averages fixed pseudo-gradients at 2 bits; the decoded mean's error, summed over syncs,
    against its exact variance."""
    torch.manual_seed(0)
    model = torch.nn.ParameterDict({"a": torch.nn.Parameter(torch.zeros(3000)), "b": torch.nn.Parameter(torch.zeros(1096))})
    g = torch.Generator().manual_seed(100 + rank)
    deltas = {"a": torch.randn(3000, generator=g), "b": 5 * torch.randn(1096, generator=g)}  # scales differ per parameter
    outer = wrap(model, torch.optim.SGD(model.parameters(), lr=1.0),
                 period=1, codec=GlobalQSGDConfig(bits=bits), outer_lr=1.0, outer_momentum=0.0, nesterov=False)
    levels = 2 ** (bits - 1) - 1
    error, variance, exact_error = 0.0, 0.0, 0.0
    try:
        for _ in range(syncs):
            before = {n: p.detach().clone() for n, p in model.items()}
            sent = {n: before[n] - (before[n] - deltas[n]) for n in model}  # the pseudo-gradient as fp32 computes it
            for n, p in model.items():
                p.grad = deltas[n].clone()
            outer.step()  # inner: p -= delta; outer (lr 1, no momentum): p = before - decoded mean
            decoded = torch.cat([before[n] - model[n].detach() for n in model])
            mean = torch.cat([sent[n] for n in model])
            dist.all_reduce(mean)
            mean /= world_size
            scale = torch.cat([sent[n].abs().max().expand(sent[n].numel()) for n in model])
            dist.all_reduce(scale, op=dist.ReduceOp.MAX)
            # stochastic rounding of |x| levels / scale to an integer: variance (scale/levels)^2 f (1 - f), f its fraction
            f = torch.cat([sent[n] for n in model]).abs() * levels / scale
            f = f - f.floor()
            var = (scale / levels) ** 2 * f * (1 - f)
            dist.all_reduce(var)
            error = error + (decoded - mean)
            variance = variance + var / world_size ** 2
            exact_error = max(exact_error, float((decoded - mean).abs().max()))
    finally:
        outer.close()
    live = variance > 0
    return (error[live] / variance[live].sqrt()), exact_error


def test_the_pseudo_gradient_code_is_unbiased():
    syncs = 100
    for status, value in run(unbiased, 2, syncs, 2):
        assert status == "ok", value
        z, largest = value
        # Unbiased, each element's error summed over the syncs has mean 0 and the variance summed above,
        # so z has mean 0 and mean square 1 whatever its distribution; a sum of 100 independent bounded
        # terms, it is near N(0, 1) (CLT) except for elements whose rounding fraction is near 0 or 1 (a
        # rare-event count: a few may land beyond |z| = 4). On 4096 elements, mean(z) has standard
        # deviation 1/64 (0.08 is 5 of them) and mean(z^2) about sqrt(2/4096) = 0.022 (0.8..1.2 is 9);
        # N(0, 1) puts 0.26 of 4096 beyond |z| = 4. A biased code fails at once: round to nearest at
        # 2 bits is off by up to half a level (half the parameter's max |Δ|) per sync, summed 100 times.
        assert z.numel() > 4000
        assert abs(float(z.mean())) < 0.08
        assert 0.8 < float((z ** 2).mean()) < 1.2
        assert int((z.abs() > 4).sum()) <= 4
        assert largest > 0.1  # the code is lossy: the test is not vacuous


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _train(model, outer, rank, start, steps):
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
        outer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        outer.step()


def eager_averages(rank, world_size):
    """Compiles begun (kernels' names) by 2 periods of averages with the codec eager, then 2 more without: every
    kernel called is worth a compile here (NETGAIN_COMPILE=auto, a compiler, no heat needed)."""
    compile_every_call(setattr, os.environ.__setitem__)
    jobs = record_compiles(setattr)
    torch.manual_seed(0)
    model = _mlp()
    outer = wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), period=2, bits=4, overlap_steps=1)
    outer.eager = True
    _train(model, outer, rank, 0, 5)
    outer.wait()
    eager = [job[0].fn.__name__ for job in jobs]
    outer.eager = False
    _train(model, outer, rank, 5, 4)
    outer.wait()
    outer.close()
    return eager, [job[0].fn.__name__ for job in jobs]


def test_an_eager_codec_begins_no_compile_on_any_thread():
    """auto's route on trial begins no compile (SyncOptimizer.eager, kernel.cold on the sync thread): its decode,
    run on the collective's callback thread, begins none either. Not eager, the same averages begin compiles."""
    for status, value in run(eager_averages, 2):
        assert status == "ok", value
        eager, every = value
        assert eager == [] and every, value


# fragments due at steps 2 (b), 4 (a), 6 (b), ...: the save after step 6 holds b's average on the wire
RESUME = SyncConfig(period=4, fragments=2, overlap_steps=1, mix=0.25, bits=4)
SAVED_AT, MORE = 6, 5


def _equal(x, y) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and torch.equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_equal(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(map(_equal, x, y))
    return x == y


def _wrapped(seed):
    torch.manual_seed(seed)
    model = _mlp()
    return model, wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), RESUME)


def resume(rank, world_size, path):
    """Train, save rank 0's state, train on; a fresh model and optimizer load the file and train the same."""
    model, outer = _wrapped(0)
    try:
        _train(model, outer, rank, 0, SAVED_AT)
        state = outer.state_dict()
        if rank == 0:
            torch.save(state, path)
        dist.barrier()
        _train(model, outer, rank, SAVED_AT, MORE)
        first = outer.state_dict()
    finally:
        outer.close()
    again, outer = _wrapped(1)  # another initialisation: the checkpoint must replace it all
    try:
        outer.load_state_dict(torch.load(path, weights_only=True))
        _train(again, outer, rank, SAVED_AT, MORE)
        second = outer.state_dict()
    finally:
        outer.close()
    params = [(p.detach(), q.detach()) for p, q in zip(model.parameters(), again.parameters())]
    return {"pending_saved": len(state["pending"]), "params_equal": all(torch.equal(p, q) for p, q in params),
            "state_equal": _equal(first, second),  # global, momentum, pending, every rank's params and AdamW state
            "ranks_differ": not all(torch.equal(first["local"][0]["params"][n], first["local"][-1]["params"][n])
                                    for n in first["global"])}


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_resume_from_rank_zeros_checkpoint_is_bit_for_bit(world_size, tmp_path):
    for status, value in run(resume, world_size, str(tmp_path / "sync.pt")):
        assert status == "ok", value
        assert value == {"pending_saved": 1, "params_equal": True, "state_equal": True, "ranks_differ": True}, value


def sharded(rank, world_size):
    """FSDP2 on a 2 x 2 (replicate x shard) mesh, each node's 2 ranks one replica, the last layer's 3 rows sharded
    2 + 1: wrap() over the whole job (refused), then over the replicate group, codec none, periodic averaging every
    2 steps. Per step: the largest difference between this rank's shard after the sync and the replicas' mean of it
    before, or whether the replicas differ where no sync was due. Then a NaN in rank 1's shard as a sync is due."""
    mesh, model, optimizer = sharded_mlp()
    out = {}
    try:
        wrap(model, optimizer, period=2)
        out["refused"] = "no error"
    except ValueError as error:
        out["refused"] = str(error)
    group = mesh.get_group("replicate")
    outer = wrap(model, optimizer, process_group=group, period=2, codec="none", outer_lr=1.0, outer_momentum=0.0,
                 nesterov=False)

    def shard():
        return torch.cat([p.detach().to_local().reshape(-1) for p in model.parameters()])

    def replicas(flat):  # this shard on each node, gathered over the world (the sync's group is its own)
        every = [None] * world_size
        dist.all_gather_object(every, flat)
        return every[rank % 2::2]

    def inner_step(step):
        mse_step(model, optimizer, optimizer, rank, step)

    out["steps"] = []
    try:
        for step in range(6):
            inner_step(step)
            mean = torch.stack(replicas(shard())).mean(0)
            outer.after_inner_step()
            every = replicas(shard())
            out["steps"].append(float((every[0] - mean).abs().max()) if torch.equal(*every) else "differ")
        inner_step(6)
        outer.after_inner_step()
        inner_step(7)  # a sync is due after it
        if rank == 1:  # shard position 1's pseudo-gradient on one replica
            with torch.no_grad():
                next(model.parameters()).to_local().view(-1)[0] = float("nan")
        try:
            outer.after_inner_step()
            out["nan"] = "no error"
        except NonFiniteGradientError as error:
            out["nan"] = str(error)
    finally:
        outer.close()
    return out


def test_under_fsdp2_each_rank_syncs_its_shard_with_the_other_replicas():
    """DiLoCo across nodes with FSDP2 inside each: the sync averages each rank's local shards over the replicate
    group (its replicas then equal, the mean within fp32 rounding) and leaves them alone between syncs; a group
    spanning the shard mesh is refused, naming the group to pass; a NaN in one shard position's average raises
    NonFiniteGradientError on every rank of the mesh."""
    for rank, (status, value) in enumerate(run(sharded, 4, timeout=150)):
        assert status == "ok", value
        assert ("not finite" if rank % 2 else "the replicas of shard 1 raised NonFiniteGradientError") in value["nan"]
        assert "pass process_group=mesh['replicate'].get_group()" in value["refused"], value
        assert [s == "differ" for s in value["steps"]] == [True, False] * 3, value
        assert all(s < 1e-6 for s in value["steps"][1::2]), value


def sharded_resume(rank, world_size, path):
    """FSDP2 on a 2 x 2 mesh (the last layer's 3 rows sharded 2 + 1), DiLoCo's outer Nesterov step, 4-bit gqsgd, 2
    fragments, averages applied a step late: 6 inner steps, a DCP checkpoint (model, optimizer, sync) with an average
    on the wire, 4 more steps; then the checkpoint loaded (model and optimizer first, then the sync's each-rank parts)
    and the 4 steps again. Whether the replicas differed when saved, and whether every rank's shards, optimizer state
    and outer state came out bit for bit; then a sync of another period refused before any tensor loads."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from netgain.comm.fsdp import load_checkpoint
    mesh, model, optimizer = sharded_mlp()
    group = mesh.get_group("replicate")
    outer = wrap(model, optimizer, process_group=group, period=4, bits=4, fragments=2, overlap_steps=1)

    def step(t):
        mse_step(model, optimizer, outer, rank, t)

    def snapshot():
        flats = [t.clone() for f in outer.fragments for t in (f.global_, f.momentum)]
        return shard_state(model, optimizer) + flats + [torch.tensor(outer.inner_steps)]

    out = {}
    try:
        for t in range(6):
            step(t)
        every = [None] * world_size
        dist.all_gather_object(every, snapshot()[0])
        out["replicas_differ"] = not torch.equal(every[rank], every[(rank + 2) % 4])
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state, "sync": outer}, checkpoint_id=path)
        out["pending_saved"] = len(outer._pending)
        for t in range(6, 10):
            step(t)
        first = snapshot()
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        try:  # in one call DCP's one copy of the model would overwrite each rank's own
            load_checkpoint({**state, "sync": outer}, path)
            out["one_call"] = "no error"
        except ValueError as error:
            out["one_call"] = str(error)
        load_checkpoint(state, path)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        load_checkpoint({"sync": outer}, path)
        for t in range(6, 10):
            step(t)
        out["equal"] = all(torch.equal(a, b) for a, b in zip(first, snapshot()))
        outer.wait()  # the sync thread idle: wrap's collectives share its group
        other = wrap(model, optimizer, process_group=group, period=8, bits=4, fragments=2, overlap_steps=1)
        try:
            load_checkpoint({"sync": other}, path)
            out["other"] = "no error"
        except ValueError as error:
            out["other"] = str(error)
        other.close()
    finally:
        outer.close()
    return out


def test_under_fsdp2_a_dcp_checkpoint_resumes_every_ranks_shards_bit_for_bit(tmp_path):
    """DCP saves one replica's model and optimizer; the sync's state gives every rank its own back after local
    steps, and its outer state, so a resume repeats the run bit for bit; another config is refused by name."""
    for status, value in run(sharded_resume, 4, str(tmp_path / "ckpt"), timeout=180):
        assert status == "ok", value
        assert value["replicas_differ"] and value["pending_saved"] == 1 and value["equal"], value
        assert "the checkpoint's sync config differs in ['period']" in value["other"], value
        assert value["one_call"].startswith("load_checkpoint: load 'sync' in a call of its own"), value


def started(rank, world_size):
    """wrap() on replicas alike, then on replicas whose first fragment differs: the broadcasts it sent, and whether
    every rank then holds rank 0's parameters."""
    sent, real = [], dist.broadcast
    dist.broadcast = lambda tensor, *args, **kwargs: sent.append(tensor.numel()) or real(tensor, *args, **kwargs)
    try:
        starts = {}
        for case, seed in (("alike", 0), ("weight differs", rank)):
            torch.manual_seed(seed)
            model = torch.nn.Linear(3, 2)
            torch.nn.init.ones_(model.bias)  # the second fragment: alike on every rank
            wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), SyncConfig(fragments=2)).close()
            torch.manual_seed(0)
            first = torch.nn.Linear(3, 2)
            starts[case] = (list(sent), torch.equal(model.weight, first.weight))
            sent.clear()
    finally:
        dist.broadcast = real
    return starts


def test_every_rank_starts_from_rank_zeros_parameters_sending_only_fragments_that_differ():
    for status, value in run(started, 2):
        assert status == "ok", value
        assert value == {"alike": ([], True), "weight differs": ([6], True)}, value


def load_errors(rank, world_size):
    """A checkpoint of another config, world size or model, or not a checkpoint: ValueError, nothing loaded."""
    model, outer = _wrapped(0)
    try:
        _train(model, outer, rank, 0, 3)
        state = outer.state_dict()
    finally:
        outer.close()
    errors = []
    other = _mlp()
    other_config = wrap(other, torch.optim.AdamW(other.parameters()), RESUME, period=8)
    wider = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    other_model = wrap(wider, torch.optim.AdamW(wider.parameters()), RESUME)
    _, same = _wrapped(0)
    cases = [(other_config, state), (other_model, state), (same, {**state, "world_size": 3}), (same, {"weights": 1}),
             (same, {**state, "pending": [{"fragment": 5, "due": 9, "average": torch.zeros(3)}]})]
    for target, checkpoint in cases:
        try:
            target.load_state_dict(checkpoint)
            errors.append(None)
        except ValueError as error:
            errors.append(str(error))
    for wrapper in (other_config, other_model, same):
        wrapper.close()
    return errors


def test_a_checkpoint_of_another_config_world_size_or_model_is_refused():
    for status, errors in run(load_errors, 2):
        assert status == "ok", errors
        config, model, world, garbage, pending = errors
        assert "differs in ['period']" in config
        assert "another model's" in model and "0.weight" in model
        assert "3 ranks, this run has 2" in world
        assert "not a netgain sync state" in garbage
        assert "pending" in pending


def mismatched(rank, world_size):
    """Each case differs on rank 1 only; every rank must raise PlanMismatchError naming what differs."""
    raised = []
    for mine, theirs, model in ((SyncConfig(period=16), SyncConfig(period=8), _mlp),
                                (SyncConfig(bits=8), SyncConfig(bits=4), _mlp),
                                (SyncConfig(), SyncConfig(), lambda: torch.nn.Linear(8, 4 + rank))):
        m = model()
        try:
            wrap(m, torch.optim.SGD(m.parameters(), lr=0.1), mine if rank == 0 else theirs).close()
            raised.append(None)
        except PlanMismatchError as error:
            raised.append(str(error))
    return raised


def test_a_config_or_model_mismatch_raises_plan_mismatch_on_every_rank():
    for status, raised in run(mismatched, 2):
        assert status == "ok", raised
        period, bits, model = raised
        assert "sync.period" in period and "sync.comm.codec.bits" in bits and "model" in model, raised


def nan_at_a_sync(rank, world_size, codec, overlap):
    """Rank 1 puts a NaN into a parameter before step 2, a sync step (period 2): the step that applies that
    sync's average raises on every rank."""
    model = _mlp()
    outer = wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), period=2, codec=codec, overlap_steps=overlap)
    try:
        for step in range(4):
            if step == 1 and rank == 1:
                with torch.no_grad():
                    model[0].weight[0, 0] = float("nan")
            try:
                _train(model, outer, rank, step, 1)
            except NonFiniteGradientError as error:
                return step + 1, str(error)
        return None
    finally:
        outer.close()


@pytest.mark.parametrize("codec,overlap", [("gqsgd", 0), ("none", 1)])
def test_nan_in_one_ranks_parameters_raises_on_every_rank(codec, overlap):
    for status, value in run(nan_at_a_sync, 2, codec, overlap):
        assert status == "ok" and value is not None, value
        step, message = value
        assert step == 2 + overlap and "NaN/Inf" in message, value


@pytest.mark.parametrize("options,name", [({"period": 0}, "period"), ({"period": 2.5}, "period"),
                                          ({"fragments": 0}, "fragments"), ({"fragments": 17}, "fragments"),
                                          ({"overlap_steps": 16}, "overlap_steps"), ({"overlap_steps": -1}, "overlap_steps"),
                                          ({"outer_lr": 0}, "outer_lr"), ({"outer_lr": math.inf}, "outer_lr"),
                                          ({"outer_momentum": 1.0}, "outer_momentum"), ({"nesterov": 1}, "nesterov"),
                                          ({"outer_momentum": 0.0}, "nesterov"), ({"mix": 1.5}, "mix"),
                                          ({"codec": "topk"}, "codec"), ({"codec": "auto"}, "codec"), ({"bits": 1}, "bits"),
                                          ({"codec": "none", "bits": 4}, "bits"),
                                          ({"codec": GlobalQSGDConfig(bits=4), "bits": 4}, "bits"), ({"seed": "0"}, "seed")])
def test_bad_arguments_raise_value_error_naming_the_argument(options, name):
    with pytest.raises(ValueError, match=name):
        SyncConfig(**options)


def test_more_fragments_than_parameters_is_refused_before_any_collective():
    model = torch.nn.Linear(4, 4)  # two parameters
    with pytest.raises(ValueError, match="fragments=3"):
        wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), period=4, fragments=3)
