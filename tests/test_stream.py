"""stream.adapt_domains: what each --reset policy carries from one batch, and one
domain, to the next."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from PIL import Image

from cafa_cli.method import distances
from cafa_cli.method.adapter import Adapter
from cafa_cli.method.methods import create
from cafa_cli.data.domain import Domain
from cafa_cli.data.preprocessing import Preprocessing
from cafa_cli.jobs.stream import adapt_domains

PIXELS = Preprocessing(resize=None, crop=None, mean=(0.0,), std=(1.0,), channels=1)


def domain(name: str, x, y) -> Domain:
    images = [Image.fromarray((image[0].clamp(0, 1) * 255).round().byte().numpy()) for image in x]
    return Domain(name, [f"{name}#{i}" for i in range(len(images))], np.asarray(y, dtype=np.int64), ["0", "1", "2"],
                  lambda i: images[i], indexed_labels=True)


def confidences(trained, method: str, reset: str, domains: list[Domain]) -> dict[str, list[float]]:
    """Each domain's per-image confidences, in stream order."""
    model, gaussians, _, _ = trained
    adapter = Adapter(copy.deepcopy(model), create(method, gaussians), lr=1e-2)
    seen: dict[str, list[float]] = {}
    adapt_domains(adapter, domains, PIXELS, batch_size=50, reset=reset, shuffle=False,
                  on_records=lambda records, so_far: seen.setdefault(so_far.data, []).extend(r.confidence for r in records))
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
    results = adapt_domains(adapter, [domain("a", x[:6], y[:6]), domain("b", x[6:12], y[6:12])], PIXELS, batch_size=2,
                            shuffle=False, on_domain=nan_in_b)
    assert [(r.skipped_steps, r.unrefined_batches) for r in results] == [(0, 3), (3, 0)]
