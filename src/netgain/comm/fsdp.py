"""netgain codecs on the slow hop of hybrid sharding: FSDP2 shards inside a node, the codec crosses nodes.

    mesh = init_device_mesh("cuda", (nodes, gpus_per_node), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    state = netgain.comm.fsdp.register(model, mesh)  # auto; or a codec: GlobalQSGDConfig(bits=8), "lowrank", ...

Why the shard sub-mesh, not the 2-D mesh: with native HSDP, torch 2.13's FSDP2 runs its own
all-reduce across replicas and calls the all-reduce hook only with that result, and
`set_requires_all_reduce(False)` skips the hook as well (`_fsdp_collectives.foreach_reduce`). So
FSDP reduce-scatters inside a replica (the fast link), and `set_all_reduce_hook` hands each
parameter group's reduce-scatter output to this module, which all-reduces it across the
mesh's "replicate" dimension through the codec, in place, before FSDP views it as the sharded
gradients. This is the pattern torchft uses.

The group's flat output is one bucket of the DDP pipeline (bucket.py): the same header
(global per-parameter scales, the non-finite flag and the plan signature in one allreduce MAX),
codecs and per-step statistics. FSDP views the output as the sharded gradients right after the hook
returns, but reads them only at the backward's end where it divides nothing after the hook, casts
nothing and accumulates nothing (`FSDPCommState._unread`): there the hook starts the group's average on
the pipeline's thread and returns, so it crosses the link while the backward and the next groups'
reduce-scatters go on, and the step's end waits for it (`overlap`, the default). Elsewhere the hook
holds the backward until the group's average is done, and so does a planner's step that samples the
link (a first step, an error measurement, an agreement): its link samples need each group's collectives alone on
the link (every step overlapped on the lab at 50 Mbit/s, auto read 232 kB payloads in 12 ms beside 48-byte
headers waiting 20-45 ms for a peer still in its backward, fitted an infinite rate and sent fp32 for 8
steps). auto's steps that sample no link (`Planner.observes`: a settled plan's, 9 of every AGREE_EVERY, and a trial's
but its error measurement) overlap and go unobserved (`_overlaps`): held, auto's hook held the backward 0.05-0.24 s
a step at 50 Mbit/s where fixed low rank, overlapped, held none (bench/results/fsdp_lab_tta_50mbit_deec9c3.md).

The hook's process group is this rank's replicate group: the ranks that hold the same shard. auto,
kimad and kimad+ run the DDP hook's planner (adaptive.py) on it: each shard position prices and plans
its own buckets (its shard of each FSDP group) from what its replicas agree, so shard positions may run
different plans, as their shards differ. A step ends when autograd finishes the backward (a queued
final callback), once per backward on every rank; there the planner ends its step on the replicate
group (but in a local step of auto's route, netgain.sync.offer, which averages nothing), and then one
allreduce MAX over the shard group tells every rank whether any shard position's
replicas failed (NaN/Inf, a plan mismatch): a failure raises on every rank of the mesh, so no replica
steps while another stops. A failed replicate group's later buckets send nothing until then, while
FSDP's reduce-scatters go on, so every rank reaches the step's end. The statistics' wait_s is the time
the step waited for the buckets (held in the hook, or at the step's end for those started), and
backward_s (kimad's default budget) the backward's time without it; the planner's link time is its own collectives', not FSDP's inside the node.

FSDP2 shards each parameter on one dimension, so this rank's padded shard of a weight is itself a
matrix, the same shard on every replica: low rank runs on it across the replicas, its residual
this rank's own and its warm start the shard's, as under DDP; EF21 (top-k, random-k) likewise.
The state checkpoints through DCP as DTensors over the mesh, each shard position's planner in its
header (`FSDPCommState.state_dict`).
"""

from __future__ import annotations

import json
import pickle

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.autograd import Variable
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard

from .codecs import NonFiniteGradientError, PlanMismatchError
from .config import CODEC_NAMES, CommConfig, comm_config
from .feedback import EF21, LowRankMemory
from .fused import Segments, name_key
from .hooks import CommState, check_saved
from .store import BucketLayout

REPLICATE, SHARD = "replicate", "shard"
FORMAT = "netgain.comm.fsdp/1"
CODECS = CODEC_NAMES  # every codec and planner runs on the cross-replica hop
# a step's verdict, one code per shard position (allreduce MAX: the most specific failure wins): what the ranks
# whose own replicas did not fail raise
FAILURES = (None, RuntimeError, NonFiniteGradientError, PlanMismatchError)


class FSDPCommState(CommState):
    """The DDP pipeline's state, fed by FSDP2's all-reduce hook: one job per parameter group per step.

    A step ends when autograd finishes the backward (a queued final callback), so `last_step`
    and `history` hold the same statistics as under DDP, with one record per FSDP group, and a
    planner's (auto, kimad, kimad+) per shard position: see the module's docstring.

    Each group's layout carries its parameters' padded shard shapes, so low rank runs on each shard
    matrix across the replicas, and every codec's memory (low rank's residual and warm start, EF21's
    g_i and g) is this rank's shard's, kept by name as under DDP. `state_dict()` is a
    torch.distributed.checkpoint Stateful: see there.
    """

    def __init__(self, config: CommConfig, *, mesh: DeviceMesh, param_names: dict[int, str], overlap: bool = True):
        super().__init__(config, process_group=mesh.get_group(REPLICATE), param_names=param_names)
        self.mesh, self.overlap = mesh, overlap
        self._overlapping = False  # this step's groups cross the link while the backward goes on (`_overlaps`)
        self.shard_group = mesh.get_group(SHARD)  # this rank's replica: one rank of each shard position
        self.shard, self.shards = mesh.get_local_rank(SHARD), mesh[SHARD].size()
        self._groups: dict[int, list] = {}  # group index -> its FSDPParams, in FSDP's order
        self._param_groups: dict[int, object] = {}  # group index -> its FSDPParamGroup
        self._flat_layouts: dict[int, tuple[tuple, BucketLayout]] = {}
        self._in_step = False
        self._failure: Exception | None = None  # this step's error on this replicate group, raised at its end
        self._device = torch.device("cpu")  # of the flat outputs: where the step's verdict is agreed
        self.local = False  # the replicas step alone (auto's route of local steps, netgain.sync.offer): no average

    def reduce(self, index: int, flat: torch.Tensor) -> None:
        """Replace ``flat`` (one group's reduce-scatter output) by its mean over the replicas.

        A failure of the pipeline (NaN/Inf, a plan mismatch: the same on every replica of this shard) is held
        and raised at the backward's end on every rank (`_close_step`); this replicate group's later buckets
        send nothing meanwhile, and FSDP goes on with the step's reduce-scatters, which every rank runs.
        While ``local``, ``flat`` stays this replica's own (FSDP2 calls the hook even where
        set_requires_all_reduce(False) is set, on a 1-D shard mesh), and the step's end only exchanges verdicts:
        another shard position's replicas may be on a per-step plan."""
        first = not self._in_step
        if first:
            self._in_step = True
            Variable._execution_engine.queue_callback(self._close_step)  # runs after FSDP's own
        self._device = flat.device
        if self.local:
            return
        try:
            layout = self._flat_layout(index, flat)
        except Exception:  # this rank's own (a parameter without a gradient): raised now
            self._in_step, self._jobs, self._started = False, [], []  # autograd skips final callbacks once a backward raises
            raise
        if self._failure is None:
            if self.pipeline is None:
                self._start(side_stream=self.overlap)
            if first:
                self._overlapping = self._overlaps()
            try:
                if self._overlapping and self._unread(index, flat):
                    self.start_flat(index, flat, layout)
                else:
                    self.reduce_flat(index, flat, layout)
            except Exception as error:
                self._failure = error

    def _overlaps(self) -> bool:
        """Whether this step's groups may cross the link while the backward goes on (`overlap`): with a fixed codec
        every step; under a planner one whose collectives are no samples of the link (`Planner.observes`: auto's
        settled and trial steps but its agreements, error measurements and first steps), which then go unobserved,
        as they share the link and the cores with the backward: the held steps sample the link, each group's
        collectives alone."""
        if self.planner is None or not self.overlap:
            return self.overlap
        overlaps = not self.planner.observes(self.step)
        if overlaps:
            self.pipeline.communicator.observer = None
        else:
            self.planner.attach(self.pipeline.communicator)
        return overlaps

    def _unread(self, index: int, flat: torch.Tensor) -> bool:
        """Whether FSDP leaves ``flat`` unread until the backward's end, so its average may cross the link while
        the backward goes on (`start_flat`): FSDP divides nothing after the hook (fp32 or bf16 reduced with its
        average op), views the output as the sharded gradients without a cast (reduced in the parameters' dtype),
        and neither adds it to a gradient already there (accumulation), copies it to the CPU (offload), nor
        hands it to a post-accumulate-grad hook (torch 2.13's `foreach_reduce`)."""
        group = self._param_groups[index]
        return (flat.dtype in (torch.float32, torch.bfloat16) and not group.force_sum_reduction_for_comms
                and group._orig_dtype in (None, flat.dtype)
                and not any(p.sharded_param.grad is not None or p.offload_to_cpu
                            or getattr(p.sharded_param, "_post_accumulate_grad_hooks", None) for p in group.fsdp_params))

    def _close_step(self) -> None:
        """The backward's end: statistics and the planner's end of step (on the replicate group; none while
        ``local``), then every shard position's verdict in one allreduce MAX over the shard group
        (`raise_on_every_shard`); raises any failure on every rank."""
        self._in_step = False
        error, self._failure = self._failure, None
        try:
            if not self.local:
                self.end_step()
        except Exception as failed:  # the planner's agreement (a plan mismatch): the same on every replica
            error = error or failed
        raise_on_every_shard(error, self.shard_group, self._device, f"netgain.comm.fsdp step {self.step - 1}")

    def fail(self, error: Exception) -> None:
        """Hold ``error``, this shard position's replicas' own (the route's average of local steps), to raise at the
        next backward's end on every rank of the mesh, with the step's verdict."""
        self._failure = self._failure or error

    def _flat_layout(self, index: int, flat: torch.Tensor) -> BucketLayout:
        """Each group's layout, built once: its parameters' padded shards tile the flat output."""
        key = (flat.numel(), flat.device)
        cached = self._flat_layouts.get(index)
        if cached is None or cached[0] != key:
            cached = self._build_layout(index, flat.device)
            if cached[0] != key:
                raise RuntimeError(f"FSDP group {index}: its reduce-scatter output has {flat.numel()} elements, its "
                                   f"trainable parameters {cached[0][0]}: a parameter got no gradient this step; call "
                                   "model.set_reduce_scatter_unused_params(True) so every rank sends the same layout")
            self._flat_layouts[index] = cached
        return cached[1]

    def _build_layout(self, index: int, device: torch.device) -> tuple[tuple, BucketLayout]:
        """(its key, the layout) of group ``index``'s trainable parameters. A padded shard is a row-major
        block of the flat output, of the same shape on every rank (low rank's matrices)."""
        params = [p for p in self._groups[index] if p.sharded_param.requires_grad]
        shapes = [tuple(p.padded_sharded_param_size) for p in params]
        sizes = [p.padded_sharded_param_size.numel() for p in params]
        names = [self.name_of(p.sharded_param) for p in params]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        exact = [torch.arange(o, o + k, device=device) for o, k, shape in zip(offsets, sizes, shapes)
                 if self.config.skip_1d and len(shape) <= 1]
        layout = BucketLayout(names, list(zip(offsets, sizes)),
                              Segments.build(sizes, [name_key(n) for n in names], device),
                              torch.cat(exact) if exact else None, shapes=shapes)
        return (sum(sizes), device), layout

    def _group_layouts(self) -> list[BucketLayout]:
        """Every group's layout in group order, built now where no step has built it yet."""
        for index, params in self._groups.items():
            if index not in self._flat_layouts and any(p.sharded_param.requires_grad for p in params):
                self._flat_layouts[index] = self._build_layout(index, params[0].sharded_param.device)
        return [self._flat_layouts[index][1] for index in sorted(self._flat_layouts)]

    def _memories(self) -> "list[EF21 | LowRankMemory]":
        """Every group's codec memory in group order (made now, as the first step would, where none is yet);
        none for the stateless codecs."""
        codec = self.chooser.memory_codec
        if codec is None:
            return []
        return [self.store.feedback_for(layout, layout.segments.sizes.device, codec)
                for layout in self._group_layouts()]

    # ---- checkpoints: a torch.distributed.checkpoint Stateful --------------------------------------
    def state_dict(self) -> dict:
        """``header``: step, config, mesh and parameter names as one JSON string (what `load_checkpoint`
        checks before it loads a tensor), and with a planner each shard position's planner state (``chooser``,
        gathered over the shard group: collective). With a codec that keeps memory, ``local``: every rank's own part
        (the error feedback), a (replicate, shard, numel) DTensor of which each rank holds its entry; and
        ``shared``: what the replicas of a shard hold alike (low rank's warm start, EF21's g), a (shard,
        numel) DTensor replicated over the replicas. DCP writes each piece once and loads each rank's own."""
        header = self._header()
        if self.planner is not None:
            header["chooser"] = self._planners()
        state = {"header": json.dumps(header)}
        memories = self._memories()
        if memories:
            local = torch.cat([memory.local for memory in memories]).view(1, 1, -1)
            shared = torch.cat([memory.shared for memory in memories]).view(1, -1)
            state["local"] = DTensor.from_local(local, self.mesh, [Shard(0), Shard(1)], run_check=False)
            state["shared"] = DTensor.from_local(shared, self.mesh, [Replicate(), Shard(0)], run_check=False)
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict()` returned (loaded in place by DCP); ValueError as `check_header`."""
        header = self.check_header(state.get("header"))
        if self.planner is not None:
            saved = header.get("chooser")
            if not isinstance(saved, list) or len(saved) != self.shards:
                raise ValueError(f"the checkpoint's comm header holds no {self.describe()} planner state per shard")
            self._load_planner(saved[self.shard])
        memories = self._memories()
        if memories:
            local = state["local"].to_local().reshape(-1).split([memory.local.numel() for memory in memories])
            shared = state["shared"].to_local().reshape(-1).split([memory.shared.numel() for memory in memories])
            for memory, mine, ours in zip(memories, local, shared):
                memory.local.copy_(mine)
                memory.shared.copy_(ours)
        self.step = header["step"]

    def _planners(self) -> list:
        """Each shard position's planner state (its replicas agreed it: every replica holds the same), gathered over
        the shard group, so that every rank saves one header and DCP's one copy of it holds them all."""
        states = [None] * self.shards
        dist.all_gather_object(states, self.planner.state_dict(), group=self.shard_group)
        return states

    def check_header(self, header) -> dict:
        """The saved header as a dict, or ValueError naming what differs from this run: the format, config,
        mesh (a state loads onto the mesh it was saved on) or parameters, or a malformed step."""
        saved = read_header(header)
        saved = saved if isinstance(saved, dict) else {}  # no header: refused for its format
        mine = json.loads(json.dumps(self._header()))  # the config's tuples as JSON lists, as saved
        where = (f"it was saved on a {_shape(saved.get('mesh') if isinstance(saved, dict) else None)} "
                 f"({REPLICATE} x {SHARD}) mesh, this run's is {_shape(mine['mesh'])}")
        check_saved(saved, FORMAT, mine["config"], "comm", mine["world_size"], where)
        if saved.get("mesh") != mine["mesh"]:
            raise ValueError(f"the checkpoint's comm state does not fit this mesh: {where}; netgain.comm.fsdp "
                             "loads a state onto the mesh it was saved on (error feedback is per rank, warm starts "
                             "per shard)")
        if saved.get("names") != mine["names"]:
            theirs = saved.get("names") if isinstance(saved.get("names"), list) else []
            differ = [n for n in mine["names"] if n not in theirs] + [n for n in theirs if n not in mine["names"]]
            raise ValueError(f"the checkpoint's comm state is another model's: its trainable parameters differ from "
                             f"this model's in {differ[:5] or 'their order'}")
        return saved

    def _header(self) -> dict:
        return {"format": FORMAT, "config": self.config.describe(), "mesh": list(self.mesh.shape),
                "world_size": self.mesh.size(), "step": self.step,
                "names": [name for layout in self._group_layouts() for name in layout.names]}


def raise_on_every_shard(error: Exception | None, shard_group, device: torch.device, where: str) -> None:
    """Every shard position's verdict (``error``: this rank's, the same on its replicas) in one allreduce MAX over
    ``shard_group`` (this rank's replica: one rank of each shard position); raises this rank's error, or the most
    specific class another position's replicas raised, on every rank: no replica steps while another stops."""
    verdicts = torch.zeros(dist.get_world_size(shard_group), device=device)
    verdicts[dist.get_rank(shard_group)] = _failure_code(error)
    if verdicts.numel() > 1:
        dist.all_reduce(verdicts, dist.ReduceOp.MAX, group=shard_group)
    if error is not None:
        raise error
    failed = [shard for shard, code in enumerate(verdicts.tolist()) if code]
    if failed:
        kind = FAILURES[int(verdicts.max())]
        raise kind(f"{where}: the replicas of shard {', '.join(map(str, failed))} raised {kind.__name__} (named on "
                   "their ranks); every rank raises it, so that no replica steps while another stops")


def read_header(header):
    """A saved JSON header as Python data, or None where it is missing or not JSON (its checks refuse it)."""
    try:
        return json.loads(header) if isinstance(header, str) else None
    except ValueError:
        return None


def laid(flat: torch.Tensor, replicas: DeviceMesh, per_rank: bool) -> DTensor:
    """This rank's 1-D ``flat`` as a DTensor over its shard's ``replicas`` (the 1-D mesh of the ranks holding the same
    shard), which DCP saves once and loads in place: per rank, (replicas, n), every rank's own; else (n,), what the
    replicas hold alike, one copy. Shard positions differ in size: their keys tell them apart. `unlaid` takes it
    back."""
    if per_rank:
        return DTensor.from_local(flat.view(1, -1), replicas, [Shard(0)], run_check=False)
    return DTensor.from_local(flat, replicas, [Replicate()], run_check=False)


def unlaid(laid_out: DTensor) -> torch.Tensor:
    """This rank's part of what `laid` made (loaded in place by DCP), flat."""
    return laid_out.to_local().reshape(-1)


def _failure_code(error: Exception | None) -> int:
    """A step's verdict: 0 none, else the index in FAILURES of the most specific class the error is (1: any other)."""
    if error is None:
        return 0
    return max((code for code, kind in enumerate(FAILURES) if kind is not None and isinstance(error, kind)), default=1)


def _shape(mesh) -> str:
    return " x ".join(map(str, mesh)) if isinstance(mesh, list) else repr(mesh)


def register(model: FSDPModule, mesh: DeviceMesh, config: "CommConfig | str" = "auto", *, overlap: bool = True,
             **options) -> FSDPCommState:
    """Run the cross-replica gradient all-reduce of ``model`` through a netgain codec; returns its state.

    ``model``: fully_shard-ed (root and submodules) over ``mesh["shard"]``; ``mesh``: the 2-D
    (replicate, shard) DeviceMesh. ``config`` as for netgain.comm.register (CODECS): "auto" (the default:
    per FSDP group, the fastest option at the measured link, planned per shard position), a fixed codec
    (none, fp16/bf16, qsgd, gqsgd, gqsgd-exp, topk, randomk, lowrank) or kimad/kimad+. ``overlap``: a group's
    average crosses the link while the backward goes on, wherever FSDP reads the group's gradients only at
    the backward's end (`FSDPCommState._unread`): every step with a fixed codec, under a planner the steps that
    sample no link (`FSDPCommState._overlaps`); False: every group's average holds the backward until it is done. Collective over the default group: raises PlanMismatchError on every rank when the
    ranks' configs differ.
    """
    if not isinstance(overlap, bool):
        raise ValueError(f"overlap must be True or False, got {overlap!r}")
    comm = comm_config(config, **options)
    _check_mesh(model, mesh)
    state = FSDPCommState(comm, mesh=mesh, param_names={id(p): name for name, p in model.named_parameters()},
                          overlap=overlap)
    state.check_config(None)  # every rank of the job, not only this replicate group
    for index, module in enumerate(m for m in model.modules() if isinstance(m, FSDPModule)):
        param_group = module._get_fsdp_state()._fsdp_param_group
        if param_group is None:  # fully_shard of a module without parameters of its own
            continue
        state._groups[index], state._param_groups[index] = param_group.fsdp_params, param_group
        module.set_all_reduce_hook(lambda flat, index=index: state.reduce(index, flat))
    model.register_forward_hook(lambda *_: state.forward_done())
    return state


def _check_mesh(model, mesh: DeviceMesh) -> None:
    """A 2-D (replicate, shard) mesh, and every FSDP module sharded over its shard dimension only."""
    if not isinstance(model, FSDPModule):
        raise TypeError(f"register() needs a model passed through fully_shard, got {type(model).__name__}")
    if mesh.ndim != 2 or mesh.mesh_dim_names != (REPLICATE, SHARD):
        raise ValueError(f"mesh: a 2-D DeviceMesh with mesh_dim_names=('{REPLICATE}', '{SHARD}'), got "
                         f"{mesh.ndim}-D with names {mesh.mesh_dim_names}")
    shard = mesh[SHARD]
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        param_group = module._get_fsdp_state()._fsdp_param_group
        if param_group is not None and param_group.mesh_info.mesh != shard:
            raise ValueError(f"module {name or '<root>'!r} is sharded over {param_group.mesh_info.mesh}, not over "
                             f"mesh['{SHARD}']: with a 2-D mesh FSDP2 all-reduces across replicas in full precision "
                             f"itself; call fully_shard(module, mesh=mesh['{SHARD}'])")


def load_checkpoint(state_dict: dict, path) -> None:
    """torch.distributed.checkpoint.load(state_dict, checkpoint_id=path), reading data only.

    DCP's own reader unpickles the checkpoint's .metadata and its non-tensor items without
    restriction, so a crafted checkpoint could run code; here .metadata may name DCP's metadata
    classes only and the items load with torch.load(weights_only=True). Raises pickle.UnpicklingError
    on anything else, on every rank.

    The headers of the values in ``state_dict`` that have `check_header` (FSDPCommState, netgain.sync's
    SyncOptimizer and route under FSDP2) load first and go to it: a state of another config, mesh or model
    raises ValueError naming what differs, on every rank, before DCP meets tensors of the wrong shape
    (whose error would name a size only); a route's enters its saved phase there, so the state DCP then
    loads in place has its parts.
    """
    last = [key for key, value in state_dict.items() if getattr(value, "loads_last", False)]
    if last and len(state_dict) > 1:
        raise ValueError(f"load_checkpoint: load {last[0]!r} in a call of its own, after the model and optimizer are "
                         "set (set_state_dict): it gives each rank back its own shards and optimizer state, which DCP's "
                         "one copy of them would then overwrite")
    headers = {key: {"header": None} for key, value in state_dict.items() if hasattr(value, "check_header")}
    if headers:
        _load(headers, path, _DataOnlyPlanner(allow_partial_load=True))  # a missing header stays None: refused
        for key, loaded in headers.items():
            state_dict[key].check_header(loaded["header"])
    _load(state_dict, path, _DataOnlyPlanner())


def _load(state_dict: dict, path, planner) -> None:
    """dcp.load through the data-only reader; its refusals raised as pickle.UnpicklingError."""
    reader = _DataOnlyReader(path)
    try:
        dcp.load(state_dict, storage_reader=reader, planner=planner)
    except dcp.api.CheckpointException as error:  # DCP gathers every rank's failure into one exception
        refused = [e for e, _ in error.failures.values() if isinstance(e, pickle.UnpicklingError)] + reader.refused
        if not refused:
            raise
        lines = str(refused[0]).splitlines()
        reason = next((line.strip() for line in lines if "GLOBAL" in line or "Unsupported" in line), lines[0])
        raise pickle.UnpicklingError(f"checkpoint {path}: refused, it holds more than tensors and plain data "
                                     f"(read with weights_only=True, so it cannot run code): {reason}") from None


class _MetadataUnpickler(pickle.Unpickler):
    """What DCP's .metadata holds: its metadata classes, torch.Size, dtypes, layouts, a path."""

    ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
               ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}

    def find_class(self, module, name):
        metadata = module == "torch.distributed.checkpoint.metadata" and isinstance(
            getattr(dcp.metadata, name, None), type)
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if metadata or dtype or (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata names {module}.{name}, which is not DCP metadata: refused")


class _DataOnlyReader(dcp.FileSystemReader):
    """Reads .metadata through _MetadataUnpickler; keeps what it refused (DCP rewords that error)."""

    def __init__(self, path):
        super().__init__(path)
        self.refused: list[pickle.UnpicklingError] = []

    def read_metadata(self, *args, **kwargs):
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as file:
            try:
                metadata = _MetadataUnpickler(file).load()
            except pickle.UnpicklingError as error:
                self.refused.append(error)
                raise
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _DataOnlyPlanner(dcp.DefaultLoadPlanner):
    def load_bytes(self, read_item, value) -> None:
        torch.load(value, weights_only=True)  # raises on anything but tensors and plain data
        value.seek(0)
        super().load_bytes(read_item, value)  # DCP's own placement of the same, checked bytes
