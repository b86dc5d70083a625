"""Checkpoints: reading them (as data, never code), and checking one against the run that resumes it
or the path it would replace. The Trainer writes them (its ranks hold the state)."""

from __future__ import annotations

import json
import pickle
import zipfile
from pathlib import Path

import torch

from netgain.train.config import TrainConfig, flag

CHECKPOINT_KEYS = {"step", "world_size", "config", "model", "optimizer", "comm"}
# --fsdp: a checkpoint is a DCP folder (every rank writes its shards) with this file of plain data
SHARDED_CHECKPOINT_FILE = "netgain.json"
SHARDED_CHECKPOINT_KEYS = {"step", "world_size", "config"}
# On --resume: these settings are taken from this run and announced; any other difference in
# RESUME_FIXED is refused by name (the model, the data stream or the codec state would not match).
RESUME_APPLIED = ("lr", "batch_size", "data")
RESUME_FIXED = ("task", "seed", "codec", "bits", "encoding", "ratio", "warmup_steps", "skip_1d", "rank", "factors",
                "comm_budget_ms", "replan_every", "kimad_lowrank_rank", "hidden_size", "layers", "seq_len", "replicas", "shards")


def check_checkpoint_paths(c: TrainConfig, checkpoint: dict | None) -> None:
    """A --checkpoint path that exists is replaced only when it is an earlier checkpoint of the same kind:
    nothing else a user has there is overwritten."""
    start = checkpoint["step"] if checkpoint else 0
    for step in _checkpoint_steps(c, start):
        path = Path(c.checkpoint.replace("{step}", str(step)))
        if not path.exists():
            continue
        earlier = (path / SHARDED_CHECKPOINT_FILE).is_file() if c.fsdp else path.is_file() and _is_checkpoint(path)
        if not earlier:
            kind = "--fsdp checkpoint (a folder with " + SHARDED_CHECKPOINT_FILE + ")" if c.fsdp else "train checkpoint"
            raise ValueError(f"--checkpoint {path} exists and is not a netgain {kind}; a checkpoint replaces "
                             "only an earlier one: give a new path")


def _is_checkpoint(path: Path) -> bool:
    try:
        read_checkpoint(str(path))
    except ValueError:
        return False
    return True


def check_resume(c: TrainConfig, checkpoint: dict) -> None:
    """Refuse by name every setting that differs from the checkpoint (read_checkpoint's) and cannot be applied."""
    saved = checkpoint["config"]
    if saved.get("fsdp", False) != c.fsdp:
        raise ValueError(f"--resume {c.resume} was written " + ("with" if saved.get("fsdp") else "without")
                         + " --fsdp, this run is " + ("with" if c.fsdp else "without") + " it: the model and "
                         "optimizer are saved sharded under --fsdp and whole without")
    if checkpoint["world_size"] != c.world_size:
        raise ValueError(f"--resume {c.resume} was written by {checkpoint['world_size']} workers, "
                         f"this run has {c.world_size}: the codec state is per worker")
    differ = [name for name in RESUME_FIXED if name in saved and saved[name] != getattr(c, name)]
    if differ:
        theirs = " ".join(f"{flag(name)} {saved[name]}" for name in differ)
        ours = " ".join(f"{flag(name)} {getattr(c, name)}" for name in differ)
        raise ValueError(f"--resume {c.resume} was trained with {theirs}; this run has {ours}: "
                         "a resumed run keeps these (repeat the checkpoint's, or start a new run)")
    if checkpoint["step"] >= c.steps:
        raise ValueError(f"--steps {c.steps} is not beyond the checkpoint's step {checkpoint['step']}")
    for step in _checkpoint_steps(c, checkpoint["step"]):
        if Path(c.checkpoint.replace("{step}", str(step))).resolve() == Path(c.resume).resolve():
            raise ValueError(f"--checkpoint {c.checkpoint} would overwrite --resume {c.resume} at step {step}; "
                             "write to a new path (a '{step}' in it helps)")


def read_sharded_checkpoint(path: str) -> dict:
    """The plain data of an --fsdp checkpoint folder (step, world size, config)."""
    try:
        checkpoint = json.loads((Path(path) / SHARDED_CHECKPOINT_FILE).read_text())
    except OSError as error:
        raise ValueError(f"--resume {path}: a folder without a readable {SHARDED_CHECKPOINT_FILE} is not a "
                         f"netgain --fsdp checkpoint ({error.strerror or error})") from error
    except json.JSONDecodeError as error:
        raise ValueError(f"--resume {path}: its {SHARDED_CHECKPOINT_FILE} is not JSON ({error})") from error
    if not isinstance(checkpoint, dict) or not SHARDED_CHECKPOINT_KEYS <= checkpoint.keys():
        raise ValueError(f"--resume {path}: its {SHARDED_CHECKPOINT_FILE} needs the keys "
                         f"{', '.join(sorted(SHARDED_CHECKPOINT_KEYS))}")
    return checkpoint


def resume_changes(c: TrainConfig) -> dict[str, tuple]:
    """The settings this resumed run takes over from the command line: name -> (checkpoint's, this run's)."""
    if not c.resume:
        return {}
    saved = read_checkpoint(c.resume)["config"]
    return {name: (saved.get(name), getattr(c, name)) for name in RESUME_APPLIED
            if saved.get(name) != getattr(c, name)}


def read_checkpoint(path: str, map_location: str | torch.device = "cpu") -> dict:
    """torch.load with weights_only=True: a checkpoint is data, and an unrestricted pickle runs code.

    mmap: the parent's checks read the config without reading every tensor. A folder is an --fsdp
    checkpoint: its SHARDED_CHECKPOINT_FILE (JSON) only; the workers load the shards through DCP.
    """
    if Path(path).is_dir():
        return read_sharded_checkpoint(path)
    try:
        with open(path, "rb") as f:
            archive = zipfile.is_zipfile(f)
    except OSError as error:
        raise ValueError(f"--resume {path}: {error.strerror or error}") from error
    if not archive:
        raise ValueError(f"--resume {path} is not a zip archive, the format torch.save writes: not a checkpoint "
                         "netgain can read")
    try:
        checkpoint = torch.load(path, map_location=map_location, weights_only=True, mmap=True)
    except OSError as error:
        raise ValueError(f"--resume {path}: {error.strerror or error}") from error
    except pickle.UnpicklingError as error:
        reason = next((line for line in str(error).splitlines() if "GLOBAL" in line or "Unsupported" in line),
                      str(error).splitlines()[0])
        raise ValueError(f"--resume {path}: refused, it holds more than tensors and plain data "
                         f"(netgain loads checkpoints with weights_only=True, so they cannot run code): {reason}") from error
    except Exception as error:  # torch.load raises KeyError, RuntimeError... on files that are no checkpoint
        raise ValueError(f"--resume {path} is not a torch checkpoint ({type(error).__name__}: {error})") from error
    if not isinstance(checkpoint, dict) or not CHECKPOINT_KEYS <= checkpoint.keys():
        raise ValueError(f"--resume {path} is not a netgain train checkpoint (it needs the keys "
                         f"{', '.join(sorted(CHECKPOINT_KEYS))})")
    return checkpoint


def _checkpoint_steps(c: TrainConfig, start: int) -> list[int]:
    if not c.checkpoint:
        return []
    every = [s for s in range(start + 1, c.steps) if c.checkpoint_every and s % c.checkpoint_every == 0]
    return every + [c.steps]
