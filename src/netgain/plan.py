"""Multi-choice knapsack: pick exactly one option per group, maximise total value under a weight budget.

One solver serves every planner in netgain (Kimad re-plans codec levels per layer with
value = -error; GAC re-selects aligned ranks with value = s_i * (|W_i(d)| - |W_i*|)); it knows
nothing about either.

The exact method is a dynamic program over a quantised budget. Each group's lightest option is
paid up front, so only the slack ``budget - sum(min weights)`` is quantised into ``resolution``
units; the extra weight of every option is rounded UP to whole units, so a returned choice is
always truly feasible (the price is that a solution using the last fraction of a unit per group
may be missed: at most one unit per group). Integer weights whose slack fits in ``resolution``
units are solved without any quantisation loss. Whatever either method leaves unused is then spent
by repeated best single-group swaps that still fit (a local improvement that never breaks
feasibility), so the result is never worse than the table's. On many groups the greedy often
beats a coarse table (quantisation loss grows with the group count), so "auto" runs both. The greedy method walks each group's upper convex hull in order of marginal
value per weight (the LP relaxation's order) and needs no table, for instances too large for it.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

METHODS = ("auto", "exact", "greedy")
# "auto" runs both methods and keeps the better while groups * options * (resolution + 1) stays
# below this many table cells, else the greedy alone.
AUTO_EXACT_MAX_CELLS = 50_000_000


@dataclass(frozen=True)
class Option:
    """One choice within a group: its weight (cost against the budget) and its value."""

    weight: float
    value: float
    label: Any = None


@dataclass(frozen=True)
class Solution:
    """The chosen option index for each group, with the true total weight and value."""

    choice: list[int]
    weight: float
    value: float
    method: str


def solve(
    groups: Sequence[Sequence[Option | tuple[float, float]]],
    budget: float,
    *,
    method: str = "auto",
    resolution: int = 1000,
) -> Solution:
    """Choose one option per group maximising total value subject to total weight <= budget."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if isinstance(resolution, bool) or not isinstance(resolution, (int, np.integer)) or resolution < 1:
        raise ValueError(f"resolution must be a positive integer, got {resolution!r}")
    budget = float(budget)
    if not math.isfinite(budget) or budget < 0:
        raise ValueError(f"budget must be a finite number >= 0, got {budget!r}")
    weights, values = _as_arrays(groups)

    min_weight = float(sum(w.min() for w in weights))
    if min_weight > budget:
        raise ValueError(
            f"no feasible choice: the lightest option of every group weighs {min_weight:g} in total, "
            f"more than the budget {budget:g}"
        )
    if method == "auto":
        cells = len(weights) * max(len(w) for w in weights) * (resolution + 1)
        methods = ["exact", "greedy"] if cells <= AUTO_EXACT_MAX_CELLS else ["greedy"]
    else:
        methods = [method]
    solutions = []
    for name in methods:
        pick = _exact if name == "exact" else _greedy
        choice = _improve_by_swaps(weights, values, budget, pick(weights, values, budget, resolution))
        solutions.append(
            Solution(
                choice=choice,
                weight=float(sum(w[c] for w, c in zip(weights, choice))),
                value=float(sum(v[c] for v, c in zip(values, choice))),
                method=name,
            )
        )
    return max(solutions, key=lambda s: s.value)  # first (exact) wins ties


def _as_arrays(groups) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Validate the groups and return per-group weight and value arrays."""
    if len(groups) == 0:
        raise ValueError("groups must contain at least one group")
    weights, values = [], []
    for g, options in enumerate(groups):
        if len(options) == 0:
            raise ValueError(f"group {g} has no options; every group needs at least one")
        pairs = [(o.weight, o.value) if isinstance(o, Option) else tuple(o) for o in options]
        if any(len(p) != 2 for p in pairs):
            raise ValueError(f"group {g}: options must be Option or (weight, value) pairs")
        arr = np.asarray(pairs, dtype=np.float64)
        w, v = arr[:, 0], arr[:, 1]
        if not np.all(np.isfinite(arr)):
            raise ValueError(f"group {g}: weights and values must be finite numbers (no NaN or inf)")
        if np.any(w < 0):
            raise ValueError(f"group {g}: weights must be >= 0, got {w[w < 0][0]:g}")
        weights.append(w)
        values.append(v)
    return weights, values


def _quantise(weights: list[np.ndarray], budget: float, resolution: int) -> tuple[list[np.ndarray], int]:
    """Extra weight above each group's lightest option, in budget units rounded up, and the unit count."""
    extra = [w - w.min() for w in weights]
    slack = budget - float(sum(w.min() for w in weights))
    integral = float(slack).is_integer() and all(np.all(e == np.round(e)) for e in extra)
    if integral and slack <= resolution:
        return [e.astype(np.int64) for e in extra], int(slack)  # unit 1: lossless
    if slack <= 0:  # only each group's lightest options fit
        return [np.where(e > 0, resolution + 1, 0).astype(np.int64) for e in extra], resolution
    scale = resolution / slack
    return [np.ceil(e * scale).astype(np.int64) for e in extra], resolution


def _exact(weights, values, budget, resolution) -> list[int]:
    """Dynamic program: best[c] = best value with at most c units of slack used; backtrack the argmaxes."""
    units, capacity = _quantise(weights, budget, resolution)
    best = np.zeros(capacity + 1)
    cols = np.arange(capacity + 1)
    index_type = np.int16 if max(len(w) for w in weights) < 2**15 else np.int32
    argmax = np.empty((len(weights), capacity + 1), dtype=index_type)
    for g, (q, v) in enumerate(zip(units, values)):
        source = cols[None, :] - q[:, None]
        candidates = np.where(source >= 0, best[np.maximum(source, 0)], -np.inf) + v[:, None]
        argmax[g] = candidates.argmax(axis=0)
        best = candidates[argmax[g], cols]
    choice = [0] * len(weights)
    c = capacity
    for g in range(len(weights) - 1, -1, -1):
        choice[g] = int(argmax[g, c])
        c -= int(units[g][choice[g]])
    return choice


def _greedy(weights, values, budget, resolution) -> list[int]:
    """LP-order greedy: start at each group's lightest option, take hull upgrades by value per weight."""
    del resolution  # the greedy needs no table
    hulls = [_upper_hull(w, v) for w, v in zip(weights, values)]
    choice = [h[0] for h in hulls]
    position = [0] * len(hulls)
    remaining = budget - float(sum(w[c] for w, c in zip(weights, choice)))
    heap = []

    def push(g: int) -> None:
        p = position[g]
        if p + 1 < len(hulls[g]):
            a, b = hulls[g][p], hulls[g][p + 1]
            dw, dv = weights[g][b] - weights[g][a], values[g][b] - values[g][a]
            heapq.heappush(heap, (-(dv / dw), g))

    for g in range(len(hulls)):
        push(g)
    while heap:
        _, g = heapq.heappop(heap)
        p = position[g]
        a, b = hulls[g][p], hulls[g][p + 1]
        dw = weights[g][b] - weights[g][a]
        if dw <= remaining:
            remaining -= dw
            position[g] = p + 1
            choice[g] = b
            push(g)
    return choice


def _improve_by_swaps(weights, values, budget, choice: list[int]) -> list[int]:
    """Spend what quantisation or the greedy left unused: apply the best single-group swap that fits, repeatedly."""
    width = max(len(w) for w in weights)
    W = np.full((len(weights), width), np.inf)
    V = np.full((len(weights), width), -np.inf)
    for g, (w, v) in enumerate(zip(weights, values)):
        W[g, : len(w)], V[g, : len(v)] = w, v
    rows = np.arange(len(weights))
    chosen = np.array(choice)
    while True:
        leftover = budget - W[rows, chosen].sum()
        gain = np.where(W - W[rows, chosen][:, None] <= leftover, V - V[rows, chosen][:, None], -np.inf)
        g, o = np.unravel_index(np.argmax(gain), gain.shape)
        if gain[g, o] <= 0:
            return [int(c) for c in chosen]
        chosen[g] = o


def _upper_hull(w: np.ndarray, v: np.ndarray) -> list[int]:
    """Indices of the undominated options on the upper convex hull of (weight, value), by weight."""
    order = sorted(range(len(w)), key=lambda i: (w[i], -v[i]))
    frontier = []
    for i in order:  # drop options no better than a lighter (or equally heavy) one
        if not frontier or v[i] > v[frontier[-1]]:
            frontier.append(i)
    hull: list[int] = []
    for i in frontier:
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # b lies on or below the chord a -> i: its marginal rate is not decreasing, drop it
            if (v[b] - v[a]) * (w[i] - w[a]) <= (v[i] - v[a]) * (w[b] - w[a]):
                hull.pop()
            else:
                break
        hull.append(i)
    return hull
