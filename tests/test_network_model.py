"""The network performance model: collective formulas, bucket timeline, codec profiles, CLI."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import pytest
import torch

from netgain import cli
from netgain.comm.calibrate import codec_profile
from netgain.comm.config import SETTINGS, candidate_profiles, make_codec
from netgain.cost import advise, network as net
from netgain.cost.kernels import GPU, GPUS

MBIT100 = net.Link("100mbit", 100e6 / 8, 0.0)


def test_ring_allreduce_matches_the_quoted_lab_model():
    # ../shared/resources.md: 25 MB fp32 at 100 Mbit/s, ring: 2.00 s for 2 workers, 3.00 s for 4
    assert net.ring_allreduce_s(25e6, 2, MBIT100) == pytest.approx(2.0)
    assert net.ring_allreduce_s(25e6, 4, MBIT100) == pytest.approx(3.0)
    assert net.ring_allreduce_s(25e6, 2, net.Link("1g", 1e9 / 8, 0.0)) == pytest.approx(0.2)


def test_alpha_terms_and_the_other_collectives():
    link = net.Link("x", 1e6, 1e-3)
    assert net.ring_allreduce_s(3e6, 3, link) == pytest.approx(2 * 2 * 1e-3 + 2 * 2 / 3 * 3)
    assert net.tree_allreduce_s(1e6, 4, link) == pytest.approx(2 * 2 * (1e-3 + 1))
    assert net.tree_allreduce_s(1e6, 5, link, combine_s=0.5) == pytest.approx(2 * 3 * 1.001 + 3 * 0.5)
    assert net.allgather_s(1e6, 4, link) == pytest.approx(3 * (1e-3 + 1))
    assert net.ring_combine_allreduce_s(3e6, 3, link, combine_s=0.3) == pytest.approx(
        net.ring_allreduce_s(3e6, 3, link) + 2 * 0.3 / 3)
    for f in (net.ring_allreduce_s, net.tree_allreduce_s, net.allgather_s):
        assert f(1e6, 1, link) == 0.0


def test_auto_takes_the_faster_allreduce_per_message():
    link = net.Link("x", 1e9, 30e-6)
    # 64 ranks: a 16-byte header is latency-bound (tree: 12 alpha < ring: 126 alpha) ...
    assert net.allreduce_s(16, 64, link) == pytest.approx(net.tree_allreduce_s(16, 64, link))
    assert net.allreduce_s(16, 64, link) < net.ring_allreduce_s(16, 64, link) / 10
    # ... a 100 MB bucket is bandwidth-bound (ring moves 2(n-1)/n S, tree 2 log2(n) S)
    assert net.allreduce_s(1e8, 64, link) == pytest.approx(net.ring_allreduce_s(1e8, 64, link))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="world_size"):
        net.ring_allreduce_s(1, 0, MBIT100)
    with pytest.raises(ValueError, match="bandwidth"):
        net.Link("x", 0, 0)
    with pytest.raises(ValueError, match="collective"):
        net.CodecProfile("x", 8, "broadcast")
    with pytest.raises(ValueError, match="link"):
        net.preset("infiniband")
    with pytest.raises(ValueError, match="algorithm"):
        net.collective_s(10, 2, MBIT100, net.UNCOMPRESSED, algorithm="butterfly")
    with pytest.raises(ValueError, match="bandwidth"):
        net.parse_bandwidth("fast")
    with pytest.raises(ValueError, match="latency"):
        net.parse_duration("30 parsecs")
    with pytest.raises(ValueError, match="cost"):
        codec_profile(make_codec("none"), 2, cost="guess")


def test_parsers():
    assert net.parse_bandwidth("25gbit") == pytest.approx(3.125e9)
    assert net.parse_bandwidth("100mbit") == pytest.approx(12.5e6)
    assert net.parse_bandwidth("12GB/s") == pytest.approx(12e9)
    assert net.parse_bandwidth("12GBps") == pytest.approx(12e9)
    # network specs' convention: a lower-case b is a bit, an upper-case B a byte; either case of prefix
    assert net.parse_bandwidth("10Gb/s") == net.parse_bandwidth("10gbps") == net.parse_bandwidth("10GBit") == 1.25e9
    assert net.parse_bandwidth("10 Gbit/s") == 1.25e9
    for text, message in (("", "cannot parse ''"), ("1e999gbit", "finite rate > 0"), ("0GB/s", "finite rate > 0"),
                          ("12gb/s", "ambiguous: write 12Gb/s or 12gbit for bits, 12GB/s for bytes")):
        with pytest.raises(ValueError, match=message):
            net.parse_bandwidth(text)
    for text, message in (("", "cannot parse ''"), ("1e999s", "must be finite")):
        with pytest.raises(ValueError, match=message):
            net.parse_duration(text)
    assert net.parse_duration("30us") == pytest.approx(30e-6)
    assert net.parse_duration("1.5ms") == pytest.approx(1.5e-3)


def test_presets_follow_their_documented_arithmetic():
    assert net.preset("25gbe").bandwidth == pytest.approx(25e9 / 8 * 1448 / 1538)
    assert net.preset("nvlink-a100").bandwidth == pytest.approx(240e9)
    assert net.preset("pcie4").bandwidth == pytest.approx(0.8 * 31.5e9 / 2)
    # the lab's links are fitted to timed collectives: near the tbf rate's TCP payload share
    assert net.preset("lab-100mbit").bandwidth == pytest.approx(100e6 / 8 * 1448 / 1514, rel=0.1)
    assert net.preset_device("nvlink-h100") == "h100" and net.preset_device("lab-1gbit") == "cpu"


def test_ddp_buckets_fill_in_reverse_order_with_a_small_first_bucket():
    mb = 2**20 // 4  # elements per MiB of fp32
    sizes = [mb // 2, mb // 2, 3 * mb // 4, 3 * mb // 4]
    # reverse: 0.75 + 0.75 reaches the 1 MiB first cap, then 0.5 + 0.5 stays open under 2 MiB
    assert net.ddp_buckets(sizes, bucket_mb=2, first_bucket_mb=1) == [3 * mb // 2, mb]
    assert net.ddp_buckets([3 * mb, 10], bucket_mb=2, first_bucket_mb=1) == [3 * mb + 10]
    even = net.even_buckets(1e8, bucket_mb=25)
    assert sum(even) == 10**8 and even[0] == mb and max(even) == 25 * mb


def _ddp_rebuilt_buckets(model, **ddp_options) -> list[int]:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, **ddp_options)
    seen: list[int] = []

    def record(state, bucket):
        seen.append(bucket.buffer().numel())
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    ddp.register_comm_hook(None, record)
    for _ in range(3):  # DDP rebuilds its buckets in ready order after the first step
        seen.clear()
        ddp(torch.randn(4, 300)).sum().backward()
    return seen


def test_ddp_buckets_match_pytorch_ddp(tmp_path):
    import torch.distributed as dist
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(300, 300) for _ in range(12)])
    sizes = [p.numel() for p in model.parameters()]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        default = _ddp_rebuilt_buckets(model)  # 25 MB, first bucket 1 MiB
        explicit = _ddp_rebuilt_buckets(model, bucket_cap_mb=1.5)  # an explicit cap: first too
    finally:
        dist.destroy_process_group()
    assert default == net.ddp_buckets(sizes) and len(default) == 2
    assert explicit == net.ddp_buckets(sizes, bucket_mb=1.5, first_bucket_mb=1.5) and len(explicit) == 3


def test_overlap_hides_communication_that_fits_in_the_backward():
    # two buckets of 100 elements, fp32: 400 bytes; n=2 ring moves 400 bytes per rank
    link = net.Link("slow", 800.0, 0.0)  # 0.5 s per bucket
    p = net.predict([100, 100], 2, link, compute_s=3.0)  # forward 1 s, backward 2 s
    # bucket 1 ready at 2 s -> done 2.5; bucket 2 ready at 3 s -> done 3.5
    assert p.step_s == pytest.approx(3.5)
    assert p.exposed_comm_s == pytest.approx(0.5)
    assert p.comm_s == pytest.approx(1.0)
    assert p.payload_bytes == 800


def test_communication_queues_behind_the_previous_bucket():
    link = net.Link("slower", 400 / 1.5, 0.0)  # 1.5 s per bucket
    p = net.predict([100, 100], 2, link, compute_s=3.0)
    # bucket 1: 2.0 -> 3.5; bucket 2 waits for it: 3.5 -> 5.0
    assert p.step_s == pytest.approx(5.0)
    assert p.exposed_comm_s == pytest.approx(2.0)


def test_codec_costs_header_and_compression_in_the_timeline():
    link = net.Link("slow", 800.0, 0.0)  # n=2: ring and tree agree
    codec = net.CodecProfile("q8", 8.0, "allreduce", header_bytes=16,
                             encode_s_per_elem=1e-3, decode_s_per_elem=2e-3)
    p = net.predict([100], 2, link, codec, compute_s=0.0)
    wire = (100 + 16) / 800  # payload 100 bytes + the 16-byte header allreduce
    assert p.comm_s == pytest.approx(wire)
    assert p.step_s == pytest.approx(0.1 + wire + 0.2)
    assert p.payload_bytes == 116
    assert net.predict([100], 1, link, codec, compute_s=2.0).step_s == 2.0


def test_allgather_and_ring_codecs_use_their_collectives():
    link = net.Link("x", 1000.0, 0.0)
    gather = net.CodecProfile("g", 8.0, "allgather")
    ring = net.CodecProfile("r", 8.0, "ring", combine_s_per_elem=0.01)
    assert net.collective_s(1000, 4, link, gather) == pytest.approx(3 * 1.0)
    assert net.collective_s(1000, 4, link, ring) == pytest.approx(2 * 3 / 4 * 1.0 + 3 / 4 * 10)


def test_memory_bound_cost_and_compute_estimate():
    enc, dec, comb = net.memory_bound_cost(8, "allreduce", 4, True, 1e12)
    assert (enc, dec, comb) == pytest.approx((9e-12, 5e-12, 0.0))
    enc, dec, comb = net.memory_bound_cost(8, "allgather", 4, True, 1e12)
    assert dec == pytest.approx(8e-12)
    assert net.memory_bound_cost(8, "ring", 4, True, 1e12)[2] == pytest.approx(3e-12)
    gpu = GPU("g", sms=100, tensor_tflops=1000.0, memory_gbps=1000.0)
    assert net.estimate_compute_s(1e9, 1000, gpu, mfu=0.5) == pytest.approx(6e12 / 5e14)


def test_profiles_of_real_codecs():
    free = {name: codec_profile(make_codec(name, encoding="int8"), 4, "free")
            for name in ("none", "fp16", "gqsgd", "qsgd", "gqsgd-exp")}
    assert free["none"].wire_bits == 32 and free["none"].header_bytes == 0
    assert free["fp16"].wire_bits == 16
    assert free["gqsgd"].wire_bits == 8 and free["gqsgd"].header_size(5) == 4 * (5 + 3)
    assert free["qsgd"].collective == "allgather" and free["gqsgd-exp"].collective == "ring"
    torch.manual_seed(0)
    timed = codec_profile(make_codec("fp16"), 2, "calibrate", calibration_numel=4096)
    assert timed.encode_s_per_elem > 0 and timed.decode_s_per_elem > 0


def test_recommendation_is_none_on_nvlink_and_a_codec_on_a_slow_link():
    buckets = net.even_buckets(1.25e8)
    compute = net.estimate_compute_s(1.25e8, 16384, GPUS["h100"])
    fast = advise.evaluate(buckets, 8, net.preset("nvlink-h100"), compute, candidate_profiles(8, GPUS["h100"]))
    assert advise.recommend(fast).profile.name == "none"
    slow = advise.evaluate(buckets, 8, net.preset("10gbe"), compute, candidate_profiles(8, GPUS["a100"]))
    chosen = advise.recommend(slow)
    assert chosen.profile.name != "none" and chosen.speedup > 1.05 and chosen.convergence in advise.CONVERGES
    assert {r.profile.name.split("(")[0] for r in slow} == {name for name, _ in SETTINGS}
    assert advise.recommend(slow, biased=True).speedup >= chosen.speedup / (1 + advise.DEFAULT_TOLERANCE)


def test_cli_prints_every_codec_and_a_recommendation(capsys):
    assert cli.main(["model", "--params", "7e9", "--workers", "64", "--link", "25gbe"]) == 0
    out = capsys.readouterr().out
    for name, params in SETTINGS:
        assert make_codec(name, **params).describe() in out
    assert "fixed codec:" in out and "**<-**" in out
    assert "7e+09 parameters" in out
    auto = re.search(r"recommendation: auto \(the default\) would run: (.*?); predicted step .* to the target ([0-9.]+)x sooner than "
                     r"fp32 DDP .* ([0-9.]+)x sooner than PowerSGD r4", out)
    assert auto and float(auto[2]) >= 1.0, out  # auto's own plan: never priced behind sending fp32


def test_local_steps_expose_only_what_the_average_takes_beyond_the_steps_it_overlaps():
    """A 0.1 s step, a 0.5 s average every 8 steps applied a step later: (0.5 - 0.1) / 8 = 0.05 s exposed a step; an
    average shorter than the step it overlaps costs nothing."""
    step = net.Prediction("none", 0.1, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0, 1, 1000)
    sync = net.Prediction("gqsgd", 0.5, 0.0, 0.48, 0.01, 0.01, 0.5, 800.0, 1, 1000)
    local = net.predict_local(step, sync, period=8, overlap_steps=1)
    assert local.step_s == pytest.approx(0.15) and local.payload_bytes == 100.0 and local.comm_s == pytest.approx(0.06)
    assert net.predict_local(step, dataclasses.replace(sync, step_s=0.09), 8, 1).step_s == 0.1


@pytest.mark.parametrize("argv, routes", [(["--workers", "8", "--link", "25gbe"], ["DDP"]),
                                          (["--nodes", "2", "--gpus-per-node", "4", "--intra-link", "nvlink-a100",
                                            "--inter-link", "25gbe"], ["DDP", "HSDP"])])
def test_cli_prices_local_steps_against_fp32_ddp_and_the_recommendation(capsys, argv, routes):
    """auto's route of local steps (netgain.sync.ROUTE: 4-bit averages every 8 steps, at ROUTE_STEPS x fp32's steps),
    priced on each route the cluster has: its time to the target against fp32 DDP's is step x steps."""
    from netgain.sync import ROUTE_STEPS
    assert cli.main(["model", "--params", "1.3e9", *argv]) == 0
    out = capsys.readouterr().out
    found = re.findall(r"local steps, (DDP|HSDP) \(netgain.sync: gqsgd\(bits=4.*?\) every 8 steps; .*?\): predicted step "
                       r"([0-9.e+-]+) s and ([0-9.]+)x fp32's steps .*?: ([0-9.]+)x sooner than fp32 DDP, ([0-9.]+)x than "
                       r"the recommendation", out)
    assert [route for route, *_ in found] == routes, out
    fp32 = float(_table(out, "DDP:" if len(routes) > 1 else "| codec")[0].split(" | ")[-2])
    for _, step, steps, versus_fp32, _ in found:
        assert float(steps) == ROUTE_STEPS
        assert float(versus_fp32) == pytest.approx(fp32 / (float(step) * ROUTE_STEPS), rel=0.01)
    if routes == ["DDP"]:  # one level: the recommendation is auto's plan, its time to the target step x steps
        auto = re.search(r"recommendation: auto \(the default\) would run: .*?; predicted step ([0-9.e+-]+) s and "
                         r"([0-9.]+)x fp32's steps", out)
        _, step, _, _, versus_auto = found[0]
        assert float(versus_auto) == pytest.approx(float(auto[1]) * float(auto[2]) / (float(step) * ROUTE_STEPS), abs=0.011)


def test_cli_custom_link_cpu_and_no_compression(capsys):
    assert cli.main(["model", "--params", "1e6", "--workers", "2", "--bandwidth", "400gbit",
                     "--latency", "2us", "--gpu", "cpu", "--codec-cost", "free",
                     "--compute-ms", "1000"]) == 0
    out = capsys.readouterr().out
    assert "fixed codec: no compression" in out  # and auto's plan gains nothing either
    assert re.search(r"recommendation: auto \(the default\) would run: .*: to the target 1\.00x sooner than fp32 DDP", out)
    with pytest.raises(SystemExit):
        cli.main(["model", "--params", "1e6", "--workers", "2", "--link", "lab-1gbit"])
    assert "give --compute-ms" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--bandwidth", "1e-300bit"], "--bandwidth must be between 1 kbit/s and 10 Pbit/s, got 1e-300bit"),
    (["--bandwidth", "1e30gbit"], "--bandwidth must be between 1 kbit/s and 10 Pbit/s"),
    (["--bandwidth", "10gbit", "--latency", "1e300s"], "--latency must be between 0 s and 10 s, got 1e300s"),
    (["--link", "10gbe", "--latency", "1e5s"], "--latency must be between 0 s and 10 s"),
    (["--compute-ms", "1e308"], "--compute-ms must be at most 1e+09 (11.6 days a step), got 1e+308"),
    (["--tokens-per-step", "1e308"], "--tokens-per-step and --mfu give inf ms of compute per step"),
    (["--mfu", "1e-300"], "more than 1e+09 ms (11.6 days)"),
])
def test_model_refuses_numbers_no_job_has_by_name(capsys, argv, message):
    """Past these the model's sums ran to inf and nan ("best: fp16 at nanx the step speed")."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["model", "--params", "7e9", "--workers", "8", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--bandwidth", "1kbit", "--latency", "10s"], ["--bandwidth", "10000tbit", "--latency", "0us"],
                                  ["--compute-ms", "1e9"], ["--tokens-per-step", "1e-300"]])
def test_model_predicts_finite_numbers_at_the_edges_of_its_ranges(capsys, argv):
    """0 latency is an ideal link the model computes as well as any (the lab fit may give one)."""
    assert cli.main(["model", "--params", "7e9", "--workers", "100000", *argv]) == 0
    out = capsys.readouterr().out
    assert "recommendation:" in out and not re.search(r"\b(inf|nan)", out)


def write_safetensors_header(folder, header: bytes, length: int | None = None):
    with open(folder / "model.safetensors", "wb") as f:
        f.write((len(header) if length is None else length).to_bytes(8, "little") + header)


@pytest.mark.parametrize("make, message", [
    (lambda d: write_safetensors_header(d, b"{}", length=1 << 62), "is no safetensors file (its header would be"),
    (lambda d: write_safetensors_header(d, b"[1, 2]"), "has no safetensors header of tensor shapes"),
    (lambda d: write_safetensors_header(d, json.dumps({"w": {"shape": [-4, 5]}}).encode()), "shape must be a list of sizes >= 0"),
    (lambda d: os.mkfifo(d / "model.safetensors"), "is a FIFO (named pipe), not a regular file"),
    (lambda d: os.mkfifo(d / "config.json"), "is a FIFO (named pipe), not a regular file"),
    (lambda d: (d / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 10_000_000})),
     "num_hidden_layers=10000000 is more layers than netgain models (at most 10,000)"),
    (lambda d: (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 1 << 40,
                                                          "intermediate_size": 1 << 41})), "has no buildable config.json"),
    (lambda d: (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": "big"})),
     "has no buildable config.json"),
])
def test_a_model_folder_that_cannot_be_counted_is_refused_at_once(tmp_path, make, message):
    """Hostile or absurd folders: no read of a FIFO, no allocation of a header's claimed size, no build of
    10 million layers (minutes), one ValueError naming --model."""
    make(tmp_path)
    with pytest.raises(ValueError, match=re.escape(message)):
        advise.count_parameters(str(tmp_path))


def test_hf_model_folder_is_counted_from_its_config(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    config.save_pretrained(tmp_path)
    shapes = advise.count_parameters(str(tmp_path))
    assert shapes == [tuple(p.shape) for p in LlamaForCausalLM(config).parameters()]


def test_safetensors_only_folder_is_counted_from_headers(tmp_path):
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(3, 4), "b": torch.zeros(5)}, tmp_path / "model.safetensors")
    assert sorted(advise.count_parameters(str(tmp_path))) == [(3, 4), (5,)]
    with pytest.raises(ValueError, match="--model"):
        advise.count_parameters(str(tmp_path / "missing"))


def test_speedups_are_relative_to_no_compression():
    rows = advise.evaluate(net.even_buckets(1e7), 2, net.preset("lab-100mbit"), 0.5, candidate_profiles(2, "free"))
    base = next(r for r in rows if r.profile.name == "none")
    assert base.speedup == 1.0
    for r in rows:
        assert r.speedup == pytest.approx(base.prediction.step_s / r.prediction.step_s)
        assert math.isfinite(r.prediction.step_s)


def test_the_header_is_three_flags_and_one_float_per_parameter():
    codec = net.CodecProfile("q", 8.0, header_bytes=net.HEADER_FLAG_BYTES,
                             header_bytes_per_tensor=net.HEADER_BYTES_PER_TENSOR)
    assert codec.header_size(10) == 4 * (10 + 3)
    assert net.UNCOMPRESSED.header_size(10) == 0
    assert net.payload_bytes(100, codec, tensors=10) == 100 + 52
    # the old one-number profile still means "a 16-byte header"
    assert net.CodecProfile("old", 8.0, header_bytes=net.HEADER_BYTES).header_size(10) == 16


def test_per_collective_overhead_makes_the_header_latency_bound():
    link = net.Link("1g", 1e9 / 8, 50e-6, overhead=400e-6)
    codec = net.CodecProfile("q", 8.0, header_bytes=12, header_bytes_per_tensor=4)
    header, payload = net.bucket_collectives(1000, 2, link, codec, tensors=5)
    assert header[0] == pytest.approx(400e-6 + 2 * 50e-6 + 32 / link.bandwidth)
    assert payload[0] == pytest.approx(400e-6 + 2 * 50e-6 + 1000 / link.bandwidth)
    assert net.collective_s(1000, 2, link, codec, tensors=5) == pytest.approx(header[0] + payload[0])
    assert net.collective_s(1000, 2, link, net.UNCOMPRESSED) == pytest.approx(500e-6 + 4000 / link.bandwidth)


def test_a_gloo_link_runs_its_ring_whatever_the_size():
    nccl = net.Link("x", 1e9, 30e-6)
    gloo = net.Link("x", 1e9, 30e-6, algorithm="ring")
    assert net.allreduce_algorithm(16, 64, nccl) == "tree"
    assert net.allreduce_s(16, 64, gloo) == pytest.approx(net.ring_allreduce_s(16, 64, gloo))
    assert net.allreduce_s(16, 64, gloo, "tree") == pytest.approx(net.tree_allreduce_s(16, 64, gloo))
    assert net.sent_bytes(16, 64, "allreduce", nccl) == 2 * 6 * 16
    with pytest.raises(ValueError, match="algorithm"):
        net.Link("x", 1e9, 0.0, algorithm="tree")


def test_the_shaper_passes_its_burst_then_paces():
    link = net.Link("tbf", 1000.0, 0.0, burst=500.0, algorithm="ring")
    # n=2: a rank sends S; 500 bytes go at once, the rest at 1000 B/s
    assert net.ring_allreduce_s(800, 2, link, tokens=500) == pytest.approx(0.3)
    assert net.ring_allreduce_s(400, 2, link, tokens=500) == 0.0
    assert net.refill(500, 800, 0.3, link) == pytest.approx(0.0)
    assert net.refill(0, 0, 10.0, link) == 500
    # two 400-byte buckets back to back: the first rides the burst, the second gets 100 bytes of it
    p = net.predict([100, 100], 2, link, compute_s=0.0)
    assert p.comm_s == pytest.approx(0.0 + 0.3)
    # with compute in between the shaper refills: bucket 2 is ready 1 s after bucket 1
    assert net.predict([100, 100], 2, link, compute_s=3.0).comm_s == pytest.approx(0.0)


def _samples(link: net.Link, rate: str) -> list[dict]:
    rows = []
    for n in (2, 3):
        for op in ("allreduce", "allgather"):
            for nbytes in (4, 256, 1024, 2**18, 2**20, 2**22):
                for gap, tokens in ((0.05, link.burst), (0.0, 0.0)):
                    rows.append({"rate": rate, "workers": n, "op": op, "bytes": nbytes, "gap_s": gap,
                                 "seconds": net.lab_collective_s(op, nbytes, n, link, tokens)})
    return rows


def test_fit_lab_recovers_the_link_that_made_its_samples():
    truth = net.Link("lab-1gbit", 1.2e8, 80e-6, overhead=300e-6, burst=6e5, algorithm="ring")
    fitted = net.fit_lab(_samples(truth, "1gbit"), "1gbit")
    assert fitted.name == "lab-1gbit" and fitted.algorithm == "ring"
    assert fitted.overhead == pytest.approx(truth.overhead, rel=1e-6)
    assert fitted.latency == pytest.approx(truth.latency, rel=1e-6)
    assert fitted.bandwidth == pytest.approx(truth.bandwidth, rel=1e-6)
    # the burst is what a large collective's whole time leaves unexplained: short of the truth by
    # at most its fixed costs at the paced rate (they overlap the transfer on the real lab)
    fixed = truth.overhead + 2 * (3 - 1) * truth.latency
    assert truth.burst - fixed * truth.bandwidth <= fitted.burst < truth.burst
    with pytest.raises(ValueError, match="rate"):
        net.fit_lab(_samples(truth, "1gbit"), "100mbit")


def test_lab_presets_are_fitted_to_the_stored_calibration():
    for rate in net.LAB_RATES:
        link = net.preset(net.lab_preset_name(rate))
        assert link.algorithm == "ring" and link.overhead > 0 and link.burst > 0
        assert net.LAB_CALIBRATION.name in link.note
    assert net.preset("lab-100mbit").bandwidth < net.preset("lab-1gbit").bandwidth / 5


def test_bucket_layout_counts_parameters_and_sizes_the_headers():
    mb = 2**20 // 4
    sizes = [mb // 2, mb // 2, 3 * mb // 4, 3 * mb // 4, 10]
    layout = net.ddp_bucket_layout(sizes, bucket_mb=2, first_bucket_mb=1)
    assert layout == [(3 * mb // 4 + 10 + 3 * mb // 4, 3), (mb, 2)]
    assert [numel for numel, _ in layout] == net.ddp_buckets(sizes, bucket_mb=2, first_bucket_mb=1)
    link = net.Link("x", 1e6, 0.0)
    codec = net.CodecProfile("q", 8.0, header_bytes=12, header_bytes_per_tensor=4)
    numels, tensors = zip(*layout)
    p = net.predict(list(numels), 2, link, codec, tensors=list(tensors))
    assert p.payload_bytes == sum(numels) + (12 + 4 * 3) + (12 + 4 * 2)
    with pytest.raises(ValueError, match="tensors"):
        net.predict(list(numels), 2, link, codec, tensors=[1])


def test_low_rank_sends_factors_in_two_rounds_sized_by_the_shapes():
    codec = net.CodecProfile("lr", 8.0, header_bytes=12, header_bytes_per_tensor=4, rank=4, factor_scales=True)
    shapes = [(64, 32), (32,), (4, 4)]  # 64 x 32 compresses (4 x 96 x 2 <= 2048); 4 x 4 and the vector do not
    messages = net.bucket_messages(2048 + 32 + 16, codec, tensors=3, shapes=shapes)
    # one scale per factor column: P's 4 + the other 2 parameters' in the header, Q's 4 in their own MAX
    assert messages == [("allreduce", 12 + 4 * (4 + 2)), ("allreduce", 64 * 4 + 32 + 16),
                        ("allreduce", 4 * 4), ("allreduce", 32 * 4)]
    fp32 = net.CodecProfile("lr", 32.0, header_bytes=12, header_bytes_per_tensor=4, rank=4)
    assert [b for _, b in net.bucket_messages(2048 + 48, fp32, 3, shapes)][1:] == [4 * (256 + 48), 4 * 128]
    # nothing to compress: one round, every parameter whole
    assert net.bucket_messages(48, fp32, 2, [(32,), (4, 4)]) == [("allreduce", 12 + 8), ("allreduce", 4 * 48)]
    link = net.Link("x", 1e6, 1e-3, overhead=1e-3)
    p = net.predict([2096], 2, link, codec, tensors=[3], shapes=[shapes])
    assert p.payload_bytes == sum(b for _, b in messages)
    assert p.comm_s == pytest.approx(sum(net.allreduce_s(b, 2, link) for _, b in messages))
    # without shapes: square matrices of the bucket's size
    assert net.payload_bytes(10000, fp32, 1) == 12 + 4 + 4 * (100 * 4 + 100 * 4)


def test_low_rank_profile_matches_the_codec():
    from netgain.comm.lowrank import LowRank

    codec = LowRank(rank=4, factors="gqsgd", bits=8)
    profile = codec_profile(codec, 3, "free")
    assert (profile.rank, profile.wire_bits, profile.factor_scales) == (4, make_codec("gqsgd").wire_bits(3), True)
    assert codec.compresses(64, 32) == net.low_rank_compresses(64, 32, 4) and not codec.compresses(4, 4)
    assert codec_profile(LowRank(2, "fp32"), 3, "free").factor_scales is False
    assert codec.convergence == "low-rank"


def test_bucket_shapes_follow_ddp_ready_order():
    shapes = [(8, 4), (4,), (16, 8), (8,)]
    layout = net.ddp_bucket_layout([32, 4, 128, 8], bucket_mb=200 * 4 / 2**20, first_bucket_mb=130 * 4 / 2**20)
    assert layout == [(136, 2), (36, 2)]
    assert net.ddp_bucket_shapes(shapes, [t for _, t in layout]) == [[(8,), (16, 8)], [(4,), (8, 4)]]
    with pytest.raises(ValueError, match="tensors"):
        net.ddp_bucket_shapes(shapes, [1, 1])


def test_low_rank_is_recommended_where_the_link_is_slow_and_quantization_where_it_is_fast():
    shapes = [(1024, 1024)] * 8 + [(1024,)] * 8
    numels = [math.prod(s) for s in shapes]
    buckets, tensors = map(list, zip(*net.ddp_bucket_layout(numels)))
    bucket_shapes = net.ddp_bucket_shapes(shapes, tensors)
    profiles = candidate_profiles(2, "free")
    slow = advise.evaluate(buckets, 2, net.preset("lab-100mbit"), 0.05, profiles, tensors=tensors, shapes=bucket_shapes)
    assert advise.recommend(slow).profile.name.startswith("lowrank")
    fast = advise.evaluate(buckets, 2, net.preset("nvlink-h100"), 0.05, profiles, tensors=tensors, shapes=bucket_shapes)
    assert advise.recommend(fast).profile.name == "none"


def test_codec_work_on_the_compute_cores_lengthens_the_step():
    codec = net.CodecProfile("q", 8.0, encode_s_per_elem=1e-3, decode_s_per_elem=1e-3)
    link = net.Link("fast", 1e12, 0.0)
    alone = net.predict([100], 2, link, codec, compute_s=1.0)
    shared = net.predict([100], 2, link, codec, compute_s=1.0, codec_shares_compute=True)
    assert alone.step_s == pytest.approx(1.0 + 0.2)  # the bucket's codec work after the backward
    assert shared.step_s == pytest.approx(1.0 + 0.2 + 0.2)  # and the cores it took from the backward


def test_calibration_takes_the_largest_buckets_own_shapes():
    buckets = [[(4, 4)], [(1024, 1024), (512, 512), (1024,)]]
    assert advise.calibration_shapes(buckets, 2) == [(1024, 1024), (512, 512), (1024,)]
    assert advise.calibration_shapes(buckets, 8) == [(1024, 1024)]  # at most 2^22 / 8 elements, at least one
    assert advise.calibration_shapes(None, 2) is None
    torch.manual_seed(0)
    timed = codec_profile(make_codec("lowrank", rank=2), 2, "calibrate", shapes=[(64, 32), (32,)])
    assert timed.encode_s_per_elem > 0 and timed.rank == 2


def _steps_csv(path, rows):
    import csv

    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([("rate", "workers", "contestant", "codec", "steps_ratio"),
                                 *((r, w, "x", c, s) for r, w, c, s in rows)])
    return str(path)


def test_steps_are_read_per_world_size_and_median_over_cells(tmp_path):
    low, q8 = "lowrank(rank=4,factors=fp32)", "gqsgd(bits=8,encoding=packed)"
    a = _steps_csv(tmp_path / "a.csv", [("50mbit", 2, "none", 1.0), ("50mbit", 2, low, 1.1), ("50mbit", 2, "", 1.3),
                                        ("50mbit", 3, low, 1.5), ("50mbit", 3, q8, 1.2), ("50mbit", 2, "randomk(ratio=0.01)", "")])
    b = _steps_csv(tmp_path / "b.csv", [("1gbit", 2, low, 1.3), ("1gbit", 3, q8, 1.4)])
    steps = advise.read_steps([a, b], 2)
    assert steps[low] == pytest.approx(1.2)  # the median over both files' 2-worker rows; 3 workers ignored
    assert steps[q8] == pytest.approx(1.3)  # no 2-worker rows: its other rows
    assert steps["randomk(ratio=0.01)"] == math.inf  # never reached
    assert "" not in steps  # PyTorch's hooks have no netgain codec
    with pytest.raises(ValueError, match="--steps-from .*missing codec, steps_ratio"):
        (tmp_path / "bad.csv").write_text("workers,x\n2,1\n")
        advise.read_steps([str(tmp_path / "bad.csv")], 2)
    for name, workers, ratio in (("neg", 2, -1), ("text", 2, "fast"), ("float-workers", "2.0", 1.1), ("no-workers", "", 1.1)):
        with pytest.raises(ValueError, match=f"--steps-from .*{name}.csv, line 2: workers must be an integer"):
            advise.read_steps([_steps_csv(tmp_path / f"{name}.csv", [("x", workers, low, ratio)])], 2)
    (tmp_path / "short.csv").write_text("workers,codec,steps_ratio\n2,fp16\n")
    with pytest.raises(ValueError, match="line 2"):
        advise.read_steps([str(tmp_path / "short.csv")], 2)
    (tmp_path / "binary.csv").write_bytes(b"workers,codec,steps_ratio\n\xff\xfe\n")
    with pytest.raises(ValueError, match="not a text CSV"):
        advise.read_steps([str(tmp_path / "binary.csv")], 2)
    with pytest.raises(ValueError, match="--steps-from"):
        advise.read_steps([str(tmp_path / "missing.csv")], 2)


def test_measured_steps_turn_the_recommendation_into_time_to_target():
    shapes = [(1024, 1024)] * 8 + [(1024,)] * 8
    buckets, tensors = map(list, zip(*net.ddp_bucket_layout([math.prod(s) for s in shapes])))
    bucket_shapes = net.ddp_bucket_shapes(shapes, tensors)
    profiles = candidate_profiles(2, "free")
    link = net.preset("lab-100mbit")
    by_step = advise.recommend(advise.evaluate(buckets, 2, link, 0.05, profiles, tensors=tensors, shapes=bucket_shapes))
    # the step-time pick never reaches the target; quantization needs as many steps as fp32
    steps = {by_step.profile.name: math.inf, "gqsgd(bits=8,encoding=packed)": 1.0, "gqsgd(bits=4,encoding=packed)": 1.0}
    rows = advise.evaluate(buckets, 2, link, 0.05, profiles, tensors=tensors, shapes=bucket_shapes, steps=steps)
    chosen = advise.recommend(rows)
    assert chosen.profile.name in ("gqsgd(bits=8,encoding=packed)", "gqsgd(bits=4,encoding=packed)")
    assert all(r.time_s == pytest.approx(r.prediction.step_s * r.steps) for r in rows if r.steps is not None)
    assert next(r for r in rows if r.profile.name == "none").steps == 1.0
    # unmeasured codecs are not recommended: they would look as if they converged like fp32
    faster = [r for r in rows if r.convergence in advise.CONVERGES and r.time_s < chosen.time_s / (1 + advise.DEFAULT_TOLERANCE)]
    assert faster and all(r.steps is None for r in faster)
    table = advise.format_table(rows, chosen)
    assert "steps x" in table and "| - | - |" in table and "| never | 0.00x |" in table
    with pytest.raises(ValueError, match="--steps-from: none of its codecs"):  # nothing it measured is weighed here
        advise.evaluate(buckets, 2, link, 0.05, profiles, tensors=tensors, shapes=bucket_shapes, steps={"misspelt": 1.0})


def test_cli_steps_from_prints_time_to_target(tmp_path, capsys):
    path = _steps_csv(tmp_path / "s.csv", [("lab", 2, "gqsgd(bits=4,encoding=packed)", 1.1)])
    assert cli.main(["model", "--params", "1e7", "--workers", "2", "--link", "lab-100mbit", "--compute-ms", "50",
                     "--codec-cost", "free", "--steps-from", path]) == 0
    out = capsys.readouterr().out
    assert "to-target speedup" in out and "fixed codec: gqsgd(bits=4,encoding=packed)" in out
    assert "1.1x its steps to the target" in out
    with pytest.raises(SystemExit):
        cli.main(["model", "--params", "1e7", "--workers", "2", "--link", "lab-100mbit", "--compute-ms", "50",
                  "--steps-from", str(tmp_path / "none.csv")])
    assert "--steps-from" in capsys.readouterr().err


def test_casts_are_eligible_sparsifiers_only_when_biased_is_allowed():
    """16-bit casts round each addition to within half a unit in the last place (0.97-0.99x fp32's steps
    to the target on the lab), so the recommendation weighs them; top-k and random-k only when asked."""
    rows = advise.evaluate(net.even_buckets(1e8), 4, net.preset("10gbe"), 0.1, candidate_profiles(4, "free"))
    names = {r.profile.name.split("(")[0] for r in advise.eligible(rows)}
    assert {"fp16", "bf16", "gqsgd", "lowrank", "none"} <= names and not names & {"topk", "randomk"}
    assert {"topk", "randomk"} <= {r.profile.name.split("(")[0] for r in advise.eligible(rows, biased=True)}


# ------------------------------------------------------------------ two-level clusters (nodes of several GPUs)

NVLINK, NIC = net.preset("nvlink-a100"), net.preset("25gbe")


def test_one_node_is_the_flat_case_and_one_gpu_per_node_the_network():
    buckets = net.even_buckets(1e8)
    one_node = net.Cluster(1, 8, NVLINK, NIC)
    assert one_node.flat_link() == NVLINK and one_node.world_size == 8
    assert net.predict(buckets, 8, one_node.flat_link()) == net.predict(buckets, 8, NVLINK)
    spread = net.Cluster(4, 1, NVLINK, NIC)
    assert spread.flat_link() == NIC and spread.replica_link().bandwidth == NIC.bandwidth
    # HSDP with one GPU per node shards nothing: it is DDP across the nodes
    codec = next(p for p, _ in candidate_profiles(4, "free") if p.name == "gqsgd(bits=8,encoding=packed)")
    hsdp, ddp = net.predict_hsdp(buckets, spread, codec, 0.5), net.predict(buckets, 4, NIC, codec, 0.5)
    assert (hsdp.step_s, hsdp.comm_s, hsdp.payload_bytes) == pytest.approx((ddp.step_s, ddp.comm_s, ddp.payload_bytes))


def test_ddp_across_nodes_runs_at_the_pace_of_the_nic():
    """NCCL's ring over all ranks leaves and enters each node once: every step waits for the NIC."""
    cluster = net.Cluster(2, 4, NVLINK, NIC)
    link = cluster.flat_link()
    assert (link.bandwidth, link.latency, link.algorithm) == (NIC.bandwidth, NIC.latency, "fastest")
    assert net.ring_allreduce_s(1e8, 8, link) == pytest.approx(net.ring_allreduce_s(1e8, 8, NIC))
    lab = net.Cluster(2, 2, net.preset("lab-1gbit"), net.preset("lab-100mbit")).flat_link()
    assert lab.algorithm == "ring" and lab.overhead == net.preset("lab-1gbit").overhead  # the larger of the two
    with pytest.raises(ValueError, match="gpus_per_node: must be an integer >= 1, got 0"):
        net.Cluster(2, 0, NVLINK, NIC)


def test_hsdp_sends_a_shard_across_nodes_through_a_shared_nic():
    fast = net.Link("ideal", 1e15, 0.0)
    slow = net.Link("slow", 1e9, 0.0)
    cluster = net.Cluster(2, 4, fast, slow)
    buckets = net.even_buckets(1e8)  # every bucket divides by 4
    ddp = net.predict(buckets, 8, cluster.flat_link(), algorithm="ring")
    hsdp = net.predict_hsdp(buckets, cluster, algorithm="ring")
    assert hsdp.payload_bytes == ddp.payload_bytes / 4 and hsdp.elements == ddp.elements / 4
    # 4 shards share the NIC: each all-reduces 1/4 of the bytes at 1/4 of its rate, 2(N-1)/N against DDP's 2(n-1)/n
    assert hsdp.comm_s == pytest.approx(sum(net.ring_allreduce_s(4 * b, 2, slow) for b in buckets), rel=1e-4)
    assert hsdp.comm_s / ddp.comm_s == pytest.approx((2 * 1 / 2) / (2 * 7 / 8), rel=1e-4)


def test_hsdp_gathers_hide_behind_compute_and_the_last_reduce_scatter_does_not():
    cluster = net.Cluster(1, 4, net.preset("pcie4"), NIC)
    buckets = net.even_buckets(1e8)
    moves = [net.allgather_s(4 * b / 4, 4, cluster.intra) for b in buckets]  # a reduce-scatter moves the same
    hidden = net.predict_hsdp(buckets, cluster, compute_s=100.0)
    assert hidden.step_s == pytest.approx(100.0 + moves[-1]) and hidden.comm_s == pytest.approx(3 * sum(moves))
    assert hidden.payload_bytes == 0  # one node: nothing crosses nodes
    exposed = net.predict_hsdp(buckets, cluster, compute_s=0.0)
    assert exposed.step_s >= 2 * sum(moves)  # each pass takes its gathers' time at least


def _routes(compute_s: float = 0.05):
    cluster = net.Cluster(2, 4, NVLINK, net.preset("10gbe"))
    buckets = net.even_buckets(1e8)
    ddp = advise.evaluate(buckets, 8, cluster.flat_link(), compute_s, candidate_profiles(8, GPUS["a100"]))
    fp32 = next(r for r in ddp if r.profile.name == "none").prediction.step_s
    hsdp = advise.evaluate(buckets, 2, None, compute_s, candidate_profiles(2, GPUS["a100"]), hsdp=cluster, baseline_s=fp32)
    return cluster, ddp, hsdp


def test_the_recommended_route_is_the_cheapest_priced():
    cluster, ddp, hsdp = _routes()
    assert {r.route for r in ddp} == {"DDP"} and {r.route for r in hsdp} == {"HSDP"}
    fp32 = next(r for r in ddp if r.profile.name == "none").prediction.step_s
    assert all(r.speedup == pytest.approx(fp32 / r.prediction.step_s) for r in hsdp)  # against fp32 DDP
    rows = ddp + hsdp
    assert advise.recommend(rows, tolerance=0) is min(advise.eligible(rows), key=lambda r: r.time_s)
    assert advise.recommend(rows, tolerance=0, biased=True) is min(rows, key=lambda r: r.time_s)
    # within the tolerance, the least lossy per gradient element whatever the route: HSDP's none is fp32 too
    chosen = advise.recommend(rows)
    close = [r for r in advise.eligible(rows) if r.time_s <= min(x.time_s for x in advise.eligible(rows)) * 1.1]
    assert chosen in close and all(r.prediction.payload_bytes / r.prediction.elements
                                   <= chosen.prediction.payload_bytes / chosen.prediction.elements for r in close)


def _table(out: str, heading: str) -> list[str]:
    """The rows of the first table after the line that starts with `heading`."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    start = next(i for i in range(start, len(lines)) if lines[i].startswith("|---")) + 1
    return lines[start:lines.index("", start)]


def test_cli_prices_a_two_level_cluster_and_recommends_a_route(capsys):
    assert cli.main(["model", "--params", "1.3e9", "--nodes", "2", "--gpus-per-node", "4", "--intra-link", "nvlink-a100",
                     "--inter-link", "25gbe"]) == 0
    out = capsys.readouterr().out
    assert "2 nodes x 4 GPUs = 8 workers" in out and "per node (its NIC, shared by its 4 GPUs)" in out
    hsdp = _table(out, "HSDP:")
    from netgain.comm.fsdp import CODECS  # what the FSDP hook runs across replicas is what HSDP prices
    assert {line.split(" | ")[0].strip("| ").split("(")[0] for line in hsdp} == {n for n, _ in SETTINGS if n in CODECS}
    route = re.search(r"recommendation: (DDP|HSDP), (.*?) \(([0-9.]+)x the step speed of fp32 DDP, ([0-9.]+)x the step "
                      r"speed of DDP with PowerSGD r4\)", out)
    assert route, out
    step = {name: float(line.split(" | ")[-2]) for name, table in (("DDP", _table(out, "DDP:")), ("HSDP", hsdp))
            for line in table if "**<-**" in line}
    fp32 = float(_table(out, "DDP:")[0].split(" | ")[-2])
    assert list(step) == [route[1]] and float(route[3]) == pytest.approx(fp32 / step[route[1]], abs=0.01)
    # DDP's rows are the flat cluster's on the NIC: --workers 8 --link 25gbe prices the same table
    assert cli.main(["model", "--params", "1.3e9", "--workers", "8", "--link", "25gbe"]) == 0
    flat = capsys.readouterr().out
    assert [line.replace(" **<-**", "") for line in _table(out, "DDP:")] == \
        [line.replace(" **<-**", "") for line in _table(flat, "| codec")]


@pytest.mark.parametrize("argv, message", [
    (["--workers", "6", "--nodes", "2", "--gpus-per-node", "4"],
     "--workers must be --nodes 2 x --gpus-per-node 4 = 8 (or be left out), got 6"),
    (["--nodes", "2"], "--nodes 2 needs its partner: a two-level cluster is --nodes x --gpus-per-node, give both"),
    (["--nodes", "2", "--gpus-per-node", "4", "--link", "25gbe"], "--link 25gbe is a flat cluster's one link: with "
     "--nodes give --intra-link and --inter-link"),
    (["--workers", "8", "--inter-link", "25gbe"], "--inter-link 25gbe describes a two-level cluster: give --nodes"),
    ([], "give --workers (a flat cluster, every rank on --link), or --nodes and --gpus-per-node"),
    (["--nodes", "2", "--gpus-per-node", "0"], "--gpus-per-node must be at least 1, got 0"),
    (["--nodes", "2", "--gpus-per-node", "4", "--inter-bandwidth", "fast"], "--inter-bandwidth: cannot parse 'fast'"),
    (["--nodes", "2", "--gpus-per-node", "4", "--intra-link", "pcie4", "--intra-bandwidth", "40gbit"],
     "--intra-link pcie4 and --intra-bandwidth 40gbit both name the link: give one"),
    (["--nodes", "2", "--gpus-per-node", "4", "--inter-bandwidth", "1e30gbit"],
     "--inter-bandwidth must be between 1 kbit/s and 10 Pbit/s, got 1e30gbit"),
    (["--nodes", "2", "--gpus-per-node", "4", "--intra-link", "nvlink"], "argument --intra-link: invalid choice: 'nvlink'"),
])
def test_cli_refuses_an_inconsistent_cluster_by_name(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["model", "--params", "1.3e9", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_cli_two_level_custom_links_and_defaults():
    args = cli.build_parser("model").parse_args(["model", "--params", "1e9", "--nodes", "3", "--gpus-per-node", "8",
                                                 "--gpu", "h100", "--inter-bandwidth", "200gbit", "--inter-latency", "5us"])
    advise.check_args(args)
    cluster, link, device = advise.resolve_cluster(args)
    assert (cluster.nodes, cluster.gpus_per_node, cluster.intra.name, device) == (3, 8, "nvlink-h100", "h100")
    assert (cluster.inter.bandwidth, cluster.inter.latency) == (pytest.approx(25e9), pytest.approx(5e-6))
    assert link == cluster.flat_link() and link.bandwidth == cluster.inter.bandwidth
