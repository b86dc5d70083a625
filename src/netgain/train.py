"""`netgain train`: data-parallel training with a gradient codec on a DDP communication hook.

Spawns `--world-size` local gloo workers, or runs as one rank when launched by torchrun (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT set; nccl when CUDA is available). Every batch is a pure
function of (seed, step, rank), so a run resumed from a checkpoint equals a straight run.

With --fsdp the model is fully_shard-ed (FSDP2) over the "shard" dimension of a (replicate, shard)
DeviceMesh of --replicas x --shards ranks, and the codec carries the all-reduce across replicas
(netgain.comm.fsdp); its checkpoints are torch.distributed.checkpoint folders.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import pickle
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import netgain.comm as comm
import netgain.comm.fsdp as comm_fsdp
from netgain import data, models
from netgain.comm import bandwidth, fused
from netgain.cost import network as net

TASKS = ("lm", "digits")
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
DEFAULT_BATCH_SIZE = {"lm": 16, "digits": 32}  # per worker: sequences of --seq-len bytes, or images
COMM_STATISTICS = ("wait_s", "wire_bytes", "raw_bytes", "encode_s", "decode_s", "comm_s")  # per step
BUCKET_STATISTICS = ("numel", "codec", "wire_bytes", "comm_s")  # per step and bucket: what the link fit reads
LINK_FIT_SAMPLES = 256  # the link is fitted to the run's last 256 bucket collectives (as Kimad's monitor keeps)
ADAPTIVE_STATISTICS = ("bandwidth_Bps", "budget_s", "margin", "predicted_comm_s", "link_comm_s", "plan", "plan_fits",
                       "climbing")  # per step, kimad only
CODEC_CHOICES = comm.CODEC_NAMES + comm.baselines.BASELINES
DEFAULT_CODEC = "gqsgd"  # at the --bits and --encoding defaults, 8 and packed (why: --codec's help)
VALIDATION_BATCHES = 16  # the fixed held-out set: 16 batches of 8 sequences (lm)
VALIDATION_BATCH_SIZE = 8
FINAL_TRAIN_LOSS_WINDOW = 10  # final train loss = mean over the last 10 steps (one step is noise)
COLLECTIVE_TIMEOUT_S = 600  # default --collective-timeout: a dead peer ends the job instead of hanging it
SILENCE_NOTICE_S = 30  # a rank that makes no progress this long says so (at most half the collective timeout)
LOCAL_WORKERS_PER_CPU = 4  # --world-size cap for local spawn
WORKER_GRACE_S = 2  # after a worker fails or a signal, the others get this long to exit before SIGKILL
DEFAULT_WORLD_SIZE = 2
CHECKPOINT_KEYS = {"step", "world_size", "config", "model", "optimizer", "comm"}
# --fsdp: a checkpoint is a DCP folder (every rank writes its shards) with this file of plain data
SHARDED_CHECKPOINT_FILE = "netgain.json"
SHARDED_CHECKPOINT_KEYS = {"step", "world_size", "config"}
# On --resume: these settings are taken from this run and announced; any other difference in
# RESUME_FIXED is refused by name (the model, the data stream or the codec state would not match).
RESUME_APPLIED = ("lr", "batch_size", "data")
RESUME_FIXED = ("task", "seed", "codec", "bits", "encoding", "ratio", "warmup_steps", "skip_1d", "rank", "factors",
                "comm_budget_ms", "replan_every", "kimad_lowrank_rank", "hidden_size", "layers", "seq_len", "replicas", "shards")


@dataclass(frozen=True)
class TrainConfig:
    task: str
    codec: str
    bits: int
    encoding: str
    ratio: float
    warmup_steps: int
    skip_1d: bool
    rank: int
    factors: str
    comm_budget_ms: float | None
    replan_every: int
    kimad_lowrank_rank: int | None
    steps: int
    batch_size: int
    lr: float
    world_size: int
    fsdp: bool
    replicas: int | None  # --fsdp only: the mesh's (replicate, shard) sizes, world_size = replicas * shards
    shards: int | None
    seed: int
    data: str | None
    eval_every: int
    out: str
    checkpoint: str | None
    checkpoint_every: int
    resume: str | None
    hidden_size: int
    layers: int
    seq_len: int
    collective_timeout: float


def configure(parser: argparse.ArgumentParser) -> None:
    bits = comm.codecs.BITS_RANGE
    parser.add_argument("--task", choices=TASKS, default="lm",
                        help="lm: byte-level Llama on the stdlib source (or --data); digits: MLP on sklearn digits")
    parser.add_argument("--codec", choices=CODEC_CHOICES, default=DEFAULT_CODEC,
                        help=f"netgain codec (default {DEFAULT_CODEC} --bits 8 --encoding packed: unbiased, summed by "
                        "one allreduce, 3.5x fewer bytes than fp32 at 2 workers and within 1%% of its validation loss "
                        "on the default job; none: fp32, as plain DDP); kimad/kimad+ adapt to the measured bandwidth; "
                        "ddp, ddp-fp16, ddp-powersgd are PyTorch's own hooks, for comparison")
    parser.add_argument("--bits", type=int, default=8,
                        help=f"quantisation bits, {bits.start}..{bits.stop - 1} (qsgd, gqsgd, gqsgd-exp)")
    parser.add_argument("--encoding", choices=comm.codecs.ENCODINGS, default="packed",
                        help="gqsgd wire encoding (int8: --bits 8 only)")
    parser.add_argument("--ratio", type=float, default=0.01, help="fraction of coordinates sent, in (0, 1] (topk, randomk)")
    parser.add_argument("--warmup-steps", type=int,
                        help="uncompressed steps before the codec starts (default: 2 for lowrank, as PowerSGD; 0 for the other "
                        "netgain codecs; ddp-powersgd runs at least 2 whatever this says; on --resume the checkpoint's)")
    parser.add_argument("--skip-1d", action="store_true", help="send 1-D gradients (biases, norm weights) uncompressed")
    parser.add_argument("--rank", type=int, default=4, help="matrix approximation rank, >= 1 (lowrank, ddp-powersgd)")
    parser.add_argument("--factors", choices=comm.lowrank.FACTORS, default="gqsgd",
                        help="how lowrank's factors travel: gqsgd (--bits-bit Global-QSGD codes) or fp32 (as PowerSGD)")
    parser.add_argument("--comm-budget-ms", type=float,
                        help="kimad: communication time target per step, > 0 (default: the measured backward time)")
    parser.add_argument("--replan-every", type=int, default=10,
                        help="kimad: re-plan every N >= 1 steps (and whenever the bandwidth moves by more than 20%%)")
    parser.add_argument("--kimad-lowrank-rank", type=int,
                        help="kimad: add low rank at this rank >= 1 (8-bit gqsgd factors, error feedback) to the plan's "
                        "options, in place of top-k (default: no low rank; top-k 0.001, 0.01, 0.1)")
    parser.add_argument("--steps", type=int, default=300, help="total optimizer steps, counted from 0 also when resuming")
    parser.add_argument("--batch-size", type=int, help="per worker (default: lm 16 sequences, digits 32 images)")
    parser.add_argument("--lr", type=float, default=3e-3,
                        help="AdamW learning rate (constant; on --resume it replaces the checkpoint's)")
    parser.add_argument("--world-size", type=int,
                        help=f"local CPU workers to spawn on gloo (default {DEFAULT_WORLD_SIZE}; under --fsdp "
                        f"--replicas x --shards), at most {LOCAL_WORKERS_PER_CPU} per CPU "
                        "(under torchrun its WORLD_SIZE applies)")
    parser.add_argument("--fsdp", action="store_true",
                        help="shard the model with FSDP2 (fully_shard) inside each replica and send the all-reduce "
                        "across replicas through the codec (HSDP); codecs: " + ", ".join(comm_fsdp.CODECS))
    parser.add_argument("--replicas", type=int,
                        help="--fsdp: model replicas, the mesh's replicate dimension (the hop the codec compresses)")
    parser.add_argument("--shards", type=int,
                        help="--fsdp: ranks each replica is sharded over, the mesh's shard dimension")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", help="lm task: a text file or a folder of text files (default: the stdlib source)")
    parser.add_argument("--eval-every", type=int, default=50, help="validate every N steps, 0: only at the end")
    parser.add_argument("--out", help="output folder for record.json and loss.png "
                        "(default runs/<codec>-<time>, with a suffix if that folder exists)")
    parser.add_argument("--checkpoint", help="save model, optimizer, codec state and step here at the end "
                        "(and every --checkpoint-every steps); a '{step}' in the path is replaced by the step; "
                        "with --fsdp a torch.distributed.checkpoint folder")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="also checkpoint every N steps (0: only at the end)")
    parser.add_argument("--resume", help="continue from a checkpoint written by --checkpoint (--lr, --batch-size "
                        "and --data may differ, and are announced; other settings must match)")
    parser.add_argument("--hidden-size", type=int, default=192, help="lm model width")
    parser.add_argument("--layers", type=int, default=4, help="lm decoder layers")
    parser.add_argument("--seq-len", type=int, default=128, help="lm sequence length in bytes")
    parser.add_argument("--collective-timeout", type=float, default=COLLECTIVE_TIMEOUT_S,
                        help=f"seconds a rank waits for a silent peer before the run fails (default "
                        f"{COLLECTIVE_TIMEOUT_S}); a rank without progress says so after "
                        f"{SILENCE_NOTICE_S} s (or half this timeout)")


def run(args: argparse.Namespace) -> int:
    config = build_config(args)
    if _is_rank_zero():
        config = prepare_outputs(config)
        for name, (old, new) in resume_changes(config).items():
            print(f"netgain train: --resume: {_flag(name)} {new} replaces the checkpoint's {old}", file=sys.stderr)
    if launched_by_torchrun():
        train_worker(int(os.environ["RANK"]), config.world_size, config, "env://")
        return 0
    return spawn_workers(config)


def build_config(args: argparse.Namespace) -> TrainConfig:
    """The run's settings, every one checked here in the parent, before any worker starts."""
    world_size = resolve_world_size(args)
    batch_size = DEFAULT_BATCH_SIZE[args.task] if args.batch_size is None else args.batch_size
    checkpoint = read_checkpoint(args.resume) if args.resume else None  # read once for every check below
    warmup_steps = args.warmup_steps
    if warmup_steps is None:  # the codec's default; on --resume the checkpoint's, which may predate that default
        saved = checkpoint["config"].get("warmup_steps") if checkpoint else None
        warmup_steps = comm.default_warmup_steps(args.codec) if saved is None else saved
    config = TrainConfig(task=args.task, codec=args.codec, bits=args.bits, encoding=args.encoding,
                         ratio=args.ratio, warmup_steps=warmup_steps, skip_1d=args.skip_1d,
                         rank=args.rank, factors=args.factors,
                         comm_budget_ms=args.comm_budget_ms, replan_every=args.replan_every,
                         kimad_lowrank_rank=args.kimad_lowrank_rank, steps=args.steps,
                         batch_size=batch_size, lr=args.lr, world_size=world_size, fsdp=args.fsdp,
                         replicas=args.replicas, shards=args.shards, seed=args.seed,
                         data=args.data, eval_every=args.eval_every, out=args.out, checkpoint=args.checkpoint,
                         checkpoint_every=args.checkpoint_every, resume=args.resume,
                         hidden_size=args.hidden_size, layers=args.layers, seq_len=args.seq_len,
                         collective_timeout=args.collective_timeout)
    for name in ("data", "out", "checkpoint", "resume"):  # '' is a typo, never "not given"
        _require(getattr(args, name) != "", name, "must not be empty (leave the flag out instead)", "''")
    check_numbers(config)
    if not launched_by_torchrun():
        check_local_world_size(config.world_size)
    check_data(config)
    if config.fsdp:
        check_fsdp(config, checkpoint)
    if config.checkpoint:
        check_checkpoint_paths(config, checkpoint)
    if checkpoint:
        check_resume(config, checkpoint)
    return config


def resolve_world_size(args: argparse.Namespace) -> int:
    """--world-size, or under --fsdp --replicas x --shards (a --world-size or torchrun WORLD_SIZE must agree)."""
    launched = int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else None
    if not args.fsdp:
        for name in ("replicas", "shards"):
            if getattr(args, name) is not None:
                raise ValueError(f"{_flag(name)} applies with --fsdp only")
        return launched or (DEFAULT_WORLD_SIZE if args.world_size is None else args.world_size)
    if args.replicas is None or args.shards is None:
        raise ValueError("--fsdp needs --replicas R and --shards S (R x S workers, a mesh of R replicas "
                         "each sharded over S ranks)")
    for name in ("replicas", "shards"):
        _require(getattr(args, name) >= 1, name, "must be at least 1", getattr(args, name))
    mesh = args.replicas * args.shards
    given = ("torchrun's WORLD_SIZE", launched) if launched else ("--world-size", args.world_size)
    if given[1] is not None and given[1] != mesh:
        raise ValueError(f"{given[0]} {given[1]} differs from --replicas {args.replicas} x --shards {args.shards} "
                         f"= {mesh}: under --fsdp the world size is replicas x shards"
                         + ("" if launched else " (leave --world-size out)"))
    return mesh


def check_fsdp(c: TrainConfig, checkpoint: dict | None) -> None:
    """The codecs that run on FSDP's cross-replica hop, and checkpoint folders that are netgain's to replace."""
    if c.codec not in comm_fsdp.CODECS:
        raise ValueError(f"--codec {c.codec} does not run under --fsdp; choose one of {', '.join(comm_fsdp.CODECS)} "
                         "(topk/randomk keep per-rank EF21 buffers and kimad/kimad+ plans that FSDP does not "
                         "shard; ddp, ddp-fp16, ddp-powersgd are DDP hooks)")


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


def check_numbers(c: TrainConfig) -> None:
    """Ranges of every numeric setting, named as on the command line."""
    for name in ("steps", "batch_size", "world_size", "seq_len", "rank", "replan_every", "hidden_size", "layers"):
        _require(getattr(c, name) >= 1, name, "must be at least 1", getattr(c, name))
    for name in ("warmup_steps", "eval_every"):
        _require(getattr(c, name) >= 0, name, "must be 0 or more", getattr(c, name))
    _require(0 <= c.seed < 2**32, "seed", f"must be in 0..{2**32 - 1}", c.seed)
    _require(math.isfinite(c.lr) and c.lr > 0, "lr", "must be a finite number > 0", c.lr)
    _require(math.isfinite(c.collective_timeout) and c.collective_timeout > 0, "collective_timeout",
             "must be a finite number of seconds > 0", c.collective_timeout)
    _require(c.comm_budget_ms is None or (math.isfinite(c.comm_budget_ms) and c.comm_budget_ms > 0),
             "comm_budget_ms", "must be a finite number > 0", c.comm_budget_ms)
    _require(0 < c.ratio <= 1, "ratio", "must be in (0, 1]", c.ratio)
    _require(c.kimad_lowrank_rank is None or (c.kimad_lowrank_rank >= 1 and c.codec in comm.ADAPTIVE_MODES),
             "kimad_lowrank_rank", "must be at least 1, and only with --codec kimad or kimad+", c.kimad_lowrank_rank)
    bits = comm.codecs.BITS_RANGE
    _require(c.bits in bits, "bits", f"must be in {bits.start}..{bits.stop - 1}", c.bits)
    _require(not (c.codec == "gqsgd" and c.encoding == "int8" and c.bits != 8), "bits",
             "must be 8 with --encoding int8 (or use --encoding packed)", c.bits)
    _require(c.checkpoint_every == 0 or (c.checkpoint_every > 0 and c.checkpoint), "checkpoint_every",
             "must be 0 or more, and more than 0 needs --checkpoint", c.checkpoint_every)
    if c.task == "lm":
        models.check_byte_llama(c.hidden_size, c.layers)


def check_local_world_size(world_size: int) -> None:
    """More local workers than this only time-slice the cores: 64 on 2 cores sat silent for minutes."""
    cpus = os.cpu_count() or 1
    limit = LOCAL_WORKERS_PER_CPU * cpus
    if world_size > limit:
        raise ValueError(f"--world-size {world_size}: at most {limit} local workers on this machine's {cpus} "
                         f"CPUs ({LOCAL_WORKERS_PER_CPU} per CPU; more spend minutes starting and time-slicing "
                         "the cores); for more ranks, launch under torchrun on more machines")


def check_data(c: TrainConfig) -> None:
    """--data must exist and hold a sequence per rank and for validation (the stdlib source does)."""
    if c.data is None:
        return
    if c.task != "lm":
        raise ValueError("--data applies to --task lm only")
    try:
        corpus = data.ByteCorpus.from_files(data.text_files(c.data))
    except OSError as error:
        raise ValueError(f"--data {c.data}: cannot read {error.filename} ({error.strerror})") from error
    corpus.require_sequences(c.world_size, c.seq_len, f"--data {c.data}")


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
        theirs = " ".join(f"{_flag(name)} {saved[name]}" for name in differ)
        ours = " ".join(f"{_flag(name)} {getattr(c, name)}" for name in differ)
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


def prepare_outputs(c: TrainConfig) -> TrainConfig:
    """Make --out (or a fresh default folder) and check that it and --checkpoint's folder take files."""
    out = Path(c.out) if c.out else _new_run_folder(c.codec)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"--out {out}: cannot create it ({error.strerror or error})") from error
    _require_writable(out, "--out")
    if c.checkpoint:
        folder = Path(c.checkpoint.replace("{step}", "0")).parent
        while not folder.exists():
            folder = folder.parent
        _require_writable(folder, "--checkpoint")
    return replace(c, out=str(out))


def _new_run_folder(codec: str) -> Path:
    """runs/<codec>-<time>, with -2, -3... if a run started in the same second already made it."""
    base = Path("runs") / f"{codec}-{time.strftime('%Y%m%d-%H%M%S')}"
    base.parent.mkdir(parents=True, exist_ok=True)
    for suffix in ("", *(f"-{n}" for n in range(2, 1000))):
        try:
            (path := base.with_name(base.name + suffix)).mkdir()
            return path
        except FileExistsError:
            continue
    raise ValueError(f"--out: runs/ holds 999 runs named {base.name}; give --out")


def _require_writable(folder: Path, flag: str) -> None:
    if not folder.is_dir():
        raise ValueError(f"{flag}: {folder} is not a folder")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise ValueError(f"{flag}: cannot write to {folder} ({error.strerror or error})") from error


def _checkpoint_steps(c: TrainConfig, start: int) -> list[int]:
    if not c.checkpoint:
        return []
    every = [s for s in range(start + 1, c.steps) if c.checkpoint_every and s % c.checkpoint_every == 0]
    return every + [c.steps]


def _require(ok: bool, name: str, rule: str, value) -> None:
    if not ok:
        raise ValueError(f"{_flag(name)} {rule}, got {value}")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _is_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0" or not launched_by_torchrun()


def launched_by_torchrun() -> bool:
    return all(name in os.environ for name in TORCHRUN_VARIABLES)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- local workers


def worker_start_method() -> str:
    """"forkserver" where the platform has it: one server process imports torch and netgain once, and
    every worker is a fork of it (0.1-0.2 s each) instead of a fresh interpreter importing them again
    (3-5 s of CPU each, which several workers on few cores pay in turn). The server never touches a
    GPU or a thread pool, so its forks are as clean as spawned processes. Else "spawn". A worker prints
    wherever stdout pointed when the server started: a process that redirects its fd 1 between two runs
    (pytest's capfd) gets the second run's output where the first's went."""
    if "forkserver" not in torch.multiprocessing.get_all_start_methods():
        return "spawn"
    torch.multiprocessing.set_forkserver_preload(["netgain.train"])  # no effect on a server already running
    return "forkserver"


def spawn_workers(config: TrainConfig) -> int:
    """Local gloo workers; a SIGINT or SIGTERM to this parent stops them too (else they trained on)."""
    init_method = f"tcp://127.0.0.1:{free_port()}"
    print(f"netgain train: starting {config.world_size} local workers", file=sys.stderr)
    received: list[int] = []
    with _record_signals(received):
        context = torch.multiprocessing.start_processes(
            train_worker, args=(config.world_size, config, init_method, True), nprocs=config.world_size,
            join=False, start_method=worker_start_method())
        try:
            while not received:
                if context.join(timeout=0.2, grace_period=WORKER_GRACE_S):
                    return 0
        except (torch.multiprocessing.ProcessRaisedException, torch.multiprocessing.ProcessExitedException) as error:
            print(f"{error}\n{worker_failure(error, config)}", file=sys.stderr)
            return 1
        stop_workers(context.processes)
    name = signal.Signals(received[0]).name
    print(f"netgain train: {name}: stopped the {config.world_size} workers", file=sys.stderr)
    return 128 + received[0]


def worker_failure(error: Exception, config: TrainConfig) -> str:
    """One closing line under the worker's traceback: which worker, and why (its last exception line)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    reason = next((line for line in reversed(lines) if re.match(r"[\w.]*(Error|Exception)\b", line)),
                  lines[-1] if lines else "")
    line = f"netgain train: worker {error.error_index} failed: {reason}"
    if re.search(r"timed out|timeout", str(error), re.IGNORECASE):  # gloo and NCCL word it differently
        line += f" (a peer was silent for --collective-timeout {config.collective_timeout:g} s)"
    return line


@contextmanager
def _record_signals(received: list[int]):
    """SIGINT and SIGTERM append to `received` instead of raising, so no worker is left unreferenced."""
    previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stop_workers(processes) -> None:
    """SIGTERM, then SIGKILL for any worker still alive after WORKER_GRACE_S (a stopped one, say)."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + WORKER_GRACE_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()


# ---------------------------------------------------------------- tasks


class LanguageModelTask:
    """Next-byte prediction with a small Llama; validation loss in nats per byte."""

    def __init__(self, config: TrainConfig):
        files = data.text_files(config.data) if config.data else data.stdlib_source_files()
        self.corpus = data.ByteCorpus.from_files(files)
        self.config = config
        self.validation = self.corpus.validation_batches(VALIDATION_BATCHES, VALIDATION_BATCH_SIZE,
                                                         config.seq_len)

    def build_model(self) -> nn.Module:
        return models.byte_llama(self.config.hidden_size, self.config.layers, self.config.seq_len)

    @staticmethod
    def blocks(model: nn.Module) -> list[nn.Module]:
        """--fsdp: one FSDP group per decoder layer (the root holds embeddings, norm and head)."""
        return list(model.model.layers)

    def train_loss(self, model: nn.Module, step: int, rank: int, world_size: int,
                   device: torch.device) -> torch.Tensor:
        c = self.config
        ids = self.corpus.train_batch(c.seed, step, rank, world_size, c.batch_size, c.seq_len).to(device)
        return model(input_ids=ids, labels=ids).loss

    @torch.no_grad()
    def evaluate(self, model: nn.Module, rank: int, world_size: int, device: torch.device) -> dict:
        """Every rank runs as many forwards (an FSDP forward all-gathers): a rank short of a batch weighs one 0."""
        sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, batches
        mine = self.validation[rank::world_size]
        for i in range(-(-len(self.validation) // world_size)):
            ids = (mine[i] if i < len(mine) else self.validation[0]).to(device)
            weight = float(i < len(mine))
            sums += torch.tensor([weight * model(input_ids=ids, labels=ids).loss.item(), weight],
                                 dtype=torch.float64, device=device)
        dist.all_reduce(sums)
        return {"val_loss": (sums[0] / sums[1]).item()}


class DigitsTask:
    """Classify sklearn's 8x8 digits with an MLP: a convergence check that runs in seconds."""

    def __init__(self, config: TrainConfig):
        self.digits = data.Digits.load()
        self.config = config

    def build_model(self) -> nn.Module:
        return models.digits_mlp()

    @staticmethod
    def blocks(model: nn.Module) -> list[nn.Module]:
        """--fsdp: the MLP is one FSDP group (the root's)."""
        return []

    def train_loss(self, model: nn.Module, step: int, rank: int, world_size: int,
                   device: torch.device) -> torch.Tensor:
        c = self.config
        x, y = self.digits.train_batch(c.seed, step, rank, world_size, c.batch_size)
        return F.cross_entropy(model(x.to(device)), y.to(device))

    @torch.no_grad()
    def evaluate(self, model: nn.Module, rank: int, world_size: int, device: torch.device) -> dict:
        start, stop = data.shard(len(self.digits.test_y), rank, world_size)
        x, y = self.digits.test_x[start:stop].to(device), self.digits.test_y[start:stop].to(device)
        logits = model(x)
        sums = torch.tensor([F.cross_entropy(logits, y, reduction="sum").item(),
                             (logits.argmax(1) == y).sum().item(), len(y)],
                            dtype=torch.float64, device=device)
        dist.all_reduce(sums)
        return {"val_loss": (sums[0] / sums[2]).item(), "val_accuracy": (sums[1] / sums[2]).item()}


TASK_CLASSES = {"lm": LanguageModelTask, "digits": DigitsTask}


# ---------------------------------------------------------------- the worker


def train_worker(rank: int, world_size: int, config: TrainConfig, init_method: str, local: bool = False) -> None:
    """One data-parallel rank: train, validate, checkpoint; rank 0 reports."""
    if local:  # Ctrl-C reaches the whole process group: the parent alone handles it and stops the workers
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    cuda = torch.cuda.is_available() and not local
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if local:  # local workers split the machine's cores instead of oversubscribing them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    progress = SilenceNotice(rank, config.collective_timeout)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=config.collective_timeout))  # the hook's own group takes it too
    trainer = Trainer(config, rank, world_size, device, progress)
    try:
        trainer.train()
    finally:
        trainer.comm_state.close()  # buckets still queued on the communication thread finish first
    del trainer
    gc.collect()  # DDP objects in reference cycles die now, not at exit after their group is gone (SIGABRT)
    progress.beat("finishing")
    dist.barrier()  # no rank tears its process group down while a peer still uses it
    dist.destroy_process_group()
    progress.close()


class SilenceNotice:
    """Says on stderr when this rank has made no progress for a while: a silent peer, not a silent hang."""

    def __init__(self, rank: int, timeout_s: float):
        self.rank, self.timeout_s = rank, timeout_s
        self.after_s = min(SILENCE_NOTICE_S, timeout_s / 2)
        self.mark = ("joining the other workers", time.monotonic())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="netgain-silence-notice", daemon=True)
        self._thread.start()

    def beat(self, doing: str) -> None:
        self.mark = (doing, time.monotonic())

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        told = None
        while not self._stop.wait(self.after_s / 4):
            doing, since = self.mark
            silent = time.monotonic() - since
            if silent >= self.after_s and told != (since, int(silent // self.after_s)):
                told = (since, int(silent // self.after_s))
                print(f"netgain train: rank {self.rank} has made no progress for {silent:.0f} s while {doing}: "
                      f"a peer may be stuck or gone, or a codec compiling its kernels (the run fails after --collective-timeout "
                      f"{self.timeout_s:g} s of waiting)", file=sys.stderr, flush=True)


class Trainer:
    def __init__(self, config: TrainConfig, rank: int, world_size: int, device: torch.device,
                 progress: SilenceNotice):
        self.config, self.rank, self.world_size, self.device = config, rank, world_size, device
        self.progress = progress
        progress.beat("building the model and codec")
        self.task = TASK_CLASSES[config.task](config)
        torch.manual_seed(config.seed)  # identical initialisation on every rank
        self.module = self.task.build_model().to(device)  # what evaluation and the report see
        codec = dict(bits=config.bits, encoding=config.encoding, rank=config.rank, factors=config.factors,
                     warmup_steps=config.warmup_steps, skip_1d=config.skip_1d, seed=config.seed)
        if config.fsdp:  # FSDP2 inside each replica; the codec on the all-reduce across replicas
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(device.type, (config.replicas, config.shards),
                                    mesh_dim_names=(comm_fsdp.REPLICATE, comm_fsdp.SHARD))
            for block in self.task.blocks(self.module):
                fully_shard(block, mesh=mesh[comm_fsdp.SHARD])
            self.model = fully_shard(self.module, mesh=mesh[comm_fsdp.SHARD])
            self.comm_state = comm_fsdp.register(self.model, mesh, config.codec, **codec)
        else:
            self.model = DistributedDataParallel(self.module, device_ids=[device] if device.type == "cuda" else None)
            if config.codec in comm.baselines.BASELINES:
                self.comm_state = comm.baselines.register(self.model, config.codec, rank=config.rank,
                                                          warmup_steps=config.warmup_steps)
            else:
                self.comm_state = comm.register(self.model, config.codec, ratio=config.ratio,
                                                budget_ms=config.comm_budget_ms, replan_every=config.replan_every,
                                                lowrank_rank=config.kimad_lowrank_rank,
                                                **codec)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr)
        self.start_step = self.load_checkpoint(config.resume) if config.resume else 0

    def train(self) -> None:
        c = self.config
        history: dict[str, list] = {"step": [], "step_s": [], "compiled": [], "time_unix": [], "train_loss": []}
        validations = [{"step": self.start_step, **self.evaluate()}]
        samples_per_step = c.batch_size * self.world_size
        bar = _progress(range(self.start_step, c.steps), enabled=self.rank == 0)
        for step in bar:
            self.progress.beat(f"in step {step}")
            compiled_before = fused.compiled_kernels()
            start = time.perf_counter()
            loss = self.task.train_loss(self.model, step, self.rank, self.world_size, self.device)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            step_s = time.perf_counter() - start
            history["step"].append(step)
            history["step_s"].append(step_s)
            history["compiled"].append(fused.compiled_kernels() > compiled_before)
            history["time_unix"].append(time.time())
            history["train_loss"].append(loss.item())
            adaptive = ADAPTIVE_STATISTICS if c.codec in comm.ADAPTIVE_MODES else ()
            for key in COMM_STATISTICS + adaptive:
                history.setdefault(key, []).append(self.comm_state.last_step.get(key))
            history.setdefault("buckets", []).append(  # PyTorch's hooks (ddp*) time no bucket: []
                [{key: record[key] for key in BUCKET_STATISTICS}
                 for record in self.comm_state.last_step.get("per_bucket", [])])
            bar.set_postfix(loss=f"{loss.item():.3f}", samples_s=f"{samples_per_step / step_s:.0f}", refresh=False)
            done = step + 1
            if c.eval_every and done % c.eval_every == 0 and done < c.steps:
                validations.append({"step": done, **self.evaluate()})
            if c.checkpoint and (done == c.steps or (c.checkpoint_every and done % c.checkpoint_every == 0)):
                self.save_checkpoint(c.checkpoint.replace("{step}", str(done)), done)
        validations.append({"step": c.steps, **self.evaluate()})
        history["train_loss"] = self.mean_over_ranks(history["train_loss"])
        if self.rank == 0:
            resumed = ({"checkpoint": c.resume, "step": self.start_step, "applied": resume_changes(c)}
                       if c.resume else None)
            report(c, self.world_size, history, validations, self.device, self.module, resumed)

    def evaluate(self) -> dict:
        self.progress.beat("validating")
        self.module.eval()
        metrics = self.task.evaluate(self.module, self.rank, self.world_size, self.device)
        self.module.train()
        return metrics

    def mean_over_ranks(self, values: list[float]) -> list[float]:
        total = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        return (total / self.world_size).tolist()

    def save_checkpoint(self, path: str, step: int) -> None:
        """Rank 0 writes; the comm state holds every rank's codec state (state_dict is collective).

        --fsdp: every rank writes its shards into a DCP folder, rank 0 adds SHARDED_CHECKPOINT_FILE.
        Both write next to `path` first and replace it when complete.
        """
        if self.config.fsdp:
            self.save_sharded_checkpoint(Path(path), step)
            return
        comm_states = self.comm_state.state_dict()
        if self.rank == 0:
            checkpoint = {"step": step, "world_size": self.world_size, "config": asdict(self.config),
                          "model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                          "comm": comm_states}
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            partial = Path(f"{path}.partial")
            torch.save(checkpoint, partial)
            partial.replace(path)
        dist.barrier()

    def save_sharded_checkpoint(self, path: Path, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        partial, replaced = Path(f"{path}.partial"), Path(f"{path}.replaced")
        dcp.save(self.sharded_state(), checkpoint_id=partial)  # returns on every rank once .metadata is written
        if self.rank == 0:
            plain = {"step": step, "world_size": self.world_size, "config": asdict(self.config)}
            (partial / SHARDED_CHECKPOINT_FILE).write_text(json.dumps(plain, indent=1))
            if path.exists():  # check_fsdp made sure it is an earlier netgain checkpoint
                path.rename(replaced)
            partial.rename(path)
            shutil.rmtree(replaced, ignore_errors=True)
        dist.barrier()

    def sharded_state(self) -> dict:
        """What DCP saves and loads in place: model and optimizer shards, and the comm state (a Stateful)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optimizer": optimizer, "comm": self.comm_state}

    def load_checkpoint(self, path: str) -> int:
        """build_config has checked the checkpoint against this run; --lr replaces the saved rate."""
        if self.config.fsdp:
            from torch.distributed.checkpoint.state_dict import set_state_dict

            state = self.sharded_state()
            comm_fsdp.load_checkpoint(state, path)
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"])
            step = read_sharded_checkpoint(path)["step"]
        else:
            checkpoint = read_checkpoint(path, map_location=self.device)
            self.module.load_state_dict(checkpoint["model"])
            self.optimizer.load_state_dict(checkpoint["optimizer"])
            self.comm_state.load_state_dict(checkpoint["comm"])
            step = checkpoint["step"]
        for group in self.optimizer.param_groups:
            group["lr"] = self.config.lr
        return step


def _progress(steps: range, enabled: bool):
    from tqdm import tqdm

    return tqdm(steps, desc="train", unit="step", disable=not enabled, dynamic_ncols=True)


# ---------------------------------------------------------------- rank 0's report


def report(config: TrainConfig, world_size: int, history: dict, validations: list[dict],
           device: torch.device, model: nn.Module, resumed: dict | None) -> None:
    """Summary table on stdout, record.json and loss.png under --out (made by prepare_outputs)."""
    summary = summarize(config, world_size, history, validations, model)
    out = Path(config.out)
    record = {"config": asdict(config), "resumed": resumed, "summary": summary, "per_step": history,
              "validation": validations, "git": git_state(), "host": host_info(device, world_size)}
    (out / "record.json").write_text(json.dumps(record, indent=1))
    plot_losses(history, validations, out / "loss.png",
                f"{config.task}, codec {config.codec}" + (f", fsdp {config.replicas}x{config.shards}" if config.fsdp else ""))
    written = [out / "record.json", out / "loss.png"]
    if config.codec in comm.ADAPTIVE_MODES:
        plot_adaptive(history, out / "adaptive.png", f"{config.codec}, {world_size} workers")
        written.append(out / "adaptive.png")
    print(format_table(summary))
    print("wrote " + ", ".join(map(str, written)))


def summarize(config: TrainConfig, world_size: int, history: dict, validations: list[dict],
              model: nn.Module) -> dict:
    """Means over the steady steps of this run: after the first (which also builds DDP's buckets), and
    without the steps in which a codec kernel compiled (seconds of one-off torch.compile); and fp32's step
    time on this run's link as netgain's cost model predicts it from the measured compute."""
    steps = len(history["step_s"])
    timed = [i for i in range(1, steps) if not history["compiled"][i]] or list(range(steps))
    step_s, wait_s, wire, raw = (_mean([history[key][i] for i in timed])
                                 for key in ("step_s", "wait_s", "wire_bytes", "raw_bytes"))
    hop_size = config.replicas if config.fsdp else world_size  # the ranks the codec's collectives span
    link = fit_link([history["buckets"][i] for i in timed], hop_size)
    fp32_step_s = (net.predict([b["numel"] for b in history["buckets"][-1]], hop_size, link,
                               compute_s=step_s - wait_s).step_s if link else None)
    final = validations[-1]
    summary = {
        "task": config.task,
        "codec": config.codec,
        "world_size": world_size,
        **({"fsdp_mesh": f"{config.replicas} replicas x {config.shards} shards"} if config.fsdp else {}),
        "parameters": models.parameter_count(model),
        "steps": history["step"][-1] + 1,
        "samples_per_s": config.batch_size * world_size / step_s,
        "step_s": step_s,
        "compute_s": step_s - wait_s,
        "comm_wait_s": wait_s,
        "wire_bytes_per_step": wire,
        "fp32_bytes_per_step": raw,
        "compression_ratio": raw / wire if wire else None,  # None: nothing sent (one worker)
        "predicted_fp32_step_s": fp32_step_s,
        "link_bandwidth_Bps": link.bandwidth if link else None,
        "link_overhead_s": link.overhead if link else None,
        "final_train_loss": _mean(history["train_loss"][-FINAL_TRAIN_LOSS_WINDOW:]),
        **{f"final_{key}": value for key, value in final.items() if key != "step"},
    }
    summary["versus_fp32"] = versus_fp32(summary, hop_size, config.fsdp)
    return summary


def fit_link(steps: list[list[dict]], world_size: int) -> net.Link | None:
    """This run's link for netgain's cost model, fitted to the run's own bucket collectives with Kimad's
    fit (bandwidth.fit): seconds = overhead + bytes sent / bandwidth, one overhead per bucket (its
    header's included). None when nothing was timed: 1 worker, or PyTorch's hooks (ddp*). Rank 0's own
    times, waits for slower ranks included (Kimad's planner fits each collective's least time across ranks)."""
    samples = [(bandwidth.WIRE_FACTOR[_collective(b["codec"])](world_size) * b["wire_bytes"], b["comm_s"])
               for buckets in steps for b in buckets if b["wire_bytes"]]
    if not samples:
        return None
    overhead, seconds_per_byte = bandwidth.fit(samples[-LINK_FIT_SAMPLES:])
    return net.Link("this run", bandwidth.rate(seconds_per_byte), 0.0, "fitted to the run's collectives", overhead=overhead,
                    algorithm="ring")


def _collective(codec: str) -> str:
    """The collective of a codec as the hook describes it: 'gqsgd(bits=8,encoding=packed)' -> 'allreduce'."""
    return comm.make_codec(codec.split("(")[0].strip()).collective


def versus_fp32(summary: dict, hop_size: int, fsdp: bool) -> list[str]:
    """The run against fp32 in words: wire bytes per step, and the measured step beside fp32's predicted one."""
    if hop_size == 1:
        return [f"no communication ({'1 replica' if fsdp else '1 worker'}): nothing for a codec to compress, "
                "fp32 included"]
    wire, fp32 = summary["wire_bytes_per_step"], summary["fp32_bytes_per_step"]
    saved = f"{fp32 / wire:.1f}x fewer" if wire < fp32 else "no fewer"
    step = f"step {summary['step_s']:.3g} s measured"
    if summary["predicted_fp32_step_s"] is None:
        predicted = "fp32 not predicted (PyTorch's hooks time no collective: no link to fit)"
    else:
        predicted = (f"fp32 {summary['predicted_fp32_step_s']:.3g} s predicted on this link "
                     f"({bandwidth.in_words(summary['link_bandwidth_Bps'], 'MB/s')}, {summary['link_overhead_s'] * 1e6:,.0f} us "
                     "per bucket, fitted to the run's collectives)")
    return [f"wire {wire / 1e6:.3g} MB/step vs {fp32 / 1e6:.3g} MB fp32: {saved}", f"{step}; {predicted}"]


def format_table(summary: dict) -> str:
    """The summary's numbers as a table, its versus_fp32 lines under it."""
    rows = [(key, _format(value)) for key, value in summary.items() if key != "versus_fp32"]
    width = max(len(key) for key, _ in rows)
    rule = "-" * (width + 2 + max(len(value) for _, value in rows))
    return "\n".join([rule, *(f"{key:<{width}}  {value}" for key, value in rows), rule, *summary["versus_fp32"]])


def plot_losses(history: dict, validations: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([s + 1 for s in history["step"]], history["train_loss"], label="train (mean over workers)", lw=1)
    ax.plot([v["step"] for v in validations], [v["val_loss"] for v in validations], "o-", label="validation")
    ax.set(xlabel="step", ylabel="loss", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_adaptive(history: dict, path: Path, title: str) -> None:
    """Kimad over the run: bandwidth estimate, bits chosen per bucket, communication vs budget, loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s + 1 for s in history["step"]]
    fig, axes = plt.subplots(4, 1, figsize=(7, 9), sharex=True)
    mbit = [b * 8e-6 if b else float("nan") for b in history["bandwidth_Bps"]]
    axes[0].plot(steps, mbit)
    axes[0].set(ylabel="bandwidth\nestimate (Mbit/s)", title=title)
    buckets = sorted({int(i) for plan in history["plan"] if plan for i in plan})
    for index in buckets:
        bits = [_plan_bits((plan or {}).get(index, (plan or {}).get(str(index)))) for plan in history["plan"]]
        axes[1].step(steps, bits, where="post", label=f"bucket {index}")
    axes[1].set(ylabel="bits per element\nchosen")
    axes[1].legend(fontsize=7)
    communication = [c + e + d for c, e, d in zip(history["comm_s"], history["encode_s"], history["decode_s"])]
    axes[2].plot(steps, [1e3 * t for t in communication], label="rank 0's communication (its waits included)")
    link = history.get("link_comm_s", [])
    if len(link) == len(steps):  # a history resumed from an older record has none
        axes[2].plot(steps, [1e3 * t if t is not None else float("nan") for t in link], label="link time (what the budget counts)")
    axes[2].plot(steps, [1e3 * b if b else float("nan") for b in history["budget_s"]], "--", label="budget")
    axes[2].set(ylabel="ms per step")
    axes[2].legend(fontsize=7)
    axes[3].plot(steps, history["train_loss"])
    axes[3].set(xlabel="step", ylabel="train loss")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plan_bits(codec: str | None) -> float:
    """Payload bits per element of a planned codec, read from its name (32 for none)."""
    if codec is None:
        return float("nan")
    if codec.startswith("gqsgd"):
        return float(codec.split("bits=")[1].split(",")[0])
    if codec.startswith("topk"):
        return 64 * float(codec.split("ratio=")[1].rstrip(")"))
    return 32.0


def git_state() -> dict:
    here = Path(__file__).parent
    try:
        commit = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--", "."],
                                    capture_output=True, text=True, check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": dirty}


def host_info(device: torch.device, world_size: int) -> dict:
    return {"hostname": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "backend": dist.get_backend(), "world_size": world_size}


def _format(value) -> str:
    if isinstance(value, float):
        if abs(value) >= 100:
            return f"{value:,.0f}" if value.is_integer() else f"{value:,.1f}"
        return f"{value:.4g}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
