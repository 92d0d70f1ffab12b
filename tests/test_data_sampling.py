"""data/sampling.py: stratified subsets of the training images."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import write_folder

from cafa_cli.core.errors import InputError
from cafa_cli.data.sampling import stratified_subset
from cafa_cli.data.sources import open_domain


def labels_with(counts):
    return np.concatenate([np.full(n, c) for c, n in enumerate(counts)])[
        np.random.default_rng(0).permutation(sum(counts))
    ]


def test_stratified_subset_takes_round_fraction_per_class():
    counts = [10, 30, 7, 100]
    labels = labels_with(counts)
    chosen = stratified_subset(labels, ["a", "b", "c", "d"], fraction=0.3, seed=0)
    assert np.bincount(labels[chosen], minlength=4).tolist() == [3, 9, 2, 30]
    assert np.all(np.diff(chosen) > 0), "sorted, no repeats"


def test_stratified_subset_per_class_caps_at_class_size():
    labels = labels_with([10, 3, 50])
    chosen = stratified_subset(labels, ["a", "b", "c"], per_class=5, seed=0)
    assert np.bincount(labels[chosen]).tolist() == [5, 3, 5]


def test_stratified_subset_seed():
    labels = labels_with([100, 100])
    first = stratified_subset(labels, ["a", "b"], fraction=0.3, seed=1)
    again = stratified_subset(labels, ["a", "b"], fraction=0.3, seed=1)
    other = stratified_subset(labels, ["a", "b"], fraction=0.3, seed=2)
    assert np.array_equal(first, again)
    assert not np.array_equal(first, other)
    assert np.bincount(labels[other]).tolist() == [30, 30]


def test_stratified_subset_names_classes_with_too_few():
    labels = labels_with([40, 7, 40, 3])
    with pytest.raises(InputError, match=r"rare \(1 of 7\), few \(0 of 3\); raise `fraction`/`per_class`"):
        stratified_subset(labels, ["common", "rare", "other", "few"], fraction=0.1, seed=0)


def test_classes_without_any_image_are_named_not_blamed_on_the_fraction():
    labels = labels_with([40, 7, 0, 0])
    with pytest.raises(InputError) as info:
        stratified_subset(labels, ["common", "rare", "tshirt_top", "bag"], fraction=0.1, seed=0)
    assert str(info.value) == (
        "no images of classes tshirt_top, bag in the data, and statistics need every class; "
        "give each its folder of images (e.g. tshirt_top/ in the `data` folder)"
    )
    with pytest.raises(InputError, match=r"^no images of class bag in the data"):
        stratified_subset(labels_with([5, 5, 0]), ["a", "b", "bag"], per_class=2, seed=0)


def test_a_class_folder_that_is_missing_is_named(tmp_path):
    """The way it happens: the model's class list names a folder the data does not have."""
    write_folder(tmp_path / "d", per_class=3, classes=("a", "c"))
    domain = open_domain(str(tmp_path / "d"), class_names=["a", "b", "c"])
    with pytest.raises(InputError, match=r"^no images of class b in the data.*\(e\.g\. b/ in the `data` folder\)$"):
        stratified_subset(domain.labels, domain.class_names, per_class=2, seed=0)
