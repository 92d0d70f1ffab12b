"""TDA's class-wise caches of test features (Karmanov et al., CVPR 2024; kdiAAA/TDA
tda_runner.py: update_cache, compute_cache_logits), which BoostAdapter extends, as tensors.

A cache keeps, for each class c, at most `capacity` entries (a feature, its entropy, and for
the negative cache its probabilities): a new entry of class c is kept when the class has room,
or in place of the entry of highest entropy when its own entropy is lower; the class's entries
stay sorted by entropy. So each class holds the `capacity` entries of lowest entropy it was
given (of equal ones, the earliest), as the authors' dict of sorted lists, whose order of
classes and entries only changes the order of a sum. Empty slots hold entropy +∞.

Its logits for a feature f: each entry's affinity A = fᵀk weighted exp(−β(1 − A)), times
the entry's value (positive cache: its class, one-hot; negative cache: the mask of the classes
whose probability lies in (lower, upper)), summed, times α.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from cafa_cli.engine.method import AdapterSurface, Method
from cafa_cli.engine.options import Option
from cafa_cli.methods.shared.losses import marginal_entropy
from cafa_cli.methods.shared.zero_shot import AUGMENT, confident, widened, with_views, zero_shot_head
from cafa_cli.model.features import FeatureClassifier


class FeatureCache:
    """At most `capacity` entries a class (with `with_probabilities`, their class
    probabilities too); its tensors are made at the first entry, for its classes and features."""

    def __init__(self, capacity: int, with_probabilities: bool = False):
        self.capacity, self.with_probabilities = capacity, with_probabilities
        self.keys: torch.Tensor | None = None  # [classes, capacity, dim]
        self.entropies: torch.Tensor | None = None  # [classes, capacity], +inf where empty
        self.probabilities: torch.Tensor | None = None  # [classes, capacity, classes]

    def clear(self) -> None:
        self.keys = self.entropies = self.probabilities = None

    def make(self, classes: int, key: torch.Tensor) -> None:
        """Its tensors, for `classes` classes and features like `key`, unless made already."""
        if self.keys is None:
            self.keys = key.new_zeros(classes, self.capacity, len(key))
            self.entropies = key.new_full((classes, self.capacity), torch.inf)
            if self.with_probabilities:
                self.probabilities = key.new_zeros(classes, self.capacity, classes)

    def add(self, label: int, key: torch.Tensor, entropy: torch.Tensor, probabilities: torch.Tensor | None = None):
        """The authors' update_cache: kept where class `label` has room or its worst entry is worse
        (make() first)."""
        row = self.entropies[label]
        if not bool(entropy < row[-1]):
            return
        row[-1] = entropy
        self.keys[label, -1] = key
        if self.probabilities is not None:
            self.probabilities[label, -1] = probabilities
        order = torch.sort(row, stable=True).indices  # Python's sorted() is stable too
        self.entropies[label] = row[order]
        self.keys[label] = self.keys[label, order]
        if self.probabilities is not None:
            self.probabilities[label] = self.probabilities[label, order]

    def logits(self, feature: torch.Tensor, alpha: float, beta: float, mask: tuple[float, float] | None = None):
        """α Σ_entries exp(−β(1 − fᵀk)) value, [classes]; values one-hot (positive), or with
        `mask` (lower, upper) the classes whose cached probability lies strictly between them.
        Zero while it holds nothing."""
        if self.keys is None:
            return torch.zeros((), dtype=feature.dtype, device=feature.device)
        filled = torch.isfinite(self.entropies)  # [C, capacity]
        weights = torch.exp(-(beta - beta * (self.keys @ feature))) * filled
        if mask is None:
            return alpha * weights.sum(1)
        values = ((self.probabilities > mask[0]) & (self.probabilities < mask[1])).to(weights.dtype)
        return alpha * torch.einsum("ks,ksc->c", weights, values)

    def widened(self, capacity: int) -> FeatureCache:
        """A copy with `capacity` slots a class (BoostAdapter's cache for one image)."""
        wide = FeatureCache(capacity, self.with_probabilities)
        if self.keys is not None:
            classes, held, dim = self.keys.shape
            wide.make(classes, self.keys[0, 0])
            wide.keys[:, :held], wide.entropies[:, :held] = self.keys, self.entropies
            if self.probabilities is not None:
                wide.probabilities[:, :held] = self.probabilities
        return wide


VIEW_OPTIONS = (
    Option("views", 0, "B, the augmented views of each image besides itself (0: the image alone)", "count0", most=1024),
    Option("share", 0.1, "ρ, the share of the views, lowest entropy first, that stand for the image", "fraction"),
    replace(AUGMENT, default="augmix"),
)
CACHE_OPTIONS = (
    Option("positive_shots", 3, "entries a class of the positive cache", "count", most=10_000),
    Option("positive_alpha", 2.0, "α⁺, the weight of the positive cache's logits", "weight"),
    Option("positive_beta", 5.0, "β⁺, the sharpness of the positive cache's affinities", "weight"),
    Option("negative_shots", 2, "entries a class of the negative cache", "count", most=10_000),
    Option("negative_alpha", 0.117, "α⁻, the weight of the negative cache's logits", "weight"),
    Option("negative_beta", 1.0, "β⁻, the sharpness of the negative cache's affinities", "weight"),
    Option("entropy_lower", 0.2, "the negative cache takes images whose entropy ÷ log₂ C lies above this", "weight"),
    Option("entropy_upper", 0.5, "… and below this", "weight"),
    Option("mask_lower", 0.03, "a negative entry's classes: those whose probability lies above this", "fraction"),
    Option("mask_upper", 1.0, "… and below this", "fraction"),
)


class CacheMethod(Method):
    """TDA's method (tda.py's docstring), for TDA and BoostAdapter: the images one by one, each
    summarised from its views (summary), remembered in the caches, then predicted with them."""

    needs_clip = True
    trains = False
    owns_update = True  # its forward pass may hold views, and its images are taken one by one
    adapts_normalisation = False
    not_served = "the caches of the test features it has seen"
    generator: torch.Generator | None = None  # the views' random numbers; None: the device's default
    unsaved = (*Method.unsaved, "generator")
    options = (*VIEW_OPTIONS, *CACHE_OPTIONS)

    draws_random_numbers = True  # with `views` above 0, from torch's generator

    def setup(self) -> None:
        self.positive = FeatureCache(self.positive_shots)
        self.negative = FeatureCache(self.negative_shots, with_probabilities=True)

    def check(self, model: FeatureClassifier, device: torch.device) -> None:
        zero_shot_head(model, self.name)

    def reset(self) -> None:
        self.positive.clear()
        self.negative.clear()

    def update(self, adapter: AdapterSurface, images: torch.Tensor, skipped: torch.Tensor | None):
        with torch.no_grad(), adapter.autocast:
            logits, features = adapter.forward(with_views(images, self.views, self.augment, self.generator))
        b = 1 + self.views
        logits = widened(logits).view(len(images), b, -1)
        features = widened(features).view(len(images), b, -1)
        reported = torch.stack([self.predict(each, feature) for each, feature in zip(logits, features)])
        return reported, features[:, 0], skipped

    def summary(self, logits: torch.Tensor, features: torch.Tensor):
        """One image's (logits, feature, entropy, probabilities, class) from its views' (get_clip_logits)."""
        if len(logits) == 1:
            p = logits.softmax(1)
            return logits[0], features[0], -(p * logits.log_softmax(1)).sum(), p[0], int(logits[0].argmax())
        chosen = confident(logits, self.share)
        mean = logits[chosen].mean(0)
        return (
            mean,
            features[chosen].mean(0),
            marginal_entropy(logits[chosen]),
            logits[chosen].softmax(1).mean(0),
            int(mean.argmax()),
        )

    def predict(self, views: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """One image's logits from its views' [1 + B, C] and their features, once the caches hold it."""
        logits, feature = self.remember(*self.summary(views, features))
        return self.cached(logits, feature, self.positive)

    def remember(self, logits, feature, entropy, probabilities, label):
        """The image in the caches (update_cache): its class's positive entries, and the negative
        cache's where its normalised entropy lies within the bounds."""
        classes = len(logits)
        self.positive.make(classes, feature)
        self.positive.add(label, feature, entropy)
        if self.entropy_lower < float(entropy) / math.log2(classes) < self.entropy_upper:
            self.negative.make(classes, feature)
            self.negative.add(label, feature, entropy, probabilities)
        return logits, feature

    def cached(self, logits: torch.Tensor, feature: torch.Tensor, positive: FeatureCache) -> torch.Tensor:
        return (
            logits
            + positive.logits(feature, self.positive_alpha, self.positive_beta)
            - self.negative.logits(feature, self.negative_alpha, self.negative_beta, (self.mask_lower, self.mask_upper))
        )
