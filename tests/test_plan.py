"""The knapsack solver against brute force on small random instances, and its argument checks."""

import itertools
import random

import numpy as np
import pytest

from netgain.plan import Option, Solution, solve


def brute_force(groups, budget):
    """Best total value over every feasible combination (None if nothing fits)."""
    best = None
    for combo in itertools.product(*[range(len(g)) for g in groups]):
        w = sum(groups[i][c][0] for i, c in enumerate(combo))
        v = sum(groups[i][c][1] for i, c in enumerate(combo))
        if w <= budget and (best is None or v > best):
            best = v
    return best


def random_instance(rng, integer, max_groups=5, max_options=4):
    groups = []
    for _ in range(rng.randint(1, max_groups)):
        n = rng.randint(1, max_options)
        if integer:
            groups.append([(rng.randint(0, 12), rng.randint(-20, 20)) for _ in range(n)])
        else:
            groups.append([(rng.uniform(0, 10), rng.uniform(-5, 5)) for _ in range(n)])
    lightest = sum(min(w for w, _ in g) for g in groups)
    heaviest = sum(max(w for w, _ in g) for g in groups)
    return groups, (rng.randint(lightest, heaviest) if integer else rng.uniform(lightest, heaviest))


def check_feasible(groups, budget, sol):
    assert len(sol.choice) == len(groups)
    assert sol.weight == pytest.approx(sum(groups[i][c][0] for i, c in enumerate(sol.choice)))
    assert sol.value == pytest.approx(sum(groups[i][c][1] for i, c in enumerate(sol.choice)))
    assert sol.weight <= budget + 1e-9


@pytest.mark.parametrize("seed", range(200))
def test_exact_matches_brute_force_on_integer_weights(seed):
    # integer weights whose slack fits in `resolution` units: quantisation is lossless
    rng = random.Random(seed)
    groups, budget = random_instance(rng, integer=True)
    sol = solve(groups, budget, method="exact", resolution=1000)
    check_feasible(groups, budget, sol)
    assert sol.value == brute_force(groups, budget)


@pytest.mark.parametrize("seed", range(200))
def test_exact_is_feasible_and_loses_at_most_one_unit_per_group(seed):
    rng = random.Random(1000 + seed)
    groups, budget = random_instance(rng, integer=False)
    resolution = rng.choice([5, 50, 1000])
    sol = solve(groups, budget, method="exact", resolution=resolution)
    check_feasible(groups, budget, sol)
    optimum = brute_force(groups, budget)
    assert sol.value <= optimum + 1e-9
    # rounding up costs < 1 unit per group: anything fitting in budget - n * unit is still reachable
    slack = budget - sum(min(w for w, _ in g) for g in groups)
    shrunk = budget - len(groups) * slack / resolution
    reachable = brute_force(groups, shrunk)
    if reachable is not None:
        assert sol.value >= reachable - 1e-9


@pytest.mark.parametrize("seed", range(100))
def test_greedy_is_feasible_and_no_better_than_optimum(seed):
    rng = random.Random(5000 + seed)
    groups, budget = random_instance(rng, integer=seed % 2 == 0)
    sol = solve(groups, budget, method="greedy")
    check_feasible(groups, budget, sol)
    assert sol.value <= brute_force(groups, budget) + 1e-9
    lightest = sum(max(v for w, v in g if w == min(x for x, _ in g)) for g in groups)
    assert sol.value >= lightest - 1e-9


def test_option_objects_labels_and_auto_method():
    groups = [
        [Option(1, 1.0, "a"), Option(3, 5.0, "b")],
        [Option(2, 2.0), Option(4, 3.0)],
    ]
    sol = solve(groups, 5)
    assert isinstance(sol, Solution)
    assert sol.method == "exact"  # auto: a problem this small is solved exactly
    assert sol.choice == [1, 0]
    assert (sol.weight, sol.value) == (5.0, 7.0)


def test_greedy_matches_exact_on_concave_groups():
    # diminishing returns per group (concave value curves): LP greedy is optimal at hull points
    groups = [[(w, scale * np.sqrt(w)) for w in range(0, 17, 4)] for scale in (1.0, 2.0, 3.0)]
    exact = solve(groups, 24, method="exact")
    greedy = solve(groups, 24, method="greedy")
    assert greedy.value == pytest.approx(exact.value)


def test_zero_slack_takes_the_lightest_options():
    sol = solve([[(2.5, 1.0), (3.0, 9.0)], [(1.5, 0.0), (1.5, 4.0)]], 4.0, method="exact")
    assert sol.choice == [0, 1]


@pytest.mark.parametrize("method", ["exact", "greedy"])
def test_large_instance_is_feasible_and_no_single_swap_improves_it(method):
    rng = np.random.default_rng(0)
    groups = [list(zip(rng.uniform(1e5, 1e6, 16), rng.normal(size=16))) for _ in range(224)]
    budget = sum(sum(w for w, _ in g) / 16 for g in groups)
    sol = solve(groups, budget, method=method, resolution=2000)
    assert sol.weight <= budget
    leftover = budget - sol.weight
    for g, c in zip(groups, sol.choice):
        for w, v in g:
            assert w - g[c][0] > leftover or v <= g[c][1]


@pytest.mark.parametrize(
    "groups, budget, kwargs, message",
    [
        ([], 1, {}, "at least one group"),
        ([[]], 1, {}, "group 0 has no options"),
        ([[(-1, 0)]], 1, {}, "weights must be >= 0"),
        ([[(1, float("nan"))]], 1, {}, "finite"),
        ([[(1, 0)], [(3, 0), (2, 1)]], 2.5, {}, r"lightest option of every group weighs 3 .* budget 2.5"),
        ([[(1, 0)]], 1, {"method": "fast"}, "method must be one of"),
        ([[(1, 0)]], 1, {"resolution": 0}, "resolution must be a positive integer"),
        ([[(1, 0)]], -1, {}, "budget must be"),
        ([[(1, 0, 3)]], 1, {}, "Option or"),
    ],
)
def test_bad_arguments_raise_clear_errors(groups, budget, kwargs, message):
    with pytest.raises(ValueError, match=message):
        solve(groups, budget, **kwargs)
