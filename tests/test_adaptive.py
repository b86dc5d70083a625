"""Kimad: the bandwidth monitor, and the adaptive hook's plan agreement across ranks."""

import collections
import dataclasses
import io
import json
import math
import statistics
import time

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import netgain.comm as comm
from netgain.comm import adaptive
from netgain.comm.adaptive import (MAX_ERROR, OVERRUN_EXCEEDANCE, RISE_VOLUME, TRIAL_RANGE, TRIAL_SKIP, TRIAL_STEPS,
                                   WARMUP_WORTH, AdaptivePlanner, option_error)
from netgain.comm.bandwidth import WIRE_FACTOR, BandwidthMonitor, fit, in_words, rate
from netgain.comm.collectives import Communicator
from netgain.comm.calibrate import codec_profile
from netgain.comm.codecs import Context, GlobalQSGD, NoCompression, TopK
from netgain.comm.fused import Segments
from netgain.comm.lowrank import LowRank

from distributed import run
from test_hook import Layers, grads


def big_layers():
    """Parameters large enough (80-160 KB) for the monitor to measure bandwidth, not latency."""
    return Layers(20_000, (200, 200), 30_000)


class Clock:
    """A fake completion clock: every collective completes well after the previous one (no queueing)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        self.now += 10.0
        return self.now


def observe_step(monitor, sizes, rate, alpha=0.0005, collective="allreduce", world_size=2, noise=None):
    """Feed one step of collectives taking alpha + wire bytes / rate each."""
    noise = noise or [1.0] * len(sizes)
    for size, factor in zip(sizes, noise):
        wire = WIRE_FACTOR[collective](world_size) * size
        monitor.observe(collective, size, (alpha + wire / rate) * factor, world_size)


def monitor_step(monitor, sizes, rate, **step):
    """Feed one step of collectives (observe_step); return the local estimate."""
    observe_step(monitor, sizes, rate, **step)
    return own_estimate(monitor)


def own_estimate(monitor):
    """(bandwidth, latency, overhead_s) from this rank's own samples of the step just ended (one rank: no agreeing)."""
    return monitor.add_step(monitor.take_step())[:3]


def test_fit_takes_alpha_from_small_and_beta_from_large_collectives():
    samples = [(100, 0.0005), (64, 0.00052), (200_000, 0.0005 + 200_000 / 12.5e6), (1_000_000, 0.0805),
               (1_000_000, 0.5)]  # the last one stalled: a robust fit ignores it
    alpha, slope, _ = fit(samples)
    assert alpha == pytest.approx(0.0005, rel=0.05) and 1 / slope == pytest.approx(12.5e6, rel=0.02)


def test_monitor_counts_wire_bytes_by_collective():
    monitor = BandwidthMonitor(clock=Clock())
    bandwidth, latency, _ = monitor_step(monitor, [16, 1_000_000], 3e6, alpha=0.002, world_size=4)
    assert bandwidth == pytest.approx(3e6) and latency == pytest.approx(0.002)  # ring: 1.5 x payload on the wire


def test_monitor_slope_ignores_a_per_transfer_burst():
    monitor = BandwidthMonitor(clock=Clock())
    burst, rate = 256 * 1024, 12.5e6  # a token bucket lets 256 KB through at once, then 100 Mbit/s
    for size in (1_000_000, 5_000_000):
        monitor.observe("allreduce", size, 0.0001 + (size - burst) / rate, 2)
    bandwidth, _, _ = own_estimate(monitor)
    assert bandwidth == pytest.approx(rate)  # bytes / time would say 13.2e6 and 16.0e6


def test_monitor_learns_from_small_payloads_alone():
    """Headers and heavily compressed payloads all under 4 KiB: the estimate still moves with the link."""
    monitor = BandwidthMonitor(clock=Clock())
    sizes = [40, 200, 1_000, 3_000]
    first = monitor_step(monitor, sizes, 5e6)[0]
    for _ in range(3):
        monitor_step(monitor, sizes, 1e6)
    assert first == pytest.approx(5e6, rel=0.01) and own_estimate(monitor)[0] == pytest.approx(1e6, rel=0.01)


def test_bytes_that_cost_no_measurable_time_leave_the_rate_unmeasured():
    """1-4 KB messages whose times are rank skew (0.3 or 1.3 ms, whatever their size): no slope to read,
    so the rate is unmeasured (infinite) above the volumes sent, not the 2-6 MB/s their noise suggests."""
    skew = [0.0003, 0.0013, 0.0013, 0.0003, 0.0003, 0.0013, 0.0013, 0.0003]
    samples = [(size, seconds) for size, seconds in zip([1_000, 4_000, 1_000, 4_000, 2_000, 3_000, 2_000, 3_000] * 2,
                                                         skew + skew[::-1])]
    alpha, slope, _ = fit(samples)
    assert slope == 0.0 and rate(slope) == float("inf") and 0.0003 <= alpha <= 0.0013
    monitor = BandwidthMonitor(clock=Clock())
    for size, seconds in samples:
        monitor.observe("allreduce", size / WIRE_FACTOR["allreduce"](2), seconds, 2)
    assert own_estimate(monitor)[0] == float("inf")
    monitor_step(monitor, [1_000, 1_000_000], 1e6)  # the plan climbed: the first larger message measures the rate
    assert own_estimate(monitor)[0] < 2e6  # at once: larger messages taking longer is no link change to hold back
    assert "bytes cost no measurable time" in in_words(float("inf")) and in_words(12.5e6) == "100 Mbit/s"
    # one pair, a header that waited out a slow rank beside its payload: too little to call the rate unmeasured
    alpha, slope, _ = fit([(100, 0.004), (3_400_000, 0.003)])
    assert rate(slope) == 3_400_000 / 0.003


def agreed_samples(rank, world_size):
    """Rank 0 reached the header first and waited 5 ms for rank 1; the payload then took 2 ms on both.
    The collectives completed in a different order on each rank."""
    step = [(16.0, 0.005), (1e6, 0.002)] if rank == 0 else [(1e6, 0.0021), (16.0, 0.0001)]
    return BandwidthMonitor.agree(Communicator(), step)


def test_ranks_fit_each_collectives_least_service_time():
    """The skew between ranks is not link time: the header's 5 ms wait on rank 0 is gone from the samples
    both ranks fit."""
    results = run(agreed_samples, 2)
    assert results[0] == results[1] == ("ok", [(16.0, 0.0001), (1e6, 0.002)])


def test_monitor_follows_a_rate_change_in_two_steps_and_ignores_one_slow_step():
    monitor = BandwidthMonitor(clock=Clock())
    sizes = [40, 500_000, 40, 2_000_000]
    for _ in range(5):
        monitor_step(monitor, sizes, 125e6)
    noisy = monitor_step(monitor, sizes, 125e6, noise=[1, 1, 1, 3])  # one stalled payload
    after = monitor_step(monitor, sizes, 125e6)
    first = monitor_step(monitor, sizes, 12.5e6)                    # the link drops 10x: one step held back
    second = monitor_step(monitor, sizes, 12.5e6)                   # a second step agrees: follow it
    assert noisy[0] == after[0] == first[0] == pytest.approx(125e6, rel=0.01)
    assert second[0] == pytest.approx(12.5e6, rel=0.01) and second[1] == pytest.approx(0.0005, rel=0.01)


def test_monitor_skips_the_first_steps_start_up_stall():
    """A process's first step (late ranks, first-call compiles) is no sample: the fit starts from step 2."""
    monitor = BandwidthMonitor(clock=Clock(), skip_steps=1)
    assert monitor_step(monitor, [1_000, 1_000_000], 1e6, alpha=0.5) == (0.0, 0.0, 0.0)
    bandwidth, latency, overhead = monitor_step(monitor, [1_000, 1_000_000], 1e6)
    assert bandwidth == pytest.approx(1e6, rel=0.01) and latency < 0.001 and overhead < 0.001
    with pytest.raises(ValueError, match="skip_steps must be >= 0"):
        BandwidthMonitor(skip_steps=-1)


def test_auto_plans_after_the_first_step_on_the_rate_it_bounds():
    """auto's monitor (rise_volume): the skipped first step still bounds the rate from below, and that bound is
    planned with and caps small messages' reading until a rate is measured at comparable volume: at 10 Mbit/s
    an unplanned step took 11-14 s, so waiting for a second one to measure the link cost a step of those."""
    monitor = BandwidthMonitor(clock=Clock(), skip_steps=1, rise_volume=RISE_VOLUME)
    monitor_step(monitor, [1_000, 1_000_000], 1e6, alpha=0.5)  # start-up stalls: 0.5 s more on each collective
    assert monitor.bandwidth == pytest.approx(1e6 / 1.5) and monitor.latency == 0.0
    monitor.update(*monitor.add_step(monitor.take_step()))  # a step that sent nothing changes nothing
    assert monitor.bandwidth == pytest.approx(1e6 / 1.5)
    for _ in range(2):  # low rank's small messages pass a shaper's burst: no rise read from them
        observe_step(monitor, [1_000, 20_000], 25e6)
        monitor.update(*monitor.add_step(monitor.take_step()))
    assert monitor.bandwidth == pytest.approx(1e6 / 1.5)
    for _ in range(2):  # a step far off the small messages' fit waits for a second opinion (`change`)
        observe_step(monitor, [1_000, 1_000_000], 1e6)
        monitor.update(*monitor.add_step(monitor.take_step()))
    assert monitor.bandwidth == pytest.approx(1e6, rel=0.01)  # measured at volume: the bound gives way


def test_a_bound_read_from_small_messages_is_no_fall_below_the_rate_measured_at_volume():
    """The lab at 1 Gbit/s (3 workers): fp16 steps measured 148 MB/s; two steps of low rank's 150 and 173 kB
    messages, their times CPU jitter, then ran far off that fit, restarted the window, and their sizes (within
    `spread`) measure no slope: the fastest rate one achieved, 48 MB/s, bounds the link from below and is no fall.
    kimad's monitor (no rise_volume, no rate held at volume) plans with it as before."""
    jittery = [[(150_186, 0.0031), (173_056, 0.0103)], [(150_186, 0.0069), (173_056, 0.0064)]]
    for rise_volume, expected in ((RISE_VOLUME, 148e6), (None, 150_186 / 0.0031)):
        monitor = BandwidthMonitor(clock=Clock(), rise_volume=rise_volume)
        for step in [[(224, 0.0002), (4_592_128, 0.0002 + 4_592_128 / 148e6)]] * 3 + jittery:
            for wire, seconds in step:
                monitor.observe("allreduce", wire / WIRE_FACTOR["allreduce"](3), seconds, 3)
            monitor.update(*monitor.add_step(monitor.take_step()))
        assert monitor.bandwidth == pytest.approx(expected, rel=0.01)
    assert fit([(150_186, 0.0031), (173_056, 0.0103)])[2] and not fit([(224, 0.0002), (4_592_128, 0.031)])[2]


def test_a_bound_read_at_volume_is_a_reading_like_any_other():
    """A plain step sends one payload size, so its window fits to a bound: at volume a fall read so is followed at
    once, and a rise after it waits, as for a measured slope."""
    monitor = BandwidthMonitor(rise_volume=RISE_VOLUME, rise_steps=2)
    assert monitor.update(148e6, 0.0, 0.0, 4.6e6, bound=True) == 148e6
    assert monitor.update(14.8e6, 0.0, 0.0, 4.6e6, bound=True) == 14.8e6  # a fall at volume: followed at once
    assert monitor.update(148e6, 0.0, 0.0, 4.6e6, bound=True) == 14.8e6   # a rise waits out rise_steps
    assert monitor.update(10e6, 0.0, 0.0, 0.2e6, bound=True) == 14.8e6    # below volume: a bound is no fall


def test_monitor_charges_a_queued_collective_only_its_own_time():
    clock = iter([1.0, 1.2]).__next__  # the second payload waited 0.2 s behind the first, then took 0.2 s
    monitor = BandwidthMonitor(clock=clock)
    monitor.observe("allreduce", 1_000_000, 0.2, 2)
    monitor.observe("allreduce", 1_000_000, 0.4, 2)
    assert [round(s, 6) for _, s in monitor._step] == [0.2, 0.2]
    bandwidth, _, overhead = own_estimate(monitor)
    assert overhead == pytest.approx(0.0, abs=1e-9)  # the link was busy 0.4 s, as the fit predicts (the hook's 0.6 s counts the queueing twice)


def test_a_rise_in_bandwidth_counts_once_it_outlasts_the_window():
    monitor = BandwidthMonitor(window_steps=4)
    assert monitor.update(1e6, 0.001) == 1e6
    for _ in range(3):
        assert monitor.update(20e6, 0.001) == 1e6  # a misfit lasts while its samples stay in the window
    assert monitor.update(20e6, 0.001) == 20e6     # a full window later: the link got faster
    assert monitor.update(0.5e6, 0.001) == 0.5e6   # a fall is followed at once


def test_a_rise_counts_after_rise_steps():
    monitor = BandwidthMonitor(rise_steps=2)
    assert monitor.update(1e6, 0.001) == 1e6
    assert monitor.update(5e6, 0.001) == 1e6     # one fast step (a shaper's burst) is not believed
    assert monitor.update(1.2e6, 0.001) == 1.2e6  # and gone the step after
    assert monitor.update(4e6, 0.001) == 1.2e6
    assert monitor.update(4.5e6, 0.001) == 4e6   # two steps agree: the link got faster
    assert monitor.update(0.5e6, 0.001) == 0.5e6  # a fall is followed at once
    assert monitor.update(0.0, 0.0) == 0.5e6      # no sample on any rank: nothing changes


def test_a_rise_read_from_small_messages_does_not_count_where_volume_is_required():
    """auto's monitor (rise_volume): a token bucket's burst passes small messages at wire speed while it
    refills between steps. Measured at 1.6 MB a message, the rate is a ceiling: 80 kB messages that read 20x
    faster (or unmeasured) do not raise it, a fall read from them counts while it lasts, and a rise at
    comparable volume counts."""
    monitor = BandwidthMonitor(window_steps=1, rise_volume=0.5)
    assert monitor.update(1.25e6, 0.001, 0.0, 1.6e6) == 1.25e6
    assert monitor.update(25e6, 0.001, 0.0, 80e3) == 1.25e6
    assert monitor.update(float("inf"), 0.001, 0.0, 80e3) == 1.25e6
    assert monitor.update(1e6, 0.001, 0.0, 80e3) == 1e6              # slower at any volume: believed at once
    assert monitor.update(25e6, 0.001, 0.0, 80e3) == 1.25e6          # and gone with the steps that read it
    assert monitor.update(2e6, 0.001, 0.0, 0.9e6) == 2e6             # faster at comparable volume: believed
    assert monitor.volume == 1.6e6 and BandwidthMonitor(window_steps=1).update(25e6, 0.001, 0.0, 80e3) == 25e6
    with pytest.raises(ValueError, match="rise_volume must be in"):
        BandwidthMonitor(rise_volume=2.0)


def test_before_any_rate_is_measured_auto_plans_with_the_fastest_rate_a_collective_achieved():
    """auto's monitor (rise_volume): messages whose times read no slope leave the rate unmeasured; until one is
    measured, the rate planned with is the fastest any sample achieved (a lower bound), not infinite, which
    made auto's first plan fp32 on a 50 Mbit/s link. Without rise_volume (kimad) it stays unmeasured."""
    skew = [0.0003, 0.0013, 0.0013, 0.0003, 0.0003, 0.0013, 0.0013, 0.0003]
    sizes = [1_000, 4_000, 1_000, 4_000, 2_000, 3_000, 2_000, 3_000]
    for rise_volume, expected in ((RISE_VOLUME, 4_000 / 0.0003), (None, float("inf"))):
        monitor = BandwidthMonitor(clock=Clock(), rise_volume=rise_volume)
        for size, seconds in zip(sizes, skew):
            monitor.observe("allreduce", size / WIRE_FACTOR["allreduce"](2), seconds, 2)
        monitor.update(*monitor.add_step(monitor.take_step()))
        assert monitor.bandwidth == pytest.approx(expected)


def test_planner_checkpoint_carries_the_agreed_link_and_the_margin():
    planner = AdaptivePlanner("kimad+")
    planner.monitor.update(1e6, 0.002, 0.01)
    planner.monitor.update(3e6, 0.002, 0.01)
    planner._overruns.extend([1.0] * 10 + [1.4] * 2)
    planner._backward_s = 0.05
    state = torch.load(io.BytesIO(_saved(planner.state_dict())), weights_only=True)
    resumed = AdaptivePlanner("kimad+")
    resumed.load_state_dict(state)
    assert resumed.monitor.bandwidth == 1e6 and list(resumed.monitor.agreed) == [1e6, 3e6]
    assert resumed.margin() == planner.margin() > 1
    assert resumed.monitor.update(3.5e6, 0.002) == 1e6  # the steps before the checkpoint count toward a rise
    assert [resumed.monitor.update(3.5e6, 0.002) for _ in range(6)][-1] == 3e6


def test_auto_checkpoint_carries_its_measured_prices_and_the_rate_believed_at_volume():
    """A rank-0 checkpoint resumes auto's choice exactly: the plans' measured step times, the step's other time
    and the rate measured at volume (a later small-volume reading must not lift it after the resume)."""
    planner = comm.AutoConfig().build()
    planner.monitor.update(1.25e6, 0.001, 0.0, 3e6)
    planner._compute.extend([0.12, 0.13])
    planner._periods[((0, 1000, 5),)] = 0.15
    planner._periods[((0, 1000, 2),)], planner._short = 0.2, {((0, 1000, 2),)}  # priced out before it cleared
    planner._priced_rate = 1.25e6
    resumed = comm.AutoConfig().build()
    resumed.load_state_dict(torch.load(io.BytesIO(_saved(planner.state_dict())), weights_only=True))
    assert resumed._periods == {((0, 1000, 5),): 0.15, ((0, 1000, 2),): 0.2} and resumed._priced_rate == 1.25e6
    assert resumed._short == {((0, 1000, 2),)}
    assert resumed.compute_s() == planner.compute_s() == 0.125
    assert resumed.monitor.update(25e6, 0.001, 0.0, 80e3) == 1.25e6 and resumed.monitor.volume == 3e6


def test_auto_checkpoint_carries_its_plan_as_plain_data():
    """The plan running, the errors it was solved on and how far it is priced come back, as plain data (JSON too:
    netgain.comm.fsdp keeps it in its header); the resumed planner reports the plan before it agrees again."""
    planner = one_bucket_auto(1e6)
    planner._solve(2)
    planner._running.extend([0.2, 0.3])
    saved = json.loads(json.dumps(planner.state_dict()))
    resumed = comm.AutoConfig().build()
    resumed.load_state_dict(torch.load(io.BytesIO(_saved(saved)), weights_only=True))
    assert resumed.codec_for(0, 1_000_000).describe() == "lowrank(rank=4,factors=gqsgd,bits=8)"
    assert resumed._plan_key == planner._plan_key and list(resumed._running) == [0.2, 0.3]
    assert resumed.errors == planner.errors and resumed._shapes == planner._shapes and not resumed._stale
    assert resumed.last["plan"] == {0: "lowrank(rank=4,factors=gqsgd,bits=8)"}
    assert json.loads(json.dumps(resumed.state_dict())) == saved
    with pytest.raises(ValueError, match="does not fit this planner's 4 options"):  # another config's plan
        comm.AutoConfig(bits=(8,), rank=None).build().load_state_dict(saved)


def test_margin_is_an_order_statistic_a_new_step_exceeds_at_most_one_time_in_twenty():
    planner = AdaptivePlanner("kimad+")
    planner._overruns.extend([1.0, 1.2, 1.1, 1.05])
    assert planner.margin() == 1.0                   # too few steps to judge
    planner._overruns.extend([1.0] * 15 + [1.5])
    assert planner.margin() == 1.5                   # 20 steps: the largest (exceeded with chance 1/21)
    planner._overruns.clear()
    planner._overruns.extend([0.9] * 20)
    assert planner.margin() == 1.0                   # never below 1
    planner._overruns.extend([1.2] * 16 + [4.9, 2.9] + [1.3, 1.1])
    assert planner.margin() == 1.3                   # the two steps of a link change are not spread
    planner._overruns.extend([0.4] * 15 + [1.8] * 5)
    assert planner.margin() == 1.8                   # a median below 1 does not make real overruns stalls


def test_margin_counts_exceedance_by_rank_not_by_a_percentile():
    ratios = [1.0 + i / 100 for i in range(40)]
    planner = AdaptivePlanner("kimad+")
    planner._overruns = collections.deque(ratios, maxlen=40)
    assert planner.margin() == ratios[-2]            # 2 / 41 <= 5%: the second largest of 40
    assert 2 / 41 <= OVERRUN_EXCEEDANCE < 3 / 41


def _saved(state) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def _two_parameter_bucket():
    """A large parameter and a small one 100x quieter, as a bucket with its segments and global scales."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(1 << 20, generator=g) * torch.linspace(0.1, 2, 1 << 20),
                   torch.randn(1 << 18, generator=g) * 0.01])
    segments = Segments.build([1 << 20, 1 << 18], [1, 2], "cpu")
    return x, segments, segments.absmax(x)


def test_errors_measured_on_a_sample_match_the_whole_bucket():
    x, segments, scales = _two_parameter_bucket()
    planner = AdaptivePlanner("kimad+", bits=(8, 4, 2), topk_ratios=(0.01,))
    planner.observe(0, x, Context(2, segments, segments.keys, segments.keys, scales=scales), GlobalQSGD(8))
    energy, *sampled = planner._local_errors[0]
    whole = [option_error(o, x, scales[segments.seg.long()]) for o in planner.options]
    assert energy == pytest.approx(float(x.square().sum()))
    assert sampled == pytest.approx(whole, rel=0.05)


def test_a_low_rank_step_measures_gqsgd_against_each_parameters_max_not_ps_column_scales():
    x, segments, scales = _two_parameter_bucket()
    planner = AdaptivePlanner("kimad+", bits=(8, 4), lowrank_rank=4)
    layout = type("Layout", (), {"shapes": [(1024, 1024), (512, 512)]})()
    column_scales = torch.full((8,), 100.0)  # what low rank's header holds: a scale per column of P
    tables = {LowRank(4).describe(): {"p_params": torch.arange(8) // 4}}  # the parameter of each column
    planner.observe(0, x, Context(2, segments, segments.keys, segments.keys, scales=column_scales, layout=layout,
                                  tables=tables), LowRank(4))
    planner.observe(1, x, Context(2, segments, segments.keys, segments.keys, scales=scales, layout=layout),
                    GlobalQSGD(8))
    assert planner._local_errors[0] == pytest.approx(planner._local_errors[1])  # this rank's max = the global one here


def test_gqsgd_error_is_measured_against_each_parameters_own_scale():
    """The codec rounds each parameter against its own global max |g|: the quiet parameter's error is
    10^4 x smaller than against the bucket's max, and the measured error is the codec's."""
    x, segments, scales = _two_parameter_bucket()
    quiet = slice(1 << 20, None)
    own = option_error(GlobalQSGD(4), x[quiet], scales[1])
    bucket_wide = option_error(GlobalQSGD(4), x[quiet], float(x.abs().max()))
    assert own < bucket_wide / 1e3
    per_element = option_error(GlobalQSGD(4), x, scales[segments.seg.long()])
    assert per_element == pytest.approx(option_error(GlobalQSGD(4), x[: 1 << 20], scales[0]) + own, rel=1e-4)


def test_option_errors_order_as_expected():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    errors = [option_error(o, x) for o in (NoCompression(), GlobalQSGD(8), GlobalQSGD(4), GlobalQSGD(2))]
    assert errors[0] == 0 and errors[1] < errors[2] < errors[3]
    assert option_error(TopK(0.1), x) < option_error(TopK(0.01), x) < x.square().sum()


def test_bad_planner_arguments():
    with pytest.raises(ValueError, match=r"is not one of \('kimad', 'kimad\+', 'auto'\)"):
        AdaptivePlanner("kimad++")
    with pytest.raises(ValueError, match="time_budget_s must be > 0"):
        AdaptivePlanner(time_budget_s=0)
    with pytest.raises(ValueError, match="max_error must be > 0"):
        AdaptivePlanner(max_error=0)
    with pytest.raises(ValueError, match="window_steps must be >= 1"):
        BandwidthMonitor(window_steps=0)


def test_low_rank_is_an_option_in_place_of_top_k():
    planner = AdaptivePlanner(bits=(8,), lowrank_rank=4)
    assert [o.describe() for o in planner.options] == ["none", "gqsgd(bits=8,encoding=packed)",
                                                        "lowrank(rank=4,factors=gqsgd,bits=8)"]
    assert isinstance(planner.memory_codec, LowRank)  # the buckets' error-feedback memory is low rank's
    assert any(isinstance(o, TopK) for o in AdaptivePlanner(bits=(8,)).options)  # without it, top-k as before
    with pytest.raises(ValueError, match=r"topk_ratios=\(0.01,\) with lowrank_rank=4: a bucket keeps one error-feedback memory"):
        AdaptivePlanner(lowrank_rank=4, topk_ratios=(0.01,))
    with pytest.raises(ValueError, match="rank must be an integer >= 1"):
        comm.KimadConfig(lowrank_rank=0)


def matrix_planner(budget_s, mode="kimad+", matrices=1):
    """Options none, gqsgd 8-bit, gqsgd 2-bit (beyond max_error) and rank-4 low rank, for buckets of one
    1000 x 1000 matrix each, at 1 MB/s, solved."""
    planner = AdaptivePlanner(mode, time_budget_s=budget_s, bits=(8, 2), lowrank_rank=4)
    planner.monitor.update(1e6, 0.0, 0.0)
    planner._profiles[2] = [codec_profile(o, 2, cost="free") for o in planner.options]
    for index in range(matrices):
        planner._numels[index], planner._shapes[index] = 1_000_000, [(1000, 1000)]
        planner.errors[index] = planner.relative[index] = [0.0, 0.001, 0.5, 1.0]
    planner._solve(2)
    return planner


def test_low_rank_is_planned_where_no_unbiased_code_fits_and_priced_from_the_buckets_shapes():
    """A 1000 x 1000 matrix at 1 MB/s: gqsgd 8-bit sends 1.14 MB (1.1 s), rank 4 with 8-bit factors about
    8 KB. A 0.5 s budget takes low rank, though it counts as erring by the whole gradient; 2 s keeps 8 bits."""
    plan = matrix_planner
    tight = plan(0.5)
    assert [codec.describe() for _, codec in tight.plan.values()] == ["lowrank(rank=4,factors=gqsgd,bits=8)"]
    assert tight.fits and tight._predicted < 0.05
    assert [codec.describe() for _, codec in plan(2.0).plan.values()] == ["gqsgd(bits=8,encoding=packed)"]


@pytest.mark.parametrize("mode", ["kimad", "kimad+"])
@pytest.mark.parametrize("faster", [1e10, float("inf")])
def test_a_replan_climbs_one_rung_at_a_time_from_a_small_plan(mode, faster):
    """Steps of low rank's 8 KB read a shaper's burst as a fast link; the estimate asks for fp32 (4 MB). The
    plan climbs one safe option a step (gqsgd 8-bit, past the unsafe 2-bit, then none), measuring each,
    instead of jumping 500x."""
    planner = matrix_planner(1.0, mode, matrices=2)
    def plan():
        return set(codec.describe() for _, codec in planner.plan.values())
    assert plan() == {"lowrank(rank=4,factors=gqsgd,bits=8)"}
    for _ in range(planner.monitor.agreed.maxlen):  # a rise counts once it outlasts the monitor's window
        planner.monitor.update(faster, 0.0, 0.0)
    planner._solve(2)
    assert plan() == {"gqsgd(bits=8,encoding=packed)"} and planner.climbing and planner.fits  # re-plans next step
    planner._solve(2)
    assert plan() == {"none"} and not planner.climbing
    planner.monitor.update(1e6, 0.0, 0.0)  # the link is slow after all: straight down, no climb
    assert planner._link_moved()
    planner._solve(2)
    assert plan() == {"lowrank(rank=4,factors=gqsgd,bits=8)"}


def planner_on_link(mode, budget_s, relative, numels=(100_000,), bandwidth=1e6, overruns=()):
    """The plan of a planner whose agreed inputs are set by hand (`solved_planner`)."""
    return [codec.describe() for _, codec in solved_planner(mode, budget_s, relative, numels, bandwidth, overruns).plan.values()]


def solved_planner(mode, budget_s, relative, numels=(100_000,), bandwidth=1e6, overruns=()):
    """A planner whose agreed inputs are set by hand: options none, gqsgd 8/4/2, top-k 0.01 (EF21)."""
    planner = AdaptivePlanner(mode, time_budget_s=budget_s, bits=(8, 4, 2), topk_ratios=(0.01,), max_error=0.05)
    planner.monitor.update(bandwidth, 0.0, 0.0)
    planner._overruns.extend(overruns)
    planner._profiles[2] = [codec_profile(o, 2, cost="free") for o in planner.options]
    for index, numel in enumerate(numels):
        planner._numels[index] = numel
        planner.relative[index] = list(relative)
        planner.errors[index] = list(relative)
    planner._solve(2)
    return planner


# relative error of the mean per option: none, gqsgd 8, 4, 2, top-k 0.01 (biased, the least error here)
RELATIVE = (0.0, 0.001, 0.03, 2.0, 0.0005)


def test_plan_prefers_unbiased_codes_that_fit_over_a_biased_one():
    assert planner_on_link("kimad+", 1.0, RELATIVE) == ["none"]
    assert planner_on_link("kimad+", 0.2, RELATIVE) == ["gqsgd(bits=8,encoding=packed)"]  # top-k errs less, but is biased


def test_plans_not_yet_measured_are_scaled_by_the_running_plans_own_overrun():
    """A trial's overrun (fp16 on a burst's rate, 35x) does not price the plans after it: the running plan's own
    ratios do, and until it has any, recent steps'. A new plan starts its own."""
    planner = comm.AutoConfig().build()
    assert planner.overrun() == 1.0
    planner._overruns.extend([35.0] * 8)
    assert planner.overrun() == 35.0
    planner._overruns.extend([2.4] * 3)
    planner._plan_overrun_steps = 3
    assert planner.overrun() == 2.4
    planner._numels[0], planner.errors[0], planner.relative[0] = 1000, [0.0] * 7, [0.0] * 7
    planner.monitor.update(1e6, 0.0)
    planner._profiles[2] = [codec_profile(o, 2, cost="free") for o in planner.options]
    planner._solve(2)  # a new plan
    assert planner._plan_overrun_steps == 0 and planner.overrun() == 35.0


def test_plan_leaves_room_for_the_steps_measured_spread():
    """gqsgd 8-bit (0.114 s on the model) fits 0.12 s; steps that overran their prediction by 1.5x at
    the 95th percentile make the plan aim at 0.08 s, where only 4 bits (0.067 s) fit."""
    assert planner_on_link("kimad+", 0.12, RELATIVE) == ["gqsgd(bits=8,encoding=packed)"]
    assert planner_on_link("kimad+", 0.12, RELATIVE, overruns=[1.0] * 18 + [1.5] * 2) == ["gqsgd(bits=4,encoding=packed)"]
    assert planner_on_link("kimad+", 0.12, RELATIVE, overruns=[1.0] * 19 + [9.0]) == ["gqsgd(bits=8,encoding=packed)"]  # one stall
    assert planner_on_link("kimad+", 0.12, RELATIVE, overruns=[0.8] * 20) == ["gqsgd(bits=8,encoding=packed)"]  # at most the budget


def test_plan_never_picks_an_unsafe_option_when_nothing_fits():
    """Only top-k and 2-bit fit a 10 ms budget, and both err beyond max_error: the fastest safe option instead."""
    unsafe_topk = (0.0, 0.001, 0.03, 2.0, 0.7)
    for mode in ("kimad", "kimad+"):
        assert planner_on_link(mode, 0.01, unsafe_topk, numels=(100_000, 50_000)) == ["gqsgd(bits=4,encoding=packed)"] * 2


def test_planner_says_when_no_safe_plan_fits():
    """The user learns the budget will be missed, why, and what to change; a plan that fits says nothing."""
    assert solved_planner("kimad+", 0.2, RELATIVE).fits
    unsafe_topk = (0.0, 0.001, 0.03, 2.0, 0.7)
    planner = solved_planner("kimad", 0.01, unsafe_topk)
    assert not planner.fits
    message = planner.unfit_message()
    assert "no plan within max_error=0.05 fits the 10 ms budget" in message and "8 Mbit/s" in message
    assert "or use kimad+" in message and "use kimad+" not in solved_planner("kimad+", 0.01, unsafe_topk).unfit_message()


def test_planner_says_when_the_steps_overhead_alone_exceeds_the_budget():
    """Per-call overhead beyond the budget: no codec helps, and the message says so (not max_error)."""
    planner = solved_planner("kimad+", 0.2, RELATIVE)
    planner.monitor.update(1e6, 0.0, 0.5)  # 0.5 s a step beyond the fit
    planner._solve(2)
    message = planner.unfit_message()
    assert not planner.fits and "500 ms a step beyond what their bytes cost" in message
    assert "no compression can fit it" in message and "max_error" not in message


def test_plan_takes_a_safe_biased_option_when_no_unbiased_one_fits():
    assert planner_on_link("kimad+", 0.01, RELATIVE) == ["topk(ratio=0.01)"]


def adaptive_run(rank, world_size, mode, force_mismatch=False, extra_sample=False):
    model = DDP(big_layers(), bucket_cap_mb=0.2)
    state = comm.register(model, mode, min_compress_numel=0, replan_every=2, budget_ms=2.0)
    plans = []
    for step in range(6):
        if force_mismatch and rank == 1 and step == 4:
            state.chooser.codec_for = lambda index, numel: GlobalQSGD(2)
        if extra_sample and rank == 1 and step == 3:  # one rank timed a collective the others did not
            state.chooser.monitor.observe("allreduce", 4096, 0.5, world_size)
        model.zero_grad()
        time.sleep(0.01 * rank)  # ranks reach the collectives at different times
        model(step, rank).backward()
        plans.append((state.last_step.get("plan"), state.last_step.get("bandwidth_Bps"), state.last_step.get("plan_error"),
                      state.last_step.get("link_comm_s")))
    return plans, grads(model)


@pytest.mark.parametrize("mode,world_size,extra_sample", [("kimad", 2, False), ("kimad+", 2, False),
                                                         ("kimad+", 3, False), ("kimad+", 2, True)])
def test_plan_identical_on_every_rank(mode, world_size, extra_sample):
    """Ranks fit agreed samples, so they plan alike and count the same link time: at 2 and 3 ranks, and when
    one rank saw a sample the others did not (every rank then skips that step's samples: no mismatched
    collective, no hang)."""
    results = run(adaptive_run, world_size, mode, False, extra_sample)
    assert all(status == "ok" for status, _ in results), results
    (plans0, grads0), *others = (value for _, value in results)
    assert all(plans == plans0 and torch.equal(grads, grads0) for plans, grads in others)
    assert plans0[-1][0] and plans0[-1][1] > 0 and plans0[-1][3] > 0  # a plan from a measured bandwidth; link time counted
    assert all(error <= MAX_ERROR for _, _, error, _ in plans0 if error is not None)  # within max_error, every step


def test_forced_mismatch_raises_on_every_rank():
    results = run(adaptive_run, 2, "kimad+", True)
    assert all(status == "error" and "different codecs" in message for status, message in results), results


def scripted_lowrank_run(rank, world_size, later):
    """kimad+ with low rank as an option, its plan scripted: step 0 none (DDP's rebuild), step 1 low rank
    (rank 2 of a 60 x 50 matrix, fp32 factors: its residual is all it leaves out), step 2 ``later``. Returns the three steps' averaged gradients (the
    model's output is its weight, transposed: the gradient is true_gradient)."""
    model = DDP(torch.nn.Linear(50, 60, bias=False), bucket_cap_mb=25)
    state = comm.register(model, "kimad+", min_compress_numel=0, lowrank_rank=2, bits=(8,), topk_ratios=())
    script = {0: NoCompression(), 1: LowRank(2, "fp32"), 2: later}
    out = []
    for step in range(3):
        state.chooser.codec_for = lambda index, numel, step=step: script[step]
        model.zero_grad()
        (model(torch.eye(50)) * true_gradient(step, rank).T).sum().backward()
        out.append(model.module.weight.grad.clone())
    state.close()
    return out


def true_gradient(step, rank):
    """Step 2's gradient is 10x smaller than low rank's residual: scaled without the residual, most of it would clip."""
    return torch.randn(60, 50, generator=torch.Generator().manual_seed(100 * step + rank)) * (0.1 if step == 2 else 1.0)


def true_mean(step, world_size):
    return sum(true_gradient(step, r) for r in range(world_size)) / world_size


@pytest.mark.parametrize("later", [NoCompression(), GlobalQSGD(8)], ids=["none", "gqsgd8"])
def test_a_step_after_low_rank_sends_what_low_rank_left_behind(later):
    """Low rank's residual rides along the next step of another option: over the two steps the ranks
    receive the true mean exactly (none), or within 8-bit rounding (gqsgd, whose header scales the
    gradient with the residual in it: scaled without it, the residual's values would clip)."""
    results = run(scripted_lowrank_run, 2, later)
    assert all(status == "ok" for status, _ in results), results
    (out0, out1) = (value for _, value in results)
    assert all(torch.equal(a, b) for a, b in zip(out0, out1))
    assert torch.allclose(out0[0], true_mean(0, 2))
    assert not torch.allclose(out0[1], true_mean(1, 2), atol=0.1)  # low rank sent less than the gradient
    sent, truth = out0[1] + out0[2], true_mean(1, 2) + true_mean(2, 2)
    relative = float((sent - truth).norm() / truth.norm())
    assert relative < (1e-6 if isinstance(later, NoCompression) else 0.02), relative


def one_bucket_auto(bandwidth, costs=None, relative=(0.0, 1e-6, 1e-7, 0.001, 0.005, 1.0, 1.0), compute_s=None,
                    warmed=True):
    """auto's options (none, bf16, fp16, gqsgd 8 and 4, low rank r4 with fp32 and 8-bit factors) for one bucket of a
    1000 x 1000 matrix at `bandwidth` B/s, each codec charged costs[its description, else its name] seconds
    per element, not yet solved; warmed: every option has run on the bucket (no compile ahead of any)."""
    planner = comm.AutoConfig().build()
    planner._warmed = {(0, option) for option in range(len(planner.options))} if warmed else set()
    planner.monitor.update(bandwidth, 0.0, 0.0)
    planner._compute.extend([] if compute_s is None else [compute_s])
    planner._profiles[2] = [dataclasses.replace(codec_profile(o, 2, cost="free"), encode_s_per_elem=(costs or {}).get(o.describe(), (costs or {}).get(o.name, 0.0)))
                            for o in planner.options]
    planner._numels[0], planner._shapes[0] = 1_000_000, [(1000, 1000)]
    planner.errors[0] = planner.relative[0] = list(relative)
    return planner


def auto_planner(*args, **kwargs):
    """one_bucket_auto's plan, solved: each bucket's codec description."""
    planner = one_bucket_auto(*args, **kwargs)
    planner._solve(2)
    return [codec.describe() for _, codec in planner.plan.values()]


def test_auto_takes_the_fastest_option_and_spends_no_time_on_accuracy_beyond_its_slack():
    """A slow link: low rank, whatever it errs (its error feedback keeps what it drops). A link where bytes
    are free and codecs are not: fp32, no codec work at all. At 1 Gbit/s with low rank's codec dear: gqsgd
    4-bit (about 0.66 MB) beats 8-bit (1.14 MB) by more than AUTO_SLACK; with 4-bit's encode dearer by a
    hair, 8-bit, which errs less, is taken within the slack."""
    assert auto_planner(1e6) == ["lowrank(rank=4,factors=gqsgd,bits=8)"]
    assert auto_planner(float("inf"), {"bf16": 1e-9, "gqsgd": 1e-9, "lowrank": 1e-9}) == ["none"]
    gigabit = {"bf16": 1e-9, "gqsgd": 1e-9, "lowrank": 1e-7}
    assert auto_planner(125e6, gigabit) == ["gqsgd(bits=4,encoding=packed)"]
    assert auto_planner(125e6, {**gigabit, "gqsgd(bits=4,encoding=packed)": 4.5e-9}) == ["gqsgd(bits=8,encoding=packed)"]
    with pytest.raises(ValueError, match="mode='auto' minimises the step's time and takes no time budget"):
        AdaptivePlanner("auto", time_budget_s=1.0)


def test_auto_sends_gqsgd_until_a_layout_has_its_plan_and_admits_one_error_feedback_memory():
    """No fp32 warm-up on a slow link: a bucket without a plan (the first steps, DDP's rebuild) goes as the
    widest gqsgd, unbiased, which keeps the first, largest gradients that low rank's random warm start would
    lose; both low rank options share the one memory (the same rank), so a bucket may switch factor codes."""
    planner = comm.AutoConfig(rank=8).build()
    assert planner.codec_for(0, 4096).describe() == "gqsgd(bits=8,encoding=packed)"
    assert comm.AutoConfig(bits=(3, 5)).build().codec_for(0, 4096).describe() == "gqsgd(bits=5,encoding=packed)"
    assert comm.KimadConfig().build().codec_for(0, 4096).describe() == "none"
    ranks = {o.rank for o in planner.options if isinstance(o, LowRank)}
    assert ranks == {8} and isinstance(planner.memory_codec, LowRank) and planner.memory_codec.rank == 8
    assert comm.comm_config("auto").warmup_steps == 0 and isinstance(comm.CommConfig().codec, comm.AutoConfig)
    assert comm.codec_config("auto", bits=8, rank=8, ratio=0.1) == comm.AutoConfig(rank=8)  # a fixed codec's int bits is not auto's widths
    with pytest.raises(ValueError, match="max_error must be a number"):
        comm.AutoConfig(max_error="0.1")


def test_codec_profiles_are_calibrated_once_per_machine_and_a_bad_cache_is_measured_again(tmp_path, monkeypatch):
    """A later process reads the calibration back (no compile stall); a cache that is not netgain's JSON, or
    holds other types, is ignored and rewritten, never executed."""
    from netgain.comm import calibrate

    calls = []
    real = calibrate.codec_profile
    monkeypatch.setattr(calibrate, "codec_profile", lambda *a, **k: calls.append(a[2] if len(a) > 2 else k.get("cost"))
                        or real(*a, **k))
    cache = tmp_path / "profiles.json"
    codec = comm.make_codec("fp16")
    first = calibrate.cached_profiles([(codec, None)], 2, calibration_numel=4096, cache=cache)[0]
    again = calibrate.cached_profiles([(codec, None)], 2, calibration_numel=4096, cache=cache)[0]
    assert calls.count("calibrate") == 1 and again.encode_s_per_elem == first.encode_s_per_elem > 0
    for junk in (b"\x80\x04pickle", b'{"format": "netgain.codec-profiles/1", "entries": {"k": ["x", 1]}}', b"[1]"):
        cache.write_bytes(junk)
        assert calibrate.cached_profiles([(codec, None)], 2, calibration_numel=4096, cache=cache)[0].encode_s_per_elem > 0
    assert calls.count("calibrate") == 4
    assert json.loads(cache.read_bytes())["format"] == "netgain.codec-profiles/1"


def test_auto_tries_the_plans_priced_near_the_best_and_keeps_the_fastest_measured():
    """The model's prices make a shortlist; measured steps judge it. At 50 Mbit/s and 0.12 s of other time, low
    rank with fp32 factors is priced cheapest, 8-bit factors and gqsgd 4-bit within TRIAL_RANGE, bf16 beyond it:
    each of the three runs TRIAL_STEPS and is priced by its median step x its steps; the cheapest measured stays,
    and bf16 never runs (every option has run on the bucket: none waits for a compile)."""
    planner = one_bucket_auto(6.25e6, compute_s=0.12)

    def run(step_s):
        """TRIAL_STEPS steps of the plan; then re-plan, as end_step does when the plan has its price."""
        assert [planner._price_plan(step_s) for _ in range(TRIAL_STEPS)][-1]
        planner._solve(2)
        return planner.plan[0][1].describe()

    planner._solve(2)
    assert planner.trying and planner.plan[0][1].describe() == "lowrank(rank=4,factors=fp32)"
    assert run(0.20) == "lowrank(rank=4,factors=gqsgd,bits=8)"   # 0.23 s to the target per fp32 step, measured
    assert run(0.14) == "gqsgd(bits=4,encoding=packed)"           # 0.175 measured: gqsgd's 0.2 predicted is within 1.5x
    assert run(0.19) == "lowrank(rank=4,factors=gqsgd,bits=8)" and not planner.trying
    bf16 = [o.describe() for o in planner.options].index("bf16")
    assert len(planner._periods) == 3 and all(key[0][2] != bf16 for key in planner._periods)


def test_auto_prices_low_rank_by_its_steps_to_the_target_not_its_step_alone():
    """Low rank takes more steps to the target (LOWRANK_STEPS). Where compute dominates the step, a faster
    step by low rank loses to gqsgd, which takes fp32's steps; where the link dominates, low rank wins."""
    gigabit = {"bf16": 1e-9, "gqsgd": 1e-9, "lowrank": 1e-9}  # gqsgd 4-bit ~6 ms, low rank ~1 ms a step
    assert auto_planner(125e6, gigabit, compute_s=None) == ["lowrank(rank=4,factors=gqsgd,bits=8)"]
    assert auto_planner(125e6, gigabit, compute_s=0.3) == ["gqsgd(bits=4,encoding=packed)"]
    assert auto_planner(1e6, gigabit, compute_s=0.3) == ["lowrank(rank=4,factors=fp32)"]  # 1.15x the steps, not 1.3x
    assert auto_planner(1e5, gigabit, compute_s=0.3) == ["lowrank(rank=4,factors=gqsgd,bits=8)"]


def test_auto_warms_a_plan_that_would_compile_before_it_tries_it():
    """gqsgd's kernels compile on their first calls, which run eagerly meanwhile: a cold gqsgd priced WARM_GAIN
    below the rest runs once on a copy of the bucket (`prepare`), the running plan serving; its trial starts once
    the compiles are done. Before the step's other time is measured, nothing is warmed; nor before the steps run so
    far, run again at what it saves a step, would repay the compiles' stall (WARM_STALL_S)."""
    from netgain.comm.adaptive import WARM_STALL_S
    from netgain.comm.codecs import Context
    from netgain.comm.fused import Segments, name_key

    gigabit = {"bf16": 2e-8, "gqsgd": 1e-9, "lowrank": 1e-7}  # bf16's cast dear: gqsgd 4-bit far cheapest
    planner = one_bucket_auto(125e6, gigabit, warmed=False)
    planner._steps_run = 10 ** 6
    planner._solve(2)
    assert not planner.warm and "gqsgd" not in planner.plan[0][1].describe()  # no compute measured yet
    planner._compute.append(0.05)
    planner._solve(2)
    assert planner.warm
    saving = planner._best_price - planner._cheapest[0]  # what the cold gqsgd would save a step
    for steps_run, warmed in ((1, False), (math.floor(WARM_STALL_S / saving), False), (math.ceil(WARM_STALL_S / saving), True)):
        planner._steps_run = steps_run
        planner._solve(2)
        assert bool(planner.warm) == planner._awaiting == warmed and "gqsgd" not in planner.plan[0][1].describe()
    four = [o.describe() for o in planner.options].index("gqsgd(bits=4,encoding=packed)")
    running = planner.plan[0][1].describe()
    assert (0, four) in planner.warm and planner._awaiting and "gqsgd" not in running
    x = torch.randn(1_000_000)
    segments = Segments.build([x.numel()], [name_key("w")], "cpu")
    before = x.clone()
    planner.prepare(0, x, Context.for_step(2, segments, 0, 1, 0))
    assert not planner.warm and torch.equal(x, before)  # the bucket itself untouched
    planner._awaiting = False  # end_step: the compiles are done on every rank
    planner._solve(2)
    assert planner.plan[0][1].describe() == "gqsgd(bits=4,encoding=packed)"


def test_auto_runs_a_settled_plan_of_headerless_codecs_as_a_fixed_codec():
    """A plan of none/bf16/fp32-factor low rank steps with no header (`plain`), also while it is tried (so that its
    trial prices it as it runs); not on a step that measures errors, nor with a codec that needs scales. A plan
    whose codecs relay nothing launches from the caller's thread; one with low rank, all of it from the
    pipeline's."""
    planner = comm.AutoConfig().build()
    names = [o.describe() for o in planner.options]
    planner._numels[0] = 1000
    planner.plan = {0: (1000, planner.options[names.index("bf16")])}
    planner._stale = False
    assert planner.plain(3) and not planner.plain(planner.replan_every - 1)  # errors measured at replan_every
    assert not planner.relays
    planner.trying = True
    assert planner.plain(3)
    planner.trying = False
    planner._numels[1] = 1000
    for name, plain in (("gqsgd(bits=8,encoding=packed)", False), ("lowrank(rank=4,factors=gqsgd,bits=8)", False),
                        ("lowrank(rank=4,factors=fp32)", True)):
        planner.plan = {0: (1000, planner.options[names.index(name)])}
        assert planner.plain(3) == plain
        # a mix: one bucket launched inline and one on the pipeline's thread would issue a step's collectives in a
        # different order on each rank (gloo aborted an HSDP run so, 2b56ca7): the whole step goes to the thread
        planner.plan = {0: (1000, planner.options[names.index("fp16")]), 1: (1000, planner.options[names.index(name)])}
        assert planner.plain(3) == plain and planner.relays == name.startswith("lowrank")
    assert not comm.AdaptivePlanner("kimad+").plain(3)


def test_fp16_is_admissible_only_far_below_its_range():
    """auto's fp16 counts as infinitely wrong where a bucket's max |g| exceeds FP16_PEAK (65504 / 1024)."""
    from netgain.comm.adaptive import FP16_PEAK, option_error
    from netgain.comm.codecs import Cast

    fp16, bf16 = Cast("fp16", torch.float16), Cast("bf16", torch.bfloat16)
    x = torch.randn(1000)
    assert 0 < option_error(fp16, x) < option_error(bf16, x)  # 3 more mantissa bits
    assert option_error(fp16, x * 2 * FP16_PEAK) == float("inf") and option_error(bf16, x * 2 * FP16_PEAK) < float("inf")
    assert option_error(fp16, x, torch.full((1000,), 2 * FP16_PEAK)) == float("inf")  # the header's max |g|, not the sample's


def test_a_trial_beside_a_compile_is_priced_by_its_clear_steps_and_ends_at_twice_its_length():
    """Steps that ran beside a compile (codecs eager, cores shared) price a plan only while it has no others;
    a trial that never clears of compiles still ends, after 2 x TRIAL_STEPS."""
    planner = comm.AutoConfig().build()
    planner.trying, planner._plan_key = True, ("plan",)
    results = [planner._price_plan(0.5, compiling=True) for _ in range(2 * TRIAL_STEPS)]
    assert results[-1] and not any(results[:-1]) and planner._periods[("plan",)] == 0.5
    planner._plan_steps, planner._beside_compiles = 0, []
    results = [planner._price_plan(0.5 if k % 2 else 0.1, compiling=bool(k % 2)) for k in range(2 * TRIAL_STEPS)]
    assert planner._periods[("plan",)] == 0.1  # the clear steps only


def test_a_price_from_steps_beside_compiles_only_is_dropped_once_the_compiles_end():
    """A trial that never cleared of a compile (its steps on shared cores) keeps that price only while kernels
    compile: then the plan is priced by the model again, and may be tried clear; a plan with clear steps keeps its."""
    planner = comm.AutoConfig().build()
    beside, clear, running = ((0, 100, 3),), ((0, 100, 4),), ((0, 100, 5),)
    for key, compiling in ((beside, True), (clear, False)):
        planner.trying, planner._plan_key, planner._plan_steps = True, key, 0
        planner._running.clear()
        planner._beside_compiles.clear()
        for _ in range(2 * TRIAL_STEPS):
            planner._price_plan(0.5, compiling=compiling)
    planner._plan_key = running
    assert set(planner._periods) == {beside, clear} and planner._provisional == {beside}
    assert not planner._reopen(compiling=True) and beside in planner._periods  # compiles still run: it stands
    assert planner._reopen(compiling=False) and set(planner._periods) == {clear} and not planner._provisional
    assert not planner._reopen(compiling=False)


@pytest.mark.parametrize("step_s, ends_after", [(TRIAL_RANGE * 0.1 * 1.2, TRIAL_SKIP + 1),
                                                 (TRIAL_RANGE * 0.1 * 0.8, TRIAL_STEPS)])
def test_a_trial_priced_beyond_the_range_of_the_best_candidate_ends_at_its_first_clear_step(step_s, ends_after):
    """A plan tried on a first guess (fp32 before the link was measured) that its first clear step prices beyond
    TRIAL_RANGE x the best candidate's price ends there; one within the range runs its TRIAL_STEPS. Priced on one
    step, the first is short: its next trial runs its TRIAL_STEPS whatever they cost, and then it is measured."""
    planner = comm.AutoConfig().build()
    planner.trying, planner._plan_key, planner._best_price = True, ((0, 100, 0),), 0.1  # option 0: none, fp32's steps
    assert _steps_until_priced(planner, step_s) == ends_after and planner._periods[planner._plan_key] == step_s
    assert planner._short == ({planner._plan_key} if ends_after < TRIAL_STEPS else set())
    planner._plan_steps = 0
    planner._running.clear()
    assert _steps_until_priced(planner, step_s) == TRIAL_STEPS and not planner._short


def _steps_until_priced(planner, step_s) -> int:
    """How many steps of step_s the trial running takes to be priced (at most 2 x TRIAL_STEPS)."""
    return next(k + 1 for k in range(2 * TRIAL_STEPS) if planner._price_plan(step_s))


def _auto_with_prices(compute_s, prices):
    """one_bucket_auto at 1 Gbit/s with these plans measured (description -> step seconds); every other option's
    codec 1 s a step (priced out)."""
    planner = one_bucket_auto(125e6, compute_s=compute_s)
    names = [o.describe() for o in planner.options]
    planner._profiles[2] = [dataclasses.replace(p, encode_s_per_elem=1e-6) for p in planner._profiles[2]]
    planner._periods = {((0, 1_000_000, names.index(name)),): seconds for name, seconds in prices.items()}
    return planner, names


def test_a_plan_priced_out_before_it_cleared_is_tried_again_before_one_taking_more_steps_beats_it():
    """fp16's first trial, priced out on one noisy step (0.13 s) by the model's guess from the first step's bound,
    is short; low rank then measured 0.1 s a step (x 1.15 steps: 0.115): fp16 runs its trial again rather than
    lose to low rank beyond the tie (on the lab at 1 Gbit/s fp16 was so priced on one step of 0.157 s, low rank
    won, and took 139 steps to the fp16 hook's 118). Measured at 0.117, fp16 then runs."""
    fp32_factors = "lowrank(rank=4,factors=fp32)"
    planner, names = _auto_with_prices(0.05, {"fp16": 0.13, fp32_factors: 0.1})
    fp16 = ((0, 1_000_000, names.index("fp16")),)
    planner._short, planner._plan_key = {fp16}, ((0, 1_000_000, names.index(fp32_factors)),)
    planner._solve(2)
    assert planner.plan[0][1].describe() == "fp16" and planner.trying
    for _ in range(TRIAL_STEPS):
        planner._price_plan(0.117)
    planner._solve(2)
    assert planner.plan[0][1].describe() == "fp16" and not planner.trying and not planner._short


def test_prices_stand_for_the_first_finite_rate_and_an_infinite_one_is_no_rate():
    """Prices measured while the link's estimate was infinite (no slope yet) stand for the first finite rate."""
    planner = comm.AutoConfig().build()
    planner._plan_key = ((0, 100, 0),)
    planner.monitor.agreed.append(float("inf"))
    for _ in range(TRIAL_SKIP + 1):
        planner._price_plan(0.5)
    assert planner._priced_rate is None and planner._periods
    planner.monitor.agreed.clear()
    planner.monitor.agreed.append(6e6)
    planner._price_plan(0.5)
    assert planner._priced_rate == 6e6


@pytest.mark.parametrize("rate, step_s, dropped", [(14e6, 0.5, False),   # a rise the steps do not show: a burst
                                                   (14e6, 0.3, True),    # the running plan's steps sped up with it
                                                   (1e6, 0.5, False),    # a fall the steps do not show
                                                   (1e6, 0.8, True)])    # they slowed down with it
def test_measured_prices_stand_until_the_running_plans_steps_witness_the_rates_move(rate, step_s, dropped):
    """A fitted rate beyond REPRICE of the one the prices stand for drops them only where the running plan's next
    TRIAL_STEPS - TRIAL_SKIP steps move the same way by over WITNESS; the decision is kept in a checkpoint."""
    planner = comm.AutoConfig().build()
    running, other = ((0, 100, 3),), ((0, 100, 4),)
    planner._plan_key, planner._plan_steps, planner._priced_rate = running, 10, 4e6
    planner._running.extend([0.5] * 8)
    planner._periods = {running: 0.5, other: 0.6}
    planner.monitor.agreed.append(rate)
    planner._watch_rate()
    for _ in range(TRIAL_STEPS - TRIAL_SKIP - 1):
        planner._price_plan(step_s)
    resumed = comm.AutoConfig().build()
    resumed.load_state_dict(torch.load(io.BytesIO(_saved(planner.state_dict())), weights_only=True))
    for p in (planner, resumed):
        p._plan_key, p._plan_steps = running, 10
        p._running.extend(planner._running)
        p._price_plan(step_s)
        assert p._witness is None
        assert (other not in p._periods) == dropped
        assert p._periods[running] == (step_s if dropped else statistics.median([0.5] * 8 + [step_s] * 6))
        assert p._priced_rate == (rate if dropped else 4e6)


def test_a_price_from_steps_beside_compiles_is_no_witness_base():
    """A running plan priced beside compiles only (provisional) starts no witness: its clear steps would read as a
    move of the link."""
    planner = comm.AutoConfig().build()
    planner._plan_key, planner._priced_rate = ((0, 100, 3),), 4e6
    planner._periods, planner._provisional = {planner._plan_key: 0.8}, {planner._plan_key}
    planner.monitor.agreed.append(14e6)
    planner._watch_rate()
    assert planner._witness is None
    planner._provisional.clear()
    planner._watch_rate()
    assert planner._witness == [0.8, [], True]


def test_a_new_plan_witnesses_no_move_of_the_rate():
    """The plan changing while the rate's move is watched ends the watch: the measured prices stand."""
    planner = matrix_planner(None, mode="auto")
    running = planner._plan_key
    another = ((0, 1_000_000, next(o for o in range(4) if o != running[0][2])),)
    planner._plan_key, planner._periods = another, {another: 9.0}  # measured far dearer: not chosen again
    planner._witness = [9.0, [5.0], True]
    planner._solve(2)
    assert planner._plan_key == running and planner._witness is None and planner._periods == {another: 9.0}


class OneRankLink:
    """A link of one rank: every collective returns its input."""
    rank, world_size, observer = 0, 1, None

    def allreduce(self, tensor, op=None):
        return tensor


def test_collectives_beside_a_compile_are_no_samples_of_the_link(monkeypatch):
    """A step that ran beside a kernel compile (its cores and GIL shared) measures no link: the rate comes from
    the steps clear of compiles."""
    from netgain.comm import kernel
    planner, link = comm.AutoConfig().build(), OneRankLink()
    planner.monitor.clock = Clock()
    for step, compiling in enumerate([False, True, False]):
        monkeypatch.setattr(kernel, "compiling", lambda compiling=compiling: compiling)
        planner.monitor.observe("allreduce", 16, 0.5 if compiling else 0.0005, 2)
        planner.monitor.observe("allreduce", 1_000_000, 5.0 if compiling else 0.0805, 2)
        planner.end_step(link, step, 0.1, 0.0)
        # step 0 bounds the rate from below (skip_steps, auto's floor); step 1's slow reading beside a compile is no sample
        assert planner.monitor.bandwidth == pytest.approx(12.5e6, rel=0.01 if step == 2 else 0.02)


def test_steps_a_hook_left_unobserved_price_no_compute_and_no_link():
    """netgain.comm.fsdp overlaps auto's settled steps and leaves their collectives unobserved: at the agreement
    the steps' other time comes from the observed step alone, and the link time per step is that step's, not
    spread over the unobserved ones."""
    planner, link = comm.AutoConfig().build(), OneRankLink()
    planner.monitor.clock = Clock()
    planner._numels, planner.plan, planner._stale = {0: 1000}, {0: (1000, planner.options[0])}, False
    for step in range(adaptive.AGREE_EVERY):
        assert planner.settled(step) == (step < adaptive.AGREE_EVERY - 1)
        if not planner.settled(step):
            planner.monitor.observe("allreduce", 16, 0.0005, 2)
            planner.monitor.observe("allreduce", 1_000_000, 0.0805, 2)
        planner.end_step(link, step, 0.01, 0.0)
    assert len(planner._compute) == 1 and planner.last["link_comm_s"] == pytest.approx(0.081)


def test_auto_samples_the_link_only_where_it_needs_to():
    """A hook that overlaps unobserved steps (FSDP2) holds those auto observes: a new layout's, an error measurement,
    a settled plan's agreement; a trial and a plan awaiting compiles overlap as a settled plan does. kimad+ observes
    every step."""
    planner = comm.AutoConfig().build()
    assert planner.observes(3)  # no plan yet
    planner._numels, planner.plan, planner._stale = {0: 1000}, {0: (1000, planner.options[0])}, False
    assert planner.observes(3)  # no rate fitted yet
    planner.monitor.agreed.append(1e8)
    every = adaptive.AGREE_EVERY
    assert [planner.observes(step) for step in range(every)] == [step == every - 1 for step in range(every)]
    for flag in ("trying", "_awaiting"):
        setattr(planner, flag, True)
        assert not any(planner.observes(step) for step in range(2 * every))  # its agreements' steps too
        assert planner.observes(planner.replan_every - 1)  # its error measurement
        setattr(planner, flag, False)
    planner.climbing = True
    assert planner.observes(3)
    kimad = comm.AdaptivePlanner("kimad+")
    kimad._numels, kimad.plan, kimad._stale = planner._numels, planner.plan, False
    kimad.monitor.agreed.append(1e8)
    assert kimad.observes(3)


@pytest.mark.parametrize("rate, whole_steps", [(12.5e6, 2), (0.5e6, 1)])
def test_auto_sends_a_second_whole_step_where_it_is_cheap(rate, whole_steps):
    """The first step sends the whole gradient in gqsgd 8-bit, and the second too where that step's link and codec
    time is under WARMUP_WORTH backward passes: the warm-up low rank needs (auto that ran low rank from step 1 took as
    many steps to the target as low rank without warm-up), which on a slow link costs more than it saves. The first
    plan comes after the last whole step."""
    planner, link = one_bucket_auto(rate, compute_s=0.1), OneRankLink()
    planner.monitor.clock = Clock()
    relative = list(planner.relative[0])
    backward_s = 0.05  # a 1 MB step: 0.08 s at 12.5 MB/s, 2 s at 0.5 MB/s, against 10 x 0.05
    for step in range(whole_steps + 1):
        codec = planner.codec_for(0, 1_000_000)
        assert (codec is planner.unplanned) == (step < whole_steps), step
        planner._local_errors = {0: [1.0] + relative}  # the step's measured energy and errors
        for nbytes in (16, 1_000_000):
            planner.monitor.observe("allreduce", nbytes, 0.0005 + nbytes / rate, 2)
        planner.end_step(link, step, backward_s, 0.0)
        assert bool(planner.plan) == (step + 1 >= whole_steps), step
    assert WARMUP_WORTH * backward_s == 0.5


def test_the_codec_of_the_unplanned_steps_stays_cold():
    """auto's first step sends gqsgd 8-bit on every bucket, as an instance of its own whose kernels begin no
    compile (bucket.send, kernel.cold): under HSDP it runs once per group, hot by its third call, and the compile it began
    took the cores of the first 23 steps on the lab at 50 Mbit/s (a probe at a load of 1.8), which measured no link
    beside it and went unplanned. A trial of gqsgd 8-bit is warmed first like any other cold option."""
    planner = comm.AutoConfig().build()
    unplanned = planner.codec_for(3, 1000)
    option = [o.describe() for o in planner.options].index(unplanned.describe())
    assert unplanned is planner.unplanned and isinstance(unplanned, GlobalQSGD) and unplanned is not planner.options[option]
    assert planner._cold(3, option)


def test_a_warm_up_whose_compiles_get_no_cores_is_forgone(monkeypatch):
    """A compile at nice 19 on a busy host may take minutes: after AWAIT_S of steps, auto stops waiting for it and
    plans without the options it was warming."""
    from netgain.comm import kernel
    monkeypatch.setattr(kernel, "compiling", lambda: True)
    planner, link = comm.AutoConfig().build(), OneRankLink()
    gqsgd = next(o for o, option in enumerate(planner.options) if isinstance(option, GlobalQSGD))
    planner._numels, planner.plan = {0: 1000}, {0: (1000, planner.options[0])}
    planner._awaiting, planner._warming, planner._stale = True, {(0, gqsgd)}, False
    for step in range(3):
        planner.end_step(link, step, 0.01, 0.0)
        time.sleep(0.01)
    assert planner._awaiting and not planner._forgone
    monkeypatch.setattr(adaptive, "AWAIT_S", 0.0)
    planner.end_step(link, 3, 0.01, 0.0)
    assert not planner._awaiting and planner._forgone == {(0, gqsgd)}


AUTO_SCRIPT = ["bf16", "lowrank(rank=4,factors=fp32)", "lowrank(rank=4,factors=gqsgd,bits=8)",
               "gqsgd(bits=4,encoding=packed)", "fp16", "lowrank(rank=4,factors=fp32)", "bf16",
               "lowrank(rank=4,factors=gqsgd,bits=8)", "gqsgd(bits=8,encoding=packed)", "none"]
AUTO_PLAIN = {4, 5, 6, 9}  # settled steps of plain codecs: no header; low rank's (5) on the pipeline's thread


def scripted_auto_run(rank, world_size):
    """auto through every kind of switch its plans make: low rank and back, gqsgd warmed ahead (step 2) then
    run, plain steps. Returns each step's averaged gradient."""
    model = DDP(torch.nn.Linear(50, 60, bias=False), bucket_cap_mb=25)
    state = comm.register(model, "auto", min_compress_numel=0)
    planner = state.chooser
    options = {option.describe(): option for option in planner.options}
    planner.wants_errors = lambda step: False
    out = []
    for step, name in enumerate(AUTO_SCRIPT):
        planner.codec_for = lambda index, numel, name=name: options[name]
        planner.plain = lambda step, plain=step in AUTO_PLAIN: plain
        planner.plan = {0: (3000, options[name])}  # what `relays` reads
        if step == 2:
            planner.warm = {(0, planner.options.index(options["gqsgd(bits=4,encoding=packed)"]))}
        model.zero_grad()
        (model(torch.eye(50)) * true_gradient(step, rank).T).sum().backward()
        out.append(model.module.weight.grad.clone())
    state.close()
    return out, [record["wire_bytes"] for record in state.history]


def test_auto_sends_every_gradient_through_its_switches_of_plan():
    """Whatever auto switches between, nothing is lost or sent twice: each step of an exact, rounded or unbiased
    code adds to the error of all the ranks received so far (against the sum of the true means) at most that
    code's rounding of what it carried, the true means since the last such step (low rank's residual rides
    along on the step after it); every rank receives the same."""
    results = run(scripted_auto_run, 2)
    assert all(status == "ok" for status, _ in results), results
    (out0, wire), (out1, _) = (value for _, value in results)
    assert all(torch.equal(a, b) for a, b in zip(out0, out1))
    assert wire[5] < wire[1]  # the same low rank, its plain step without the header
    sent, truth, since, error = torch.zeros(60, 50), torch.zeros(60, 50), torch.zeros(60, 50), 0.0
    rounding = {"none": 1e-6, "bf16": 1e-2, "fp16": 1e-3, "gqsgd(bits=8,encoding=packed)": 0.05,
                "gqsgd(bits=4,encoding=packed)": 0.5}  # of the norm of what a step carries
    for step, name in enumerate(AUTO_SCRIPT):
        sent += out0[step]
        truth += true_mean(step, 2)
        since += true_mean(step, 2)
        if name in rounding:
            now = float((sent - truth).norm())
            assert now <= error + rounding[name] * float(since.norm()), (step, name, now, error)
            error, since = now, torch.zeros(60, 50)


def test_measured_prices_within_the_tie_go_to_the_plan_taking_fewer_steps():
    """Low rank measured 0.13 s a step (x 1.15 steps: 0.1495) against fp16's 0.150 s: a tie within TIE, which fp16
    wins, its steps certain; at 0.12 s low rank is cheaper beyond the tie and wins."""
    planner = one_bucket_auto(125e6, relative=(0.0, 1e-6, 1e-7, 0.02, 0.05, 1.0, 1.0), compute_s=0.1)  # gqsgd unsafe
    names = [o.describe() for o in planner.options]
    for lowrank_s, expected in ((0.13, "fp16"), (0.12, "lowrank(rank=4,factors=fp32)")):
        planner._periods = {((0, 1_000_000, k),): 1.0 for k in range(len(names))}  # every plan measured, dear
        planner._periods[((0, 1_000_000, names.index("fp16")),)] = 0.150
        planner._periods[((0, 1_000_000, names.index("lowrank(rank=4,factors=fp32)")),)] = lowrank_s
        planner._solve(2)
        assert planner.plan[0][1].describe() == expected and not planner.trying


def test_a_new_plan_runs_a_trial_only_where_the_model_prices_it_beyond_a_tie_with_a_measured_one():
    """At a fast link every plan's price lies near the others': with fp16 measured and running, a gqsgd 4-bit plan
    the model prices 2% below it runs no trial (on the lab at 1 Gbit/s such trials made 8-10 switches in 120
    steps); priced 20% below, it is tried. A measured plan stays a candidate after a re-plan made another, and a
    tie between measured plans of equal steps keeps the plan running."""
    for ratio, tried in ((0.98, False), (0.80, True)):
        planner = one_bucket_auto(125e6, compute_s=0.1)
        names = [o.describe() for o in planner.options]
        fp16, four = names.index("fp16"), names.index("gqsgd(bits=4,encoding=packed)")
        fp16_step = 0.1 + planner._option_cost(fp16, 0, 2)[0]
        wire = planner._option_cost(four, 0, 2)[0]  # its codec free: the wire alone
        # every other option dear (1 s a step of codec work); gqsgd 4-bit's codec priced to make its step ratio x fp16's
        planner._profiles[2] = [p if k == fp16 else dataclasses.replace(
            p, encode_s_per_elem=(ratio * fp16_step - 0.1 - wire) / 1e6 if k == four else 1e-6) for k, p in enumerate(planner._profiles[2])]
        planner._plan_key = ((0, 1_000_000, fp16),)
        planner._periods = {planner._plan_key: fp16_step}
        planner._solve(2)
        assert (planner.plan[0][1].describe(), planner.trying) == (names[four] if tried else "fp16", tried)
    planner._periods[((0, 1_000_000, four),)] = 0.99 * fp16_step  # measured: a tie with fp16, which runs
    planner._plan_key, planner.trying = ((0, 1_000_000, fp16),), False
    planner._solve(2)
    assert planner.plan[0][1].describe() == "fp16" and not planner.trying


def test_best_price_needs_the_link_measured_at_the_routes_volume_or_at_the_largest_bucket_in_16_bits():
    """auto's cheapest price for the route's early trial (netgain.sync.LocalRoute): none before a plan priced with the
    step's other time and the link measured; then only where the link was measured at the asked allreduce's wire
    bytes, or at the largest bucket's in 16 bits (no plan that measures the link sends more)."""
    planner = AdaptivePlanner("auto")
    assert planner.best_price(1e6, 2) is None
    planner._numels = {0: 2e6, 1: 1e3}  # 2 workers: an allreduce's wire bytes = its payload; 16 bits' largest 4e6
    planner._cheapest = [0.5, 2e6]  # the price, the link's volume (wire bytes) when it was priced
    assert planner.best_price(1e6, 2) == 0.5 and planner.best_price(2e6, 2) == 0.5 and planner.best_price(4e6, 2) is None
    planner._cheapest = [0.5, 4e6]
    assert planner.best_price(1e9, 2) == 0.5
    assert AdaptivePlanner("kimad+").best_price(0.0, 2) is None


def test_plan_ahead_prices_autos_plan_on_a_link_given_not_measured():
    """`netgain model`'s forecast of auto (plan_ahead): the planner's own solve on a modelled link, which counts as
    measured at any volume."""
    from netgain.cost import network

    link = network.Link("test-100mbit", bandwidth=100e6 / 8, latency=1e-4)
    ahead = AdaptivePlanner("auto").plan_ahead([1 << 20, 1 << 16], None, 4, link, compute_s=0.1, cost="free")
    assert len(ahead["plan"]) == 2 and ahead["step_s"] > 0.1 and ahead["steps"] >= 1.0


def test_a_trial_runs_until_it_is_priced_whatever_the_rate_reads_meanwhile():
    """A re-plan during a trial chose afresh and could cut it short unpriced: on the lab at 1 Gbit/s the rate read
    off low rank's own small messages fell 2-6x, and its trial was cut after 2 steps, twice. Here the link reads 10x
    slower from the trial's first step on (8-bit factors then priced cheapest): the plan stands until its TRIAL_STEPS are priced."""
    planner, link = one_bucket_auto(6.25e6, compute_s=0.12), OneRankLink()
    planner.monitor.clock = Clock()
    planner._solve(2)
    tried = planner._plan_key
    assert planner.trying and planner.plan[0][1].describe() == "lowrank(rank=4,factors=fp32)"
    keys = []
    for step in range(TRIAL_STEPS + 1):
        for nbytes in (16, 1_000_000, 2_000_000):
            planner.monitor.observe("allreduce", nbytes, 0.0005 + nbytes / 0.625e6, 2)
        planner.end_step(link, step, 0.01, 0.0)
        keys.append(planner._plan_key)
    assert planner.monitor.bandwidth < 6.25e6 / 3  # the move a re-plan follows
    assert keys[:-1] == [tried] * TRIAL_STEPS and tried in planner._periods and not planner.trying


@pytest.mark.parametrize("guess", [True, False])
def test_a_trial_chosen_on_the_first_steps_bound_may_be_cut_and_a_cut_trial_is_short(guess):
    """A first plan is chosen on the first step's bound on the link (`_guess`): the re-plan that has the link
    measured may cut its trial (under HSDP at 50 Mbit/s, held to its end, fp16's ran 8 steps at 0.66 s against low
    rank's 0.4), and the plan, priced on too few steps, is short: not yet measured, it may run its trial again.
    A trial chosen on a measured link runs to its end."""
    planner, link = one_bucket_auto(6.25e6, compute_s=0.12), OneRankLink()
    planner.monitor.clock = Clock()
    planner._solve(2)
    first, planner._guess = planner._plan_key, guess
    replanned = []
    for step in range(TRIAL_STEPS - 1):
        rate = 6.25e6 if step < 4 else 0.625e6  # the link reads 10x slower from step 4
        for nbytes in (16, 1_000_000, 2_000_000):
            planner.monitor.observe("allreduce", nbytes, 0.0005 + nbytes / rate, 2)
        planner.end_step(link, step, 0.01, 0.0)
        replanned.append(planner.last["replanned"])
    assert any(replanned) == guess, replanned  # not priced yet: only the move re-plans
    planner._plan_key, planner.trying = first, True
    planner._running.clear()
    planner._running.extend([0.5])
    planner._periods[first] = 0.5
    fp16 = [o.describe() for o in planner.options].index("fp16")
    planner._periods[((0, 1_000_000, fp16),)] = 0.01  # a re-plan now finds a measured plan far cheaper
    planner._solve(2)
    assert planner._plan_key != first and first in planner._short  # cut after one clear step: short
