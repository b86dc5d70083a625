"""Every codec on the default `netgain train` job at the same step count: final validation loss
against `none` (fp32), measured in one run of this script.

    python bench/codec_losses.py [--steps 100] [--world-size 2]

Writes bench/results/codec_losses.md and .csv; each run's record.json stays under runs/codec_losses/.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from provenance import git_commit, write_csv

ROWS = [("none", []), ("fp16", []), ("bf16", []), ("qsgd", ["--bits", "8"]),
        ("gqsgd", ["--bits", "8", "--encoding", "int8"]), ("gqsgd", ["--bits", "8"]), ("gqsgd", ["--bits", "4"]),
        ("gqsgd", ["--bits", "2"]), ("gqsgd-exp", ["--bits", "8"]), ("topk", ["--ratio", "0.01"]),
        ("randomk", ["--ratio", "0.01"])]
EIGHT_BIT_UNBIASED = {"qsgd --bits 8", "gqsgd --bits 8 --encoding int8", "gqsgd --bits 8", "gqsgd-exp --bits 8"}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--runs", type=Path, default=Path("runs/codec_losses"))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    load_start = os.getloadavg()[1]
    rows = []
    for codec, extra in ROWS:
        label = " ".join([codec, *extra])
        out = args.runs / label.replace(" ", "_").replace("--", "")
        cmd = ["netgain", "train", "--codec", codec, *extra, "--steps", str(args.steps),
               "--world-size", str(args.world_size), "--eval-every", "0", "--out", str(out)]
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        summary = json.loads((out / "record.json").read_text())["summary"]
        rows.append({"codec": label, "val_loss": summary["final_val_loss"], "train_loss": summary["final_train_loss"],
                     "compression_ratio": summary["compression_ratio"], "step_s": summary["step_s"]})
        print(rows[-1], flush=True)
    base = rows[0]["val_loss"]
    for row in rows:
        row["val_vs_none"] = row["val_loss"] / base - 1
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "codec_losses.csv", rows)
    commit = git_commit()
    lines = ["# Validation loss of every codec on the default `netgain train` job", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores shared with other jobs (load average "
             f"{load_start:.1f} at start, {os.getloadavg()[1]:.1f} at end), no GPU; commit {commit}.",
             f"Command: `python bench/codec_losses.py --steps {args.steps} --world-size {args.world_size}` "
             "(local gloo workers on loopback; same seed and data order for every row).", "",
             "| codec | final val loss | vs none | final train loss | compression | step s |", "|---|---|---|---|---|---|"]
    for r in rows:
        mark = " (8-bit unbiased)" if r["codec"] in EIGHT_BIT_UNBIASED else ""
        ratio = "-" if r["compression_ratio"] is None else f"{r['compression_ratio']:.2f}x"  # None: one worker
        lines.append(f"| {r['codec']}{mark} | {r['val_loss']:.4f} | {100 * r['val_vs_none']:+.2f}% | "
                     f"{r['train_loss']:.4f} | {ratio} | {r['step_s']:.3f} |")
    (args.out / "codec_losses.md").write_text("\n".join(lines) + "\n")
    print((args.out / "codec_losses.md").read_text())


if __name__ == "__main__":
    sys.exit(main())
