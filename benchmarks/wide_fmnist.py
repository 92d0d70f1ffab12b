"""The bundled Fashion-MNIST ResNet with a wider last stage, for experiments where the
feature dimension d is larger than the test batch (as for ResNet-50's 2,048 features
and batch 64), so that a batch's feature covariance is far from full rank.

As a model factory:  --model benchmarks/wide_fmnist.py:build --weights wide-fmnist.safetensors
                     --resize none --crop none --mean 0.2860 --std 0.3530 --channels 1
To train it (same recipe, seed and epochs as the bundled model):

    PYTHONPATH=src python benchmarks/wide_fmnist.py --width 256 --out wide-fmnist.safetensors

The factory builds width $CAFA_WIDE_FMNIST_WIDTH (default 256): set it for other widths.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

from cafa_cli.api import load_fashion_mnist

# Internal, what this varies (tests/test_api.py lists these): the bundled model's architecture
# and the code that trained it
from cafa_cli.model.zoo import train_fmnist
from cafa_cli.model.zoo.fmnist_resnet import STAGE_WIDTHS, FmnistResNet, ResidualBlock

DEFAULT_WIDTH = 256


def build(num_classes: int = 10, width: int | None = None) -> nn.Module:
    """FmnistResNet whose second stage (and so the pooled features) has `width` channels;
    by default the width of $CAFA_WIDE_FMNIST_WIDTH or 256."""
    width = width or int(os.environ.get("CAFA_WIDE_FMNIST_WIDTH", DEFAULT_WIDTH))
    net = FmnistResNet(num_classes)
    net.layer2 = ResidualBlock(STAGE_WIDTHS[0], width, stride=2)
    net.fc = nn.Linear(width, num_classes)
    return net


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=DEFAULT_WIDTH)
    parser.add_argument("--epochs", type=int, default=train_fmnist.DEFAULT_EPOCHS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    train_images, train_labels = load_fashion_mnist(None, "train")
    test_images, test_labels = load_fashion_mnist(None, "test")
    torch.manual_seed(args.seed)
    model = build(width=args.width)
    started = time.perf_counter()
    train_fmnist.train(
        model, train_fmnist.to_unit_tensor(train_images), torch.from_numpy(train_labels), args.epochs, args.seed
    )
    accuracy = train_fmnist.evaluate(model, train_fmnist.to_unit_tensor(test_images), torch.from_numpy(test_labels))
    print(
        f"width {args.width}: clean test accuracy {accuracy:.4f}, {time.perf_counter() - started:.0f} s on {args.threads} threads"
    )
    metadata = {
        "clean_test_accuracy": f"{accuracy:.4f}",
        "width": str(args.width),
        "epochs": str(args.epochs),
        "seed": str(args.seed),
        "torch": torch.__version__,
    }
    train_fmnist.save_weights_atomically(model, args.out, metadata)
    return 0


if __name__ == "__main__":
    sys.exit(main())
