"""Time netgain.plan.solve on a GAC-sized instance: 224 matrices x 16 candidate ranks.

The instance mimics GAC on Llama-3-8B (32 layers x 7 projections): each matrix (m x n) has a
compressor rank r* and 16 candidates at multiples of 8 around it; weight = r (m + n) parameters,
value = s (weight - weight*), budget = sum of weight*. Writes bench/results/plan.md.

    python bench/plan_bench.py
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from netgain.plan import solve
from provenance import git_commit

SHAPES = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336)]
REPEATS = 5


def gac_like_instance(seed: int = 0):
    rng = np.random.default_rng(seed)
    groups, budget = [], 0
    for layer in range(32):
        for m, n in SHAPES:
            full = m * n // (m + n)
            r_star = int(full * rng.uniform(0.6, 0.9))
            s = rng.lognormal(0.0, 1.0)
            ranks = [max(8, 8 * (r_star // 8) + 8 * k) for k in range(-8, 8)]
            groups.append([(r * (m + n), s * (r - r_star) * (m + n)) for r in ranks])
            budget += r_star * (m + n)
    return groups, budget


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def timed(fn):
    times, result = [], None
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def main() -> int:
    groups, budget = gac_like_instance()
    _, reference = timed(lambda: solve(groups, budget, method="exact", resolution=50_000))
    rows = []
    for method, resolution in [("exact", 1000), ("exact", 2000), ("exact", 10_000), ("greedy", 1000), ("auto", 1000)]:
        seconds, sol = timed(lambda: solve(groups, budget, method=method, resolution=resolution))
        rows.append((method, resolution, seconds, sol))
    commit = git_commit()
    lines = [
        "# netgain.plan: multi-choice knapsack timing",
        "",
        f"Instance: {len(groups)} groups x {len(groups[0])} options (GAC-like: Llama-3-8B projection shapes,",
        "ranks at multiples of 8 around r*, value = s (|W(r)| - |W*|), budget = sum |W*|).",
        f"Machine: {cpu_model()}, {os.cpu_count()} cores shared with other jobs, no GPU.",
        f"Commit: {commit}. Command: `python bench/plan_bench.py`. Median of {REPEATS} runs.",
        f"Reference value: exact at resolution 50,000 = {reference.value:.6g}.",
        "",
        "| method | resolution | time (ms) | weight / budget | value | value gap to reference | winner |",
        "|---|---|---|---|---|---|---|",
    ]
    for method, resolution, seconds, sol in rows:
        gap = (reference.value - sol.value) / abs(reference.value) if reference.value else 0.0
        lines.append(
            f"| {method} | {resolution} | {seconds * 1e3:.1f} | {sol.weight / budget:.6f} | {sol.value:.6g} | {gap:+.2e} | {sol.method} |"
        )
    out = Path(__file__).parent / "results" / "plan.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
