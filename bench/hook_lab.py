"""The netgain hook against PyTorch's DDP hooks on the lab, contestants interleaved in the same processes.

Why: a fresh `netgain train` per contestant spends 10-25 s starting up and lets machine-load drift
fall on one contestant; here the workers start once per (rate, world size) cell and train every
contestant in turn, round after round (A B C ... A B C ...). Each contestant gets a fresh DDP wrap
of the same initial model, `--warmup` untimed steps (DDP's bucket rebuild, compiling, PowerSGD's
start) and `--steps` timed steps. Speed-ups are per round against the fp32 DDP of that round
(plain DDP, no hook): median and min-max over rounds.

    python bench/hook_lab.py --rates none 1gbit --workers 2 3                    # root: the lab
    python bench/hook_lab.py --rates 100mbit --workers 2 --batch-size 2 --predict # network-bound, vs the model
    python bench/hook_lab.py --rates none 1gbit --workers 2 --layers 24 --hidden 128 --bucket-mb 2 \
        --contestants ddp none gqsgd-8 --trace --out bench/results/hook_overhead  # 219 tensors: overhead, overlap

Writes OUT.md, OUT.csv and OUT.json (OUT defaults to bench/results/hook_lab).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from netgain.cost.measured import cpu_name  # noqa: E402

# label -> how the contestant's hook is registered ("ddp": plain DDP, no hook)
CONTESTANTS = {
    "ddp": None,
    "ddp-fp16": ("torch", "ddp-fp16", {}),
    "ddp-powersgd-r4": ("torch", "ddp-powersgd", {"rank": 4}),
    "none": ("netgain", "none", {}),
    "fp16": ("netgain", "fp16", {}),
    "bf16": ("netgain", "bf16", {}),
    "gqsgd-8": ("netgain", "gqsgd", {"bits": 8}),
    "gqsgd-8-int8": ("netgain", "gqsgd", {"bits": 8, "encoding": "int8"}),
    "gqsgd-4": ("netgain", "gqsgd", {"bits": 4}),
    "topk-1%": ("netgain", "topk", {"ratio": 0.01}),
    "lowrank-r4-fp32": ("netgain", "lowrank", {"rank": 4, "factors": "fp32"}),
    "lowrank-r4-gqsgd8": ("netgain", "lowrank", {"rank": 4, "factors": "gqsgd", "bits": 8}),
    "kimad+": ("netgain", "kimad+", {}),
    "auto": ("netgain", "auto", {}),
}
LINKS = {"100mbit": "lab-100mbit", "1gbit": "lab-1gbit"}  # netgain.cost.network presets of the lab's rates
PEERS = (("ddp", "x_ddp"), ("ddp-fp16", "x_fp16_hook"), ("ddp-powersgd-r4", "x_powersgd"))  # ratio columns


def register_contestant(ddp, spec):
    """Register one CONTESTANTS entry's hook on a DDP wrap; its state (None: plain DDP)."""
    import netgain.comm as comm

    if spec is None:
        return None
    if spec[0] == "torch":
        return comm.baselines.register(ddp, spec[1], warmup_steps=2, **spec[2])
    return comm.register(ddp, spec[1], **spec[2])


# ---------------------------------------------------------------- one worker (inside the lab)


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from netgain import models

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = torch.randint(0, 256, (args.batch_size, args.seq_len), generator=torch.Generator().manual_seed(rank))

    def contest(label: str, round_: int) -> dict:
        torch.manual_seed(0)
        model = models.byte_llama(args.hidden, args.layers, args.seq_len)
        ddp = DDP(model, bucket_cap_mb=args.bucket_mb)
        spec = CONTESTANTS[label]
        state = register_contestant(ddp, spec)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        times, records = [], []
        for step in range(args.warmup + args.steps):
            dist.barrier()
            start = time.perf_counter()
            model_out = ddp(input_ids=ids, labels=ids)
            model_out.loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
                records.append(dict(state.last_step) if state is not None else {})
        if state is not None:
            state.close()
        tensors = sum(1 for _ in model.parameters())
        numel = sum(p.numel() for p in model.parameters())
        del ddp, state
        gc.collect()
        mean = lambda key: statistics.mean(r.get(key, 0.0) for r in records) if records and key in records[0] else None  # noqa: E731
        return {"label": label, "round": round_, "workers": world, "step_s": statistics.median(times),
                "steps_s": times, "tensors": tensors, "numel": numel,
                "wire_bytes": mean("wire_bytes") if spec is not None else 4 * numel,
                "encode_s": mean("encode_s"), "decode_s": mean("decode_s"), "comm_s": mean("comm_s"),
                "wait_s": mean("wait_s"), "backward_s": mean("backward_s"),
                "buckets": [(b["numel"], b.get("t_encode"), b.get("t_launch"), b.get("t_done"))
                            for b in records[-1].get("per_bucket", [])] if records else []}

    rows = [contest(label, r) for r in range(args.rounds) for label in args.contestants]
    if rank == 0:
        Path(args.worker_out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- the driver


def lab_cell(script: Path, flags: list[str], rate: str, workers: int, timeout: float = 3000,
             quiet_wait_s: float = 900) -> tuple[list[dict], float]:
    """Wait (up to quiet_wait_s) for a quiet machine, then run `script --worker FLAGS` on every worker of a lab at `rate`.

    The script's workers get `--threads` (cores / workers) and `--worker-out`, where rank 0 writes
    its rows as JSON; the rows come back tagged with the rate and the load average waited for.
    """
    from lab import Lab
    from provenance import wait_for_quiet
    from runs import threads_per_worker

    load = wait_for_quiet(wait_s=quiet_wait_s)
    with tempfile.TemporaryDirectory(prefix="netgain-lab-cell-") as folder:
        out = Path(folder) / "rows.json"
        cmd = [sys.executable, str(script.resolve()), "--worker", "--worker-out", str(out),
               "--threads", str(threads_per_worker(workers)), *flags]
        with Lab(workers, None if rate == "none" else rate) as lab:
            codes = lab.run(cmd, extra_env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}, timeout=timeout)
        if any(codes):
            raise RuntimeError(f"lab workers failed with {codes} at {rate}, {workers} workers")
        rows = json.loads(out.read_text())
    for row in rows:
        row.update(rate=rate, load=load)
    return rows, load


def run_cell(rate: str, workers: int, args) -> tuple[list[dict], float]:
    return lab_cell(Path(__file__), worker_flags(args), rate, workers)


def worker_flags(args) -> list[str]:
    return ["--rounds", str(args.rounds), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
            "--hidden", str(args.hidden), "--layers", str(args.layers), "--bucket-mb", str(args.bucket_mb),
            "--contestants", *args.contestants]


def add_ratios(row: dict, by_round: dict, label: str, value: str, peers=PEERS) -> None:
    """row[key]: median over rounds of peer's `value` / label's `value` in the same round; key_range: min-max.

    Rounds where the ratio is undefined (both values infinite) are left out.
    """
    for peer, key in peers:
        ratios = [rounds[peer][value] / rounds[label][value] for rounds in by_round.values()
                  if peer in rounds and label in rounds]
        ratios = [r for r in ratios if not math.isnan(r)]
        if ratios:
            row[key] = statistics.median(ratios)
            row[key + "_range"] = (min(ratios), max(ratios))


def format_ratio(summary: dict, key: str) -> str:
    """"median (min-max)" of an add_ratios column, "" where the contestant has none."""
    if key not in summary:
        return ""
    low, high = summary[key + "_range"]
    return f"{summary[key]:.2f} ({low:.2f}-{high:.2f})"


def machine() -> str:
    return f"{cpu_name()}, {os.cpu_count()} cores, torch threads per worker = cores / workers"


def per_contestant(rows: list[dict]):
    """Cell by cell (in run order), each contestant: (rate, workers, label, its rows, the cell's rows by round and label)."""
    for rate, workers in dict.fromkeys((r["rate"], r["workers"]) for r in rows):
        cell = [r for r in rows if (r["rate"], r["workers"]) == (rate, workers)]
        by_round = {}
        for r in cell:
            by_round.setdefault(r["round"], {})[r["label"]] = r
        for label in dict.fromkeys(r["label"] for r in cell):
            yield rate, workers, label, [r for r in cell if r["label"] == label], by_round


def summarise(rows: list[dict]) -> list[dict]:
    """Per cell and contestant: median step and min-max over rounds; speed-ups per round vs ddp, fp16, PowerSGD."""
    out = []
    for rate, workers, label, mine, by_round in per_contestant(rows):
        steps = [r["step_s"] for r in mine]
        row = {"rate": rate, "workers": workers, "contestant": label, "load": mine[0]["load"],
               "step_s": statistics.median(steps), "step_min": min(steps), "step_max": max(steps),
               "wire_MB": mine[-1]["wire_bytes"] / 1e6,
               "codec_ms": None if mine[-1]["encode_s"] is None else
               1e3 * statistics.median(r["encode_s"] + r["decode_s"] for r in mine)}
        add_ratios(row, by_round, label, "step_s")
        out.append(row)
    return out


def predictions(rows: list[dict], compute: dict[int, float]) -> list[dict]:
    """gqsgd rows on a shaped link against netgain.cost.network.predict from their measured wire bytes and codec time."""
    import netgain.comm as comm
    from netgain.cost import network as net

    out = []
    for r in rows:
        if r["rate"] not in LINKS or not r["label"].startswith("gqsgd") or not r["buckets"]:
            continue
        spec = CONTESTANTS[r["label"]]
        codec = comm.make_codec(spec[1], **spec[2])
        numel = sum(b[0] for b in r["buckets"])
        profile = dataclasses.replace(comm.codec_profile(codec, r["workers"], "free"),
                                      wire_bits=8 * r["wire_bytes"] / numel, header_bytes=0,
                                      encode_s_per_elem=r["encode_s"] / numel, decode_s_per_elem=r["decode_s"] / numel)
        buckets = [b[0] for b in r["buckets"]]
        predicted = net.predict(buckets, r["workers"], net.preset(LINKS[r["rate"]]), profile, compute[r["workers"]])
        out.append({"rate": r["rate"], "workers": r["workers"], "contestant": r["label"], "round": r["round"],
                    "measured_s": r["step_s"], "predicted_s": predicted.step_s,
                    "error": (predicted.step_s - r["step_s"]) / r["step_s"]})
    return out


def overlap(rows: list[dict]) -> list[str]:
    """From the pipeline's trace points: does bucket k+1's encode start before bucket k's collective ends?"""
    lines = []
    for r in rows:
        b = [x for x in r["buckets"] if x[1] is not None]
        if len(b) < 2:
            continue
        hits = sum(1 for k in range(len(b) - 1) if b[k + 1][1] < b[k][3])
        lines.append(f"{r['label']}, round {r['round']}: {hits} of {len(b) - 1} bucket pairs encode k+1 while "
                     f"bucket k is on the wire; first 4 buckets (ms from the first encode, "
                     f"encode start / launch / done): "
                     + "; ".join(f"{(e - b[0][1]) * 1e3:.1f}/{(s - b[0][1]) * 1e3:.1f}/{(d - b[0][1]) * 1e3:.1f}"
                                 for _, e, s, d in b[:4]))
    return lines


def report(rows, summary, predicted, meta, out: Path) -> None:
    from provenance import write_csv

    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps({"meta": meta, "rows": rows, "predicted": predicted}, indent=1))
    write_csv(Path(f"{out}.csv"), summary)
    fmt = lambda v, s=".3f": "" if v is None else format(v, s)  # noqa: E731
    lines = [f"# {meta['title']}", "", f"Machine: {meta['machine']}; commit {meta['commit']}; command: `{meta['command']}`.",
             f"Model: byte-level Llama, hidden {meta['hidden']}, {meta['layers']} layers ({rows[0]['tensors']} parameter "
             f"tensors, {rows[0]['numel'] / 1e6:.2f} M parameters), batch {meta['batch_size']} x {meta['seq_len']} "
             f"per worker, SGD, DDP buckets of {meta['bucket_mb']} MB. {meta['rounds']} rounds x {meta['steps']} timed steps (after {meta['warmup']} "
             "untimed), contestants interleaved within each round. Step: median over rounds of each round's "
             "median (min-max); x ddp etc.: per-round ratio of step times, median (min-max).", "",
             "| rate | workers | load | contestant | step s (min-max) | wire MB | codec ms | x fp32 DDP | x fp16_compress_hook | x powerSGD r4 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['rate']} | {s['workers']} | {s['load']:.2f} | {s['contestant']} | {s['step_s']:.3f} "
                     f"({s['step_min']:.3f}-{s['step_max']:.3f}) | {s['wire_MB']:.2f} | {fmt(s['codec_ms'], '.1f')} | "
                     f"{format_ratio(s, 'x_ddp')} | {format_ratio(s, 'x_fp16_hook')} | {format_ratio(s, 'x_powersgd')} |")
    if predicted:
        lines += ["", "Cost model (netgain.cost.network.predict from each row's measured wire bytes and codec time; "
                  "compute = fp32 DDP's step at no rate limit, same model: "
                  + ", ".join(f"{n} workers {1e3 * s:.1f} ms" for n, s in meta["compute_s"].items()) + "):", "",
                  "| rate | workers | contestant | round | measured s | predicted s | error |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {p['rate']} | {p['workers']} | {p['contestant']} | {p['round']} | {p['measured_s']:.3f} | "
                  f"{p['predicted_s']:.3f} | {100 * p['error']:+.1f}% |" for p in predicted]
    if meta.get("trace"):
        lines += ["", "Overlap (the pipeline's own trace points of the last timed step):", ""]
        lines += [f"- {line}" for line in meta["trace"]]
    Path(f"{out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", nargs="+", default=["none", "1gbit"],
                        help="lab egress rates per worker (none, 1gbit, 100mbit, 20mbit, ...)")
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--contestants", nargs="+", default=["ddp", "ddp-fp16", "ddp-powersgd-r4", "none", "fp16",
                                                            "gqsgd-8", "gqsgd-4", "kimad+"], choices=list(CONTESTANTS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="DDP's bucket_cap_mb")
    parser.add_argument("--predict", action="store_true", help="also compare gqsgd rows with the cost model")
    parser.add_argument("--trace", action="store_true", help="report the pipeline's overlap from its trace points")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "hook_lab")
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 1 or args.warmup < 2:
        parser.error("--rounds and --steps must be >= 1, --warmup >= 2 (DDP rebuilds its buckets after step 1)")
    if args.worker:
        worker(args)
        return 0
    from provenance import git_commit

    if args.predict and "ddp" not in args.contestants:
        parser.error("--predict needs the ddp contestant")
    rows, compute = [], {}
    for workers in args.workers:
        if args.predict:  # compute: fp32 DDP with no rate limit, same model and batch
            free, _ = run_cell("none", workers, argparse.Namespace(**{**vars(args), "contestants": ["ddp"]}))
            compute[workers] = statistics.median(r["step_s"] for r in free)
        for rate in args.rates:
            cell, load = run_cell(rate, workers, args)
            print(f"{rate}, {workers} workers (load {load:.2f}): "
                  + ", ".join(f"{r['label']} {r['step_s']:.3f}s" for r in cell), flush=True)
            rows += cell
    meta = {"title": "netgain hook vs PyTorch's DDP hooks on the lab (interleaved)",
            "machine": machine(),
            "commit": git_commit(), "command": "python " + " ".join(sys.argv),
            **{k: getattr(args, k) for k in ("hidden", "layers", "batch_size", "seq_len", "rounds", "steps", "warmup",
                                             "bucket_mb")}}
    if compute:
        meta["compute_s"] = compute  # fp32 DDP's step with no rate limit, per world size
    if args.trace:
        meta["trace"] = overlap([r for r in rows if r["round"] == args.rounds - 1])
    report(rows, summarise(rows), predictions(rows, compute) if args.predict else [], meta, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
