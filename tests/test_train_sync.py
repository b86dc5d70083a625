"""`netgain train --sync`: netgain.sync's outer steps in place of the per-step hook, end to end on 2 spawned
gloo workers; its bad combinations refused in the parent."""

import argparse
import json
from dataclasses import asdict

import pytest
import torch

from netgain import cli
from netgain.train.checkpoints import write_checkpoint
from netgain.train.cli import build_config, configure
from netgain.train.tasks import TASK_CLASSES

SYNC_CODECS = "choose one of none, fp16, bf16, qsgd, gqsgd, gqsgd-exp"


def run_train(*argv: str) -> int:
    return cli.main(["train", *argv])


def record(out) -> dict:
    return json.loads((out / "record.json").read_text())


def config(*argv: str):
    parser = argparse.ArgumentParser()
    configure(parser)
    return build_config(parser.parse_args(argv))


def test_digits_trains_with_local_steps_and_a_coded_average_every_h(tmp_path):
    """The defaults: H=8, 4-bit gqsgd, outer lr 1, no momentum, one step overlapped. A sync's bytes count at
    the step that applies it (steps 9 and 17 of 24, indices 8 and 16), and the loss falls."""
    assert run_train("--task", "digits", "--sync", "--steps", "24", "--eval-every", "12", "--out", str(tmp_path)) == 0
    run = record(tmp_path)
    assert run["config"]["sync"] and (run["config"]["sync_period"], run["config"]["sync_bits"]) == (8, 4)
    summary = run["summary"]
    assert summary["route"] == ("sync every 8 steps: gqsgd 4-bit pseudo-gradients, outer lr 1, momentum 0, "
                                "1 fragment(s), 1 step(s) overlapped")
    wire = run["per_step"]["wire_bytes"]
    assert [step for step, sent in enumerate(wire) if sent] == [8, 16] and wire[8] == wire[16]
    assert summary["wire_bytes_per_step"] == pytest.approx(sum(wire) / 24)
    # fp32 DDP sends every fp32 gradient every step: 8 steps of them against one 4-bit average
    assert summary["fp32_bytes_per_step"] == 4 * summary["parameters"] and summary["compression_ratio"] > 8 * 4
    assert summary["versus_fp32"][1].endswith("fp32 not predicted (--sync has no per-step collective: no link to fit)")
    losses = [v["val_loss"] for v in run["validation"]]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[0] > losses[1] > losses[2]
    assert summary["final_val_accuracy"] > 0.6


def test_lm_resume_repeats_the_straight_run_bit_for_bit(tmp_path):
    """12 steps straight == resuming its step-6 checkpoint in fresh processes for 6 more. H=4 in 2 fragments with
    Nesterov momentum: the step-6 checkpoint holds an average still on the wire (fragment 1's, launched at step
    6, due at 7), the outer momentum and each rank's own parameters and AdamW state."""
    text = tmp_path / "corpus.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 200)
    common = ["--sync", "--sync-period", "4", "--fragments", "2", "--outer-lr", "0.7", "--outer-momentum", "0.9",
              "--data", str(text), "--hidden-size", "64", "--layers", "1", "--seq-len", "32", "--batch-size", "4",
              "--steps", "12", "--eval-every", "0"]
    assert run_train(*common, "--checkpoint", str(tmp_path / "straight-{step}.pt"), "--checkpoint-every", "6",
                     "--out", str(tmp_path / "straight")) == 0
    assert run_train(*common, "--resume", str(tmp_path / "straight-6.pt"), "--checkpoint", str(tmp_path / "resumed.pt"),
                     "--out", str(tmp_path / "resumed")) == 0
    middle = torch.load(tmp_path / "straight-6.pt", weights_only=True)
    assert [(p["fragment"], p["due"]) for p in middle["comm"]["pending"]] == [(1, 7)]
    straight = torch.load(tmp_path / "straight-12.pt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert straight["comm"]["step"] == resumed["comm"]["step"] == 12
    for part in ("global", "momentum"):
        for name, tensor in straight["comm"][part].items():
            assert torch.equal(tensor, resumed["comm"][part][name]), (part, name)
    for rank in range(2):
        for name, tensor in straight["comm"]["local"][rank]["params"].items():
            assert torch.equal(tensor, resumed["comm"]["local"][rank]["params"][name]), (rank, name)
    losses = record(tmp_path / "straight")["per_step"]["train_loss"]
    assert record(tmp_path / "resumed")["per_step"]["train_loss"] == losses[6:]
    assert all(torch.isfinite(torch.tensor(losses))) and sum(losses[-3:]) < sum(losses[:3])


def test_under_fsdp_a_resume_repeats_the_straight_run_bit_for_bit(tmp_path):
    """--fsdp --sync on a 2 x 2 mesh: each replica steps alone, its shards synced with the other replica's every 4
    steps (2 fragments, an average on the wire at step 6). 12 steps straight == resuming the step-6 DCP checkpoint in
    fresh processes for 6 more: the same losses (each rank's own shards and AdamW state came back, not DCP's one
    copy of the model)."""
    text = tmp_path / "corpus.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 200)
    common = ["--fsdp", "--replicas", "2", "--shards", "2", "--sync", "--sync-period", "4", "--fragments", "2",
              "--outer-lr", "0.7", "--outer-momentum", "0.9", "--data", str(text), "--hidden-size", "64",
              "--layers", "1", "--seq-len", "32", "--batch-size", "4", "--steps", "12", "--eval-every", "0"]
    assert run_train(*common, "--checkpoint", str(tmp_path / "straight-{step}"), "--checkpoint-every", "6",
                     "--out", str(tmp_path / "straight")) == 0
    assert run_train(*common, "--resume", str(tmp_path / "straight-6"), "--out", str(tmp_path / "resumed")) == 0
    losses = record(tmp_path / "straight")["per_step"]["train_loss"]
    assert record(tmp_path / "resumed")["per_step"]["train_loss"] == losses[6:]
    assert all(torch.isfinite(torch.tensor(losses))) and sum(losses[-3:]) < sum(losses[:3])


@pytest.mark.parametrize("argv, message", [
    (["--comm-budget-ms", "5"], "--comm-budget-ms is an option of the per-step route, not of --sync, which takes "
     "--codec none, fp16, bf16, qsgd, gqsgd, gqsgd-exp and --sync-period, --sync-bits, --outer-lr"),
    (["--bits", "4"], "--bits is an option of the per-step route"),
    (["--ratio", "0.5"], "--ratio is an option of the per-step route"),
    (["--codec", "auto"], f"--codec auto does not run under --sync; {SYNC_CODECS}"),
    (["--codec", "lowrank"], f"--codec lowrank does not run under --sync; {SYNC_CODECS}"),
    (["--codec", "ddp-powersgd"], f"--codec ddp-powersgd does not run under --sync; {SYNC_CODECS}"),
    (["--sync-period", "0"], "--sync-period must be at least 1, got 0"),
    (["--sync-period", "4", "--fragments", "5"], "--fragments must be in 1..4"),
    (["--task", "digits", "--sync-period", "16", "--fragments", "5"],
     "--fragments must be at most the model's 4 trainable parameters"),
    (["--sync-period", "4", "--overlap-steps", "4"], "--overlap-steps must be in 0..3"),
    (["--outer-lr", "0"], "--outer-lr must be a finite number > 0, got 0.0"),
    (["--outer-lr", "nan"], "--outer-lr must be a finite number > 0, got nan"),
    (["--outer-momentum", "1"], "--outer-momentum must be in [0, 1), got 1.0"),
    (["--sync-bits", "9"], "--sync-bits must be in 2..8, got 9"),
    (["--codec", "bf16", "--sync-bits", "4"], "--sync-bits applies to --codec qsgd, gqsgd, gqsgd-exp only, not --codec bf16"),
])
def test_bad_sync_setting_is_named_in_the_parent(argv, message):
    with pytest.raises(ValueError) as error:
        config("--sync", *argv)
    assert message in str(error.value)


@pytest.mark.parametrize("option", [["--sync-period", "4"], ["--sync-bits", "4"], ["--outer-lr", "1"],
                                    ["--outer-momentum", "0"], ["--fragments", "1"], ["--overlap-steps", "0"]])
def test_sync_options_apply_with_sync_only(option):
    with pytest.raises(ValueError, match=f"{option[0]} applies with --sync only"):
        config(*option)


def test_defaults_follow_the_codec_and_the_period():
    assert config("--sync").sync_config() == config("--sync", "--codec", "gqsgd", "--sync-bits", "4").sync_config()
    settings = config("--sync", "--codec", "fp16", "--sync-period", "1", "--outer-momentum", "0.9")
    assert (settings.sync_bits, settings.overlap_steps, settings.sync_config().nesterov) == (None, 0, True)


def test_resume_keeps_the_route_and_the_checkpoints_sync_settings(tmp_path):
    """Left out on --resume, the sync settings are the checkpoint's; a route or a setting that differs is named."""
    saved = config("--task", "digits", "--sync", "--sync-period", "4", "--outer-lr", "0.5")
    model = TASK_CLASSES["digits"].model_of(saved)
    path = tmp_path / "ck.pt"
    write_checkpoint(path, {"step": 4, "world_size": 2, "config": asdict(saved), "model": model.state_dict(),
                            "optimizer": torch.optim.AdamW(model.parameters()).state_dict(), "comm": {}})
    resumed = config("--task", "digits", "--sync", "--resume", str(path))
    assert resumed.sync_config() == saved.sync_config()
    with pytest.raises(ValueError, match="ck.pt was written with --sync, this run is without it"):
        config("--task", "digits", "--resume", str(path))
    with pytest.raises(ValueError, match="was trained with --sync-period 4; this run has --sync-period 8"):
        config("--task", "digits", "--sync", "--sync-period", "8", "--resume", str(path))
