"""The stratified training subset the statistics are computed from, and its fingerprint."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from cafa_cli.data.domain import Domain
from cafa_cli.errors import InputError, listing


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
