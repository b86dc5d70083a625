"""Kimad on a link whose rate changes during training (throttled-network lab, root needed).

Every run trains the default `netgain train` job on `--workers` lab workers (2) while the lab changes the
link rate at fixed steps (default 1gbit -> 100mbit -> 300mbit, `tc qdisc change`), read live
from rank 0's progress bar so every run sees the same schedule at the same steps. Rows: kimad+
and kimad with a communication budget, fixed gqsgd 8-bit, fp32 (`none`), and the fixed gqsgd
whose bits per element come closest to kimad+'s average traffic. `--kimad-lowrank-rank R` adds low
rank at rank R to the kimad rows' options (in place of top-k).

    python bench/kimad_lab.py [--steps 120] [--schedule 0:1gbit,40:100mbit,80:300mbit] [--budget-ms 200]
                              [--codecs kimad+,kimad,gqsgd,none] [--kimad-lowrank-rank R] [--workers 2] [--out DIR]

Writes bench/results/kimad_lab.md/.csv and kimad_lab.png; records stay under runs/kimad_lab/.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from lab import Lab, list_lab_namespaces, terminate_on_signals  # noqa: E402

from netgain.comm import make_codec  # noqa: E402
from provenance import git_commit, write_csv  # noqa: E402
from runs import train_command, worker_env  # noqa: E402

SETTLE_STEPS = 3  # steps after a rate change before the budget is held to account (monitor + re-plan)
WITHIN = 1.10     # "within 10% of the budget"


def parse_schedule(text: str) -> list[tuple[int, str]]:
    """'0:1gbit,40:100mbit' -> [(0, '1gbit'), (40, '100mbit')], steps ascending from 0."""
    phases = [(int(step), rate) for step, rate in (part.split(":") for part in text.split(","))]
    if phases[0][0] != 0 or any(a[0] >= b[0] for a, b in zip(phases, phases[1:])):
        raise ValueError(f"--schedule must start at step 0 and ascend, got {text!r}")
    return phases


def run_with_schedule(name: str, args_: list[str], steps: int, schedule, out: Path, workers: int) -> dict:
    """Train on the lab, changing the rate when rank 0's progress bar reaches each phase's step."""
    cmd = train_command(name, steps, out, args_)
    with Lab(workers, schedule[0][1]) as lab:
        procs = lab.start(cmd, extra_env=worker_env(workers), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for p in procs[1:]:
            threading.Thread(target=p.stderr.read, daemon=True).start()  # drain
        pending = list(schedule[1:])
        buffer = b""
        while True:
            chunk = procs[0].stderr.read1(4096) if hasattr(procs[0].stderr, "read1") else procs[0].stderr.read(64)
            if not chunk:
                break
            buffer = (buffer + chunk)[-4096:]
            done = [int(m) for m in re.findall(rb"\|\s*(\d+)/\d+ \[", buffer)]
            while pending and done and max(done) >= pending[0][0]:
                lab.set_rate(pending.pop(0)[1])
        codes = [p.wait() for p in procs]
    if any(codes):
        raise RuntimeError(f"{name} failed on the lab ({codes}): {buffer.decode(errors='replace')[-2000:]}")
    return json.loads((out / "record.json").read_text())


def phase_stats(record: dict, schedule, budget_s: float) -> list[dict]:
    steps = record["per_step"]
    comm = [c + e + d for c, e, d in zip(steps["comm_s"], steps["encode_s"], steps["decode_s"])]
    # kimad's own account (what its budget counts): link time, each collective's least time across ranks,
    # plus the slowest rank's codec time; rank 0's comm above also holds its waits for the other rank
    link = steps.get("link_comm_s") or [None] * len(comm)
    bounds = [s for s, _ in schedule] + [len(comm)]
    rows = []
    for (start, rate), end in zip(schedule, bounds[1:]):
        held = comm[start + SETTLE_STEPS:end]
        held_link = [t for t in link[start + SETTLE_STEPS:end] if t is not None]
        bandwidth = [b for b in (steps.get("bandwidth_Bps") or [None] * len(comm))[start + SETTLE_STEPS:end] if b]
        # kimad's verdict on the plan each step ran (made at the end of the step before): did a plan within
        # max_error fit? (None: a fixed codec)
        fits = (steps.get("plan_fits") or [None] * len(comm))[start + SETTLE_STEPS - 1:end - 1]
        fitting = [t for t, f in zip(held, fits) if f is not False]
        rows.append({"rate": rate, "steps": f"{start + SETTLE_STEPS}-{end - 1}",
                     "comm_median_s": statistics.median(held), "comm_p90_s": sorted(held)[int(0.9 * (len(held) - 1))],
                     "within_budget": share_within(held, budget_s),
                     "link_median_s": statistics.median(held_link) if held_link else None,
                     "link_within_budget": share_within(held_link, budget_s) if held_link else None,
                     "planned_to_fit": len(fitting) / len(held),
                     "within_budget_of_fitting": share_within(fitting, budget_s) if fitting else None,
                     "bandwidth_mbit": statistics.median(bandwidth) * 8e-6 if bandwidth else None,
                     "wire_bytes": statistics.mean(steps["wire_bytes"][start:end])})
    return rows


def share_within(comm_s: list[float], budget_s: float) -> float:
    """The share of steps whose communication came within WITHIN x the budget."""
    return sum(t <= WITHIN * budget_s for t in comm_s) / len(comm_s)


def closest_bits(wire_bytes: float, raw_bytes: float, world_size: int) -> int:
    bits_per_element = 32 * wire_bytes / raw_bytes
    # ties (e.g. 7 and 8 bits both pack into 9.1 bits at n = 2) go to the more precise codec
    return min(range(2, 9), key=lambda b: (abs(make_codec("gqsgd", bits=b).wire_bits(world_size) - bits_per_element), -b))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--schedule", default="0:1gbit,40:100mbit,80:300mbit")
    parser.add_argument("--budget-ms", type=float, default=200.0)
    parser.add_argument("--codecs", default="kimad+,kimad,gqsgd,none",
                        help="rows to run, of kimad+, kimad, gqsgd (8-bit, and the bits closest to kimad+'s traffic), none")
    parser.add_argument("--kimad-lowrank-rank", type=int,
                        help="kimad rows: add low rank at this rank to the plan's options (netgain train's flag)")
    parser.add_argument("--workers", type=int, default=2, help="lab workers (each a rank of the job)")
    parser.add_argument("--runs", type=Path, default=Path("runs/kimad_lab"))
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    if args.workers < 2:
        raise SystemExit(f"--workers must be at least 2 (a collective needs two ranks), got {args.workers}")
    schedule = parse_schedule(args.schedule)
    budget_s = args.budget_ms / 1e3
    load_start = os.getloadavg()
    codecs = args.codecs.split(",")
    unknown = sorted(set(codecs) - {"kimad+", "kimad", "gqsgd", "none"})
    if unknown:
        raise SystemExit(f"--codecs: unknown {unknown}; choose from kimad+, kimad, gqsgd, none")
    lowrank = ["--kimad-lowrank-rank", str(args.kimad_lowrank_rank)] if args.kimad_lowrank_rank else []
    plan = [("kimad+", ["--comm-budget-ms", str(args.budget_ms), "--replan-every", "10", *lowrank]),
            ("kimad", ["--comm-budget-ms", str(args.budget_ms), "--replan-every", "10", *lowrank]),
            ("gqsgd", ["--bits", "8"]), ("none", [])]
    plan = [(name, extra) for name, extra in plan if name in codecs]
    records = {}
    with terminate_on_signals():
        for name, extra in plan:
            label = " ".join([name, *extra[:2], *lowrank]) if name.startswith("kimad") else " ".join([name, *extra])
            print(f"== {label}", flush=True)
            records[label] = run_with_schedule(name, extra, args.steps, schedule, args.runs / label.replace(" ", "_"),
                                               args.workers)
            if name == "kimad+" and "gqsgd" in codecs:  # queue the fixed codec that sends what kimad+ sent on average
                summary = records[label]["summary"]
                bits = closest_bits(summary["wire_bytes_per_step"], summary["fp32_bytes_per_step"], args.workers)
                if bits != 8:
                    plan.append(("gqsgd", ["--bits", str(bits)]))
    rows = []
    for label, record in records.items():
        s = record["summary"]
        for phase in phase_stats(record, schedule, budget_s):
            rows.append({"run": label, **phase, "final_val_loss": s["final_val_loss"], "step_s": s["step_s"],
                         "mean_wire_bytes": s["wire_bytes_per_step"]})
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "kimad_lab.csv", rows)
    plot(records, schedule, budget_s, args.out / "kimad_lab.png")
    commit = git_commit()
    lines = ["# Kimad on a link whose rate changes during training", "",
             f"Machine: 2-core x86_64 shared with other jobs, in a quiet window (load average 1/5 min "
             f"{load_start[0]:.2f}/{load_start[1]:.2f} at start, {os.getloadavg()[0]:.2f}/{os.getloadavg()[1]:.2f} "
             f"at end), no GPU; commit {commit}; {args.workers} lab workers.",
             f"Command: `python bench/kimad_lab.py --steps {args.steps} --schedule {args.schedule} "
             f"--budget-ms {args.budget_ms} --codecs {args.codecs}"
             + (f" --kimad-lowrank-rank {args.kimad_lowrank_rank}" if lowrank else "")
             + (f" --workers {args.workers}" if args.workers != 2 else "") + "`. Comm = rank 0's collective + encode + decode "
             "seconds per step (the hook's own timing, its waits for the other ranks' backward included); link (kimad "
             "rows) = what kimad's budget counts, each collective's least time across ranks (the last rank to arrive "
             "waits for no one) plus the slowest rank's encode + decode; held to account from "
             f"{SETTLE_STEPS} steps after each change.", "",
             "| run | rate | steps | comm median s | comm p90 s | steps within 1.1 x budget | link comm median s "
             "| steps within 1.1 x budget, link | steps planned to fit "
             "| of those, within 1.1 x budget | bandwidth estimate Mbit/s | wire bytes/step | final val loss |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        bandwidth = f"{r['bandwidth_mbit']:.0f}" if r["bandwidth_mbit"] else "-"
        of_fitting = f"{100 * r['within_budget_of_fitting']:.0f}%" if r["within_budget_of_fitting"] is not None else "-"
        link = (f"{r['link_median_s']:.3f} | {100 * r['link_within_budget']:.0f}%" if r["link_median_s"] is not None
                else "- | -")
        lines.append(f"| {r['run']} | {r['rate']} | {r['steps']} | {r['comm_median_s']:.3f} | {r['comm_p90_s']:.3f} "
                     f"| {100 * r['within_budget']:.0f}% | {link} | {100 * r['planned_to_fit']:.0f}% | {of_fitting} | {bandwidth} "
                     f"| {r['wire_bytes']:,.0f} | {r['final_val_loss']:.4f} |")
    lines.append(f"\nBudget: {budget_s:.3f} s per step. \"Planned to fit\": kimad found a plan within its max_error "
                 "predicted inside budget / margin; on the other steps no safe plan fits, it runs the fastest safe one "
                 "and warns (fixed codecs: every step counts as planned). Lab namespaces of this process left: "
                 f"{sum(f'-{os.getpid()}-' in name for name in list_lab_namespaces())}.")
    (args.out / "kimad_lab.md").write_text("\n".join(lines) + "\n")
    print((args.out / "kimad_lab.md").read_text())
    return 0


def plot(records: dict, schedule, budget_s: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    for label, record in records.items():
        steps = record["per_step"]
        x = [s + 1 for s in steps["step"]]
        comm = [c + e + d for c, e, d in zip(steps["comm_s"], steps["encode_s"], steps["decode_s"])]
        axes[0].plot(x, comm, label=label, lw=1)
        axes[1].plot(x, [32 * w / r for w, r in zip(steps["wire_bytes"], steps["raw_bytes"])], label=label, lw=1)
        axes[2].plot(x, steps["train_loss"], label=label, lw=1)
    axes[0].axhline(budget_s, color="k", ls="--", lw=1, label="kimad budget")
    for ax in axes:
        for start, rate in schedule[1:]:
            ax.axvline(start, color="grey", ls=":", lw=1)
    axes[0].set(ylabel="communication s/step", yscale="log",
                title="rate: " + " -> ".join(f"{rate} (step {start})" for start, rate in schedule))
    axes[1].set(ylabel="wire bits per element")
    axes[2].set(xlabel="step", ylabel="train loss")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
