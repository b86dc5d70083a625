"""What every benchmark records beside its numbers: the commit that produced them, and a CSV."""

import csv
import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def git_commit(root: Path = ROOT) -> str:
    """Short HEAD hash of the checkout at ``root``, marked when src/ or bench/ differ from it (the numbers are then not HEAD's)."""
    def git(*cmd):
        return subprocess.run(["git", *cmd], capture_output=True, text=True, cwd=root).stdout.strip()
    dirty = git("status", "--porcelain", "--", "src", "bench/*.py")
    return git("rev-parse", "--short", "HEAD") + (" (with uncommitted changes)" if dirty else "")


def write_csv(path: Path, rows: list[dict], fieldnames: list[str] | None = None) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fieldnames or list(rows[0]), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def wait_for_quiet(limit: float = 1.0, wait_s: float = 900) -> float:
    """Wait (up to wait_s) for the 1-minute load average to fall below `limit`; returns it (to record)."""
    deadline = time.monotonic() + wait_s
    while os.getloadavg()[0] >= limit and time.monotonic() < deadline:
        time.sleep(10)
    return os.getloadavg()[0]
