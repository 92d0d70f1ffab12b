"""One sha256 of every method's predictions, and of a few settings, on a fixed stream of real
images, through the Python API: what a refactor must leave byte-identical, compared between two
checkouts on one machine (checksums.sh compares against sums made on another machine, and its
CSV sums depend on the CPU's kernels). A few minutes on 2 cores.

    cafa demo --data-only --workdir fm --test-per-class 30 --corruptions fog,contrast  # once
    PYTHONPATH=OLD/src python benchmarks/api_checksums.py fm/fashion-mnist-c-30 > old.txt
    PYTHONPATH=NEW/src python benchmarks/api_checksums.py fm/fashion-mnist-c-30 > new.txt
    diff old.txt new.txt                                              # the rows that moved

The statistics are estimated from the stream's first 200 images, labelled by the model's
predictions: no training set is needed, and both checkouts see the same numbers. One thread,
so that the sums do not depend on how torch splits its reductions. It imports cafa through
cafa_cli.api alone, which the refactors keep; a checkout from before it (issue 61) runs its own copy.
"""

from __future__ import annotations

import copy
import hashlib
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from cafa_cli.api import REGISTRY, Adapter, ClassMoments, create, estimate, load_model

MEAN, STD = 0.2860, 0.3530  # fmnist-resnet's input normalisation
OPTIONS = {  # smaller banks and fewer views than the recipes': the same code paths, faster
    "cotta": {"augmentations": 4},
    "rotta": {"memory_size": 16, "update_every": 16},
    "cafa-robust": {"memory_size": 16, "update_every": 16},
    "memo": {"copies": 4},
    "ttaug": {"copies": 4},
}
SETTINGS = [
    ("tent", {"norm": "ema:0.05"}),
    ("tent", {"norm": "prior:16"}),
    ("tent", {"norm": "alpha:0.1"}),
    ("bn", {"norm": "prior:16"}),
    ("tent", {"norm": "unmix:4"}),
    ("sar", {"norm": "ema:0.05"}),
    ("tent", {"params": "all", "steps": 2}),
    ("cafa", {"optimizer": "sgd", "lr": 0.01}),
]


def stream(root: Path) -> torch.Tensor:
    """400 images of fog and contrast at severity 3, shuffled (seed 0), normalised."""
    folders = [sorted((root / name / "3").rglob("*.png")) for name in ("fog", "contrast")]
    pixels = np.stack([np.asarray(Image.open(file)) for files in folders for file in files]).astype(np.float32)
    images = torch.tensor(pixels / 255)[:, None]
    images = images[torch.randperm(len(images), generator=torch.Generator().manual_seed(0))][:400]
    return (images - MEAN) / STD


def main(root: str) -> None:
    torch.set_num_threads(1)
    images = stream(Path(root))
    model = load_model("fmnist-resnet")
    with torch.no_grad():
        logits, features = model(images[:200])
    moments = ClassMoments(10, model.feature_dim)
    moments.update(features, logits.argmax(1))
    gaussians = estimate(moments, "full", "auto")
    for name, settings in [(name, {}) for name in REGISTRY] + SETTINGS:
        torch.manual_seed(0)
        method = create(name, gaussians, "cpu", **OPTIONS.get(name, {}))  # ignored by those that need none
        adapter = Adapter(copy.deepcopy(model), method, "cpu", **{"lr": 1e-3, **settings})
        predicted = torch.cat([adapter.step(batch) for batch in images.split(50)])
        print(name, settings, hashlib.sha256(predicted.numpy().tobytes()).hexdigest()[:16], flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cafa-demo/fashion-mnist-c-30")
