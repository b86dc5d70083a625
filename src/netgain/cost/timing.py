"""Timing that survives a shared machine: calls interleaved in rounds, repeated, outliers rejected, spread kept.

On a loaded CPU one slow sample (another process, a page fault, a frequency change) moves a mean by
more than the alignment effects being measured, and timing one shape after another lets a burst of
load land on one shape only. So every call is timed once per round, in a rotating order; samples
further than `OUTLIER_MADS` median absolute deviations from the median are dropped; what is left
gives the median and the spread (interquartile range / median) that callers compare effects to.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Mapping

OUTLIER_MADS = 3.0  # a sample this many (scaled) MADs from the median is an outlier
MAD_TO_SIGMA = 1.4826  # MAD of a normal sample x this = its standard deviation


@dataclass(frozen=True)
class Timing:
    """Summary of one call's samples after outlier rejection."""

    median_s: float
    spread: float  # interquartile range of the kept samples / median (0 with fewer than 4)
    kept: int
    rejected: int
    times_s: tuple[float, ...]  # every sample, in the order taken

    def as_dict(self) -> dict:
        return {**asdict(self), "times_s": list(self.times_s)}

    @classmethod
    def from_dict(cls, record: Mapping) -> "Timing":
        return cls(record["median_s"], record["spread"], record["kept"], record["rejected"], tuple(record["times_s"]))


def summarise(times: list[float]) -> Timing:
    """Median and spread of the samples within `OUTLIER_MADS` scaled MADs of the median."""
    if not times:
        raise ValueError("times must hold at least one sample")
    median = statistics.median(times)
    mad = MAD_TO_SIGMA * statistics.median(abs(t - median) for t in times)
    kept = [t for t in times if abs(t - median) <= OUTLIER_MADS * mad] if mad > 0 else list(times)
    centre = statistics.median(kept)
    spread = 0.0
    if len(kept) >= 4:
        q1, _, q3 = statistics.quantiles(kept, n=4)
        spread = (q3 - q1) / centre if centre > 0 else 0.0
    return Timing(centre, spread, len(kept), len(times) - len(kept), tuple(times))


def interleaved(
    calls: Mapping[str, Callable[[], object]],
    repeats: int,
    warmup: int = 1,
    sync: Callable[[], None] | None = None,
    before: Mapping[str, Callable[[], object]] | None = None,
) -> dict[str, Timing]:
    """Time each call `repeats` times after `warmup` untimed rounds, one call per key per round.

    The order rotates every round, so no key always runs first (cold) or right after the same neighbour.
    `before[key]`, where given, runs untimed right before each call of `key` (e.g. to reset a KV cache).
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    sync = sync or (lambda: None)
    keys = list(calls)
    samples: dict[str, list[float]] = {k: [] for k in keys}
    for round_ in range(warmup + repeats):
        shift = round_ % len(keys) if keys else 0
        for key in keys[shift:] + keys[:shift]:
            if before and key in before:
                before[key]()
            sync()
            start = time.perf_counter()
            calls[key]()
            sync()
            if round_ >= warmup:
                samples[key].append(time.perf_counter() - start)
    return {k: summarise(v) for k, v in samples.items()}
