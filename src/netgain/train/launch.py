"""Starting the workers: local gloo processes (forks of a forkserver), or this process as one rank under
torchrun; signals and a failed worker stop them all."""

from __future__ import annotations

import multiprocessing.connection
import os
import re
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager

import torch

from netgain.train.config import TrainConfig
from netgain.train.loop import train_worker

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
WORKER_GRACE_S = 2  # after a worker fails or a signal, the others get this long to exit before SIGKILL
# a worker's failures whose message says it all (a full disk, a diverged loss, a checkpoint file that would run
# code): one line, no traceback above it
EXPLAINED_ERRORS = ("WriteError", "NonFiniteLossError", "UnpicklingError")


def launched_by_torchrun() -> bool:
    return all(name in os.environ for name in TORCHRUN_VARIABLES)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_start_method() -> str:
    """"forkserver" where the platform has it: one server process imports torch and netgain once, and
    every worker is a fork of it (0.1-0.2 s each) instead of a fresh interpreter importing them again
    (3-5 s of CPU each, which several workers on few cores pay in turn). The server never touches a
    GPU or a thread pool, so its forks are as clean as spawned processes. Else "spawn". A worker prints
    wherever stdout pointed when the server started: a process that redirects its fd 1 between two runs
    (pytest's capfd) gets the second run's output where the first's went."""
    if "forkserver" not in torch.multiprocessing.get_all_start_methods():
        return "spawn"
    torch.multiprocessing.set_forkserver_preload(["netgain.train.launch"])  # no effect on a server already running
    return "forkserver"


def exit_with_parent() -> None:
    """SIGKILL this worker as soon as the process that started it is gone, however it went (kill -9
    included): a worker's parent is the forkserver, which lives on while any worker does, so neither
    the kernel's parent-death signal nor the forkserver ends it. multiprocessing's parent sentinel
    is a pipe whose write end only the starting process holds: EOF when it exits, at once if it
    already has. The forkserver exits by itself once its last worker is gone."""
    parent = multiprocessing.parent_process()
    if parent is None:  # not started by multiprocessing (torchrun's rank): torchrun watches it
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="netgain-exit-with-parent", daemon=True).start()


def local_worker(rank: int, world_size: int, config: TrainConfig, init_method: str) -> None:
    """One spawned worker: it dies with `netgain train`, and trains as a local rank."""
    exit_with_parent()
    train_worker(rank, world_size, config, init_method, local=True)


def spawn_workers(config: TrainConfig) -> int:
    """Local gloo workers; a SIGINT or SIGTERM to this parent stops them too (else they trained on)."""
    init_method = f"tcp://127.0.0.1:{free_port()}"
    on = f" on an emulated {config.emulate_link} link" if config.emulate_link else ""
    print(f"netgain train: starting {config.world_size} local workers{on}", file=sys.stderr)
    received: list[int] = []
    with _record_signals(received):
        context = torch.multiprocessing.start_processes(
            local_worker, args=(config.world_size, config, init_method), nprocs=config.world_size,
            join=False, start_method=worker_start_method())
        try:
            while not received:
                if context.join(timeout=0.2, grace_period=WORKER_GRACE_S):
                    return 0
        except (torch.multiprocessing.ProcessRaisedException, torch.multiprocessing.ProcessExitedException) as error:
            print(("" if explained(error) else f"{error}\n") + worker_failure(error, config), file=sys.stderr)
            return 1
        stop_workers(context.processes)
    name = signal.Signals(received[0]).name
    print(f"netgain train: {name}: stopped the {config.world_size} workers", file=sys.stderr)
    return 128 + received[0]


def worker_failure(error: Exception, config: TrainConfig) -> str:
    """One closing line under the worker's traceback: which worker, and why (its last exception line)."""
    line = f"netgain train: worker {error.error_index} failed: {_reason(error)}"
    if _timed_out(error):
        line += f" (a peer was silent for --collective-timeout {config.collective_timeout:g} s)"
    return line


def explained(error: Exception) -> bool:
    """Whether a worker's failure says it all in its closing line, so its traceback is left out."""
    return _reason(error).split(":")[0].split(".")[-1] in EXPLAINED_ERRORS or _timed_out(error)


def _timed_out(error: Exception) -> bool:
    """A collective that waited --collective-timeout: the closing line says it all, the traceback is noise."""
    return re.search(r"timed out|timeout", _reason(error), re.IGNORECASE) is not None  # gloo and NCCL word it differently


def _reason(error: Exception) -> str:
    """A failed worker's last exception line: 'netgain.files.WriteError: cannot write ...'."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return next((line for line in reversed(lines) if re.match(r"[\w.]*(Error|Exception)\b", line)),
                lines[-1] if lines else "")


@contextmanager
def _record_signals(received: list[int]):
    """SIGINT and SIGTERM append to `received` instead of raising, so no worker is left unreferenced."""
    previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stop_workers(processes) -> None:
    """SIGTERM, then SIGKILL for any worker still alive after WORKER_GRACE_S (a stopped one, say)."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + WORKER_GRACE_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()
