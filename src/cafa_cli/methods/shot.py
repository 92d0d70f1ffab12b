"""SHOT-IM and SHOT online: source hypothesis transfer (Liang et al., "Do We Really Need to
Access the Source Data? Source Hypothesis Transfer for Unsupervised Domain Adaptation",
ICML 2020), as Alfarra et al. run it online on each test batch ("Revisiting Test Time
Adaptation under Online Evaluation", ICML 2024; MotasemAlfarra/Online_Test_Time_Adaptation
tta_methods/shot_im.py and shot.py, adapted from fiveai/LAME's).

Update rule: BatchNorms use the test batch's statistics, the classifier stays as the source
trained it (SHOT's "hypothesis"), and for each batch one optimiser step minimises

    shot-im:  L_IM = (1/N) Σ_n −Σ_c p_nc log(p_nc + ε)  +  Σ_c p̄_c log(p̄_c + ε),
              p_n = softmax(logits_n),  p̄ = (1/N) Σ_n p_n,  ε = 1e-5,

confident predictions (the first term, each prediction's entropy) that are diverse over
the batch (the second, minus the entropy of the batch's mean prediction);

    shot:     L = L_IM + β · CE(logits, ŷ),

ŷ the batch's pseudo-labels from class centroids of its features (no gradient through ŷ):
the features f_n (those entering the classifier) scaled to unit length; centroids weighted
by the predictions, c_k = Σ_n p_nk f_n / (1e-8 + Σ_n p_nk); ŷ_n the nearest centroid in
Euclidean distance; then one refinement round with the hard labels as weights (centroids
of the samples labelled k, nearest again). β = 0.1 (`beta`), Alfarra et al.'s default.

Which parameters: the authors' optimiser takes the BatchNorm affines alone (collect_params),
so `params` norm is their update (their default also computes, and never uses, the
gradients of every other weight of the feature extractor); `params` all trains the whole
feature extractor, as SHOT's offline code does. The prediction reported is the forward
pass's before the update, as their forward_and_adapt returns it. Recipes
(recipes/shot-im.toml, recipes/shot.toml): their SGD, lr 0.01, momentum 0.9, batch 64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cafa_cli.engine.method import Method
from cafa_cli.engine.options import Option

EPSILON = 1e-5  # inside the logs of both entropies, as SHOT's loss.Entropy and its diversity term
CENTROID_EPSILON = 1e-8  # SHOT's obtain_label: a class no sample weighs on gets the zero centroid
BETA = 0.1  # Alfarra et al.'s --beta_clustering_loss default (SHOT's offline cls_par: 0.3)
REFINEMENTS = 1  # rounds of hard-label centroids after the soft ones, as every SHOT code


def information_maximisation(logits: torch.Tensor) -> torch.Tensor:
    """SHOT-IM's loss: the mean entropy of the predictions minus the entropy of their mean."""
    probabilities = logits.softmax(1)
    conditional_entropy = -(probabilities * torch.log(probabilities + EPSILON)).sum(1).mean(0)
    marginal = probabilities.mean(0)
    negative_marginal_entropy = (marginal * torch.log(marginal + EPSILON)).sum()
    return conditional_entropy + negative_marginal_entropy


@torch.no_grad()
def centroid_pseudo_labels(logits: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """Each sample's nearest class centroid, [N]: centroids of the unit-length features weighted
    by the softmax, then REFINEMENTS rounds weighted by the labels so found."""
    # unit length; an all-zero feature vector stays zero (the authors' division makes it NaN,
    # which would turn every centroid, and so every label of the batch, into class 0's)
    features = F.normalize(features.detach(), dim=1)
    weights = logits.detach().softmax(1)
    labels = _nearest_centroid(features, weights)
    for _ in range(REFINEMENTS):
        hard = torch.zeros_like(weights).scatter_(1, labels[:, None], 1.0)  # one-hot, no host sync
        labels = _nearest_centroid(features, hard)
    return labels


def _nearest_centroid(features: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    centroids = weights.T @ features / (CENTROID_EPSILON + weights.sum(0)[:, None])
    return torch.cdist(features, centroids).argmin(1)


class ShotIM(Method):
    name = "shot-im"
    capturable = True  # a CUDA graph may replay its step (engine/method.py)
    predicts_before_update = True

    def loss(self, logits: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return information_maximisation(logits)


class Shot(ShotIM):
    name = "shot"
    capturable = True  # said again: a loss of its own is not replayed unless it says so (engine/method.py)
    options = (
        Option("beta", BETA, "β, the weight of the cross-entropy against the centroid pseudo-labels", "positive"),
    )

    def loss(self, logits: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        labels = centroid_pseudo_labels(logits, features)
        return information_maximisation(logits) + self.beta * F.cross_entropy(logits, labels)
