"""Held-out domains beyond corrupt-tta's: Fashion-MNIST test images under six label-preserving
image transforms that none of the 15 reported corruptions is (docs/design.md, "The continual
column, fourth session": the four held-out corruptions are too few kinds of change for a
continual stream). Writes ROOT/NAME/CLASS/INDEX.png for each transform, PER_CLASS images a
class (the first of each class in the test split, as the demo's), deterministic:

    PYTHONPATH=src python benchmarks/held_out_transforms.py /tmp/fmnist-t --per-class 300
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
import torchvision.transforms.functional as F
from PIL import Image

from cafa_cli.data.fashion_mnist import FASHION_MNIST_CLASSES, load_fashion_mnist

TRANSFORMS = {  # each on a uint8 [1, 28, 28] tensor; the random ones draw from `g`
    "posterize": lambda x, g: F.posterize(x, 2),
    "solarize": lambda x, g: F.solarize(x, 160),
    "rotate": lambda x, g: F.rotate(x, float(torch.empty(1).uniform_(-35, 35, generator=g))),
    "shear": lambda x, g: F.affine(x, 0.0, [0, 0], 1.0, [float(torch.empty(1).uniform_(-25, 25, generator=g)), 0.0]),
    "cutout": lambda x, g: F.erase(x, *torch.randint(0, 16, (2,), generator=g).tolist(), 12, 12, torch.tensor(0)),
    "equalize": lambda x, g: F.equalize(x),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", type=Path)
    parser.add_argument("--per-class", type=int, default=300)
    args = parser.parse_args()
    images, labels = load_fashion_mnist(split="test")
    for name, transform in TRANSFORMS.items():
        folder = args.root / name
        if (folder / ".complete").exists():
            continue
        g = torch.Generator().manual_seed(0)
        for label, class_name in enumerate(FASHION_MNIST_CLASSES):
            (folder / class_name).mkdir(parents=True, exist_ok=True)
            for i in np.flatnonzero(labels == label)[: args.per_class]:
                x = transform(torch.from_numpy(images[i])[None], g)
                Image.fromarray(x[0].numpy()).save(folder / class_name / f"{i:05d}.png")
        (folder / ".complete").touch()
        print(f"{folder}: {len(FASHION_MNIST_CLASSES) * args.per_class} images")


if __name__ == "__main__":
    main()
