"""What the jobs share: the model as the options name it, the class names in its output
order, and the preprocessing, from the options, an artifact or a bundled model."""

from __future__ import annotations

from pathlib import Path

import torch

from cafa_cli import hub
from cafa_cli.data.domain import Domain, read_class_list
from cafa_cli.data.preprocessing import Preprocessing
from cafa_cli.data.sources import on_disk
from cafa_cli.errors import InputError, UsageError, listing
from cafa_cli.factories import is_factory
from cafa_cli.jobs.config.data import InputOptions, ModelOptions
from cafa_cli.method.features import FeatureClassifier
from cafa_cli.models import ModelSpec, bundled_model, resolve


def recipe(options: InputOptions, model: str | None, changes: dict | None = None) -> Preprocessing:
    """The preprocessing the options give for `model`: its defaults (what the model and the
    weights the options name declare), then the values given (`changes`, when another
    side's geometry applies: bench's test domains). `options` holds the ModelOptions too."""
    declared = default_preprocessing(model, options.weights, options.model_arguments())
    return declared.with_changes(options.preprocessing_changes() if changes is None else changes)


def default_preprocessing(
    model: str | None, weights: str | None = None, model_args: dict | None = None
) -> Preprocessing:
    """The bundled model's preprocessing, or the one a timm model or torchvision weights
    named by enum declare (hub.py), else ImageNet's at 256/224, bilinear."""
    bundled = bundled_model(model)
    if bundled:
        return Preprocessing.from_dict(bundled.preprocessing)
    declared = hub.declared_preprocessing(model, weights, model_args or {}) if model else None
    return Preprocessing(**declared) if declared else Preprocessing()


def default_class_names(model: str | None, options: InputOptions) -> list[str] | None:
    bundled = bundled_model(model)
    if options.classes:
        names = read_class_list(options.classes)
        if bundled and names != list(bundled.class_names) and sorted(names) == sorted(bundled.class_names):
            # the same names in another order would label every output wrongly, silently
            raise InputError(
                f"the class list {options.classes} holds {model}'s class names in another order; its outputs "
                f"are {listing(bundled.class_names, 3)}, in that order: give them so, or leave out `classes`"
            )
        return names
    return list(bundled.class_names) if bundled else None


def resolve_model(model: ModelOptions) -> tuple[FeatureClassifier, ModelSpec]:
    net, spec = resolve(
        model.model, model.weights, model.num_classes, model.classifier, model.trust_checkpoint, model.model_arguments()
    )
    if spec.weights is None and not is_factory(spec.model) and bundled_model(spec.model) is None:
        # torchvision's and timm's own initialisation is random: statistics and adaptation
        # would each see another network, and no result could be reproduced
        raise UsageError(
            f"`model` {spec.model} without `weights` is an untrained network with random weights, different in "
            f"every run; give `weights` FILE (a state dict of this architecture), or pretrained weights by name from "
            f"the local cache (IMAGENET1K_V2, a timm tag)"
        )
    _check_parameters(net.model)
    return net, spec


def _check_parameters(model: torch.nn.Module) -> None:
    """float32 values, all finite: other dtypes meet float32 images and fail with a message
    about the input, and NaN weights make every prediction NaN, with exit 0."""
    kinds = {
        "meta" if p.is_meta else str(p.dtype).removeprefix("torch.")
        for p in model.parameters()
        if p.is_floating_point() or p.is_meta
    }
    if kinds - {"float32"}:
        raise InputError(
            f"the model's parameters are {listing(sorted(kinds))}, not float32; return a float32 model "
            f"(model.float(), with its values) — mixed precision on CUDA is `precision` bf16 or fp16"
        )
    broken = [
        name
        for name, tensor in model.state_dict().items()
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())
    ]
    if broken:
        raise InputError(
            f"the model's weights hold NaN or infinite values in {listing(broken)}; "
            f"the checkpoint is damaged or was saved after training diverged: use another"
        )
    # a variance below 0 normalises to NaN: every prediction of a method on the source
    # statistics would be NaN, which a check of the outputs would blame on `mean`/`std`
    negative = [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm)
        and module.running_var is not None
        and bool((module.running_var < 0).any())
    ]
    if negative:
        raise InputError(
            f"the model's BatchNorm running variances are negative in {listing(negative)}; the checkpoint "
            f"is damaged (a variance is never below 0): use another"
        )


def _class_names_of(domains: list[Domain], net: FeatureClassifier) -> list[str]:
    """The class list when no artifact, --classes or bundled model gives one: the sorted
    class folders; else the model's output indices, as arrays label by index (a test
    array may lack the last classes) and unlabelled data has none."""
    folders = [d.class_names for d in domains if d.class_names and not d.indexed_labels]
    if any(names != folders[0] for names in folders):
        raise InputError("the `data` folders have different class folders; give the class list with `classes`")
    return folders[0] if folders else [str(i) for i in range(net.num_classes)]


def _check_classes(
    model: FeatureClassifier,
    class_names: list[str],
    where: str,
    fix: str = "check `num_classes`, or give the class list in output order with `classes`",
) -> None:
    if model.num_classes != len(class_names):
        raise InputError(
            f"{where} has {len(class_names)} classes but the model's classifier has {model.num_classes} outputs; {fix}"
        )


def _skip_warning(ref: str, why: str) -> str:
    return f"skipped unreadable image {ref} ({why})"


def recorded_data(data: str) -> str:
    """Record a folder or file as an absolute path (`cifar10:/abs/root` for a training set's
    ROOT), so that the artifact can be followed from anywhere and bench's re-use check
    tells two training sets under the same relative path apart."""
    location = on_disk(data)
    if location == data:
        return str(Path(data).resolve()) if Path(data).exists() else data
    return data[: -len(location)] + str(Path(location).resolve())
