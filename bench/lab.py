"""The throttled-network lab: N workers, each in its own network namespace, on a shaped link.

Why: gradient compression only pays off when the network is the bottleneck, and a laptop or a CI
box has no slow network. Linux network namespaces give every worker its own interface; a token
bucket (`tc ... tbf`) on each worker's egress gives it a real bandwidth limit, so gloo collectives
run over real TCP at, say, 100 Mbit/s. The worker ends of the veth pairs are called eth0 and join a
bridge that lives in its own namespace, so the host's interfaces and routes are never touched and
the 10.77.0.0/24 addresses exist only inside the lab.

As a module:
    with Lab(workers=2, rate="100mbit") as lab:
        codes = lab.run(["python", "train.py"])    # one process per namespace, torchrun env vars
        lab.set_rate("1gbit")                        # also while a job runs (tc qdisc change)

As a script (root):
    python bench/lab.py --workers 2 --rate 100mbit -- python -c "import os; print(os.environ['RANK'])"
    python bench/lab.py --cleanup            # remove namespaces left by dead lab processes
    python bench/lab.py --cleanup --all      # remove every lab namespace (no lab may be running)

Everything is torn down on exit, on error, on Ctrl-C and on SIGTERM.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from netgain.cost.network import parse_bandwidth

NAME_PREFIX = "nglab"
SUBNET = "10.77.0"
MASTER_PORT = 29500
BURST_SMALL = 256 * 1024      # bytes; enough for <= 100 Mbit/s
BURST_1GBIT_S = 0.008         # seconds of traffic at the rate: 1 MB at 1 Gbit/s


_LAB_IDS = itertools.count()  # labs of one process get distinct names


class LabError(RuntimeError):
    """The lab could not be set up (not root, namespaces not permitted, a failing command)."""


def parse_rate(rate: str | float | int | None) -> float | None:
    """Bits per second from '100mbit', '1gbit', '12MB/s', a number of bit/s, or None/'none'."""
    if rate is None or (isinstance(rate, str) and rate.strip().lower() in ("none", "unlimited")):
        return None
    try:
        value = float(rate) if isinstance(rate, (int, float)) else 8 * parse_bandwidth(rate)
    except ValueError as error:
        raise ValueError(f"rate: {error}; or 'none' for no limit") from None
    if value <= 0:
        raise ValueError(f"rate: must be positive, got {rate!r}")
    return value


def tbf_burst_bytes(rate_bps: float) -> int:
    """Token-bucket depth: 256 KiB up to 100 Mbit/s, 8 ms of traffic above (1 MB at 1 Gbit/s)."""
    return max(BURST_SMALL, int(rate_bps / 8 * BURST_1GBIT_S))


def _sh(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise LabError(f"`{shlex.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def list_lab_namespaces() -> list[str]:
    """Names of all namespaces made by any lab (prefix NAME_PREFIX)."""
    out = _sh(["ip", "netns", "list"]).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(NAME_PREFIX + "-")]


def _owner_pid(namespace: str) -> int | None:
    m = re.match(rf"{NAME_PREFIX}-(\d+)-", namespace)
    return int(m.group(1)) if m else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_processes(namespace: str) -> None:
    """SIGKILL whatever still runs inside one of the lab's own namespaces (only our workers can)."""
    pids = _sh(["ip", "netns", "pids", namespace], check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def delete_namespaces(names: Sequence[str]) -> None:
    """Kill processes inside, then delete each namespace (its veth ends and bridge go with it)."""
    for name in names:
        _kill_namespace_processes(name)
    for name in names:
        _sh(["ip", "netns", "del", name], check=False)


def cleanup(include_live: bool = False) -> list[str]:
    """Remove leftover lab namespaces; by default only those whose creating process is gone."""
    def abandoned(name: str) -> bool:
        pid = _owner_pid(name)
        return pid is None or not _pid_alive(pid)

    leftovers = [n for n in list_lab_namespaces() if include_live or abandoned(n)]
    delete_namespaces(leftovers)
    return leftovers


class Lab:
    """N worker namespaces on one bridge, each worker's egress shaped to `rate` (None: unshaped)."""

    def __init__(self, workers: int, rate: str | float | None = None,
                 master_port: int = MASTER_PORT):
        if not isinstance(workers, int) or not 1 <= workers <= 250:
            raise ValueError(f"workers: must be an integer in 1..250, got {workers!r}")
        self.workers = workers
        self.rates_bps = [parse_rate(rate)] * workers  # current egress limit per worker
        self.master_port = master_port
        base = f"{NAME_PREFIX}-{os.getpid()}-{next(_LAB_IDS)}"
        self.bridge_ns = f"{base}-br"
        self.namespaces = [f"{base}-w{i}" for i in range(workers)]
        self._created: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.Lock()

    # addresses exist only inside the lab's namespaces
    def address(self, rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"

    def __enter__(self) -> "Lab":
        try:
            self.setup()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def setup(self) -> None:
        if os.geteuid() != 0:
            raise LabError("the lab needs root (network namespaces and tc); run it with sudo")
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise LabError(f"`{tool}` not found; install iproute2")
        self._add_namespace(self.bridge_ns)
        _sh(["ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge"])
        _sh(["ip", "-n", self.bridge_ns, "link", "set", "br0", "up"])
        for rank, ns in enumerate(self.namespaces):
            self._add_namespace(ns)
            # created inside the bridge namespace; the peer goes straight into the worker's
            _sh(["ip", "-n", self.bridge_ns, "link", "add", f"v{rank}", "type", "veth",
                 "peer", "name", "eth0", "netns", ns])
            _sh(["ip", "-n", self.bridge_ns, "link", "set", f"v{rank}", "master", "br0", "up"])
            _sh(["ip", "-n", ns, "addr", "add", f"{self.address(rank)}/24", "dev", "eth0"])
            _sh(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _sh(["ip", "-n", ns, "link", "set", "lo", "up"])
        if self.rates_bps[0] is not None:
            self._apply_rate("add", self.rates_bps[0], range(self.workers))

    def _add_namespace(self, name: str) -> None:
        proc = _sh(["ip", "netns", "add", name], check=False)
        if proc.returncode != 0:
            raise LabError(f"`ip netns add {name}` is not permitted here: {proc.stderr.strip()} "
                           "(needs root and a kernel/container that allows network namespaces)")
        self._created.append(name)

    def _apply_rate(self, verb: str, rate_bps: float | None, ranks: Sequence[int]) -> None:
        for rank in ranks:
            cmd = ["ip", "netns", "exec", self.namespaces[rank], "tc", "qdisc", verb, "dev",
                   "eth0", "root"]
            if rate_bps is not None:
                cmd += ["tbf", "rate", f"{int(rate_bps)}bit",
                        "burst", str(tbf_burst_bytes(rate_bps)), "latency", "100ms"]
            _sh(cmd)

    def set_rate(self, rate: str | float | None, ranks: Sequence[int] | None = None) -> None:
        """Change the egress limit of `ranks` (default: every worker) now; safe while a job runs."""
        new = parse_rate(rate)
        ranks = range(self.workers) if ranks is None else ranks
        for rank in ranks:
            if not 0 <= rank < self.workers:
                raise ValueError(f"ranks: {rank} is not a worker of this {self.workers}-worker lab")
            old = self.rates_bps[rank]
            if old is None and new is not None:
                self._apply_rate("add", new, [rank])
            elif old is not None and new is None:
                self._apply_rate("del", None, [rank])
            elif new is not None:
                self._apply_rate("change", new, [rank])
            self.rates_bps[rank] = new

    def worker_env(self, rank: int, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """torchrun's variables for one worker, gloo bound to the namespace's eth0."""
        env = {
            "GLOO_SOCKET_IFNAME": "eth0",
            "MASTER_ADDR": self.address(0),
            "MASTER_PORT": str(self.master_port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(self.workers),
            "LOCAL_WORLD_SIZE": str(self.workers),
        }
        env.update(extra or {})
        return env

    def worker_command(self, rank: int, cmd: Sequence[str],
                       extra_env: Mapping[str, str] | None = None) -> list[str]:
        env = [f"{k}={v}" for k, v in self.worker_env(rank, extra_env).items()]
        return ["ip", "netns", "exec", self.namespaces[rank], "env", *env, *cmd]

    def start(self, cmd: Sequence[str], extra_env: Mapping[str, str] | None = None,
              stdout=None, stderr=None) -> list[subprocess.Popen]:
        """Launch `cmd` once per worker (each in its own process group); returns the processes."""
        procs = []
        with self._lock:
            for rank in range(self.workers):
                p = subprocess.Popen(self.worker_command(rank, cmd, extra_env),
                                     stdout=stdout, stderr=stderr, start_new_session=True)
                self._procs.append(p)
                procs.append(p)
        return procs

    def run(self, cmd: Sequence[str], extra_env: Mapping[str, str] | None = None,
            timeout: float | None = None, stdout=None, stderr=None) -> list[int]:
        """Run `cmd` on every worker and wait; a failing worker stops the others. Exit codes."""
        procs = self.start(cmd, extra_env, stdout, stderr)
        deadline = None if timeout is None else time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            failed = any(p.returncode not in (None, 0) for p in procs)
            if failed or (deadline is not None and time.monotonic() > deadline):
                self._stop(procs)
                if not failed:
                    raise TimeoutError(f"lab job exceeded {timeout} s: {shlex.join(cmd)}")
                break
            time.sleep(0.05)
        return [p.wait() for p in procs]

    @staticmethod
    def _stop(procs: Sequence[subprocess.Popen], grace_s: float = 3.0) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in procs:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, sig)
                    except ProcessLookupError:
                        pass
            end = time.monotonic() + grace_s
            while time.monotonic() < end and any(p.poll() is None for p in procs):
                time.sleep(0.05)

    def teardown(self) -> None:
        """Stop the workers and delete every namespace this lab made. Idempotent.

        SIGINT/SIGTERM are held back meanwhile (in the main thread) so a second Ctrl-C cannot
        interrupt the teardown halfway; they are delivered right after it.
        """
        held = set(_TerminateOnSignal.SIGNALS)
        in_main = threading.current_thread() is threading.main_thread()
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, held) if in_main else None
        try:
            with self._lock:
                self._stop(self._procs)
                self._procs.clear()
                delete_namespaces(self._created)
                self._created.clear()
        finally:
            if in_main:
                signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class _TerminateOnSignal:
    """Turn SIGTERM/SIGINT/SIGHUP into exceptions so `with Lab(...)` blocks always tear down."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __enter__(self):
        self._previous = {s: signal.signal(s, self._raise) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    @staticmethod
    def _raise(signum, frame):
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def terminate_on_signals() -> _TerminateOnSignal:
    """Context manager for the main thread: SIGINT/SIGTERM/SIGHUP raise KeyboardInterrupt."""
    return _TerminateOnSignal()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Example: python bench/lab.py --workers 2 --rate 100mbit -- python job.py")
    parser.add_argument("--workers", type=int, default=2, help="number of worker namespaces")
    parser.add_argument("--rate", default=None,
                        help="egress limit per worker, e.g. 100mbit, 1gbit; omit or 'none' for no limit")
    parser.add_argument("--port", type=int, default=MASTER_PORT, help="MASTER_PORT for rendezvous")
    parser.add_argument("--timeout", type=float, default=None, help="kill the job after this many seconds")
    parser.add_argument("--cleanup", action="store_true",
                        help="remove lab namespaces left behind by dead lab processes and exit")
    parser.add_argument("--all", action="store_true",
                        help="with --cleanup: remove every lab namespace, also of running labs")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND run once per worker")
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if args.cleanup:
        removed = cleanup(include_live=args.all)
        print(f"removed {len(removed)} namespace(s): {' '.join(removed) or '-'}")
        return 0
    if not cmd:
        parser.error("give a command after --, or --cleanup")
    try:
        with terminate_on_signals(), Lab(args.workers, args.rate, args.port) as lab:
            print(f"lab: {args.workers} workers at {args.rate or 'no limit'} in {lab.namespaces}",
                  file=sys.stderr, flush=True)
            codes = lab.run(cmd, timeout=args.timeout)
    except LabError as e:
        print(f"lab: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(f"lab: interrupted ({e}); torn down", file=sys.stderr)
        return 130
    print(f"lab: exit codes {codes}", file=sys.stderr)
    return max(codes, key=abs) if any(codes) else 0


if __name__ == "__main__":
    sys.exit(main())
