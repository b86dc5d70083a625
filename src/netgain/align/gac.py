"""GAC: re-select each unit's size among hardware-aligned, non-cliff candidates under the compressor's budget.

Given a compressor's units (proposed size d_i*, a value per size), GAC offers each unit the multiples of
the alignment within a few steps of d_i*, adds "leave it unchanged" where compressing at d_i*
does not pay in latency, drops the latency cliffs that the cost model (measured or analytic)
shows — a candidate slower than a larger candidate of the same unit — and solves the knapsack

    maximise  sum_i s_i (|W_i(d_i)| - |W_i(d_i*)|)   subject to   sum_i |W_i(d_i)| <= sum_i |W_i(d_i*)|

with `netgain.plan`. The value is `Unit.gain`: this linear form, or, where the compressor predicts
its loss at every size (ASVD's Fisher-predicted loss increase, the pruner's pruned salience), the
exact difference of that curve, so GAC optimises the compressor's own objective over aligned sizes.
The naive baselines round every size to the alignment.
"""

from __future__ import annotations

from typing import Sequence

from ..plan import Option, solve
from .units import Unit, proposed_sizes, total_params

ROUNDING = ("nearest", "down")


def unit_latency(unit: Unit, size: int, cost, tokens: int) -> float:
    """Seconds the unit's GEMMs take at this size for `tokens` tokens under a cost model."""
    return sum(cost.gemm(m, k, n) for m, k, n in unit.gemms(size, tokens))


def candidate_sizes(unit: Unit, multiple: int, steps: int) -> list[int]:
    """Sizes at multiples of `multiple` within `steps` multiples of the proposal that save parameters."""
    center = multiple * round(unit.proposed / multiple)
    dense = unit.params(unit.full)
    sizes = {center + k * multiple for k in range(-steps, steps + 1)}
    return sorted(s for s in sizes if multiple <= s < unit.full and unit.params(s) < dense)


def unit_options(unit: Unit, cost, tokens: int, multiple: int, steps: int, tolerance: float = 0.0) -> list[int]:
    """GAC's candidates for one unit: aligned sizes near the proposal, plus "unchanged" where compressing
    at the proposed size does not pay in latency, minus the cliffs."""
    if unit.proposed == unit.full:
        return [unit.full]
    sizes = candidate_sizes(unit, multiple, steps)
    if unit_latency(unit, unit.full, cost, tokens) <= unit_latency(unit, unit.proposed, cost, tokens):
        sizes.append(unit.full)
    return drop_cliffs(unit, sizes, cost, tokens, tolerance)


def drop_cliffs(unit: Unit, sizes: Sequence[int], cost, tokens: int, tolerance: float = 0.0) -> list[int]:
    """Keep the Pareto front of parameters vs latency: drop a size when a larger one is faster.

    `tolerance` (a fraction) ignores speed-ups smaller than measurement noise. The smallest size is
    always kept, so the knapsack stays as feasible as before.
    """
    latency = {s: unit_latency(unit, s, cost, tokens) for s in sizes}
    smallest = min(sizes, key=unit.params)
    return [
        s
        for s in sizes
        if s == smallest
        or not any(unit.params(t) > unit.params(s) and latency[t] * (1 + tolerance) < latency[s] for t in sizes)
    ]


def select(
    units: Sequence[Unit],
    cost,
    tokens: int,
    *,
    multiple: int = 8,
    steps: int = 4,
    tolerance: float = 0.0,
    resolution: int = 2000,
    progress=None,
) -> dict[str, int]:
    """GAC's sizes for every unit: aligned, non-cliff, within the proposal's parameter count."""
    if multiple < 1 or steps < 1:
        raise ValueError(f"multiple and steps must be >= 1, got multiple={multiple}, steps={steps}")
    groups = []
    for unit in units:
        sizes = unit_options(unit, cost, tokens, multiple, steps, tolerance)
        groups.append([Option(unit.params(s), unit.gain(s), s) for s in sizes])
        if progress is not None:
            progress.update(1)
    budget = total_params(units, proposed_sizes(units))
    solution = solve(groups, budget, resolution=resolution)
    return {u.name: g[c].label for u, g, c in zip(units, groups, solution.choice)}


def round_sizes(units: Sequence[Unit], multiple: int = 8, mode: str = "nearest") -> dict[str, int]:
    """The naive baseline: every proposed size rounded to a multiple (nearest ignores the budget, down keeps
    it, except that a size below one multiple becomes one multiple)."""
    if mode not in ROUNDING:
        raise ValueError(f"mode must be one of {ROUNDING}, got {mode!r}")
    sizes = {}
    for u in units:
        if u.proposed == u.full:
            sizes[u.name] = u.full
            continue
        rounded = multiple * (round(u.proposed / multiple) if mode == "nearest" else u.proposed // multiple)
        sizes[u.name] = min(max(multiple, rounded), u.full)
    return sizes
