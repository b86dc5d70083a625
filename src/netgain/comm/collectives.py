"""Collectives as the codecs need them, timed, over one process group.

`Communicator` launches a codec's payload collective asynchronously (a future, so the pipeline can
encode the next bucket while this one is on the wire) and runs the small header and planner
collectives synchronously. Three aggregation patterns:
  allreduce  - payloads add up under a native SUM (fp32/fp16, integer codes with a global scale);
  allgather  - payloads that cannot be added (per-worker scales, different sparse supports);
  ring       - a ring reduce-scatter over point-to-point send/recv where each hop merges two
               payloads with the codec's own combine, then a native allgather of the reduced
               chunks: any world size, one payload size on the wire per rank like a ring allreduce.
An optional `link` (emulate.EmulatedLink, `netgain train --emulate-link`) holds each collective until
its bytes could have crossed a slower link than the real one.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

# torch >= 2.13 renamed all_gather_into_tensor (which warns there) to all_gather_single
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

if TYPE_CHECKING:
    from .emulate import EmulatedLink


class Communicator:
    def __init__(self, group: dist.ProcessGroup | None = None, link: EmulatedLink | None = None):
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.observer: Callable[[str, int, float, int], None] | None = None  # e.g. a BandwidthMonitor
        self.link = link  # an emulated slower link: comm_s and the observer then see its times

    def _seen(self, collective: str, payload_bytes: int, seconds: float) -> None:
        if self.observer is not None:
            self.observer(collective, payload_bytes, seconds, self.world_size)

    def start(self, collective: str, payload: torch.Tensor, record: dict,
              combine: Callable | None = None, op=dist.ReduceOp.SUM) -> torch.futures.Future:
        """Launch the payload's collective (``op``: an allreduce's); the future's value is the aggregated tensor.

        record["wire_bytes"] and, on completion, record["comm_s"] are filled in.
        """
        payload_bytes = payload.numel() * payload.element_size()
        record["wire_bytes"] = record.get("wire_bytes", 0) + payload_bytes
        start = time.perf_counter()
        if collective == "ring":  # point-to-point hops with a combine in between: run here, in order
            result = self.ring_allreduce(payload, combine)
            done = torch.futures.Future()
            done.set_result(result)
            work_future, value = done, result
        elif collective == "allreduce":
            work_future = dist.all_reduce(payload, op=op, group=self.group, async_op=True).get_future()
            value = payload
        else:
            gathered = torch.empty(self.world_size * payload.numel(), dtype=payload.dtype, device=payload.device)
            work_future = _all_gather_flat(gathered, payload, group=self.group, async_op=True).get_future()
            value = gathered.view(self.world_size, *payload.shape)
        if self.link is not None:
            due = self.link.reserve(collective, payload_bytes, self.world_size, start)
            work_future = self.link.hold(work_future, due, payload.device)

        def finished(future):
            future.value()  # re-raises a failed collective
            seconds = time.perf_counter() - start
            record["comm_s"] = record.get("comm_s", 0.0) + seconds
            self._seen(collective, payload_bytes, seconds)
            return value

        return work_future.then(finished)

    def allreduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, record: dict | None = None) -> torch.Tensor:
        """Blocking in-place native allreduce (headers, the planner); returns the tensor."""
        start = time.perf_counter()
        dist.all_reduce(tensor, op=op, group=self.group)
        if self.link is not None:
            self.link.wait(self.link.reserve("allreduce", tensor.numel() * tensor.element_size(), self.world_size, start))
        seconds = time.perf_counter() - start
        if record is not None:
            record["wire_bytes"] = record.get("wire_bytes", 0) + tensor.numel() * tensor.element_size()
            record["comm_s"] = record.get("comm_s", 0.0) + seconds
        self._seen("allreduce", tensor.numel() * tensor.element_size(), seconds)
        return tensor

    def ring_allreduce(self, codes: torch.Tensor, combine: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
        """Reduce ``codes`` across ranks with ``combine(a, b, hop)`` (associative in expectation); same result on every rank."""
        n, rank = self.world_size, self.rank
        numel = codes.numel()
        chunk = math.ceil(numel / n)
        padded = torch.zeros(chunk * n, dtype=codes.dtype, device=codes.device)
        padded[:numel] = codes
        chunks = list(padded.view(n, chunk))
        right, left = (rank + 1) % n, (rank - 1) % n
        received = torch.empty(chunk, dtype=codes.dtype, device=codes.device)
        for hop in range(n - 1):
            send_index, recv_index = (rank - hop) % n, (rank - hop - 1) % n
            requests = [dist.isend(chunks[send_index], self._global(right), group=self.group),
                        dist.irecv(received, self._global(left), group=self.group)]
            for request in requests:
                request.wait()
            chunks[recv_index] = combine(chunks[recv_index], received, hop)
        owned = chunks[(rank + 1) % n]  # fully reduced after n - 1 hops
        gathered = torch.empty(n * chunk, dtype=codes.dtype, device=codes.device)
        _all_gather_flat(gathered, owned.contiguous(), group=self.group)
        return gathered.view(n, chunk).roll(1, dims=0).reshape(-1)[:numel]  # rank j owned chunk j + 1

    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)
