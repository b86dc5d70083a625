"""Analytic GPU kernel model (alignment tiers, waves, attention backends) and the measured, cached profile."""

import argparse
import json

import pytest
import torch
from transformers import LlamaConfig

from netgain.cost import profile
from netgain.cost.kernels import PRESETS, AnalyticCost, gemm_tier
from netgain.cost.profile import MeasuredCost, linear_shapes, rank_sweep


def test_gemm_tiers_follow_alignment_of_k_and_n():
    assert gemm_tier(4096, 112) == "native"
    assert gemm_tier(4104, 112) == "native-k8"
    assert gemm_tier(4096, 106) == "align2"
    assert gemm_tier(4096, 107) == "align1"


@pytest.mark.parametrize("gpu", sorted(PRESETS))
def test_misaligned_rank_is_slower_than_a_larger_aligned_one(gpu):
    cost = AnalyticCost(gpu)
    for tokens in (1, 1024):
        # rank 107 vs 112 (the paper's example): the smaller, odd rank costs more
        odd = cost.gemm(tokens, 4096, 107) + cost.gemm(tokens, 107, 4096)
        aligned = cost.gemm(tokens, 4096, 112) + cost.gemm(tokens, 112, 4096)
        assert odd > aligned


def test_wave_quantisation_makes_a_step():
    cost = AnalyticCost("a100")
    # 4096 x N with 256x128 tiles: 16 row tiles; 108 SMs -> the 7th column tile starts a second wave,
    # so 1/6 more columns cost far more than 1/6 more time
    assert cost.gemm(4096, 4096, 7 * 128) > 1.4 * cost.gemm(4096, 4096, 6 * 128)


def test_sdpa_falls_back_to_math_kernel_when_head_dim_not_multiple_of_8():
    cost = AnalyticCost("h100")
    assert cost.sdpa(1, 32, 1024, 1024, 100) > 2 * cost.sdpa(1, 32, 1024, 1024, 128)
    # 136 is a multiple of 8 but pads to the 160 template
    assert cost.sdpa(1, 32, 1024, 1024, 136) == pytest.approx(cost.sdpa(1, 32, 1024, 1024, 160))


def test_analytic_rejects_bad_arguments():
    with pytest.raises(ValueError, match="gpu must be one of"):
        AnalyticCost("v100")
    with pytest.raises(ValueError, match="k must be a positive integer"):
        AnalyticCost("a100").gemm(1, 0, 8)


def test_measured_cost_times_once_and_reloads_from_cache(tmp_path, monkeypatch):
    path = tmp_path / "table.json"
    cost = MeasuredCost("cpu", "float32", warmup=1, repeats=3, cache=path)
    t = cost.gemm(16, 32, 24)
    a = cost.sdpa(1, 2, 8, 8, 16)
    assert t > 0 and a > 0
    cost.save()
    record = json.loads(path.read_text())
    assert record["device"] == cost.name and record["threads"] == torch.get_num_threads()
    assert len(record["entries"]["gemm 16 32 24"]["times_s"]) == 3

    reloaded = MeasuredCost("cpu", "float32", cache=path)
    monkeypatch.setattr(reloaded, "_time", lambda fn: pytest.fail("cached shape was measured again"))
    assert reloaded.gemm(16, 32, 24) == t
    assert reloaded.sdpa(1, 2, 8, 8, 16) == a


def test_measured_cost_rejects_bad_arguments():
    with pytest.raises(ValueError, match="dtype must be one of"):
        MeasuredCost("cpu", "int8")
    with pytest.raises(ValueError, match="device must be"):
        MeasuredCost("tpu")


def tiny_llama_config():
    return LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128
    )


def test_linear_shapes_and_rank_sweep():
    assert linear_shapes(tiny_llama_config()) == [(64, 32), (64, 64), (64, 96), (96, 64)]
    # 64 x 96: dense size 6144 = rank 38.4 x (64 + 96); ranks 24..38 at ratio 0.6..1.0, step 8
    assert rank_sweep(64, 96, 8, 0.6, 1.0) == [16, 24, 32]


def test_profile_cli_writes_a_table(tmp_path):
    tiny_llama_config().save_pretrained(tmp_path / "model")
    path = tmp_path / "table.json"
    parser = argparse.ArgumentParser()
    profile.configure(parser)
    rc = profile.run(parser.parse_args(["--model", str(tmp_path / "model"), "--seq", "16", "--repeats", "1", "--warmup", "0", "--cache", str(path)]))
    assert rc == 0
    entries = json.loads(path.read_text())["entries"]
    assert "gemm 16 64 96" in entries and "gemm 1 96 64" in entries and "sdpa 1 4 16 16 16 1" in entries
