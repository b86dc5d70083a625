"""Codec cost on this machine: encode + decode time per million elements of a whole bucket, relative
to a plain fp32 -> fp16 cast of the same tensor, and wire bits per element.

Encode includes the per-parameter max |g| the header needs. Each repeat times the cast, the cast into
a buffer and the codec back to back (A B A B): the cast alone moves between runs (1.41 against
1.57 ms/M at 4M elements, one thread), so a ratio holds against the cast of the same moment; the table
gives each ratio's median over the repeats and the x cast ratio's min-max. Each (codec, size, threads)
is timed after one untimed call; that first call's extra time is the compile (torch.compile, when a compiler
is present; NETGAIN_COMPILE=0 times the eager path). A second process then repeats the first calls
at the first size and the last thread count, as a restarted job would, to show what compiling
costs once the cache is warm.

    python bench/codecs.py [--numel 4194304 67108864] [--world-size 2] [--threads 1 2] [--repeats 5]

Writes bench/results/codecs.md and codecs.csv.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from netgain.comm import kernel
from netgain.comm.calibrate import bucket_wire_bits, time_codec
from netgain.comm.config import SETTINGS as VARIANTS, make_codec
from provenance import git_commit, wait_for_quiet, write_csv


def cast_seconds(x: torch.Tensor, out: torch.Tensor | None = None) -> float:
    """One fp32 -> fp16 cast of x: x.to(fp16) (a new tensor, as earlier runs of this bench), or into `out`."""
    start = time.perf_counter()
    out.copy_(x) if out is not None else x.to(torch.float16)
    return time.perf_counter() - start


def paired(codec, x: torch.Tensor, out: torch.Tensor, world_size: int, repeats: int, parameters: int) -> dict:
    """Per repeat: the cast, the cast into a buffer, then the codec's encode + decode (one timed call)."""
    runs = []
    for _ in range(repeats):
        cast, cast_into = cast_seconds(x), cast_seconds(x, out)
        t = time_codec(codec, x.numel(), world_size, repeats=1, parameters=parameters)
        runs.append({"cast": cast, "cast_into": cast_into, **t})
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]} | {
        "x_cast": sorted((r["encode_s"] + r["decode_s"]) / r["cast"] for r in runs),
        "x_into": statistics.median((r["encode_s"] + r["decode_s"]) / r["cast_into"] for r in runs)}


COMPILER_IMPORT = "import of torch's compiler"


def first_calls(numel: int, world_size: int, parameters: int) -> dict:
    """Seconds of each codec's first encode + decode (compile included) in this process, after the
    import of torch's compiler stack, timed first: a process pays it once, whatever it compiles."""
    start = time.perf_counter()
    import torch._dynamo  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401
    out = {COMPILER_IMPORT: time.perf_counter() - start}
    for name, params in VARIANTS:
        codec = make_codec(name, **params)
        start = time.perf_counter()
        time_codec(codec, numel, world_size, repeats=1, parameters=parameters)
        out[codec.describe()] = time.perf_counter() - start
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, nargs="+", default=[1 << 22, 1 << 26])
    parser.add_argument("--world-size", type=int, nargs="+", default=[2])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch intra-op threads")
    parser.add_argument("--parameters", type=int, default=16, help="parameters per bucket (segments)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--first-calls", action="store_true", help=argparse.SUPPRESS)  # the second process
    args = parser.parse_args()
    if args.first_calls:
        torch.set_num_threads(args.threads[0])
        print(json.dumps(first_calls(args.numel[0], args.world_size[0], args.parameters)))
        return

    load = wait_for_quiet()
    compiled = kernel.compile_mode(torch.device("cpu")) != "eager"
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        torch._dynamo.reset()  # inductor's C++ bakes the thread count in: recompile, or 2 threads run 1-thread code
        for numel in args.numel:
            x, out = torch.randn(numel), torch.empty(numel, dtype=torch.float16)
            per_million = 1e6 / numel
            for name, params in VARIANTS:
                codec = make_codec(name, **params)
                for n in args.world_size:
                    start = time.perf_counter()
                    t = time_codec(codec, numel, n, repeats=1, parameters=args.parameters)
                    first = time.perf_counter() - start - 2 * (t["encode_s"] + t["decode_s"])  # the untimed call, less a timed one
                    t = paired(codec, x, out, n, args.repeats, args.parameters)
                    rows.append({"codec": codec.describe(), "numel": numel, "threads": threads, "world_size": n,
                                 "wire_bits": round(bucket_wire_bits(codec, numel, n, args.parameters), 3),
                                 "encode_ms_per_M": round(t["encode_s"] * per_million * 1e3, 3),
                                 "decode_ms_per_M": round(t["decode_s"] * per_million * 1e3, 3),
                                 "cast_ms_per_M": round(t["cast"] * per_million * 1e3, 3),
                                 "cast_into_ms_per_M": round(t["cast_into"] * per_million * 1e3, 3),
                                 "x_fp16_cast": round(statistics.median(t["x_cast"]), 2),
                                 "x_fp16_cast_min": round(t["x_cast"][0], 2), "x_fp16_cast_max": round(t["x_cast"][-1], 2),
                                 "x_cast_into": round(t["x_into"], 2),
                                 "first_call_extra_s": round(max(first, 0.0), 2),
                                 "unbiased": codec.unbiased})
                    print(rows[-1], flush=True)
    second = subprocess.run([sys.executable, __file__, "--first-calls", "--numel", str(args.numel[0]), "--world-size", str(args.world_size[0]),
                             "--parameters", str(args.parameters), "--threads", str(args.threads[-1])], capture_output=True, text=True, check=True)
    warm = json.loads(second.stdout.strip().splitlines()[-1])

    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "codecs.csv", rows)
    command = (f"python bench/codecs.py --numel {' '.join(map(str, args.numel))} --world-size "
               f"{' '.join(map(str, args.world_size))} --threads {' '.join(map(str, args.threads))} "
               f"--parameters {args.parameters} --repeats {args.repeats}")
    lines = [
        "# Codec cost per million elements",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
        f"commit {git_commit()}; load average {load:.2f} at the start (after waiting for it to fall below 1); command: `{command}`.",
        f"Path: {'compiled (torch.compile, C++)' if compiled else 'eager'}. Buckets of {args.parameters} equal "
        "parameters; encode includes the per-parameter max |g| of the header. Baselines, same run and thread count: "
        "the fp32 -> fp16 cast `x.to(torch.float16)` of the same size (`cast ms/M`, as earlier runs of this bench; "
        "it allocates its result) and the same cast into a preallocated tensor (`into ms/M`). `x cast`, `x into` = "
        "(encode + decode) / each, per repeat against the casts timed just before it: median (and x cast's min-max) "
        "over the repeats. `first call +s`: extra seconds of the first, untimed call (the compile, with a cold or warm cache "
        "in this process). Wire bits: payload bits per element each rank contributes.",
        "",
        "| codec | elements | threads | n | wire bits | encode ms/M | decode ms/M | cast ms/M | x cast (min-max) | into ms/M | x into | first call +s | unbiased |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [f"| {r['codec']} | {r['numel']:,} | {r['threads']} | {r['world_size']} | {r['wire_bits']} | "
              f"{r['encode_ms_per_M']} | {r['decode_ms_per_M']} | {r['cast_ms_per_M']} | "
              f"{r['x_fp16_cast']} ({r['x_fp16_cast_min']}-{r['x_fp16_cast_max']}) | "
              f"{r['cast_into_ms_per_M']} | {r['x_cast_into']} | {r['first_call_extra_s']} | {'yes' if r['unbiased'] else 'no'} |" for r in rows]
    compiler_import_s = warm.pop(COMPILER_IMPORT)
    lines += ["", f"A second process, as a restarted job (the first size, {args.numel[0]:,} elements, at {args.threads[-1]} "
              f"threads; compile cache warm): seconds of the {COMPILER_IMPORT} ({compiler_import_s:.2f}, once per "
              "process, first), then of each codec's first encode + decode, compile included: "
              + ", ".join(f"{k} {v:.2f}" for k, v in warm.items()) + "."]
    (args.out / "codecs.md").write_text("\n".join(lines) + "\n")
    print((args.out / "codecs.md").read_text())


if __name__ == "__main__":
    main()
