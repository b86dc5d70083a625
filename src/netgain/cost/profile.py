"""`netgain profile`: fill the measured cost table for a model's shapes ahead of time.

Times, on this device and in interleaved rounds (`netgain.cost.measured`), every GEMM a
low-rank compression of the model's decoder Linears could run — each Linear dense and factorised
at a sweep of ranks, for a prefill of --seq tokens and for one decode token — and the per-layer
work around them (norms, activation, attention, elementwise passes, module calls) that
`netgain.cost.latency` adds up. Only the model's config is read; weights are never loaded.
Entries the table holds are reused unless they were disturbed (`netgain.cost.measured.Entry`);
--refresh measures every one this model uses again.
"""

from __future__ import annotations

import os

import torch

from ..files import WriteError, in_bytes, machine_memory_bytes
from .latency import predict
from .measured import DEFAULT_CACHE_DIR, DTYPES, MeasuredCost, cpu_name
from .modelconfig import load_config, meta_model

MAX_ROUNDS = 1000  # --repeats, --warmup: a shape's spread settles within tens of interleaved rounds
MAX_RATIO = 2.0  # a factorised size twice the dense one is full rank for a square layer

__all__ = ["DEFAULT_CACHE_DIR", "MeasuredCost", "configure", "cpu_name", "linear_shapes", "rank_sweep", "run"]


def shape_model(config):
    """The causal LM of a config on the meta device (shapes only)."""
    return meta_model(config, "--model", causal_lm=True)


def linear_shapes(config) -> list[tuple[int, int]]:
    """Distinct (in_features, out_features) of the Linears inside a model's decoder layers (no weights loaded)."""
    shapes = {
        (m.in_features, m.out_features)
        for name, m in shape_model(config).named_modules()
        if isinstance(m, torch.nn.Linear) and ".layers." in f".{name}"
    }
    return sorted(shapes)


def rank_sweep(in_features: int, out_features: int, step: int, min_ratio: float, max_ratio: float) -> list[int]:
    """Ranks at multiples of `step` whose factorised size is within [min_ratio, max_ratio] of the dense layer."""
    breakeven = in_features * out_features / (in_features + out_features)
    low = max(step, step * int(min_ratio * breakeven // step))
    return list(range(low, int(max_ratio * breakeven) + 1, step))


def configure(parser) -> None:
    parser.add_argument("--model", required=True, help="Hugging Face model directory (only its config is read)")
    parser.add_argument("--seq", type=int, default=512, help="prefill tokens (decode is timed with 1 token)")
    parser.add_argument("--step", type=int, default=8, help="rank sweep step")
    parser.add_argument("--min-ratio", type=float, default=0.6, help="smallest factorised size / dense size")
    parser.add_argument("--max-ratio", type=float, default=1.0, help="largest factorised size / dense size")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="dtype the shapes are timed in")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda when torch sees one, else cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds per shape (interleaved)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds per shape before the timed ones")
    parser.add_argument("--refresh", action="store_true",
                        help="measure every entry this model uses again, even those the table holds undisturbed")
    parser.add_argument("--cache", default=None, help=f"JSON table path (default: {DEFAULT_CACHE_DIR}/kernels-<device>-<dtype>.json)")


def check_args(args) -> None:
    """Every number `netgain profile` takes, named as on the command line, before the model is read."""
    if not 0 < args.min_ratio <= args.max_ratio <= MAX_RATIO:
        raise ValueError(f"--min-ratio/--max-ratio must satisfy 0 < min <= max <= {MAX_RATIO:g} (full rank of a square "
                         f"layer), got {args.min_ratio}, {args.max_ratio}")
    if args.seq < 1 or args.step < 1:
        raise ValueError(f"--seq and --step must be >= 1, got --seq {args.seq}, --step {args.step}")
    for flag, rounds in (("--repeats", args.repeats), ("--warmup", args.warmup)):
        if rounds > MAX_ROUNDS:
            raise ValueError(f"{flag} must be at most {MAX_ROUNDS}, got {rounds}")
    cores = os.cpu_count() or 1
    if args.threads is not None and args.threads > cores:
        raise ValueError(f"--threads must be at most this machine's {cores} cores, got {args.threads}")


def check_sizes(config, shapes: list[tuple[int, int]], seq: int, dtype: str) -> None:
    """A prefill the model can run (--seq within its context) whose largest GEMM (x, w and out) fits in half of
    this machine's memory, before anything is allocated."""
    context = getattr(config.get_text_config(), "max_position_embeddings", None)
    if isinstance(context, int) and seq > context:
        raise ValueError(f"--seq {seq} is longer than the model's context (max_position_embeddings={context})")
    largest = max((seq * k + k * n + seq * n for k, n in shapes), default=0) * torch.finfo(DTYPES[dtype]).bits // 8
    if largest > machine_memory_bytes() // 2:
        raise ValueError(f"--seq {seq}: the model's largest GEMM holds {in_bytes(largest)} at once, more than half of "
                         f"this machine's {in_bytes(machine_memory_bytes())}")


def run(args) -> int:
    check_args(args)
    config = load_config(args.model, "--model")
    shapes = linear_shapes(config)
    check_sizes(config, shapes, args.seq, args.dtype)
    cost = MeasuredCost(args.device, args.dtype, threads=args.threads, warmup=args.warmup, repeats=args.repeats, cache=args.cache,
                        refresh=args.refresh)
    jobs = set()
    for k, n in shapes:
        for tokens in (args.seq, 1):
            jobs.add((tokens, k, n))
            for r in rank_sweep(k, n, args.step, args.min_ratio, args.max_ratio):
                jobs.update({(tokens, k, r), (tokens, r, n)})
    print(f"timing {len(jobs)} GEMM shapes on {cost.name} ({cost.threads} threads, {args.dtype}), {args.repeats} interleaved rounds")
    cost.measure_gemms(sorted(jobs))
    model = shape_model(config)
    prefill = predict(model, cost, args.seq, args.seq)  # also times the per-layer work around the GEMMs
    decode = predict(model, cost, 1, args.seq + 1)
    try:
        cost.save()
    except WriteError as error:  # one line, as bad input is; the earlier table is unchanged
        raise ValueError(str(error)) from None
    print(f"dense model predicted: prefill S={args.seq} {prefill.total_s * 1e3:.1f} ms "
          f"(overheads {prefill.overhead_s * 1e3:.1f} ms), decode {decode.total_s * 1e3:.2f} ms")
    print(cost.describe())
    return 0
