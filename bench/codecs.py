"""Codec cost on this machine: encode + decode time per million elements, relative to a plain
fp32 -> fp16 cast measured in the same run, and wire bits per element.

    python bench/codecs.py [--numel 4194304] [--world-size 2 3 4] [--repeats 7]

Writes bench/results/codecs.md and codecs.csv.
"""

import argparse
import platform
import time
from pathlib import Path

import torch

from netgain.comm.codecs import CODEC_NAMES, make_codec, time_codec
from provenance import git_commit, write_csv

VARIANTS = [("none", {}), ("fp16", {}), ("bf16", {}), ("qsgd", {"bits": 8}), ("gqsgd", {"bits": 8, "encoding": "int8"}),
            ("gqsgd", {"bits": 8}), ("gqsgd", {"bits": 4}), ("gqsgd", {"bits": 2}), ("gqsgd-exp", {"bits": 8}),
            ("topk", {"ratio": 0.01}), ("randomk", {"ratio": 0.01})]
assert {name for name, _ in VARIANTS} == set(CODEC_NAMES)


def cast_seconds(numel: int, repeats: int) -> float:
    x = torch.randn(numel)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        x.to(torch.float16)
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=1 << 22)
    parser.add_argument("--world-size", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (a DDP worker usually gets 1-2)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    cast = cast_seconds(args.numel, args.repeats)
    per_million = 1e6 / args.numel
    rows = []
    for name, params in VARIANTS:
        codec = make_codec(name, **params)
        for n in args.world_size:
            t = time_codec(codec, args.numel, n, repeats=args.repeats)
            total = t["encode_s"] + t["decode_s"]
            rows.append({"codec": codec.describe(), "world_size": n, "wire_bits": round(codec.wire_bits(n), 3),
                         "encode_ms_per_M": round(t["encode_s"] * per_million * 1e3, 3),
                         "decode_ms_per_M": round(t["decode_s"] * per_million * 1e3, 3),
                         "x_fp16_cast": round(total / cast, 2), "unbiased": codec.unbiased})
            print(rows[-1], flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "codecs.csv", rows)
    commit = git_commit()
    lines = [
        "# Codec cost per million elements",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch thread(s), "
        f"torch {torch.__version__}; commit {commit}; command: `python bench/codecs.py "
        f"--numel {args.numel} --world-size {' '.join(map(str, args.world_size))} --repeats {args.repeats} --threads {args.threads}`.",
        f"Baseline: fp32 -> fp16 cast of the same tensor, {cast * per_million * 1e3:.3f} ms per million elements "
        "(median of repeats, same run). `x_fp16_cast` = (encode + decode) / cast.",
        "Wire bits: payload bits per element each rank contributes (headers and per-worker scales excluded).",
        "",
        "| codec | n | wire bits | encode ms/M | decode ms/M | x fp16 cast | unbiased |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [f"| {r['codec']} | {r['world_size']} | {r['wire_bits']} | {r['encode_ms_per_M']} | {r['decode_ms_per_M']} "
              f"| {r['x_fp16_cast']} | {'yes' if r['unbiased'] else 'no'} |" for r in rows]
    (args.out / "codecs.md").write_text("\n".join(lines) + "\n")
    print((args.out / "codecs.md").read_text())


if __name__ == "__main__":
    main()
