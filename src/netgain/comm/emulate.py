"""A slower link than the one the ranks share, emulated: `netgain train --emulate-link 100mbit`.

On loopback a codec has nothing to gain, so `EmulatedLink` holds each collective's result until its
bytes could have crossed a link of the given rate: a collective that sends S bytes per rank (a ring
allreduce of B bytes 2(n-1)/n x B, an allgather (n-1) x B: `network.sent_bytes`, the cost model's
own formula) completes no earlier than S / rate after it began. The real collective still runs; the
hold only delays when its result is handed on.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import threading
import time

import torch

from netgain.cost import network as net


def link_rate(text: str, flag: str = "--emulate-link") -> float:
    """Bytes/s of a rate as netgain reads link rates ('100mbit', '1gbit', '12MB/s'); a bad one named by ``flag``."""
    try:
        return net.parse_bandwidth(text)
    except ValueError as error:
        raise ValueError(f"{flag} {text}: {str(error).removeprefix('bandwidth: ')}") from None


def emulated_link(rate: str) -> net.Link:
    """The cost model's link of an emulated ``rate``: its bandwidth, no latency, gloo's ring."""
    return net.Link(f"emulated {rate}", link_rate(rate), 0.0, f"--emulate-link {rate}", algorithm="ring")


class EmulatedLink:
    """One rank's side of an emulated link of ``rate`` ('100mbit'), shared by every collective it launches.

    The link carries one collective after another (first in, first out), as one wire does: a collective's
    bytes start crossing when it is launched or when the one before it has crossed, whichever is later.
    Two buckets in flight at once so take as long as their bytes together, not as long as the larger.

    A held result is released by one timer thread, in the order the results are due, never by a sleep on
    the thread that launched the collective: the backward pass keeps computing and the hook keeps encoding
    the next bucket while a bucket is "on the wire", which is the overlap the emulation must keep honest;
    and since due times grow in launch order, buckets complete in bucket order. What runs on a released
    future (a codec's decode) runs on that thread, as it would on the collective's own callback thread.
    """

    def __init__(self, rate: str):
        self.rate = rate
        self.link = emulated_link(rate)
        self._free_at = 0.0  # time.perf_counter() at which the bytes launched so far have crossed
        self._due: list = []  # heap of (due, order, future to complete, value, CUDA stream)
        self._order = itertools.count()
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    @property
    def label(self) -> str:
        return f"emulated {self.rate}"

    def reserve(self, collective: str, payload_bytes: int, world_size: int, start: float) -> float:
        """When a collective of ``payload_bytes`` per rank launched at ``start`` (perf_counter) has crossed."""
        seconds = net.sent_bytes(payload_bytes, world_size, collective, self.link) / self.link.bandwidth
        with self._changed:
            self._free_at = max(start, self._free_at) + seconds
            return self._free_at

    def wait(self, due: float) -> None:
        """A blocking collective (a header) returns at ``due``: its caller waits for it anyway."""
        time.sleep(max(0.0, due - time.perf_counter()))

    def hold(self, future: torch.futures.Future, due: float, device: torch.device) -> torch.futures.Future:
        """A future of ``future``'s value that completes at ``due`` (perf_counter) or when ``future`` does, the later."""
        held = torch.futures.Future(devices=[device] if device.type == "cuda" else None)

        def arrived(done: torch.futures.Future) -> None:
            try:
                value = done.value()
            except Exception as error:  # a failed collective fails at once: nothing crossed
                held.set_exception(error)
                return
            stream = torch.cuda.current_stream(device) if device.type == "cuda" else None  # where the value is ready
            with self._changed:
                heapq.heappush(self._due, (due, next(self._order), held, value, stream))
                if self._thread is None:
                    self._thread = threading.Thread(target=self._release, name="netgain-emulated-link", daemon=True)
                    self._thread.start()
                self._changed.notify()

        future.then(arrived)
        return held

    def _release(self) -> None:
        while True:
            with self._changed:
                while not self._due or self._due[0][0] > time.perf_counter():
                    self._changed.wait(max(0.0, self._due[0][0] - time.perf_counter()) if self._due else None)
                _, _, held, value, stream = heapq.heappop(self._due)
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                held.set_result(value)
