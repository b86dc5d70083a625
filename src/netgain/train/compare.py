"""`netgain train --compare`: the run beside PyTorch's fp32 DDP and PowerSGD on the same job.

The baselines run after the main run, one after another, through the same launcher, with the same
seed, steps, data and --emulate-link, each under --out/<codec>. The comparison reads the three
record.json files: each run's steady step time (report.summarize's), and its time to a train loss
that every run reaches, the highest of their final train losses, so that no run is timed to a loss
it never got to.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from netgain.files import require_claimed, write_atomically
from netgain.train.config import SYNC_FIELDS, TrainConfig, run_label
from netgain.train.report import COMPARE_FILE, FINAL_TRAIN_LOSS_WINDOW

BASELINES = ("ddp", "ddp-powersgd")  # fp32 DDP (allreduce_hook), PowerSGD at --rank


def baseline_configs(config: TrainConfig) -> list[TrainConfig]:
    """The baselines' runs: the same job under --out/<codec>, per step (a --sync run's too), no checkpoints, no
    further comparison."""
    return [replace(config, codec=codec, out=str(Path(config.out) / codec), run_id="", checkpoint=None,
                    checkpoint_every=0, compare=False, sync=False, local_route=False,
                    **dict.fromkeys(SYNC_FIELDS))
            for codec in BASELINES if codec != config.codec]


def time_to_loss(per_step: dict, target: float) -> float | None:
    """Seconds of training (every step's time, compiles included) until the mean train loss of the last
    FINAL_TRAIN_LOSS_WINDOW steps is at most ``target``; None if it never is."""
    losses, elapsed = per_step["train_loss"], 0.0
    window = min(FINAL_TRAIN_LOSS_WINDOW, len(losses))
    for i, seconds in enumerate(per_step["step_s"]):
        elapsed += seconds
        if i + 1 >= window and sum(losses[i + 1 - window:i + 1]) / window <= target:
            return elapsed
    return None


def comparison(records: list[dict]) -> dict:
    """The runs side by side; ratios are the first run's (netgain's) over each run's."""
    target = max(r["summary"]["final_train_loss"] for r in records)
    runs = [{"codec": run_label(r["config"]), "out": r["config"]["out"], "step_s": r["summary"]["step_s"],
             "time_to_loss_s": time_to_loss(r["per_step"], target),
             "final_val_loss": r["summary"].get("final_val_loss")} for r in records]
    first = runs[0]
    for run in runs:
        run["step_ratio"] = first["step_s"] / run["step_s"]
        run["time_ratio"] = (first["time_to_loss_s"] / run["time_to_loss_s"]
                             if first["time_to_loss_s"] and run["time_to_loss_s"] else None)
    return {"link": f"emulated {records[0]['config']['emulate_link']}" if records[0]["config"]["emulate_link"]
            else "this machine's own link", "target_train_loss": target, "runs": runs}


def format_comparison(result: dict) -> str:
    first = result["runs"][0]["codec"]
    header = (f"compare on {result['link']}: time to train loss {result['target_train_loss']:.4g} (the highest "
              f"final train loss, mean of the last {FINAL_TRAIN_LOSS_WINDOW} steps); ratios: {first}'s time / the run's")
    rows = [("run", "step s", "time to loss s", "final val loss", "step ratio", "time ratio")]
    for run in result["runs"]:
        rows.append((run["codec"], f"{run['step_s']:.3g}", _number(run["time_to_loss_s"]),
                     _number(run["final_val_loss"]), f"{run['step_ratio']:.2f}", _number(run["time_ratio"], ".2f")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join([header, *("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)])


def report(runs: list[TrainConfig]) -> None:
    """Print the comparison and write it to the main run's --out/compare.json (that folder still the run's)."""
    records = [json.loads((Path(c.out) / "record.json").read_text()) for c in runs]
    result = comparison(records)
    out = Path(runs[0].out)
    require_claimed(out, runs[0].run_id)
    write_atomically(out / COMPARE_FILE, lambda f: f.write(json.dumps(result, indent=1).encode()))
    print(format_comparison(result))
    print(f"wrote {out / COMPARE_FILE}")


def _number(value: float | None, spec: str = ".4g") -> str:
    return "-" if value is None else format(value, spec)
