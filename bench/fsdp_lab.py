"""HSDP on the lab: 2 "nodes" x 2 workers, the inter-node link throttled, fp32 vs Global-QSGD across nodes.

Why: hybrid sharding sends its reduce-scatter and all-gather over the fast link inside a node
and only the cross-replica all-reduce over the slow link between nodes, which is the hop
netgain.comm.fsdp compresses. The lab (lab.py) puts every worker in its own namespace on one
bridge. Here workers 0, 1 (node A) stay on that bridge and workers 2, 3 (node B) move to a
second one, and the two bridges are joined by one veth pair with a tbf on both ends. So only
inter-node traffic is shaped, and both cross-node pairs share the one link, as on real nodes.

Mesh (replicate, shard) = (2, 2): rank = 2 * replica + shard, so the shard groups {0, 1}, {2, 3}
stay inside a node and the replicate groups {0, 2}, {1, 3} cross the link. The workers start
once and build every contestant's copy of the same model; each contestant trains its copy on the
same data stream, --steps at a time, round after round (A B C A B C ...), so each trains
rounds x steps in all (after --warmup untimed steps) while all of them see the machine and link
in the same states. Step time = the median of each round's steps, reported as the median
(min-max) over rounds; loss = the mean over ranks, on each step's fresh batch (the data are
endless, so it is also a held-out loss), averaged over the last 10 steps of each round.
Contestants: native-fp32 (FSDP's own HSDP over the 2-D mesh, no netgain), and netgain.comm.fsdp
with none (fp32 through the hook), gqsgd 8-bit and 4-bit (packed).

    python bench/fsdp_lab.py --rate 100mbit --rounds 3 --steps 40     # root
Writes OUT.md and OUT.json (OUT defaults to bench/results/fsdp_lab).
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

# label -> the netgain codec on the cross-node hop; None: FSDP's native HSDP (fully_shard over the 2-D mesh)
CONTESTANTS = {"native-fp32": None, "fp32": ("none", {}), "gqsgd-8": ("gqsgd", {"bits": 8}),
               "gqsgd-4": ("gqsgd", {"bits": 4})}
NODES, PER_NODE = 2, 2
LOSS_WINDOW = 10  # a round's loss: the mean of its last 10 steps (one step's batch is noise)


# ---------------------------------------------------------------- one worker (inside the lab)


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import netgain.comm.fsdp as fsdp

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (NODES, PER_NODE), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(123)
    teacher = torch.nn.Linear(args.width, args.width)

    def batch(step):
        x = torch.randn(args.batch_size, args.width, generator=torch.Generator().manual_seed(10_000 * rank + step))
        with torch.no_grad():
            return x, torch.tanh(teacher(x))

    def build(label: str):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[m for _ in range(args.layers)
                                      for m in (torch.nn.Linear(args.width, args.width), torch.nn.Tanh())])
        spec = CONTESTANTS[label]
        over = mesh if spec is None else mesh["shard"]
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=over)
        fully_shard(model, mesh=over)
        state = None if spec is None else fsdp.register(model, mesh, spec[0], **spec[1])
        return {"model": model, "state": state, "optimizer": torch.optim.Adam(model.parameters(), lr=args.lr),
                "step": 0}

    def train(contestant: dict, steps: int) -> tuple[list[float], list[float], float]:
        """`steps` more steps of this contestant: their seconds, their losses (this rank), wire MB per step."""
        model, state, optimizer = contestant["model"], contestant["state"], contestant["optimizer"]
        times, losses, wire = [], [], []
        for _ in range(steps):
            x, y = batch(contestant["step"])
            dist.barrier()
            start = time.perf_counter()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
            wire.append(state.last_step["wire_bytes"] if state else 4 * sum(p.to_local().numel()
                                                                             for p in model.parameters()))
            contestant["step"] += 1
        return times, losses, statistics.mean(wire) / 1e6

    contestants = {label: build(label) for label in args.contestants}
    for contestant in contestants.values():
        train(contestant, args.warmup)
    rows = []
    for round_ in range(args.rounds):
        for label, contestant in contestants.items():
            times, losses, wire_mb = train(contestant, args.steps)
            mean_losses = torch.tensor(losses, dtype=torch.float64)
            dist.all_reduce(mean_losses)
            mean_losses = (mean_losses / dist.get_world_size()).tolist()
            rows.append({"label": label, "round": round_, "last_step": contestant["step"],
                         "step_s": statistics.median(times), "steps_s": times, "losses": mean_losses,
                         "loss": statistics.mean(mean_losses[-LOSS_WINDOW:]), "wire_MB": wire_mb,
                         "numel": sum(p.numel() for p in contestant["model"].parameters())})
    for contestant in contestants.values():
        if contestant["state"] is not None:
            contestant["state"].close()
    if rank == 0:
        Path(args.worker_out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- the two-node lab


def join_nodes(lab, rate: str) -> None:
    """Move workers 2, 3 to a second bridge and join the bridges by one veth pair, shaped both ways."""
    from lab import _sh, parse_rate, tbf_burst_bytes

    rate_bps = parse_rate(rate)
    ns = ["ip", "-n", lab.bridge_ns]
    _sh([*ns, "link", "add", "br1", "type", "bridge"])
    _sh([*ns, "link", "set", "br1", "up"])
    for rank in range(PER_NODE, NODES * PER_NODE):
        _sh([*ns, "link", "set", f"v{rank}", "master", "br1"])
    _sh([*ns, "link", "add", "x0", "type", "veth", "peer", "name", "x1"])
    for end, bridge in (("x0", "br0"), ("x1", "br1")):
        _sh([*ns, "link", "set", end, "master", bridge, "up"])
        if rate_bps is not None:
            _sh(["ip", "netns", "exec", lab.bridge_ns, "tc", "qdisc", "add", "dev", end, "root", "tbf", "rate",
                 f"{int(rate_bps)}bit", "burst", str(tbf_burst_bytes(rate_bps)), "latency", "100ms"])


def run(args) -> tuple[list[dict], float, float]:
    """The contestants' rows, and the load average before and after."""
    from lab import Lab
    from provenance import wait_for_quiet

    load = wait_for_quiet(wait_s=args.wait_s)
    with tempfile.TemporaryDirectory(prefix="netgain-fsdp-lab-") as folder:
        out = Path(folder) / "rows.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--worker-out", str(out),
               *worker_flags(args)]
        with Lab(NODES * PER_NODE, None) as lab:
            join_nodes(lab, args.rate)
            codes = lab.run(cmd, extra_env={"OMP_NUM_THREADS": "1"}, timeout=900)
        if any(codes):
            raise RuntimeError(f"lab workers failed with exit codes {codes}")
        rows = json.loads(out.read_text())
    return rows, load, os.getloadavg()[0]


def worker_flags(args) -> list[str]:
    return ["--rounds", str(args.rounds), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--batch-size", str(args.batch_size), "--width", str(args.width), "--layers", str(args.layers),
            "--lr", str(args.lr), "--contestants", *args.contestants]


def report(rows: list[dict], meta: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    rounds = sorted({r["round"] for r in rows})
    ends = [next(r["last_step"] for r in rows if r["round"] == k) for k in rounds]
    lines = [f"# {meta['title']}", "", f"Machine: {meta['machine']}; commit {meta['commit']}; command: `{meta['command']}`; "
             f"load average (1 min) {meta['load_before']:.2f} before, {meta['load_after']:.2f} after.",
             f"Model: {meta['layers']} x Linear({meta['width']}, {meta['width']}) + tanh ({rows[0]['numel'] / 1e6:.2f} M "
             f"parameters), each Linear one FSDP group, regressing a fixed random tanh(Linear) teacher on fresh "
             f"Gaussian batches of {meta['batch_size']} per worker; Adam lr {meta['lr']}. Each contestant trains one "
             f"model: {meta['warmup']} untimed steps, then {meta['rounds']} rounds of {meta['steps']} steps, the "
             "contestants interleaved within each round. Inter-node link: one veth pair between the nodes' "
             f"bridges, tbf {meta['rate']} each way; intra-node traffic unshaped.", "",
             "Step time: the median of each round's steps, then the median (min-max) over rounds. Loss: mean over "
             f"the 4 ranks, averaged over the last {LOSS_WINDOW} steps of the round (every batch is fresh data).", "",
             "| contestant | step s, median (min-max) | x native fp32 HSDP | "
             + " | ".join(f"loss, steps {e - LOSS_WINDOW + 1}-{e}" for e in ends) + " | wire MB/step/rank |",
             "|---|---|---|" + "---|" * len(ends) + "---|"]
    native = [r["step_s"] for r in rows if r["label"] == "native-fp32"]
    base = statistics.median(native) if native else None
    for label in dict.fromkeys(r["label"] for r in rows):
        mine = sorted((r for r in rows if r["label"] == label), key=lambda r: r["round"])
        steps = [r["step_s"] for r in mine]
        speed = f"{base / statistics.median(steps):.2f}" if base else ""
        lines.append(f"| {label} | {statistics.median(steps):.3f} ({min(steps):.3f}-{max(steps):.3f}) | {speed} | "
                     + " | ".join(f"{r['loss']:.5f}" for r in mine) + f" | {mine[-1]['wire_MB']:.2f} |")
    Path(f"{out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="100mbit", help="the inter-node link, each way ('none': unshaped)")
    parser.add_argument("--contestants", nargs="+", default=["native-fp32", "gqsgd-8", "gqsgd-4"],
                        choices=list(CONTESTANTS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="steps per contestant per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per contestant before the rounds")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate")
    parser.add_argument("--wait-s", type=float, default=900,
                        help="how long to wait for the load to fall below 1")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "fsdp_lab")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rounds < 3 or args.steps < LOSS_WINDOW or args.warmup < 1:
        parser.error(f"--rounds must be >= 3 (medians), --steps >= {LOSS_WINDOW} (a round's loss), --warmup >= 1")
    if args.worker:
        worker(args)
        return 0
    from provenance import git_commit

    rows, before, after = run(args)
    meta = {"title": "HSDP on the two-node lab: fp32 vs Global-QSGD on the inter-node all-reduce (interleaved rounds)",
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, 4 workers of 1 torch thread",
            "commit": git_commit(), "command": "python " + " ".join(sys.argv), "load_before": before,
            "load_after": after, **{k: getattr(args, k) for k in ("rate", "width", "layers", "batch_size", "lr",
                                                                   "rounds", "steps", "warmup")}}
    report(rows, meta, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
