"""Checkpoints: written complete or not at all, recognised by their own id (never by a file name),
verified (zip CRC, or the SHA-256 of every --fsdp file) and read as data, never code; and checked
against the run that resumes them or the path they would replace. The Trainer's ranks hold the state."""

from __future__ import annotations

import hashlib
import json
import pickle
import reprlib
import sys
import uuid
import zipfile
from pathlib import Path

import torch

from netgain.files import (MANIFEST_MAX_BYTES, WriteError, machine_memory_bytes, require_regular_file, same_file,
                           write_atomically)
from netgain.train.config import SYNC_FIELDS, TrainConfig, flag
from netgain.train.tasks import TASK_CLASSES

CHECKPOINT_ID = "netgain_checkpoint"  # a unique id that netgain writes into every checkpoint it saves
CHECKPOINT_KEYS = {"step", "world_size", "config", "model", "optimizer", "comm"}
# --fsdp: a checkpoint is a DCP folder (every rank writes its shards) with this manifest of plain data
SHARDED_CHECKPOINT_FILE = "netgain.json"
SHARDED_CHECKPOINT_KEYS = {"step", "world_size", "config", CHECKPOINT_ID, "files"}  # files: name -> SHA-256
MAX_CHECKPOINT_FILES = 10_000  # a '{step}' path with --checkpoint-every: one file per checkpoint
# On --resume: these settings are taken from this run and announced; any other difference in
# RESUME_FIXED is refused by name (the model, the data stream or the codec state would not match).
RESUME_APPLIED = ("lr", "batch_size", "data")
RESUME_FIXED = ("task", "seed", "codec", "bits", "encoding", "ratio", "warmup_steps", "skip_1d", "rank", "factors",
                "comm_budget_ms", "replan_every", "kimad_lowrank_rank", "hidden_size", "layers", "seq_len", "replicas", "shards",
                *SYNC_FIELDS)
# routes a checkpoint is written by, and why one does not resume on the other
ROUTES = {"fsdp": "the model and optimizer are saved sharded under --fsdp and whole without",
          "sync": "under --sync its comm state is netgain.sync's (outer state, every rank's parameters), else the hook's",
          "local_route": "under --local-route its comm state is the route's (the hook's and, while local, every rank's "
                         "parameters and optimizer state), else the hook's"}


def check_checkpoint_paths(c: TrainConfig, checkpoint: dict | None) -> None:
    """A --checkpoint path that exists is replaced only when it is an earlier checkpoint of the same kind
    (netgain's id in it): nothing else a user has there is overwritten."""
    for path in checkpoint_paths(c, checkpoint["step"] if checkpoint else 0):
        if path.exists() and not is_netgain_checkpoint(path, sharded=c.fsdp):
            kind = "--fsdp checkpoint (a folder with netgain's " + SHARDED_CHECKPOINT_FILE + ")" if c.fsdp else "train checkpoint"
            raise ValueError(f"--checkpoint {path} exists and is not a netgain {kind}; a checkpoint replaces "
                             "only an earlier one: give a new path")


def checkpoint_paths(c: TrainConfig, start: int) -> dict[Path, int]:
    """Each path this run writes a checkpoint to, with the last step written there: counted, not looped
    over (--steps 10000000000 to one path is one path), and at most MAX_CHECKPOINT_FILES of them."""
    if not c.checkpoint:
        return {}
    if "{step}" not in c.checkpoint:
        return {Path(c.checkpoint): c.steps}
    every = c.checkpoint_every
    steps = range((start // every + 1) * every, c.steps, every) if every else range(0)
    if len(steps) + 1 > MAX_CHECKPOINT_FILES:
        raise ValueError(f"--checkpoint-every {every} writes {len(steps) + 1:,} files to --checkpoint {c.checkpoint} "
                         f"by --steps {c.steps}, more than {MAX_CHECKPOINT_FILES:,}: checkpoint less often, or give a "
                         "path without '{step}' (each checkpoint then replaces the one before)")
    return {Path(c.checkpoint.replace("{step}", str(step))): step for step in (*steps, c.steps)}


def is_netgain_checkpoint(path: Path, sharded: bool) -> bool:
    """Whether `path` holds a checkpoint netgain wrote (its id inside), of this kind: a torch.save file, or an
    --fsdp folder."""
    if path.is_dir() != sharded:
        return False
    try:
        return isinstance(read_checkpoint(str(path)).get(CHECKPOINT_ID), str)
    except ValueError:
        return False


def check_resume(c: TrainConfig, checkpoint: dict) -> None:
    """Refuse by name every setting that differs from the checkpoint (read_checkpoint's) and cannot be applied."""
    saved = checkpoint["config"]
    for route, why in ROUTES.items():
        if saved.get(route, False) != getattr(c, route):
            raise ValueError(f"--resume {c.resume} was written " + ("with" if saved.get(route) else "without")
                             + f" {flag(route)}, this run is " + ("with" if getattr(c, route) else "without") + f" it: {why}")
    if checkpoint["world_size"] != c.world_size:
        raise ValueError(f"--resume {c.resume} was written by {checkpoint['world_size']} workers, "
                         f"this run has {c.world_size}: the codec state is per worker")
    differ = [name for name in RESUME_FIXED if name in saved and saved[name] != getattr(c, name)]
    if differ:
        theirs = " ".join(f"{flag(name)} {saved[name]}" for name in differ)
        ours = " ".join(f"{flag(name)} {getattr(c, name)}" for name in differ)
        raise ValueError(f"--resume {c.resume} was trained with {theirs}; this run has {ours}: "
                         "a resumed run keeps these (repeat the checkpoint's, or start a new run)")
    if not c.fsdp:  # --fsdp: DCP checks each shard against the model as it loads
        check_saved_state(c, checkpoint)
    if checkpoint["step"] >= c.steps:
        raise ValueError(f"--steps {c.steps} is not beyond the checkpoint's step {checkpoint['step']}")
    for path, step in checkpoint_paths(c, checkpoint["step"]).items():
        if same_file(path, c.resume):
            raise ValueError(f"--checkpoint {c.checkpoint} would overwrite --resume {c.resume} at step {step}; "
                             "write to a new path (a '{step}' in it helps)")


def check_saved_state(c: TrainConfig, checkpoint: dict) -> None:
    """The saved weights have this run's parameter names and shapes, and the optimizer state is AdamW's
    for as many parameters: a file whose checksums hold can still be another model's, which failed in
    every worker, after startup, with a traceback."""
    with torch.device("meta"):
        model = TASK_CLASSES[c.task].model_of(c)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    state = checkpoint["model"]
    saved = ({name: tuple(t.shape) for name, t in state.items() if isinstance(t, torch.Tensor)}
             if isinstance(state, dict) else {})
    differ = sorted(name for name in expected.keys() | saved.keys() if expected.get(name) != saved.get(name))
    if differ or len(saved) != len(state or ()):
        raise ValueError(f"--resume {c.resume}: its model weights are not this run's model's (names or shapes "
                         f"differ: {reprlib.repr(differ)}): not a checkpoint of these settings")
    if _optimizer_parameters(checkpoint["optimizer"]) != len(list(model.parameters())):
        raise ValueError(f"--resume {c.resume}: its optimizer state is not AdamW's for this model's "
                         f"{len(list(model.parameters()))} parameters: not a checkpoint of these settings")


def _optimizer_parameters(state) -> int | None:
    """How many parameters a torch optimizer state_dict covers; None if it is not one."""
    groups = state.get("param_groups") if isinstance(state, dict) and isinstance(state.get("state"), dict) else None
    if not (isinstance(groups, list) and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)):
        return None
    return sum(len(g["params"]) for g in groups)


def resume_changes(c: TrainConfig) -> dict[str, tuple]:
    """The settings this resumed run takes over from the command line: name -> (checkpoint's, this run's)."""
    if not c.resume:
        return {}
    saved = read_checkpoint(c.resume)["config"]
    return {name: (saved.get(name), getattr(c, name)) for name in RESUME_APPLIED
            if saved.get(name) != getattr(c, name)}


# ------------------------------------------------------------------ reading


def read_checkpoint(path: str, map_location: str | torch.device = "cpu") -> dict:
    """torch.load with weights_only=True: a checkpoint is data, and an unrestricted pickle runs code.

    mmap: the parent's checks read the config without reading every tensor. A folder is an --fsdp
    checkpoint: its SHARDED_CHECKPOINT_FILE (JSON) only; the workers load the shards through DCP.
    verify_checkpoint checks the bytes.
    """
    if Path(path).is_dir():
        return read_sharded_checkpoint(path)
    require_regular_file(path, "--resume", machine_memory_bytes())
    with open(path, "rb") as f:
        archive = zipfile.is_zipfile(f)
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
    _check_fields(checkpoint, path)
    return checkpoint


def read_sharded_checkpoint(path: str) -> dict:
    """The plain data of an --fsdp checkpoint folder: its manifest (step, world size, config, files)."""
    manifest = Path(path) / SHARDED_CHECKPOINT_FILE
    try:
        require_regular_file(manifest, "--resume", MANIFEST_MAX_BYTES)
        checkpoint = json.loads(manifest.read_text())
    except (OSError, ValueError) as error:
        reason = error.strerror if isinstance(error, OSError) else error
        raise ValueError(f"--resume {path}: a folder without a readable {SHARDED_CHECKPOINT_FILE} is not a "
                         f"netgain --fsdp checkpoint ({reason})") from error
    if not isinstance(checkpoint, dict) or not SHARDED_CHECKPOINT_KEYS <= checkpoint.keys():
        raise ValueError(f"--resume {path}: its {SHARDED_CHECKPOINT_FILE} is not netgain's manifest (it needs the keys "
                         f"{', '.join(sorted(SHARDED_CHECKPOINT_KEYS))})")
    _check_fields(checkpoint, path)
    files = checkpoint["files"]
    if not (isinstance(files, dict) and all(_is_plain_name(name) and isinstance(digest, str)
                                            for name, digest in files.items())):
        raise ValueError(f"--resume {path}: its {SHARDED_CHECKPOINT_FILE}'s files must map names in the folder to "
                         "SHA-256 digests")
    return checkpoint


def _check_fields(checkpoint: dict, path: str) -> None:
    """The fields the checks read, of the types they need: a hostile file gets one line, not a traceback."""
    config = checkpoint["config"]
    fields = {"step": (checkpoint["step"], _is_count(checkpoint["step"], 0)),
              "world_size": (checkpoint["world_size"], _is_count(checkpoint["world_size"], 1)),
              "config": (config, isinstance(config, dict) and all(
                  isinstance(key, str) and (value is None or type(value) in (bool, int, float, str))
                  for key, value in config.items()))}
    if fields["config"][1]:
        fields["config.warmup_steps"] = (config.get("warmup_steps"), config.get("warmup_steps") is None
                                         or _is_count(config.get("warmup_steps"), 0))
        fields.update({f"config.{route}": (config.get(route), type(config.get(route, False)) is bool) for route in ROUTES})
    if CHECKPOINT_ID in checkpoint:
        fields[CHECKPOINT_ID] = (checkpoint[CHECKPOINT_ID], isinstance(checkpoint[CHECKPOINT_ID], str))
    bad = [f"{name} {reprlib.repr(value)}" for name, (value, ok) in fields.items() if not ok]
    if bad:
        raise ValueError(f"--resume {path}: not a netgain checkpoint, its fields hold the wrong types or values: "
                         f"{', '.join(bad)} (step: an integer >= 0, world_size >= 1, config: names to plain values)")


def _is_count(value, least: int) -> bool:
    return type(value) is int and value >= least


def _is_plain_name(name) -> bool:
    """A file right inside the folder: no separator, no '..' (a manifest names nothing outside its folder)."""
    return isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name and "\\" not in name


def verify_checkpoint(path: str) -> None:
    """Every byte of a checkpoint against its checksums, before a run uses it: a torch.save file's zip
    CRC-32s, an --fsdp folder's SHA-256s in its manifest. A flipped bit is refused, not trained on."""
    if Path(path).is_dir():
        files = read_sharded_checkpoint(path)["files"]
        unlisted = sorted({entry.name for entry in Path(path).iterdir()} - {*files, SHARDED_CHECKPOINT_FILE})
        if unlisted:  # a manifest listing no files verified nothing, and DCP read them all the same
            raise ValueError(f"--resume {path}: {reprlib.repr(unlisted)} are not in its {SHARDED_CHECKPOINT_FILE}'s "
                             "checksums: the checkpoint is damaged or not netgain's")
        for name, digest in files.items():
            if _sha256(Path(path) / name, "--resume") != digest:
                raise ValueError(f"--resume {path}: {name} does not match the SHA-256 in its {SHARDED_CHECKPOINT_FILE}: "
                                 "the checkpoint is damaged (a changed or truncated file)")
        return
    try:
        with zipfile.ZipFile(path) as archive:
            if any(info.compress_type != zipfile.ZIP_STORED for info in archive.infolist()):
                raise ValueError(f"--resume {path} holds compressed entries, which torch.save never writes: "
                                 "not a checkpoint netgain reads")
            damaged = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as error:
        raise ValueError(f"--resume {path}: the checkpoint is damaged ({error})") from error
    if damaged is not None:
        raise ValueError(f"--resume {path}: {damaged} fails its CRC-32 check: the checkpoint is damaged "
                         "(a changed or truncated file)")


def _sha256(path: Path, flag: str) -> str:
    require_regular_file(path, flag, None)  # read in chunks: any size
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# ------------------------------------------------------------------ writing


def write_checkpoint(path: Path, checkpoint: dict) -> None:
    """One torch.save file, with a new id: written beside `path` and renamed over it when complete, and only
    over an earlier netgain checkpoint (a user may have put a file there since the run checked)."""
    _require_replaceable(path, sharded=False)
    identified = {**checkpoint, CHECKPOINT_ID: uuid.uuid4().hex}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, lambda f: torch.save(identified, f))


def sharded_partial_path(path: Path, token: str) -> Path:
    """Where every rank writes an --fsdp checkpoint before it replaces `path`: a name no user file has."""
    return path.with_name(f".{path.name}.{token}.partial")


def finish_sharded_checkpoint(partial: Path, path: Path, step: int, world_size: int, config: dict) -> None:
    """Rank 0, once DCP has written every rank's files into `partial`: the manifest (their SHA-256s and a new
    id), then `partial` renamed to `path`. An earlier checkpoint at `path` goes: the files its manifest lists;
    anything else a user put in that folder stays, in the folder named on stderr."""
    _require_replaceable(path, sharded=True)
    files = {file.name: _sha256(file, "--checkpoint") for file in sorted(partial.iterdir())}
    manifest = {"step": step, "world_size": world_size, "config": config, CHECKPOINT_ID: uuid.uuid4().hex,
                "files": files}
    write_atomically(partial / SHARDED_CHECKPOINT_FILE, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
    if not path.exists():
        partial.rename(path)
        return
    earlier = read_sharded_checkpoint(str(path))
    replaced = path.with_name(f".{path.name}.{earlier[CHECKPOINT_ID]}.replaced")
    path.rename(replaced)
    partial.rename(path)
    for name in (*earlier["files"], SHARDED_CHECKPOINT_FILE):
        (replaced / name).unlink(missing_ok=True)
    try:
        replaced.rmdir()
    except OSError:
        print(f"netgain train: kept {replaced}: the files in the earlier checkpoint {path} that netgain did not "
              "write", file=sys.stderr)


def _require_replaceable(path: Path, sharded: bool) -> None:
    if path.exists() and not is_netgain_checkpoint(path, sharded):
        raise WriteError(f"cannot write the checkpoint {path}: something that is not a netgain checkpoint is "
                         "there now; it is left as it was")
