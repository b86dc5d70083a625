"""What low rank's decode would save by forming its residual in one elementwise pass.

Today (lowrank.LowRank.decode) each shape group runs baddbmm (e = M - P Q^T) then bmm (P Q^T into the
bucket). The alternative times bmm once plus one subtraction pass (e = M - P Q^T from the product), the
cost a fused "swap and subtract" kernel would have at best. Both interleaved on the same tensors, 1
thread, per repeat; ms per million elements of M, median (min-max) over repeats.

    python bench/lowrank_residual.py [--rank 4] [--repeats 5]

Writes bench/results/lowrank_residual.md.
"""

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from provenance import git_commit, wait_for_quiet

SHAPES = [(4, 192, 512), (16, 192, 192), (4, 1376, 512), (4, 512, 1376), (16, 512, 512)]  # (count, rows, cols)


def best_of(fn, calls: int = 7) -> float:
    """Median seconds of `calls` runs after one untimed."""
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "lowrank_residual.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load = wait_for_quiet()
    lines = ["# Low rank's residual: baddbmm + bmm against bmm + one subtraction pass", "",
             f"Machine: {os.cpu_count()} cores, 1 torch thread; commit {git_commit()}; command: "
             f"`python bench/lowrank_residual.py --rank {args.rank} --repeats {args.repeats}`; load average "
             f"(1 min) {load:.2f} before. ms per million elements of M, median (min-max) over {args.repeats} "
             "interleaved repeats (each the median of 7 calls).", "",
             "| count x rows x cols | baddbmm + bmm (now) | bmm + subtract | now / alternative |", "|---|---|---|---|"]
    for count, rows, cols in SHAPES:
        m, out, e = (torch.randn(count, rows, cols) for _ in range(3))
        basis, q_t = torch.randn(count, rows, args.rank), torch.randn(count, args.rank, cols)
        per_million = 1e3 / (m.numel() / 1e6)
        now, alternative = [], []
        for _ in range(args.repeats):
            now.append(per_million * (best_of(lambda: torch.baddbmm(m, basis, q_t, alpha=-1, out=e))
                                      + best_of(lambda: torch.bmm(basis, q_t, out=out))))
            alternative.append(per_million * (best_of(lambda: torch.bmm(basis, q_t, out=out))
                                              + best_of(lambda: torch.sub(m, out, out=e))))
        ratios = [a / b for a, b in zip(now, alternative)]
        cell = lambda xs: f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"  # noqa: E731
        lines.append(f"| {count} x {rows} x {cols} | {cell(now)} | {cell(alternative)} | {cell(ratios)}x |")
    lines += ["", f"Load average (1 min) after: {os.getloadavg()[0]:.2f}."]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
