"""RMT: Robust Mean Teacher (Döbler, Marsden and Yang, "Robust Mean Teacher for Continual
and Gradual Test-Time Adaptation", CVPR 2023; the authors' code is the benchmark
collection mariodoebler/test-time-adaptation, classification/methods/rmt.py).

Update rule: a student θ (trained; under the recipes every parameter a module holds as
`weight` or `bias`, the classifier's too, as the collection's collect_params), a mean
teacher θ' and a projector g (Linear d→p, ReLU, Linear p→p; trained with the student, same
rate), all normalising with the test batch's statistics. For each batch x,
with x̃ = one random view of x (methods/shared/augment.py, CoTTA's pipeline, as the authors'
get_tta_transforms), student logits s = f_θ(x), s̃ = f_θ(x̃) and features z, z̃, teacher
logits t = f_θ'(x) (no gradient):

1. self-training, the symmetric cross-entropy against the teacher (gradient through s):
       SCE(s, t) = −½ Σ_c [softmax(t)_c log softmax(s)_c + softmax(s)_c log softmax(t)_c],
       L_st = (1/N) Σ_n [½ SCE(s_n, t_n) + ½ SCE(s̃_n, t_n)];
2. contrastive alignment to the source prototypes μ_c (the source class means of the
   features): each sample's nearest prototype by cosine, k_n = argmax_c cos(z_n, μ_c) (no
   gradient); the 3N views v = (μ_k1..μ_kN, z_1..z_N, z̃_1..z̃_N), projected and
   normalised, e_i = g(v_i)/‖g(v_i)‖; with a_ij = e_i·e_j/τ and P(i) the two other views of
   the same sample (SupCon, contrast mode `all`),
       L_con = −(1/3N) Σ_i (1/2) Σ_{j∈P(i)} [a_ij − log Σ_{k≠i} exp a_ik];
3. source replay (only with source images): L_src = CE(f_θ(x_src), y_src) on the next
   labelled source batch;
4. one optimiser step on L = λ_trg L_st + λ_cont L_con + λ_src L_src, then the teacher
   follows: θ' ← α θ' + (1 − α) θ.

The prediction reported is the ensemble s + t (the logits of student and teacher, summed,
before the update), as the authors' code returns it.

Warm-up (only with source images): before the first batch, ⌊`warmup_samples` / source
batch size⌋ steps on source batches with the SCE between student and teacher alone
(no view, no contrast, no replay), the rate rising linearly to its value ((i+1)/K of it at
step i), the teacher following after each. A reset (`--reset`, episodic) goes back to the
model, teacher, projector and optimiser state as they were after the warm-up, as the
authors' reset loads the states they saved then.

Source images: `source_batches`, an iterable of (images, labels), normalised and on any
device. A re-iterable one (each iter() a new pass) is gone through again when it ends, as
the authors' loader; a one-shot iterator (a generator) is kept as it goes and its batches
are cycled. A saved state (Adapter.state_dict) holds the teacher, the projector and
the states after the warm-up, not the place in the source batches: a resumed stream replays
them from the first. Without source images RMT is the authors' source-free variant (their
scripts' LAMBDA_CE_SRC 0, NUM_SAMPLES_WARM_UP 0): no warm-up, no replay. Their prototypes
still come from source images (computed once and cached on disk); here they are the
statistics' class means (`cafa stats`, `needs_statistics`), the same quantity over the
training images (the authors take at most 100,000 of them, their BatchNorms on each source
batch's statistics; `cafa stats` runs the source model in eval mode).

Options and their defaults, the collection's conf.py, which the rmt.yaml files leave as
they are: α = 0.999 (`teacher_momentum`), τ = 0.1 (`temperature`), p = 128
(`projection_dim`), λ_src = λ_trg = λ_cont = 1, `warmup_samples` 50,000. The recipes hold
the optimiser: Adam lr 1e-3, batch 200 (CIFAR); SGD lr 0.01, Nesterov momentum 0.9, batch
64 (ImageNet-C).

Cost: the student runs forward and backward on x, x̃ (and the source batch), the teacher
forward on x. The view is drawn from torch's generator through the module's `augment`
(tests replace it), one draw per image where the authors draw one per batch. Not
replayable as a CUDA graph: it draws random numbers and iterates source batches on the host.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from cafa_cli.core.errors import UsageError
from cafa_cli.engine.method import AdapterSurface, Method, with_classifier
from cafa_cli.engine.options import Option
from cafa_cli.methods.shared import losses
from cafa_cli.methods.shared.augment import augment
from cafa_cli.methods.shared.prototype_contrast import (
    LAMBDA_CONT_OPTION,
    PROJECTION_OPTION,
    TEMPERATURE_OPTION,
    projector,
    prototype_contrast,
)
from cafa_cli.methods.shared.teacher_student import follow, frozen_copy, named, names_of
from cafa_cli.model.features import FeatureClassifier

TEACHER_MOMENTUM = 0.999  # α
WARMUP_SAMPLES = 50_000


class Ensemble(nn.Module):
    """Student and teacher as one network: the summed logits, the student's features (what
    a step of RMT reports, for Adapter.features)."""

    def __init__(self, student: nn.Module, teacher: nn.Module):
        super().__init__()
        self.student, self.teacher = student, teacher

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, features = self.student(images)
        return logits.float() + self.teacher(images)[0].float(), features


class Rmt(Method):
    name = "rmt"
    draws_random_numbers = True  # from torch's generator (base.py)
    needs_statistics = True  # the source prototypes: the class means
    running_norms = "its teacher is a copy of the model, BatchNorms included"
    owns_update = True
    options = (
        Option("teacher_momentum", TEACHER_MOMENTUM, "α: the teacher's moving average θ' ← αθ' + (1 − α)θ", "fraction"),
        TEMPERATURE_OPTION,
        PROJECTION_OPTION,
        Option("lambda_ce_trg", 1.0, "λ_trg, the weight of the symmetric cross-entropy to the teacher", "weight"),
        LAMBDA_CONT_OPTION,
        Option(
            "lambda_ce_src", 1.0, "λ_src, the weight of the source replay's cross-entropy (source images)", "weight"
        ),
        Option("warmup_samples", WARMUP_SAMPLES, "source images of the warm-up before the first batch", "count0"),
    )
    inputs = ("source_batches",)  # labelled source images, an iterable of (images, labels) batches
    without_source_images = "runs as its authors' source-free variant: no warm-up and no source replay"
    # the model the Adapter saves itself, what is made from the inputs, and where the source batches stand
    unsaved = (*Method.unsaved, "prototypes", "student", "_source", "_back")

    def setup(self) -> None:
        self.prototypes = self.gaussians.means.to(self.device, torch.float32)
        self.names: list[str] = []  # the student's trained parameters, found by name in the teacher
        self.student: FeatureClassifier | None = None
        self.teacher: FeatureClassifier | None = None
        self.projector: nn.Module | None = None
        self.projector_start: dict[str, torch.Tensor] = {}
        # the warm-up: whether it ran, and the states after it that a reset goes back to
        self.warmed = False
        self.warm: dict | None = None
        self.optimizer_pending = False  # a reset made a fresh optimiser: the warm one's state goes in at the next step
        self._source: Iterator | None = None  # the source batches as they come (_cycle)
        self._back: tuple | None = None  # a batch drawn and not used (the warm-up's first, when it takes no step)

    def parameters(self, model: FeatureClassifier, which: str = "norm") -> list[nn.Parameter]:
        """The model's, then the projector's, which the same optimiser trains (the authors add
        them as a group at the same rate)."""
        return [*super().parameters(model, which), *self.projector.parameters()]

    def choose_parameters(self, model: FeatureClassifier, which: str = "norm") -> list[nn.Parameter]:
        """`all`: every weight and bias, the classifier's too (the authors'); `norm`: the
        normalisation affines."""
        return with_classifier(model, which)

    def attach(self, model: FeatureClassifier) -> None:
        """The teacher, a copy of the model, and the projector."""
        self.names = names_of(model, self.params)
        self.student, self.teacher = model, frozen_copy(model)
        self.projector, self.projector_start = projector(model.feature_dim, self.projection_dim, self.device)

    def reset(self) -> None:
        """Back to the states after the warm-up (the model is at the source weights: without a
        warm-up the teacher copies it); the warm optimiser state goes in at the next step."""
        if self.teacher is None:
            return
        if self.warm is None:
            self.teacher.load_state_dict(self.student.state_dict())
            self.projector.load_state_dict(self.projector_start)
            return
        self.student.load_state_dict(self.warm["student"])
        self.teacher.load_state_dict(self.warm["teacher"])
        self.projector.load_state_dict(self.warm["projector"])
        self.optimizer_pending = True

    def reporting_network(self, adapter: AdapterSurface) -> nn.Module:
        return Ensemble(adapter.forward, self.teacher)  # the reported prediction is both networks'

    def served_network(self, adapter: AdapterSurface) -> FeatureClassifier:
        return self.teacher  # the ensemble is two networks; the mean teacher is the steadier one

    def update(self, adapter: AdapterSurface, images: torch.Tensor, skipped: torch.Tensor | None):
        if not self.warmed:
            self.warm_up(adapter)
        if self.optimizer_pending:  # a copy: the optimiser takes the tensors it is given and steps them in place
            adapter.optimizer.load_state_dict(copy.deepcopy(self.warm["optimizer"]))
            self.optimizer_pending = False
        with adapter.autocast:
            student, features = adapter.forward(images)
            viewed, viewed_features = adapter.forward(augment(images))
            with torch.no_grad():
                teacher = self.teacher(images)[0].float()
        student, features = student.float(), features.float()
        self_training = (
            0.5 * losses.symmetric_cross_entropy(student, teacher.detach())
            + 0.5 * losses.symmetric_cross_entropy(viewed.float(), teacher.detach())
        ).mean()
        loss = self.lambda_ce_trg * self_training + self.lambda_cont * prototype_contrast(
            features, viewed_features.float(), self.prototypes, self.projector, self.temperature
        )
        if self.lambda_ce_src > 0 and self.source_batches is not None:
            source_images, labels = self.next_source()
            with adapter.autocast:
                source_logits, _ = adapter.forward(source_images)
            loss = loss + self.lambda_ce_src * F.cross_entropy(source_logits.float(), labels)
        prediction = student.detach() + teacher
        flag = adapter.apply(loss, skipped)
        self.follow_student()
        return prediction, features.detach(), flag

    def follow_student(self) -> None:
        """θ' ← α θ' + (1 − α) θ over the trained parameters (the others are equal in both)."""
        follow(named(self.teacher, self.names), self.params, self.teacher_momentum)

    def warm_up(self, adapter: AdapterSurface) -> None:
        """The authors' warm-up on source batches (module docstring), once, before the first
        step; then the states a reset goes back to are kept."""
        self.warmed = True
        if self.source_batches is None or self.warmup_samples == 0:
            return
        first = self.next_source()
        steps = self.warmup_samples // len(first[0])
        if steps == 0:
            self._back = first
            return
        groups = adapter.optimizer.param_groups
        rates = [group["lr"] for group in groups]
        for i in range(steps):
            images = first[0] if i == 0 else self.next_source()[0]
            for group, rate in zip(groups, rates):
                group["lr"] = rate * (i + 1) / steps
            with adapter.autocast:
                student, _ = adapter.forward(images)
                with torch.no_grad():
                    teacher = self.teacher(images)[0].float()
            adapter.apply(losses.symmetric_cross_entropy(student.float(), teacher.detach()).mean())
            self.follow_student()
        for group, rate in zip(groups, rates):
            group["lr"] = rate
        self.warm = {
            "student": {k: v.detach().clone() for k, v in self.student.state_dict().items()},
            "teacher": {k: v.detach().clone() for k, v in self.teacher.state_dict().items()},
            "projector": {k: v.detach().clone() for k, v in self.projector.state_dict().items()},
            "optimizer": copy.deepcopy(adapter.optimizer.state_dict()),
        }

    def next_source(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next labelled source batch, on the device (module docstring)."""
        if self._back is not None:
            batch, self._back = self._back, None
            return batch
        if self._source is None:
            self._source = self._cycle()
        images, labels = next(self._source)
        return images.to(self.device), labels.to(self.device, torch.long)

    def _cycle(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """source_batches batch after batch, from the start again when they end: a new pass
        of a re-iterable; the kept batches of a one-shot iterator."""
        source = iter(self.source_batches)
        if source is self.source_batches:  # one pass only: keep its batches
            kept = []
            for batch in source:
                kept.append(batch)
                yield batch
            if not kept:
                raise UsageError("rmt's source_batches holds no batch")
            while True:
                yield from kept
        while True:
            empty = True
            for batch in source:
                empty = False
                yield batch
            if empty:
                raise UsageError("rmt's source_batches holds no batch")
            source = iter(self.source_batches)
