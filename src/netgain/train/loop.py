"""One worker's run: join the process group, train with the codec's hook (or --sync's outer steps), validate,
checkpoint, report."""

from __future__ import annotations

import gc
import os
import secrets
import shutil
import signal
import sys
import threading
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import netgain.comm as comm
import netgain.comm.fsdp as comm_fsdp
import netgain.sync
from netgain.comm import kernel
from netgain.comm.emulate import EmulatedLink
from netgain.train.checkpoints import (finish_sharded_checkpoint, read_checkpoint, read_sharded_checkpoint,
                                       resume_changes, sharded_partial_path, write_checkpoint)
from netgain.train.config import TrainConfig
from netgain.train.report import report
from netgain.train.tasks import TASK_CLASSES

COMM_STATISTICS = ("wait_s", "wire_bytes", "raw_bytes", "encode_s", "decode_s", "comm_s")  # per step
BUCKET_STATISTICS = ("numel", "codec", "wire_bytes", "comm_s")  # per step and bucket: what the link fit reads
ADAPTIVE_STATISTICS = ("bandwidth_Bps", "budget_s", "margin", "predicted_comm_s", "link_comm_s", "plan", "plan_fits",
                       "climbing")  # per step, kimad only
SILENCE_NOTICE_S = 30  # a rank that makes no progress this long says so (at most half the collective timeout)


class NonFiniteLossError(RuntimeError):
    """A NaN or infinite train loss: the run has diverged, and every later step would train on it."""


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
    """Says on stderr when this rank has made no progress for a while. A codec kernel compiling on this rank
    (torch.compile, seconds to a minute on few cores) is named as such: only when nothing compiles here
    may a silent peer be to blame. ``compiling`` and ``clock`` are kernel.compiling and time.monotonic
    (tests give others)."""

    def __init__(self, rank: int, timeout_s: float, compiling: Callable[[], bool] = kernel.compiling,
                 clock: Callable[[], float] = time.monotonic):
        self.rank, self.timeout_s = rank, timeout_s
        self.compiling, self.clock = compiling, clock
        self.after_s = min(SILENCE_NOTICE_S, timeout_s / 2)
        self.mark = ("joining the other workers", clock())
        self.compiling_since: float | None = None  # when this rank was first seen compiling, while it still is
        self._told = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="netgain-silence-notice", daemon=True)
        self._thread.start()

    def beat(self, doing: str) -> None:
        self.mark = (doing, self.clock())

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(self.after_s / 4):
            line = self.check()
            if line:
                print(line, file=sys.stderr, flush=True)

    def check(self) -> str | None:
        """The notice due now, once per after_s of silence; None while progress is made or already told."""
        now, (doing, since) = self.clock(), self.mark
        if not self.compiling():
            self.compiling_since = None
        elif self.compiling_since is None:
            self.compiling_since = now
        silent = now - since
        if silent < self.after_s or self._told == (since, int(silent // self.after_s)):
            return None
        self._told = (since, int(silent // self.after_s))
        if self.compiling_since is not None:
            why = (f"this rank is compiling codec kernels (for at least {now - self.compiling_since:.0f} s; its codecs "
                   "run eagerly meanwhile, and its peers wait for it)")
        else:
            why = "a peer may be stuck or gone, or still compiling its kernels"
        return (f"netgain train: rank {self.rank} has made no progress for {silent:.0f} s while {doing}: {why} "
                f"(the run fails after --collective-timeout {self.timeout_s:g} s of waiting)")


class Trainer:
    def __init__(self, config: TrainConfig, rank: int, world_size: int, device: torch.device,
                 progress: SilenceNotice):
        self.config, self.rank, self.world_size, self.device = config, rank, world_size, device
        self.progress = progress
        progress.beat("building the model and codec")
        self.task = TASK_CLASSES[config.task](config)
        torch.manual_seed(config.seed)  # identical initialisation on every rank
        self.module = self.task.build_model().to(device)  # what evaluation and the report see
        codec = dict(bits=config.bits, encoding=config.encoding, ratio=config.ratio, rank=config.rank,
                     factors=config.factors, warmup_steps=config.warmup_steps, skip_1d=config.skip_1d, seed=config.seed,
                     budget_ms=config.comm_budget_ms, replan_every=config.replan_every,
                     lowrank_rank=config.kimad_lowrank_rank)  # the planners' (auto, kimad), with or without --fsdp
        if config.fsdp:  # FSDP2 inside each replica; the codec on the all-reduce across replicas
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(device.type, (config.replicas, config.shards),
                                    mesh_dim_names=(comm_fsdp.REPLICATE, comm_fsdp.SHARD))
            for block in self.task.blocks(self.module):
                fully_shard(block, mesh=mesh[comm_fsdp.SHARD])
            self.model = fully_shard(self.module, mesh=mesh[comm_fsdp.SHARD])
            self.replicas = mesh[comm_fsdp.REPLICATE].get_group()  # what --sync syncs over: each shard's replicas
            if not config.sync:
                self.comm_state = comm_fsdp.register(self.model, mesh, config.codec, **codec)
        elif config.sync:  # inner steps are local: DDP would all-reduce every gradient
            self.model = self.module
        else:
            self.model = DistributedDataParallel(self.module, device_ids=[device] if device.type == "cuda" else None)
            if config.codec in comm.baselines.BASELINES:
                self.comm_state = comm.baselines.register(self.model, config.codec, rank=config.rank,
                                                          warmup_steps=config.warmup_steps)
            else:
                self.comm_state = comm.register(self.model, config.codec, **codec)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr)
        # comm_state: what checkpoints save and the end closes; stats: where each step's statistics and the link
        # live; stepper: what steps the parameters. Under --sync the first and last are the SyncOptimizer
        # around the optimizer, and the statistics its codec pipeline's, one record per sync.
        if config.sync:
            self.comm_state = netgain.sync.wrap(self.model, self.optimizer, config.sync_config(),
                                                process_group=self.replicas if config.fsdp else None)
            self.stats, self.stepper = self.comm_state.comm, self.comm_state
        else:
            self.stats, self.stepper = self.comm_state, self.optimizer
            if config.local_route:  # the route holds the hook's state, and its local steps' averages
                self.comm_state = netgain.sync.offer(self.stats, self.model, self.optimizer)
        if config.emulate_link:  # netgain's pipeline hands it to its Communicator, made at the first bucket
            self.stats.link = EmulatedLink(config.emulate_link)
        self.start_step = self.load_checkpoint(config.resume) if config.resume else 0

    def train(self) -> None:
        c = self.config
        history: dict[str, list] = {"step": [], "step_s": [], "compiled": [], "time_unix": [], "train_loss": []}
        validations = [{"step": self.start_step, **self.evaluate()}]
        samples_per_step = c.batch_size * self.world_size
        bar = _progress(range(self.start_step, c.steps), enabled=self.rank == 0,
                        desc=f"train, emulated {c.emulate_link}" if c.emulate_link else "train")
        for step in bar:
            self.progress.beat(f"in step {step}")
            compiled_before = kernel.compiled_kernels()
            start = time.perf_counter()
            loss = self.task.train_loss(self.model, step, self.rank, self.world_size, self.device)
            if not torch.isfinite(loss):
                raise NonFiniteLossError(f"rank {self.rank}'s train loss is {loss.item()} at step {step}: the run "
                                         "diverged (a lower --lr?)")
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.stepper.step()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            step_s = time.perf_counter() - start
            history["step"].append(step)
            history["step_s"].append(step_s)
            # a step that began a compile, or ran codecs eagerly while one was in flight, is not steady
            history["compiled"].append(kernel.compiled_kernels() > compiled_before or kernel.compiling())
            history["time_unix"].append(time.time())
            history["train_loss"].append(loss.item())
            statistics = self.step_statistics()
            adaptive = ADAPTIVE_STATISTICS if c.codec in comm.ADAPTIVE_MODES else ()
            for key in COMM_STATISTICS + adaptive:
                history.setdefault(key, []).append(statistics.get(key))
            history.setdefault("buckets", []).append(  # PyTorch's hooks (ddp*) and --sync time no bucket: []
                [{key: record[key] for key in BUCKET_STATISTICS}
                 for record in statistics.get("per_bucket", [])])
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

    def step_statistics(self) -> dict:
        """This step's communication: the hook's, the route's, or under --sync that of the averages the step applied."""
        return self.comm_state.last_step

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
        """Rank 0 writes; the comm state holds every rank's codec state (state_dict is collective), under --sync
        also every rank's own parameters and optimizer state (the model and optimizer saved beside it: rank 0's).

        --fsdp: every rank writes its shards into a new DCP folder, rank 0 adds the manifest. Both replace
        `path` only when complete (checkpoints.write_checkpoint, finish_sharded_checkpoint).
        """
        if self.config.fsdp:
            self.save_sharded_checkpoint(Path(path), step)
            return
        comm_states = self.comm_state.state_dict()
        if self.rank == 0:
            write_checkpoint(Path(path), {"step": step, "world_size": self.world_size, "config": asdict(self.config),
                                          "model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                                          "comm": comm_states})
        dist.barrier()

    def save_sharded_checkpoint(self, path: Path, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        token = [secrets.token_hex(8)]
        dist.broadcast_object_list(token)  # rank 0's: every rank writes into the same new folder
        partial = sharded_partial_path(path, token[0])
        try:
            dcp.save(self.sharded_state(), checkpoint_id=partial)  # returns on every rank once .metadata is written
            if self.rank == 0:
                finish_sharded_checkpoint(partial, path, step, self.world_size, asdict(self.config))
        finally:
            if self.rank == 0:  # a failed save leaves no half-written folder (after a rename, there is none)
                shutil.rmtree(partial, ignore_errors=True)
        dist.barrier()

    def sharded_state(self) -> dict:
        """What DCP saves and loads in place: model and optimizer shards, and the comm state (a Stateful: the hook's,
        the route's or --sync's, which holds each rank's own parameters and optimizer state after local steps)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optimizer": optimizer, "comm": self.comm_state}

    def load_checkpoint(self, path: str) -> int:
        """build_config has checked the checkpoint against this run; --lr replaces the saved rate. Under --sync and
        --local-route the comm state, loaded last, gives each rank its own parameters and optimizer state (--fsdp:
        DCP saved one replica's model and optimizer)."""
        if self.config.fsdp:
            from torch.distributed.checkpoint.state_dict import set_state_dict

            state = self.sharded_state()
            comm = {"comm": state.pop("comm")}
            comm_fsdp.load_checkpoint(state, path)
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"])
            comm_fsdp.load_checkpoint(comm, path)  # after them: it holds each rank's own (the sync's parts)
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


def _progress(steps: range, enabled: bool, desc: str):
    from tqdm import tqdm

    return tqdm(steps, desc=desc, unit="step", disable=not enabled, dynamic_ncols=True)
