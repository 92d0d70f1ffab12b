"""The order of a test stream: which image comes when (`--order`).

Every order is a permutation of the domain's positions (each image exactly once),
drawn from `np.random.default_rng(seed)` alone, so one seed gives one order.

- `iid`: a uniform random permutation (`--no-shuffle`: the domain's own order).
- `label-shift:S`, the paper's label shift (Jung et al., ICCV 2023, § "Impact of small
  batch sizes and label shifts"): the class distribution of the stream moves from
  [S + (1-S)/c, (1-S)/c, ..., (1-S)/c] at its start to [(1-S)/c, ..., S + (1-S)/c] at its
  end, the peak passing through the c classes in turn. Each image gets a time

      t_i = (r(y_i) + v_i) / c   with probability S   (during its own class's period)
      t_i = u_i                  otherwise            (anywhere in the stream)

  with u_i, v_i ~ U[0, 1) and r(y) the rank of class y among the c classes the domain
  holds; the stream is the images sorted by t. With balanced classes the share of
  class k at stream fraction x is S·[k = floor(c·x)] + (1-S)/c: the paper's multinomial,
  its peak on class floor(c·x). S = 1 gives the classes one after another, S = 0 an
  i.i.d. order.
- `dirichlet:D`, the temporally correlated stream of NOTE (Gong et al., NeurIPS 2022)
  as RoTTA (Yuan et al., CVPR 2023, core/data/ttasampler.py) and the test-time-adaptation
  benchmark (mariodoebler/test-time-adaptation, "correlated") build it: T time slots
  (T = c, at most 100); each class's images, shuffled, are split over the slots in the
  proportions p_k ~ Dirichlet(D·1_T); each slot holds its classes' parts one class after
  another, the classes in a random order. Small D (0.01) puts each class in about one
  slot; large D spreads every class over every slot.
"""

from __future__ import annotations

import numpy as np

from cafa_cli.core.errors import InputError
from cafa_cli.data.domain import UNLABELLED
from cafa_cli.data.values import parse_order

MAX_SLOTS = 100  # RoTTA's: as many time slots as classes, at most 100


def stream_order(
    labels: np.ndarray, order: str = "iid", shuffle: bool = True, seed: int = 0, name: str = "the data"
) -> np.ndarray:
    """The positions of `labels`' images in stream order. `name` is what a message calls
    the images when an order needs labels they lack."""
    kind, value = parse_order(order)
    if kind == "iid":
        return np.random.default_rng(seed).permutation(len(labels)) if shuffle else np.arange(len(labels))
    check_labels(labels, order, name)
    rng = np.random.default_rng(seed)
    if kind == "label-shift":
        return label_shift_order(labels, value, rng)
    return dirichlet_order(labels, value, rng)


def check_labels(labels: np.ndarray, order: str, name: str = "the data") -> None:
    """An order by class needs every image's class."""
    missing, n = int((labels == UNLABELLED).sum()), len(labels)
    if missing and parse_order(order)[0] != "iid":
        what = "has no labels" if missing == n else f"has {missing} unlabelled image(s) of {n}"
        raise InputError(
            f"{name} {what}, and `order` {order} orders the stream by class; give labelled data (one folder "
            f"per class, or an array with `labels`), or use `order` iid"
        )


def label_shift_order(labels: np.ndarray, severity: float, rng: np.random.Generator) -> np.ndarray:
    classes, ranks = np.unique(labels, return_inverse=True)
    c, n = len(classes), len(labels)
    anywhere, within, peaked = rng.random(n), rng.random(n), rng.random(n) < severity
    times = np.where(peaked, (ranks + within) / c, anywhere)
    return np.argsort(times, kind="stable")


def dirichlet_order(labels: np.ndarray, concentration: float, rng: np.random.Generator) -> np.ndarray:
    classes, ranks = np.unique(labels, return_inverse=True)
    c, n, slots = len(classes), len(labels), min(len(classes), MAX_SLOTS)
    grouped = np.lexsort((rng.permutation(n), ranks))  # the images class by class, each class shuffled
    counts = np.bincount(ranks, minlength=c)
    shares = rng.dirichlet(np.full(slots, concentration), size=c)  # a class's share of each slot, one row a class
    cuts = (np.cumsum(shares, axis=1)[:, :-1] * counts[:, None]).astype(int)  # where its images move to the next slot
    klass, starts = ranks[grouped], np.cumsum(counts) - counts
    position = np.arange(n) - np.repeat(starts, counts)  # within its class
    # its slot, as np.split(members, cuts) parts a class: the cuts of its class at or before it
    slot = np.searchsorted((cuts + starts[:, None]).ravel(), np.arange(n), side="right") - klass * (slots - 1)
    class_rank_in_slot = rng.random((slots, c))  # each slot takes its classes in a random order
    return grouped[np.lexsort((position, class_rank_in_slot[slot, klass], slot))]
