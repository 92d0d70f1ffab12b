"""data/orders.py: the stream orders of --order, each a permutation of the domain."""

from __future__ import annotations

import numpy as np
import pytest

from cafa_cli.core.errors import InputError, UsageError
from cafa_cli.data.domain import UNLABELLED
from cafa_cli.data.orders import stream_order
from cafa_cli.data.values import parse_order

BALANCED = np.repeat(np.arange(10), 300)  # as a Fashion-MNIST-C demo domain: 10 classes × 300
ORDERS = (
    "iid",
    "label-shift:0",
    "label-shift:0.5",
    "label-shift:1.0",
    "dirichlet:0.01",
    "dirichlet:1",
    "dirichlet:1e6",
)


def batch_histograms(labels_in_order: np.ndarray, batch_size: int) -> np.ndarray:
    """Per batch of the stream, the count of each class: one row a batch."""
    classes = int(labels_in_order.max()) + 1
    return np.stack(
        [
            np.bincount(labels_in_order[i : i + batch_size], minlength=classes)
            for i in range(0, len(labels_in_order), batch_size)
        ]
    )


def mostly_one_class(labels_in_order: np.ndarray, batch_size: int) -> bool:
    """Whether the batches hold mostly one class each: the largest class of a batch is on
    average more than 60% of it (an i.i.d. batch of 50 from 10 balanced classes: about 20%)."""
    counts = batch_histograms(labels_in_order, batch_size)
    return float((counts.max(1) / counts.sum(1)).mean()) > 0.6


@pytest.mark.parametrize("order", ["label-shift:1.0", "dirichlet:0.01"])
def test_the_label_shifted_orders_give_batches_of_about_one_class_and_iid_does_not(order):
    iid = BALANCED[stream_order(BALANCED, "iid", seed=0)]
    assert not mostly_one_class(iid, 50)  # the check fails for an i.i.d. order...
    assert mostly_one_class(BALANCED[stream_order(BALANCED, order, seed=0)], 50)  # ...and holds for these


def test_label_shift_follows_the_papers_multinomial_with_its_peak_moving_through_the_classes():
    """At stream fraction x the class shares are S + (1-S)/c on class floor(c·x) and (1-S)/c
    on each other: per tenth of the stream, its own class about 0.55 at S = 0.5, c = 10."""
    labels = np.repeat(np.arange(10), 2000)
    for severity in (0.5, 1.0):
        streamed = labels[stream_order(labels, f"label-shift:{severity}", seed=3)]
        shares = np.stack([np.bincount(part, minlength=10) / len(part) for part in np.split(streamed, 10)])
        expected = np.full((10, 10), (1 - severity) / 10) + severity * np.eye(10)
        assert np.abs(shares - expected).max() < 0.03, shares.round(2)
    streamed = labels[stream_order(labels, "label-shift:0", seed=3)]
    assert not mostly_one_class(streamed, 50)  # S = 0: no shift


@pytest.mark.parametrize("order", ORDERS)
def test_every_order_uses_every_image_exactly_once_and_repeats_for_its_seed(order):
    rng = np.random.default_rng(0)
    imbalanced = np.concatenate([np.full(n, y) for y, n in [(2, 7), (5, 300), (7, 41), (9, 1)]])  # classes with gaps
    for labels in (BALANCED, rng.permutation(imbalanced)):
        first = stream_order(labels, order, seed=11)
        assert np.array_equal(np.sort(first), np.arange(len(labels)))
        assert np.array_equal(stream_order(labels, order, seed=11), first)
        assert not np.array_equal(stream_order(labels, order, seed=12), first)


def test_iid_is_the_seeded_permutation_of_earlier_versions():
    """The default order must not change a prediction of an earlier run."""
    assert np.array_equal(stream_order(BALANCED, "iid", True, 4), np.random.default_rng(4).permutation(len(BALANCED)))
    assert np.array_equal(stream_order(BALANCED, "iid", False, 4), np.arange(len(BALANCED)))


def test_dirichlet_concentration_decides_how_many_slots_a_class_spans():
    """A class's images go to the c time slots in Dirichlet(D) shares, and within a slot
    each class comes as one run: the runs per class count the slots it spans."""

    def slots_per_class(order: str) -> float:
        streamed = BALANCED[stream_order(BALANCED, order, seed=0)]
        return (np.count_nonzero(np.diff(streamed)) + 1) / 10

    assert slots_per_class("dirichlet:0.01") < 2.5 < 7 < slots_per_class("dirichlet:1000")


def test_orders_that_need_labels_say_so_for_unlabelled_images():
    unlabelled = np.full(20, UNLABELLED)
    with pytest.raises(
        InputError, match=r"^photos has no labels, and `order` label-shift:1.0 orders the stream by class"
    ):
        stream_order(unlabelled, "label-shift:1.0", name="photos")
    partly = np.array([0, 1, UNLABELLED, 1])
    with pytest.raises(InputError, match=r"has 1 unlabelled image\(s\) of 4.*use `order` iid"):
        stream_order(partly, "dirichlet:0.1")
    assert len(stream_order(unlabelled, "iid")) == 20


@pytest.mark.parametrize(
    "text",
    [
        "random",
        "iid:1",
        "label-shift",
        "label-shift:1.5",
        "label-shift:-0.1",
        "label-shift:x",
        "dirichlet:0",
        "dirichlet:-1",
        "dirichlet:inf",
        "dirichlet:nan",
        "dirichlet",
        "",
    ],
)
def test_a_malformed_order_is_a_usage_error_naming_the_forms(text):
    with pytest.raises(
        UsageError,
        match=r"`order` must be iid, label-shift:S \(S 0 or from 0.000001 to 1\) or dirichlet:D \(D from 0.000001 to 1,000,000\)",
    ):
        parse_order(text)


def test_parse_order():
    assert parse_order("iid") == ("iid", None)
    assert parse_order("label-shift:1") == ("label-shift", 1.0)
    assert parse_order("dirichlet:0.01") == ("dirichlet", 0.01)
