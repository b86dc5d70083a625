"""The CPU latency model checked end to end: predicted vs measured prefill and decode of whole Gemma-3-270M models.

Variants from `netgain.align.compress` (ASVD at parameter ratio 0.85, calibrated on the Python docs'
library reference, GAC priced by kernels measured on this CPU): dense, raw ASVD, round-down to 8, GAC.
For each: `netgain.cost.latency.predict` under the measured cost table (kernels + per-layer
overheads, broken down) next to `evaluate.interleaved_latency` (every variant's prefill and decode
timed once per round, rotating order, outliers rejected), prefill S=512 with last-token logits and
one decode step on a 512-token cache, batch 1. The noise band is the spread (IQR / median) of the
measured samples and of the kernel table. Run it on a quiet machine (see the coordination rules).

    python bench/gac_latency.py [--repeats 7]   # writes bench/results/gac_latency.md and .json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from netgain.align import ASVDConfig, AlignConfig, compress, evaluate
from netgain.align.defaults import packaged_gemma, python_docs
from netgain.cost.latency import predict
from netgain.cost.measured import MeasuredCost, cpu_name

sys.path.insert(0, str(Path(__file__).parent))
from provenance import git_commit  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
RUNS = ROOT / "runs"
VARIANTS = ("dense", "raw", "round-down", "gac")
SEQ = 512


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds of the whole models (and of each kernel)")
    parser.add_argument("--model", default=str(RUNS / "gemma3-270m"), help="Gemma-3-270M directory (converted on first use)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    load_before = os.getloadavg()[0]
    started = time.time()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = packaged_gemma(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    calib = evaluate.token_chunks(tokenizer, python_docs("calib"), 256, 8)
    kernels = RUNS / "gac_latency_kernels.json"  # measured in this run, not reused
    kernels.unlink(missing_ok=True)
    cost = MeasuredCost("cpu", "float32", warmup=2, repeats=args.repeats, cache=kernels)
    config = AlignConfig(ASVDConfig(), param_ratio=0.85, cost=cost, tokens=SEQ, tolerance=0.0)
    _, compression = compress(model, calib, config, inplace=False)
    models = {v: model if v == "dense" else compression.build(model, v) for v in VARIANTS}

    predicted = {v: {"prefill": predict(m, cost, SEQ, SEQ), "decode": predict(m, cost, 1, SEQ + 1)} for v, m in models.items()}
    cost.save()
    measured = evaluate.interleaved_latency(models, SEQ, repeats=args.repeats, warmup=2)
    load_after = os.getloadavg()[0]

    rows = []
    for v in VARIANTS:
        for phase in ("prefill", "decode"):
            p, m = predicted[v][phase], measured[v]
            rows.append({
                "variant": v, "phase": phase, "predicted_ms": 1e3 * p.total_s, "measured_ms": 1e3 * m[f"{phase}_s"],
                "error": p.total_s / m[f"{phase}_s"] - 1, "measured_spread": m[f"{phase}_spread"],
                **{f"{k}_ms": 1e3 * s for k, s in p.as_dict().items() if k not in ("total_s",)},
            })
    summary = compression.summary()
    lines = [
        "# CPU latency model vs measured whole models (Gemma-3-270M, float32)\n",
        f"Machine: {cpu_name()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads; load average (1 min) "
        f"{load_before:.2f} before, {load_after:.2f} after (quiet-machine protocol). Commit: {git_commit()}. "
        f"Command: `python bench/gac_latency.py {' '.join(sys.argv[1:])}`. Took {time.time() - started:.0f} s.\n",
        f"Variants: netgain.align.compress, ASVD at parameter ratio 0.85 (calibration 8 x 256 tokens of the Python docs' "
        f"library reference); GAC priced by the kernel table measured in this run ({len(cost.table)} entries, "
        f"typical spread {100 * cost.noise:.1f}%). Prefill S={SEQ} (last-token logits), decode one token on a {SEQ}-token "
        f"cache, batch 1. Measured: median of {args.repeats} interleaved rounds after outlier rejection; spread = IQR / median.\n",
        "| variant | aligned %8 | phase | predicted ms | measured ms | error | measured spread | GEMM ms | attention ms | norms ms | activation ms | glue ms | framework ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        aligned = summary[r["variant"]]["aligned_8"]
        lines.append(
            f"| {r['variant']} | {100 * aligned:.0f}% | {r['phase']} | {r['predicted_ms']:.1f} | {r['measured_ms']:.1f} | {100 * r['error']:+.1f}% "
            f"| {100 * r['measured_spread']:.1f}% | {r['gemm_s_ms']:.1f} | {r['attention_s_ms']:.1f} | {r['norm_s_ms']:.1f} "
            f"| {r['activation_s_ms']:.1f} | {r['glue_s_ms']:.1f} | {r['framework_s_ms']:.1f} |"
        )
    worst = max(abs(r["error"]) for r in rows)
    lines.append(f"\nWorst error {100 * worst:.1f}%; measured spread up to {100 * max(r['measured_spread'] for r in rows):.1f}%.\n")
    text = "\n".join(lines)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "gac_latency.md").write_text(text)
    (RESULTS / "gac_latency.json").write_text(json.dumps({"rows": rows, "summary": summary, "load_before": load_before,
                                                          "load_after": load_after, "noise": cost.noise}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
