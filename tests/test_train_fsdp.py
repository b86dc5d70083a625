"""`netgain train --fsdp`: 4 spawned gloo workers on a 2 x 2 (replicate x shard) mesh, end to end."""

import json

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from netgain import cli

MESH = ["--fsdp", "--replicas", "2", "--shards", "2"]
TINY_LM = ["--hidden-size", "64", "--layers", "2", "--seq-len", "32", "--batch-size", "4"]


def run_train(*argv: str) -> int:
    return cli.main(["train", *argv])


def record(out) -> dict:
    return json.loads((out / "record.json").read_text())


def test_fsdp_none_trains_as_ddp_does(tmp_path):
    """The same 4 workers and batches: FSDP with the fp32 codec and DDP differ only in summation order."""
    common = ["--task", "digits", "--codec", "none", "--steps", "20", "--eval-every", "0"]
    assert run_train(*common, *MESH, "--out", str(tmp_path / "fsdp")) == 0
    assert run_train(*common, "--world-size", "4", "--out", str(tmp_path / "ddp")) == 0
    fsdp, ddp = record(tmp_path / "fsdp"), record(tmp_path / "ddp")
    assert fsdp["summary"]["world_size"] == 4 and fsdp["summary"]["fsdp_mesh"] == "2 replicas x 2 shards"
    assert fsdp["summary"]["compression_ratio"] == 1.0
    # the cross-replica hop carries each rank's shard: half of the model's fp32 gradient bytes
    assert fsdp["summary"]["fp32_bytes_per_step"] == ddp["summary"]["fp32_bytes_per_step"] / 2
    assert abs(fsdp["summary"]["final_val_loss"] - ddp["summary"]["final_val_loss"]) < 1e-4
    for a, b in zip(fsdp["per_step"]["train_loss"], ddp["per_step"]["train_loss"]):
        assert abs(a - b) < 1e-4


def test_fsdp_runs_auto_by_default(tmp_path):
    """No --codec under --fsdp: auto, planned per shard position; rank 0's plan in each step's record once made."""
    assert run_train("--task", "digits", *MESH, "--steps", "6", "--eval-every", "0", "--out", str(tmp_path)) == 0
    auto = record(tmp_path)
    assert auto["summary"]["codec"] == "auto" and auto["config"]["codec"] == "auto"
    assert auto["per_step"]["plan"][-1] and auto["per_step"]["bandwidth_Bps"][-1] > 0


def _model_tensors(folder, tmp_path):
    saved = tmp_path / f"{folder.name}.pt"
    dcp_to_torch_save(folder, saved)
    checkpoint = torch.load(saved, weights_only=False)  # this test's own files
    return checkpoint["model"], json.loads(checkpoint["comm"]["header"])["step"]


def test_lm_checkpoint_resumes_bit_for_bit(tmp_path):
    """4 steps straight == resuming the step-2 DCP checkpoint in fresh processes for 2 more (gqsgd 4-bit)."""
    common = ["--codec", "gqsgd", "--bits", "4", *MESH, *TINY_LM, "--steps", "4", "--eval-every", "0"]
    assert run_train(*common, "--checkpoint", str(tmp_path / "straight-{step}"), "--checkpoint-every", "2",
                     "--out", str(tmp_path / "straight")) == 0
    assert run_train(*common, "--resume", str(tmp_path / "straight-2"), "--checkpoint", str(tmp_path / "resumed"),
                     "--out", str(tmp_path / "resumed-run")) == 0
    straight = record(tmp_path / "straight")
    assert straight["summary"]["compression_ratio"] > 5  # 4-bit codes on the cross-replica hop
    assert record(tmp_path / "resumed-run")["resumed"]["step"] == 2
    assert json.loads((tmp_path / "resumed" / "netgain.json").read_text())["step"] == 4
    straight_model, straight_step = _model_tensors(tmp_path / "straight-4", tmp_path)
    resumed_model, resumed_step = _model_tensors(tmp_path / "resumed", tmp_path)
    assert straight_step == resumed_step == 4
    assert straight_model.keys() == resumed_model.keys()
    for name, tensor in straight_model.items():
        assert torch.equal(tensor, resumed_model[name]), name
