"""Test-time objectives as plain tensor functions -> scalar loss: entropy and pseudo-label take
logits, global alignment takes features, cafa and intra take class distances and pseudo-labels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Distances are clamped into this range before the log: a sample sitting exactly on
# a class mean (D = 0) or absurdly far from all (D overflowing) must give a finite loss.
_MIN_DISTANCE = 1e-12


_MAX_DISTANCE = 1e30


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """TENT: mean Shannon entropy of the predictions."""
    return entropies(logits).mean()


def entropies(logits: torch.Tensor) -> torch.Tensor:
    """Each prediction's Shannon entropy, [N] (EATA and SAR select and weight by it)."""
    log_p = logits.log_softmax(1)
    return -(log_p.exp() * log_p).sum(1)


def pseudo_label(logits: torch.Tensor) -> torch.Tensor:
    """PL: cross-entropy against the model's own hard predictions."""
    return F.cross_entropy(logits, logits.detach().argmax(1))


def cafa(distances: torch.Tensor, pseudo_labels: torch.Tensor) -> torch.Tensor:
    """L_CAFA = mean_n log( D_ŷ(z_n) / Σ_c D_c(z_n) ), computed in log space.

    `pseudo_labels` must carry no gradient; gradients reach the features through the
    distances only.
    """
    return cafa_terms(distances, pseudo_labels).mean()


def cafa_terms(distances: torch.Tensor, pseudo_labels: torch.Tensor) -> torch.Tensor:
    """Each sample's log( D_ŷ(z_n) / Σ_c D_c(z_n) ), [N] (cafa-eata weights them)."""
    log_d = distances.clamp(_MIN_DISTANCE, _MAX_DISTANCE).log()
    own = log_d.gather(1, pseudo_labels.detach().view(-1, 1)).squeeze(1)
    return own - torch.logsumexp(log_d, dim=1)


def intra(distances: torch.Tensor, pseudo_labels: torch.Tensor) -> torch.Tensor:
    """Intra-class distance only: mean D_ŷ(z_n) (the paper's ablation)."""
    return distances.clamp_max(_MAX_DISTANCE).gather(1, pseudo_labels.detach().view(-1, 1)).mean()


def global_alignment(
    features: torch.Tensor, source_mean: torch.Tensor, source_covariance: torch.Tensor
) -> torch.Tensor:
    """Global FA: ‖μ_s − μ̂_t‖² + ‖Σ_s − Σ̂_t‖_F² with the test batch's mean and covariance."""
    z = features.float()
    mean = z.mean(0)
    centred = z - mean
    covariance = centred.T @ centred / len(z)
    return (source_mean - mean).square().sum() + (source_covariance - covariance).square().sum()
