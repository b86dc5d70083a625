"""Codec cost, before and after a change: fresh processes alternating base and head (A B B A ...).

Why: a codec's cost moves 2x between processes on a shared machine (allocator state, caches), so a
change is judged per pair of neighbouring processes, never against a number from another run.

    git worktree add /tmp/base <rev>
    python bench/codec_ab.py --base /tmp/base --codecs "gqsgd(bits=8,encoding=packed)" "gqsgd-exp(bits=8)"

Codecs are named as bench/codecs.py's table names them (netgain.comm.codecs.SETTINGS; default: all).
Each process: 1 torch thread, `time_codec` (one untimed call, the compile, then the median of 5) of each
codec on a bucket of --parameters equal parameters. Writes OUT.md: encode + decode ms per million
elements, median (min-max) over rounds, and the speed-up per pair.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from provenance import git_commit, wait_for_quiet

HEAD = Path(__file__).resolve().parent.parent


def measure(args) -> None:
    import torch

    from netgain.comm.codecs import time_codec

    torch.set_num_threads(1)
    out = {}
    for name, codec in settings().items():
        if name in args.codecs:
            t = time_codec(codec, args.numel, args.world_size, repeats=5, parameters=args.parameters)  # untimed 1st call
            out[name] = (t["encode_s"] + t["decode_s"]) * 1e9 / args.numel  # ms per million
    print(json.dumps(out))


def settings() -> dict:
    """The codecs of bench/codecs.py's table, by the name it shows."""
    from netgain.comm.codecs import SETTINGS, make_codec

    codecs = [make_codec(name, **params) for name, params in SETTINGS]
    return {codec.describe(): codec for codec in codecs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, help="a checkout of the base revision (e.g. a git worktree)")
    parser.add_argument("--codecs", nargs="+", help="names as bench/codecs.py shows them (default: all)")
    parser.add_argument("--numel", type=int, default=1 << 22)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--parameters", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=HEAD / "bench" / "results" / "codec_ab")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # one process
    args = parser.parse_args()
    if args.measure:
        return measure(args)
    if args.base is None:
        parser.error("--base is required: a checkout of the revision to compare against")
    known = list(settings())
    args.codecs = args.codecs or known
    unknown = [name for name in args.codecs if name not in known]
    if unknown:
        parser.error(f"--codecs: unknown {unknown}; choose from {known}")

    flags = ["--measure", "--numel", str(args.numel), "--world-size", str(args.world_size),
             "--parameters", str(args.parameters), "--codecs", *args.codecs]
    load = [wait_for_quiet()]
    runs = {"base": [], "head": []}
    for round_ in range(args.rounds):
        sides = (("base", args.base), ("head", HEAD))
        for side, root in sides if round_ % 2 == 0 else sides[::-1]:  # A B B A: neither side always goes first
            env = {**os.environ, "PYTHONPATH": str(Path(root) / "src")}
            done = subprocess.run([sys.executable, __file__, *flags], env=env, capture_output=True, text=True, check=True)
            runs[side].append(json.loads(done.stdout.strip().splitlines()[-1]))
    load.append(os.getloadavg()[0])

    def spread(values):
        return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"

    lines = ["# Codec cost before and after a change, processes alternating (A B B A ...)", "",
             f"Machine: {os.cpu_count()} cores, 1 torch thread; load average {load[0]:.2f} before, {load[1]:.2f} after "
             f"(1 min). Base: {git_commit(args.base)}; head: {git_commit()}. {args.numel:,} elements, "
             f"{args.parameters} equal parameters, {args.world_size} workers, {args.rounds} rounds "
             "(base first in even rounds, head first in odd ones).",
             f"Command: `python bench/codec_ab.py --base <checkout of base> --codecs {' '.join(map(repr, args.codecs))} "
             f"--numel {args.numel} --world-size {args.world_size} --rounds {args.rounds}`.", "",
             "| codec | base ms/M | head ms/M | speed-up per pair, median (min-max) |", "|---|---|---|---|"]
    for spec in args.codecs:
        base = [r[spec] for r in runs["base"]]
        head = [r[spec] for r in runs["head"]]
        lines.append(f"| {spec} | {spread(base)} | {spread(head)} | {spread([b / h for b, h in zip(base, head)])}x |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
