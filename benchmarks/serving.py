"""Serving an adapted model one image at a time: the error of a batch and of single images,
through the Adapter and through Adapter.export(), for each `norm` (docs/guides/deploy.md,
"Serve one image at a time").

    python benchmarks/serving.py cafa-demo/fashion-mnist-c-300/contrast/3 --images 300

The bundled fmnist-resnet adapts with TENT (its CIFAR recipe: Adam lr 1e-3) over the first
`--images` of the shuffled domain in batches of `--batch`; then, with the weights it
arrived at, the same images are predicted (1) by one more Adapter step as one batch, (2)
by the Adapter one image at a time, (3) by the exported network as one batch and (4) one
image at a time. Predictions through the Adapter update it, so each of (1) and (2) starts
from a copy of the adapted state.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from cafa_cli.api import (  # noqa: E402
    FASHION_MNIST_CLASSES,
    Adapter,
    Preprocessing,
    batches,
    create,
    load_model,
    open_domain,
)


def images_of(folder: str, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    # labels by class name in the model's output order, as cafa adapt maps them
    domain = open_domain(folder, FASHION_MNIST_CLASSES)
    preprocess = Preprocessing(resize=None, crop=None, mean=(0.2860,), std=(0.3530,), channels=1)  # fmnist-resnet's
    chosen = np.random.default_rng(0).permutation(len(domain))[:count]
    loaded = list(batches(domain, preprocess, 100, chosen))
    images = torch.cat([preprocess.normalize(b.images) for b in loaded])
    labels = torch.as_tensor(domain.labels[np.concatenate([b.indices for b in loaded])])  # positions in the domain
    return images, labels


def error(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return round(100 * float((logits.argmax(1) != labels).float().mean()), 2)


def measure(images: torch.Tensor, labels: torch.Tensor, norm: str, batch: int) -> dict:
    torch.manual_seed(0)
    adapter = Adapter(load_model("fmnist-resnet"), create("tent"), "cpu", norm=norm)
    for part in images.split(batch):
        adapter.step(part)
    state = adapter.state_dict()

    def through_adapter(size: int) -> float:
        again = Adapter(load_model("fmnist-resnet"), create("tent"), "cpu", norm=norm)
        again.load_state_dict(state)
        return error(torch.cat([again.step(part) for part in images.split(size)]), labels)

    served = adapter.export()
    with torch.no_grad():
        exported_batch = error(served(images), labels)
        exported_single = error(torch.cat([served(image[None]) for image in images]), labels)
    return {
        "norm": norm,
        "adapter_batch": through_adapter(len(images)),
        "adapter_single": through_adapter(1),
        "exported_batch": exported_batch,
        "exported_single": exported_single,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("domain", help="a labelled image folder, e.g. cafa-demo/fashion-mnist-c-300/contrast/3")
    parser.add_argument("--images", type=int, default=300)
    parser.add_argument("--batch", type=int, default=50, help="adaptation batch size")
    parser.add_argument("--norms", default="batch,prior:16,ema:0.05,source")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    images, labels = images_of(args.domain, args.images)
    rows = [measure(images, labels, norm, args.batch) for norm in args.norms.split(",")]
    print("| norm | adapter, batch | adapter, one image | exported, batch | exported, one image |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['norm']} | {r['adapter_batch']} | {r['adapter_single']} | {r['exported_batch']} | "
            f"{r['exported_single']} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"domain": args.domain, "images": len(labels), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
