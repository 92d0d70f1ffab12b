"""Reproduce the bundled Fashion-MNIST ViT (`fmnist-vit`) from scratch on the CPU.

    python -m cafa_cli.model.zoo.train_fmnist_vit [--data-root DIR] [--epochs N] [--seed 0] [--out PATH]

Trains the timm VisionTransformer of fmnist_vit.py on the Fashion-MNIST training split with
train_fmnist.py's loop and augmentation (±2 px shift, horizontal flip, contrast and brightness
jitter), cross-entropy, batches of 128, AdamW (weight decay 0.05 on matrices only) with a
linear warm-up over the first 5 % of the steps to 1e-3 and a cosine to 0. Prints the clean
test accuracy and the wall time, and writes the weights with the architecture in the
metadata, atomically (default: the packaged file).
Same seed, same thread count, same torch and timm builds -> same weights.
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

from cafa_cli.core.environment import environment
from cafa_cli.core.errors import CafaError
from cafa_cli.data.fashion_mnist import load_fashion_mnist
from cafa_cli.model.zoo.fmnist_vit import ARCHITECTURE, build_fmnist_vit
from cafa_cli.model.zoo.train_fmnist import (
    BATCH_SIZE,
    adamw_warmup_cosine,
    evaluate,
    fit,
    save_weights_atomically,
    to_unit_tensor,
    training_arguments,
)

DEFAULT_OUT = Path(__file__).resolve().with_name("fmnist_vit.safetensors")
DEFAULT_EPOCHS = 10
PEAK_LR = 1e-3
WARMUP_FRACTION = 0.05
WEIGHT_DECAY = 0.05


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
    model = build_fmnist_vit()
    steps = args.epochs * math.ceil(len(train_images) / BATCH_SIZE)
    optimizer, schedule = adamw_warmup_cosine(list(model.parameters()), PEAK_LR, WEIGHT_DECAY, steps, WARMUP_FRACTION)
    images, labels = to_unit_tensor(train_images), torch.from_numpy(train_labels)
    fit(model, images, labels, args.epochs, args.seed, optimizer, schedule)
    accuracy = evaluate(model, to_unit_tensor(test_images), torch.from_numpy(test_labels))
    wall_seconds = time.perf_counter() - started

    print(f"clean test accuracy: {accuracy:.4f} ({len(test_labels)} images)")
    print(f"wall time: {wall_seconds:.0f} s on {torch.get_num_threads()} threads")
    metadata = {
        "architecture": json.dumps(ARCHITECTURE),
        "clean_test_accuracy": f"{accuracy:.4f}",
        "epochs": str(args.epochs),
        "seed": str(args.seed),
        "environment": json.dumps(environment("cpu")),  # torch's build and the threads the weights depend on
        "timm": timm_version(),  # its initialisation and layer order are the architecture's
    }
    save_weights_atomically(model, args.out, metadata)
    print(f"weights written to {args.out}")
    return 0


def timm_version() -> str:
    import timm

    return timm.__version__


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return training_arguments(
        argv,
        "train_fmnist_vit",
        "Train the bundled Fashion-MNIST ViT (fmnist-vit) from scratch on the CPU.",
        DEFAULT_OUT,
        DEFAULT_EPOCHS,
    )


if __name__ == "__main__":
    sys.exit(main())
