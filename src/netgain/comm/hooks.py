"""The netgain DDP communication hook: `register(ddp, config)`, the hook, and its state.

    state = netgain.comm.register(ddp_model, GlobalQSGDConfig(bits=8))
    ... train ...
    state.close()

`hook` hands each bucket to `CommState.submit`, which wraps it in a `BucketJob` and gives it to the
pipeline (bucket.py: header -> encode -> collective -> decode, in bucket order on one thread).
CommState keeps the rest: the config (config.py), which codec a bucket uses (the chooser: a Codec,
or a Planner such as Kimad's), the per-parameter state store (store.py), each step's statistics and
the checkpoints.

`hook` keeps its annotations unquoted (no `from __future__ import annotations`): DDP checks them.
"""

import concurrent.futures
import threading
import time

import torch
import torch.distributed as dist

from .bucket import UNCOMPRESSED, BucketJob, NonFiniteGradientError, PlanMismatchError, Pipeline, _NotSent
from .codecs import Codec, Planner
from .config import CommConfig, comm_config
from .store import FORMAT, BucketLayout, StateStore

__all__ = ["CommState", "NonFiniteGradientError", "PlanMismatchError", "check_same_config", "hook", "register"]


class CommState:
    """Config, chooser, per-parameter state store, statistics and checkpoints of the netgain hook.

    Build it with `register` (which also makes the hook's own process group). Built directly, as
    `ddp.register_comm_hook(CommState(config), hook)`, it runs on ``process_group`` (default: the
    default group) and compares configs across ranks at the first bucket. ``param_names``: id(parameter)
    -> name of the parameters whose gradients reach the hook; a loaded state must name the same ones.
    `state_dict()` is collective (call it on every rank) and returns everything every rank needs,
    so a checkpoint saved by rank 0 alone resumes every rank exactly.
    """

    def __init__(self, config: "CommConfig | str" = "auto", *, process_group: dist.ProcessGroup | None = None,
                 param_names: dict[int, str] | None = None, **options):
        self.config = comm_config(config, **options)
        self.chooser = self.config.codec.build()  # a Codec (the same every step) or a Planner
        self.planner = self.chooser if isinstance(self.chooser, Planner) else None
        self.process_group = process_group
        self.store = StateStore()
        self.step = 0
        self.last_step: dict = {}
        self.history: list[dict] = []
        self.pipeline: Pipeline | None = None  # made at the first bucket
        self.link = None  # an emulate.EmulatedLink the hook's collectives are held to (netgain train --emulate-link)
        self._names = dict(param_names or {})  # id(parameter) -> name; unnamed: order of first appearance
        self._layouts: dict[int, tuple[tuple, BucketLayout]] = {}
        self._config_checked = False
        self._jobs: list[BucketJob] = []     # this step's buckets so far, in order (a new list per step)
        self._started: list[BucketJob] = []  # of them, those start_flat left on the communication thread
        self._forward_end: float | None = None
        self._first_submit = self._last_submit = 0.0
        self._inline_s = 0.0  # this step's seconds in reduce_flat and end_step's wait: a caller (FSDP's backward) waited
        self._held_s = 0.0    # this step's seconds the caller's thread spent in the hook's calls (statistics: held_s)
        self._lock = threading.Lock()

    def codec_for(self, index: int, numel: int) -> Codec:
        """The codec of bucket ``index`` this step: uncompressed in warm-up and below min_compress_numel."""
        if self.step < self.config.warmup_steps or numel < self.config.min_compress_numel:
            return UNCOMPRESSED
        return self.chooser.codec_for(index, numel)

    def describe(self) -> str:
        return self.chooser.describe()

    def forward_done(self) -> None:
        """The forward pass ended: the statistics' `backward_s` is measured from here (a forward hook calls it)."""
        self._forward_end = time.perf_counter()

    # ---- the hook, on DDP's autograd thread ----------------------------------------------------
    def submit(self, bucket: dist.GradBucket) -> torch.futures.Future:
        buffer = bucket.buffer()
        self._submitted()
        result = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)
        if dist.get_world_size(self.process_group) == 1:  # nothing to send: pass through
            self._pass_through(bucket, buffer)
            result.set_result(buffer)
            return result
        if self.pipeline is None:
            self._start(side_stream=True)
        job = BucketJob(bucket.index(), buffer, self._layout(bucket), result, step_jobs=self._jobs, last=bucket.is_last())
        self._jobs.append(job)
        if job.last:
            self._jobs = []  # the next backward's buckets start a new step, whenever this one ends
        try:
            self.pipeline.submit(job)
        finally:
            self._held_s += time.perf_counter() - self._last_submit
        return result

    def _submitted(self) -> float:
        now = time.perf_counter()
        if not self._jobs:
            self._first_submit, self._inline_s, self._held_s = now, 0.0, 0.0
        self._last_submit = now
        return now

    def _pass_through(self, bucket: dist.GradBucket, buffer: torch.Tensor) -> None:
        job = BucketJob(bucket.index(), buffer, None, None)
        job.record = {"index": bucket.index(), "numel": buffer.numel(), "codec": "passthrough", "wire_bytes": 0,
                      "raw_bytes": buffer.numel() * buffer.element_size(), "comm_s": 0.0, "encode_s": 0.0,
                      "decode_s": 0.0}
        self._jobs.append(job)
        if bucket.is_last():
            jobs, self._jobs = self._jobs, []
            self.close_step(jobs, time.perf_counter(), None)

    def _start(self, side_stream: bool) -> None:
        """First bucket: one config check across ranks, then the pipeline."""
        if not self._config_checked:
            self.check_config(self.process_group)
        self.pipeline = Pipeline(self, side_stream)

    def check_config(self, group: dist.ProcessGroup | None) -> None:
        """Raise PlanMismatchError on every rank of ``group`` (None: the whole job) when their configs differ."""
        check_same_config(self.config, group)
        self._config_checked = True

    # ---- one flat tensor at a time, for callers that own the schedule (netgain.comm.fsdp) -------
    def reduce_flat(self, index: int, flat: torch.Tensor, layout: BucketLayout) -> None:
        """Average ``flat`` across the process group in place through bucket ``index``'s codec; return when done.

        The caller's thread and stream do the work (no hand-off: the caller reads ``flat`` next), unless
        buckets started this step (`start_flat`) are still on the communication thread: it then goes after
        them, so every rank issues the collectives in the same order. The bucket joins this step's
        statistics until `end_step()`. Raises NonFiniteGradientError or PlanMismatchError on every rank.
        """
        start = self._submitted()
        if self.pipeline is None:
            self._start(side_stream=False)
        job = BucketJob(index, flat, layout, torch.futures.Future(), step_jobs=self._jobs)
        started = any(not j.done.done() for j in self._jobs)
        self._jobs.append(job)
        try:
            if started:
                self.pipeline.submit(job)
                job.done.result()
                if job.verdict.exception() is not None:
                    raise job.verdict.exception()
            else:
                self.pipeline.run_now(job)
            _settle([job])
        finally:
            held = time.perf_counter() - start
            self._inline_s += held
            self._held_s += held

    def start_flat(self, index: int, flat: torch.Tensor, layout: BucketLayout) -> None:
        """Start averaging ``flat`` in place through bucket ``index``'s codec and return at once: it crosses the
        link on the communication thread while the caller goes on (FSDP: the next group's backward and
        reduce-scatter). The caller must not read ``flat`` before `end_step()`, which waits for it and raises
        the step's first error (NonFiniteGradientError, PlanMismatchError) on every rank."""
        start = self._submitted()
        if self.pipeline is None:
            self._start(side_stream=True)
        job = BucketJob(index, flat, layout, torch.futures.Future(), step_jobs=self._jobs)
        self._jobs.append(job)
        self._started.append(job)
        try:
            self.pipeline.submit(job)
        finally:
            self._held_s += time.perf_counter() - start

    def end_step(self) -> None:
        """Close the step of `reduce_flat` and `start_flat` buckets: wait for the started ones, then the
        statistics and the planner's end of step; raise the step's first error."""
        if self._jobs:
            jobs, self._jobs, started, self._started = self._jobs, [], self._started, []
            if started:
                start = time.perf_counter()
                concurrent.futures.wait([job.done for job in started])
                _settle([job for job in started if job.out is not None])
                self._inline_s += time.perf_counter() - start
            self.pipeline.end_step(jobs)
            errors = [job.verdict.exception() for job in started]  # reduce_flat's were raised to its caller
            error = next((e for e in errors if e is not None and not isinstance(e, _NotSent)), None)
            if error is not None:
                raise error

    # ---- statistics ----------------------------------------------------------------------------
    def close_step(self, jobs: list[BucketJob], done: float, link) -> None:
        """The step's totals into `history` and `last_step`; ``link``: the communicator on which a
        planner ends its step (None: no planning, e.g. after a bucket failed)."""
        records = [job.record for job in jobs if job.record is not None]
        totals = {key: sum(r.get(key, 0.0) for r in records)
                  for key in ("wire_bytes", "raw_bytes", "comm_s", "encode_s", "decode_s")}
        if self._inline_s:  # buckets run inline (reduce_flat, FSDP's hook) or waited for at the step's end
            wait_s, backward_end = self._inline_s, done - self._inline_s
        else:  # DDP's: the backward ends at its last bucket, which the step's end waits for
            wait_s, backward_end = max(0.0, done - self._last_submit), self._last_submit
        totals.update(step=self.step, buckets=len(records), wait_s=wait_s, held_s=self._held_s,
                      backward_s=backward_end - (self._forward_end or self._first_submit),
                      compression_ratio=totals["raw_bytes"] / max(totals["wire_bytes"], 1))
        try:
            if link is not None and self.planner is not None:
                totals.update(self.planner.end_step(link, self.step, totals["backward_s"],
                                                    totals["encode_s"] + totals["decode_s"]))
        finally:  # a step whose planner agreement failed (PlanMismatchError) still counts: every rank's step moves on
            self.history.append(totals)
            self.last_step = {**totals, "per_bucket": records}
            self.step += 1

    def close(self) -> None:
        """Wait for buckets still on the communication thread (e.g. after one raised), then stop it.

        Call before destroying the process group, or a peer's pending collective may find it gone.
        """
        if self.pipeline is not None:
            self.pipeline.close()
            self.pipeline = None

    def _drain(self) -> None:
        if self.pipeline is not None:
            self.pipeline.drain()

    # ---- bucket layouts --------------------------------------------------------------------
    def _layout(self, bucket: dist.GradBucket) -> BucketLayout:
        """Built once per DDP bucket layout (a new one after DDP rebuilds its buckets). Keyed by the buffer and its
        parameters in order: DDP's rebuild reorders them, and the allocator may hand the new buffer the old one's
        address on some ranks only; a layout reused there maps each parameter to another's span on those ranks (seen:
        `auto`'s replicas diverged from step 1 on, bench/results/layout_key_divergence.md).
        The key's parameter list costs 10-12 us a bucket of 200 parameters per step (3 timings of 2,000 calls, CPU)."""
        buffer = bucket.buffer()
        key = (buffer.data_ptr(), buffer.numel(), buffer.dtype, tuple(map(id, bucket.parameters())))
        cached = self._layouts.get(bucket.index())
        if cached is None or cached[0] != key:
            cached = self._layouts[bucket.index()] = (key, BucketLayout.of(bucket, self.name_of, self.config.skip_1d))
        return cached[1]

    def name_of(self, parameter) -> str:
        """The parameter's name from ``param_names``; unnamed ones: param<k> in order of first appearance."""
        with self._lock:
            return self._names.setdefault(id(parameter), f"param{len(self._names)}")

    # ---- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Every rank's state in one object (collective: call it on every rank between steps)."""
        self._drain()
        n = dist.get_world_size(self.process_group) if dist.is_initialized() else 1
        local = self.store.local_state()
        locals_ = [None] * n
        if n > 1:
            dist.all_gather_object(locals_, local, group=self.process_group)
        else:
            locals_ = [local]
        return {"format": FORMAT, "config": self.config.describe(), "world_size": n, "step": self.step,
                "shared": self.store.shared_state(), "local": locals_,
                "chooser": self.planner.state_dict() if self.planner is not None else {}}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict()` returned, on every rank. ValueError for a state of another config,
        world size or model (parameter names), or one that is malformed."""
        n = dist.get_world_size(self.process_group) if dist.is_initialized() else 1
        check_state(state, self.config.describe(), n, set(self._names.values()))
        rank = dist.get_rank(self.process_group) if dist.is_initialized() else 0
        self._drain()
        self._load_planner(state["chooser"])
        self.step = state["step"]
        self.store.load(state["local"][rank], state["shared"])
        self._layouts.clear()

    def _load_planner(self, saved) -> None:
        """The planner's state_dict() as saved (nothing without a planner); ValueError for one that is not its own."""
        if self.planner is not None:
            try:
                self.planner.load_state_dict(saved)
            except (KeyError, TypeError, ValueError, AttributeError) as error:
                raise ValueError(f"the comm state's chooser is not a {self.describe()} planner's ({error!r})") from error

    def __getstate__(self):
        state = dict(self.__dict__)
        state.update(pipeline=None, process_group=None, link=None, _lock=None, _layouts={}, _jobs=[], _started=[])
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()


def _settle(jobs: list[BucketJob]) -> None:
    """Each job's decoded mean into its own buffer, finished on the device (once) before the caller reads them."""
    for job in jobs:
        if job.out is not job.buffer:
            job.buffer.copy_(job.out)
    if jobs and jobs[0].buffer.is_cuda:  # the decodes ran on the collectives' (or the pipeline's) stream
        torch.cuda.synchronize(jobs[0].buffer.device)


def hook(state: CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: returns a future of the averaged bucket."""
    return state.submit(bucket)


def register(ddp_model: torch.nn.parallel.DistributedDataParallel, config: "CommConfig | str" = "auto",
             **options) -> CommState:
    """Register the netgain hook on ``ddp_model``; returns its CommState.

    ``config``: "auto" (the default: the fastest option per bucket at the measured link), a codec
    config (GlobalQSGDConfig(bits=4), TopKConfig(...), KimadConfig(...)), a
    CommConfig, or a codec name from CODEC_NAMES with codec and hook fields as keywords
    (register(ddp, "gqsgd", bits=4, warmup_steps=10)). Makes the hook's own process group unless
    config.own_group is False or ``process_group`` is given. Collective over that group (default: the
    default group): raises PlanMismatchError on every rank when the ranks' configs differ; a rank that
    never calls it leaves the others waiting until the group's timeout, then raises saying so.
    """
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"register() needs a torch.nn.parallel.DistributedDataParallel model, got "
                        f"{type(ddp_model).__name__}: wrap it first, DistributedDataParallel(model)")
    group = options.pop("process_group", None)
    names = {id(p): name for name, p in ddp_model.module.named_parameters() if p.requires_grad and p.numel()}
    state = CommState(config, process_group=group, param_names=names, **options)
    if dist.get_world_size(group) > 1:
        # on the default group unless given one: before new_group, which ranks that disagree on own_group
        # would call on one side only (a store timeout, not a PlanMismatchError)
        state.check_config(group)
    if group is None and state.config.own_group and dist.get_world_size() > 1:
        state.process_group = dist.new_group(backend=dist.get_backend(), timeout=_default_group_timeout())
    ddp_model.register_comm_hook(state, hook)
    ddp_model.module.register_forward_hook(lambda *_: state.forward_done())
    return state


def _default_group_timeout():
    """The default group's collective timeout, so the hook's group ends a run with a silent peer as soon
    (new_group would otherwise take torch's default, 30 minutes on gloo); None where torch hides it."""
    try:
        device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
        return dist.distributed_c10d._get_default_group()._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


def check_same_config(config: CommConfig, group: dist.ProcessGroup | None) -> None:
    """Raise PlanMismatchError on every rank of ``group`` when the ranks' configs differ (collective)."""
    mine = config.describe()
    configs = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(configs, mine, group=group)
    except RuntimeError as error:  # DistBackendError, DistStoreError: a timeout, or a peer that went away
        raise RuntimeError(f"netgain could not compare its comm config with every rank ({type(error).__name__}: "
                           f"{str(error).splitlines()[0] if str(error) else ''}): every rank of the group must call "
                           "register() (or build its CommState) for the same model; a rank that did not, or that "
                           "failed before it, leaves the others waiting until the group's timeout") from error
    if any(c != configs[0] for c in configs):
        flat = [_flatten(c) for c in configs]
        differ = sorted({k for c in flat for k in c if c.get(k) != flat[0].get(k)})
        raise PlanMismatchError(f"netgain comm configuration differs between ranks in {differ}: "
                                + "; ".join(f"rank {r}: {c}" for r, c in enumerate(configs)))


def check_saved(state, fmt: str, config: dict, what: str, world_size: int, per_rank: str) -> None:
    """ValueError unless ``state`` is a dict of format ``fmt`` saved under ``config`` by ``world_size`` ranks at a
    step >= 0 (what: "comm", "sync"; per_rank: why another world size cannot load it)."""
    if not isinstance(state, dict) or state.get("format") != fmt:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"not a netgain {what} state of format {fmt!r} (got {found!r})")
    if state.get("config") != config:
        saved = state["config"] if isinstance(state.get("config"), dict) else {}
        differ = sorted(k for k in set(saved) | set(config) if saved.get(k) != config.get(k))
        raise ValueError(f"the checkpoint's {what} config differs in {differ}: saved {state.get('config')}, "
                         f"this run {config}")
    if state.get("world_size") != world_size:
        raise ValueError(f"the checkpoint holds the {what} state of {state.get('world_size')!r} ranks, "
                         f"this run has {world_size}: {per_rank}")
    step = state.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"the {what} state's step must be an integer >= 0, got {step!r}")


def check_state(state, config: dict, world_size: int, names: set[str]) -> None:
    """ValueError unless ``state`` is a well-formed comm state of ``config`` at ``world_size`` for the parameters
    ``names`` (empty: not known, as for a CommState built without param_names)."""
    check_saved(state, FORMAT, config, "comm", world_size, "EF21 buffers are per rank")
    local, shared = state.get("local"), state.get("shared")
    if not (isinstance(local, list) and len(local) == world_size and all(map(_tensors, local)) and _tensors(shared)
            and all(set(ranks) == set(shared) for ranks in local) and isinstance(state.get("chooser"), dict)):
        raise ValueError("the comm state is malformed: it needs local (per rank, parameter name -> tensor), shared "
                         "(the same names -> tensor) and chooser (a dict)")
    if names and shared and set(shared) != names:
        missing, unexpected = sorted(names - set(shared)), sorted(set(shared) - names)
        parts = ([f"lacks this model's parameters {_few(missing)}"] if missing else []) + (
            [f"holds parameters this model does not have {_few(unexpected)}"] if unexpected else [])
        raise ValueError(f"the comm state is another model's: it {' and '.join(parts)}")


def _tensors(entries) -> bool:
    return isinstance(entries, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in entries.items())


def _few(names: list[str]) -> str:
    return "[" + ", ".join(names[:5]) + (f", ... {len(names) - 5} more" if len(names) > 5 else "") + "]"


def _flatten(config: dict, prefix: str = "") -> dict:
    """{"codec": {"bits": 8}} -> {"codec.bits": 8}: a mismatch names the field that differs."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
