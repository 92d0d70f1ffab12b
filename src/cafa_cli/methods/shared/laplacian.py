"""LAME's Laplacian correction of a batch's predictions (Boudiaf et al., CVPR 2022), shared
by `lame` (methods/lame.py, whose docstring gives the equations) and `cafa-robust`, which
applies it to a batch its gate reads as skewed: the affinity of the batch's features and
the fixed-point assignment, as the official code computes them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

AFFINITIES = ("rbf", "knn", "linear")
KNN = 5
LAMBDA = 1.0
MAX_STEPS = 100


def knn_affinity(features: torch.Tensor, k: int = KNN) -> torch.Tensor:
    """W [N, N]: 1 where m is among n's k nearest neighbours (Euclidean, itself excluded), else 0."""
    n = len(features)
    distances = torch.cdist(features, features)
    neighbours = distances.topk(min(k + 1, n), dim=1, largest=False).indices[:, 1:]
    return features.new_zeros(n, n).scatter_(1, neighbours, 1.0)


def rbf_affinity(features: torch.Tensor, k: int = KNN, sigma: float | str = "auto") -> torch.Tensor:
    """W [N, N] = exp(−d²/2σ²) of the Euclidean distances d; σ `auto` is the batch's mean
    distance to the k-th nearest neighbour, counting each point as its own first.

    σ is 0 when every point's k-th neighbour lies at distance 0 (a batch of one image, or of
    identical ones): the official code's W is then 0/0, NaN, and so is every prediction of
    the batch. W here is the kernel's limit as σ → 0 (the value at any σ for d = 0, 0 for
    d > 0), under which each image keeps the class the source model gives it: its only
    neighbours are images of the same features, hence of the same logits. Any other batch's W
    is the official one, bit for bit."""
    distances = torch.cdist(features, features)
    if sigma == "auto":
        sigma = distances.topk(min(k, len(features)), dim=1, largest=False).values[:, -1].mean()
    return torch.where(distances == 0, 1.0, torch.exp(-distances.square() / (2 * sigma**2)))


def affinity_matrix(
    features: torch.Tensor, kind: str = "rbf", k: int = KNN, sigma: float | str = "auto", symmetric: bool = False
) -> torch.Tensor:
    """The affinity `kind` of the (normalised) features, made symmetric when asked."""
    if kind == "rbf":
        kernel = rbf_affinity(features, k, sigma)
    elif kind == "knn":
        kernel = knn_affinity(features, k)
    else:
        kernel = features @ features.T
    return (kernel + kernel.T) / 2 if symmetric else kernel


def laplacian_assignment(
    unary: torch.Tensor, kernel: torch.Tensor, bound_lambda: float = LAMBDA, max_steps: int = MAX_STEPS
) -> torch.Tensor:
    """LAME's fixed-point iterations from Y = softmax(−unary); see methods/lame.py's docstring.
    Every iteration runs (three operators each: a launch apiece on a GPU, where a check
    between them would wait for the device), and the energies and the stop are found
    after them, for all at once: the result is the iterate at which the official loop
    stops, since until then the iterations are the same. (Summed over a stack of
    iterates, an energy may round differently from the loop's sum of one, as that sum
    does with the thread count: where two iterations' energies differ by about 1e-8, the
    stop may move by an iteration, past convergence.)"""
    weighted = bound_lambda * kernel
    assignment = (-unary).softmax(1)
    iterates, pairwises = [], []
    for _ in range(max_steps):
        pairwise = weighted @ assignment
        assignment = (pairwise - unary).softmax(1)
        iterates.append(assignment)
        pairwises.append(pairwise)
    if max_steps < 3:  # the stop is tried from the third iteration
        return assignment
    assignments, pairwise = torch.stack(iterates), torch.stack(pairwises)  # [steps, N, C]
    energy = (
        unary * assignments - bound_lambda * pairwise * assignments + assignments * assignments.clamp_min(1e-20).log()
    ).sum((1, 2))
    return assignments.index_select(0, stopping_iteration(energy).reshape(1))[0]  # indexing by a tensor would read it


def stopping_iteration(energy: torch.Tensor) -> torch.Tensor:
    """The index of the iteration at which the official loop breaks, given every
    iteration's energy E_i: the first i ≥ 2 with |E_i − E_{i−1}| ≤ 1e-8·|E_{i−1}|, else the
    last (a device scalar: nothing is read back)."""
    previous = energy[1:-1]
    converged = (energy[2:] - previous).abs() <= 1e-8 * previous.abs()
    return torch.where(converged.any(), converged.int().argmax() + 2, len(energy) - 1)


def corrected_logits(
    logits: torch.Tensor,
    features: torch.Tensor,
    bound_lambda: float = LAMBDA,
    affinity: str = "rbf",
    knn: int = KNN,
    sigma: float | str = "auto",
    symmetric: bool = False,
    max_steps: int = MAX_STEPS,
) -> torch.Tensor:
    """A batch's logits after LAME's Laplacian correction: the log of the assignment Y from
    −log softmax(logits) and the affinity of the L2-normalised features."""
    unary = -(logits.softmax(1) + 1e-10).log()
    kernel = affinity_matrix(F.normalize(features, dim=1), affinity, knn, sigma, symmetric)
    assignment = laplacian_assignment(unary, kernel, bound_lambda, max_steps)
    return assignment.clamp_min(torch.finfo(assignment.dtype).tiny).log()
