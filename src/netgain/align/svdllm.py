"""SVD-LLM: truncation-aware data whitening by the Cholesky factor of the calibration input covariance.

With C = E[x x^T] = L L^T, the SVD of W L makes the output error of dropping component j exactly
sigma_j^2 on the calibration data (||(W - W_r) X||^2 = sum of the dropped sigma^2), so truncating
the smallest singular values is the least-squares choice, which ASVD's diagonal scaling only
approximates (Wang et al., SVD-LLM, 2024). Rank allocation, the rebuild and save/load are
`lowrank.LowRank`'s: the predicted loss curve prices every rank of every Linear in nats per token.
"""

from __future__ import annotations

import torch

from .lowrank import LowRank

CHOLESKY_TRIES = 12  # jitter grows tenfold per failed try


def cholesky(covariance: torch.Tensor, jitter: float) -> torch.Tensor:
    """Lower Cholesky factor of a covariance; when it is not positive definite (fewer calibration
    tokens than inputs, dead channels), `jitter` x its mean diagonal is added to the diagonal, tenfold
    more per try."""
    eye = torch.eye(covariance.shape[0], dtype=covariance.dtype)
    scale = float(covariance.diagonal().mean().clamp_min(1e-30))
    added = 0.0
    for _ in range(CHOLESKY_TRIES):
        factor, info = torch.linalg.cholesky_ex(covariance + added * scale * eye)
        if info == 0:
            return factor
        added = jitter if added == 0 else added * 10
    raise ValueError(f"input covariance is not positive definite even with jitter {added / 10:g} x its mean diagonal")


class SVDLLM(LowRank):
    """Whitening S = L, the Cholesky factor of the calibration input covariance; implements `Compressor`."""

    method = "svdllm"

    def __init__(self, jitter: float = 1e-6):
        if not 0 < jitter < 1:
            raise ValueError(f"jitter must be in (0, 1), got {jitter}")
        super().__init__()
        self.jitter = jitter

    def factorise(self, weight, inputs):
        # float64; q, k and v (gate and up) read one input: one factor
        factor = inputs.cached("cholesky", lambda: cholesky(inputs.covariance(), self.jitter))
        u, sigma, vt = torch.linalg.svd(weight.double() @ factor, full_matrices=False)
        m = torch.linalg.solve_triangular(factor.T, vt.T, upper=True).T  # V^T L^-1
        return u.float(), sigma.float(), m.float()
