"""SANTA: Source Anchoring Network and Target Alignment (Chakrabarty, Sreenivas and Biswas,
"SANTA: Source Anchoring Network and Target Alignment for Continual Test Time Adaptation",
TMLR 2023; its code is in the benchmark collection mariodoebler/test-time-adaptation,
classification/methods/santa.py, which this follows).

Update rule: the adapted model θ (its normalisation affines), an anchor θ₀ (a frozen copy
of the source model) and a projector g (Linear d→p, ReLU, Linear p→p; trained with θ, same
rate), all normalising with the test batch's statistics. For each batch x, with x̃ = one
random view of x (methods/shared/augment.py, CoTTA's pipeline, as the authors' get_tta_transforms),
logits s = f_θ(x), s̃ = f_θ(x̃) with features z, z̃, and anchor logits a = f_θ₀(x):

1. source anchoring, a cross-entropy from the adapted model's distributions to the
   anchor's (the authors' AugCrossEntropy, α = ½; the gradient goes through softmax(s)
   and softmax(s̃), the anchor's log-probabilities are constants):
       L_anc = −(1/N) Σ_n Σ_c [½ softmax(s_n)_c + ½ softmax(s̃_n)_c] log softmax(a_n)_c;
2. target alignment, a contrastive loss that pulls each sample and its view to their
   nearest source prototype μ_k (the source class means of the features; k_n = argmax_c
   cos(z_n, μ_c), no gradient): the 3N vectors v = (μ_k1..μ_kN, z_1..z_N, z̃_1..z̃_N),
   projected and normalised, e_i = g(v_i)/‖g(v_i)‖; with a_ij = e_i·e_j/τ and P(i) the two
   other vectors of the same sample (SupCon, contrast mode `all`),
       L_con = −(1/3N) Σ_i (1/2) Σ_{j∈P(i)} [a_ij − log Σ_{k≠i} exp a_ik];
3. one optimiser step on L = λ_trg L_anc + λ_cont L_con.

The prediction reported is s, the adapted model's logits before the update. A reset puts
the projector back to its first weights (the authors' reset loads the states they saved
when it was made); the anchor never changes.

Prototypes: the authors compute the class means of the source model's features over at
most 100,000 training images, their BatchNorms on each source batch's statistics, once
(cached on disk); here they are the statistics' class means (`cafa stats`,
`needs_statistics`), the same quantity with the source model in eval mode.

Options and their defaults, the collection's conf.py, which the santa.yaml files leave as
they are: τ = 0.1 (`temperature`), p = 128 (`projection_dim`), λ_trg = λ_cont = 1. The
recipes hold the optimiser: Adam lr 1e-3, batch 200 (CIFAR); SGD lr 0.01, Nesterov
momentum 0.9, batch 64 (ImageNet-C).

Cost: the adapted model runs forward and backward on x and x̃, the anchor forward on x.
The view is drawn from torch's generator through the module's `augment` (tests replace
it), one draw per image where the authors draw one per batch. Not replayable as a CUDA
graph: it draws random numbers.
"""

from __future__ import annotations

import torch
from torch import nn

from cafa_cli.engine.method import AdapterSurface, Method
from cafa_cli.engine.options import Option
from cafa_cli.methods.shared.augment import augment
from cafa_cli.methods.shared.prototype_contrast import (
    LAMBDA_CONT_OPTION,
    PROJECTION_OPTION,
    TEMPERATURE_OPTION,
    projector,
    prototype_contrast,
)
from cafa_cli.methods.shared.teacher_student import frozen_copy
from cafa_cli.model.features import FeatureClassifier

VIEW_SHARE = 0.5  # α of the authors' AugCrossEntropy: the view's share of the anchoring term


def anchoring(logits: torch.Tensor, viewed: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """Each sample's −Σ_c [(1 − α) softmax(s)_c + α softmax(s̃)_c] log softmax(a)_c, [N]: the
    anchor's log-probabilities are constants, the gradient goes through both softmaxes."""
    target = anchor.detach().log_softmax(1)
    return -((1 - VIEW_SHARE) * logits.softmax(1) + VIEW_SHARE * viewed.softmax(1)).mul(target).sum(1)


class Santa(Method):
    name = "santa"
    draws_random_numbers = True  # from torch's generator (base.py)
    needs_statistics = True  # the source prototypes: the class means
    predicts_before_update = True
    running_norms = "its anchor is a copy of the model, normalisation layers included"
    owns_update = True  # a second (augmented) pass and the anchor's pass each step
    options = (
        TEMPERATURE_OPTION,
        PROJECTION_OPTION,
        Option("lambda_ce_trg", 1.0, "λ_trg, the weight of the cross-entropy to the source anchor", "weight"),
        LAMBDA_CONT_OPTION,
    )
    # what is made once from the inputs: the prototypes, and the anchor (the source model, never changed)
    unsaved = (*Method.unsaved, "prototypes", "anchor")

    def setup(self) -> None:
        self.prototypes = self.gaussians.means.to(self.device, torch.float32)
        self.anchor: FeatureClassifier | None = None
        self.projector: nn.Module | None = None
        self.projector_start: dict[str, torch.Tensor] = {}

    def parameters(self, model: FeatureClassifier, which: str = "norm") -> list[nn.Parameter]:
        """The normalisation affines (the authors': BatchNorm, LayerNorm and GroupNorm) or, with
        `all`, the feature extractor; then the projector's, which the same optimiser trains
        (the authors add them as a group at the same rate)."""
        return [*super().parameters(model, which), *self.projector.parameters()]

    def attach(self, model: FeatureClassifier) -> None:
        """The anchor, a copy of the model as it is now (source weights, its normalisation on
        the test batch's statistics), and the projector."""
        self.anchor = frozen_copy(model)
        self.projector, self.projector_start = projector(model.feature_dim, self.projection_dim, self.device)

    def reset(self) -> None:
        """The projector back to its first weights (the model is at the source weights again)."""
        if self.projector is not None:
            self.projector.load_state_dict(self.projector_start)

    def update(self, adapter: AdapterSurface, images: torch.Tensor, skipped: torch.Tensor | None):
        with adapter.autocast:
            logits, features = adapter.forward(images)
            viewed, viewed_features = adapter.forward(augment(images))
            with torch.no_grad():
                anchor = self.anchor(images)[0].float()
        logits, features = logits.float(), features.float()
        loss = self.lambda_ce_trg * anchoring(logits, viewed.float(), anchor).mean()
        loss = loss + self.lambda_cont * prototype_contrast(
            features, viewed_features.float(), self.prototypes, self.projector, self.temperature
        )
        flag = adapter.apply(loss, skipped)
        return logits.detach(), features.detach(), flag
