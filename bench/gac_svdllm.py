"""SVD-LLM against ASVD at equal parameter budgets on Gemma-3-270M, each raw, rounded down and with GAC.

For every parameter ratio (default 0.9 and 0.75 of the decoder Linears) and compressor, one
`netgain.align.compress` call (calibrated on the Python docs' library reference, GAC on kernel
latencies measured on this CPU) gives the GAC model; the raw and round-down models are built from
the same fit. Perplexity on two held-out corpora the calibration never saw: the KJV Bible and the
CPython standard library source. Also recorded: parameters vs the raw budget and % aligned to 8.

    python bench/gac_svdllm.py                  # writes bench/results/gac_svdllm.{md,json}
    python bench/gac_svdllm.py --quick          # smoke run: tiny calibration and evaluation, results to /tmp
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gac_models import kjv_text, stdlib_text  # noqa: E402

from netgain.align import AlignConfig, ASVDConfig, MeasuredCost, SVDLLMConfig, compress  # noqa: E402
from netgain.align.defaults import packaged_gemma, python_docs  # noqa: E402
from netgain.align.evaluate import perplexity, token_chunks  # noqa: E402
from netgain.cost.profile import cpu_name  # noqa: E402
from provenance import git_commit  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
COMPRESSORS = {"ASVD": ASVDConfig(), "SVD-LLM": SVDLLMConfig()}
CORPORA = {"kjv": kjv_text, "stdlib": stdlib_text}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ratios", default="0.9,0.75")
    parser.add_argument("--variants", default="raw,round-down,gac", help="built from each fit (the GAC model is compress's own)")
    parser.add_argument("--calib-seqs", type=int, default=16)
    parser.add_argument("--calib-len", type=int, default=256)
    parser.add_argument("--eval-chunks", type=int, default=4)
    parser.add_argument("--eval-len", type=int, default=512)
    parser.add_argument("--quick", action="store_true", help="smoke run: 2x64 calibration, 1x64 eval, one ratio")
    parser.add_argument("--out", default=None, help="results directory (default bench/results; /tmp/gac_svdllm with --quick)")
    args = parser.parse_args()
    if args.quick:
        args.ratios, args.calib_seqs, args.calib_len, args.eval_chunks, args.eval_len = "0.75", 2, 64, 1, 64
    ratios = [float(r) for r in args.ratios.split(",")]
    variants = args.variants.split(",")
    out = Path(args.out or ("/tmp/gac_svdllm" if args.quick else ROOT / "bench" / "results"))
    started, load_start, commit = time.time(), os.getloadavg()[0], git_commit()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = packaged_gemma()
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    calib = token_chunks(tokenizer, python_docs("calib"), args.calib_len, args.calib_seqs)
    held_out = {c: token_chunks(tokenizer, text(), args.eval_len, args.eval_chunks) for c, text in CORPORA.items()}
    cost = MeasuredCost("cpu", "float32", warmup=1, repeats=3, cache=ROOT / "runs" / "gac_svdllm_kernels.json")

    rows = [{"ratio": 1.0, "method": "dense", "variant": "dense", "vs_budget": float("nan"), "aligned_8": 1.0,
             **{f"ppl_{c}": perplexity(model, chunks) for c, chunks in held_out.items()}}]
    print(rows[-1], flush=True)
    for ratio in ratios:
        for method, compressor in COMPRESSORS.items():
            t0 = time.perf_counter()
            gac_model, result = compress(model, calib, AlignConfig(compressor, ratio, cost, tokens=args.eval_len), inplace=False)
            fit_s = time.perf_counter() - t0
            summary = result.summary()
            for variant in variants:
                candidate = gac_model if variant == "gac" else result.build(model, variant)
                rows.append({
                    "ratio": ratio, "method": method, "variant": variant, "fit_s": fit_s,
                    "vs_budget": summary[variant]["vs_budget"], "aligned_8": summary[variant]["aligned_8"],
                    **{f"ppl_{c}": perplexity(candidate, chunks) for c, chunks in held_out.items()},
                })
                print(rows[-1], flush=True)
                del candidate
            del gac_model, result

    command = f"python bench/gac_svdllm.py {' '.join(sys.argv[1:])}".strip()
    header = (
        "# SVD-LLM vs ASVD at equal parameter budget, raw / round-down / GAC (Gemma-3-270M, CPU)\n\n"
        f"Machine: {cpu_name()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, float32, no GPU; "
        f"load average {load_start:.2f} at the start, {os.getloadavg()[0]:.2f} at the end (perplexity does not depend on it). "
        f"Commit {commit}. Command: `{command}` ({(time.time() - started) / 60:.0f} min).\n\n"
        f"Calibration: {args.calib_seqs} x {args.calib_len} tokens of the Python docs' library reference. Perplexity: "
        f"{args.eval_chunks} x {args.eval_len} tokens of the KJV Bible (`bible -l0 gen1:1-rev22:21`) and of the CPython "
        "standard library source (*.py, sorted). Budget: the decoder Linears' parameters at the ratio; both compressors "
        "allocate ranks by the same predicted-loss knapsack. GAC: `netgain.align.compress`, candidates at multiples of 8 "
        f"within 4 steps, kernel latencies measured on this CPU ({cost.name}). vs budget = unit parameters / the raw "
        "compressor's; aligned = share of the decoder Linears whose size (rank, or unchanged) is a multiple of 8.\n\n"
    )
    head = ["ratio", "method", "variant", "params / budget", "aligned %8"] + [f"ppl {c}" for c in CORPORA]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"{r['ratio']:g}", r["method"], r["variant"], f"{r['vs_budget']:.4f}", f"{100 * r['aligned_8']:.0f}%"]
        lines.append("| " + " | ".join(cells + [f"{r[f'ppl_{c}']:.2f}" for c in CORPORA]) + " |")
    out.mkdir(parents=True, exist_ok=True)
    (out / "gac_svdllm.md").write_text(header + "\n".join(lines) + "\n")
    (out / "gac_svdllm.json").write_text(json.dumps({"command": command, "commit": commit, "machine": cpu_name(),
                                                     "rows": rows}, indent=1))
    print(header + "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
