"""Read the Fashion-MNIST idx files from disk with numpy alone.

The demo and the bundled model's training use the copy shipped by the Debian
package `dataset-fashion-mnist`, so nothing is ever downloaded.
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path
import numpy as np
from cafa_cli.errors import InputError


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


SPLIT_PREFIXES = {"train": "train", "test": "t10k"}


# Pixel mean and std of the 60,000 training images on the [0,1] scale (0.28604, 0.35302),
# for Normalize after ToTensor.
FASHION_MNIST_MEAN = 0.2860


FASHION_MNIST_STD = 0.3530


IMAGE_MAGIC = 0x00000803  # unsigned bytes, 3 dimensions


LABEL_MAGIC = 0x00000801  # unsigned bytes, 1 dimension


IMAGE_SIDE = 28


ALL_FILE_NAMES = tuple(
    f"{prefix}-{kind}-idx{dims}-ubyte.gz"
    for prefix in SPLIT_PREFIXES.values()
    for kind, dims in (("images", 3), ("labels", 1))
)


def load_fashion_mnist(
    root: str | Path | None = None, split: str = "train"
) -> tuple[np.ndarray, np.ndarray]:
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
    images = parse_images(read_bytes(images_path), images_path)
    labels = parse_labels(read_bytes(labels_path), labels_path)
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


def read_bytes(path: Path) -> bytes:
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as stream:
                return stream.read()
        return path.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile) as error:
        raise InputError(
            f"cannot read Fashion-MNIST file {path} ({error}); reinstall dataset-fashion-mnist "
            f"or replace the file"
        ) from None


def parse_images(data: bytes, path: Path) -> np.ndarray:
    count, rows, cols = parse_header(data, path, IMAGE_MAGIC, dims=3)
    if (rows, cols) != (IMAGE_SIDE, IMAGE_SIDE):
        raise malformed(path, f"images are {rows}x{cols}, expected {IMAGE_SIDE}x{IMAGE_SIDE}")
    pixels = payload(data, path, header_size=16, expected=count * rows * cols)
    return pixels.reshape(count, rows, cols)


def parse_labels(data: bytes, path: Path) -> np.ndarray:
    (count,) = parse_header(data, path, LABEL_MAGIC, dims=1)
    labels = payload(data, path, header_size=8, expected=count).astype(np.int64)
    if labels.size and labels.max() >= len(FASHION_MNIST_CLASSES):
        raise malformed(path, f"label {labels.max()} is out of range 0-9")
    return labels


def parse_header(data: bytes, path: Path, magic: int, dims: int) -> tuple[int, ...]:
    """Check the big-endian magic number and return the dimension sizes."""
    header_size = 4 + 4 * dims
    if len(data) < header_size:
        raise malformed(path, f"only {len(data)} bytes, shorter than the idx header")
    fields = np.frombuffer(data, dtype=">u4", count=1 + dims)
    if int(fields[0]) != magic:
        raise malformed(path, f"magic number 0x{int(fields[0]):08x}, expected 0x{magic:08x}")
    return tuple(int(size) for size in fields[1:])


def payload(data: bytes, path: Path, header_size: int, expected: int) -> np.ndarray:
    actual = len(data) - header_size
    if actual != expected:
        raise malformed(path, f"{actual} data bytes, the header announces {expected}")
    # Copy so callers get a writable array that does not pin the whole file buffer.
    return np.frombuffer(data, dtype=np.uint8, offset=header_size).copy()


def malformed(path: Path, detail: str) -> InputError:
    return InputError(
        f"Fashion-MNIST file {path} is malformed: {detail}; reinstall dataset-fashion-mnist "
        f"or replace the file"
    )
