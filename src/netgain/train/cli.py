"""`netgain train`'s options, and the checks that turn them into a TrainConfig in the parent, before any
worker starts."""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, fields, replace
from pathlib import Path

import netgain.comm as comm
import netgain.comm.fsdp as comm_fsdp
import netgain.sync
from netgain import data, models
from netgain.comm.emulate import link_rate
from netgain.files import RUN_MARKER, claim_folder, in_bytes, machine_memory_bytes, require_regular_file, same_file
from netgain.train import compare
from netgain.train.checkpoints import (check_checkpoint_paths, check_resume, checkpoint_paths, read_checkpoint,
                                       resume_changes, verify_checkpoint)
from netgain.train.config import SYNC_FIELDS, TrainConfig, flag, run_label
from netgain.train.launch import launched_by_torchrun, spawn_workers
from netgain.train.loop import SILENCE_NOTICE_S, train_worker
from netgain.train.report import OUTPUT_FILES
from netgain.train.tasks import TASK_CLASSES

TASKS = ("lm", "digits")
DEFAULT_BATCH_SIZE = {"lm": 16, "digits": 32}  # per worker: sequences of --seq-len bytes, or images
CODEC_CHOICES = comm.CODEC_NAMES + comm.baselines.BASELINES
DEFAULT_CODEC = "auto"  # the fastest route per bucket at the measured link (why: --codec's help)
COLLECTIVE_TIMEOUT_S = 600  # default --collective-timeout: a dead peer ends the job instead of hanging it
COLLECTIVE_TIMEOUT_RANGE = (1, 86_400)  # under 1 s the silence notice would fire every few ms; a day is plenty
LOCAL_WORKERS_PER_CPU = 4  # --world-size cap for local spawn
INT64_MAX = 2**63 - 1  # torch, numpy and the progress bar count in 64-bit integers: --steps 1e30 overflowed in the workers
DEFAULT_WORLD_SIZE = 2
# --sync's defaults. bench/results/time_to_accuracy_sync*_3w_*.md, the default lm job at 3 workers: outer lr 1 without
# momentum (periodic averaging, coded), H=8 with 4-bit gqsgd, one step overlapped, reached fp32 DDP's loss at step 120
# in 3 of 3 rounds at 10 Mbit/s and 1 of 1 at 50 Mbit/s (the fastest there; H=4 8-bit took 1.5x its time), where
# DiLoCo's outer lr 0.7 and momentum 0.9 did not within 240 steps at H=4, 8 or 16 (3 rounds at 50 Mbit/s). The bench
# ran AdamW lr 1e-3 on batches of 2 x 128 bytes per worker; this command's --lr and --batch-size defaults are not measured.
DEFAULT_SYNC_CODEC = "gqsgd"
DEFAULT_SYNC = {"sync_period": 8, "sync_bits": 4, "outer_lr": 1.0, "outer_momentum": 0.0, "fragments": 1}
SYNC_CODECS = netgain.sync.CODECS
SYNC_BITS_CODECS = tuple(name for name in SYNC_CODECS
                         if "bits" in {f.name for f in fields(comm.config.CODEC_CONFIGS[name])})
# options of the per-step codecs and of the DDP hook, which --sync leaves out: one given with --sync is refused
PER_STEP_OPTIONS = ("bits", "encoding", "ratio", "warmup_steps", "skip_1d", "rank", "factors", "comm_budget_ms",
                    "replan_every", "kimad_lowrank_rank")


def configure(parser: argparse.ArgumentParser) -> None:
    bits = comm.codecs.BITS_RANGE
    parser.add_argument("--task", choices=TASKS, default="lm",
                        help="lm: byte-level Llama on the stdlib source (or --data); digits: MLP on sklearn digits")
    parser.add_argument("--codec", choices=CODEC_CHOICES, default=None,
                        help=f"netgain codec (default {DEFAULT_CODEC}: per bucket, the least communication plus codec time "
                        "at the link measured in the run, among none, bf16, fp16, gqsgd and low rank at --rank; on --resume "
                        f"the checkpoint's; under --fsdp the same, planned per shard position on the hop across replicas; under --sync "
                        f"{DEFAULT_SYNC_CODEC}, the pseudo-gradients' code); "
                        "none: fp32, as plain DDP; kimad/kimad+ fit a time budget; ddp, ddp-fp16, ddp-powersgd are "
                        "PyTorch's own hooks, for comparison")
    parser.add_argument("--bits", type=int, default=8,
                        help=f"quantisation bits, {bits.start}..{bits.stop - 1} (qsgd, gqsgd, gqsgd-exp)")
    parser.add_argument("--encoding", choices=comm.codecs.ENCODINGS, default="packed",
                        help="gqsgd wire encoding (int8: --bits 8 only)")
    parser.add_argument("--ratio", type=float, default=0.01, help="fraction of coordinates sent, in (0, 1] (topk, randomk)")
    parser.add_argument("--warmup-steps", type=int,
                        help="uncompressed steps before the codec starts (default: 2 for lowrank, as PowerSGD; 0 for the other "
                        "netgain codecs; ddp-powersgd runs at least 2 whatever this says; on --resume the checkpoint's)")
    parser.add_argument("--skip-1d", action="store_true", help="send 1-D gradients (biases, norm weights) uncompressed")
    parser.add_argument("--rank", type=int, default=4, help="matrix approximation rank, >= 1 (auto's low rank, lowrank, ddp-powersgd)")
    parser.add_argument("--factors", choices=comm.lowrank.FACTORS, default="gqsgd",
                        help="how lowrank's factors travel: gqsgd (--bits-bit Global-QSGD codes) or fp32 (as PowerSGD)")
    parser.add_argument("--comm-budget-ms", type=float,
                        help="kimad: communication time target per step, > 0 (default: the measured backward time)")
    parser.add_argument("--replan-every", type=int,
                        help="auto, kimad: measure the options' errors and re-plan every N >= 1 steps (and whenever the "
                        "bandwidth moves by more than 20%%); default: auto 50, kimad 10; on --resume the checkpoint's")
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
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds the initialisation, every batch (with the step and rank) and the codecs' noise")
    parser.add_argument("--data", help="lm task: a text file or a folder of text files (default: the stdlib source)")
    parser.add_argument("--eval-every", type=int, default=50, help="validate every N steps, 0: only at the end")
    parser.add_argument("--out", help="output folder for record.json and loss.png, claimed by the run (a folder "
                        "holding an earlier run's files is refused; default runs/<codec>-<time>, under --sync "
                        "runs/sync-h<H>-<codec>-b<bits>-<time>, with a suffix if that folder exists)")
    parser.add_argument("--checkpoint", help="save model, optimizer, codec state and step here at the end "
                        "(and every --checkpoint-every steps); a '{step}' in the path is replaced by the step; "
                        "with --fsdp a torch.distributed.checkpoint folder")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="also checkpoint every N steps (0: only at the end)")
    parser.add_argument("--resume", help="continue from a checkpoint written by --checkpoint, its checksums "
                        "verified first (--lr, --batch-size and --data may differ, and are announced; other settings "
                        "must match)")
    parser.add_argument("--hidden-size", type=int, default=192, help="lm model width")
    parser.add_argument("--layers", type=int, default=4, help="lm decoder layers")
    parser.add_argument("--seq-len", type=int, default=128, help="lm sequence length in bytes, at least 2")
    parser.add_argument("--collective-timeout", type=float, default=COLLECTIVE_TIMEOUT_S,
                        help=f"seconds a rank waits for a silent peer before the run fails, "
                        f"{COLLECTIVE_TIMEOUT_RANGE[0]}..{COLLECTIVE_TIMEOUT_RANGE[1]} (default "
                        f"{COLLECTIVE_TIMEOUT_S}); a rank without progress says so after "
                        f"{SILENCE_NOTICE_S} s (or half this timeout)")
    parser.add_argument("--emulate-link", metavar="RATE",
                        help="emulate a slower link between the workers, e.g. 100mbit, 1gbit, 50Mb/s, 12MB/s: each "
                        "collective of the gradient hook (netgain's codecs and ddp*) or of --sync completes no earlier than its "
                        "bytes sent per rank / RATE after it began, one collective after another; step times and "
                        "fp32's prediction are then on this link, and say so")
    parser.add_argument("--local-route", action="store_true",
                        help="with --codec auto: offer auto the route of local steps (netgain.sync.offer). Once its "
                        "per-step plan is measured, and where the model prices local steps within 1.5x of it, the workers "
                        "try 2 periods of 8 local steps averaged in 4 bits, and keep them where they reach the target sooner "
                        "(docs/sync.md); under --fsdp each shard position chooses for itself. Not with --sync")
    parser.add_argument("--sync", action="store_true",
                        help="train with netgain.sync instead of a per-step hook (no DDP): each worker takes --sync-period "
                        "steps alone, then the workers average their pseudo-gradients (global minus local parameters) "
                        f"through --codec ({', '.join(SYNC_CODECS)}; default {DEFAULT_SYNC_CODEC}) and an outer SGD applies "
                        "the average (DiLoCo). Defaults H=8, 4 bits, outer lr 1, no momentum: on the bench's lm job (3 "
                        "workers at 10 and 50 Mbit/s) they reached fp32 DDP's loss, where DiLoCo's outer lr 0.7 and momentum "
                        "0.9 did not within 240 steps (docs/sync.md). With --fsdp each replica steps alone and syncs its "
                        "shards with the other replicas'. Not with the per-step codecs' options")
    parser.add_argument("--sync-period", type=int, metavar="H",
                        help=f"--sync: inner steps between two syncs of a fragment, >= 1 (default {DEFAULT_SYNC['sync_period']})")
    parser.add_argument("--sync-bits", type=int,
                        help=f"--sync: the pseudo-gradients' bits, {bits.start}..{bits.stop - 1} "
                        f"({', '.join(SYNC_BITS_CODECS)}; default {DEFAULT_SYNC['sync_bits']})")
    parser.add_argument("--outer-lr", type=float,
                        help=f"--sync: the outer SGD's learning rate, > 0 (default {DEFAULT_SYNC['outer_lr']:g}: the "
                        "average replaces the parameters, as PyTorch's periodic averaging; DiLoCo's is 0.7)")
    parser.add_argument("--outer-momentum", type=float,
                        help=f"--sync: the outer momentum, in [0, 1), Nesterov when > 0 "
                        f"(default {DEFAULT_SYNC['outer_momentum']:g}; DiLoCo's is 0.9)")
    parser.add_argument("--fragments", type=int,
                        help="--sync: parts of the model synced in turn, one every H / F steps, 1..H "
                        f"(default {DEFAULT_SYNC['fragments']})")
    parser.add_argument("--overlap-steps", type=int,
                        help="--sync: inner steps a fragment's average spends on the wire before it is applied, 0..H-1 "
                        "(default 1; 0 at H=1)")
    parser.add_argument("--compare", action="store_true",
                        help="after this run, run the same job (seed, steps, --emulate-link) with " +
                        " and ".join(compare.BASELINES) + " (PowerSGD at --rank), under --out/<codec>, and print "
                        "the step times and times to a common train loss side by side (local workers only)")


def run(args: argparse.Namespace) -> int:
    config = build_config(args)
    if _is_rank_zero():
        config = prepare_outputs(config)
        for name, (old, new) in resume_changes(config).items():
            print(f"netgain train: --resume: {flag(name)} {new} replaces the checkpoint's {old}", file=sys.stderr)
    if launched_by_torchrun():
        train_worker(int(os.environ["RANK"]), config.world_size, config, "env://")
        return 0
    code = spawn_workers(config)
    if code or not config.compare:
        return code
    runs = [config]
    for baseline in compare.baseline_configs(config):
        runs.append(prepare_outputs(baseline))
        print(f"netgain train --compare: the same job with --codec {baseline.codec}", file=sys.stderr)
        code = spawn_workers(runs[-1])
        if code:
            return code
    compare.report(runs)
    return 0


def build_config(args: argparse.Namespace) -> TrainConfig:
    """The run's settings, every one checked here in the parent, before any worker starts."""
    check_route(args)
    world_size = resolve_world_size(args)
    batch_size = DEFAULT_BATCH_SIZE[args.task] if args.batch_size is None else args.batch_size
    if args.resume:  # read once for every check below, its bytes checked before any worker trusts them
        checkpoint = read_checkpoint(args.resume)
        verify_checkpoint(args.resume)
    else:
        checkpoint = None
    args.codec = given_or_saved(args, checkpoint, "codec", DEFAULT_SYNC_CODEC if args.sync else DEFAULT_CODEC)
    # the codec's default warm-up; on --resume the checkpoint's, which may predate that default
    warmup_steps = given_or_saved(args, checkpoint, "warmup_steps", comm.default_warmup_steps(args.codec))
    config = TrainConfig(task=args.task, codec=args.codec, bits=args.bits, encoding=args.encoding,
                         ratio=args.ratio, warmup_steps=warmup_steps, skip_1d=args.skip_1d,
                         rank=args.rank, factors=args.factors,
                         comm_budget_ms=args.comm_budget_ms,
                         replan_every=given_or_saved(args, checkpoint, "replan_every", None),
                         kimad_lowrank_rank=args.kimad_lowrank_rank, steps=args.steps,
                         batch_size=batch_size, lr=args.lr, world_size=world_size, fsdp=args.fsdp,
                         replicas=args.replicas, shards=args.shards, seed=args.seed,
                         data=args.data, eval_every=args.eval_every, out=args.out, checkpoint=args.checkpoint,
                         checkpoint_every=args.checkpoint_every, resume=args.resume,
                         hidden_size=args.hidden_size, layers=args.layers, seq_len=args.seq_len,
                         collective_timeout=args.collective_timeout, emulate_link=args.emulate_link,
                         compare=args.compare, sync=args.sync, local_route=args.local_route,
                         **(sync_settings(args, checkpoint) if args.sync else {}))
    for name in ("data", "out", "checkpoint", "resume", "emulate_link"):  # '' is a typo, never "not given"
        _require(getattr(args, name) != "", name, "must not be empty (leave the flag out instead)", "''")
    check_numbers(config)
    if not launched_by_torchrun():
        check_local_world_size(config.world_size)
    check_memory(config)
    check_data(config)
    check_emulation(config)
    if checkpoint:  # first: a DDP checkpoint's codec (a DDP hook's) would otherwise be refused as an FSDP codec
        check_resume(config, checkpoint)
    if config.fsdp:
        check_fsdp(config, checkpoint)
    if config.sync:
        check_sync(config)
    if config.local_route and (config.codec != "auto" or config.sync):
        raise ValueError("--local-route is a route of --codec auto, not of "
                         + ("--sync" if config.sync else f"--codec {config.codec}"))
    if config.checkpoint:
        check_checkpoint_paths(config, checkpoint)
    return config


def given_or_saved(args: argparse.Namespace, checkpoint: dict | None, name: str, default):
    """An option left out (None) is the checkpoint's on --resume, where it has one, else ``default``."""
    value = getattr(args, name)
    if value is None and checkpoint:
        value = checkpoint["config"].get(name)
    return default if value is None else value


def check_route(args: argparse.Namespace) -> None:
    """--sync's options only with --sync, and none of the per-step route's with it (a value other than
    its default would be silently ignored)."""
    if not args.sync:
        for name in SYNC_FIELDS:
            if getattr(args, name) is not None:
                raise ValueError(f"{flag(name)} applies with --sync only")
        return
    defaults = vars(_parser().parse_args([]))
    for name in PER_STEP_OPTIONS:
        if getattr(args, name) != defaults[name]:
            raise ValueError(f"{flag(name)} is an option of the per-step route, not of --sync, which takes --codec "
                             f"{', '.join(SYNC_CODECS)} and {', '.join(flag(f) for f in SYNC_FIELDS)}")


def sync_settings(args: argparse.Namespace, checkpoint: dict | None) -> dict:
    """--sync's SYNC_FIELDS: as given, else the checkpoint's on --resume, else DEFAULT_SYNC (why: its comment)."""
    settings = {name: given_or_saved(args, checkpoint, name, default) for name, default in DEFAULT_SYNC.items()}
    if args.codec not in SYNC_BITS_CODECS:  # none, fp16, bf16 take no bits
        settings["sync_bits"] = args.sync_bits
    settings["overlap_steps"] = given_or_saved(args, checkpoint, "overlap_steps", min(1, settings["sync_period"] - 1))
    return settings


def check_sync(c: TrainConfig) -> None:
    """--sync's codec and settings, named as on the command line; netgain.sync's own checks last."""
    if c.codec not in SYNC_CODECS:
        raise ValueError(f"--codec {c.codec} does not run under --sync; choose one of {', '.join(SYNC_CODECS)} "
                         "(a pseudo-gradient is averaged by all-reduce through a summable code without per-rank "
                         "state; the planners, error feedback and PyTorch's hooks are per-step)")
    _require(c.sync_period >= 1, "sync_period", "must be at least 1", c.sync_period)
    _require(1 <= c.fragments <= c.sync_period, "fragments", f"must be in 1..{c.sync_period} (at most --sync-period: "
             "one fragment is synced per step at most)", c.fragments)
    _require(0 <= c.overlap_steps < c.sync_period, "overlap_steps", f"must be in 0..{c.sync_period - 1} (below "
             "--sync-period: a fragment's average is applied before its next sync)", c.overlap_steps)
    _require(math.isfinite(c.outer_lr) and c.outer_lr > 0, "outer_lr", "must be a finite number > 0", c.outer_lr)
    _require(0 <= c.outer_momentum < 1, "outer_momentum", "must be in [0, 1)", c.outer_momentum)
    bits = comm.codecs.BITS_RANGE
    if c.codec in SYNC_BITS_CODECS:
        _require(c.sync_bits in bits, "sync_bits", f"must be in {bits.start}..{bits.stop - 1}", c.sync_bits)
    else:
        _require(c.sync_bits is None, "sync_bits", f"applies to --codec {', '.join(SYNC_BITS_CODECS)} only, "
                 f"not --codec {c.codec}", c.sync_bits)
    import torch

    with torch.device("meta"):
        trainable = sum(1 for p in TASK_CLASSES[c.task].model_of(c).parameters() if p.requires_grad and p.numel())
    _require(c.fragments <= trainable, "fragments", f"must be at most the model's {trainable} trainable parameters "
             "(a fragment holds whole parameters)", c.fragments)
    try:
        c.sync_config()
    except ValueError as error:
        raise ValueError(f"--sync: {error}") from None


def resolve_world_size(args: argparse.Namespace) -> int:
    """--world-size, or under --fsdp --replicas x --shards (a --world-size or torchrun WORLD_SIZE must agree)."""
    launched = int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else None
    if not args.fsdp:
        for name in ("replicas", "shards"):
            if getattr(args, name) is not None:
                raise ValueError(f"{flag(name)} applies with --fsdp only")
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
                         "(ddp, ddp-fp16, ddp-powersgd are DDP hooks)")


def check_emulation(c: TrainConfig) -> None:
    """--emulate-link's rate, and the runs --emulate-link and --compare apply to."""
    if c.emulate_link:
        link_rate(c.emulate_link)
        if c.world_size == 1:
            raise ValueError(f"--emulate-link {c.emulate_link} needs at least 2 workers: 1 worker sends nothing")
        if c.fsdp:
            raise ValueError(f"--emulate-link {c.emulate_link} does not apply under --fsdp: FSDP's own collectives "
                             "inside a replica would not be held")
    if c.compare:
        for ok, why in ((not launched_by_torchrun(), "runs local workers, not under torchrun"),
                        (not c.fsdp, f"runs DDP baselines ({', '.join(compare.BASELINES)}), not under --fsdp"),
                        (not c.resume, "runs each baseline from step 0, not with --resume")):
            if not ok:
                raise ValueError(f"--compare {why}")


def check_numbers(c: TrainConfig) -> None:
    """Ranges of every numeric setting, named as on the command line."""
    for name, value in vars(c).items():
        _require(type(value) is not int or value <= INT64_MAX, name, f"must be at most {INT64_MAX:,}", value)
    for name in ("steps", "batch_size", "world_size", "seq_len", "rank", "replan_every", "hidden_size", "layers"):
        _require(getattr(c, name) is None or getattr(c, name) >= 1, name, "must be at least 1", getattr(c, name))
    for name in ("warmup_steps", "eval_every"):
        _require(getattr(c, name) >= 0, name, "must be 0 or more", getattr(c, name))
    _require(0 <= c.seed < 2**32, "seed", f"must be in 0..{2**32 - 1}", c.seed)
    _require(math.isfinite(c.lr) and c.lr > 0, "lr", "must be a finite number > 0", c.lr)
    low, high = COLLECTIVE_TIMEOUT_RANGE
    _require(low <= c.collective_timeout <= high, "collective_timeout", f"must be {low}..{high} seconds",
             c.collective_timeout)
    _require(c.comm_budget_ms is None or (math.isfinite(c.comm_budget_ms) and c.comm_budget_ms > 0),
             "comm_budget_ms", "must be a finite number > 0", c.comm_budget_ms)
    _require(0 < c.ratio <= 1, "ratio", "must be in (0, 1]", c.ratio)
    kimad = c.codec in ("kimad", "kimad+")
    _require(c.comm_budget_ms is None or kimad, "comm_budget_ms",
             "is Kimad's time budget: only with --codec kimad or kimad+ (auto has none: it takes the fastest option)",
             c.comm_budget_ms)
    _require(c.kimad_lowrank_rank is None or (c.kimad_lowrank_rank >= 1 and kimad),
             "kimad_lowrank_rank", "must be at least 1, and only with --codec kimad or kimad+ (auto: --rank)",
             c.kimad_lowrank_rank)
    bits = comm.codecs.BITS_RANGE
    _require(c.bits in bits, "bits", f"must be in {bits.start}..{bits.stop - 1}", c.bits)
    _require(not (c.codec == "gqsgd" and c.encoding == "int8" and c.bits != 8), "bits",
             "must be 8 with --encoding int8 (or use --encoding packed)", c.bits)
    _require(c.checkpoint_every == 0 or (c.checkpoint_every > 0 and c.checkpoint), "checkpoint_every",
             "must be 0 or more, and more than 0 needs --checkpoint", c.checkpoint_every)
    if c.task == "lm":
        _require(c.seq_len >= 2, "seq_len", "must be at least 2 (each byte is predicted from those before it: "
                 "a sequence of 1 has nothing to learn and a NaN loss)", c.seq_len)
        models.check_byte_llama(c.hidden_size, c.layers)


def check_local_world_size(world_size: int) -> None:
    """More local workers than this only time-slice the cores: 64 on 2 cores sat silent for minutes."""
    cpus = os.cpu_count() or 1
    limit = LOCAL_WORKERS_PER_CPU * cpus
    if world_size > limit:
        raise ValueError(f"--world-size {world_size}: at most {limit} local workers on this machine's {cpus} "
                         f"CPUs ({LOCAL_WORKERS_PER_CPU} per CPU; more spend minutes starting and time-slicing "
                         "the cores); for more ranks, launch under torchrun on more machines")


def check_memory(c: TrainConfig) -> None:
    """The model, its training state and activations must fit: counted from the settings here, before a
    worker allocates (--layers 100000 ran for minutes, --hidden-size 1048576 failed in the workers)."""
    task = TASK_CLASSES[c.task]
    per_worker = task.memory_bytes(c)
    workers, limit, memory = _memory_per_machine(c)
    if per_worker * workers > limit:
        shape = " ".join(f"{flag(name)} {getattr(c, name)}" for name in task.SHAPE)
        raise ValueError(f"{shape}: each worker needs at least {in_bytes(per_worker)} (fp32 parameters, gradients, "
                         f"AdamW state and activations), x {workers} worker(s) here, more than {memory} "
                         f"({in_bytes(limit)}): make them smaller")


def _memory_per_machine(c: TrainConfig) -> tuple[int, int, str]:
    """(workers sharing it, bytes, in words): local workers share this machine's memory; a torchrun rank on
    CUDA has its GPU's."""
    if not launched_by_torchrun():
        return c.world_size, machine_memory_bytes(), "this machine's memory"
    import torch

    if torch.cuda.is_available():
        return 1, torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", 0))).total_memory, "its GPU's memory"
    return int(os.environ.get("LOCAL_WORLD_SIZE", 1)), machine_memory_bytes(), "this machine's memory"


def check_data(c: TrainConfig) -> None:
    """--data must be regular files that fit in memory (the parent and every worker hold the text), and
    hold a sequence per rank and for validation (the stdlib source does)."""
    if c.data is None:
        return
    if c.task != "lm":
        raise ValueError("--data applies to --task lm only")
    files = data.text_files(c.data)
    limit = machine_memory_bytes() // (c.world_size + 1)
    total = sum(require_regular_file(file, "--data", limit) for file in files)
    if total > limit:
        raise ValueError(f"--data {c.data} holds {in_bytes(total)} of text, more than the {in_bytes(limit)} that "
                         f"this machine's memory holds for the parent and each of {c.world_size} workers")
    try:
        corpus = data.ByteCorpus.from_files(files)
    except OSError as error:
        raise ValueError(f"--data {c.data}: cannot read {error.filename} ({error.strerror})") from error
    corpus.require_sequences(c.world_size, c.seq_len, f"--data {c.data}")


def prepare_outputs(c: TrainConfig) -> TrainConfig:
    """Make --out (or a fresh default folder) and claim it for this run, after checking that it and
    --checkpoint's folder take files and that no checkpoint would land on --out or its files."""
    out = Path(c.out) if c.out else _new_run_folder(run_label(asdict(c)))
    ours = {out: f"--out {out}", **{out / name: f"--out's {name}" for name in (RUN_MARKER, *OUTPUT_FILES)}}
    for path, step in checkpoint_paths(c, 0).items():
        clash = next((what for target, what in ours.items() if same_file(path, target)), None)
        if clash:
            raise ValueError(f"--checkpoint {path} would write over {clash} at step {step}: give them different paths")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ValueError(f"--out {out} exists and is not a folder: give a folder") from None
    except OSError as error:
        raise ValueError(f"--out {out}: cannot create it ({error.strerror or error})") from error
    _require_writable(out, "--out")
    if c.checkpoint:
        folder = Path(c.checkpoint.replace("{step}", "0")).parent
        while not folder.exists():
            folder = folder.parent
        _require_writable(folder, "--checkpoint")
    return replace(c, out=str(out), run_id=claim_folder(out, "--out", OUTPUT_FILES))


def _new_run_folder(label: str) -> Path:
    """runs/<codec>-<time> (config.run_label), with -2, -3... if a run started in the same second already made it."""
    base = Path("runs") / f"{label}-{time.strftime('%Y%m%d-%H%M%S')}"
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


def _parser() -> argparse.ArgumentParser:
    """`netgain train`'s options alone: their defaults, as a command line without them gets them."""
    parser = argparse.ArgumentParser(add_help=False)
    configure(parser)
    return parser


def _require(ok: bool, name: str, rule: str, value) -> None:
    if not ok:
        raise ValueError(f"{flag(name)} {rule}, got {value}")


def _is_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0" or not launched_by_torchrun()
