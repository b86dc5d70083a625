"""The netgain DDP communication hook: `register(ddp, config)`, the hook, and its state.

    state = netgain.comm.register(ddp_model, GlobalQSGDConfig(bits=8))

CommState joins three parts: the config (config.py), the per-parameter state store (store.py)
and the bucket pipeline below. The hook hands each bucket to one communication thread and
returns a future at once. That thread, in bucket order, runs each bucket's small header
allreduce (per-parameter max |g|, a non-finite flag, the plan signature), encodes the bucket in
one fused pass and LAUNCHES its payload collective asynchronously, then moves on to the next
bucket: encoding bucket k+1 overlaps bucket k on the wire. The payload's future decodes straight
into the bucket's buffer (`.then`). A multi-round codec (low rank: P, then Q from P's mean) waits
for each earlier round on that thread, so every collective still leaves in the same order. Issuing every collective from that one thread, on the hook's
own process group, keeps their order identical on every rank. On CUDA the work runs on a side
stream that waits on an event of the backward's stream, never synchronising it. A fixed codec with
no header (none, fp16, bf16, qsgd) has nothing to wait for before its one collective, so the hook
launches it from DDP's own thread, as PyTorch's hooks do, and skips the hand-off. Low rank with
fp32 factors has no header either, but its rounds wait on each other, so it stays on the thread; NaN/Inf are caught on each round's sum before the codec writes its state.

Errors: the header makes every rank see the same verdict, so NaN/Inf or a plan mismatch raises
on every rank; the hook of the step's last bucket waits for every bucket's verdict and raises the
error itself, so it reaches the caller's `except NonFiniteGradientError` as that class (an error
set on a DDP future arrives as a plain RuntimeError).

`hook` keeps its annotations unquoted (no `from __future__ import annotations`): DDP checks them.
"""

import concurrent.futures
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from . import fused
from .codecs import Codec, Context, NoCompression
from .collectives import Communicator
from .config import CommConfig, comm_config
from .store import FORMAT, BucketLayout, StateStore


class NonFiniteGradientError(RuntimeError):
    """A bucket held NaN or Inf on at least one rank; raised on every rank."""


class PlanMismatchError(RuntimeError):
    """Ranks asked for different codecs or hook settings (for a bucket, or for the whole run); raised on every rank."""


class _NotSent(RuntimeError):
    """A later bucket of a step in which an earlier one failed: it issued no collective."""


_UNCOMPRESSED = NoCompression()


class CommState:
    """Config, per-parameter state store and bucket pipeline of the netgain hook.

    Build it with `register` (which also makes the hook's own process group). Built directly, as
    `ddp.register_comm_hook(CommState(config), hook)`, it runs on ``process_group`` (default: the
    default group) and compares configs across ranks at the first bucket.
    `state_dict()` is collective (call it on every rank) and returns everything every rank needs,
    so a checkpoint saved by rank 0 alone resumes every rank exactly.
    """

    def __init__(self, config: "CommConfig | str" = "gqsgd", *, process_group: dist.ProcessGroup | None = None,
                 param_names: dict[int, str] | None = None, **options):
        self.config = comm_config(config, **options)
        self.chooser = self.config.codec.build()
        self.process_group = process_group
        self.store = StateStore()
        self.step = 0
        self.last_step: dict = {}
        self.history: list[dict] = []
        self._names = dict(param_names or {})  # id(parameter) -> name; unnamed: order of first appearance
        self._layouts: dict[int, tuple[tuple, BucketLayout]] = {}
        self._communicator: Communicator | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._stream = None
        self._started = False
        self._inline = False
        self._config_checked = False
        self._jobs: list[dict] = []          # this step's buckets so far, in order (a new list per step)
        self._failure: str | None = None     # why a bucket of this step failed; later buckets skip
        self._forward_end: float | None = None
        self._first_submit = self._last_submit = 0.0
        self._lock = threading.Lock()

    # ---- which codec a bucket uses this step ---------------------------------------------------
    def codec_for(self, index: int, numel: int) -> Codec:
        if self.step < self.config.warmup_steps or numel < self.config.min_compress_numel:
            return _UNCOMPRESSED
        return self.chooser.codec_for(index, numel)

    def describe(self) -> str:
        return self.chooser.describe()

    def forward_done(self) -> None:
        """The forward pass ended: the statistics' `backward_s` is measured from here (a forward hook calls it)."""
        self._forward_end = time.perf_counter()

    # ---- the hook, on DDP's autograd thread ----------------------------------------------------
    def submit(self, bucket: dist.GradBucket) -> torch.futures.Future:
        buffer = bucket.buffer()
        now = time.perf_counter()
        if not self._jobs:
            self._first_submit = now
        self._last_submit = now
        result = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)
        if dist.get_world_size(self.process_group) == 1:  # nothing to send: pass through
            self._jobs.append({"record": {"index": bucket.index(), "numel": buffer.numel(), "codec": "passthrough",
                                          "wire_bytes": 0, "raw_bytes": buffer.numel() * buffer.element_size(),
                                          "comm_s": 0.0, "encode_s": 0.0, "decode_s": 0.0}})
            if bucket.is_last():
                jobs, self._jobs = self._jobs, []
                self._end_step(jobs, time.perf_counter())
            result.set_result(buffer)
            return result
        if not self._started:
            self._start()
        step_jobs = self._jobs
        job = {"index": bucket.index(), "buffer": buffer, "layout": self._layout(bucket), "result": result,
               "verdict": concurrent.futures.Future(), "done": concurrent.futures.Future(), "step_jobs": step_jobs,
               "last": bucket.is_last()}
        if buffer.is_cuda:
            job["ready"] = torch.cuda.Event()
            job["ready"].record()
        step_jobs.append(job)
        if job["last"]:
            self._jobs = []  # the next backward's buckets start a new step, whenever this one ends
        if self._inline:  # no header to wait for: launch from here, as PyTorch's own hooks do
            self._run(job)
        else:
            self._executor.submit(self._run, job)
        if job["last"]:
            _raise_verdicts(step_jobs)
        return result

    def _start(self, side_stream: bool = True) -> None:
        """First bucket: the communicator, the thread, and one config check across ranks."""
        self._communicator = Communicator(self.process_group)
        self.chooser.attach(self._communicator)
        if not self._config_checked:
            self.check_config(self.process_group)
        # A fixed codec without a header issues one collective per bucket and waits for nothing before
        # it: DDP's autograd thread can launch it in bucket order itself, with no thread hand-off.
        self._inline = (not self.chooser.checked and not self.chooser.codec.needs_header
                        and not self.chooser.codec.relays and self.config.nonfinite == "raise")
        # the threads that run codecs keep the caller's intra-op thread count: OpenMP's is per thread, and a
        # new thread's default (every core) oversubscribes what the user set and makes matmuls run-dependent
        self._threads = torch.get_num_threads()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="netgain-comm",
                                            initializer=torch.set_num_threads, initargs=(self._threads,))
        if side_stream and torch.cuda.is_available() and torch.cuda.is_initialized() and not self._inline:
            self._stream = torch.cuda.Stream()
        self._started = True

    def check_config(self, group: dist.ProcessGroup | None) -> None:
        """Raise PlanMismatchError on every rank of ``group`` (None: the whole job) when their configs differ."""
        check_same_config(self.config, group)
        self._config_checked = True

    # ---- one flat tensor at a time, for callers that own the schedule (netgain.comm.fsdp) -------
    def reduce_flat(self, index: int, flat: torch.Tensor, layout: BucketLayout) -> None:
        """Average ``flat`` across the process group in place through bucket ``index``'s codec; return when done.

        The caller's thread and stream do the work (no hand-off: the caller reads ``flat`` next).
        The bucket joins this step's statistics until `end_step()`. Raises NonFiniteGradientError
        or PlanMismatchError on every rank.
        """
        now = time.perf_counter()
        if not self._jobs:
            self._first_submit = now
        self._last_submit = now
        if not self._started:
            self._start(side_stream=False)
        job = {"index": index, "buffer": flat, "layout": layout, "result": torch.futures.Future(),
               "verdict": concurrent.futures.Future(), "done": concurrent.futures.Future(), "last": False}
        self._jobs.append(job)
        try:
            self._send(job)
            job["done"].result()
            error = job["verdict"].exception()
            if error is not None:
                raise error
        except Exception as error:
            self._failure = f"bucket {index} failed ({type(error).__name__})"
            _settle(job, error)
            raise
        if job["out"] is not flat:
            flat.copy_(job["out"])
        if flat.is_cuda:  # the decode ran on the collective's stream: finish it before the caller's reads
            torch.cuda.synchronize(flat.device)

    def end_step(self) -> None:
        """Close the step of `reduce_flat` buckets: statistics, the planner's end of step (no-op without any)."""
        if self._jobs:
            jobs, self._jobs = self._jobs, []
            self._end_step(jobs, time.perf_counter())

    # ---- the pipeline, on the communication thread ---------------------------------------------
    def _run(self, job: dict) -> None:
        try:
            if self._failure is not None:
                raise _NotSent(f"bucket {job['index']} not sent: {self._failure}")
            with _on_stream(self._stream, job.get("ready")):
                self._send(job)
        except Exception as error:
            # Header errors are seen by every rank at the same bucket, so every rank stops issuing
            # collectives here: none is left queued to meet a barrier or a new step out of order.
            if self._failure is None:
                self._failure = f"bucket {job['index']} failed ({type(error).__name__})"
            _settle(job, error)
        if job["last"]:
            jobs = job["step_jobs"]
            concurrent.futures.wait([j["done"] for j in jobs])
            self._end_step(jobs, time.perf_counter())
            with _on_stream(self._stream, None):  # DDP sees the step's results once its statistics are in
                for j in jobs:
                    if not j["result"].done():
                        j["result"].set_result(j["out"])

    def _send(self, job: dict) -> None:
        x, layout, communicator = job["buffer"], job["layout"], self._communicator
        n, index = communicator.world_size, job["index"]
        codec = self.codec_for(index, x.numel())
        record = job["record"] = {"index": index, "numel": x.numel(), "codec": codec.describe(), "wire_bytes": 0,
                                  "raw_bytes": x.numel() * x.element_size(), "comm_s": 0.0}
        segments = layout.segments
        ctx = Context(n, segments, fused.step_keys(segments.keys, self.config.seed, self.step, communicator.rank),
                      fused.step_keys(segments.keys, self.config.seed, self.step, -1), tables=layout.tables,
                      layout=layout)
        uncompressed = isinstance(codec, NoCompression)
        # Error-feedback state (EF21, low rank's residual): touched by the codecs that keep it; a stateful
        # chooser's other steps (none, gqsgd) restart it from their local gradient and decoded mean
        feedback = self.chooser.memory_codec is not None
        if feedback:
            ctx.feedback = self.store.feedback_for(layout, x.device, self.chooser.memory_codec)
        # the memory restarts from this step's gradient, before the header scales it (low rank's residual joins it)
        restart = feedback and not codec.uses_feedback
        local_grad = ctx.feedback.restart(x, ctx) if restart else None
        checked = codec.needs_header or self.chooser.checked or (
            self.config.nonfinite == "uncompressed" and not uncompressed)
        if checked:
            scales, nonfinite = self._header(index, codec, x, ctx, record)
            if nonfinite:
                self._nonfinite_error(index, layout, scales, codec.scale_params(ctx))  # raises, or sends uncompressed
                codec, uncompressed, record["codec"] = _UNCOMPRESSED, True, "none (non-finite)"
                if feedback and not restart:
                    restart, local_grad = True, ctx.feedback.restart(x, ctx)
            ctx.scales = torch.where(scales > 0, scales, torch.ones_like(scales))
            job["verdict"].set_result(None)
        if self.chooser.wants_errors(self.step) and codec is not _UNCOMPRESSED:
            self.chooser.observe(index, x, ctx, codec)  # only buckets the planner plans (not warm-up, not tiny ones)
        exact = None
        if layout.exact_index is not None and not uncompressed:
            exact = communicator.start("allreduce", x[layout.exact_index] / n, record)
        record["t_encode"] = time.perf_counter()  # trace points: encode start, payload launched / done
        with torch.profiler.record_function(f"netgain.encode bucket {index}"):
            payload = codec.encode(x, ctx)
        record["t_launch"] = time.perf_counter()
        sent = communicator.start(codec.collective, payload, record,
                                  combine=lambda a, b, hop: codec.combine(a, b, hop, ctx))
        for _ in range(codec.rounds(ctx) - 1):  # low rank: each round's payload needs the last one's mean
            aggregated = sent.wait()
            if not checked and not bool(aggregated.sum().isfinite()):
                # no header: NaN/Inf reach every rank through this round's SUM, so every rank raises here,
                # before the codec writes its state (low rank's residual and warm start)
                self._nonfinite_error(index, layout, None, policy="raise")
            payload, op = codec.relay(aggregated, ctx)
            sent = communicator.start("allreduce", payload, record, op=op)
        pending = torch.futures.collect_all([sent] + ([exact] if exact is not None else []))

        def finish(_):
            try:
                record["t_done"] = time.perf_counter()
                if torch.get_num_threads() != self._threads:  # the collective's callback thread
                    torch.set_num_threads(self._threads)
                with _on_stream(self._stream, None), torch.profiler.record_function(f"netgain.decode bucket {index}"):
                    out = codec.decode(sent.value(), x, ctx)
                    if exact is not None:
                        out[layout.exact_index] = exact.value()
                    if not checked and not bool(out.sum().isfinite()):
                        # NaN/Inf reach every rank through the float SUM, so every rank raises here. The
                        # bucket's sum is non-finite whenever an element is (also if finite values sum past
                        # the float range), and needs no bucket-sized bool tensor
                        self._nonfinite_error(index, layout, None, policy="raise", wire=sent.value().dtype)
                    if restart:
                        ctx.feedback.sync(local_grad, out)
                record.update(ctx.seconds)
                job["verdict"].set_result(None) if not job["verdict"].done() else None
                job["out"] = out
                job["done"].set_result(None)
            except Exception as error:
                _settle(job, error)

        pending.then(finish)

    def _header(self, index, codec, x, ctx, record):
        """One allreduce MAX of [max |g| per parameter (+inf where non-finite), flag, signature, -signature]."""
        with ctx.timed("encode_s"):  # codec work (max |g|; low rank's P), as time_codec counts it
            maxes = codec.local_scales(x, ctx)
        finite = torch.isfinite(maxes)
        signature = float(zlib.crc32(f"{index}:{self.step}:{codec.describe()}".encode()) % (1 << 24))
        flags = torch.stack([(~finite).any().float(), torch.tensor(signature, device=x.device),
                             torch.tensor(-signature, device=x.device)])
        header = torch.cat([torch.where(finite, maxes, torch.full_like(maxes, float("inf"))), flags])
        self._communicator.allreduce(header, dist.ReduceOp.MAX, record)
        nonfinite, high, low = header[-3:].tolist()  # the step's one host read per bucket
        if high != -low:  # max(signature) != min(signature)
            raise PlanMismatchError(f"bucket {index}: ranks chose different codecs at step {self.step} "
                                    f"(this rank: {codec.describe()})")
        return header[:-3], nonfinite > 0

    def _nonfinite_error(self, index, layout, scales, owners=None, policy=None, wire=None) -> None:
        """owners: the parameter of each header scale (`Codec.scale_params`; None: one scale per parameter);
        wire: the dtype summed, where the check ran on the sum (an fp16 cast overflows finite gradients)."""
        if (policy or self.config.nonfinite) != "raise":
            return
        if scales is not None:
            bad = torch.isinf(scales).nonzero().flatten()
            names = [layout.names[i] for i in dict.fromkeys((bad if owners is None else owners[bad]).tolist())]
        else:
            names = layout.names
        shown = ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")
        overflow = (", or finite gradients whose mean overflowed fp16 (largest 65504) on the wire: use bf16 or gqsgd"
                    if wire == torch.float16 else "")
        raise NonFiniteGradientError(
            f"bucket {index} holds NaN/Inf gradients on at least one rank{overflow} (parameters: {shown}); "
            "pass nonfinite='uncompressed' to send such buckets uncompressed")

    def _end_step(self, jobs: list[dict], done: float) -> None:
        records = [job["record"] for job in jobs if "record" in job]
        totals = {key: sum(r.get(key, 0.0) for r in records)
                  for key in ("wire_bytes", "raw_bytes", "comm_s", "encode_s", "decode_s")}
        totals.update(step=self.step, buckets=len(records), wait_s=max(0.0, done - self._last_submit),
                      backward_s=self._last_submit - (self._forward_end or self._first_submit),
                      compression_ratio=totals["raw_bytes"] / max(totals["wire_bytes"], 1))
        failed, self._failure = self._failure, None
        if failed is None and self._communicator is not None:
            totals.update(self.chooser.end_step(self._communicator, self.step, totals["backward_s"],
                                                totals["encode_s"] + totals["decode_s"]))
        self.history.append(totals)
        self.last_step = {**totals, "per_bucket": records}
        self.step += 1

    def close(self) -> None:
        """Wait for buckets still on the communication thread (e.g. after one raised), then stop it.

        Call before destroying the process group, or a peer's pending collective may find it gone.
        """
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def _drain(self) -> None:
        if self._executor is not None:
            self._executor.submit(lambda: None).result()

    # ---- bucket layouts --------------------------------------------------------------------
    def _layout(self, bucket: dist.GradBucket) -> BucketLayout:
        """Built once per DDP bucket layout (a new one after DDP rebuilds its buckets)."""
        buffer = bucket.buffer()
        key = (buffer.data_ptr(), buffer.numel(), buffer.dtype)
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
                "shared": self.store.shared_state(), "local": locals_, "chooser": self.chooser.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("format") != FORMAT:
            raise ValueError(f"not a netgain comm state of format {FORMAT!r} (got {state.get('format')!r})")
        if state["config"] != self.config.describe():
            differ = sorted(k for k in set(state["config"]) | set(self.config.describe())
                            if state["config"].get(k) != self.config.describe().get(k))
            raise ValueError(f"the checkpoint's comm config differs in {differ}: saved {state['config']}, "
                             f"this state {self.config.describe()}")
        n = dist.get_world_size(self.process_group) if dist.is_initialized() else 1
        if state["world_size"] != n:
            raise ValueError(f"the checkpoint holds the comm state of {state['world_size']} ranks, "
                             f"this run has {n}: EF21 buffers are per rank")
        rank = dist.get_rank(self.process_group) if dist.is_initialized() else 0
        self._drain()
        self.step = state["step"]
        self.store.load(state["local"][rank], state["shared"])
        self._layouts.clear()
        self.chooser.load_state_dict(state["chooser"])

    def __getstate__(self):
        state = dict(self.__dict__)
        state.update(_communicator=None, _executor=None, process_group=None, _stream=None, _lock=None,
                     _layouts={}, _jobs=[], _started=False)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()


def _raise_verdicts(jobs: list[dict]) -> None:
    """Wait for every bucket of the step to pass its checks; raise the first error as its own class."""
    for job in jobs:
        error = job["verdict"].exception() if "verdict" in job else None
        if error is not None and not isinstance(error, _NotSent):
            raise error


def _settle(job: dict, error: Exception) -> None:
    """A failed bucket: its result and verdict carry the error, and only then is it done (others wait on that)."""
    if not job["result"].done():
        job["result"].set_exception(error)
    if not job["verdict"].done():
        job["verdict"].set_exception(error)
    if not job["done"].done():
        job["done"].set_result(None)


class _on_stream:
    """Run on the hook's CUDA side stream (after the backward's event), or do nothing on CPU."""

    def __init__(self, stream, ready):
        self.stream, self.ready = stream, ready

    def __enter__(self):
        if self.stream is not None:
            self.context = torch.cuda.stream(self.stream)
            self.context.__enter__()
            if self.ready is not None:
                self.stream.wait_event(self.ready)

    def __exit__(self, *exc):
        if self.stream is not None:
            self.context.__exit__(*exc)


def hook(state: CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: returns a future of the averaged bucket."""
    return state.submit(bucket)


def register(ddp_model: torch.nn.parallel.DistributedDataParallel, config: "CommConfig | str" = "gqsgd",
             **options) -> CommState:
    """Register the netgain hook on ``ddp_model``; returns its CommState.

    ``config``: a codec config (GlobalQSGDConfig(bits=4), TopKConfig(...), KimadConfig(...)), a
    CommConfig, or a codec name from CODEC_NAMES with codec and hook fields as keywords
    (register(ddp, "gqsgd", bits=4, warmup_steps=10)). Makes the hook's own process group unless
    config.own_group is False or ``process_group`` is given. Raises PlanMismatchError on every rank
    when the ranks' configs differ.
    """
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"register() needs a torch.nn.parallel.DistributedDataParallel model, got "
                        f"{type(ddp_model).__name__}: wrap it first, DistributedDataParallel(model)")
    group = options.pop("process_group", None)
    comm = comm_config(config, **options)
    if group is None and comm.own_group and dist.get_world_size() > 1:
        group = dist.new_group(backend=dist.get_backend(), timeout=_default_group_timeout())
    names = {id(p): name for name, p in ddp_model.module.named_parameters()}
    state = CommState(comm, process_group=group, param_names=names)
    if dist.get_world_size(group) > 1:
        state.check_config(group)
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
    dist.all_gather_object(configs, mine, group=group)
    if any(c != configs[0] for c in configs):
        flat = [_flatten(c) for c in configs]
        differ = sorted({k for c in flat for k in c if c.get(k) != flat[0].get(k)})
        raise PlanMismatchError(f"netgain comm configuration differs between ranks in {differ}: "
                                + "; ".join(f"rank {r}: {c}" for r, c in enumerate(configs)))


def _flatten(config: dict, prefix: str = "") -> dict:
    """{"codec": {"bits": 8}} -> {"codec.bits": 8}: a mismatch names the field that differs."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
