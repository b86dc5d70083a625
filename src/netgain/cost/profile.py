"""Kernel latency measured on the current device (CUDA when present, else CPU), cached as JSON.

Rules of thumb about alignment differ per GPU and per CPU (papers/gac.md): the only reliable cost
is a measurement of the real shapes on the target device. `MeasuredCost` times a GEMM or an SDPA
call the first time it is asked (warm-up, then the median of several repeats, threads pinned) and
keeps the result in a table keyed by device, thread count and dtype; `netgain profile` fills that
table ahead of time for the shapes of a given model's layers.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CACHE_DIR = Path(os.environ.get("NETGAIN_CACHE", Path.home() / ".cache" / "netgain"))


def cpu_name() -> str:
    """The CPU model string (for cache keys and reports)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class MeasuredCost:
    """Latency (seconds) of kernels timed on this device; same interface as `AnalyticCost`."""

    def __init__(
        self,
        device: str = "auto",
        dtype: str = "float32",
        *,
        threads: int | None = None,
        warmup: int = 2,
        repeats: int = 5,
        cache: str | Path | None = None,
    ):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
        if warmup < 0 or repeats < 1:
            raise ValueError(f"warmup must be >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
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
        slug = "".join(c if c.isalnum() else "-" for c in f"{self.name}-{dtype}").strip("-").lower()
        self.path = Path(cache) if cache is not None else DEFAULT_CACHE_DIR / f"kernels-{slug}.json"
        self.table: dict[str, dict] = {}
        if self.path.exists():
            stored = json.loads(self.path.read_text())
            if stored.get("device") == self.name and stored.get("dtype") == dtype:
                self.table = stored["entries"]

    def gemm(self, m: int, k: int, n: int) -> float:
        """(M x K) @ (K x N) as nn.Linear runs it: F.linear(x[M, K], w[N, K])."""
        key = f"gemm {m} {k} {n}"
        if key not in self.table:
            x = torch.randn(m, k, device=self.device, dtype=DTYPES[self.dtype])
            w = torch.randn(n, k, device=self.device, dtype=DTYPES[self.dtype])
            self.table[key] = self._time(lambda: F.linear(x, w))
        return self.table[key]["median_s"]

    def sdpa(self, batch: int, heads: int, q_len: int, kv_len: int, head_dim: int, causal: bool = True) -> float:
        """torch's scaled_dot_product_attention with whatever backend it picks for this head_dim."""
        causal = causal and q_len == kv_len and q_len > 1
        key = f"sdpa {batch} {heads} {q_len} {kv_len} {head_dim} {int(causal)}"
        if key not in self.table:
            dtype = DTYPES[self.dtype]
            q = torch.randn(batch, heads, q_len, head_dim, device=self.device, dtype=dtype)
            kv = torch.randn(batch, heads, kv_len, head_dim, device=self.device, dtype=dtype)
            self.table[key] = self._time(lambda: F.scaled_dot_product_attention(q, kv, kv, is_causal=causal))
        return self.table[key]["median_s"]

    def save(self) -> Path:
        """Write the table (with what it was measured on) to the cache file."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "device": self.name,
            "dtype": self.dtype,
            "threads": self.threads,
            "torch": torch.__version__,
            "warmup": self.warmup,
            "repeats": self.repeats,
            "entries": self.table,
        }
        self.path.write_text(json.dumps(record, indent=1, sort_keys=True))
        return self.path

    @torch.inference_mode()
    def _time(self, fn) -> dict:
        cuda = self.device.type == "cuda"
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.repeats):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return {"median_s": statistics.median(times), "times_s": times}


def linear_shapes(config) -> list[tuple[int, int]]:
    """Distinct (in_features, out_features) of the Linears inside a model's decoder layers (no weights loaded)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {
        (m.in_features, m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and ".layers." in f".{name}"
    }
    return sorted(shapes)


def rank_sweep(in_features: int, out_features: int, step: int, min_ratio: float, max_ratio: float) -> list[int]:
    """Ranks at multiples of `step` whose factorised size is within [min_ratio, max_ratio] of the dense layer."""
    breakeven = in_features * out_features / (in_features + out_features)
    low = max(step, step * int(min_ratio * breakeven // step))
    return list(range(low, int(max_ratio * breakeven) + 1, step))


def configure(parser) -> None:
    parser.add_argument("--model", required=True, help="Hugging Face model directory (only its config is read)")
    parser.add_argument("--seq", type=int, default=512, help="prefill tokens (decode is timed with 1 token)")
    parser.add_argument("--step", type=int, default=8, help="rank sweep step")
    parser.add_argument("--min-ratio", type=float, default=0.6, help="smallest factorised size / dense size")
    parser.add_argument("--max-ratio", type=float, default=1.0, help="largest factorised size / dense size")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--cache", default=None, help="JSON table path (default: ~/.cache/netgain/kernels-<device>-<dtype>.json)")


def run(args) -> int:
    from tqdm import tqdm
    from transformers import AutoConfig

    if not 0 < args.min_ratio <= args.max_ratio:
        raise SystemExit(f"--min-ratio/--max-ratio must satisfy 0 < min <= max, got {args.min_ratio}, {args.max_ratio}")
    config = AutoConfig.from_pretrained(args.model)
    cost = MeasuredCost(args.device, args.dtype, threads=args.threads, warmup=args.warmup, repeats=args.repeats, cache=args.cache)
    jobs = []
    for k, n in linear_shapes(config):
        for tokens in (args.seq, 1):
            jobs.append((tokens, k, n))
            for r in rank_sweep(k, n, args.step, args.min_ratio, args.max_ratio):
                jobs += [(tokens, k, r), (tokens, r, n)]
    jobs = sorted(set(jobs))
    for m, k, n in tqdm(jobs, desc=f"profiling {cost.name}", unit="gemm"):
        cost.gemm(m, k, n)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    cost.sdpa(1, config.num_attention_heads, args.seq, args.seq, head_dim)
    path = cost.save()
    print(f"{len(jobs)} GEMM shapes + SDPA timed on {cost.name} ({cost.threads} threads, {args.dtype}); table: {path}")
    return 0
