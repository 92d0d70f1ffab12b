"""STAMP: a stable memory of reliable samples for open-world test-time adaptation (Yu et
al., "STAMP: Outlier-Aware Test-Time Adaptation with Stable Memory Replay", ECCV 2024),
for streams that mix images from outside the label set (outliers) into the test data.

Update rule. BatchNorms normalise with the batch's statistics. For each batch x:

1. the prediction reported is the mean p̄ of the softmax over x and `augmentations` views
   of it (each its own batch through the model), the model as it was before the batch's
   step; the in-distribution score of an image is −H(p̄) = Σ_c p̄_c log(p̄_c + 1e-5)
   (`id_score`), the score the authors' AUROC uses;
2. an image enters the memory (K = `memory_size` images, a class-balanced FIFO, RBM) with
   the adapted model's predicted class when H(p̄) < α·ln C (α = `alpha`) and, with
   `consistency`, the model and a frozen copy of it at the source weights (also normalising
   with the batch) predict the same class; when the memory is full, the oldest image of a
   random class among those whose count n̄_c is the largest of the non-empty classes leaves
   first; n̄_c ← 0.9·n̄_c + 0.1·(images of class c) each time the memory is read (float32);
3. one sharpness-aware step (methods/shared/sam.py, ρ = `rho`) on the memory's M images,
   with the self-weighted entropy
       L = (1/M) Σ_m E_m · K·exp(−E_m)/Σ_j exp(−E_j),   E_m the entropy of image m,
   (the gradient flows through the weights too, as in the authors' code), the optimiser's
   rate following a cosine over `cosine_steps` steps: lr_t = lr·(1 + cos(π t/T))/2 at the
   t-th step since the last reset (torch's CosineAnnealingLR, periodic past T).

Transcribed from yuyongcan/STAMP src/methods/stamp.py (STAMP, RBM), src/methods/setup.py
(setup_stamp: SAM over plain SGD, ρ 0.05) and src/data/data.py (get_stamp_transforms: the
views). The authors run the consistency filter on CIFAR and leave it out on ImageNet (their
`num_class == 1000`), and draw their views with CoTTA's pipeline on CIFAR-10-C
(`augmentation` cotta: methods/shared/augment.py, with its differences) and RandomCrop with
4 pixels of padding and a flip elsewhere (`augmentation` crop). The parameters are the
normalisation affines but the top block (their collect_params, `frozen`).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from cafa_cli.engine.method import AdapterSurface, Method
from cafa_cli.engine.options import Option
from cafa_cli.methods.shared import class_memory
from cafa_cli.methods.shared.augment import augment, padded_crop_and_flip
from cafa_cli.methods.shared.class_memory import ClassMemory, pick
from cafa_cli.methods.shared.sam import FROZEN_OPTION, ascend, descend_from, unfrozen_parameters
from cafa_cli.methods.shared.teacher_student import frozen_copy
from cafa_cli.model.features import FeatureClassifier

ALPHA = 0.5
AUGMENTATIONS = 15  # the authors' STAMP.NUM_AUG
MEMORY = 64  # RBM(64) and the loss's ·64
COSINE_STEPS = 150  # the authors' max_iter away from ImageNet (750 there)
RHO = 0.05
SCORE_EPS = 1e-5  # in the entropy of the mean prediction (their entropy())


def views(images: torch.Tensor, augmentation: str) -> torch.Tensor:
    """One augmented view of each image (the authors' get_stamp_transforms)."""
    return augment(images) if augmentation == "cotta" else padded_crop_and_flip(images)


def mean_entropy(probabilities: torch.Tensor) -> torch.Tensor:
    return -(probabilities * torch.log(probabilities + SCORE_EPS)).sum(1)


class Stamp(Method):
    name = "stamp"
    owns_update = True
    draws_random_numbers = True  # the views and the memory's removals
    running_norms = "its filter compares with a frozen copy of the source model that normalises with the batch"
    options = (
        Option("alpha", ALPHA, "α: an image enters the memory when its entropy is below α·ln C", "positive"),
        Option(
            "augmentations",
            AUGMENTATIONS,
            "augmented views averaged with each image for its prediction",
            "count0",
            most=256,
        ),
        Option(
            "augmentation",
            "cotta",
            "the views: cotta (CoTTA's pipeline) or crop (a padded crop and a flip)",
            "choice",
            ("cotta", "crop"),
        ),
        Option(
            "consistency",
            True,
            "an image enters only where the model and the source model predict the same class",
            "flag",
        ),
        Option(
            "memory_size", MEMORY, "K, the images the memory holds (and the loss's weight scale)", "count", most=10_000
        ),
        Option(
            "cosine_steps", COSINE_STEPS, "T, the period of the learning rate's cosine; 0: a constant rate", "count0"
        ),
        Option("rho", RHO, "ρ, the radius of the sharpness-aware perturbation", "positive"),
        FROZEN_OPTION,
    )

    def setup(self) -> None:
        self.saved: list[torch.Tensor] | None = None  # θ while the step is taken at θ + ε
        self.source: FeatureClassifier | None = None  # the consistency filter's frozen copy
        self.num_classes = 0
        self.reported: tuple | None = None
        self.fresh = False
        self.reset()

    def reset(self) -> None:
        self.memory = ClassMemory(self.num_classes, self.memory_size) if self.num_classes else None
        self.class_counts = [0.0] * self.num_classes  # n̄_c, float32 values (the authors' torch.zeros)
        self.adapted = 0  # steps since the last reset: the cosine's t

    def choose_parameters(self, model: FeatureClassifier, which: str = "norm") -> list[nn.Parameter]:
        return unfrozen_parameters(model, which, self.frozen, self.name)

    def attach(self, model: FeatureClassifier) -> None:
        if self.consistency:
            self.source = frozen_copy(model)
        self.num_classes = model.num_classes
        self.reset()

    def id_score(self, logits: torch.Tensor) -> torch.Tensor:
        """−H(p̄) of the reported mean prediction (its logits are log p̄)."""
        return -mean_entropy(logits.softmax(1))

    def before_step(self, images: torch.Tensor) -> None:
        self.fresh = True

    def update(self, adapter: AdapterSurface, images: torch.Tensor, skipped: torch.Tensor | None):
        if not self.fresh:  # the Adapter's later `steps`: one step a batch, as the authors'
            return self.reported + (skipped,)
        self.fresh = False
        with torch.no_grad(), adapter.autocast:
            logits, features = adapter.forward(images)
            outputs = [logits.float().softmax(1)]
            for _ in range(self.augmentations):
                outputs.append(adapter.forward(views(images, self.augmentation))[0].float().softmax(1))
            mean = torch.stack(outputs).mean(0)
            labels = logits.argmax(1)
            keep = mean_entropy(mean) < self.alpha * math.log(self.num_classes)
            if self.consistency:
                keep &= labels == self.source(images)[0].argmax(1)
        self.reported = (mean.log(), features.float())
        draws = class_memory.removal_draws(len(images), images.device)
        host = torch.cat([torch.stack([keep.double(), labels.double()], 1), draws], 1).tolist()  # one transfer
        for n, (k, c, *u) in enumerate(host):
            if k:
                self._store(images[n], int(c), u[0])
        flag = skipped
        if self.memory is not None and len(self.memory):
            flag = self._train(adapter, flag)
        return self.reported + (flag,)

    def _store(self, sample: torch.Tensor, c: int, u: float) -> None:
        """RBM's append: when full, the oldest image of a random class among the non-empty
        ones whose n̄ is the largest leaves first."""
        memory = self.memory
        counts = memory.counts()
        if sum(counts) >= self.memory_size:
            averaged = self.class_counts
            most = max([0.0] + [a for a, n in zip(averaged, counts) if n])
            largest = [k for k, (a, n) in enumerate(zip(averaged, counts)) if n and a == most]
            memory.remove(largest[pick(u, len(largest))], 0)
        memory.add(sample, c)

    def _train(self, adapter: AdapterSurface, flag: torch.Tensor | None) -> torch.Tensor | None:
        samples = self.memory.samples()
        # as the authors' 0.9·n̄ + 0.1·len in float32: 0.1·len in double, rounded once
        lengths = np.array(self.memory.counts(), np.float64)
        before = np.array(self.class_counts, np.float32)
        self.class_counts = (np.float32(0.9) * before + (0.1 * lengths).astype(np.float32)).tolist()
        if self.saved is None:
            self.saved = [torch.empty_like(p) for p in self.params]
        with adapter.autocast:
            first = self._loss(adapter.forward(samples)[0].float())
        ascend(self.params, first if adapter.scaler is None else adapter.scaler.scale(first), self.rho, self.saved)
        with adapter.autocast:
            second = self._loss(adapter.forward(samples)[0].float())
        groups = adapter.optimizer.param_groups
        rates = [group["lr"] for group in groups]
        if self.cosine_steps:
            for group in groups:
                group["lr"] *= (1 + math.cos(math.pi * self.adapted / self.cosine_steps)) / 2
        flag = adapter.apply(second, flag, after_backward=descend_from(self.params, self.saved))
        for group, rate in zip(groups, rates):  # the optimiser keeps its own rate between steps
            group["lr"] = rate
        self.adapted += 1
        return flag

    def _loss(self, logits: torch.Tensor) -> torch.Tensor:
        entropies = -(logits.softmax(1) * logits.log_softmax(1)).sum(1)
        weights = (-entropies).softmax(0) * self.memory_size
        return (entropies * weights).mean()
