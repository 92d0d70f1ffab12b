"""CAFA as the paper writes it (Jung et al., ICCV 2023, Sec. 3): dense, float64, read top to bottom.

This is the definition. gaussians.py, distances.py and losses.py compute the same numbers
in float32 from structured covariances (tied, diagonal, low-rank), in chunks, and
tests/test_reference.py checks them against it. Notation: features z ∈ R^d (the input of
the final linear layer), C classes, ŷ_n = argmax of sample n's logits, D [N, C] distances.
"""

import torch
import torch.nn.functional as F


def moments(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and covariance, dividing by N: of one class's source features (μ_c, Σ_c), or of
    features without their classes (Global FA's μ_s, Σ_s; a test batch's μ̂_t, Σ̂_t)."""
    centred = z.double() - z.double().mean(0)
    return z.double().mean(0), centred.T @ centred / len(z)


def class_gaussians(
    z: torch.Tensor, labels: torch.Tensor, num_classes: int, shrinkage: float = 0.0, covariance: str = "full"
) -> tuple[torch.Tensor, torch.Tensor]:
    """μ_c, Σ_c of each class's source features, Σ_c shrunk to (1 − λ)Σ_c + λ·tr(Σ_c)/d·I.
    `tied`: the pooled Σ = Σ_c N_c Σ_c / N for every class, shrunk likewise; `diag`: the
    diagonal of the shrunk Σ_c. Returns the means [C, d] and covariances [C, d, d]."""
    means, sigmas = map(torch.stack, zip(*(moments(z[labels == c]) for c in range(num_classes))))
    if covariance == "tied":
        counts = torch.bincount(labels, minlength=num_classes).double()
        sigmas = ((counts[:, None, None] * sigmas).sum(0) / counts.sum()).expand_as(sigmas)
    sigmas = shrink(sigmas, shrinkage)
    if covariance == "diag":
        sigmas = torch.diag_embed(sigmas.diagonal(dim1=-2, dim2=-1))
    return means, sigmas


def shrink(sigma: torch.Tensor, shrinkage: float) -> torch.Tensor:
    """(1 − λ)Σ + λ·tr(Σ)/d·I: toward a scaled identity, so that Σ is invertible when N_c ≤ d."""
    d = sigma.shape[-1]
    target = sigma.diagonal(dim1=-2, dim2=-1).sum(-1) / d
    return (1 - shrinkage) * sigma + shrinkage * target[..., None, None] * torch.eye(d, dtype=sigma.dtype)


def precision_factor(sigma: torch.Tensor) -> torch.Tensor:
    """L with Σ⁻¹ = L Lᵀ: for Σ = K Kᵀ (Cholesky), L = K⁻ᵀ. The artifact stores a lower-triangular
    L instead; every such L gives the same D_c(z) = ‖Lᵀ(z − μ_c)‖²."""
    k = torch.linalg.cholesky(sigma)
    eye = torch.eye(sigma.shape[-1], dtype=sigma.dtype).expand_as(sigma)
    return torch.linalg.solve_triangular(k, eye, upper=False).mT


def mahalanobis(z: torch.Tensor, means: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """D[n, c] = (z_n − μ_c)ᵀ Σ_c⁻¹ (z_n − μ_c) = ‖K_c⁻¹(z_n − μ_c)‖² with Σ_c = K_c K_cᵀ:
    one triangular solve per class, never an inverse."""
    diff = z.double()[None] - means.double()[:, None]  # [C, N, d]
    k = torch.linalg.cholesky(sigmas.double())
    return torch.linalg.solve_triangular(k, diff.mT, upper=False).square().sum(1).T


def mahalanobis_from_factors(z: torch.Tensor, means: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """The same D from precision factors [C, d, d]: D[n, c] = ‖L_cᵀ(z_n − μ_c)‖²."""
    diff = z.double()[None] - means.double()[:, None]  # [C, N, d]
    return (diff @ factors.double()).square().sum(-1).T


def euclidean(z: torch.Tensor, means: torch.Tensor) -> torch.Tensor:
    """The Euclidean ablation: D[n, c] = ‖z_n − μ_c‖², the Mahalanobis distance with Σ_c = I."""
    return (z.double()[:, None] - means.double()[None]).square().sum(-1)


def pseudo_labels(logits: torch.Tensor) -> torch.Tensor:
    """ŷ_n = argmax_c logits[n, c], a proxy for the unknown label: no gradient flows through it."""
    return logits.detach().argmax(1)


def cafa_loss(distances: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """L_CAFA = (1/N) Σ_n log( D_ŷn(z_n) / Σ_c D_c(z_n) ): pulls z_n toward its predicted
    class (intra-class distance) and away from the others (inter-class distance)."""
    own = distances.gather(1, pseudo_labels(logits)[:, None]).squeeze(1)
    return (own / distances.sum(1)).log().mean()


def intra_loss(distances: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The intra-class ablation: L_intra = (1/N) Σ_n D_ŷn(z_n)."""
    return distances.gather(1, pseudo_labels(logits)[:, None]).mean()


def global_alignment(z: torch.Tensor, source_mean: torch.Tensor, source_sigma: torch.Tensor) -> torch.Tensor:
    """Global FA: ‖μ_s − μ̂_t‖² + ‖Σ_s − Σ̂_t‖_F², blind to the classes."""
    mean, sigma = moments(z)
    return (source_mean.double() - mean).square().sum() + (source_sigma.double() - sigma).square().sum()


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """TENT: (1/N) Σ_n −Σ_c p_nc log p_nc with p_n = softmax(logits_n)."""
    p = logits.double().softmax(1)
    return -(p * p.log()).sum(1).mean()


def pseudo_label(logits: torch.Tensor) -> torch.Tensor:
    """PL: the cross-entropy of the logits against their own hard predictions ŷ."""
    return F.cross_entropy(logits.double(), pseudo_labels(logits))
