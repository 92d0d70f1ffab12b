"""Reproduce the bundled Fashion-MNIST weights from scratch on the CPU.

    python -m cafa_cli.model.zoo.train_fmnist [--data-root DIR] [--epochs N] [--seed 0] [--out PATH]

Reads the idx files of the Debian package dataset-fashion-mnist (or --data-root /
CAFA_FASHION_MNIST), trains with light augmentation, prints the clean test accuracy
and wall time, and writes the weights atomically (default: the packaged file).
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

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from cafa_cli.core.environment import environment
from cafa_cli.core.errors import CafaError
from cafa_cli.core.files import atomic_write
from cafa_cli.data.fashion_mnist import FASHION_MNIST_MEAN, FASHION_MNIST_STD, load_fashion_mnist
from cafa_cli.model.zoo.fmnist_resnet import FmnistResNet

DEFAULT_OUT = Path(__file__).resolve().with_name("fmnist_resnet.safetensors")
DEFAULT_EPOCHS = 6
BATCH_SIZE = 128
PEAK_LR = 0.1
MOMENTUM = 0.9
WEIGHT_DECAY = 5e-4
EVAL_BATCH_SIZE = 1000

# Augmentation strengths. Shifts, flips and contrast/brightness jitter make a source
# model whose accuracy degrades gradually under corruptions instead of collapsing,
# which is what a test-time-adaptation demo needs to show a difference.
MAX_SHIFT_PX = 2
CONTRAST_RANGE = (0.7, 1.3)
MAX_BRIGHTNESS_DELTA = 0.1


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
    model = FmnistResNet()
    train(model, to_unit_tensor(train_images), torch.from_numpy(train_labels), args.epochs, args.seed)
    accuracy = evaluate(model, to_unit_tensor(test_images), torch.from_numpy(test_labels))
    wall_seconds = time.perf_counter() - started

    print(f"clean test accuracy: {accuracy:.4f} ({len(test_labels)} images)")
    print(f"wall time: {wall_seconds:.0f} s on {torch.get_num_threads()} threads")
    metadata = {
        "clean_test_accuracy": f"{accuracy:.4f}",
        "epochs": str(args.epochs),
        "seed": str(args.seed),
        "environment": json.dumps(environment("cpu")),  # torch's build and the threads the weights depend on
    }
    save_weights_atomically(model, args.out, metadata)
    print(f"weights written to {args.out}")
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return training_arguments(
        argv,
        "train_fmnist",
        "Train the bundled Fashion-MNIST ResNet from scratch on the CPU.",
        DEFAULT_OUT,
        DEFAULT_EPOCHS,
    )


def training_arguments(
    argv: list[str] | None, module: str, description: str, default_out: Path, default_epochs: int
) -> argparse.Namespace:
    """The options of a bundled model's training script (`python -m cafa_cli.model.zoo.MODULE`)."""
    parser = argparse.ArgumentParser(prog=f"python -m cafa_cli.model.zoo.{module}", description=description)
    parser.add_argument(
        "--data-root",
        type=Path,
        default=None,
        help="folder with the idx files (default: $CAFA_FASHION_MNIST or /usr/share/datasets/fashion-mnist)",
    )
    parser.add_argument("--epochs", type=int, default=default_epochs)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, default=default_out, help="safetensors file to write (default: the packaged weights)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: 2, the budget the weights were made with)",
    )
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error("--epochs must be at least 1")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be at least 1")
    return args


def to_unit_tensor(images: np.ndarray) -> torch.Tensor:
    """uint8 [N,28,28] -> float [N,1,28,28] on [0,1], as ToTensor gives at use time."""
    return torch.from_numpy(images).unsqueeze(1).float().div_(255.0)


def normalize(images: torch.Tensor) -> torch.Tensor:
    return (images - FASHION_MNIST_MEAN) / FASHION_MNIST_STD


def augment(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random shift, horizontal flip, contrast and brightness on a [0,1] batch."""
    images = random_shift(images, MAX_SHIFT_PX, generator)
    images = random_hflip(images, generator)
    return random_contrast_brightness(images, generator)


def random_shift(images: torch.Tensor, max_shift: int, generator: torch.Generator) -> torch.Tensor:
    """Zero-pad by max_shift and crop back at a random offset per image.

    Zero padding matches the black Fashion-MNIST background.
    """
    count, _, height, width = images.shape
    padded = F.pad(images, (max_shift,) * 4)
    offsets = torch.randint(0, 2 * max_shift + 1, (count, 2), generator=generator)
    rows = offsets[:, 0, None] + torch.arange(height)  # [N, H]
    cols = offsets[:, 1, None] + torch.arange(width)  # [N, W]
    batch_index = torch.arange(count)[:, None, None]
    return padded[batch_index, 0, rows[:, :, None], cols[:, None, :]].unsqueeze(1)


def random_hflip(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    flip = torch.rand(len(images), generator=generator) < 0.5
    return torch.where(flip[:, None, None, None], images.flip(-1), images)


def random_contrast_brightness(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    # Contrast blends with each image's mean grey level, as torchvision's adjust_contrast.
    count = len(images)
    low, high = CONTRAST_RANGE
    contrast = low + (high - low) * torch.rand(count, 1, 1, 1, generator=generator)
    brightness = MAX_BRIGHTNESS_DELTA * (2 * torch.rand(count, 1, 1, 1, generator=generator) - 1)
    image_means = images.mean(dim=(1, 2, 3), keepdim=True)
    adjusted = (images - image_means) * contrast + image_means + brightness
    return adjusted.clamp_(0.0, 1.0)


def train(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, epochs: int, seed: int) -> None:
    steps_per_epoch = math.ceil(len(images) / BATCH_SIZE)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=PEAK_LR, momentum=MOMENTUM, nesterov=True, weight_decay=WEIGHT_DECAY
    )
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=PEAK_LR, epochs=epochs, steps_per_epoch=steps_per_epoch
    )
    fit(model, images, labels, epochs, seed, optimizer, schedule)


def adamw_warmup_cosine(
    parameters: list[nn.Parameter], peak_lr: float, weight_decay: float, steps: int, warmup_fraction: float
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW with weight decay on matrices only (not on gains, biases, embeddings' scale), its
    rate rising linearly to `peak_lr` over the first `warmup_fraction` of the steps, then a cosine to 0."""
    decay = [p for p in parameters if p.ndim >= 2]
    no_decay = [p for p in parameters if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=peak_lr
    )
    warmup = max(1, int(warmup_fraction * steps))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: (
            (step + 1) / warmup if step < warmup else 0.5 * (1 + math.cos(math.pi * (step - warmup) / (steps - warmup)))
        ),
    )
    return optimizer, schedule


def fit(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    epochs: int,
    seed: int,
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
) -> None:
    """Cross-entropy on augmented batches of BATCH_SIZE, in an order and with augmentations drawn from `seed`."""
    generator = torch.Generator().manual_seed(seed)
    model.train()
    for epoch in range(1, epochs + 1):
        epoch_started = time.perf_counter()
        order = torch.randperm(len(images), generator=generator)
        loss_sum, correct = 0.0, 0
        for start in range(0, len(images), BATCH_SIZE):
            batch = order[start : start + BATCH_SIZE]
            inputs = normalize(augment(images[batch], generator))
            logits = model(inputs)
            loss = F.cross_entropy(logits, labels[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            loss_sum += loss.item() * len(batch)
            correct += (logits.argmax(1) == labels[batch]).sum().item()
        print(
            f"epoch {epoch}/{epochs}: loss {loss_sum / len(images):.4f}, "
            f"train accuracy {correct / len(images):.4f} (augmented), "
            f"{time.perf_counter() - epoch_started:.0f} s",
            flush=True,
        )


@torch.no_grad()
def evaluate(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> float:
    model.eval()
    correct = 0
    for start in range(0, len(images), EVAL_BATCH_SIZE):
        logits = model(normalize(images[start : start + EVAL_BATCH_SIZE]))
        correct += (logits.argmax(1) == labels[start : start + EVAL_BATCH_SIZE]).sum().item()
    return correct / len(images)


def save_weights_atomically(model: nn.Module, out: Path, metadata: dict[str, str]) -> None:
    """Write to a temporary file beside `out`, then rename, so a crash never leaves half a file."""
    from safetensors.torch import save_file

    # state_dict includes BN running stats; safetensors refuses shared or strided storage.
    tensors = {name: tensor.detach().contiguous().clone() for name, tensor in model.state_dict().items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, lambda tmp: save_file(tensors, tmp, metadata=metadata))


if __name__ == "__main__":
    sys.exit(main())
