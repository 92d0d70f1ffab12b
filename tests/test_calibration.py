"""Calibration: the expected calibration error (15 bins), NLL and Brier score of the reported
predictions, in adapt's summary and metrics JSON and in bench's tables."""

from __future__ import annotations

import csv
import json
import math
import shutil

import numpy as np
import pytest
import torch
from helpers import CALIBRATION_COLUMNS, adapt, bench, fails, rows

from cafa_cli.jobs.adapt.stream import calibration_terms
from cafa_cli.jobs.bench import per_domain
from cafa_cli.jobs.shared.results import Calibration, DomainResult, Record

# six images of three classes: the probabilities reported, and their labels
PROBABILITIES = [
    [0.6, 0.3, 0.1],  # right, confidence 0.6 = 9/15: on an edge, so in the bin (8/15, 9/15]
    [0.58, 0.32, 0.1],  # wrong (label 1), in that bin too
    [0.2, 0.7, 0.1],  # right, bin (10/15, 11/15]
    [0.05, 0.05, 0.9],  # wrong (label 0), bin (13/15, 14/15]
    [0.4, 0.35, 0.25],  # right, confidence 0.4 = 6/15, on an edge: bin (5/15, 6/15]
    [0.1, 0.1, 0.8],  # right, confidence 0.8 = 12/15, on an edge: bin (11/15, 12/15]
]
LABELS = [0, 1, 1, 0, 0, 2]


def calibration_of(probabilities, labels) -> Calibration:
    """The fixed set's records, as the stream makes them (calibration_terms of the logits
    log p), with each confidence the exact largest probability."""
    p = torch.tensor(probabilities, dtype=torch.float64)
    nll, brier = calibration_terms(p.log(), np.array(labels))
    calibration = Calibration()
    for k, label in enumerate(labels):
        confidence, prediction = p[k].max(0)
        calibration.add(Record(f"{k}", int(prediction), label, float(confidence), float(nll[k]), float(brier[k])))
    return calibration


def test_ece_nll_and_brier_equal_a_hand_computation():
    calibration = calibration_of(PROBABILITIES, LABELS)
    # bins with images: (8/15, 9/15] holds 0.6 (right) and 0.58 (wrong): accuracy 1/2, confidence 0.59;
    # 0.7 right, 0.9 wrong, 0.4 right, 0.8 right alone in theirs; the other ten bins are empty
    assert [b for b, n in enumerate(calibration.images) if n] == [5, 8, 10, 11, 13]
    hand = (2 * abs(0.5 - 0.59) + abs(1 - 0.7) + abs(0 - 0.9) + abs(1 - 0.4) + abs(1 - 0.8)) / 6
    assert calibration.ece == pytest.approx(hand, abs=1e-12)
    assert calibration.ece == pytest.approx(2.18 / 6, abs=1e-12)  # 0.6 in the bin above would make it 2.98 / 6
    # NLL: −log of each label's probability, in nats
    assert calibration.nll == pytest.approx(
        -(math.log(0.6) + math.log(0.32) + math.log(0.7) + math.log(0.05) + math.log(0.4) + math.log(0.8)) / 6,
        abs=1e-12,
    )
    # Brier: Σ_k (p_k − y_k)² an image, the multi-class sum, then the mean over the images
    by_image = [0.16 + 0.09 + 0.01, 0.58**2 + 0.68**2 + 0.01, 0.04 + 0.09 + 0.01, 0.95**2 + 0.05**2 + 0.81]
    by_image += [0.36 + 0.35**2 + 0.25**2, 0.01 + 0.01 + 0.04]
    assert calibration.brier == pytest.approx(sum(by_image) / 6, abs=1e-12)
    assert sum(by_image) / 6 == pytest.approx(3.5288 / 6)


def test_the_sums_of_two_parts_merge_into_those_of_the_whole():
    whole = calibration_of(PROBABILITIES, LABELS)
    first, second = calibration_of(PROBABILITIES[:2], LABELS[:2]), calibration_of(PROBABILITIES[2:], LABELS[2:])
    first.merge(second)
    assert first.images == whole.images and first.right == whole.right
    assert (first.ece, first.nll, first.brier) == pytest.approx((whole.ece, whole.nll, whole.brier), abs=1e-12)
    # a gradual bench's corruption: its severity visits as one
    visits = [DomainResult("fog/1", calibration=calibration_of(PROBABILITIES[:2], LABELS[:2]))]
    visits.append(DomainResult("fog/2", calibration=calibration_of(PROBABILITIES[2:], LABELS[2:])))
    (merged,) = per_domain(visits, [0, 0], ["fog"])
    assert merged.ece == pytest.approx(whole.ece, abs=1e-12) and merged.calibration.images == whole.images


def test_no_labelled_image_has_no_calibration():
    empty = Calibration()
    assert (empty.n, empty.ece, empty.nll, empty.brier) == (0, None, None, None)


def test_ece_agrees_with_torchmetrics():
    """torchmetrics keeps every confidence (O(n) memory) and puts a confidence on an edge in
    the bin above it; away from the edges its l1 calibration error is the same."""
    torchmetrics = pytest.importorskip("torchmetrics")
    generator = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(500, 10, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 10, (500,), generator=generator)
    probabilities = logits.softmax(1)
    calibration = calibration_of(probabilities.tolist(), labels.tolist())
    metric = torchmetrics.classification.MulticlassCalibrationError(num_classes=10, n_bins=15, norm="l1")
    assert calibration.ece == pytest.approx(float(metric(probabilities.float(), labels)), abs=1e-5)


def test_nll_and_brier_agree_with_scikit_learn():
    """scikit-learn (a test dependency) has the multi-class Brier score as a sum over the
    classes since 1.7, and the log loss."""
    metrics = pytest.importorskip("sklearn.metrics")
    generator = torch.Generator().manual_seed(1)
    probabilities = (3 * torch.randn(200, 10, generator=generator, dtype=torch.float64)).softmax(1)
    labels = torch.randint(0, 10, (200,), generator=generator).tolist()
    calibration = calibration_of(probabilities.tolist(), labels)
    assert calibration.nll == pytest.approx(metrics.log_loss(labels, probabilities.numpy(), labels=range(10)))
    try:
        brier = metrics.brier_score_loss(labels, probabilities.numpy(), labels=range(10))
    except (TypeError, ValueError):  # before 1.7: binary only
        pytest.skip("this scikit-learn has no multi-class Brier score")
    assert calibration.brier == pytest.approx(brier)


def test_nll_is_that_of_cross_entropy_and_stays_finite_when_confident():
    logits = torch.tensor([[30.0, 0.0, -3.0], [1.0, 2.0, 0.5], [120.0, 0.0, 0.0]])
    labels = np.array([0, 2, 1])
    nll, brier = calibration_terms(logits, labels)
    expected = torch.nn.functional.cross_entropy(logits.double(), torch.tensor(labels), reduction="none")
    assert torch.allclose(nll, expected)
    assert 0 < nll[0] < 1e-12  # float32 would round a sure right answer's to 0
    assert nll[2] == pytest.approx(120)  # and a sure wrong one's to −log 0
    assert brier[2] == pytest.approx(2)  # all on the wrong class: the largest Brier score


def test_adapt_reports_calibration_for_labelled_images_in_the_json_and_summary(setup, tmp_path):
    metrics = tmp_path / "m.json"
    result = adapt(setup, setup["train"], "--metrics-json", metrics)
    assert result.exit_code == 0, result.stderr
    assert all(column in result.stderr for column in ("ECE %", "NLL", "Brier"))
    saved = json.loads(metrics.read_text())
    units = {"ece": "fraction", "nll": "nats per image", "brier": "sum over the classes per image, from 0 to 2"}
    for record in (saved, *saved["domains"]):
        calibration = record["calibration"]
        assert calibration["bins"] == 15 and calibration["units"] == units
        assert 0 <= calibration["ece"] <= 1 and calibration["nll"] > 0 and 0 <= calibration["brier"] <= 2
    # the ECE again from the records (their confidences rounded to 6 decimals)
    records = rows(result)
    confidence = np.array([float(r["confidence"]) for r in records])
    right = np.array([r["prediction"] == r["label"] for r in records])
    bins = np.clip(np.ceil(confidence * 15).astype(int) - 1, 0, 14)
    ece = sum(abs(right[bins == b].sum() - confidence[bins == b].sum()) for b in range(15)) / len(records)
    assert saved["calibration"]["ece"] == pytest.approx(ece, abs=1e-5)


def test_adapt_without_labels_has_null_calibration_and_no_calibration_columns(setup, tmp_path):
    flat = tmp_path / "flat"
    flat.mkdir()
    for k, image in enumerate(sorted((setup["train"] / "a").glob("*.png"))[:4]):
        shutil.copy(image, flat / f"{k}.png")
    metrics = tmp_path / "m.json"
    result = adapt(setup, flat, "--metrics-json", metrics)
    assert result.exit_code == 0, result.stderr
    saved = json.loads(metrics.read_text())
    assert saved["calibration"] is None and saved["domains"][0]["calibration"] is None
    assert saved["error"] is None  # as the error is
    assert "ECE" not in result.stderr and "Brier" not in result.stderr


def test_bench_metric_chooses_the_table_and_the_csv_and_json_hold_every_metric(setup, tmp_path):
    out = {k: tmp_path / f"r.{k}" for k in ("csv", "json")}
    common = dict(
        weights=setup["weights"],
        train=setup["train"],
        methods="source,bn",
        per_class=6,
        batch_size=6,
        workdir=tmp_path / "work",
        quiet=True,
    )
    result = bench(setup["train"], metric="ece", csv=out["csv"], metrics_json=out["json"], **common)
    assert result.exit_code == 0, result.stderr
    report = json.loads(out["json"].read_text())
    ece = {run["method"]: 100 * run["calibration"]["ece"] for run in report["runs"]}
    error = {run["method"]: 100 * run["error"] for run in report["runs"]}
    assert result.stdout.startswith("ECE %, of the labelled images' predictions\n\n| method | train | mean |")
    assert f"| source | {ece['source']:.2f} |" in result.stdout and f"{error['source']:.2f}" not in result.stdout
    # the JSON's `table` stays the error's; the calibration's tables beside it, each with its unit
    assert report["table"][0]["mean"]["mean"] == pytest.approx(error["source"])
    assert report["calibration"]["ece"]["unit"] == "ECE %"
    assert report["calibration"]["ece"]["table"][1]["mean"]["mean"] == pytest.approx(ece["bn"])
    assert {"nll", "brier"} <= set(report["calibration"])
    lines = list(csv.DictReader(out["csv"].open()))
    assert list(lines[0]) == [
        "method",
        "domain",
        "error_mean_percent",
        "error_std_percent",
        *CALIBRATION_COLUMNS,
    ]
    assert float(lines[0]["ece_mean_percent"]) == pytest.approx(ece["source"], abs=1e-4)
    default = bench(setup["train"], **common)  # the error's table, as ever, with the statistics re-used
    assert default.stdout.startswith("| method | train | mean |")
    assert f"| source | {error['source']:.2f} |" in default.stdout


def test_an_unknown_bench_metric_is_a_usage_error(setup, tmp_path):
    fails(
        bench(setup["train"], weights=setup["weights"], metric="auroc", workdir=tmp_path / "work"),
        2,
        "Invalid value for '--metric'",
        "'auroc' is not one of 'error', 'ece', 'nll', 'brier'",
    )
    assert not (tmp_path / "work").exists()


def test_a_bench_config_built_in_python_checks_its_metric():
    from cafa_cli.core.errors import UsageError
    from cafa_cli.jobs.config import BenchConfig

    with pytest.raises(UsageError, match="`metric` must be one of error, ece, nll, brier, not auroc"):
        BenchConfig(metric="auroc")
