"""A small CLIP-style dual encoder for Fashion-MNIST: an open_clip CLIP with a 4-layer ViT on
the 28×28 images (7×7 patches) and a 2-layer text transformer, trained contrastively on
captions made from the class names and prompt templates (train_fmnist_clip.py).

Its vocabulary is the few dozen BPE tokens those captions use, not open_clip's 49,408: the
token embedding of the full vocabulary alone would be 6 MB, and a text tower trained on ten
class names has nothing to say about the other tokens anyway. `CompactTokenizer` runs
open_clip's own BPE tokenizer (its vocabulary ships inside the package, so no network) and
maps each token to its row, any token the captions never used to one shared unknown row.
The end-of-text token keeps the largest id, as open_clip's argmax pooling (and TPT's code)
finds the end of a prompt by its id.

Everything needed to rebuild the model (the open_clip config, the vocabulary, the class
names and templates) is in the safetensors file's metadata, written by the training script.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from cafa_cli.model.clip import import_open_clip

# The data set's own class names (what the prompts say), in label order; the folder-safe
# names of fashion_mnist.FASHION_MNIST_CLASSES name the same classes in the same order.
CLASS_NAMES = (
    "t-shirt/top",
    "trouser",
    "pullover",
    "dress",
    "coat",
    "sandal",
    "shirt",
    "sneaker",
    "bag",
    "ankle boot",
)

# Other words for each class that captions use in training, so the text tower learns the
# class, not one spelling of it.
SYNONYMS = (
    ("t-shirt", "top", "tee"),
    ("trousers", "pants"),
    ("sweater", "jumper"),
    ("gown",),
    ("jacket",),
    ("sandals",),
    ("blouse",),
    ("sneakers", "trainer"),
    ("handbag", "purse"),
    ("boot", "boots"),
)

# The zero-shot classifier's prompt ensemble; training captions draw from the same list.
TEMPLATES = (
    "a photo of a {}.",
    "a photo of the {}.",
    "a picture of a {}.",
    "an image of a {}.",
    "a black and white photo of a {}.",
    "a grayscale photo of a {}.",
    "a low resolution photo of a {}.",
    "a small photo of a {}.",
    "a close-up photo of a {}.",
    "a product photo of a {}.",
    "a {}.",
    "{}",
)

# Never seen in training (a new order of known words; a word the vocabulary lacks): the docs
# report the zero-shot accuracy with these too, a check that the text tower encodes the class
# name rather than memorising whole captions.
HELD_OUT_TEMPLATES = (
    "the small {}.",
    "a photo of one {}.",
    "a blurry photo of a {}.",
)

EMBED_DIM = 64
CONTEXT_LENGTH = 16
VISION_CFG = {"image_size": 28, "patch_size": 7, "width": 64, "layers": 4, "head_width": 16, "mlp_ratio": 2.0}
TEXT_WIDTH = {"width": 64, "heads": 4, "layers": 2, "mlp_ratio": 2.0}

PAD_ID, UNKNOWN_ID = 0, 1  # open_clip pads with 0; row 1 stands for every token outside the vocabulary


def training_captions() -> list[tuple[int, str]]:
    """(class, caption) for every caption training draws from: each template with each class's
    name and synonyms."""
    return [
        (label, template.format(name))
        for label, names in enumerate(zip(CLASS_NAMES, SYNONYMS, strict=True))
        for name in (names[0], *names[1])
        for template in TEMPLATES
    ]


class CompactTokenizer:
    """open_clip's BPE tokenizer with its ids mapped onto the model's small vocabulary."""

    def __init__(self, vocabulary: list[int], context_length: int = CONTEXT_LENGTH):
        open_clip = import_open_clip("fmnist-clip")
        self.bpe = open_clip.tokenizer.SimpleTokenizer(context_length=context_length)
        self.context_length = context_length
        self.vocabulary = vocabulary  # BPE ids, in row order from row 2
        self.rows = torch.full((len(self.bpe.encoder),), UNKNOWN_ID, dtype=torch.long)
        self.rows[torch.tensor(vocabulary)] = torch.arange(2, 2 + len(vocabulary))
        self.rows[0] = PAD_ID

    @classmethod
    def fitted(cls, texts: list[str], context_length: int = CONTEXT_LENGTH) -> CompactTokenizer:
        """The vocabulary of `texts`, sorted by BPE id (so end-of-text, the largest, is last)."""
        bpe = import_open_clip("fmnist-clip").tokenizer.SimpleTokenizer(context_length=context_length)
        used = sorted({int(token) for token in bpe(texts).flatten().tolist()} - {0})
        return cls(used, context_length)

    @property
    def vocab_size(self) -> int:
        return 2 + len(self.vocabulary)

    def __call__(self, texts: str | list[str], context_length: int | None = None) -> torch.Tensor:
        return self.rows[self.bpe(texts, context_length or self.context_length)]


def clip_config(vocab_size: int) -> dict:
    return {
        "embed_dim": EMBED_DIM,
        "vision_cfg": VISION_CFG,
        "text_cfg": {"context_length": CONTEXT_LENGTH, "vocab_size": vocab_size, **TEXT_WIDTH},
    }


def build_clip(config: dict) -> nn.Module:
    return import_open_clip("fmnist-clip").CLIP(**config)


def load_fmnist_clip(weights: Path) -> nn.Module:
    """The zero-shot classifier of the bundled dual encoder, its text tower and tokenizer in
    `.text`, in eval mode."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from cafa_cli.model.clip import ClassTexts, zero_shot_classifier

    with safe_open(str(weights), "pt") as stored:
        metadata = stored.metadata()
    clip = build_clip(json.loads(metadata["config"]))
    clip.load_state_dict(load_file(str(weights)), strict=True)
    clip.eval()
    tokenizer = CompactTokenizer(json.loads(metadata["vocabulary"]), clip.context_length)
    texts = ClassTexts(
        clip, tokenizer, tuple(json.loads(metadata["class_names"])), tuple(json.loads(metadata["templates"]))
    )
    return zero_shot_classifier(clip, texts).eval()
