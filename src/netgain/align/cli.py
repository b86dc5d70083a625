"""`netgain align`: compress a HF causal LM, re-select aligned sizes with GAC, save it, and compare variants.

Variants reported, all from one run of `netgain.align.compress`: dense; the raw compressor; naive
rounding of its sizes to multiples of 8 (nearest: ignores the budget; down: keeps it); GAC under
the raw compressor's parameter count. With no --model, the packaged Gemma-3-270M (converted once
into the user cache); with no --calib / --eval, the Python docs (Debian package python3.11-doc).
`netgain align export --model DIR --dense OUT` writes a saved output as a plain, full-size model.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from ..cost.modelconfig import load_config
from ..cost.profile import MAX_ROUNDS
from . import store
from .config import COSTS, VARIANTS as APPLIED
from .prune import IMPORTANCE, SCOPES

METHODS = ("svdllm", "asvd", "prune")
EXPORT_HELP = ("Every factorised Linear multiplied back and every pruned one zero-filled to its full shape: the same "
               "function for engines that know only dense layers, at the dense model's size (it gives up the compression).")
VARIANTS = ("dense",) + APPLIED


def configure(parser) -> None:
    parser.add_argument("--model", default=None,
                        help="local Hugging Face model directory (default: the packaged Gemma-3-270M, converted once into the user cache)")
    parser.add_argument("--method", default="svdllm", choices=METHODS, help="the compressor GAC wraps")
    parser.add_argument("--param-ratio", type=float, default=0.85, help="parameters kept in the decoder Linears")
    parser.add_argument("--cost", default="measured", choices=COSTS, help="latency model GAC uses to drop cliffs")
    parser.add_argument("--calib", default=None, help="calibration text: a file or a directory of *.txt (default: the Python docs' library reference)")
    parser.add_argument("--eval", default=None, help="held-out text for perplexity (default: the rest of the Python docs)")
    parser.add_argument("--out", default=None, help="directory for the saved model and the report: new, empty, or an "
                        "earlier netgain output (never --model, inside it, or another model's folder); required")
    parser.add_argument("--save", default="gac", choices=VARIANTS[1:], help="which variant to save")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)} (default: all)")
    parser.add_argument("--predict", default="a100,h100", help="analytic GPU presets for predicted-latency columns "
                        "(comma-separated; an empty string: none)")
    parser.add_argument("--calib-seqs", type=int, default=16, help="calibration sequences (SVD-LLM wants more tokens than the widest Linear input)")
    parser.add_argument("--calib-len", type=int, default=256, help="tokens per calibration sequence")
    parser.add_argument("--check-seqs", type=int, default=8,
                        help="sequences of the calibration text after the calibration's own, on which GAC's sizes must beat "
                             "round-down's to be kept (0: no check; else at least 2)")
    parser.add_argument("--eval-chunks", type=int, default=4, help="held-out chunks of --seq tokens for perplexity")
    parser.add_argument("--seq", type=int, default=512, help="prefill tokens for latency and for GAC's cost model")
    parser.add_argument("--alpha", type=float, default=0.5, help="asvd: activation exponent")
    parser.add_argument("--jitter", type=float, default=1e-6, help="svdllm: diagonal jitter (x mean diagonal) where the covariance is not positive definite")
    parser.add_argument("--importance", default="taylor", choices=IMPORTANCE, help="prune: channel/head salience")
    parser.add_argument("--scope", default="uniform", choices=SCOPES, help="prune: same ratio per layer, or global ranking")
    parser.add_argument("--layers", default=None, help="prune: layer range START:END (END exclusive; default all)")
    parser.add_argument("--keep-heads", action="store_true", help="prune: prune MLP channels only")
    parser.add_argument("--multiple", type=int, default=8, help="alignment of GAC's candidates and of the rounding baselines")
    parser.add_argument("--steps", type=int, default=4, help="candidates per side of the proposed size")
    parser.add_argument("--tolerance", type=float, default=0.03, help="measured speed-ups below this fraction are noise")
    parser.add_argument("--repeats", type=int, default=5, help=f"timing repeats (median), 1..{MAX_ROUNDS}")
    parser.add_argument("--cache", default=None, help="kernel timing table for --cost measured (default: ~/.cache/netgain/...)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads, from 1 to the cores this process may use (default: torch's choice)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="dtype the model is loaded, compressed and timed in")
    actions = parser.add_subparsers(dest="action", metavar="export", help="netgain align export --model DIR --dense OUT: "
                                    "a compressed model as a plain, full-size transformers folder")
    export = actions.add_parser("export", help="write a netgain align output as a plain transformers folder",
                                description=EXPORT_HELP)
    export.add_argument("--model", required=True, help="a folder netgain align wrote")
    export.add_argument("--dense", required=True, help="directory for the dense copy (same rules as --out)")


def _parse_list(text: str, allowed, what: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in allowed]
    if bad or not items:
        raise SystemExit(f"--{what} must be a comma-separated subset of {', '.join(allowed)}, got {text!r}")
    return items


def _checked(check: dict | None, args) -> str:
    """The summary's words for GAC's check on held-out calibration text (`Compression.verify_gac`)."""
    if check is None:
        return "; GAC not checked (--check-seqs 0)"
    if check["same_as_round_down"]:
        return "; GAC's sizes are round-down's (nothing to check)"
    verdict = "GAC kept" if check["kept"] else "round-down's sizes taken for gac"
    return (f"; GAC / round-down perplexity on {args.check_seqs} x {args.calib_len} held-out calibration tokens "
            f"{check['ratio']:.4f} ({check['low']:.4f}-{check['high']:.4f}): {verdict}")


def model_dir(model: str | None) -> Path:
    """--model as a local Hugging Face directory (checked before anything is loaded), or the packaged default."""
    if model is None:
        from .defaults import packaged_gemma

        path = packaged_gemma()
        print(f"netgain align: no --model given; using the packaged Gemma-3-270M from {path}", file=sys.stderr)
        return path
    path = Path(model)
    if not model or not path.is_dir():  # '' would be the current directory
        raise SystemExit(f"--model {model!r}: no such directory (a local Hugging Face model directory; omit --model "
                         "for the packaged Gemma-3-270M)")
    if not (path / "config.json").is_file():
        raise SystemExit(f"--model {model} is not a Hugging Face model directory: it has no config.json")
    load_config(path, "--model")  # a regular file that loads, its layers bounded before any build
    factorised = [name for name, spec in store.compressed_modules(path).items() if spec.get("kind") == "lowrank"]
    if factorised:
        raise SystemExit(f"--model {model} is a netgain low-rank model ({len(factorised)} Linears already factorised): "
                         "compressing its factors again is not supported; give the model it was compressed from, or "
                         f"compress a dense copy (netgain align export --model {model} --dense DIR)")
    return path


def check_out(out: str | None, model: Path, flag: str = "--out") -> Path:
    """Refuse an output directory that would overwrite a model: --model itself or a folder inside it,
    compared by inode (a symlink or bind mount of --model is caught), or a folder that holds files
    netgain did not write (another model's). A previous netgain output may be written again: its
    files are replaced by os.replace (`store.write_folder`), never written through a hard link."""
    if not out:
        raise SystemExit(f"{flag} is required: give the directory for the saved model")
    path = Path(out).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())  # what saving would create the folder in
    if not existing.is_dir():
        raise SystemExit(f"{flag} {out}: {existing} is an existing file, not a directory: choose a directory")
    try:  # before any work: /proc/self/x failed at the save, after compressing
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise SystemExit(f"{flag} {out}: cannot write in {existing} ({error.strerror or error})") from None
    if any(os.path.samefile(p, model) for p in (existing, *existing.parents)):
        raise SystemExit(f"{flag} {out} is --model {model} or inside it: saving would overwrite the input model; "
                         "choose another directory")
    if existing == path and any(path.iterdir()) and store.manifest(path) is None:
        raise SystemExit(f"{flag} {out} holds files netgain did not write (no netgain manifest.json), perhaps another "
                         "model: choose a new or empty directory")
    return Path(out)


def check_counts(args) -> None:
    """The integer flags AlignConfig does not check (it checks --multiple and --steps), named as on the
    command line, before a model is loaded; a sequence needs two tokens for one prediction. The text
    bounds the sequence counts; --repeats 1e30 timed for ever and --threads 1e30 overflowed in torch."""
    cores = len(os.sched_getaffinity(0))
    for flag, value, least, most in (("--calib-seqs", args.calib_seqs, 1, None), ("--calib-len", args.calib_len, 2, None),
                                     ("--eval-chunks", args.eval_chunks, 1, None), ("--seq", args.seq, 2, None),
                                     ("--repeats", args.repeats, 1, MAX_ROUNDS), ("--threads", args.threads, 1, cores)):
        if value is not None and value < least:
            raise SystemExit(f"{flag} must be at least {least}, got {value}")
        if value is not None and most is not None and value > most:
            raise SystemExit(f"{flag} must be at most {most}, got {value}")
    if args.check_seqs < 0 or args.check_seqs == 1:
        raise SystemExit(f"--check-seqs must be 0 (GAC unchecked) or >= 2 (its interval needs two), got {args.check_seqs}")


def text(path: str | None, flag: str) -> str:
    """The text of --calib or --eval: a file, a directory of *.txt, or (None) the Python docs' split."""
    from .defaults import python_docs
    from .evaluate import read_text

    if path is None:
        return python_docs(flag)
    if not path:
        raise SystemExit(f"--{flag} is empty: give a text file or a directory of *.txt (or leave --{flag} out for the "
                         "Python docs)")
    try:
        return read_text(path, f"--{flag}")
    except OSError as error:
        raise SystemExit(f"--{flag} {path}: {error.strerror or error} (a text file or a directory of *.txt)") from None


def align_config(args):
    """The AlignConfig the flags describe (validated there)."""
    from ..cost.profile import MeasuredCost
    from .config import AlignConfig, ASVDConfig, PrunerConfig, SVDLLMConfig

    compressor = {
        "asvd": lambda: ASVDConfig(alpha=args.alpha),
        "svdllm": lambda: SVDLLMConfig(jitter=args.jitter),
        "prune": lambda: PrunerConfig(args.importance, args.scope, args.layers, heads=not args.keep_heads),
    }[args.method]()
    cost = MeasuredCost("auto", args.dtype, repeats=args.repeats, cache=args.cache) if args.cost == "measured" else args.cost
    return AlignConfig(compressor, args.param_ratio, cost, tokens=args.seq, multiple=args.multiple, steps=args.steps,
                       tolerance=args.tolerance, variant=args.save)


def loaded(source: Path, load):
    """load(), with anything a folder that does not load raises (missing, truncated, pickled or mismatched
    weights, no tokenizer, a hostile manifest: tracebacks before) as one line naming --model."""
    try:
        return load()
    except Exception as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise SystemExit(f"--model {source}: cannot load it ({reason})") from None


def export(args) -> int:
    """`netgain align export`: the dense copy (`store.export_dense`), and what it gives up."""
    source = Path(args.model)
    if store.manifest(source) is None:
        raise SystemExit(f"--model {args.model}: not a folder netgain align wrote (no netgain manifest.json)")
    out = check_out(args.dense, source, "--dense")
    compressed = sum(p.numel() for p in loaded(source, lambda: store.load(source)).parameters())
    dense = sum(p.numel() for p in loaded(source, lambda: store.export_dense(source, out)).parameters())
    print(f"wrote a plain transformers model to {out}: {dense:,} parameters, where {source} holds {compressed:,}. "
          "Same function, at the dense size: the export gives up the compression's memory and speed.")
    return 0


def run(args) -> int:
    from ..cost.kernels import GPUS, AnalyticCost

    if args.action == "export":
        return export(args)
    variants = _parse_list(args.variants, VARIANTS, "variants")
    check_counts(args)
    if args.save not in variants:
        raise SystemExit(f"--save {args.save} must be one of the evaluated --variants ({', '.join(variants)})")
    predict = _parse_list(args.predict, tuple(GPUS), "predict") if args.predict else []
    config = align_config(args)
    source = model_dir(args.model)
    out = check_out(args.out, source)
    calib_text, eval_text = text(args.calib, "calib"), text(args.eval, "eval")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from . import evaluate, report
    from .phases import bar
    from .pipeline import compress

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    tokenizer = loaded(source, lambda: AutoTokenizer.from_pretrained(source, local_files_only=True))
    if store.manifest(source) is not None:  # a pruned netgain model: its real, pruned layers
        model = loaded(source, lambda: store.load(source, args.dtype))
    else:
        model = loaded(source, lambda: AutoModelForCausalLM.from_pretrained(
            source, dtype=getattr(torch, args.dtype), local_files_only=True).eval())
    try:
        chunks = evaluate.token_chunks(tokenizer, calib_text, args.calib_len, args.calib_seqs + args.check_seqs)
    except ValueError as error:
        raise SystemExit(f"--calib: {error} (--calib-seqs {args.calib_seqs} + --check-seqs {args.check_seqs} sequences of "
                         f"--calib-len {args.calib_len}; give more text or fewer sequences)") from None
    calib, validation = chunks[: args.calib_seqs], chunks[args.calib_seqs :] or None
    try:
        held_out = evaluate.token_chunks(tokenizer, eval_text, args.seq, args.eval_chunks)
    except ValueError as error:
        raise SystemExit(f"--eval: {error} (--eval-chunks {args.eval_chunks} chunks of --seq {args.seq}; give more "
                         "text or fewer chunks)") from None

    compressed, result = compress(model, calib, config, validation=validation, inplace=False, progress=True)
    cost = result.cost
    # predicted latency: the sum of the cost model's kernels ("measured-kernels": timed on this device)
    costs = {"measured-kernels" if args.cost == "measured" else args.cost: cost}
    costs.update({p: AnalyticCost(p) for p in predict if p not in costs})
    result.save(compressed, out, tokenizer)
    with result.phases.timed("perplexity and latency of the variants"), \
            bar(len(variants) + 1, "perplexity, then latency in turns") as done:
        rows = result.compare(model, compressed, variants, costs=costs, seq_len=args.seq, eval_chunks=held_out,
                              repeats=args.repeats, progress=done)

    table = report.markdown(rows, result.budget, cost.preferred_multiple)
    priced = cost.describe() if hasattr(cost, "describe") else f"the analytic model of {cost.name}"
    summary = (
        f"model {source}; {args.method} at param ratio {args.param_ratio}: decoder Linears {result.dense_params:,} -> "
        f"budget {result.budget:,} (raw compressor); GAC priced by {priced}; prefill S={args.seq}, batch 1, "
        f"{torch.get_num_threads()} threads, median of {args.repeats} (variants timed in turns)" + _checked(result.check, args)
        + f"; time: {result.phases.summary()} (load average {os.getloadavg()[0]:.2f} on {len(os.sched_getaffinity(0))} cores)"
    )
    record = {"summary": summary, "budget": result.budget, "dense_params": result.dense_params, "sizes": result.sizes,
              "check": result.check, "phases_s": result.phases.seconds, "rows": [r.as_dict() for r in rows]}
    store.write_folder(out, lambda folder: ((folder / "report.md").write_text(f"{summary}\n\n{table}"),
                                            (folder / "report.json").write_text(json.dumps(record, indent=1))))
    print(summary)
    print(table)
    print(f"saved {args.save} model and report to {out}")
    return 0
