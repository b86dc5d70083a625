"""Rank 0's report of a finished run: the summary table, record.json and the plots."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import netgain.comm as comm
from netgain import models
from netgain.comm import bandwidth
from netgain.comm.emulate import emulated_link
from netgain.cost import network as net
from netgain.files import require_claimed, write_atomically
from netgain.train.config import TrainConfig
from netgain.train.tasks import FP32_BYTES

COMPARE_FILE = "compare.json"  # --compare's, in the main run's --out
OUTPUT_FILES = ("record.json", "loss.png", "adaptive.png", COMPARE_FILE)  # what a run writes under --out
LINK_FIT_SAMPLES = 256  # the link is fitted to the run's last 256 bucket collectives (as Kimad's monitor keeps)
TIMED_ROWS = ("samples_per_s", "step_s", "compute_s", "comm_wait_s", "predicted_fp32_step_s", "link_bandwidth_Bps",
              "link_overhead_s")  # the summary's rows that a link's speed sets
FINAL_TRAIN_LOSS_WINDOW = 10  # final train loss = mean over the last 10 steps (one step is noise)


def report(config: TrainConfig, world_size: int, history: dict, validations: list[dict],
           device: torch.device, model: nn.Module, resumed: dict | None) -> None:
    """Summary table on stdout, record.json and loss.png under --out (made and claimed by prepare_outputs;
    each file written whole or not at all)."""
    summary = summarize(config, world_size, history, validations, model)
    out = Path(config.out)
    require_claimed(out, config.run_id)
    record = {"config": asdict(config), "resumed": resumed, "summary": summary, "per_step": history,
              "validation": validations, "git": git_state(), "host": host_info(device, world_size)}
    write_atomically(out / "record.json", lambda f: f.write(json.dumps(record, indent=1).encode()))
    plot_losses(history, validations, out / "loss.png",
                f"{config.task}, codec {config.codec}" + (f", fsdp {config.replicas}x{config.shards}" if config.fsdp else "")
                + (f", sync every {config.sync_period} steps" if config.sync else ""))
    written = [out / "record.json", out / "loss.png"]
    if config.codec in comm.ADAPTIVE_MODES:
        plot_adaptive(history, out / "adaptive.png", f"{config.codec}, {world_size} workers")
        written.append(out / "adaptive.png")
    print(format_table(summary))
    print("wrote " + ", ".join(map(str, written)))


def summarize(config: TrainConfig, world_size: int, history: dict, validations: list[dict],
              model: nn.Module) -> dict:
    """Means over the steady steps of this run: after the first (which also builds DDP's buckets), and
    without the steps in which a codec kernel compiled (its codecs ran eagerly while torch.compile worked in
    the background, or waited for it); and fp32's step
    time on this run's link as netgain's cost model predicts it from the measured compute. Under
    --emulate-link that link has the emulated rate (and the per-bucket overhead fitted to the run).
    Under --sync the bytes are per step over every step (a sync's land on one step in H), fp32's are
    what fp32 DDP sends every step, and fp32's step is not predicted: no bucket is timed every step."""
    steps = len(history["step_s"])
    timed = [i for i in range(1, steps) if not history["compiled"][i]] or list(range(steps))
    step_s, wait_s = (_mean([history[key][i] for i in timed]) for key in ("step_s", "wait_s"))
    if config.sync:
        wire, raw = _mean(history["wire_bytes"]), FP32_BYTES * models.parameter_count(model)
    else:
        wire, raw = (_mean([history[key][i] for i in timed]) for key in ("wire_bytes", "raw_bytes"))
    hop_size = config.replicas if config.fsdp else world_size  # the ranks the codec's collectives span
    link = fit_link([history["buckets"][i] for i in timed], hop_size)
    emulated = emulated_link(config.emulate_link) if config.emulate_link else None
    if emulated and link:
        link = dataclasses.replace(emulated, overhead=link.overhead)
    layout = next((buckets for buckets in reversed(history["buckets"]) if buckets), [])  # a local step times none
    fp32_step_s = (net.predict([b["numel"] for b in layout], hop_size, link,
                               compute_s=step_s - wait_s).step_s if link else None)
    final = validations[-1]
    summary = {
        "task": config.task,
        "codec": config.codec,
        "route": config.route(),
        "world_size": world_size,
        **({"fsdp_mesh": f"{config.replicas} replicas x {config.shards} shards"} if config.fsdp else {}),
        **({"emulated_link": config.emulate_link, "emulated_link_Bps": emulated.bandwidth} if emulated else {}),
        "parameters": models.parameter_count(model),
        "steps": history["step"][-1] + 1,
        "samples_per_s": config.batch_size * world_size / step_s,
        "step_s": step_s,
        "compute_s": step_s - wait_s,
        "comm_wait_s": wait_s,
        "wire_bytes_per_step": wire,
        "fp32_bytes_per_step": raw,
        "compression_ratio": raw / wire if wire else None,  # None: nothing sent (one worker)
        "predicted_fp32_step_s": fp32_step_s,
        "link_bandwidth_Bps": link.bandwidth if link else None,
        "link_overhead_s": link.overhead if link else None,
        "final_train_loss": _mean(history["train_loss"][-FINAL_TRAIN_LOSS_WINDOW:]),
        **{f"final_{key}": value for key, value in final.items() if key != "step"},
    }
    summary["versus_fp32"] = versus_fp32(summary, hop_size, config.fsdp, config.sync)
    return summary


def fit_link(steps: list[list[dict]], world_size: int) -> net.Link | None:
    """This run's link for netgain's cost model, fitted to the run's own bucket collectives with Kimad's
    fit (bandwidth.fit): seconds = overhead + bytes sent / bandwidth, one overhead per bucket (its
    header's included). None when nothing was timed: 1 worker, or PyTorch's hooks (ddp*). Rank 0's own
    times, waits for slower ranks included (Kimad's planner fits each collective's least time across ranks)."""
    samples = [(bandwidth.WIRE_FACTOR[_collective(b["codec"])](world_size) * b["wire_bytes"], b["comm_s"])
               for buckets in steps for b in buckets if b["wire_bytes"]]
    if not samples:
        return None
    overhead, seconds_per_byte, _ = bandwidth.fit(samples[-LINK_FIT_SAMPLES:])
    return net.Link("this run", bandwidth.rate(seconds_per_byte), 0.0, "fitted to the run's collectives", overhead=overhead,
                    algorithm="ring")


def _collective(codec: str) -> str:
    """The collective of a codec as the hook describes it: 'gqsgd(bits=8,encoding=packed)' -> 'allreduce'."""
    return comm.make_codec(codec.split("(")[0].strip()).collective


def versus_fp32(summary: dict, hop_size: int, fsdp: bool, sync: bool = False) -> list[str]:
    """The run against fp32 in words: wire bytes per step, and the measured step beside fp32's predicted one."""
    if hop_size == 1:
        return [f"no communication ({'1 replica' if fsdp else '1 worker'}): nothing for a codec to compress, "
                "fp32 included"]
    wire, fp32 = summary["wire_bytes_per_step"], summary["fp32_bytes_per_step"]
    # nothing sent: every step local (the route's, on trial or chosen) with no average applied
    saved = "none sent" if not wire else f"{fp32 / wire:.1f}x fewer" if wire < fp32 else "no fewer"
    emulated = summary.get("emulated_link")
    on = f" on emulated {emulated}" if emulated else ""
    step = f"step {summary['step_s']:.3g} s measured{on}"
    if summary["predicted_fp32_step_s"] is None:
        predicted = ("fp32 not predicted (" + ("--sync has no per-step collective" if sync else
                                               "PyTorch's hooks time no collective") + ": no link to fit)")
    else:
        rate = bandwidth.in_words(summary["link_bandwidth_Bps"], "Mbit/s" if emulated else "MB/s")
        predicted = (f"fp32 {summary['predicted_fp32_step_s']:.3g} s predicted{on or ' on this link'} ("
                     + (f"{rate}; " if emulated else f"{rate}, ")
                     + f"{summary['link_overhead_s'] * 1e6:,.0f} us per bucket, fitted to the run's collectives)")
    return [f"wire {wire / 1e6:.3g} MB/step vs {fp32 / 1e6:.3g} MB fp32: {saved}", f"{step}; {predicted}"]


def format_table(summary: dict) -> str:
    """The summary's numbers as a table, its versus_fp32 lines under it; under --emulate-link each time and
    link row says so."""
    label = f" (emulated {summary['emulated_link']})" if "emulated_link" in summary else ""
    rows = [(key, _format(value) + (label if key in TIMED_ROWS else ""))
            for key, value in summary.items() if key != "versus_fp32"]
    width = max(len(key) for key, _ in rows)
    rule = "-" * (width + 2 + max(len(value) for _, value in rows))
    return "\n".join([rule, *(f"{key:<{width}}  {value}" for key, value in rows), rule, *summary["versus_fp32"]])


def plot_losses(history: dict, validations: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([s + 1 for s in history["step"]], history["train_loss"], label="train (mean over workers)", lw=1)
    ax.plot([v["step"] for v in validations], [v["val_loss"] for v in validations], "o-", label="validation")
    ax.set(xlabel="step", ylabel="loss", title=title)
    ax.legend()
    _save(fig, path)


def plot_adaptive(history: dict, path: Path, title: str) -> None:
    """Kimad over the run: bandwidth estimate, bits chosen per bucket, communication vs budget, loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s + 1 for s in history["step"]]
    fig, axes = plt.subplots(4, 1, figsize=(7, 9), sharex=True)
    mbit = [b * 8e-6 if b else float("nan") for b in history["bandwidth_Bps"]]
    axes[0].plot(steps, mbit)
    axes[0].set(ylabel="bandwidth\nestimate (Mbit/s)", title=title)
    plans = [plan if isinstance(plan, dict) else {} for plan in history["plan"]]  # "local": the route's local steps
    buckets = sorted({int(i) for plan in plans for i in plan})
    for index in buckets:
        bits = [_plan_bits(plan.get(index, plan.get(str(index)))) for plan in plans]
        axes[1].step(steps, bits, where="post", label=f"bucket {index}")
    axes[1].set(ylabel="bits per element\nchosen")
    axes[1].legend(fontsize=7)
    communication = [c + e + d for c, e, d in zip(history["comm_s"], history["encode_s"], history["decode_s"])]
    axes[2].plot(steps, [1e3 * t for t in communication], label="rank 0's communication (its waits included)")
    link = history.get("link_comm_s", [])
    if len(link) == len(steps):  # a history resumed from an older record has none
        axes[2].plot(steps, [1e3 * t if t is not None else float("nan") for t in link], label="link time (what the budget counts)")
    axes[2].plot(steps, [1e3 * b if b else float("nan") for b in history["budget_s"]], "--", label="budget")
    axes[2].set(ylabel="ms per step")
    axes[2].legend(fontsize=7)
    axes[3].plot(steps, history["train_loss"])
    axes[3].set(xlabel="step", ylabel="train loss")
    _save(fig, path)


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    try:
        fig.tight_layout()
        write_atomically(path, lambda f: fig.savefig(f, format="png", dpi=100))
    finally:
        plt.close(fig)


def _plan_bits(codec: str | None) -> float:
    """Payload bits per element of a planned codec, read from its name (32 for none)."""
    if codec is None:
        return float("nan")
    if codec.startswith("gqsgd"):
        return float(codec.split("bits=")[1].split(",")[0])
    if codec.startswith("topk"):
        return 64 * float(codec.split("ratio=")[1].rstrip(")"))
    return 32.0


def git_state() -> dict:
    here = Path(__file__).parents[1]  # src/netgain: "dirty" means any change to the package
    try:
        commit = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--", "."],
                                    capture_output=True, text=True, check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": dirty}


def host_info(device: torch.device, world_size: int) -> dict:
    return {"hostname": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "backend": dist.get_backend(), "world_size": world_size}


def _format(value) -> str:
    if isinstance(value, float):
        if abs(value) >= 100:
            return f"{value:,.0f}" if value.is_integer() else f"{value:,.1f}"
        return f"{value:.4g}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
