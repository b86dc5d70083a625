"""Kimad: bandwidth-aware adaptive compression (../shared/papers/kimad.md).

Each step the ranks agree on the link (BandwidthMonitor: an alpha-beta fit of every collective
the hook ran, and the seconds per step its link time carries beyond the fit); the communication
budget is a time target on the step's link time plus codec time (given, or the measured backward
time so communication hides under compute). Link time is each collective's least time across ranks,
as bandwidth.py explains: a wait for a slower rank's backward is no communication a codec can shorten.
Every `replan_every` steps, or when the link estimate moves by a factor beyond 1 + `replan_threshold`
(either way), the plan is re-solved:
  kimad  - one option for every bucket;
  kimad+ - a multi-choice knapsack (netgain.plan) choosing one option per bucket;
  auto   - no budget: the plan with the least predicted time to the target loss, then, among plans
           predicted within AUTO_SLACK of its communication time, the least error (see below).
Options: uncompressed, gqsgd (packed) at each bit width, and either top-k (EF21) at each ratio or
low rank at one rank with 8-bit Global-QSGD factors (`lowrank_rank`: a bucket keeps one
error-feedback memory, EF21's or low rank's residual, which the unbiased options flush). An option's
time is its header and payload collectives on the monitor's fit (low rank's from the bucket's
shapes) plus this machine's calibrated codec cost; the plan fits them into the budget less the monitor's overhead, divided by the margin
by which recent steps overran their prediction (an order statistic that a new step exceeds with
chance at most 5%, so the spread fits, not only the median; stalls left out). Its error is measured on the current
gradient (expected stochastic-rounding error for gqsgd, the dropped energy for top-k), summed over
ranks.

No collapse: an option is admissible for a bucket only if the error it adds to the averaged
gradient is at most `max_error` of the gradient's energy (an unbiased code's independent rounding
averages down over n ranks, a biased one's does not). Low rank is admitted by a rule of its own:
its error feedback resends what a step drops (PowerSGD's convergence), where top-k's EF21 at small
ratios collapsed; its error counts as the bucket's whole energy, an upper bound, so the plan takes it
only where nothing that errs less fits. Among admissible options the plan prefers
the unbiased, allreduce-compatible ones (none, gqsgd) whenever they fit the budget, then any
admissible one that fits, the least total error first; when nothing admissible fits, each bucket
takes its fastest admissible option: the safe plan closest to fitting, never the most aggressive,
and rank 0 warns (RuntimeWarning) when the plan stops fitting; `plan_fits` in each step's statistics.
A re-plan moves each bucket at most GROWTH (2x) its bytes, or to the next larger safe option (kimad:
the plan's total bytes), and re-plans at the next step until it reaches what the estimate asks for: the link is measured only up to the
volumes sent, and a shaper's burst passes small steps at wire speed. Every input to the solver is agreed by collectives, so every rank computes the same plan; the
hook's header checks it bucket by bucket.

auto is the route a user gets without choosing: time to the target loss is step time x steps. The
step is its other time, measured (each step's wall time from the previous step's end, less its link and
codec time: the median over recent steps of the slowest rank's) plus each bucket's predicted link
and codec time; the steps are fp32's for the exact, rounded and unbiased options (bf16 took 0.97-0.99x
fp32's steps on the lab, gqsgd is held within max_error), and low rank's measured multiple of them
(LOWRANK_STEPS: its error feedback gets there, later). It counts every collective and all codec time
as exposed: on the lab a budget of the backward time "fitted"
fp32 at 1 Gbit/s while two compressing routes ran 1.3-1.45x faster, since the step is not
overlapped there. Options: none, bf16, fp16 (where max |g| stays below FP16_PEAK), gqsgd at `bits`, and low rank at `lowrank_rank` with fp32
factors and with 8-bit Global-QSGD factors (one rank, so the buckets keep one error-feedback memory).
Until a bucket layout has a plan (a process's first step, and its second where that is cheap: WARMUP_WORTH;
DDP's rebuild) it sends its widest gqsgd (8 bits), not fp32: the warm-up low rank needs, with no uncompressed
step on a slow link, and low rank's random warm start starts from a plan made on gradients kept unbiased.
The first step's collectives bound the link's rate from below (a start-up stall only slows them), and a
second whole step's measure it; on a bound alone auto takes low rank only where priced
TRIAL_RANGE below every plan that measures the link at volume (`_measuring`). auto's monitor
believes a higher rate only from collectives of comparable volume (RISE_VOLUME): it prices every option
at that rate and does not climb, since a shaper's burst passes small messages at a rate the link cannot
sustain for large ones; before any rate is measured it plans with the fastest rate a collective achieved (a
lower bound, BandwidthMonitor.floor), and it scales the plans not yet measured by how far the running plan's
steps overran the model (`overrun`). It re-plans when its errors are measured (replan_every), when the link's rate
moves by more than replan_threshold, and when a plan it tries has its measured price. Measured prices stand until
the rate moves beyond REPRICE and the running plan's own steps move with it (WITNESS).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import math
import statistics
import time
import warnings
import zlib

import torch

from .. import plan as knapsack
from ..cost import network
from . import kernel
from .bandwidth import WIRE_FACTOR, BandwidthMonitor, in_words, link_time
from .calibrate import cached_profiles, codec_profile
from .codecs import Cast, Codec, GlobalQSGD, NoCompression, PlanMismatchError, TopK, check_integer, warm
from .lowrank import LowRank
from .quantize import levels_per_side

MODES = ("kimad", "kimad+", "auto")
AUTO_SLACK = 0.05  # auto: the least-error plan among those predicted at most 5% slower than the fastest
# auto: low rank's steps to the target as a multiple of fp32's, measured on the lab's lm job with
# bench/time_to_accuracy.py: rank 4 took 1.10x (fp32 factors) and 1.14x (8-bit) at 1 Gbit/s, 3 workers, 3 seeds
# (bench/results/time_to_accuracy_auto_1gbit_3w.md; PowerSGD r4 1.16x, fp16 0.98x), and 1.09-1.27x and
# 1.21-1.52x on the earlier cells netgain.cost.advise cites
LOWRANK_STEPS = {"fp32": 1.15, "gqsgd": 1.25}
# auto tries each plan the model prices within TRIAL_RANGE x the best price (measured or predicted) for TRIAL_STEPS
# steps, the first TRIAL_SKIP left out (a codec's first calls, a flushed memory); the median step then prices it
TRIAL_RANGE = 1.5
TRIAL_STEPS = 8
# auto's first step goes unplanned (whole gradients in gqsgd 8-bit), and so does its second where that step's link and
# codec time stays under WARMUP_WORTH backward passes: the warm-up low rank needs, as a fixed low rank's two fp32 steps,
# where a whole step is cheap. On the lab's default job at 100 Mbit/s, 2 workers, 4 seeds (f846781), auto with one
# whole step ran low rank from step 1 and took 119.9-172.5 steps to fp32's target, as low rank without warm-up did
# (133.0-182.8), where low rank after two fp32 steps took 119.8-132.4; with two whole steps (72ab3ce) 124.6-131.1, and
# 1.08x (0.99-1.27) sooner per round. At 10 Mbit/s, 3 workers, 3 seeds, where a whole step took 2.6-3.1 s against
# 0.12-0.15 for a low-rank one, the second saved 4.3, 23.5 and -1.1 steps and cost 1.09-1.14x the time to the target
WARMUP_WORTH = 10
TRIAL_SKIP = 2
AGREE_EVERY = 10  # auto, settled: agree once per 10 steps (2 small collectives a step: see docs/adaptive.md)
WARM_GAIN = 0.1  # auto: a plan that would compile kernels is warmed and tried only if priced 10% below the best that would not
# ... and only once what it would save by the run's end pays for the stall its compiles cost the steps, the run taken to
# last as long again as it has so far (ski rental: a warm-up never costs more than twice what the better choice in
# hindsight would have). The stall: on the lab at 1 Gbit/s, 3 workers on 2 cores, a gqsgd warm-up after step 49 (the
# process's first compiles, 5.0-6.1 s per rank at nice 19) slowed steps 50-59 to 0.17-0.67 s against 0.12, 2.2 s in all
# (a probe), and one in the f6b29a0 grid's round 0 slowed steps 40-58 by 4.2 s; auto then kept fp16 in both
WARM_STALL_S = 4.0
# auto waits at most this many seconds of steps for a warm-up's compiles; then it forgoes those options for the run. A CPU
# compile runs at nice 19 on what the steps leave idle (kernel.py): on the lab at 1 Gbit/s, 3 workers on 2 cores, one had
# not finished after 60 steps (30 s) that a lone process finished in 5 s (one timing each, at a load of 2-3), and
# meanwhile the plan could not settle
AWAIT_S = 20.0
# auto: prices within 5% are a tie, which goes to the plan taking fewer steps to the target (fp32's steps are
# certain, low rank's LOWRANK_STEPS an estimate): on the lab at 1 Gbit/s a running bf16 plan's measured price moved
# 0.138-0.157 s over 40 steps, and in 2 of 3 rounds auto kept low rank and took 129-132 steps to the fp16 hook's 117-118
TIE = 0.05
REPRICE = 2.0  # auto's measured prices stand until the link's rate moves beyond 2x (a link change, not an estimate's noise)
# ... and the running plan's own steps move with it by over 10% (WITNESS), measured over TRIAL_STEPS - TRIAL_SKIP steps: the
# fitted rate is a model, the steps are what the link did. Under HSDP at 50 Mbit/s on the lab the fitted rate rose 3.6x
# right after a low-rank trial with no change of link, the dropped prices priced fp16 at 0.254 s a step against its
# measured 0.598, and auto tried it again, into steps 37-49 of 120
WITNESS = 0.1
RISE_VOLUME = 0.5  # auto's monitor: a higher rate counts only if measured on collectives at least half the largest behind it
OVERRUN_WINDOW = 20  # steps of measured / predicted communication behind the plan's margin
OVERRUN_EXCEEDANCE = 0.05  # the chance, at most, that a step overruns the margin (where the window allows)
STALL = 2.0  # a step over STALL x the median ratio is a stall or a link change, not spread (on the lab, steady-state ratios lay at 0.5-1.9)
ERROR_SAMPLES = 1 << 16  # elements per bucket on which the options' errors are measured
# The default bound on an option's error of the averaged gradient, as a fraction of its energy. At 0.05
# (measured as the codecs round) kimad+ planned gqsgd 4-5 bits on netgain train --task digits and one
# seed of 10 ended 6.3% above fp32's validation loss; at 0.01 the plans keep a margin to that.
MAX_ERROR = 0.01
# fp16 is admissible for a bucket only while its measured max |g| stays below this: 65504 / 1024, so its gradients
# may grow 1000x between two measurements before the cast overflows (an overflow raises NonFiniteGradientError).
# Where it is, fp16 keeps 3 more mantissa bits than bf16, and x86 CPUs cast it in hardware (F16C): on the lab at
# 1 Gbit/s, 3 workers, a fixed fp16 step took 0.131 s against bf16's 0.137 s (PyTorch's fp16 hook 0.128 s; 3 rounds
# interleaved, begun at a load average of 2: an indication)
FP16_PEAK = 64.0
TOPK_RATIOS = (0.001, 0.01, 0.1)
LOWRANK_FACTOR_BITS = 8
GROWTH = 2.0  # a re-plan may at most double a bucket's bytes (or take the next larger option): see _reachable
LOWRANK_CALIBRATION_SHAPES = [(256, 256)] * 4  # low rank's cost is per matrix shape: calibrate on matrices


class AdaptivePlanner:
    """Picks each bucket's codec per step: a codecs.Planner."""

    def __init__(self, mode: str = "kimad+", *, time_budget_s: float | None = None, replan_every: int = 10,
                 replan_threshold: float = 0.2, bits: tuple[int, ...] = (2, 3, 4, 5, 6, 7, 8),
                 topk_ratios: tuple[float, ...] | None = None, lowrank_rank: int | None = None,
                 max_error: float = MAX_ERROR, monitor: BandwidthMonitor | None = None):
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not one of {MODES}")
        if time_budget_s is not None and time_budget_s <= 0:
            raise ValueError(f"time_budget_s must be > 0 (or None for the measured backward time), got {time_budget_s}")
        check_integer("replan_every", replan_every, 1)
        if not 0 < max_error < float("inf"):
            raise ValueError(f"max_error must be > 0 and finite, got {max_error}")
        if lowrank_rank is not None and topk_ratios:
            raise ValueError(f"topk_ratios={topk_ratios} with lowrank_rank={lowrank_rank}: a bucket keeps one error-feedback "
                             "memory (top-k's EF21 or low rank's residual); pass topk_ratios=() to plan with low rank")
        auto = mode == "auto"
        if auto and time_budget_s is not None:
            raise ValueError(f"mode='auto' minimises the step's time and takes no time budget, got time_budget_s={time_budget_s}")
        if topk_ratios is None:
            topk_ratios = () if lowrank_rank is not None or auto else TOPK_RATIOS
        factors = [("fp32", 8), ("gqsgd", LOWRANK_FACTOR_BITS)] if auto else [("gqsgd", LOWRANK_FACTOR_BITS)]
        lowrank = [LowRank(lowrank_rank, f, b) for f, b in factors] if lowrank_rank is not None else []
        self.mode, self.time_budget_s = mode, time_budget_s
        self.replan_every, self.replan_threshold, self.max_error = replan_every, replan_threshold, max_error
        cast = [Cast("bf16", torch.bfloat16), Cast("fp16", torch.float16)] if auto else []
        self.options: list[Codec] = ([NoCompression()] + cast + [GlobalQSGD(b) for b in sorted(bits, reverse=True)]
                                     + [TopK(r) for r in sorted(topk_ratios, reverse=True)] + lowrank)
        # what a bucket layout without a plan sends (its first steps, DDP's rebuild): fp32, or auto's widest gqsgd,
        # unbiased in a quarter of fp32's bytes (on the lab at 10 Mbit/s its first 2 steps in bf16 took 8 s of 27)
        # an instance of its own, whose kernels begin no compile (bucket.send, kernel.cold): it runs a step or two
        widest = [option for option in self.options if isinstance(option, GlobalQSGD)][:1]
        self.unplanned = copy.copy((widest + cast if auto else self.options)[0])
        self.memory_codec = next((option for option in self.options if option.uses_feedback), None)  # EF21 or low rank's
        self.monitor = monitor or BandwidthMonitor(skip_steps=1, rise_volume=RISE_VOLUME if auto else None)
        self.plan: dict[int, tuple[int, Codec]] = {}     # bucket index -> (numel, codec)
        self.errors: dict[int, list[float]] = {}          # bucket index -> agreed error of the mean per option
        self.relative: dict[int, list[float]] = {}        # bucket index -> those errors / the gradient's energy
        self._local_errors: dict[int, list[float]] = {}
        self._numels: dict[int, int] = {}                 # bucket index -> numel, this step's layout
        self._shapes: dict[int, list] = {}                # bucket index -> its parameters' shapes (low rank's bytes)
        self._profiles: dict[int, list[network.CodecProfile]] = {}
        self._predicted: float | None = None
        self._backward_s: float | None = None
        self._compute: collections.deque = collections.deque(maxlen=OVERRUN_WINDOW)  # agreed step seconds less communication
        self._last_end: float | None = None               # when the previous step ended (this rank's clock)
        self._periods: dict[tuple, float] = {}            # auto: plan key -> its measured step seconds (agreed median)
        self._running: collections.deque = collections.deque(maxlen=OVERRUN_WINDOW)  # auto: agreed step seconds of the plan running now
        self._plan_key: tuple = ()                        # auto: the plan running now (_key)
        self._plan_steps = 0                              # auto: steps the plan running now has run
        self._beside_compiles: list[float] = []           # auto: its agreed step seconds that ran beside a compile
        self._provisional: set[tuple] = set()             # auto: plans priced by steps beside a compile only
        self._short: set[tuple] = set()                   # auto: plans whose trial ended before it cleared
        self._guess = False                               # auto: the trial running was chosen on the first step's bound
        self.trying = False                               # auto: the plan running now is tried for its price
        self._best_price: float | None = None             # auto: the best candidate's price when the plan was chosen
        self._cheapest: list[float] | None = None         # auto: [the cheapest's price, a cold one's too; the link's volume then]
        self._priced_rate: float | None = None            # auto: the link's rate when the measured prices began
        self._witness: list | None = None                 # auto: [the running plan's price, its steps since the rate moved, rose]
        self.warm: set[tuple[int, int]] = set()           # auto: (bucket, option) to run once, its output dropped (prepare)
        self._warmed: set[tuple[int, int]] = set()        # auto: (bucket, option) that ran: its kernels compiled or compiling
        self._awaiting = False                            # auto: a trial waits for the kernels its warm-up began compiling
        self._awaited = 0.0                               # auto: agreed step seconds waited so far
        self._warming: set[tuple[int, int]] = set()       # auto: (bucket, option) whose warm-up is waited for
        self._forgone: set[tuple[int, int]] = set()       # auto: (bucket, option) whose compiles outlasted AWAIT_S
        self._steps_run = 0                               # auto: steps ended so far (the run's length as yet: WARM_STALL_S)
        self._whole_steps = 1                             # auto: steps sent unplanned from the first (WARMUP_WORTH)
        self._pending: list[list[float]] = []             # this rank's (backward, codec, step, other) seconds not yet agreed
        self._pending_samples: list[tuple[float, float]] = []  # and its collectives' samples
        self._planned_link: tuple[float, float] | None = None  # (bandwidth, overhead_s) the plan was made for
        self._overruns: collections.deque = collections.deque(maxlen=OVERRUN_WINDOW)  # measured / predicted per step
        self._plan_overrun_steps = 0                      # auto: how many of them the plan running now measured
        self._stale = True
        self.fits = True  # the plan is predicted within budget / margin (False: nothing admissible fits)
        self.climbing = False  # the plan is held below what the estimate asks for (GROWTH): re-plan each step
        self.last: dict = {}

    # ---- per bucket, on the communication thread -------------------------------------------------
    def codec_for(self, index: int, numel: int) -> Codec:
        self._numels[index] = numel
        planned = self.plan.get(index)
        if planned is None or planned[0] != numel:
            self._stale = True  # a new bucket layout (DDP rebuilds after step 1): measure and re-plan
            return self.unplanned
        return planned[1]

    def describe(self) -> str:
        return self.mode

    def attach(self, communicator) -> None:
        """Every collective of the hook becomes a sample of the link."""
        communicator.observer = self.monitor.observe

    def wants_errors(self, step: int) -> bool:
        return self._stale or (step + 1) % self.replan_every == 0

    def plain(self, step: int) -> bool:
        """auto, planned on codecs that need no header (none, bf16, fp16, low rank with fp32 factors), measuring
        no errors this step: the step runs as a fixed codec does, with no header. NaN/Inf reach every rank
        through the SUM (low rank's: its first round's), and the plan's signature joins the agreement instead
        (AGREE_EVERY, or every step while tried): on the lab at 1 Gbit/s the header and the hand-off to the
        pipeline's thread made auto's bf16 step 1.08x a fixed bf16 codec's, and under HSDP at 50 Mbit/s the
        header, a blocking round trip per group on the slow link, made auto's low-rank step 0.26-0.29 s against
        a fixed low rank's 0.22-0.25. A trial runs so too, so that it prices the plan as it would run: fp16
        tried with headers read 0.138-0.17 s a step against low rank's 0.108-0.135, which then ran 32 steps
        before fp16 took over. Where no codec of the plan `relays`, the step's collectives launch from the
        caller's thread."""
        return (self._standing(step) and not self._awaiting
                and not any(codec.needs_header for _, codec in self.plan.values()))

    def _standing(self, step: int) -> bool:
        """auto, with a plan that stands this step: planned on this layout, not climbing, measuring no errors (what
        `plain`, `settled` and `observes` share)."""
        return (self.mode == "auto" and bool(self.plan) and not (self._stale or self.climbing)
                and not self.wants_errors(step))

    @property
    def relays(self) -> bool:
        """A codec of the plan makes each round from the last one's mean (low rank): a plain step then runs on the
        pipeline's thread, all of it, as one bucket launched from the caller's thread and another from the
        pipeline's would issue a step's collectives in a different order on each rank (gloo aborted an HSDP run
        so, 2b56ca7)."""
        return any(codec.relays for _, codec in self.plan.values())

    def prepare(self, index: int, x: torch.Tensor, ctx) -> None:
        """auto: run the options awaiting their trial on this bucket once, on this rank's bucket, the output
        dropped, so their kernels compile in the background while the running plan serves; the trial then
        measures the compiled path, not eager calls and a compile (on the lab at 1 Gbit/s, gqsgd's first trial
        steps took 0.68 s against 0.145 s steady). Stateless options only: low rank's state is its memory."""
        for option in sorted(o for i, o in self.warm if i == index):
            warm(self.options[option], x, ctx)
            self._warmed.add((index, option))
        self.warm = {(i, o) for i, o in self.warm if i != index}

    def observe(self, index: int, x: torch.Tensor, ctx, codec: Codec) -> None:
        """Measure the bucket's energy and every option's compression error on this rank's bucket.

        gqsgd's error is that of the codec as it runs: each element against its parameter's global
        max |g| (``ctx.scales``, the header's; on the default job a bucket-wide max overstated 4-bit's
        error 3-9x and ruled unbiased options out). The errors come from an even sample of at most
        ERROR_SAMPLES elements, scaled up: the measuring step must not cost a pass per option over
        the bucket. A bucket that ran low rank has P's column scales in its header: gqsgd's errors are then
        measured against this rank's own max |g| per parameter."""
        scales = ctx.scales if codec.scale_params(ctx) is None else ctx.segments.absmax(x)
        self._shapes[index] = ctx.layout.shapes if ctx.layout is not None else None
        stride = -(-x.numel() // ERROR_SAMPLES) | 1  # odd: no lock-step with matrix rows
        sample, scale = x[::stride], scales[ctx.segments.seg[::stride].long()]
        factor = x.numel() / sample.numel()
        self._local_errors[index] = [float(x.square().sum())] + [option_error(option, sample, scale) * factor
                                                                 for option in self.options]

    # ---- at the end of a step, on the communication thread ---------------------------------------
    def end_step(self, link, step: int, backward_s: float, codec_s: float) -> dict:
        """After a step's last bucket: agree on the link, record how the plan did, re-plan if due.
        codec_s: this rank's encode + decode seconds in the step."""
        observer, link.observer = link.observer, None  # the planner's own small collectives are not samples
        try:
            return self._end_step(link, step, backward_s, codec_s)
        finally:
            link.observer = observer

    def _end_step(self, link, step: int, backward_s: float, codec_s: float) -> dict:
        # the step's other seconds (compute, the user's loop): from the previous step's end, less its communication
        now = time.perf_counter()
        last, self._last_end, self._steps_run = self._last_end, now, step + 1
        samples = self.monitor.take_step()
        period_s = -1.0 if last is None else now - last
        # a kernel compiling in the background: the codecs ran eagerly and the compile took cores, so the step
        # prices no plan and no compute (on the lab at 1 Gbit/s, bf16's trial during the first compiles read
        # 0.21-0.38 s a step and kept that price, against 0.14 s once they were done)
        # a step whose collectives went unobserved (FSDP's overlapped steps: `observes`) prices no compute and no link
        timed = float(bool(samples))
        self._pending.append([backward_s, codec_s, period_s, -1.0 if last is None or not timed else
                              max(0.0, period_s - link_time(samples) - codec_s), float(kernel.compiling()), timed])
        self._pending_samples += samples
        if self.settled(step):
            self.last = {**self.last, "replanned": False}
            return self.last
        pending, samples, self._pending, self._pending_samples = self._pending, self._pending_samples, [], []
        # MAX of each step's backward, codec, step and other seconds, compiling and timed flags; the sample counts'
        # and the plan signatures' MAX and MIN (-MAX of -x)
        signature = float(zlib.crc32(repr(self._plan_key).encode()) % (1 << 24))
        agreed_rows = link.allreduce(torch.tensor(pending + [[len(samples), -len(samples), signature, -signature, 0.0, 0.0]],
                                                  dtype=torch.float64), torch.distributed.ReduceOp.MAX).tolist()
        (most, fewest, high, low, *_), priced = agreed_rows.pop(), False
        if high != -low:
            raise PlanMismatchError(f"{self.mode}: ranks ran different plans before step {step + 1} (this rank: "
                                    f"{ {i: codec.describe() for i, (_, codec) in sorted(self.plan.items())} })")
        for backward_s, codec_s, period_s, other_s, compiling, _ in agreed_rows:
            if other_s >= 0 and not compiling:
                self._compute.append(other_s)
            priced |= self.mode == "auto" and not self._stale and period_s >= 0 and self._price_plan(period_s, compiling)
            self._backward_s = backward_s if self._backward_s is None else 0.7 * self._backward_s + 0.3 * backward_s
        codec_s = sum(row[1] for row in agreed_rows) / len(agreed_rows)
        warmed = self._awaiting and not agreed_rows[-1][4]  # the warm-ups' compiles are done on every rank: try now
        self._awaited = self._awaited + sum(max(0.0, row[2]) for row in agreed_rows) if self._awaiting else 0.0
        starved = self._awaiting and not warmed and self._awaited > AWAIT_S  # the compiles get no cores: go on without
        if starved:
            self._forgone |= self._warming
        self._awaiting &= not (warmed or starved)
        reopened = self._reopen(compiling=agreed_rows[-1][4])
        # every rank fits the same samples: the same estimate everywhere (ranks that saw different collectives skip the
        # step), and none from steps that ran beside a compile, whose cores and GIL it shared: on the lab at 1 Gbit/s a
        # first step beside one read a slow link, and auto ran low rank with 8-bit factors for 130 steps
        beside_compile = any(row[4] for row in agreed_rows)
        agreed = self.monitor.agree(link, samples) if most == -fewest and not beside_compile else []
        if self.mode == "auto" and step == 0 and agreed:  # a second whole step, where it is cheap (agreed: MAX rows)
            self._whole_steps = 1 + (link_time(agreed) + codec_s < WARMUP_WORTH * backward_s)  # step 0's, agreed
        bandwidth = self.monitor.update(*self.monitor.add_step(agreed))
        # the step's communication as the budget counts it: link time (each collective's least time across
        # ranks, no wait for a slower rank's backward) plus the slowest rank's codec time
        comm_s = link_time(agreed) / sum(row[5] for row in agreed_rows) + codec_s if agreed else None
        if self._predicted and not self._stale and comm_s is not None:
            self._overruns.append(comm_s / self._predicted)
            self._plan_overrun_steps += 1
        measured = self.wants_errors(step) and bool(self._local_errors)
        if measured:
            self._agree_errors(link)
        moved = self._link_moved()
        if moved:
            self._watch_rate()
        # auto: a trial runs until it is priced; a re-plan meanwhile (a rate read off the trial's own messages, errors
        # due) chose afresh and could cut it short: on the lab at 1 Gbit/s low rank's trial was cut twice after 2 steps,
        # unpriced, and ran again at step 49 (a probe). But for a first plan chosen on the first step's bound (`_guess`):
        # under HSDP at 50 Mbit/s, held to its end, such a trial of fp16 ran 8 steps at 0.66 s against low rank's 0.4
        # (93d9cfb's grid)
        trial = self.mode == "auto" and self.trying and not (self._stale or self._guess)
        replanned = bandwidth is not None and bool(self.errors) and step + 1 >= self._whole_steps and (
            priced or self.climbing or not trial and (measured or moved or warmed or starved or reopened))
        if replanned:
            fitted_before = self.fits
            self._agree_profiles(link)
            self._solve(link.world_size)
            if fitted_before and not self.fits and link.rank == 0:
                warnings.warn(self.unfit_message(), RuntimeWarning, stacklevel=2)
        self.last = self._statistics(replanned, comm_s)
        return self.last

    def _statistics(self, replanned: bool, comm_s: float | None) -> dict:
        """What a step's statistics hold of the planner (comm_s: the step's agreed link plus codec seconds)."""
        return {"bandwidth_Bps": self.monitor.bandwidth, "latency_s": self.monitor.latency,
                "overhead_s": self.monitor.overhead_s, "budget_s": self.budget_s(), "margin": self.margin(),
                "replanned": replanned, "plan": {i: codec.describe() for i, (_, codec) in sorted(self.plan.items())},
                # low rank counts as 1 here: its error is taken as the bucket's whole energy
                "plan_error": max((self.relative[i][self.options.index(codec)]
                                   for i, (_, codec) in self.plan.items() if i in self.relative), default=None),
                "predicted_comm_s": self._predicted, "link_comm_s": comm_s, "plan_fits": self.fits,
                "climbing": self.climbing, "trying": self.trying}

    def settled(self, step: int) -> bool:
        """auto, its plan settled (planned, nothing tried, no errors due): the ranks agree on the link and the
        steps' times once every AGREE_EVERY steps, from what each rank recorded since (a hook that overlaps
        unobserved steps holds those that `observes` names)."""
        return self._standing(step) and not (self.trying or self._awaiting) and (step + 1) % AGREE_EVERY != 0

    def observes(self, step: int) -> bool:
        """Whether the step's collectives are samples of the link. A hook that overlaps them with the backward
        (netgain.comm.fsdp) holds such a step's instead, each group's alone on the link, and overlaps the others,
        unobserved. auto observes a step on a new bucket layout, one before a rate is fitted (a first plan's trial
        measures the link: overlapped, fp16's ran 0.65 s a step under HSDP at 50 Mbit/s, and unobserved, priced
        out, against 0.43 held), one that measures errors or climbs, and a settled plan's agreement (one step in
        AGREE_EVERY); a trial and a plan awaiting its candidates' compiles run as a settled plan does, so that a
        trial prices a plan as it will run (under HSDP at 50 Mbit/s, held on trial, low rank's steps took
        0.25-0.27 s against 0.21-0.23 settled, and gqsgd 8-bit, 0.28-0.31 either way, won the tie and ran for
        good), and a step beside a compile is no sample anyway. kimad and kimad+ observe every step."""
        unsampled = self.trying or self._awaiting or (step + 1) % AGREE_EVERY != 0
        return not (self._standing(step) and bool(self.monitor.agreed) and unsampled)

    def unfit_message(self) -> str:
        """Why the budget will be missed: no plan within max_error fits the budget at the measured link, or
        the steps' collectives already take longer than the budget beyond what their bytes cost."""
        budget = f"{self.budget_s() * 1e3:.3g} ms budget" + ("" if self.time_budget_s is not None else " (the measured backward time)")
        running = f"running the fastest safe plan, predicted at {self._predicted * 1e3:.3g} ms a step"
        if self.monitor.overhead_s >= self.budget_s() / self.margin():
            return (f"{self.mode}: the steps' collectives take {self.monitor.overhead_s * 1e3:.3g} ms a step beyond what "
                    f"their bytes cost (per-call overhead, gloo's threads sharing cores with the backward), more than the {budget} "
                    f"(with the margin for the steps' spread, x{self.margin():.2f}): no compression can fit it; "
                    f"{running}: raise budget_ms, or send fewer, larger buckets (DDP's bucket_cap_mb)")
        advice = "raise budget_ms or max_error" + (", or use kimad+ (an option per bucket)" if self.mode == "kimad" else "")
        return (f"{self.mode}: no plan within max_error={self.max_error:g} fits the {budget} at the measured "
                f"link ({in_words(self.monitor.bandwidth)}, with the margin for the steps' spread, x{self.margin():.2f}); "
                f"{running}: {advice}")

    def _agree_errors(self, link) -> None:
        """Sum energies and errors over ranks; keep each option's error of the averaged gradient."""
        n, order = link.world_size, sorted(self._local_errors)
        summed = link.allreduce(torch.tensor([e for i in order for e in self._local_errors[i]], dtype=torch.float64))
        width = len(self.options) + 1
        for k, index in enumerate(order):
            energy, *errors = summed[k * width:(k + 1) * width].tolist()
            # mean of n independent roundings: error sum / n^2; a biased code's errors add up: sum / n
            mean_error = [e / (n * n if option.unbiased else n) for option, e in zip(self.options, errors)]
            self.errors[index] = mean_error
            self.relative[index] = [e / (energy / n) if energy > 0 else 0.0 for e in mean_error]
        self._local_errors = {}

    def _link_moved(self) -> bool:
        if self._planned_link is None:
            return False
        bandwidth, overhead_s = self._planned_link  # either may be infinite: bytes cost no measurable time
        within = bandwidth / (1 + self.replan_threshold) <= self.monitor.bandwidth <= bandwidth * (1 + self.replan_threshold)
        if self.mode == "auto":  # auto has no budget: per-step overhead is in its measured step times
            return not within
        return not within or abs(self.monitor.overhead_s - overhead_s) > self.replan_threshold * self.budget_s()

    def state_dict(self) -> dict:
        """What every rank agreed on (identical everywhere), as plain lists and numbers: the link estimate, the
        compute time, the recent overruns behind the margin, and the plan running, so a resume continues it."""
        return {"bandwidth": self.monitor.bandwidth, "agreed": list(self.monitor.agreed),
                "sustained": self.monitor.sustained, "volume": self.monitor.volume, "floor": self.monitor.floor,
                "latency": self.monitor.latency, "overhead_s": self.monitor.overhead_s,
                "backward_s": self._backward_s, "compute": list(self._compute), "overruns": list(self._overruns),
                "periods": [[list(map(list, key)), seconds] for key, seconds in self._periods.items()],
                "priced_rate": self._priced_rate, "witness": copy.deepcopy(self._witness),
                "provisional": [list(map(list, key)) for key in self._provisional],
                "short": [list(map(list, key)) for key in self._short], "plan": self._plan_state()}

    def _plan_state(self) -> dict:
        """The plan (bucket, numel, option index), the errors and shapes it was solved on, and how far it is priced."""
        return {"buckets": [[index, numel, self.options.index(codec)] for index, (numel, codec) in sorted(self.plan.items())],
                "errors": [[index, self.errors[index], self.relative[index]] for index in sorted(self.errors)],
                "shapes": [[index, [list(s) for s in shapes]] for index, shapes in sorted(self._shapes.items()) if shapes],
                "stale": self._stale, "trying": self.trying, "climbing": self.climbing, "fits": self.fits,
                "predicted": self._predicted, "planned_link": list(self._planned_link) if self._planned_link else None,
                "steps": self._plan_steps, "running": list(self._running), "beside_compiles": list(self._beside_compiles),
                "overrun_steps": self._plan_overrun_steps,
                "best_price": self._best_price, "cheapest": self._cheapest, "guess": self._guess}

    def load_state_dict(self, state: dict) -> None:
        self.monitor.agreed.clear()
        self.monitor.agreed.extend(state.get("agreed", [state["bandwidth"]] if state["bandwidth"] else []))
        self.monitor.sustained, self.monitor.volume = state.get("sustained"), state.get("volume", 0.0)
        self.monitor.floor = state.get("floor")
        self.monitor.latency, self.monitor.overhead_s = state["latency"], state["overhead_s"]
        self._backward_s = state["backward_s"]
        self._compute.clear()
        self._compute.extend(state.get("compute", []))
        self._periods = {tuple(map(tuple, key)): seconds for key, seconds in state.get("periods", [])}
        self._priced_rate, self._witness = state.get("priced_rate"), copy.deepcopy(state.get("witness"))
        self._provisional = {tuple(map(tuple, key)) for key in state.get("provisional", [])}
        self._short = {tuple(map(tuple, key)) for key in state.get("short", [])}
        self._overruns.clear()
        self._overruns.extend(state.get("overruns", []))
        if "plan" in state:  # (a state saved without it re-plans from the next step's measurements)
            self._load_plan(state["plan"])
        self.last = self._statistics(False, None)  # what settled steps report until the next agreement

    def _load_plan(self, saved: dict) -> None:
        """What _plan_state saved; ValueError for an option index this planner does not have."""
        width = len(self.options)
        buckets = [(int(index), int(numel), int(option)) for index, numel, option in saved["buckets"]]
        if not all(0 <= option < width for *_, option in buckets) or not all(
                len(errors) == len(relative) == width for _, errors, relative in saved["errors"]):
            raise ValueError(f"the saved plan does not fit this planner's {width} options")
        self.plan = {index: (numel, self.options[option]) for index, numel, option in buckets}
        self._plan_key = tuple(buckets)  # as _key makes it: the measured prices (periods) are keyed by it
        self.errors = {int(index): list(errors) for index, errors, _ in saved["errors"]}
        self.relative = {int(index): list(relative) for index, _, relative in saved["errors"]}
        self._shapes = {int(index): [tuple(s) for s in shapes] for index, shapes in saved["shapes"]}
        self._stale, self.trying, self.climbing, self.fits = (bool(saved[key]) for key in ("stale", "trying", "climbing", "fits"))
        self._predicted = saved["predicted"]
        self._planned_link = tuple(saved["planned_link"]) if saved["planned_link"] else None
        self._plan_steps = int(saved["steps"])
        self._running.clear()
        self._running.extend(saved["running"])
        self._beside_compiles = list(saved["beside_compiles"])
        self._plan_overrun_steps = int(saved.get("overrun_steps", 0))
        self._best_price = saved.get("best_price")
        self._guess = bool(saved.get("guess", False))
        self._cheapest = saved.get("cheapest")

    def settled_price(self) -> float | None:
        """auto: the running plan's measured seconds to the target per fp32 step (its step x its steps to the
        target) once nothing is on trial or waited for; else None. Agreed: the same on every rank."""
        if (self.mode != "auto" or self._stale or self.trying or self._awaiting or self.climbing
                or self._plan_key not in self._periods):
            return None
        return self._running_price()

    def best_price(self, payload_bytes: float, world_size: int) -> float | None:
        """auto, settled or not: the cheapest candidate's price when the plan was chosen (measured, or the model's; a
        cold one's included), where by then the step's other time was measured and the link's rate fitted on
        allreduces of ``payload_bytes``, or of the largest bucket in 16 bits (a plan measuring the link sends no
        more), at least: a smaller message's rate may be a shaper's burst. Else None. Agreed: the same on every rank."""
        if self.mode != "auto" or self._cheapest is None:
            return None
        price, measured_at = self._cheapest
        largest = 2 * max(self._numels.values(), default=0)
        return price if measured_at >= WIRE_FACTOR["allreduce"](world_size) * min(payload_bytes, largest) else None

    def _running_price(self) -> float:
        """The running plan's measured step x its steps to the target (as a multiple of fp32's)."""
        return self._periods[self._plan_key] * self._steps([option for *_, option in self._plan_key])

    def pause(self) -> None:
        """The hook skipped steps (auto's route of local steps): the next step's time from the last is none of its own."""
        self._last_end = None

    def budget_s(self) -> float | None:
        return self.time_budget_s if self.time_budget_s is not None else self._backward_s

    def compute_s(self) -> float:
        """auto's price of a step beside its communication: the median over recent steps of the slowest rank's
        seconds from one step's end to the next less the step's link and codec time; before a second step, the
        backward's seconds (a lower bound: the plan made after the first step priced low rank's 1.15x steps on its
        communication alone, and at 1 Gbit/s tried it first)."""
        return statistics.median(self._compute) if self._compute else (self._backward_s or 0.0)

    def overrun(self) -> float:
        """auto: how far the running plan's steps' communication overran the model's prediction, the median (before
        it has any, recent steps'; 1 before a step): it scales the communication of the plans not yet measured. A
        shaper's burst read 2.5 Gbit/s on the lab at 50 Mbit/s under HSDP, the first plan sent fp32 and fp16 at 0.66 s
        a step against low rank's 0.3 s, and until the rate fell, the model priced every smaller plan no cheaper.
        The running plan's own: under HSDP at 100 Mbit/s, a window holding fp16's trial (35x) and low rank 8-bit
        factors' steps read 10x, which priced fp32 factors at twice 8-bit's measured step, and auto kept 8-bit
        factors for 49-99 steps without trying fp32 ones (the fastest contestant there; the prices from a probe at a
        load of 1-2, an indication)."""
        ratios = list(self._overruns)[-self._plan_overrun_steps:] if self._plan_overrun_steps else self._overruns
        return statistics.median(ratios) if ratios else 1.0

    def margin(self) -> float:
        """How far measured steps overrun the plan's prediction, at least 1: the plan aims at budget /
        margin, so that the steps' spread, not only their median, fits the budget.

        The margin is the k-th largest of the last n ratios measured / predicted, with k the largest
        for which k / (n + 1) <= OVERRUN_EXCEEDANCE (at least 1: the largest). Whatever the ratios'
        distribution, a new step exceeds the k-th largest of n exchangeable earlier ones with chance
        k / (n + 1); an empirical 95th percentile of 20 steps (the second largest) is exceeded with
        chance 2/21, about 10%. Ratios above STALL x their median (at least STALL) are left out: a compile
        stall or the link changing under the plan (the monitor follows it) is not spread that a smaller
        plan absorbs, and it would shrink the plan for the whole window; the bound then holds for the
        steps that are not stalls. Kept across link changes."""
        if len(self._overruns) < 5:
            return 1.0
        ordered = sorted(self._overruns)
        spread = [r for r in ordered if r <= STALL * max(1.0, ordered[len(ordered) // 2])]
        k = max(1, int(OVERRUN_EXCEEDANCE * (len(spread) + 1)))
        return max(1.0, spread[-k])

    def _solve(self, world_size: int) -> None:
        indices = sorted(i for i in self._numels if i in self.errors)
        costs = [[self._option_cost(o, i, world_size) for o in range(len(self.options))] for i in indices]
        times = [[seconds for seconds, _ in row] for row in costs]
        errors = [self.errors[i] for i in indices]
        own_rule = [isinstance(option, (NoCompression, LowRank)) for option in self.options]
        safe = [[own or r <= self.max_error for own, r in zip(own_rule, self.relative[i])] for i in indices]
        uncleared = self.trying and bool(self._running) and not self._cleared()  # a trial this re-plan may cut
        wanted, self.fits = self._choose(indices, times, errors, safe)  # fits: some safe plan fits, reachable now or not
        held = self._reachable(indices, [[nbytes for _, nbytes in row] for row in costs], safe)
        choice = wanted if held == safe else self._choose(indices, times, errors, held)[0]
        # held below the plan the estimate asks for: re-plan at the next step, one rung up
        self.climbing = any(not row[w] for row, w in zip(held, wanted))
        key = self._key(indices, choice)
        if key != self._plan_key:  # a new plan's step times price it from its first steps
            if uncleared:
                self._short.add(self._plan_key)  # priced on too few steps: it may run its trial again
            self._plan_key, self._plan_steps, self._witness = key, 0, None  # (another plan witnesses nothing: prices stand)
            self._running.clear()
            self._beside_compiles.clear()
            self._plan_overrun_steps = 0
        self.plan = {i: (self._numels[i], self.options[c]) for i, c in zip(indices, choice)}
        self._predicted = sum(ts[c] for ts, c in zip(times, choice)) + self.monitor.overhead_s
        self._planned_link = (self.monitor.bandwidth, self.monitor.overhead_s)
        self._stale = False

    def _choose(self, indices, times, errors, safe) -> tuple[list[int], bool]:
        """The plan among the safe options: unbiased ones that fit, else any that fit, else the fastest;
        and whether it fits."""
        if self.mode == "auto":
            return self._soonest(indices, times, errors, safe), True
        unbiased = [[ok and self.options[o].unbiased for o, ok in enumerate(row)] for row in safe]
        fits = _fit_uniform if self.mode == "kimad" else _fit_knapsack
        budget = self.budget_s() / self.margin() - self.monitor.overhead_s
        fitted = fits(times, errors, unbiased, budget) or fits(times, errors, safe, budget)
        return fitted or _fastest(times, safe, uniform=self.mode == "kimad"), fitted is not None

    def _soonest(self, indices, times, errors, safe) -> list[int]:
        """auto: the plan with the least time to the target, step time x steps.

        Each option's steps to the target, as a multiple of fp32's, is steps_to_target's (LOWRANK_STEPS,
        measured on the lab); a plan takes its slowest option's. For each such level the candidate is the
        fastest plan among the options that take at most those steps, or within AUTO_SLACK of its
        communication time the one that errs least. A candidate's step is its measured step time once it
        ran TRIAL_STEPS on this link (_price_plan), else predicted: the step's other time (compute_s) plus
        its communication. The cheapest candidate wins, unless one not yet measured is predicted within
        TRIAL_RANGE of it: that one runs next, to be measured (`trying`), and runs until it is priced (`_end_step`),
        unless it was chosen on the first step's bound on the link (`_guess`): the re-plan that has the link
        measured may cut that one. A plan whose trial ended before it cleared (`_short`: priced out, or cut, on as
        little as one step) is not yet measured: it may run its trial again, to the end
        (on the lab at 1 Gbit/s fp16 priced on its first clear step of 0.157 s lost to low rank, which then took 139
        steps to the fp16 hook's 118: time_to_accuracy_job1_eager_decode_1gbit_3w_0981243.json, round 1, inferred
        from the step's time). Prices within TIE of the cheapest are a
        tie, won by the plan taking the fewest steps, then by the plan running (a measured price moves with the
        steps' noise: no switch for it). A candidate whose stateless options have
        not run on a bucket yet (cold: their kernels would compile) competes only if priced WARM_GAIN below the
        best of the others, by enough that the steps run so far, run again, would repay the compiles' stall
        (WARM_STALL_S): it is warmed first (`prepare`), and tried once their compiles are done (forgone for the
        run if they take over AWAIT_S); meanwhile the others run."""
        safe = [[ok and (i, o) not in self._forgone for o, ok in enumerate(row)] for i, row in zip(indices, safe)]
        warm = [[ok and not self._cold(i, o) for o, ok in enumerate(row)] for i, row in zip(indices, safe)]
        ready = self._candidates(indices, times, errors, warm)  # never empty: none is safe and never cold
        if not self.monitor.agreed:  # only a first step's bound on the rate (BandwidthMonitor._bound): see _measuring
            ready = self._measuring(ready)
        best = min(ready.values(), key=lambda c: c[0])
        self._best_price = best[0]
        # a compile holds the GIL and the cores for seconds (on the lab at 1 Gbit/s, 3 workers on 2 cores: 16
        # steps at 0.2-0.4 s against 0.14 s), so a cold candidate is warmed only where the model prices it
        # WARM_GAIN below the best that would not compile, with the step's other time measured, and by enough to
        # repay the stall within as many steps again as have run (WARM_STALL_S)
        cold = self._candidates(indices, times, errors, safe) if self._compute else {}
        gaining = [c for key, c in cold.items() if key not in ready and c[0] * (1 + WARM_GAIN) < best[0]
                   and (best[0] - c[0]) * self._steps_run >= WARM_STALL_S]
        self.warm = self._warming = {(i, o) for c in gaining for i, o in zip(indices, c[2]) if self._cold(i, o)}
        self._cheapest = ([min([best[0], *(c[0] for c in gaining)]), self.monitor.volume]
                          if self._compute and self.monitor.agreed else None)
        self._awaiting = bool(self.warm)
        untried = [c for c in ready.values() if not c[1] and c[0] <= TRIAL_RANGE * best[0]]
        # a lone candidate not yet measured is tried too: a trial priced out ends early, and the re-plan then scales
        # the model by the overrun (under HSDP on the lab at 100 Mbit/s, a lone first plan of fp32 and fp16 ran 8
        # steps at 0.49 s against the 0.31 s of the plan that followed)
        self.trying = bool(untried)
        self._guess = self.trying and not self.monitor.agreed  # chosen on the first step's bound on the link
        if self.trying:
            return min(untried, key=lambda c: c[0])[2]
        tied = [c for c in ready.values() if c[0] <= (1 + TIE) * best[0]]
        running = self._plan_key
        return min(tied, key=lambda c: (self._steps(c[2]), self._key(indices, c[2]) != running, c[0]))[2]

    def _measuring(self, candidates: dict) -> dict:
        """The candidates whose messages measure the link at volume (no low rank), unless low rank is priced TRIAL_RANGE
        below them all: a plan of small messages leaves the rate unmeasured, and on a bound alone it is no rate. On the
        lab at 1 Gbit/s, low rank planned after the first step held the rate at the first step's bound (1.08 Gbit/s for
        14 steps) and ran first, fp16's trial came 8-10 steps later, and `auto` took 0.76x the fp16 hook's speed
        (bench/results/time_to_accuracy_job1_1gbit_first_step_plan_3w_9b51ccf.md); at 10 Mbit/s low rank is priced far
        below anything else."""
        measuring = {key: c for key, c in candidates.items()
                     if not any(isinstance(self.options[option], LowRank) for option in c[2])}
        if measuring and min(c[0] for c in measuring.values()) <= TRIAL_RANGE * min(c[0] for c in candidates.values()):
            return measuring
        return candidates

    def _candidates(self, indices, times, errors, safe) -> dict[tuple, tuple[float, bool, list[int]]]:
        """Every plan measured on this bucket layout whose options are still allowed, and one new plan per level
        of steps to the target: plan key -> (price, measured, choice). A new plan joins only where the model
        prices it TIE below every measured plan of its level: on the lab at 1 Gbit/s, where all prices lay within
        10%, each re-plan's new mix of options (and each level's new candidate after the first) ran a trial of
        8 steps, 8-10 switches in a 120-step run."""
        compute_s, overrun = self.compute_s(), self.overrun()
        factors = [steps_to_target(option) for option in self.options]

        def predicted(choice):
            return compute_s + overrun * sum(ts[c] for ts, c in zip(times, choice))

        measured = {key: choice for key, choice in ((key, self._choice_of(key, indices)) for key in self._periods)
                    if choice is not None and all(row[c] for row, c in zip(safe, choice))}
        candidates = {key: (self._periods[key] * self._steps(choice), key not in self._short, choice)
                      for key, choice in measured.items()}
        for top in sorted(set(factors)):
            allowed = [[ok and factors[o] <= top for o, ok in enumerate(row)] for row in safe]
            if not all(any(row) for row in allowed):
                continue
            fastest = _fastest(times, allowed, uniform=False)
            comm_s = sum(ts[c] for ts, c in zip(times, fastest))
            choice = _fit_knapsack(times, errors, allowed, (1 + AUTO_SLACK) * comm_s) or fastest
            key, price = self._key(indices, choice), predicted(choice)
            if key in candidates or any(predicted(other) < (1 + TIE) * price for other in measured.values()
                                        if self._steps(other) == self._steps(choice)):
                continue
            candidates[key] = (price * self._steps(choice), False, choice)
        return candidates

    def _steps(self, choice: list[int]) -> float:
        """A plan's steps to the target as a multiple of fp32's: its slowest option's (steps_to_target)."""
        return max(steps_to_target(self.options[option]) for option in choice)

    def _choice_of(self, key: tuple, indices) -> list[int] | None:
        """A plan key's option per bucket, if it is a plan of this bucket layout (else None)."""
        if [i for i, _, _ in key] != list(indices) or any(numel != self._numels[i] for i, numel, _ in key):
            return None
        return [option for _, _, option in key]

    def _cold(self, index: int, option: int) -> bool:
        """A stateless option whose kernels pay to compile (gqsgd: not none, nor a 16-bit cast, whose eager pass
        took 0.99 ms per M elements against 0.51 compiled, kernel.py: 1.7 ms of the lab job's 0.13 s step) that has
        not been warmed on this bucket: its first calls would run eagerly while its kernels compile, so it is
        warmed (`prepare`) before it is tried."""
        codec = self.options[option]
        return not (isinstance(codec, (NoCompression, Cast)) or codec.uses_feedback or (index, option) in self._warmed)

    def _key(self, indices, choice) -> tuple:
        """A plan's identity: each bucket's index, size and option."""
        return tuple((i, self._numels[i], c) for i, c in zip(indices, choice))

    def _price_plan(self, period_s: float, compiling: bool = False) -> bool:
        """auto: one more agreed step time of the plan running now; its measured price is the median of its
        recent steps after its first TRIAL_SKIP, leaving out steps that ran beside a compile (their codecs
        eager, their cores shared) while there are others. True when a tried plan has just been priced:
        after TRIAL_STEPS steps clear of compiles, once its clear steps price it beyond TRIAL_RANGE x the best
        candidate's price when it was chosen (it would not have been tried), or 2 x TRIAL_STEPS in all (a trial must
        end). Its prices stand for the first finite rate measured while they run (REPRICE): an infinite estimate
        is no rate."""
        self._plan_steps += 1
        if self._plan_steps <= TRIAL_SKIP:
            return False
        if self._priced_rate is None and min(self.monitor.agreed, default=math.inf) < math.inf:
            # the rate the prices stand for: the first fitted while they run. A first step's bound is none: at 1 Gbit/s a
            # shaper's burst read 1.35 Gbit/s in it, and prices that stood for it could be dropped as another link's once a
            # rate was fitted (REPRICE); the 9b51ccf grid's plans show a second trial of low rank in 2 rounds of 3
            self._priced_rate = self.monitor.bandwidth
        (self._beside_compiles if compiling else self._running).append(period_s)
        if self._witness is not None and not compiling:
            self._witness[1].append(period_s)
            if len(self._witness[1]) >= TRIAL_STEPS - TRIAL_SKIP:
                self._reprice(*self._witness)
        self._periods[self._plan_key] = statistics.median(self._running or self._beside_compiles)
        (self._provisional.discard if self._running else self._provisional.add)(self._plan_key)
        clear = self._cleared()
        # priced out: its clear steps already cost over TRIAL_RANGE x the best candidate's price, so it would not be
        # tried, let alone kept (on the lab at 50 Mbit/s under HSDP, a first plan made before the link was measured
        # tried fp32 for 8 steps at 1.55 s against the 0.7 s of gqsgd 8-bit's). Priced on so few steps, it is short
        # (`_short`): its next trial runs until clear
        outpriced = (self.trying and not clear and bool(self._running) and self._best_price is not None
                     and self._plan_key not in self._short and self._running_price() > TRIAL_RANGE * self._best_price)
        if outpriced:
            self._short.add(self._plan_key)
        elif clear:
            self._short.discard(self._plan_key)
        return self.trying and (clear or outpriced or self._plan_steps >= 2 * TRIAL_STEPS)

    def _cleared(self) -> bool:
        """auto: the plan running now has the clear steps (none beside a compile) that price a trial."""
        return len(self._running) >= TRIAL_STEPS - TRIAL_SKIP

    def _reopen(self, compiling: bool) -> bool:
        """auto: once no kernel compiles on any rank, the plans priced by steps beside a compile only (a trial that
        never cleared of one) lose that price, so the model prices them again and may try them clear. True when
        any did. Under HSDP at 50 Mbit/s on the lab, low rank's trial ran its 16 steps beside the compiles of the
        8-bit factors' warm-up at 0.35-0.98 s a step against 0.21-0.23 clear, and auto kept gqsgd 8-bit at 0.30 s
        for 120 steps (an instrumented run, not committed). The running plan's own clear steps price it."""
        reopened = self._provisional - {self._plan_key}
        if compiling or not reopened:
            return False
        for key in reopened:
            self._periods.pop(key, None)
        self._provisional -= reopened
        return True

    def _watch_rate(self) -> None:
        """auto: where the rate moved beyond REPRICE from the one the measured prices stand for, watch whether the
        running plan's steps move with it (_reprice)."""
        if (self._priced_rate and self._witness is None and self._plan_key in self._periods
                and self._plan_key not in self._provisional  # a price beside compiles is no witness's base
                and not self._priced_rate / REPRICE <= self.monitor.bandwidth <= self._priced_rate * REPRICE):
            self._witness = [self._periods[self._plan_key], [], self.monitor.bandwidth > self._priced_rate]

    def _reprice(self, price: float, steps: list[float], rose: bool) -> None:
        """auto: the link's rate moved beyond REPRICE; the running plan's steps since then witness it. Moved with it
        by over WITNESS (faster for a rise, slower for a fall): the measured prices are another link's, dropped. Else
        they stand, for the rate they were measured at (a plan sending few bytes witnesses little: a faster link is
        followed as far as the running plan's steps show it)."""
        now = statistics.median(steps)
        if now * (1 + WITNESS) < price if rose else now > price * (1 + WITNESS):
            self._periods.clear()
            self._provisional.clear()
            self._running.clear()
            self._running.extend(steps)  # the running plan's price: its steps on the new link
            self._priced_rate = self.monitor.bandwidth
        self._witness = None

    def _reachable(self, indices: list[int], sizes: list[list[float]], safe: list[list[bool]]) -> list[list[bool]]:
        """The safe options the buckets may move to from the current plan: any smaller, and larger ones up
        to GROWTH x the bytes or the next larger safe one (an unsafe rung must not stop the climb); kimad
        climbs on the plan's total bytes. The link's rate is measured only up to the volumes sent: a
        shaper's burst passes small steps at wire speed (on the lab at 100 Mbit/s, low rank's 0.2 MB steps
        read as 67 Gbit/s, and the next plan sent 6.9 MB uncompressed, 0.55 s against a 0.2 s budget)."""
        planned = [self.plan.get(i) for i in indices]
        if self.mode == "auto" or any(p is None or p[0] != self._numels[i] for p, i in zip(planned, indices)):
            return safe  # auto prices every option at the rate its largest messages measured; a new layout's first plan
        now = [self.options.index(p[1]) for p in planned]
        if self.mode == "kimad":
            totals, common = [sum(column) for column in zip(*sizes)], [all(column) for column in zip(*safe)]
            reach = _within_reach(totals, totals[now[0]], common)
            held = [[ok and near for ok, near in zip(row, reach)] for row in safe]
        else:
            held = [_within_reach(row, row[c], ok) for row, c, ok in zip(sizes, now, safe)]
        return held  # never empty: none is always safe, and the next larger safe option is always in reach

    def _agree_profiles(self, link) -> None:
        """Every option's encode/decode cost on this machine (_local_profiles); ranks agree on the slowest (MAX)."""
        n = link.world_size
        if n in self._profiles:
            return
        local = self._local_profiles(n)
        costs = torch.tensor([[p.encode_s_per_elem, p.decode_s_per_elem] for p in local], dtype=torch.float64)
        costs = link.allreduce(costs, torch.distributed.ReduceOp.MAX).tolist()
        self._profiles[n] = [dataclasses.replace(p, encode_s_per_elem=e, decode_s_per_elem=d)
                             for p, (e, d) in zip(local, costs)]

    def _local_profiles(self, world_size: int, cost="calibrate") -> list[network.CodecProfile]:
        """Every option's cost model: calibrated once per machine (calibrate.cached_profiles: a later process
        reads it, with no compile stall), or by `cost` ("free", a GPU's memory-bound kernel)."""
        if cost != "calibrate":
            return [codec_profile(option, world_size, cost) for option in self.options]
        return cached_profiles([(o, LOWRANK_CALIBRATION_SHAPES if isinstance(o, LowRank) else None) for o in self.options],
                               world_size, calibration_numel=1 << 18)

    def plan_ahead(self, numels: list[int], shapes: list | None, world_size: int, link: network.Link,
                   compute_s: float, cost="calibrate") -> dict:
        """auto's plan for a job before it runs (`netgain model`), by the planner's own solve: the link given
        (ModelledLink), the step's other time `compute_s` given, every option's error within max_error but
        low rank's, counted as the bucket's energy as in a run. Returns {"plan": a codec description per bucket,
        "step_s", "steps": its predicted step and steps to the target (x fp32's), "options": {description:
        (step_s, steps)} of each option on every bucket}."""
        self.monitor = ModelledLink(link)
        self._compute.append(compute_s)
        self._profiles[world_size] = self._local_profiles(world_size, cost)
        for index, numel in enumerate(numels):
            self._numels[index], self._shapes[index] = numel, shapes[index] if shapes else None
            self.errors[index] = self.relative[index] = [float(isinstance(o, LowRank)) for o in self.options]
        self._solve(world_size)

        def priced(choice: list[int]) -> tuple[float, float]:
            step_s = compute_s + sum(self._option_cost(c, index, world_size)[0] for index, c in enumerate(choice))
            return step_s, self._steps(choice)

        choice = [self.options.index(self.plan[index][1]) for index in range(len(numels))]
        step_s, steps = priced(choice)
        return {"plan": [self.options[c].describe() for c in choice], "step_s": step_s, "steps": steps,
                "options": {o.describe(): priced([k] * len(numels)) for k, o in enumerate(self.options)}}

    def _option_cost(self, option_index: int, index: int, world_size: int) -> tuple[float, float]:
        """(seconds, payload bytes) of an option for a bucket: its header and payload collectives on the
        monitor's fit, plus codec work. The header counts as a one-parameter bucket's whether or not the
        option has one (a plain plan sends none once settled, which its measured price shows)."""
        profile, numel = self._profiles[world_size][option_index], self._numels[index]
        payload = network.bucket_messages(numel, dataclasses.replace(profile, header_bytes=0, header_bytes_per_tensor=0),
                                          shapes=self._shapes.get(index) if profile.rank else None)
        wire = sum(self.monitor.predict_s(collective, nbytes, world_size)
                   for collective, nbytes in [("allreduce", network.HEADER_BYTES), *payload])
        seconds = wire + numel * (profile.encode_s_per_elem + profile.decode_s_per_elem)
        return seconds, sum(nbytes for _, nbytes in payload)


class ModelledLink:
    """A link given, not measured, in the monitor's place (AdaptivePlanner.plan_ahead): each collective priced
    by netgain.cost.network, the shaper's burst counted as spent (auto's rate is the one measured at volume)."""

    def __init__(self, link: network.Link):
        self.link, self.bandwidth, self.overhead_s = link, link.bandwidth, 0.0
        self.agreed = [link.bandwidth]  # given, so as good as measured
        self.volume = math.inf          # at any volume

    def predict_s(self, collective: str, payload_bytes: float, world_size: int) -> float:
        if collective == "allgather":
            return network.allgather_s(payload_bytes, world_size, self.link)
        return network.allreduce_s(payload_bytes, world_size, self.link)


def _fit_knapsack(times, errors, allowed, budget) -> list[int] | None:
    """Kimad+: least total error over the allowed options that fits the budget; None if nothing fits."""
    keep = [[o for o, ok in enumerate(row) if ok] for row in allowed]
    if any(not row for row in keep):
        return None
    groups = [[knapsack.Option(times[b][o], -errors[b][o]) for o in row] for b, row in enumerate(keep)]
    try:
        choice = knapsack.solve(groups, budget).choice
    except ValueError:  # even the fastest allowed options overrun the budget
        return None
    return [row[c] for row, c in zip(keep, choice)]


def _fit_uniform(times, errors, allowed, budget) -> list[int] | None:
    """Kimad: one option allowed for every bucket, the least total error that fits; None if none fits."""
    width = len(times[0])
    fitting = [o for o in range(width) if all(row[o] for row in allowed) and sum(ts[o] for ts in times) <= budget]
    if not fitting:
        return None
    best = min(fitting, key=lambda o: sum(es[o] for es in errors))
    return [best] * len(times)


def _within_reach(sizes: list[float], current: float, safe: list[bool]) -> list[bool]:
    limit = GROWTH * current
    next_rung = min((size for size, ok in zip(sizes, safe) if ok and size > limit), default=limit)
    return [ok and (size <= limit or size == next_rung) for size, ok in zip(sizes, safe)]


def _fastest(times, allowed, uniform: bool) -> list[int]:
    """Nothing safe fits: the fastest safe option (per bucket, or one for all), the closest to fitting."""
    if uniform:
        width = len(times[0])
        common = [o for o in range(width) if all(row[o] for row in allowed)]  # never empty: none (0) is always safe, and _reachable keeps a safe option
        return [min(common, key=lambda o: sum(ts[o] for ts in times))] * len(times)
    return [min((o for o, ok in enumerate(row) if ok), key=ts.__getitem__) for ts, row in zip(times, allowed)]


def steps_to_target(option: Codec) -> float:
    """The steps an option takes to the target as a multiple of fp32's (auto's price of low rank's bias):
    1 for the exact, rounded and unbiased codes within max_error."""
    return LOWRANK_STEPS[option.factors] if isinstance(option, LowRank) else 1.0


def option_error(option: Codec, x: torch.Tensor, scale: torch.Tensor | float | None = None) -> float:
    """||x - C(x)||^2 this option would cause on x (expected value for stochastic rounding); gqsgd
    quantizes against ``scale``: one number, or each element's own (its parameter's global max |g|,
    as the codec does); default max |x|."""
    if isinstance(option, NoCompression):
        return 0.0
    if isinstance(option, Cast):  # round to nearest: deterministic, and tiny beside any gradient's noise
        peak = x.abs().max() if scale is None else torch.as_tensor(scale).max()
        if option.dtype == torch.float16 and float(peak) > FP16_PEAK:
            return float("inf")  # too near fp16's range: inadmissible
        return float((x - x.to(option.dtype).float()).square().sum())
    if isinstance(option, GlobalQSGD):
        scale = x.abs().max() if scale is None else torch.as_tensor(scale, dtype=torch.float32, device=x.device)
        step = scale / levels_per_side(option.bits)
        scaled = torch.where(step > 0, x.abs() / step, 0.0)
        frac = scaled - scaled.floor()
        return float((frac * (1 - frac) * step * step).sum())
    if isinstance(option, LowRank):  # an upper bound: the projection keeps some of it, error feedback the rest
        return float(x.square().sum())
    if isinstance(option, TopK):
        energy = x.square()
        kept = energy.topk(option.k(x.numel()), sorted=False).values.sum()
        return float(energy.sum() - kept)
    raise TypeError(f"no error model for {option.describe()}")
