"""Read the Fashion-MNIST idx files from disk with numpy alone.

The demo and the bundled model's training use the copy shipped by the Debian
package `dataset-fashion-mnist`, so nothing is ever downloaded.
"""

from __future__ import annotations

import gzip
import math
import os
import zlib
from pathlib import Path

import numpy as np

from cafa_cli.core.errors import InputError
from cafa_cli.core.files import reading

DEFAULT_ROOT = Path("/usr/share/datasets/fashion-mnist")


ROOT_ENV_VAR = "CAFA_FASHION_MNIST"


# Label order of the original data set; names are safe to use as folder names.
FASHION_MNIST_CLASSES = (
    "tshirt_top",
    "trouser",
    "pullover",
    "dress",
    "coat",
    "sandal",
    "shirt",
    "sneaker",
    "bag",
    "ankle_boot",
)
"""Fashion-MNIST's ten class names, in the order of its labels (and of `fmnist-resnet`'s outputs)."""


SPLIT_PREFIXES = {"train": "train", "test": "t10k"}


# Pixel mean and std of the 60,000 training images on the [0,1] scale (0.28604, 0.35302),
# for Normalize after ToTensor.
FASHION_MNIST_MEAN = 0.2860


FASHION_MNIST_STD = 0.3530


IMAGE_MAGIC = 0x00000803  # unsigned bytes, 3 dimensions


LABEL_MAGIC = 0x00000801  # unsigned bytes, 1 dimension


IMAGE_SIDE = 28


# Images (or labels) one file may announce: Fashion-MNIST's train split has 60,000, and EMNIST
# digits in the same format 240,000. The header is read first, and a count of billions (a
# 20-byte file, or a small gzip of zeros) is refused before anything is allocated for it.
MAX_ITEMS = 1_000_000


ALL_FILE_NAMES = tuple(
    f"{prefix}-{kind}-idx{dims}-ubyte.gz"
    for prefix in SPLIT_PREFIXES.values()
    for kind, dims in (("images", 3), ("labels", 1))
)


def load_fashion_mnist(root: str | Path | None = None, split: str = "train") -> tuple[np.ndarray, np.ndarray]:
    """Return (images uint8 [N,28,28], labels int64 [N]) of one split.

    `root` wins over the CAFA_FASHION_MNIST variable, which wins over the Debian
    location.
    """
    if split not in SPLIT_PREFIXES:
        raise InputError(f"Fashion-MNIST split must be 'train' or 'test', not {split!r}")
    folder = resolve_root(root)
    prefix = SPLIT_PREFIXES[split]
    images_path = find_idx_file(folder, f"{prefix}-images-idx3-ubyte")
    labels_path = find_idx_file(folder, f"{prefix}-labels-idx1-ubyte")
    images = read_images(images_path)
    labels = read_labels(labels_path)
    if len(images) != len(labels):
        raise InputError(
            f"Fashion-MNIST {split} files in {folder} disagree: {len(images)} images but "
            f"{len(labels)} labels; reinstall dataset-fashion-mnist"
        )
    return images, labels


def check_installed(root: str | Path | None = None) -> None:
    """Fail now, before any work, when a split's files are missing."""
    folder = resolve_root(root)
    for prefix in SPLIT_PREFIXES.values():
        for kind, dims in (("images", 3), ("labels", 1)):
            find_idx_file(folder, f"{prefix}-{kind}-idx{dims}-ubyte")


def resolve_root(root: str | Path | None) -> Path:
    if root is not None:
        return Path(root).expanduser()
    from_env = os.environ.get(ROOT_ENV_VAR)
    if from_env:
        return Path(from_env).expanduser()
    return DEFAULT_ROOT


def find_idx_file(folder: Path, stem: str) -> Path:
    """Prefer the gzipped file (what Debian ships), fall back to an unpacked one."""
    for candidate in (folder / f"{stem}.gz", folder / stem):
        if candidate.is_file():
            return candidate
    raise InputError(
        f"Fashion-MNIST not found in {folder} (no {stem}.gz): install the Debian package "
        f"(apt-get install dataset-fashion-mnist) or put {', '.join(ALL_FILE_NAMES)} "
        f"in that folder (or set {ROOT_ENV_VAR})"
    )


def read_images(path: Path) -> np.ndarray:
    return read_idx(path, IMAGE_MAGIC, dims=3)


def read_labels(path: Path) -> np.ndarray:
    labels = read_idx(path, LABEL_MAGIC, dims=1).astype(np.int64)
    if labels.size and labels.max() >= len(FASHION_MNIST_CLASSES):
        raise malformed(path, f"label {labels.max()} is out of range 0-9")
    return labels


def read_idx(path: Path, magic: int, dims: int) -> np.ndarray:
    """An idx file's array, uint8. The header is read and checked first (magic number, image
    size, at most MAX_ITEMS items); then exactly what it announces, plus one byte to notice
    excess, and never the rest: a gzip of zeros expands a thousandfold, so a few MB on disk
    would be GBs in memory."""
    reading(path, "a data set")
    try:
        with gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb") as stream:
            header = _read_at_most(stream, 4 + 4 * dims)
            sizes = _check_header(header, path, magic, dims)
            expected = math.prod(sizes)
            data = _read_at_most(stream, expected + 1)
    except (OSError, EOFError, zlib.error) as error:  # gzip.BadGzipFile is an OSError
        raise InputError(
            f"cannot read Fashion-MNIST file {path} ({error}); reinstall dataset-fashion-mnist or replace the file"
        ) from None
    if len(data) > expected:
        raise malformed(path, f"more data bytes than the {expected} the header announces")
    if len(data) != expected:
        raise malformed(path, f"{len(data)} data bytes, the header announces {expected}")
    return data.reshape(sizes)


def _check_header(header: np.ndarray, path: Path, magic: int, dims: int) -> tuple[int, ...]:
    """The dimension sizes of a big-endian idx header, checked."""
    if len(header) < 4 + 4 * dims:
        raise malformed(path, f"only {len(header)} bytes, shorter than the idx header")
    fields = header.view(">u4")
    if int(fields[0]) != magic:
        raise malformed(path, f"magic number 0x{int(fields[0]):08x}, expected 0x{magic:08x}")
    sizes = tuple(int(size) for size in fields[1:])
    if dims == 3 and sizes[1:] != (IMAGE_SIDE, IMAGE_SIDE):  # width x height, as image sizes are given everywhere
        raise malformed(path, f"images are {sizes[2]}x{sizes[1]}, expected {IMAGE_SIDE}x{IMAGE_SIDE}")
    if sizes[0] > MAX_ITEMS:
        raise malformed(
            path, f"the header announces {sizes[0]:,} items, more than the {MAX_ITEMS:,} cafa reads from one file"
        )
    return sizes


def _read_at_most(stream, limit: int) -> np.ndarray:
    """Up to `limit` bytes of a stream, in blocks: memory is only ever filled with bytes the
    file really holds (np.empty reserves the rest without touching it)."""
    buffer = np.empty(limit, dtype=np.uint8)
    view, filled = memoryview(buffer), 0
    while filled < limit:
        read = stream.readinto(view[filled : min(limit, filled + (1 << 20))])
        if not read:
            break
        filled += read
    return buffer[:filled]


def malformed(path: Path, detail: str) -> InputError:
    return InputError(
        f"Fashion-MNIST file {path} is malformed: {detail}; reinstall dataset-fashion-mnist or replace the file"
    )
