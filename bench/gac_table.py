"""The GAC evaluation table on this machine: dense, ASVD, ASVD+round, ASVD+GAC, Pruner, Pruner+round, Pruner+GAC.

Gemma-3-270M at 15% compression (parameter ratio 0.85 of the decoder Linears, as both compressors
count it), all rows from one run:
- calibration: the Python docs' library reference (ASVD activations, the pruner's Taylor gradients);
- perplexity on two held-out corpora: the rest of the Python docs, and the KJV Bible;
- measured CPU latency, batch 1: prefill S=512 and S=1024 and one decode step on a 512-token cache,
  every variant timed in turns (median of repeats) so other jobs' load falls on all alike;
- analytic A100/H100 latency (netgain.cost.kernels) of prefill S=1024;
- GAC re-selects sizes with kernel latencies measured on this CPU (float32) in this run;
  "+round" is round_to 8, down (keeps the budget), as LLM-Pruner / Torch-Pruning / ASVD offer.

    python bench/gac_table.py            # writes bench/results/gac_table.{md,csv,json,png}
    python bench/gac_table.py --quick    # a small smoke run (fewer tokens, one repeat), results to /tmp

The per-variant unit sizes and the units (with their error curves) go to gac_table.json, which
bench/gac_gpu.sh reads to rebuild the same architectures on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gac_models import kjv_text  # noqa: E402

from netgain.align import AlignConfig, ASVDConfig, MeasuredCost, PrunerConfig, compress, evaluate, prune  # noqa: E402
from netgain.align.defaults import packaged_gemma, python_docs  # noqa: E402
from netgain.align.units import aligned_fraction, total_params  # noqa: E402
from netgain.cost.kernels import AnalyticCost  # noqa: E402
from netgain.cost.profile import cpu_name  # noqa: E402
from netgain.models import parameter_count  # noqa: E402
from provenance import git_commit, write_csv  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RUNS = ROOT / "runs"
ROWS = ("dense", "ASVD", "ASVD+round", "ASVD+GAC", "Pruner", "Pruner+round", "Pruner+GAC")
SUFFIX = {"": "raw", "+round": "round-down", "+GAC": "gac"}  # row name suffix -> variant of compress's result
CORPORA = ("python-docs", "kjv")
GPUS = ("a100", "h100")


def corpus_files(text_dir: Path) -> dict[str, Path]:
    """calib / python-docs / kjv text files, written once from the Debian packages."""
    text_dir.mkdir(parents=True, exist_ok=True)
    make = {"calib": lambda: python_docs("calib"), "python-docs": lambda: python_docs("eval"), "kjv": kjv_text}
    paths = {name: text_dir / f"{name}.txt" for name in make}
    for name, path in paths.items():
        if not path.exists():
            path.write_text(make[name]())
    return paths


def unit_record(unit) -> dict:
    """A unit as gac_gpu.py rebuilds it; its error curve to 6 significant digits (it only ranks sizes)."""
    record = {"type": type(unit).__name__, **asdict(unit)}
    record["error"] = [float(f"{e:.6g}") for e in unit.error]
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--param-ratio", type=float, default=0.85)
    parser.add_argument("--calib-seqs", type=int, default=8)
    parser.add_argument("--calib-len", type=int, default=256)
    parser.add_argument("--eval-chunks", type=int, default=4, help="chunks per held-out corpus")
    parser.add_argument("--eval-len", type=int, default=512, help="tokens per held-out chunk")
    parser.add_argument("--repeats", type=int, default=3, help="latency repeats (median), after one warm-up round")
    parser.add_argument("--kernel-repeats", type=int, default=3)
    parser.add_argument("--seqs", default="512,1024", help="prefill lengths timed on this CPU (decode uses the first)")
    parser.add_argument("--importance", default="taylor", choices=prune.IMPORTANCE)
    parser.add_argument("--scope", default="global", choices=prune.SCOPES)
    parser.add_argument("--quick", action="store_true", help="smoke run: 2x64 calibration, 1x128 eval, S=64,128, 1 repeat; writes to /tmp")
    parser.add_argument("--out", default=None, help="results directory (default bench/results, /tmp/gac_table with --quick)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.quick:
        args.calib_seqs, args.calib_len, args.eval_chunks, args.eval_len = 2, 64, 1, 128
        args.repeats, args.kernel_repeats, args.seqs = 1, 1, "64,128"
    seqs = [int(s) for s in args.seqs.split(",")]
    out = Path(args.out or ("/tmp/gac_table" if args.quick else ROOT / "bench" / "results"))
    work = RUNS / ("gac_table_quick" if args.quick else "gac_table")
    work.mkdir(parents=True, exist_ok=True)
    commit = git_commit()
    started = time.time()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = packaged_gemma()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts = corpus_files(RUNS / "gac_text")
    calib = evaluate.token_chunks(tokenizer, texts["calib"].read_text(), args.calib_len, args.calib_seqs)
    held_out = {c: evaluate.token_chunks(tokenizer, texts[c].read_text(), args.eval_len, args.eval_chunks) for c in CORPORA}

    kernels = work / "kernels.json"  # measured in this run
    kernels.unlink(missing_ok=True)
    cost = MeasuredCost("cpu", "float32", warmup=1, repeats=args.kernel_repeats, cache=kernels)
    t0 = time.perf_counter()
    results, models = {}, {"dense": model}
    for method, compressor in (("ASVD", ASVDConfig(alpha=0.5)), ("Pruner", PrunerConfig(args.importance, args.scope))):
        config = AlignConfig(compressor, args.param_ratio, cost, tokens=seqs[0], multiple=8, steps=4, tolerance=0.03)
        models[f"{method}+GAC"], results[method] = compress(model, calib, config, inplace=False)
        models.update({method + suffix: results[method].build(model, v) for suffix, v in SUFFIX.items() if v != "gac"})
    fit_s = time.perf_counter() - t0  # calibration, proposal, kernel profiling and GAC, both methods
    models = {row: models[row] for row in ROWS}
    units = {method: result.units for method, result in results.items()}
    sizes = {"dense": (None, results["ASVD"].sizes["dense"])}
    sizes.update({m + suffix: (m, results[m].sizes[v]) for m in results for suffix, v in SUFFIX.items()})
    sizes = {row: sizes[row] for row in ROWS}

    rows = {}
    for row, (method, chosen) in sizes.items():
        m = models[row]
        u = units[method or "ASVD"]
        budget = results[method or "ASVD"].budget
        rows[row] = {
            "variant": row,
            "aligned_8": aligned_fraction(u, chosen, 8) if method else 1.0,
            "aligned_16": aligned_fraction(u, chosen, 16) if method else 1.0,
            "model_params": parameter_count(m),
            "unit_params": total_params(u, chosen),
            "unit_params_vs_budget": total_params(u, chosen) / budget if method else float("nan"),
            **{f"ppl_{c}": evaluate.perplexity(m, held_out[c]) for c in CORPORA},
            **{f"{g}_prefill{seqs[-1]}_ms": 1e3 * evaluate.predicted_latency(m, AnalyticCost(g), seqs[-1], seqs[-1]) for g in GPUS},
        }
        print(f"{row}: params {rows[row]['model_params']:,}, ppl {[round(rows[row][f'ppl_{c}'], 2) for c in CORPORA]}", flush=True)
    for s in seqs:
        latency = evaluate.interleaved_latency(models, s, repeats=args.repeats)
        for row in rows:
            rows[row][f"cpu_prefill{s}_ms"] = 1e3 * latency[row]["prefill_s"]
            if s == seqs[0]:
                rows[row][f"cpu_decode_tok_s_ctx{s}"] = 1 / latency[row]["decode_s"]
        print(f"timed S={s}", flush=True)

    ratios = {}
    for method in ("ASVD", "Pruner"):
        raw, rnd, g = rows[method], rows[f"{method}+round"], rows[f"{method}+GAC"]
        ratios[method] = {
            "GAC aligned %8": 100 * g["aligned_8"],
            "raw aligned %8": 100 * raw["aligned_8"],
            "unit params GAC / raw budget": g["unit_params"] / raw["unit_params"],
            **{f"ppl GAC / round ({c})": g[f"ppl_{c}"] / rnd[f"ppl_{c}"] for c in CORPORA},
            **{f"ppl GAC / raw ({c})": g[f"ppl_{c}"] / raw[f"ppl_{c}"] for c in CORPORA},
            **{f"CPU prefill S={s} GAC / raw": g[f"cpu_prefill{s}_ms"] / raw[f"cpu_prefill{s}_ms"] for s in seqs},
            **{f"CPU prefill S={s} GAC / dense": g[f"cpu_prefill{s}_ms"] / rows["dense"][f"cpu_prefill{s}_ms"] for s in seqs},
            **{f"CPU prefill S={s} raw / dense": raw[f"cpu_prefill{s}_ms"] / rows["dense"][f"cpu_prefill{s}_ms"] for s in seqs},
            "CPU decode tok/s GAC / raw": g[f"cpu_decode_tok_s_ctx{seqs[0]}"] / raw[f"cpu_decode_tok_s_ctx{seqs[0]}"],
            **{f"{gpu.upper()} prefill S={seqs[-1]} GAC / raw": g[f"{gpu}_prefill{seqs[-1]}_ms"] / raw[f"{gpu}_prefill{seqs[-1]}_ms"] for gpu in GPUS},
        }

    columns = list(next(iter(rows.values())))
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "gac_table.csv", list(rows.values()), columns)
    heads_note = "" if any(isinstance(u, prune.HeadUnit) for u in units["Pruner"]) else (
        "; every attention block has one KV head, so the pruner removes MLP channels only"
    )
    command = f"python bench/gac_table.py {' '.join(sys.argv[1:])}".strip()
    header = (
        "# GAC evaluation table: Gemma-3-270M at 15% compression (parameter ratio "
        f"{args.param_ratio} of the decoder Linears)\n\n"
        f"Machine: {cpu_name()}, {os.cpu_count()} cores (load average {os.getloadavg()[0]:.2f} at the end), {torch.get_num_threads()} torch threads, "
        f"float32, no GPU. Commit {commit}. Command: `{command}` ({(time.time() - started) / 60:.0f} min).\n\n"
        f"Calibration: {args.calib_seqs} x {args.calib_len} tokens of the Python docs' library reference (ASVD activations, "
        f"pruner {args.importance} importance, {args.scope} ranking{heads_note}). Perplexity: {args.eval_chunks} x {args.eval_len} tokens of the other Python docs and of the KJV Bible. "
        f"GAC: candidates at multiples of 8 within 4 steps, cliffs from kernel latencies measured on this CPU in this run "
        f"({cost.name}, 3% noise tolerance), knapsack under the raw method's parameter count. +round = round_to 8, down. "
        f"CPU latency: batch 1, median of {args.repeats} after a warm-up, all 7 variants timed in turns; decode = one token "
        f"on a {seqs[0]}-token KV cache. A100/H100: analytic model (sum of GEMMs + SDPA + LM head), prefill S={seqs[-1]}. "
        f"Aligned % counts units (ASVD: {len(units['ASVD'])} Linears; Pruner: {len(units['Pruner'])} blocks) whose size is a multiple of 8; "
        f"netgain.align.compress (fitting, kernel profiling and selection, both methods) took {fit_s:.0f} s.\n\n"
    )
    head = ["variant", "aligned %8", "params", "unit params / budget"] + [f"ppl {c}" for c in CORPORA]
    head += [f"CPU prefill S={s} ms" for s in seqs] + ["CPU decode tok/s"] + [f"{g.upper()} prefill S={seqs[-1]} ms" for g in GPUS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows.values():
        cells = [r["variant"], f"{100 * r['aligned_8']:.0f}%", f"{r['model_params']:,}", f"{r['unit_params_vs_budget']:.4f}"]
        cells += [f"{r[f'ppl_{c}']:.2f}" for c in CORPORA] + [f"{r[f'cpu_prefill{s}_ms']:.0f}" for s in seqs]
        cells += [f"{r[f'cpu_decode_tok_s_ctx{seqs[0]}']:.2f}"] + [f"{r[f'{g}_prefill{seqs[-1]}_ms']:.3f}" for g in GPUS]
        lines.append("| " + " | ".join(cells) + " |")
    ratio_text = "\n".join(
        f"- {method}: " + ", ".join(f"{k} = {v:.3f}" for k, v in r.items()) for method, r in ratios.items()
    )
    (out / "gac_table.md").write_text(header + "\n".join(lines) + "\n\nRatios from this run:\n" + ratio_text + "\n")
    record = {
        "command": command, "commit": commit, "machine": cpu_name(), "threads": torch.get_num_threads(), "seqs": seqs,
        "param_ratio": args.param_ratio, "config": model.config.to_dict(), "rows": rows, "ratios": ratios, "cost": cost.name,
        "units": {m: [unit_record(u) for u in us] for m, us in units.items()},
        "sizes": {row: {"method": method, "sizes": chosen} for row, (method, chosen) in sizes.items()},
    }
    (out / "gac_table.json").write_text(json.dumps(record, separators=(",", ":")))
    plot(rows, seqs, out / "gac_table.png")
    print((out / "gac_table.md").read_text())
    return 0


def plot(rows: dict, seqs: list[int], path: Path) -> None:
    """Measured CPU prefill latency vs perplexity (Python docs), one point per variant, and the A100 prediction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, title in (
        (axes[0], f"cpu_prefill{seqs[-1]}_ms", f"measured CPU prefill S={seqs[-1]} (ms)"),
        (axes[1], f"a100_prefill{seqs[-1]}_ms", f"analytic A100 prefill S={seqs[-1]} (ms)"),
    ):
        for r in rows.values():
            family = "o" if r["variant"] == "dense" else ("s" if r["variant"].startswith("ASVD") else "^")
            ax.scatter(r[key], r["ppl_python-docs"], marker=family)
            ax.annotate(r["variant"], (r[key], r["ppl_python-docs"]), fontsize=8, xytext=(4, 3), textcoords="offset points")
        ax.set_xlabel(title)
        ax.set_ylabel("perplexity, Python docs (log)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    fig.suptitle("Gemma-3-270M, 15% compression: latency vs perplexity")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
