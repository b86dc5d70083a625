"""A job's first steps against its steady step, per codec: what a compile costs a user's run.

Each codec's `netgain train` (the default lm job, 2 local workers on loopback) runs as a user's second
process on this machine (torch.compile's on-disk cache and netgain's codec calibrations warm from an
earlier run), under
NETGAIN_COMPILE=auto (kernels compile in a background thread while the eager path serves) and
NETGAIN_COMPILE=1 (kernels compile on their first call, which waits: netgain before the background
compile), interleaved, --repeats times. Reports the mean of the first 3 steps over the median of the last
10 (the steady step), per run, median and min-max. A cold run (an empty compile cache, the first process
on a machine) per codec is reported apart.

    python bench/first_steps.py [--codecs auto none gqsgd lowrank kimad+] [--steps 40] [--repeats 3]

Writes bench/results/first_steps.md and first_steps.csv.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
from pathlib import Path

from provenance import git_commit, wait_for_quiet, write_csv
from runs import train_command

FIRST, STEADY = 3, 10  # steps: the first ones a user waits for; the last ones, the steady step


def run(codec: str, steps: int, mode: str, cache: str) -> dict:
    """One `netgain train` process; its first and steady steps."""
    with tempfile.TemporaryDirectory(prefix="netgain-first-steps-") as out:
        env = {**os.environ, "NETGAIN_COMPILE": mode, "TORCHINDUCTOR_CACHE_DIR": cache, "NETGAIN_CACHE": cache,
               "HF_HUB_OFFLINE": "1"}
        done = subprocess.run(train_command(codec, steps, out), env=env, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"netgain train --codec {codec} failed:\n{done.stderr[-2000:]}")
        step_s = json.loads((Path(out) / "record.json").read_text())["per_step"]["step_s"]
    first, steady = statistics.mean(step_s[:FIRST]), statistics.median(step_s[-STEADY:])
    return {"codec": codec, "mode": mode, "first_s": first, "steady_s": steady, "ratio": first / steady,
            "step0_s": step_s[0]}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--codecs", nargs="+", default=["auto", "none", "fp16", "gqsgd", "lowrank", "topk", "kimad+"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if args.steps < FIRST + STEADY:
        parser.error(f"--steps must be at least {FIRST + STEADY}")
    load = wait_for_quiet()
    rows = []
    with tempfile.TemporaryDirectory(prefix="netgain-inductor-") as cache:
        for codec in args.codecs:
            rows.append({**run(codec, args.steps, "auto", cache), "process": "cold"})  # fills the cache
            for _ in range(args.repeats):
                for mode in ("auto", "1"):
                    rows.append({**run(codec, args.steps, mode, cache), "process": "second"})
                    print(json.dumps(rows[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "first_steps.csv", rows)
    lines = ["# First steps against the steady step\n",
             f"`python bench/first_steps.py --codecs {' '.join(args.codecs)} --steps {args.steps} --repeats "
             f"{args.repeats}` at {git_commit()} on {platform.processor() or platform.machine()} "
             f"({os.cpu_count()} cores), load average {load:.2f} before the first run; default lm job, 2 workers, "
             f"loopback.\n",
             f"Ratio: the mean of the first {FIRST} steps over the median of the last {STEADY}, per run; median "
             f"(min-max) of {args.repeats} runs per cell, interleaved.\n",
             "| codec | background compile (auto) | compile on first call (1) | steady step, auto | cold process, auto: ratio, step 0 |",
             "|---|---|---|---|---|"]
    for codec in args.codecs:
        cell = {mode: [r for r in rows if r["codec"] == codec and r["mode"] == mode and r["process"] == "second"]
                for mode in ("auto", "1")}
        cold = next(r for r in rows if r["codec"] == codec and r["process"] == "cold")
        ratios = {mode: sorted(r["ratio"] for r in runs) for mode, runs in cell.items()}
        lines.append(f"| {codec} | " + " | ".join(
            f"{statistics.median(v):.2f}x ({v[0]:.2f}-{v[-1]:.2f})" for v in ratios.values())
            + f" | {statistics.median(r['steady_s'] for r in cell['auto']):.3f} s"
            + f" | {cold['ratio']:.2f}x, {cold['step0_s']:.1f} s |")
    (args.out / "first_steps.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
