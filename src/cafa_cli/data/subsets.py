"""Subsets of a data set: the classes a run predicts among (`class_subset`: ImageNet-R's and
ImageNet-A's 200 of ImageNet's 1,000), and the images it keeps (`subset`: RobustBench's
5,000-image ImageNet-C protocol, a list of image ids)."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from cafa_cli.core.errors import InputError, UsageError, listing
from cafa_cli.core.files import read_small_text
from cafa_cli.data.domain import UNLABELLED, Domain, did_you_mean, read_class_list

# The most a `subset` list may hold: all 50,000 of ImageNet's validation images as
# n01440764/ILSVRC2012_val_00000293.JPEG lines are 2.4 MB (RobustBench's 5,000: 240 KB); a file
# over 16 MiB is no such list (a link to /dev/zero, a sparse file) and is refused unread.
SUBSET_LIMIT = 16 << 20


@dataclass(frozen=True)
class ClassSubset:
    """The classes a run predicts among: `names[i]` is model output `outputs[i]`, in the
    model's output order; `model_classes` are the names of all its outputs."""

    names: list[str]
    outputs: list[int]
    model_classes: list[str]


def read_class_subset(path: str, model_classes: list[str], within: ClassSubset | None = None) -> ClassSubset:
    """The classes `path` lists (one name or wnid a line), found by name among the model's,
    and among `within`'s when a subset is already in force (an artifact's)."""
    wanted = read_class_list(path, "class_subset")
    allowed = within.names if within else model_classes
    unknown = [name for name in wanted if name not in allowed]
    if unknown:
        where = (
            f"the {len(allowed)} classes of the statistics' own class subset"
            if within
            else f"the model's {len(allowed)} classes"
        )
        raise InputError(
            f"`class_subset` {path}: {listing(unknown)} {'is' if len(unknown) == 1 else 'are'} not among {where}"
            f"{did_you_mean(unknown, allowed)}; list names of the model's class list (`classes`, or the artifact's)"
        )
    position = {name: i for i, name in enumerate(model_classes)}
    outputs = sorted(position[name] for name in wanted)  # the model's output order, whatever the file's
    return ClassSubset([model_classes[o] for o in outputs], outputs, list(model_classes))


def narrow(domain: Domain, subset: ClassSubset, drop_others: bool = False) -> Domain:
    """The domain with its labels as positions in the subset. Its labels must be model
    outputs (an array's indices, or names mapped through the model's class list). Images of
    other classes are left out with `drop_others` (training data), else refused: a test image
    whose class cannot be predicted would count as an error whatever the method does."""
    lookup = np.full(len(subset.model_classes) + 1, -2, dtype=np.int64)  # -2: a class outside the subset
    lookup[subset.outputs] = np.arange(len(subset.outputs))
    lookup[-1] = UNLABELLED  # labels of -1 index the last entry: unlabelled stays unlabelled
    if len(domain.labels) and int(domain.labels.max()) >= len(subset.model_classes):
        raise InputError(
            f"{domain.name}: label {int(domain.labels.max())} is out of range for {len(subset.model_classes)} classes"
        )
    labels = lookup[domain.labels]
    outside = labels == -2
    if outside.any() and not drop_others:
        names = sorted({subset.model_classes[label] for label in np.unique(domain.labels[outside]).tolist()})
        raise InputError(
            f"{domain.name}: {int(outside.sum())} image(s) of class(es) {listing(names)}, which `class_subset` leaves "
            f"out, so they could never be predicted right; add the classes to the subset, or remove their images"
        )
    if not outside.any():
        return replace(domain, labels=labels, class_names=list(subset.names))
    return keep(replace(domain, labels=labels, class_names=list(subset.names)), np.flatnonzero(~outside))


def keep(domain: Domain, rows: np.ndarray) -> Domain:
    """The domain's images at `rows` only, in their order."""
    rows = np.asarray(rows, dtype=np.int64)
    read = domain.read
    return replace(
        domain, refs=[domain.refs[int(r)] for r in rows], labels=domain.labels[rows], read=lambda i: read(int(rows[i]))
    )


def read_image_ids(path: str) -> set[str]:
    """RobustBench's list: one image a line, a path relative to the class folders' parent
    (`n01440764/ILSVRC2012_val_00000293.JPEG`) or a file name."""
    file = Path(path)
    if file.exists() and not file.is_file():
        raise InputError(
            f"`subset` {path}: not a regular file (a folder, a device or a pipe); write the image ids to a file"
        )
    if not file.is_file():
        raise InputError(
            f"`subset` {path}: no such file (give one image id a line: CLASS/FILE as in a domain folder, or FILE)"
        )
    text = read_small_text(path, "`subset`", SUBSET_LIMIT, "give one image id a line")
    ids = {line.strip().replace("\\", "/") for line in text.splitlines() if line.strip()}
    if not ids:
        raise InputError(f"`subset` {path}: the file lists no image ids")
    return ids


def keep_listed(domain: Domain, ids: set[str], path: str) -> tuple[Domain, str | None]:
    """The images of a folder domain that `ids` lists (by path relative to the domain's folder,
    or by file name), and a note when some listed ids are not among them."""
    root = domain.name
    if not os.path.isdir(root):
        raise UsageError(f"`subset` {path} lists images of image folders, and {root} is not one")
    relative = [os.path.relpath(ref, root).replace(os.sep, "/") for ref in domain.refs]
    rows = np.flatnonzero([rel in ids or os.path.basename(rel) in ids for rel in relative])
    if not len(rows):
        raise InputError(
            f"`subset` {path}: none of its {len(ids):,} image ids is an image of {root}; ids are paths relative to "
            f"the domain's folder (n01440764/ILSVRC2012_val_00000293.JPEG) or file names"
        )
    note = None
    if len(rows) < len(ids):
        note = f"`subset` {path}: {len(rows):,} of its {len(ids):,} images are in {root}"
    return keep(domain, rows), note
