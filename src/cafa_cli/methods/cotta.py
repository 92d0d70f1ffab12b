"""CoTTA: continual test-time adaptation (Wang et al., "Continual Test-Time Domain
Adaptation", CVPR 2022).

Update rule: three copies of the model, all normalising with the test batch's statistics
(as the official code, whose BatchNorms keep no running statistics): the student θ
(trained), the teacher θ' (an exponential moving average of the student) and the frozen
source model (the anchor). For each batch x:

1. the anchor's confidence: a = mean over the batch of max_c softmax(f_source(x))_c;
2. the pseudo-label: the teacher's logits on x when a ≥ τ, otherwise the mean of the
   teacher's logits on K random views of x (methods/shared/augment.py): ỹ = softmax(of those);
3. one optimiser step on the student with the cross-entropy against it (`loss` ce),
       L = (1/N) Σ_n −Σ_c ỹ_nc log softmax(f_θ(x_n))_c,
   or, as the official ImageNet-C code (`loss` sce), its symmetric form with s_n =
   softmax(f_θ(x_n)) and the target's logits t_n (both directions, the gradient through s):
       L = (1/N) Σ_n −½ Σ_c [ ỹ_nc log s_nc + s_nc log softmax(t_n)_c ];
4. the teacher follows: θ' ← α θ' + (1 − α) θ (the trained parameters; the others are
   the source's in both);
5. stochastic restore: each element of each trained parameter goes back to its source
   value with probability p, drawn anew every batch.

The prediction reported is the pseudo-label's logits of step 2 (the teacher's, or the
augmentation average), made before the update, as in the paper.

Options and their defaults, the official CIFAR10-C ones: α = 0.999 (`teacher_momentum`),
p = 0.01 (`restore_probability`), τ = 0.92 (`confidence_threshold`), K = 32
(`augmentations`), `loss` ce. The official code sets, per dataset: CIFAR10-C τ = 0.92,
p = 0.01; CIFAR100-C τ = 0.72, p = 0.01 (Adam, lr 1e-3, batch 200); ImageNet-C τ = 0.1,
p = 0.001, SGD lr 0.01, momentum 0.9, batch 64 and the symmetric cross-entropy; α = 0.999
everywhere. recipes/cotta.toml holds them.

`params`: `all` is the official code's choice and the recipes', every parameter a module
holds as `weight` or `bias` (its collect_params' rule: a ViT's pos_embed and cls_token stay
frozen), the classifier included (cafa's other methods keep the classifier fixed under
`all`); `norm` trains the normalisation affines only, as TENT, for a fraction of the cost.

Cost: the teacher sees K + 1 batches and the anchor and the student one each, with one
backward pass a batch. The official CIFAR code also computes the K views on every batch
and then picks; the choice is made here with torch.where on the device, and the restore
mask is drawn there too, so no step reads a device value. The K views go through the
teacher several at a time (up to VIEW_IMAGES images a pass), each still normalised with
its own batch statistics (views_as_groups), their random draws made in the order of one
view at a time. `augmentations` 0 uses the teacher's own prediction always (3 passes).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from cafa_cli.engine.method import AdapterSurface, Method, with_classifier
from cafa_cli.engine.norms import BatchStatisticsNorm
from cafa_cli.engine.options import Option
from cafa_cli.methods.shared import losses
from cafa_cli.methods.shared.augment import augment
from cafa_cli.methods.shared.teacher_student import follow, frozen_copy, named, names_of, soft_cross_entropy
from cafa_cli.model.features import FeatureClassifier

TEACHER_MOMENTUM = 0.999  # α
RESTORE_PROBABILITY = 0.01  # p
CONFIDENCE_THRESHOLD = 0.92  # τ, CIFAR10-C
AUGMENTATIONS = 32  # K
LOSSES = ("ce", "sce")
VIEW_IMAGES = 512  # augmented images in one teacher forward pass: 8 views of a batch of 64


def _uses_the_batch(layer: nn.Module) -> bool:
    """Whether a normalisation layer takes statistics from the batch (a BatchNorm in
    training mode, or without running statistics; the Adapter's with `norm` batch or prior)."""
    if isinstance(layer, BatchStatisticsNorm):
        return layer.kind != "source"
    return isinstance(layer, _BatchNorm) and (layer.training or layer.running_mean is None)


def groupable(model: nn.Module) -> bool:
    """Whether views_as_groups can stand in for one forward pass a group: every layer that
    takes batch statistics is a BatchStatisticsNorm with the batch's own (`norm` batch)."""
    return all(
        not _uses_the_batch(m)
        or isinstance(m, BatchStatisticsNorm)
        and (m.kind == "batch" or m.kind == "prior" and m.prior == 0)
        for m in model.modules()
    )


@contextmanager
def views_as_groups(model: nn.Module, groups: int):
    """The model's batch-statistics BatchNorms normalise a batch of N·groups rows (row
    n·groups + g: group g of sample n) with each group's own statistics, as `groups`
    forward passes of N rows each would (groupable() says when that is all the batch
    dependence there is; BatchStatisticsNorm.groups)."""
    layers = [m for m in model.modules() if isinstance(m, BatchStatisticsNorm) and _uses_the_batch(m)]
    for layer in layers:
        layer.groups = groups
    try:
        yield
    finally:
        for layer in layers:
            layer.groups = 1


class CoTTA(Method):
    name = "cotta"
    draws_random_numbers = True  # from torch's generator (base.py)
    running_norms = "its teacher and anchor are copies of the model, BatchNorms included"
    owns_update = True
    options = (
        Option("teacher_momentum", TEACHER_MOMENTUM, "α: the teacher's moving average θ' ← αθ' + (1 − α)θ", "fraction"),
        Option(
            "restore_probability",
            RESTORE_PROBABILITY,
            "p: each trained value goes back to the source's with it",
            "fraction",
        ),
        Option(
            "confidence_threshold",
            CONFIDENCE_THRESHOLD,
            "τ: below this mean source confidence the pseudo-label averages the augmented views",
            "fraction",
        ),
        Option(
            "augmentations",
            AUGMENTATIONS,
            "K, the augmented views (0: the teacher's prediction always)",
            "count0",
            most=1024,
        ),
        Option("loss", "ce", "ce, or sce (the official ImageNet-C symmetric cross-entropy)", "choice", LOSSES),
    )

    def setup(self) -> None:
        self.names: list[str] = []  # the trained parameters' names, shared by the three copies
        self.teacher: FeatureClassifier | None = None
        self.anchor: FeatureClassifier | None = None

    def choose_parameters(self, model: FeatureClassifier, which: str = "norm") -> list[torch.nn.Parameter]:
        """`norm`: the normalisation affines; `all`: every weight and bias, the classifier's too
        (the official code)."""
        return with_classifier(model, which)

    def attach(self, model: FeatureClassifier) -> None:
        """The teacher and the anchor: copies of the model as it adapts."""
        self.names = names_of(model, self.params)
        self.teacher, self.anchor = frozen_copy(model), frozen_copy(model)

    def reset(self) -> None:
        """The teacher back to the source weights, which the anchor keeps."""
        if self.teacher is not None:
            self.teacher.load_state_dict(self.anchor.state_dict())

    def reporting_network(self, adapter: AdapterSurface) -> torch.nn.Module:
        return self.teacher  # its predictions are reported, the student only trains

    def served_network(self, adapter: AdapterSurface) -> FeatureClassifier:
        return self.teacher

    def update(self, adapter: AdapterSurface, images: torch.Tensor, skipped: torch.Tensor | None):
        with torch.no_grad(), adapter.autocast:
            target, features = self.pseudo_label(images)
        with adapter.autocast:
            student, _ = adapter.forward(images)
        # the official ImageNet-C loss (sce) or the CIFAR one (ce); the teacher's target carries no gradient
        criterion = losses.symmetric_cross_entropy if self.loss == "sce" else soft_cross_entropy
        loss = criterion(student.float(), target.detach()).mean()
        flag = adapter.apply(loss, skipped)
        with torch.no_grad():
            self.follow_student()
            self.restore()
        return target, features, flag

    def pseudo_label(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's logits, or their mean over random views when the anchor's mean
        confidence is below the threshold (chosen on the device); and the teacher's features."""
        logits, features = self.teacher(images)
        logits = logits.float()
        if self.augmentations == 0:
            return logits, features.float()
        confidence = self.anchor(images)[0].float().softmax(1).amax(1).mean()
        views = self.views_mean(images)
        return torch.where(confidence < self.confidence_threshold, views, logits), features.float()

    def views_mean(self, images: torch.Tensor) -> torch.Tensor:
        """The mean of the teacher's logits over K random views of `images`, each view
        normalised with its own batch statistics as a forward pass of its own would; up to
        VIEW_IMAGES images a forward pass (several views of each image in one batch, the
        batch-statistics BatchNorms told the groups: views_as_groups)."""
        n, total = len(images), 0
        per_pass = max(1, VIEW_IMAGES // max(n, 1)) if groupable(self.teacher) else 1
        for start in range(0, self.augmentations, per_pass):
            views = min(per_pass, self.augmentations - start)
            with views_as_groups(self.teacher, views):
                logits = self.teacher(augment(images, views))[0].float().unflatten(0, (n, views))
            for v in range(views):  # summed view after view, as one pass a view sums them
                total = total + logits[:, v]
        return total / self.augmentations

    def follow_student(self) -> None:
        """θ' ← α θ' + (1 − α) θ over the trained parameters."""
        follow(named(self.teacher, self.names), self.params, self.teacher_momentum)

    def restore(self) -> None:
        """Each element of each trained parameter back to its source value with probability p."""
        if self.restore_probability == 0:
            return
        for p, source in zip(self.params, named(self.anchor, self.names)):
            back = torch.rand(p.shape, device=p.device) < self.restore_probability
            p.copy_(torch.where(back, source, p))
