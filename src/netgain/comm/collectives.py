"""Collectives as the codecs need them, timed, over one process group.

`Link` counts the payload bytes this rank contributes and the seconds spent waiting on the
network, so the hook can report them per bucket. Three aggregation patterns:
  allreduce  - payloads add up under a native SUM (fp32/fp16, integer codes with a global scale);
  allgather  - payloads that cannot be added (per-worker scales, different sparse supports);
  ring       - a ring reduce-scatter over point-to-point send/recv where each hop merges two
               payloads with the codec's own combine, then a native allgather of the reduced
               chunks: any world size, one payload size on the wire per rank like a ring allreduce.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch
import torch.distributed as dist


# torch >= 2.13 renamed all_gather_into_tensor (which warns there) to all_gather_single
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Link:
    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.bytes_sent = 0
        self.seconds = 0.0
        self.observer: Callable[[str, int, float, int], None] | None = None  # e.g. a BandwidthMonitor

    def _timed(self, collective: str, payload_bytes: int, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        start = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - start
        self.seconds += seconds
        self.bytes_sent += payload_bytes
        if self.observer is not None:
            self.observer(collective, payload_bytes, seconds, self.world_size)
        return out

    def allreduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """In-place native allreduce; returns the tensor."""
        def run():
            dist.all_reduce(tensor, op=op, group=self.group)
            return tensor
        return self._timed("allreduce", tensor.numel() * tensor.element_size(), run)

    def allgather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's tensor, stacked: shape (world_size, *tensor.shape)."""
        def run():
            out = torch.empty(self.world_size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
            _all_gather_flat(out, tensor.contiguous(), group=self.group)
            return out.view(self.world_size, *tensor.shape)
        return self._timed("allgather", tensor.numel() * tensor.element_size(), run)

    def ring_allreduce(self, codes: torch.Tensor, combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Reduce ``codes`` across ranks with ``combine`` (associative in expectation); same result on every rank."""
        n, rank = self.world_size, self.rank
        numel = codes.numel()
        chunk = math.ceil(numel / n)
        padded = torch.zeros(chunk * n, dtype=codes.dtype, device=codes.device)
        padded[:numel] = codes
        chunks = list(padded.view(n, chunk))
        right, left = (rank + 1) % n, (rank - 1) % n

        def run():
            received = torch.empty(chunk, dtype=codes.dtype, device=codes.device)
            for hop in range(n - 1):
                send_index, recv_index = (rank - hop) % n, (rank - hop - 1) % n
                requests = [dist.isend(chunks[send_index], self._global(right), group=self.group),
                            dist.irecv(received, self._global(left), group=self.group)]
                for request in requests:
                    request.wait()
                chunks[recv_index] = combine(chunks[recv_index], received)
            owned = chunks[(rank + 1) % n]  # fully reduced after n - 1 hops
            gathered = torch.empty(n * chunk, dtype=codes.dtype, device=codes.device)
            _all_gather_flat(gathered, owned.contiguous(), group=self.group)
            return gathered.view(n, chunk).roll(1, dims=0).reshape(-1)[:numel]  # rank j owned chunk j + 1

        return self._timed("ring", numel * codes.element_size(), run)

    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)
