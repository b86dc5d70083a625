"""The settings of one `netgain train` run, as the parent checked them and every worker receives them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainConfig:
    task: str
    codec: str
    bits: int
    encoding: str
    ratio: float
    warmup_steps: int
    skip_1d: bool
    rank: int
    factors: str
    comm_budget_ms: float | None
    replan_every: int | None  # None: the planner's own default
    kimad_lowrank_rank: int | None
    steps: int
    batch_size: int
    lr: float
    world_size: int
    fsdp: bool
    replicas: int | None  # --fsdp only: the mesh's (replicate, shard) sizes, world_size = replicas * shards
    shards: int | None
    seed: int
    data: str | None
    eval_every: int
    out: str
    checkpoint: str | None
    checkpoint_every: int
    resume: str | None
    hidden_size: int
    layers: int
    seq_len: int
    collective_timeout: float
    emulate_link: str | None = None  # a rate ('100mbit'): every collective held until its bytes crossed it
    compare: bool = False  # then also run ddp and ddp-powersgd on the same job, and compare
    run_id: str = ""  # set by prepare_outputs: the id in --out's marker (files.RUN_MARKER), rank 0's only


def flag(name: str) -> str:
    """The command-line flag of a TrainConfig field: batch_size -> --batch-size."""
    return "--" + name.replace("_", "-")
