"""Test-time objectives as plain tensor functions -> scalar loss: entropy and pseudo-label take
logits, global alignment takes features, cafa and intra take class distances and pseudo-labels.
The per-sample terms ROID, CMF and RMT share (soft likelihood ratio, symmetric cross-entropy),
COME's entropy of opinion (and the option by which the entropy methods take it) and ROID's
batch prior are here too, so that no method imports another's."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from cafa_cli.engine.options import Option

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


def marginal_entropy(logits: torch.Tensor) -> torch.Tensor:
    """The entropy of the mean of softmax(logits) over the rows (the views of one image):
    MEMO's and TPT's objective, log p̄ in log space and clamped to the dtype's lowest value."""
    mean = torch.logsumexp(logits.log_softmax(1), 0) - math.log(len(logits))  # log p̄
    mean = mean.clamp_min(torch.finfo(mean.dtype).min)
    return -(mean.exp() * mean).sum()


COME_EPS = 1e-7  # added to each mass of the opinion before its logarithm, as the authors


def come_entropies(logits: torch.Tensor) -> torch.Tensor:
    """COME's entropy of opinion (Zhang et al., ICLR 2025), each sample's, [N]: the Shannon
    entropy of the subjective-logic opinion whose evidence is e = exp(logits), over the C class
    beliefs b_c = e_c/S and the uncertainty u = C/S, S = Σ_c e_c + C, each mass plus 1e-7.
    Those C + 1 masses are the softmax of the logits with one more logit, ln C, so they are
    computed as that softmax (finite where exp(logits) would overflow). The logits enter as
    x/‖x‖·‖x‖ with the second norm detached: the same value, but a gradient that cannot change
    their norm (the authors' stand-in for bounding it)."""
    norm = logits.norm(dim=1, keepdim=True)
    bounded = logits / norm * norm.detach()
    uncertain = bounded.new_full((len(bounded), 1), math.log(bounded.shape[1]))
    opinion = torch.cat([bounded, uncertain], 1).softmax(1) + COME_EPS
    return -(opinion * opinion.log()).sum(1)


# TENT, ETA, EATA and SAR minimise (and ETA, EATA and SAR select by) one of these; COME is the same
# methods with its entropy in place of Shannon's, as its authors run them
ENTROPIES = {"shannon": entropies, "come": come_entropies}
ENTROPY = Option(
    "entropy",
    "shannon",
    "the entropy minimised (and selected by): shannon, or come (COME's entropy of opinion, Zhang et al. ICLR 2025)",
    "choice",
    tuple(ENTROPIES),
)


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


SLR_CLIP = 0.99  # the soft likelihood ratio's largest probability
SLR_EPS = 1e-5  # inside its logarithm


def soft_likelihood_ratio(logits: torch.Tensor) -> torch.Tensor:
    """Each sample's −Σ_c p̃_c log(p̃_c/(1 − p̃_c) + ε), p̃ = softmax clamped at 0.99, [N]:
    entropy-like, but its gradient does not vanish as a prediction grows confident (ROID, CMF)."""
    probs = torch.clamp(logits.softmax(1), min=0.0, max=SLR_CLIP)
    return -(probs * torch.log(probs / (1 - probs) + SLR_EPS)).sum(1)


def symmetric_cross_entropy(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Each sample's −½ Σ_c softmax(b)_c log softmax(a)_c − ½ Σ_c softmax(a)_c log softmax(b)_c,
    [N], with gradients through both (detach one side for a teacher's target)."""
    return -0.5 * (b.softmax(1) * a.log_softmax(1)).sum(1) - 0.5 * (a.softmax(1) * b.log_softmax(1)).sum(1)


def min_max(scores: torch.Tensor) -> torch.Tensor:
    """`scores` mapped onto [0, 1] by the batch's smallest and largest (NaN where they are one: `alike`)."""
    return (scores - scores.min()) / (scores.max() - scores.min())


# When sample weights min-max normalised over the batch (roid's, cmf's) are undefined: the
# authors' weights are then NaN (0/0), and after their step so is every trained value
MIN_MAX_UNDEFINED = (
    "a batch of one image or of images it scores alike (its sample weights are min-max normalised over the batch)"
)


def alike(*scores: torch.Tensor) -> torch.Tensor:
    """Whether some of `scores` is the same for every sample (a batch of one image, or of
    images scored alike), where min_max is 0/0 (a device bool; NaN scores are not alike)."""
    return torch.stack([s.max() == s.min() for s in scores]).any()


def smoothed_prior(logits: torch.Tensor) -> torch.Tensor:
    """The batch's mean prediction π, smoothed toward uniform: (π + s)/(1 + s·C), s =
    max(1/N, 1/C)/max π, [C] (the smaller the batch, the less it is trusted; ROID's prior correction)."""
    n, classes = logits.shape
    prior = logits.softmax(1).mean(0)
    smooth = max(1 / n, 1 / classes) / prior.max()
    return (prior + smooth) / (1 + smooth * classes)
