"""CAFA-Oracle (`--oracle`): the class-aware loss takes the true labels in place of the
predicted classes, and only the loss sees them; refused where it would mean nothing."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from conftest import PLAIN, TINY_NET, invoke, write_folder
from helpers import adapt, fails
from test_stream import PIXELS, domain

from cafa_cli.engine.adapter import Adapter
from cafa_cli.jobs.adapt.stream import StreamEvents, adapt_domains
from cafa_cli.jobs.config.settings import StreamSettings
from cafa_cli.methods import create, method_class
from cafa_cli.methods.shared import losses


@pytest.mark.parametrize("name, loss", [("cafa", losses.cafa), ("euclidean", losses.cafa), ("intra", losses.intra)])
def test_the_oracle_loss_is_the_loss_of_the_true_labels(trained, name, loss):
    model, gaussians, x, y = trained
    method = create(name, gaussians)
    with torch.no_grad():
        logits, features = model(x[:40])
    predicted = logits.argmax(1)
    wrong = (predicted + 1) % 3  # labels the prediction never matches: the two losses cannot agree by chance
    assert method.loss(logits, features) == loss(method.distances(features), predicted)
    method.oracle_labels = wrong
    assert method.loss(logits, features) == loss(method.distances(features), wrong)
    assert method.loss(logits, features) != loss(method.distances(features), predicted)


def test_cafa_eata_aligns_its_kept_samples_with_the_true_labels_under_the_oracle(trained):
    """The selection (and its weights) still come from the model's entropy; only ŷ changes."""
    model, gaussians, x, _ = trained
    method = create("cafa-eata", gaussians, entropy_margin=10.0)  # a margin that keeps every sample
    with torch.no_grad():
        logits, features = model(x[:40])
    wrong = (logits.argmax(1) + 1) % 3
    _, weights, kept = copy.deepcopy(method.selection).select(logits)
    method.oracle_labels = wrong
    want = (losses.cafa_terms(method.distances(features), wrong) * weights).sum() / kept.clamp_min(1)
    assert int(kept) == 40 and torch.equal(method.loss(logits, features), want)


def test_only_the_class_aware_losses_take_the_labels():
    assert [
        name
        for name in ("cafa", "intra", "euclidean", "global-fa", "cafa-eata", "tent", "pl")
        if method_class(name).takes_labels
    ] == ["cafa", "intra", "euclidean", "cafa-eata"]


def test_the_stream_gives_the_loss_each_batchs_labels_only_with_the_oracle(trained):
    model, gaussians, x, y = trained
    stream = [domain("a", x[:60], y[:60])]
    seen, predictions = {}, {}
    for oracle in (False, True):
        method = create("cafa", gaussians)
        given, plain_loss = [], method.loss
        method.loss = lambda logits, features: given.append(method.oracle_labels) or plain_loss(logits, features)
        adapter = Adapter(copy.deepcopy(model), method, lr=1e-2)
        records = []
        adapt_domains(
            adapter,
            stream,
            PIXELS,
            StreamSettings(batch_size=20, seed=3, oracle=oracle),
            events=StreamEvents(on_records=lambda batch, so_far: records.extend(batch)),
        )
        seen[oracle], predictions[oracle] = given, records
    assert seen[False] == [None] * 3
    labels = [r.label for r in predictions[True]]  # the shuffled stream's labels, batch by batch
    assert [t.tolist() for t in seen[True]] == [labels[k : k + 20] for k in (0, 20, 40)]
    # the predictions are the model's: the first batch, predicted before any update, is the same
    assert [r.prediction for r in predictions[True][:20]] == [r.prediction for r in predictions[False][:20]]


def test_adapt_records_the_oracle_and_refuses_it_where_it_means_nothing(setup, tmp_path):
    test = write_folder(tmp_path / "test", per_class=4, seed=2)
    metrics = tmp_path / "m.json"
    for oracle in ([], ["--oracle"]):
        result = adapt(setup, test, *oracle, "--metrics-json", metrics)
        assert result.exit_code == 0, result.stderr
        assert json.loads(metrics.read_text())["settings"]["oracle"] is bool(oracle)
        assert ("cafa adapt --method cafa --oracle" in result.stderr) is bool(oracle)  # the summary's title
    fails(
        adapt(setup, test, "--oracle", "--method", "tent"),
        2,
        "--oracle gives the true labels to a loss that uses the "
        "predicted class (cafa, intra, euclidean, cafa-eata); --method tent takes none",
    )
    fails(adapt(setup, test, "--oracle", "--method", "global-fa"), 2, "--method global-fa takes none")
    fails(adapt(setup, test, "--oracle", "--method", "pl"), 2, "--method pl takes none")
    flat = tmp_path / "flat"
    flat.mkdir()
    for path in sorted(test.rglob("*.png"))[:5]:
        shutil.copy(path, flat / f"{path.parent.name}-{path.name}")
    fails(
        adapt(setup, flat, "--oracle"),
        2,
        "--oracle gives the loss each image's true label, and 5 of its 5 image(s) have none",
    )


def test_bench_adds_an_oracle_row_after_each_class_aware_row(setup, tmp_path):
    test = write_folder(tmp_path / "test", per_class=4, seed=2)
    report = tmp_path / "r.json"
    base = [
        "bench",
        test,
        "--model",
        TINY_NET,
        "--weights",
        setup["weights"],
        "--train",
        setup["train"],
        *PLAIN,
        "--batch-size",
        "4",
        "--per-class",
        "6",
        "--workdir",
        tmp_path / "w",
    ]
    result = invoke(*base, "--methods", "source,cafa,intra@0.01", "--oracle", "--json", report)
    assert result.exit_code == 0, result.stderr
    assert [line.split(" | ")[0] for line in result.stdout.splitlines()[2:]] == [
        "| source",
        "| cafa",
        "| cafa-oracle",
        "| intra@0.01",
        "| intra-oracle@0.01",
    ]
    saved = json.loads(report.read_text())
    assert [(r["label"], r["method"], r["oracle"]) for r in saved["rows"]] == [
        ("source", "source", False),
        ("cafa", "cafa", False),
        ("cafa-oracle", "cafa", True),
        ("intra@0.01", "intra", False),
        ("intra-oracle@0.01", "intra", True),
    ]
    assert saved["settings"]["oracle"] is True and saved["settings"]["methods"] == "source,cafa,intra@0.01"
    fails(
        invoke(*base, "--methods", "source,tent", "--oracle", "--workdir", tmp_path / "x"),
        2,
        "--oracle adds a CAFA-Oracle row after each row whose loss uses the predicted class",
        "--methods source,tent has none",
    )
    assert not (tmp_path / "x").exists()  # refused before any statistics


def test_the_oracle_help_names_every_method_it_takes():
    """The help is a fixed string beside a list derived from the methods: a new class-aware
    method must reach both."""
    from dataclasses import fields

    from cafa_cli.jobs.config.settings import OracleOptions, oracle_methods

    help_text = next(f for f in fields(OracleOptions) if f.name == "oracle").metadata["help"]
    listed = help_text.split("For ", 1)[1].split(";", 1)[0]
    assert sorted(listed.replace(" and ", ", ").split(", ")) == sorted(oracle_methods())
