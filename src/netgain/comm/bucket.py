"""One bucket's way through the hook, and the pipeline that runs a step's buckets in order.

`send` is the algorithm, for one bucket: header (an allreduce MAX of each parameter's max |g|, a
non-finite flag and the plan's signature) -> encode (one fused pass) -> collective, launched
asynchronously -> decode straight into the bucket's buffer when the collective completes (`.then`).
A multi-round codec (low rank: P, then Q from P's mean) waits for each earlier round before the next.

`Pipeline` runs `send` for each bucket of a step on one communication thread, in bucket order, and
moves on at once: encoding bucket k+1 overlaps bucket k on the wire, and one thread issuing every
collective on the hook's own process group keeps their order identical on every rank. A fixed codec
with no header (none, fp16, bf16, qsgd) waits for nothing before its one collective, so it is
launched from DDP's own thread, as PyTorch's hooks do. On CUDA the work runs on a side stream that
waits on an event of the backward's stream, never synchronising it.

Errors: the header makes every rank see the same verdict, so NaN/Inf or a plan mismatch raises on
every rank. After a bucket fails, the step's later buckets send nothing, so no collective is left to
meet a peer out of order. The hook of the step's last bucket waits for every bucket's verdict and
raises the error itself, so it reaches the caller's `except NonFiniteGradientError` as that class
(an error set on a DDP future arrives as a plain RuntimeError).
"""

from __future__ import annotations

import concurrent.futures
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from . import kernel
from .codecs import Codec, Context, NoCompression, NonFiniteGradientError, PlanMismatchError
from .collectives import Communicator
from .store import BucketLayout

if TYPE_CHECKING:
    from .hooks import CommState

UNCOMPRESSED = NoCompression()


class _NotSent(RuntimeError):
    """A later bucket of a step in which an earlier one failed: it issued no collective."""


@dataclass(eq=False)
class BucketJob:
    """One bucket of one step, from DDP's call to its decoded mean."""
    index: int
    buffer: torch.Tensor                  # the gradients, flat; the mean is decoded into it
    layout: BucketLayout
    result: torch.futures.Future          # what DDP waits on: the averaged bucket
    step_jobs: list[BucketJob] = field(default_factory=list)  # this step's buckets so far, this one included
    last: bool = False                    # DDP's last bucket of the step
    plain: bool = False                   # a planner's step run as a fixed codec's: no header
    inline: bool = False                  # launched from the caller's thread (a plain step whose codecs relay nothing)
    ready: object = None                  # CUDA: an event of the backward's stream, recorded when the bucket was
    record: dict | None = None            # statistics: codec, bytes, seconds, trace points
    out: torch.Tensor | None = None       # the decoded mean
    verdict: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)  # checks passed, or the error
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)     # decoded, or failed

    def fail(self, error: Exception) -> None:
        """Its result and verdict carry the error, and only then is it done (others wait on that)."""
        if not self.result.done():
            self.result.set_exception(error)
        if not self.verdict.done():
            self.verdict.set_exception(error)
        if not self.done.done():
            self.done.set_result(None)


def send(state: CommState, job: BucketJob, communicator: Communicator, stream=None) -> None:
    """Header -> encode -> collective(s) -> decode of one bucket; the decode runs when the last collective completes."""
    x, layout, planner = job.buffer, job.layout, state.planner
    n, index = communicator.world_size, job.index
    codec = state.codec_for(index, x.numel())
    record = job.record = {"index": index, "numel": x.numel(), "codec": codec.describe(), "wire_bytes": 0,
                           "raw_bytes": x.numel() * x.element_size(), "comm_s": 0.0}
    segments = layout.segments
    ctx = Context.for_step(n, segments, state.config.seed, state.step, communicator.rank, tables=layout.tables,
                           layout=layout)
    uncompressed = isinstance(codec, NoCompression)
    # Error-feedback state (EF21, low rank's residual): touched by the codecs that keep it; a planner's
    # other options (none, gqsgd) restart it from their local gradient and decoded mean
    memory_codec = state.chooser.memory_codec
    if memory_codec is not None:
        ctx.feedback = state.store.feedback_for(layout, x.device, memory_codec)
    # the memory restarts from this step's gradient, before the header scales it (low rank's residual joins it)
    restart = memory_codec is not None and not codec.uses_feedback
    local_grad = ctx.feedback.restart(x, ctx) if restart else None
    # a planner's unplanned codec runs a step or two: its kernels begin no compile (kernel.cold), as a caller's inside `cold`
    # do (auto's route on trial); the decode runs on the collective's callback thread, so it is told
    cold = kernel.is_cold() or (planner is not None and codec is planner.unplanned)
    with kernel.cold(cold):
        checked = codec.needs_header or (planner is not None and not job.plain) or (
            state.config.nonfinite == "uncompressed" and not uncompressed)
        measuring = planner is not None and planner.wants_errors(state.step)
        if checked:
            scaled = codec.needs_scales or measuring  # the scales where the codec or the error measurement uses them
            scales, nonfinite = header(state, communicator, index, codec, x, ctx, record, scaled)
            if nonfinite and state.config.nonfinite == "raise":
                bad = nonfinite_gradients(communicator, layout, x)
                if bad or scaled:
                    raise nonfinite_error(index, bad or header_names(layout, scales, codec.scale_params(ctx)), overflowed=not bad)
                nonfinite = False  # finite gradients whose sum (the flag's test) went past float32: fine to send
            if nonfinite:
                codec, uncompressed, record["codec"] = UNCOMPRESSED, True, "none (non-finite)"
                if memory_codec is not None and not restart:
                    restart, local_grad = True, ctx.feedback.restart(x, ctx)
            if scaled:
                ctx.scales = torch.where(scales > 0, scales, torch.ones_like(scales))
            job.verdict.set_result(None)
        if measuring and codec is not UNCOMPRESSED:
            planner.observe(index, x, ctx, codec)  # only buckets the planner plans (not warm-up, not tiny ones)
        if planner is not None and planner.warm:
            planner.prepare(index, x, ctx)  # auto: options awaiting their trial run once, their kernels compile meanwhile
        exact = None
        if layout.exact_index is not None and not uncompressed:
            exact = communicator.start("allreduce", x[layout.exact_index] / n, record)
        record["t_encode"] = time.perf_counter()  # trace points: encode start, payload launched / done
        with torch.profiler.record_function(f"netgain.encode bucket {index}"):
            payload = codec.encode(x, ctx)
        record["t_launch"] = time.perf_counter()
        sent = communicator.start(codec.collective, payload, record, combine=lambda a, b, hop: codec.combine(a, b, hop, ctx))
        for _ in range(codec.rounds(ctx) - 1):  # low rank: each round's payload needs the last one's mean
            aggregated = sent.wait()
            if aggregated.is_floating_point() and not all_finite(aggregated):
                # NaN/Inf reach every rank through this round's SUM or MAX (without a header: a NaN gradient; with
                # one, or finite gradients: a product or sum past float32), so every rank raises here, before
                # the codec writes its state (low rank's residual and warm start)
                bad = nonfinite_gradients(communicator, layout, x)
                raise nonfinite_error(index, bad or layout.names, overflowed=not bad)
            payload, op = codec.relay(aggregated, ctx)
            sent = communicator.start("allreduce", payload, record, op=op)
    pending = torch.futures.collect_all([sent] + ([exact] if exact is not None else []))
    threads = torch.get_num_threads()

    def decode(_):
        try:
            record["t_done"] = time.perf_counter()
            if torch.get_num_threads() != threads:  # the collective's callback thread
                torch.set_num_threads(threads)
            with (on_stream(stream, None), torch.profiler.record_function(f"netgain.decode bucket {index}"),
                  kernel.cold(cold)):
                out = codec.decode(sent.value(), x, ctx)
                if exact is not None:
                    out[layout.exact_index] = exact.value()
                if not checked and not bool(out.sum().isfinite()):
                    # NaN/Inf reach every rank through the SUM (qsgd's: through the gathered scales), so every
                    # rank raises here. The bucket's sum is non-finite whenever an element is, and needs no
                    # bucket-sized bool tensor; only then is each parameter checked (finite elements can sum past
                    # the float range: such a bucket is fine)
                    names = nonfinite_params(layout, out)
                    if names:
                        raise nonfinite_error(index, names, wire=sent.value().dtype)
                if restart:
                    ctx.feedback.sync(local_grad, out)
            record.update(ctx.seconds)
            if not job.verdict.done():
                job.verdict.set_result(None)
            job.out = out
            job.done.set_result(None)
        except Exception as error:
            job.fail(error)

    pending.then(decode)


def header(state: CommState, communicator: Communicator, index, codec, x, ctx, record,
           scaled: bool = True) -> tuple[torch.Tensor | None, bool]:
    """One allreduce MAX of [max |g| per parameter (+inf where non-finite), flag, signature, -signature].
    Without ``scaled`` (a codec that uses no scales, on a step that measures no errors) the entries are
    zeros and the non-finite flag comes from the bucket's sum: one pass, where max |g| per parameter took
    5 ms eager per 1.7M elements on one CPU thread. The size stays a scaled header's, so ranks that chose
    different codecs meet in one collective and fail on the signatures."""
    with ctx.timed("encode_s"):  # codec work (max |g|; low rank's P), as time_codec counts it
        if scaled:
            maxes = codec.local_scales(x, ctx)
            finite = torch.isfinite(maxes)
            flag = (~finite).any()
            maxes = torch.where(finite, maxes, torch.full_like(maxes, float("inf")))
        else:
            maxes = torch.zeros(ctx.segments.count, device=x.device)
            flag = ~torch.isfinite(x.sum())
    signature = float(zlib.crc32(f"{index}:{state.step}:{codec.describe()}".encode()) % (1 << 24))
    flags = torch.stack([flag.float(), torch.tensor(signature, device=x.device), torch.tensor(-signature, device=x.device)])
    joined = torch.cat([maxes, flags])
    communicator.allreduce(joined, dist.ReduceOp.MAX, record)
    nonfinite, high, low = joined[-3:].tolist()  # the step's one host read per bucket
    if high != -low:  # max(signature) != min(signature)
        raise PlanMismatchError(f"bucket {index}: ranks chose different codecs at step {state.step} "
                                f"(this rank: {codec.describe()})")
    return joined[:-3] if scaled else None, nonfinite > 0


def nonfinite_error(index: int, names: list[str], overflowed: bool = False, wire=None) -> NonFiniteGradientError:
    """The error naming the parameters. overflowed: every rank's gradients were finite, and the codec's sum or
    product of them went past float32 (low rank's P = M Q); wire: the dtype summed, where the check ran on the
    sum (an fp16 cast overflows finite gradients)."""
    shown = ", ".join(names[:4]) + (" ..." if len(names) > 4 else "")
    if overflowed:
        what = "finite gradients whose sum overflowed float32 (largest 3.4e38): scale the loss down or clip them"
    else:
        what = "NaN/Inf gradients on at least one rank" + (
            ", or finite gradients whose mean overflowed fp16 (largest 65504) on the wire: use bf16 or gqsgd"
            if wire == torch.float16 else "")
    return NonFiniteGradientError(f"bucket {index} holds {what} (parameters: {shown}); "
                                  "pass nonfinite='uncompressed' to send such buckets uncompressed")


def header_names(layout: BucketLayout, scales: torch.Tensor, owners=None) -> list[str]:
    """The parameters of the header's non-finite entries; owners: the parameter of each entry
    (`Codec.scale_params`; None: one entry per parameter)."""
    bad = torch.isinf(scales).nonzero().flatten()
    return [layout.names[i] for i in dict.fromkeys((bad if owners is None else owners[bad]).tolist())]


def nonfinite_params(layout: BucketLayout, out: torch.Tensor) -> list[str]:
    """The parameters whose span of ``out`` holds NaN/Inf (the error path only: a bool tensor per parameter)."""
    return [name for name, (offset, numel) in zip(layout.names, layout.spans)
            if not bool(torch.isfinite(out[offset:offset + numel]).all())]


def all_finite(aggregated: torch.Tensor) -> bool:
    """No NaN/Inf in a round's result: its sum first (one pass, no bool tensor), each element only if that overflowed."""
    return bool(aggregated.sum().isfinite()) or bool(torch.isfinite(aggregated).all())


def nonfinite_gradients(communicator: Communicator, layout: BucketLayout, x: torch.Tensor) -> list[str]:
    """The parameters whose gradients ``x`` hold NaN/Inf on some rank (none: finite gradients whose sum
    overflowed). One more allreduce MAX, of a flag per parameter, on the error path only, which every rank
    takes at the same bucket."""
    local = set(nonfinite_params(layout, x))
    flags = torch.tensor([float(name in local) for name in layout.names], device=x.device)
    communicator.allreduce(flags, dist.ReduceOp.MAX)
    return [name for name, flag in zip(layout.names, flags.tolist()) if flag]


class Pipeline:
    """Runs each step's buckets through `send` in bucket order, on one thread or from DDP's (inline).

    Made at the first bucket; `state.close_step` gets each step's jobs once they are all done."""

    def __init__(self, state: CommState, side_stream: bool = True):
        self.state = state
        self.communicator = Communicator(state.process_group, link=state.link)
        if state.planner is not None:
            state.planner.attach(self.communicator)
        # A fixed codec without a header issues one collective per bucket and waits for nothing before it:
        # DDP's autograd thread can launch it in bucket order itself, with no thread hand-off.
        fixed = state.chooser if isinstance(state.chooser, Codec) else None
        self.inline = (fixed is not None and not fixed.needs_header and not fixed.relays
                       and state.config.nonfinite == "raise")
        # the thread that runs codecs keeps the caller's intra-op thread count: OpenMP's is per thread, and a
        # new thread's default (every core) oversubscribes what the user set and makes matmuls run-dependent
        threads = torch.get_num_threads()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="netgain-comm",
                                           initializer=torch.set_num_threads, initargs=(threads,))
        self.stream = None
        if side_stream and torch.cuda.is_available() and torch.cuda.is_initialized() and not self.inline:
            self.stream = torch.cuda.Stream()
        self.failure: str | None = None  # why a bucket of this step failed; later buckets skip
        self.plain = False  # this step's buckets run as a fixed codec's (a planner's settled plan: Planner.plain)
        self.plain_inline = False  # and launch from the caller's thread (no codec of the plan relays)

    def submit(self, job: BucketJob) -> None:
        """From DDP's thread: start the bucket; the last bucket's call raises the step's first error."""
        if job.buffer.is_cuda:
            job.ready = torch.cuda.Event()
            job.ready.record()
        self._plan(job)
        if self.inline or job.inline:  # nothing to wait for: launch from here, as PyTorch's own hooks do
            self._run(job)
        else:
            ran = self.executor.submit(self._run, job)
            if job.last and job.plain:  # its agreement is the step's only check of the plan: raised here as its class
                ran.result()
        if job.last:
            _raise_verdicts(job.step_jobs)

    def _run(self, job: BucketJob) -> None:
        try:
            if self.failure is not None:
                raise _NotSent(f"bucket {job.index} not sent: {self.failure}")
            with on_stream(self.stream, job.ready):
                send(self.state, job, self.communicator, self.stream)
        except Exception as error:
            # Header errors are seen by every rank at the same bucket, so every rank stops issuing
            # collectives here: none is left queued to meet a barrier or a new step out of order.
            self._failed(job, error)
        if job.last:
            jobs = job.step_jobs
            concurrent.futures.wait([j.done for j in jobs])
            try:
                self.end_step(jobs)
            except Exception as error:  # the planner's agreement (a plan mismatch, a peer gone): every bucket fails
                for j in jobs:
                    j.fail(error)
                if job.plain:  # to DDP's thread (inline, or the last bucket's submit): raised as its class
                    raise
            with on_stream(self.stream, None):  # DDP sees the step's results once its statistics are in
                for j in jobs:
                    if not j.result.done():
                        j.result.set_result(j.out)

    def _plan(self, job: BucketJob) -> None:
        """Whether the job runs plain, and inline: decided at the step's first bucket (the previous step has ended,
        its plan stands), for the whole step."""
        if len(job.step_jobs) == 1:
            planner = self.state.planner
            self.plain = (planner is not None and self.state.config.nonfinite == "raise"
                          and planner.plain(self.state.step))
            self.plain_inline = self.plain and not planner.relays
        job.plain, job.inline = self.plain, self.plain_inline

    def run_now(self, job: BucketJob) -> None:
        """On the caller's thread and stream, to the decoded mean (netgain.comm.fsdp: the caller reads it next)."""
        self._plan(job)
        try:
            send(self.state, job, self.communicator)
            job.done.result()
            error = job.verdict.exception()
            if error is not None:
                raise error
        except Exception as error:
            self._failed(job, error)
            raise

    def end_step(self, jobs: list[BucketJob]) -> None:
        """The step's statistics; the planner's end of step unless a bucket failed."""
        failed, self.failure = self.failure, None
        self.state.close_step(jobs, time.perf_counter(), self.communicator if failed is None else None)

    def _failed(self, job: BucketJob, error: Exception) -> None:
        if self.failure is None:
            self.failure = f"bucket {job.index} failed ({type(error).__name__})"
        job.fail(error)

    def drain(self) -> None:
        """Wait for what the communication thread holds."""
        self.executor.submit(lambda: None).result()

    def close(self) -> None:
        self.executor.shutdown(wait=True)


def _raise_verdicts(jobs: list[BucketJob]) -> None:
    """Wait for every bucket of the step to pass its checks; raise the first error as its own class."""
    for job in jobs:
        error = job.verdict.exception()
        if error is not None and not isinstance(error, _NotSent):
            raise error


class on_stream:
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
