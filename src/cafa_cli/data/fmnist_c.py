"""Fashion-MNIST-C: Fashion-MNIST test images corrupted with corrupt-tta, written as
PNG ImageFolders in the ImageNet-C layout (`<corruption>/<severity>/<class>/*.png`).

Corruptions come from the maintained `corrupt-tta` package (the ImageNet-C
corruptions, offline). Its severities are calibrated for 224-px images; see
docs/results/setup.md for which severity gives a meaningful benchmark at 28 px.
"""

from __future__ import annotations

import shutil
import warnings
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from PIL import Image

from cafa_cli.core.errors import UsageError, repeated
from cafa_cli.core.files import make_workdir
from cafa_cli.data.fashion_mnist import FASHION_MNIST_CLASSES, load_fashion_mnist

# The 15 corruptions of the ImageNet-C benchmark, and the 4 held out for choosing
# hyper-parameters (never reported).
BENCHMARK_CORRUPTIONS = (
    "gaussian_noise",
    "shot_noise",
    "impulse_noise",
    "defocus_blur",
    "glass_blur",
    "motion_blur",
    "zoom_blur",
    "snow",
    "frost",
    "fog",
    "brightness",
    "contrast",
    "elastic_transform",
    "pixelate",
    "jpeg_compression",
)


HELD_OUT_CORRUPTIONS = ("speckle_noise", "gaussian_blur", "spatter", "saturate")


COMPLETE = ".complete"  # written last: a folder without it is rebuilt


def _corruptions():
    try:
        import corrupt_tta
    except ImportError:
        raise UsageError("the demo needs corrupt-tta: pip install 'cafa-cli[demo]' (or: make demo)") from None
    return corrupt_tta


def check_corruptions(corruptions: list[str], severity: int, per_class: int | None = None) -> None:
    """Names, severity and images per class checked before any image is built."""
    library = _corruptions()
    unknown = [c for c in corruptions if c not in library.corruption_dict]
    if unknown:
        raise UsageError(f"unknown corruption {unknown[0]!r}; choose from {', '.join(library.corruption_dict)}")
    if not corruptions:
        raise UsageError("`corruptions` names no corruption")
    twice = repeated(corruptions)
    if twice:
        raise UsageError(f"`corruptions` names {twice[0]} twice; give each once")
    if severity not in range(1, 6):
        raise UsageError(f"`severity` must be 1-5, not {severity}")
    if per_class is not None and per_class < 1:
        raise UsageError(f"`test_per_class` must be 0 (all) or more, not {per_class}")


# Where corrupt-tta (0.1.7, corruptions.py) draws its random numbers; its API takes no generator:
# - NumPy's global RandomState (np.random.normal, poisson, randint, uniform): gaussian_noise,
#   shot_noise, speckle_noise, glass_blur, motion_blur, snow, frost, fog, spatter, elastic_transform.
# - scikit-image's random_noise(..., rng=None), that is a fresh np.random.default_rng() seeded from
#   the OS on every call, so no global seed reaches it: impulse_noise.
# - nowhere: defocus_blur, gaussian_blur, zoom_blur, contrast, brightness, saturate, jpeg_compression,
#   pixelate. None uses Python's `random` or OpenCV's generator.
@contextmanager
def _seeded_corruptions(library, seed: int) -> Iterator[None]:
    """Every draw of the block's corruptions from generators seeded with `seed`, one stream per domain.

    NumPy's global RandomState is seeded, and restored afterwards; corrupt-tta's module-level
    `random_noise` (impulse_noise's) is swapped, for the block, for one given an explicit
    `np.random.default_rng(seed)`. Both are process-wide: the data is built in one thread.
    """
    module = library.corruptions
    unseeded = getattr(module, "random_noise", None)
    if unseeded is None:  # a corrupt-tta whose impulse_noise no longer goes through this name
        raise RuntimeError(f"corrupt-tta {library.__version__}: cannot seed impulse_noise (no random_noise)")
    generator = np.random.default_rng(seed)

    def random_noise(image, *args, **kwargs):
        return unseeded(image, *args, **{**kwargs, "rng": generator})

    state = np.random.get_state()
    np.random.seed(seed)  # as before this change: the same bytes for the global-RandomState corruptions
    module.random_noise = random_noise
    try:
        yield
    finally:
        module.random_noise = unseeded
        np.random.set_state(state)


def corrupt_grey(images: np.ndarray, corruption: str, severity: int, seed: int) -> np.ndarray:
    """Corrupt 28x28 grey uint8 images (as grey RGB, the library's input) back to grey uint8.

    The same images, corruption, severity and seed give the same bytes (_seeded_corruptions).
    """
    check_corruptions([corruption], severity)
    library = _corruptions()
    out = np.empty_like(images)
    with _seeded_corruptions(library, seed), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, image in enumerate(images):
            rgb = np.repeat(image[..., None], 3, axis=2)
            corrupted = np.asarray(
                library.corrupt(rgb, severity=severity, corruption_name=corruption), dtype=np.float64
            )
            out[i] = np.clip(corrupted.mean(axis=2), 0, 255).round().astype(np.uint8)
    return out


def corrupted_as_built(images: np.ndarray, corruption: str, severity: int, seed: int = 0) -> np.ndarray:
    """The bytes build_corrupted writes for this corruption of these images: each corruption
    draws from its own seed, derived from the builder's and its name."""
    return corrupt_grey(images, corruption, severity, (seed + zlib.crc32(corruption.encode())) % 2**32)


def write_image_folder(folder: Path, images: np.ndarray, labels: np.ndarray) -> Path:
    """PNG files under folder/<class name>/, written to a temporary folder then renamed."""
    if (folder / COMPLETE).is_file():
        return folder
    staging = folder.with_name(folder.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        for name in FASHION_MNIST_CLASSES:
            (staging / name).mkdir(parents=True)
        for i, (image, label) in enumerate(zip(images, labels)):
            Image.fromarray(image).save(staging / FASHION_MNIST_CLASSES[label] / f"{i:05d}.png")
        (staging / COMPLETE).write_text("")
    except BaseException:  # Ctrl-C, a full disk: leave no half folder for a glob to pick up as a domain
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    return folder


def stratified_rows(labels: np.ndarray, per_class: int | None, seed: int) -> np.ndarray:
    """The first `per_class` rows of each class in a seeded shuffle (all rows if None)."""
    if per_class is None:
        return np.arange(len(labels))
    order = np.random.default_rng(seed).permutation(len(labels))
    chosen = np.concatenate([order[labels[order] == c][:per_class] for c in range(len(FASHION_MNIST_CLASSES))])
    return np.sort(chosen)


def build_training_subset(workdir: Path, per_class: int, seed: int = 0, root=None) -> Path:
    folder = make_workdir(workdir) / f"train-{per_class}"
    if (folder / COMPLETE).is_file():
        return folder
    images, labels = load_fashion_mnist(root, "train")
    rows = stratified_rows(labels, per_class, seed)
    return write_image_folder(folder, images[rows], labels[rows])


def build_corrupted(
    workdir: Path,
    corruptions: list[str],
    severity: int,
    per_class: int | None = None,
    seed: int = 0,
    root=None,
    on_domain=None,
) -> list[Path]:
    """One ImageFolder per corruption at `severity`; re-uses folders already complete."""
    check_corruptions(corruptions, severity, per_class)
    base = make_workdir(workdir) / ("fashion-mnist-c" if per_class is None else f"fashion-mnist-c-{per_class}")
    folders = []
    images = labels = None
    for corruption in corruptions:
        folder = base / corruption / str(severity)
        if not (folder / COMPLETE).is_file():
            if images is None:
                all_images, all_labels = load_fashion_mnist(root, "test")
                rows = stratified_rows(all_labels, per_class, seed)
                images, labels = all_images[rows], all_labels[rows]
            if on_domain:
                on_domain(corruption)
            write_image_folder(
                folder,
                corrupted_as_built(images, corruption, severity, seed),
                labels,
            )
        folders.append(folder)
    return folders
