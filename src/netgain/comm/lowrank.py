"""Low-rank gradient compression (PowerSGD, Vogels et al. 2019) whose factors may travel as Global-QSGD codes.

Each matrix-shaped gradient M (rows x cols, error feedback added) is approximated by P Q^T of
rank r. One power iteration per step, warm-started from last step's Q:
    P = mean_i(M_i Q)        (round 1: allreduce)      P <- orthonormal columns of P
    Q = mean_i(M_i^T P)      (round 2: allreduce)      result P Q^T, identical on every rank
and each rank keeps e_i = M_i - P Q_i^T for its next step, Q_i = M_i^T P its own part of round 2: the residual of
its own projection. Its mean over the ranks is PowerSGD's M - P Q^T, but unlike PowerSGD's e_i it holds no
rank-specific part in P's span. That part (P (Q_i - Q)^T) cancels in every mean, yet it adds up step after step
(P barely moves between steps), and with Global-QSGD factors it sets the global scale of Q's code: on the second
lab job (3 simulated ranks, r = 4, 8-bit, 4 seeds) the relative error of Q's mean grew to 13-33% by step 30-39
and the loss at step 160 lagged fp32 factors' by 0.09-0.17; with own residuals that error stayed at 3-4%, the lag
0.03-0.06 (bench/results/lowrank_own_residual.md). Both rounds are sums, so Global-QSGD can
quantize the factors against one global scale per factor column (P's ride in the hook's header, Q's
in one small MAX allreduce) and a native integer allreduce adds them up: low rank and 8 bits
together, 3.5x fewer bytes than PowerSGD's fp32 factors at 2 workers (3x at 3-4). Vectors and
matrices too small to gain (rank r would send more than half of rows x cols) ride in round 1's
payload through the same factor codec.

No Python loop over parameters on the hot path: same-shaped matrices whose offsets in the bucket
step evenly (one per layer, as models lay them out) form one strided view of the bucket, and each
shape group costs one batched matmul per round.

Factors are kept transposed, P^T (r x rows) and Q^T (r x cols) per matrix, so each column of a
factor is a run of its own: one Global-QSGD scale per column. Columns differ in size by the
singular values, and P's are each scaled to unit length by the orthonormalisation, so one scale
per matrix would drown the small columns in rounding noise (relative error of P Q^T 2.4x larger
in a synthetic 768 x 192, r = 4, 3-worker power iteration, 6.9x at 1024 x 1024, r = 8, 4 workers:
bench/results/lowrank_columns_synthetic.md; steps to target: bench/results/lowrank_columns.md). Q's scales need their
own MAX round: bounding them in the header instead (|Q_i[j, c]| <= ||M_i[:, j]||, as P's columns have
unit length), one collective fewer, cost 6-19% more steps to target in 3 of 3 seeds
(bench/results/lowrank_q_bound.md).
"""

from __future__ import annotations

import itertools
import re
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..cost import network
from . import fused
from .codecs import Codec, Context, GlobalQSGD, NoCompression, check_bits
from .feedback import LowRankMemory
from .fused import Segments

FACTORS = ("fp32", "gqsgd")
_P_SALT, _Q_SALT = 0x5053, 0x5153  # factor noise keys differ from the gradient's


@dataclass
class _Group:
    """Same-shaped matrices at evenly spaced offsets: one strided (count, rows, cols) view of the bucket."""

    rows: int
    cols: int
    count: int
    first: int          # offset of the first matrix in the bucket
    stride: int         # offset step between matrices
    p_index: torch.Tensor  # where their P^T (count, rank, rows) lie in round 1's payload
    q_index: torch.Tensor  # where their Q^T (count, rank, cols) lie in round 2's payload and in the warm start

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.as_strided((self.count, self.rows, self.cols), (self.stride, self.cols, 1),
                               flat.storage_offset() + self.first)


class LowRank(Codec):
    """PowerSGD-style rank-r compression with error feedback, warm start and orthonormalisation.

    factors="fp32": the factors travel as fp32 (PyTorch's powerSGD_hook); "gqsgd": as Global-QSGD
    ``bits``-bit packed codes against a global scale per factor (unbiased rounding, one extra small
    MAX allreduce). Every rank must compute the same QR and matmuls bit for bit: run ranks on
    alike devices and thread counts (as PyTorch's PowerSGD requires). Biased (low rank), error feedback keeps what it drops. Wire bits per element
    of an m x n matrix: factor bits * r (m + n) / (m n); see `wire_bits`.
    """

    name, collective, unbiased, needs_scales, uses_feedback, relays = "lowrank", "allreduce", False, True, True, True

    def __init__(self, rank: int = 4, factors: str = "gqsgd", bits: int = 8):
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be an integer >= 1, got rank={rank!r}")
        if factors not in FACTORS:
            raise ValueError(f"factors={factors!r} is not one of {FACTORS}")
        self.rank, self.factors, self.bits = rank, factors, check_bits(bits)
        self.factor_codec = GlobalQSGD(bits) if factors == "gqsgd" else NoCompression()

    def params(self):
        return {"rank": self.rank, "factors": self.factors, **({"bits": self.bits} if self.factors == "gqsgd" else {})}

    def wire_bits(self, world_size):
        raise ValueError("lowrank's wire bits depend on the parameters' shapes: see profile_fields and "
                         "netgain.cost.network.low_rank_messages")

    def compresses(self, rows: int, cols: int) -> bool:
        return network.low_rank_compresses(rows, cols, self.rank)

    convergence = "low-rank"

    def profile_fields(self, world_size: int) -> dict:
        return {"wire_bits": self.factor_codec.wire_bits(world_size), "rank": self.rank,
                "factor_scales": self.factor_codec.needs_scales}

    def rounds(self, ctx: Context) -> int:
        """Collectives per bucket after the header: P, [Q's scales,] Q; only P without a matrix to compress."""
        if not ctx.table(self.describe(), lambda: self._tables(ctx))["groups"]:
            return 1
        return 3 if self.factor_codec.needs_scales else 2

    # ---- state: the store calls these once per bucket layout -------------------------------------
    def memory(self, layout, device) -> tuple[LowRankMemory, list[tuple[int, int]]]:
        """The layout's state and, per parameter, the span of its warm-start Q in the shared buffer."""
        spans = self._warm_spans(_matrices(layout))
        return LowRankMemory(layout.segments.numel, sum(size for _, size in spans), device), spans

    def _warm_spans(self, shapes: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """(offset, size) of each parameter's Q in the warm start and in round 2's payload (0 if not compressed)."""
        sizes = [cols * self.rank if rows and self.compresses(rows, cols) else 0 for rows, cols in shapes]
        return list(zip(itertools.accumulate([0] + sizes[:-1]), sizes))

    def fill_shared(self, name: str, warm: torch.Tensor) -> None:
        """A fresh warm start: Gaussian from the parameter's name, so identical on every rank, run and seed."""
        generator = torch.Generator().manual_seed(fused.name_key(name))
        warm.copy_(torch.randn(warm.numel(), generator=generator))

    # ---- the rounds ----------------------------------------------------------------------
    @property
    def needs_header(self) -> bool:
        """Only gqsgd factors need the header (their global scales). fp32 factors go without it: two
        collectives per bucket, P (the dense parameters riding along) then Q, where PyTorch's PowerSGD
        runs three (its uncompressed tensors, P, Q). NaN/Inf still raise on every rank before any state
        is written: they reach every rank through round 1's sum, which the hook checks before `relay`."""
        return self.factor_codec.needs_scales

    def local_scales(self, x, ctx):
        """The header's part: round 1's local work (`_project`) and max |P| per parameter.
        (The caller times it as encoding, as it does every codec's header work.)"""
        self._project(x, ctx)
        return ctx.tables[self.describe()]["p_segments"].absmax(ctx.carry["p"])

    def scale_params(self, ctx):
        """The header holds one scale per column of P: a compressed matrix owns rank of them."""
        return ctx.tables[self.describe()]["p_params"]

    def _project(self, x, ctx) -> None:
        """Round 1's local part: M = grad + e (in the bucket, or in an fp32 buffer for a 16-bit bucket, so
        the residual keeps its low bits), P = M Q per group; no state is written."""
        t = ctx.table(self.describe(), lambda: self._tables(ctx))
        m = x if x.dtype == torch.float32 else ctx.buffer("lowrank M", x.numel(), torch.float32, x.device)
        torch.add(x, ctx.feedback.local, out=m)
        p = ctx.buffer("lowrank P", t["p_segments"].numel, torch.float32, x.device)
        for g in t["groups"]:
            warm_t = ctx.feedback.shared[g.q_index].view(g.count, self.rank, g.cols)
            p[g.p_index] = _times_t(g.view(m), warm_t).reshape(-1)
        p[t["dense_to"]] = m[t["dense_from"]]
        ctx.carry.update(m=m, p=p, p_ctx=self._factor_context(ctx, t, "p"))

    def encode(self, x, ctx):
        if "p" not in ctx.carry:  # no header ran (fp32 factors)
            with ctx.timed("encode_s"):
                self._project(x, ctx)
        p_ctx = ctx.carry["p_ctx"]
        p_ctx.scales = ctx.scales
        return self.factor_codec.encode(ctx.carry["p"], p_ctx)

    def relay(self, aggregated: torch.Tensor, ctx: Context) -> tuple[torch.Tensor, dist.ReduceOp]:
        """The next round's payload from the last round's result (called rounds - 1 times per bucket)."""
        t, carry = ctx.tables[self.describe()], ctx.carry
        if "q" not in carry:  # P's mean is in: orthonormalise it, Q = M^T P
            p = self.factor_codec.decode(aggregated, carry["p"], carry["p_ctx"])
            with ctx.timed("encode_s"):
                q = ctx.buffer("lowrank Q", t["q_segments"].numel, torch.float32, aggregated.device)
                orthonormal = []
                for g in t["groups"]:
                    basis = torch.linalg.qr(p[g.p_index].view(g.count, self.rank, g.rows).transpose(1, 2)).Q
                    q[g.q_index] = _times_t(g.view(carry["m"]).transpose(1, 2), basis.transpose(1, 2)).reshape(-1)
                    orthonormal.append(basis)
            own = ctx.buffer("lowrank own Q", q.numel(), torch.float32, q.device).copy_(q)  # encode may overwrite q
            carry.update(q=q, own=own, basis=orthonormal, q_ctx=self._factor_context(ctx, t, "q"))
            if self.factor_codec.needs_scales:
                return t["q_segments"].absmax(q), dist.ReduceOp.MAX
        else:  # Q's global scales are in
            carry["q_ctx"].scales = torch.where(aggregated > 0, aggregated, torch.ones_like(aggregated))
        return self.factor_codec.encode(carry["q"], carry["q_ctx"]), dist.ReduceOp.SUM

    def decode(self, aggregated, out, ctx):
        """Q's mean is in: write P Q^T into the bucket, keep e_i = M_i - P Q_i^T (this rank's own Q_i) and Q as the
        next warm start."""
        t, carry, memory = ctx.tables[self.describe()], ctx.carry, ctx.feedback
        if not t["groups"]:  # no matrix: round 1 carried every parameter, in the bucket's order
            return out.copy_(self.factor_codec.decode(aggregated, carry["p"], carry["p_ctx"]))
        q = self.factor_codec.decode(aggregated, carry["q"], carry["q_ctx"])
        with ctx.timed("decode_s"):
            dense = carry["p"][t["dense_to"]]  # P's buffer holds the dense parameters' mean
            for g, basis in zip(t["groups"], carry["basis"]):
                q_t = q[g.q_index].view(g.count, self.rank, g.cols)
                own_t = carry["own"][g.q_index].view(g.count, self.rank, g.cols)
                # e_i = M_i - P Q_i^T first (M may be the bucket itself), then P Q^T straight into the bucket:
                # no approximation buffer to write, read back and copy (1.2 + 1.0 against 1.0 + 0.5 + 0.5 ms/M)
                torch.baddbmm(g.view(carry["m"]), basis, own_t, alpha=-1, out=g.view(memory.local))
                if out.dtype == torch.float32:
                    torch.bmm(basis, q_t, out=g.view(out))
                else:  # a 16-bit bucket: bmm writes fp32 only
                    g.view(out).copy_(torch.bmm(basis, q_t))
            memory.shared.copy_(q)
            out[t["dense_from"]] = dense.to(out.dtype)
            return out

    # ---- tables, once per bucket layout ----------------------------------------------------
    def _tables(self, ctx: Context) -> dict:
        layout, s, r = ctx.layout, ctx.segments, self.rank
        device = s.starts.device
        shapes = _matrices(layout)
        compressed = [bool(rows) and self.compresses(rows, cols) for rows, cols in shapes]
        p_sizes = [rows * r if c else numel for (rows, _), (_, numel), c in zip(shapes, layout.spans, compressed)]
        p_starts = list(itertools.accumulate([0] + p_sizes[:-1]))
        p_columns = [(i, j, rows if c else numel) for i, ((rows, _), (_, numel), c)
                     in enumerate(zip(shapes, layout.spans, compressed)) for j in range(r if c else 1)]
        q_columns = [(i, j, cols) for i, ((_, cols), c) in enumerate(zip(shapes, compressed)) if c for j in range(r)]
        warm = self._warm_spans(shapes)
        q_starts = {i: at for i, (at, _) in enumerate(warm)}
        families = defaultdict(list)  # same shape and name up to layer numbers: evenly spaced, usually
        for i, c in enumerate(compressed):
            if c:
                families[(shapes[i], re.sub(r"\d+", "#", layout.names[i]))].append(i)
        groups = []
        for ((rows, cols), _), members in families.items():
            for run in _even_runs(members, [layout.spans[i][0] for i in members]):
                offsets = [layout.spans[i][0] for i in run]
                groups.append(_Group(rows, cols, len(run), offsets[0], offsets[1] - offsets[0] if len(run) > 1 else 0,
                                     _ranges([p_starts[i] for i in run], rows * r, device),
                                     _ranges([q_starts[i] for i in run], cols * r, device)))
        dense = [i for i, c in enumerate(compressed) if not c]
        keys = s.keys.tolist()
        return {"groups": groups,
                "dense_from": _ranges([layout.spans[i][0] for i in dense], [layout.spans[i][1] for i in dense], device),
                "dense_to": _ranges([p_starts[i] for i in dense], [layout.spans[i][1] for i in dense], device),
                **_column_segments("p", p_columns, keys, device),
                **(_column_segments("q", q_columns, keys, device) if groups else {"q_segments": None})}

    def _factor_context(self, ctx: Context, t: dict, factor: str) -> Context:
        """The factor codec's view of one round: its own segments (one per column), noise keys and buffers."""
        segments, keys = t[f"{factor}_segments"], ctx.noise_keys[t[f"{factor}_params"]] ^ t[f"{factor}_salts"]
        return Context(ctx.world_size, segments, fused.hash32(keys), keys,
                       tables=ctx.table(("lowrank factor tables", factor), dict), seconds=ctx.seconds,
                       synchronize=ctx.synchronize)


def _times_t(m: torch.Tensor, factor_t: torch.Tensor) -> torch.Tensor:
    """(m @ factor)^T for a batch of matrices m and thin factors (r columns) given transposed, computed as
    factor^T m^T: BLAS runs this wide product at memory speed, the tall-thin m @ factor 2-9x slower
    (16 x 1024 x 1024, r = 4, 1 thread, ms per million elements of m: M Q 1.37 -> 0.55, M^T P 5.4 -> 0.61)."""
    return torch.bmm(factor_t, m.transpose(1, 2))


def _column_segments(factor: str, columns: list[tuple[int, int, int]], keys: list[int], device) -> dict:
    """A factor's segments, one per (parameter, column, size) in payload order; each column's noise
    is keyed by its parameter's step key (``{factor}_params``) xor a salt of (factor, column)."""
    salt = _P_SALT if factor == "p" else _Q_SALT
    return {f"{factor}_segments": Segments.build([size for _, _, size in columns],
                                                 [keys[i] for i, _, _ in columns], device),
            f"{factor}_params": torch.tensor([i for i, _, _ in columns], dtype=torch.long, device=device),
            f"{factor}_salts": fused.hash32(torch.tensor([salt ^ (j << 16) for _, j, _ in columns], dtype=torch.int32,
                                                         device=device))}


def _matrices(layout) -> list[tuple[int, int]]:
    """(rows, cols) of every parameter as PowerSGD sees it (dim 0 by the rest), (0, 0) for vectors."""
    if layout.shapes is None:
        raise ValueError("lowrank needs the parameters' shapes (a bucket layout from DDP)")
    return [network.as_matrix(shape) for shape in layout.shapes]


def _even_runs(members: list[int], offsets: list[int]) -> list[list[int]]:
    """Split parameters (in bucket order) into runs whose offsets step by one constant."""
    runs = []
    for i, offset in zip(members, offsets):
        run = runs[-1] if runs else None
        if run is not None and (len(run[0]) == 1 or offset - run[1][-1] == run[1][1] - run[1][0]):
            run[0].append(i)
            run[1].append(offset)
        else:
            runs.append(([i], [offset]))
    return [run for run, _ in runs]


def _ranges(starts: list[int], sizes, device) -> torch.Tensor:
    """Concatenated index ranges [start, start + size) as one int64 tensor (built once per layout)."""
    sizes = sizes if isinstance(sizes, list) else [sizes] * len(starts)
    if not starts:
        return torch.zeros(0, dtype=torch.long, device=device)
    return torch.cat([torch.arange(a, a + n, device=device) for a, n in zip(starts, sizes)])
