"""The labelled source images some methods take beside the test stream (`source_data`):
EATA's images for its Fisher information, RMT's batches replayed with every step."""

from __future__ import annotations

import numpy as np
import torch

from cafa_cli.data.domain import Domain, relabel
from cafa_cli.data.loading import batches
from cafa_cli.data.preprocessing import Preprocessing
from cafa_cli.errors import InputError
from cafa_cli.jobs.config import AdaptConfig
from cafa_cli.method.methods import method_class


def source_images(
    config: AdaptConfig, domain: Domain, preprocess: Preprocessing, device: torch.device, class_names
) -> dict:
    """`source_data` (opened as `domain`) as the input the method takes: eata's `fisher_batches`
    (images), rmt's `source_batches` (images and their labels as model outputs, a new shuffled
    pass each time)."""
    inputs = method_class(config.method).inputs
    if "fisher_batches" in inputs:
        return {"fisher_batches": fisher_batches(config, domain, preprocess, device)}
    if "source_batches" in inputs:
        labelled = relabel(domain, list(class_names)) if class_names is not None else domain
        return {"source_batches": LabelledBatches(labelled, preprocess, config.batch_size, config.num_workers, device)}
    return {}


class LabelledBatches:
    """A source domain's labelled images in batches, prepared as the test images; each
    iteration a new pass in a new order (seeds 1, 2, ...), as a shuffling data loader's."""

    def __init__(self, domain: Domain, preprocess: Preprocessing, batch_size: int, workers: int, device):
        self.labelled = np.flatnonzero(domain.labels >= 0)
        if len(self.labelled) == 0:
            raise InputError(f"`source_data` {domain.name}: no labelled images (the method trains on their labels)")
        self.domain, self.preprocess, self.batch_size, self.workers, self.device = (
            domain,
            preprocess,
            batch_size,
            workers,
            device,
        )
        self.passes = 0

    def __iter__(self):
        self.passes += 1
        order = np.random.default_rng(self.passes).permutation(self.labelled)
        for batch in batches(self.domain, self.preprocess, self.batch_size, order, self.workers, self.device):
            if batch.images is not None:
                labels = torch.as_tensor(self.domain.labels[batch.indices], dtype=torch.int64, device=self.device)
                yield self.preprocess.normalize(batch.images.to(self.device)), labels


def fisher_batches(config: AdaptConfig, domain: Domain, preprocess: Preprocessing, device: torch.device):
    """EATA's source images: `fisher_samples` of `source_data` at random (seed 0), in that
    random order, as the authors' shuffling loader gives them (in file order, each batch of a
    class-folder set was nearly one class, and the Fisher about 12 times the authors'), prepared
    as the test images, in batches of `batch_size` (read once, when the Adapter is built)."""
    if len(domain) == 0:
        raise InputError(f"`source_data` {config.source_data}: no images")
    count = min(config.fisher_samples, len(domain))
    indices = np.random.default_rng(0).choice(len(domain), size=count, replace=False)
    for batch in batches(domain, preprocess, config.batch_size, indices, config.num_workers, device):
        if batch.images is not None:
            yield preprocess.normalize(batch.images.to(device))
