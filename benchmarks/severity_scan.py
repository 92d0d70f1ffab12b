"""Source (and BN) error of the bundled fmnist-resnet per corruption and severity.

Used to choose which severity makes a meaningful Fashion-MNIST-C benchmark: Source
clearly hurt but not at chance (90% error). Prints a markdown table.

    python benchmarks/severity_scan.py --images 2000
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from cafa_cli.api import Adapter, create, load_fashion_mnist, load_model

# Internal, what this studies (tests/test_api.py lists it): how `cafa demo` corrupts Fashion-MNIST
from cafa_cli.data.fmnist_c import BENCHMARK_CORRUPTIONS, HELD_OUT_CORRUPTIONS, corrupt_grey, stratified_rows

MEAN, STD = 0.2860, 0.3530  # fmnist-resnet's input normalisation


def error(method: str, images: np.ndarray, labels: np.ndarray, batch: int = 200) -> float:
    adapter = Adapter(load_model("fmnist-resnet"), create(method))
    x = (torch.from_numpy(images).float().div(255).unsqueeze(1) - MEAN) / STD
    order = np.random.default_rng(0).permutation(len(x))
    wrong = 0
    for idx in np.array_split(order, max(1, len(x) // batch)):
        wrong += (adapter.step(x[idx]).argmax(1).numpy() != labels[idx]).sum()
    return 100 * wrong / len(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--images", type=int, default=2000, help="test images (stratified)")
    args = parser.parse_args()
    images, labels = load_fashion_mnist(None, "test")
    rows = stratified_rows(labels, args.images // 10, 0)
    images, labels = images[rows], labels[rows]
    print(f"clean: source {error('source', images, labels):.1f}, bn {error('bn', images, labels):.1f}")
    print("| corruption | " + " | ".join(f"s{s} source / bn" for s in range(1, 6)) + " |")
    print("|---|" + "---:|" * 5)
    means = np.zeros((5, 2))
    for name in BENCHMARK_CORRUPTIONS + HELD_OUT_CORRUPTIONS:
        cells = []
        for severity in range(1, 6):
            corrupted = corrupt_grey(images, name, severity, seed=severity)
            pair = (error("source", corrupted, labels), error("bn", corrupted, labels))
            if name in BENCHMARK_CORRUPTIONS:
                means[severity - 1] += np.array(pair) / len(BENCHMARK_CORRUPTIONS)
            cells.append(f"{pair[0]:.1f} / {pair[1]:.1f}")
        print(
            f"| {name}{' (held out)' if name in HELD_OUT_CORRUPTIONS else ''} | " + " | ".join(cells) + " |", flush=True
        )
    print("| **mean of the 15** | " + " | ".join(f"{s:.1f} / {b:.1f}" for s, b in means) + " |")


if __name__ == "__main__":
    main()
