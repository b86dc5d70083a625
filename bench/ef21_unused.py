"""EF21 codecs on a parameter that no rank uses in some steps (DDP find_unused_parameters=True).

A trunk with two heads. "by step": every rank uses head step % 2, so each head is idle on every
rank every other step; "by rank": rank r uses head r % 2, so both heads are used somewhere each
step; "both": every rank uses both heads (no idle parameter, the control). SGD on a fixed
regression task; the loss reported is both heads' mean squared error on held-out data after the
last step. Each row is one torchrun job of --world-size gloo workers.

    python bench/ef21_unused.py [--steps 80] [--world-size 3] [--ratio 0.1] [--momentum 0]
                                [--codecs none,gqsgd,topk,randomk] [--schedules "by step,by rank"]

Writes bench/results/ef21_unused.md/.csv (with machine, commit, command and load).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from provenance import git_commit, write_csv  # noqa: E402

DIM, HIDDEN, BATCH = 32, 64, 64


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.Tanh())
        self.heads = torch.nn.ModuleList(torch.nn.Linear(HIDDEN, 1) for _ in range(2))

    def forward(self, x, heads):
        """The outputs of the listed heads, (batch, len(heads)): one forward, as DDP requires."""
        h = self.trunk(x)
        return torch.cat([self.heads[i](h) for i in heads], dim=1)


def task(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and the two heads' targets: fixed random teachers, so every codec sees the same problem."""
    teacher = torch.Generator().manual_seed(0)
    w = torch.randn(2, DIM, generator=teacher)
    x = torch.randn(n, DIM, generator=torch.Generator().manual_seed(seed))
    return x, torch.tanh(x @ w.T)


def worker(codec: str, schedule: str, steps: int, lr: float, ratio: float, momentum: float, out: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import netgain.comm as comm

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(TwoHeads(), find_unused_parameters=True)
    state = comm.register(model, codec, min_compress_numel=0, ratio=ratio) if codec != "none" else None
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for step in range(steps):
        heads = {"by step": [step % 2], "by rank": [rank % 2], "both": [0, 1]}[schedule]
        x, y = task(1000 * step + rank, BATCH)
        optimizer.zero_grad()
        predicted = model(x, heads)
        sum(torch.nn.functional.mse_loss(predicted[:, i], y[:, h]) for i, h in enumerate(heads)).backward()
        optimizer.step()
    x, y = task(999_999, 2048)
    with torch.no_grad():
        loss = torch.nn.functional.mse_loss(model.module(x, [0, 1]), y).item()
    if state is not None:
        state.close()
    if rank == 0:
        Path(out).write_text(json.dumps({"loss": loss}))
    dist.barrier()
    dist.destroy_process_group()


def launch(codec: str, schedule: str, args) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.world_size}",
                   __file__, "--worker", codec, schedule, str(args.steps), str(args.lr), str(args.ratio), str(args.momentum), str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
        if done.returncode:
            raise RuntimeError(f"{codec} {schedule}: torchrun exited {done.returncode}:\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())["loss"]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        codec, schedule, steps, lr, ratio, momentum, out = sys.argv[2:9]
        return worker(codec, schedule, int(steps), float(lr), float(ratio), float(momentum), out)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--world-size", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--ratio", type=float, default=0.1, help="top-k's and random-k's ratio")
    parser.add_argument("--momentum", type=float, default=0.0)
    parser.add_argument("--codecs", default="none,gqsgd,topk,randomk")
    parser.add_argument("--schedules", default="by step,by rank",
                        help="which heads a rank uses: by step, by rank, or both (every head on every rank: no idle parameter)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per row before it is called hung")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    rows = []
    for schedule in args.schedules.split(","):
        for codec in args.codecs.split(","):
            start = time.perf_counter()
            loss = launch(codec, schedule, args)
            rows.append({"schedule": schedule, "codec": codec, "held_out_mse": loss})
            print(f"{schedule:8} {codec:8} held-out MSE {loss:.4f} ({time.perf_counter() - start:.0f} s)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "ef21_unused.csv", rows)
    lines = ["# EF21 codecs and parameters no rank uses in a step", "",
             f"Machine: {os.cpu_count()}-core {platform.machine()}, no GPU (load average {load:.2f} at start, "
             f"{os.getloadavg()[0]:.2f} at end; untimed); commit {git_commit()}.",
             f"Command: `python bench/ef21_unused.py {' '.join(sys.argv[1:])}`", "",
             f"{args.world_size} gloo workers, SGD lr {args.lr} momentum {args.momentum}, top-k/random-k ratio {args.ratio}, {args.steps} steps, batch {BATCH} per worker, "
             "one seed (the runs are deterministic). Held-out MSE of both heads after the last step.", "",
             "| schedule | codec | held-out MSE |", "|---|---|---|"]
    lines += [f"| {r['schedule']} | {r['codec']} | {r['held_out_mse']:.4f} |" for r in rows]
    (args.out / "ef21_unused.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
