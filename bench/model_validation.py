"""Validate netgain's network model against `netgain train` on the throttled-network lab.

Why: a model that recommends codecs is only worth its measured error. For every world size the
compute-bound limit is measured first (no rate limit, no compression: median per-step time minus
the hook's wait for the network); then each (rate, codec) row trains a few steps on the lab and
its median step time is compared with netgain.cost.network.predict for the same model buckets,
world size, link (the lab preset: tbf rate x TCP payload share, 100 us per message) and codec
(encode/decode timed on this machine).

    python bench/model_validation.py                         # default grid, about 10 minutes
    python bench/model_validation.py --workers 2 --rates 100mbit --codecs none gqsgd:8:int8
Writes bench/results/model_validation.{md,csv} (root needed for the lab).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from lab import list_lab_namespaces, terminate_on_signals  # noqa: E402
from runs import SKIP_STEPS, measured, threads_per_worker, train_on_lab  # noqa: E402

from netgain.comm.codecs import codec_profile, make_codec  # noqa: E402
from netgain.cost import network as net  # noqa: E402
from provenance import git_commit, write_csv  # noqa: E402

PRESET_OF_RATE = {"100mbit": "lab-100mbit", "1gbit": "lab-1gbit"}
DEFAULT_CODECS = ("none", "fp16", "gqsgd:8:int8", "gqsgd:8:packed", "qsgd:8", "gqsgd-exp:8")


def parse_codec(spec: str) -> tuple[str, dict]:
    """'gqsgd:8:int8' -> ('gqsgd', {'bits': 8, 'encoding': 'int8'}); 'topk:0.01' -> ratio."""
    name, *rest = spec.split(":")
    params: dict = {}
    for value in rest:
        if value in ("int8", "packed"):
            params["encoding"] = value
        elif "." in value:
            params["ratio"] = float(value)
        else:
            params["bits"] = int(value)
    make_codec(name, **params)  # validates
    return name, params


def model_buckets(train_args: list[str]) -> list[int]:
    """The DDP buckets of the job's model (the default `netgain train` lm model unless overridden)."""
    from netgain import models

    opts = argparse.ArgumentParser(add_help=False)
    opts.add_argument("--hidden-size", type=int, default=192)
    opts.add_argument("--layers", type=int, default=4)
    opts.add_argument("--seq-len", type=int, default=128)
    known, _ = opts.parse_known_args(train_args)
    model = models.byte_llama(known.hidden_size, known.layers, known.seq_len)
    return net.ddp_buckets([p.numel() for p in model.parameters()])


def compare(n: int, rate: str, profile: net.CodecProfile, buckets: list[int], limit: dict,
            m: dict) -> dict:
    """One validation row: the measurement beside predictions from the limit and own compute."""
    link = net.preset(PRESET_OF_RATE[rate])
    p = net.predict(buckets, n, link, profile, limit["compute_s"])
    own = net.predict(buckets, n, link, profile, m["compute_s"])
    row = {"workers": n, "rate": rate, "codec": profile.name,
           "limit_compute_s": limit["compute_s"], "row_compute_s": m["compute_s"],
           "measured_step_s": m["step_s"], "predicted_step_s": p.step_s,
           "error": (p.step_s - m["step_s"]) / m["step_s"],
           "predicted_step_own_compute_s": own.step_s,
           "error_own_compute": (own.step_s - m["step_s"]) / m["step_s"],
           "measured_comm_s": m["comm_s"], "predicted_comm_s": p.comm_s,
           "predicted_codec_s": p.encode_s + p.decode_s,
           "measured_wire_bytes": m["wire_bytes"], "predicted_wire_bytes": p.payload_bytes}
    print(f"  {rate} {profile.name}: measured {m['step_s']:.3f} s, predicted {p.step_s:.3f} s "
          f"({row['error']:+.1%}), from its own compute {own.step_s:.3f} s "
          f"({row['error_own_compute']:+.1%})", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--rates", nargs="+", default=list(PRESET_OF_RATE), choices=list(PRESET_OF_RATE))
    parser.add_argument("--codecs", nargs="+", default=list(DEFAULT_CODECS),
                        help="name[:bits][:int8|packed][:ratio], e.g. gqsgd:8:int8, topk:0.01")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--limit-every", choices=("codec", "world"), default="codec",
                        help="measure the compute-bound limit again before every codec (default; "
                        "follows load changes on a shared machine) or once per world size")
    parser.add_argument("--out", default=str(HERE / "results" / "model_validation"))
    parser.add_argument("train_args", nargs=argparse.REMAINDER,
                        help="-- extra `netgain train` options (model size, batch size)")
    args = parser.parse_args(argv)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    codecs = [parse_codec(spec) for spec in args.codecs]
    buckets = model_buckets(train_args)

    rows = []
    load_before = os.getloadavg()[1]
    try:
        with terminate_on_signals():
            for n in args.workers:
                limit = None
                for name, params in codecs:
                    if limit is None or args.limit_every == "codec":
                        limit = measured(train_on_lab(n, None, "none", {}, args.steps, train_args))
                        print(f"n={n}: compute-bound step {limit['step_s']:.3f} s, "
                              f"compute {limit['compute_s']:.3f} s", flush=True)
                    profile = codec_profile(make_codec(name, **params), n, "calibrate",
                                                calibration_numel=max(buckets),
                                                threads=threads_per_worker(n))
                    for rate in args.rates:
                        m = measured(train_on_lab(n, rate, name, params, args.steps, train_args))
                        rows.append(compare(n, rate, profile, buckets, limit, m))
    except KeyboardInterrupt as e:
        print(f"interrupted ({e}); lab torn down", file=sys.stderr)
        return 130
    load = (load_before, os.getloadavg()[1])
    write_results(rows, args, train_args, len(buckets), sum(buckets), load)
    return 0


def write_results(rows: list[dict], args, train_args: list[str], n_buckets: int, params: int,
                  load: tuple[float, float]) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_csv(out.with_suffix(".csv"), rows)
    errors = sorted(rows, key=lambda r: -abs(r["error"]))
    median = statistics.median(abs(r["error"]) for r in rows)
    commit = git_commit()
    command = " ".join(["python bench/model_validation.py", "--workers", *map(str, args.workers),
                        "--rates", *args.rates, "--codecs", *args.codecs, "--steps", str(args.steps),
                        "--limit-every", args.limit_every,
                        *(["--", *train_args] if train_args else [])])
    lines = [
        "# Network model vs `netgain train` on the throttled-network lab",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores shared by all workers (and by other "
        f"jobs: 5-minute load average {load[0]:.1f} at the start, {load[1]:.1f} at the end), "
        f"no GPU; commit {commit}.",
        f"Command: `{command}`",
        f"Job: default `netgain train` lm model ({params:,} parameters, {n_buckets} DDP buckets), "
        f"{args.steps} steps, medians over steps {SKIP_STEPS}..{args.steps - 1}.",
        "Prediction: netgain.cost.network.predict with the lab presets and codec encode/decode "
        f"timed on this machine, from (a) the compute-bound limit measured once per "
        f"{args.limit_every if args.limit_every == 'codec' else 'world size'} (no rate limit, no "
        "compression: step minus the hook's network wait), independent of the row; (b) the row's own compute (its step minus its network wait), which isolates "
        "the network part of the model from load changes on the shared machine.",
        "",
        "| workers | rate | codec | measured step s | predicted (a) s | error (a) | predicted (b) s "
        "| error (b) | compute (a) / (b) s | measured comm s | predicted comm s | predicted codec s "
        "| wire bytes measured / predicted |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workers']} | {r['rate']} | {r['codec']} | {r['measured_step_s']:.3f} | "
            f"{r['predicted_step_s']:.3f} | {r['error']:+.1%} | "
            f"{r['predicted_step_own_compute_s']:.3f} | {r['error_own_compute']:+.1%} | "
            f"{r['limit_compute_s']:.3f} / {r['row_compute_s']:.3f} | {r['measured_comm_s']:.3f} | "
            f"{r['predicted_comm_s']:.3f} | {r['predicted_codec_s']:.3f} | "
            f"{r['measured_wire_bytes']:,.0f} / {r['predicted_wire_bytes']:,.0f} |")
    median_own = statistics.median(abs(r["error_own_compute"]) for r in rows)
    worst_own = sorted(rows, key=lambda r: -abs(r["error_own_compute"]))
    lines += ["", f"Median |predicted - measured| / measured over {len(rows)} rows: "
                  f"**{median:.1%}** from the compute-bound limit (a), **{median_own:.1%}** from "
                  "each row's own compute (b).",
              "Worst rows (b): " + "; ".join(f"{r['workers']} workers {r['rate']} {r['codec']} "
                                             f"{r['error_own_compute']:+.1%}" for r in worst_own[:3]) + ".",
              "Worst rows (a): " + "; ".join(f"{r['workers']} workers {r['rate']} {r['codec']} "
                                         f"{r['error']:+.1%}" for r in errors[:3]) + ".",
              f"Lab namespaces left (`ip netns list`): {len(list_lab_namespaces())}.", ""]
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
