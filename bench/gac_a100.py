"""The analytic A100 model against the GAC paper's five published rows (Llama-3-8B, prefill, batch 1, FP16).

Each row is priced at the sequence length its authors' script timed (`published.PAPER_SEQ_LEN`: the
dense and LLM-Pruner rows at S=1024, the ASVD rows at S=512). Prints and writes the table
(bench/results/gac_a100.md and .json) for the model as committed; with --fit it first re-runs the fit
of three constants (the native GEMM's efficiency, the align1 tier's, and the K % 16 tier's within
the paper's "up to ~70%") by grid search, minimising the worst relative error over the five rows and
the paper figure's three S=512 bars, and reports the best values (to be put into cost/kernels.py's
GPU defaults). align2 stays at the paper's ~30%. Also reported: every row at S=1024 and S=512, and
why no FLOP-respecting model reaches the ASVD rows if they were at S=1024.
Shapes: netgain.cost.published.

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
K16_PENALTY_BOUND = round(1 / 1.7, 2)  # ../shared/papers/gac.md: the m16n8k16 tile costs up to ~70% when K % 16 != 0


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


def worst_error(ms: dict[str, float], points: dict[str, float]) -> float:
    return max(abs(ms[k] / v - 1) for k, v in points.items())


def fit(recorders, points) -> tuple[float, dict]:
    """Grid search of efficiency, align1 and the K % 16 tier (the paper: up to ~70% slower, so >= 1/1.7)."""
    base, best = GPUS["a100"], None
    for native_k8 in np.arange(K16_PENALTY_BOUND, 1.0001, 0.04):
        for efficiency in np.arange(0.5, 0.951, 0.005):
            for align1 in np.arange(0.2, base.align2 + 1e-9, 0.02):
                gpu = dataclasses.replace(base, efficiency=round(float(efficiency), 3), align1=round(float(align1), 3),
                                          native_k8=round(float(native_k8), 3))
                error = worst_error(predicted_ms(recorders, gpu), points)
                if best is None or error < best[0] - 1e-9:
                    best = (error, {"efficiency": gpu.efficiency, "align1": gpu.align1, "native_k8": gpu.native_k8})
    return best


def gemm_flops(recorder) -> float:
    return sum(count * 2 * args[0] * args[1] * args[2] for (kind, args), count in recorder.asked.items() if kind == "gemm")


def gemm_ms(recorder, gpu) -> float:
    cost = AnalyticCost(gpu)
    return 1e3 * sum(count * cost.gemm(*args) for (kind, args), count in recorder.asked.items() if kind == "gemm")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fit", action="store_true", help="re-run the grid search for the two fitted constants")
    args = parser.parse_args()
    paper, seq, figure = published.PAPER_A100_MS, published.PAPER_SEQ_LEN, published.FIGURE_A100_MS_S512
    recorders, at = {}, {1024: {}, 512: {}}
    aligned = {}
    for name in paper:
        model = published.variant(name)
        for s, table in at.items():
            table[name] = Recorder()
            latency.predict(model, table[name], s, s, logits=s)
        recorders[name] = at[seq[name]][name]
        aligned[name] = published.aligned_fraction(model)
    # the fit's points: the five rows at their scripts' lengths, and the figure's S=512 bars of the pruner script
    points = {**paper, **{f"{n}@512": v for n, v in figure.items()}}
    fitted = {**recorders, **{f"{n}@512": at[512][n] for n in figure}}
    ranks = list(published.asvd_ranks(published.llama3_8b()).values())
    lines = []
    if args.fit:
        error, constants = fit(fitted, points)
        lines.append(f"Fit (grid search): {constants}, worst error {100 * error:.1f}% over the five rows (each at its script's "
                     "length) and the figure's three S=512 bars.\n")
    gpu = GPUS["a100"]
    ms = predicted_ms(recorders, gpu)
    ms_at = {s: predicted_ms(table, gpu) for s, table in at.items()}
    at512 = {f"{n}@512": ms_at[512][n] for n in figure}
    rows = [{"variant": n, "aligned_8_dims": aligned[n], "timed_at_seq": seq[n], "paper_ms": paper[n], "predicted_ms": ms[n],
             "error": ms[n] / paper[n] - 1, "predicted_ms_s1024": ms_at[1024][n], "predicted_ms_s512": ms_at[512][n],
             "figure_ms_s512": published.FIGURE_A100_MS_S512.get(n)} for n in paper]
    # if the ASVD rows were at S=1024: every ASVD+GAC GEMM at dense's own seconds per FLOP, the rest as dense
    dense_gemm, dense_total = gemm_ms(at[1024]["dense"], gpu), ms_at[1024]["dense"]
    flop_share = gemm_flops(at[1024]["asvd+gac"]) / gemm_flops(at[1024]["dense"])
    bound = (dense_total - dense_gemm + dense_gemm * flop_share) * paper["dense"] / dense_total
    lines += [
        "# Analytic A100 model vs the GAC paper (Llama-3-8B, prefill, batch 1, FP16, logits for every token)\n",
        f"Machine: {cpu_name()}, {os.cpu_count()} cores (a model, nothing timed), load average {os.getloadavg()[0]:.2f}. "
        f"Commit: {git_commit()}. Command: `python bench/gac_a100.py{' --fit' if args.fit else ''}`.\n",
        f"Constants (cost/kernels.py): native GEMM efficiency {gpu.efficiency}, align1 {gpu.align1} (both fitted), align2 {gpu.align2} "
        f"and native-k8 {gpu.native_k8} (the paper's penalties); shapes rebuilt as netgain/cost/published.py describes. Each row is "
        "priced at the length its authors' script timed (published.PAPER_SEQ_LEN): the table's dense and LLM-Pruner rows come "
        "from the LLM-Pruner script at S=1024, every ASVD latency script times S=512.\n",
        f"ASVD's ranks: {100 * sum(r % 8 == 0 for r in ranks) / len(ranks):.0f}% multiples of 8 (the paper: 5%); the K/N column "
        "counts every GEMM dimension, as the paper does for LLM-Pruner (83%).\n",
        "| variant | aligned K/N dims %8 | timed at S | paper ms | predicted ms | error | predicted at S=1024 | predicted at S=512 | figure at S=512 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [f"| {r['variant']} | {100 * r['aligned_8_dims']:.0f}% | {r['timed_at_seq']} | {r['paper_ms']:.1f} | {r['predicted_ms']:.1f} "
              f"| {100 * r['error']:+.1f}% | {r['predicted_ms_s1024']:.1f} | {r['predicted_ms_s512']:.1f} "
              f"| {'' if r['figure_ms_s512'] is None else format(r['figure_ms_s512'], '.1f')} |" for r in rows]
    lines.append(
        f"\nWorst error: {100 * worst_error(ms, paper):.1f}% over the five rows, {100 * worst_error({**ms, **at512}, points):.1f}% "
        f"with the figure's S=512 bars. ASVD raw / ASVD+GAC: predicted {ms['asvd'] / ms['asvd+gac']:.2f}, "
        f"paper {paper['asvd'] / paper['asvd+gac']:.2f}.\n\n"
        f"Why not S=1024 for the ASVD rows (as the paper's text says): ASVD+GAC keeps {100 * flop_share:.0f}% of dense's GEMM FLOPs "
        "in two GEMMs per layer. Even if every one of them ran at dense's own seconds per FLOP (no tile, wave or tier loss), "
        f"it would take {bound:.1f} ms at S=1024, {100 * (bound / paper['asvd+gac'] - 1):+.0f}% over the published 67.1 ms; "
        "no model that prices FLOPs and gets dense right reaches it.\n\n"
        f"At S=512 the figure's dense bar is {figure['dense']:.1f} ms, so the published ASVD+GAC is "
        f"{paper['asvd+gac'] / figure['dense']:.2f}x dense at the same length and raw ASVD {paper['asvd'] / figure['dense']:.2f}x; "
        f"the model gives {ms_at[512]['asvd+gac'] / ms_at[512]['dense']:.2f}x and {ms_at[512]['asvd'] / ms_at[512]['dense']:.2f}x. "
        "Measured on their own script's terms, the factorised models run slower against dense than tile, wave and tier "
        "physics predicts, so the fit meets them from both sides (dense at S=512 over-predicted, ASVD+GAC under). The ASVD "
        "runs used another software environment (conda env svdllm; the pruner's its own) and perf_counter around the "
        "call; neither is modelled.\n"
    )
    text = "\n".join(lines)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gac_a100.md").write_text(text)
    (RESULTS / "gac_a100.json").write_text(json.dumps({"constants": dataclasses.asdict(gpu), "rows": rows,
                                                       "asvd_gac_bound_ms_s1024": bound}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
