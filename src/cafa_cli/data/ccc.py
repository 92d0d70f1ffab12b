"""A continuously changing corruption stream, after CCC (Press et al., "RDumb: A simple approach that
questions our progress in continual test-time adaptation", NeurIPS 2023), generated on the fly
from clean images with corrupt-tta.

As CCC: each image is corrupted by two corruptions, one applied after the other, at severities
(s1, s2); the stream walks from (s, 0) to (0, s') one severity a step, the first corruption
fading out as the second comes in, by the path whose mean source accuracy is closest to the
target; `speed` images per step, each drawn at random from the clean images; at the end of a
walk the second corruption becomes the first of the next pair, the new second drawn at random.
Where this differs from CCC (docs/guides/streams.md says it too):
- severities are corrupt-tta's whole ones, 0 to 5 (CCC: 0 to 5 in quarters, with corruption
  functions of its own that take fractional severities);
- the accuracy grid of each pair is measured on the model under test, on CALIBRATION_IMAGES of the
  clean images, when the stream first reaches the pair (CCC: a ResNet-50's, on 5,000 ImageNet
  images, published as a file);
- the walk is the best of every path through the 6 × 6 grid (CCC's recursion picks greedily);
- one list of corruptions for every target (CCC drops those that cannot reach a low target);
- no random crop and flip before the corruptions (CCC: RandomResizedCrop(224) and a flip), and
  no JPEG round trip after them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
from PIL import Image

from cafa_cli.data.domain import Domain
from cafa_cli.data.fmnist_c import BENCHMARK_CORRUPTIONS, _corruptions, _seeded_corruptions

# CCC-Easy's corruptions (its generate.py): the benchmark's 15 but brightness, which cannot hurt enough
CORRUPTIONS = tuple(name for name in BENCHMARK_CORRUPTIONS if name != "brightness")
SEVERITIES = 6  # 0 (none) to 5
CALIBRATION_IMAGES = 100


@dataclass(frozen=True)
class Step:
    """`speed` images of the stream: `first` at `severities[0]`, then `second` at `severities[1]`."""

    first: str
    second: str
    severities: tuple[int, int]

    def name(self) -> str:
        return f"{self.first}@{self.severities[0]}+{self.second}@{self.severities[1]}"


def walk(accuracy: np.ndarray, target: float) -> list[tuple[int, int]]:
    """The walk through a pair's grid of source accuracies (`accuracy[s1, s2]`): from (s, 0), s ≥ 1,
    to (0, s'), each step lowering s1 or raising s2 by one, the path whose mean accuracy is closest
    to `target` (the shortest, then the first found, on a tie)."""
    last = accuracy.shape[0] - 1
    paths: list[list[tuple[int, int]]] = []

    def extend(path):
        s1, s2 = path[-1]
        if s1 == 0:
            paths.append(path)
            return
        extend([*path, (s1 - 1, s2)])
        if s2 < last:
            extend([*path, (s1, s2 + 1)])

    for start in range(1, last + 1):
        extend([(start, 0)])
    return min(paths, key=lambda path: (abs(np.mean([accuracy[cell] for cell in path]) - target), len(path)))


def schedule(
    images: int,
    speed: int,
    target: float,
    seed: int,
    accuracy_of: Callable[[str, str], np.ndarray],
) -> list[Step]:
    """The steps of a stream of `images`: pair after pair, each walked (walk) on its grid of source
    accuracies, measured once a pair by `accuracy_of(first, second)`."""
    rng = np.random.default_rng([seed, 0])
    first, second = (str(name) for name in rng.choice(CORRUPTIONS, 2, replace=False))
    steps: list[Step] = []
    while len(steps) * speed < images:
        for cell in walk(accuracy_of(first, second), target):
            steps.append(Step(first, second, cell))
            if len(steps) * speed >= images:
                break
        first, second = second, str(rng.choice([name for name in CORRUPTIONS if name != second]))
    return steps


class _FrostImages:
    """corrupt-tta's cv2, but each frost texture read once: its frost() reads one from disk at every
    call (0.1.7), which costs more than the corruption of a small image. The textures are only read
    from (cropped, scaled into a new array), so one copy serves every call."""

    def __init__(self, cv2):
        self._cv2, self._read = cv2, {}

    def __getattr__(self, name):
        return getattr(self._cv2, name)

    def imread(self, path, *args):
        if (path, args) not in self._read:
            self._read[path, args] = self._cv2.imread(path, *args)
        return self._read[path, args]


@contextmanager
def _frost_read_once(library) -> Iterator[None]:
    module = library.corruptions
    cv2 = module.cv2
    module.cv2 = _FROST.setdefault(id(cv2), _FrostImages(cv2))
    try:
        yield
    finally:
        module.cv2 = cv2


_FROST: dict[int, _FrostImages] = {}


def corrupt(image: Image.Image, corruptions: list[tuple[str, int]], seed: int) -> Image.Image:
    """`image` through each (corruption, severity) in turn, severity 0 leaving it be; rounded to
    8 bits between them, as CCC does; a grey image stays grey (the mean of the channels, as
    Fashion-MNIST-C is built). The same image, corruptions and seed give the same bytes."""
    library = _corruptions()
    pixels = np.asarray(image.convert("RGB"))
    with _seeded_corruptions(library, seed), _frost_read_once(library), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, severity in corruptions:
            if severity:
                corrupted = np.asarray(library.corrupt(pixels, severity=severity, corruption_name=name))
                pixels = np.clip(corrupted, 0, 255).round().astype(np.uint8)
    if image.mode == "L":
        return Image.fromarray(pixels.astype(np.float64).mean(axis=2).round().astype(np.uint8))
    return Image.fromarray(pixels)


def image_seed(seed: int, k: int) -> int:
    """The corruptions' seed for image k of the stream of `seed` (NumPy's global generator takes 32 bits)."""
    return int(np.random.SeedSequence([seed, k]).generate_state(1)[0])


def calibration_images(clean: Domain, seed: int, count: int | None = None) -> list[int]:
    """The clean images each pair's grid is measured on: `count` (CALIBRATION_IMAGES) labelled ones, drawn once."""
    count = CALIBRATION_IMAGES if count is None else count
    labelled = np.flatnonzero(clean.labels >= 0)
    rng = np.random.default_rng([seed, 1])
    return sorted(rng.choice(labelled, min(count, len(labelled)), replace=False).tolist())


def corrupted_domain(clean: Domain, positions: list[int], corruptions: list[tuple[str, int]], seed: int) -> Domain:
    """The images at `positions` of `clean`, each corrupted alike, as a domain of their own (a cell
    of a pair's grid, measured by the source model)."""
    images = [corrupt(clean.read(k), corruptions, image_seed(seed, k)) for k in positions]
    return Domain(
        f"{clean.name} {'+'.join(f'{name}@{s}' for name, s in corruptions)}",
        [clean.refs[k] for k in positions],
        clean.labels[positions],
        clean.class_names,
        lambda i: images[i],
    )


def ccc_domain(
    clean: Domain,
    images: int,
    speed: int,
    target: float,
    seed: int,
    accuracy: Callable[[Domain], float],
    calibration: int | None = None,
    grids: dict[tuple[str, str], np.ndarray] | None = None,
) -> Domain:
    """The CCC stream of `images` images from the labelled images of `clean`, at `speed` images a
    step, its walks keeping the source accuracy (`accuracy` of a domain, a fraction) near `target`
    (a fraction). Image k is drawn and corrupted from the seed and k alone: the stream is the same
    for a seed, read in any order, by any process. Streamed in its own order (Domain.ordered).
    `grids` keeps each pair's grid once measured, for the next stream of the same model, images and
    seed (a bench's rows)."""
    probe = calibration_images(clean, seed, calibration)
    grids = {} if grids is None else grids

    def accuracy_of(first: str, second: str) -> np.ndarray:
        if (first, second) not in grids:
            grid = np.zeros((SEVERITIES, SEVERITIES))
            for s1 in range(SEVERITIES):
                for s2 in range(SEVERITIES):
                    grid[s1, s2] = accuracy(corrupted_domain(clean, probe, [(first, s1), (second, s2)], seed))
            grids[first, second] = grid
        return grids[first, second]

    steps = schedule(images, speed, target, seed, accuracy_of)
    labelled = np.flatnonzero(clean.labels >= 0)
    drawn = labelled[np.random.default_rng([seed, 2]).integers(0, len(labelled), images)]

    def read(k: int) -> Image.Image:
        step = steps[k // speed]
        image = clean.read(int(drawn[k]))
        return corrupt(
            image, [(step.first, step.severities[0]), (step.second, step.severities[1])], image_seed(seed, k)
        )

    return Domain(
        f"ccc {clean.name}",
        [f"{steps[k // speed].name()}/{k}/{clean.refs[j]}" for k, j in enumerate(drawn)],
        clean.labels[drawn],
        clean.class_names,
        read,
        indexed_labels=clean.indexed_labels,
        ordered=True,
    )
