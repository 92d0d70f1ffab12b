"""The `stats` job: stream a stratified subset of training data through the model into
class-conditional Gaussians, and write them as an artifact."""

from __future__ import annotations

from pathlib import Path
import numpy as np
import torch
from cafa_cli.method.gaussians import check_options, estimate
from cafa_cli.method.moments import accumulate_features
from cafa_cli.artifact import DEFAULT_PATH, Artifact, unusable_class_names, write_artifact
from cafa_cli.jobs.distributed import merge_on_root, process_group, rank_device
from cafa_cli.data.domain import Domain, padding_note, relabel
from cafa_cli.data.loading import batches, check_loading, unreadable
from cafa_cli.data.sources import open_domain
from cafa_cli.data.sampling import stratified_subset, subset_sha256
from cafa_cli.errors import InputError, UsageError, listing
from cafa_cli.jobs.outputs import check_outputs
from cafa_cli.method.features import FeatureClassifier
from cafa_cli.models import factory_sha256, parameters_sha256
from cafa_cli.devices import pick_device
from cafa_cli.data.preprocessing import Preprocessing
from cafa_cli.jobs.monitor import Monitor
from cafa_cli.jobs.inputs import DataChoice, ModelChoice, _check_classes, _class_names_of, _skip_warning, check_seed, default_class_names, recorded_data, resolve_model


DEFAULT_FRACTION = 0.05  # of each class's training images: the paper's


def subset_size(fraction: float | None, per_class: int | None) -> tuple[float | None, int | None]:
    """How many training images per class: (fraction, None) or (None, per_class), checked;
    a fraction of 0.05 when neither is given."""
    if fraction is not None and per_class is not None:
        raise UsageError("--fraction and --per-class both say how many training images to use; give one of them")
    if per_class is not None:
        if per_class < 2:
            raise UsageError(f"--per-class must be at least 2, not {per_class}")
        return None, per_class
    fraction = DEFAULT_FRACTION if fraction is None else fraction
    if not 0 < fraction <= 1:
        raise UsageError(f"--fraction must be in (0, 1], not {fraction}")
    return fraction, None


def compute_statistics(
    data: str,
    out: str | Path = DEFAULT_PATH,
    model: ModelChoice = ModelChoice(model="resnet50"),
    data_choice: DataChoice = DataChoice(),
    fraction: float | None = None,
    per_class: int | None = None,
    seed: int = 0,
    covariance: str = "auto",
    shrinkage: float | str = "auto",
    device: str = "auto",
    batch_size: int = 128,
    num_workers: int | None = None,
    strict: bool = False,
    monitor: Monitor | None = None,
) -> Artifact | None:
    """Stream a stratified subset of `data` through the model; write the artifact.

    Under torchrun the subset is sharded across ranks; rank 0 merges, writes and
    returns the artifact, the other ranks return None.
    """
    monitor = monitor or Monitor()
    fraction, per_class = subset_size(fraction, per_class)
    check_options(covariance, shrinkage)
    check_seed(seed)  # these before any model or data is read, and before any output is written
    check_loading(batch_size, num_workers)
    check_outputs({"--out": str(out)}, {"--weights": model.weights, "--classes": data_choice.classes_file,
                                        "--labels": data_choice.labels, "--data": data})
    target = pick_device(device)
    preprocess = data_choice.recipe(model.model)
    net, spec = resolve_model(model)
    fingerprint = parameters_sha256(net.model)  # before the data, which can take hours
    domain, class_names = _training_domain(data, data_choice, model.model, net, preprocess, monitor)
    indices = stratified_subset(domain.labels, class_names, fraction, per_class, seed)
    if per_class:
        _warn_short_classes(domain.labels, class_names, per_class, monitor)
    target = rank_device(target)
    with process_group(target) as (rank, world):
        moments = _accumulate(net.to(target), domain, preprocess, indices[rank::world], class_names, target,
                              batch_size, num_workers, strict, monitor if rank == 0 else Monitor())
        moments = merge_on_root(moments, rank, world)
    if moments is None:  # not rank 0: rank 0 writes the artifact
        return None
    gaussians = estimate(moments, covariance, shrinkage, class_names)
    sampling = {"data": recorded_data(data), "fraction": fraction, "per_class": per_class, "seed": seed,
                "images_sha256": subset_sha256(domain, indices), "batch_size": batch_size, "skipped_images": moments.skipped_images}
    return write_artifact(out, gaussians, class_names, spec, preprocess, sampling, fingerprint, factory_sha256(spec.model))


def _warn_short_classes(labels: np.ndarray, class_names: list[str], per_class: int, monitor: Monitor) -> None:
    counts = np.bincount(labels[labels >= 0], minlength=len(class_names))
    short = [f"{name} ({counts[c]})" for c, name in enumerate(class_names) if counts[c] < per_class]
    if short:
        monitor.warn(f"--per-class {per_class}: fewer images in {listing(short)}; all of theirs are used")


def sample_sha256(data: str, model: ModelChoice, data_choice: DataChoice, fraction: float | None, per_class: int | None, seed: int) -> str:
    """The `images_sha256` compute_statistics would record for these arguments, found
    without the feature pass: whether an artifact holds this sample of the data as it is now."""
    fraction, per_class = subset_size(fraction, per_class)
    net, _ = resolve_model(model)
    domain, class_names = _training_domain(data, data_choice, model.model, net, data_choice.recipe(model.model), Monitor())
    return subset_sha256(domain, stratified_subset(domain.labels, class_names, fraction, per_class, seed))


def _training_domain(
    data: str, data_choice: DataChoice, model: str, net: FeatureClassifier, preprocess: Preprocessing, monitor: Monitor,
) -> tuple[Domain, list[str]]:
    """The labelled training data and its class names in the model's output order."""
    class_names = default_class_names(model, data_choice)
    domain = open_domain(data, class_names, data_choice.labels, data_choice.severity)
    for note in [*domain.notes, padding_note(domain, preprocess)]:
        if note:
            monitor.warn(note)
    if len(domain.labels) and (domain.labels < 0).all():
        raise InputError(
            f"--data {data} has no labels (unlabelled images), and class statistics need them; give a folder "
            f"with one subfolder of images per class, or an array with --labels"
        )
    if class_names is None:
        class_names = _class_names_of([domain], net)
        domain = relabel(domain, class_names)
    _check_classes(net, class_names, f"--data {data}")
    unusable = unusable_class_names(class_names)
    if unusable:  # before the feature pass, not when the artifact is checked at its end
        raise InputError(f"class name(s) {listing(repr(name) for name in unusable)} cannot go into the predictions (blank, "
                         f"or with a line break); rename those class folders (or --classes lines)")
    return domain, class_names


def _accumulate(net, domain, preprocess, indices, class_names, target, batch_size, num_workers, strict, monitor):
    labels = torch.as_tensor(domain.labels)
    monitor.start("stats", len(indices))

    skipped = 0

    def on_batch(batch):
        nonlocal skipped
        for ref, why in unreadable(domain, batch, strict):
            skipped += 1
            monitor.warn(_skip_warning(ref, why))
        monitor.advance(len(batch.indices) + len(batch.failures))

    def net_on_pixels(pixels):
        return net(preprocess.normalize(pixels))

    loader = batches(domain, preprocess, batch_size, indices, num_workers, target)
    gathered = accumulate_features(net_on_pixels, loader, labels, len(class_names), net.feature_dim, target, on_batch)
    gathered.skipped_images = skipped
    return gathered
