"""What every benchmark records beside its numbers: the commit that produced them, and a CSV."""

import csv
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def git_commit() -> str:
    """Short HEAD hash, marked when src/ or bench/ differ from it (the numbers are then not HEAD's)."""
    def git(*cmd):
        return subprocess.run(["git", *cmd], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    dirty = git("status", "--porcelain", "--", "src", "bench/*.py")
    return git("rev-parse", "--short", "HEAD") + (" (with uncommitted changes)" if dirty else "")


def write_csv(path: Path, rows: list[dict], fieldnames: list[str] | None = None) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fieldnames or list(rows[0]), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
