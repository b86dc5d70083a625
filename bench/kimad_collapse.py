"""Does a planned codec (kimad+, kimad or auto) collapse? Its final loss against fp32's on the same seeds, on two small jobs.

  digits - `netgain train --task digits` (the 64-128-10 MLP, AdamW), --codec none vs --codec CODEC;
  mlp85k - a 64-256-256-10 MLP (85k parameters) with Adam on the same digits data, in this file's
           own DDP loop on `--workers` gloo workers (2): fp32 is plain DDP, CODEC is netgain.comm.register(ddp,
           CODEC) with its defaults, as a newcomer's script would call it.
A seed passes when CODEC's final validation loss is at most 5% above fp32's. Untimed (losses only).

    OMP_NUM_THREADS=1 python bench/kimad_collapse.py [--codec kimad+] [--seeds 10] [--steps 300] [--jobs digits,mlp85k]
                                                     [--kimad-lowrank-rank R] [--rate 100mbit] [--workers 2] [--out DIR]

`--kimad-lowrank-rank R` gives kimad+ low rank at rank R as an option (in place of top-k). `--rate` runs both
codecs' workers on the throttled-network lab (bench/lab.py, root needed) instead of loopback: on loopback the
bytes cost no measurable time, so kimad+ fits its budget with fp32 on most steps and compresses on few.

Writes bench/results/kimad_collapse.md/.csv; `netgain train` records stay under runs/kimad_collapse/, and
finished runs found there are reused, so an interrupted run resumes (delete the folder to start over).
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import netgain.comm as comm  # noqa: E402
from netgain import data  # noqa: E402
from netgain.train.launch import free_port  # noqa: E402
from lab import Lab  # noqa: E402
from provenance import git_commit, write_csv  # noqa: E402
from runs import train_command, train_on_lab  # noqa: E402

TOLERANCE = 1.05  # the planned codec's final loss at most 5% above fp32's
CODECS = ("kimad+", "kimad", "auto")
BATCH, LR = 32, 1e-3


def mlp85k() -> nn.Module:
    """64-256-256-10: 85,002 parameters."""
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def mlp_worker(rank: int, codec: str, seed: int, steps: int, init_method: str, out: Path, lowrank_rank: int | None,
               workers: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=workers)
    try:
        digits = data.Digits.load()
        torch.manual_seed(seed)
        model = DDP(mlp85k())
        options = {"lowrank_rank": lowrank_rank} if lowrank_rank else {}
        state = comm.register(model, codec, **options) if codec != "none" else None
        optimizer = torch.optim.Adam(model.parameters(), lr=LR)
        losses, plans, bandwidths, errors = [], collections.Counter(), [], []
        for step in range(steps):
            x, y = digits.train_batch(seed, step, rank, workers, BATCH)
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if state is not None:
                last = state.last_step
                plans.update(last.get("plan", {}).values() or ["none (first steps)"])
                bandwidths.append(last.get("bandwidth_Bps"))
                errors.append(last.get("plan_error"))
        with torch.no_grad():
            val = nn.functional.cross_entropy(model(digits.test_x), digits.test_y).item()
        train = torch.tensor(sum(losses[-20:]) / 20)
        dist.all_reduce(train)
        if state is not None:
            state.close()
        if rank == 0:
            out.write_text(json.dumps({"final_val_loss": val, "final_train_loss": train.item() / workers,
                                       "plans": dict(plans), "bandwidth_values": len({b for b in bandwidths if b}),
                                       "max_plan_error": max((e for e in errors if e is not None), default=None)}))
        # DDP's reducer must die while its group lives: destroyed later, it joins gloo's threads holding
        # the GIL that a thread still finishing the last collective needs (a hang seen at seed 4)
        del model, state, optimizer
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _label(codec: str, lowrank_rank: int | None, rate: str | None, workers: int) -> str:
    label = f"{codec}-lowrank{lowrank_rank}" if lowrank_rank and codec != "none" else codec
    label = f"{label}-{rate}" if rate else label
    return f"{label}-{workers}w" if workers != 2 else label


def run_mlp(codec: str, seed: int, steps: int, runs: Path, lowrank_rank: int | None = None, rate: str | None = None,
            workers: int = 2) -> dict:
    out = runs / f"mlp85k_{_label(codec, lowrank_rank, rate, workers)}_{seed}.json"
    if out.exists():  # finished in an interrupted run
        return json.loads(out.read_text())
    if rate:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--mlp-worker",
               json.dumps([codec, seed, steps, str(out), lowrank_rank, workers])]
        with Lab(workers, rate) as lab:
            codes = lab.run(cmd, extra_env={"OMP_NUM_THREADS": "1"})
        if any(codes):
            raise RuntimeError(f"mlp85k {codec} seed {seed} failed on the lab at {rate}: exit codes {codes}")
    else:
        mp.spawn(mlp_worker, args=(codec, seed, steps, f"tcp://127.0.0.1:{free_port()}", out, lowrank_rank, workers),
                 nprocs=workers, join=True)
    return json.loads(out.read_text())


def run_digits(codec: str, seed: int, steps: int, runs: Path, lowrank_rank: int | None = None, rate: str | None = None,
               workers: int = 2) -> dict:
    out = runs / f"digits_{_label(codec, lowrank_rank, rate, workers)}_{seed}"
    if not (out / "record.json").exists():  # else finished in an interrupted run
        flags = ["--task", "digits", "--seed", str(seed)]
        flags += ["--kimad-lowrank-rank", str(lowrank_rank)] if lowrank_rank and codec != "none" else []
        if rate:
            out.mkdir(parents=True, exist_ok=True)
            (out / "record.json").write_text(json.dumps(train_on_lab(workers, rate, codec, {}, steps, flags)))
        else:
            subprocess.run(train_command(codec, steps, out, [*flags, "--world-size", str(workers)]), check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    record = json.loads((out / "record.json").read_text())
    steps_ = record["per_step"]
    plans = collections.Counter(v for plan in steps_.get("plan") or [] for v in (plan or {"-": "none (first steps)"}).values())
    return {"final_val_loss": record["summary"]["final_val_loss"], "final_train_loss": record["summary"]["final_train_loss"],
            "plans": dict(plans), "bandwidth_values": len({b for b in steps_.get("bandwidth_Bps") or [] if b}),
            "max_plan_error": None}


JOBS = {"digits": run_digits, "mlp85k": run_mlp}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--codec", choices=CODECS, default="kimad+", help="the planned codec against fp32")
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--jobs", default="digits,mlp85k")
    parser.add_argument("--kimad-lowrank-rank", type=int, help="kimad+ plans with low rank at this rank (no top-k)")
    parser.add_argument("--rate", help="run the workers on the lab at this egress rate (e.g. 100mbit; root needed)")
    parser.add_argument("--workers", type=int, default=2, help="data-parallel workers of every run")
    parser.add_argument("--mlp-worker", help=argparse.SUPPRESS)  # one lab worker of run_mlp: its JSON arguments
    parser.add_argument("--runs", type=Path, default=Path("runs/kimad_collapse"))
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    if args.mlp_worker:
        codec, seed, steps, out, lowrank_rank, workers = json.loads(args.mlp_worker)
        mlp_worker(int(os.environ["RANK"]), codec, seed, steps, "env://", Path(out), lowrank_rank, workers)
        return 0
    if args.workers < 2:
        raise SystemExit(f"--workers must be at least 2 (data-parallel training), got {args.workers}")
    jobs = args.jobs.split(",")
    unknown = [j for j in jobs if j not in JOBS]
    if unknown:
        raise SystemExit(f"--jobs: unknown {unknown}; choose from {sorted(JOBS)}")
    args.runs.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()
    rows = []
    for job in jobs:
        for seed in range(1, args.seeds + 1):
            fp32, kimad = (JOBS[job](codec, seed, args.steps, args.runs, args.kimad_lowrank_rank, args.rate, args.workers)
                           for codec in ("none", args.codec))
            ratio = kimad["final_val_loss"] / fp32["final_val_loss"]
            plans = ", ".join(f"{name} x{count}" for name, count in sorted(kimad["plans"].items(), key=lambda kv: -kv[1]))
            rows.append({"job": job, "seed": seed, "fp32_val_loss": fp32["final_val_loss"],
                         "kimad_val_loss": kimad["final_val_loss"], "ratio": ratio, "passes": ratio <= TOLERANCE,
                         "fp32_train_loss": fp32["final_train_loss"], "kimad_train_loss": kimad["final_train_loss"],
                         "bandwidth_values": kimad["bandwidth_values"], "max_plan_error": kimad["max_plan_error"],
                         "plans": plans})
            print(f"{job} seed {seed}: fp32 {fp32['final_val_loss']:.4f} {args.codec} {kimad['final_val_loss']:.4f} "
                  f"({ratio:.3f}x) plans {plans}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "kimad_collapse.csv", rows)
    c = args.codec
    lines = [f"# Does {c} collapse? Final loss against fp32 on the same seeds", "",
             f"Machine: 2-core x86_64 shared with other jobs, no GPU (load average {load_start[0]:.2f} / "
             f"{load_start[1]:.2f} at start, {os.getloadavg()[0]:.2f} / {os.getloadavg()[1]:.2f} at end, 1 and 5 min); "
             f"commit {git_commit()}; {args.workers} gloo workers, OMP_NUM_THREADS=1; untimed.",
             f"Command: `python bench/kimad_collapse.py --codec {c} --seeds {args.seeds} --steps {args.steps} --jobs {args.jobs}"
             + (f" --kimad-lowrank-rank {args.kimad_lowrank_rank}" if args.kimad_lowrank_rank else "")
             + (f" --rate {args.rate}" if args.rate else "")
             + (f" --workers {args.workers}" if args.workers != 2 else "") + "`"
             + (f", every worker on the lab at {args.rate} (bench/lab.py)." if args.rate else ", on loopback."),
             f"digits: `netgain train --task digits --codec none|{c}` (64-128-10 MLP, AdamW lr 3e-3, batch 32 per "
             f"worker). mlp85k: 64-256-256-10 MLP (85,002 parameters), Adam lr {LR}, batch {BATCH} per worker, "
             f"fp32 = plain DDP, {c} = `netgain.comm.register(ddp, \"{c}\")` with its defaults. Final validation loss "
             "on the digits test split; train loss = mean of the "
             f"last 20 steps. A seed passes when {c} <= {TOLERANCE} x fp32.", ""]
    for job in jobs:
        mine = [r for r in rows if r["job"] == job]
        lines += [f"## {job}: {sum(r['passes'] for r in mine)} of {len(mine)} seeds within 5%", "",
                  f"| seed | fp32 val loss | {c} val loss | ratio | fp32 train loss | {c} train loss "
                  f"| distinct bandwidth estimates | max planned relative error | {c} plans (bucket-steps) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in mine:
            error = f"{r['max_plan_error']:.3g}" if r["max_plan_error"] is not None else "-"
            lines.append(f"| {r['seed']} | {r['fp32_val_loss']:.4f} | {r['kimad_val_loss']:.4f} | {r['ratio']:.3f} "
                         f"| {r['fp32_train_loss']:.4f} | {r['kimad_train_loss']:.4f} | {r['bandwidth_values']} "
                         f"| {error} | {r['plans']} |")
        lines.append("")
    (args.out / "kimad_collapse.md").write_text("\n".join(lines))
    print((args.out / "kimad_collapse.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
