"""The zero-shot classifier of a CLIP model: its logits are open_clip's own, its features
the unit-norm image embeddings, and the text tower stays out of what methods adapt."""

import pytest
import torch
from helpers import tiny_clip

from cafa_cli.engine.norms import NORM_LAYERS
from cafa_cli.model.clip import ClassTexts, zero_shot_classifier
from cafa_cli.model.features import FeatureClassifier

pytest.importorskip("open_clip")

NAMES = ("cat", "dog", "ship")


def test_logits_are_open_clips_own_image_text_logits():
    clip, tokenizer = tiny_clip()
    classifier = zero_shot_classifier(clip, ClassTexts(clip, tokenizer, NAMES))
    images = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        image, text, scale = clip(images, tokenizer([f"a photo of a {n}." for n in NAMES]))
        expected = scale * image @ text.T
        logits, features = FeatureClassifier(classifier)(images)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(features.norm(dim=1), torch.ones(4))
    assert classifier.logit_scale == pytest.approx(float(scale), rel=1e-5)


def test_a_prompt_ensemble_averages_unit_embeddings_per_class():
    clip, tokenizer = tiny_clip()
    templates = ("a photo of a {}.", "a sketch of a {}.")
    classifier = zero_shot_classifier(clip, ClassTexts(clip, tokenizer, NAMES, templates))
    with torch.no_grad():
        per_template = [
            torch.nn.functional.normalize(clip.encode_text(tokenizer([t.format(n) for n in NAMES])), dim=-1)
            for t in templates
        ]
    expected = torch.nn.functional.normalize(sum(per_template) / 2, dim=-1)
    torch.testing.assert_close(torch.nn.functional.normalize(classifier.head.weight, dim=-1), expected)


def test_only_the_image_encoders_norms_are_in_the_module_tree():
    clip, tokenizer = tiny_clip()
    classifier = zero_shot_classifier(clip, ClassTexts(clip, tokenizer, NAMES))
    norms = [name for name, module in classifier.named_modules() if isinstance(module, NORM_LAYERS)]
    assert norms and all(name.startswith("image_encoder.") for name in norms)
    assert not classifier.head.weight.requires_grad
