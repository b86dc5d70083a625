"""The low-rank codec (PowerSGD-style, fp32 or Global-QSGD factors) on gloo ranks: every rank gets the
same gradient, error feedback loses nothing, low-rank gradients arrive exactly, and the Global-QSGD
factors cut the bytes of the fp32 ones."""

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import netgain.comm as comm

from distributed import run
from test_hook import Layers, ddp, grads

STEPS = 5


def true_mean(world_size, step):
    """Layers' gradients (in parameter order a, b, c) averaged over ranks, as fp32 DDP would deliver them."""
    def one(rank):
        g = torch.Generator().manual_seed(1000 * step + rank)
        return torch.cat([torch.randn(shape, generator=g).reshape(-1) for shape in ((3000,), (40, 50), (2500,))])
    return sum(one(r) for r in range(world_size)) / world_size


def delivered(rank, world_size):
    """STEPS steps of each factor codec: the delivered gradients, this rank's residual, the wire bytes."""
    out = {}
    for factors in ("fp32", "gqsgd"):
        model = ddp(Layers())
        state = comm.register(model, comm.LowRankConfig(rank=2, factors=factors), min_compress_numel=0, warmup_steps=0)
        steps = []
        for step in range(STEPS):
            model.zero_grad()
            model(step, rank).backward()
            steps.append(grads(model))
        residual = torch.cat([state.store.local_state()[name] for name in ("a", "b", "c")])
        out[factors] = steps, residual, sum(h["wire_bytes"] for h in state.history)
        state.close()
    return out


WORLD_SIZE = 3


@pytest.fixture(scope="module")
def runs():
    results = run(delivered, WORLD_SIZE)
    assert all(status == "ok" for status, _ in results), results
    return [value for _, value in results]


@pytest.mark.parametrize("factors", ["fp32", "gqsgd"])
def test_ranks_agree_and_error_feedback_loses_nothing(runs, factors):
    """sum_t delivered_t + mean_i(e_i) = sum_t mean_i(g_i,t): what low rank drops waits in the residuals."""
    steps = [rank[factors][0] for rank in runs]
    assert all(torch.equal(a, b) for other in steps[1:] for a, b in zip(steps[0], other))
    residual = sum(rank[factors][1] for rank in runs) / WORLD_SIZE
    truth = sum(true_mean(WORLD_SIZE, step) for step in range(STEPS))
    total = sum(steps[0])
    b = slice(3000, 5000)  # the one matrix: compressed, not exact, and nothing lost
    # (with gqsgd factors, up to Q's unbiased rounding in each step: each rank's residual is its own
    # projection's, so Q's rounding is not fed back)
    lost = (total[b] + residual[b] - truth[b]).norm()
    assert lost <= (1e-4 if factors == "fp32" else 0.01 * truth[b].norm())
    assert (total[b] - truth[b]).norm() > 0.1 * truth[b].norm()
    # vectors ride in round 1, no residual: exact in fp32, one unbiased rounding per step in gqsgd
    vectors = torch.cat([total[:3000] - truth[:3000], total[5000:] - truth[5000:]])
    assert residual[:3000].abs().max() == 0 and residual[5000:].abs().max() == 0
    assert vectors.abs().max() <= (1e-5 if factors == "fp32" else STEPS * 5.0 / 127)  # max |g| < 5


@pytest.mark.parametrize("factors", ["fp32", "gqsgd"])
def test_each_rank_keeps_the_residual_of_its_own_projection(runs, factors):
    """e_i = M_i - P Q_i^T holds nothing in the span of the last step's P (the column span of the gradient it
    delivered), where PowerSGD's M_i - P Q^T holds each rank's own P (Q_i - Q)^T, which adds up over steps."""
    delivered = runs[0][factors][0][-1][3000:5000].reshape(40, 50)
    basis = torch.linalg.svd(delivered).U[:, :2]  # rank 2
    for rank in runs:
        residual = rank[factors][1][3000:5000].reshape(40, 50)
        assert (basis.T @ residual).norm() <= 1e-4 * residual.norm()


def test_global_qsgd_factors_send_fewer_bytes_than_fp32_factors(runs):
    assert runs[0]["gqsgd"][2] < runs[0]["fp32"][2] / 2.5  # 10.7 bits per element instead of 32 at n = 3


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(40, 48))
        self.bias = torch.nn.Parameter(torch.zeros(40))


class Stack(torch.nn.Module):
    """Three same-shaped layers: one strided group of the bucket (offsets step by one layer)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer() for _ in range(3))

    def forward(self, step, rank):
        g = torch.Generator().manual_seed(1000 * step + rank)
        return sum((p * torch.randn(p.shape, generator=g)).sum() for p in self.parameters())


def stacked(rank, world_size):
    model = DDP(Stack())
    state = comm.register(model, comm.LowRankConfig(rank=2, factors="fp32"), min_compress_numel=0, warmup_steps=0)
    total = torch.zeros(sum(p.numel() for p in model.parameters()))
    for step in range(STEPS):
        model.zero_grad()
        model(step, rank).backward()
        total += torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    residual = state.store.local_state()
    counts = [g.count for _, layout in state._layouts.values() for g in layout.tables[state.describe()]["groups"]]
    state.close()
    return total, torch.cat([residual[n].reshape(-1) for n, _ in model.module.named_parameters()]), counts


def test_same_shaped_layers_share_one_strided_group_and_lose_nothing():
    results = run(stacked, 2)
    assert all(status == "ok" for status, _ in results), results
    (total, residual, counts), (_, other_residual, _) = (value for _, value in results)
    assert counts == [3]
    truth = torch.zeros_like(total)
    for step in range(STEPS):
        for rank in range(2):
            g = torch.Generator().manual_seed(1000 * step + rank)
            truth += torch.cat([torch.randn(p.shape, generator=g).reshape(-1) for p in Stack().parameters()]) / 2
    assert torch.allclose(total + (residual + other_residual) / 2, truth, atol=1e-4)


class RankOne(torch.nn.Module):
    """A 64 x 96 weight whose gradient on rank r is (u + r) v^T: the mean is rank one too."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(64, 96))

    def forward(self, rank):
        u = torch.linspace(-1, 1, 64) + rank
        v = torch.linspace(0.5, 2, 96)
        return (self.w * torch.outer(u, v)).sum()


def rank_one(rank, world_size):
    out = {}
    for factors in ("fp32", "gqsgd"):
        model = DDP(RankOne())
        state = comm.register(model, comm.LowRankConfig(rank=1, factors=factors), min_compress_numel=0, warmup_steps=0)
        model(rank).backward()
        state.close()
        out[factors] = model.module.w.grad.clone(), state.last_step["wire_bytes"]
    return out


def test_low_rank_gradients_arrive_exactly():
    results = run(rank_one, 2)
    assert all(status == "ok" for status, _ in results), results
    mean = torch.outer(torch.linspace(-1, 1, 64) + 0.5, torch.linspace(0.5, 2, 96))
    for factors, tolerance in (("fp32", 1e-5), ("gqsgd", 2e-2)):
        got, wire = results[0][1][factors]
        assert (got - mean).norm() <= tolerance * mean.norm(), factors
    assert results[0][1]["fp32"][1] == 4 * (64 + 96)  # P and Q of rank 1, fp32, and no header


@pytest.mark.parametrize("build,match", [(lambda: comm.LowRankConfig(rank=0), "rank must be an integer >= 1"),
                                         (lambda: comm.LowRankConfig(factors="fp8"), "factors='fp8' is not one of"),
                                         (lambda: comm.LowRankConfig(bits=9), "bits must be in 2..8")])
def test_bad_low_rank_arguments_name_the_argument(build, match):
    with pytest.raises(ValueError, match=match):
        build()
