"""Bandwidth monitor: every collective of the hook, timed from launch to completion, becomes one
estimate of the link that all ranks agree on.

A collective's time includes waiting for the slowest rank to arrive, which only ever makes a
rank's estimate too low; the rank that arrived last measured the pure transfer. So ranks agree
on the MAX of their estimates (one small allreduce per step, on the communication thread).
"""

from __future__ import annotations

# bytes a rank puts on the wire per payload byte, by aggregation pattern (ring algorithms)
WIRE_FACTOR = {"allreduce": lambda n: 2 * (n - 1) / n, "ring": lambda n: 2 * (n - 1) / n,
               "allgather": lambda n: n - 1}


class BandwidthMonitor:
    """EWMA of bytes/s on the wire per rank, from the payload collectives of each step.

    smoothing: weight of the newest step. A step whose estimate is more than `outlier` times off
    the current one is held back once; if the next step agrees with it, the link really changed.
    Collectives under `min_bytes` (headers) measure the latency alpha; larger ones the bandwidth,
    with alpha taken off their time, so heavily compressed payloads still keep the estimate live.
    """

    def __init__(self, smoothing: float = 0.5, outlier: float = 3.0, min_bytes: int = 4 * 1024):
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.smoothing, self.outlier, self.min_bytes = smoothing, outlier, min_bytes
        self.bandwidth: float | None = None  # agreed bytes/s
        self.latency: float = 0.0            # agreed seconds per small collective
        self._wire_bytes = self._seconds = 0.0
        self._small: list[float] = []
        self._held: float | None = None

    def observe(self, collective: str, payload_bytes: int, seconds: float, world_size: int) -> None:
        if payload_bytes < self.min_bytes:
            self._small.append(seconds)
        else:
            self._wire_bytes += WIRE_FACTOR[collective](world_size) * payload_bytes
            self._seconds += max(seconds - self.latency, seconds / 2)

    def local_estimate(self) -> tuple[float, float]:
        """This rank's (bandwidth, latency) for the step just ended; resets the step's samples."""
        bandwidth = self._wire_bytes / self._seconds if self._seconds > 0 else 0.0
        latency = sorted(self._small)[len(self._small) // 2] if self._small else 0.0
        self._wire_bytes = self._seconds = 0.0
        self._small = []
        return bandwidth, latency

    def update(self, bandwidth: float, latency: float) -> float | None:
        """Fold in the agreed estimate of one step (identical on every rank); returns the estimate."""
        if bandwidth <= 0:
            return self.bandwidth
        self.latency = latency
        if self.bandwidth is None:
            self.bandwidth = bandwidth
        elif max(bandwidth / self.bandwidth, self.bandwidth / bandwidth) > self.outlier and self._held is None:
            self._held = bandwidth  # one odd step: wait for a second opinion
        else:
            if self._held is not None and max(bandwidth / self._held, self._held / bandwidth) <= self.outlier:
                self.bandwidth = self._held  # two steps agree: the link changed, jump to it
            self._held = None
            self.bandwidth += self.smoothing * (bandwidth - self.bandwidth)
        return self.bandwidth
