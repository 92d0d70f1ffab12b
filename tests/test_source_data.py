"""--source-data: one option for every method's clean labelled source images (issue 41):
eata's Fisher term reads the images, rmt's warm-up and replay the images and their labels."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from conftest import TINY_NET, invoke

from cafa_cli.core.errors import InputError
from cafa_cli.data.domain import UNLABELLED
from cafa_cli.jobs.adapt.source_images import LabelledBatches


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


def test_rmt_warms_up_and_replays_on_the_source_data_and_says_when_it_has_none(setup, tmp_path):
    from conftest import write_folder

    free = run(setup)
    assert free.exit_code == 0, free.stderr
    assert "rmt without --source-data runs as its authors' source-free variant" in free.stderr
    source = write_folder(tmp_path / "source", per_class=6, seed=4)  # apart from the test images (test_same_images)
    sourced = run(setup, "--source-data", source, "--method-option", "warmup_samples=20")
    assert sourced.exit_code == 0, sourced.stderr
    assert "source-free" not in sourced.stderr
    assert sourced.stdout.count("\n") == free.stdout.count("\n") and sourced.stdout != free.stdout


class Domain:
    def __init__(self, labels):
        self.name, self.labels = "d", np.asarray(labels)


def test_labelled_batches_skip_the_unlabelled_and_reshuffle_on_every_pass(monkeypatch):
    from cafa_cli.jobs.adapt import source_images

    class Batch:
        def __init__(self, positions):
            self.indices, self.images = list(positions), torch.zeros(len(positions), 1, 2, 2, dtype=torch.uint8)

    orders = []

    def batches(domain, preprocess, size, order, *args):
        orders.append([int(i) for i in order])
        return [Batch(order[k : k + size]) for k in range(0, len(order), size)]

    monkeypatch.setattr(source_images, "batches", batches)

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


def test_eatas_fisher_from_a_class_folder_set_is_that_of_shuffled_batches(trained, tmp_path):
    """Issue 40 §7: the Fisher images were read in file order, so on a class-folder set each batch
    was one class and the Fisher about twice (here; 12 times on ImageNet) that of the authors'
    shuffling loader. Now it lies among the Fishers of random orders, far from the sorted one."""
    import copy

    from conftest import write_folder

    from cafa_cli.data.loading import batches
    from cafa_cli.data.preprocessing import Preprocessing
    from cafa_cli.data.sources import open_domain
    from cafa_cli.engine.method import select_parameters
    from cafa_cli.jobs.adapt.source_images import fisher_batches
    from cafa_cli.jobs.config import AdaptConfig
    from cafa_cli.methods.shared.fisher import fisher_information

    model = copy.deepcopy(trained[0])
    params, cpu = select_parameters(model), torch.device("cpu")
    root = write_folder(tmp_path / "source", per_class=100)  # the classes the tiny net was trained on
    plain = Preprocessing(resize=None, crop=None, mean=(0.0,), std=(1.0,), channels=1)
    config = AdaptConfig(method="eata", data=[str(root)], source_data=str(root), fisher_samples=300, batch_size=30)
    domain = open_domain(str(root))

    def size(images) -> float:
        return sum(float(total.sum()) for total in fisher_information(model, params, images, cpu))

    def in_order(order):
        return (plain.normalize(batch.images) for batch in batches(domain, plain, 30, order, 0, cpu))

    ours = size(fisher_batches(config, domain, plain, cpu))
    shuffled = np.mean([size(in_order(np.random.default_rng(seed).permutation(300))) for seed in range(1, 6)])
    by_class = size(in_order(np.arange(300)))
    assert abs(ours - shuffled) < 0.35 * shuffled and by_class > 1.8 * shuffled, (ours, shuffled, by_class)


@pytest.mark.parametrize("method", ["eata", "rmt"])
def test_source_images_of_another_size_are_flagged_and_none_readable_is_bad_input(setup, tmp_path, method):
    """Test images of another size than the statistics' get a warning; source images did not.
    Source images none of which could be read ended eata's run with a Fisher of nothing (exit
    0) and rmt's with "rmt's source_batches holds no batch" (exit 2): bad input data is exit 3."""
    from conftest import write_folder
    from helpers import fails

    extra = ["--method", method, "--recipe", "none", "--method-option", "warmup_samples=8"][
        : 4 if method == "eata" else 6
    ]
    big = write_folder(tmp_path / "big", per_class=4, size=24)
    result = run(setup, *extra, "--source-data", big)
    assert result.exit_code == 0, result.stderr
    assert "warning: --source-data big: its images enter the model at 24x24 pixels, the statistics' at 16x16" in (
        result.stderr
    )
    bad = tmp_path / "bad"
    for name in ("a", "b", "c"):
        (bad / name).mkdir(parents=True)
        for i in range(2):
            (bad / name / f"{i}.png").write_bytes(b"not an image")
    line = fails(run(setup, *extra, "--source-data", bad), 3, "none of its 6 image(s) could be read")
    assert line.startswith(f"cafa: error: --source-data {bad}")
    # images of the statistics' size: a copy of the training images (the test data here is that
    # folder itself, which --source-data may not share: tests/test_same_images.py)
    same = run(setup, *extra, "--source-data", shutil.copytree(setup["train"], tmp_path / "copy"))
    assert same.exit_code == 0 and "enter the model at" not in same.stderr, same.stderr
