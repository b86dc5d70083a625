"""GAC against the naive rounding baselines across compressors, parameter ratios and held-out corpora.

Gemma-3-270M (float32); calibration on the Python docs' library reference (8 x 256 tokens);
perplexity on two corpora the calibration never sees: the King James Bible and the CPython
standard library source (4 x 512 tokens each). Cells: ASVD and the pruner (`netgain.align.compress`)
at parameter ratios 0.9, 0.85 and 0.75; in each, raw, round-down, round-nearest and GAC (priced by
the analytic A100 model: deterministic and independent of this machine's load). Reported per cell:
unit parameters against the raw budget, alignment to 8, perplexity per corpus, and GAC's
perplexity ratio to round-down. Nothing here is timed.

    python bench/gac_grid.py     # writes bench/results/gac_grid.md and .json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from netgain.align import AlignConfig, ASVDConfig, PrunerConfig, compress, evaluate
from netgain.align.defaults import packaged_gemma, python_docs
from netgain.cost.measured import cpu_name

sys.path.insert(0, str(Path(__file__).parent))
from gac_models import kjv_text, stdlib_text  # noqa: E402
from provenance import git_commit  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
METHODS = {"asvd": ASVDConfig(), "pruner": PrunerConfig()}
RATIOS = (0.9, 0.85, 0.75)
VARIANTS = ("raw", "round-down", "round-nearest", "gac")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "runs" / "gemma3-270m"), help="Gemma-3-270M directory (converted on first use)")
    parser.add_argument("--eval-chunks", type=int, default=4)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started = time.time()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = packaged_gemma(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    calib = evaluate.token_chunks(tokenizer, python_docs("calib"), 256, 8)
    corpora = {"kjv": kjv_text(), "stdlib": stdlib_text()}
    held_out = {name: evaluate.token_chunks(tokenizer, text, 512, args.eval_chunks) for name, text in corpora.items()}
    dense = {name: evaluate.perplexity(model, chunks) for name, chunks in held_out.items()}

    cells = []
    for method, compressor in METHODS.items():
        for ratio in RATIOS:
            _, compression = compress(model, calib, AlignConfig(compressor, param_ratio=ratio, cost="a100", tokens=512), inplace=False)
            summary = compression.summary()
            cell = {"method": method, "ratio": ratio, "variants": {}}
            for variant in VARIANTS:
                candidate = compression.build(model, variant)
                cell["variants"][variant] = {
                    **summary[variant], **{f"ppl_{n}": evaluate.perplexity(candidate, c) for n, c in held_out.items()}
                }
                del candidate
            for corpus in held_out:
                cell[f"gac_vs_round_down_{corpus}"] = cell["variants"]["gac"][f"ppl_{corpus}"] / cell["variants"]["round-down"][f"ppl_{corpus}"]
            cells.append(cell)
            print(json.dumps(cell), flush=True)

    ratios = [c[f"gac_vs_round_down_{k}"] for c in cells for k in held_out]
    no_worse = sum(r <= 1.0 for r in ratios) / len(ratios)
    lines = [
        "# GAC vs naive rounding: compressors x parameter ratios x held-out corpora (Gemma-3-270M)\n",
        f"Machine: {cpu_name()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the end (nothing timed). "
        f"Commit: {git_commit()}. Command: `python bench/gac_grid.py {' '.join(sys.argv[1:])}`. Took {time.time() - started:.0f} s.\n",
        f"Calibration: 8 x 256 tokens of the Python docs' library reference. Perplexity: {args.eval_chunks} x 512 tokens of the "
        f"King James Bible (kjv) and of the CPython standard library (stdlib); dense: kjv {dense['kjv']:.2f}, stdlib {dense['stdlib']:.2f}. "
        "GAC priced by the analytic A100 model. Cells through netgain.align.compress.\n",
        "| method | ratio | variant | unit params / budget | aligned %8 | ppl kjv | ppl stdlib |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        for v, r in c["variants"].items():
            lines.append(f"| {c['method']} | {c['ratio']} | {v} | {r['vs_budget']:.4f} | {100 * r['aligned_8']:.0f}% | {r['ppl_kjv']:.2f} | {r['ppl_stdlib']:.2f} |")
    lines += ["", "| method | ratio | GAC / round-down ppl (kjv) | GAC / round-down ppl (stdlib) | GAC / budget | GAC aligned %8 |", "|---|---|---|---|---|---|"]
    for c in cells:
        g = c["variants"]["gac"]
        lines.append(f"| {c['method']} | {c['ratio']} | {c['gac_vs_round_down_kjv']:.4f} | {c['gac_vs_round_down_stdlib']:.4f} "
                     f"| {g['vs_budget']:.4f} | {100 * g['aligned_8']:.0f}% |")
    lines.append(f"\nGAC's perplexity is no worse than round-down's in {100 * no_worse:.0f}% of the {len(ratios)} (cell, corpus) pairs; "
                 f"worst ratio {max(ratios):.4f}.\n")
    text = "\n".join(lines)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "gac_grid.md").write_text(text)
    (RESULTS / "gac_grid.json").write_text(json.dumps({"dense": dense, "cells": cells}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
