"""Run a function on N gloo ranks and collect what each returns (test helper).

The ranks start as `netgain train` starts its workers (`worker_start_method`): forks of one server
process that imported torch and netgain once for the whole session, 0.1-0.2 s per rank where a
spawned interpreter takes 3-5 s to import them."""

from __future__ import annotations

import faulthandler
import gc
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from netgain.train.launch import exit_with_parent, free_port, worker_start_method


def _worker(rank, world_size, port, folder, fn, args):
    exit_with_parent()  # a test run killed mid-test leaves no rank behind
    faulthandler.enable()  # a native abort prints the Python stack that led to it
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        try:
            result = ("ok", fn(rank, world_size, *args))
        except Exception as error:  # reported to the test, which decides
            result = ("error", f"{type(error).__name__}: {error}")
        torch.save(result, os.path.join(folder, f"{rank}.pt"))
        gc.collect()  # DDP objects left in reference cycles die now, not at exit after their group is gone
        dist.barrier()  # no rank tears gloo down while a peer still uses it (else SIGABRT at exit)
    finally:
        dist.destroy_process_group()


def run(fn, world_size: int, *args, timeout: float = 120) -> list:
    """fn(rank, world_size, *args) on each rank; returns [(status, value_or_message)] by rank."""
    with tempfile.TemporaryDirectory() as folder:
        context = mp.start_processes(_worker, args=(world_size, free_port(), folder, fn, args),
                                     nprocs=world_size, join=False, start_method=worker_start_method())
        if not _join(context, timeout):
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"ranks did not finish within {timeout} s (a hang)")
        return [torch.load(os.path.join(folder, f"{r}.pt"), weights_only=False) for r in range(world_size)]


def _join(context, timeout: float) -> bool:
    import time
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(0.0, deadline - time.monotonic()) or 0.01):
        if time.monotonic() >= deadline:
            return False
    return True


def sharded_mlp():
    """A 2 x 2 (replicate x shard) mesh and an 8-16-3 tanh MLP, each Linear and the root fully_shard-ed over
    mesh["shard"] (the last layer's 3 rows split 2 + 1), seeded alike on every rank, with AdamW lr 1e-2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    return mesh, model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def mse_step(model, optimizer, stepper, rank: int, step: int) -> None:
    """One step of `sharded_mlp`'s model on this rank's batch of ``step`` (seeded by both), stepped by ``stepper``."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 3, generator=g)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    stepper.step()


def shard_state(model, optimizer) -> list:
    """Copies of this rank's parameter shards and optimizer state tensors (a DTensor's local part)."""
    return ([p.detach().to_local().clone() for p in model.parameters()]
            + [v.to_local().clone() if hasattr(v, "to_local") else v.clone()
               for s in optimizer.state.values() for v in s.values()])
