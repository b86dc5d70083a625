"""netgain.sync.offer: auto's route of local steps beside its per-step plans, on 2 gloo ranks, and as
`netgain train --local-route`.

The per-step plan's measured price is set by hand (`settled_price`), so the route's choice is the test's:
infinite, local steps win their trial; zero, the per-step plan wins it. Data are seeded by (rank, step) and
the codecs' noise is counter-based, so every number is the same in every run.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import netgain.comm as comm
from netgain import cli
from netgain.comm.adaptive import TIE, WARM_STALL_S
from netgain.sync import ROUTE, ROUTE_FORMAT, ROUTE_TRIAL_SYNCS, SyncConfig, SyncOptimizer, offer, route_wins
from netgain.train.cli import build_config
from netgain.train.report import summarize

from distributed import mse_step, run, shard_state, sharded_mlp

TRIAL = ROUTE_TRIAL_SYNCS * ROUTE.period + ROUTE.overlap_steps  # the trial's inner steps


def _routed(seed, price, predicted=0.0):
    """auto offered the route, its per-step plan priced ``price`` and the route ``predicted`` by hand."""
    torch.manual_seed(seed)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = comm.register(model, "auto", min_compress_numel=0)
    state.planner.settled_price = lambda: price
    route = offer(state, model, optimizer)
    route._predicted = lambda: predicted
    return model, optimizer, route


def _steps(model, optimizer, route, rank, start, steps):
    """Train; each step's (phase, whether the hook ran (a local step skips DDP's reducer), this rank's parameters,
    whether the route's codec ran eagerly (None while per-step))."""
    out = []
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
        optimizer.zero_grad()
        hooked = route.state.step
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        assert (route.last_step.get("plan") == "local") == (route.state.step == hooked)
        out.append((route.phase, route.state.step > hooked,
                    torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                    None if route.sync is None else route.sync.eager))
    return out


def _gathered(params):
    every = [torch.empty_like(params) for _ in range(dist.get_world_size())]
    dist.all_gather(every, params)
    return all(torch.equal(every[0], p) for p in every)


def chosen(rank, world_size):
    """The route with the per-step plan priced infinite (local wins), near zero (per-step wins), with the route
    predicted beyond TRIAL_RANGE of it (no trial), local winning while a kernel compiles for one more step
    (reported by a stand-in for `_compiling`: its first check not clear), and local winning where its eager averages
    have already cost WARM_STALL_S (as a long trial's would)."""
    out = {}
    for case, price, predicted in (("local", float("inf"), 0.0), ("per-step", 1e-9, 0.0), ("no trial", 1.0, 10.0),
                                   ("compiling", float("inf"), 0.0), ("paid", float("inf"), 0.0),
                                   ("repaid", 1.0, 0.8), ("within the tie", 1.0, 0.96)):
        model, optimizer, route = _routed(0, price, predicted)
        if case in ("repaid", "within the tie"):
            route._leave_s = lambda: (1.0 / (1 + TIE) - 0.8) * 3.5
        if case == "paid":
            route._rent = WARM_STALL_S
        if case == "compiling":
            answers = iter([True])
            route._compiling = lambda: next(answers, False)
        try:
            steps = _steps(model, optimizer, route, rank, 0, 1 + TRIAL + 6)
            if case == "local":
                route.state.planner.monitor.predict_s = lambda collective, payload_bytes, world_size: payload_bytes
                out["leave bytes"] = route._leave_s()
        finally:
            route.close()
        out[case] = {"phases": [phase for phase, *_ in steps], "sent": [sent for _, sent, *_ in steps],
                     "equal": [_gathered(params) for _, _, params, _ in steps], "eager": [e for *_, e in steps],
                     "warmed": route._warmed}
    return out


def test_the_route_runs_a_trial_and_keeps_local_steps_or_the_per_step_plan():
    """Step 0 is per-step (its plan settled by hand); steps 1..TRIAL are the trial: each rank keeps its own gradient
    (replicas differ) but after each applied average (period 8, one step on the wire: steps 9, 17), when every
    replica holds the average. Local steps then stay (price infinite), or the per-step plan runs again from that
    average, replicas equal at every step and the hook sending every step (price near zero). A route the model
    prices beyond TRIAL_RANGE x the per-step plan runs no trial. The trial runs the route's codec eagerly and
    compiles nothing; once it wins, the codec stays eager until its eager averages have cost WARM_STALL_S (far more
    than this small model's take), and its kernels are warmed then; never where it loses or runs no trial. Where a
    kernel still compiles when the route is chosen, the trial starts once none does (a step later here).

    Short of TRIAL_RANGE below, the trial waits until the saving the model prices beyond the tie, over the steps run
    so far, repays leaving (here after 4 steps); a route priced within the tie runs none. Leaving is priced on
    AdamW's moments in bf16 and its step counts in fp32."""
    results = run(chosen, 2)
    assert all(status == "ok" for status, _ in results), results
    for _, value in results:
        local, per_step, untried = value["local"], value["per-step"], value["no trial"]
        assert local["phases"][:TRIAL] == ["trial"] * TRIAL  # the phase after each step: entered after step 0
        assert local["phases"][TRIAL:] == ["local"] * (len(local["phases"]) - TRIAL)
        applied = {s for s in range(ROUTE.period + 1, len(local["phases"])) if s % ROUTE.period == ROUTE.overlap_steps}
        assert {s for s, equal in enumerate(local["equal"]) if equal} == {0} | applied
        assert local["sent"][0] and not any(local["sent"][1:])  # the hook ran at step 0 only
        assert per_step["phases"][TRIAL:] == ["per-step-chosen"] * (len(per_step["phases"]) - TRIAL)
        assert all(per_step["equal"][TRIAL:]) and all(per_step["sent"][TRIAL + 1:])
        assert untried["phases"] == ["per-step-chosen"] * len(untried["phases"]) and all(untried["equal"])
        assert all(local["eager"]) and not local["warmed"]  # its eager averages have not cost a compile's stall
        paid = value["paid"]
        assert paid["eager"][:TRIAL - 1] == [True] * (TRIAL - 1) and not any(paid["eager"][TRIAL:]) and paid["warmed"]
        assert not per_step["warmed"] and not untried["warmed"]
        waited = value["compiling"]["phases"]
        assert waited[0] == "per-step" and waited[1:1 + TRIAL] == ["trial"] * TRIAL, waited
        repaid = value["repaid"]["phases"]
        assert repaid[:3] == ["per-step"] * 3 and repaid[3:3 + TRIAL] == ["trial"] * TRIAL, repaid  # on the 4th step
        assert value["within the tie"]["phases"] == ["per-step"] * (1 + TRIAL + 6)
        params = 8 * 16 + 16 + 16 * 4 + 4
        assert value["leave bytes"] == 2 * 2 * params + 4 * 4  # exp_avg, exp_avg_sq in bf16; 4 step counts in fp32


def waited(rank, world_size):
    """A trial whose averages keep every third step waiting 50 ms (a slow link): each step's time, from the last
    step's hook's end, leaves its own wait out, so none is negative (counted against the next step, one was)."""
    real = SyncOptimizer.after_inner_step

    def slow(sync):
        real(sync)
        if sync.inner_steps % 3 == 0:
            time.sleep(0.05)
            sync.wait_s += 0.05

    SyncOptimizer.after_inner_step = slow
    model, optimizer, route = _routed(0, float("inf"))
    try:
        _steps(model, optimizer, route, rank, 0, TRIAL)
    finally:
        route.close()
    return {"times": route._times, "waits": route._waits}


def test_a_trial_step_time_leaves_its_own_wait_for_an_average_out():
    for status, value in run(waited, 2):
        assert status == "ok", value
        assert min(value["times"]) >= 0 and sum(w >= 0.05 for w in value["waits"]) >= 3, value


def early(rank, world_size):
    """The per-step plan not settled, the route priced to win against its cheapest price (best_price): a trial at once. Where
    the route wins it (cheapest priced infinite), local steps; where it loses (priced near zero), per-step steps until
    the plan is settled (by hand, 3 steps after the trial), then its price against the trial's, no second trial. The
    route priced no cheaper, cheaper within the tie (the trial would cut the per-step plan's own trials short for a
    gamble), or no cheapest price yet (the link not measured at volume): no trial."""
    out = {}
    for case, best, settled, predicted in (
            ("local", float("inf"), None, 0.0), ("lost, then local", 1e-9, float("inf"), 0.0),
            ("lost, then per-step", 1e-9, 1e-9, 0.0), ("no cheaper", 0.0, None, 0.0),
            ("within the tie", (1 + TIE / 2) * 0.1, None, 0.1), ("unmeasured", None, None, 0.0)):
        model, optimizer, route = _routed(0, None, predicted)
        asked = []

        def settled_price(route=route, asked=asked, settled=settled):
            asked.append(route._measured)
            return settled if sum(asked) >= 3 else None

        route.state.planner.best_price = lambda payload_bytes, world_size, best=best: best
        route.state.planner.settled_price = settled_price
        try:
            steps = _steps(model, optimizer, route, rank, 0, TRIAL + 6)
        finally:
            route.close()
        out[case] = {"phases": [phase for phase, *_ in steps], "sent": [sent for _, sent, *_ in steps],
                     "equal": [_gathered(params) for _, _, params, _ in steps]}
    return out


def test_a_route_priced_to_win_against_every_per_step_plan_runs_its_trial_before_they_settle():
    lost = ["trial"] * TRIAL + ["per-step"] * 3  # the trial's last step left it; settled at the third step after
    for status, value in run(early, 2):
        assert status == "ok", value
        assert value["local"]["phases"] == ["trial"] * TRIAL + ["local"] * 6, value
        assert value["lost, then local"]["phases"] == lost + ["local"] * 3, value
        assert value["lost, then per-step"]["phases"] == lost + ["per-step-chosen"] * 3, value
        for case in ("lost, then local", "lost, then per-step"):  # per-step again: the hook sends, replicas equal
            assert all(value[case]["sent"][TRIAL + 1:TRIAL + 4]) and all(value[case]["equal"][TRIAL:TRIAL + 4]), value
        for case in ("no cheaper", "within the tie", "unmeasured"):
            assert value[case]["phases"] == ["per-step"] * (TRIAL + 6) and all(value[case]["sent"]), value


def fsdp_routed(rank, world_size, path):
    """auto under FSDP2 on a 2 x 2 (replicate x shard) mesh offered the route; shard position 0's per-step plan
    priced infinite (its replicas go local), position 1's near zero (per-step again after the trial): each step's
    phase and whether this shard's replicas hold the same parameters. Then a DCP checkpoint (model, optimizer,
    route) mid-period, 3 more steps, the checkpoint loaded (the route after the model and optimizer) and the 3 steps
    again: whether every rank's shards and optimizer state came out bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import netgain.comm.fsdp as fsdp
    mesh, model, optimizer = sharded_mlp()
    state = fsdp.register(model, mesh, min_compress_numel=0)
    shard = mesh.get_local_rank("shard")
    state.planner.settled_price = lambda: float("inf") if shard == 0 else 1e-9
    route = offer(state, model, optimizer)
    route._predicted = lambda: 0.0
    phases, equal = [], []

    def step(t):
        mse_step(model, optimizer, optimizer, rank, t)

    try:
        for t in range(1 + TRIAL + 6):
            step(t)
            phases.append(route.phase)
            local = torch.cat([p.detach().to_local().reshape(-1) for p in model.parameters()])
            every = [None] * world_size
            dist.all_gather_object(every, local)  # over the world: the replicate group carries the route's averages
            equal.append(torch.equal(every[rank], every[(rank + 2) % 4]))  # the other node's rank of this shard
        # position 1's per-step plan stays as it is: a re-plan on a timed move of the link would differ between runs
        state.planner._link_moved = lambda: False
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state, "route": route}, checkpoint_id=path)
        for t in range(1 + TRIAL + 6, 1 + TRIAL + 9):
            step(t)
        first = shard_state(model, optimizer)
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        fsdp.load_checkpoint(state, path)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        fsdp.load_checkpoint({"route": route}, path)
        for t in range(1 + TRIAL + 6, 1 + TRIAL + 9):
            step(t)
        resumed = all(torch.equal(a, b) for a, b in zip(first, shard_state(model, optimizer))) and route.phase == phases[-1]
    finally:
        route.close()
    return {"shard": shard, "phases": phases, "equal": equal, "resumed": resumed}


def test_under_fsdp2_each_shard_positions_replicas_take_the_route_or_not(tmp_path):
    """Under FSDP2 the route's average crosses the replicate group, shard by shard, and each shard position
    chooses for itself (as its per-step plans do): position 0's replicas step alone, equal only once an
    average is applied; position 1's are per-step again after the trial, equal at every step; no rank waits on
    another's choice. A DCP checkpoint resumes every rank bit for bit, each position in its own phase."""
    for status, value in run(fsdp_routed, 4, str(tmp_path / "ckpt"), timeout=150):
        assert status == "ok", value
        local = value["shard"] == 0
        after = "local" if local else "per-step-chosen"
        assert value["phases"] == ["trial"] * TRIAL + [after] * 7, value
        applied = {s for s in range(ROUTE.period + 1, TRIAL + 7) if s % ROUTE.period == ROUTE.overlap_steps}
        expected = {0} | applied | (set() if local else set(range(TRIAL, TRIAL + 7)))
        assert {s for s, same in enumerate(value["equal"]) if same} == expected, value
        assert value["resumed"], value


def resumed(rank, world_size, path):
    """Local steps, a save of rank 0's route state mid-period (on trial), more steps (local by then); a fresh run
    loads it and trains the same. The run that went on, its eager averages' cost a compile's by then (compiled while
    local), loads it too, into the SyncOptimizer it kept: eager again, as on trial."""
    saved_at, more = 1 + ROUTE.period + 3, 10
    model, optimizer, route = _routed(0, float("inf"))
    route._rent = WARM_STALL_S
    try:
        _steps(model, optimizer, route, rank, 0, saved_at)
        state = route.state_dict()
        if rank == 0:
            torch.save({"route": state, "model": model.module.state_dict()}, path)
        dist.barrier()
        first = _steps(model, optimizer, route, rank, saved_at, more)
        went_on = route.phase, route.sync.eager
        route.load_state_dict(torch.load(path, weights_only=True)["route"])
        reloaded = route.phase, route.sync.eager
    finally:
        route.close()
    again, optimizer, route = _routed(1, float("inf"))  # another initialisation: the checkpoint replaces it
    try:
        saved = torch.load(path, weights_only=True)
        again.module.load_state_dict(saved["model"])
        route.load_state_dict(saved["route"])
        loaded = route.sync.eager
        second = _steps(again, optimizer, route, rank, saved_at, more)
        try:
            route.load_state_dict({"format": "x"})
            refused = "no error"
        except ValueError as error:
            refused = str(error)
    finally:
        route.close()
    return {"phase": state["phase"], "same": all(a[0] == b[0] and torch.equal(a[2], b[2]) for a, b in zip(first, second)),
            "refused": refused.startswith("not a netgain route state"), "eager": (went_on, reloaded, loaded)}


def test_a_resume_of_the_route_from_rank_zeros_checkpoint_is_bit_for_bit(tmp_path):
    for status, value in run(resumed, 2, str(tmp_path / "route.pt")):
        assert status == "ok", value
        assert value == {"phase": "trial", "same": True, "refused": True,
                         "eager": (("local", False), ("trial", True), True)}, value


def test_the_route_wins_only_beyond_a_tie():
    """The route's measured price must beat the per-step plan's by more than TIE: within it, a tie, and the per-step
    plan, whose steps to the target are surer, runs on."""
    assert route_wins(0.1, 0.2) and route_wins(0.1, (1 + TIE) * 0.1 * 1.001)
    assert not route_wins(0.150, 0.152) and not route_wins(0.1, (1 + TIE) * 0.1) and not route_wins(0.2, 0.1)


def test_offer_explains_what_it_needs():
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    auto = comm.CommState("auto")
    with pytest.raises(ValueError, match="adds a route to auto's plans"):
        offer(comm.CommState("gqsgd"), model, optimizer)
    with pytest.raises(ValueError, match="fragments=1 and mix=0"):
        offer(auto, model, optimizer, SyncConfig(period=8, fragments=2))
    with pytest.raises(ValueError, match="measured for netgain.sync.ROUTE only"):
        offer(auto, model, optimizer, SyncConfig(period=16))
    with pytest.raises(ValueError, match="steps must be a number > 0"):
        offer(auto, model, optimizer, SyncConfig(period=16), steps=0)
    with pytest.raises(TypeError, match="needs the DistributedDataParallel model"):
        offer(auto, model, optimizer)


def _config(*argv: str):
    return build_config(cli.build_parser("train").parse_args(["train", *argv]))


@pytest.mark.parametrize("argv, named", [(["--codec", "gqsgd"], "is a route of --codec auto, not of --codec gqsgd"),
                                         (["--sync"], "is a route of --codec auto, not of --sync")])
def test_local_route_is_a_route_of_auto_in_netgain_train(argv, named):
    with pytest.raises(ValueError, match=f"--local-route {named}"):
        _config("--local-route", *argv)


def test_netgain_train_offers_the_route_and_resumes_it(tmp_path):
    """`netgain train --local-route`: the checkpoint's comm state is the route's and resumes; a resume without
    the flag is refused by name."""
    common = ["--task", "digits", "--local-route", "--eval-every", "0", "--world-size", "2"]
    # saved at step 2: per-step still, or on an early trial where the model priced the route below every per-step plan
    assert cli.main(["train", *common, "--steps", "2", "--checkpoint", str(tmp_path / "ck.pt"),
                     "--out", str(tmp_path / "first")]) == 0
    saved = torch.load(tmp_path / "ck.pt", weights_only=True)
    assert saved["comm"]["format"] == ROUTE_FORMAT and saved["comm"]["phase"] in ("per-step", "trial")
    assert cli.main(["train", *common, "--steps", "6", "--resume", str(tmp_path / "ck.pt"),
                     "--out", str(tmp_path / "second")]) == 0
    record = json.loads((tmp_path / "second" / "record.json").read_text())
    assert record["resumed"]["step"] == 2 and "local steps where auto's trial" in record["summary"]["route"]
    with pytest.raises(ValueError, match="ck.pt was written with --local-route, this run is without it"):
        _config("--task", "digits", "--resume", str(tmp_path / "ck.pt"))


def test_the_summary_of_a_run_that_went_local_prices_fp32_on_the_last_timed_buckets():
    """Local steps time no bucket (DDP's reducer is off): fp32's predicted step comes from the last step that
    timed one, and their bytes count against what fp32 DDP sends each step."""
    buckets = [{"numel": 1000, "codec": "fp16", "wire_bytes": 2000, "comm_s": 1e-3}]
    history = {"step": [0, 1, 2, 3], "step_s": [0.1] * 4, "compiled": [False] * 4, "wait_s": [0.01, 0.01, 0.0, 0.03],
               "wire_bytes": [2000, 2000, 0, 500], "raw_bytes": [4000] * 4, "buckets": [buckets, buckets, [], []],
               "train_loss": [2.0] * 4}
    config = _config("--task", "digits", "--steps", "4", "--local-route")
    result = summarize(config, 2, history, [{"step": 4, "val_loss": 1.0}], torch.nn.Linear(2, 2))
    assert result["wire_bytes_per_step"] == pytest.approx(2500 / 3) and result["predicted_fp32_step_s"] > 0
