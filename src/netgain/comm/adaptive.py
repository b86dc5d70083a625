"""Kimad: bandwidth-aware adaptive compression (../shared/papers/kimad.md).

Each step the ranks agree on the link's bandwidth (BandwidthMonitor); the communication budget
is bandwidth x a time target (given, or the measured backward time so communication hides under
compute). Every `replan_every` steps, or when the bandwidth moves by more than
`replan_threshold`, the plan is re-solved:
  kimad  - one option for every bucket, the least total error that fits the budget;
  kimad+ - a multi-choice knapsack (netgain.plan) choosing one option per bucket.
Options: uncompressed, gqsgd (packed) at each bit width, top-k (EF21) at each ratio. An option's
time comes from the alpha-beta model (netgain.cost.network) with the agreed bandwidth and this
machine's calibrated codec cost; its error is measured on the current gradient (expected
stochastic-rounding error for gqsgd, the dropped energy for top-k), summed over ranks. Every
input to the solver is agreed by collectives, so every rank computes the same plan; the hook's
header checks it bucket by bucket anyway.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import plan as knapsack
from ..cost import network
from .bandwidth import BandwidthMonitor
from .codecs import Codec, GlobalQSGD, NoCompression, TopK, codec_profile
from .quantize import levels_per_side

MODES = ("kimad", "kimad+")


class AdaptivePlanner:
    """Picks each bucket's codec per step behind the same interface as codecs.FixedChoice."""

    checked = True  # every bucket's choice is compared across ranks in its header

    def __init__(self, mode: str = "kimad+", *, time_budget_s: float | None = None, replan_every: int = 10,
                 replan_threshold: float = 0.2, bits: tuple[int, ...] = (2, 3, 4, 5, 6, 7, 8),
                 topk_ratios: tuple[float, ...] = (0.001, 0.01, 0.1), monitor: BandwidthMonitor | None = None):
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not one of {MODES}")
        if time_budget_s is not None and time_budget_s <= 0:
            raise ValueError(f"time_budget_s must be > 0 (or None for the measured backward time), got {time_budget_s}")
        if replan_every < 1:
            raise ValueError(f"replan_every must be >= 1, got {replan_every}")
        self.mode, self.time_budget_s = mode, time_budget_s
        self.replan_every, self.replan_threshold = replan_every, replan_threshold
        self.options: list[Codec] = ([NoCompression()] + [GlobalQSGD(b) for b in sorted(bits, reverse=True)]
                                     + [TopK(r) for r in sorted(topk_ratios, reverse=True)])
        self.uses_feedback = any(option.uses_feedback for option in self.options)
        self.monitor = monitor or BandwidthMonitor()
        self.plan: dict[int, tuple[int, Codec]] = {}     # bucket index -> (numel, codec)
        self.errors: dict[int, list[float]] = {}          # bucket index -> agreed error per option
        self._local_errors: dict[int, list[float]] = {}
        self._numels: dict[int, int] = {}                 # bucket index -> numel, this step's layout
        self._profiles: dict[int, list[network.CodecProfile]] = {}
        self._predicted: float | None = None
        self._backward_s: float | None = None
        self._planned_bandwidth: float | None = None
        self._stale = True
        self.last: dict = {}

    # ---- per bucket, on the communication thread -------------------------------------------------
    def codec_for(self, index: int, numel: int) -> Codec:
        self._numels[index] = numel
        planned = self.plan.get(index)
        if planned is None or planned[0] != numel:
            self._stale = True  # a new bucket layout (DDP rebuilds after step 1): measure and re-plan
            return self.options[0]
        return planned[1]

    def describe(self) -> str:
        return self.mode

    def attach(self, communicator) -> None:
        """Every payload collective of the hook becomes a bandwidth sample."""
        communicator.observer = self.monitor.observe

    def wants_errors(self, step: int) -> bool:
        return self._stale or (step + 1) % self.replan_every == 0

    def observe(self, index: int, x: torch.Tensor) -> None:
        """Measure every option's compression error on this rank's bucket."""
        self._local_errors[index] = [option_error(option, x) for option in self.options]

    # ---- at the end of a step, on the communication thread ---------------------------------------
    def end_step(self, link, step: int, backward_s: float) -> dict:
        observer, link.observer = link.observer, None  # the planner's own small collectives are not samples
        try:
            return self._end_step(link, step, backward_s)
        finally:
            link.observer = observer

    def _end_step(self, link, step: int, backward_s: float) -> dict:
        local_bandwidth, local_latency = self.monitor.local_estimate()
        # MAX of bandwidth and backward time, MIN of latency (as -MAX of -latency): the least-waiting rank's view
        agreed = link.allreduce(torch.tensor([local_bandwidth, backward_s, -local_latency], dtype=torch.float64),
                                torch.distributed.ReduceOp.MAX).tolist()
        bandwidth = self.monitor.update(agreed[0], -agreed[2])
        self._backward_s = agreed[1] if self._backward_s is None else 0.7 * self._backward_s + 0.3 * agreed[1]
        measured = self.wants_errors(step) and bool(self._local_errors)
        if measured:
            order = sorted(self._local_errors)
            summed = link.allreduce(torch.tensor([e for i in order for e in self._local_errors[i]], dtype=torch.float64))
            width = len(self.options)
            self.errors.update({i: summed[k * width:(k + 1) * width].tolist() for k, i in enumerate(order)})
            self._local_errors = {}
        moved = (self._planned_bandwidth is not None and bandwidth is not None
                 and abs(bandwidth - self._planned_bandwidth) > self.replan_threshold * self._planned_bandwidth)
        replanned = bandwidth is not None and bool(self.errors) and (measured or moved)
        if replanned:
            self._agree_profiles(link)
            self._solve(bandwidth, link.world_size)
        self.last = {"bandwidth_Bps": bandwidth, "budget_s": self.budget_s(), "replanned": replanned,
                     "plan": {i: codec.describe() for i, (_, codec) in sorted(self.plan.items())},
                     "predicted_comm_s": self._predicted}
        return self.last

    def state_dict(self) -> dict:
        """What every rank agreed on (identical everywhere): the link estimate and the compute time."""
        return {"bandwidth": self.monitor.bandwidth, "latency": self.monitor.latency, "backward_s": self._backward_s}

    def load_state_dict(self, state: dict) -> None:
        self.monitor.bandwidth, self.monitor.latency = state["bandwidth"], state["latency"]
        self._backward_s = state["backward_s"]

    def budget_s(self) -> float | None:
        return self.time_budget_s if self.time_budget_s is not None else self._backward_s

    def _solve(self, bandwidth: float, world_size: int) -> None:
        fabric = network.Link("measured", bandwidth, self.monitor.latency / max(1, 2 * (world_size - 1)))
        indices = sorted(i for i in self._numels if i in self.errors)
        times = [[self._option_s(option_index, numel, world_size, fabric)
                  for option_index in range(len(self.options))]
                 for numel in (self._numels[i] for i in indices)]
        errors = [self.errors[i] for i in indices]
        budget = self.budget_s()
        if self.mode == "kimad":
            choice = _uniform_choice(times, errors, budget)
        else:
            groups = [[knapsack.Option(t, -e) for t, e in zip(ts, es)] for ts, es in zip(times, errors)]
            try:
                choice = knapsack.solve(groups, budget).choice
            except ValueError:  # even the fastest options overrun the budget: send the least
                choice = [min(range(len(ts)), key=ts.__getitem__) for ts in times]
        self.plan = {i: (self._numels[i], self.options[c]) for i, c in zip(indices, choice)}
        self._predicted = sum(ts[c] for ts, c in zip(times, choice))
        self._planned_bandwidth = bandwidth
        self._stale = False

    def _agree_profiles(self, link) -> None:
        """Calibrate every option's encode/decode cost once; ranks agree on the slowest (MAX)."""
        n = link.world_size
        if n in self._profiles:
            return
        local = [codec_profile(o, n, calibration_numel=1 << 18) for o in self.options]
        costs = torch.tensor([[p.encode_s_per_elem, p.decode_s_per_elem] for p in local], dtype=torch.float64)
        costs = link.allreduce(costs, torch.distributed.ReduceOp.MAX).tolist()
        self._profiles[n] = [dataclasses.replace(p, encode_s_per_elem=e, decode_s_per_elem=d)
                             for p, (e, d) in zip(local, costs)]

    def _option_s(self, option_index: int, numel: int, world_size: int, fabric: network.Link) -> float:
        profile = self._profiles[world_size][option_index]
        compute = numel * (profile.encode_s_per_elem + profile.decode_s_per_elem)
        return network.collective_s(numel, world_size, fabric, profile) + compute


def _uniform_choice(times, errors, budget) -> list[int]:
    """Kimad: the same option for every bucket; least total error that fits, else the fastest."""
    width = len(times[0])
    total_t = [sum(ts[o] for ts in times) for o in range(width)]
    total_e = [sum(es[o] for es in errors) for o in range(width)]
    fitting = [o for o in range(width) if total_t[o] <= budget]
    best = min(fitting, key=total_e.__getitem__) if fitting else min(range(width), key=total_t.__getitem__)
    return [best] * len(times)


def option_error(option: Codec, x: torch.Tensor) -> float:
    """||x - C(x)||^2 this option would cause on x (expected value for stochastic rounding)."""
    if isinstance(option, NoCompression):
        return 0.0
    if isinstance(option, GlobalQSGD):
        step = float(x.abs().max()) / levels_per_side(option.bits)
        if step == 0:
            return 0.0
        scaled = x.abs() / step
        frac = scaled - scaled.floor()
        return float((frac * (1 - frac)).sum()) * step * step
    if isinstance(option, TopK):
        energy = x.square()
        kept = energy.topk(option.k(x.numel()), sorted=False).values.sum()
        return float(energy.sum() - kept)
    raise TypeError(f"no error model for {option.describe()}")
