"""DMN-ZS: the dual memory networks' zero-shot variant, a dynamic memory of test features
(Zhang et al., "Dual Memory Networks: A Versatile Adaptation Approach for Vision-Language
Models", CVPR 2024; YBZh/DMN dmn_main.py, n_shot 0: the static memory of labelled images and
the trained projections are unused, their biases zero).

Prediction, image by image in stream order: the image and B augmented views, their
probabilities p_b = softmax(s·f_bᵀt_c), and the mean of the ρ·(B + 1) views of lowest
entropy −Σ p log(p + 10⁻⁶) (`share` ρ), p̄. The image's own feature f (the image itself,
not a view) enters the memory of class ŷ = argmax p̄ with the entropy H = −Σ p̄ log(p̄ + 10⁻⁸)
of p̄: where the class's `memory` L slots are full, in place of the entry of highest entropy
if H is below it (update_memory_bank). Then, with the memory that now holds it, each class's
entries and its text embedding, M_c = [m_c1 … m_cL, t_c], read out by the image's affinity
(get_image_pred, similarity_weighted; an empty slot counts nothing):

    a_c = Σ_j exp(−β(1 − fᵀm̂_cj)) m̂_cj,   q_c = a_c / ‖a_c‖,   m̂ = m / ‖m‖,
    prediction = softmax(s·fᵀt) + w · softmax(s·fᵀq).

Reported is the log of that sum over 1 + w (a distribution), whose argmax is the prediction.
Nothing is trained and nothing of the model changes; the memory carries from batch to batch
and `reset` empties it.

Options and defaults, the authors' (scripts/run.sh, zero-shot runs): B = 31 (32 views), ρ =
0.1, L = 50, β = 5.5, crop-and-flip views on ImageNet (augmix on the fine-grained sets), and
w = 1, the weight their search over w ∈ {0.001, …, 1000} chose on ImageNet
(camera_ready_dmn_tf_searched_vit_0.txt); that search reads the test labels, so w is here a
fixed option (theirs for ImageNet-A/V/R/K: 3, 1, 0.3, 1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cafa_cli.engine.method import AdapterSurface, Method
from cafa_cli.engine.options import Option
from cafa_cli.methods.shared.zero_shot import AUGMENT, confident_count, widened, with_views, zero_shot_head
from cafa_cli.model.features import FeatureClassifier


class DmnZs(Method):
    name = "dmn-zs"
    needs_clip = True
    draws_random_numbers = True  # the views, from torch's generator
    trains = False
    owns_update = True  # its forward pass holds the views, and its images are taken one by one
    adapts_normalisation = False
    not_served = "the memory of the test features it has seen"
    generator: torch.Generator | None = None  # the views' random numbers; None: the device's default
    unsaved = (*Method.unsaved, "generator")
    options = (
        Option("views", 31, "B, the augmented views of each image besides itself", "count0", most=1024),
        Option("share", 0.1, "ρ, the share of the views, lowest entropy first, whose mean gives the class", "fraction"),
        AUGMENT,
        Option("memory", 50, "L, the test features the memory holds a class", "count", most=10_000),
        Option("beta", 5.5, "β, the sharpness of the memory's affinities", "weight"),
        Option("weight", 1.0, "w, the weight of the memory's prediction beside the zero-shot one", "weight"),
    )

    def setup(self) -> None:
        self.features: torch.Tensor | None = None  # [C, L, d], zero where empty
        self.entropies: torch.Tensor | None = None  # [C, L]
        self.counts: torch.Tensor | None = None  # [C] entries a class, on the host (each image reads it)

    def check(self, model: FeatureClassifier, device: torch.device) -> None:
        zero_shot_head(model, self.name)

    def reset(self) -> None:
        self.features = self.entropies = self.counts = None

    def update(self, adapter: AdapterSurface, images: torch.Tensor, skipped: torch.Tensor | None):
        classifier = zero_shot_head(adapter.model, self.name)
        scale = classifier.logit_scale
        with torch.no_grad(), adapter.autocast:
            logits, features = adapter.forward(with_views(images, self.views, self.augment, self.generator))
        b = 1 + self.views
        logits = widened(logits).view(len(images), b, -1)
        features = widened(features).view(len(images), b, -1)
        text = adapter.model.class_weights().to(logits.dtype) / scale  # s·t_c / s: the unit text embeddings
        return (
            torch.stack([self.predict(*each, text, scale) for each in zip(logits, features)]),
            features[:, 0],
            skipped,
        )

    def predict(self, logits: torch.Tensor, features: torch.Tensor, text: torch.Tensor, scale: float) -> torch.Tensor:
        classes, f = len(text), features[0]
        p = logits.softmax(1)
        entropy = -(p * torch.log(p + 1e-6)).sum(1)  # DMN's select_confident_samples
        chosen = torch.argsort(entropy, descending=False)[: confident_count(len(p), self.share)]
        mean = p[chosen].mean(0)
        self.remember(int(mean.argmax()), f, -(mean * torch.log(mean + 1e-8)).sum(), classes)
        memory = torch.cat([self.features, text.unsqueeze(1)], 1)  # [C, L + 1, d]
        keys = F.normalize(memory, dim=-1)  # an empty slot stays zero
        affinity = torch.exp(-self.beta * (1 - keys @ f))
        adaptive = F.normalize((keys * affinity.unsqueeze(-1)).sum(1), dim=-1)
        prediction = p[0] + self.weight * (scale * adaptive @ f).softmax(0)
        return (prediction / (1 + self.weight)).log()

    def remember(self, label: int, feature: torch.Tensor, entropy: torch.Tensor, classes: int) -> None:
        if self.features is None:
            self.features = feature.new_zeros(classes, self.memory, len(feature))
            self.entropies = feature.new_zeros(classes, self.memory)
            self.counts = torch.zeros(classes, dtype=torch.long)
        count = int(self.counts[label])
        if count < self.memory:
            slot = count
            self.counts[label] += 1
        elif bool((entropy < self.entropies[label]).any()):
            slot = int(torch.sort(self.entropies[label]).indices[-1])  # the highest entropy
        else:
            return
        self.features[label, slot] = feature
        self.entropies[label, slot] = entropy
