"""GAC: re-select each unit's size among hardware-aligned, non-cliff candidates under the compressor's budget.

Given a compressor's units (proposed size d_i*, a value per size), GAC offers each unit the multiples of
the alignment within a few steps of d_i* and no smaller than round-down's (TRUST_REGION), adds
"leave it unchanged" where compressing at d_i*
does not pay in latency, drops the latency cliffs that the cost model (measured or analytic)
shows — a candidate slower than a larger candidate of the same unit — and solves the knapsack

    maximise  sum_i s_i (|W_i(d_i)| - |W_i(d_i*)|)   subject to   sum_i |W_i(d_i)| <= sum_i |W_i(d_i*)|

with `netgain.plan`. The value is `Unit.gain`: this linear form, or, where the compressor predicts
its loss at every size (ASVD's Fisher-predicted loss increase, the pruner's pruned salience), the
exact difference of that curve, so GAC optimises the compressor's own objective over aligned sizes.
The naive baselines round every size to the alignment. GAC cannot lose to round-down on its own
terms: round-down's size is always a candidate (never dropped as a cliff), and when the knapsack's
answer is no better on the objective than round-down's sizes (budget quantisation, ties), the
faster of the two under the cost model is returned, round-down on a tie.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from ..plan import Option, solve
from .units import Unit, proposed_sizes, total_params

ROUNDING = ("nearest", "down")
# how far below its proposal (a fraction) GAC may cut a unit under round-down's size: none. The value
# curve is the compressor's local prediction on the calibration text, and on held-out text it misjudged
# every cut under round-down measured: ASVD at 0.85 cutting small ranks by 17-33% cost +5.3% KJV
# perplexity (an earlier bench/results/gac_grid.md), and one o_proj cut by 9% (176 -> 160) +4.5% on
# the stdlib (interval 3.3-5.7%; bench/results/gac_trust_region.md), against round-down. So GAC spends
# only what round-down leaves of the budget.
TRUST_REGION = 0.0


def unit_latency(unit: Unit, size: int, cost, tokens: int) -> float:
    """Seconds the unit's GEMMs take at this size for `tokens` tokens under a cost model."""
    return sum(cost.gemm(m, k, n) for m, k, n in unit.gemms(size, tokens))


def candidate_sizes(unit: Unit, multiple: int, steps: int, trust: float = TRUST_REGION) -> list[int]:
    """Sizes at multiples of `multiple` within `steps` multiples of the proposal that save parameters,
    and round-down's size. Below round-down only within `trust` of the proposal (TRUST_REGION: not at
    all, unless round-down itself is over budget; `select` then passes 1.0)."""
    center = multiple * round(unit.proposed / multiple)
    dense = unit.params(unit.full)
    down = round_size(unit, multiple, "down")
    # only the steps between `multiple` and the full size: --steps 1e30 looped for ever
    lowest, highest = max(-steps, 1 - center // multiple), min(steps, (unit.full - 1 - center) // multiple)
    sizes = {center + k * multiple for k in range(lowest, highest + 1)}
    near = {s for s in sizes if multiple <= s < unit.full and unit.params(s) < dense
            and (s >= down or s >= (1 - trust) * unit.proposed)}
    return sorted(near | {down})


def unit_options(unit: Unit, cost, tokens: int, multiple: int, steps: int, tolerance: float = 0.0,
                 trust: float = TRUST_REGION) -> list[int]:
    """GAC's candidates for one unit: aligned sizes near the proposal, plus "unchanged" where compressing
    at the proposed size does not pay in latency, minus the cliffs (round-down's size is never dropped).
    Speed-ups within the cost's timing spread (`noise`, where it has one) are not cliffs."""
    if unit.proposed == unit.full:
        return [unit.full]
    tolerance = max(tolerance, getattr(cost, "noise", 0.0))
    sizes = candidate_sizes(unit, multiple, steps, trust)
    if unit_latency(unit, unit.full, cost, tokens) <= unit_latency(unit, unit.proposed, cost, tokens):
        sizes.append(unit.full)
    return drop_cliffs(unit, sizes, cost, tokens, tolerance, keep=round_size(unit, multiple, "down"))


def drop_cliffs(unit: Unit, sizes: Sequence[int], cost, tokens: int, tolerance: float = 0.0, keep: int | None = None) -> list[int]:
    """Keep the Pareto front of parameters vs latency: drop a size when a larger one is faster.

    `tolerance` (a fraction) ignores speed-ups smaller than measurement noise. `keep` (round-down's
    size) is always kept, and a size below it that is not faster is always dropped, noise or not: the
    objective and the cost model would both rank it below round-down. The smallest size is kept
    otherwise, so the knapsack stays as feasible as before.
    """
    latency = {s: unit_latency(unit, s, cost, tokens) for s in sizes}
    smallest = min(sizes, key=unit.params)
    below = lambda s: keep is not None and unit.params(s) < unit.params(keep) and latency[s] >= latency[keep]
    return [
        s
        for s in sizes
        if s == keep
        or not below(s) and (s == smallest
                             or not any(unit.params(t) > unit.params(s) and latency[t] * (1 + tolerance) < latency[s] for t in sizes))
    ]


def objective(units: Sequence[Unit], sizes: Mapping[str, int]) -> float:
    """What GAC maximises: the summed gain of moving every unit from its proposal to `sizes`."""
    return sum(u.gain(sizes[u.name]) for u in units)


def latency(units: Sequence[Unit], sizes: Mapping[str, int], cost, tokens: int) -> float:
    """The units' summed GEMM seconds at `sizes` under a cost model."""
    return sum(unit_latency(u, sizes[u.name], cost, tokens) for u in units)


def no_worse_than(units: Sequence[Unit], chosen: dict[str, int], baseline: dict[str, int], cost, tokens: int,
                  rel: float = 1e-9) -> dict[str, int]:
    """`chosen`, unless `baseline` (within the same budget) is better on the objective, or ties it
    (within `rel` of the objective's scale) and is no slower: then `baseline`."""
    if total_params(units, baseline) > total_params(units, proposed_sizes(units)):
        return chosen
    ours, theirs = objective(units, chosen), objective(units, baseline)
    tie = abs(ours - theirs) <= rel * max(1.0, abs(ours), abs(theirs))
    if (theirs > ours and not tie) or (tie and latency(units, baseline, cost, tokens) <= latency(units, chosen, cost, tokens)):
        return dict(baseline)
    return chosen


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
    """GAC's sizes for every unit: aligned, non-cliff, within the proposal's parameter count.

    A measured cost times every candidate's GEMMs first, interleaved (`measure_gemms`), and a speed-up
    counts as a cliff only above both `tolerance` and the spread of its timings (`noise`).
    """
    if multiple < 1 or steps < 1:
        raise ValueError(f"multiple and steps must be >= 1, got multiple={multiple}, steps={steps}")
    if hasattr(cost, "measure_gemms"):
        sizes = {u.name: candidate_sizes(u, multiple, steps, trust=1.0) + [u.proposed, u.full] for u in units}
        cost.measure_gemms({g for u in units for s in sizes[u.name] for g in u.gemms(s, tokens)})
    budget = total_params(units, proposed_sizes(units))
    down = round_sizes(units, multiple, "down")
    # the trust region keeps round-down feasible, unless round-down itself is over budget (sizes below one multiple)
    trust = TRUST_REGION if total_params(units, down) <= budget else 1.0
    groups = []
    for unit in units:
        sizes = unit_options(unit, cost, tokens, multiple, steps, tolerance, trust)
        groups.append([Option(unit.params(s), unit.gain(s), s) for s in sizes])
        if progress is not None:
            progress.update(1)
    solution = solve(groups, budget, resolution=resolution)
    chosen = {u.name: g[c].label for u, g, c in zip(units, groups, solution.choice)}
    return no_worse_than(units, chosen, down, cost, tokens)


def round_size(unit: Unit, multiple: int, mode: str) -> int:
    """One unit's naive size: its proposal rounded to a multiple (at least one multiple, at most full)."""
    if mode not in ROUNDING:
        raise ValueError(f"mode must be one of {ROUNDING}, got {mode!r}")
    if unit.proposed == unit.full:
        return unit.full
    rounded = multiple * (round(unit.proposed / multiple) if mode == "nearest" else unit.proposed // multiple)
    return min(max(multiple, rounded), unit.full)


def round_sizes(units: Sequence[Unit], multiple: int = 8, mode: str = "nearest") -> dict[str, int]:
    """The naive baseline: every proposed size rounded to a multiple (nearest ignores the budget, down keeps
    it, except that a size below one multiple becomes one multiple)."""
    return {u.name: round_size(u, multiple, mode) for u in units}
