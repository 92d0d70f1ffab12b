"""The `stats` job: stream a stratified subset of training data through the model into
class-conditional Gaussians, and write them as an artifact."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from cafa_cli.artifact.format import unusable_class_names
from cafa_cli.artifact.store import Artifact, write_artifact
from cafa_cli.core.devices import pick_device
from cafa_cli.core.environment import environment
from cafa_cli.core.errors import InputError, UsageError, listing
from cafa_cli.data.domain import Domain, padding_note, relabel
from cafa_cli.data.loading import batches, unreadable
from cafa_cli.data.preprocessing import Preprocessing
from cafa_cli.data.sampling import file_stamps, source_files, stratified_subset, subset_sha256
from cafa_cli.data.sources import open_domain
from cafa_cli.data.subsets import ClassSubset, narrow, read_class_subset
from cafa_cli.jobs.config import StatsConfig
from cafa_cli.jobs.shared.distributed import merge_on_root, process_group, rank_device
from cafa_cli.jobs.shared.inputs import (
    _check_classes,
    _class_names_of,
    _skip_warning,
    default_class_names,
    recipe,
    recorded_data,
    resolve_model,
)
from cafa_cli.jobs.shared.monitor import Monitor
from cafa_cli.jobs.shared.outputs import check_outputs, guards_outputs
from cafa_cli.model.clip import ZeroShotClassifier
from cafa_cli.model.features import FeatureClassifier
from cafa_cli.model.loading import factory_sha256, parameters_sha256
from cafa_cli.statistics.gaussians import estimate, text_gaussians
from cafa_cli.statistics.moments import NormInputMoments, accumulate_features


@guards_outputs
def compute_statistics(config: StatsConfig, monitor: Monitor | None = None) -> Artifact | None:
    """Stream a stratified subset of `config.data` through the model; write the artifact.

    Under torchrun the subset is sharded across ranks; rank 0 merges, writes and
    returns the artifact, the other ranks return None.
    """
    monitor = monitor or Monitor()
    fraction, per_class = config.training_sample()
    shrinkage = config.shrinkage_value()
    # before any model or data is read, and before any output is written
    check_outputs(config.outputs(), config.inputs())
    target = pick_device(config.device)
    preprocess = recipe(config, config.model)
    net, spec = resolve_model(config, default_class_names(config.model, config))
    fingerprint = parameters_sha256(net.model)  # before the data, which can take hours
    if config.from_text:
        return _statistics_from_text(config, net, spec, preprocess, fingerprint, target)
    domain, class_names, subset = _training_domain(config, net, preprocess, monitor)
    indices = stratified_subset(domain.labels, class_names, fraction, per_class, config.seed)
    # taken before the images are read: one edited while they are is then edited since
    stamps = file_stamps(source_files(domain, indices, config.data))
    if per_class:
        _warn_short_classes(domain.labels, class_names, per_class, monitor)
    target = rank_device(target)
    with process_group(target) as (rank, world):
        moments = _accumulate(
            net.to(target),
            domain,
            preprocess,
            indices[rank::world],
            class_names,
            target,
            config,
            monitor if rank == 0 else Monitor(),
        )
        moments = merge_on_root(moments, rank, world)
    if moments is None:  # not rank 0: rank 0 writes the artifact
        return None
    gaussians = estimate(moments, config.covariance, shrinkage, class_names)
    sampling = {
        "data": recorded_data(config.data),
        "fraction": fraction,
        "per_class": per_class,
        "seed": config.seed,
        "images_sha256": subset_sha256(domain, indices),
        "file_stamps": stamps,
        "batch_size": config.batch_size,
        "skipped_images": moments.skipped_images,
        "input_size": getattr(moments, "input_size", None),
    }
    norm_moments = moments.norm_inputs.moments() if moments.norm_inputs is not None else None
    if config.norm_moments and not norm_moments:
        monitor.warn(
            "`norm_moments`: the model has no BatchNorm layers, so there are no class moments of their inputs to record"
        )
    return write_artifact(
        config.out,
        gaussians,
        class_names,
        spec,
        preprocess,
        sampling,
        fingerprint,
        factory_sha256(spec.model),
        subset.model_classes if subset else None,
        subset.outputs if subset else None,
        norm_moments or None,
        environment(target),
    )


def _statistics_from_text(config: StatsConfig, net: FeatureClassifier, spec, preprocess, fingerprint, target):
    """The artifact of text_gaussians: the class embeddings are the directions of the zero-shot
    head's rows (model/clip.py), so no text is encoded again here."""
    if not isinstance(net.model, ZeroShotClassifier):
        raise UsageError(
            f"`from_text` takes the class means from a CLIP model's text embeddings, and {config.model} is not "
            f"a CLIP model; give training images with `data`"
        )
    class_names = default_class_names(config.model, config) or list(net.model.class_names or [])
    if config.classes:
        _check_classes(net, class_names, f"the class list {config.classes}", "give a name a line for every output")
    texts = net.model.text
    sampling = {
        "from_text": {
            "class_names": list(texts.class_names) if texts else None,
            "templates": list(texts.templates) if texts else None,
        }
    }
    return write_artifact(
        config.out,
        text_gaussians(net.class_weights().detach()),
        class_names,
        spec,
        preprocess,
        sampling,
        fingerprint,
        factory_sha256(spec.model),
        environment=environment(target),
    )


def _warn_short_classes(labels: np.ndarray, class_names: list[str], per_class: int, monitor: Monitor) -> None:
    counts = np.bincount(labels[labels >= 0], minlength=len(class_names))
    short = [f"{name} ({counts[c]})" for c, name in enumerate(class_names) if counts[c] < per_class]
    if short:
        monitor.warn(f"`per_class` {per_class}: fewer images in {listing(short)}; all of theirs are used")


class Sample(NamedTuple):
    """The sample an artifact made now would hold, by the keys compute_statistics records."""

    images_sha256: str  # which images: their paths (rows) and labels
    file_stamps: str | None  # the sizes and modification times of the files they are read from
    images: int
    files: list[str] | None


def sample_keys(config: StatsConfig) -> Sample:
    """The `images_sha256` and `file_stamps` compute_statistics would record for
    this config, found without the feature pass (one stat a file, nothing read): whether an
    artifact holds this sample of the data as it is now."""
    fraction, per_class = config.training_sample()
    net, _ = resolve_model(config, default_class_names(config.model, config))
    domain, class_names, _ = _training_domain(config, net, recipe(config, config.model), Monitor())
    indices = stratified_subset(domain.labels, class_names, fraction, per_class, config.seed)
    files = source_files(domain, indices, config.data)
    return Sample(subset_sha256(domain, indices), file_stamps(files), len(indices), files)


def _training_domain(
    config: StatsConfig, net: FeatureClassifier, preprocess: Preprocessing, monitor: Monitor
) -> tuple[Domain, list[str], ClassSubset | None]:
    """The labelled training data and its class names in the model's output order; with a
    `class_subset`, the images of its classes only, its names, and the subset."""
    data = config.data
    class_names = default_class_names(config.model, config)
    if config.classes:  # the list itself first: the folders are named against it next
        _check_classes(
            net, class_names, f"the class list {config.classes}", "give a name a line for every output, in output order"
        )
    domain = open_domain(data, class_names, config.labels, config.severity)
    for note in [*domain.notes, padding_note(domain, preprocess)]:
        if note:
            monitor.warn(note)
    if len(domain.labels) and (domain.labels < 0).all():
        raise InputError(
            f"`data` {data} has no labels (unlabelled images), and class statistics need them; give a folder "
            f"with one subfolder of images per class, or an array with `labels`"
        )
    if class_names is None:
        class_names = _class_names_of([domain], net)
        domain = relabel(domain, class_names)
        _check_classes(net, class_names, f"`data` {data}")
    unusable = unusable_class_names(class_names)
    if unusable:  # before the feature pass, not when the artifact is checked at its end
        raise InputError(
            f"class name(s) {listing(repr(name) for name in unusable)} cannot go into the predictions (blank, "
            f"or with a line break); rename those class folders (or `classes` lines)"
        )
    if not config.class_subset:
        return domain, class_names, None
    subset = read_class_subset(config.class_subset, class_names)
    return narrow(domain, subset, drop_others=True), subset.names, subset


def _accumulate(net, domain, preprocess, indices, class_names, target, config: StatsConfig, monitor):
    labels = torch.as_tensor(domain.labels)
    monitor.start("stats", len(indices))

    skipped, input_size = 0, None
    norm_inputs = NormInputMoments(net.model, len(class_names), target) if config.norm_moments else None

    def on_batch(batch):
        nonlocal skipped, input_size
        if (
            input_size is None and batch.images is not None
        ):  # [height, width] entering the model: adapt compares its own
            input_size = list(batch.images.shape[-2:])
        if norm_inputs is not None and batch.images is not None:
            norm_inputs.update(labels[batch.indices])
        for ref, why in unreadable(domain, batch, config.strict):
            skipped += 1
            monitor.warn(_skip_warning(ref, why))
        monitor.advance(len(batch.indices) + len(batch.failures))

    def net_on_pixels(pixels):
        return net(preprocess.normalize(pixels))

    loader = batches(domain, preprocess, config.batch_size, indices, config.num_workers, target)
    gathered = accumulate_features(net_on_pixels, loader, labels, len(class_names), net.feature_dim, target, on_batch)
    gathered.skipped_images, gathered.input_size = skipped, input_size
    if norm_inputs is not None:
        norm_inputs.close()
        gathered.norm_inputs = norm_inputs
    return gathered
