"""CLIP-style dual encoders as classifiers. The image encoder, then the zero-shot head: the
classes' text embeddings, scaled by the model's temperature, as the weight of an nn.Linear.
So the features every method sees (FeatureClassifier's, `cafa stats`') are the unit-norm image
embeddings entering that layer, and every method that adapts a classifier runs on a CLIP
model unchanged, with the text head fixed.

The text tower stays outside the module tree (`ZeroShotClassifier.text`): the methods that
adapt normalisation layers must find the image encoder's alone, and the weights' fingerprint
is that of the classifier the methods adapt. The CLIP methods that tune prompts (TPT) reach
it through `text`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ClassTexts:
    """What names the classes: the dual encoder (its text tower), its tokenizer, the class
    names and the prompt templates ('a photo of a {}.'), or per class its own prompts
    (CuPL-style descriptions) in `prompts`."""

    model: nn.Module  # an open_clip CLIP: encode_text, token_embedding, transformer, ln_final, text_projection
    tokenizer: object  # open_clip's: list of str -> LongTensor [n, context_length]
    class_names: tuple[str, ...]
    templates: tuple[str, ...] = ("a photo of a {}.",)
    prompts: tuple[tuple[str, ...], ...] | None = None  # per class, replaces the templates where given

    def class_prompts(self, index: int) -> tuple[str, ...]:
        if self.prompts is not None and self.prompts[index]:
            return self.prompts[index]
        return tuple(template.format(self.class_names[index]) for template in self.templates)


@torch.no_grad()
def class_embeddings(texts: ClassTexts, device: torch.device | str = "cpu") -> torch.Tensor:
    """[classes, dim] unit-norm: per class, the mean of its prompts' unit-norm text embeddings,
    normalised again (the CLIP paper's prompt ensemble)."""
    rows = []
    for index in range(len(texts.class_names)):
        tokens = texts.tokenizer(list(texts.class_prompts(index))).to(device)
        embedded = F.normalize(texts.model.encode_text(tokens).float(), dim=-1)
        rows.append(F.normalize(embedded.mean(0), dim=-1))
    return torch.stack(rows)


class ZeroShotClassifier(nn.Module):
    """logits = logit_scale · normalize(image_encoder(x)) · class_embedding; the head is an
    nn.Linear without bias whose rows are logit_scale · class embedding (unit-norm), so
    `head.weight.norm(dim=1)` is the temperature and its direction the text embedding."""

    def __init__(
        self,
        image_encoder: nn.Module,
        class_embedding: torch.Tensor,
        logit_scale: float,
        texts: ClassTexts | None = None,
    ):
        super().__init__()
        classes, dim = class_embedding.shape
        self.image_encoder = image_encoder
        self.head = nn.Linear(dim, classes, bias=False)
        with torch.no_grad():
            self.head.weight.copy_(float(logit_scale) * F.normalize(class_embedding.float(), dim=-1))
        self.head.requires_grad_(False)
        self.text = texts  # a plain attribute, not a submodule (see the module's docstring)

    @property
    def logit_scale(self) -> float:
        return float(self.head.weight.norm(dim=1).mean())

    @property
    def class_names(self) -> Sequence[str] | None:
        return None if self.text is None else self.text.class_names

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.normalize(self.image_encoder(x), dim=-1))


def zero_shot_classifier(clip_model: nn.Module, texts: ClassTexts) -> ZeroShotClassifier:
    """The zero-shot classifier of an open_clip CLIP model for the classes `texts` names;
    the image encoder is the model's own `visual` module (shared, not copied)."""
    device = next(clip_model.parameters()).device
    return ZeroShotClassifier(
        clip_model.visual, class_embeddings(texts, device), float(clip_model.logit_scale.detach().exp()), texts
    )
