"""Kernel and per-layer overhead latency measured on the current device (CUDA when present, else CPU), cached as JSON.

Rules of thumb about alignment differ per GPU and per CPU (../shared/papers/gac.md): the only reliable cost
is a measurement of the real shapes on the target device. `MeasuredCost` times what a decoder
forward runs — GEMMs, SDPA, the model's own norm and activation modules, streaming elementwise
passes (residual adds, rotary embedding, KV-cache appends) and the framework's cost per module
call — the first time each is asked for (`netgain profile` fills the table ahead of time), with
`netgain.cost.timing`'s interleaved rounds and outlier rejection. Inside a forward a GEMM reads
its weight from memory, and any operand larger than a core's cache has been evicted by the kernels
in between, so before such a call a buffer larger than the last-level cache is read, untimed
(timed hot, a prefill norm ran 4-5x faster than inside Gemma-3-270M's forward on this CPU); small
operands (a decode step's activations) stay hot, as they do in the model. The table is keyed by device,
thread count and dtype and written atomically, so an interrupted run never leaves a half-written cache.
A table names its format (CACHE_FORMAT): a cache path holding any other file is refused, never moved
or written over.

A timing taken while other work ran stays wrong for as long as it is cached (one GEMM cached at 55 ms
with a 37% spread, 3.0 ms fresh, moved GAC's sizes). So every entry records its spread, the load
average per core, the date and the machine (`Entry`); an entry whose spread or load says it was
disturbed, or that predates these records, is measured again before it is used (once per run), and
`refresh=True` (`netgain profile --refresh`) measures every entry a run uses again.
"""

from __future__ import annotations

import copy
import datetime
import itertools
import json
import math
import os
import platform
import statistics
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ..files import require_regular_file, write_atomically
from .timing import Timing, interleaved

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CACHE_DIR = Path(os.environ.get("NETGAIN_CACHE", Path.home() / ".cache" / "netgain"))
CACHE_FORMAT = "netgain.kernels/1"  # in every table netgain writes: the files it may read back and rewrite
LEGACY_FIELDS = {"device", "dtype", "threads", "torch", "warmup", "repeats", "entries"}  # tables before the format field
CACHE_MAX_BYTES = 256 << 20  # a table of every shape of a large model is a few MB
FLUSH_BYTES = 64 << 20  # read before a cold call: beyond the last-level cache of the CPUs (32 MB) and GPUs here
HOT_BYTES = 1 << 20  # operands up to this size stay in a core's cache between kernels (L2: 2 MB here)
DISTURBED_SPREAD = 0.2  # IQR / median above this: the samples were spread by interference (quiet: a few %)
DISTURBED_LOAD = 1.0  # 1-minute load average per available core above this: other work shared the cores
CALLS_PER_SAMPLE = 100  # trivial calls timed together (one call is below the timer's resolution)
# the cheap ops a decoder forward dispatches between its kernels, in one representative mix
GLUE_OPS = (
    lambda x: x.view(-1), lambda x: x.transpose(0, 1), lambda x: x[..., :1], lambda x: x.unsqueeze(0),
    lambda x: x.to(torch.float16), lambda x: x + 1,
)


def cpu_name() -> str:
    """The CPU model string, with its family and model where /proc/cpuinfo gives them (for cache keys and reports:
    VMs sold under one name, "AMD EPYC", were a Zen 1 one session and family 26 another)."""
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break  # the first processor's block
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except OSError:
        pass
    if "model name" not in fields:
        return platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        return f"{fields['model name']} (family {fields['cpu family']} model {fields['model']})"
    return fields["model name"]


def load_per_core() -> float:
    """The 1-minute load average per core this process may run on."""
    return os.getloadavg()[0] / len(os.sched_getaffinity(0))


@dataclass(frozen=True)
class Entry:
    """One cached timing and the conditions it was taken in."""

    timing: Timing
    load: float | None  # load average per core just after the timing (None: not recorded)
    date: str  # when, ISO 8601 UTC
    machine: str  # the host's name

    @classmethod
    def now(cls, timing: Timing) -> "Entry":
        stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        return cls(timing, load_per_core(), stamp, platform.node())

    @property
    def disturbed(self) -> bool:
        """Spread or load says other work shared the machine, or nobody recorded the load."""
        return self.load is None or self.load > DISTURBED_LOAD or self.timing.spread > DISTURBED_SPREAD

    def as_dict(self) -> dict:
        return {**self.timing.as_dict(), "load": self.load, "date": self.date, "machine": self.machine}

    @classmethod
    def from_dict(cls, record: Mapping) -> "Entry":
        return cls(Timing.from_dict(record), record.get("load"), record.get("date", ""), record.get("machine", ""))


class MeasuredCost:
    """Latency (seconds) of kernels and overheads timed on this device; same interface as `AnalyticCost`."""

    def __init__(
        self,
        device: str = "auto",
        dtype: str = "float32",
        *,
        threads: int | None = None,
        warmup: int = 2,
        repeats: int = 7,
        cache: str | Path | None = None,
        refresh: bool = False,
    ):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda': this torch sees no CUDA device (use 'cpu' or 'auto')")
        if warmup < 0 or repeats < 1:
            raise ValueError(f"warmup must be >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if threads is not None:
            torch.set_num_threads(threads)
        self.device = torch.device(device)
        self.dtype = dtype
        self.threads = torch.get_num_threads()
        self.warmup, self.repeats = warmup, repeats
        hardware = torch.cuda.get_device_name() if device == "cuda" else f"{cpu_name()} x{self.threads} threads"
        self.name = f"{device}:{hardware}"
        # one fp32 AVX-512 register holds 16 values; a tensor-core k-step is 16 halves
        self.preferred_multiple = 16
        self.host_bound = device == "cpu"  # eager CPU: the host's dispatch time is latency
        slug = "".join(c if c.isalnum() else "-" for c in f"{self.name}-{dtype}").strip("-").lower()
        self.path = Path(cache) if cache is not None else DEFAULT_CACHE_DIR / f"kernels-{slug}.json"
        self.table: dict[str, Entry] = self._load()
        # entries to measure again before use: the disturbed ones, or all of them when refreshing
        self.stale = {key for key, entry in self.table.items() if refresh or entry.disturbed}
        self.remeasured = 0  # stale entries measured again in this run

    # --- what a forward runs -------------------------------------------------------------------

    def gemm(self, m: int, k: int, n: int) -> float:
        """(M x K) @ (K x N) as nn.Linear runs it, F.linear(x[M, K], w[N, K]), weight read from memory."""
        return self._get(f"gemm {m} {k} {n}", lambda: self._gemm_call(m, k, n), cold=True)

    def sdpa(self, batch: int, heads: int, q_len: int, kv_len: int, head_dim: int, causal: bool = True) -> float:
        """torch's scaled_dot_product_attention with whatever backend it picks for this head_dim."""
        causal = causal and q_len == kv_len and q_len > 1
        key = f"sdpa {batch} {heads} {q_len} {kv_len} {head_dim} {int(causal)}"
        cold = self._bytes(batch * heads * (q_len + 2 * kv_len) * head_dim) > HOT_BYTES
        return self._get(key, lambda: self._sdpa_call(batch, heads, q_len, kv_len, head_dim, causal), cold)

    def norm(self, module: nn.Module, shape: tuple[int, ...]) -> float:
        """The model's own norm module on an input of `shape`."""
        key = f"norm {type(module).__name__} {'x'.join(map(str, shape))}"
        return self._get(key, lambda: self._module_call(module, shape), self._bytes(math.prod(shape)) > HOT_BYTES)

    def activation(self, module: nn.Module, shape: tuple[int, ...]) -> float:
        """A gated MLP's activation: act(gate) * up on inputs of `shape`."""
        key = f"act {type(module).__name__} {'x'.join(map(str, shape))}"
        return self._get(key, lambda: self._gated_call(module, shape), self._bytes(2 * math.prod(shape)) > HOT_BYTES)

    def elementwise(self, numel: int, passes: int = 1) -> float:
        """`passes` streaming passes (read one tensor, write one) over `numel` elements."""
        if passes == 0:
            return 0.0
        x = None

        def make():
            nonlocal x
            x = torch.randn(numel, device=self.device, dtype=DTYPES[self.dtype])
            return lambda: x.mul(1.0001)

        return passes * self._get(f"pass {numel}", make, self._bytes(numel) > HOT_BYTES)

    def framework(self, calls: int, ops: int) -> float:
        """Host time of `calls` nn.Module calls and `ops` cheap aten ops (views, casts, slices, small
        arithmetic) beyond the kernels timed on their own."""

        def make_calls():
            module, x = nn.Identity(), torch.zeros(1, device=self.device)
            return lambda: [module(x) for _ in range(CALLS_PER_SAMPLE)]

        def make_ops():
            x = torch.zeros(2, 2, device=self.device)
            return lambda: [op(x) for _ in range(CALLS_PER_SAMPLE // len(GLUE_OPS)) for op in GLUE_OPS]

        per_call = self._get("call", make_calls, cold=False) / CALLS_PER_SAMPLE if calls else 0.0
        per_op = self._get("op", make_ops, cold=False) / (CALLS_PER_SAMPLE // len(GLUE_OPS) * len(GLUE_OPS)) if ops else 0.0
        return calls * per_call + ops * per_op

    # --- noise and the table ----------------------------------------------------------------------

    def spread(self, key: str) -> float:
        """Relative spread (IQR / median) of one measured entry."""
        return self.table[key].timing.spread

    @property
    def noise(self) -> float:
        """The typical relative spread (median IQR / median) of this table's GEMM timings: a latency
        difference between GEMMs smaller than this is not evidence of a cliff."""
        spreads = [e.timing.spread for key, e in self.table.items() if key.startswith("gemm ")]
        return statistics.median(spreads) if spreads else 0.0

    def describe(self) -> str:
        """Which table prices, and how much of it this run measured again."""
        return (f"measured kernels ({self.name}, {self.dtype}), table {self.path}: {len(self.table)} entries, "
                f"{self.remeasured} re-measured as disturbed or refreshed, typical GEMM spread {100 * self.noise:.1f}%")

    def measure_gemms(self, shapes) -> None:
        """Time every missing or stale (M, K, N) together, interleaved round by round (what `netgain profile` does)."""
        missing = {f"gemm {m} {k} {n}": (m, k, n) for m, k, n in shapes if self._needs(f"gemm {m} {k} {n}")}
        for start in range(0, len(missing), 64):  # batches keep the operands in memory bounded
            batch = dict(itertools.islice(missing.items(), start, start + 64))
            self._store(self._time({key: self._gemm_call(*shape) for key, shape in batch.items()}, cold=True))

    def save(self) -> Path:
        """Write the table (with what it was measured on) to the cache file, atomically (WriteError if it cannot)."""
        record = {
            "format": CACHE_FORMAT,
            "device": self.name,
            "dtype": self.dtype,
            "threads": self.threads,
            "torch": torch.__version__,
            "warmup": self.warmup,
            "repeats": self.repeats,
            "entries": {k: t.as_dict() for k, t in sorted(self.table.items())},
        }
        write_atomically(self.path, lambda f: f.write(json.dumps(record, indent=1).encode()))
        return self.path

    def _load(self) -> dict[str, Timing]:
        """Entries of the cache file for this device and dtype. Only a table netgain wrote is read (and later
        rewritten): any other file is refused, never moved or written over; a table of netgain's own with
        unreadable entries is measured again. A new table's folder is made now, so a path that cannot be
        written fails before any measuring."""
        if not os.path.lexists(self.path):
            _writable_folder(self.path)
            return {}
        require_regular_file(self.path, "cache", CACHE_MAX_BYTES)
        try:
            stored = json.loads(self.path.read_bytes())
        except OSError as error:
            raise ValueError(f"cache {self.path}: {error.strerror or error}") from None
        except ValueError:
            stored = None
        if not (isinstance(stored, dict) and (stored.get("format") == CACHE_FORMAT or set(stored) == LEGACY_FIELDS)):
            raise ValueError(f"cache {self.path} is not a netgain kernel table, and netgain writes over no other file: "
                             "give another path")
        if stored.get("device") != self.name or stored.get("dtype") != self.dtype:
            return {}
        try:
            return {k: Entry.from_dict(v) for k, v in stored["entries"].items()}
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            warnings.warn(f"kernel cache {self.path} has unreadable entries ({error!r}); measuring again", stacklevel=3)
            return {}

    # --- timing ------------------------------------------------------------------------------------

    def _get(self, key: str, make: Callable[[], Callable[[], object]], cold: bool) -> float:
        if self._needs(key):
            self._store(self._time({key: make()}, cold))
        return self.table[key].timing.median_s

    def _needs(self, key: str) -> bool:
        """Whether `key` must be timed before use: missing, or stale."""
        return key not in self.table or key in self.stale

    def _store(self, timings: Mapping[str, Timing]) -> None:
        """Keep fresh timings with the conditions they were taken in (a stale one is now measured again)."""
        self.remeasured += len(self.stale & timings.keys())
        self.stale -= timings.keys()
        self.table.update({key: Entry.now(timing) for key, timing in timings.items()})

    def _bytes(self, numel: int) -> int:
        return numel * torch.finfo(DTYPES[self.dtype]).bits // 8

    @torch.inference_mode()
    def _time(self, calls: Mapping[str, Callable[[], object]], cold: bool) -> dict[str, Timing]:
        """Interleaved timing; `cold`: the caches are flushed (untimed) before every call."""
        sync = torch.cuda.synchronize if self.device.type == "cuda" else None
        before = None
        if cold:
            flush = torch.ones(FLUSH_BYTES // 4, device=self.device)  # read, not written: no dirty lines to drain later
            before = {key: lambda: flush.sum() for key in calls}
        return interleaved(calls, self.repeats, self.warmup, sync, before)

    def _gemm_call(self, m: int, k: int, n: int):
        dtype = DTYPES[self.dtype]
        x = torch.randn(m, k, device=self.device, dtype=dtype)
        w = torch.randn(n, k, device=self.device, dtype=dtype)
        return lambda: F.linear(x, w)

    def _sdpa_call(self, batch: int, heads: int, q_len: int, kv_len: int, head_dim: int, causal: bool):
        dtype = DTYPES[self.dtype]
        q = torch.randn(batch, heads, q_len, head_dim, device=self.device, dtype=dtype)
        kv = torch.randn(batch, heads, kv_len, head_dim, device=self.device, dtype=dtype)
        return lambda: F.scaled_dot_product_attention(q, kv, kv, is_causal=causal)

    def _module_call(self, module: nn.Module, shape: tuple[int, ...]):
        x = torch.randn(*shape, device=self.device, dtype=DTYPES[self.dtype])
        module = _on(module, self.device, DTYPES[self.dtype])
        return lambda: module(x)

    def _gated_call(self, module: nn.Module, shape: tuple[int, ...]):
        gate, up = (torch.randn(*shape, device=self.device, dtype=DTYPES[self.dtype]) for _ in range(2))
        module = _on(module, self.device, DTYPES[self.dtype])
        return lambda: module(gate) * up


def _writable_folder(path: Path) -> None:
    """Make the folder of ``path`` (a cache to be written), or a ValueError saying why it cannot be."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"cache {path}: cannot make its folder ({error.strerror or error})") from None
    if not os.access(path.parent, os.W_OK):
        raise ValueError(f"cache {path}: its folder is not writable")


def _on(module: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The module itself when its parameters already live on `device` in `dtype`, else a copy that does."""
    params = list(module.parameters())
    if all(p.device == device and p.dtype == dtype for p in params):
        return module
    if any(p.is_meta for p in params):  # a shape-only model: give the copy finite values to time
        clone = copy.deepcopy(module).to_empty(device=device).to(dtype)
        for p in clone.parameters():
            p.detach().fill_(1.0)
        return clone
    return copy.deepcopy(module).to(device=device, dtype=dtype)
