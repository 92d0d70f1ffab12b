"""LAME: Laplacian adjusted maximum-likelihood estimation (Boudiaf et al., "Parameter-free
Online Test-time Adaptation", CVPR 2022).

Update rule: the model is not changed (no gradient; BatchNorms keep their source
statistics); only its outputs are. For a batch with source probabilities p_n and
L2-normalised features z_n, with the kNN affinity W_nm = 1 when z_m is among the k nearest
neighbours of z_n (itself excluded), symmetrised W ← (W + Wᵀ)/2, LAME minimises over the
assignments Y (rows on the simplex)

    E(Y) = Σ_n [ −Y_nᵀ log p_n + Y_nᵀ log Y_n ] − λ Σ_{n,m} W_nm Y_nᵀ Y_m

by the fixed-point (bound-optimisation) iterations Y_n ← softmax(log p_n + λ Σ_m W_nm Y_m),
from Y = p, stopping when E changes by at most 1e-8·|E| (after the third iteration) or
after 100 iterations. Y is reported (as log Y, whose softmax is Y).

Defaults, as the official code: k = 5, λ = 1, 100 iterations, log p = log(p + 1e-10).
The stop is made on the device: iterations after convergence leave Y as it was, so the
result is the official one without reading a value back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from cafa_cli.method.methods.base import Method

KNN = 5
LAMBDA = 1.0
MAX_STEPS = 100


def knn_affinity(features: torch.Tensor, k: int = KNN) -> torch.Tensor:
    """W [N, N]: 1 where m is among n's k nearest neighbours (Euclidean, itself excluded), else 0."""
    n = len(features)
    distances = torch.cdist(features, features)
    neighbours = distances.topk(min(k + 1, n), dim=1, largest=False).indices[:, 1:]
    return features.new_zeros(n, n).scatter_(1, neighbours, 1.0)


def laplacian_assignment(unary: torch.Tensor, kernel: torch.Tensor, bound_lambda: float = LAMBDA,
                         max_steps: int = MAX_STEPS) -> torch.Tensor:
    """LAME's fixed-point iterations from Y = softmax(−unary); see the module's docstring."""
    assignment = (-unary).softmax(1)
    done = torch.zeros((), dtype=torch.bool, device=unary.device)
    previous = torch.full((), float("inf"), device=unary.device)
    for i in range(max_steps):
        pairwise = bound_lambda * kernel @ assignment
        updated = (pairwise - unary).softmax(1)
        energy = (unary * updated - bound_lambda * pairwise * updated + updated * updated.clamp_min(1e-20).log()).sum()
        assignment = torch.where(done, assignment, updated)
        if i > 1:
            done = done | ((energy - previous).abs() <= 1e-8 * previous.abs())
        previous = energy
    return assignment


class Lame(Method):
    name = "lame"
    adapts_normalisation = False
    trains = False

    def __init__(self, knn: int = KNN, bound_lambda: float = LAMBDA, max_steps: int = MAX_STEPS):
        self.knn, self.bound_lambda, self.max_steps = knn, bound_lambda, max_steps

    def output(self, logits: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        unary = -(logits.softmax(1) + 1e-10).log()
        kernel = knn_affinity(F.normalize(features, dim=1), self.knn)
        kernel = (kernel + kernel.T) / 2
        assignment = laplacian_assignment(unary, kernel, self.bound_lambda, self.max_steps)
        return assignment.clamp_min(torch.finfo(assignment.dtype).tiny).log()
