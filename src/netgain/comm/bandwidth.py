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
    Collectives under `min_bytes` (headers) measure the latency alpha; larger ones the bandwidth.
    With payloads of clearly different sizes in a step, the bandwidth is the slope of a least-squares
    fit time = a + bytes / bandwidth: a constant per transfer (latency, or a token bucket's burst that
    lets the first bytes of every transfer through at line rate) drops out of the slope. Otherwise it
    is bytes / (time - alpha), so heavily compressed payloads still keep the estimate live.
    """

    def __init__(self, smoothing: float = 0.5, outlier: float = 3.0, min_bytes: int = 4 * 1024):
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.smoothing, self.outlier, self.min_bytes = smoothing, outlier, min_bytes
        self.bandwidth: float | None = None  # agreed bytes/s
        self.latency: float = 0.0            # agreed seconds per small collective
        self._payloads: list[tuple[float, float]] = []  # (wire bytes, seconds) this step
        self._small: list[float] = []
        self._held: float | None = None

    def observe(self, collective: str, payload_bytes: int, seconds: float, world_size: int) -> None:
        if payload_bytes < self.min_bytes:
            self._small.append(seconds)
        else:
            self._payloads.append((WIRE_FACTOR[collective](world_size) * payload_bytes, seconds))

    def local_estimate(self) -> tuple[float, float]:
        """This rank's (bandwidth, latency) for the step just ended; resets the step's samples."""
        latency = sorted(self._small)[len(self._small) // 2] if self._small else 0.0
        bandwidth = _slope_bandwidth(self._payloads) or _ratio_bandwidth(self._payloads, self.latency)
        self._payloads, self._small = [], []
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


def _slope_bandwidth(samples: list[tuple[float, float]], spread: float = 1.5) -> float | None:
    """1 / slope of time on bytes, when the sizes differ enough for a slope to mean something."""
    sizes = [x for x, _ in samples]
    if len(samples) < 2 or max(sizes) < spread * min(sizes):
        return None
    mean_x = sum(sizes) / len(sizes)
    mean_t = sum(t for _, t in samples) / len(samples)
    covariance = sum((x - mean_x) * (t - mean_t) for x, t in samples)
    variance = sum((x - mean_x) ** 2 for x in sizes)
    return variance / covariance if covariance > 0 else None


def _ratio_bandwidth(samples: list[tuple[float, float]], latency: float) -> float:
    seconds = sum(max(t - latency, t / 2) for _, t in samples)
    return sum(x for x, _ in samples) / seconds if seconds > 0 else 0.0
