"""`netgain align`: compress a HF causal LM, re-select aligned sizes with GAC, save it, and compare variants.

Variants reported, all from one run: dense; the raw compressor; naive rounding of its sizes to
multiples of 8 (nearest: ignores the budget; down: keeps it); GAC under the raw compressor's
parameter count.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from ..cost.kernels import PRESETS
from .prune import IMPORTANCE, SCOPES

METHODS = ("asvd", "prune")
COSTS = ("measured",) + tuple(sorted(PRESETS))
VARIANTS = ("dense", "raw", "round-nearest", "round-down", "gac")


def configure(parser) -> None:
    parser.add_argument("--model", required=True, help="Hugging Face model directory (from_pretrained)")
    parser.add_argument("--method", default="asvd", choices=METHODS, help="the compressor GAC wraps")
    parser.add_argument("--param-ratio", type=float, default=0.85, help="parameters kept in the decoder Linears")
    parser.add_argument("--cost", default="measured", choices=COSTS, help="latency model GAC uses to drop cliffs")
    parser.add_argument("--calib", required=True, help="calibration text: a file or a directory of *.txt")
    parser.add_argument("--eval", required=True, help="held-out text for perplexity (a different split)")
    parser.add_argument("--out", required=True, help="directory for the saved model and the report")
    parser.add_argument("--save", default="gac", choices=VARIANTS[1:], help="which variant to save")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}")
    parser.add_argument("--predict", default="a100,h100", help="analytic GPU presets for predicted-latency columns")
    parser.add_argument("--calib-seqs", type=int, default=8)
    parser.add_argument("--calib-len", type=int, default=256)
    parser.add_argument("--eval-chunks", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512, help="prefill tokens for latency and for GAC's cost model")
    parser.add_argument("--alpha", type=float, default=0.5, help="ASVD activation exponent")
    parser.add_argument("--importance", default="taylor", choices=IMPORTANCE, help="pruner: channel/head salience")
    parser.add_argument("--scope", default="uniform", choices=SCOPES, help="pruner: same ratio per layer, or global ranking")
    parser.add_argument("--layers", default=None, help="pruner: layer range START:END (END exclusive; default all)")
    parser.add_argument("--keep-heads", action="store_true", help="pruner: prune MLP channels only")
    parser.add_argument("--multiple", type=int, default=8, help="alignment of GAC's candidates")
    parser.add_argument("--steps", type=int, default=4, help="candidates per side of the proposed size")
    parser.add_argument("--tolerance", type=float, default=0.03, help="measured speed-ups below this fraction are noise")
    parser.add_argument("--repeats", type=int, default=5, help="timing repeats (median)")
    parser.add_argument("--cache", default=None, help="kernel timing table for --cost measured (default: ~/.cache/netgain/...)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])


def _parse_list(text: str, allowed, what: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in allowed]
    if bad or not items:
        raise SystemExit(f"--{what} must be a comma-separated subset of {', '.join(allowed)}, got {text!r}")
    return items


def run(args) -> int:
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..cost.kernels import AnalyticCost
    from ..cost.profile import MeasuredCost
    from . import evaluate, gac, prune, report, store
    from .lowrank import ASVD, decoder_linears
    from .units import full_sizes, proposed_sizes, total_params

    variants = _parse_list(args.variants, VARIANTS, "variants")
    if args.save not in variants:
        raise SystemExit(f"--save {args.save} must be one of the evaluated --variants ({', '.join(variants)})")
    predict = _parse_list(args.predict, tuple(PRESETS), "predict") if args.predict else []
    if not 0 < args.param_ratio <= 1:
        raise SystemExit(f"--param-ratio must be in (0, 1], got {args.param_ratio}")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    calib = evaluate.token_chunks(tokenizer, evaluate.read_text(args.calib), args.calib_len, args.calib_seqs)
    held_out = evaluate.token_chunks(tokenizer, evaluate.read_text(args.eval), args.seq, args.eval_chunks)

    if args.method == "asvd":
        compressor, sizing = ASVD(alpha=args.alpha), gac
        steps, what = len(calib) + len(decoder_linears(model)), "calibrate + SVD"
    else:  # the pruner's GAC re-selects MLP widths only (head counts are multiples of head_dim)
        try:
            layers = prune.parse_layers(args.layers)
        except ValueError as error:
            raise SystemExit(f"--{error}")
        compressor, sizing = prune.Pruner(args.importance, args.scope, layers, heads=not args.keep_heads), prune
        steps, what = len(calib), f"calibrate ({args.importance})"
    with tqdm(total=steps, desc=what, unit="step") as bar:
        compressor.fit(model, calib, progress=bar)
    units = compressor.propose(args.param_ratio)
    budget = total_params(units, proposed_sizes(units))
    dense_params = total_params(units, full_sizes(units))

    if args.cost == "measured":
        cost = MeasuredCost("auto", args.dtype, repeats=args.repeats, cache=args.cache)
    else:
        cost = AnalyticCost(args.cost)
    sizes = {"dense": full_sizes(units), "raw": proposed_sizes(units)}
    sizes["round-nearest"] = sizing.round_sizes(units, 8, "nearest")
    sizes["round-down"] = sizing.round_sizes(units, 8, "down")
    with tqdm(total=len(units), desc=f"GAC candidates ({cost.name})", unit="layer") as bar:
        sizes["gac"] = sizing.select(
            units, cost, args.seq, multiple=args.multiple, steps=args.steps, tolerance=args.tolerance, progress=bar
        )
    if isinstance(cost, MeasuredCost):
        cost.save()

    # predicted latency: the sum of the cost model's kernels ("measured-kernels": timed on this device)
    costs = {"measured-kernels" if args.cost == "measured" else args.cost: cost}
    costs.update({p: AnalyticCost(p) for p in predict if p not in costs})
    out = Path(args.out)
    built = {}
    for variant in variants:
        candidate = model if variant == "dense" else copy.deepcopy(model)
        compressor.apply(candidate, sizes[variant])
        built[variant] = (candidate, sizes[variant])
    store.save(built[args.save][0], out, tokenizer, method=args.method, variant=args.save, param_ratio=args.param_ratio,
               sizes=sizes[args.save])
    with tqdm(total=len(variants) + 1, desc="perplexity, then latency in turns", unit="step") as bar:
        rows = report.compare(
            built, units, costs=costs, preferred_multiple=cost.preferred_multiple, seq_len=args.seq,
            eval_chunks=held_out, repeats=args.repeats, progress=bar,
        )

    table = report.markdown(rows, budget, cost.preferred_multiple)
    summary = (
        f"model {args.model}; {args.method} at param ratio {args.param_ratio}: decoder Linears {dense_params:,} -> "
        f"budget {budget:,} (raw compressor); cost model for GAC: {cost.name}; prefill S={args.seq}, batch 1, "
        f"{torch.get_num_threads()} threads, median of {args.repeats} (variants timed in turns)"
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(f"{summary}\n\n{table}")
    (out / "report.json").write_text(
        json.dumps({"summary": summary, "budget": budget, "dense_params": dense_params, "sizes": sizes,
                    "rows": [r.as_dict() for r in rows]}, indent=1)
    )
    print(summary)
    print(table)
    print(f"saved {args.save} model and report to {out}")
    return 0
