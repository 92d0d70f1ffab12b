"""The stratified training subset the statistics are computed from, and its fingerprints:
which images it holds, and the files they were read from as they were then."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from cafa_cli.core.errors import InputError, listing
from cafa_cli.data.domain import Domain
from cafa_cli.data.fashion_mnist import SPLIT_PREFIXES, find_idx_file, resolve_root


def stratified_subset(
    labels: np.ndarray,
    class_names: Sequence[str],
    fraction: float | None = None,
    per_class: int | None = None,
    seed: int = 0,
) -> np.ndarray:
    """Indices of a per-class random subset: round(fraction·N_c) or min(per_class, N_c).

    Reproducible: the same seed gives the same subset, whatever else the folder holds.
    """
    counts = np.bincount(labels[labels >= 0], minlength=len(class_names))
    empty = [name for c, name in enumerate(class_names) if counts[c] == 0]
    if empty:
        # a larger fraction of nothing is nothing: the images themselves are missing
        noun = "class" if len(empty) == 1 else "classes"
        raise InputError(
            f"no images of {noun} {listing(empty)} in the data, and statistics need every class; "
            f"give each its folder of images (e.g. {empty[0]}/ in the `data` folder)"
        )
    generator = np.random.default_rng(seed)
    chosen: list[np.ndarray] = []
    too_few: list[str] = []
    for c, name in enumerate(class_names):
        members = np.flatnonzero(labels == c)
        take = min(per_class, len(members)) if per_class is not None else int(round(fraction * len(members)))
        if take < 2:
            too_few.append(f"{name} ({take} of {len(members)})")
            continue
        chosen.append(np.sort(generator.choice(members, size=take, replace=False)))
    if too_few:
        shown = listing(too_few)
        raise InputError(
            f"classes with fewer than 2 selected images: {shown}; raise `fraction`/`per_class` or add images"
        )
    return np.sort(np.concatenate(chosen))


def subset_sha256(domain: Domain, indices: np.ndarray) -> str:
    """Which images a subset holds, wherever the data lies: each one's path below the
    domain (a row for arrays) and its class index, so two artifacts can be checked to
    come from the same sample."""
    digest = hashlib.sha256()
    for i in indices:
        ref = domain.refs[i]
        below = ref[len(domain.name) :].lstrip("/") if ref.startswith(domain.name) else ref
        digest.update(f"{below}\t{domain.labels[i]}\n".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()


# The files of the training sets that hold their images as arrays, by the name their Domain
# takes (data/arrays.py): CIFAR's python batches and meta file in ROOT/FOLDER (or ROOT).
_CIFAR_FILES = {
    "cifar-10-batches-py": [*(f"data_batch_{b}" for b in range(1, 6)), "batches.meta"],
    "cifar-10-batches-py/test_batch": ["test_batch", "batches.meta"],
    "cifar-100-python": ["train", "meta"],
    "cifar-100-python/test": ["test", "meta"],
}


def source_files(domain: Domain, indices: np.ndarray, data: str) -> list[str] | None:
    """The files a subset's pixels are read from: each image's own file, or for images from
    arrays (a .npy, CIFAR's python batches, Fashion-MNIST's idx files) the files of the
    array, once. `data` is the `data` value the domain was opened from. None for arrays of
    a kind whose files are not known here (nothing can then tell whether they changed)."""
    if not len(indices):
        return []
    if not _is_row(domain, domain.refs[int(indices[0])]):
        return [domain.refs[int(i)] for i in indices]
    if os.path.isfile(domain.name):  # a .npy array (a plain one, or a corruption of CIFAR-10-C)
        return [domain.name]
    root = data.partition(":")[2]
    if domain.name in _CIFAR_FILES and root:
        folder = Path(root) / domain.name.partition("/")[0]
        base = folder if folder.is_dir() else Path(root)
        return [str(base / name) for name in _CIFAR_FILES[domain.name]]
    split = domain.name.removeprefix("fashion-mnist-")
    if domain.name.startswith("fashion-mnist-") and split in SPLIT_PREFIXES:
        folder, prefix = resolve_root(root or None), SPLIT_PREFIXES[split]
        return [str(find_idx_file(folder, f"{prefix}-{what}-idx{dims}-ubyte")) for what, dims in _IDX_FILES]
    return None


_IDX_FILES = (("images", 3), ("labels", 1))  # Fashion-MNIST's two files of a split


def _is_row(domain: Domain, ref: str) -> bool:
    """Whether `ref` names a row of an array (`NAME#ROW`), not an image file."""
    return ref.startswith(f"{domain.name}#") and ref[len(domain.name) + 1 :].isdigit()


def file_stamps(paths: Sequence[str] | None) -> str | None:
    """What an artifact's statistics were made from, as cheaply as it can be told whether
    it changed since: the SHA-256 of one UTF-8 line `PATH\\tSIZE\\tMTIME_NS\\n` a file, in
    order, PATH absolute and the size and modification time (nanoseconds) those of what
    it names (through links); a file that cannot be looked at is `PATH\\t-\\t-`. One stat a
    file, nothing read: an edit in place changes the time (and mostly the size), while
    hashing the bytes would read every image again (ImageNet's sample: gigabytes). A file
    rewritten with its size kept and its time set back is not noticed. None for None."""
    if paths is None:
        return None
    digest = hashlib.sha256()
    for path in paths:
        try:
            found = os.stat(path)
            size, mtime = str(found.st_size), str(found.st_mtime_ns)
        except OSError:
            size = mtime = "-"
        digest.update(f"{os.path.abspath(path)}\t{size}\t{mtime}\n".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()
