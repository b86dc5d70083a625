"""Bad input to `netgain train` and `netgain model` ends in one clear message, in the parent, before
any worker starts; signals and silent peers end a run instead of hanging it."""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import secrets
import signal
import struct
import subprocess
import sys
import time
import zipfile
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from netgain import cli, models
from netgain.files import RUN_MARKER, WriteError, require_claimed
from netgain.train.checkpoints import (CHECKPOINT_ID, SHARDED_CHECKPOINT_FILE, checkpoint_paths,
                                       finish_sharded_checkpoint, resume_changes, sharded_partial_path,
                                       write_checkpoint)
from netgain.train.cli import build_config, configure, prepare_outputs
from netgain.train.config import TrainConfig
from netgain.train.launch import explained, worker_failure
from netgain.train.loop import SilenceNotice
from netgain.train.tasks import TASK_CLASSES, LanguageModelTask

CPUS = os.cpu_count() or 1
needs_proc_children = pytest.mark.skipif(not Path(f"/proc/self/task/{os.getpid()}/children").exists(),
                                         reason="finds the workers through Linux's /proc/PID/task/PID/children")


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure(parser)
    return parser.parse_args(argv)


def config(*argv: str) -> TrainConfig:
    return build_config(parse(*argv))


@pytest.mark.parametrize("argv, message", [
    (["--bits", "9"], "--bits must be in 2..8, got 9"),
    (["--bits", "1"], "--bits must be in 2..8, got 1"),
    (["--codec", "gqsgd", "--encoding", "int8", "--bits", "4"], "--bits must be 8 with --encoding int8"),
    (["--ratio", "0"], "--ratio must be in (0, 1], got 0.0"),
    (["--ratio", "1.5"], "--ratio must be in (0, 1], got 1.5"),
    (["--ratio", "nan"], "--ratio must be in (0, 1], got nan"),
    (["--rank", "0"], "--rank must be at least 1, got 0"),
    (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
    (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
    (["--lr", "0"], "--lr must be a finite number > 0, got 0.0"),
    (["--comm-budget-ms", "0"], "--comm-budget-ms must be a finite number > 0, got 0.0"),
    (["--comm-budget-ms", "-5"], "--comm-budget-ms must be a finite number > 0, got -5.0"),
    (["--comm-budget-ms", "200"], "--comm-budget-ms is Kimad's time budget: only with --codec kimad or kimad+"),
    (["--replan-every", "0"], "--replan-every must be at least 1, got 0"),
    (["--codec", "kimad+", "--kimad-lowrank-rank", "0"], "--kimad-lowrank-rank must be at least 1, and only with --codec kimad"),
    (["--codec", "gqsgd", "--kimad-lowrank-rank", "4"], "--kimad-lowrank-rank must be at least 1, and only with --codec kimad"),
    (["--steps", "0"], "--steps must be at least 1, got 0"),
    (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    (["--world-size", "0"], "--world-size must be at least 1, got 0"),
    (["--seq-len", "0"], "--seq-len must be at least 1, got 0"),
    (["--seq-len", "1"], "--seq-len must be at least 2 (each byte is predicted from those before it"),
    (["--warmup-steps", "-1"], "--warmup-steps must be 0 or more, got -1"),
    (["--eval-every", "-1"], "--eval-every must be 0 or more, got -1"),
    (["--seed", "-1"], "--seed must be in 0..4294967295, got -1"),
    (["--seed", str(2**32)], f"--seed must be in 0..4294967295, got {2**32}"),
    (["--steps", str(2**63)], f"--steps must be at most 9,223,372,036,854,775,807, got {2**63}"),  # overflowed in the workers
    (["--codec", "lowrank", "--rank", "1" + "0" * 30], "--rank must be at most 9,223,372,036,854,775,807"),
    (["--checkpoint-every", "2"], "more than 0 needs --checkpoint, got 2"),
    (["--hidden-size", "100"], "--hidden-size must be a multiple of 32 and at least 64, got 100"),
    (["--layers", "0"], "--layers must be at least 1, got 0"),
    (["--collective-timeout", "0"], "--collective-timeout must be 1..86400 seconds, got 0.0"),
    (["--collective-timeout", "0.001"], "--collective-timeout must be 1..86400 seconds, got 0.001"),
    (["--collective-timeout", "1e15"], "--collective-timeout must be 1..86400 seconds, got 1000000000000000.0"),
    (["--collective-timeout", "inf"], "--collective-timeout must be 1..86400 seconds, got inf"),
    (["--collective-timeout", "nan"], "--collective-timeout must be 1..86400 seconds, got nan"),
    (["--world-size", str(4 * CPUS + 1)], f"at most {4 * CPUS} local workers on this machine's {CPUS} CPUs"),
    (["--task", "digits", "--data", "corpus.txt"], "--data applies to --task lm only"),
])
def test_bad_number_is_named_with_its_range(argv, message):
    with pytest.raises(ValueError) as error:
        config(*argv)
    assert message in str(error.value)


def test_warmup_steps_default_is_the_codecs():
    assert config("--codec", "lowrank").warmup_steps == 2
    assert config("--codec", "lowrank", "--warmup-steps", "0").warmup_steps == 0
    assert config("--codec", "gqsgd").warmup_steps == config("--codec", "ddp-powersgd").warmup_steps == 0


def test_world_size_at_the_cap_is_accepted():
    assert config("--world-size", str(4 * CPUS)).world_size == 4 * CPUS


@pytest.mark.parametrize("content, message", [
    (None, "is neither a file nor a folder"),
    ("", "holds no text (0 bytes)"),
    ("too short", "a rank's shard of the training text (2 ranks) has 4 bytes, fewer than one sequence of 128"),
])
def test_bad_data_is_found_in_the_parent(tmp_path, content, message):
    path = tmp_path / "corpus.txt"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError) as error:
        config("--data", str(path))
    assert message in str(error.value)


def test_empty_data_folder(tmp_path):
    with pytest.raises(ValueError, match="holds no files"):
        config("--data", str(tmp_path))


# ------------------------------------------------------------------ sizes, before any worker allocates


@pytest.mark.parametrize("argv, flags", [
    (["--layers", "100000"], "--hidden-size 192 --layers 100000 --seq-len 128 --batch-size 16"),
    (["--hidden-size", "1048576"], "--hidden-size 1048576 --layers 4"),
    (["--seq-len", "1000000000"], "--seq-len 1000000000"),
    (["--batch-size", "100000000000"], "--batch-size 100000000000"),
    (["--task", "digits", "--batch-size", "100000000000"], "--batch-size 100000000000"),
])
def test_sizes_beyond_memory_are_refused_in_the_parent(argv, flags):
    with pytest.raises(ValueError) as error:
        config(*argv)
    assert flags in str(error.value) and "each worker needs at least" in str(error.value)
    assert "more than this machine's memory" in str(error.value)


def test_parameters_are_counted_without_building_the_model():
    for hidden, layers in ((64, 1), (96, 3), (192, 4)):
        shape = config("--hidden-size", str(hidden), "--layers", str(layers))
        assert LanguageModelTask.parameter_count(shape) == models.parameter_count(models.byte_llama(hidden, layers, 8))


def test_many_steps_are_counted_not_looped_over(tmp_path):
    """--steps 10000000000 to one checkpoint path is one path; '{step}' paths are counted, and bounded."""
    assert config("--steps", "10000000000", "--checkpoint", str(tmp_path / "ck.pt")).steps == 10_000_000_000
    with pytest.raises(ValueError, match="--checkpoint-every 1 writes 10,000,000,000 files to --checkpoint .*ck-"):
        config("--steps", "10000000000", "--checkpoint", str(tmp_path / "ck-{step}.pt"), "--checkpoint-every", "1")
    every = config("--steps", "10", "--checkpoint", str(tmp_path / "ck-{step}.pt"), "--checkpoint-every", "3")
    assert list(checkpoint_paths(every, start=3).values()) == [6, 9, 10]


# ------------------------------------------------------------------ paths that are no regular file


@pytest.mark.parametrize("kind, message", [
    ("fifo", "is a FIFO (named pipe), not a regular file"),
    ("/dev/zero", "is a character device, not a regular file"),
])
def test_resume_reads_only_a_regular_file(tmp_path, kind, message):
    """Checked before anything opens it: a FIFO blocked forever, /dev/zero read 18 GB."""
    path = tmp_path / "ck.pt"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path = Path(kind)
    with pytest.raises(ValueError, match=re.escape(f"--resume {path} {message}")):
        config("--resume", str(path))


def test_fifo_in_a_checkpoint_folder_is_refused(tmp_path):
    folder = tmp_path / "ck"
    folder.mkdir()
    os.mkfifo(folder / SHARDED_CHECKPOINT_FILE)
    with pytest.raises(ValueError, match="netgain.json is a FIFO"):
        config(*FSDP, "--resume", str(folder))


@pytest.mark.parametrize("flag", ["--data", "--resume"])
def test_files_larger_than_memory_are_refused_before_reading(tmp_path, monkeypatch, flag):
    """A sparse 2 GB file on a machine of 512 MB: refused by its size, before a byte is read."""
    path = tmp_path / "big"
    with open(path, "wb") as f:
        f.truncate(2 * 10**9)
    for module in ("netgain.train.cli", "netgain.train.checkpoints"):
        monkeypatch.setattr(f"{module}.machine_memory_bytes", lambda: 512 * 10**6)
    with pytest.raises(ValueError, match=f"{flag} {path} is 2 GB, more than the"):
        config(flag, str(path))


# ------------------------------------------------------------------ outputs


@pytest.mark.parametrize("make", [lambda p: p.write_text("mine"), os.mkfifo])
def test_out_that_is_a_file_is_named_so(tmp_path, make):
    make(tmp_path / "out")
    with pytest.raises(ValueError, match=r"--out .*out exists and is not a folder"):
        prepare_outputs(config("--out", str(tmp_path / "out")))


def test_out_under_a_file_fails_before_training(tmp_path):
    (tmp_path / "file").write_text("mine")
    with pytest.raises(ValueError, match=r"--out .*file/run: cannot create it \(Not a directory\)"):
        prepare_outputs(config("--out", str(tmp_path / "file" / "run")))
    assert (tmp_path / "file").read_text() == "mine"


def test_checkpoint_under_a_file_fails_before_training(tmp_path):
    (tmp_path / "file").write_text("mine")
    with pytest.raises(ValueError, match="--checkpoint: .*file is not a folder"):
        prepare_outputs(config("--out", str(tmp_path / "run"), "--checkpoint", str(tmp_path / "file" / "ck.pt")))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only folders")
def test_read_only_out_fails_before_training(tmp_path):
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(ValueError, match="--out: cannot write to"):
            prepare_outputs(config("--out", str(tmp_path)))
    finally:
        tmp_path.chmod(0o700)


def test_out_holding_an_earlier_run_is_not_written_over(tmp_path):
    (tmp_path / "record.json").write_text("earlier")
    (tmp_path / "loss.png").write_text("earlier")
    with pytest.raises(ValueError, match=r"--out .* holds an earlier run's record.json, loss.png; netgain does not "
                       "write over them: give a new folder"):
        prepare_outputs(config("--out", str(tmp_path)))
    assert (tmp_path / "record.json").read_text() == "earlier" and not (tmp_path / RUN_MARKER).exists()


def test_out_is_claimed_by_one_run_with_its_own_id(tmp_path):
    """The marker names the run; a second run is refused, and a run writes its report only under its marker."""
    run = prepare_outputs(config("--out", str(tmp_path / "run")))
    assert json.loads((tmp_path / "run" / RUN_MARKER).read_text()) == {"run": run.run_id} and len(run.run_id) == 32
    with pytest.raises(ValueError, match=f"holds the {RUN_MARKER} of a run that is still going or stopped before "
                       "its report: give a new folder, or remove that file"):
        prepare_outputs(config("--out", str(tmp_path / "run")))
    require_claimed(tmp_path / "run", run.run_id)
    (tmp_path / "run" / RUN_MARKER).write_text(json.dumps({"run": "another"}))
    with pytest.raises(WriteError, match=f"not writing into .*run: its {RUN_MARKER} no longer names this run"):
        require_claimed(tmp_path / "run", run.run_id)


@pytest.mark.parametrize("checkpoint, clash", [
    ("run", "--out .*run at step 300"),
    ("run/record.json", "--out's record.json at step 300"),
    ("alias/run/loss.png", "--out's loss.png at step 300"),
    ("run/ck-{step}.pt", None),
])
def test_checkpoint_on_out_or_its_files_is_refused_up_front(tmp_path, checkpoint, clash):
    (tmp_path / "alias").symlink_to(tmp_path)
    argv = ("--out", str(tmp_path / "run"), "--checkpoint", str(tmp_path / checkpoint))
    if clash is None:
        assert prepare_outputs(config(*argv)).checkpoint
        return
    with pytest.raises(ValueError, match=f"--checkpoint .* would write over {clash}: give them different paths"):
        prepare_outputs(config(*argv))


def test_default_run_folders_started_in_the_same_second_differ(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(time, "strftime", lambda fmt: "20260101-000000")
    first, second = (prepare_outputs(config()).out for _ in range(2))
    assert first == "runs/auto-20260101-000000" and second == "runs/auto-20260101-000000-2"
    assert Path(first).is_dir() and Path(second).is_dir()


# ------------------------------------------------------------------ resume


def fake_checkpoint(path: Path, step: int = 4, world_size: int = 2, **settings) -> Path:
    """What check_resume reads of a checkpoint (its config, step and world size), written as the Trainer
    writes one, with a tensor whose bits a test can flip."""
    settings = config(*[f"--{k.replace('_', '-')}={v}" for k, v in settings.items()])
    model = TASK_CLASSES[settings.task].model_of(settings)
    write_checkpoint(path, {"step": step, "world_size": world_size, "config": asdict(settings),
                            "model": model.state_dict(), "optimizer": torch.optim.AdamW(model.parameters()).state_dict(),
                            "comm": []})
    return path


def flip_a_bit(path: Path, entry: str = "data/0", at: int = 10) -> None:
    """Flip one bit in a zip entry's stored bytes (an exponent bit of a float32 in a torch.save file)."""
    with zipfile.ZipFile(path) as archive:
        offset = next(i for i in archive.infolist() if i.filename.endswith(entry)).header_offset
    data = bytearray(path.read_bytes())
    name_length, extra_length = struct.unpack("<HH", data[offset + 26:offset + 30])  # the local file header's
    data[offset + 30 + name_length + extra_length + at] ^= 0x40
    path.write_bytes(data)


class RunsCode:
    """A pickle that runs code on load, as a crafted checkpoint would."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_checkpoint_that_runs_code_is_refused(tmp_path):
    marker = tmp_path / "code-ran"
    path = tmp_path / "evil.pt"
    torch.save({"step": 1, "payload": RunsCode(marker)}, path)
    with pytest.raises(ValueError, match="refused, it holds more than tensors and plain data.*weights_only=True"):
        config("--resume", str(path))
    assert not marker.exists()
    torch.load(path, weights_only=False)  # the control: an unrestricted load runs it
    assert marker.exists()


@pytest.mark.parametrize("part, value, message", [
    ("model", {"w": torch.zeros(3)}, "its model weights are not this run's model's"),
    ("model", {"model.embed_tokens.weight": torch.zeros(1)}, "its model weights are not this run's model's"),
    ("model", [1, 2], "its model weights are not this run's model's"),
    ("optimizer", {"state": 5}, "its optimizer state is not AdamW's for this model's"),
    ("optimizer", {"state": {}, "param_groups": [{"params": [0]}]}, "its optimizer state is not AdamW's for this model's"),
])
def test_resume_of_another_models_state_is_refused_in_the_parent(tmp_path, part, value, message):
    path = fake_checkpoint(tmp_path / "ck.pt")
    write_checkpoint(path, {**torch.load(path, weights_only=True), part: value})
    with pytest.raises(ValueError, match=message):  # a traceback per worker, after startup, before
        config("--resume", str(path))


@pytest.mark.parametrize("write, message", [
    (None, "No such file or directory"),
    (lambda p: p.write_bytes(b"not a checkpoint"), "is not a zip archive, the format torch.save writes"),
    (lambda p: torch.save({"model": {}}, p), "is not a netgain train checkpoint (it needs the keys comm, config"),
])
def test_resume_from_what_is_no_checkpoint(tmp_path, write, message):
    path = tmp_path / "ck.pt"
    if write:
        write(path)
    with pytest.raises(ValueError) as error:
        config("--resume", str(path))
    assert message in str(error.value)


@pytest.mark.parametrize("argv, message", [
    (["--seed", "1"], "was trained with --seed 0; this run has --seed 1: a resumed run keeps these"),
    (["--codec", "ddp"], "was trained with --codec topk; this run has --codec ddp"),
    (["--skip-1d"], "was trained with --skip-1d False; this run has --skip-1d True"),
    (["--ratio", "0.5"], "was trained with --ratio 0.1; this run has --ratio 0.5"),
    (["--bits", "4"], "was trained with --bits 8; this run has --bits 4"),
    (["--hidden-size", "64", "--layers", "2"],
     "was trained with --hidden-size 192 --layers 4; this run has --hidden-size 64 --layers 2"),
    (["--world-size", "1"], "was written by 2 workers, this run has 1: the codec state is per worker"),
    (["--steps", "4"], "--steps 4 is not beyond the checkpoint's step 4"),
])
def test_resume_refuses_settings_it_cannot_apply_by_name(tmp_path, argv, message):
    path = fake_checkpoint(tmp_path / "ck.pt", codec="topk", ratio=0.1)
    with pytest.raises(ValueError) as error:
        config("--resume", str(path), "--codec", "topk", "--ratio", "0.1", *argv)
    assert message in str(error.value)


def test_resume_does_not_overwrite_its_checkpoint(tmp_path):
    path = fake_checkpoint(tmp_path / "ck.pt")
    with pytest.raises(ValueError, match="--checkpoint .*ck.pt would overwrite --resume .*ck.pt at step 300"):
        config("--resume", str(path), "--checkpoint", str(path))
    misnamed = fake_checkpoint(tmp_path / "ck-8.pt", step=4)
    with pytest.raises(ValueError, match="would overwrite --resume .*ck-8.pt at step 8"):
        config("--resume", str(misnamed), "--checkpoint", str(tmp_path / "ck-{step}.pt"), "--steps", "8")
    assert config("--resume", str(path), "--checkpoint", str(tmp_path / "ck-{step}.pt"), "--steps", "8").checkpoint


def test_checkpoint_that_is_the_resume_file_by_another_name_is_refused(tmp_path):
    """The same file through a hard link or a linked folder: compared by inode, not by path."""
    path = fake_checkpoint(tmp_path / "ck.pt")
    os.link(path, tmp_path / "hard.pt")
    (tmp_path / "alias").symlink_to(tmp_path)
    for other in (tmp_path / "hard.pt", tmp_path / "alias" / "ck.pt"):
        with pytest.raises(ValueError, match=f"--checkpoint {other} would overwrite --resume .*ck.pt at step 300"):
            config("--resume", str(path), "--checkpoint", str(other))


def test_checkpoint_write_leaves_a_users_partial_file_alone(tmp_path):
    (tmp_path / "ck.pt.partial").write_text("mine")
    fake_checkpoint(tmp_path / "ck.pt")
    fake_checkpoint(tmp_path / "ck.pt", step=8)
    assert (tmp_path / "ck.pt.partial").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.pt", "ck.pt.partial"]


def test_disk_full_keeps_the_earlier_checkpoint_and_says_so_in_one_line(tmp_path, monkeypatch):
    path = fake_checkpoint(tmp_path / "ck.pt")
    before = path.read_bytes()

    def disk_full(obj, file):
        file.write(b"the first bytes")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(WriteError) as error:
        fake_checkpoint(path, step=8)
    assert str(error.value) == f"cannot write {path}: No space left on device (the earlier file is unchanged)"
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["ck.pt"]


def test_a_user_file_put_at_the_checkpoint_path_during_the_run_is_not_replaced(tmp_path):
    (tmp_path / "ck.pt").write_text("mine")
    with pytest.raises(WriteError, match="cannot write the checkpoint .*ck.pt: something that is not a netgain"):
        write_checkpoint(tmp_path / "ck.pt", {})
    assert (tmp_path / "ck.pt").read_text() == "mine"


def test_checkpoint_replaces_only_an_earlier_checkpoint(tmp_path):
    """Nothing a user has at --checkpoint is overwritten: a file or folder that is not netgain's is refused."""
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "folder").mkdir()
    for path in ("notes.txt", "folder"):
        with pytest.raises(ValueError, match=f"--checkpoint .*{path} exists and is not a netgain train checkpoint"):
            config("--checkpoint", str(tmp_path / path))
    assert (tmp_path / "notes.txt").read_text() == "mine"
    earlier = fake_checkpoint(tmp_path / "ck.pt")
    assert config("--checkpoint", str(earlier)).checkpoint == str(earlier)


@pytest.mark.parametrize("flag", ["--data", "--out", "--checkpoint", "--resume"])
def test_empty_path_is_refused_not_taken_as_absent(flag):
    with pytest.raises(ValueError, match=f"{flag} must not be empty"):
        config(flag, "")


def test_resume_keeps_the_checkpoints_warmup_unless_told(tmp_path):
    """A low-rank checkpoint from before the default of 2 warm-up steps resumes as it was trained."""
    path = fake_checkpoint(tmp_path / "ck.pt", codec="lowrank", warmup_steps=0)
    assert config("--resume", str(path), "--codec", "lowrank").warmup_steps == 0
    with pytest.raises(ValueError, match="was trained with --warmup-steps 0; this run has --warmup-steps 2"):
        config("--resume", str(path), "--codec", "lowrank", "--warmup-steps", "2")


def test_resume_applies_lr_batch_size_and_data_and_names_them(tmp_path):
    path = fake_checkpoint(tmp_path / "ck.pt")
    resumed = config("--resume", str(path), "--lr", "0.5", "--batch-size", "4")
    assert resume_changes(resumed) == {"lr": (0.003, 0.5), "batch_size": (16, 4)}


# ------------------------------------------------------------------ --fsdp

FSDP = ["--fsdp", "--replicas", "2", "--shards", "2"]


@pytest.mark.parametrize("argv, message", [
    (["--fsdp"], "--fsdp needs --replicas R and --shards S"),
    (["--fsdp", "--replicas", "2"], "--fsdp needs --replicas R and --shards S"),
    (["--replicas", "2"], "--replicas applies with --fsdp only"),
    (["--shards", "2"], "--shards applies with --fsdp only"),
    (["--fsdp", "--replicas", "0", "--shards", "2"], "--replicas must be at least 1, got 0"),
    (["--fsdp", "--replicas", "2", "--shards", "-1"], "--shards must be at least 1, got -1"),
    ([*FSDP, "--world-size", "2"], "--world-size 2 differs from --replicas 2 x --shards 2 = 4: under --fsdp the "
     "world size is replicas x shards (leave --world-size out)"),
    (["--fsdp", "--replicas", str(4 * CPUS), "--shards", "2"], f"at most {4 * CPUS} local workers"),
    *[([*FSDP, "--codec", codec], f"--codec {codec} does not run under --fsdp; choose one of auto, none, fp16, bf16, "
       "qsgd, gqsgd, gqsgd-exp, topk, randomk, lowrank, kimad, kimad+") for codec in ("ddp", "ddp-fp16", "ddp-powersgd")],
])
def test_bad_fsdp_setting_is_named(argv, message):
    with pytest.raises(ValueError) as error:
        config(*argv)
    assert message in str(error.value)


def test_fsdp_world_size_is_replicas_times_shards(monkeypatch):
    assert config(*FSDP).world_size == config(*FSDP, "--world-size", "4").world_size == 4
    assert config(*FSDP, "--codec", "gqsgd-exp").codec == "gqsgd-exp"
    for name, value in {"RANK": "0", "WORLD_SIZE": "8", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=r"torchrun's WORLD_SIZE 8 differs from --replicas 2 x --shards 2 = 4: "
                       r"under --fsdp the world size is replicas x shards$"):
        config(*FSDP)


def fake_sharded_checkpoint(folder: Path, step: int = 4, **settings) -> Path:
    """An --fsdp checkpoint as rank 0 finishes one: a shard file (DCP's) and the manifest beside it."""
    saved = asdict(config(*FSDP, *[f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]))
    partial = sharded_partial_path(folder, secrets.token_hex(8))
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(bytes(range(256)))
    finish_sharded_checkpoint(partial, folder, step, 4, saved)
    return folder


def test_fsdp_checkpoint_does_not_replace_a_folder_that_is_not_one(tmp_path):
    """A folder is netgain's checkpoint by the id in its manifest: not by holding a file named netgain.json."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "users").mkdir()
    (tmp_path / "users" / SHARDED_CHECKPOINT_FILE).write_text(json.dumps({"step": 4, "world_size": 4, "config": {}}))
    for name in ("mine", "users"):
        with pytest.raises(ValueError, match=f"--checkpoint .*{name} exists and is not a netgain --fsdp checkpoint"):
            config(*FSDP, "--checkpoint", str(tmp_path / name))
    fake_sharded_checkpoint(tmp_path / "ck-4")
    assert config(*FSDP, "--checkpoint", str(tmp_path / "ck-{step}"), "--steps", "4").checkpoint


def test_replacing_an_fsdp_checkpoint_removes_only_the_files_it_wrote(tmp_path, capsys):
    path = fake_sharded_checkpoint(tmp_path / "ck")
    (path / "notes.txt").write_text("mine")
    fake_sharded_checkpoint(path, step=8)
    assert json.loads((path / SHARDED_CHECKPOINT_FILE).read_text())["step"] == 8
    assert sorted(p.name for p in path.iterdir()) == ["__0_0.distcp", SHARDED_CHECKPOINT_FILE]
    kept = [p for p in tmp_path.iterdir() if p != path]
    assert [sorted(p.name for p in folder.iterdir()) for folder in kept] == [["notes.txt"]]
    assert f"kept {kept[0]}: the files in the earlier checkpoint {path} that netgain did not write" in capsys.readouterr().err


def test_resume_across_ddp_and_fsdp_is_refused(tmp_path):
    with pytest.raises(ValueError, match="ck.pt was written without --fsdp, this run is with it"):
        config(*FSDP, "--resume", str(fake_checkpoint(tmp_path / "ck.pt")))
    with pytest.raises(ValueError, match="sharded was written with --fsdp, this run is without it"):
        config("--resume", str(fake_sharded_checkpoint(tmp_path / "sharded")))


@pytest.mark.parametrize("argv, message", [
    (["--fsdp", "--replicas", "4", "--shards", "1"],
     "was trained with --replicas 2 --shards 2; this run has --replicas 4 --shards 1"),
    (["--fsdp", "--replicas", "1", "--shards", "2"], "was written by 4 workers, this run has 2"),
    ([*FSDP, "--bits", "4"], "was trained with --bits 8; this run has --bits 4"),
])
def test_fsdp_resume_refuses_another_mesh_or_codec(tmp_path, argv, message):
    path = fake_sharded_checkpoint(tmp_path / "ck")
    with pytest.raises(ValueError) as error:
        config("--resume", str(path), *argv)
    assert message in str(error.value)


def test_a_flipped_bit_in_a_checkpoint_is_refused(tmp_path):
    """Found by the zip's CRC-32 (torch.load alone returns the changed weight), or an --fsdp file's SHA-256."""
    path = fake_checkpoint(tmp_path / "ck.pt")
    saved = torch.load(path, weights_only=True)["model"]
    flip_a_bit(path)
    flipped = torch.load(path, weights_only=True)["model"]
    assert any(not torch.equal(saved[name], flipped[name]) for name in saved)
    with pytest.raises(ValueError, match=r"--resume .*ck.pt: .*/data/0 fails its CRC-32 check: the checkpoint is damaged"):
        config("--resume", str(path))
    folder = fake_sharded_checkpoint(tmp_path / "sharded")
    shard = folder / "__0_0.distcp"
    shard.write_bytes(bytes([shard.read_bytes()[0] ^ 1]) + shard.read_bytes()[1:])
    with pytest.raises(ValueError, match="sharded: __0_0.distcp does not match the SHA-256 in its netgain.json"):
        config(*FSDP, "--resume", str(folder))


@pytest.mark.parametrize("field, value, message", [
    ("step", "two", "step 'two'"),
    ("step", True, "step True"),
    ("world_size", 0, "world_size 0"),
    ("config", [], "config []"),
    ("config", {"lr": [1]}, "config {'lr': [1]}"),
    ("config", {"warmup_steps": "2"}, "config.warmup_steps '2'"),
    ("config", {"fsdp": "yes"}, "config.fsdp 'yes'"),
    (CHECKPOINT_ID, 5, f"{CHECKPOINT_ID} 5"),
    ("files", {"../secret": "0"}, "files must map names in the folder to SHA-256 digests"),
    ("files", [], "files must map names in the folder to SHA-256 digests"),
])
def test_hostile_fields_in_an_fsdp_manifest_are_named(tmp_path, field, value, message):
    folder = fake_sharded_checkpoint(tmp_path / "ck")
    manifest = json.loads((folder / SHARDED_CHECKPOINT_FILE).read_text())
    (folder / SHARDED_CHECKPOINT_FILE).write_text(json.dumps({**manifest, field: value}))
    with pytest.raises(ValueError) as error:
        config(*FSDP, "--resume", str(folder))
    assert f"--resume {folder}" in str(error.value) and message in str(error.value)


def test_hostile_fields_in_a_checkpoint_are_named(tmp_path):
    """A tensor where the config holds plain values raised 'Boolean value of Tensor...' in the checks."""
    saved = {**asdict(config()), "seed": torch.zeros(3)}
    write_checkpoint(tmp_path / "ck.pt", {"step": "two", "world_size": 2, "config": saved, "model": {},
                                          "optimizer": {}, "comm": []})
    with pytest.raises(ValueError, match=r"ck.pt: not a netgain checkpoint, its fields hold the wrong types or "
                       r"values: step 'two', config \{"):
        config("--resume", str(tmp_path / "ck.pt"))


def test_fsdp_checkpoint_folder_without_its_json_is_named(tmp_path):
    (tmp_path / "ck").mkdir()
    with pytest.raises(ValueError, match="ck: a folder without a readable netgain.json is not a netgain --fsdp"):
        config(*FSDP, "--resume", str(tmp_path / "ck"))


# ------------------------------------------------------------------ netgain model


@pytest.mark.parametrize("argv, message", [
    (["--bucket-mb", "0"], "--bucket-mb must be a finite number > 0, got 0.0"),
    (["--bucket-mb", "-1"], "--bucket-mb must be a finite number > 0, got -1.0"),
    (["--tokens-per-step", "0"], "--tokens-per-step must be a finite number > 0, got 0.0"),
    (["--mfu", "0"], "--mfu must be in (0, 1], got 0.0"),
    (["--compute-ms", "0"], "--compute-ms must be a finite number > 0, got 0.0"),
    (["--tolerance", "-0.1"], "--tolerance must be a finite number >= 0, got -0.1"),
    (["--params", "inf"], "--params must be a finite number >= 1, got inf"),
    (["--workers", "0"], "--workers must be at least 1, got 0"),
    (["--link", "10gbe", "--bandwidth", "40gbit"], "--link 10gbe and --bandwidth 40gbit both name the link: give one"),
    (["--bandwidth", "0gbit"], "bandwidth: must be a finite rate > 0"),
    (["--bandwidth", ""], "bandwidth: cannot parse ''"),
    (["--bandwidth", "1e999gbit"], "bandwidth: must be a finite rate > 0"),
    (["--latency", ""], "latency: cannot parse ''"),
    (["--latency", "1e999s"], "latency: must be finite"),
    (["--params", "1e30"], "--params over --bucket-mb makes 1.53e+23 buckets: at most 1,000,000"),
    (["--bucket-mb", "1e-9"], "--bucket-mb must hold one fp32 element"),
])
def test_model_rejects_bad_numbers_by_name(capsys, argv, message):
    base = {"--params": "7e9", "--workers": "8"}
    base.update(dict(zip(argv[::2], argv[1::2])))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["model", *[item for pair in base.items() for item in pair]])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_model_steps_from_reads_only_a_regular_file(tmp_path, capsys):
    os.mkfifo(tmp_path / "steps.csv")
    for path in (tmp_path / "steps.csv", Path("/dev/zero")):
        with pytest.raises(SystemExit):
            cli.main(["model", "--params", "7e9", "--workers", "8", "--steps-from", str(path)])
        assert f"--steps-from {path} is a " in capsys.readouterr().err


def test_model_default_link_still_applies():
    from netgain.cost import advise

    args = argparse.Namespace(link=None, bandwidth=None, latency=None)
    link, device = advise.resolve_link(args)
    assert (link.name, device) == (advise.DEFAULT_LINK, "a100")


# ------------------------------------------------------------------ silent peers, signals


def test_silence_notice_names_the_rank_what_it_waits_in_and_the_timeout(capsys):
    notice = SilenceNotice(rank=1, timeout_s=0.4)
    notice.beat("in step 3")
    time.sleep(0.5)
    notice.close()
    err = capsys.readouterr().err
    assert "rank 1 has made no progress for 0 s while in step 3: a peer may be stuck or gone" in err
    assert "--collective-timeout 0.4 s" in err


def test_silence_notice_is_quiet_while_progress_is_made(capsys):
    notice = SilenceNotice(rank=0, timeout_s=0.4)
    for step in range(10):
        notice.beat(f"in step {step}")
        time.sleep(0.05)
    notice.close()
    assert capsys.readouterr().err == ""


class Train:
    """`netgain train` in a subprocess, its stderr collected by a thread (tqdm writes no newlines)."""

    def __init__(self, *argv: str):
        import threading

        self.proc = subprocess.Popen([sys.executable, "-m", "netgain.cli", "train", *argv],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.chunks: list[str] = []
        self.reader = threading.Thread(target=lambda: self.chunks.extend(iter(lambda: self.proc.stderr.read(1), "")))
        self.reader.start()

    @property
    def err(self) -> str:
        return "".join(self.chunks)

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.err:
            assert self.proc.poll() is None, f"netgain train ended early:\n{self.err}"
            assert time.monotonic() < deadline, f"no {text!r} after {timeout} s:\n{self.err}"
            time.sleep(0.05)

    def workers(self) -> list[int]:
        """The workers (`launch.worker_start_method`): the forks of the parent's forkserver, or its spawned
        children (not multiprocessing's resource tracker); [] once the parent is gone."""
        workers = []
        for child in _children(self.proc.pid):
            if b"forkserver" in _cmdline(child):
                workers += _children(child)
            elif b"spawn_main" in _cmdline(child):
                workers.append(child)
        return workers

    def finish(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        self.reader.join()
        return code

    def kill(self) -> None:
        """SIGKILL whatever a failed test left running: the workers, then the parent."""
        if self.proc.poll() is None:
            for pid in filter(alive, self.workers()):
                os.kill(pid, signal.SIGKILL)
            self.proc.kill()
        self.finish(timeout=10)


@pytest.fixture
def start_train():
    runs: list[Train] = []
    yield lambda *argv: runs.append(Train(*argv)) or runs[-1]
    for run in runs:
        run.kill()


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return b""


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_bad_argument_fails_in_the_parent_before_any_worker_starts(start_train):
    """No time limit here (a cold torch import on a loaded machine took over 10 s): no worker started."""
    run = start_train("--lr", "inf")
    assert run.finish(timeout=120) == 2
    assert "netgain: error: train: --lr must be a finite number > 0, got inf" in run.err
    assert "starting" not in run.err and "Traceback" not in run.err


@needs_proc_children
@pytest.mark.parametrize("sig, training", [(signal.SIGINT, True), (signal.SIGTERM, False)])
def test_signal_to_the_parent_stops_it_and_its_workers(tmp_path, start_train, sig, training):
    """SIGINT once the workers train; SIGTERM while they start up."""
    run = start_train("--task", "digits", "--steps", "1000000", "--eval-every", "0", "--out", str(tmp_path))
    if training:
        run.wait_for("%|", timeout=60)
    deadline = time.monotonic() + 30
    while len(workers := run.workers()) < 2:
        assert time.monotonic() < deadline, run.err
        time.sleep(0.05)
    run.proc.send_signal(sig)
    assert run.finish(timeout=5) == 128 + sig
    assert f"netgain train: {sig.name}: stopped the 2 workers" in run.err
    deadline = time.monotonic() + 5
    while any(map(alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(alive, workers))


def _descendants(pid: int) -> list[int]:
    return [d for child in _children(pid) for d in (child, *_descendants(child))]


@needs_proc_children
def test_kill_9_of_the_parent_leaves_no_process_running(tmp_path, start_train):
    """The forkserver and every worker are gone within 10 s of the parent's SIGKILL (no signal handler runs)."""
    run = start_train("--task", "digits", "--steps", "100000", "--eval-every", "0", "--out", str(tmp_path))
    run.wait_for("%|", timeout=60)
    descendants = _descendants(run.proc.pid)
    assert len(run.workers()) == 2 and set(run.workers()) <= set(descendants)
    run.proc.kill()
    deadline = time.monotonic() + 10
    while any(map(alive, descendants)) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = [pid for pid in descendants if alive(pid)]
    for pid in survivors:  # the parent's gone, so the fixture cannot find them
        os.kill(pid, signal.SIGKILL)
    assert not survivors, run.err


def test_worker_failure_line_names_the_exception_and_the_timeout():
    class Failed(Exception):
        error_index = 1

    error = Failed("-- Process 1 terminated with the following error:\nTraceback (most recent call last):\n"
                   "  File \"x.py\", line 1\nRuntimeError: [gloo] Timed out waiting 3000ms for recv\n\nAt:\n"
                   "  collectives.py(60): finished\n")
    assert worker_failure(error, config("--collective-timeout", "3")) == (
        "netgain train: worker 1 failed: RuntimeError: [gloo] Timed out waiting 3000ms for recv "
        "(a peer was silent for --collective-timeout 3 s)")


@pytest.mark.parametrize("last_line, alone", [
    ("RuntimeError: [gloo] Timed out waiting 3000ms for recv", True),
    ("_pickle.UnpicklingError: checkpoint ck: refused, it holds more than tensors", True),  # a hostile DCP file
    ("netgain.files.WriteError: cannot write ck.pt: No space left on device", True),
    ("RuntimeError: something unforeseen", False),
])
def test_failures_that_say_it_all_are_printed_without_their_traceback(last_line, alone):
    class Failed(Exception):
        error_index = 0

    assert explained(Failed(f"Traceback (most recent call last):\n  File \"x.py\", line 1\n{last_line}\n")) is alone


def test_an_fsdp_checkpoint_file_its_manifest_does_not_list_is_refused(tmp_path):
    folder = fake_sharded_checkpoint(tmp_path / "ck")
    manifest = folder / SHARDED_CHECKPOINT_FILE
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "files": {}}))  # verified nothing, resumed
    with pytest.raises(ValueError, match=r"\['__0_0.distcp'\] are not in its netgain.json's checksums"):
        config("--resume", str(folder), *FSDP)


@needs_proc_children
def test_frozen_peer_is_announced_and_ends_the_run(tmp_path, start_train):
    run = start_train("--task", "digits", "--codec", "gqsgd", "--steps", "1000000", "--eval-every", "0",
                      "--collective-timeout", "2", "--out", str(tmp_path))
    run.wait_for("%|", timeout=60)
    workers = run.workers()
    os.kill(workers[1], signal.SIGSTOP)
    start = time.monotonic()
    assert run.finish(timeout=30) == 1
    assert time.monotonic() - start < 15
    assert "netgain train: rank 0 has made no progress for 1 s while in step" in run.err
    assert "(a peer was silent for --collective-timeout 2 s)" in run.err
    assert "Traceback" not in run.err  # the closing line says it all
    assert not any(map(alive, workers))


def test_the_default_codec_is_auto_with_or_without_fsdp():
    """No --codec: auto (the fastest route per bucket); under --fsdp too, planned per shard position."""
    assert config("--task", "digits").codec == "auto"
    assert config("--task", "digits", *FSDP).codec == "auto"
