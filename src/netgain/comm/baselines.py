"""PyTorch's own DDP hooks, with netgain's per-step statistics, so benchmarks compare peers on
equal terms:
  ddp           - default_hooks.allreduce_hook: fp32 allreduce, documented as what DDP does with
                  no hook at all (the plain baseline);
  ddp-fp16      - default_hooks.fp16_compress_hook;
  ddp-powersgd  - powerSGD_hook at `rank`, warm-up of max(2, warmup_steps) uncompressed steps
                  (its docs: start_powerSGD_iter must exceed 1 because DDP rebuilds buckets).
Wire bytes are what each hook hands to its allreduces, from its documented algorithm: PowerSGD
sends P (n x r) and Q (m x r) in fp32 for every matrix where that compresses by at least
min_compression_rate, and everything else (vectors, small matrices) uncompressed. Those are also the bytes an
emulated link (`link`, emulate.EmulatedLink: netgain train --emulate-link) holds each bucket for.
"""

import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

BASELINES = ("ddp", "ddp-fp16", "ddp-powersgd")


class TorchHookState:
    """Wraps a PyTorch hook and its state; keeps `last_step` / `history` like CommState."""

    def __init__(self, name: str, rank: int = 4, warmup_steps: int = 0, process_group=None):
        if name not in BASELINES:
            raise ValueError(f"unknown baseline {name!r}; choose one of {', '.join(BASELINES)}")
        self.name, self.step, self.history, self.last_step = name, 0, [], {}
        self.process_group = process_group
        self.link = None  # an EmulatedLink: each bucket completes once its wire bytes could have crossed it
        if name == "ddp-powersgd":
            self.inner_state = powersgd.PowerSGDState(process_group, matrix_approximation_rank=rank,
                                                      start_powerSGD_iter=max(2, warmup_steps))
            self.inner_hook = powersgd.powerSGD_hook
        else:
            self.inner_state = process_group
            self.inner_hook = default_hooks.fp16_compress_hook if name == "ddp-fp16" else default_hooks.allreduce_hook
        self._wire = self._raw = 0
        self._last_submit = 0.0

    def wire_bytes(self, bucket: dist.GradBucket) -> int:
        if self.name == "ddp-fp16":
            return 2 * bucket.buffer().numel()
        if self.name == "ddp" or self.step < self.inner_state.start_powerSGD_iter:
            return 4 * bucket.buffer().numel()
        total = 0
        rate = self.inner_state.min_compression_rate
        for grad in bucket.gradients():
            n = grad.shape[0] if grad.ndim > 1 else grad.numel()
            m = grad.numel() // n
            r = min(n, m, self.inner_state.matrix_approximation_rank)
            compressed = grad.ndim > 1 and n * m >= rate * (n + m) * r
            total += 4 * ((n + m) * r if compressed else grad.numel())
        return total

    def close(self) -> None:
        """Nothing to drain: PyTorch's hooks run on DDP's own threads (same interface as CommState)."""

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def hook(state: TorchHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    wire = state.wire_bytes(bucket)
    state._wire += wire
    state._raw += 4 * bucket.buffer().numel()
    state._last_submit = start = time.perf_counter()
    is_last = bucket.is_last()
    future = state.inner_hook(state.inner_state, bucket)
    if state.link is not None:  # every hook here sends its bytes by allreduce
        due = state.link.reserve("allreduce", wire, dist.get_world_size(state.process_group), start)
        future = state.link.hold(future, due, bucket.buffer().device)

    def record(done):
        if is_last:
            totals = {"step": state.step, "wire_bytes": state._wire, "raw_bytes": state._raw,
                      "wait_s": time.perf_counter() - state._last_submit, "encode_s": 0.0, "decode_s": 0.0,
                      "comm_s": float("nan")}  # the hooks run their collectives inside; not timed apart
            totals["compression_ratio"] = totals["raw_bytes"] / max(totals["wire_bytes"], 1)
            state.history.append(totals)
            state.last_step = totals
            state._wire = state._raw = 0
            state.step += 1
        return done.value()

    return future.then(record)


def register(ddp_model, name: str, *, rank: int = 4, warmup_steps: int = 0, process_group=None) -> TorchHookState:
    state = TorchHookState(name, rank, warmup_steps, process_group)
    ddp_model.register_comm_hook(state, hook)
    return state
