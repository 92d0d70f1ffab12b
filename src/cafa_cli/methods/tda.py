"""TDA: a training-free dynamic adapter (Karmanov et al., "Efficient Test-Time Adaptation of
Vision-Language Models", CVPR 2024; kdiAAA/TDA).

Prediction, image by image in stream order (tda_runner.py: run_test_tda): the zero-shot logits
l = s·fᵀt_c of the image's unit-norm embedding f, its prediction ŷ = argmax l and the entropy
H of softmax(l). With B views (`views` above 0: the image and B augmented views, as the
authors' ImageNet-A/V/R/Sketch runs), the ρ·(B + 1) views of lowest entropy stand in for the
image (utils.py: get_clip_logits): f and l the means of their embeddings and logits, H the
entropy of their mean prediction, ŷ the argmax of l, and their mean probabilities p.

Then (shared/feature_cache.py) the positive cache takes (f, H) under class ŷ, and, where
H / log₂ C lies strictly between the entropy bounds, the negative cache takes (f, H, p) under
ŷ, each keeping the entries of lowest entropy (`positive_shots`, `negative_shots` a class).
The image is then predicted with the caches that now hold it:

    logits = l + α⁺ Σ_{k∈pos} exp(−β⁺(1 − fᵀk)) onehot(k)
               − α⁻ Σ_{k∈neg} exp(−β⁻(1 − fᵀk)) 1[lower < p_k < upper].

Nothing is trained and nothing of the model changes; the caches carry from batch to batch
and `reset` empties them. A batch of N images is N such steps, in order.

Options and defaults, the authors' ImageNet settings (configs/imagenet.yaml): 3 positive
shots, α⁺ 2, β⁺ 5; 2 negative shots, α⁻ 0.117, β⁻ 1, entropy bounds (0.2, 0.5), mask
bounds (0.03, 1); `views` 0 (ImageNet itself: the image alone; 63 with `augment` augmix on
their ImageNet-A/V/R/Sketch runs, whose configs have other cache values), ρ = 0.1.
"""

from __future__ import annotations

from cafa_cli.methods.shared.feature_cache import CacheMethod


class Tda(CacheMethod):
    name = "tda"
