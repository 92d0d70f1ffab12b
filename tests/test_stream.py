"""stream.adapt_domains: what each --reset policy carries from one batch, and one
domain, to the next."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from PIL import Image

from cafa_cli.data.domain import Domain
from cafa_cli.data.preprocessing import Preprocessing
from cafa_cli.engine.adapter import Adapter
from cafa_cli.jobs.adapt.stream import StreamEvents, adapt_domains
from cafa_cli.jobs.config.settings import StreamSettings
from cafa_cli.jobs.shared.report import domain_record, overall
from cafa_cli.methods import create
from cafa_cli.statistics import distances

PIXELS = Preprocessing(resize=None, crop=None, mean=(0.0,), std=(1.0,), channels=1)


def domain(name: str, x, y) -> Domain:
    images = [Image.fromarray((image[0].clamp(0, 1) * 255).round().byte().numpy()) for image in x]
    return Domain(
        name,
        [f"{name}#{i}" for i in range(len(images))],
        np.asarray(y, dtype=np.int64),
        ["0", "1", "2"],
        lambda i: images[i],
        indexed_labels=True,
    )


def confidences(trained, method: str, reset: str, domains: list[Domain]) -> dict[str, list[float]]:
    """Each domain's per-image confidences, in stream order."""
    model, gaussians, _, _ = trained
    adapter = Adapter(copy.deepcopy(model), create(method, gaussians), lr=1e-2)
    seen: dict[str, list[float]] = {}
    adapt_domains(
        adapter,
        domains,
        PIXELS,
        StreamSettings(batch_size=50, reset=reset, shuffle=False),
        events=StreamEvents(
            on_records=lambda records, so_far: seen.setdefault(so_far.data, []).extend(r.confidence for r in records)
        ),
    )
    return seen


@pytest.fixture(scope="module")
def two_domains(trained):
    _, _, x, y = trained
    return [domain("a", x[:150], y[:150]), domain("b", x[150:], y[150:])]


def test_episodic_predicts_every_batch_from_the_source_weights(trained, two_domains):
    """Each batch is predicted before its own update, so with the update undone after
    every batch TENT predicts exactly as BN does; per domain it does not."""
    bn = confidences(trained, "bn", "domain", two_domains)
    assert confidences(trained, "tent", "episodic", two_domains) == bn
    assert confidences(trained, "tent", "domain", two_domains) != bn


def test_domain_starts_each_domain_afresh_and_never_carries_the_weights_over(trained, two_domains):
    alone = confidences(trained, "cafa", "domain", two_domains[1:])["b"]
    per_domain = confidences(trained, "cafa", "domain", two_domains)
    continual = confidences(trained, "cafa", "never", two_domains)
    assert per_domain["b"] == alone
    assert continual["a"] == per_domain["a"] and continual["b"] != alone


def run(trained, method: str, domains: list[Domain], groups: list[int] | None = None, **options):
    """Each domain's result and the records in stream order; `options` are StreamSettings'."""
    model, gaussians, _, _ = trained
    adapter = Adapter(copy.deepcopy(model), create(method, gaussians), lr=1e-2)
    records = []
    results = adapt_domains(
        adapter,
        domains,
        PIXELS,
        StreamSettings(batch_size=50, **options),
        groups=groups,
        events=StreamEvents(on_records=lambda batch, so_far: records.append(batch)),
    )
    return results, records


def test_mixed_domains_are_one_interleaved_stream_with_an_error_per_domain(trained, two_domains):
    """Source predicts each image alone: mixed or not, each domain's error is the same,
    so it is counted against the domain the image came from."""
    apart, _ = run(trained, "source", two_domains)
    together, batches = run(trained, "source", two_domains, mix_domains=True)
    assert [(r.data, r.n, r.labelled, r.errors) for r in together] == [
        (r.data, r.n, r.labelled, r.errors) for r in apart
    ]
    assert {record.ref.split("#")[0] for record in batches[0]} == {"a", "b"}  # interleaved, not one after the other
    assert sorted(record.ref for batch in batches for record in batch) == sorted(
        two_domains[0].refs + two_domains[1].refs
    )
    adapted, _ = run(trained, "tent", two_domains, mix_domains=True)
    assert sum(r.n for r in adapted) == 300 and all(r.seconds > 0 for r in adapted)


def test_mixed_domains_order_the_whole_stream_by_class_when_asked(trained, two_domains):
    _, batches = run(trained, "source", two_domains, mix_domains=True, order="label-shift:1.0")
    labels = [record.label for batch in batches for record in batch]
    assert labels == sorted(labels)  # S = 1: the classes one after another, over both domains
    assert {record.ref.split("#")[0] for record in batches[0]} == {"a", "b"}


def test_groups_reset_per_group_not_per_domain(trained, two_domains):
    """gradual: the severities of one corruption are one group, adapted continually."""

    def confidences(**options) -> list[float]:
        _, batches = run(trained, "cafa", two_domains, **options)
        return [record.confidence for batch in batches for record in batch]

    plain = confidences(reset="domain")
    assert confidences(reset="domain", groups=[0, 0]) == confidences(reset="never") != plain
    assert confidences(reset="domain", groups=[0, 1]) == plain


def test_each_domain_reports_its_own_skipped_steps_and_unrefined_batches(trained, monkeypatch):
    """Both are counted on the device during the steps and read once before and once
    after each domain."""
    model, gaussians, x, y = trained
    adapter = Adapter(copy.deepcopy(model), create("euclidean", gaussians), lr=1e-2)
    loss = adapter.method.loss

    def nan_in_b(domain: Domain) -> None:
        adapter.method.loss = (lambda logits, features: logits.sum() * float("nan")) if domain.name == "b" else loss

    monkeypatch.setattr(distances, "CHUNK_BYTES", 1)  # a batch of 2 recomputes 2 of the 3 classes
    monkeypatch.setattr(distances, "REFINE_TOLERANCE", 1e-30)  # and all 3 are at risk
    results = adapt_domains(
        adapter,
        [domain("a", x[:6], y[:6]), domain("b", x[6:12], y[6:12])],
        PIXELS,
        StreamSettings(batch_size=2, shuffle=False),
        events=StreamEvents(on_domain=nan_in_b),
    )
    assert [(r.skipped_steps, r.unrefined_batches) for r in results] == [(0, 3), (3, 0)]


def test_each_domain_reports_the_changes_of_domain_cafa_robust_detected(trained):
    """A stream that never resets, whose second domain is the first's images with heavy noise:
    cafa-robust's detector sees one change, in that domain, and the metrics say so per
    domain and overall, with the returns to the source's weights among them (none when it
    carries them on, the one when it goes back); a method without a detector reports
    neither. (The statistic is about 1.1 at the change, below 0.001 between batches of one
    domain.)"""
    model, gaussians, x, y = trained
    noisy = x[150:] + torch.randn(x[150:].shape, generator=torch.Generator().manual_seed(0)) * 0.4
    domains = [domain("a", x[:150], y[:150]), domain("b", noisy, y[150:])]

    def results(method):
        adapter = Adapter(copy.deepcopy(model), method, lr=1e-3)
        return adapt_domains(
            adapter, domains, PIXELS, StreamSettings(batch_size=50, reset="never", shuffle=True, seed=0)
        )

    robust = results(create("cafa-robust", gaussians, update_every=50, change_threshold=0.5))
    assert [r.domain_changes for r in robust] == [0, 1]
    assert [domain_record(r)["domain_changes"] for r in robust] == [0, 1] and overall(robust)["domain_changes"] == 1
    assert [r.source_restarts for r in robust] == [0, 0] and overall(robust)["source_restarts"] == 0  # it carries
    back = results(create("cafa-robust", gaussians, update_every=50, change_threshold=0.5, restart_weights="source"))
    assert [domain_record(r)["source_restarts"] for r in back] == [0, 1] and overall(back)["source_restarts"] == 1
    plain = results(create("cafa", gaussians))
    assert [(r.domain_changes, r.source_restarts) for r in plain] == [(None, None), (None, None)]
    assert not {"domain_changes", "source_restarts"} & {*domain_record(plain[0]), *overall(plain)}
