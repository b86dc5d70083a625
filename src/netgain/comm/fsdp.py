"""netgain codecs on the slow hop of hybrid sharding: FSDP2 shards inside a node, the codec crosses nodes.

    mesh = init_device_mesh("cuda", (nodes, gpus_per_node), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    state = netgain.comm.fsdp.register(model, mesh, GlobalQSGDConfig(bits=8))

Why the shard sub-mesh, not the 2-D mesh: with native HSDP, torch 2.13's FSDP2 runs its own
all-reduce across replicas and calls the all-reduce hook only with that result, and
`set_requires_all_reduce(False)` skips the hook as well (`_fsdp_collectives.foreach_reduce`). So
FSDP reduce-scatters inside a replica (the fast link), and `set_all_reduce_hook` hands each
parameter group's reduce-scatter output to this module, which all-reduces it across the
mesh's "replicate" dimension through the codec, in place, before FSDP views it as the sharded
gradients. This is the pattern torchft uses.

The group's flat output is one bucket of the DDP pipeline (bucket.py): the same header
(global per-parameter scales, the non-finite flag and the plan signature in one allreduce MAX),
codecs, errors raised on every rank and per-step statistics. The hook runs synchronously inside
FSDP's post-backward: FSDP reads the gradients right after it returns.
"""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.autograd import Variable
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from .config import CODEC_CONFIGS, STATELESS_CONFIGS, CommConfig, comm_config
from .fused import Segments, name_key
from .hooks import CommState
from .store import BucketLayout

REPLICATE, SHARD = "replicate", "shard"
CONFIGS = STATELESS_CONFIGS  # EF21 (topk, randomk), low rank's memory and the planners' state would have to be sharded
CODECS = tuple(name for name, config in CODEC_CONFIGS.items() if config in CONFIGS)


class FSDPCommState(CommState):
    """The DDP pipeline's state, fed by FSDP2's all-reduce hook: one job per parameter group per step.

    A step ends when autograd finishes the backward (a queued final callback), so `last_step`
    and `history` hold the same statistics as under DDP, with one record per FSDP group.
    `state_dict()` holds plain values only (the codecs allowed here keep no per-rank state), so
    it saves and loads with torch.distributed.checkpoint as a Stateful.
    """

    def __init__(self, config: CommConfig, *, process_group: dist.ProcessGroup, param_names: dict[int, str]):
        super().__init__(config, process_group=process_group, param_names=param_names)
        self._groups: dict[int, list] = {}  # group index -> its FSDPParams, in FSDP's order
        self._flat_layouts: dict[int, tuple[tuple, BucketLayout]] = {}
        self._in_step = False

    def reduce(self, index: int, flat: torch.Tensor) -> None:
        """Replace ``flat`` (one group's reduce-scatter output) by its mean over the replicas."""
        if not self._in_step:
            self._in_step = True
            Variable._execution_engine.queue_callback(self._close_step)  # runs after FSDP's own
        try:
            self.reduce_flat(index, flat, self._flat_layout(index, flat))
        except Exception:
            self._close_step()  # autograd skips final callbacks once a backward raises
            raise

    def _close_step(self) -> None:
        self._in_step = False
        self.end_step()

    def _flat_layout(self, index: int, flat: torch.Tensor) -> BucketLayout:
        """Each group's layout, built once: its parameters' padded shards tile the flat output."""
        key = ("fsdp", flat.numel(), flat.dtype, flat.device)
        cached = self._flat_layouts.get(index)
        if cached is not None and cached[0] == key:
            return cached[1]
        params = [p for p in self._groups[index] if p.sharded_param.requires_grad]
        sizes = [p.padded_sharded_param_size.numel() for p in params]
        if sum(sizes) != flat.numel():
            raise RuntimeError(f"FSDP group {index}: its reduce-scatter output has {flat.numel()} elements, its "
                               f"trainable parameters {sum(sizes)}: a parameter got no gradient this step; call "
                               "model.set_reduce_scatter_unused_params(True) so every rank sends the same layout")
        names = [self.name_of(p.sharded_param) for p in params]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        exact = [torch.arange(o, o + k, device=flat.device) for o, k, p in zip(offsets, sizes, params)
                 if self.config.skip_1d and p.sharded_param.dim() <= 1]
        layout = BucketLayout(names, list(zip(offsets, sizes)),
                              Segments.build(sizes, [name_key(n) for n in names], flat.device),
                              torch.cat(exact) if exact else None)
        self._flat_layouts[index] = (key, layout)
        return layout


def register(model: FSDPModule, mesh: DeviceMesh, config: "CommConfig | str" = "gqsgd", **options) -> FSDPCommState:
    """Run the cross-replica gradient all-reduce of ``model`` through a netgain codec; returns its state.

    ``model``: fully_shard-ed (root and submodules) over ``mesh["shard"]``; ``mesh``: the 2-D
    (replicate, shard) DeviceMesh. ``config`` as for netgain.comm.register: none, fp16/bf16,
    gqsgd (int8 or packed), qsgd, gqsgd-exp (CODECS). Collective over the default group: raises
    PlanMismatchError on every rank when the ranks' configs differ.
    """
    comm = comm_config(config, **options)
    if not isinstance(comm.codec, CONFIGS):
        raise ValueError(f"netgain.comm.fsdp supports codecs without per-rank state ({', '.join(CODECS)}), got "
                         f"{comm.codec.build().describe()}: EF21 and Kimad state is not sharded with FSDP yet")
    _check_mesh(model, mesh)
    group = mesh.get_group(REPLICATE)
    state = FSDPCommState(comm, process_group=group,
                          param_names={id(p): name for name, p in model.named_parameters()})
    state.check_config(None)  # every rank of the job, not only this replicate group
    for index, module in enumerate(m for m in model.modules() if isinstance(m, FSDPModule)):
        param_group = module._get_fsdp_state()._fsdp_param_group
        if param_group is None:  # fully_shard of a module without parameters of its own
            continue
        state._groups[index] = param_group.fsdp_params
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
    """
    reader = _DataOnlyReader(path)
    try:
        dcp.load(state_dict, storage_reader=reader, planner=_DataOnlyPlanner())
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
