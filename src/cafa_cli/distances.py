"""Squared Mahalanobis distances D_c(z) = ‖L_cᵀ(z − μ_c)‖² from the stored factors.

Never forms a precision or an inverse. The per-class (full) form works through the
classes in chunks whose intermediate [N, chunk, d] tensor stays under a byte
budget, and recomputes each chunk in the backward pass instead of keeping it, so
C = 1000, d = 2048 costs memory for one chunk, not for all classes.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from cafa_cli.statistics import ClassGaussians

CHUNK_BYTES = 64 << 20


class ClassDistances:
    """Callable: features [N, d] -> squared distances [N, C] to every class Gaussian.

    `metric="euclidean"` ignores the covariances (the paper's Euclidean ablation).
    """

    def __init__(self, gaussians: ClassGaussians, device: torch.device | str = "cpu", metric: str = "mahalanobis"):
        self.mode = "euclidean" if metric == "euclidean" else gaussians.covariance
        # Distances are invariant to a common shift; centring on the global mean keeps
        # the expanded forms below (‖a‖² − 2a·b + ‖b‖²) from cancelling in float32.
        self.centre = gaussians.global_mean.to(device)
        self.means = gaussians.means.to(device) - self.centre
        factors = gaussians.factors.to(device)
        if self.mode == "tied":
            self.factor = factors[0]
            self.whitened_means = self.means @ self.factor
        elif self.mode == "diag":
            self.precision_diag = factors.square()  # [C, d]
        elif self.mode == "full":
            self.factors = factors

    @property
    def num_classes(self) -> int:
        return self.means.shape[0]

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        z = z.float() - self.centre
        if self.mode == "full":
            return self._full(z)
        if self.mode == "tied":
            return _expanded_square_distance(z @ self.factor, self.whitened_means)
        if self.mode == "diag":
            # Σ_j p_cj (z_j − μ_cj)² expanded so that no [N, C, d] tensor is formed
            p = self.precision_diag
            d = (z * z) @ p.T - 2 * z @ (p * self.means).T + (p * self.means.square()).sum(1)
            return d.clamp_min(0)
        return _expanded_square_distance(z, self.means)

    def _full(self, z: torch.Tensor) -> torch.Tensor:
        n, d = z.shape
        chunk = max(1, CHUNK_BYTES // max(1, 4 * n * d))
        pieces = []
        for start in range(0, self.num_classes, chunk):
            means = self.means[start : start + chunk]
            factors = self.factors[start : start + chunk]
            if z.requires_grad:
                pieces.append(checkpoint(_full_chunk, z, means, factors, use_reentrant=False))
            else:
                pieces.append(_full_chunk(z, means, factors))
        return torch.cat(pieces, dim=1)


def _full_chunk(z: torch.Tensor, means: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    diff = z.unsqueeze(0) - means.unsqueeze(1)  # [c, N, d]
    whitened = torch.bmm(diff, factors)  # rows (z − μ_c)ᵀ L_c
    return whitened.square().sum(-1).T  # [N, c]


def _expanded_square_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """‖a_n − b_c‖² for all pairs via ‖a‖² − 2a·b + ‖b‖², clamped at 0 against rounding."""
    return (a.square().sum(1, keepdim=True) - 2 * a @ b.T + b.square().sum(1)).clamp_min(0)
