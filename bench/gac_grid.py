"""GAC against the naive rounding baselines across compressors, parameter ratios and held-out corpora.

Gemma-3-270M (float32); calibration on the Python docs' library reference (`--calib-domains docs gcide`
adds the GCIDE dictionary as a second domain); perplexity on two corpora the calibration never sees:
the King James Bible and the CPython standard library source. Cells: ASVD
and the pruner at parameter ratios 0.9, 0.85 and 0.75 (each compressor fitted once, sized per ratio
by `netgain.align.pipeline.size`); in each, raw, round-down, round-nearest and GAC (priced by the
analytic A100 model: deterministic and independent of this machine's load). Variants with identical
sizes share one evaluation (the model is the same). Reported per cell: unit parameters against the
raw budget, alignment to 8, the compressor's predicted objective, perplexity per corpus, and GAC's
perplexity ratio to round-down. Nothing here is timed. Finished cells are kept in --state, so an
interrupted run resumes and `--cells asvd:0.9` re-runs one cell. GAC is checked per cell on held-out text of
the calibration domain (`--validation-chunks`, `Compression.verify_gac`): it keeps its sizes only where
they beat round-down's there.

    python bench/gac_grid.py     # writes bench/results/gac_grid.md, .csv and .json (--name changes the stem)
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from pathlib import Path

import torch

from netgain.align import AlignConfig, ASVDConfig, PrunerConfig, evaluate
from netgain.align.defaults import packaged_gemma, python_docs
from netgain.align.gac import objective
from netgain.align.pipeline import size
from netgain.cost.measured import cpu_name

sys.path.insert(0, str(Path(__file__).parent))
from gac_models import gcide_text, kjv_text, stdlib_text  # noqa: E402
from provenance import git_commit  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
METHODS = {"asvd": ASVDConfig(), "pruner": PrunerConfig()}
RATIOS = (0.9, 0.85, 0.75)
RUN_ORDER = (0.85, 0.9, 0.75)  # the order cells run in, so an interrupted grid still covers both methods
VARIANTS = ("raw", "round-down", "round-nearest", "gac")
CORPORA = ("kjv", "stdlib")
CALIBRATION = {"docs": lambda: python_docs("calib"), "gcide": gcide_text}  # neither is held out
DOMAIN_NAMES = {"docs": "the Python docs' library reference", "gcide": "the GCIDE dictionary (Webster 1913)"}


def run_cell(model, compressor, method: str, ratio: float, held_out, tokens: int, validation) -> dict:
    """One (method, ratio) cell: every variant's sizes, budget, alignment, objective and perplexities;
    GAC's sizes kept only where the calibration domain's held-out chunks confirm them (`verify_gac`)."""
    compression = size(compressor, AlignConfig(METHODS[method], param_ratio=ratio, cost="a100", tokens=tokens))
    check = compression.verify_gac(model, validation) if validation else None
    summary = compression.summary()
    cell, seen = {"method": method, "ratio": ratio, "variants": {}, "check": check}, {}
    for variant in VARIANTS:
        sizes = compression.sizes[variant]
        key = tuple(sorted(sizes.items()))
        if key not in seen:
            candidate = compression.build(model, variant)
            losses = {n: evaluate.chunk_losses(candidate, c) for n, c in held_out.items()}
            seen[key] = {**{f"ppl_{n}": evaluate.perplexity_of(l, held_out[n]) for n, l in losses.items()},
                         **{f"nll_{n}": l for n, l in losses.items()}}
            del candidate
        cell["variants"][variant] = {**summary[variant], **seen[key], "objective": objective(compression.units, sizes),
                                     "same_as_round_down": sizes == compression.sizes["round-down"], "sizes": sizes}
    for corpus in held_out:
        cell[f"gac_vs_round_down_{corpus}"] = cell["variants"]["gac"][f"ppl_{corpus}"] / cell["variants"]["round-down"][f"ppl_{corpus}"]
    return cell


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "runs" / "gemma3-270m"), help="Gemma-3-270M directory (converted on first use)")
    parser.add_argument("--calib-chunks", type=int, default=8)
    parser.add_argument("--calib-len", type=int, default=256)
    parser.add_argument("--validation-chunks", type=int, default=16,
                        help="held-out chunks of --calib-len tokens of the calibration domains, right after the calibration's, "
                             "on which GAC must beat round-down to keep its sizes (0: GAC unchecked)")
    parser.add_argument("--eval-chunks", type=int, default=16, help="held-out chunks per corpus (their spread gives the interval)")
    parser.add_argument("--eval-len", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=512, help="the prefill length GAC's A100 cost model prices")
    parser.add_argument("--cells", nargs="*", help="method:ratio cells to (re)run, e.g. asvd:0.9 (default: all not yet in --state)")
    parser.add_argument("--calib-domains", nargs="+", choices=sorted(CALIBRATION), default=["docs"],
                        help="calibration text: the chunks are split evenly over these domains")
    parser.add_argument("--name", default="gac_grid", help="results file stem (bench/results/NAME.md) and state file (runs/NAME_cells.jsonl)")
    parser.add_argument("--state", help="finished cells, one JSON per line (default runs/NAME_cells.jsonl)")
    parser.add_argument("--report", action="store_true", help="only write the report from the cells finished so far")
    args = parser.parse_args()
    if args.validation_chunks < 0 or args.validation_chunks % len(args.calib_domains):
        parser.error(f"--validation-chunks must be >= 0 and a multiple of the {len(args.calib_domains)} calibration domains")
    args.state = args.state or str(ROOT / "runs" / f"{args.name}_cells.jsonl")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started = time.time()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    state = Path(args.state)
    done = {}
    if state.exists():
        for line in state.read_text().splitlines():
            cell = json.loads(line)
            done[(cell["method"], cell["ratio"])] = cell
    wanted = [(m, r) for m in METHODS for r in RATIOS]
    if args.cells:
        rerun = {(c.split(":")[0], float(c.split(":")[1])) for c in args.cells}
        todo = [k for k in wanted if k in rerun]
    else:
        todo = [k for k in wanted if k not in done]
    if args.report:
        todo = []

    dense_file = state.with_suffix(".dense.json")
    if todo or not dense_file.exists():  # with every cell finished, only the report is written
        model_dir = packaged_gemma(args.model)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        texts = {"kjv": kjv_text(), "stdlib": stdlib_text()}
        held_out = {name: evaluate.token_chunks(tokenizer, texts[name], args.eval_len, args.eval_chunks) for name in CORPORA}
    if dense_file.exists():
        dense = json.loads(dense_file.read_text())
    else:
        dense = {name: evaluate.perplexity(model, chunks) for name, chunks in held_out.items()}
        dense_file.parent.mkdir(parents=True, exist_ok=True)
        dense_file.write_text(json.dumps(dense))
    if todo:
        own = args.calib_chunks // len(args.calib_domains)
        per_domain = [evaluate.token_chunks(tokenizer, CALIBRATION[d](), args.calib_len, own + args.validation_chunks // len(args.calib_domains))
                      for d in args.calib_domains]
        calib = [chunk for group in zip(*(c[:own] for c in per_domain)) for chunk in group]  # interleaved domains
        validation = [chunk for group in zip(*(c[own:] for c in per_domain)) for chunk in group]
    fitted = {}
    for method, ratio in sorted(todo, key=lambda k: RUN_ORDER.index(k[1])):  # every method's middle ratio first
        if method not in fitted:
            fitted[method], t0 = METHODS[method].build(), time.time()
            fitted[method].fit(model, calib)
            print(f"[grid] {method} fitted in {time.time() - t0:.0f} s", flush=True)
        t0 = time.time()
        cell = run_cell(model, fitted[method], method, ratio, held_out, args.tokens, validation)
        cell["seconds"], cell["commit"] = round(time.time() - t0), git_commit()
        done[(method, ratio)] = cell
        with state.open("a") as f:
            f.write(json.dumps(cell) + "\n")
        print(f"[grid] {method} {ratio}: {cell['seconds']} s, GAC/round-down kjv {cell['gac_vs_round_down_kjv']:.4f} "
              f"stdlib {cell['gac_vs_round_down_stdlib']:.4f}", flush=True)

    cells = [done[k] for k in wanted if k in done]
    if not cells:
        print("no finished cells yet", file=sys.stderr)
        return 1
    write(cells, dense, args, time.time() - started, len(wanted))
    return 0


def ranking_check(cells) -> tuple[dict, dict, dict]:
    """Pairs of a cell's variants (distinct sizes) that the objective orders as measured perplexity does,
    per corpus: (agreeing, pairs, pairs resolved). A pair is resolved when the paired interval of its
    perplexity ratio excludes 1; within it, the held-out text alone could order the two either way."""
    agree, pairs, resolved = (dict.fromkeys(CORPORA, 0) for _ in range(3))
    for c in cells:
        variants = {}
        for v, r in c["variants"].items():  # one entry per distinct set of sizes
            variants.setdefault(tuple(sorted(r["sizes"].items())), r)
        rows = list(variants.values())
        for i, a in enumerate(rows):
            for b in rows[i + 1 :]:
                if a["objective"] == b["objective"]:
                    continue
                for k in CORPORA:
                    if f"nll_{k}" not in a:  # a cell from before the chunk losses were kept: no interval
                        continue
                    pairs[k] += 1
                    _, low, high = evaluate.paired_ratio(a[f"nll_{k}"], b[f"nll_{k}"])
                    if not low <= 1 <= high:
                        resolved[k] += 1
                        agree[k] += (a["objective"] > b["objective"]) == (a[f"ppl_{k}"] < b[f"ppl_{k}"])
    return agree, pairs, resolved


def write(cells, dense, args, seconds: float, wanted: int) -> None:
    """The markdown table, a CSV row per (cell, variant), and the JSON with every variant's sizes."""
    ratios = [c[f"gac_vs_round_down_{k}"] for c in cells for k in CORPORA]
    no_worse = sum(r <= 1.0 for r in ratios) / len(ratios)
    lines = [
        "# GAC vs naive rounding: compressors x parameter ratios x held-out corpora (Gemma-3-270M)\n",
        f"Machine: {cpu_name()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the end (nothing timed). "
        f"Cells run at commit {', '.join(dict.fromkeys(c.get('commit', 'unrecorded') for c in cells))}; report at {git_commit()}. "
        f"Command: `python bench/gac_grid.py {' '.join(sys.argv[1:])}`; this invocation took {seconds:.0f} s, "
        f"the cells' own seconds are in the CSV.\n",
        f"Calibration: {args.calib_chunks} x {args.calib_len} tokens, split evenly over {' and '.join(DOMAIN_NAMES[d] for d in args.calib_domains)}; "
        f"GAC's check on the next {args.validation_chunks} x {args.calib_len} tokens of the same text (`Compression.verify_gac`: "
        "GAC's sizes kept only if its mean loss there is below round-down's). Perplexity: "
        f"{args.eval_chunks} x {args.eval_len} tokens of the King James Bible (kjv) and of the CPython standard library (stdlib); "
        f"dense: kjv {dense['kjv']:.2f}, stdlib {dense['stdlib']:.2f}. GAC priced by the analytic A100 model at {args.tokens} tokens. "
        "Objective: the compressor's predicted loss at the variant's sizes relative to raw (ASVD: Fisher-predicted nats; "
        "pruner: Taylor salience kept; higher is better). `=rd`: the same sizes as round-down.\n",
        "| method | ratio | variant | unit params / budget | aligned %8 | objective | ppl kjv | ppl stdlib |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        for v, r in c["variants"].items():
            same = " =rd" if v == "gac" and r["same_as_round_down"] else ""
            lines.append(f"| {c['method']} | {c['ratio']} | {v}{same} | {r['vs_budget']:.4f} | {100 * r['aligned_8']:.0f}% "
                         f"| {r['objective']:.4g} | {r['ppl_kjv']:.3f} | {r['ppl_stdlib']:.3f} |")
    lines += ["", "| method | ratio | GAC / round-down ppl (kjv) | GAC / round-down ppl (stdlib) | GAC / budget | GAC aligned %8 "
              "| GAC's check: GAC / round-down on held-out calibration text |",
              "|---|---|---|---|---|---|---|"]
    def interval(c, k) -> str:  # from the chunk-to-chunk spread of the paired loss difference
        gac, rd = c["variants"]["gac"], c["variants"]["round-down"]
        return " ({1:.4f}-{2:.4f})".format(*evaluate.paired_ratio(gac[f"nll_{k}"], rd[f"nll_{k}"])) if f"nll_{k}" in gac else ""

    def checked(c) -> str:  # what verify_gac measured before the cell's variants were evaluated
        k = c.get("check")
        if not k:
            return "not run"
        if k["same_as_round_down"]:
            return "GAC = round-down"
        return f"{k['ratio']:.4f} ({k['low']:.4f}-{k['high']:.4f}): {'GAC kept' if k['kept'] else 'round-down taken'}"

    for c in cells:
        g = c["variants"]["gac"]
        lines.append(f"| {c['method']} | {c['ratio']} | {c['gac_vs_round_down_kjv']:.4f}{interval(c, 'kjv')} "
                     f"| {c['gac_vs_round_down_stdlib']:.4f}{interval(c, 'stdlib')} | {g['vs_budget']:.4f} | {100 * g['aligned_8']:.0f}% "
                     f"| {checked(c)} |")
    within = all(c["variants"]["gac"]["vs_budget"] <= 1.0 for c in cells)
    aligned = all(c["variants"]["gac"]["aligned_8"] == 1.0 for c in cells)
    lines.append("\nIn brackets: 95% interval of the ratio from the chunk-to-chunk spread of the paired loss difference "
                 "(Student's t over the chunks): how far the choice of held-out text alone moves it.")
    lines.append(f"\nGAC's perplexity is no worse than round-down's in {100 * no_worse:.0f}% of the {len(ratios)} (cell, corpus) pairs; "
                 f"worst ratio {max(ratios):.4f} ({len(cells)} of the {wanted} cells finished). GAC within the raw budget in every cell: {within}; 100% aligned in every cell: {aligned}.\n")
    agree, pairs, resolved = ranking_check(cells)
    lines.append("The objective against measured perplexity: of the pairs of a cell's variants with different sizes whose "
                 "perplexity ratio's interval excludes 1, the objective ranks them as perplexity does in "
                 + ", ".join(f"{agree[k]} of {resolved[k]} ({k}; {pairs[k] - resolved[k]} of {pairs[k]} pairs within the interval)"
                             for k in CORPORA) + ".\n")
    text = "\n".join(lines)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.md").write_text(text)
    with (RESULTS / f"{args.name}.csv").open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["method", "ratio", "variant", "unit_params", "vs_budget", "aligned_8", "objective", "ppl_kjv", "ppl_stdlib",
                      "vs_round_down_kjv", "vs_round_down_stdlib", "cell_seconds"])
        for c in cells:
            rd = c["variants"]["round-down"]
            for v, r in c["variants"].items():
                out.writerow([c["method"], c["ratio"], v, r["unit_params"], f"{r['vs_budget']:.6f}", r["aligned_8"], f"{r['objective']:.6g}",
                              f"{r['ppl_kjv']:.4f}", f"{r['ppl_stdlib']:.4f}", f"{r['ppl_kjv'] / rd['ppl_kjv']:.5f}",
                              f"{r['ppl_stdlib'] / rd['ppl_stdlib']:.5f}", c["seconds"]])
    (RESULTS / f"{args.name}.json").write_text(json.dumps({"dense": dense, "cells": cells}, indent=1))
    print(text)


if __name__ == "__main__":
    sys.exit(main())
