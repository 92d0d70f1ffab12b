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

from cafa_cli.data.domain import UNLABELLED
from cafa_cli.data.values import parse_order
from cafa_cli.errors import InputError

MAX_SLOTS = 100  # RoTTA's: as many time slots as classes, at most 100


def stream_order(labels: np.ndarray, order: str = "iid", shuffle: bool = True, seed: int = 0, name: str = "the data") -> np.ndarray:
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
        raise InputError(f"{name} {what}, and `order` {order} orders the stream by class; give labelled data (one folder "
                         f"per class, or an array with `labels`), or use `order` iid")


def label_shift_order(labels: np.ndarray, severity: float, rng: np.random.Generator) -> np.ndarray:
    classes, ranks = np.unique(labels, return_inverse=True)
    c, n = len(classes), len(labels)
    anywhere, within, peaked = rng.random(n), rng.random(n), rng.random(n) < severity
    times = np.where(peaked, (ranks + within) / c, anywhere)
    return np.argsort(times, kind="stable")


def dirichlet_order(labels: np.ndarray, concentration: float, rng: np.random.Generator) -> np.ndarray:
    classes = np.unique(labels)
    slots: list[list[np.ndarray]] = [[] for _ in range(min(len(classes), MAX_SLOTS))]
    for y in classes:
        members = rng.permutation(np.flatnonzero(labels == y))
        shares = rng.dirichlet(np.full(len(slots), concentration))
        cuts = (np.cumsum(shares)[:-1] * len(members)).astype(int)
        for slot, part in zip(slots, np.split(members, cuts)):
            slot.append(part)
    return np.concatenate([part for slot in slots for part in (slot[k] for k in rng.permutation(len(slot)))])
