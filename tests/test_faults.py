"""Faults in the hook's inputs, on real gloo ranks: finite gradients past float32, 0-element parameters,
ranks that disagree before the hook's group exists or never register, and comm states of another model."""

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import netgain.comm as comm

from distributed import run
from test_hook import Layers, ddp


def huge_gradients(rank, world_size, codec, options):
    """One step whose gradient of b is 3e38 everywhere on every rank: finite, but the bucket's sum is not."""
    model = ddp(Layers())
    state = comm.register(model, codec, min_compress_numel=0, **options)
    try:
        (model(0, rank) + (model.module.b * 3e38).sum()).backward()
        return float(model.module.b.grad.min()), float(model.module.b.grad.max())
    finally:
        state.close()


@pytest.mark.parametrize("codec", ["none", "qsgd", "bf16", "gqsgd"])
def test_finite_gradients_whose_bucket_sum_overflows_are_averaged(codec):
    """The NaN check sums the bucket: a sum past float32 of finite elements is no NaN (each element is checked then)."""
    results = run(huge_gradients, 2, codec, {})
    assert all(status == "ok" for status, _ in results), results
    for _, (low, high) in results:
        assert 2.9e38 <= low <= high <= 3.0e38 * (1 + 2 ** -7)


@pytest.mark.parametrize("factors", ["gqsgd", "fp32"])
def test_finite_gradients_whose_product_overflows_say_so_on_every_rank(factors):
    """Low rank's P = M Q sums 3e38-sized products past float32: named as an overflow, not as NaN gradients."""
    results = run(huge_gradients, 2, "lowrank", {"factors": factors, "warmup_steps": 0})
    assert all(status == "error" and "finite gradients whose sum overflowed float32" in message
               and "NaN" not in message for status, message in results), results


class WithEmpty(Layers):
    """Layers plus a 0-element parameter (a model may register one: an empty bias, a pruned head)."""

    def __init__(self):
        super().__init__()
        self.empty = torch.nn.Parameter(torch.zeros(0))

    def forward(self, step, rank):
        return super().forward(step, rank) + self.empty.sum()


def train_with_an_empty_parameter(rank, world_size, codec):
    model = ddp(WithEmpty())
    state = comm.register(model, codec, min_compress_numel=0, warmup_steps=0)
    try:
        for step in range(3):
            model.zero_grad()
            model(step, rank).backward()
        state.load_state_dict(state.state_dict())
        return torch.cat([p.grad.reshape(-1) for p in model.module.parameters()]), sorted(state.store.views)
    finally:
        state.close()


@pytest.mark.parametrize("codec", ["topk", "randomk", "lowrank", "qsgd"])
def test_a_zero_element_parameter_contributes_nothing(codec):
    results = run(train_with_an_empty_parameter, 2, codec)
    assert all(status == "ok" for status, _ in results), results
    (grads_0, names), (grads_1, _) = (value for _, value in results)
    assert torch.equal(grads_0, grads_1) and torch.isfinite(grads_0).all()
    assert names in ([], ["a", "b", "c"])  # stateful codecs keep state for the parameters that have elements


def own_group_on_rank_zero_only(rank, world_size):
    comm.register(ddp(Layers()), "gqsgd", own_group=rank == 0).close()


def test_ranks_that_disagree_on_own_group_raise_plan_mismatch_on_every_rank():
    results = run(own_group_on_rank_zero_only, 2)
    assert all(status == "error" and message.startswith("PlanMismatchError") and "own_group" in message
               for status, message in results), results


def register_on_rank_zero_only(rank, world_size):
    from datetime import timedelta

    import torch.distributed as dist
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=2))
    model = ddp(Layers())
    if rank == 0:
        comm.register(model, "gqsgd", process_group=group)
    return "did not register"


def test_a_rank_that_never_registers_is_named_as_the_likely_cause():
    """Undetectable before the group's timeout (the peer may only be late): then the waiting rank says why."""
    (status, message), other = run(register_on_rank_zero_only, 2)
    assert status == "error" and "every rank of the group must call register()" in message, message
    assert other == ("ok", "did not register")


class Renamed(torch.nn.Module):
    """Layers' shapes under other names: another model."""

    def __init__(self):
        super().__init__()
        self.x = torch.nn.Parameter(torch.zeros(3000))
        self.b = torch.nn.Parameter(torch.zeros(40, 50))
        self.c = torch.nn.Parameter(torch.zeros(2500))

    def forward(self, step, rank):
        return Layers.forward(self, step, rank)


def load_into(rank, world_size, codec, target):
    """A state saved after one step of Layers, loaded into `target`."""
    model = ddp(Layers())
    state = comm.register(model, codec, min_compress_numel=0, warmup_steps=0)
    model(0, rank).backward()
    saved = state.state_dict()
    state.close()
    other = comm.register(ddp(target()), codec, min_compress_numel=0, warmup_steps=0)
    try:
        other.load_state_dict(saved)
    finally:
        other.close()


class Wider(Layers):
    """Layers with one more element in a: the same names, another shape."""

    def __init__(self):
        super().__init__(a=3001)


@pytest.mark.parametrize("codec", ["topk", "lowrank"])
def test_another_models_state_is_refused_naming_its_parameters(codec):
    results = run(load_into, 2, codec, Renamed)
    assert all(status == "error" and "another model's: it lacks this model's parameters [x] and holds parameters "
               "this model does not have [a]" in message for status, message in results), results


def load_into_and_step(rank, world_size):
    model = ddp(Layers())
    state = comm.register(model, "topk", min_compress_numel=0)
    model(0, rank).backward()
    saved = state.state_dict()
    state.close()
    wider = ddp(Wider())
    other = comm.register(wider, "topk", min_compress_numel=0)
    try:
        other.load_state_dict(saved)
        wider(1, rank).backward()
    finally:
        other.close()


def test_a_state_of_other_shapes_is_refused_at_the_first_step():
    results = run(load_into_and_step, 2)
    assert all(status == "error" and "holds 3000 values for parameter a, which has 3001 here" in message
               for status, message in results), results


GOOD = {"format": "netgain.comm/2", "world_size": 1, "step": 3, "local": [{"a": torch.zeros(2)}],
        "shared": {"a": torch.zeros(2)}, "chooser": {}}


@pytest.mark.parametrize("change,match", [
    ({"step": "two"}, "step must be an integer >= 0, got 'two'"),
    ({"step": -1}, "step must be an integer >= 0"),
    ({"step": 1e300}, "step must be an integer >= 0"),
    ({"world_size": "1"}, "comm state of '1' ranks, this run has 1"),
    ({"local": []}, "malformed"),
    ({"local": [{"a": "x"}]}, "malformed"),
    ({"local": [{"b": torch.zeros(2)}]}, "malformed"),
    ({"shared": [1]}, "malformed"),
    ({"chooser": None}, "malformed"),
    ({"config": None}, "config differs in"),
    ({"format": None}, "not a netgain comm state"),
    ({"local": [{"z": torch.zeros(2)}], "shared": {"z": torch.zeros(2)}}, r"lacks this model's parameters \[a\]"),
])
def test_a_malformed_or_foreign_state_is_refused_by_name(change, match):
    state = comm.CommState("topk", param_names={1: "a"})
    with pytest.raises(ValueError, match=match):
        state.load_state_dict({**GOOD, "config": state.config.describe(), **change})


def test_a_state_that_is_no_dict_is_refused():
    with pytest.raises(ValueError, match="not a netgain comm state"):
        comm.CommState("topk").load_state_dict([1, 2])


def test_a_planner_state_that_is_not_kimads_is_refused():
    saved = comm.CommState("kimad+").state_dict()
    with pytest.raises(ValueError, match=r"the comm state's chooser is not a kimad\+.* planner's \(KeyError"):
        comm.CommState("kimad+").load_state_dict({**saved, "chooser": {"x": 1}})
