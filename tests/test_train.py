"""`netgain train` end to end: spawned gloo workers, records, checkpoint/resume exactness."""

import json
import subprocess
import sys

import pytest
import torch

from netgain import cli
from netgain.train.cli import build_config
from netgain.train.report import fit_link, summarize, versus_fp32


def run_train(*argv: str) -> int:
    """The `netgain train ...` command line, in-process (the workers are spawned as usual)."""
    return cli.main(["train", *argv])


def summary(out) -> dict:
    return json.loads((out / "record.json").read_text())["summary"]


def test_digits_converges(tmp_path):
    assert run_train("--task", "digits", "--steps", "150", "--eval-every", "0", "--out", str(tmp_path)) == 0
    result = summary(tmp_path)
    assert result["world_size"] == 2
    assert result["final_val_accuracy"] > 0.93


def test_lm_writes_record_and_loss_curve(tmp_path):
    """gqsgd 8-bit packed: the summary states its bytes and fp32's predicted step.
    Run as a user runs it, a command of its own, so its stdout is the one its workers print to (the
    workers of an in-process run print wherever stdout was when its forkserver started)."""
    text = tmp_path / "corpus.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 200)
    out = tmp_path / "run"
    command = subprocess.run([sys.executable, "-m", "netgain.cli", "train", "--data", str(text), "--hidden-size", "64",
                              "--layers", "1", "--seq-len", "32", "--batch-size", "4", "--steps", "3",
                              "--codec", "gqsgd", "--eval-every", "2", "--out", str(out)], capture_output=True, text=True)
    assert command.returncode == 0, command.stderr
    record = json.loads((out / "record.json").read_text())
    assert record["config"]["task"] == "lm"
    assert (record["config"]["codec"], record["config"]["bits"], record["config"]["encoding"]) == ("gqsgd", 8, "packed")
    assert len(record["per_step"]["step_s"]) == len(record["per_step"]["wire_bytes"]) == 3
    assert len(record["per_step"]["compiled"]) == 3 and all(isinstance(c, bool) for c in record["per_step"]["compiled"])
    assert [v["step"] for v in record["validation"]] == [0, 2, 3]
    result = record["summary"]
    assert 0 < result["wire_bytes_per_step"] < result["fp32_bytes_per_step"]
    assert result["compression_ratio"] == pytest.approx(32 / (64 / 7), rel=0.01)  # 9.1 bits per element at n=2
    assert result["predicted_fp32_step_s"] > 0 and result["link_bandwidth_Bps"] > 0
    wire, step = result["versus_fp32"]
    assert wire.startswith("wire ") and wire.endswith(" MB fp32: 3.5x fewer")
    assert "s predicted on this link" in step
    assert f"{wire}\n{step}\n" in command.stdout  # rank 0, a worker process, prints it
    assert (out / "loss.png").read_bytes().startswith(b"\x89PNG")


def test_summary_leaves_out_steps_that_compiled_a_kernel():
    """A codec's first compressed step compiles its kernels (seconds, once): the summary's step time is the
    steady one, the compile left out, as fp32's predicted step beside it is."""
    buckets = [{"numel": 1000, "codec": "gqsgd(bits=8,encoding=packed)", "wire_bytes": 1000, "comm_s": 1e-3}]
    history = {"step": [0, 1, 2, 3], "step_s": [1.0, 30.0, 0.1, 0.1], "compiled": [False, True, False, False],
               "wait_s": [0.0, 25.0, 0.02, 0.02], "wire_bytes": [4000, 1000, 1000, 1000],
               "raw_bytes": [4000] * 4, "buckets": [buckets] * 4, "train_loss": [2.0] * 4}
    config = build_config(cli.build_parser("train").parse_args(["train", "--task", "digits", "--steps", "4"]))
    result = summarize(config, 2, history, [{"step": 4, "val_loss": 1.0}], torch.nn.Linear(2, 2))
    assert result["step_s"] == pytest.approx(0.1) and result["comm_wait_s"] == pytest.approx(0.02)
    assert result["wire_bytes_per_step"] == 1000


def test_link_is_fitted_to_the_runs_collectives():
    """Buckets that took 1 ms + bytes / (100 MB/s) give that link (the one fp32 is predicted on)."""
    steps = [[{"numel": numel, "codec": "gqsgd(bits=8,encoding=packed)", "wire_bytes": numel,
               "comm_s": 1e-3 + numel / 1e8} for numel in (1000, 100_000)]] * 3
    link = fit_link(steps, world_size=2)  # a ring allreduce at 2 workers sends its payload once
    assert link.bandwidth == pytest.approx(1e8) and link.overhead == pytest.approx(1e-3)
    assert fit_link([[]] * 3, world_size=2) is None  # PyTorch's hooks (ddp*) time no bucket


def test_versus_fp32_without_a_link_or_a_peer_says_why():
    ddp = {"wire_bytes_per_step": 4e6, "fp32_bytes_per_step": 4e6, "step_s": 0.2, "predicted_fp32_step_s": None}
    assert versus_fp32(ddp, hop_size=2, fsdp=False) == [
        "wire 4 MB/step vs 4 MB fp32: no fewer",
        "step 0.2 s measured; fp32 not predicted (PyTorch's hooks time no collective: no link to fit)"]
    assert versus_fp32(ddp, hop_size=1, fsdp=False) == [
        "no communication (1 worker): nothing for a codec to compress, fp32 included"]
    local = {**ddp, "wire_bytes_per_step": 0}  # the route's local steps, no average applied in them
    assert versus_fp32(local, hop_size=2, fsdp=False)[0] == "wire 0 MB/step vs 4 MB fp32: none sent"


def test_a_diverged_loss_ends_the_run_in_one_line(tmp_path, capsys):
    """--lr 1e30 overflows the weights after one step: a NaN train loss fails the run (it exited 0 before)."""
    assert run_train("--task", "digits", "--codec", "none", "--lr", "1e30", "--steps", "20", "--eval-every", "0",
                     "--out", str(tmp_path)) == 1
    err = capsys.readouterr().err
    assert "failed: netgain.train.loop.NonFiniteLossError: rank " in err and "the run diverged (a lower --lr?)" in err
    assert "Traceback" not in err and not (tmp_path / "record.json").exists()


@pytest.mark.parametrize("codec", ["gqsgd", "topk", "lowrank"])
def test_resume_equals_straight_run(tmp_path, codec):
    """8 steps straight == resuming its step-4 checkpoint in fresh processes for 4 more steps.

    gqsgd carries per-parameter rounding RNG and topk EF21 error feedback: both must be restored.
    """
    common = ["--task", "digits", "--codec", codec, "--ratio", "0.1", "--eval-every", "0", "--steps", "8"]
    assert run_train(*common, "--checkpoint", str(tmp_path / "straight-{step}.pt"), "--checkpoint-every", "4",
                     "--out", str(tmp_path / "straight")) == 0
    assert run_train(*common, "--resume", str(tmp_path / "straight-4.pt"), "--checkpoint",
                     str(tmp_path / "resumed.pt"), "--out", str(tmp_path / "resumed")) == 0
    straight = torch.load(tmp_path / "straight-8.pt", weights_only=True)  # data only: see test_bad_input
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert straight["step"] == resumed["step"] == 8
    assert summary(tmp_path / "straight")["compression_ratio"] > 1.5  # the codec really ran
    for name, tensor in straight["model"].items():
        assert torch.equal(tensor, resumed["model"][name]), name


def test_resume_applies_a_new_lr_and_records_it(tmp_path, capsys):
    common = ["--task", "digits", "--eval-every", "0", "--world-size", "1"]
    assert run_train(*common, "--steps", "2", "--checkpoint", str(tmp_path / "first.pt"),
                     "--out", str(tmp_path / "first")) == 0
    assert run_train(*common, "--steps", "3", "--resume", str(tmp_path / "first.pt"), "--lr", "0.5",
                     "--checkpoint", str(tmp_path / "second.pt"), "--out", str(tmp_path / "second")) == 0
    assert "--resume: --lr 0.5 replaces the checkpoint's 0.003" in capsys.readouterr().err
    optimizer = torch.load(tmp_path / "second.pt", weights_only=True)["optimizer"]
    assert [group["lr"] for group in optimizer["param_groups"]] == [0.5]
    record = json.loads((tmp_path / "second" / "record.json").read_text())
    assert record["config"]["lr"] == 0.5
    assert record["resumed"] == {"checkpoint": str(tmp_path / "first.pt"), "step": 2, "applied": {"lr": [0.003, 0.5]}}


@pytest.mark.parametrize("codec", ["kimad", "kimad+"])
def test_adaptive_codecs_start_planning_after_warmup(tmp_path, codec):
    """Warm-up steps go uncompressed without a plan; the planner must not plan from them (kimad crashed),
    and it plans every step after them."""
    assert run_train("--task", "digits", "--codec", codec, "--warmup-steps", "2", "--steps", "6", "--eval-every", "0",
                     "--out", str(tmp_path / "run")) == 0
    steps = json.loads((tmp_path / "run" / "record.json").read_text())["per_step"]
    assert steps["step"] == list(range(6))
    for step in (0, 1):
        assert not steps["plan"][step] and steps["predicted_comm_s"][step] is None
        assert steps["wire_bytes"][step] >= steps["raw_bytes"][step]
    for step in range(2, 6):
        assert steps["plan"][step] and steps["predicted_comm_s"][step] > 0
