"""What the jobs share: the model as the options name it, the class names in its output
order, and the preprocessing, from the options, an artifact or a bundled model."""

from __future__ import annotations

from pathlib import Path

from cafa_cli.core.errors import InputError, UsageError, listing
from cafa_cli.core.files import image_identity
from cafa_cli.data.benchmarks import imagenet_classes, imagenet_family
from cafa_cli.data.domain import Domain, read_class_list
from cafa_cli.data.outliers import Outliers
from cafa_cli.data.preprocessing import Preprocessing
from cafa_cli.data.sources import on_disk, open_domain
from cafa_cli.data.values import GENERATED_OUTLIERS
from cafa_cli.jobs.config.data import InputOptions, ModelOptions
from cafa_cli.model import hub, libraries
from cafa_cli.model.clip import Prompting
from cafa_cli.model.features import FeatureClassifier
from cafa_cli.model.loading import ModelSpec, bundled_model, checked_model


def recipe(options: InputOptions, model: str | None, changes: dict | None = None) -> Preprocessing:
    """The preprocessing the options give for `model`: its defaults (what the model and the
    weights the options name declare), then the values given (`changes`, when another
    side's geometry applies: bench's test domains). `options` holds the ModelOptions too."""
    changes = options.preprocessing_changes() if changes is None else changes
    return default_preprocessing(model, options.weights, options.model_arguments(), changes)


def default_preprocessing(
    model: str | None, weights: str | None = None, model_args: dict | None = None, changes: dict | None = None
) -> Preprocessing:
    """The bundled model's preprocessing, or the one a timm model or torchvision weights
    named by enum declare (model/hub.py), else ImageNet's at 256/224, bilinear; with the values the
    user gave (`changes`) in place before anything is checked: a timm model made for one
    channel (`in_chans=1`) declares a three-channel mean, which the user's replaces."""
    changes = changes or {}
    bundled = bundled_model(model)
    if bundled:
        return Preprocessing.from_dict(bundled.preprocessing).with_changes(changes)
    declared = libraries.declared_preprocessing(model, weights, model_args or {}) if model else None
    return Preprocessing(**{**(declared or {}), **changes})


def default_class_names(model: str | None, options: InputOptions, data: list[str] = ()) -> list[str] | None:
    """`classes`, the bundled model's list, or for a CLIP model on benchmarks labelled as ImageNet's
    classes (imagenet-c, -v2, -sketch) ImageNet's wnids, which its prompts name; else None."""
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
    if bundled:
        return list(bundled.class_names)
    if model is not None and hub.library_of(model)[0] == "openclip" and imagenet_family(list(data)):
        return list(imagenet_classes())
    return None


def resolve_model(model: ModelOptions, class_names: list[str] | None = None) -> tuple[FeatureClassifier, ModelSpec]:
    """The model the options name, built, its weights loaded and checked (models.checked_model);
    `class_names`, in output order, are what a CLIP model's zero-shot head is made of."""
    prompting = None
    if class_names is not None or model.templates is not None:
        prompting = Prompting(tuple(class_names or ()), model.templates)
    return checked_model(
        model.model,
        model.weights,
        model.num_classes,
        model.classifier,
        model.trust_checkpoint,
        model.model_arguments(),
        prompting,
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


# what to give instead of images that are also test images, by the option that gave them
APART_FIXES = {
    "forgetting": "give a clean domain the stream does not adapt on (e.g. the benchmark's clean test set)",
    "source_data": "give labelled source images none of which is a test image (e.g. the training set)",
    "outliers": "give images from outside the label set, none of which is a test image (another data set, or "
    "noise:gaussian)",
}


def open_outliers(images: str, share: float, tests: list[Domain], together: int = 0) -> Outliers:
    """`outliers`' images (`images`, a share of each stream), opened and checked against the test
    domains (`tests`, each once, as opened): none of them a test image, and enough of them for
    each stream to draw its share without drawing one twice. `together`: how many times every
    test domain goes into one stream (`mix_domains`, with its rounds); 0, each its own."""
    if images in GENERATED_OUTLIERS:
        return Outliers(images, share, noise=images.partition(":")[2])
    source = open_domain(images, option="outliers")
    check_apart("outliers", images, source, tests)
    outliers = Outliers(images, share, source=source)
    counts = {test.name: outliers.count(len(test)) for test in tests}
    if together:
        stream, needed = f"the one stream of {len(tests)} domains", together * sum(counts.values())
    else:
        name = max(counts, key=counts.get, default="")
        stream, needed = f"the stream of {name}", counts.get(name, 0)
    if needed > len(source):
        raise InputError(
            f"`outliers` {images}: {len(source):,} images, and a share of {share:g} mixes {needed:,} into {stream}, "
            f"each image once; give more outlier images, or a lower share"
        )
    return outliers


def check_apart(option: str, spec: str, domain: Domain, tests: list[Domain], fix: str | None = None) -> None:
    """None of `option`'s images (`spec`, opened as `domain`) is one of the test domains'
    images by another name (files.image_identity: the folder again, a relative path, a
    symlinked folder, a folder of symlinked class folders, hard links): forgetting measured on
    the images adapted on, or source images that train on the test labels, would measure the
    test set. A UsageError naming both options, before any statistics or records."""
    arrays: dict[str, tuple] = {}
    tested: dict[tuple, tuple[str, str]] = {}
    for test in tests:
        for ref in test.refs:
            tested.setdefault(image_identity(ref, arrays), (ref, test.name))
    shared = [(ref, tested[key]) for ref in domain.refs if (key := image_identity(ref, arrays)) in tested]
    if not shared:
        return
    ref, (test_ref, test_name) = shared[0]
    example = f"such as {ref}" if ref == test_ref else f"{ref} is {test_ref}"
    raise UsageError(
        f"`{option}` {spec}: {len(shared):,} of its {len(domain):,} images are images of the test domain `data` "
        f"{test_name}, compared as files, not names ({example}); {fix or APART_FIXES[option]}"
    )
