"""The netgain DDP communication hook: state object, hook function, one-line `register`.

    state = netgain.comm.register(ddp_model, codec="gqsgd", bits=8)
    # or, e.g. for Lightning: DDPStrategy(ddp_comm_state=CommState(make_codec("gqsgd")),
    #                                     ddp_comm_hook=netgain.comm.hook)

The hook hands each bucket to ONE communication thread and returns a future at once, so the
backward pass keeps computing while earlier buckets are encoded and sent. A single thread
issuing collectives in submission order keeps their order identical on every rank (DDP submits
buckets in index order), which multi-step pipelines (header -> payload) need on gloo.

Per bucket: [header allreduce MAX: max |g| per parameter, non-finite flag, plan signature] ->
codec.encode -> collective -> codec.decode. The header makes every rank see the same verdict,
so NaN/Inf or a plan mismatch raises on every rank instead of hanging one of them.

`hook` keeps its annotations unquoted (no `from __future__ import annotations`): DDP checks them.
"""

import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from .adaptive import MODES as ADAPTIVE_MODES, AdaptivePlanner
from .codecs import Codec, Context, NoCompression, make_codec
from .collectives import Link
from .feedback import EF21

NONFINITE_POLICIES = ("raise", "uncompressed")


class NonFiniteGradientError(RuntimeError):
    """A bucket held NaN or Inf on at least one rank; raised on every rank."""


class PlanMismatchError(RuntimeError):
    """Ranks tried to aggregate one bucket with different codecs; raised on every rank."""


class CommState:
    """Hyperparameters, per-parameter state and statistics of the netgain hook.

    Codecs work per parameter inside a bucket (a scale, an RNG stream and EF21 buffers per
    parameter, one collective per bucket), so nothing depends on how DDP groups parameters into
    buckets: state survives DDP rebuilding its buckets after the first step, and a resumed run
    (whose first step uses DDP's initial layout again) reproduces an uninterrupted one exactly
    (except gqsgd-exp, whose ring chunks follow the bucket layout, and Kimad's planner, which re-measures).
    Holds no process group: `state_dict()` / `load_state_dict()` carry the step counter and every
    parameter's RNG state and EF21 buffers.
    """

    def __init__(self, codec: Codec | AdaptivePlanner, *, process_group: dist.ProcessGroup | None = None,
                 warmup_steps: int = 0, min_compress_numel: int = 1024, skip_1d: bool = False,
                 nonfinite: str = "raise", seed: int = 0, param_names: dict[int, str] | None = None):
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite={nonfinite!r} is not one of {NONFINITE_POLICIES}")
        if warmup_steps < 0 or min_compress_numel < 0:
            raise ValueError(f"warmup_steps and min_compress_numel must be >= 0, got {warmup_steps}, {min_compress_numel}")
        # a fixed codec, or a planner that picks one per bucket (Kimad)
        self.planner = codec if isinstance(codec, AdaptivePlanner) else None
        self.codec = None if self.planner else codec
        self.process_group = process_group
        self.warmup_steps, self.min_compress_numel = warmup_steps, min_compress_numel
        self.skip_1d = skip_1d  # biases and norm weights: few bytes, sent exact (as PowerSGD does)
        self.nonfinite, self.seed = nonfinite, seed
        self.param_names = param_names or {}
        self.step = 0
        self.last_step: dict = {}
        self.history: list[dict] = []
        self._generators: dict[str, torch.Generator] = {}
        self._feedback: dict[str, EF21] = {}
        self._records: list[dict] = []
        self._first_submit = self._last_submit = 0.0
        self._forward_end: float | None = None  # set by register()'s forward hook
        self._step_open = False
        self._link: Link | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._failure: str | None = None  # why a bucket of this step failed; later buckets skip their collectives

    # ---- which codec a bucket uses this step ---------------------------------------------------
    def codec_for(self, index: int, numel: int) -> Codec:
        if self.step < self.warmup_steps or numel < self.min_compress_numel:
            return _UNCOMPRESSED
        return self.planner.codec_for(index, numel) if self.planner else self.codec

    def describe(self) -> str:
        return self.planner.mode if self.planner else self.codec.describe()

    def plan_signature(self, index: int, codec: Codec) -> float:
        """A number every rank must agree on for this bucket (exact in float32)."""
        return float(zlib.crc32(f"{index}:{codec.describe()}".encode()) % (1 << 24))

    # ---- the hook's work, on the communication thread ------------------------------------------
    def submit(self, bucket: dist.GradBucket) -> torch.futures.Future:
        buffer = bucket.buffer()
        future = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)
        self._last_submit = time.perf_counter()
        if not self._step_open:  # the first bucket of a backward pass
            self._first_submit, self._step_open = self._last_submit, True
        self._step_open = not bucket.is_last()
        if dist.get_world_size(self.process_group) == 1:  # nothing to send: pass through
            self._records.append({"index": bucket.index(), "numel": buffer.numel(), "codec": "passthrough",
                                  "wire_bytes": 0, "raw_bytes": 4 * buffer.numel(), "comm_s": 0.0,
                                  "encode_s": 0.0, "decode_s": 0.0})
            if bucket.is_last():
                self._end_step()
            future.set_result(buffer)
            return future
        if self._executor is None:
            self._link = Link(self.process_group)
            if self.planner:
                self._link.observer = self.planner.monitor.observe
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="netgain-comm")
        ready = torch.cuda.Event() if buffer.is_cuda else None
        if ready is not None:
            ready.record()
        layout, exact = self._layout(bucket)
        job = self._executor.submit(self._run, bucket.index(), buffer, layout, exact, bucket.is_last(), ready)

        def resolve(done):
            error = done.exception()
            future.set_exception(error) if error is not None else future.set_result(done.result())

        job.add_done_callback(resolve)
        return future

    def _run(self, index, buffer, layout, exact, is_last, ready):
        if ready is not None:
            ready.synchronize()
        try:
            if self._failure is not None:
                raise RuntimeError(f"bucket {index} not sent: {self._failure}")
            out = self._aggregate(index, buffer, layout, exact)
            if buffer.is_cuda:
                torch.cuda.current_stream().synchronize()
            return out
        except Exception as error:
            # Header errors are seen by every rank at the same bucket, so every rank stops issuing
            # collectives here: none is left queued to meet a barrier or a new step out of order.
            self._failure = self._failure or f"bucket {index} failed ({type(error).__name__})"
            raise
        finally:
            if is_last:
                self._end_step()

    def _aggregate(self, index: int, x: torch.Tensor, layout, exact: set[str]) -> torch.Tensor:
        link, codec = self._link, self.codec_for(index, x.numel())
        bytes_before, seconds_before = link.bytes_sent, link.seconds
        checked = codec.needs_header or self.planner is not None  # adaptive: every bucket's plan is checked
        exact = set() if isinstance(codec, NoCompression) else exact
        coded = {key: span for key, span in layout.items() if key not in exact}
        # checked codecs work per parameter (scale, RNG, EF21); the plain casts see the whole bucket
        segments = coded if checked or exact else {"bucket": (0, x.numel())}
        contexts = {key: self._context(key, k, codec, x.device) for key, (_, k) in segments.items()}

        if checked and segments and self._header(index, codec, x, segments, contexts):
            out = self._nonfinite(index, x, layout, link)
        else:
            out = self._exchange(codec, x, segments, contexts) if segments else torch.zeros_like(x)
            if exact:
                self._exchange_exact(x, out, {key: layout[key] for key in layout if key in exact})
            if (not checked or exact) and not bool(torch.isfinite(out).all()):
                # NaN/Inf reach every rank through the float SUM, so every rank takes this branch
                if self.nonfinite == "raise" or not isinstance(codec, NoCompression):
                    out = self._nonfinite(index, x, layout, link)
            elif isinstance(codec, NoCompression):
                for key, (o, k) in layout.items():  # after an exact step, EF21 estimates are exact
                    if key in self._feedback:
                        self._feedback[key].sync(x[o:o + k], out[o:o + k])
            if self.planner and codec is not _UNCOMPRESSED and self.planner.wants_errors(self.step):
                self.planner.observe(index, x)  # only buckets the planner plans (not warm-up, not tiny ones)

        self._records.append({
            "index": index, "numel": x.numel(), "codec": codec.describe(),
            "wire_bytes": link.bytes_sent - bytes_before, "raw_bytes": 4 * x.numel(),
            "comm_s": link.seconds - seconds_before,
            **{key: sum(ctx.seconds[key] for ctx in contexts.values()) for key in ("encode_s", "decode_s")},
        })
        return out

    def _header(self, index, codec, x, segments, contexts) -> bool:
        """One allreduce MAX of [max |g| per parameter, non-finite flag, plan signature, -signature].

        Sets each context's global scale; returns whether any rank holds NaN/Inf in this bucket.
        """
        maxes = torch.stack([x[o:o + k].abs().max() for o, k in segments.values()]).to(torch.float32)
        finite = torch.isfinite(maxes)
        signature = self.plan_signature(index, codec)
        header = torch.cat([torch.where(finite, maxes, torch.zeros_like(maxes)),
                            torch.tensor([0.0 if bool(finite.all()) else 1.0, signature, -signature], device=x.device)])
        self._link.allreduce(header, dist.ReduceOp.MAX)
        if header[-2] != -header[-1]:  # max(signature) != min(signature)
            raise PlanMismatchError(f"bucket {index}: ranks chose different codecs (this rank: {codec.describe()})")
        for ctx, scale in zip(contexts.values(), header[:-3].tolist()):
            ctx.scale = scale or 1.0  # an all-zero parameter: codes are all zero whatever the scale
        return bool(header[-3] > 0)

    def _exchange_exact(self, x, out, spans) -> None:
        """The uncompressed parameters of a bucket (see skip_1d): one fp32 allreduce of their mean into `out`."""
        joined = torch.cat([x[o:o + k] for o, k in spans.values()]) / self._link.world_size
        summed = self._link.allreduce(joined)
        for part, (o, k) in zip(summed.split([k for _, k in spans.values()]), spans.values()):
            out[o:o + k] = part

    def _exchange(self, codec, x, segments, contexts) -> torch.Tensor:
        """Encode every segment, run the codec's one collective on the joined payload, decode."""
        payloads = [codec.encode(x[o:o + k], contexts[key]) for key, (o, k) in segments.items()]
        payload = torch.cat(payloads, dim=-1) if len(payloads) > 1 else payloads[0]
        if codec.collective == "allreduce":
            aggregated = self._link.allreduce(payload)
        elif codec.collective == "allgather":
            aggregated = self._link.allgather(payload)
        else:
            combine_ctx = next(iter(contexts.values()))
            aggregated = self._link.ring_allreduce(payload, lambda a, b: codec.combine(a, b, combine_ctx))
        out = torch.zeros_like(x)
        for part, (key, (o, k)) in zip(aggregated.split([p.shape[-1] for p in payloads], dim=-1), segments.items()):
            out[o:o + k] = codec.decode(part, k, contexts[key])
        return out

    def _context(self, key: str, numel: int, codec: Codec, device) -> Context:
        generator = self._generators.get(key)
        if generator is None:
            generator = self._generators[key] = torch.Generator(device=device).manual_seed(
                zlib.crc32(f"{self.seed}:{self._link.rank}:{key}".encode()))
        ctx = Context(self._link.world_size, generator,
                      shared_seed=zlib.crc32(f"{self.seed}:{key}:{self.step}".encode()))
        if codec.uses_feedback:
            ctx.feedback = self._feedback_for(key, numel, device)
        return ctx

    def _feedback_for(self, key: str, numel: int, device) -> EF21:
        if key not in self._feedback:
            self._feedback[key] = EF21(numel, device)
        return self._feedback[key]

    def _nonfinite(self, index, x, layout, link) -> torch.Tensor:
        if self.nonfinite == "raise":
            names = [self.param_names.get(key, key) for key in layout][:4]
            raise NonFiniteGradientError(
                f"bucket {index} holds NaN/Inf gradients on at least one rank (parameters {names}"
                f"{' ...' if len(layout) > 4 else ''}); pass nonfinite='uncompressed' to send such buckets uncompressed"
            )
        return link.allreduce(x / link.world_size)

    def _end_step(self):
        records, self._records = self._records, []
        totals = {key: sum(r[key] for r in records) for key in ("wire_bytes", "raw_bytes", "comm_s", "encode_s", "decode_s")}
        totals.update(step=self.step, buckets=len(records), wait_s=time.perf_counter() - self._last_submit,
                      backward_s=self._last_submit - (self._forward_end or self._first_submit),
                      compression_ratio=totals["raw_bytes"] / max(totals["wire_bytes"], 1))
        failed, self._failure = self._failure, None
        if self.planner and self._link is not None and failed is None:
            self._link.observer = None  # the planner's own small collectives are not samples of the link
            try:
                self.planner.end_step(self._link, self.step, totals["backward_s"])
            finally:
                self._link.observer = self.planner.monitor.observe
            totals.update(self.planner.last)
        self.history.append(totals)
        self.last_step = {**totals, "per_bucket": records}
        self.step += 1

    def close(self) -> None:
        """Wait for buckets still queued on the communication thread (e.g. after one raised), then stop it.

        Call before destroying the process group, or a peer's pending collective may find it gone.
        """
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # ---- bucket layout ---------------------------------------------------------------------
    def _layout(self, bucket: dist.GradBucket) -> tuple[dict[str, tuple[int, int]], set[str]]:
        """parameter key -> (offset, numel) inside the bucket's flat buffer, and the keys sent exact (skip_1d)."""
        base, size = bucket.buffer().data_ptr(), bucket.buffer().element_size()
        layout, exact = {}, set()
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            key = self.param_names.get(id(p), f"param{id(p)}")
            layout[key] = ((g.data_ptr() - base) // size, g.numel())
            if self.skip_1d and p.dim() <= 1:
                exact.add(key)
        return layout, exact

    # ---- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "codec": self.describe(),
            "rng": {key: {"device": str(g.device), "state": g.get_state()} for key, g in self._generators.items()},
            "feedback": {key: ef.state_dict() for key, ef in self._feedback.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        if state["codec"] != self.describe():
            raise ValueError(f"checkpoint was saved with codec {state['codec']}, this state uses {self.describe()}")
        self.step = state["step"]
        self._generators = {}
        for key, rng in state["rng"].items():
            self._generators[key] = torch.Generator(device=rng["device"])
            self._generators[key].set_state(rng["state"])
        self._feedback = {}
        for key, buffers in state["feedback"].items():
            self._feedback[key] = EF21(buffers["local"].numel(), buffers["local"].device)
            self._feedback[key].load_state_dict(buffers)

    def __getstate__(self):
        state = dict(self.__dict__)
        state.update(_link=None, _executor=None, process_group=None)
        return state


_UNCOMPRESSED = NoCompression()


def hook(state: CommState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: returns a future of the averaged bucket."""
    return state.submit(bucket)


def register(ddp_model: torch.nn.parallel.DistributedDataParallel, codec: str | Codec = "gqsgd", *,
             bits: int = 8, encoding: str = "packed", ratio: float = 0.01, comm_budget_ms: float | None = None,
             replan_every: int = 10, process_group: dist.ProcessGroup | None = None, **options) -> CommState:
    """Register the netgain hook on ``ddp_model``; returns its CommState.

    ``codec``: a name from CODEC_NAMES ("kimad" / "kimad+" adapt to the measured bandwidth, with
    a time budget of ``comm_budget_ms`` per step or, by default, the measured backward time).
    Checks that every rank asked for the same codec and options (raises on every rank if not).
    ``options``: warmup_steps, min_compress_numel, skip_1d, nonfinite, seed (see CommState).
    """
    if codec in ADAPTIVE_MODES:
        codec = AdaptivePlanner(codec, replan_every=replan_every,
                                time_budget_s=None if comm_budget_ms is None else comm_budget_ms / 1e3)
    elif isinstance(codec, str):
        codec = make_codec(codec, bits=bits, encoding=encoding, ratio=ratio)
    names = {id(p): name for name, p in ddp_model.module.named_parameters()}
    state = CommState(codec, process_group=process_group, param_names=names, **options)
    _check_same_config(state)
    ddp_model.register_comm_hook(state, hook)
    ddp_model.module.register_forward_hook(lambda *_: setattr(state, "_forward_end", time.perf_counter()))
    return state


def _check_same_config(state: CommState) -> None:
    config = {"codec": state.describe(), "warmup_steps": state.warmup_steps,
              "min_compress_numel": state.min_compress_numel, "skip_1d": state.skip_1d, "nonfinite": state.nonfinite,
              "seed": state.seed}
    configs = [None] * dist.get_world_size(state.process_group)
    dist.all_gather_object(configs, config, group=state.process_group)
    if any(c != configs[0] for c in configs):
        raise ValueError("netgain comm configuration differs between ranks: "
                         + "; ".join(f"rank {r}: {c}" for r, c in enumerate(configs)))
