"""netgain.comm.fsdp on FSDP2 over gloo: a 2 x 2 (replicate x shard) mesh, 4 CPU processes.

Each spawn serves several checks (a spawn of 4 ranks costs seconds on 2 cores). The reference
gradient is computed from every rank's full local gradient of an unsharded copy of the model,
in the order FSDP adds them, so `none` matches it bit for bit. Noise is counter-based and the
data seeded, so every number here is the same in every run.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distributed import run

REPLICAS, SHARDS = 2, 2
STEPS = 40  # repeated estimates of one gradient (the noise changes with the step)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 4))


def _batch(rank: int, step: int = 0):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _shard(model, mesh):
    from torch.distributed.fsdp import fully_shard
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh["shard"])
    return fully_shard(model, mesh=mesh["shard"])


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (REPLICAS, SHARDS), mesh_dim_names=("replicate", "shard"))


def _loss(model, rank, step=0):
    x, y = _batch(rank, step)
    return torch.nn.functional.mse_loss(model(x), y)


def _reference(rank, world):
    """This rank's shard of the mean gradient, and the per-parameter max |shard mean| over replicas."""
    plain = _model()
    _loss(plain, rank).backward()
    out = {}
    for name, p in plain.named_parameters():
        grads = [torch.empty_like(p.grad) for _ in range(world)]
        dist.all_gather(grads, p.grad)
        by_replica = [grads[r * SHARDS] + grads[r * SHARDS + 1] for r in range(REPLICAS)]  # FSDP's SUM order
        shard = rank % SHARDS
        rows = -(-p.shape[0] // SHARDS)
        cut = lambda t: t[shard * rows:(shard + 1) * rows]  # noqa: E731
        mean = cut((by_replica[0] + by_replica[1]) / (REPLICAS * SHARDS))
        scale = max(float(cut(b / SHARDS).abs().max()) for b in by_replica)
        out[name] = (mean, scale)
    return out


def _grads(model):
    return {name: p.grad.to_local().clone() for name, p in model.named_parameters()}


def _aggregates(rank, world):
    """Per codec: the aggregated gradient of STEPS backward passes of one batch, against the exact mean."""
    import netgain.comm.fsdp as fsdp
    from netgain.comm import CastConfig, GlobalQSGDConfig, NoCompressionConfig, PlanMismatchError

    reference = _reference(rank, world)
    mesh = _mesh()
    model = _shard(_model(), mesh)
    results = {}
    try:
        fsdp.register(model, mesh, GlobalQSGDConfig(bits=8 if rank else 4))
    except PlanMismatchError as error:
        results["mismatch"] = type(error).__name__
    from torch.distributed.fsdp import fully_shard
    try:
        fsdp.register(fully_shard(_model(), mesh=mesh), mesh)  # native HSDP: FSDP's own fp32 all-reduce
    except ValueError as error:
        results["native"] = str(error)
    codecs = {"none": NoCompressionConfig(), "fp16": CastConfig("fp16"), "bf16": CastConfig("bf16"),
              "gqsgd-int8": GlobalQSGDConfig(bits=8, encoding="int8"), "gqsgd-8": GlobalQSGDConfig(bits=8),
              "gqsgd-4": GlobalQSGDConfig(bits=4), "skip-1d": GlobalQSGDConfig(bits=4)}
    for label, config in codecs.items():
        state = fsdp.register(model, mesh, config, min_compress_numel=0, skip_1d=label == "skip-1d")
        steps = 1 if label in ("none", "fp16", "bf16", "skip-1d") else STEPS
        estimates = []
        for _ in range(steps):
            _loss(model, rank).backward()
            estimates.append(_grads(model))
            model.zero_grad(set_to_none=True)
        results[label] = {"estimates": estimates, "last_step": state.last_step, "steps": state.step}
    results["reference"] = reference
    x, y = _batch(rank)
    if rank == 3:
        x[0, 0] = float("nan")
    try:
        torch.nn.functional.mse_loss(model(x), y).backward()
        results["nan"] = "no error"
    except Exception as error:
        results["nan"] = type(error).__name__
    return results


@pytest.fixture(scope="module")
def aggregates():
    results = run(_aggregates, REPLICAS * SHARDS, timeout=150)
    assert all(status == "ok" for status, _ in results), results
    return [value for _, value in results]


def test_none_equals_the_uncompressed_mean_exactly(aggregates):
    for rank in aggregates:
        (grads,) = rank["none"]["estimates"]
        for name, (mean, _) in rank["reference"].items():
            assert torch.equal(grads[name], mean), name


@pytest.mark.parametrize("label, levels", [("gqsgd-int8", 127 // REPLICAS), ("gqsgd-8", 127), ("gqsgd-4", 7)])
def test_gqsgd_within_its_bound_and_unbiased(aggregates, label, levels):
    for rank in aggregates:
        estimates = rank[label]["estimates"]
        for name, (mean, scale) in rank["reference"].items():
            errors = torch.stack([e[name] - mean for e in estimates])
            # each replica's code is within one level of its value: the mean over replicas is too
            assert errors.abs().max() <= scale / levels * (1 + 1e-5), (label, name)
        # unbiased: the projection of the error on a fixed direction averages to 0 within 3 standard errors
        flat = torch.stack([torch.cat([e[n].flatten() - m.flatten() for n, (m, _) in rank["reference"].items()])
                            for e in estimates])
        direction = torch.randn(flat.shape[1], generator=torch.Generator().manual_seed(7))
        t = flat @ direction
        assert t.std() > 0, label
        assert abs(t.mean()) <= 3 * t.std() / len(t) ** 0.5, (label, float(t.mean()), float(t.std()))


def test_skip_1d_sends_biases_exact(aggregates):
    for rank in aggregates:
        (grads,) = rank["skip-1d"]["estimates"]
        for name, (mean, _) in rank["reference"].items():
            assert torch.equal(grads[name], mean) == name.endswith("bias"), name


@pytest.mark.parametrize("label, relative", [("fp16", 2.0**-10), ("bf16", 2.0**-7)])
def test_casts_within_their_rounding(aggregates, label, relative):
    for rank in aggregates:
        (grads,) = rank[label]["estimates"]
        for name, (mean, scale) in rank["reference"].items():
            assert (grads[name] - mean).abs().max() <= relative * scale, (label, name)


def test_statistics_of_every_step(aggregates):
    for rank in aggregates:
        assert rank["gqsgd-8"]["steps"] == STEPS
        last = rank["gqsgd-8"]["last_step"]
        assert last["buckets"] == 3 and last["step"] == STEPS - 1  # one record per FSDP group (three Linears)
        assert {r["codec"] for r in last["per_bucket"]} == {"gqsgd(bits=8,encoding=packed)"}
        assert 3 < last["compression_ratio"] < 4
        assert rank["none"]["last_step"]["compression_ratio"] == 1.0  # fp32, no header


def test_nan_and_plan_mismatch_raise_on_every_rank(aggregates):
    assert [rank["nan"] for rank in aggregates] == ["NonFiniteGradientError"] * 4
    assert [rank["mismatch"] for rank in aggregates] == ["PlanMismatchError"] * 4


def test_a_model_sharded_over_the_2d_mesh_is_refused(aggregates):
    for rank in aggregates:
        assert "call fully_shard(module, mesh=mesh['shard'])" in rank["native"]


def _train(model, optimizer, rank, steps, first):
    for step in range(first, first + steps):
        _loss(model, rank, step).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _resume(rank, world, folder):
    """k steps, a DCP checkpoint, k more; then a fresh model resumed from the checkpoint runs the same k."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import netgain.comm.fsdp as fsdp
    from netgain.comm import GlobalQSGDConfig

    mesh = _mesh()

    def fresh():
        model = _shard(_model(), mesh)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        return model, optimizer, fsdp.register(model, mesh, GlobalQSGDConfig(bits=4), min_compress_numel=0)

    model, optimizer, state = fresh()
    _train(model, optimizer, rank, 3, 0)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd, "comm": state}, checkpoint_id=folder)
    _train(model, optimizer, rank, 3, 3)
    continued = _params(model)

    model, optimizer, state = fresh()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    checkpoint = {"model": model_sd, "optim": optim_sd, "comm": state}
    dcp.load(checkpoint, checkpoint_id=folder)
    set_state_dict(model, optimizer, model_state_dict=checkpoint["model"], optim_state_dict=checkpoint["optim"])
    assert state.step == 3
    _train(model, optimizer, rank, 3, 3)
    resumed = _params(model)
    return all(torch.equal(continued[n], resumed[n]) for n in continued), state.step


def _params(model):
    return {name: p.to_local().detach().clone() for name, p in model.named_parameters()}


def test_dcp_checkpoint_resumes_bit_for_bit(tmp_path):
    results = run(_resume, REPLICAS * SHARDS, str(tmp_path / "checkpoint"), timeout=120)
    assert results == [("ok", (True, 6))] * 4, results


def test_register_explains_what_it_needs():
    import netgain.comm.fsdp as fsdp
    with pytest.raises(TypeError, match="fully_shard"):
        fsdp.register(torch.nn.Linear(2, 2), None)
    with pytest.raises(ValueError, match="EF21"):
        fsdp.register(torch.nn.Linear(2, 2), None, "topk")


class _RunsCode:
    """A pickle that runs code on load, as a crafted checkpoint would."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        from pathlib import Path
        return (Path.touch, (self.marker,))


def test_load_checkpoint_reads_data_only(tmp_path):
    """DCP's own load would run a pickle in .metadata or in a non-tensor item; load_checkpoint refuses both."""
    import pickle

    import torch.distributed.checkpoint as dcp

    import netgain.comm.fsdp as fsdp

    good = tmp_path / "good"
    dcp.save({"w": torch.arange(4.0), "step": {"n": 3}}, checkpoint_id=good)  # one process: no group needed
    loaded = {"w": torch.zeros(4), "step": {"n": 0}}
    fsdp.load_checkpoint(loaded, good)
    assert torch.equal(loaded["w"], torch.arange(4.0)) and loaded["step"] == {"n": 3}

    marker = tmp_path / "code-ran"
    item = tmp_path / "item"
    dcp.save({"w": torch.arange(4.0), "step": _RunsCode(marker)}, checkpoint_id=item)
    with pytest.raises(pickle.UnpicklingError, match="refused, it holds more than tensors and plain data"):
        fsdp.load_checkpoint({"w": torch.zeros(4), "step": None}, item)
    assert not marker.exists()

    (good / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(pickle.UnpicklingError, match="names pathlib.Path.touch, which is not DCP metadata"):
        fsdp.load_checkpoint({"w": torch.zeros(4)}, good)
    assert not marker.exists()
