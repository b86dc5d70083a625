"""Error feedback: EF21 (Richtárik et al. 2021) for the biased sparsifiers, and low rank's residual.

Each worker keeps its own estimate g_i of its gradient and all workers keep the same g, the
mean of the g_i. A step sends only c_i = C(grad_i - g_i); then g_i += c_i and g += mean_i(c_i).
What C drops is not lost: it stays in grad_i - g_i and is sent in a later step.

Buffers are flat over a bucket; the pipeline's state store keeps per-parameter views of them by
name, so they survive DDP's bucket rebuild and checkpoints name parameters, not buckets.
"""

from __future__ import annotations

import torch


class EF21:
    def __init__(self, numel: int, device: torch.device | str = "cpu"):
        self.local = torch.zeros(numel, device=device)   # g_i
        self.shared = torch.zeros(numel, device=device)  # g, identical on every rank

    def advance(self, local_index, local_values, mean_index, mean_values, out: torch.Tensor) -> torch.Tensor:
        """g_i += c_i and g += mean(c), both sparse; writes the new g (this step's mean) into ``out``.
        scatter_add_, not index_add_: 4x faster on CPU (1% of 16M elements, 1 thread: 0.045 vs 0.18 ms/M)."""
        self.local.scatter_add_(0, local_index, local_values)
        self.shared.scatter_add_(0, mean_index, mean_values)
        return out.copy_(self.shared)

    def restart(self, x: torch.Tensor, ctx) -> torch.Tensor:
        """A step sent by another codec (none, gqsgd) begins: keep this rank's gradient for `sync`."""
        return ctx.buffer("local gradient", x.numel(), x.dtype, x.device).copy_(x)

    def sync(self, grad: torch.Tensor, mean: torch.Tensor) -> None:
        """After an uncompressed step both estimates are exact."""
        self.local.copy_(grad)
        self.shared.copy_(mean)


class LowRankMemory:
    """A rank's residual e_i (what its own projection onto the step's basis missed, per gradient element; their
    mean is what the low-rank mean missed) and the warm-start Q of every compressed matrix (identical on every
    rank), flat over one bucket layout."""

    def __init__(self, numel: int, warm_numel: int, device):
        self.local = torch.zeros(numel, device=device)
        self.shared = torch.zeros(warm_numel, device=device)

    def restart(self, x: torch.Tensor, ctx) -> None:
        """A step sent by another codec (none: warm-up, a small bucket, non-finite; gqsgd: a plan) sends
        grad + e; the warm start stays. The header may have formed M = grad + e already (ctx.carry)."""
        m = ctx.carry.get("m")
        if m is None:
            x.add_(self.local)
        elif m is not x:
            x.copy_(m)

    def sync(self, grad: None, mean: torch.Tensor) -> None:
        """The step that carried e is done: nothing is left behind (a step that raised keeps e)."""
        self.local.zero_()
