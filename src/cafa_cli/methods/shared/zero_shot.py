"""What the CLIP test-time methods share (TPT, ZERO, TDA, DMN-ZS, BoostAdapter): the zero-shot
classifier they need (model/clip.py), each test image with augmented views of it, and the
confident views, those of lowest entropy.

Their authors (azshue/TPT, FarinaMatteo/zero, YBZh/DMN, kdiAAA/TDA, taolinzhang/BoostAdapter)
load each test image as the image itself (resized and centre-cropped) followed by B views:
on ImageNet and its variants a RandomResizedCrop and a horizontal flip (their
AugMixAugmenter with augmix False: `crop` here, augmix.crop_and_flip), on the fine-grained
sets those followed by AugMix's operations (`augmix`, augmix.augmix with the resized crop).
Theirs are drawn from the full-size image before it is resized; here, from the image as the
model takes it (the data pipeline has resized it), so a crop has fewer pixels to choose from.
"""

from __future__ import annotations

import torch

from cafa_cli.core.errors import UsageError
from cafa_cli.engine.options import Option
from cafa_cli.methods.shared.augmix import augmix, crop_and_flip
from cafa_cli.model.clip import ZeroShotClassifier
from cafa_cli.model.features import FeatureClassifier

AUGMENTS = ("crop", "augmix")
# the views' option, as every CLIP method that makes views declares it
AUGMENT = Option(
    "augment", "crop", "the views: crop (resized crop and flip) or augmix (and AugMix's operations)", "choice", AUGMENTS
)


def zero_shot_head(model: FeatureClassifier, method: str, text_tower: bool = False) -> ZeroShotClassifier:
    """The model's zero-shot classifier; a UsageError naming why where the model is none (or,
    with `text_tower`, has no class texts to run the text tower on)."""
    classifier = getattr(model, "model", None)
    if not isinstance(classifier, ZeroShotClassifier):
        raise UsageError(
            f"{method} needs a CLIP model (its text embeddings), not a {type(classifier).__name__}: give `model` "
            f"openclip:ARCH (or a ZeroShotClassifier, cafa_cli.model.clip)"
        )
    if text_tower and classifier.text is None:
        raise UsageError(
            f"{method} tunes the prompts of the CLIP model's text tower, and this zero-shot classifier was made "
            f"without its class texts; build it with zero_shot_classifier(clip_model, ClassTexts(...))"
        )
    return classifier


def with_views(images: torch.Tensor, views: int, augment: str, generator: torch.Generator | None) -> torch.Tensor:
    """Each image followed by `views` augmented views of it: [N·(1 + views), C, H, W], row
    n·(1 + views) the image n itself."""
    if images.dim() != 4:
        raise UsageError(
            f"augmented views are of images [N, channels, height, width], not of inputs shaped {list(images.shape)}"
        )
    n = len(images)
    if views == 0:
        return images
    made = crop_and_flip(images, views, generator) if augment == "crop" else augmix(images, views, generator, "resized")
    return torch.cat([images.unsqueeze(1), made.view(n, views, *images.shape[1:])], 1).flatten(0, 1)


def confident(logits: torch.Tensor, share: float) -> torch.Tensor:
    """The rows of the int(rows·share) lowest entropies, lowest first (TPT's select_confident_samples)."""
    entropy = -(logits.softmax(1) * logits.log_softmax(1)).sum(1)
    return torch.argsort(entropy, descending=False)[: confident_count(len(logits), share)]


def confident_count(rows: int, share: float) -> int:
    """int(rows·share), the authors' count of confident views, but at least one: where it rounds
    down to none (few views, a small share) theirs selects nothing and predicts NaN."""
    return max(1, int(rows * share))


def widened(x: torch.Tensor) -> torch.Tensor:
    """float32, or float64 where it is: what a loss or a selection is computed in (fp16 and
    bf16 logits are widened; a float64 model's stay float64, as the fidelity tests run it)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))
