"""The library verb `netgain.align.compress`, its configs, SVD-LLM, and GAC never losing to round-down."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from netgain.align import AlignConfig, ASVDConfig, PrunerConfig, SVDLLMConfig, compress, gac, load
from netgain.align.lowrank import LowRankLinear, LowRankUnit
from netgain.align.prune import PrunedLinear
from netgain.align.svdllm import SVDLLM, cholesky
from netgain.align.units import aligned_fraction, proposed_sizes, total_params

CONFIG = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=128)
COMPRESSORS = {"asvd": ASVDConfig(), "svdllm": SVDLLMConfig(), "prune": PrunerConfig(scope="global")}
MODULE = {"asvd": LowRankLinear, "svdllm": LowRankLinear, "prune": PrunedLinear}


def tiny():
    torch.manual_seed(0)
    return LlamaForCausalLM(CONFIG).eval()


def batches(n=4, length=32):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (1, length), generator=g) for _ in range(n)]


class WorkCost:
    """Fake cost: latency = work, so a smaller size is never slower."""

    name, preferred_multiple = "work", 8

    def gemm(self, m, k, n):
        return float(m * k * n)


class CliffCost(WorkCost):
    """Work, except any GEMM touching size 24 is 10x slower (a cliff)."""

    def gemm(self, m, k, n):
        return super().gemm(m, k, n) * (10 if 24 in (k, n) else 1)


class SmallIsSlow(WorkCost):
    """Latency falls with the size (so the knapsack's tie-break towards light sizes is the slow choice)."""

    def gemm(self, m, k, n):
        return 1.0 / min(k, n)


@pytest.fixture(scope="module", params=sorted(COMPRESSORS))
def compressed(request):
    model = tiny()
    config = AlignConfig(COMPRESSORS[request.param], param_ratio=0.7, cost="a100", tokens=64)
    out, result = compress(model, batches(), config, inplace=False)
    return request.param, model, out, result


def test_the_verb_builds_each_compressor_aligned_within_budget(compressed):
    method, dense, model, result = compressed
    assert any(isinstance(m, MODULE[method]) for m in model.modules())
    assert not any(isinstance(m, MODULE[method]) for m in dense.modules())  # inplace=False leaves it dense
    assert set(result.sizes) == {"dense", "raw", "round-nearest", "round-down", "gac"}
    assert result.compressor.method == method
    assert aligned_fraction(result.units, result.sizes["gac"], 8) == 1.0
    assert total_params(result.units, result.sizes["gac"]) <= result.budget
    summary = result.summary()
    assert summary["gac"]["aligned_8"] == 1.0 and summary["gac"]["vs_budget"] <= 1.0
    assert summary["raw"]["unit_params"] == result.budget < result.dense_params


def test_gac_objective_is_never_worse_than_round_down(compressed):
    _, _, _, result = compressed
    units = result.compressor.resizable(result.units)
    down = result.sizes["round-down"]
    assert total_params(units, down) <= total_params(units, proposed_sizes(units))
    assert gac.objective(units, result.sizes["gac"]) >= gac.objective(units, down)
    for unit in units:
        assert down[unit.name] in gac.unit_options(unit, CliffCost(), 64, multiple=8, steps=1)


def test_variants_build_from_the_dense_model_and_save_load_gives_identical_logits(compressed, tmp_path):
    method, dense, model, result = compressed
    rebuilt = result.build(dense, "gac")
    ids = batches(1)[0]
    with torch.no_grad():
        assert torch.equal(rebuilt(ids).logits, model(ids).logits)
    result.save(model, tmp_path / method)
    with torch.no_grad():
        assert torch.equal(load(tmp_path / method)(ids).logits, model(ids).logits)


def test_round_down_is_a_candidate_even_on_a_cliff():
    unit = LowRankUnit("u", 29, 64, 1.0, 64, 160)  # round-down 24 sits on the cliff
    assert 24 in gac.unit_options(unit, CliffCost(), 4, multiple=8, steps=2)
    assert 24 not in gac.drop_cliffs(unit, [8, 16, 24, 32], CliffCost(), 4)


class SmallBelowDownIsSlow:
    """Fake cost: rank 16 is 2% slower than rank 24 (within a 3% noise tolerance), everything else is work."""

    def gemm(self, m, k, n):
        return m * k * n * (1.0 if 16 not in (k, n) else 24 / 16 * 1.02)


def test_a_size_below_round_down_that_is_not_faster_is_never_a_candidate():
    unit = LowRankUnit("u", 29, 64, 1.0, 64, 160)  # round-down 24
    kept = gac.drop_cliffs(unit, [8, 16, 24, 32], SmallBelowDownIsSlow(), 4, tolerance=0.03, keep=24)
    assert 16 not in kept and {8, 24, 32} <= set(kept)  # 16: fewer parameters than 24 and no faster, noise or not


def test_ties_and_a_coarse_knapsack_fall_back_to_round_down():
    flat = [LowRankUnit(f"u{i}", 29 + i, 64, 0.0, 64, 160) for i in range(6)]  # every size worth the same
    down = gac.round_sizes(flat, 8, "down")
    for cost in (WorkCost(), SmallIsSlow()):  # a tie on the objective: never slower than round-down
        chosen = gac.select(flat, cost, 4, steps=2)
        assert gac.latency(flat, chosen, cost, 4) <= gac.latency(flat, down, cost, 4)
    assert gac.select(flat, SmallIsSlow(), 4, steps=2) == down
    units = [LowRankUnit(f"u{i}", 21 + 3 * i, 64, 1.0 + i, 64, 160) for i in range(8)]
    coarse = gac.select(units, WorkCost(), 4, steps=2, resolution=1)
    assert gac.objective(units, coarse) >= gac.objective(units, gac.round_sizes(units, 8, "down"))


def test_svdllm_truncation_error_is_the_dropped_singular_values():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 9, generator=g, dtype=torch.float64) @ torch.randn(9, 9, generator=g, dtype=torch.float64)
    weight = torch.randn(12, 9, generator=g)

    class Stats:
        def covariance(self):
            return x.T @ x / len(x)

        def cached(self, key, derive):
            return derive()

    u, sigma, m = SVDLLM().factorise(weight, Stats())
    for rank in (0, 4, 9):
        kept = (u[:, :rank] * sigma[:rank]) @ m[:rank]
        error = ((x.float() @ (weight - kept).T) ** 2).sum(1).mean()
        assert error.item() == pytest.approx(sigma[rank:].pow(2).sum().item(), rel=1e-3, abs=1e-6)


def test_cholesky_adds_jitter_only_where_needed():
    a = torch.randn(3, 6, dtype=torch.float64)
    singular = a.T @ a  # rank 3 of 6
    factor = cholesky(singular, 1e-6)
    assert torch.allclose(factor @ factor.T, singular, atol=1e-4)
    pd = singular + torch.eye(6, dtype=torch.float64)
    assert torch.allclose(cholesky(pd, 1e-6), torch.linalg.cholesky(pd))


@pytest.mark.parametrize("make, message", [
    (lambda: ASVDConfig(alpha=2), r"alpha must be in \[0, 1\]"),
    (lambda: SVDLLMConfig(jitter=0), r"jitter must be in \(0, 1\)"),
    (lambda: PrunerConfig(importance="random"), r"importance must be one of \('taylor', 'magnitude'\)"),
    (lambda: PrunerConfig(scope="layer"), r"scope must be one of \('uniform', 'global'\)"),
    (lambda: PrunerConfig(layers="4"), r"layers must be 'START:END'"),
    (lambda: AlignConfig(param_ratio=1.5), r"param_ratio must be in \(0, 1\]"),
    (lambda: AlignConfig(cost="tpu"), r"cost must be one of measured, a100, h100, h200 or a cost object"),
    (lambda: AlignConfig(variant="best"), r"variant must be one of raw, round-nearest, round-down, gac"),
    (lambda: AlignConfig(compressor="asvd"), r"compressor must be one of ASVDConfig, SVDLLMConfig, PrunerConfig"),
    (lambda: AlignConfig(steps=0), r"steps must be an integer >= 1"),
    (lambda: AlignConfig(tolerance=-0.1), r"tolerance must be in \[0, 1\)"),
])
def test_bad_configs_name_the_argument_and_the_allowed_values(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_a_measured_cost_times_every_candidate_first_and_its_noise_hides_small_cliffs():
    class Noisy(WorkCost):
        """Size 24 is 5% slower than 32: a cliff only where timings are tighter than that."""

        def __init__(self, noise):
            self.noise, self.measured = noise, set()

        def measure_gemms(self, shapes):
            self.measured |= set(shapes)

        def gemm(self, m, k, n):
            return 3.0 if (k, n) == (64, 160) else 1.05 if 24 in (k, n) else 1.0  # dense is slowest

    unit = LowRankUnit("u", 21, 64, 1.0, 64, 160)  # candidates 8..40, round-down 16: the cliff 24 lies above it
    quiet, noisy = Noisy(0.0), Noisy(0.1)
    gac.select([unit], quiet, 4, steps=2)
    assert {(4, 64, s) for s in (8, 16, 24, 32, 40, 21, 160)} <= quiet.measured  # candidates, proposal, dense
    assert 24 not in gac.unit_options(unit, quiet, 4, multiple=8, steps=2)
    assert 24 in gac.unit_options(unit, noisy, 4, multiple=8, steps=2)


@pytest.mark.parametrize("gac_loss,kept", [(1.0, True), (1.2, False)])
def test_verify_gac_keeps_gac_only_where_held_out_text_confirms_it(gac_loss, kept, monkeypatch):
    model = tiny()
    _, result = compress(model, batches(), AlignConfig(ASVDConfig(), param_ratio=0.7, cost="a100", tokens=64), inplace=False)
    result.sizes["gac"] = dict(result.sizes["round-nearest"])  # a GAC that differs from round-down
    assert result.sizes["gac"] != result.sizes["round-down"]
    proposed = dict(result.sizes["gac"])
    built = []

    def losses(candidate, chunks):  # GAC's model is built first: a fixed loss per chunk for each
        built.append(candidate)
        return [gac_loss if len(built) == 1 else 1.1] * len(chunks)

    monkeypatch.setattr("netgain.align.evaluate.chunk_losses", losses)
    check = result.verify_gac(model, batches(3))
    assert check["kept"] is kept and result.check is check
    assert check["ratio"] == pytest.approx(torch.tensor(gac_loss - 1.1).exp().item())
    assert result.sizes["gac"] == (proposed if kept else result.sizes["round-down"])


def test_verify_gac_needs_two_chunks_for_its_interval():
    model = tiny()
    _, result = compress(model, batches(), AlignConfig(ASVDConfig(), param_ratio=0.7, cost="a100", tokens=64), inplace=False)
    with pytest.raises(ValueError, match="at least 2"):
        result.verify_gac(model, batches(1))


def test_verify_gac_measures_nothing_when_gac_is_round_down(monkeypatch):
    model = tiny()
    _, result = compress(model, batches(), AlignConfig(ASVDConfig(), param_ratio=0.7, cost="a100", tokens=64), inplace=False)
    result.sizes["gac"] = dict(result.sizes["round-down"])
    monkeypatch.setattr("netgain.align.evaluate.chunk_losses", lambda *a: pytest.fail("nothing to measure"))
    assert result.verify_gac(model, batches(3))["same_as_round_down"]


def test_compress_with_validation_applies_the_checked_sizes():
    model = tiny()
    config = AlignConfig(ASVDConfig(), param_ratio=0.7, cost="a100", tokens=64)
    out, result = compress(model, batches(), config, validation=batches(3, 48), inplace=False)
    assert result.check is not None
    ids = batches(1)[0]
    with torch.no_grad():
        assert torch.equal(result.build(model, "gac")(ids).logits, out(ids).logits)
