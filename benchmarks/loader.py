"""What the data loader costs per image: uint8 batches (the tool) against float batches
normalised per image in the loader processes (torchvision's to_tensor + normalize).

`batches` (cafa_cli.api) decodes (PIL), resizes and crops to uint8 in the loader; the
batch is normalised afterwards by `Preprocessing.normalize` on the model's device. On a
GPU that last step is a negligible kernel, so the loader's images/s is what bounds the
data path; on the CPU the main process pays for it, so its time per batch is printed
too. Both loaders run in this process on the same files, in turn: their ratio is
measured side by side.

Builds a folder of 224x224 JPEGs (quality 85, smooth random content; ImageNet-C's
geometry) unless --data names one:

    python benchmarks/loader.py --images 1280 --workers 0,2 --json loader.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from cafa_cli.api import Preprocessing, batches, open_domain


@dataclass(frozen=True)
class FloatPerImage:
    """The recipe, but converting and normalising each image in the loader."""

    recipe: Preprocessing

    def pixels(self, image: Image.Image) -> torch.Tensor:
        return self.recipe.normalize(self.recipe.pixels(image))

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        return images


def build_folder(root: Path, images: int, size: int) -> Path:
    rng = np.random.default_rng(0)
    folder = root / "c0"
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(images):
        small = rng.integers(0, 255, size=(14, 14, 3), dtype=np.uint8)
        Image.fromarray(small).resize((size, size), Image.BILINEAR).save(folder / f"{i:05d}.JPEG", quality=85)
    return root


def images_per_s(domain, preprocess, batch_size: int, workers: int) -> float:
    start = time.perf_counter()
    n = sum(len(batch.indices) for batch in batches(domain, preprocess, batch_size, num_workers=workers))
    return n / (time.perf_counter() - start)


def normalize_ms(recipe: Preprocessing, batch_size: int, size: int, repeats: int = 20) -> float:
    pixels = torch.randint(0, 256, (batch_size, 3, size, size), dtype=torch.uint8)
    recipe.normalize(pixels)
    start = time.perf_counter()
    for _ in range(repeats):
        recipe.normalize(pixels)
    return 1000 * (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", help="an image folder (default: build --images JPEGs in --workdir)")
    parser.add_argument("--workdir", default="/tmp/cafa-loader-bench")
    parser.add_argument("--images", type=int, default=1280)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--resize", default="none", help="an int or 'none' (ImageNet-C is already 224 px)")
    parser.add_argument("--crop", default="none")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--workers", default="0,2", help="comma-separated loader process counts")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many passes per setting")
    parser.add_argument("--json")
    args = parser.parse_args()

    root = Path(args.data) if args.data else build_folder(Path(args.workdir), args.images, args.size)
    domain = open_domain(str(root))
    size = lambda text: None if text == "none" else int(text)  # noqa: E731
    recipe = Preprocessing(resize=size(args.resize), crop=size(args.crop))
    pixels_size = recipe.pixels(domain.read(0)).shape[-1]
    result = {
        "images": len(domain),
        "batch": args.batch,
        "resize": args.resize,
        "crop": args.crop,
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_normalize_ms_per_batch": normalize_ms(recipe, args.batch, pixels_size),
        "runs": [],
    }
    print(
        f"normalising a batch of {args.batch} on the CPU ({torch.get_num_threads()} threads): "
        f"{result['cpu_normalize_ms_per_batch']:.1f} ms",
        flush=True,
    )
    for workers in (int(w) for w in args.workers.split(",")):
        row = {"workers": workers}
        for name, preprocess in (("uint8", recipe), ("float_per_image", FloatPerImage(recipe))):
            images_per_s(domain, preprocess, args.batch, workers)  # warm the page cache and the code
            row[name] = max(images_per_s(domain, preprocess, args.batch, workers) for _ in range(args.repeats))
        row["ratio"] = row["uint8"] / row["float_per_image"]
        result["runs"].append(row)
        print(
            f"workers {workers}: uint8 batches {row['uint8']:.0f} img/s, float per image "
            f"{row['float_per_image']:.0f} img/s (×{row['ratio']:.2f})",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
