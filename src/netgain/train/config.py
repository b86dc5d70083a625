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
    sync: bool = False  # --sync: no per-step hook; netgain.sync's outer steps every sync_period steps
    sync_period: int | None = None  # the SYNC_FIELDS: set under --sync only (None without it)
    sync_bits: int | None = None  # None also under --sync, for a codec without bits (none, fp16, bf16)
    outer_lr: float | None = None
    outer_momentum: float | None = None
    fragments: int | None = None
    overlap_steps: int | None = None
    local_route: bool = False  # --local-route: auto may take the route of local steps (netgain.sync.offer)

    def sync_config(self):
        """netgain.sync's config of these settings: Nesterov whenever there is outer momentum, as DiLoCo."""
        from netgain.sync import SyncConfig

        return SyncConfig(period=self.sync_period, codec=self.codec, bits=self.sync_bits, outer_lr=self.outer_lr,
                          outer_momentum=self.outer_momentum, nesterov=self.outer_momentum > 0,
                          fragments=self.fragments, overlap_steps=self.overlap_steps, seed=self.seed)

    def route(self) -> str:
        """How the workers' updates meet, in words (the summary's route row)."""
        if self.sync:
            bits = f" {self.sync_bits}-bit" if self.sync_bits else ""
            return (f"sync every {self.sync_period} steps: {self.codec}{bits} pseudo-gradients, outer lr "
                    f"{self.outer_lr:g}, momentum {self.outer_momentum:g}, {self.fragments} fragment(s), "
                    f"{self.overlap_steps} step(s) overlapped" + (", across replicas of FSDP2" if self.fsdp else ""))
        if self.fsdp:
            return "every step: FSDP2 in each replica, the codec across replicas" + (
                ", or local steps where auto's trial finds them sooner" if self.local_route else "")
        if self.local_route:
            return "every step: the codec on DDP's communication hook, or local steps where auto's trial finds them sooner"
        return "every step: the codec on DDP's communication hook"


SYNC_FIELDS = ("sync_period", "sync_bits", "outer_lr", "outer_momentum", "fragments", "overlap_steps")


def run_label(config: dict) -> str:
    """A run in one word (its default --out folder, --compare's rows): its codec; under --sync 'sync-h8-gqsgd-b4'."""
    if not config.get("sync"):
        return config["codec"]
    bits = f"-b{config['sync_bits']}" if config["sync_bits"] else ""
    return f"sync-h{config['sync_period']}-{config['codec']}{bits}"


def flag(name: str) -> str:
    """The command-line flag of a TrainConfig field: batch_size -> --batch-size."""
    return "--" + name.replace("_", "-")
