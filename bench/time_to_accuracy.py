"""Time to a target validation loss on the lab: netgain's codecs against PyTorch's DDP hooks.

Why: users want to reach a target loss sooner. Samples/s alone rewards throwing information away,
and a loss at a fixed step count ignores time. Every contestant trains the same byte-level Llama
from the same initial weights on the same batches of real text (the Python standard library's
source, `netgain train`'s default corpus, every 10th file held out) with AdamW, until its
validation loss reaches the target or a step cap of `--cap` x T. The target is the validation
loss fp32 DDP reaches at step T (`--target-step`): ddp trains first in round 0 and sets it.
With `--seed-per-round`, round r trains from seed + r (batches and initial model) and its own ddp
run sets its target: one seed's steps to target is a draw (the same algorithm moved 117-162 steps
over three seeds), and rounds on one seed sample only the step times.
Time to target = the sum of the step times (validations excluded) up to where the validation loss
crosses the target, interpolated linearly between the last validation above it and the first at or
below it (validations: every `--eval-every` steps, on a fixed set of held-out windows, the same for
every contestant), so that a contestant a hair above the target at a validation is not charged
`--eval-every` whole steps. After each per-step run the ranks compare a fingerprint of their parameters' bits: the
report names any run whose replicas differed (data parallel training must keep them equal).
With `--time-budget S` every contestant trains on to at least S seconds, and the report adds each one's
validation loss at S seconds: a route that reaches the target soon but ends worse shows as worse.

As in bench/hook_lab.py, the workers start once per (rate, world size) cell and train every
contestant in turn, round after round (A B C ... A B C ...), each from a fresh DDP wrap; before
round 0 each contestant runs `--warmup` throwaway steps, so that compiling is in nobody's time; and each
contestant starts once the compiles an earlier one left in flight are done (untimed): they would slow its steps.
`netgain model`'s fixed codec for each cell (netgain.cost.advise on this model's parameters, the compute
step timed here with every worker computing at once, as the lab's workers share the cores, codecs
charged the same slowdown, and the cell's lab link) is made before the run and always runs as a contestant;
with `--steps-from` earlier results' steps to target enter it (time to target = step time x steps). Its
recommendation is auto, whose forecast plan the verdicts set beside auto's measured time.
The CSV's `codec` and `steps_ratio` columns are what `netgain model --steps-from` reads (steps_ratio
is empty unless the contestant reached the target in every round).

    python bench/time_to_accuracy.py                                   # root: the issue's grid
    python bench/time_to_accuracy.py --rates 100mbit --workers 2 --contestants ddp ddp-fp16 gqsgd-8

Writes OUT.md, OUT.csv, OUT.json and OUT.png (OUT defaults to bench/results/time_to_accuracy);
`--report-from OUT.json` rewrites the others from a finished run.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from hook_lab import (LINKS, add_ratios, format_ratio, lab_cell, machine, per_contestant,  # noqa: E402
                      register_contestant)
from runs import threads_per_worker  # noqa: E402

# label -> how the contestant's hook is registered ("ddp": plain DDP, no hook; "bf16-hook": PyTorch's
# bf16_compress_hook, which netgain.comm.baselines does not wrap). Not here: batched_powerSGD_hook,
# which fails in torch 2.13 (_orthogonalize asserts a batch of matrices and is given one matrix).
CONTESTANTS = {
    "ddp": None,
    "ddp-fp16": ("torch", "ddp-fp16", {}),
    "ddp-bf16": ("bf16-hook",),
    "ddp-powersgd-r4": ("torch", "ddp-powersgd", {"rank": 4}),
    "ddp-powersgd-r8": ("torch", "ddp-powersgd", {"rank": 8}),
    "ddp-powersgd-r32": ("torch", "ddp-powersgd", {"rank": 32}),
    "none": ("netgain", "none", {}),
    "fp16": ("netgain", "fp16", {}),
    "bf16": ("netgain", "bf16", {}),
    "qsgd-8": ("netgain", "qsgd", {"bits": 8}),
    "gqsgd-8": ("netgain", "gqsgd", {"bits": 8}),
    "gqsgd-8-int8": ("netgain", "gqsgd", {"bits": 8, "encoding": "int8"}),
    "gqsgd-4": ("netgain", "gqsgd", {"bits": 4}),
    "gqsgd-2": ("netgain", "gqsgd", {"bits": 2}),
    "gqsgd-exp-8": ("netgain", "gqsgd-exp", {"bits": 8}),
    "topk-1%": ("netgain", "topk", {"ratio": 0.01}),
    "randomk-1%": ("netgain", "randomk", {"ratio": 0.01}),
    "lowrank-r4-fp32": ("netgain", "lowrank", {"rank": 4, "factors": "fp32"}),
    "lowrank-r4-gqsgd8": ("netgain", "lowrank", {"rank": 4, "factors": "gqsgd", "bits": 8}),
    "lowrank-r4-fp32-w0": ("netgain", "lowrank", {"rank": 4, "factors": "fp32", "warmup_steps": 0}),
    "kimad+": ("netgain", "kimad+", {}),
    # netgain.sync (DiLoCo): no DDP, each worker steps alone and syncs every `period` steps, one step overlapped
    "sync-h4-b8": ("sync", {"period": 4, "bits": 8, "overlap_steps": 1}),
    "sync-h8-b4": ("sync", {"period": 8, "bits": 4, "overlap_steps": 1}),
    "sync-h16-b4": ("sync", {"period": 16, "bits": 4, "fragments": 2, "overlap_steps": 1}),
    # outer lr 1 without momentum: periodic averaging (PyTorch's PostLocalSGD), coded
    "sync-h4-b8-avg": ("sync", {"period": 4, "bits": 8, "overlap_steps": 1, "outer_lr": 1.0, "outer_momentum": 0.0,
                                "nesterov": False}),
    "sync-h8-b4-avg": ("sync", {"period": 8, "bits": 4, "overlap_steps": 1, "outer_lr": 1.0, "outer_momentum": 0.0,
                                "nesterov": False}),
    # PyTorch's periodic averaging (PostLocalSGD), the fp32 baseline of the "-avg" contestants: see PostLocalSGD
    "post-local-h4": ("post-local", {"period": 4, "warmup_steps": 0}),
    "post-local-h16": ("post-local", {"period": 16, "warmup_steps": 0}),
    "kimad": ("netgain", "kimad", {}),
    "auto": ("netgain", "auto", {}),
    "auto-w2": ("netgain", "auto", {"warmup_steps": 2}),  # auto after 2 fp32 steps, the fixed low rank's warm-up
    # auto offered the route of local steps (netgain.sync.offer): DDP's hook and loop unchanged
    "auto-sync": ("route",),
}
DEFAULT_CONTESTANTS = ["ddp", "ddp-fp16", "ddp-bf16", "ddp-powersgd-r4", "ddp-powersgd-r32", "fp16", "gqsgd-8",
                       "gqsgd-4", "gqsgd-2", "gqsgd-exp-8", "topk-1%", "randomk-1%", "lowrank-r4-fp32", "lowrank-r4-gqsgd8",
                       "kimad+", "kimad", "auto"]
# ratio columns: every PyTorch hook, time to target of the hook / the contestant's, same round
PEERS = (("ddp", "x_ddp"), ("ddp-fp16", "x_fp16_hook"), ("ddp-bf16", "x_bf16_hook"),
         ("ddp-powersgd-r4", "x_powersgd_r4"), ("ddp-powersgd-r8", "x_powersgd_r8"), ("ddp-powersgd-r32", "x_powersgd_r32"))
PEER_TITLES = {"x_ddp": "x fp32 DDP", "x_fp16_hook": "x fp16_compress_hook", "x_bf16_hook": "x bf16_compress_hook",
               "x_powersgd_r4": "x powerSGD r4", "x_powersgd_r8": "x powerSGD r8",
               "x_powersgd_r32": "x powerSGD r32"}
LOCAL_STEPS = ("sync", "post-local")  # each worker steps alone between averages: no yardstick for per-step routes
FIRST_STEPS = 10  # time to target is also reported without a contestant's first steps: a win from the warm-up shows
WITHIN = 1.10  # the pick counts as right within 10% of the fastest time to target


class BF16Hook:
    """PyTorch's bf16_compress_hook, counting the bytes it hands to its allreduce (2 per element)."""

    def __init__(self, ddp):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        self.inner, self.last_step, self._wire = default_hooks.bf16_compress_hook, {}, 0
        ddp.register_comm_hook(self, BF16Hook.hook)

    @staticmethod
    def hook(state: "BF16Hook", bucket):
        state._wire += 2 * bucket.buffer().numel()
        if bucket.is_last():
            state.last_step, state._wire = {"wire_bytes": state._wire}, 0
        return state.inner(None, bucket)

    def close(self) -> None:
        """Nothing to drain (same interface as CommState)."""


class PostLocalSGD:
    """PyTorch's post-local SGD: DDP's post_localSGD_hook (PostLocalSGDState) all-reduces the gradients for
    the first `warmup_steps` steps and then none; PostLocalSGDOptimizer runs each worker's AdamW step, then
    its PeriodicModelAverager averages the parameters in fp32 every `period` steps after the warm-up.

    No gradient all-reduce after the warm-up (post_local_gradient_allreduce=False): the hook's default
    all-reduces within each machine, and every lab worker is a machine of its own. warmup_steps 0, as
    netgain.sync has none: PyTorch's example warms up for 100 steps of fp32 DDP, 1.6-8 s a step on this
    job at 50-10 Mbit/s. Counts the fp32 bytes each step hands to all-reduce, as the other states do.
    """

    def __init__(self, ddp, optimizer, period: int, warmup_steps: int):
        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        from torch.distributed.optim import PostLocalSGDOptimizer

        hook = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=warmup_steps,
                                 post_local_gradient_allreduce=False)
        ddp.register_comm_hook(hook, post_localSGD_hook)
        self.averager = PeriodicModelAverager(period=period, warmup_steps=warmup_steps)
        self.optimizer = PostLocalSGDOptimizer(optimizer, self.averager)
        self.fp32_bytes = 4 * sum(p.numel() for p in ddp.parameters())
        self.last_step = {}

    def step(self) -> None:
        step, warmup, period = self.averager.step, self.averager.warmup_steps, self.averager.period
        self.optimizer.step()
        averaged = step >= warmup and (step - warmup) % period == 0  # PeriodicModelAverager's rule
        self.last_step = {"wire_bytes": self.fp32_bytes * ((step < warmup) + averaged)}

    def close(self) -> None:
        """Nothing to drain (same interface as CommState)."""


def steady_step(step_times: list[float], local: bool, plans: list) -> tuple[float, bool]:
    """This rank's steady step, and whether the contestant stepped alone: a local-step route (``local``) or auto's
    route once local (``plans``: its [step, plan, trying] runs so far). The median of steps 1-FIRST_STEPS; the mean
    where it stepped alone, whose steps differ by design (the mean holds its averages), and which then sets no bar
    for per-step routes: its steps skip the link."""
    alone = local or any(plan == "local" for _, plan, _ in plans)
    return (statistics.mean if alone else statistics.median)(step_times[1:]), alone


def synced_bytes(history: list[dict], seen: int) -> tuple[int, int]:
    """The wire bytes of a sync's records appended since the first ``seen``, and how many it holds now (its thread
    may append one meanwhile: that one counts next time)."""
    done = len(history)
    return sum(h["wire_bytes"] for h in history[seen:done]), done


def crossing(curve: list[tuple], target: float) -> tuple[float, float] | None:
    """(step, seconds) where the validation curve [(step, seconds, loss)] first reaches the target, interpolated."""
    for (s0, t0, l0), (s1, t1, l1) in zip(curve, curve[1:]):
        if l1 <= target:  # l0 > target, or the crossing would have come earlier
            share = (l0 - target) / (l0 - l1)
            return s0 + share * (s1 - s0), t0 + share * (t1 - t0)
    return None


def loss_at(curve: list[tuple], seconds: float) -> float | None:
    """The validation loss at `seconds` of training on the curve [(step, seconds, loss)], interpolated between the
    validations around it; None where the curve ends before it."""
    for (_, t0, l0), (_, t1, l1) in zip(curve, curve[1:]):
        if t1 >= seconds:
            return l0 + (l1 - l0) * (seconds - t0) / (t1 - t0) if t1 > t0 else l1
    return None


def validation_loss(model, batches) -> float:
    """Mean loss over fixed validation batches, each rank a share of them: a collective, every rank calls it."""
    import torch
    import torch.distributed as dist

    model.eval()
    with torch.no_grad():
        total = torch.tensor([sum(model(input_ids=b, labels=b).loss.item() for b in batches), len(batches)],
                             dtype=torch.float64)
    model.train()
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def replicas_agree(model) -> bool:
    """Whether every rank holds the same parameters, bit for bit (netgain.sync.alike: a fingerprint of each one's bits,
    one small allreduce): a per-step route must keep its replicas equal, or it trains a different model per rank.
    A collective, untimed."""
    import torch
    from netgain.sync import alike

    with torch.no_grad():
        return all(alike([p.detach().reshape(-1) for p in model.parameters()], None))


STDLIB = "the Python standard library's source"


def load_corpus(args):
    """The job's text: --corpus (a file or a folder of files), else STDLIB."""
    from netgain import data

    return data.ByteCorpus.from_files(data.text_files(args.corpus, "--corpus") if args.corpus else data.stdlib_source_files())


def register(ddp, spec, optimizer):
    if spec is not None and spec[0] == "bf16-hook":
        return BF16Hook(ddp)
    if spec is not None and spec[0] == "post-local":
        return PostLocalSGD(ddp, optimizer, **spec[1])
    if spec is not None and spec[0] == "route":
        import netgain.sync

        return netgain.sync.offer(register_contestant(ddp, CONTESTANTS["auto"]), ddp, optimizer)
    return register_contestant(ddp, spec)


# ---------------------------------------------------------------- one worker (inside the lab)


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from netgain import models
    from netgain.comm import kernel

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    corpus = load_corpus(args)
    validation = corpus.validation_batches(args.eval_batches, args.eval_batch_size, args.seq_len)[rank::world]

    def validate(model) -> float:
        return validation_loss(model, validation)

    best_steady = [math.inf]  # the cell's fastest steady step so far, agreed by every rank

    def slowest(step_times: list[float]) -> list[float]:
        """Each step's time at the slowest rank (a collective: every rank calls it)."""
        times = torch.tensor(step_times, dtype=torch.float64)
        dist.all_reduce(times, dist.ReduceOp.MAX)
        return times.tolist()

    def budget_spent(step_times: list[float], budget_s: float) -> bool:
        """No budget, or the seconds trained so far (the slowest rank's, summed as the curve's times are) reach it:
        a collective where there is one, so every rank calls it at the same steps."""
        return not budget_s or sum(slowest(step_times)) >= budget_s

    def train(label: str, steps: int, seed: int, target: float | None = None, eval_every: int = 0,
              may_leave: bool = False, budget_s: float = 0.0) -> dict:
        """A fresh DDP wrap of the initial model, trained up to `steps` steps or to the first validation <= target,
        and either way, unless it leaves the race, on to the first validation after `budget_s` seconds of training
        (the slowest rank's; past the cap too).
        seed: the batches'; with --seed-per-round also the initial model's (else seed 0's). may_leave: leave the
        race once the steady step (median of steps 1-10, the mean for local-step routes and a route local by then,
        whose averages it includes; the slowest rank's) is over --leave-above x the cell's best: a per-step contestant as soon as
        over half of those steps are (fp32 DDP at 10 Mbit/s takes half a minute a step)."""
        kernel.wait_for_compiles()  # untimed: a compile an earlier contestant left in flight would slow this one
        torch.manual_seed(seed if args.seed_per_round else 0)
        model = models.byte_llama(args.hidden, args.layers, args.seq_len)
        numel = sum(p.numel() for p in model.parameters())
        spec = CONTESTANTS[label]
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        local = spec is not None and spec[0] in LOCAL_STEPS  # its state steps the optimizer
        if spec is not None and spec[0] == "sync":  # the model alone: its outer steps sync it
            import netgain.sync

            ddp, state = model, netgain.sync.wrap(model, optimizer, **spec[1])
            synced = 0
        else:
            ddp = DDP(model, bucket_cap_mb=args.bucket_mb)
            state = register(ddp, spec, optimizer)
        train_s, eval_s, wire, step_times, steady, left = 0.0, 0.0, [], [], None, False
        norms, plans = [], []  # the norm of the gradient each step applied (untimed), a planner's plan by step
        curve = [(0, 0.0, validate(model))] if eval_every else []  # (step, train seconds, validation loss)
        for step in itertools.count():
            at_validation = not eval_every or step % eval_every == 0  # past the cap, a budget ends at a validation
            if step >= steps and (not budget_s or at_validation) and budget_spent(step_times, budget_s):
                break
            ids = corpus.train_batch(seed, step, rank, world, args.batch_size, args.seq_len)
            dist.barrier()
            start = time.perf_counter()
            ddp(input_ids=ids, labels=ids).loss.backward()
            (state if local else optimizer).step()
            step_times.append(time.perf_counter() - start)
            train_s += step_times[-1]
            norms.append(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]).norm().item())
            optimizer.zero_grad(set_to_none=True)
            plan = (state.last_step.get("plan"), state.last_step.get("trying")) if hasattr(state, "last_step") else None
            if plan is not None and (not plans or plans[-1][1:] != [str(plan[0]), bool(plan[1])]):
                plans.append([step, str(plan[0]), bool(plan[1])])  # auto/kimad: the plan's runs, and whether on trial
            if spec is not None and spec[0] == "sync":  # the syncs completed since the last step
                sent, synced = synced_bytes(state.comm.history, synced)
                wire.append(sent)
            else:
                wire.append(state.last_step["wire_bytes"] if state is not None else 4 * numel)
            if eval_every and (step + 1) % eval_every == 0:
                start = time.perf_counter()
                curve.append((step + 1, train_s, validate(model)))
                eval_s += time.perf_counter() - start
                if target is not None and curve[-1][2] <= target and budget_spent(step_times, budget_s):
                    break
            sure_over = False  # over half of steps 1-10 already over the bar: the median will be, leave now
            if may_leave and not local and math.isfinite(best_steady[0]) and 1 < len(step_times) <= FIRST_STEPS:
                over = torch.tensor(sum(t > args.leave_above * best_steady[0] for t in step_times[1:]))
                dist.all_reduce(over, dist.ReduceOp.MAX)  # one rank's median over the bar puts the slowest's over
                sure_over = over.item() > FIRST_STEPS // 2
            if len(step_times) == FIRST_STEPS + 1 or sure_over:  # a local-step route's steady step has an average
                steady, alone = steady_step(step_times, local, plans)
                steady = torch.tensor(steady)
                dist.all_reduce(steady, dist.ReduceOp.MAX)
                steady = steady.item()
                left = may_leave and steady > args.leave_above * best_steady[0]
                if not alone:
                    best_steady[0] = min(best_steady[0], steady)
                if left:
                    break
        # routes of local steps, and auto's that may take one, differ between their averages by design: not checked
        agree = replicas_agree(model) if not local and (spec is None or spec[0] not in ("sync", "route")) else None
        # each step's time is the slowest rank's: ranks that step alone between averages (sync, post-local, a route's
        # local steps) drift apart within a step, the barrier before the next waits for the slowest, and the wall
        # clock with it; rank 0's own time hid that (per-step routes wait inside their collective anyway)
        step_times = slowest(step_times)
        ends = [0.0, *itertools.accumulate(step_times)]
        curve = [(s, ends[s], loss) for s, _, loss in curve]
        train_s = ends[-1]
        # the route's choice: its phase at the end and the prices it compared (seconds to the target per fp32 step)
        route = ({key: state.last_step.get(key) for key in ("phase", "per_step_price", "route_price")}
                 if spec is not None and spec[0] == "route" else None)
        if state is not None:
            state.close()
        return {"label": label, "workers": world, "numel": numel, "curve": curve, "steps": len(wire), "route": route,
                "step_times": step_times, "grad_norms": norms, "plans": plans, "step_wire_bytes": wire, "steady_step_s": steady, "left_race": left,
                "replicas_agree": agree, "budget_loss": loss_at(curve, budget_s) if budget_s else None,
                "train_s": train_s, "eval_s": eval_s, "wire_bytes": statistics.mean(wire),
                "samples_s": len(wire) * args.batch_size * world / train_s}

    for label in args.contestants if args.warmup else ():  # compile, first allocations: untimed, discarded
        train(label, args.warmup, args.seed)
    rows, target, first_round = [], None, time.perf_counter()
    for round_ in range(args.rounds):
        round_start = time.perf_counter()
        seed = args.seed + (round_ if args.seed_per_round else 0)
        for label in args.contestants:  # ddp first: it sets the target (round 0's, or each round's)
            if args.targets:
                target = args.targets[min(round_, len(args.targets) - 1)]
            if label == "ddp" and not args.targets and (target is None or args.seed_per_round):
                row = train(label, args.target_step, seed, eval_every=args.eval_every)
                target = row["curve"][-1][2]
            else:
                row = train(label, args.cap * args.target_step, seed, target, args.eval_every, may_leave=True,
                            budget_s=args.time_budget or 0.0)
            first = crossing(row["curve"], target)
            first_s = sum(row["step_times"][:FIRST_STEPS])
            row.update(round=round_, target=target, reached=first is not None, final_loss=row["curve"][-1][2],
                       steps_to_target=first and first[0], time_to_target=first[1] if first else math.inf,
                       time_to_target_after_first=first[1] - first_s if first and first[0] > FIRST_STEPS else math.inf)
            rows.append(row)
            if rank == 0:
                outcome = (f"target {target:.4f} at step {first[0]:.1f}, {first[1]:.1f} s" if first else
                           f"left the race: steady step {row['steady_step_s']:.3f} s" if row["left_race"] else
                           f"val {row['final_loss']:.4f} > target {target:.4f} after {row['steps']} steps")
                print(f"round {round_} {label}: {outcome}; {row['train_s']:.1f} s training, {row['eval_s']:.1f} s "
                      f"validating, {row['wire_bytes'] / 1e6:.3f} MB/step", flush=True)
        now = time.perf_counter()  # would another round like this one overrun --max-minutes? rank 0 decides
        stop = torch.tensor(float(args.max_minutes is not None
                                  and 2 * now - round_start - first_round > 60 * args.max_minutes))
        dist.broadcast(stop, 0)
        if stop.item():
            break
    if rank == 0:
        Path(args.worker_out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- netgain model's pick, before the run


def compute_step(args, workers: int, barrier=None, results=None) -> float:
    """Median forward + backward + AdamW step of one worker's batch, no DDP, cores / workers threads;
    with a barrier, the timed steps start when every process passed its warm-up, and the median goes
    to `results`."""
    import torch

    from netgain import models

    corpus = load_corpus(args)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads_per_worker(workers))
    torch.manual_seed(0)
    model = models.byte_llama(args.hidden, args.layers, args.seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    times = []
    for step in range(args.warmup + 10):
        if barrier is not None and step == args.warmup:
            barrier.wait()
        ids = corpus.train_batch(args.seed, step, 0, workers, args.batch_size, args.seq_len)
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    torch.set_num_threads(threads)
    median = statistics.median(times[args.warmup:])
    if results is not None:
        results.put(median)
    return median


def measure_compute(args, workers: int) -> tuple[float, float]:
    """(one worker's compute step timed in `workers` processes at once, as the lab's workers share this
    machine's cores; the same step timed alone): the first is the pick's compute, their ratio how much
    slower CPU work (the codec's too) runs in a lab worker than when calibrated alone. A process that
    dies raises here with the exit codes, and breaks the others' barrier."""
    import queue
    from multiprocessing import get_context

    context = get_context("spawn")
    barrier, results = context.Barrier(workers, timeout=600), context.Queue()
    processes = [context.Process(target=compute_step, args=(args, workers, barrier, results), daemon=True)
                 for _ in range(workers)]
    for process in processes:
        process.start()
    try:
        medians = []
        while len(medians) < workers:
            try:
                medians.append(results.get(timeout=5))
            except queue.Empty:
                failed = [process.exitcode for process in processes if process.exitcode not in (None, 0)]
                if failed:
                    raise RuntimeError(f"timing the compute step: a worker process failed (exit codes {failed})") from None
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
            process.join()
    return statistics.median(medians), compute_step(args, workers)


def lab_link(rate: str):
    """The cost model's link for a shaped lab rate: its preset, else the nearer preset's fit scaled to the rate's
    bandwidth."""
    from lab import parse_rate
    from netgain.cost import network as net

    if rate in LINKS:
        return net.preset(LINKS[rate])
    bps = parse_rate(rate)
    base = "1gbit" if bps >= 1e9 else "100mbit"
    link = net.preset(LINKS[base])
    return dataclasses.replace(link, name=f"lab-{rate}", bandwidth=link.bandwidth * bps / parse_rate(base),
                               note=f"{link.name} with its bandwidth scaled to {rate} (no preset fitted)")


@functools.cache
def codec_profiles(workers: int, cost: str, shapes: tuple | None = None, slowdown: float = 1.0):
    """netgain model's candidates, calibrated at a lab worker's threads (cores / workers) and charged
    `slowdown` x their encode and decode: the lab's workers share the cores that calibration had alone."""
    from netgain.comm.config import candidate_profiles

    threads = threads_per_worker(workers)
    return tuple((dataclasses.replace(profile, encode_s_per_elem=profile.encode_s_per_elem * slowdown,
                                      decode_s_per_elem=profile.decode_s_per_elem * slowdown), convergence)
                 for profile, convergence in candidate_profiles(workers, cost, list(shapes) if shapes else None, threads))


def codec_name(label: str) -> str:
    """The codec name `netgain model` prints for a netgain contestant ("none" for fp32 DDP); "" for the others."""
    import netgain.comm as comm

    spec = CONTESTANTS[label]
    if spec is None:
        return "none"
    if spec[0] != "netgain":  # PyTorch's hooks, netgain.sync
        return ""
    try:
        return comm.make_codec(spec[1], **spec[2]).describe()  # a profile is named by its codec's describe()
    except (TypeError, ValueError):  # kimad, codecs make_codec does not build
        return ""


def label_of(profile_name: str) -> str | None:
    """The contestant that runs the codec `netgain model` names."""
    return next((label for label in CONTESTANTS if CONTESTANTS[label] is not None and codec_name(label) == profile_name), None)


UNSHAPED = {"codec": "none made (an unshaped link has no rate for netgain model to price)", "label": None}


def pick(rate: str, workers: int, args, shapes: list[tuple[int, ...]], compute_s: float, slowdown: float) -> dict:
    """What `netgain model --workers N --link lab-RATE --compute-ms C --bucket-mb B --codec-cost COST` recommends,
    on this model's own parameter shapes; compute_s: a worker's step with every worker computing at once,
    slowdown: its ratio to the step alone (see measure_compute, codec_profiles)."""
    from netgain.comm.config import AutoConfig
    from netgain.cost import advise

    buckets, tensors, bucket_shapes = advise.model_buckets(shapes, args.bucket_mb, args.bucket_mb)
    # the lab's per-message latency is this machine's CPU time (veth pairs, gloo's threads), fitted on
    # collectives timed alone: slowed like any CPU work when the workers share the cores
    link = lab_link(rate)
    link = dataclasses.replace(link, latency=link.latency * slowdown, overhead=link.overhead * slowdown)
    calibration = advise.calibration_shapes(bucket_shapes, workers)
    rows = advise.evaluate(buckets, workers, link, compute_s,
                           list(codec_profiles(workers, args.codec_cost, tuple(calibration), slowdown)), "auto", tensors, bucket_shapes,
                           codec_shares_compute=True,  # lab workers: their threads fill the cores
                           steps=advise.read_steps(args.steps_from, workers) if args.steps_from else None)
    chosen = advise.recommend(rows)
    forecast = AutoConfig().build().plan_ahead(buckets, bucket_shapes, workers, link, compute_s, args.codec_cost)
    plan = sorted(set(forecast["plan"]))
    return {"rate": rate, "workers": workers, "link": link.name, "link_note": link.note, "compute_s": compute_s,
            "slowdown": slowdown,
            "codec": chosen.profile.name, "label": label_of(chosen.profile.name),
            "predicted_step_s": chosen.prediction.step_s, "predicted_speedup": chosen.speedup,
            "steps_from": args.steps_from, "steps": chosen.steps,
            "auto_forecast": advise.auto_forecast(forecast), "auto_plan": forecast["plan"],
            "auto_label": label_of(plan[0]) if len(plan) == 1 else None}


# ---------------------------------------------------------------- the driver


def worker_flags(args, contestants: list[str]) -> list[str]:
    return ["--rounds", str(args.rounds), "--target-step", str(args.target_step), "--cap", str(args.cap),
            "--eval-every", str(args.eval_every), "--eval-batches", str(args.eval_batches),
            "--eval-batch-size", str(args.eval_batch_size), "--warmup", str(args.warmup), "--lr", str(args.lr),
            "--seed", str(args.seed), *(["--seed-per-round"] if args.seed_per_round else []), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
            "--hidden", str(args.hidden), "--layers", str(args.layers), *(["--corpus", args.corpus] if args.corpus else []), "--bucket-mb", str(args.bucket_mb),
            *(["--max-minutes", str(args.max_minutes)] if args.max_minutes is not None else []),
            *(["--time-budget", str(args.time_budget)] if args.time_budget is not None else []),
            "--leave-above", str(args.leave_above), *(["--targets", *map(str, args.targets)] if args.targets else []),
            "--contestants", *contestants]


def race_summary(mine: list[dict]) -> dict:
    """One contestant's rounds in one cell: medians and min-max over rounds (shared with bench/fsdp_lab.py)."""
    times = [r["time_to_target"] for r in mine]
    reached = [r["steps_to_target"] for r in mine if r["reached"]]
    return {"load": mine[0]["load"], "target": mine[0]["target"], "reached": f"{len(reached)}/{len(mine)}",
            "tta_s": statistics.median(times), "tta_min": min(times), "tta_max": max(times),
            "tta_after_first_s": statistics.median(r.get("time_to_target_after_first", math.inf) for r in mine),
            "steady_step_s": statistics.median(r["steady_step_s"] for r in mine) if all(r.get("steady_step_s") for r in mine) else None,
            "left_race": sum(bool(r.get("left_race")) for r in mine),
            "steps_to_target": statistics.median(reached) if reached else None,
            "samples_s": statistics.median(r["samples_s"] for r in mine),
            "wire_MB": statistics.median(r["wire_bytes"] for r in mine) / 1e6,
            "final_loss": statistics.median(r["final_loss"] for r in mine)}


def summarise(rows: list[dict], picks: dict) -> list[dict]:
    """Per cell and contestant: medians and min-max over rounds; time-to-target ratios per round vs every PyTorch hook."""
    out = []
    for rate, workers, label, mine, by_round in per_contestant(rows):
        budget = [r.get("budget_loss") for r in mine]
        row = {"rate": rate, "workers": workers, "contestant": label, **race_summary(mine),
               "budget_loss": None if None in budget else statistics.median(budget),
               "pick": picks.get((rate, workers), {}).get("label") == label}
        add_ratios(row, by_round, label, "time_to_target", PEERS)
        out.append(row)
    fp32 = {(r["rate"], r["workers"]): r["steps_to_target"] for r in out if r["contestant"] == "ddp"}
    for row in out:  # what `netgain model --steps-from` reads: steps to target as a multiple of fp32's, in every round
        reached, rounds = row["reached"].split("/")
        row["codec"] = codec_name(row["contestant"])
        fp32_steps = fp32.get((row["rate"], row["workers"]))
        row["steps_ratio"] = row["steps_to_target"] / fp32_steps if reached == rounds and fp32_steps else None
    return out


def verdicts(summary: list[dict], picks: dict) -> list[str]:
    """Per cell: the fastest to target; netgain model's fixed codec and its recommendation (auto, which would run its
    forecast plan) against it, by the contestants that run them; and unresolved orders."""
    lines = []
    for (rate, workers), chosen in picks.items():
        cell = sorted((s for s in summary if (s["rate"], s["workers"]) == (rate, workers)), key=lambda s: s["tta_s"])
        if not cell:
            continue
        best, mine = cell[0], next((s for s in cell if s["contestant"] == chosen["label"]), None)
        fastest = f"{rate}, {workers} workers: fastest to target {best['contestant']} ({best['tta_s']:.1f} s)"
        if "predicted_step_s" not in chosen:  # an unshaped cell: no pick
            lines.append(fastest + ".")
        else:
            if mine is None:
                verdict = "it was not run"
            elif not math.isfinite(mine["tta_s"]):
                verdict = f"it did not reach the target (reached in {mine['reached']} rounds)"
            elif mine["tta_s"] <= WITHIN * best["tta_s"]:
                verdict = f"{mine['tta_s']:.1f} s, within 10% of the fastest"
            else:
                verdict = f"{mine['tta_s']:.1f} s, {mine['tta_s'] / best['tta_s']:.2f}x the fastest's time"
            lines.append(f"{fastest}; netgain model's fixed codec {chosen['codec']} ({chosen['label'] or 'no contestant'}; "
                         f"predicted step {chosen['predicted_step_s']:.3f} s, {chosen['predicted_speedup']:.2f}x fp32): "
                         f"{verdict}.")
        if "auto_forecast" in chosen:
            measured = [f"{s['contestant']} took {s['tta_s'] / best['tta_s']:.2f}x the fastest's time" for s in cell
                        if s["contestant"] in ("auto", chosen["auto_label"]) and math.isfinite(s["tta_s"])]
            lines.append(f"{rate}, {workers} workers: netgain model's recommendation: {chosen['auto_forecast']} "
                         f"Measured: {', '.join(measured) or 'no contestant runs it'}.")
        for a, b in zip(cell, cell[1:]):
            if math.isfinite(b["tta_s"]) and b["tta_min"] <= a["tta_max"]:
                lines.append(f"{rate}, {workers} workers: {a['contestant']} ({a['tta_s']:.1f} s) before "
                             f"{b['contestant']} ({b['tta_s']:.1f} s) is within the spread over rounds "
                             f"({a['tta_min']:.1f}-{a['tta_max']:.1f} vs {b['tta_min']:.1f}-{b['tta_max']:.1f} s).")
    return lines


def plot(rows: list[dict], summary: list[dict], path: Path, baseline: str = "fp32 DDP") -> None:
    """Per cell: time to target (bars) and validation loss vs time; `baseline`: whose loss at step T is the target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = list(dict.fromkeys((s["rate"], s["workers"]) for s in summary))
    fig, axes = plt.subplots(len(cells), 2, figsize=(15, 5 * len(cells)), squeeze=False)
    colors = dict(zip(dict.fromkeys(s["contestant"] for s in summary), plt.cm.tab20.colors))
    for (rate, workers), (bars, curves) in zip(cells, axes):
        mine = [s for s in summary if (s["rate"], s["workers"]) == (rate, workers)]
        for i, s in enumerate(mine):
            if math.isfinite(s["tta_s"]):
                high = s["tta_max"] if math.isfinite(s["tta_max"]) else s["tta_s"]
                bars.bar(i, s["tta_s"], color=colors[s["contestant"]], capsize=3,
                         yerr=[[s["tta_s"] - s["tta_min"]], [high - s["tta_s"]]])
            else:
                bars.text(i, 0, "not reached", rotation=90, ha="center", va="bottom")
        bars.set_xticks(range(len(mine)), [s["contestant"] for s in mine], rotation=60, ha="right")
        bars.set_ylabel("time to target, s (median, min-max)")
        bars.set_title(f"{rate}, {workers} workers: time to {baseline}'s validation loss at its step T")
        for r in (r for r in rows if (r["rate"], r["workers"]) == (rate, workers)):
            _, seconds, losses = zip(*r["curve"])
            curves.plot(seconds, losses, color=colors[r["label"]], alpha=0.8, lw=1,
                        label=r["label"] if r["round"] == 0 else None)
        curves.axhline(mine[0]["target"], color="k", ls="--", lw=0.8, label="target")
        curves.set_xlabel("training time (validations excluded), s")
        curves.set_ylabel("validation loss")
        curves.set_ylim(top=mine[0]["target"] + 0.6)
        curves.set_title(f"{rate}, {workers} workers: validation loss vs time, every round")
        curves.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def compute_note(chosen: dict, codec_cost: str) -> str:
    """How a pick's compute was timed (results before the slowdown was measured: alone)."""
    if "slowdown" not in chosen:
        return "timed here"
    charged = "codec cost calibrated alone at a worker's threads, and " if codec_cost == "calibrate" else ""
    return (f"timed with every worker computing at once, {chosen['slowdown']:.2f}x the step alone; "
            f"{charged}the link's per-message latency charged the same factor")


def write_data(out: Path, data: dict, summary: list[dict]) -> list[str]:
    """OUT.json (``data``) and OUT.csv (``summary``); returns the report's title and provenance lines."""
    from provenance import write_csv

    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(data, indent=1))
    write_csv(Path(f"{out}.csv"), summary, fieldnames=list(dict.fromkeys(k for s in summary for k in s)))
    meta = data["meta"]
    return [f"# {meta['title']}", "", f"Machine: {meta['machine']}; commit {meta['commit']}; command: `{meta['command']}`.",
            "Load average (1 min): " + ", ".join(f"{c} {v:.2f}" for c, v in meta["load"].items()) + "."]


def fmt(value, spec: str) -> str:
    """A report cell: empty for None, 'not reached' for an infinite time to target."""
    return "" if value is None else "not reached" if value == math.inf else format(value, spec)


def report(rows, summary, picks, meta, out: Path) -> None:
    head = write_data(out, {"meta": meta, "picks": list(picks.values()), "summary": summary, "rows": rows}, summary)
    plot(rows, summary, Path(f"{out}.png"))
    peers = [key for _, key in PEERS if any(key in s for s in summary)]
    lines = [*head,
             f"Model: byte-level Llama, hidden {meta['hidden']}, {meta['layers']} layers ({rows[0]['numel'] / 1e6:.2f} M "
             f"parameters), batch {meta['batch_size']} x {meta['seq_len']} bytes per worker, AdamW lr {meta['lr']}, "
             f"DDP buckets of {meta['bucket_mb']} MB; text: {meta.get('corpus') or STDLIB}, every 10th file "
             f"held out. Validation: {meta['eval_batches']} x {meta['eval_batch_size']} x {meta['seq_len']} held-out "
             f"bytes every {meta['eval_every']} steps. Target: fp32 DDP's validation loss at step {meta['target_step']} "
             + (f"(each round's own: round r trains from seed {meta['seed']} + r, batches and initial model)"
                if meta.get("seed_per_round") else "(round 0)") + f"; step cap {meta['cap']} x {meta['target_step']}. Up to {meta['rounds']} rounds per cell"
             f"{'' if meta['max_minutes'] is None else ' within ' + format(meta['max_minutes'], 'g') + ' minutes'}, contestants "
             f"interleaved within each (ddp first), each from the round's initial model; {meta['warmup']} untimed "
             "throwaway steps per contestant before round 0.",
             "Time to target: the sum of step times (barrier to optimizer step, the slowest rank's; validations excluded) up to the target's "
             "crossing, interpolated between the last validation above it and the first at or below it (steps to "
             "target likewise); median over rounds (min-max), 'not reached' counted as infinite. "
             "x HOOK: per-round ratio of the hook's time to target to the contestant's (> 1: sooner than the hook), "
             "median (min-max); 0.00: the contestant did not reach the target, inf: the hook did not. "
             "Samples/s, wire MB/step (mean over the steps trained), final validation loss: medians over rounds."
             + ("" if not meta.get("time_budget") else
                f" Every contestant trained on past the target (and past the step cap) to at least {meta['time_budget']:g} s "
                f"of training; val loss at {meta['time_budget']:g} s: the curve's, interpolated between the validations "
                "around it, median over rounds (empty where a round ended sooner: it left the race, or it was the ddp "
                "run that sets a round's target at step T). Samples/s, wire MB/step and the final loss then cover the "
                "steps after the target too, each contestant's final loss at its own end.")]
    if meta.get("targets"):
        lines += ["", f"Targets given (`--targets`, fp32 DDP's from an earlier run of this job): {meta['targets']}; "
                  f"ddp raced last. A contestant whose steady step (median of steps 1-{FIRST_STEPS}, slowest rank) was "
                  f"over {meta['leave_above']:g}x the cell's best so far (of per-step routes: local steps skip the link) "
                  f"left the race; its time to target is 'not reached'."]
    for (rate, workers), chosen in picks.items():
        mine = [s for s in summary if (s["rate"], s["workers"]) == (rate, workers)]
        if not mine:
            continue
        rounds = 1 + max(r["round"] for r in rows if (r["rate"], r["workers"]) == (rate, workers))
        targets = dict.fromkeys(f"{r['target']:.4f}" for r in rows if (r["rate"], r["workers"]) == (rate, workers)
                                and r["label"] == "ddp")  # one per round with --seed-per-round
        lines += ["", f"## {rate}, {workers} workers", "",
                  f"{rounds} rounds. Target {' / '.join(targets)}. netgain model's fixed codec, before the run: "
                  f"**{chosen['codec']}**"
                  + ("" if "predicted_step_s" not in chosen else
                     f" (predicted step {chosen['predicted_step_s']:.3f} s, {chosen['predicted_speedup']:.2f}x fp32) on "
                     f"{chosen['link']} ({chosen['link_note']}), compute {1e3 * chosen['compute_s']:.1f} ms per step "
                     f"({compute_note(chosen, meta['codec_cost'])}), codec cost {meta['codec_cost']}")
                  + (f"; by time to target with steps from {', '.join(chosen['steps_from'])} ({chosen['steps']:.3g}x fp32's)"
                     if chosen.get("steps") is not None else "") + ".", "",
                  f"| contestant | reached | time to target s (min-max) | without the first {FIRST_STEPS} steps | "
                  + " | ".join(PEER_TITLES[k] for k in peers)
                  + " | steps to target | steady step s | samples/s | wire MB/step | final val loss |"
                  + (f" val loss at {meta['time_budget']:g} s |" if meta.get("time_budget") else ""),
                  "|---|---|---|---|" + "---|" * len(peers) + "---|---|---|---|---|" + ("---|" if meta.get("time_budget") else "")]
        for s in mine:
            spread = "" if s["tta_s"] == math.inf else f" ({fmt(s['tta_min'], '.1f')}-{fmt(s['tta_max'], '.1f')})"
            left = f" (left the race {s['left_race']}x)" if s.get("left_race") else ""
            lines.append(f"| {s['contestant']}{' (pick)' if s['pick'] else ''} | {s['reached']}{left} | "
                         f"{fmt(s['tta_s'], '.1f')}{spread} | {fmt(s.get('tta_after_first_s'), '.1f')} | "
                         + " | ".join(format_ratio(s, k) for k in peers)
                         + f" | {fmt(s['steps_to_target'], '.1f')} | {fmt(s.get('steady_step_s'), '.3f')} | "
                         f"{s['samples_s']:.2f} | {s['wire_MB']:.3f} | {s['final_loss']:.4f} |"
                         + (f" {fmt(s.get('budget_loss'), '.4f')} |" if meta.get("time_budget") else ""))
    drifted = [f"{r['label']} (round {r['round']}, {r['rate']}, {r['workers']} workers)" for r in rows
               if r.get("replicas_agree") is False]
    lines += ["", "## Verdicts", ""] + [f"- {line}" for line in verdicts(summary, picks)]
    if any(r.get("replicas_agree") is not None for r in rows):  # (results from before the check have none)
        lines += [f"- **Replicas differed at the end** (parameter fingerprints across ranks): {', '.join(drifted)}." if drifted
                  else "- Replicas agreed at the end of every per-step run (parameter fingerprints across ranks)."]
    lines += ["", f"![time to target and validation loss vs time]({out.name}.png)"]
    Path(f"{out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", nargs="+", default=["50mbit", "100mbit", "1gbit"], help="lab egress rates per worker")
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--contestants", nargs="+", default=DEFAULT_CONTESTANTS, choices=list(CONTESTANTS),
                        help="ddp always runs (first): it sets the target")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--target-step", type=int, default=120, help="T: the target is fp32 DDP's loss at step T")
    parser.add_argument("--cap", type=int, default=3, help="train at most CAP x T steps")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--eval-batch-size", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3, help="untimed throwaway steps per contestant before round 0")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0, help="batches are a function of (seed, step, rank)")
    parser.add_argument("--seed-per-round", action="store_true",
                        help="round r trains from seed + r (batches and initial model) to its own ddp run's target: "
                             "the rounds sample steps to target over seeds, not only step times")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--corpus", help="the job's text: a file or a folder of files (default: the Python standard "
                        "library's source; a second job: apt-get install python3.11-doc, then "
                        "--corpus /usr/share/doc/python3.11/html/_sources)")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="DDP's bucket_cap_mb")
    parser.add_argument("--time-budget", type=float, metavar="SECONDS",
                        help="quality at equal time: every contestant trains on to at least SECONDS of training (past the "
                        "target and the step cap), and the report adds its validation loss at SECONDS")
    parser.add_argument("--max-minutes", type=float,
                        help="per cell, from its first round: start no round that would end later than this "
                        "(as long as the last one took; the report says how many ran)")
    parser.add_argument("--codec-cost", choices=("calibrate", "free"), default="calibrate",
                        help="netgain model's codec cost for the pick (its default on cpu: timed on this machine)")
    parser.add_argument("--steps-from", nargs="+", metavar="CSV",
                        help="earlier results (this script's CSV) whose steps to target the pick weighs, as "
                        "`netgain model --steps-from` does: by time to target among the codecs measured there")
    parser.add_argument("--report-from", type=Path, metavar="JSON",
                        help="only rewrite the report from an earlier run's JSON (md, csv, png beside it, and the "
                        "JSON itself with the summary recomputed)")
    parser.add_argument("--targets", type=float, nargs="+",
                        help="the target of each round (the last for later rounds), e.g. fp32 DDP's from an earlier run "
                        "of this job at the same workers and seeds: ddp then races last, and may leave the race")
    parser.add_argument("--leave-above", type=float, default=2.0,
                        help="a contestant whose steady step (median of its steps 1-10) is over this x the cell's best "
                        "so far leaves the race, reported by that step (fp32 DDP at 10 Mbit/s would take hours); a "
                        "per-step contestant leaves as soon as over half of those steps are over it")
    parser.add_argument("--quiet-wait", type=float, default=900,
                        help="seconds to wait for a load average below 1.0 before each cell (0: do not wait)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "time_to_accuracy")
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.cap < 1 or args.eval_every < 1 or args.target_step % args.eval_every:
        parser.error("--rounds, --cap and --eval-every must be >= 1, --target-step a multiple of --eval-every")
    if args.time_budget is not None and not 0 < args.time_budget < math.inf:
        parser.error(f"--time-budget must be a number of seconds > 0, got {args.time_budget}")
    if args.corpus and not args.worker:  # in the parent, before any worker starts
        from netgain import data

        try:
            data.text_files(args.corpus, "--corpus")
        except ValueError as error:
            parser.error(str(error))
    if args.worker:
        worker(args)
        return 0
    if args.report_from:
        saved = json.loads(args.report_from.read_text())
        picks = {(p["rate"], p["workers"]): p for p in saved["picks"]}
        report(saved["rows"], summarise(saved["rows"], picks), picks, saved["meta"], args.report_from.with_suffix(""))
        return 0
    from lab import parse_rate
    from netgain import models
    from provenance import git_commit, wait_for_quiet

    commit = git_commit()
    # ddp sets the target, so runs first; given the targets, it races last (it may leave the race)
    contestants = list(dict.fromkeys([*args.contestants, "ddp"] if args.targets else ["ddp", *args.contestants]))
    shapes = [tuple(p.shape) for p in models.byte_llama(args.hidden, args.layers, args.seq_len).parameters()]
    picks, compute, load = {}, {}, {"before the picks": wait_for_quiet(wait_s=args.quiet_wait)}
    for workers in args.workers:
        compute[workers], alone = measure_compute(args, workers)
        for rate in args.rates:
            # sharing the cores cannot speed a worker up: below 1 is noise (2 workers: 0.91-1.07)
            picks[(rate, workers)] = (UNSHAPED if parse_rate(rate) is None else  # "none", "unlimited"
                                      pick(rate, workers, args, shapes, compute[workers], max(1.0, compute[workers] / alone)))
            print(f"netgain model's pick for {rate}, {workers} workers: {picks[(rate, workers)]['codec']} "
                  f"(contestant {picks[(rate, workers)]['label']})", flush=True)
    rows = []
    for workers in args.workers:
        for rate in args.rates:
            chosen = picks[(rate, workers)]["label"]
            cell_contestants = contestants + ([chosen] if chosen and chosen not in contestants else [])
            cell, load[f"before {rate}, {workers} workers"] = lab_cell(
                Path(__file__), worker_flags(args, cell_contestants), rate, workers, timeout=4 * 3600,
                quiet_wait_s=args.quiet_wait)
            rows += cell
    meta = {"title": "Time to target validation loss on the lab: netgain codecs vs PyTorch's DDP hooks (interleaved)",
            "machine": machine(), "commit": commit, "command": "python " + " ".join(sys.argv), "load": load,
            "compute_s": compute, "codec_cost": args.codec_cost,
            **{k: getattr(args, k) for k in ("hidden", "layers", "batch_size", "seq_len", "lr", "rounds", "target_step",
                                             "cap", "eval_every", "eval_batches", "eval_batch_size", "warmup",
                                             "bucket_mb", "max_minutes", "time_budget", "seed", "seed_per_round", "targets",
                                             "leave_above", "corpus")}}
    report(rows, summarise(rows, picks), picks, meta, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
