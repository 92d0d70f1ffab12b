"""Images from outside the label set in a test stream (`outliers`), the open-world protocol of
OWTTT (Li et al., ICCV 2023), SoTTA (Gong et al., NeurIPS 2023) and STAMP (Yu et al., ECCV 2024).

A share s of the stream's images are outliers: beside a domain's n images, round(n·s / (1 − s))
outliers, so s = 0.2 is STAMP's 2,500 outliers beside CIFAR-C's 10,000 images and s = 0.5 is
SoTTA's and OWTTT's one outlier for each image. They are drawn without replacement from the
source (a folder, an array, a training set: any data cafa reads; their labels are not read),
or generated: `noise:gaussian` and `noise:uniform`, each pixel clip(N(0.5, 1), 0, 1)·255 or
U[0, 1)·255, as STAMP's data/Gaussian.py makes them. Each is resized to the size of the
domain's images, as STAMP resizes its outlier sets, then read as the domain's images are.

They take uniformly random places in the stream, and the domain's images keep their order
(`order`): a run with outliers streams the same images in the same order as one without,
outliers between them. Places and images are drawn from their own generator, seeded by
`seed` alone, so one seed gives one stream, and every domain of a run the same draw.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
from PIL import Image

from cafa_cli.data.domain import UNLABELLED, UNREADABLE, Domain

OUTLIER_DRAWS = 0x0171E4  # mixed into `seed`: the outliers' draws never follow the order's


@dataclass(frozen=True)
class Outliers:
    """What `outliers` mixes into each stream: `share` of its images, from `source` (None: `noise`
    generated, gaussian or uniform)."""

    name: str  # as given: the path, or noise:KIND
    share: float
    source: Domain | None = None
    noise: str | None = None

    def count(self, images: int) -> int:
        """How many outliers go beside a domain of `images` images."""
        return round(images * self.share / (1 - self.share))

    def drawn(self, count: int, rng: np.random.Generator) -> tuple[list[str], Callable[[int, tuple, str], Image.Image]]:
        """`count` outliers: their names, and a reader of the j-th at a size and mode."""
        if self.source is None:
            seeds = rng.integers(2**63, size=count)
            return [f"{self.name}#{j}" for j in range(count)], lambda j, size, mode: _noise(
                self.noise, int(seeds[j]), size, mode
            )
        source = self.source
        picks = rng.choice(len(source), count, replace=False)
        return [source.refs[i] for i in picks], lambda j, size, mode: source.read(int(picks[j])).resize(
            size, Image.BILINEAR
        )


def with_outliers(
    domain: Domain, positions: np.ndarray, outliers: Outliers, count: int, seed: int, channels: int
) -> tuple[Domain, np.ndarray]:
    """`domain` with `count` outliers after its own images (unlabelled), and the stream order:
    `positions` (the domain's own order) with the outliers at random places among them.
    `channels`: of the images the model takes, which generated noise is made in."""
    if not count:
        return domain, positions
    rng = np.random.default_rng([seed, OUTLIER_DRAWS])
    refs, read_outlier = outliers.drawn(count, rng)
    places = np.zeros(len(positions) + count, dtype=bool)
    places[rng.choice(len(places), count, replace=False)] = True
    order = np.empty(len(places), dtype=np.int64)
    order[~places], order[places] = positions, len(domain) + np.arange(count)
    size, mode = _image_size(domain), "L" if channels == 1 else "RGB"
    own = len(domain)

    def read(i: int) -> Image.Image:
        return domain.read(i) if i < own else read_outlier(i - own, size, mode)

    mixed = replace(
        domain,
        refs=[*domain.refs, *refs],
        labels=np.concatenate([domain.labels, np.full(count, UNLABELLED, dtype=np.int64)]),
        read=read,
    )
    return mixed, order


def _image_size(domain: Domain) -> tuple[int, int]:
    """(width, height) of the domain's first readable image (of its first eight), else 224 x 224."""
    for i in range(min(len(domain), 8)):
        try:
            return domain.read(i).size
        except UNREADABLE:
            continue
    return 224, 224


def _noise(kind: str, seed: int, size: tuple[int, int], mode: str) -> Image.Image:
    rng = np.random.default_rng(seed)
    shape = (size[1], size[0]) if mode == "L" else (size[1], size[0], 3)
    values = np.clip(rng.standard_normal(shape) + 0.5, 0, 1) if kind == "gaussian" else rng.random(shape)
    return Image.fromarray((values * 255).astype(np.uint8))
