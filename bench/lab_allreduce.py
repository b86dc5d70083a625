"""Calibrate the lab against the alpha-beta model: gloo all_reduce timings on shaped links.

Why: every lab measurement (and the model's validation) rests on the shaping doing what the model
assumes. This times a 25 MB fp32 all_reduce (bandwidth term) and a 4-byte one (latency term) for
each world size and rate, next to netgain.cost.network's ring prediction, and checks that no lab
namespace is left behind.

    python bench/lab_allreduce.py                      # grid: 2,3 workers x 100mbit, 1gbit
    python bench/lab_allreduce.py --workers 2 --rates 100mbit
Writes bench/results/lab_allreduce.md (root needed). Each worker runs this same file with RANK set.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from lab import Lab, list_lab_namespaces, parse_rate, terminate_on_signals  # noqa: E402

from netgain.cost.network import TCP_OVER_SHAPED_VETH, Link, ring_allreduce_s  # noqa: E402
from provenance import git_commit  # noqa: E402

BIG_BYTES = 25_000_000


def worker(out_path: str, repeats: int) -> None:
    """One rank: time the big and the tiny all_reduce; rank 0 writes the medians as JSON."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    big = torch.ones(BIG_BYTES // 4)
    tiny = torch.ones(1)

    def timed(tensor, times):
        out = []
        for _ in range(times):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(tensor)
            out.append(time.perf_counter() - t0)
        return out

    timed(big, 1)  # warm-up: connections, buffers
    big_s = timed(big, repeats)
    tiny_s = timed(tiny, 50)
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps({"big_s": big_s, "tiny_s": tiny_s}))
    dist.destroy_process_group()


def measure(workers: int, rate: str, repeats: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    try:
        with Lab(workers, rate) as lab:
            codes = lab.run([sys.executable, __file__, "--worker", out, "--repeats", str(repeats)],
                            timeout=600)
        if any(codes):
            raise RuntimeError(f"workers failed with exit codes {codes}")
        return json.loads(Path(out).read_text())
    finally:
        os.unlink(out)


def row(n: int, rate: str, repeats: int) -> tuple:
    """Measure one (world size, rate) cell and put the ring model's two readings beside it."""
    m = measure(n, rate, repeats)
    rate_bps = parse_rate(rate)
    big = statistics.median(m["big_s"])
    tiny = statistics.median(m["tiny_s"])
    alpha = tiny / (2 * (n - 1))
    raw = Link.from_rate(rate, rate_bps, 0.0, efficiency=1.0)
    framed = Link.from_rate(rate, rate_bps, alpha, efficiency=TCP_OVER_SHAPED_VETH)
    print(f"n={n} {rate}: 25 MB all_reduce {big:.3f} s, 4 B {tiny * 1e3:.3f} ms", flush=True)
    return (n, rate, big, ring_allreduce_s(BIG_BYTES, n, raw),
            ring_allreduce_s(BIG_BYTES, n, framed), tiny, alpha)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--rates", nargs="+", default=["100mbit", "1gbit"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(HERE / "results" / "lab_allreduce.md"))
    parser.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.repeats)
        return 0

    try:
        with terminate_on_signals():
            rows = [row(n, rate, args.repeats) for n in args.workers for rate in args.rates]
    except KeyboardInterrupt as e:
        print(f"interrupted ({e}); lab torn down", file=sys.stderr)
        return 130
    leftovers = list_lab_namespaces()
    commit = git_commit()
    lines = [
        "# Lab calibration: gloo all_reduce on shaped links vs the alpha-beta ring model",
        "",
        f"Machine: {platform.machine()} {os.cpu_count()}-core ({platform.processor() or 'Xeon'}), "
        f"no GPU; torch gloo over veth + tbf; commit {commit}.",
        f"Command: `python bench/lab_allreduce.py --workers {' '.join(map(str, args.workers))} "
        f"--rates {' '.join(args.rates)} --repeats {args.repeats}`",
        "",
        "Model columns: ring 2(n-1)/n S/beta with beta = the tbf rate (\"raw\"), and with beta = the "
        "rate times the TCP payload share of a metered 1514-byte frame (1448/1514) plus "
        "2(n-1) alpha, alpha taken from the 4-byte all_reduce (\"framed\").",
        "",
        "| workers | rate | measured 25 MB (median s) | model raw (s) | model framed (s) "
        "| framed error | 4-byte all_reduce (ms) | alpha (us) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n, rate, big, raw, framed, tiny, alpha in rows:
        lines.append(f"| {n} | {rate} | {big:.3f} | {raw:.3f} | {framed:.3f} | "
                     f"{(framed - big) / big:+.1%} | {tiny * 1e3:.3f} | {alpha * 1e6:.0f} |")
    lines += ["", f"Lab namespaces left after the runs (`ip netns list`): "
                  f"{len(leftovers)}{' ' + ' '.join(leftovers) if leftovers else ''}", ""]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
