"""The GAC table's latency columns on a GPU (an H200 when one is lent): same architectures, random weights, bf16.

Reads the CPU run's record (bench/results/gac_table.json: the model config, every unit with the error
curve GAC values it by, and each variant's sizes), then on the current device:
1. profiles the real GEMM shapes of every unit's GAC candidates with `netgain.cost.profile.MeasuredCost`
   and re-runs GAC with those measured costs: extra rows "ASVD+GAC(device)" and "Pruner+GAC(device)";
2. times prefill (S=512 and S=1024, batch 1) and one decode step on a 512-token cache, synchronised,
   median of repeats, every variant in turns;
3. puts the analytic model's H200 prefill prediction next to it.
Weights are random (no checkpoint travels to the GPU machine): latency depends on shapes, not values;
perplexity stays with the CPU table. Run through bench/gac_gpu.sh; `--dry-run` is a CPU smoke test.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

from netgain.align import prune
from netgain.align.evaluate import interleaved_latency, predicted_latency
from netgain.align.lowrank import ASVD, LowRankUnit, install
from netgain.align.prune import ChannelUnit, HeadUnit
from netgain.align.units import aligned_fraction, total_params
from netgain.cost.kernels import AnalyticCost
from netgain.cost.profile import MeasuredCost

ROOT = Path(__file__).resolve().parent.parent
UNIT_TYPES = {cls.__name__: cls for cls in (LowRankUnit, ChannelUnit, HeadUnit)}


def load_record(path: Path, layers: int | None):
    """Config, units and per-variant sizes of the CPU run (optionally only the first `layers` decoder layers)."""
    from transformers import AutoConfig

    record = json.loads(path.read_text())
    config = AutoConfig.for_model(**record["config"])
    keep = lambda name: layers is None or prune.layer_index(name) < layers
    if layers is not None:
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:layers]
    units = {
        method: [UNIT_TYPES[u.pop("type")](**u) for u in map(dict, records) if keep(u["name"])]
        for method, records in record["units"].items()
    }
    sizes = {row: (v["method"], {n: s for n, s in v["sizes"].items() if keep(n)}) for row, v in record["sizes"].items()}
    return config, units, sizes


def build(base, method: str | None, sizes: dict[str, int], units, pruner) -> torch.nn.Module:
    """`base` (embeddings shared) with ASVD factors or pruned blocks at `sizes`; random weights."""
    embedding = base.get_input_embeddings().weight
    model = copy.deepcopy(base, memo={id(embedding): embedding})
    if method == "ASVD":
        full = {u.name: u.full for u in units}
        for module in install(model, {n: r for n, r in sizes.items() if r < full[n]}).values():
            torch.nn.init.normal_(module.down.weight, std=0.02)
            torch.nn.init.normal_(module.up.weight, std=0.02)
    elif method == "Pruner":
        pruner.apply(model, sizes)
    return model.eval()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", default=str(ROOT / "bench" / "results" / "gac_table.json"))
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu"))
    parser.add_argument("--seqs", default="512,1024", help="prefill lengths (decode on a cache of the first)")
    parser.add_argument("--select-seq", type=int, default=1024, help="prefill tokens GAC's device cost model uses")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dry-run", action="store_true", help="CPU smoke test: 2 layers, float32, S=32,64, 1 repeat")
    args = parser.parse_args()
    seqs = [int(s) for s in args.seqs.split(",")]
    layers, dtype = None, "bfloat16"
    if args.dry_run:
        layers, dtype, seqs, args.select_seq, args.repeats, args.warmup = 2, "float32", [32, 64], 64, 1, 0
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on the GPU machine, or pass --dry-run for a CPU smoke test")
    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    config, units, sizes = load_record(Path(args.table), layers)

    cost = MeasuredCost(device, dtype, warmup=2, repeats=10 if device == "cuda" else 1, cache=out / "kernels.json")
    # the CPU run's units carry the fitted compressors' error curves: GAC re-selects from them (no weights here)
    compressors = {"ASVD": ASVD(), "Pruner": prune.Pruner(importance="magnitude")}
    t0 = time.perf_counter()
    for method, compressor in compressors.items():
        sizes[f"{method}+GAC(device)"] = (method, compressor.select(units[method], cost, args.select_seq, multiple=8, steps=4, tolerance=0.03))
    profile_s = time.perf_counter() - t0
    cost.save()

    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        base = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).eval()
    pruner = compressors["Pruner"]
    pruner.fit(base, [])  # only a ranking is needed; values are random anyway
    models = {row: base if method is None else build(base, method, chosen, units[method], pruner) for row, (method, chosen) in sizes.items()}
    latency = {s: interleaved_latency(models, s, args.repeats, args.warmup) for s in seqs}
    h200 = AnalyticCost("h200")

    rows = []
    for row, (method, chosen) in sizes.items():
        u = units[method or "ASVD"]
        rows.append({
            "variant": row,
            "aligned_8": aligned_fraction(u, chosen, 8) if method else 1.0,
            "unit_params": total_params(u, chosen),
            **{f"prefill{s}_ms": 1e3 * latency[s][row]["prefill_s"] for s in seqs},
            "decode_tok_s": 1 / latency[seqs[0]][row]["decode_s"],
            f"h200_predicted_prefill{seqs[-1]}_ms": 1e3 * predicted_latency(models[row], h200, seqs[-1], seqs[-1]),
        })
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (dry run)"
    head = ["variant", "aligned %8", "unit params"] + [f"prefill S={s} ms" for s in seqs] + ["decode tok/s", f"H200 analytic S={seqs[-1]} ms"]
    lines = [
        f"# GAC table latency on {name} ({dtype}, torch {torch.__version__})\n",
        f"From {args.table}; random weights; batch 1; median of {args.repeats} after {args.warmup} warm-up rounds, variants in "
        f"turns, synchronised. (device) rows: GAC re-run with GEMM latencies measured here at S={args.select_seq} "
        f"(profiling + selection {profile_s:.0f} s). Total {time.time() - started:.0f} s.\n",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in rows:
        cells = [r["variant"], f"{100 * r['aligned_8']:.0f}%", f"{r['unit_params']:,}"]
        cells += [f"{r[f'prefill{s}_ms']:.3f}" for s in seqs] + [f"{r['decode_tok_s']:.1f}", f"{r[f'h200_predicted_prefill{seqs[-1]}_ms']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    (out / "gac_gpu.md").write_text("\n".join(lines) + "\n")
    (out / "gac_gpu.json").write_text(json.dumps({"device": name, "dtype": dtype, "rows": rows, "sizes": sizes}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
