"""`netgain train` end to end: spawned gloo workers, records, checkpoint/resume exactness."""

import json

import pytest
import torch

from netgain import cli


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
    text = tmp_path / "corpus.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 200)
    out = tmp_path / "run"
    assert run_train("--data", str(text), "--hidden-size", "64", "--layers", "1", "--seq-len", "32",
                     "--batch-size", "4", "--steps", "3", "--eval-every", "2", "--out", str(out)) == 0
    record = json.loads((out / "record.json").read_text())
    assert record["config"]["task"] == "lm"
    assert len(record["per_step"]["step_s"]) == len(record["per_step"]["wire_bytes"]) == 3
    assert [v["step"] for v in record["validation"]] == [0, 2, 3]
    assert record["summary"]["wire_bytes_per_step"] == record["summary"]["fp32_bytes_per_step"] > 0
    assert (out / "loss.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("codec", ["gqsgd", "topk"])
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
