"""The source model's error on the benchmark's clean test set (`clean`): a sanity check
before adapting; and the adapted model's on a clean domain after each test domain
(`forgetting`). ResNet-50 on ImageNet's validation set is about 24 % wrong; 80 % means
the weights, the class order or the preprocessing are not what they should be."""

from __future__ import annotations

import numpy as np
import torch

from cafa_cli.core.errors import InputError
from cafa_cli.data.domain import Domain
from cafa_cli.data.loading import batches, unreadable
from cafa_cli.data.preprocessing import Preprocessing
from cafa_cli.engine.adapter import Adapter
from cafa_cli.jobs.shared.inputs import _skip_warning
from cafa_cli.jobs.shared.monitor import Monitor
from cafa_cli.model.features import FeatureClassifier


def clean_error(
    net: FeatureClassifier,
    domain: Domain,
    preprocess: Preprocessing,
    batch_size: int,
    num_workers: int | None,
    device: torch.device,
    strict: bool,
    monitor: Monitor,
) -> dict:
    """{"data", "n", "error"} of the model as it is (eval mode, its own BatchNorm
    statistics, no update) on a labelled domain. Run before the Adapter changes the model."""
    net = net.to(device).eval()
    labelled = _labelled(domain, "clean")

    def logits_of(images: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return net(images)[0]

    return _error(logits_of, domain, labelled, preprocess, batch_size, num_workers, device, strict, monitor, "clean")


def adapted_error(
    adapter: Adapter,
    domain: Domain,
    preprocess: Preprocessing,
    batch_size: int,
    num_workers: int | None,
    strict: bool,
    monitor: Monitor,
) -> dict:
    """{"data", "n", "error"} of the model as adapted so far on a labelled domain (`forgetting`),
    changing nothing: no update, statistics put back (Adapter.features). Its images come in a
    fixed shuffled order, so that the batches that normalise with their own statistics hold
    every class, whatever order the domain lists them in."""
    labelled = np.random.default_rng(0).permutation(_labelled(domain, "forgetting"))
    return _error(
        lambda images: adapter.features(images)[0],
        domain,
        labelled,
        preprocess,
        batch_size,
        num_workers,
        adapter.device,
        strict,
        monitor,
        "forgetting",
    )


def _labelled(domain: Domain, option: str) -> np.ndarray:
    labelled = np.flatnonzero(domain.labels >= 0)
    if not len(labelled):
        raise InputError(
            f"`{option}` {domain.name}: no labels, so no error; give the clean test set with one folder per class"
        )
    return labelled


def _error(logits_of, domain, positions, preprocess, batch_size, num_workers, device, strict, monitor, option) -> dict:
    errors = seen = 0
    monitor.start(f"{option} {domain.name}", len(positions))
    for batch in batches(domain, preprocess, batch_size, positions, num_workers, device):
        for ref, why in unreadable(domain, batch, strict):
            monitor.warn(_skip_warning(ref, why))
        if batch.images is not None:
            logits = logits_of(preprocess.normalize(batch.images.to(device)))
            truth = torch.as_tensor(domain.labels[batch.indices], device=logits.device)
            errors += int((logits.argmax(1) != truth).sum())
            seen += len(batch.indices)
        monitor.advance(len(batch.indices) + len(batch.failures))
    if not seen:
        raise InputError(f"`{option}` {domain.name}: none of its images could be read (see the warnings)")
    return {"data": domain.name, "n": seen, "error": errors / seen}


def clean_summary(result: dict) -> str:
    return (
        f"source model's clean error on {result['data']}: {100 * result['error']:.2f}% of {result['n']:,} images "
        f"(no adaptation; a sanity check of the weights, classes and preprocessing)"
    )
