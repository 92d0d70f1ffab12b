"""The continuously changing corruption stream (`ccc`, issue 64; data/ccc.py): the same for a seed,
its walks keeping the source model's accuracy near the target, and its settings checked."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import invoke, write_folder
from helpers import adapt_args, fails, rows

from cafa_cli.data import ccc
from cafa_cli.data.sources import open_domain


def fake_accuracy(domain) -> float:
    """A stand-in for the source model: the accuracy falls with the severities in the domain's name."""
    severities = [int(part.rpartition("@")[2]) for part in domain.name.rpartition(" ")[2].split("+")]
    return 1 - sum(severities) / 10


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return open_domain(str(write_folder(tmp_path_factory.mktemp("ccc") / "clean", per_class=4)))


def pixels(domain, k) -> bytes:
    return np.asarray(domain.read(k)).tobytes()


def test_the_stream_is_the_same_for_a_seed_and_another_for_another(clean):
    made = [ccc.ccc_domain(clean, 30, 4, 0.6, seed, fake_accuracy, calibration=3) for seed in (0, 0, 1)]
    assert made[0].refs == made[1].refs and np.array_equal(made[0].labels, made[1].labels)
    assert made[0].ordered and len(made[0]) == 30
    # image k comes from the seed and k alone: read in any order, the same bytes
    assert [pixels(made[0], k) for k in (29, 3, 0)] == [pixels(made[1], k) for k in (29, 3, 0)]
    assert made[0].refs != made[2].refs
    steps = [ref.partition("/")[0] for ref in made[0].refs]
    assert len(set(steps[:4])) == 1 and len(dict.fromkeys(steps)) == 8  # 4 images a step


def test_the_walk_fades_one_corruption_out_as_the_next_comes_in():
    accuracy = 1 - np.add.outer(np.arange(6), np.arange(6)) / 10  # falls with either severity
    path = ccc.walk(accuracy, 0.7)
    assert path[0][1] == 0 and path[-1][0] == 0
    assert all(a[0] - b[0] + b[1] - a[1] == 1 for a, b in zip(path, path[1:]))  # one severity a step
    assert np.mean([accuracy[cell] for cell in path]) == pytest.approx(0.7, abs=0.05)


def test_source_accuracy_on_the_bundled_model_stays_near_the_target(monkeypatch, tmp_path):
    """A short stream (120 images, 30 a step) from Fashion-MNIST's test images, the grids measured on 15."""
    monkeypatch.setattr(ccc, "CALIBRATION_IMAGES", 15)
    out = tmp_path / "m.json"
    args = adapt_args(
        "fashion-mnist-test", model="fmnist-resnet", preprocessing=(), method="source", ccc=120, ccc_speed=30
    )
    result = invoke(*args, "--ccc-accuracy", "50", "--batch-size", "40", "--metrics-json", out, "--quiet")
    assert result.exit_code == 0, result.stderr
    (domain,) = json.loads(out.read_text())["domains"]
    assert domain["n"] == 120
    assert 0.35 <= 1 - domain["error"] <= 0.65  # the target 50 %, ± 15 points


@pytest.mark.parametrize(
    "given, needle",
    [
        (("--ccc-speed", "0"), "a walk of no image a step never moves"),
        (("--ccc-accuracy", "100"), "(0, 100)"),
        (("--ccc", "0"), "1 image or more"),
        (("--order", "label-shift:1"), "leave --order out"),
        (("--mix-domains",), "--mix-domains"),
    ],
)
def test_bad_settings_are_one_line_errors(setup, given, needle):
    args = adapt_args(setup["train"], model="fmnist-resnet", preprocessing=())
    fails(invoke(*args, *(("--ccc", "10") if "--ccc" not in given else ()), *given), 2, needle)


def test_rounds_run_the_same_stream_again_and_a_paced_stream_reads_it(setup, monkeypatch):
    """`rounds` visits the stream twice, image for image; `stream_rate` paces it as any stream."""
    monkeypatch.setattr(ccc, "CALIBRATION_IMAGES", 2)
    args = adapt_args(setup["train"], stats=setup["artifact"], ccc=12, ccc_speed=4, batch_size=4)
    result = invoke(*args, "--rounds", "2", "--stream-rate", "1")
    assert result.exit_code == 0, result.stderr
    paths = [row["path"] for row in rows(result)]
    assert len(paths) == 24 and paths[:12] == paths[12:]
    assert len({path.partition("/")[0] for path in paths[:12]}) >= 2  # the walk moved
