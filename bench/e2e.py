"""Head-to-head on the throttled-network lab: netgain codecs against PyTorch's own DDP hooks.

Why: compression is only worth shipping if it makes training faster on a slow link without hurting
the loss. Every row trains the default `netgain train` job for a fixed number of steps with one
worker per lab namespace, at link rates {no limit, 1 Gbit/s, 100 Mbit/s} and 2 or 3 workers.
Rows of one (rate, world size) run back to back, between two runs of the `ddp` baseline (fp32
allreduce, what DDP does without a hook), so machine-load drift falls on baseline and candidates
alike; ratios use the mean of the two baseline runs. The compute-bound limit per world size is the
`ddp` baseline at no rate limit, step minus network wait: no codec can make a step faster.

    python bench/e2e.py                                    # full grid, about 40 minutes (root)
    python bench/e2e.py --rates 100mbit --workers 2 --codecs ddp-fp16 gqsgd-8-int8 --steps 8 \
        --out /tmp/e2e-quick
Writes OUT.md, OUT.csv, OUT.json (per-step records), OUT_throughput.png, OUT_loss.png
(OUT defaults to bench/results/e2e).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from lab import NAME_PREFIX, list_lab_namespaces, terminate_on_signals  # noqa: E402
from runs import SKIP_STEPS, measured, train_on_lab  # noqa: E402
from provenance import git_commit, write_csv  # noqa: E402

BASELINE = "ddp"
# row label -> (`netgain train --codec`, its options)
CODECS = {
    "ddp": ("ddp", {}),
    "ddp-fp16": ("ddp-fp16", {}),
    "ddp-powersgd-r4": ("ddp-powersgd", {"rank": 4}),
    "ddp-powersgd-r32": ("ddp-powersgd", {"rank": 32}),
    "fp16": ("fp16", {}),
    "qsgd-8": ("qsgd", {"bits": 8}),
    "gqsgd-8-int8": ("gqsgd", {"bits": 8, "encoding": "int8"}),
    "gqsgd-8-packed": ("gqsgd", {"bits": 8, "encoding": "packed"}),
    "gqsgd-4-packed": ("gqsgd", {"bits": 4, "encoding": "packed"}),
    "gqsgd-exp-8": ("gqsgd-exp", {"bits": 8}),
    "topk-1%": ("topk", {"ratio": 0.01}),
}
RATES = {"none": None, "1gbit": "1gbit", "100mbit": "100mbit"}  # run in this order
RATE_LABEL = {"none": "no limit", "1gbit": "1 Gbit/s", "100mbit": "100 Mbit/s"}
TARGET_ROW, PEER_ROW, TARGET_SPEEDUP = "gqsgd-8-int8", "ddp-fp16", 3.0


def run_row(workers: int, rate: str, label: str, run: str, steps: int, train_args: list[str]) -> dict:
    """Train one row on the lab; its measurements (medians over steps after SKIP_STEPS) or its error."""
    name, params = CODECS[label]
    row = {"workers": workers, "rate": rate, "codec": label, "run": run, "started_unix": time.time()}
    try:
        record = train_on_lab(workers, RATES[rate], name, params, steps, train_args)
    except (RuntimeError, TimeoutError) as error:
        print(f"  {rate} n={workers} {label}: FAILED {error}", file=sys.stderr, flush=True)
        return {**row, "error": str(error).splitlines()[0]}
    m = measured(record)
    summary, per_step = record["summary"], record["per_step"]
    row.update({
        "samples_per_s": record["config"]["batch_size"] * summary["world_size"] / m["step_s"],
        "step_s": m["step_s"], "compute_s": m["compute_s"], "wait_s": m["wait_s"],
        "wire_bytes": m["wire_bytes"], "fp32_bytes": summary["fp32_bytes_per_step"],
        "final_train_loss": summary["final_train_loss"], "final_val_loss": summary["final_val_loss"],
        "per_step": {key: per_step[key] for key in ("step_s", "wait_s", "wire_bytes", "train_loss")},
    })
    print(f"  {rate} n={workers} {label} ({run}): {row['samples_per_s']:.1f} samples/s, step "
          f"{m['step_s']:.3f} s = compute {m['compute_s']:.3f} + wait {m['wait_s']:.3f}, "
          f"val loss {row['final_val_loss']:.4f}", flush=True)
    return row


def run_group(workers: int, rate: str, labels: list[str], steps: int, train_args: list[str]) -> list[dict]:
    """The baseline, every other row, the baseline again; ratios to the mean of the two baselines."""
    others = [label for label in labels if label != BASELINE]
    plan = [(BASELINE, "before"), *((label, "") for label in others), (BASELINE, "after")]
    rows = [run_row(workers, rate, label, run, steps, train_args) for label, run in plan]
    baselines = [r for r in rows if r["codec"] == BASELINE and "error" not in r]
    if baselines:
        base = statistics.mean(r["samples_per_s"] for r in baselines)
        for r in rows:
            if "error" not in r:
                r["ratio_to_ddp"] = r["samples_per_s"] / base
    return rows


def add_limit(rows: list[dict]) -> None:
    """Per world size: the compute-bound limit (`ddp` at no rate limit, step minus wait) and each
    row's step time over it."""
    for n in {r["workers"] for r in rows}:
        limits = [r["compute_s"] for r in rows if r["workers"] == n and r["rate"] == "none"
                  and r["codec"] == BASELINE and "error" not in r]
        if not limits:
            continue
        limit = statistics.mean(limits)
        for r in rows:
            if r["workers"] == n and "error" not in r:
                r["limit_compute_s"] = limit
                r["step_over_limit"] = r["step_s"] / limit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", nargs="+", default=list(RATES), choices=list(RATES))
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 3], choices=[2, 3])
    parser.add_argument("--codecs", nargs="+", default=list(CODECS), choices=list(CODECS),
                        help=f"rows to run; the {BASELINE} baseline always runs")
    parser.add_argument("--steps", type=int, default=15,
                        help=f"training steps per row; timings are medians over steps {SKIP_STEPS}..")
    parser.add_argument("--out", default=str(HERE / "results" / "e2e"),
                        help="output prefix: OUT.md, OUT.csv, OUT.json, OUT_throughput.png, OUT_loss.png")
    parser.add_argument("--report-only", action="store_true",
                        help="no training: rewrite OUT.md, OUT.csv and the plots from OUT.json")
    parser.add_argument("train_args", nargs=argparse.REMAINDER,
                        help="-- extra `netgain train` options (model size, batch size)")
    args = parser.parse_args(argv)
    if args.steps <= SKIP_STEPS:
        parser.error(f"--steps: must exceed {SKIP_STEPS} (the untimed warm-up steps), got {args.steps}")
    if args.report_only:
        saved = json.loads(Path(args.out).with_suffix(".json").read_text())
        write_results(saved["rows"], saved["meta"], Path(args.out))
        print(Path(args.out).with_suffix(".md").read_text())
        return 0
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    labels = [BASELINE] + [c for c in args.codecs if c != BASELINE]
    # the compute-bound limit needs the baseline at no rate limit, also when that rate is not asked for
    groups = [(n, rate, labels if rate in args.rates else [BASELINE])
              for n in args.workers for rate in RATES if rate in args.rates or rate == "none"]

    command = shlex.join([sys.executable, *(sys.argv if argv is None else ["bench/e2e.py", *argv])])
    meta = {"command": command, "commit": git_commit(), "steps": args.steps, "machine": _machine(),
            "load_start": os.getloadavg(), "started_unix": time.time()}
    rows: list[dict] = []
    try:
        with terminate_on_signals():
            for n, rate, group_labels in groups:
                print(f"{RATE_LABEL[rate]}, {n} workers:", flush=True)
                rows += run_group(n, rate, group_labels, args.steps, train_args)
                add_limit(rows)
                own = [name for name in list_lab_namespaces() if name.startswith(f"{NAME_PREFIX}-{os.getpid()}-")]
                meta.update(load_end=os.getloadavg(), ended_unix=time.time(), namespaces_left=len(own))
                write_results(rows, meta, Path(args.out))
    except KeyboardInterrupt as e:
        print(f"interrupted ({e}); lab torn down; partial results written", file=sys.stderr)
        return 130
    print(Path(args.out).with_suffix(".md").read_text())
    return 0 if all("error" not in r for r in rows) else 1


# ---------------------------------------------------------------- results

CSV_FIELDS = ("workers", "rate", "codec", "run", "samples_per_s", "ratio_to_ddp", "step_s", "compute_s",
              "wait_s", "limit_compute_s", "step_over_limit", "wire_bytes", "fp32_bytes",
              "final_train_loss", "final_val_loss", "started_unix", "error")


def write_results(rows: list[dict], meta: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    write_csv(out.with_suffix(".csv"), rows, CSV_FIELDS)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    out.with_suffix(".md").write_text(markdown(rows, meta))
    plot_throughput(rows, Path(f"{out}_throughput.png"))
    plot_loss(rows, Path(f"{out}_loss.png"))




def _machine() -> str:
    model = platform.processor() or platform.machine()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    return f"{model}, {os.cpu_count()} cores shared by all lab workers and by other jobs, no GPU"


def _fmt(row: dict, key: str, spec: str) -> str:
    return format(row[key], spec) if key in row else "-"


def markdown(rows: list[dict], meta: dict) -> str:
    def load(key):
        return "/".join(f"{x:.1f}" for x in meta[key])

    lines = [
        "# Head-to-head on the throttled-network lab: netgain codecs vs PyTorch DDP hooks",
        "",
        f"Machine: {meta['machine']}. Load average (1/5/15 min) {load('load_start')} at the start, "
        f"{load('load_end')} at the end; {(meta['ended_unix'] - meta['started_unix']) / 60:.0f} min "
        f"of wall time. Commit {meta['commit']}.",
        f"Command: `{meta['command']}`",
        "",
        f"Job: default `netgain train` (byte-level Llama, lm task), {meta['steps']} steps per row, "
        f"`--eval-every 0` (validation once, at the end). Times are medians over steps "
        f"{SKIP_STEPS}..{meta['steps'] - 1}; samples/s = batch x workers / median step; compute = step "
        "minus the hook's wait for the network after the last bucket (medians taken apart, so compute + "
        "wait need not add up to the step exactly). Each (rate, workers) group ran "
        f"`{BASELINE}` first and last; `vs ddp` divides by the mean of those two runs. Limit = the "
        "compute-bound step (`ddp` at no rate limit, compute part) of that world size; `step/limit` "
        "is how far a row is from it. Final train loss = mean of the last 10 steps over ranks.",
    ]
    for n in sorted({r["workers"] for r in rows}):
        for rate in RATES:
            group = [r for r in rows if r["workers"] == n and r["rate"] == rate]
            if not group:
                continue
            lines += ["", f"## {RATE_LABEL[rate]}, {n} workers", "",
                      "| codec | samples/s | vs ddp | step s | compute s | wait s | step/limit | "
                      "wire MB/step | train loss | val loss |",
                      "|---|---|---|---|---|---|---|---|---|---|"]
            for r in group:
                name = f"{r['codec']} ({r['run']})" if r["run"] else r["codec"]
                if "error" in r:
                    lines.append(f"| {name} | failed: {r['error'][:80]} |||||||||")
                    continue
                lines.append(
                    f"| {name} | {r['samples_per_s']:.1f} | {_fmt(r, 'ratio_to_ddp', '.2f')}x | "
                    f"{r['step_s']:.3f} | {r['compute_s']:.3f} | {r['wait_s']:.3f} | "
                    f"{_fmt(r, 'step_over_limit', '.2f')} | {r['wire_bytes'] / 1e6:.2f} | "
                    f"{r['final_train_loss']:.4f} | {r['final_val_loss']:.4f} |")
    lines += ["", "## At 100 Mbit/s: does gqsgd 8-bit reach 3x the fp32 baseline and beat ddp-fp16?", ""]
    lines += target_verdict(rows)
    lines += ["", f"Lab namespaces of this run left after its last group (`ip netns list`): "
                  f"{meta['namespaces_left']}.", ""]
    return "\n".join(lines)


def target_verdict(rows: list[dict]) -> list[str]:
    """Measured answer per world size, with the step-time breakdown that bounds the speedup: a
    codec can at best remove the baseline's network wait, leaving its compute."""
    ok = [r for r in rows if "error" not in r and r["rate"] == "100mbit"]
    lines = []
    for n in sorted({r["workers"] for r in ok}):
        def row(label):
            return next((r for r in ok if r["workers"] == n and r["codec"] == label), None)
        target, peer = row(TARGET_ROW), row(PEER_ROW)
        bases = [r for r in ok if r["workers"] == n and r["codec"] == BASELINE]
        if not (target and bases and "limit_compute_s" in target):
            continue
        base = {key: statistics.mean(r[key] for r in bases) for key in ("step_s", "compute_s", "wait_s", "final_val_loss")}
        limit = target["limit_compute_s"]
        verdict = "reaches" if target["ratio_to_ddp"] >= TARGET_SPEEDUP else "does not reach"
        peer_text = ("has no ddp-fp16 row to compare with" if not peer else
                     f"{'beats' if target['samples_per_s'] > peer['samples_per_s'] else 'does not beat'} "
                     f"`ddp-fp16` ({target['samples_per_s']:.1f} vs {peer['samples_per_s']:.1f} samples/s, "
                     f"{peer['ratio_to_ddp']:.2f}x)")
        val = target["final_val_loss"] / base["final_val_loss"] - 1
        cap_limit, cap_own = base["step_s"] / limit, base["step_s"] / base["compute_s"]
        lines.append(
            f"- {n} workers: `{TARGET_ROW}` runs at **{target['ratio_to_ddp']:.2f}x** the `ddp` baseline "
            f"({target['samples_per_s']:.1f} samples/s) and so {verdict} {TARGET_SPEEDUP:.0f}x; it "
            f"{peer_text}; validation loss {val:+.1%} vs the baseline. Breakdown: the baseline's step "
            f"is {base['step_s']:.3f} s = compute {base['compute_s']:.3f} + network wait "
            f"{base['wait_s']:.3f} (mean of its two runs); `{TARGET_ROW}` steps in "
            f"{target['step_s']:.3f} s = compute {target['compute_s']:.3f} + wait {target['wait_s']:.3f}. "
            f"Even a free network leaves the compute, so the possible speedup is at most "
            f"{cap_limit:.2f}x by the compute-bound limit ({limit:.3f} s, `ddp` at no rate limit) or "
            f"{cap_own:.2f}x by the baseline's own compute in this group: {TARGET_SPEEDUP:.0f}x "
            f"{'is within' if min(cap_limit, cap_own) >= TARGET_SPEEDUP else 'is out of'} reach on "
            f"this machine for any codec.")
    return lines or ["No 100 Mbit/s rows with the baseline and the compute-bound limit in this run."]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_throughput(rows: list[dict], path: Path) -> None:
    """Samples/s vs link rate per codec, one panel per world size (the baseline: mean of its runs)."""
    plt = _plt()
    sizes = sorted({r["workers"] for r in rows})
    rates = [rate for rate in ("100mbit", "1gbit", "none") if any(r["rate"] == rate for r in rows)]
    fig, axes = plt.subplots(1, len(sizes), figsize=(6.5 * len(sizes), 4.8), squeeze=False, sharey=True)
    for ax, n in zip(axes[0], sizes):
        for label in CODECS:
            points = []
            for x, rate in enumerate(rates):
                values = [r["samples_per_s"] for r in rows if r["workers"] == n and r["rate"] == rate
                          and r["codec"] == label and "error" not in r]
                if values:
                    points.append((x, statistics.mean(values)))
            if points:
                style = {"linewidth": 2.5, "color": "black"} if label == BASELINE else {}
                ax.plot(*zip(*points), marker="o", label=label, **style)
        ax.set_xticks(range(len(rates)), [RATE_LABEL[rate] for rate in rates])
        ax.set_xlabel("link rate per worker (egress)")
        ax.set_title(f"{n} workers")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("samples/s")
    axes[0][-1].legend(fontsize=8, loc="best")
    fig.suptitle("netgain train (byte-level Llama) on the throttled-network lab")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_loss(rows: list[dict], path: Path, rate: str = "100mbit", workers: int = 2) -> None:
    """Per-step train loss (mean over ranks) of every row at one rate and world size."""
    plt = _plt()
    group = [r for r in rows if r["rate"] == rate and r["workers"] == workers and "error" not in r]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in group:
        name = f"{r['codec']} ({r['run']})" if r["run"] else r["codec"]
        style = {"color": "black", "linewidth": 2} if r["codec"] == BASELINE else {}
        ax.plot(r["per_step"]["train_loss"], label=name, alpha=0.85, **style)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (mean over ranks)")
    ax.set_title(f"train loss, {RATE_LABEL[rate]}, {workers} workers")
    ax.grid(alpha=0.3)
    if group:
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
