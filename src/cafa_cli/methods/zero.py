"""ZERO: test-time augmentation with the temperature set to zero (Farina et al., "Frustratingly
Easy Test-Time Adaptation of Vision-Language Models", NeurIPS 2024; FarinaMatteo/zero).

Prediction, for each test image x on its own: the image and B augmented views of it
(methods/shared/zero_shot.py), their logits l_b = f_bᵀ t_c against the classifier's unit-norm
class embeddings (without the temperature s), the γ·(B + 1) views of lowest entropy of
softmax(s·l_b) kept (`share` γ), and each kept view's prediction made one-hot by a
temperature of zero (softmax(l_b / ε), ε the dtype's machine epsilon, as the authors write
it); the prediction is their sum, the vote of the confident views:

    v_c = Σ_{b∈S} softmax(l_b / ε)_c,   ŷ = argmax_c v_c.

A tie between classes for the most votes goes to the first of the other views, by
increasing entropy, whose own prediction is one of them, and that class gets one vote more
(the authors' greedy_break). Nothing is trained and nothing of the model changes. Reported
are the logarithms of the vote shares, log(v / Σv) (−∞, a vote of 0, clamped to the dtype's
lowest value), whose argmax is ŷ.

Options and defaults, the authors' (ttas/zero.py and run.py): B = 63 (64 views in all),
γ = 0.3, `augment` crop (their MultiViewCropAndFlip, on every dataset).
"""

from __future__ import annotations

import torch

from cafa_cli.engine.method import AdapterSurface, Method
from cafa_cli.engine.options import Option
from cafa_cli.methods.shared.zero_shot import AUGMENT, confident_count, widened, with_views, zero_shot_head
from cafa_cli.model.features import FeatureClassifier


def votes(logits: torch.Tensor, scale: float, share: float) -> torch.Tensor:
    """ZERO's vote [C] of one image's views, from their unscaled logits [B + 1, C]."""
    p = (logits * scale).softmax(1)
    entropy = -(p * (logits * scale).log_softmax(1)).sum(1)  # the authors' p·log p, without its 0·(−∞)
    order = torch.argsort(entropy, descending=False)
    k = confident_count(len(logits), share)
    vote = (logits[order[:k]] / torch.finfo(logits.dtype).eps).softmax(1).sum(0)
    tied = (vote == vote.max()).nonzero().flatten()
    if len(tied) > 1:  # ties are rare: this reads the vote back to the host, once an image
        rest = logits[order[k:]].argmax(1)
        among = rest[torch.isin(rest, tied)]
        winner = among[0] if len(among) else tied[logits[order[min(k, len(order) - 1)], tied].argmax()]
        vote[winner] += 1
    return vote


class Zero(Method):
    name = "zero"
    needs_clip = True
    draws_random_numbers = True  # the views, from torch's generator
    trains = False
    owns_update = True  # its forward pass is of the images and their views (base.py: no apply)
    adapts_normalisation = False
    not_served = "the vote of each image's confident augmented views"
    generator: torch.Generator | None = None  # the views' random numbers; None: the device's default
    unsaved = (*Method.unsaved, "generator")
    options = (
        Option("views", 63, "B, the augmented views of each image besides itself", "count", most=1024),
        Option("share", 0.3, "γ, the share of the views, lowest entropy first, that vote", "fraction"),
        AUGMENT,
    )

    def check(self, model: FeatureClassifier, device: torch.device) -> None:
        zero_shot_head(model, self.name)

    def update(self, adapter: AdapterSurface, images: torch.Tensor, skipped: torch.Tensor | None):
        classifier = zero_shot_head(adapter.model, self.name)
        scale = classifier.logit_scale
        with torch.no_grad(), adapter.autocast:
            logits, features = adapter.forward(with_views(images, self.views, self.augment, self.generator))
        logits = widened(logits).view(len(images), 1 + self.views, -1) / scale  # f_bᵀ t_c
        vote = torch.stack([votes(each, scale, self.share) for each in logits])
        share = (vote / vote.sum(1, keepdim=True)).log().clamp_min(torch.finfo(vote.dtype).min)
        return share, widened(features.view(len(images), 1 + self.views, -1)[:, 0]), skipped
