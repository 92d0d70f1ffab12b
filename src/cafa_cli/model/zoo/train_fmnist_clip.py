"""Reproduce the bundled Fashion-MNIST dual encoder (`fmnist-clip`) from scratch on the CPU.

    python -m cafa_cli.model.zoo.train_fmnist_clip [--data-root DIR] [--epochs N] [--seed 0] [--out PATH]

Trains the open_clip CLIP of fmnist_clip.py on the Fashion-MNIST training split only: each
image is paired with a caption drawn at random from its class's templates × names (the class
name or a synonym), and the loss is CLIP's symmetric contrastive loss with every pair of the
same class counted as a positive (a batch of 256 holds ~26 images of each class, which plain
CLIP would push apart). The image augmentation is train_fmnist.py's. Prints the zero-shot
accuracy on the clean test split (the prompt ensemble; the held-out templates) and the wall
time, and writes the weights with the model's config, vocabulary, class names and templates
in the metadata, atomically (default: the packaged file).
Same seed, same thread count, same torch build -> same weights.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from cafa_cli.core.environment import environment
from cafa_cli.core.errors import CafaError
from cafa_cli.data.fashion_mnist import load_fashion_mnist
from cafa_cli.model.clip import ClassTexts, zero_shot_classifier
from cafa_cli.model.zoo.fmnist_clip import (
    CLASS_NAMES,
    HELD_OUT_TEMPLATES,
    TEMPLATES,
    CompactTokenizer,
    build_clip,
    clip_config,
    training_captions,
)
from cafa_cli.model.zoo.train_fmnist import (
    adamw_warmup_cosine,
    augment,
    evaluate,
    normalize,
    save_weights_atomically,
    to_unit_tensor,
    training_arguments,
)

DEFAULT_OUT = Path(__file__).resolve().with_name("fmnist_clip.safetensors")
DEFAULT_EPOCHS = 4
BATCH_SIZE = 256
PEAK_LR = 2e-3
WARMUP_FRACTION = 0.05
WEIGHT_DECAY = 0.05  # on matrices only, as CLIP


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads or min(2, os.cpu_count() or 1))
    try:
        train_images, train_labels = load_fashion_mnist(args.data_root, "train")
        test_images, test_labels = load_fashion_mnist(args.data_root, "test")
    except CafaError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code

    started = time.perf_counter()
    torch.manual_seed(args.seed)
    captions = training_captions()
    tokenizer = CompactTokenizer.fitted([caption for _, caption in captions])
    config = clip_config(tokenizer.vocab_size)
    clip = build_clip(config)
    train(clip, tokenizer, captions, to_unit_tensor(train_images), torch.from_numpy(train_labels), args)
    clip.eval()
    test_images, test_labels = to_unit_tensor(test_images), torch.from_numpy(test_labels)
    accuracy = {
        name: evaluate(zero_shot(clip, tokenizer, templates), test_images, test_labels)
        for name, templates in (("templates", TEMPLATES), ("held_out_templates", HELD_OUT_TEMPLATES))
    }
    wall_seconds = time.perf_counter() - started

    print(f"zero-shot clean test accuracy: {accuracy['templates']:.4f} ({len(test_labels)} images)")
    print(f"  with the {len(HELD_OUT_TEMPLATES)} held-out templates: {accuracy['held_out_templates']:.4f}")
    print(f"wall time: {wall_seconds:.0f} s on {torch.get_num_threads()} threads")
    metadata = {
        "config": json.dumps(config),
        "vocabulary": json.dumps(tokenizer.vocabulary),
        "class_names": json.dumps(CLASS_NAMES),
        "templates": json.dumps(TEMPLATES),
        "clean_test_accuracy": f"{accuracy['templates']:.4f}",
        "clean_test_accuracy_held_out_templates": f"{accuracy['held_out_templates']:.4f}",
        "epochs": str(args.epochs),
        "seed": str(args.seed),
        "environment": json.dumps(environment("cpu")),  # torch's build and the threads the weights depend on
    }
    save_weights_atomically(clip, args.out, metadata)
    print(f"weights written to {args.out}")
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return training_arguments(
        argv,
        "train_fmnist_clip",
        "Train the bundled Fashion-MNIST dual encoder (fmnist-clip) from scratch on the CPU.",
        DEFAULT_OUT,
        DEFAULT_EPOCHS,
    )


def grey_to_rgb(images: torch.Tensor) -> torch.Tensor:
    """What the bundled preprocessing gives at use time: the grey image in 3 equal channels,
    each normalised with Fashion-MNIST's grey mean and std (open_clip's ViT takes RGB)."""
    return normalize(images).expand(-1, 3, -1, -1)


def zero_shot(clip: nn.Module, tokenizer: CompactTokenizer, templates: tuple[str, ...]) -> nn.Module:
    classifier = zero_shot_classifier(clip, ClassTexts(clip, tokenizer, CLASS_NAMES, templates))
    return _Rgb(classifier)


class _Rgb(nn.Module):
    """train_fmnist.evaluate normalises one grey channel; the ViT wants it in three."""

    def __init__(self, classifier: nn.Module):
        super().__init__()
        self.classifier = classifier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(x.expand(-1, 3, -1, -1))


def contrastive_loss(image_features, text_features, logit_scale, labels) -> torch.Tensor:
    """CLIP's symmetric cross-entropy over the batch's image–caption similarities, with every
    same-class pair a positive: -log(sum of positives' softmax mass), both directions."""
    logits = logit_scale * F.normalize(image_features, dim=-1) @ F.normalize(text_features, dim=-1).T
    negatives = labels[:, None] != labels[None, :]
    losses = []
    for directed in (logits, logits.T):
        positive_mass = directed.masked_fill(negatives, float("-inf")).logsumexp(1)
        losses.append((directed.logsumexp(1) - positive_mass).mean())
    return (losses[0] + losses[1]) / 2


def train(clip, tokenizer, captions, images, labels, args) -> None:
    generator = torch.Generator().manual_seed(args.seed)
    caption_labels = torch.tensor([label for label, _ in captions])
    caption_tokens = tokenizer([caption for _, caption in captions])
    counts = torch.bincount(caption_labels, minlength=len(CLASS_NAMES))
    offsets = torch.cumsum(counts, 0) - counts  # captions are grouped by class

    steps = args.epochs * math.ceil(len(images) / BATCH_SIZE)
    optimizer, schedule = adamw_warmup_cosine(list(clip.parameters()), PEAK_LR, WEIGHT_DECAY, steps, WARMUP_FRACTION)
    clip.train()
    for epoch in range(1, args.epochs + 1):
        epoch_started = time.perf_counter()
        order = torch.randperm(len(images), generator=generator)
        loss_sum = 0.0
        for start in range(0, len(images), BATCH_SIZE):
            batch = order[start : start + BATCH_SIZE]
            batch_labels = labels[batch]
            inputs = grey_to_rgb(augment(images[batch], generator))
            drawn = (torch.rand(len(batch), generator=generator) * counts[batch_labels]).long()
            tokens = caption_tokens[offsets[batch_labels] + drawn]
            loss = contrastive_loss(
                clip.encode_image(inputs), clip.encode_text(tokens), clip.logit_scale.exp(), batch_labels
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            with torch.no_grad():  # CLIP's clamp: a temperature below 1/100 destabilises training
                clip.logit_scale.clamp_(0, math.log(100))
            loss_sum += loss.item() * len(batch)
        print(
            f"epoch {epoch}/{args.epochs}: loss {loss_sum / len(images):.4f}, "
            f"logit scale {clip.logit_scale.exp().item():.1f}, {time.perf_counter() - epoch_started:.0f} s",
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
