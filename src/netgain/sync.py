"""Synchronize less often: DiLoCo's outer steps around your optimizer, pseudo-gradients in summable codes.

    inner = torch.optim.AdamW(model.parameters(), lr=3e-4)
    outer = netgain.sync.wrap(model, inner, SyncConfig(period=64, bits=4, fragments=4, overlap_steps=2))
    for inputs, labels in loader:              # this rank's own data
        loss = torch.nn.functional.cross_entropy(model(inputs), labels)
        inner.zero_grad()
        loss.backward()
        outer.step()                           # inner.step(), then whatever sync is due
    outer.wait()                               # apply the averages still on the wire
    outer.close()                              # before the process group is destroyed

Why. Per-step compression keeps one collective round trip per step. DiLoCo (arXiv 2311.08105) lets
each worker take H inner steps alone, averages the pseudo-gradients Δ = global − local parameters,
and applies the average to the global parameters with an outer SGD with Nesterov momentum (lr 0.7,
momentum 0.9): H times fewer collectives. Streaming DiLoCo (arXiv 2501.18512) syncs fragments of the
model in turn, overlaps each fragment's collective with the next inner steps, and sends 4-bit outer
gradients. A pseudo-gradient is averaged by all-reduce, so Global-QSGD's summable codes apply
unchanged: each fragment's Δ, one flat tensor, goes through the DDP bucket pipeline
(`CommState.reduce_flat`: header, codec, errors raised on every rank, statistics in ``outer.comm``).

PyTorch's `PostLocalSGDOptimizer` with `PeriodicModelAverager` averages the parameters themselves in
fp32 and takes the average as the new parameters: no outer optimizer (outer lr 1, momentum 0), no
fragments, overlap, compression or checkpoint of its own. Its calling convention is kept:
``outer.step()`` runs the inner ``optimizer.step()``, then the outer work.

Schedule. After inner step t, fragment f of F is due when t % period == f * period // F: its Δ is
taken at once and averaged on one background thread (fragments in launch order, so every rank
issues the same collectives in the same order), and the average is applied ``overlap_steps`` steps
later, waiting for it if needed. That step is fixed by the step count, never by when the collective
ends, so every rank applies it at the same step and a resume repeats the uninterrupted run bit for bit.

Codecs. gqsgd (the default), qsgd and gqsgd-exp are unbiased: their error averages out over syncs,
so no error feedback is needed. fp16 and bf16 round to nearest; none is exact. Error-feedback codecs
and the planners are not offered yet. docs/sync.md has the rest: fields, fragments, checkpoints.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import dataclasses
import functools
import itertools
import json
import numbers
import statistics
import time
import types
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from .comm.adaptive import TIE, TRIAL_RANGE, WARM_STALL_S
from .comm import kernel
from .comm.bucket import on_stream
from .comm.codecs import Context, NonFiniteGradientError, PlanMismatchError, check_integer, warm
from .comm.fsdp import FSDPCommState, laid, raise_on_every_shard, read_header, unlaid
from .comm.config import CODEC_CONFIGS, STATELESS_CONFIGS as CONFIGS, CodecConfig, CommConfig, codec_config
from .comm.fused import Segments, name_key
from .comm.hooks import CommState, _default_group_timeout, check_same_config, check_saved
from .comm.store import BucketLayout

__all__ = ["CODECS", "LocalRoute", "NonFiniteGradientError", "PlanMismatchError", "SyncConfig", "SyncOptimizer", "offer",
           "wrap"]

FORMAT = "netgain.sync/1"
APPLIED_STATISTICS = ("wire_bytes", "raw_bytes", "encode_s", "decode_s", "comm_s")  # summed in last_step
CODECS = tuple(name for name, config in CODEC_CONFIGS.items() if config in CONFIGS)


@dataclass(frozen=True)
class SyncConfig:
    """What is synced, how often, how it is coded, and the outer optimizer; checked on construction.

    period: inner steps between two syncs of a fragment (DiLoCo's H).
    fragments: parts of the model synced in turn, one every period // fragments steps (Streaming DiLoCo).
    codec: how a pseudo-gradient is averaged: a name from CODECS or its config (GlobalQSGDConfig(bits=4)).
    bits: the named codec's bits (None: its default); only with a codec name that takes bits.
    outer_lr, outer_momentum, nesterov: the outer SGD (DiLoCo's: 0.7, 0.9, Nesterov).
    overlap_steps: inner steps a fragment's average stays on the wire before it is applied (Streaming
        DiLoCo's tau, torchft's fragment_sync_delay); 0: applied in the step that launched it.
    mix: the share of a fragment's local parameters kept when the new global ones arrive (Streaming
        DiLoCo's alpha, torchft's fragment_update_alpha); 0: replaced by them.
    seed: keys the codec's rounding noise.
    A bad value raises ValueError naming the field.
    """
    period: int = 16
    codec: "str | CodecConfig" = "gqsgd"
    bits: int | None = None
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    fragments: int = 1
    overlap_steps: int = 0
    mix: float = 0.0
    seed: int = 0

    def __post_init__(self):
        check_integer("period", self.period, 1)
        check_integer("fragments", self.fragments, 1)
        if self.fragments > self.period:
            raise ValueError(f"fragments must be <= period={self.period} (one fragment is due per step at most), "
                             f"got fragments={self.fragments}")
        check_integer("overlap_steps", self.overlap_steps, 0)
        if self.overlap_steps >= self.period:
            raise ValueError(f"overlap_steps must be < period={self.period} (a fragment's average is applied before "
                             f"its next sync), got overlap_steps={self.overlap_steps}")
        check_integer("seed", self.seed)
        for name, ok, what in (("outer_lr", lambda v: 0 < v < float("inf"), "> 0 and finite"),
                               ("outer_momentum", lambda v: 0 <= v < 1, "in [0, 1)"), ("mix", lambda v: 0 <= v <= 1, "in [0, 1]")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not ok(value):
                raise ValueError(f"{name} must be a number {what}, got {value!r}")
            object.__setattr__(self, name, float(value))
        if not isinstance(self.nesterov, bool):
            raise ValueError(f"nesterov must be True or False, got {self.nesterov!r}")
        if self.nesterov and self.outer_momentum == 0:
            raise ValueError("nesterov=True needs outer_momentum > 0; pass nesterov=False for plain outer SGD")
        self.comm_config()  # checks codec and bits

    def comm_config(self) -> CommConfig:
        """The codec as the DDP hook's pipeline takes it: every fragment coded (no warm-up, no size floor),
        NaN/Inf raised on every rank."""
        if isinstance(self.codec, str):
            if self.codec not in CODECS:
                raise ValueError(f"codec={self.codec!r} is not one of {CODECS}")
            takes_bits = "bits" in {f.name for f in dataclasses.fields(CODEC_CONFIGS[self.codec])}
            if self.bits is not None and not takes_bits:
                raise ValueError(f"bits: codec {self.codec!r} takes no bits, got bits={self.bits!r}")
            codec = codec_config(self.codec, bits=self.bits)
        elif isinstance(self.codec, CONFIGS):
            if self.bits is not None:
                raise ValueError(f"bits: set the bits in the codec config itself, got bits={self.bits!r} "
                                 f"beside {self.codec!r}")
            codec = self.codec
        else:
            raise ValueError(f"codec must be one of {CODECS} or the config of one, got {self.codec!r}")
        return CommConfig(codec, warmup_steps=0, min_compress_numel=0, seed=self.seed)

    def describe(self) -> dict:
        """Every field, the codec resolved: what ranks compare and checkpoints hold."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("codec", "bits", "seed")}
        return {**fields, "comm": self.comm_config().describe()}


@dataclass(eq=False)
class _Fragment:
    """One part of the model: its parameters and, flat in fp32 on their device, the outer state."""
    index: int
    offset: int                   # due when inner_steps % period == offset
    names: list[str]
    params: list[torch.nn.Parameter]
    global_: torch.Tensor         # the global parameters
    momentum: torch.Tensor        # the outer optimizer's momentum
    delta: torch.Tensor           # scratch: Δ = global − local, then its average over the ranks
    layout: BucketLayout          # what the codec pipeline knows of the flat tensor (names, spans, segments)
    global_views: list[torch.Tensor]
    delta_views: list[torch.Tensor]

    @classmethod
    def build(cls, index: int, offset: int, named: list[tuple[str, torch.nn.Parameter]]) -> _Fragment:
        names, params = [n for n, _ in named], [p for _, p in named]
        sizes = [p.numel() for p in params]
        device = params[0].device
        global_ = torch.cat([p.detach().reshape(-1).float() for p in params])
        delta = torch.empty_like(global_)
        spans = list(zip(itertools.accumulate([0] + sizes[:-1]), sizes))
        layout = BucketLayout(names, spans, Segments.build(sizes, [name_key(n) for n in names], device))
        return cls(index, offset, names, params, global_, torch.zeros_like(global_), delta, layout,
                   _views(global_, params), _views(delta, params))


def alike(flats: list[torch.Tensor], group) -> list[bool]:
    """Whether each flat fp32 tensor holds the same bits on every rank: a fingerprint of its bits (a weighted sum
    of them as integers, wrapping) per tensor, and one small MAX allreduce of the fingerprints and their negations."""
    prints = torch.stack([_fingerprint(flat) for flat in flats])
    agreed = torch.cat([prints, -prints])
    dist.all_reduce(agreed, dist.ReduceOp.MAX, group=group)
    return (agreed[:len(flats)] == -agreed[len(flats):]).tolist()


def _fingerprint(flat: torch.Tensor, chunk: int = 1 << 22) -> torch.Tensor:
    """sum_i (i + 1) * bits_i over the fp32 tensor's bits as integers, in int64 (wrapping), a chunk at a time so that
    the scratch stays a few chunks of memory on any model."""
    bits = flat.view(torch.int32)
    weights = torch.arange(1, min(chunk, bits.numel()) + 1, device=flat.device)
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, bits.numel(), chunk):
        part = bits[start:start + chunk].long()
        total += (part * (weights[:part.numel()] + start)).sum()
    return total


def _views(flat: torch.Tensor, params) -> list[torch.Tensor]:
    return [chunk.view(p.shape) for chunk, p in zip(flat.split([p.numel() for p in params]), params)]


@dataclass(eq=False)
class _Sync:
    """A fragment's average on its way: launched, applied after inner step ``due``."""
    fragment: _Fragment
    due: int
    done: concurrent.futures.Future


class SyncOptimizer:
    """DiLoCo around ``optimizer``: build it with `wrap`; call `step()` where you called ``optimizer.step()``.

    Attributes: ``optimizer`` (the inner one, yours: schedulers and zero_grad go to it), ``config``,
    ``inner_steps``, ``eager`` (the codec begins no compile, and runs eagerly unless a graph is compiled already: auto's route on trial),
    ``comm`` (the codec pipeline's CommState: per-sync statistics in
    ``comm.history``, the last in ``comm.last_step``), ``process_group``, and of the last `step()`
    (or `wait()`): ``applied``, the pipeline's records of the averages it applied (most steps: none;
    an average loaded from a checkpoint has none; the step is the schedule's, so every run has them
    on the same steps), and ``wait_s``, the seconds it waited for them: the communication the inner
    steps did not hide; ``last_step`` sums them up as the hook's statistics do.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: SyncConfig,
                 process_group: dist.ProcessGroup | None = None, *, shard_verdicts: bool = True):
        named = _local_shards(model, process_group)
        if not named:
            raise ValueError("model has no trainable parameters to sync")
        if len({p.device for _, p in named}) > 1:
            raise ValueError(f"model's parameters lie on several devices ({sorted({str(p.device) for _, p in named})}): "
                             "netgain.sync keeps one flat buffer per fragment on one device")
        if config.fragments > len(named):
            raise ValueError(f"fragments={config.fragments} is more than the model's {len(named)} trainable parameters: "
                             "each fragment holds whole parameters")
        if not dist.is_initialized():
            raise RuntimeError("netgain.sync needs the process group up: call torch.distributed.init_process_group "
                               "first (torchrun sets its environment)")
        self.config, self.optimizer, self.inner_steps = config, optimizer, 0
        meshes = [p.device_mesh for p in model.parameters() if isinstance(p, DTensor)]
        self._sharded = bool(meshes)
        self._shard_mesh = meshes[0] if meshes else None  # under FSDP2: this rank's replica, one rank per shard
        # under FSDP2 every shard position's: the whole parameters' names and shapes, not its shards'
        self._model = _signature([(n, p) for n, p in model.named_parameters() if p.requires_grad])
        # FSDP2: a failed average (NaN/Inf, a mismatch) is raised on its replicas only, so the other shard
        # positions learn of it over the shard mesh, else they would wait in FSDP's next all-gather. False: the
        # caller does it (the route, through netgain.comm.fsdp's step verdict: its shard positions may not sync at
        # the same steps)
        self.shard_group = meshes[0].get_group() if meshes and shard_verdicts else None
        self.applied: list[dict] = []
        self.wait_s = 0.0
        self.eager = False  # through kernel.cold, on the sync thread
        # Ranks compare config and model before new_group, which ranks that disagree would call on one side only
        check_same_config(types.SimpleNamespace(describe=lambda: {"sync": config.describe(), "model": _signature(named)}),
                          process_group)
        if process_group is None:
            process_group = dist.new_group(backend=dist.get_backend(), timeout=_default_group_timeout())
        self.process_group = process_group
        self.fragments = [_Fragment.build(f, f * config.period // config.fragments, part)
                          for f, part in enumerate(_split(named, config.fragments))]
        self._due = {fragment.offset: fragment for fragment in self.fragments}
        # every rank starts from rank 0's parameters, as DDP does; fragments already alike on every rank (DDP's
        # replicas, models seeded alike) are not sent: on the lab at 50 Mbit/s the route's broadcast on entering
        # took 2.4 s of the lm job's 1.7 M parameters
        source = dist.get_global_rank(self.process_group, 0)
        same_bits = alike([fragment.global_ for fragment in self.fragments], self.process_group)
        with torch.no_grad():
            for fragment, same in zip(self.fragments, same_bits):
                if not same:
                    dist.broadcast(fragment.global_, src=source, group=self.process_group)
                    torch._foreach_copy_(fragment.params, fragment.global_views)
        self.comm = CommState(config.comm_config(), process_group=self.process_group)
        self.comm.check_config(self.process_group)  # compared above: marks it so no sync compares it again
        device = self.fragments[0].global_.device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="netgain-sync", initializer=_thread_start,
                                            initargs=(torch.get_num_threads(), device))
        self._pending: deque[_Sync] = deque()

    def step(self, closure=None):
        """The inner step, then the outer work due after it; returns what the inner step returned.

        Raises NonFiniteGradientError on every rank when a fragment's pseudo-gradient held NaN/Inf on
        some rank (at the step its average was due), PlanMismatchError when ranks disagree.
        """
        loss = self.optimizer.step() if closure is None else self.optimizer.step(closure)
        self.after_inner_step()
        return loss

    def after_inner_step(self) -> None:
        """The outer work due after an inner step taken by the caller (`step()` without the inner step)."""
        self.inner_steps += 1
        fragment = self._due.get(self.inner_steps % self.config.period)
        if fragment is not None:
            self._launch(fragment)
        self._apply_due(self.inner_steps)

    @property
    def last_step(self) -> dict:
        """The last step's communication: ``wait_s``, and summed over the averages it applied (on most steps none:
        an average's bytes count at the step that applies it) their ``wire_bytes``, ``raw_bytes`` and seconds."""
        return {"wait_s": self.wait_s, **{key: sum(record[key] for record in self.applied) for key in APPLIED_STATISTICS}}

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def wait(self) -> None:
        """Apply every average still on the wire now, e.g. after the last step (every rank at the same step)."""
        self._apply_due(float("inf"))

    def _apply_due(self, step: float) -> None:
        """Apply the averages due after inner step ``step``, in launch order; ``applied`` and ``wait_s`` say what."""
        self.applied, self.wait_s = [], 0.0
        while self._pending and self._pending[0].due <= step:
            self._apply(self._pending.popleft())

    @torch.no_grad()
    def _launch(self, fragment: _Fragment) -> None:
        torch._foreach_copy_(fragment.delta_views, fragment.params)
        torch.sub(fragment.global_, fragment.delta, out=fragment.delta)
        ready = None
        if self._stream is not None:  # the side stream starts after Δ is written, never blocking this one
            ready = torch.cuda.Event()
            ready.record()
        done = self._executor.submit(self._average, fragment, ready, self.inner_steps)
        self._pending.append(_Sync(fragment, self.inner_steps + self.config.overlap_steps, done))

    def _average(self, fragment: _Fragment, ready, step: int) -> dict:
        """On the sync thread: Δ becomes its mean over the ranks, through the codec (a CUDA decode is
        finished on return: reduce_flat synchronizes the device); returns the pipeline's record of it."""
        try:
            with on_stream(self._stream, ready), kernel.cold(self.eager):
                self.comm.reduce_flat(fragment.index, fragment.delta, fragment.layout)
        except NonFiniteGradientError as error:  # the hook's hint, nonfinite='uncompressed', is no option here
            raise NonFiniteGradientError(f"the pseudo-gradient (global minus local parameters) of fragment {fragment.index}, "
                                         f"synced after inner step {step}, is not finite: "
                                         f"{str(error).partition('; pass nonfinite')[0]}") from None
        finally:
            self.comm.end_step()
        return self.comm.last_step

    @torch.no_grad()
    def _apply(self, sync: _Sync) -> None:
        """The outer Nesterov step on the fragment's global copy (torch.optim.SGD's arithmetic), then the
        local parameters from it."""
        start = time.perf_counter()
        if self.shard_group is not None:  # every shard position applies an average at this step
            raise_on_every_shard(sync.done.exception(), self.shard_group, sync.fragment.delta.device,
                                 f"netgain.sync after inner step {self.inner_steps}")
        record = sync.done.result()  # raises the sync thread's error, the same on every rank of the process group
        self.wait_s += time.perf_counter() - start
        if record is not None:
            self.applied.append(record)
        fragment, config = sync.fragment, self.config
        average = fragment.delta
        fragment.momentum.mul_(config.outer_momentum).add_(average)
        update = average.add_(fragment.momentum, alpha=config.outer_momentum) if config.nesterov else fragment.momentum
        fragment.global_.sub_(update, alpha=config.outer_lr)
        if config.mix:  # the scratch, free again, holds the mix in fp32
            torch._foreach_copy_(fragment.delta_views, fragment.params)
            fragment.delta.lerp_(fragment.global_, 1.0 - config.mix)
            torch._foreach_copy_(fragment.params, fragment.delta_views)
        else:
            torch._foreach_copy_(fragment.params, fragment.global_views)

    def _settle(self) -> None:
        """Wait until no collective is on the sync thread; raise a failed one's error (the same on every rank)."""
        concurrent.futures.wait([sync.done for sync in self._pending])
        for sync in self._pending:
            sync.done.result()

    # ---- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything every rank needs to resume bit for bit (collective: call it on every rank at the same step).

        Holds the global parameters, the outer momentum, the step, the averages still to apply, the
        codec state and, per rank, its local parameters and inner optimizer state: save rank 0's alone
        and load it on every rank, in place of saving the model and the inner optimizer. Tensors,
        numbers, strings, lists and dicts only: read it with torch.load(path, weights_only=True).

        Under FSDP2 (sharded parameters) a DCP Stateful instead (`_sharded_state`): save it with the model and
        optimizer through torch.distributed.checkpoint, on every rank, and load it with
        netgain.comm.fsdp.load_checkpoint after them.
        """
        if self._sharded:
            return self._sharded_state()
        self._settle()
        local = {"params": {n: p.detach().cpu().clone() for f in self.fragments for n, p in zip(f.names, f.params)},
                 "optimizer": _to_cpu(self.optimizer.state_dict())}
        ranks = [None] * dist.get_world_size(self.process_group)
        dist.all_gather_object(ranks, local, group=self.process_group)
        return {"format": FORMAT, "config": self.config.describe(), "world_size": len(ranks), "step": self.inner_steps,
                "global": self._by_name("global_"), "momentum": self._by_name("momentum"),
                "pending": [{"fragment": s.fragment.index, "due": s.due, "average": s.fragment.delta.cpu().clone()}
                            for s in self._pending],
                "comm": self.comm.state_dict(), "local": ranks}

    def _by_name(self, flat: str) -> dict[str, torch.Tensor]:
        """Each fragment's flat ``flat`` buffer (global_ or momentum) per parameter name, on the CPU."""
        return {n: v.cpu().clone() for f in self.fragments for n, v in zip(f.names, _views(getattr(f, flat), f.params))}

    def load_state_dict(self, state: dict) -> None:
        """Resume from what `state_dict()` returned (on any rank): every rank loads the same object.

        ValueError for a state of another config, world size or model, or one that is malformed.
        Averages on the wire when it is called are dropped. Under FSDP2 the DCP state `state_dict()` returned,
        loaded in place (netgain.comm.fsdp.load_checkpoint, after the model and optimizer): each rank its own.
        """
        if self._sharded:
            self.load_parts(state, self.check_header(state.get("header")))
            return
        rank, world = dist.get_rank(self.process_group), dist.get_world_size(self.process_group)
        shapes = {n: tuple(p.shape) for f in self.fragments for n, p in zip(f.names, f.params)}
        _check_state(state, self.config.describe(), world, shapes, [f.global_.numel() for f in self.fragments])
        concurrent.futures.wait([sync.done for sync in self._pending])  # the sync thread idle, then the codec state
        self.comm.load_state_dict(state["comm"])  # which checks its part
        self._pending.clear()
        local = state["local"][rank]
        with torch.no_grad():
            for fragment in self.fragments:
                for name, param, global_, momentum in zip(fragment.names, fragment.params, fragment.global_views,
                                                          _views(fragment.momentum, fragment.params)):
                    global_.copy_(state["global"][name])
                    momentum.copy_(state["momentum"][name])
                    param.copy_(local["params"][name])
            for entry in state["pending"]:
                fragment = self.fragments[entry["fragment"]]
                fragment.delta.copy_(entry["average"])
                done = concurrent.futures.Future()
                done.set_result(None)
                self._pending.append(_Sync(fragment, entry["due"], done))
        self.optimizer.load_state_dict(local["optimizer"])
        self.inner_steps = state["step"]

    # ---- checkpoints under FSDP2: each shard position's state, and each rank's own, through DCP ------
    def _sharded_state(self) -> dict:
        """A DCP Stateful's state: ``header``, every shard position's JSON header (`position_header`), gathered over the
        shard mesh, and this position's parts (`sharded_parts`). Collective over the whole mesh: an average that
        failed on the wire raises on every rank."""
        raise_on_every_shard(self.settled_error(), self._shard_mesh.get_group(), self.fragments[0].global_.device,
                             "netgain.sync's checkpoint")
        parts = self.sharded_parts()
        headers = [None] * self._shard_mesh.size()
        dist.all_gather_object(headers, self.position_header(), group=self._shard_mesh.get_group())
        return {"header": json.dumps(headers), **parts}

    def sharded_parts(self) -> dict[str, DTensor]:
        """This shard position's state as DTensors over its replicas (comm.fsdp.laid), keyed ``part.position``. What
        the replicas hold alike, one copy: ``global``, ``momentum``, ``average`` (the fragments' scratch, holding
        the averages still to apply). What each rank holds alone after local steps: ``params`` (its shards, in their
        widest dtype) and ``inner.<dtype>`` (its inner optimizer's tensors): DCP saves one replica's model and
        optimizer, so these give each rank its own back (on the parameters' device: AdamW keeps its step counts on
        the CPU). Call once `settled_error()` is None on every shard position; no collective."""
        device, widest = self.fragments[0].global_.device, self._widest()
        replicas = DeviceMesh.from_group(self.process_group, device.type)
        position = self._shard_mesh.get_local_rank()
        return {f"{key}.{position}": laid(torch.cat([t.detach().reshape(-1).to(device, widest if key == "params"
                                                                               else t.dtype) for t in tensors]),
                                          replicas, per_rank=key == "params" or key.startswith("inner."))
                for key, tensors in self._parts().items()}

    def settled_error(self) -> Exception | None:
        """Wait until no collective is on the sync thread; the first failed average's error, not raised."""
        concurrent.futures.wait([sync.done for sync in self._pending])
        return next((sync.done.exception() for sync in self._pending if sync.done.exception() is not None), None)

    @property
    def loads_last(self) -> bool:
        """Under FSDP2 its DCP state loads after the model and optimizer (netgain.comm.fsdp.load_checkpoint)."""
        return self._sharded

    def _parts(self) -> dict[str, list[torch.Tensor]]:
        """This rank's sharded state, by part, as the tensors each part flattens (`sharded_parts`)."""
        parts = {key: [getattr(f, attr) for f in self.fragments]
                 for key, attr in (("global", "global_"), ("momentum", "momentum"), ("average", "delta"))}
        parts["params"] = [p for f in self.fragments for p in f.params]
        parts.update((f"inner.{dtype}", tensors) for dtype, tensors in self._inner_tensors().items())
        return parts

    def _widest(self) -> torch.dtype:
        """The parameters' widest dtype, which holds every one's values exactly."""
        return functools.reduce(torch.promote_types, (p.dtype for f in self.fragments for p in f.params))

    def _inner_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The inner optimizer's state tensors on this rank (a DTensor's local shard), by dtype, in its order."""
        tensors: dict[str, list[torch.Tensor]] = {}
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                for key, value in sorted(self.optimizer.state.get(param, {}).items()):
                    if isinstance(value, torch.Tensor):
                        value = value.to_local() if isinstance(value, DTensor) else value
                        tensors.setdefault(str(value.dtype).removeprefix("torch."), []).append(value)
        return tensors

    def position_header(self) -> dict:
        """This shard position's header, alike on its replicas: the format, config, replicas (world_size), model,
        step, codec step, the averages on the wire and each part's dtype and size."""
        widest = self._widest()
        return {"format": FORMAT, "config": self.config.describe(), "world_size": dist.get_world_size(self.process_group),
                "model": self._model, "step": self.inner_steps, "comm_step": self.comm.step,
                "pending": [[s.fragment.index, s.due] for s in self._pending],
                "parts": {key: [str(widest if key == "params" else tensors[0].dtype).removeprefix("torch."),
                                sum(t.numel() for t in tensors)] for key, tensors in self._parts().items()}}

    def check_header(self, header) -> dict:
        """Under FSDP2, this shard position's saved header (from `_sharded_state`'s JSON list) as a dict, or
        ValueError naming what differs from this run (`check_position`), raised on every rank of the mesh."""
        if not self._sharded:
            raise ValueError("netgain.sync's header is FSDP2's (a DCP state); without FSDP2 load what state_dict() "
                             "returned with load_state_dict()")
        saved, error = read_header(header), None
        try:
            if not (isinstance(saved, list) and len(saved) == self._shard_mesh.size()):
                raise ValueError(f"not a netgain sync state of this run's {self._shard_mesh.size()} shard positions "
                                 f"(its header holds {len(saved) if isinstance(saved, list) else 'no list of'} "
                                 "positions; from SyncOptimizer.state_dict() under FSDP2)")
            saved = self.check_position(saved[self._shard_mesh.get_local_rank()])
        except ValueError as failed:
            error = failed
        raise_on_every_shard(error, self._shard_mesh.get_group(), self.fragments[0].global_.device,
                             "netgain.sync's checkpoint")
        return saved

    def check_position(self, saved) -> dict:
        """``saved`` if it is this shard position's header of this run's config, replicas, model and inner optimizer
        state (load that first), else ValueError naming what differs or what is malformed."""
        mine = json.loads(json.dumps(self.position_header()))
        check_saved(saved, FORMAT, mine["config"], "sync", mine["world_size"],
                    "each rank's local parameters and inner optimizer state are its own")
        for key, what in (("model", "model"), ("parts", "parts (the inner optimizer's state: load it, through DCP, "
                                                         "before the sync's)")):
            if saved.get(key) != mine[key]:
                raise ValueError(f"the sync state does not fit this run: its {what} was {saved.get(key)!r}, "
                                 f"this run's is {mine[key]!r}")
        pending, comm_step = saved.get("pending"), saved.get("comm_step")
        if not (type(comm_step) is int and comm_step >= 0 and isinstance(pending, list) and all(
                isinstance(e, list) and len(e) == 2 and all(type(v) is int for v in e) and 0 <= e[0] < len(self.fragments)
                and e[1] > saved["step"] for e in pending)):
            raise ValueError("the sync state is malformed: its header needs comm_step (an integer >= 0) and pending, "
                             "[fragment, due after a later step] per average on the wire")
        return saved

    @torch.no_grad()
    def load_parts(self, parts: dict, header: dict) -> None:
        """Restore this shard position's parts (loaded in place by DCP) and its checked ``header``."""
        concurrent.futures.wait([sync.done for sync in self._pending])
        self._pending.clear()
        position = self._shard_mesh.get_local_rank()
        for key, tensors in self._parts().items():
            for tensor, saved in zip(tensors, unlaid(parts[f"{key}.{position}"]).split([t.numel() for t in tensors])):
                tensor.copy_(saved.view(tensor.shape))
        for index, due in header["pending"]:
            done = concurrent.futures.Future()
            done.set_result(None)
            self._pending.append(_Sync(self.fragments[index], due, done))
        self.inner_steps, self.comm.step = header["step"], header["comm_step"]

    def close(self) -> None:
        """Wait for the sync thread's collectives, then stop it; averages not yet applied are dropped (call
        `wait()` first to apply them). Call before destroying the process group."""
        self._executor.shutdown(wait=True)
        self.comm.close()


# auto's route of local steps: its settings (periodic averaging in 4 bits, DiLoCo's outer step off) and their steps
# to the target as a multiple of fp32 DDP's, measured with bench/time_to_accuracy.py (sync-h8-b4-avg), 3 workers,
# 3 seeds: on the lab's lm job (1.7 M parameters, Python source) 158.6-170.7 steps to fp32's 120 at 1 Gbit/s, 162.5 at
# 10 Mbit/s (1.35x); on a second job (6.9 M parameters, the Python docs) 115.5-128.4 to 120 (1.02x)
# (bench/results/time_to_accuracy_auto_sync_1gbit_3w_ed2ff69.md, ..._job2_1gbit_3w_0c68bd6.md). It differs by job
# and no run can measure it before the target: ROUTE_STEPS is the two jobs' geometric mean (1.17), rounded up. With
# 1.35 the route lost its trial in every round of the second job (priced 0.465-0.493 s against 0.448-0.478), where
# alone it reached the target in 36.2 s, against 50.1 s for the fastest per-step contestant (low rank r4)
ROUTE = SyncConfig(period=8, bits=4, outer_lr=1.0, outer_momentum=0.0, nesterov=False, overlap_steps=1)
ROUTE_STEPS = 1.2
ROUTE_TRIAL_SYNCS = 2  # the route runs this many periods on trial, and is priced on the last
ROUTE_FORMAT = "netgain.route/1"


def route_wins(route_price: float, price: float) -> bool:
    """Whether the route's measured price beats the per-step plan's: by more than TIE, as auto breaks its own ties,
    toward the plan whose steps to the target are surer. The route's ROUTE_STEPS is an estimate (the fixed route took
    1.35-1.41x fp32's steps on the lab's first job, 1.02x on the second), low rank's LOWRANK_STEPS too, fp32's exact.
    On the first job at 50 Mbit/s the route won two trials by 1% (0.150 s against 0.152, 0.173 against 0.175) and
    took 22.8 and 19.1 s to the target against `auto` alone's 16.6 and 15.0 (773b581, rounds 0 and 2)."""
    return price > (1 + TIE) * route_price


class LocalRoute:
    """auto's route of local steps beside its per-step plans: build it with `offer`.

    Where the model prices the route (`_predicted`) below auto's per-step plan (its measured price once settled, before
    that every plan's) by enough that a trial is worth its risk (`_choose`, `_worth_trying`), every rank
    takes ROUTE_TRIAL_SYNCS periods of local steps
    (DDP's reducer is off, as in its no_sync(), so each rank steps on its own gradient; under FSDP2 each replica
    steps on its own, reduce-scattered inside it, and syncs its shards with the other replicas'; a SyncOptimizer
    averages the parameters every period, in summable codes; its codec begins no compile, on trial and after, until its
    eager averages have cost the stall a compile would (WARM_STALL_S), and then its kernels compile ahead, `_warm`). Its price, from the trial's last
    period, is its median step less its waits for averages, plus those waits spread over its steps (the slowest
    rank's), times its steps to the target (``steps``); it stays where that is more than TIE below the per-step plan's
    price (`route_wins`),
    else the per-step plan runs again from the average just applied (every replica then holds the same parameters, and the mean of the inner
    optimizer's states). The choice is made once, but for an early trial that lost: its price then meets the
    settled plan's.

    ``phase``: "per-step", "trial" or "local"; ``sync``: the SyncOptimizer while local (its ``comm`` has the
    averages' statistics). `state_dict()` / `load_state_dict()` checkpoint the hook's state with the route's:
    under DDP save rank 0's alone, in place of the comm state, model and optimizer; under FSDP2 it is a DCP
    Stateful, saved beside the model and optimizer and loaded after them (netgain.comm.fsdp.load_checkpoint).
    """

    def __init__(self, state: CommState, model: "DistributedDataParallel | FSDPModule", optimizer: torch.optim.Optimizer,
                 config: SyncConfig, steps: float):
        self.state, self.optimizer, self.config, self.steps = state, optimizer, config, steps
        self.ddp = model if isinstance(model, DistributedDataParallel) else None
        self.model = model.module if self.ddp is not None else model
        self.phase, self.sync = "per-step", None
        self.price: float | None = None  # the per-step price the route's was compared with (for an early trial the
        # cheapest per-step plan's when it began; once it lost, the settled plan's)
        self.route_price: float | None = None  # the route's, measured on trial (or the model's, where it ran none)
        self._times: list[float] = []    # the trial's steps: seconds less the wait for averages, this rank's
        self._waits: list[float] = []    # and the seconds each waited for averages
        self._last: float | None = None
        self._trying = False  # of the last step (last_step); and its SyncOptimizer.last_step if it was local, else None
        self._local_step: dict | None = None
        self._named = _local_shards(self.model, state.process_group)  # what it syncs: parameters or FSDP2's shards
        trained = [p for _, p in self._named]
        self._raw_bytes = sum(p.numel() * p.element_size() for p in trained)
        self._world_size = dist.get_world_size(state.process_group)
        self._payload = (sum(p.numel() for p in trained) * config.comm_config().codec.build().wire_bits(self._world_size)
                         / 8)  # one average's bytes
        self._warmed = False
        self._rent = 0.0        # the seconds its eager averages took so far (encode and decode, this rank's)
        self._early = False     # the trial began before the per-step plan was settled (`_choose`)
        self._measured = False  # and lost: its measured price waits for the settled plan's
        self._leave_bytes: float | None = None  # what leaving sends (`_leave_s`), once the optimizer has state
        self._hook = optimizer.register_step_post_hook(lambda *_: self._after_step())

    def _warm(self) -> None:
        """Run the route's codec once on a scratch copy of the parameters, its output dropped, so its kernels
        compile in the background: once the route is local (won, or entered for good) and its eager averages have
        cost what the compile's stall would (ski rental, as auto's warm-ups: WARM_STALL_S), so a short run never
        stalls for a compile it could not repay, and a long one pays at most twice the better choice's cost. Eager,
        an average took 0.03-0.06 s against 0.002 compiled on the lab's 1.72 M parameters (one process, one
        thread), and 0.11-0.19 s with 3 ranks on 2 cores (a probe): the rent reaches 4 s after some 20-130
        averages, 160-1000 steps at H=8 (derived), and a trial's price is a little dear. Compiled
        before the trial, the kernels were often the process's first compile (dynamo's and inductor's set-up,
        1.9-3.3 s alone on the lab's 2-core EPYC): 3.2-5.2 s per worker with 3 workers, and the per-step steps
        waiting for it ran at 0.19-1.00 s, so that auto offered the route left round 0's race of two grids
        (c5dbe09, de52428) even where it then lost the trial; where the compile's heat was left to the trial
        (eb6cfcc), it turned hot inside it, and a 0.62 s step priced the route at 0.289 s against 0.122."""
        if self._warmed:
            return
        self._warmed = True
        fragment = _Fragment.build(0, 0, self._named)
        warm(self.config.comm_config().codec.build(), fragment.global_,
             Context.for_step(self._world_size, fragment.layout.segments, 0, 0, dist.get_rank(self.state.process_group),
                              layout=fragment.layout))

    def _after_step(self) -> None:
        now, last = time.perf_counter(), self._last
        try:
            self._account(now, last)
        finally:
            # the next step's time runs from here: this step's wait for an average (in after_inner_step) is its own.
            # Taken before it, a wait counted against the next step: on the lab at 1 Gbit/s a trial read -0.21 s
            # for one step and 0.37-0.40 for the next (a probe)
            self._last = time.perf_counter()

    def _account(self, now: float, last: float | None) -> None:
        """The step just taken, from ``last`` (the previous step's hook's end) to ``now``."""
        # the step just taken: the hook ran unless it was local (DDP's reducer, or the FSDP hook's average, is off
        # exactly while sync is set)
        self._trying, self._local_step = self.phase == "trial", None
        if self.sync is None:
            if self.phase == "per-step":
                self._choose()
            return
        try:
            self.sync.after_inner_step()
        except Exception as error:
            if self.ddp is not None:
                raise
            self.state.fail(error)  # raised on every rank of the mesh at the next backward's end
            return
        self._local_step = self.sync.last_step
        if self.sync.eager:
            self._rent += self._local_step["encode_s"] + self._local_step["decode_s"]
            if self.phase == "local" and self._rent >= WARM_STALL_S:
                self._set_phase("local")
        if self.phase != "trial":
            return
        if last is not None:  # (none in the first step after a resume)
            self._times.append(now - last)
            self._waits.append(self.sync.wait_s)
        if self.sync.inner_steps >= ROUTE_TRIAL_SYNCS * self.config.period + self.config.overlap_steps:
            # a step's price, from the trial's last period (the first runs the sync's first calls: on the lab at
            # 1 Gbit/s the steps after its first average took 0.19-0.22 s against 0.06-0.10): the median step less
            # its wait (the user's own spikes, a validation, left out, as the per-step plan's median leaves them),
            # plus the period's waits for averages spread over its steps
            times, waits = self._times[-self.config.period:], self._waits[-self.config.period:]
            step = statistics.median(times) + sum(waits) / len(waits)
            step = torch.tensor(step, dtype=torch.float64)
            dist.all_reduce(step, dist.ReduceOp.MAX, group=self.state.process_group)  # the sync thread is idle
            self.route_price = step.item() * self.steps
            if route_wins(self.route_price, self.price):
                self._set_phase("local")
            else:
                self._leave()
                if self._early:
                    self.phase, self._measured = "per-step", True

    def _choose(self) -> None:
        """Per-step, on agreed prices: a trial of the route, local steps, or the per-step plan for good.

        A trial where it is worth its risk (`_worth_trying`) against the per-step plan's measured price once settled;
        before, against every per-step plan's (the cheapest, measured or the model's, with the link measured at the
        volume of the route's average or of the largest bucket in 16 bits: AdaptivePlanner.best_price). Once settled,
        a route the model prices beyond TRIAL_RANGE above the plan runs no trial.
        On the lab's second job
        at 1 Gbit/s the route won every trial it ran once auto had settled, at steps 12-23, whose per-step steps
        took 0.3-0.4 s against the route's 0.2 (time_to_accuracy_job2_1gbit_3w_397296c.md). Such a trial keeps the
        route for good where its measured price beats that cheapest price (the model tends to underprice per-step
        plans, their overlap and codecs under contention: in the lab grids its forecast of the picked plan's step read
        0.214 and 0.218 s against 0.254 and 0.281 measured on the second job at 1 Gbit/s, 0.085 against 0.144 on the
        first, 397296c, 9414ad7, 23590de); else the per-step plans run until settled, and the
        route's measured price meets the settled plan's then, with no second trial."""
        settled = self.state.planner.settled_price()
        if self._measured:
            if settled is not None:
                self.price, self._measured = settled, False
                if route_wins(self.route_price, settled):
                    self._enter("local")
                else:
                    self.phase = "per-step-chosen"
            return
        price = settled if settled is not None else self.state.planner.best_price(self._payload, self._world_size)
        if price is None:
            return
        predicted = self._predicted()
        if settled is not None and predicted > TRIAL_RANGE * price:
            # the model prices it far dearer: no trial (at 10 Mbit/s one would cost 17 local steps of 0.23 s)
            self.price, self.route_price, self.phase = price, predicted, "per-step-chosen"
            return
        if not self._worth_trying(predicted, price):
            return
        if self._compiling():  # the trial once no rank compiles: it prices no step beside a compile
            return
        self.price, self.route_price, self._early = price, predicted, settled is None
        self._enter("trial")

    def _worth_trying(self, predicted: float, price: float) -> bool:
        """Whether a trial pays for its risk now. Sure, where the model prices the route TRIAL_RANGE below ``price`` (it
        would have to be off by the range it is trusted to within for the trial to lose). Else the trial is a gamble: a
        lost one costs its leaving (`_leave_s`, about 2 s at 50 Mbit/s on the lab's lm job) and cuts the per-step
        plan's own trials short. So it waits until the saving the model prices beyond the tie, over the steps run so
        far, repays that leaving (ski rental: the run taken to last as long again). On the lab's lm job such trials
        lost at both 1 Gbit/s (the model priced the route 0.4-0.7% below) and 50 Mbit/s (0.172 and 0.169 measured
        against 0.134 and 0.142, 93d9cfb), and `auto` offered the route took 1.09x and 1.12x `auto` alone's time."""
        if TRIAL_RANGE * predicted < price:
            return True
        saving = price / (1 + TIE) - predicted
        return saving > 0 and saving * self.state.step >= self._leave_s()

    def _leave_s(self) -> float:
        """The model's seconds to leave a lost trial: the inner optimizer's state averaged (`_leave`) on the monitor's
        fit of the link. Agreed: FSDP2's shards differ in size by rank, so the largest's."""
        if self._leave_bytes is None:
            count = torch.tensor([float(sum(v.numel() * dtype.itemsize for tensors, dtype in self._leave_parts()
                                            for v in tensors))], dtype=torch.float64)
            dist.all_reduce(count, dist.ReduceOp.MAX, group=self.state.process_group)
            self._leave_bytes = count.item()
        return self.state.planner.monitor.predict_s("allreduce", self._leave_bytes, self._world_size)

    def _leave_parts(self) -> list[tuple[list[torch.Tensor], torch.dtype]]:
        """What leaving averages, and in which dtype: the inner optimizer's floating state, this rank's shards under
        FSDP2; the moments in bf16 (fp32's range, relative error 2^-9; in fp32 leaving took 3.7 s on the lab's lm job
        at 50 Mbit/s, in fp64 0.57-0.65 s at 1 Gbit/s, its neighbours 0.15), the scalars (step counts) exact in fp32."""
        state = [v.to_local() if isinstance(v, DTensor) else v for entry in self.optimizer.state.values()
                 for v in entry.values() if isinstance(v, torch.Tensor) and v.is_floating_point()]
        return [([v for v in state if v.numel() > 1], torch.bfloat16), ([v for v in state if v.numel() == 1], torch.float32)]

    def _compiling(self) -> bool:
        """Whether a kernel compiles on any rank (a per-step candidate's): agreed, so every rank enters the trial
        together."""
        flag = torch.tensor(float(kernel.compiling()))
        dist.all_reduce(flag, dist.ReduceOp.MAX, group=self.state.process_group)
        return bool(flag.item())

    def _predicted(self) -> float:
        """The model's price of the route, as auto prices a plan it has not run: the step's other time plus one
        period's average on the monitor's fit of the link, per step, times the route's steps to the target.
        Agreed: the same on every rank."""
        link_s = self.state.planner.monitor.predict_s("allreduce", self._payload, self._world_size)
        return (self.state.planner.compute_s() + link_s / self.config.period) * self.steps

    def _enter(self, phase: str) -> None:
        """Local steps from the next backward: every rank at the same step (its decision is agreed)."""
        self.sync = SyncOptimizer(self.model, self.optimizer, self.config, process_group=self.state.process_group,
                                  shard_verdicts=False)
        self.sync.comm.link = self.state.link  # the averages cross the hook's link (netgain train --emulate-link)
        self._set_phase(phase)
        self._times, self._waits = [], []
        self._local(True)

    def _set_phase(self, phase: str) -> None:
        """The phase of a route taking local steps: on trial its codec begins no compile (kernel.cold); local for good (entered so,
        won, or resumed so), its kernels compile ahead once its eager averages have cost WARM_STALL_S (no
        collective: compiled kernels are the process's, and give the same bits)."""
        self.phase, self.sync.eager = phase, phase == "trial" or self._rent < WARM_STALL_S
        if not self.sync.eager:
            self._warm()

    def _local(self, local: bool) -> None:
        """Local steps skip DDP's reducer, as its no_sync() does: no gradient is copied into a bucket and the hook
        does not run (a pass-through hook cost a median 7% of a local step, 3 gloo ranks on 2 cores, 5 rounds).
        Under FSDP2 the reduce-scatter inside a replica goes on, and the hook leaves its output unaveraged."""
        if self.ddp is not None:
            self.ddp.require_backward_grad_sync = not local
        else:
            self.state.local = local

    @torch.no_grad()
    def _leave(self) -> None:
        """Per-step again, right after an average was applied with none pending: every replica holds it. The
        inner optimizer's state (AdamW's moments), each rank's own after local steps, becomes its mean over the
        ranks, so the replicas' averaged gradients make the same updates from here on."""
        self.sync.close()
        self.sync, self.phase = None, "per-step-chosen"
        self._local(False)
        self.state.planner.pause()
        for tensors, dtype in self._leave_parts():
            _mean(tensors, dtype, self.state.process_group)

    @property
    def last_step(self) -> dict:
        """The last step's statistics: the hook's where it ran (a per-step plan's step), else a local step's (``plan``
        "local"; ``raw_bytes`` what the hook would have sent uncompressed (under FSDP2 this rank's shards); ``wait_s``
        the wait for averages; their codec and
        link seconds); the bytes of the averages it applied added to ``wire_bytes``; the route's ``phase`` and the
        prices it compared (seconds to the target per fp32 step: ``per_step_price``, ``route_price``)."""
        last = (self.state.last_step if self._local_step is None else
                {**self._local_step, "plan": "local", "trying": self._trying, "raw_bytes": self._raw_bytes})
        return {**last, "phase": self.phase, "per_step_price": self.price, "route_price": self.route_price}

    def close(self) -> None:
        self._hook.remove()
        if self.sync is not None:
            self.sync.close()
        self.state.close()

    def state_dict(self) -> dict:
        """The hook's state and the route's, while local the SyncOptimizer's (every rank's parameters and inner
        optimizer state): collective, call it on every rank between steps. Under FSDP2 a DCP Stateful's state: a
        JSON ``header`` (the hook's header, and each shard position's route fields and SyncOptimizer header: what
        netgain.comm.fsdp.load_checkpoint checks first, `check_header`), the hook's state under ``comm`` and
        the SyncOptimizer's parts under ``sync``."""
        route = {"format": ROUTE_FORMAT, "phase": self.phase, "price": self.price, "route_price": self.route_price,
                 "early": self._early, "measured": self._measured, "times": list(self._times), "waits": list(self._waits)}
        if self.ddp is not None:
            return {**route, "comm": self.state.state_dict(),
                    "sync": self.sync.state_dict() if self.sync is not None else None}
        raise_on_every_shard(self.sync.settled_error() if self.sync is not None else None, self.state.shard_group,
                             self._named[0][1].device, "the route's checkpoint")
        comm, parts = self.state.state_dict(), self.sync.sharded_parts() if self.sync is not None else None
        # each shard position's, as its replicas' first rank holds it (the times are each rank's: under DDP rank
        # 0's), gathered over the shard mesh: positions choose their phase each for itself
        mine = [{**route, "sync": self.sync.position_header() if self.sync is not None else None}]
        dist.broadcast_object_list(mine, src=dist.get_global_rank(self.state.process_group, 0),
                                   group=self.state.process_group)
        routes = [None] * self.state.shards
        dist.all_gather_object(routes, mine[0], group=self.state.shard_group)
        header = json.dumps({"comm": comm["header"], "routes": routes})
        return {"header": header, "comm": comm, **({"sync": parts} if parts is not None else {})}

    def check_header(self, header) -> dict:
        """Under FSDP2, before DCP loads a tensor: this shard position's saved route fields as a dict, the hook's
        header and the SyncOptimizer's checked (ValueError naming what differs), and the saved phase entered, so
        that `state_dict()` then has the parts DCP loads in place; a refusal is raised on every rank of the mesh."""
        if self.ddp is not None:
            raise ValueError("the route's header is FSDP2's (a DCP state); under DDP load what state_dict() returned "
                             "with load_state_dict()")
        saved, route, error = read_header(header), None, None
        saved = saved if isinstance(saved, dict) else {}
        try:
            self.state.check_header(saved.get("comm"))  # names another mesh first
            routes = saved.get("routes")
            if not (isinstance(routes, list) and len(routes) == self.state.shards):
                raise ValueError(f"not a netgain route state of format {ROUTE_FORMAT!r} for this run's "
                                 f"{self.state.shards} shard positions (from LocalRoute.state_dict() under FSDP2)")
            route = _check_route(routes[self.state.shard])
            self._resume_phase(route)
            if self.sync is not None:
                self.sync.check_position(route["sync"])
        except ValueError as failed:
            error = failed
        raise_on_every_shard(error, self.state.shard_group, self._named[0][1].device, "the route's checkpoint")
        return route

    @property
    def loads_last(self) -> bool:
        """Under FSDP2 its DCP state loads after the model and optimizer (netgain.comm.fsdp.load_checkpoint)."""
        return self.ddp is None

    def load_state_dict(self, saved: dict) -> None:
        """Resume what `state_dict()` returned, on every rank; ValueError for anything else."""
        if self.ddp is None:
            route = self.check_header(saved.get("header") if isinstance(saved, dict) else None)
            self.state.load_state_dict(saved["comm"])
            if self.sync is not None:
                self.sync.load_parts(saved["sync"], route["sync"])
        else:
            route = _check_route(saved)
            self.state.load_state_dict(saved["comm"])
            self._resume_phase(saved)
            if self.sync is not None:
                self.sync.load_state_dict(saved["sync"])
        self.phase, self.price, self.route_price = route["phase"], route["price"], route.get("route_price")
        if self.sync is not None:  # a SyncOptimizer kept from this run: eager as the loaded phase has it
            self._set_phase(self.phase)
        self._early, self._measured = bool(route.get("early", False)), bool(route.get("measured", False))
        self._times, self._waits = [float(t) for t in route["times"]], [float(t) for t in route.get("waits", [])]
        self._last = None  # the next step's time from the last is none of the trial's (a load may call step())

    def _resume_phase(self, saved: dict) -> None:
        """Local steps where the saved route had a SyncOptimizer (kept where one runs), per-step where it had none."""
        if saved["sync"] is None and self.sync is not None:
            self.sync.close()
            self.sync = None
            self._local(False)
        elif saved["sync"] is not None and self.sync is None:
            self._enter(saved["phase"])


def _check_route(saved) -> dict:
    """``saved`` if it holds a route's fields (LocalRoute.state_dict()), else ValueError."""
    if not (isinstance(saved, dict) and saved.get("format") == ROUTE_FORMAT
            and saved.get("phase") in ("per-step", "trial", "local", "per-step-chosen")
            and isinstance(saved.get("times"), list) and (saved.get("sync") is None) == (saved["phase"] not in ("trial", "local"))
            and not (saved.get("measured") and saved["phase"] != "per-step")):
        raise ValueError(f"not a netgain route state of format {ROUTE_FORMAT!r} (from LocalRoute.state_dict())")
    return saved


def _mean(tensors: list[torch.Tensor], dtype: torch.dtype, group) -> None:
    """Each tensor becomes its mean over the ranks, sent as ``dtype``, in one allreduce."""
    if not tensors:
        return
    flat = torch.cat([v.reshape(-1).to(dtype) for v in tensors])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)  # after the sum: alike step counts stay exact
    torch._foreach_copy_(tensors, [chunk.view_as(v) for chunk, v in zip(flat.split([v.numel() for v in tensors]), tensors)])


def offer(state: CommState, model: "DistributedDataParallel | FSDPModule", optimizer: torch.optim.Optimizer,
          config: SyncConfig = ROUTE, steps: float | None = None) -> LocalRoute:
    """Let auto (``state``: `netgain.comm.register(model, "auto")`'s on a DDP model, or
    `netgain.comm.fsdp.register(model, mesh)`'s on an FSDP2 one, whose replicas then step alone) take the route of
    local steps where it reaches the target sooner than its per-step plans (LocalRoute). ``optimizer``: the one the
    training loop steps (a post-step hook does the outer work; the loop is unchanged). ``config``: the route's SyncConfig,
    one fragment and mix 0 (a switch back needs every replica equal); ``steps``: its steps to the target as a
    multiple of fp32's, measured for the default ROUTE (ROUTE_STEPS), to be given for any other."""
    if state.planner is None or state.planner.mode != "auto":
        raise ValueError(f"offer() adds a route to auto's plans: state runs {state.describe()!r}, not 'auto'")
    if config.fragments != 1 or config.mix != 0:
        raise ValueError(f"the route needs fragments=1 and mix=0 (every replica equal after an average), got "
                         f"fragments={config.fragments}, mix={config.mix}")
    if steps is None and config != ROUTE:
        raise ValueError("steps: the route's steps to the target as a multiple of fp32's is measured for "
                         "netgain.sync.ROUTE only; pass steps= for another config")
    steps = ROUTE_STEPS if steps is None else steps
    if isinstance(steps, bool) or not isinstance(steps, numbers.Real) or not 0 < steps < float("inf"):
        raise ValueError(f"steps must be a number > 0, got {steps!r}")
    fsdp = isinstance(state, FSDPCommState)
    if not isinstance(model, FSDPModule if fsdp else DistributedDataParallel):
        raise TypeError(f"offer() needs the {'fully_shard-ed' if fsdp else 'DistributedDataParallel'} model the hook "
                        f"is registered on, got {type(model).__name__}")
    return LocalRoute(state, model, optimizer, config, float(steps))


def wrap(model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: SyncConfig | None = None, *,
         process_group: dist.ProcessGroup | None = None, **options) -> SyncOptimizer:
    """DiLoCo outer steps around ``optimizer`` (which steps ``model``'s parameters); returns the SyncOptimizer.

    ``config``: a SyncConfig; ``options``: its fields as keywords, alone or overriding ``config``'s
    (wrap(model, opt, period=32, bits=4)). Collective over ``process_group`` (default: the default
    group): every rank gets rank 0's parameters, and PlanMismatchError is raised on every rank when
    the ranks' configs or models differ. The syncs then run on a process group of their own (or on
    ``process_group``, which must then carry nothing else while training runs).
    """
    config = dataclasses.replace(config or SyncConfig(), **options) if options else (config or SyncConfig())
    return SyncOptimizer(model, optimizer, config, process_group)


def _split(named: list, parts: int) -> list[list]:
    """``parts`` contiguous, non-empty groups of the parameters, of near-equal total size."""
    ends = list(itertools.accumulate(p.numel() for _, p in named))
    cuts = [0]
    for f in range(1, parts):
        cut = bisect.bisect_left(ends, ends[-1] * f / parts) + 1  # group f-1 ends with the parameter that reaches f/parts
        cuts.append(min(max(cut, cuts[-1] + 1), len(named) - (parts - f)))
    cuts.append(len(named))
    return [named[start:end] for start, end in zip(cuts, cuts[1:])]


def _local_shards(model: torch.nn.Module, group) -> list[tuple[str, torch.Tensor]]:
    """The trainable parameters with elements on this rank, each as the tensor the optimizer writes: itself, or for
    a DTensor (FSDP2's sharded parameters) its local shard, which ``group`` must sync with the same shard on the
    other replicas: ValueError when it spans the mesh the parameter is sharded over."""
    named = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if isinstance(param, DTensor):  # only where a process group is up
            if param.device_mesh.ndim != 1:
                raise ValueError(f"parameter {name} is sharded over a {param.device_mesh.ndim}-D mesh: FSDP2's own HSDP "
                                 "all-reduces across replicas every step; for local steps fully_shard over "
                                 "mesh['shard'] and pass process_group=mesh['replicate'].get_group()")
            mesh = param.device_mesh.mesh.flatten().tolist()
            peers = set(mesh) & set(dist.get_process_group_ranks(group or dist.group.WORLD))
            if peers != {dist.get_rank()}:
                raise ValueError(f"parameter {name} is sharded over ranks {mesh}, "
                                 f"and process_group holds {sorted(peers)} of them: under FSDP2 pass "
                                 "process_group=mesh['replicate'].get_group(), the ranks that hold this rank's shard")
            with torch.no_grad():
                param = param.to_local()
        if param.numel():
            named.append((name, param))
    return named


def _signature(named) -> str:
    """The trainable parameters' names and shapes, short enough to show in a mismatch error."""
    text = ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in named)
    return f"{len(named)} parameters, {sum(p.numel() for _, p in named)} elements, crc32 {zlib.crc32(text.encode()):08x}"


def _check_state(state, config: dict, world_size: int, shapes: dict[str, tuple], sizes: list[int]) -> None:
    """ValueError unless ``state`` is a well-formed sync state of ``config`` at ``world_size`` for parameters of
    ``shapes`` in fragments of ``sizes`` elements (the codec state is checked by CommState.load_state_dict)."""
    check_saved(state, FORMAT, config, "sync", world_size,
                "each rank's local parameters and inner optimizer state are its own")
    step, local, pending = state["step"], state.get("local"), state.get("pending")
    _check_params("global", state.get("global"), shapes)
    _check_params("momentum", state.get("momentum"), shapes)
    if not (isinstance(local, list) and len(local) == world_size
            and all(isinstance(r, dict) and isinstance(r.get("optimizer"), dict) for r in local)):
        raise ValueError(f"the sync state is malformed: local needs, for each of its {world_size} ranks, params and "
                         "optimizer (a dict)")
    for rank, entry in enumerate(local):
        _check_params(f"local[{rank}] params", entry.get("params"), shapes)
    if not (isinstance(pending, list) and all(
            isinstance(e, dict) and type(e.get("fragment")) is int and 0 <= e["fragment"] < len(sizes) and isinstance(e.get("due"), int)
            and e["due"] > step and isinstance(e.get("average"), torch.Tensor)
            and e["average"].numel() == sizes[e["fragment"]] for e in pending)):
        raise ValueError("the sync state is malformed: pending needs, per average on the wire, its fragment, the step "
                         "it is due after (later than step) and the average (the fragment's size)")


def _check_params(what: str, tensors, shapes: dict[str, tuple]) -> None:
    if not (isinstance(tensors, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items())):
        raise ValueError(f"the sync state is malformed: its {what} must map parameter names to tensors")
    missing, unexpected = sorted(set(shapes) - set(tensors)), sorted(set(tensors) - set(shapes))
    if missing or unexpected:
        raise ValueError(f"the sync state is another model's: its {what} lacks this model's parameters {missing[:5]} "
                         f"and holds parameters this model does not have {unexpected[:5]}")
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"the sync state is another model's: parameter {name} has shape {tuple(tensors[name].shape)} "
                             f"in its {what}, {shape} in this model")


def _thread_start(threads: int, device: torch.device) -> None:
    """The sync thread keeps the caller's intra-op thread count (OpenMP's is per thread) and CUDA device."""
    torch.set_num_threads(threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value
