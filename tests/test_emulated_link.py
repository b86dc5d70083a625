"""`netgain train --emulate-link` and `--compare`: the held collectives, the refusals, the labels; and the
silence notice under a compile."""

import time

import pytest
import torch
import torch.distributed as dist

from distributed import run
from netgain import cli
from netgain.comm import baselines
from netgain.comm.collectives import Communicator
from netgain.comm.emulate import EmulatedLink
from netgain.train.cli import build_config
from netgain.train.compare import comparison, time_to_loss
from netgain.train.loop import SilenceNotice
from netgain.train.report import format_table, summarize

RATE = "8mbit"  # 1 MB/s: 400 kB take 0.4 s


def config(*argv: str):
    return build_config(cli.build_parser("train").parse_args(["train", "--task", "digits", *argv]))


def _held_collectives(rank, world_size):
    """Seconds each collective took, from launch to its held result: netgain's Communicator (an allreduce of
    400 kB, an allgather of 100 kB per rank, two allreduces of 200 kB in flight at once) and ddp's hook."""
    communicator = Communicator(link=EmulatedLink(RATE))
    seconds = {}
    start = time.perf_counter()
    total = communicator.start("allreduce", torch.ones(100_000), {}).wait()
    seconds["allreduce"] = time.perf_counter() - start
    start = time.perf_counter()
    gathered = communicator.start("allgather", torch.full((25_000,), float(rank)), {}).wait()
    seconds["allgather"] = time.perf_counter() - start
    start = time.perf_counter()
    futures = [communicator.start("allreduce", torch.ones(50_000), {}) for _ in range(2)]
    torch.futures.wait_all(futures)
    seconds["two in flight"] = time.perf_counter() - start
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1000, 100))  # 100,100 fp32 gradients
    state = baselines.register(model, "ddp")
    state.link = EmulatedLink(RATE)
    start = time.perf_counter()
    model(torch.ones(4, 1000)).sum().backward()
    seconds["ddp step"] = time.perf_counter() - start
    dist.barrier()
    return seconds, total[0].item(), gathered[:, 0].tolist()


def test_a_collective_is_held_until_its_bytes_crossed_the_emulated_link():
    """At 2 ranks a ring allreduce sends its payload once per rank, an allgather each rank's once; two
    collectives on one link take their bytes' time together. Lower bounds only: a busy machine is slower."""
    for status, value in run(_held_collectives, 2):
        assert status == "ok", value
        seconds, total, gathered = value
        assert (total, gathered) == (2.0, [0.0, 1.0])  # the values pass through the hold unchanged
        assert seconds["allreduce"] >= 0.4
        assert seconds["allgather"] >= 0.1
        assert seconds["two in flight"] >= 0.4
        assert seconds["ddp step"] >= 0.4


@pytest.mark.parametrize("argv, message", [
    (["--emulate-link", "fast"], "--emulate-link fast: cannot parse 'fast'; use e.g. '25gbit', '100Mb/s'"),
    (["--emulate-link", "0mbit"], "--emulate-link 0mbit: must be a finite rate > 0"),
    (["--emulate-link", ""], "--emulate-link must not be empty"),
    (["--emulate-link", "100mbit", "--world-size", "1"], "--emulate-link 100mbit needs at least 2 workers"),
    (["--compare", "--fsdp", "--replicas", "2", "--shards", "1"], "--compare runs DDP baselines"),
])
def test_a_bad_emulated_link_or_compare_is_refused_by_name(argv, message):
    with pytest.raises(ValueError) as error:
        config(*argv)
    assert message in str(error.value)


def test_the_report_labels_every_time_and_link_as_emulated():
    """fp32's prediction is on the emulated rate (with the overhead fitted to the run), and says so."""
    buckets = [{"numel": 10_000, "codec": "gqsgd(bits=8,encoding=packed)", "wire_bytes": wire,
                "comm_s": 1e-3 + wire / 12.5e6} for wire in (1000, 100_000)]
    history = {"step": [0, 1, 2], "step_s": [1.0, 0.1, 0.1], "compiled": [False] * 3, "wait_s": [0.05] * 3,
               "wire_bytes": [101_000] * 3, "raw_bytes": [80_000] * 3, "buckets": [buckets] * 3, "train_loss": [2.0] * 3}
    result = summarize(config("--steps", "3", "--emulate-link", "100mbit"), 2, history, [{"step": 3, "val_loss": 1.0}],
                       torch.nn.Linear(2, 2))
    assert (result["emulated_link"], result["link_bandwidth_Bps"]) == ("100mbit", 12.5e6)
    assert result["link_overhead_s"] == pytest.approx(1e-3)
    step = result["versus_fp32"][1]
    assert step.startswith("step 0.1 s measured on emulated 100mbit; fp32 ") and " s predicted on emulated 100mbit (" in step
    table = format_table(result)
    for row in ("step_s", "comm_wait_s", "predicted_fp32_step_s", "link_bandwidth_Bps"):
        assert next(line for line in table.splitlines() if line.startswith(row)).endswith("(emulated 100mbit)")


def test_compare_times_each_run_to_a_loss_every_run_reaches():
    fast = {"config": {"codec": "gqsgd", "out": "a", "emulate_link": "100mbit"},
            "summary": {"step_s": 1.0, "final_train_loss": 1.0, "final_val_loss": 1.1},
            "per_step": {"step_s": [1.0] * 12, "train_loss": [3.0, 3.0] + [1.0] * 10}}
    slow = {"config": {"codec": "ddp", "out": "b", "emulate_link": "100mbit"},
            "summary": {"step_s": 2.0, "final_train_loss": 2.0, "final_val_loss": 2.1},
            "per_step": {"step_s": [2.0] * 12, "train_loss": [3.0, 3.0] + [2.0] * 10}}
    assert time_to_loss(fast["per_step"], 2.0) == 10.0  # the first full window: steps 0..9, mean 1.4
    result = comparison([fast, slow])
    assert (result["link"], result["target_train_loss"]) == ("emulated 100mbit", 2.0)
    assert [(r["step_ratio"], r["time_ratio"]) for r in result["runs"]] == [(1.0, 1.0), (0.5, 10.0 / 24.0)]


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_silence_under_a_compile_names_the_compile_not_a_peer():
    clock, compiling = _Clock(), [True]
    notice = SilenceNotice(rank=0, timeout_s=600, compiling=lambda: compiling[0], clock=clock)
    notice.close()  # its thread would check on the real clock: the test calls check() itself
    notice.beat("in step 1")
    assert notice.check() is None  # first seen compiling at 0 s
    clock.now = 37.0
    line = notice.check()
    assert "rank 0 has made no progress for 37 s while in step 1: this rank is compiling codec kernels (for at " \
           "least 37 s;" in line and "stuck" not in line
    compiling[0] = False
    clock.now = 61.0
    assert "a peer may be stuck or gone" in notice.check()
