"""Bandwidth monitor: every collective the hook times, small ones included, is a sample of the
link; a robust fit of time = alpha + wire bytes / beta over the last few steps says what the
next collective will cost.

Small collectives (headers, heavily compressed payloads) pin the latency alpha, larger ones the
slope 1/beta, so the estimate stays live whatever the plan sends (a minimum payload size froze it
for 70 steps when every payload was tiny). The fit is Theil-Sen: the median of the slopes between
pairs of samples, weighted by how far apart their sizes are, so a stray slow collective moves
nothing and a per-transfer constant (latency, a token bucket's burst) drops out of the slope. Where
the bytes cost no measurable time (more than a quarter of the pairs' weight on a larger message
that was no slower: small messages on a fast link), the rate is unmeasured above the volumes sent:
infinite, so the plan climbs a rung at a time to larger messages that measure it (the planner's
GROWTH). A step whose times are more than `change` times off the fit is held back; if the next step is off the
same way, the link changed and the window restarts from those two steps (one stalled step alone
moves nothing).

A sample is a collective's service time: from its launch, or from the completion of the one
before it if that came later (a payload queued behind the previous bucket's is not charged for
that wait). Ranks fit the same samples (`agree`): each collective's service time is the least any
rank measured, since the last rank to arrive waits for no one. A rank's own times carry the skew
between ranks: on loopback, a header's wait for the other rank's backward dwarfs any message's bytes,
and low rank's 1-4 KB messages read 56 Mbit/s.

`overhead_s` is what a step's collectives cost beyond the fit, which no plan can compress away: the
0.9-quantile over recent steps of the step's agreed service times summed (its link time) less the
fit's prediction of the same collectives. A wait for a slower rank's backward is left out: no codec
shortens it, and on the 2-core lab it is most of what a rank reports on some steps (0.54-1.13 s on 8 of
37 steps against 0.13-0.28 s on the rest, at no more wall time: bench/results/kimad_lab_runs.md), so
planning on it ran the most compressed safe plan for nothing.

A rise is followed once it outlasts the window: the bandwidth to plan with is the lowest of the
last window_steps agreed estimates, and a fall counts at once. With `rise_volume` (auto's), a rise
also needs volume: it counts only where the window's largest collective was at least that share of the
largest one measured: the rate last measured at such volume is a ceiling on the one planned with (a
fall read from small messages counts while it lasts, unless it is only a bound: `update`), and before any rate is measured its estimate is the
fastest rate a collective in the window achieved (`floor`), a lower bound: an unmeasured first rate read
infinite under HSDP on the lab at 50 Mbit/s, and auto's first plan sent fp32 for 8 steps at 1.55 s against
gqsgd 8-bit's 0.7 s. A token bucket passes each step's small messages from its burst while
the burst refills between steps, so they read a rate the link cannot sustain for larger ones: on the lab at
10 Mbit/s, low rank's 82 kB steps read 152 Mbit/s and then "unmeasured", and every 11 steps a plan of
2.3 MB took 2.8 s against 0.14 s. A shaper's burst can make steps look
far faster than the link (1,449 Mbit/s estimated at 300 Mbit/s on the lab), and a fit off the link
lasts while its samples stay in the window (3+ steps at 5-20 Gbit/s at 300 Mbit/s): planning fp32
on that overran the budget.
"""

from __future__ import annotations

import collections
import math
import time

import torch

# bytes a rank puts on the wire per payload byte, by aggregation pattern (ring algorithms)
WIRE_FACTOR = {"allreduce": lambda n: 2 * (n - 1) / n, "ring": lambda n: 2 * (n - 1) / n,
               "allgather": lambda n: n - 1}
OVERHEAD_QUANTILE = 0.9
UNMEASURED_SHARE = 0.25  # a slope counts when at most this share of the pairs' weight has the larger message no slower
# a rate is left unmeasured only on the word of this many pairs: one pair (a step's header and its payload) read
# "no slower" from rank skew on the lab at 1 Gbit/s, and auto then sent fp32 for 75 steps at 0.18 s against 0.14 s
UNMEASURED_PAIRS = 3


class BandwidthMonitor:
    """Alpha-beta fit of the hook's collectives over a window of recent steps, agreed across ranks.

    window_steps: steps of samples the fit uses; change: a step this many times slower or faster
    than the fit restarts the window (the link changed); spread: two samples give a slope only if
    their sizes differ by this factor; overhead_steps: steps the overhead quantile looks back;
    rise_steps: steps a higher estimate must hold before it is planned with (a fall counts at once): a fit
    off the link lasts while its samples stay in the window (on the lab at 300 Mbit/s, 3+ steps read
    5-20 Gbit/s and the plan sent fp32, 0.23-0.49 s against a 0.2 s budget), so a rise must outlast one
    window; skip_steps: first steps whose collectives are not samples (a process's first step waits for ranks
    that start late and for first calls that compile: 0.6 s beyond the fit on `netgain train --task
    digits`, which the first plan took for per-step overhead); with rise_volume they still bound the rate from
    below (`_bound`), so auto plans after the first step; rise_volume: a rise counts only where
    measured on collectives at least this share of the largest behind the estimate (None: at any volume,
    so that a plan of small messages can climb to a faster link); clock: when a collective completed (seconds).
    """

    def __init__(self, window_steps: int = 8, change: float = 1.5, spread: float = 1.5,
                 overhead_steps: int = 20, max_samples: int = 256, skip_steps: int = 0, rise_steps: int | None = None,
                 rise_volume: float | None = None, clock=time.perf_counter):
        if window_steps < 1:
            raise ValueError(f"window_steps must be >= 1, got {window_steps}")
        if rise_steps is not None and rise_steps < 1:
            raise ValueError(f"rise_steps must be >= 1, got {rise_steps}")
        if skip_steps < 0:
            raise ValueError(f"skip_steps must be >= 0, got {skip_steps}")
        if change <= 1:
            raise ValueError(f"change must be > 1, got {change}")
        if rise_volume is not None and not 0 < rise_volume <= 1:
            raise ValueError(f"rise_volume must be in (0, 1] or None, got {rise_volume}")
        self.window_steps, self.change, self.spread = window_steps, change, spread
        self.overhead_steps, self.max_samples, self.clock = overhead_steps, max_samples, clock
        self._skip = skip_steps
        self.agreed: collections.deque = collections.deque(maxlen=rise_steps or window_steps)  # the last steps' agreed estimates
        self.rise_volume = rise_volume
        self.volume = 0.0                    # wire bytes of the largest collective measured (rise_volume)
        self.sustained: float | None = None  # the rate last measured at comparable volume (rise_volume): a ceiling
        self.floor: float | None = None      # the fastest rate a sample in the window achieved: a lower bound
        self.latency: float = 0.0            # agreed seconds per collective
        self.overhead_s: float = 0.0         # agreed seconds per step beyond the fit
        self._step: list[tuple[float, float]] = []         # (wire bytes, service s) this step
        self._window: list[list[tuple[float, float]]] = []  # (wire bytes, service s) of recent steps
        self._extra: list[float] = []
        self._local_fit: tuple[float, float, bool] | None = None  # (alpha, 1 / beta, bound) of the samples fitted
        self._held: tuple[int, list] | None = None          # (direction, samples) of a step off the fit
        self._busy_until = 0.0

    def observe(self, collective: str, payload_bytes: int, seconds: float, world_size: int) -> None:
        """One timed collective (called at its completion, as Communicator's observer)."""
        done = self.clock()
        service = min(seconds, done - self._busy_until)
        self._busy_until = max(self._busy_until, done)
        self._step.append((WIRE_FACTOR[collective](world_size) * payload_bytes, max(service, 0.0)))

    def take_step(self) -> list[tuple[float, float]]:
        """The step's samples (wire bytes, service s); starts the next step (one swap: a collective
        completing on another thread lands in one step or the next)."""
        step, self._step = self._step, []
        return step

    @staticmethod
    def agree(link, step: list[tuple[float, float]]) -> list[tuple[float, float]]:
        """Every rank's samples of the same collectives as one: each one's service time is the least any
        rank measured. The last rank to arrive waits for no one, so rank skew (a slower backward reaching
        a bucket later) is not taken for link time. Samples are matched by size, not by order: in-flight
        collectives complete in a different order on different ranks. Call it on every rank with the same
        number of samples (the planner checks)."""
        if not step:
            return step
        # sizes too (MAX): every rank then fits identical samples, so every rank makes the same plan
        rows = [[wire, -service] for wire, service in sorted(step)]
        agreed = link.allreduce(torch.tensor(rows, dtype=torch.float64), torch.distributed.ReduceOp.MAX).tolist()
        return [(wire, -service) for wire, service in agreed]

    def add_step(self, step: list[tuple[float, float]]) -> tuple[float, float, float, float, bool]:
        """(bandwidth, latency, overhead_s, volume, bound) after one step's samples: volume is the wire bytes of the
        fitted window's largest collective; bandwidth is 0 before any sample; bound: the window's sizes measure no
        slope, and the bandwidth is the fastest rate a sample achieved (`fit`)."""
        if step and self._skip:
            if self.rise_volume is not None:  # auto's: the skipped step still bounds the rate from below
                self._bound(step)
            self._skip, step = self._skip - 1, []
        if step:
            # against an unmeasured rate (slope 0) larger messages taking longer is its first measurement, not a change
            moved = 0 if self._local_fit is None or not self._local_fit[1] else self._moved(step, *self._local_fit[:2])
            if moved and self._held is not None and self._held[0] == moved:
                self._window, self._held = [self._held[1]], None  # two steps agree: the link changed
            elif moved:
                self._held, step = (moved, step), []                # one odd step: wait for a second opinion
            else:
                self._held = None
        if step:
            self._window = (self._window + [step])[-self.window_steps:]
            self._local_fit = fit([s for samples in self._window for s in samples][-self.max_samples:], self.spread)
            predicted = sum(self._local_fit[0] + x * self._local_fit[1] for x, _ in step)
            self._extra = (self._extra + [link_time(step) - predicted])[-self.overhead_steps:]
            if self.rise_volume is not None:  # only auto's monitor plans with it
                self.floor = max((x / s for samples in self._window for x, s in samples if s > 0), default=None)
        if self._local_fit is None:
            return 0.0, 0.0, 0.0, 0.0, False
        alpha, slope, bound = self._local_fit
        extra = sorted(self._extra) or [0.0]
        volume = max(x for samples in self._window for x, _ in samples)
        return rate(slope), alpha, max(0.0, extra[int(OVERHEAD_QUANTILE * (len(extra) - 1))]), volume, bound

    def _bound(self, step: list[tuple[float, float]]) -> None:
        """A skipped step's collectives as a lower bound on the link: a start-up stall only slows a collective, so
        the fastest rate one achieved is at most the link's. It is the rate planned with, and the ceiling, until a
        rate is measured at comparable volume: auto plans after a process's first step instead of its second (at
        10 Mbit/s on the lab's second job, each unplanned step of gqsgd 8-bit took 11-14 s against 0.3-0.6 s planned)."""
        measured = [(x, s) for x, s in step if s > 0]
        if measured:
            self.sustained, self.volume = max(x / s for x, s in measured), max(x for x, _ in measured)

    def update(self, bandwidth: float, latency: float, overhead_s: float = 0.0, volume: float = math.inf,
               bound: bool = False) -> float | None:
        """Take the agreed estimate of one step (identical on every rank), measured on collectives of up to
        `volume` wire bytes; returns the bandwidth to plan with. With rise_volume, a ``bound`` (the fastest rate a
        sample achieved: the link carries at least that) read below volume and below the rate measured there is no
        reading of the link: on the lab at 1 Gbit/s, two steps of low rank's 150-173 kB messages, their times CPU
        jitter (3-10 ms), restarted the window (`change`) and bounded the rate at 48 MB/s against the 148 MB/s fp16
        measured, and auto planned with 48 MB/s for 39 steps and 93 MB/s for 40 more (an instrumented run). At
        volume a bound counts as any reading (a plain step's one payload size fits to a bound)."""
        at_volume = self.rise_volume is not None and volume >= self.rise_volume * self.volume
        if bandwidth > 0:
            if not (bound and not at_volume and self.sustained is not None and bandwidth < self.sustained):
                self.agreed.append(bandwidth)
            self.latency, self.overhead_s = latency, overhead_s
            # at volume, and measured: a fit left unmeasured by small messages' noise (low rank's, in the window
            # beside one large step) read infinite on the lab at 1 Gbit/s, and lifted the ceiling with it
            if at_volume and bandwidth < math.inf:
                self.sustained, self.volume = bandwidth, max(self.volume, volume)
        return self.bandwidth

    @property
    def bandwidth(self) -> float | None:
        """Bytes/s on the wire per rank to plan with: the lowest recent agreed estimate (None before any;
        infinite where bytes cost no measurable time), with rise_volume at most the rate last measured at
        the largest volume, and before any such rate (nothing measured: infinite) the floor."""
        recent = min(self.agreed, default=None)
        if recent == math.inf and self.sustained is None and self.rise_volume is not None and self.floor:
            return self.floor  # nothing measured yet: the link carried at least what its fastest collective did
        # either may be None: no fit yet (a skipped step's bound alone, `_bound`), or no rate measured at volume
        return min((rate for rate in (recent, self.sustained) if rate is not None), default=None)

    def predict_s(self, collective: str, payload_bytes: float, world_size: int) -> float:
        """Seconds one collective of `payload_bytes` takes on the agreed fit (overhead not included)."""
        if self.bandwidth is None:
            raise ValueError("predict_s needs a bandwidth estimate: no collective was observed yet")
        return self.latency + WIRE_FACTOR[collective](world_size) * payload_bytes / self.bandwidth

    def _moved(self, step, alpha: float, slope: float) -> int:
        """+1 if the step ran `change` x slower than the fit, -1 if that much faster, else 0."""
        predicted = sum(alpha + x * slope for x, _ in step)
        measured = sum(s for _, s in step)
        if predicted <= 0:
            return 0
        return 1 if measured > self.change * predicted else -1 if measured * self.change < predicted else 0


def link_time(step: list[tuple[float, float]]) -> float:
    """A step's link time: its (agreed) samples' service seconds, summed."""
    return sum(service for _, service in step)


def fit(samples: list[tuple[float, ...]], spread: float = 1.5) -> tuple[float, float, bool]:
    """(alpha, 1 / beta, bound) of time = alpha + bytes / beta, robustly, from (bytes, seconds, ...) samples.

    The slope is the median of pairwise slopes weighted by the pair's size difference, over pairs
    whose sizes differ by `spread` x. It counts only where the bytes cost measurable time: when more
    than a quarter of that weight lies on pairs whose larger message was no slower (the times' noise
    dwarfs the bytes, as small messages on a fast link), 1 / beta is 0, the link's rate unmeasured
    above the volumes sent. On loopback, low rank's 1-4 KB messages otherwise read a slope out of rank
    skew: 56 Mbit/s, and the plan stayed on the small messages that measured it (on the word of at least
    UNMEASURED_PAIRS pairs). Where only one size was sampled, or fewer pairs say unmeasured, 1 / beta falls back to the
    fastest rate any sample achieved, a lower bound on the link's bandwidth (``bound``: True), and alpha to the median
    time less that rate's share.
    """
    x = torch.tensor([s[0] for s in samples], dtype=torch.float64)
    t = torch.tensor([s[1] for s in samples], dtype=torch.float64)
    i, j = torch.triu_indices(len(samples), len(samples), offset=1)
    dx, dt = x[j] - x[i], t[j] - t[i]
    apart = torch.maximum(x[i], x[j]) >= spread * torch.minimum(x[i], x[j]).clamp(min=1.0)
    slopes, weights = dt[apart] / dx[apart], dx[apart].abs()
    measured = float(weights[slopes <= 0].sum()) <= UNMEASURED_SHARE * float(weights.sum())
    bound = not (bool(apart.any()) and (measured or len(slopes) >= UNMEASURED_PAIRS))
    if not bound:
        slope = _weighted_median(slopes, weights) if measured else 0.0
    else:
        rates = x / t.clamp(min=1e-9)
        slope = 1.0 / float(rates.max()) if float(rates.max()) > 0 else 1e-12
    alpha = float((t - slope * x).median().clamp(min=0.0))
    return alpha, slope, bound


def rate(slope: float) -> float:
    """Bytes/s of a fitted slope (seconds per byte): infinite where the bytes cost no measurable time."""
    return 1.0 / slope if slope > 0 else math.inf


def in_words(bandwidth: float, unit: str = "Mbit/s") -> str:
    """A bandwidth (bytes/s) in words, in Mbit/s or MB/s; an infinite one is a rate the bytes did not measure."""
    if bandwidth == math.inf:
        return "bytes cost no measurable time"
    return f"{bandwidth * 8e-6:.0f} Mbit/s" if unit == "Mbit/s" else f"{bandwidth / 1e6:,.1f} MB/s"


def _weighted_median(values: torch.Tensor, weights: torch.Tensor) -> float:
    order = values.argsort()
    cumulative = weights[order].cumsum(0)
    return float(values[order][int(torch.searchsorted(cumulative, cumulative[-1] / 2))])
