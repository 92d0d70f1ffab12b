"""--source-data: one option for every method's clean labelled source images (issue 41):
eata's Fisher term reads the images, rmt's warm-up and replay the images and their labels."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import TINY_NET, invoke

from cafa_cli.data.domain import UNLABELLED
from cafa_cli.errors import InputError
from cafa_cli.jobs.adapt.prepare import LabelledBatches


def run(setup, *extra):
    return invoke(
        "adapt",
        "--stats",
        setup["artifact"],
        "--model",
        TINY_NET,
        "--data",
        setup["train"],
        "--batch-size",
        "10",
        "--method",
        "rmt",
        "--recipe",
        "cifar10-c",
        *extra,
    )


def test_rmt_warms_up_and_replays_on_the_source_data_and_says_when_it_has_none(setup):
    free = run(setup)
    assert free.exit_code == 0, free.stderr
    assert "rmt without --source-data runs as its authors' source-free variant" in free.stderr
    sourced = run(setup, "--source-data", setup["train"], "--method-option", "warmup_samples=20")
    assert sourced.exit_code == 0, sourced.stderr
    assert "source-free" not in sourced.stderr
    assert sourced.stdout.count("\n") == free.stdout.count("\n") and sourced.stdout != free.stdout


class Domain:
    def __init__(self, labels):
        self.name, self.labels = "d", np.asarray(labels)


def test_labelled_batches_skip_the_unlabelled_and_reshuffle_on_every_pass(monkeypatch):
    from cafa_cli.jobs.adapt import prepare

    class Batch:
        def __init__(self, positions):
            self.indices, self.images = list(positions), torch.zeros(len(positions), 1, 2, 2, dtype=torch.uint8)

    orders = []

    def batches(domain, preprocess, size, order, *args):
        orders.append([int(i) for i in order])
        return [Batch(order[k : k + size]) for k in range(0, len(order), size)]

    monkeypatch.setattr(prepare, "batches", batches)

    class Plain:
        def normalize(self, images):
            return images.float()

    labels = [0, 1, UNLABELLED, 2, 1, 0, UNLABELLED, 2]
    source = LabelledBatches(Domain(labels), Plain(), 3, 0, "cpu")
    first, second = ([int(y) for _, batch in iter(source) for y in batch] for _ in range(2))
    assert sorted(first) == sorted(second) == [0, 0, 1, 1, 2, 2]
    assert sorted(orders[0]) == sorted(orders[1]) == [0, 1, 3, 4, 5, 7] and orders[0] != orders[1]
    assert first == [labels[i] for i in orders[0]]
    with pytest.raises(InputError, match="no labelled images"):
        LabelledBatches(Domain([UNLABELLED] * 3), Plain(), 3, 0, "cpu")
