"""Kimad: the bandwidth monitor, and the adaptive hook's plan agreement across ranks."""

import time

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import netgain.comm as comm
from netgain.comm.adaptive import AdaptivePlanner, option_error
from netgain.comm.bandwidth import BandwidthMonitor
from netgain.comm.codecs import GlobalQSGD, NoCompression, TopK

from distributed import run
from test_hook import Layers, grads


def big_layers():
    """Parameters large enough (80-160 KB) for the monitor to measure bandwidth, not latency."""
    return Layers(20_000, (200, 200), 30_000)


def test_monitor_holds_back_one_outlier_and_follows_a_real_change():
    monitor = BandwidthMonitor(smoothing=0.5, outlier=3.0)
    assert monitor.update(100.0, 0.001) == 100.0
    assert monitor.update(1000.0, 0.001) == 100.0     # one odd step: held back
    assert monitor.update(110.0, 0.001) == 105.0      # it was noise
    monitor.update(10.0, 0.001)
    assert monitor.update(11.0, 0.001) == pytest.approx(10.5)  # two steps agree: jump


def test_monitor_counts_wire_bytes_by_collective():
    monitor = BandwidthMonitor()
    monitor.observe("allreduce", 1_000_000, 0.5, 4)   # ring: 2(n-1)/n = 1.5 x payload on the wire
    monitor.observe("allreduce", 16, 0.002, 4)        # a header: latency only
    bandwidth, latency = monitor.local_estimate()
    assert bandwidth == pytest.approx(3_000_000) and latency == 0.002


def test_monitor_slope_ignores_a_per_transfer_burst():
    monitor = BandwidthMonitor()
    burst, rate = 256 * 1024, 12.5e6  # a token bucket lets 256 KB through at once, then 100 Mbit/s
    for size in (1_000_000, 5_000_000):
        monitor.observe("allreduce", size, 0.0001 + (size - burst) / rate, 2)
    bandwidth, _ = monitor.local_estimate()
    assert bandwidth == pytest.approx(rate)  # bytes / time would say 13.2e6 and 16.0e6


def test_option_errors_order_as_expected():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    errors = [option_error(o, x) for o in (NoCompression(), GlobalQSGD(8), GlobalQSGD(4), GlobalQSGD(2))]
    assert errors[0] == 0 and errors[1] < errors[2] < errors[3]
    assert option_error(TopK(0.1), x) < option_error(TopK(0.01), x) < x.square().sum()


def test_bad_planner_arguments():
    with pytest.raises(ValueError, match=r"is not one of \('kimad', 'kimad\+'\)"):
        AdaptivePlanner("kimad++")
    with pytest.raises(ValueError, match="time_budget_s must be > 0"):
        AdaptivePlanner(time_budget_s=0)


def adaptive_run(rank, world_size, mode, force_mismatch=False):
    model = DDP(big_layers(), bucket_cap_mb=0.2)
    state = comm.register(model, mode, min_compress_numel=0, replan_every=2, comm_budget_ms=2.0)
    plans = []
    for step in range(6):
        if force_mismatch and rank == 1 and step == 4:
            state.chooser.codec_for = lambda index, numel: GlobalQSGD(2)
        model.zero_grad()
        time.sleep(0.01 * rank)  # ranks reach the collectives at different times
        model(step, rank).backward()
        plans.append((state.last_step.get("plan"), state.last_step.get("bandwidth_Bps")))
    return plans, grads(model)


@pytest.mark.parametrize("mode", ["kimad", "kimad+"])
def test_plan_identical_on_every_rank(mode):
    results = run(adaptive_run, 2, mode)
    assert all(status == "ok" for status, _ in results), results
    (plans0, grads0), (plans1, grads1) = (value for _, value in results)
    assert plans0 == plans1
    assert torch.equal(grads0, grads1)
    assert plans0[-1][0] and plans0[-1][1] > 0  # a plan was made from a measured bandwidth


def test_forced_mismatch_raises_on_every_rank():
    results = run(adaptive_run, 2, "kimad+", True)
    assert all(status == "error" and "different codecs" in message for status, message in results), results
