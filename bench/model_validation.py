"""Validate netgain's network model on the throttled-network lab: communication time and step time.

Why: a model that recommends codecs is only worth its measured error, and a step-time error can
hide a communication error when compute dominates the step. Every (workers, rate, codec) row:
- communication: the row's per-step collectives (for each DDP bucket of the job's model: the
  header allreduce MAX of its scales + 3 floats if the codec has one, then the payload collective
  with the dtype and size the codec's own encode produces, and low rank's later rounds as its relay
  produces them) timed alone on the lab
  (bench/lab_collectives.py), against netgain.cost.network.predict's comm_s for the same buckets;
- step: `netgain train` for a few steps, its median step time against predict from (a) the
  compute-bound limit (no rate limit, no compression) and (b) the row's own compute; and the
  hook's own comm_s in training beside both.

    python bench/model_validation.py --workers 2 --rows /tmp/mv.jsonl   # one quiet window
    python bench/model_validation.py --codecs lowrank:r4:fp32 lowrank:r4:gqsgd:8  # rank 4, fp32 / 8-bit factors
    python bench/model_validation.py --report /tmp/mv.jsonl             # md + csv of all rows
Writes bench/results/model_validation.{md,csv}. Root needed for the lab.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import lab_collectives  # noqa: E402
from lab import list_lab_namespaces, terminate_on_signals  # noqa: E402
from provenance import git_commit, write_csv  # noqa: E402
from runs import SKIP_STEPS, measured, threads_per_worker, train_on_lab  # noqa: E402

from netgain.comm import codec_profile, make_codec  # noqa: E402
from netgain.cost import network as net  # noqa: E402

DEFAULT_CODECS = ("none", "fp16", "gqsgd:8:int8", "gqsgd:8:packed", "gqsgd:4", "topk:0.01")


def parse_codec(spec: str) -> tuple[str, dict]:
    """'gqsgd:8:int8' -> ('gqsgd', {'bits': 8, 'encoding': 'int8'}); 'topk:0.01' -> ratio;
    'lowrank:r4:fp32' -> rank and factors ('lowrank:r4:gqsgd:8': 8-bit factors)."""
    name, *rest = spec.split(":")
    params: dict = {}
    for value in rest:
        if value in ("int8", "packed"):
            params["encoding"] = value
        elif value in ("fp32", "gqsgd"):
            params["factors"] = value
        elif value.startswith("r") and value[1:].isdigit():
            params["rank"] = int(value[1:])
        elif "." in value:
            params["ratio"] = float(value)
        else:
            params["bits"] = int(value)
    if make_codec(name, **params).collective == "ring":
        raise ValueError(f"{spec}: ring codecs (point-to-point hops) are not replayed by lab_collectives")
    return name, params


def model_buckets(train_args: list[str]) -> list[list[tuple[int, ...]]]:
    """Parameter shapes of each DDP bucket of the job's model, buckets in ready order."""
    from netgain import models

    opts = argparse.ArgumentParser(add_help=False)
    opts.add_argument("--hidden-size", type=int, default=192)
    opts.add_argument("--layers", type=int, default=4)
    opts.add_argument("--seq-len", type=int, default=128)
    known, _ = opts.parse_known_args(train_args)
    shapes = [tuple(p.shape) for p in models.byte_llama(known.hidden_size, known.layers, known.seq_len).parameters()]
    ready = shapes[::-1]
    out, at = [], 0
    for _, count in net.ddp_bucket_layout([math.prod(shape) for shape in shapes]):
        out.append(ready[at:at + count])
        at += count
    return out


def step_ops(codec, buckets: list[list[tuple[int, ...]]], n: int) -> list[dict]:
    """The collectives the hook issues in one step: per bucket, its header (max |g| per scale + 3 floats),
    then its payload, then low rank's later rounds (Q's scales, Q), as the codec itself produces them."""
    import torch
    import torch.distributed as dist

    from netgain.comm.calibrate import bucket_layout
    from netgain.comm.codecs import Context

    ops = []
    for shapes in buckets:
        layout, memory = bucket_layout(codec, shapes)
        segments = layout.segments
        ctx = Context.for_step(n, segments, 0, 0, 0, tables=layout.tables, feedback=memory, layout=layout)
        x = torch.randn(segments.numel)
        if codec.needs_header:
            scales = codec.local_scales(x, ctx)
            ops.append({"op": "allreduce_max", "dtype": "float32", "numel": scales.numel() + 3})
            ctx.scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        payload, op = codec.encode(x, ctx), dist.ReduceOp.SUM
        for round_ in range(codec.rounds(ctx)):  # later rounds are allreduces (hooks.py's relay loop)
            kind = "allgather" if codec.collective == "allgather" and not round_ else "allreduce"
            ops.append({"op": "allreduce_max" if op == dist.ReduceOp.MAX else kind,
                        "dtype": str(payload.dtype).removeprefix("torch."), "numel": payload.numel()})
            if round_ < codec.rounds(ctx) - 1:  # a one-rank "sum" has the sizes the next round needs
                payload, op = codec.relay(payload, ctx)
    return ops


def row(n: int, rate: str, profile: net.CodecProfile, buckets: list[list[tuple[int, ...]]], limit: dict, m: dict,
        replay_s: float) -> dict:
    """One validation row: measured beside predicted communication and step time."""
    link = net.preset(net.lab_preset_name(rate))
    numels, tensors = [sum(map(math.prod, b)) for b in buckets], [len(b) for b in buckets]
    alone, p, own = (net.predict(numels, n, link, profile, compute, tensors=tensors, shapes=buckets)
                     for compute in (0.0, limit["compute_s"], m["compute_s"]))
    out = {"workers": n, "rate": rate, "codec": profile.name,
           "measured_comm_s": replay_s, "predicted_comm_s": alone.comm_s,
           "comm_error": (alone.comm_s - replay_s) / replay_s,
           "hook_comm_s": m["comm_s"], "predicted_comm_in_step_s": own.comm_s,
           "measured_step_s": m["step_s"], "predicted_step_s": p.step_s,
           "step_error": (p.step_s - m["step_s"]) / m["step_s"],
           "predicted_step_own_compute_s": own.step_s,
           "step_error_own_compute": (own.step_s - m["step_s"]) / m["step_s"],
           "limit_compute_s": limit["compute_s"], "row_compute_s": m["compute_s"],
           "predicted_codec_s": own.encode_s + own.decode_s,
           "measured_wire_bytes": m["wire_bytes"], "predicted_wire_bytes": own.payload_bytes}
    print(f"  n={n} {rate} {profile.name}: comm alone {replay_s * 1e3:.2f} ms, predicted "
          f"{alone.comm_s * 1e3:.2f} ms ({out['comm_error']:+.1%}); step {m['step_s']:.3f} s, predicted "
          f"{own.step_s:.3f} s ({out['step_error_own_compute']:+.1%}); hook comm {m['comm_s'] * 1e3:.1f} ms",
          flush=True)
    return out


def run_window(args, train_args: list[str]) -> list[dict]:
    codecs = [(spec, *parse_codec(spec)) for spec in args.codecs]
    buckets = model_buckets(train_args)
    rows = []
    for n in args.workers:
        limit = measured(train_on_lab(n, None, "none", {}, args.steps, train_args))
        print(f"n={n}: compute-bound step {limit['step_s']:.3f} s, compute {limit['compute_s']:.3f} s", flush=True)
        made = [make_codec(name, **params) for _, name, params in codecs]
        items = [step_ops(codec, buckets, n) for codec in made]
        largest = max(buckets, key=lambda shapes: sum(map(math.prod, shapes)))
        profiles = [codec_profile(codec, n, "calibrate", threads=threads_per_worker(n), shapes=largest) for codec in made]
        for rate in args.rates:
            replays = lab_collectives.run(n, rate, items, repeats=args.repeats)
            for (spec, name, params), profile, seconds in zip(codecs, profiles, replays):
                m = measured(train_on_lab(n, rate, name, params, args.steps, train_args))
                rows.append(row(n, rate, profile, buckets, limit, m, sum(seconds)))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--rates", nargs="+", default=list(net.LAB_RATES), choices=list(net.LAB_RATES))
    parser.add_argument("--codecs", nargs="+", default=list(DEFAULT_CODECS),
                        help="name[:bits][:int8|packed][:ratio], e.g. gqsgd:8:int8, topk:0.01; low rank: "
                        "lowrank:rRANK:fp32|gqsgd[:bits], e.g. lowrank:r4:gqsgd:8")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=41, help="repeats of each step's collectives alone")
    parser.add_argument("--rows", default=str(HERE / "results" / "model_validation.jsonl"),
                        help="append this window's rows (with its load and command) here")
    parser.add_argument("--report", nargs="+", metavar="ROWS", help="write the report from stored rows")
    parser.add_argument("--out", default=str(HERE / "results" / "model_validation"))
    parser.add_argument("train_args", nargs=argparse.REMAINDER,
                        help="-- extra `netgain train` options (model size, batch size)")
    args = parser.parse_args(argv)
    if args.report:
        write_report([json.loads(line) for path in args.report for line in Path(path).read_text().splitlines()],
                     Path(args.out))
        return 0
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    load_before = os.getloadavg()
    try:
        with terminate_on_signals():
            rows = run_window(args, train_args)
    except KeyboardInterrupt as e:
        print(f"interrupted ({e}); lab torn down", file=sys.stderr)
        return 130
    command = " ".join(["python bench/model_validation.py", "--workers", *map(str, args.workers),
                        "--rates", *args.rates, "--codecs", *args.codecs, "--steps", str(args.steps),
                        "--repeats", str(args.repeats), *(["--", *train_args] if train_args else [])])
    layout = model_buckets(train_args)
    window = {"commit": git_commit(), "command": command, "load_1min_before": load_before[0],
              "load_1min_after": os.getloadavg()[0], "steps": args.steps, "repeats": args.repeats,
              "params": sum(math.prod(shape) for bucket in layout for shape in bucket), "buckets": len(layout)}
    with open(args.rows, "a") as f:
        for r in rows:
            f.write(json.dumps({**r, **window}) + "\n")
    return 0


def _worst(rows: list[dict], key: str, k: int = 3) -> str:
    return "; ".join(f"{r['workers']} workers {r['rate']} {r['codec']} {r[key]:+.1%}"
                     for r in sorted(rows, key=lambda r: -abs(r[key]))[:k])


def write_report(rows: list[dict], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    write_csv(out.with_suffix(".csv"), rows)
    windows = list({(r["command"], r["commit"], r["load_1min_before"], r["load_1min_after"]): None for r in rows})
    median = {key: statistics.median(abs(r[key]) for r in rows)
              for key in ("comm_error", "step_error", "step_error_own_compute")}
    at_1g = [r for r in rows if r["rate"] == "1gbit"]
    lines = [
        "# Network model vs the throttled-network lab: communication and step time", "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores shared by all lab workers, no GPU. "
        f"Job: default `netgain train` lm model ({rows[0]['params']:,} parameters, {rows[0]['buckets']} DDP "
        f"buckets), {rows[0]['steps']} steps per training run, medians over steps {SKIP_STEPS}.."
        f"{rows[0]['steps'] - 1}.",
        "Windows (each on a quiet machine, 1-minute load average before / after):",
        *(f"- `{command}` at commit {commit}: load {before:.2f} / {after:.2f}"
          for command, commit, before, after in windows),
        "",
        "**Measured communication** is the row's per-step collectives timed alone on the same lab "
        "(bench/lab_collectives.py): for each DDP bucket, in ready order, the hook's header "
        "(allreduce MAX of its S scales + 3 float32, S = parameters in the bucket; for low rank's 8-bit "
        "factors, P's columns: rank per compressed matrix and one per other parameter; codecs with a header only) then the payload collective with the dtype and "
        "element count that the codec's own encode returns (low rank: P's, then, for 8-bit factors, a "
        "MAX of Q's column scales, then Q's, as its own relay returns them); every repeat starts after a barrier and a pause that refills the token bucket, as "
        f"a step's compute does; mean over {rows[0]['repeats']} repeats and over ranks (a small "
        "collective on this machine takes either about 0.4 ms or 3-5 ms, with or without the shaper: "
        "the mean is what steps pay). This "
        "is what the model's comm_s predicts: time on the wire with nothing else running. "
        "**Predicted communication**: netgain.cost.network.predict(..., compute_s=0).comm_s on the "
        "lab preset (fitted to bench/results/lab_collectives.md, not to these rows) with the real "
        "header size. The hook's comm_s inside training (header + payload, launch to completion on "
        "rank 0) is shown beside it: it also holds the wait for the slower rank and the CPU the "
        "backward takes from gloo's threads on this 2-core machine, which no network model covers.",
        "**Step**: predicted from (a) the compute-bound limit (no rate limit, no compression), measured "
        "once per window, (b) the row's own compute (its step minus the hook's wait for the network). "
        "Limit compute against the rows' median own compute: " + "; ".join(
            f"{n} workers {limit:.3f} s / {statistics.median(r['row_compute_s'] for r in rows if r['workers'] == n):.3f} s"
            for n, limit in {r["workers"]: r["limit_compute_s"] for r in rows}.items())
        + " (where they differ, the machine's speed moved between the limit run and the rows, and (a) "
        "shows that, not the network model).",
        "",
        "| workers | rate | codec | measured comm ms | predicted comm ms | comm error | hook comm in training ms "
        "(predicted) | measured step s | predicted (a) s | error (a) | predicted (b) s | error (b) "
        "| wire bytes measured / predicted |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workers']} | {r['rate']} | {r['codec']} | {r['measured_comm_s'] * 1e3:.2f} | "
            f"{r['predicted_comm_s'] * 1e3:.2f} | {r['comm_error']:+.1%} | {r['hook_comm_s'] * 1e3:.1f} "
            f"({r['predicted_comm_in_step_s'] * 1e3:.1f}) | "
            f"{r['measured_step_s']:.3f} | {r['predicted_step_s']:.3f} | {r['step_error']:+.1%} | "
            f"{r['predicted_step_own_compute_s']:.3f} | {r['step_error_own_compute']:+.1%} | "
            f"{r['measured_wire_bytes']:,.0f} / {r['predicted_wire_bytes']:,.0f} |")
    lines += [
        "",
        f"Median |predicted - measured| / measured over {len(rows)} rows: communication "
        f"**{median['comm_error']:.1%}** (at 1 Gbit/s alone: "
        f"{statistics.median(abs(r['comm_error']) for r in at_1g):.1%} over {len(at_1g)} rows); "
        f"step {median['step_error']:.1%} from the limit (a), {median['step_error_own_compute']:.1%} "
        "from each row's own compute (b).",
        f"Worst rows, communication: {_worst(rows, 'comm_error')}.",
        "In training, the hook's comm_s was a median "
        f"{statistics.median(r['hook_comm_s'] / r['measured_comm_s'] for r in rows):.1f}x the same collectives "
        f"alone ({statistics.median(r['hook_comm_s'] / r['measured_comm_s'] for r in at_1g):.1f}x at 1 Gbit/s): "
        "rank skew and CPU contention, not the wire.",
        f"Worst rows, step (b): {_worst(rows, 'step_error_own_compute')}.",
        f"Worst rows, step (a): {_worst(rows, 'step_error')}.",
        f"Lab namespaces left (`ip netns list`): {len(list_lab_namespaces())}.", ""]
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
