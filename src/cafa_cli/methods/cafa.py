"""CAFA: Class-Aware Feature Alignment (Jung et al., ICCV 2023), and two of its ablations.

Update rule: BatchNorms use the test batch's statistics; for each batch, one optimiser
step on the normalisation affines (γ, β) minimising

    L_CAFA = (1/N) Σ_n log( D_ŷn(z_n) / Σ_c D_c(z_n) ),   ŷ_n = argmax logits_n (no gradient)

with D_c(z) = (z − μ_c)ᵀ Σ_c⁻¹ (z − μ_c) the squared Mahalanobis distance to the source
Gaussian of class c (`cafa stats`). It pulls each feature toward its predicted class and
away from the others. Defaults, as the paper's CIFAR runs: Adam, lr 1e-3, batch 200
(ImageNet-C: SGD, lr 0.0025, batch 64). reference.py spells it out in float64.

Ablations from the paper: `intra` minimises D_ŷn(z_n) alone (pulls toward the predicted
class, pushes from none); `euclidean` is CAFA with D_c(z) = ‖z − μ_c‖² (Σ_c = I). The
covariance ablations (tied, diagonal) are CAFA given Gaussians estimated in that form.

CAFA-Oracle (`oracle`, the paper's analysis of how many training samples suffice): ŷ_n is
the image's true label instead of the prediction; the reported predictions do not change.
"""

from __future__ import annotations

import torch

from cafa_cli.engine.method import Method
from cafa_cli.methods.shared import losses
from cafa_cli.statistics.distances import ClassDistances


class Cafa(Method):
    name = "cafa"
    capturable = True  # a CUDA graph may replay its step (base.py)
    needs_statistics = True
    takes_labels = True  # CAFA-Oracle: the true labels in place of ŷ (base.py)
    predicts_before_update = True
    metric = "mahalanobis"
    unsaved = (*Method.unsaved, "distances")  # made from the statistics: GBs on ImageNet, and never changed

    def setup(self) -> None:
        self.distances = ClassDistances(self.gaussians, self.device, metric=self.metric)
        self.unrefined = self.distances.unrefined

    def loss(self, logits: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return losses.cafa(self.distances(features), self.class_labels(logits))


class IntraOnly(Cafa):
    name = "intra"
    capturable = True  # its loss keeps its state in place (base.py)
    takes_labels = True

    def loss(self, logits: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return losses.intra(self.distances(features), self.class_labels(logits))


class Euclidean(Cafa):
    name = "euclidean"
    metric = "euclidean"
