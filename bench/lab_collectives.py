"""Time gloo collectives on the throttled-network lab, alone: no compute, no rank skew.

Why: the network model predicts time on the wire. A collective timed inside training also holds
the wait for the slowest rank and the CPU that the backward takes from gloo's threads, so the
model is calibrated and checked on collectives timed here: every repeat starts with a barrier and
a pause (`gap_s`) that refills the lab's token bucket, as the compute between two steps does,
and a second barrier (the ranks do not wake from the pause together).

    python bench/lab_collectives.py --workers 2 3 --rates 100mbit 1gbit   # calibration, ~4 min
Writes src/netgain/cost/lab_collectives.json (what the lab presets of netgain.cost.network are
fitted on) and bench/results/lab_collectives.{md,csv}. Root needed for the lab.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from lab import Lab, list_lab_namespaces, terminate_on_signals  # noqa: E402
from provenance import git_commit, write_csv  # noqa: E402

DATA = HERE.parent / "src" / "netgain" / "cost" / "lab_collectives.json"
REPEATS = 21
GAP_S = 0.06  # longer than the lab's token bucket takes to refill at 100 Mbit/s (256 KiB: 21 ms)
# latency-bound ones (<= 1 KiB): more repeats, a short pause (they hardly touch the token bucket)
SMALL_REPEATS = 81
SMALL_GAP_S = 0.01
# (op, dtype, numel): small to bandwidth-bound, the codecs' payload dtypes, the header's MAX
SIZES = (4096, 65536, 262144, 1048576)
SMALL = (*(("allreduce", "float32", n) for n in (1, 4, 16, 64, 256)),
         *(("allreduce_max", "float32", n) for n in (4, 16, 64)),
         *(("allgather", "int32", n) for n in (1, 16, 256)))
CALIBRATION = (*(("allreduce", "float32", n) for n in SIZES),
               *(("allgather", "int32", n) for n in SIZES[:-1]),
               *(("allreduce", dtype, 262144) for dtype in ("float16", "int8", "int32", "int64")))
# the same large allreduces with no pause: the token bucket stays drained (the paced rate alone)
DRAINED = tuple(("allreduce", "float32", n) for n in SIZES[-2:])


def time_ops(ops: list[dict], repeats: int, gap_s: float) -> list[list[float]]:
    """On a lab worker: seconds of each op per repeat (a pause between two barriers before each)."""
    import torch
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    n = dist.get_world_size()
    tensors = [torch.ones(op["numel"], dtype=getattr(torch, op["dtype"])) for op in ops]
    gathered = [torch.empty(n * t.numel(), dtype=t.dtype) for t in tensors]
    out = []
    for _ in range(repeats + 1):  # the first repeat connects and warms up: not kept
        dist.barrier()
        time.sleep(gap_s)
        dist.barrier()  # the ranks woke up at different times: start together
        seconds = []
        for op, t, g in zip(ops, tensors, gathered):
            start = time.perf_counter()
            if op["op"] == "allgather":
                gather(g, t)
            else:
                dist.all_reduce(t, dist.ReduceOp.MAX if op["op"] == "allreduce_max" else dist.ReduceOp.SUM)
            seconds.append(time.perf_counter() - start)
        out.append(seconds)
    return out[1:]


def worker(plan_path: str, out_path: str) -> None:
    """One lab rank: run every item of the plan; rank 0 writes all ranks' seconds."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    plan = json.loads(Path(plan_path).read_text())
    results = [time_ops(item["ops"], plan["repeats"], item["gap_s"]) for item in plan["items"]]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, results)
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(every))
    dist.destroy_process_group()


def run(workers: int, rate: str, items: list[list[dict]], repeats: int = REPEATS,
        gaps: list[float] | None = None) -> list[list[float]]:
    """Time each item (a list of ops run back to back, after a pause of gaps[i], default GAP_S)
    on a fresh lab: seconds per op, each the mean over repeats of the mean over ranks.

    The mean, not the median: a small collective here takes either about 0.4 ms or 3-5 ms (two
    modes, whatever the op), so a median jumps between them while a step pays the average."""
    gaps = gaps or [GAP_S] * len(items)
    with tempfile.TemporaryDirectory(prefix="netgain-collectives-") as tmp:
        plan, out = Path(tmp) / "plan.json", Path(tmp) / "out.json"
        plan.write_text(json.dumps({"items": [{"ops": ops, "gap_s": gap} for ops, gap in zip(items, gaps)],
                                    "repeats": repeats}))
        env = {"OMP_NUM_THREADS": "1"}
        with Lab(workers, rate) as lab:
            codes = lab.run([sys.executable, __file__, "--worker", str(plan), str(out)],
                            extra_env=env, timeout=600)
        if any(codes):
            raise RuntimeError(f"lab_collectives worker failed ({codes})")
        every = json.loads(out.read_text())
    return [[statistics.fmean(rank[i][r][k] for rank in every for r in range(repeats)) for k in range(len(ops))]
            for i, ops in enumerate(items)]


def calibrate(workers: list[int], rates: list[str]) -> list[dict]:
    import torch

    rows = []
    passes = (([(spec, SMALL_GAP_S) for spec in SMALL], SMALL_REPEATS),
              ([(spec, GAP_S) for spec in CALIBRATION] + [(spec, 0.0) for spec in DRAINED], REPEATS))
    for n in workers:
        for rate in rates:
            for specs, repeats in passes:
                items = [[{"op": op, "dtype": dtype, "numel": numel}] for (op, dtype, numel), _ in specs]
                seconds = run(n, rate, items, repeats, gaps=[gap for _, gap in specs])
                for ((op, dtype, numel), gap), (s,) in zip(specs, seconds):
                    nbytes = numel * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
                    rows.append({"workers": n, "rate": rate, "op": op, "dtype": dtype, "numel": numel,
                                 "bytes": nbytes, "gap_s": gap, "repeats": repeats, "seconds": s})
                    print(f"n={n} {rate} {op} {dtype} {nbytes:>9,} B gap {gap}: {s * 1e3:8.3f} ms", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", nargs=2, metavar=("PLAN", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--rates", nargs="+", default=["100mbit", "1gbit"])
    parser.add_argument("--out", default=str(HERE / "results" / "lab_collectives"))
    parser.add_argument("--report", action="store_true",
                        help="only rewrite the report from the stored calibration (no lab)")
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    if not args.report:
        load = os.getloadavg()[0]
        with terminate_on_signals():
            rows = calibrate(args.workers, args.rates)
        store(rows, args, (load, os.getloadavg()[0]))
    write_report(Path(args.out))
    return 0


def store(rows: list[dict], args, load: tuple[float, float]) -> None:
    import platform

    command = " ".join(["python bench/lab_collectives.py", "--workers", *map(str, args.workers),
                        "--rates", *args.rates])
    provenance = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "commit": git_commit(),
                  "command": command, "load_1min": list(load)}
    DATA.write_text(json.dumps({"provenance": provenance, "samples": rows}, indent=1) + "\n")


def write_report(out: Path) -> None:
    from netgain.cost import network as net

    data = json.loads(DATA.read_text())
    provenance, rows = data["provenance"], data["samples"]
    command, load = provenance["command"], provenance["load_1min"]
    out.parent.mkdir(parents=True, exist_ok=True)
    write_csv(out.with_suffix(".csv"), rows)
    lines = ["# gloo collectives alone on the throttled-network lab (the network model's calibration)", "",
             f"Machine: {provenance['machine']}, no GPU; commit {provenance['commit']}; 1-minute load "
             f"average {load[0]:.2f} before, {load[1]:.2f} after.",
             f"Command: `{command}`",
             "Each value: mean over its repeats (after one warm-up) and over ranks; every repeat starts "
             "with a barrier, a pause (token bucket refilled; none in the rows marked drained) and a "
             "second barrier. The mean, not the median: a small collective here takes either about "
             "0.4 ms or 3-5 ms, with or without the shaper.",
             "Fit: netgain.cost.network.fit_lab, what the lab presets use (rate: the tbf rate times "
             "the TCP payload share of a 1514-byte frame, 1448/1514):", ""]
    links = {rate: net.fit_lab(rows, rate) for rate in dict.fromkeys(r["rate"] for r in rows)}
    for rate, link in links.items():
        nominal = net.Link.from_rate(rate, net.parse_bandwidth(rate) * 8, 0.0, net.TCP_OVER_SHAPED_VETH)
        lines.append(f"- {rate}: overhead {link.overhead * 1e3:.3f} ms per collective, latency "
                     f"{link.latency * 1e3:.3f} ms per ring step, bandwidth {link.bandwidth / 1e6:.2f} MB/s "
                     f"({link.bandwidth / nominal.bandwidth:.1%} of the rate's), burst {link.burst / 1e3:.0f} kB")
    lines += ["", "| workers | rate | op | dtype | bytes | pause ms | repeats | measured ms | fitted model ms | error |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        link = links[r["rate"]]
        model = net.lab_collective_s(r["op"], r["bytes"], r["workers"], link, link.burst if r["gap_s"] else 0.0)
        lines.append(f"| {r['workers']} | {r['rate']} | {r['op']} | {r['dtype']} | {r['bytes']:,} | "
                     f"{r['gap_s'] * 1e3:.0f}{'' if r['gap_s'] else ' (drained)'} | {r['repeats']} | "
                     f"{r['seconds'] * 1e3:.3f} | {model * 1e3:.3f} | "
                     f"{(model - r['seconds']) / r['seconds']:+.1%} |")
    lines += ["", f"Lab namespaces left (`ip netns list`): {len(list_lab_namespaces())}.", ""]
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
