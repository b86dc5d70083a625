"""Why low rank's Global-QSGD factors carry one scale per column: a power iteration (PowerSGD's, with
warm start, n workers) whose factors are stochastically rounded to 8 bits against one global scale
per matrix or per column, and the relative error of the result P Q^T against fp32 factors.

    python bench/lowrank_columns.py [--rows 768] [--cols 192] [--rank 4] [--workers 3] [--steps 30] [--seeds 3]

Gradients: a shared signal whose 16 singular values fall from 1 to 0.01, plus per-worker noise.
Writes bench/results/lowrank_columns_synthetic.md (steps-to-target evidence: lowrank_columns.md).
"""

import argparse
import statistics
from pathlib import Path

import torch

from provenance import git_commit

LEVELS = 127


def rounded(x, scale, generator):
    """Unbiased stochastic rounding of x to LEVELS levels of scale (broadcast)."""
    q = x / scale * LEVELS
    low = q.floor()
    return (low + (torch.rand(q.shape, generator=generator) < q - low).float()) * scale / LEVELS


def mean_error(per_column: bool, args, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    signal = (torch.randn(args.rows, 16, generator=g) * torch.logspace(0, -2, 16)) @ torch.randn(args.cols, 16, generator=g).T
    warm = torch.randn(args.cols, args.rank, generator=g)

    def global_scale(factors):  # MAX over workers of max |factor| per matrix or per column
        return torch.stack([f.abs().amax(0, keepdim=True) if per_column else f.abs().amax() for f in factors]).amax(0)

    def quantized_mean(factors):
        scale = global_scale(factors)
        return sum(rounded(f, scale, g) for f in factors) / len(factors)

    errors = []
    for _ in range(args.steps):
        grads = [signal + 0.3 * torch.randn(args.rows, args.cols, generator=g) for _ in range(args.workers)]
        basis = torch.linalg.qr(quantized_mean([m @ warm for m in grads])).Q
        exact_basis = torch.linalg.qr(sum(m @ warm for m in grads) / args.workers).Q
        q = quantized_mean([m.T @ basis for m in grads])
        exact = exact_basis @ (sum(m.T @ exact_basis for m in grads) / args.workers).T
        errors.append(float((basis @ q.T - exact).norm() / exact.norm()))
        warm = q
    return statistics.mean(errors[5:])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("rows", 768), ("cols", 192), ("rank", 4), ("workers", 3), ("steps", 30), ("seeds", 3)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    results = {kind: [mean_error(kind == "column", args, seed) for seed in range(args.seeds)] for kind in ("matrix", "column")}
    lines = ["# Low-rank factors in 8 bits: one scale per matrix or per column (synthetic power iteration)", "",
             f"Commit {git_commit()}; command: `python bench/lowrank_columns.py --rows {args.rows} --cols {args.cols} "
             f"--rank {args.rank} --workers {args.workers} --steps {args.steps} --seeds {args.seeds}`. Relative error of "
             "P Q^T against fp32 factors, mean over steps 5 on, per seed; median (min-max) over seeds.", "",
             "| scale | relative error |", "|---|---|"]
    for kind, values in results.items():
        lines.append(f"| per {kind} | {statistics.median(values):.4f} ({min(values):.4f}-{max(values):.4f}) |")
    out = Path(__file__).parent / "results" / "lowrank_columns_synthetic.md"
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())


if __name__ == "__main__":
    main()
