"""Time to a target validation loss for HSDP on the two-node lab: FSDP2's own HSDP against netgain on the slow hop.

Why: compressing hybrid sharding's cross-node all-reduce (netgain.comm.fsdp) must get a real model to
a given loss sooner, not only make a step faster. The job: netgain's byte-level Llama (`--layers`
decoder layers) on the Python standard library's source (`netgain train`'s corpus, every 10th file
held out), AdamW; each decoder layer and the root one FSDP2 group. 4 processes, 2 "nodes" x 2
workers, mesh (replicate, shard) = (2, 2): rank = 2 * node + worker, so the shard groups {0, 1},
{2, 3} stay inside a node and the replicate groups {0, 2}, {1, 3} cross the link.

The lab (lab.py) puts every worker in its own namespace on one bridge. Here node B's workers move to
a second bridge, joined to the first by one veth pair with a tbf on both ends: only inter-node
traffic is shaped, and both cross-node pairs share the one link, as on real nodes.

Contestants: native-fp32 and native-bf16 are FSDP2's own HSDP (fully_shard over the 2-D mesh), the
latter with MixedPrecisionPolicy(reduce_dtype=bfloat16), so its reduce-scatter and cross-node
all-reduce run in bf16. The others shard over mesh["shard"] and send the cross-node all-reduce
through netgain.comm.fsdp.register with the codec of bench/time_to_accuracy.py's contestant of the
same name; one that `register` refuses (a codec a given netgain version does not run under FSDP) is skipped
with a note. The sync-* contestants (netgain.sync, DiLoCo across the nodes) shard over mesh["shard"]
too, with no cross-node all-reduce in the step: each node steps alone, and netgain.sync averages each
rank's local shards with the other node's every `period` steps over mesh["replicate"]. auto-sync is auto
offered that route (netgain.sync.offer on netgain.comm.fsdp's state).

The race is bench/time_to_accuracy.py's with --seed-per-round: round r trains from seed + r (initial
model and batches); native-fp32 runs first for T (`--target-step`) steps, and its validation loss
at step T is the round's target (with `--targets`, given, and native-fp32 races last). Then each
contestant in turn trains the round's model until a validation reaches the target, at most
`--cap` x T steps, and at least `--budget` steps (default T), so that every contestant's
validation loss after the same number of steps is reported too. Time to target: the step times
(validations excluded) up to the crossing, interpolated between validations. A contestant whose
steady step is over `--leave-above` x the best so far leaves the race. The workers start once per
rate; every contestant trains `--warmup` throwaway steps first.

    python bench/fsdp_lab.py --rates 50mbit 100mbit                          # root: the grid
    python bench/fsdp_lab.py --rates 1gbit --rounds 1 --target-step 10 --out /tmp/fsdp_smoke

Writes OUT.md, OUT.csv, OUT.json and OUT.png (OUT defaults to bench/results/fsdp_lab_tta);
`--report-from OUT.json` rewrites the others from a finished run.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import time_to_accuracy as tta  # noqa: E402
from hook_lab import add_ratios, cpu_name, format_ratio, per_contestant  # noqa: E402

NODES, PER_NODE = 2, 2
BASELINE = "native-fp32"  # sets each round's target
# label -> ("native", FSDP's reduce dtype) or time_to_accuracy's ("netgain", codec, options)
NETGAIN = {label: spec for label, spec in tta.CONTESTANTS.items() if spec and spec[0] in ("netgain", "sync", "route")}
# <label>-held: the same codec with register(..., overlap=False), every group's average holding the backward
HELD = ("gqsgd-8", "lowrank-r4-fp32", "lowrank-r4-gqsgd8", "auto")
CONTESTANTS = {BASELINE: ("native", "float32"), "native-bf16": ("native", "bfloat16"), **NETGAIN,
               **{f"{label}-held": (*NETGAIN[label][:2], {**NETGAIN[label][2], "overlap": False}) for label in HELD}}
DEFAULT_CONTESTANTS = [BASELINE, "native-bf16", "gqsgd-8", "lowrank-r4-fp32", "lowrank-r4-gqsgd8", "auto"]
PEERS = ((BASELINE, "x_fp32"), ("native-bf16", "x_bf16"))  # ratio columns: the peer's time to target / the contestant's
PEER_TITLES = {"x_fp32": "x native fp32", "x_bf16": "x native bf16"}
TRACE_STEPS = 3  # --trace-from: the steps of round 0 whose timelines each netgain contestant records


class Refused(Exception):
    """netgain.comm.fsdp.register refused the contestant's codec (one this netgain does not run under FSDP)."""


# ---------------------------------------------------------------- one worker (inside the lab)


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import netgain.comm.fsdp as fsdp
    import netgain.sync
    from netgain import data, models

    torch.set_num_threads(1)  # 4 workers on this machine's cores
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (NODES, PER_NODE), mesh_dim_names=(fsdp.REPLICATE, fsdp.SHARD))
    corpus = data.ByteCorpus.from_files(data.stdlib_source_files())
    validation = corpus.validation_batches(args.eval_batches, args.eval_batch_size, args.seq_len)[rank::world]

    def build(label: str, seed: int):
        """The round's initial model, sharded as the contestant runs HSDP; (model, netgain.comm.fsdp's state or None)."""
        torch.manual_seed(seed)
        model = models.byte_llama(args.hidden, args.layers, args.seq_len)
        spec = CONTESTANTS[label]
        native = spec[0] == "native"
        shard = ({"mesh": mesh, "mp_policy": MixedPrecisionPolicy(reduce_dtype=getattr(torch, spec[1]))} if native
                 else {"mesh": mesh[fsdp.SHARD]})
        for layer in model.model.layers:
            fully_shard(layer, **shard)
        fully_shard(model, **shard)
        if spec[0] not in ("netgain", "route"):
            return model, None
        codec, options = ("auto", {}) if spec[0] == "route" else spec[1:]  # auto-sync: auto, offered the route in train
        try:
            return model, fsdp.register(model, mesh, codec, **options)
        except ValueError as error:
            raise Refused(str(error)) from error

    def validate(model) -> float:
        """Each rank an equal share of the batches: FSDP's forward is collective."""
        return tta.validation_loss(model, validation)

    best_steady = [math.inf]  # the fastest steady step so far at this rate, agreed by every rank

    def train(label: str, steps: int, seed: int, target: float | None = None, evaluate: bool = True,
              may_leave: bool = False, traced: range = range(0)) -> dict:
        """Up to `steps` steps of a fresh model, stopping at the first validation <= target once past --budget steps;
        the `traced` steps' timelines (`timeline`) in its "trace"."""
        began = time.perf_counter()
        model, state = build(label, seed)
        spans, trace = [], []  # (group, start, end) of the hook's calls; the traced steps' timelines
        if state is not None and traced:
            reduce = state.reduce  # FSDP calls state.reduce, looked up at each call

            def timed(index, flat):
                start = time.perf_counter()
                try:
                    reduce(index, flat)
                finally:
                    spans.append((index, start, time.perf_counter()))
            state.reduce = timed
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        local = CONTESTANTS[label][0] == "sync"  # its outer steps sync the nodes: it steps the optimizer
        outer = (netgain.sync.wrap(model, optimizer, process_group=mesh[fsdp.REPLICATE].get_group(), **CONTESTANTS[label][1])
                 if local else None)
        synced = 0
        # auto-sync: auto offered the route of local steps, whose statistics it reports (its hook's while per-step)
        route = netgain.sync.offer(state, model, optimizer) if CONTESTANTS[label][0] == "route" else None
        stats = route or state
        # native HSDP all-reduces this rank's reduce-scattered shard across the nodes, in its reduce dtype
        native_wire = None if state is not None or local else (getattr(torch, CONTESTANTS[label][1]).itemsize
                                                               * sum(p.to_local().numel() for p in model.parameters()))
        train_s, eval_s, wire, held, plans, step_times, steady, left = 0.0, 0.0, [], [], [], [], None, False
        curve = [(0, 0.0, validate(model))] if evaluate else []  # (step, train seconds, validation loss)
        for step in range(steps):
            ids = corpus.train_batch(seed, step, rank, world, args.batch_size, args.seq_len)
            dist.barrier()
            spans.clear()
            start = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            forward_end = time.perf_counter()
            loss.backward()
            backward_end = time.perf_counter()
            (outer or optimizer).step()
            step_times.append(time.perf_counter() - start)
            if step in traced and state is not None:
                trace.append(timeline(step, start, forward_end, backward_end, spans, stats.last_step))
            train_s += step_times[-1]
            optimizer.zero_grad(set_to_none=True)
            if local:  # the syncs completed since the last step
                sent, synced = tta.synced_bytes(outer.comm.history, synced)
                wire.append(sent)
            else:
                wire.append(native_wire if state is None else stats.last_step["wire_bytes"])
            held.append(None if state is None else stats.last_step.get("held_s", 0.0))  # none in a local step
            plan = None if state is None else [str(stats.last_step.get("plan")), bool(stats.last_step.get("trying"))]
            if plan is not None and state.planner is not None and (not plans or plans[-1][1:] != plan):
                plans.append([step, *plan])  # auto/kimad: this rank's shard position's plan by step, and whether on trial
            if evaluate and (step + 1) % args.eval_every == 0:
                start = time.perf_counter()
                curve.append((step + 1, train_s, validate(model)))
                eval_s += time.perf_counter() - start
                if target is not None and curve[-1][2] <= target and step + 1 >= args.budget:
                    break
            if len(step_times) == tta.FIRST_STEPS + 1:
                # both agreed: under auto-sync each shard position takes the route or not for itself, so ranks read
                # `alone` apart, set different bars, and one left the race while the others waited for it (a hang)
                agreed = torch.tensor([*tta.steady_step(step_times, local, plans)], dtype=torch.float64)
                dist.all_reduce(agreed, dist.ReduceOp.MAX)
                steady, alone = agreed[0].item(), bool(agreed[1].item())
                left = may_leave and steady > args.leave_above * best_steady[0]
                if not alone:
                    best_steady[0] = min(best_steady[0], steady)
                if left:
                    break
        if stats is not None:
            stats.close()  # the route closes the hook's state
        if outer is not None:
            outer.close()
        return {"label": label, "workers": world, "numel": sum(p.numel() for p in model.parameters()),
                "curve": curve, "steps": len(wire), "step_times": step_times, "step_wire_bytes": wire, "step_held_s": held,
                "plans": plans, "trace": trace,
                "steady_step_s": steady, "left_race": left, "train_s": train_s, "eval_s": eval_s,
                "wall_s": time.perf_counter() - began, "wire_bytes": statistics.mean(wire),
                "samples_s": len(wire) * args.batch_size * world / train_s}

    skipped, racing = {}, []
    for label in args.contestants:  # compile, first allocations: untimed, discarded
        try:
            train(label, args.warmup, args.seed, evaluate=False)
            racing.append(label)
        except Refused as error:
            skipped[label] = str(error)
            if rank == 0:
                print(f"skipping {label}: netgain.comm.fsdp.register refused it: {error}", flush=True)
    rows, target = [], None
    for round_ in range(args.rounds):
        seed = args.seed + round_
        for label in racing:
            traced = range(args.trace_from, args.trace_from + TRACE_STEPS) if args.trace_from and round_ == 0 else range(0)
            if args.targets:
                target = args.targets[min(round_, len(args.targets) - 1)]
                row = train(label, args.cap * args.target_step, seed, target, may_leave=True, traced=traced)
            elif label == BASELINE:  # the round's target: its validation at step T
                row = train(label, max(args.target_step, args.budget), seed)
                target = dict((s, loss) for s, _, loss in row["curve"])[args.target_step]
            else:
                row = train(label, args.cap * args.target_step, seed, target, may_leave=True, traced=traced)
            first = tta.crossing(row["curve"], target)
            first_s = sum(row["step_times"][:tta.FIRST_STEPS])
            row.update(round=round_, seed=seed, target=target, reached=first is not None,
                       final_loss=row["curve"][-1][2],
                       budget_loss=dict((s, loss) for s, _, loss in row["curve"]).get(args.budget),
                       steps_to_target=first and first[0], time_to_target=first[1] if first else math.inf,
                       time_to_target_after_first=first[1] - first_s if first and first[0] > tta.FIRST_STEPS
                       else math.inf)
            rows.append(row)
            if rank == 0:
                outcome = (f"target {target:.4f} at step {first[0]:.1f}, {first[1]:.1f} s" if first else
                           f"left the race: steady step {row['steady_step_s']:.3f} s" if row["left_race"] else
                           f"val {row['final_loss']:.4f} > target {target:.4f} after {row['steps']} steps")
                print(f"round {round_} {label}: {outcome}; {row['steps']} steps, {row['train_s']:.1f} s training, "
                      f"{row['eval_s']:.1f} s validating, {row['wall_s']:.1f} s in all, "
                      f"{row['wire_bytes'] / 1e6:.3f} MB/step/rank across nodes", flush=True)
    if rank == 0:
        Path(args.worker_out).write_text(json.dumps({"rows": rows, "skipped": skipped}))
    dist.barrier()
    dist.destroy_process_group()


def timeline(step: int, start: float, forward_end: float, backward_end: float, spans: list, last_step: dict) -> dict:
    """One step's timeline on this rank, seconds from its start: the forward, the backward (to FSDP's final
    callback, where the step's started averages are waited for), the hook's calls (FSDP's backward waiting in
    it) and each group's average from the pipeline's trace points (encode from, on the wire from, done)."""
    return {"step": step, "forward_end": forward_end - start, "backward_end": backward_end - start,
            "plan": last_step.get("plan"),
            "hook": [(index, begin - start, end - start) for index, begin, end in spans],
            "buckets": [(b["index"], b["t_encode"] - start, b["t_launch"] - start, b["t_done"] - start)
                        for b in last_step["per_bucket"] if "t_done" in b]}


# ---------------------------------------------------------------- the two-node lab


def join_nodes(lab, rate: str) -> None:
    """Move workers 2, 3 to a second bridge and join the bridges by one veth pair, shaped both ways."""
    from lab import _sh, parse_rate, tbf_burst_bytes

    rate_bps = parse_rate(rate)
    ns = ["ip", "-n", lab.bridge_ns]
    _sh([*ns, "link", "add", "br1", "type", "bridge"])
    _sh([*ns, "link", "set", "br1", "up"])
    for rank in range(PER_NODE, NODES * PER_NODE):
        _sh([*ns, "link", "set", f"v{rank}", "master", "br1"])
    _sh([*ns, "link", "add", "x0", "type", "veth", "peer", "name", "x1"])
    for end, bridge in (("x0", "br0"), ("x1", "br1")):
        _sh([*ns, "link", "set", end, "master", bridge, "up"])
        if rate_bps is not None:
            _sh(["ip", "netns", "exec", lab.bridge_ns, "tc", "qdisc", "add", "dev", end, "root", "tbf", "rate",
                 f"{int(rate_bps)}bit", "burst", str(tbf_burst_bytes(rate_bps)), "latency", "100ms"])


def lab_cell(rate: str, args) -> tuple[list[dict], dict, float]:
    """Wait (up to --quiet-wait) for a quiet machine, then race every contestant on a two-node lab at `rate`:
    the rows (tagged with the rate and load), the contestants register refused, the load waited for."""
    from lab import Lab
    from provenance import wait_for_quiet

    load = wait_for_quiet(wait_s=args.quiet_wait)
    with tempfile.TemporaryDirectory(prefix="netgain-fsdp-lab-") as folder:
        out = Path(folder) / "rows.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--worker-out", str(out),
               *worker_flags(args)]
        with Lab(NODES * PER_NODE, None) as lab:
            join_nodes(lab, rate)
            codes = lab.run(cmd, extra_env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}, timeout=4 * 3600)
        if any(codes):
            raise RuntimeError(f"lab workers failed with exit codes {codes} at {rate}")
        result = json.loads(out.read_text())
    for row in result["rows"]:
        row.update(rate=rate, load=load)
    return result["rows"], result["skipped"], load


def worker_flags(args) -> list[str]:
    return ["--rounds", str(args.rounds), "--target-step", str(args.target_step), "--cap", str(args.cap),
            "--budget", str(args.budget), "--eval-every", str(args.eval_every),
            "--eval-batches", str(args.eval_batches), "--eval-batch-size", str(args.eval_batch_size),
            "--warmup", str(args.warmup), "--lr", str(args.lr), "--seed", str(args.seed),
            "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--hidden", str(args.hidden),
            "--layers", str(args.layers), "--leave-above", str(args.leave_above), "--trace-from", str(args.trace_from),
            *(["--targets", *map(str, args.targets)] if args.targets else []), "--contestants", *args.contestants]


# ---------------------------------------------------------------- the report


def summarise(rows: list[dict]) -> list[dict]:
    """Per rate and contestant: time_to_accuracy's medians over rounds, the loss at the budget, ratios to native HSDP."""
    out = []
    for rate, workers, label, mine, by_round in per_contestant(rows):
        budget = [r["budget_loss"] for r in mine]
        row = {"rate": rate, "workers": workers, "contestant": label, **tta.race_summary(mine),
               "budget_loss": None if None in budget else statistics.median(budget),
               "round_wall_s": statistics.median(r["wall_s"] for r in mine),
               # the seconds a step's backward spent in netgain's hook: the median step's, median over rounds
               "held_s": None if None in mine[0].get("step_held_s", [None])
               else statistics.median(statistics.median(r["step_held_s"][tta.FIRST_STEPS:] or r["step_held_s"]) for r in mine)}
        add_ratios(row, by_round, label, "time_to_target", PEERS)
        out.append(row)
    return out


def report(rows: list[dict], summary: list[dict], meta: dict, out: Path) -> None:
    head = tta.write_data(out, {"meta": meta, "summary": summary, "rows": rows}, summary)
    tta.plot(rows, summary, Path(f"{out}.png"), baseline="native fp32 HSDP")
    peers = [key for _, key in PEERS if any(key in s for s in summary)]
    fmt = tta.fmt
    lines = [*head,
             f"Model: byte-level Llama, hidden {meta['hidden']}, {meta['layers']} layers ({rows[0]['numel'] / 1e6:.2f} M "
             f"parameters), each decoder layer and the root one FSDP2 group; batch {meta['batch_size']} x "
             f"{meta['seq_len']} bytes per worker, AdamW lr {meta['lr']}; text: the Python standard library's source, "
             f"every 10th file held out. Validation: {meta['eval_batches']} x {meta['eval_batch_size']} x "
             f"{meta['seq_len']} held-out bytes every {meta['eval_every']} steps.",
             f"Lab: {NODES} nodes x {PER_NODE} workers, mesh (replicate, shard) = ({NODES}, {PER_NODE}); inside a node "
             "an unshaped link, between the nodes one veth pair with tbf at the rate each way, shared by both "
             "cross-node pairs. native-*: FSDP2's own HSDP over the 2-D mesh (bf16: "
             "MixedPrecisionPolicy(reduce_dtype=bfloat16)); the others: fully_shard over mesh['shard'] and "
             "netgain.comm.fsdp on the cross-node all-reduce.",
             f"Race: round r trains from seed {meta['seed']} + r (initial model and batches); "
             + (f"targets given (`--targets`): {meta['targets']}, native-fp32 racing last"
                if meta.get("targets") else f"target: native fp32 HSDP's validation loss at step {meta['target_step']}")
             + f"; each contestant stops at the first validation at or below it after at least {meta['budget']} "
             f"steps, at most {meta['cap']} x {meta['target_step']}. {meta['warmup']} untimed steps per contestant "
             f"first; contestants interleaved within each round. A contestant whose steady step (median of steps "
             f"1-{tta.FIRST_STEPS}, the mean for sync-* and an auto-sync local by then, whose syncs it holds; slowest rank) was "
             f"over {meta['leave_above']:g}x the best so far of the per-step contestants (local steps skip the link) left the race "
             "('not reached').",
             "Time to target: step times (barrier to optimizer step; validations excluded) up to the crossing, "
             "interpolated between validations; median over rounds (min-max). x native: per-round ratio of native "
             f"HSDP's time to target to the contestant's (> 1: sooner). Val loss at step {meta['budget']}: every "
             "contestant after the same steps; round s: a contestant's wall time per round (build, training, "
             "validations). Medians over rounds. Hook holds the backward: the seconds a step's backward spent in "
             "netgain's hook calls (median of the steps after the first "
             f"{tta.FIRST_STEPS}); <codec>-held: the same codec with register(..., overlap=False)."]
    for note in meta.get("skipped", {}).items():
        lines += ["", "Skipped %s: %s" % note]
    for rate in dict.fromkeys(s["rate"] for s in summary):
        mine = [s for s in summary if s["rate"] == rate]
        targets = dict.fromkeys(f"{r['target']:.4f}" for r in rows if r["rate"] == rate)
        lines += ["", f"## {rate} between the nodes", "", f"Target {' / '.join(targets)} (round by round).", "",
                  f"| contestant | reached | time to target s (min-max) | without the first {tta.FIRST_STEPS} steps | "
                  + " | ".join(PEER_TITLES[k] for k in peers) + " | steps to target | steady step s | "
                  f"hook holds the backward s/step | wire MB/step/rank | val loss at step {meta['budget']} | "
                  "final val loss | round s |",
                  "|---|---|---|---|" + "---|" * len(peers) + "---|---|---|---|---|---|---|"]
        for s in mine:
            spread = "" if s["tta_s"] == math.inf else f" ({fmt(s['tta_min'], '.1f')}-{fmt(s['tta_max'], '.1f')})"
            left = f" (left the race {s['left_race']}x)" if s["left_race"] else ""
            lines.append(f"| {s['contestant']} | {s['reached']}{left} | {fmt(s['tta_s'], '.1f')}{spread} | "
                         f"{fmt(s['tta_after_first_s'], '.1f')} | " + " | ".join(format_ratio(s, k) for k in peers)
                         + f" | {fmt(s['steps_to_target'], '.1f')} | {fmt(s['steady_step_s'], '.3f')} | "
                         f"{fmt(s.get('held_s'), '.3f')} | {s['wire_MB']:.3f} | {fmt(s['budget_loss'], '.4f')} | {s['final_loss']:.4f} | "
                         f"{s['round_wall_s']:.0f} |")
        best = min(mine, key=lambda s: s["tta_s"])
        lines += ["", f"Fastest to target at {rate}: {best['contestant']} ({fmt(best['tta_s'], '.1f')} s)."]
    lines += ["", f"![time to target and validation loss vs time]({out.name}.png)"]
    traced = [r for r in rows if r.get("trace")]
    if traced:
        plot_trace(traced, Path(f"{out}_trace.png"))
        lines += ["", "## What overlaps", "",
                  f"Round 0's steps {meta['trace_from']}-{meta['trace_from'] + TRACE_STEPS - 1} on rank 0, timed in the "
                  f"race at {traced[0]['rate']}. Held: every group's average ran inside the hook's call. Backward: from the forward's end to the hook's last return; the "
                  "hook holds it: its calls' seconds (FSDP waiting in them); averages beside it: the groups' encode, "
                  "collectives and decode (the pipeline's trace points) while the backward computes, outside the "
                  "hook's calls; end wait: from the hook's last return to the backward's end (FSDP's final callback "
                  "waiting for the started averages, the planner's end of step).", "",
                  "| contestant | step | held | step s | backward s | hook holds s | averages beside it s | "
                  "end wait s | plan |", "|---|---|---|---|---|---|---|---|---|"]
        for r in traced:
            for t in r["trace"]:
                o = overlap(t)
                lines.append(f"| {r['label']} | {t['step']} | {'yes' if o['held'] else 'no'} | "
                             f"{r['step_times'][t['step']]:.3f} | {o['backward_s']:.3f} | {o['hook_s']:.3f} | "
                             f"{o['beside_s']:.3f} | {o['end_wait_s']:.3f} | {_groups(t['plan'])} |")
        lines += ["", f"![one step's timeline per contestant]({out.name}_trace.png)"]
    Path(f"{out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _groups(plan: dict | None) -> str:
    """A plan as each codec and its number of groups."""
    counts = collections.Counter((plan or {}).values())
    return ", ".join(f"{codec} x{count}" for codec, count in counts.items())


def _length(intervals) -> float:
    """Seconds covered by a union of (start, end) intervals."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        total += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return total


def overlap(t: dict) -> dict:
    """A timeline's overlap: the backward (forward end to the hook's last return), the hook's seconds in it, the
    groups' averages while it computes outside the hook, the wait from there to the backward's end, and whether
    every group's average ran inside the hook's call (held)."""
    backward = (t["forward_end"], max(end for *_, end in t["hook"]))
    hook = [(a, b) for _, a, b in t["hook"]]
    inside = [(max(a, backward[0]), min(d, backward[1])) for _, a, _, d in t["buckets"]]
    inside = [(a, b) for a, b in inside if b > a]
    in_hook = [(max(a, c), min(b, d)) for a, b in inside for c, d in hook if min(b, d) > max(a, c)]
    return {"backward_s": backward[1] - backward[0], "hook_s": _length(hook),
            "beside_s": _length(inside) - _length(in_hook), "end_wait_s": t["backward_end"] - backward[1],
            "held": all(any(a <= c and d <= b for _, a, b in t["hook"]) for _, c, _, d in t["buckets"])}


def plot_trace(traced: list[dict], path: Path) -> None:
    """Each contestant's middle traced step: the backward, the hook's calls and each group's encode and wire time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(traced), 1, figsize=(12, 1.6 + 0.45 * 8 * len(traced)), squeeze=False)
    for r, (ax,) in zip(traced, axes):
        t = r["trace"][len(r["trace"]) // 2]
        groups = sorted({index for index, *_ in t["buckets"]} | {index for index, *_ in t["hook"]})
        lane = {index: i + 2 for i, index in enumerate(groups)}
        last = max(end for *_, end in t["hook"])
        ax.broken_barh([(t["forward_end"], last - t["forward_end"])], (0.6, 0.8), color="0.75")
        ax.broken_barh([(a, b - a) for _, a, b in t["hook"]], (0.6, 0.8), color="tab:red")
        for index, encode, launch, done in t["buckets"]:
            ax.broken_barh([(encode, launch - encode), (launch, done - launch)], (lane[index] - 0.4, 0.8),
                           color=["tab:orange", "tab:blue"])
        ax.axvline(t["backward_end"], color="k", lw=0.8, ls="--")
        ax.set_yticks([1, *lane.values()], ["backward\n(red: in the hook)", *(f"group {i}" for i in groups)], fontsize=7)
        ax.set_title(f"{r['label']}, step {t['step']} ({'held' if overlap(t)['held'] else 'overlapped'}): "
                     "orange encode, blue on the wire to decoded; dashed: the backward's end", fontsize=9)
    axes[-1][0].set_xlabel("seconds from the step's start (rank 0)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", nargs="+", default=["50mbit", "100mbit"],
                        help="the inter-node link, each way ('none': unshaped)")
    parser.add_argument("--contestants", nargs="+", default=DEFAULT_CONTESTANTS, choices=list(CONTESTANTS),
                        help=f"{BASELINE} always runs: it sets the target")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each from its own seed")
    parser.add_argument("--target-step", type=int, default=120, help="T: the target is native fp32's loss at step T")
    parser.add_argument("--cap", type=int, default=3, help="train at most CAP x T steps")
    parser.add_argument("--budget", type=int, help="train at least this many steps, and report every contestant's "
                        "validation loss there (default: T)")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-batches", type=int, default=8, help="a multiple of the 4 workers")
    parser.add_argument("--eval-batch-size", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3, help="untimed throwaway steps per contestant before round 0")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0, help="round r: seed + r (initial model and batches)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--targets", type=float, nargs="+",
                        help=f"the target of each round (the last for later rounds), e.g. {BASELINE}'s from an earlier "
                        f"run at the same seeds: {BASELINE} then races last, and may leave the race")
    parser.add_argument("--leave-above", type=float, default=2.0,
                        help="a contestant whose steady step is over this x the best so far leaves the race")
    parser.add_argument("--trace-from", type=int, default=0, metavar="STEP",
                        help=f"record what overlaps in round 0's steps STEP..STEP+{TRACE_STEPS - 1} of each netgain "
                        "contestant: OUT_trace.png and a table (0: none)")
    parser.add_argument("--quiet-wait", type=float, default=900,
                        help="seconds to wait for a load average below 1.0 before each rate (0: do not wait)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "fsdp_lab_tta")
    parser.add_argument("--report-from", type=Path, metavar="JSON",
                        help="only rewrite the report from an earlier run's JSON (md, csv, png beside it)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.budget = args.target_step if args.budget is None else args.budget
    if (args.rounds < 1 or args.cap < 1 or args.eval_every < 1 or args.warmup < 1 or args.target_step % args.eval_every
            or args.budget % args.eval_every or not 0 < args.budget <= args.cap * args.target_step
            or args.eval_batches % (NODES * PER_NODE) or args.trace_from < 0):
        parser.error("--rounds, --cap, --eval-every and --warmup must be >= 1, --target-step and --budget multiples of "
                     "--eval-every, --budget at most CAP x T, --eval-batches a multiple of 4, --trace-from >= 0")
    if args.worker:
        worker(args)
        return 0
    if args.report_from:
        saved = json.loads(args.report_from.read_text())
        report(saved["rows"], summarise(saved["rows"]), saved["meta"], args.report_from.with_suffix(""))
        return 0
    from lab import terminate_on_signals
    from provenance import git_commit

    # native-fp32 sets the target, so runs first; given the targets, it races last (it may leave the race)
    args.contestants = list(dict.fromkeys([*args.contestants, BASELINE] if args.targets
                                          else [BASELINE, *args.contestants]))
    commit, rows, skipped, load = git_commit(), [], {}, {}
    with terminate_on_signals():  # a SIGTERM tears the lab down too
        for rate in args.rates:
            cell, refused, load[f"before {rate}"] = lab_cell(rate, args)
            rows += cell
            skipped.update(refused)
    meta = {"title": "Time to target validation loss for HSDP on the two-node lab: native FSDP2 vs netgain on "
                     "the cross-node all-reduce (interleaved)",
            "machine": f"{cpu_name()}, {os.cpu_count()} cores, {NODES * PER_NODE} workers of 1 torch thread",
            "commit": commit,
            "command": "python " + " ".join(sys.argv), "load": load, "skipped": skipped,
            **{k: getattr(args, k) for k in ("rates", "hidden", "layers", "batch_size", "seq_len", "lr", "rounds",
                                             "target_step", "cap", "budget", "eval_every", "eval_batches",
                                             "eval_batch_size", "warmup", "seed", "targets", "leave_above",
                                             "trace_from")}}
    report(rows, summarise(rows), meta, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
