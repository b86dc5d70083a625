"""GAC on low-rank (ASVD-style) compression, measured on this CPU and predicted for A100/H100.

1. Gemma-3-270M at parameter ratio 0.85 through `netgain.align.compress` (calibrated on the Python docs'
   library reference, perplexity on the rest of the Python docs): dense / raw ASVD / rounding /
   GAC with measured CPU kernel costs; alignment, parameters, perplexity, prefill S=512 latency.
2. Llama-3-8B-shaped decoder layers (random weights, latency only): measured CPU prefill for dense,
   raw, round-down and GAC; and the analytic A100/H100 model for the whole 32-layer model at the
   paper's setting (S=1024, batch 1) next to the paper's numbers.

The 8B ranks are not from a real ASVD run (no 8B weights here): each matrix takes a parameter ratio
drawn (seeded) from ASVD's grid around 0.85 and ASVD's rank formula floor(mn ratio / (m + n)).

    python bench/gac_lowrank.py            # writes bench/results/gac_lowrank.md and .json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from gac_models import llama3_8b_shaped  # noqa: E402

from netgain.align import AlignConfig, ASVDConfig, MeasuredCost, compress, evaluate, report  # noqa: E402
from netgain.align.defaults import packaged_gemma, python_docs  # noqa: E402
from netgain.align.lowrank import ASVD, LowRankUnit, decoder_linears, install, rank_for_ratio  # noqa: E402
from netgain.align.units import aligned_fraction, full_sizes, proposed_sizes, total_params  # noqa: E402
from netgain.cost.kernels import AnalyticCost  # noqa: E402
from netgain.cost.profile import cpu_name  # noqa: E402
from provenance import git_commit  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
RUNS = ROOT / "runs"
PAPER_MS = {"dense": 99.6, "raw": 100.5, "gac": 67.1}  # Llama-3-8B, A100, S=1024 (../shared/papers/gac.md)
SYNTHETIC_RATIOS = (0.75, 0.8, 0.85, 0.9, 0.95)
VARIANTS = ("dense", "raw", "round-nearest", "round-down", "gac")


def gemma_section(repeats: int) -> tuple[str, dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = packaged_gemma()
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    calib = evaluate.token_chunks(tokenizer, python_docs("calib"), 256, 8)
    held_out = evaluate.token_chunks(tokenizer, python_docs("eval"), 512, 4)
    kernels = RUNS / "gac_gemma_kernels.json"  # measured in this run, not reused from an earlier one
    kernels.unlink(missing_ok=True)
    cost = MeasuredCost("auto", "float32", repeats=repeats, cache=kernels)
    config = AlignConfig(ASVDConfig(alpha=0.5), 0.85, cost, tokens=512, multiple=8, steps=4, tolerance=0.03)
    compressed, result = compress(model, calib, config, inplace=False)
    costs = {"measured-kernels": cost, "a100": AnalyticCost("a100"), "h100": AnalyticCost("h100")}
    table_rows = result.compare(model, compressed, VARIANTS, costs=costs, seq_len=512, eval_chunks=held_out, repeats=repeats)
    record = {"budget": result.budget, "dense_params": result.dense_params, "sizes": result.sizes,
              "rows": [r.as_dict() for r in table_rows]}
    rows = {r["variant"]: r for r in record["rows"]}
    ratios = {
        "prefill gac / raw": rows["gac"]["measured_prefill_s"] / rows["raw"]["measured_prefill_s"],
        "prefill gac / dense": rows["gac"]["measured_prefill_s"] / rows["dense"]["measured_prefill_s"],
        "prefill raw / dense": rows["raw"]["measured_prefill_s"] / rows["dense"]["measured_prefill_s"],
        "perplexity gac / raw": rows["gac"]["perplexity"] / rows["raw"]["perplexity"],
        "perplexity gac / round-down": rows["gac"]["perplexity"] / rows["round-down"]["perplexity"],
        "params gac / raw": rows["gac"]["unit_params"] / rows["raw"]["unit_params"],
    }
    text = (
        "## 1. Gemma-3-270M, ASVD at parameter ratio 0.85 (CPU, float32)\n\n"
        f"`netgain.align.compress(model, calib, {config})`\n\n"
        "Calibration: 8 x 256 tokens of the Python docs' library reference; perplexity: 4 x 512 tokens of the\n"
        "other Python docs (tutorial, reference, howto, ...). Latency: batch 1, median of repeats, variants timed\n"
        "in turns in one run. Units the compressor keeps dense count as aligned. Predicted columns: the sum of the\n"
        "kernels (GEMMs, SDPA, LM head for one token) under each cost model; measured-kernels = timed on this CPU.\n"
        "GAC: candidates at multiples of 8 within 4 steps of each ASVD rank, dense where factorising does not pay on\n"
        "this CPU, cliffs (3% tolerance) removed, valued by the compressor's own predicted-loss curve (the\n"
        "same curve its per-layer allocation minimised).\n\n"
        + report.markdown(table_rows, result.budget, cost.preferred_multiple)
        + "\nRatios from this run: "
        + ", ".join(f"{k} = {v:.3f}" for k, v in ratios.items())
        + "\n"
    )
    return text, {"report": record, "ratios": ratios}


def synthetic_units(model, seed: int = 0) -> list[LowRankUnit]:
    """ASVD-shaped proposals without ASVD: a seeded grid ratio per matrix, ASVD's rank formula."""
    rng = np.random.default_rng(seed)
    units = []
    for name, linear in decoder_linears(model).items():
        in_f, out_f = linear.in_features, linear.out_features
        rank = rank_for_ratio(in_f, out_f, float(rng.choice(SYNTHETIC_RATIOS)))
        units.append(LowRankUnit(name, rank, min(in_f, out_f), float(rng.lognormal()), in_f, out_f))
    return units


def variant_sizes(units, cost, tokens: int) -> dict[str, dict[str, int]]:
    return {
        "dense": full_sizes(units),
        "raw": proposed_sizes(units),
        "round-down": ASVD().round_sizes(units, 8, "down"),
        "gac": ASVD().select(units, cost, tokens, multiple=8, steps=4),
    }


def with_ranks(model, sizes: dict[str, int], units):
    """A copy of `model` with the factorised units at the given ranks (random factors: latency only)."""
    variant = copy.deepcopy(model)
    for module in install(variant, {u.name: sizes[u.name] for u in units if sizes[u.name] != u.full}).values():
        if module.down.weight.device.type != "meta":
            module.down.reset_parameters()
            module.up.reset_parameters()
    return variant


def llama_cpu_section(layers: int, seq: int, repeats: int) -> tuple[str, dict]:
    model = llama3_8b_shaped(layers=layers, dtype=torch.bfloat16)
    units = synthetic_units(model)
    kernels = RUNS / "gac_llama_kernels.json"  # measured in this run
    kernels.unlink(missing_ok=True)
    cost = MeasuredCost("cpu", "bfloat16", warmup=1, repeats=repeats, cache=kernels)
    t0 = time.perf_counter()
    sizes = variant_sizes(units, cost, seq)
    select_s = time.perf_counter() - t0
    cost.save()
    models = {variant: with_ranks(model, chosen, units) for variant, chosen in sizes.items()}
    latency = evaluate.interleaved_latency(models, seq, repeats=repeats)
    del models
    results = {
        variant: {
            "prefill_s": latency[variant]["prefill_s"],
            "decode_s": latency[variant]["decode_s"],
            "unit_params": total_params(units, chosen),
            "aligned_8": aligned_fraction(units, chosen, 8),
        }
        for variant, chosen in sizes.items()
    }
    dense = results["dense"]["prefill_s"]
    lines = [
        f"## 2a. Llama-3-8B-shaped layers on this CPU ({layers} decoder layers, bfloat16, random weights)\n",
        f"Prefill S={seq} and one decode step on a {seq}-token cache, batch 1, {torch.get_num_threads()} threads, "
        f"median of {repeats}, variants timed in turns; GAC used measured CPU",
        f"kernel costs ({cost.name}, bfloat16); profiling + selection took {select_s:.0f} s.\n",
        "| variant | unit params | aligned %8 | prefill ms | vs dense | vs raw | decode ms | vs dense |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for variant, r in results.items():
        lines.append(
            f"| {variant} | {r['unit_params']:,} | {100 * r['aligned_8']:.0f}% | {r['prefill_s'] * 1e3:.0f} "
            f"| {r['prefill_s'] / dense:.3f} | {r['prefill_s'] / results['raw']['prefill_s']:.3f} "
            f"| {r['decode_s'] * 1e3:.0f} | {r['decode_s'] / results['dense']['decode_s']:.3f} |"
        )
    return "\n".join(lines) + "\n", {"results": results, "sizes": sizes}


def llama_analytic_section(seq: int = 1024) -> tuple[str, dict]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    units = synthetic_units(model)
    results = {}
    for gpu in ("a100", "h100"):
        cost = AnalyticCost(gpu)
        for variant, chosen in variant_sizes(units, cost, seq).items():
            candidate = with_ranks(model, chosen, units)
            results.setdefault(variant, {})[gpu] = evaluate.predicted_latency(candidate, cost, seq, seq)
            results[variant]["aligned_8"] = aligned_fraction(units, chosen, 8)
            results[variant][f"params_{gpu}"] = total_params(units, chosen)
    lines = [
        f"## 2b. Llama-3-8B (32 layers), analytic model, prefill S={seq}, batch 1, FP16\n",
        f"{len(units)} matrices; the raw ranks are {100 * results['raw']['aligned_8']:.0f}% aligned to 8 "
        f"(the paper's real ASVD run: 5%). The paper measured on an A100 (PyTorch 2.9).\n",
        "| variant | aligned %8 | A100 predicted ms | vs dense | H100 predicted ms | vs dense | paper A100 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for variant, r in results.items():
        lines.append(
            f"| {variant} | {100 * r['aligned_8']:.0f}% | {r['a100'] * 1e3:.1f} | {r['a100'] / results['dense']['a100']:.3f} "
            f"| {r['h100'] * 1e3:.1f} | {r['h100'] / results['dense']['h100']:.3f} | {PAPER_MS.get(variant, '')} |"
        )
    return "\n".join(lines) + "\n", {"results": results}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-gemma", action="store_true")
    parser.add_argument("--skip-llama-cpu", action="store_true")
    parser.add_argument("--layers", type=int, default=2, help="Llama-3-8B-shaped decoder layers timed on CPU")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    commit = git_commit()
    sections, record = [], {}
    if not args.skip_gemma:
        text, record["gemma"] = gemma_section(args.repeats)
        sections.append(text)
    if not args.skip_llama_cpu:
        text, record["llama_cpu"] = llama_cpu_section(args.layers, 512, max(3, args.repeats // 2))
        sections.append(text)
    text, record["llama_analytic"] = llama_analytic_section()
    sections.append(text)
    header = (
        "# GAC on low-rank compression\n\n"
        f"Machine: {cpu_name()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} when it finished "
        "(timings are medians of turns), no GPU lent to this session.\n"
        f"Commit: {commit}. Command: `{' '.join(['python bench/gac_lowrank.py'] + sys.argv[1:])}`.\n"
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "gac_lowrank.md").write_text(header + "\n" + "\n".join(sections))
    (RESULTS / "gac_lowrank.json").write_text(json.dumps(record, indent=1, default=str))
    print(header + "\n" + "\n".join(sections))
    return 0


if __name__ == "__main__":
    sys.exit(main())
