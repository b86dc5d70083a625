"""What a codec costs on this machine, as data for the cost model (netgain.cost knows no codecs).

`time_codec` runs a codec's encode and decode on one bucket in-process, with the aggregate faked;
`codec_profile` turns that (or a GPU's memory-bound estimate) into a `network.CodecProfile`, which
Kimad's planner, `netgain model` and the benchmarks price (the planner through `cached_profiles`: once per
machine); `bucket_layout` lays a bucket out as the
hook does, so a codec can be timed or replayed outside training.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from . import fused, kernel
from .codecs import Codec, Context
from .fused import Segments
from .store import BucketLayout
from ..cost import network
from ..cost.kernels import GPU
from ..cost.measured import DEFAULT_CACHE_DIR, cpu_name
from ..files import MANIFEST_MAX_BYTES, require_regular_file, write_atomically

PROFILE_CACHE_FORMAT = "netgain.codec-profiles/1"


def time_codec(codec: Codec, numel: int, world_size: int, repeats: int = 5, seed: int = 0,
               parameters: int = 1, device: str = "cpu", shapes: list[tuple[int, ...]] | None = None) -> dict:
    """Median encode and decode seconds for one bucket of ``numel`` (``parameters`` equal parts, each
    as its squarest matrix; or parameters of these ``shapes``, whose sizes add up to ``numel``), in-process.

    encode_s includes the per-parameter max |g| that the header needs (codecs with needs_scales).
    The aggregated payload is faked as n copies of one worker's payload (a valid input for every
    codec: integer sums stay within their bounds); for the ring codec, decode includes the n - 1
    per-hop combines of one chunk each. The first call (the compile, where one happens, here and now) is
    not timed.
    """
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(device)
    if shapes is not None and sum(math.prod(shape) for shape in shapes) != numel:
        raise ValueError(f"shapes: their sizes add up to {sum(math.prod(shape) for shape in shapes)}, not numel={numel}")
    shapes = list(shapes) if shapes is not None else [_squarest(size) for size in _part_sizes(numel, parameters)]
    layout, memory = bucket_layout(codec, shapes, device)
    segments = layout.segments
    cuda = x.is_cuda
    encode_s, decode_s = [], []
    with kernel.compile_now():  # the compiled path is what is timed: its first call compiles
        for trial in range(repeats + 1):
            ctx = Context.for_step(world_size, segments, seed, trial, 0, tables=layout.tables, feedback=memory,
                                   synchronize=cuda, layout=layout)
            bucket = x.clone()
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            if codec.needs_scales:
                ctx.scales = codec.local_scales(bucket, ctx)
                if cuda:
                    torch.cuda.synchronize()
            ctx.seconds["encode_s"] += time.perf_counter() - start
            payload, op = codec.encode(bucket, ctx), dist.ReduceOp.SUM
            for _ in range(codec.rounds(ctx) - 1):  # low rank's later rounds (a MAX of n copies is one copy)
                payload, op = codec.relay(payload if op == dist.ReduceOp.MAX else payload * world_size, ctx)
            if codec.collective == "allreduce":
                aggregated = payload if payload is bucket else payload * world_size
            elif codec.collective == "allgather":
                aggregated = payload.expand(world_size, *payload.shape).contiguous()
            else:
                chunk = payload[: math.ceil(numel / world_size)]
                for hop in range(world_size - 1):
                    codec.combine(chunk, chunk, hop, ctx)
                aggregated = payload
            codec.decode(aggregated, bucket, ctx)
            if trial:
                encode_s.append(ctx.seconds["encode_s"])
                decode_s.append(ctx.seconds["decode_s"])
    return {"encode_s": sorted(encode_s)[repeats // 2], "decode_s": sorted(decode_s)[repeats // 2]}


def bucket_layout(codec: Codec, shapes: list[tuple[int, ...]], device="cpu") -> tuple[BucketLayout, object]:
    """One bucket of parameters of these shapes as the hook lays it out, and the codec's error-feedback
    memory for it (warm start filled; None without feedback): to time or replay a codec outside training."""
    sizes = [math.prod(shape) for shape in shapes]
    names = [f"p{i}" for i in range(len(sizes))]
    segments = Segments.build(sizes, [fused.name_key(name) for name in names], device)
    spans = [(start, size) for start, size in zip(segments.starts.tolist(), sizes)]
    layout = BucketLayout(names, spans, segments, shapes=list(shapes))
    memory = None
    if codec.uses_feedback:
        memory, shared_spans = codec.memory(layout, device)
        for name, (at, size) in zip(names, shared_spans):
            codec.fill_shared(name, memory.shared[at:at + size])
    return layout, memory


def bucket_wire_bits(codec: Codec, numel: int, world_size: int, parameters: int = 1) -> float:
    """Payload bits per element of time_codec's bucket (``parameters`` equal parts), header excluded:
    wire_bits, except for low rank, whose factors depend on the (squarest) shapes."""
    profile = codec_profile(codec, world_size, "free")
    sizes = _part_sizes(numel, parameters)
    shapes = [_squarest(size) for size in sizes]
    messages = network.bucket_messages(numel, profile, parameters, shapes)[1 if codec.needs_header else 0:]
    return 8 * sum(nbytes for _, nbytes in messages) / numel


def _part_sizes(numel: int, parameters: int) -> list[int]:
    sizes = [numel // parameters] * parameters
    sizes[-1] += numel - sum(sizes)
    return sizes


def _squarest(numel: int) -> tuple[int, int]:
    """The most nearly square rows x cols = numel (what time_codec gives low rank to factor)."""
    rows = max(d for d in range(1, math.isqrt(numel) + 1) if numel % d == 0)
    return (rows, numel // rows)


def codec_profile(codec: Codec, world_size: int, cost: "str | GPU" = "calibrate",
                  calibration_numel: int | None = None, threads: int | None = None,
                  shapes: list[tuple[int, ...]] | None = None) -> network.CodecProfile:
    """The cost model's view of a codec at ``world_size``, as data (netgain.cost knows no codecs).

    cost: "calibrate" times encode/decode on this machine (the fastest of 3 medians, at
    ``threads`` torch threads: a lab worker's share of the cores) on a bucket of
    ``calibration_numel`` elements, or of parameters of these ``shapes`` (a model's own layout:
    low rank's cost is per shape group, so one big matrix would understate it 2-3x); a GPU: a
    fused kernel limited by memory traffic (network.memory_bound_cost); "free": codec work costs
    nothing.
    """
    network.check_world(world_size)
    size = codec.profile_fields(world_size)
    # the hook's header: one allreduce MAX of (header_entries * P + 3) float32 per bucket of P parameters (bucket.header)
    header = ({"header_bytes": network.HEADER_FLAG_BYTES,
               "header_bytes_per_tensor": network.HEADER_BYTES_PER_TENSOR * codec.header_entries}
              if codec.needs_header else {})
    profile = network.CodecProfile(codec.describe(), collective=codec.collective, **size, **header)
    if isinstance(cost, GPU):
        enc, dec, comb = network.memory_bound_cost(size["wire_bits"], codec.collective, world_size,
                                                   codec.needs_scales, cost.memory_bandwidth)
        return dataclasses.replace(profile, encode_s_per_elem=enc, decode_s_per_elem=dec, combine_s_per_elem=comb)
    if cost == "free":
        return profile
    if cost != "calibrate":
        raise ValueError(f"cost: must be a GPU or one of {', '.join(network.CODEC_COSTS)}, got {cost!r}")
    numel = sum(math.prod(shape) for shape in shapes) if shapes else calibration_numel or max(2**14, network.CALIBRATION_ELEMENTS // world_size)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads or previous)
    try:
        # first a bucket like a model's, small parameters among large ones: torch.compile specializes
        # sizes of 1 (one parameter's scale, one element that three parameters share), so this builds
        # the dynamic-shape kernels that real buckets run, not the first step that uses the codec
        # (Kimad's 1.3-2 s stall when its plan switched codecs)
        half = numel // 4 + 1
        time_codec(codec, 2 * half + 24, world_size, repeats=1, shapes=[(half,), *[(3,)] * 8, (half,)])
        runs = [time_codec(codec, numel, world_size, repeats=3, shapes=shapes) for _ in range(3)]
    finally:
        torch.set_num_threads(previous)
    enc, dec = min(r["encode_s"] for r in runs), min(r["decode_s"] for r in runs)
    return dataclasses.replace(profile, encode_s_per_elem=enc / numel, decode_s_per_elem=dec / numel)


def cached_profiles(codecs: list[tuple[Codec, list[tuple[int, ...]] | None]], world_size: int,
                    calibration_numel: int | None = None, cache: "str | None" = None) -> list[network.CodecProfile]:
    """codec_profile(codec, world_size, "calibrate", calibration_numel, shapes) of each (codec, shapes),
    measured once per machine and read back by later processes from ``cache`` (default
    DEFAULT_CACHE_DIR/codec-profiles.json): the file is read once, and written once if any was missing.

    Why: calibrating times the compiled path, and its first call compiles: 3-11 s of a job's first steps
    on a 2-core CPU, in every process. The key holds all that the cost depends on: the codec, world size,
    bucket, torch threads, compile mode, CPU model and torch version. Entries are plain numbers in JSON
    (nothing read can run code); an unreadable cache is measured again and rewritten.
    """
    path = Path(cache) if cache is not None else DEFAULT_CACHE_DIR / "codec-profiles.json"
    machine = [torch.get_num_threads(), kernel.compile_mode(torch.device("cpu")) == "eager", cpu_name(), torch.__version__]
    entries, added, profiles = _read_profiles(path), {}, []
    for codec, shapes in codecs:
        key = json.dumps([codec.describe(), world_size, calibration_numel, shapes and [list(s) for s in shapes], *machine])
        if key in entries:
            encode, decode = entries[key]
            profiles.append(dataclasses.replace(codec_profile(codec, world_size, "free"),
                                                encode_s_per_elem=encode, decode_s_per_elem=decode))
            continue
        profile = codec_profile(codec, world_size, "calibrate", calibration_numel=calibration_numel, shapes=shapes)
        added[key] = [profile.encode_s_per_elem, profile.decode_s_per_elem]
        profiles.append(profile)
    if added:
        entries = {**_read_profiles(path), **added}  # another process's entries too, written meanwhile
        record = json.dumps({"format": PROFILE_CACHE_FORMAT, "entries": entries}, indent=0).encode()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(path, lambda f: f.write(record))
        except OSError as error:  # a read-only home: the run goes on, the next process calibrates again
            warnings.warn(f"netgain: could not keep codec calibrations in {path} ({error})", RuntimeWarning)
    return profiles


def _read_profiles(path: Path) -> dict[str, list[float]]:
    """The cache's entries, or none if it is missing, too large, not JSON or not netgain's format."""
    try:
        require_regular_file(path, "codec profile cache", MANIFEST_MAX_BYTES)
        stored = json.loads(path.read_bytes())
        entries = stored["entries"] if stored.get("format") == PROFILE_CACHE_FORMAT else {}
        return {k: [float(e), float(d)] for k, (e, d) in entries.items() if math.isfinite(e) and math.isfinite(d)}
    except (ValueError, OSError, KeyError, TypeError, AttributeError):
        return {}
