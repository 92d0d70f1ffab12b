"""Can a batch's class mix be read from a pass that normalises it with its own statistics?

cafa-robust's gate reads a batch's skew (class_balanced.correction_strength) from a pass
with the global statistics, which start as the source's; on a domain the source model gets
mostly wrong that pass predicts a few classes even for an i.i.d. batch (docs/design/cafa-robust.md,
Limits). This prints, for each domain folder of the bundled Fashion-MNIST
model, the mean skew and error of batches of N images under two passes, the source
statistics' and the batch's own (BN's), for an i.i.d. stream and a class-sorted one
(label shift 1.0). A pass that told the two streams apart on the hard domains would be a
gate for issue 43. The last columns are what cafa-robust's `entropy_rise` reads: the rise in
a batch's mean prediction entropy (nats) from the first pass to the second, its smallest,
median and largest over the stream's batches.

    PYTHONPATH=src python benchmarks/gate_probe.py fm/fashion-mnist-c-300 64 gaussian_blur/5 spatter/3
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from cafa_cli.api import FASHION_MNIST_CLASSES, load_model, losses

# Internal, what this probes (tests/test_api.py lists these): class-balanced's skew, and BN's
# normalisation with the batch's own statistics
from cafa_cli.engine.class_balanced import correction_strength
from cafa_cli.engine.norms import use_test_batch_norm

MEAN, STD = 0.2860, 0.3530  # fmnist-resnet's input normalisation


def images_of(folder: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The normalised images of a class-folder domain, and their labels."""
    images, labels = [], []
    for label, name in enumerate(FASHION_MNIST_CLASSES):
        for path in sorted((folder / name).glob("*.png")):
            images.append(np.asarray(Image.open(path)))
            labels.append(label)
    return (torch.from_numpy(np.stack(images)).unsqueeze(1).float() / 255 - MEAN) / STD, torch.tensor(labels)


def on_batch_statistics(net: torch.nn.Module) -> torch.nn.Module:
    """A copy that normalises every batch with its own statistics, as BN does (norms.py)."""
    net = copy.deepcopy(net)
    use_test_batch_norm(net)
    return net


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="the folder holding CORRUPTION/SEVERITY class folders")
    parser.add_argument("batch", type=int)
    parser.add_argument("domains", nargs="+", help="CORRUPTION/SEVERITY under root")
    args = parser.parse_args()
    source = load_model("fmnist-resnet").model  # the network itself, its forward returning logits alone
    passes = {"source statistics": source, "batch statistics": on_batch_statistics(source)}
    print(
        f"| domain | stream | {' | '.join(f'skew, {p} | error %, {p}' for p in passes)} | entropy rise: min | median | max |"
    )
    print("|---|---|" + "---:|" * (2 * len(passes) + 3))
    for domain in args.domains:
        images, labels = images_of(args.root / domain)
        streams = {
            "iid": np.random.default_rng(0).permutation(len(labels)),
            "sorted": np.argsort(labels.numpy(), kind="stable"),
        }
        for stream, order in streams.items():
            cells, entropies = [], []
            for net in passes.values():
                skews, errors, entropy = [], [], []
                for start in range(0, len(order) - args.batch + 1, args.batch):
                    batch = torch.from_numpy(order[start : start + args.batch])
                    with torch.no_grad():
                        logits = net(images[batch])
                    skews.append(float(correction_strength(logits.softmax(1).mean(0), args.batch)))
                    errors.append(float((logits.argmax(1) != labels[batch]).float().mean()))
                    entropy.append(float(losses.entropy(logits)))
                cells += [f"{np.mean(skews):.2f}", f"{100 * np.mean(errors):.1f}"]
                entropies.append(np.array(entropy))
            rise = entropies[1] - entropies[0]
            cells += [f"{np.min(rise):+.2f}", f"{np.median(rise):+.2f}", f"{np.max(rise):+.2f}"]
            print(f"| {domain} | {stream} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
