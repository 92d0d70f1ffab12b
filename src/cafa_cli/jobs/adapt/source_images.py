"""The labelled source images some methods take beside the test stream (`source_data`):
EATA's images for its Fisher information, FOA's for its source statistics, RMT's batches
replayed with every step."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch

from cafa_cli.artifact.store import Artifact
from cafa_cli.core.errors import InputError
from cafa_cli.data.domain import Domain, relabel
from cafa_cli.data.loading import Batch, batches
from cafa_cli.data.preprocessing import Preprocessing
from cafa_cli.jobs.config import AdaptConfig
from cafa_cli.jobs.shared.report import short_name
from cafa_cli.jobs.shared.what_runs import size_note, statistics_input_size
from cafa_cli.methods import method_class

# told a pass's first batch of images, as they enter the model (the size check)
FirstBatch = Callable[[torch.Tensor], None]


def source_images(
    config: AdaptConfig,
    domain: Domain,
    preprocess: Preprocessing,
    device: torch.device,
    class_names,
    first_batch: FirstBatch | None = None,
) -> dict:
    """`source_data` (opened as `domain`) as the input the method takes: eata's `fisher_batches`
    and foa's `statistics_batches` (images, the same draw), rmt's `source_batches` (images and their
    labels as model outputs, a new shuffled pass each time). `first_batch` is told the first images
    read (once), to check their size as a test domain's."""
    inputs = method_class(config.method).inputs
    for images in ("fisher_batches", "statistics_batches"):
        if images in inputs:
            return {images: fisher_batches(config, domain, preprocess, device, first_batch)}
    if "source_batches" in inputs:
        labelled = relabel(domain, list(class_names)) if class_names is not None else domain
        return {
            "source_batches": LabelledBatches(
                labelled, preprocess, config.batch_size, config.num_workers, device, first_batch
            )
        }
    return {}


def size_check(source_data: str, artifact: Artifact | None, warn: Callable[[str], None] | None) -> FirstBatch:
    """A warning when the source images enter the model at another size than the statistics'
    (when known), as a test domain's first batch gets (Adaptation.run)."""

    def check(images: torch.Tensor) -> None:
        made = artifact.preprocessing if artifact else None
        size = statistics_input_size(made, artifact.sampling) if artifact else None
        note = size_note(f"`source_data` {short_name(source_data)}", images, size, made)
        if note and warn is not None:
            warn(note)

    return check


def readable(
    domain: Domain,
    preprocess: Preprocessing,
    batch_size: int,
    order: np.ndarray,
    workers: int | None,
    device: torch.device,
    first_batch: FirstBatch | None = None,
) -> Iterator[Batch]:
    """The batches of `order` with an image read, the first told to `first_batch`; an
    InputError when none could be read (the method would train on nothing, or fail later
    blaming its own input)."""
    read = False
    for batch in batches(domain, preprocess, batch_size, order, workers, device):
        if batch.images is None:
            continue
        if not read and first_batch is not None:
            first_batch(batch.images)
        read = True
        yield batch
    if not read:
        raise InputError(
            f"`source_data` {domain.name}: none of its {len(order)} image(s) could be read; give labelled images "
            f"a decoder reads (PNG, JPEG, ...)"
        )


class LabelledBatches:
    """A source domain's labelled images in batches, prepared as the test images; each
    iteration a new pass in a new order (seeds 1, 2, ...), as a shuffling data loader's."""

    def __init__(
        self,
        domain: Domain,
        preprocess: Preprocessing,
        batch_size: int,
        workers: int,
        device,
        first_batch: FirstBatch | None = None,
    ):
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
        self.first_batch = first_batch
        self.passes = 0

    def __iter__(self):
        self.passes += 1
        order = np.random.default_rng(self.passes).permutation(self.labelled)
        told = self.first_batch if self.passes == 1 else None
        for batch in readable(self.domain, self.preprocess, self.batch_size, order, self.workers, self.device, told):
            labels = torch.as_tensor(self.domain.labels[batch.indices], dtype=torch.int64, device=self.device)
            yield self.preprocess.normalize(batch.images.to(self.device)), labels


def fisher_batches(
    config: AdaptConfig,
    domain: Domain,
    preprocess: Preprocessing,
    device: torch.device,
    first_batch: FirstBatch | None = None,
):
    """EATA's and FOA's source images: `fisher_samples` of `source_data` at random (seed 0), in that
    random order, as the authors' shuffling loader gives them (in file order, each batch of a
    class-folder set was nearly one class, and the Fisher about 12 times the authors'), prepared
    as the test images, in batches of `batch_size` (read once, when the Adapter is built)."""
    if len(domain) == 0:
        raise InputError(f"`source_data` {config.source_data}: no images")
    count = min(config.fisher_samples, len(domain))
    indices = np.random.default_rng(0).choice(len(domain), size=count, replace=False)
    for batch in readable(domain, preprocess, config.batch_size, indices, config.num_workers, device, first_batch):
        yield preprocess.normalize(batch.images.to(device))
