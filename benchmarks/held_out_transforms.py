"""Held-out domains beyond corrupt-tta's: Fashion-MNIST test images under six label-preserving
image transforms that none of the 15 reported corruptions is (docs/design/cafa-robust-sweeps.md, "The continual
column, fourth session": the four held-out corruptions are too few kinds of change for a
continual stream). Writes ROOT/NAME/CLASS/INDEX.png for each transform, PER_CLASS images a
class, the test images `cafa demo --data-only --test-per-class PER_CLASS` corrupts (its rows
and its folder writer), deterministic:

    PYTHONPATH=src python benchmarks/held_out_transforms.py /tmp/fmnist-t --per-class 300

`--extreme` writes six harsher ones instead (invert, vertical flip, a quarter turn, solarize
at 64, one-bit posterize, a quarter of the brightness), looked through for a held-out domain
the source model gets confidently wrong and batch statistics help, as the 15's motion blur
(docs/design/cafa-robust-skewed-batches.md, "A second look at a skewed batch"); none is both. `--filters` writes sixteen
image filters and resamplings instead (box, gaussian, median, mode, min and max filters, down-
and upsampling, a vertical squash, a blur along the columns), blurs of other kinds than
gaussian blur looked through for the same. `--of CORRUPTION/SEVERITY`
transforms that corruption's images instead of the clean ones (the bytes `cafa demo
--data-only` writes for it), a domain of two changes at once, e.g. a rotated gaussian blur
(looked through for a held-out stand-in of the 15's continual stream into motion blur;
docs/design/cafa-robust-skewed-batches.md, "A held-out stand-in for motion blur, sixth session"):

    PYTHONPATH=src python benchmarks/held_out_transforms.py /tmp/fmnist-gb3 --of gaussian_blur/3
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
import torchvision.transforms.functional as F
from PIL import Image, ImageFilter

from cafa_cli.api import load_fashion_mnist

# Internal, what this extends (tests/test_api.py lists it): how `cafa demo` builds Fashion-MNIST-C
from cafa_cli.data.fmnist_c import corrupted_as_built, stratified_rows, write_image_folder

TRANSFORMS = {  # each on a uint8 [1, 28, 28] tensor; the random ones draw from `g`
    "posterize": lambda x, g: F.posterize(x, 2),
    "solarize": lambda x, g: F.solarize(x, 160),
    "rotate": lambda x, g: F.rotate(x, float(torch.empty(1).uniform_(-35, 35, generator=g))),
    "shear": lambda x, g: F.affine(x, 0.0, [0, 0], 1.0, [float(torch.empty(1).uniform_(-25, 25, generator=g)), 0.0]),
    "cutout": lambda x, g: F.erase(x, *torch.randint(0, 16, (2,), generator=g).tolist(), 12, 12, torch.tensor(0)),
    "equalize": lambda x, g: F.equalize(x),
}
EXTREME = {
    "invert": lambda x, g: 255 - x,
    "vflip": lambda x, g: F.vflip(x),
    "rot90": lambda x, g: torch.rot90(x, 1, (1, 2)),
    "solarize64": lambda x, g: F.solarize(x, 64),
    "posterize1": lambda x, g: F.posterize(x, 1),
    "dim": lambda x, g: (x.float() * 0.25).to(torch.uint8),
}


def _pil(change):
    """A transform of a uint8 [1, 28, 28] tensor made from one of a PIL grey image."""
    return lambda x, g: torch.from_numpy(np.asarray(change(Image.fromarray(x[0].numpy()))).copy())[None]


def _squashed(height: int):
    """The image resized to `height` rows, centred on a black 28-row canvas."""

    def change(image):
        canvas = Image.new("L", image.size)
        canvas.paste(image.resize((image.width, height), Image.BILINEAR), (0, (image.height - height) // 2))
        return canvas

    return change


def _vertical_blur(x: torch.Tensor, radius: int) -> torch.Tensor:
    """A box blur along the columns only (2·radius + 1 rows, zeros beyond the edge)."""
    kernel = torch.full((1, 1, 2 * radius + 1, 1), 1 / (2 * radius + 1), dtype=torch.float64)
    blurred = torch.nn.functional.conv2d(x[None].double(), kernel, padding=(radius, 0))[0]
    return blurred.round().clamp(0, 255).to(torch.uint8)


# image filters and resamplings: blurs of other kinds than gaussian blur, looked through for a
# held-out domain that the source model predicts as one class and batch statistics mend, as the
# 15's motion blur (docs/design/cafa-robust-skewed-batches.md, "A held-out stand-in for motion blur"); none is
FILTERS = {
    "box2": _pil(lambda im: im.filter(ImageFilter.BoxBlur(2))),
    "box3": _pil(lambda im: im.filter(ImageFilter.BoxBlur(3))),
    "box4": _pil(lambda im: im.filter(ImageFilter.BoxBlur(4))),
    "gauss3": _pil(lambda im: im.filter(ImageFilter.GaussianBlur(3))),
    "gauss4": _pil(lambda im: im.filter(ImageFilter.GaussianBlur(4))),
    "median5": _pil(lambda im: im.filter(ImageFilter.MedianFilter(5))),
    "mode5": _pil(lambda im: im.filter(ImageFilter.ModeFilter(5))),
    "max3": _pil(lambda im: im.filter(ImageFilter.MaxFilter(3))),
    "min3": _pil(lambda im: im.filter(ImageFilter.MinFilter(3))),
    "down7": _pil(lambda im: im.resize((7, 7), Image.BILINEAR).resize(im.size, Image.BILINEAR)),
    "down5": _pil(lambda im: im.resize((5, 5), Image.BILINEAR).resize(im.size, Image.BILINEAR)),
    "down4": _pil(lambda im: im.resize((4, 4), Image.BILINEAR).resize(im.size, Image.BILINEAR)),
    "squash16": _pil(_squashed(16)),
    "squash12": _pil(_squashed(12)),
    "vblur3": lambda x, g: _vertical_blur(x, 3),
    "vblur5": lambda x, g: _vertical_blur(x, 5),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", type=Path)
    parser.add_argument("--per-class", type=int, default=300)
    parser.add_argument("--extreme", action="store_true", help="the six harsher transforms instead")
    parser.add_argument("--filters", action="store_true", help="the sixteen filters and resamplings instead")
    parser.add_argument("--of", metavar="CORRUPTION/SEVERITY", help="transform this corruption's images")
    args = parser.parse_args()
    images, labels = load_fashion_mnist(split="test")
    rows = stratified_rows(labels, args.per_class, seed=0)  # the demo's default seed
    images, labels = images[rows], labels[rows]
    if args.of:
        corruption, severity = args.of.split("/")
        images = corrupted_as_built(images, corruption, int(severity))
    chosen = FILTERS if args.filters else EXTREME if args.extreme else TRANSFORMS
    for name, transform in chosen.items():
        g = torch.Generator().manual_seed(0)
        transformed = torch.stack([transform(torch.from_numpy(image)[None], g)[0] for image in images])
        folder = write_image_folder(args.root / name, transformed.numpy(), labels)  # kept when complete
        print(f"{folder}: {len(images)} images")


if __name__ == "__main__":
    main()
