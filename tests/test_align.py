"""ASVD low-rank compression, GAC selection, naive rounding and save/load on tiny random HF models."""

import copy
import math

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config

from netgain.align import evaluate, gac, load, save
from netgain.align.lowrank import ASVD, LowRankLinear, LowRankUnit, loss_curve, rank_for_ratio
from netgain.align.units import aligned_fraction, full_sizes, proposed_sizes, total_params
from netgain.cost.kernels import AnalyticCost

CONFIGS = {
    "llama": LlamaConfig(
        hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128
    ),
    "qwen2": Qwen2Config(
        hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128
    ),
    "gemma3": Gemma3TextConfig(
        hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        head_dim=16, vocab_size=128, sliding_window=16,
    ),
}


def tiny(arch):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(copy.deepcopy(CONFIGS[arch])).eval()


def batches(n=3, length=24, vocab=128):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (1, length), generator=g) for _ in range(n)]


@pytest.fixture(scope="module")
def fitted_llama():
    model = tiny("llama")
    compressor = ASVD()
    compressor.fit(model, batches())
    return model, compressor


def test_factorisation_is_exact_for_a_weight_of_that_rank():
    model = tiny("llama")
    layer = model.model.layers[0].mlp.up_proj  # 64 -> 160
    with torch.no_grad():
        layer.weight.copy_(torch.randn(160, 5) @ torch.randn(5, 64))
    compressor = ASVD()
    compressor.fit(model, batches())
    name = "model.layers.0.mlp.up_proj"
    x = torch.randn(7, 64)
    expected = layer(x)
    compressor.apply(model, {name: 5})
    assert isinstance(model.get_submodule(name), LowRankLinear)
    assert torch.allclose(model.get_submodule(name)(x), expected, atol=1e-4)
    assert compressor.truncation_error(name, 5) < 1e-10


def test_linears_reading_one_tensor_share_its_statistics_and_whitening(monkeypatch):
    """q, k and v (and gate and up) read one tensor: its x x^T is accumulated, and SVD-LLM's Cholesky
    factor computed, once per layer and input, not once per Linear; the fit says where its time went."""
    from netgain.align import svdllm
    from netgain.align.lowrank import _Inputs

    recorded, factored = [], []
    record, cholesky = _Inputs.record, svdllm.cholesky
    monkeypatch.setattr(_Inputs, "record", lambda self, x: (recorded.append(self), record(self, x))[1])
    monkeypatch.setattr(svdllm, "cholesky", lambda c, jitter: (factored.append(c), cholesky(c, jitter))[1])
    compressor = svdllm.SVDLLM()
    compressor.fit(tiny("llama"), batches(2))
    assert len(recorded) == 2 * 4 * 2 and len(set(map(id, recorded))) == 2 * 4  # layers x inputs (x batches)
    assert len(factored) == 2 * 4 and len(compressor.factors) == 2 * 7
    assert set(compressor.phases.seconds) == {"forward/backward passes", "activation statistics", "SVDs", "loss curves"}


def test_proposal_meets_the_parameter_ratio_with_asvd_ranks(fitted_llama):
    _, compressor = fitted_llama
    units = compressor.propose(0.85)
    assert len(units) == 14  # 2 layers x (q, k, v, o, gate, up, down)
    dense = total_params(units, full_sizes(units))
    assert total_params(units, proposed_sizes(units)) <= 0.85 * dense
    grid_ranks = lambda u: {rank_for_ratio(u.in_features, u.out_features, r) for r in (0.1 + 0.05 * i for i in range(18))}
    for u in units:
        assert u.proposed == u.full or u.proposed in grid_ranks(u)
        assert u.score > 0


def test_truncation_error_falls_with_rank(fitted_llama):
    _, compressor = fitted_llama
    name = "model.layers.1.self_attn.o_proj"
    errors = [compressor.truncation_error(name, r) for r in (8, 16, 32, 64)]
    assert errors == sorted(errors, reverse=True) and errors[-1] == pytest.approx(0.0, abs=1e-12)


def test_loss_curve_is_the_fisher_weighted_output_error_of_each_truncation():
    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(12, 9, generator=g), torch.randn(500, 9, generator=g) * torch.linspace(0.1, 3, 9)
    scale, fisher = x.abs().mean(0).sqrt(), torch.rand(12, generator=g, dtype=torch.float64)
    u, sigma, vt = torch.linalg.svd(weight * scale, full_matrices=False)
    curve = loss_curve(u, sigma, vt / scale, (x.T @ x).double() / len(x), fisher)
    for rank in (0, 3, 9):
        kept = (u[:, :rank] * sigma[:rank]) @ (vt[:rank] / scale)
        dy = (x @ (weight - kept).T).double()
        assert curve[rank].item() == pytest.approx((dy.square() * fisher).sum(1).mean().item() / 2, rel=1e-4, abs=1e-9)


def test_units_carry_the_error_curve_gac_values_them_by(fitted_llama):
    _, compressor = fitted_llama
    u = next(u for u in compressor.propose(0.85) if 8 <= u.proposed <= u.full - 8)
    assert len(u.error) == u.full + 1 and u.error[u.full] == 0.0
    assert u.error[u.proposed - 8] == pytest.approx(compressor.truncation_error(u.name, u.proposed - 8))
    assert u.gain(u.full) == pytest.approx(compressor.truncation_error(u.name, u.proposed))
    assert u.gain(u.proposed - 8) < 0 < u.gain(u.proposed + 8)
    # without a curve, the gain is GAC's linear s_i * parameters
    linear = LowRankUnit(u.name, u.proposed, u.full, 2.0, u.in_features, u.out_features)
    assert linear.gain(u.proposed + 1) == 2.0 * (u.in_features + u.out_features)


class CliffCost:
    """Fake cost: latency = work, except any GEMM touching size 24 is 10x slower (a cliff)."""

    def gemm(self, m, k, n):
        return m * k * n * (10 if 24 in (k, n) else 1)


def unit(proposed=29, score=1.0, in_f=64, out_f=160):
    return LowRankUnit("u", proposed, min(in_f, out_f), score, in_f, out_f)


def test_cliffs_are_dropped_but_the_smallest_size_kept():
    u = unit()
    kept = gac.drop_cliffs(u, [8, 16, 24, 32, 40], CliffCost(), tokens=4)
    assert kept == [8, 16, 32, 40]
    assert gac.drop_cliffs(u, [24, 32], CliffCost(), tokens=4) == [24, 32]


def test_dense_is_offered_only_where_factorising_does_not_pay():
    # dense 64 x 160 = 10240 MACs per token; rank 40 costs 40 x 224 = 8960: factorising pays
    assert 64 not in gac.unit_options(unit(proposed=40), CliffCost(), 4, multiple=8, steps=2)
    # rank 45 costs 10080 but the unit's GEMMs at 24 are cliffs; at 45 > 10240? no: 45*224 = 10080 < 10240
    assert 64 in gac.unit_options(unit(proposed=46), CliffCost(), 4, multiple=8, steps=2)  # 46*224 = 10304


def test_gac_selection_is_aligned_and_within_the_raw_budget(fitted_llama):
    _, compressor = fitted_llama
    units = compressor.propose(0.85)
    sizes = gac.select(units, AnalyticCost("a100"), tokens=64, multiple=8, steps=4)
    assert aligned_fraction(units, sizes, 8) == 1.0
    assert total_params(units, sizes) <= total_params(units, proposed_sizes(units))


def test_gac_keeps_a_cliff_free_size_when_the_proposal_sits_on_a_cliff():
    units = [unit(proposed=25, score=1.0), LowRankUnit("v", 47, 64, 0.5, 64, 160)]  # v's slack pays u's way up
    sizes = gac.select(units, CliffCost(), tokens=4, multiple=8, steps=2)
    assert sizes["u"] != 24 and sizes["u"] % 8 == 0
    assert total_params(units, sizes) <= total_params(units, proposed_sizes(units))


def test_cuts_below_round_down_stay_within_the_trust_region():
    big, small = LowRankUnit("b", 300, 640, 1.0, 640, 1024), LowRankUnit("s", 45, 640, 1.0, 640, 1024)
    assert gac.candidate_sizes(big, 8, 4) == [296, 304, 312, 320, 328, 336]  # by default nothing under round-down's 296
    assert gac.candidate_sizes(big, 8, 4, trust=0.1) == [272, 280, 288, 296, 304, 312, 320, 328, 336]  # >= 270 below it
    assert gac.candidate_sizes(small, 8, 4, trust=0.1) == [40, 48, 56, 64, 72, 80]  # nothing under 40 (10% of 45)
    assert gac.candidate_sizes(small, 8, 4, trust=1.0) == [16, 24, 32, 40, 48, 56, 64, 72, 80]


def test_steps_beyond_the_layer_are_not_enumerated():
    small = LowRankUnit("s", 45, 640, 1.0, 640, 1024)
    assert gac.candidate_sizes(small, 8, 10**30, trust=1.0) == gac.candidate_sizes(small, 8, 80, trust=1.0)  # looped for ever


def test_naive_rounding():
    units = [unit(proposed=29), unit(proposed=31), unit(proposed=64)]
    units = [LowRankUnit(f"u{i}", u.proposed, u.full, u.score, 64, 160) for i, u in enumerate(units)]
    assert list(gac.round_sizes(units, 8, "nearest").values()) == [32, 32, 64]
    assert list(gac.round_sizes(units, 8, "down").values()) == [24, 24, 64]
    with pytest.raises(ValueError, match="mode must be one of"):
        gac.round_sizes(units, 8, "up")


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_save_load_round_trip_gives_identical_logits(arch, tmp_path):
    model = tiny(arch)
    compressor = ASVD()
    compressor.fit(model, batches())
    units = compressor.propose(0.7)
    compressor.apply(model, gac.round_sizes(units, 8, "down"))
    assert any(isinstance(m, LowRankLinear) for m in model.modules())
    save(model, tmp_path / "out", method="asvd")
    reloaded = load(tmp_path / "out")
    ids = batches(1)[0]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)


def test_load_rejects_a_directory_without_manifest(tmp_path):
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        load(tmp_path)


def test_predicted_latency_counts_both_factors():
    model = tiny("llama")
    calls = []

    class Recorder:
        def gemm(self, m, k, n):
            calls.append((m, k, n))
            return 1.0

        def sdpa(self, *args):
            return 0.0

    evaluate.predicted_latency(model, Recorder(), 8, 8)
    dense_calls = len(calls)
    assert dense_calls == 2 * 7 + 1  # 7 Linears per layer + the LM head
    from netgain.align.lowrank import install

    assert install(model, {"model.layers.0.mlp.up_proj": 8})["model.layers.0.mlp.up_proj"].rank == 8
    calls.clear()
    evaluate.predicted_latency(model, Recorder(), 8, 8)
    assert len(calls) == dense_calls + 1 and (8, 64, 8) in calls and (8, 8, 160) in calls


def test_measurements_run_on_a_tiny_model():
    model = tiny("qwen2")
    latency = evaluate.interleaved_latency({"a": model, "b": copy.deepcopy(model)}, 16, repeats=2, warmup=0)
    assert set(latency) == {"a", "b"}
    assert all(t["prefill_s"] > 0 and t["decode_s"] > 0 for t in latency.values())
    assert 1 < evaluate.perplexity(model, batches(2)) < 1e4
    losses = evaluate.chunk_losses(model, batches(3))
    assert evaluate.perplexity(model, batches(3)) == pytest.approx(math.exp(sum(losses) / 3))


def test_paired_ratio_is_the_perplexity_ratio_with_the_chunks_spread():
    ratio, low, high = evaluate.paired_ratio([1.1, 2.1, 3.1], [1.0, 2.0, 3.0])
    assert ratio == pytest.approx(math.exp(0.1)) and low == pytest.approx(ratio) and high == pytest.approx(ratio)
    ratio, low, high = evaluate.paired_ratio([1.0, 2.2], [1.0, 2.0])
    spread = 0.1  # the differences' standard deviation (0.141) / sqrt(2)
    assert ratio == pytest.approx(math.exp(0.1)) and high == pytest.approx(math.exp(0.1 + 12.706 * spread))  # t, 1 dof
    assert low < 1 < high  # a gap the chunk-to-chunk spread covers
    assert evaluate.paired_ratio([1.5], [1.0]) == (pytest.approx(math.exp(0.5)), 0.0, math.inf)  # one chunk: no spread
    with pytest.raises(ValueError, match="same chunks"):
        evaluate.paired_ratio([1.0], [1.0, 2.0])


def test_bad_arguments():
    with pytest.raises(ValueError, match="alpha must be in"):
        ASVD(alpha=2)
    with pytest.raises(RuntimeError, match="fit"):
        ASVD().propose(0.8)
    model = LlamaForCausalLM(CONFIGS["llama"])
    compressor = ASVD()
    compressor.fit(model, batches(1))
    with pytest.raises(ValueError, match="param_ratio must be in"):
        compressor.propose(1.5)
    with pytest.raises(ValueError, match="rank for"):
        compressor.apply(model, {"model.layers.0.mlp.up_proj": 0})


def test_a_prune_layer_range_past_the_model_is_refused():
    from netgain.align.config import PrunerConfig

    with pytest.raises(ValueError, match=r"layers 0:100 reaches past the model's 2 decoder layers \(0:2 is all of them\)"):
        PrunerConfig(layers="0:100").build().fit(tiny("llama"), batches(1))  # was taken as 0:2
