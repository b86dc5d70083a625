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


def _by_replica(rank, world, step=0):
    """Per parameter, each replica's sum of its ranks' full local gradients (FSDP's SUM order), cut to this
    rank's shard."""
    plain = _model()
    _loss(plain, rank, step).backward()
    out = {}
    for name, p in plain.named_parameters():
        grads = [torch.empty_like(p.grad) for _ in range(world)]
        dist.all_gather(grads, p.grad)
        shard, rows = rank % SHARDS, -(-p.shape[0] // SHARDS)
        out[name] = [(grads[r * SHARDS] + grads[r * SHARDS + 1])[shard * rows:(shard + 1) * rows]
                     for r in range(REPLICAS)]
    return out


def _reference(rank, world):
    """This rank's shard of the mean gradient, and the per-parameter max |shard mean| over replicas."""
    out = {}
    for name, (first, second) in _by_replica(rank, world).items():
        scale = max(float((b / SHARDS).abs().max()) for b in (first, second))
        out[name] = ((first + second) / (REPLICAS * SHARDS), scale)
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
    for overlap in (True, False):  # the average started and left on the wire, or held; then a second backward
        state = fsdp.register(model, mesh, GlobalQSGDConfig(bits=4), min_compress_numel=0, overlap=overlap)
        started, start = [], state.start_flat
        state.start_flat = lambda index, *rest: (started.append((state.step, index)), start(index, *rest))
        _loss(model, rank).backward()
        first = _grads(model)
        _loss(model, rank, 1).backward()  # accumulates into the gradients there: FSDP reads them in its hook
        results[f"overlap={overlap}"] = {"first": first, "accumulated": _grads(model), "started": started}
        model.zero_grad(set_to_none=True)
    x, y = _batch(rank)
    if rank == 3:
        x[0, 0] = float("nan")
    try:
        torch.nn.functional.mse_loss(model(x), y).backward()
        results["nan"] = "no error"
    except Exception as error:
        results["nan"] = type(error).__name__
    return results


def on_the_mesh(fn, *args):
    """Each rank's result of fn on the 2 x 2 mesh's 4 processes; fails with every rank's status unless all ran."""
    results = run(fn, REPLICAS * SHARDS, *args, timeout=150)
    assert all(status == "ok" for status, _ in results), results
    return [value for _, value in results]


@pytest.fixture(scope="module")
def aggregates():
    return on_the_mesh(_aggregates)


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


def test_overlapped_averages_are_the_held_ones_bit_for_bit_and_accumulation_is_held(aggregates):
    """overlap=True starts every group's average and returns (the backward goes on); the step's end waits for
    them, so the optimizer reads the same bits as with overlap=False. A backward that accumulates into
    gradients already there is held group by group: FSDP adds the hook's tensor to them right after it."""
    for result in aggregates:
        on, off = result["overlap=True"], result["overlap=False"]
        assert on["started"] and {step for step, _ in on["started"]} == {0} and not off["started"]
        assert len(on["started"]) == len(on["first"]) // 2  # every group (weight and bias) of the first step
        for name in on["first"]:
            assert torch.equal(on["first"][name], off["first"][name])
            assert torch.equal(on["accumulated"][name], off["accumulated"][name])


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


RESUMED = {"gqsgd": ("GlobalQSGDConfig", {"bits": 4}), "lowrank": ("LowRankConfig", {"rank": 2}),
           "topk": ("TopKConfig", {"ratio": 0.1})}


def _resume(rank, world, folder):
    """Per codec: k steps, a DCP checkpoint, k more; then a fresh model resumed from the checkpoint runs the
    same k. Then low rank's checkpoint loaded onto 1 x 4 and 4 x 1 meshes, and one with a crafted header."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import netgain.comm as comm
    import netgain.comm.fsdp as fsdp

    mesh = _mesh()

    def fresh(codec, mesh=mesh, model=None):
        model = _shard(model or _model(), mesh)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        name, options = codec
        return model, optimizer, fsdp.register(model, mesh, getattr(comm, name)(**options), min_compress_numel=0)

    def refusal(state, path):
        try:
            fsdp.load_checkpoint({"comm": state}, f"{folder}/{path}")
            return "loaded"
        except Exception as error:
            return f"{type(error).__name__}: {error}"

    results = {}
    for label in RESUMED:
        path = f"{folder}/{label}"
        model, optimizer, state = fresh(RESUMED[label])
        _train(model, optimizer, rank, 3, 0)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd, "comm": state}, checkpoint_id=path)
        _train(model, optimizer, rank, 3, 3)
        continued = _params(model)

        model, optimizer, state = fresh(RESUMED[label])
        model_sd, optim_sd = get_state_dict(model, optimizer)
        checkpoint = {"model": model_sd, "optim": optim_sd, "comm": state}
        if label == "gqsgd":  # DCP's own load works too; load_checkpoint reads data only, the header first
            dcp.load(checkpoint, checkpoint_id=path)
        else:
            fsdp.load_checkpoint(checkpoint, path)
        set_state_dict(model, optimizer, model_state_dict=checkpoint["model"], optim_state_dict=checkpoint["optim"])
        assert state.step == 3
        _train(model, optimizer, rank, 3, 3)
        resumed = _params(model)
        results[label] = (all(torch.equal(continued[n], resumed[n]) for n in continued), state.step)

    from torch.distributed.device_mesh import init_device_mesh
    for shape in ((1, REPLICAS * SHARDS), (REPLICAS * SHARDS, 1)):
        other = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        results[shape] = refusal(fresh(RESUMED["lowrank"], other)[2], "lowrank")
    results["rank 3"] = refusal(fresh(("LowRankConfig", {"rank": 3}))[2], "lowrank")
    results["from gqsgd"] = refusal(fresh(RESUMED["lowrank"])[2], "gqsgd")
    larger = torch.nn.Sequential(*_model(), torch.nn.Linear(4, 4))
    results["other model"] = refusal(fresh(RESUMED["lowrank"], model=larger)[2], "lowrank")

    marker = f"{folder}/code-ran"
    dcp.save({"comm": {"header": _RunsCode(marker)}}, checkpoint_id=f"{folder}/crafted")
    results["crafted"] = refusal(fresh(RESUMED["lowrank"])[2], "crafted")
    import os
    results["code ran"] = os.path.exists(marker)
    return results


def _params(model):
    return {name: p.to_local().detach().clone() for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    return on_the_mesh(_resume, str(tmp_path_factory.mktemp("checkpoints")))


@pytest.mark.parametrize("label", RESUMED)
def test_dcp_checkpoint_resumes_bit_for_bit(resumed, label):
    """gqsgd keeps only its step; low rank its residual and warm start, top-k its EF21 g_i and g."""
    assert [rank[label] for rank in resumed] == [(True, 6)] * 4


@pytest.mark.parametrize("shape", [(1, 4), (4, 1)])
def test_a_checkpoint_loads_onto_its_own_mesh_only(resumed, shape):
    for rank in resumed:
        assert rank[shape].startswith("ValueError: the checkpoint's comm state does not fit this mesh: it was saved "
                                      f"on a 2 x 2 (replicate x shard) mesh, this run's is {shape[0]} x {shape[1]}")


@pytest.mark.parametrize("case, message", [
    ("rank 3", "ValueError: the checkpoint's comm config differs in ['codec']"),
    ("from gqsgd", "ValueError: the checkpoint's comm config differs in ['codec', 'codec_type', 'warmup_steps']"),
    ("other model", "ValueError: the checkpoint's comm state is another model's: its trainable parameters differ "
                    "from this model's in ['5.weight', '5.bias']"),
])
def test_a_checkpoint_of_another_config_or_model_is_named(resumed, case, message):
    """Named from the header, before DCP would meet tensors of another size (or none)."""
    for rank in resumed:
        assert rank[case].startswith(message), rank[case]


def test_a_crafted_comm_header_runs_no_code(resumed):
    """load_checkpoint reads the comm state's header before anything else: as data only too."""
    for rank in resumed:
        assert rank["crafted"].startswith("UnpicklingError: checkpoint ") and "refused" in rank["crafted"]
        assert not rank["code ran"]


LOWRANK_STEPS = 3


def _powersgd(replicas, warm_t):
    """PowerSGD's arithmetic for one shard matrix: the replicas' M_i (error feedback added) and the warm start
    Q^T -> the mean's rank-r approximation P Q^T and the next warm start."""
    p = sum(m @ warm_t.T for m in replicas) / len(replicas)
    basis = torch.linalg.qr(p).Q
    q = sum(m.T @ basis for m in replicas) / len(replicas)
    return basis @ q.T, q.T


def _lowrank(rank, world):
    """Low rank (fp32 factors) on each shard across replicas against _powersgd, step by step; EF21's top-k
    and random-k at ratio 1 against the mean; NaN on rank 3 and a different codec on rank 3."""
    import netgain.comm.fsdp as fsdp
    from netgain.comm import GlobalQSGDConfig, LowRankConfig, PlanMismatchError, RandomKConfig, TopKConfig
    from netgain.comm.lowrank import LowRank
    from netgain.cost.network import as_matrix

    mesh = _mesh()
    results = {}
    try:
        fsdp.register(_shard(_model(), mesh), mesh, GlobalQSGDConfig() if rank == 3 else LowRankConfig())
    except PlanMismatchError as error:
        results["mismatch"] = type(error).__name__

    codec = LowRank(rank=4, factors="fp32")
    model = _shard(_model(), mesh)
    fsdp.register(model, mesh, LowRankConfig(rank=4, factors="fp32"), warmup_steps=0, min_compress_numel=0)
    residuals, warm, errors, gaps = {}, {}, [], []
    for step in range(LOWRANK_STEPS):
        _loss(model, rank, step).backward()
        grads = _grads(model)
        model.zero_grad(set_to_none=True)
        for name, replicas in _by_replica(rank, world, step).items():
            ms = [b / SHARDS + residuals.get((name, r), 0) for r, b in enumerate(replicas)]
            rows, cols = as_matrix(ms[0].shape)
            if rows and codec.compresses(rows, cols):
                if name not in warm:
                    warm[name] = torch.empty(codec.rank * cols)
                    codec.fill_shared(name, warm[name])
                approx, warm[name] = _powersgd(ms, warm[name].view(codec.rank, cols))
                residuals.update({(name, r): m - approx for r, m in enumerate(ms)})
                gaps.append(float((approx - sum(ms) / REPLICAS).abs().max() / approx.abs().max()))
            else:
                approx = sum(ms) / REPLICAS
            errors.append(float((grads[name] - approx).abs().max() / approx.abs().max()))
    results["lowrank error"], results["lowrank gap"] = max(errors), min(gaps)

    for config in (TopKConfig(ratio=1.0), RandomKConfig(ratio=1.0)):
        model = _shard(_model(), mesh)
        fsdp.register(model, mesh, config, min_compress_numel=0)
        _loss(model, rank).backward()
        results[type(config).__name__] = _grads(model)
    results["reference"] = _reference(rank, world)

    for factors in ("gqsgd", "fp32"):
        model = _shard(_model(), mesh)
        fsdp.register(model, mesh, LowRankConfig(factors=factors), warmup_steps=0)
        x, y = _batch(rank)
        if rank == 3:
            x[0, 0] = float("nan")
        try:
            torch.nn.functional.mse_loss(model(x), y).backward()
            results[f"nan {factors}"] = "no error"
        except Exception as error:
            results[f"nan {factors}"] = type(error).__name__
    return results


@pytest.fixture(scope="module")
def lowrank():
    return on_the_mesh(_lowrank)


def test_lowrank_on_each_shard_is_powersgd_across_replicas(lowrank):
    """Error feedback and warm start included, to float rounding; far from the exact mean (it does compress)."""
    for rank in lowrank:
        assert rank["lowrank error"] < 1e-5, rank["lowrank error"]
        assert rank["lowrank gap"] > 1e-2, rank["lowrank gap"]


@pytest.mark.parametrize("config", ["TopKConfig", "RandomKConfig"])
def test_ef21_at_ratio_1_is_the_mean(lowrank, config):
    """Every coordinate sent: g_i and g start at 0, so the first step's g is the mean (random-k's to its
    fixed point)."""
    for rank in lowrank:
        for name, (mean, scale) in rank["reference"].items():
            assert (rank[config][name] - mean).abs().max() <= 1e-6 * scale, name


def test_lowrank_nan_and_plan_mismatch_raise_on_every_rank(lowrank):
    for factors in ("gqsgd", "fp32"):
        assert [rank[f"nan {factors}"] for rank in lowrank] == ["NonFiniteGradientError"] * 4
    assert [rank["mismatch"] for rank in lowrank] == ["PlanMismatchError"] * 4


def test_register_explains_what_it_needs():
    import netgain.comm.fsdp as fsdp
    for config in ("auto", "gqsgd"):
        with pytest.raises(TypeError, match="fully_shard"):
            fsdp.register(torch.nn.Linear(2, 2), None, config)


AUTO_STEPS = 5
# the plan the checkpoint's runs are held to, per FSDP group (the measured link would move a plan between runs)
SCRIPTED = {1: "lowrank(rank=4,factors=fp32)", 2: "gqsgd(bits=4,encoding=packed)", 3: "bf16"}


def _auto(rank, world, folder):
    """auto on each shard position's replicas: AUTO_STEPS steps' statistics; NaN on rank 3; a codec forced on rank 1
    (one replicate group's mismatch); a DCP checkpoint after 3 steps of a scripted plan, against 3 more."""
    import json

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import netgain.comm.fsdp as fsdp
    from netgain.comm.codecs import GlobalQSGD

    mesh = _mesh()

    def fresh(scripted=False):
        model = _shard(_model(), mesh)
        state = fsdp.register(model, mesh, "auto", min_compress_numel=0)
        if scripted:  # the planner's own solve, its choice held to SCRIPTED
            options = [option.describe() for option in state.planner.options]
            state.planner._soonest = lambda indices, *_: [options.index(SCRIPTED[i]) for i in indices]
        return model, torch.optim.Adam(model.parameters(), lr=1e-2), state

    def error_of(backward):
        try:
            backward()
            return "no error"
        except Exception as error:
            return type(error).__name__

    results = {"steps": []}
    model, optimizer, state = fresh()
    for step in range(AUTO_STEPS):
        _train(model, optimizer, rank, 1, step)
        results["steps"].append(state.last_step)

    model, _, _ = fresh()
    x, y = _batch(rank)
    if rank == 3:
        x[0, 0] = float("nan")
    results["nan"] = error_of(lambda: torch.nn.functional.mse_loss(model(x), y).backward())

    model, _, state = fresh()
    if rank == 1:  # its replicate group (ranks 1, 3) fails on the header's signature; ranks 0 and 2 learn it at the end
        state.chooser.codec_for = lambda index, numel: GlobalQSGD(2)
    # at the first step, whose unplanned codec sends a header on every rank (a plain plan's collectives have none)
    results["mismatch"] = error_of(lambda: _loss(model, rank, 0).backward())

    model, optimizer, state = fresh(scripted=True)
    _train(model, optimizer, rank, 3, 0)
    results["planned"] = {index: codec.describe() for index, (_, codec) in state.planner.plan.items()}
    saved = json.loads(json.dumps(state.planner.state_dict()))
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd, "comm": state}, checkpoint_id=f"{folder}/auto")
    _train(model, optimizer, rank, 3, 3)
    continued = _params(model)

    model, optimizer, state = fresh(scripted=True)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    checkpoint = {"model": model_sd, "optim": optim_sd, "comm": state}
    fsdp.load_checkpoint(checkpoint, f"{folder}/auto")
    set_state_dict(model, optimizer, model_state_dict=checkpoint["model"], optim_state_dict=checkpoint["optim"])
    results["loaded"] = json.loads(json.dumps(state.planner.state_dict())) == saved
    _train(model, optimizer, rank, 3, 3)
    resumed = _params(model)
    results["resumed"] = (all(torch.equal(continued[n], resumed[n]) for n in continued), state.step)

    for settled in (False, True):  # the scripted plan's steps held, or overlapped as auto's settled steps are
        model, optimizer, state = fresh(scripted=True)
        _train(model, optimizer, rank, 2, 0)  # planned by now, after one whole step or two (WARMUP_WORTH)
        state.planner.settled = lambda step, settled=settled: settled
        state.planner.observes = lambda step, settled=settled: not settled
        _train(model, optimizer, rank, 2, 2)
        results[f"settled={settled}"] = {"params": _params(model), "overlapping": state._overlapping,
                                         "unobserved": state.pipeline.communicator.observer is None,
                                         "samples": len(state.planner._pending_samples)}
    return results


@pytest.fixture(scope="module")
def auto(tmp_path_factory):
    return on_the_mesh(_auto, str(tmp_path_factory.mktemp("auto")))


def test_auto_plans_each_group_and_reports_it(auto):
    """Each FSDP group is one bucket the planner plans; each step runs the plan the step before it made, and the
    replicas of a shard (ranks 0 and 2, 1 and 3) agree on plan and link."""
    for rank in auto:
        last = rank["steps"][-1]
        assert last["buckets"] == 3 and last["step"] == AUTO_STEPS - 1
        assert set(last["plan"]) == {1, 2, 3} and last["bandwidth_Bps"] > 0
        assert last["backward_s"] > 0 and last["wait_s"] > 0  # the backward's own time, and its time in the hook
        planned = [(before, after) for before, after in zip(rank["steps"], rank["steps"][1:]) if before["plan"]]
        assert planned
        for before, after in planned:
            assert {r["index"]: r["codec"] for r in after["per_bucket"]} == before["plan"]
    for replica, other in ((0, 2), (1, 3)):
        for key in ("plan", "bandwidth_Bps", "latency_s"):
            assert [step[key] for step in auto[replica]["steps"]] == [step[key] for step in auto[other]["steps"]], key


def test_auto_nan_and_plan_mismatch_raise_on_every_rank(auto):
    """A mismatch in one replicate group raises on the other's ranks too: the step's verdict crosses the shard group."""
    assert [rank["nan"] for rank in auto] == ["NonFiniteGradientError"] * 4
    assert [rank["mismatch"] for rank in auto] == ["PlanMismatchError"] * 4


def test_auto_dcp_checkpoint_resumes_its_plan_bit_for_bit(auto):
    """The plan, the planner's agreed state, low rank's memory and the step come back: the 3 resumed steps equal
    the 3 continued ones exactly."""
    for rank in auto:
        assert rank["planned"] == SCRIPTED and rank["loaded"]
        assert rank["resumed"] == (True, 6)


def test_auto_overlaps_its_settled_steps_unobserved_with_the_held_steps_bits(auto):
    """A settled step's groups cross the link while the backward goes on, as a fixed codec's do, and its
    collectives are no samples of the link; the optimizer reads the same bits as when every step is held."""
    for rank in auto:
        held, overlapped = rank["settled=False"], rank["settled=True"]
        assert not (held["overlapping"] or held["unobserved"])
        assert overlapped["overlapping"] and overlapped["unobserved"] and overlapped["samples"] == 0
        assert all(torch.equal(held["params"][n], overlapped["params"][n]) for n in held["params"])


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
