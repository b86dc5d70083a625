"""Run `netgain train` on the throttled-network lab and read its record (shared by bench scripts).

Why: model_validation.py, e2e.py, kimad_lab.py and kimad_collapse.py train the same job on the same
lab and must measure it the same way (same command line, thread share per worker, skipped warm-up
steps and medians).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from lab import Lab

SKIP_STEPS = 2  # the first steps build DDP's buckets and warm the allocator (and PowerSGD's warm-up)
RUN_TIMEOUT_S = 900


def threads_per_worker(workers: int) -> int:
    """The lab's workers share this machine's cores."""
    return max(1, (os.cpu_count() or 1) // workers)


def train_command(codec: str, steps: int, out, args=()) -> list[str]:
    """The `netgain train` command line every bench runner starts: validation only at the end."""
    return [sys.executable, "-m", "netgain.cli", "train", "--codec", codec, "--steps", str(steps),
            "--eval-every", "0", "--out", str(out), *args]


def worker_env(workers: int) -> dict[str, str]:
    """A lab worker's share of the cores, and no hub lookups."""
    return {"OMP_NUM_THREADS": str(threads_per_worker(workers)), "HF_HUB_OFFLINE": "1"}


def train_on_lab(workers: int, rate: str | None, name: str, params: dict, steps: int,
                 train_args: list[str]) -> dict:
    """Run `netgain train --codec name --key value...` with one rank per lab namespace; rank 0's
    record.json. A failing run raises with the tail of rank 0's stderr."""
    with tempfile.TemporaryDirectory(prefix="netgain-lab-run-") as out:
        cmd = train_command(name, steps, out, train_args)
        for key, value in params.items():
            cmd += [f"--{key}", str(value)]
        log = Path(out) / "stderr.log"
        with open(log, "w") as stderr, Lab(workers, rate) as lab:
            codes = lab.run(cmd, extra_env=worker_env(workers), timeout=RUN_TIMEOUT_S, stdout=subprocess.DEVNULL,
                            stderr=stderr)
        if any(codes):
            tail = log.read_text()[-2000:]
            raise RuntimeError(f"netgain train failed on the lab ({codes}): {' '.join(cmd)}\n{tail}")
        return json.loads((Path(out) / "record.json").read_text())


def measured(record: dict) -> dict:
    """Medians over the steps after SKIP_STEPS: step, network wait, compute (step minus wait)."""
    steps = record["per_step"]
    keep = slice(SKIP_STEPS, None)
    return {
        "step_s": statistics.median(steps["step_s"][keep]),
        "comm_s": statistics.median(steps["comm_s"][keep]),
        "wait_s": statistics.median(steps["wait_s"][keep]),
        "wire_bytes": statistics.median(steps["wire_bytes"][keep]),
        "compute_s": statistics.median(s - w for s, w in zip(steps["step_s"][keep], steps["wait_s"][keep])),
    }
