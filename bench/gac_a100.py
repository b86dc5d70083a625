"""The analytic A100 model against the GAC paper's five published rows (Llama-3-8B, prefill S=1024, batch 1, FP16).

Prints and writes the table (bench/results/gac_a100.md and .json) for the model as committed; with
--fit it first re-runs the fit of two constants (the native GEMM's efficiency and the align1 tier's)
by grid search, minimising the worst relative error over the rows that agree with FLOP accounting
(dense, LLM-Pruner, LLM-Pruner+GAC) and ASVD's raw/GAC ratio, and reports the best values (to be
put into cost/kernels.py's GPU defaults). The align2 tier is not fitted (one pruner row cannot
tell the two tiers apart): it is the paper's measured ~30% penalty. Shapes: netgain.cost.published.

    python bench/gac_a100.py [--fit]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys
from pathlib import Path

import numpy as np

from netgain.cost import latency, published
from netgain.cost.kernels import GPUS, AnalyticCost
from netgain.cost.measured import cpu_name

sys.path.insert(0, str(Path(__file__).parent))
from provenance import git_commit  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
FIT_ROWS = ("dense", "llm-pruner", "llm-pruner+gac")
ALIGN2 = round(1 / 1.3, 3)  # ../shared/papers/gac.md: the align2 kernel tier costs ~30%


class Recorder:
    """Records what `latency.predict` asks of a cost model, so any cost model can re-price it quickly."""

    host_bound = False

    def __init__(self):
        self.asked = collections.Counter()

    def __getattr__(self, kind):
        def ask(*args):
            self.asked[(kind, tuple(a if isinstance(a, (int, float, tuple)) else None for a in args))] += 1
            return 0.0

        return ask

    def price(self, cost) -> float:
        return sum(count * getattr(cost, kind)(*args) for (kind, args), count in self.asked.items())


def predicted_ms(recorders, gpu) -> dict[str, float]:
    cost = AnalyticCost(gpu)
    return {name: 1e3 * r.price(cost) for name, r in recorders.items()}


def worst_error(ms: dict[str, float]) -> float:
    paper = published.PAPER_A100_MS
    ratio = (ms["asvd"] / ms["asvd+gac"]) / (paper["asvd"] / paper["asvd+gac"]) - 1
    return max([abs(ms[r] / paper[r] - 1) for r in FIT_ROWS] + [abs(ratio)])


def fit(recorders) -> tuple[float, dict]:
    base, best = GPUS["a100"], None
    for efficiency in np.arange(0.5, 0.851, 0.01):
        for align1 in np.arange(0.2, ALIGN2 + 1e-9, 0.01):
            gpu = dataclasses.replace(base, efficiency=round(float(efficiency), 3), align2=ALIGN2, align1=round(float(align1), 3))
            error = worst_error(predicted_ms(recorders, gpu))
            if best is None or error < best[0] - 1e-9:
                best = (error, {"efficiency": gpu.efficiency, "align1": gpu.align1, "align2 (fixed)": ALIGN2})
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fit", action="store_true", help="re-run the grid search for the three fitted constants")
    args = parser.parse_args()
    seq = published.SEQ_LEN
    recorders, at_512, aligned = {}, {}, {}
    for name in published.PAPER_A100_MS:
        model = published.variant(name)
        recorders[name], at_512[name] = Recorder(), Recorder()
        latency.predict(model, recorders[name], seq, seq, logits=seq)
        latency.predict(model, at_512[name], 512, 512, logits=512)
        aligned[name] = published.aligned_fraction(model)
    ranks = list(published.asvd_ranks(published.llama3_8b()).values())
    lines = []
    if args.fit:
        error, constants = fit(recorders)
        lines.append(f"Fit (grid search): {constants}, worst error {100 * error:.1f}% over {', '.join(FIT_ROWS)} and the ASVD raw/GAC ratio.\n")
    gpu = GPUS["a100"]
    ms, ms_512 = predicted_ms(recorders, gpu), predicted_ms(at_512, gpu)
    paper = published.PAPER_A100_MS
    rows = [{"variant": n, "aligned_8_dims": aligned[n], "paper_ms": paper[n], "predicted_ms": ms[n], "error": ms[n] / paper[n] - 1,
             "predicted_ms_s512": ms_512[n]} for n in paper]
    ratio = ms["asvd"] / ms["asvd+gac"], paper["asvd"] / paper["asvd+gac"]
    lines += [
        "# Analytic A100 model vs the GAC paper (Llama-3-8B, prefill S=1024, batch 1, FP16, logits for every token)\n",
        f"Machine: {cpu_name()}, {os.cpu_count()} cores (a model, nothing timed), load average {os.getloadavg()[0]:.2f}. "
        f"Commit: {git_commit()}. Command: `python bench/gac_a100.py{' --fit' if args.fit else ''}`.\n",
        f"Constants (cost/kernels.py): native GEMM efficiency {gpu.efficiency}, align2 {gpu.align2}, align1 {gpu.align1}, "
        f"native-k8 {gpu.native_k8}; shapes rebuilt as netgain/cost/published.py describes.\n",
        f"ASVD's ranks: {100 * sum(r % 8 == 0 for r in ranks) / len(ranks):.0f}% multiples of 8 (the paper: 5%); the K/N column "
        "counts every GEMM dimension, as the paper does for LLM-Pruner (83%).\n",
        "| variant | aligned K/N dims %8 | paper ms | predicted ms | error | predicted ms at S=512 |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {r['variant']} | {100 * r['aligned_8_dims']:.0f}% | {r['paper_ms']:.1f} | {r['predicted_ms']:.1f} | {100 * r['error']:+.1f}% "
              f"| {r['predicted_ms_s512']:.1f} |" for r in rows]
    lines.append(
        f"\nASVD raw / ASVD+GAC: predicted {ratio[0]:.2f}, paper {ratio[1]:.2f} ({100 * (ratio[0] / ratio[1] - 1):+.1f}%). "
        f"ASVD+GAC / dense: predicted {ms['asvd+gac'] / ms['dense']:.2f}, paper {paper['asvd+gac'] / paper['dense']:.2f}: "
        "ASVD+GAC keeps 85% of dense's GEMM FLOPs, in two GEMMs per layer, so no model that prices FLOPs and gets dense "
        "right puts it below ~0.85 of dense; the paper's 0.67 (and its ASVD rows' absolute level) is not reachable.\n"
        "A lead, not a fit: the authors' ASVD script (scripts/asvd_gac_experiment.py) times with its benchmark's default "
        "S=512 (perf_counter, mean of 10 runs), their LLM-Pruner script S=1024 with CUDA events; at S=512 the model gives "
        f"ASVD {ms_512['asvd']:.1f} ms ({100 * (ms_512['asvd'] / paper['asvd'] - 1):+.0f}%) and ASVD+GAC {ms_512['asvd+gac']:.1f} ms "
        f"({100 * (ms_512['asvd+gac'] / paper['asvd+gac'] - 1):+.0f}%).\n"
    )
    text = "\n".join(lines)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gac_a100.md").write_text(text)
    (RESULTS / "gac_a100.json").write_text(json.dumps({"constants": dataclasses.asdict(gpu), "rows": rows}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
