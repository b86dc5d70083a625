"""Register the netgain hook on an `accelerator.prepare`d model and carry its state in save_state/load_state.

    model, optimizer = accelerator.prepare(model, optimizer)
    state = netgain.integrations.accelerate.register(accelerator, model, GlobalQSGDConfig(bits=8))

`DistributedDataParallelKwargs(comm_hook=...)` takes only Accelerate's own hooks, so this registers
the hook itself. The codec state goes through save-state / load-state pre-hooks, not
`register_for_checkpointing`: Accelerate saves a registered object's state on rank 0 only after
calling its `state_dict` (fine, ours is collective) but unpickles it unrestricted (it can run code); here the
file is `<dir>/netgain_comm.pt`, written by rank 0 and read by every rank with `weights_only=True`, once every
rank has left save_state.
"""

from __future__ import annotations

import os
import weakref

import torch
from accelerate import Accelerator

from .. import comm
from ..comm import CommConfig, CommState

LAUNCH = ("torchrun --nproc-per-node 2 train.py (CPU: gloo; GPUs: nccl) or "
          "accelerate launch --multi_gpu --num_processes 2 train.py")
_NAMES: "weakref.WeakKeyDictionary[Accelerator, set]" = weakref.WeakKeyDictionary()


def register(accelerator: Accelerator, model: torch.nn.Module, config: "CommConfig | str" = "gqsgd", *,
             name: str = "netgain_comm", **options) -> CommState:
    """Register the hook on ``model`` (what accelerator.prepare returned); returns its CommState.

    save_state writes the state of every rank to ``<dir>/<name>.pt`` (give each model its own
    ``name``); load_state restores it on every rank. Call ``state.close()`` before the process
    group is destroyed.
    """
    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"accelerator must be an accelerate.Accelerator, got {type(accelerator).__name__}")
    if accelerator.num_processes < 2:
        raise ValueError(_single_process(accelerator))
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"model must be the DistributedDataParallel that accelerator.prepare(model) returned, "
                        f"got {type(model).__name__} (distributed_type={accelerator.distributed_type})")
    names = _NAMES.setdefault(accelerator, set())
    if name in names:
        raise ValueError(f"name={name!r} is already taken on this accelerator: give each model its own name")
    state = comm.register(model, config, **options)
    names.add(name)
    filename = f"{name}.pt"

    def save(models, weights, output_dir):
        saved = state.state_dict()  # collective: every rank is inside save_state here
        each_node = accelerator.project_configuration.save_on_each_node  # node-local disks: a copy per node
        if accelerator.is_local_main_process if each_node else accelerator.is_main_process:
            torch.save(saved, os.path.join(output_dir, filename))

    def load(models, input_dir):
        # first, every rank waits until all have left save_state: a load_state right after one finds rank 0's
        # files whole (Accelerate's own too: its save_state ends with no barrier, so rank 1 read half a file)
        accelerator.wait_for_everyone()
        path = os.path.join(input_dir, filename)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing: the checkpoint was saved without this netgain hook "
                                    f"(or with another name=)")
        state.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)
    return state


def _single_process(accelerator: Accelerator) -> str:
    """Why this run has one process, and what to do: under torchrun on a machine without GPUs, Accelerate
    (1.16) runs each launched rank alone unless told to use the CPU."""
    launched = os.environ.get("WORLD_SIZE", "1")
    if launched.isdigit() and int(launched) > 1:
        return (f"this process is one of WORLD_SIZE={launched} launched ranks, but Accelerate runs it alone "
                f"(distributed_type={accelerator.distributed_type}): without a GPU, Accelerate joins launched ranks "
                "only when told to use the CPU: Accelerator(cpu=True), or ACCELERATE_USE_CPU=1")
    return (f"the netgain hook compresses gradients between processes, and this run has "
            f"accelerator.num_processes={accelerator.num_processes}: launch it distributed, e.g. {LAUNCH}")
