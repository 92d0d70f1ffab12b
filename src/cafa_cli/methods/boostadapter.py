"""BoostAdapter: TDA's caches and, for each image, its own confident views as boosting samples
(Zhang et al., "BoostAdapter: Improving Vision-Language Test-Time Adaptation via Regional
Bootstrapping", NeurIPS 2024; taolinzhang/BoostAdapter runner.py, mode boostadapter).

Chosen over DPE (zhangce01/DPE-CLIP, NeurIPS 2024) because it is training-free and built on
TDA's caches (shared/feature_cache.py), which it reuses as they are, and on the views TPT,
ZERO and DMN-ZS take (shared/zero_shot.py): one file of new logic. DPE instead optimises
residuals of the text and image prototypes per image with AdamW, a second training loop.

Prediction, image by image in stream order, as TDA's (tda.py) with B views: the image is
summarised by the mean of its ρ·(B + 1) confident views and remembered in the positive and
negative caches. Then a copy of the positive cache, `boost_shots` δ more entries a class,
takes the ρ·(B + 1) views of lowest entropy as entries of their own (each under its own
predicted class, with its own entropy), and the image's logits are

    l + α⁺ Σ_{k∈pos ∪ boost} exp(−β⁺(1 − fᵀk)) onehot(k) − α⁻ Σ_{k∈neg} exp(−β⁻(1 − fᵀk)) mask(k),

the boosting samples kept for this image alone. Options and defaults, the authors'
(scripts/run.sh and configs/imagenet_a.yaml, their ImageNet-A/V/R/Sketch runs): B = 63
(64 views), crop-and-flip views (get_ood_preprocess: augmix False), δ = 3, ρ = 0.1, and
TDA's ImageNet cache values.
"""

from __future__ import annotations

import torch

from cafa_cli.engine.options import Option
from cafa_cli.methods.shared.feature_cache import CACHE_OPTIONS, CacheMethod
from cafa_cli.methods.shared.zero_shot import AUGMENT, confident


class BoostAdapter(CacheMethod):
    name = "boostadapter"
    options = (
        Option("views", 63, "B, the augmented views of each image besides itself", "count", most=1024),
        Option(
            "share",
            0.1,
            "ρ, the share of the views, lowest entropy first, that stand for the image and boost",
            "fraction",
        ),
        AUGMENT,
        Option(
            "boost_shots",
            3,
            "δ, the boosting samples a class beyond the positive cache's entries",
            "count0",
            most=10_000,
        ),
        *CACHE_OPTIONS,
    )

    def predict(self, views: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        logits, feature = self.remember(*self.summary(views, features))
        boosted = self.positive.widened(self.positive_shots + self.boost_shots)
        for i in confident(views, self.share):
            p = views[i].log_softmax(0)
            boosted.add(int(views[i].argmax()), features[i], -(p.exp() * p).sum())
        return self.cached(logits, feature, boosted)
