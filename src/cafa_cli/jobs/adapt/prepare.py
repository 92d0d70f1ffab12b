"""Preparing an `adapt` job: the model and its statistics read and checked against each
other, the test domains opened against the model's classes, the recipe applied, the
Adapter built, and every setting the results depend on recorded for the metrics JSON."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from cafa_cli import DEFAULT_ARTIFACT
from cafa_cli.artifact.provenance import model_mismatch, recorded_model
from cafa_cli.artifact.store import Artifact, read_artifact
from cafa_cli.core.devices import pick_device
from cafa_cli.core.errors import InputError, UsageError, WouldOverwrite, repeated
from cafa_cli.core.files import absolute
from cafa_cli.data import ccc
from cafa_cli.data.benchmarks import DEFAULT_SEVERITY, expand_benchmarks, has_severities, source_of
from cafa_cli.data.domain import Domain, relabel
from cafa_cli.data.loading import loader_processes
from cafa_cli.data.orders import check_labels
from cafa_cli.data.outliers import Outliers
from cafa_cli.data.preprocessing import Preprocessing
from cafa_cli.data.sources import gradual_stages, open_domain
from cafa_cli.data.subsets import ClassSubset, keep_listed, narrow, read_image_ids
from cafa_cli.data.values import GENERATED_OUTLIERS
from cafa_cli.engine.adapter import Adapter
from cafa_cli.engine.method import Method
from cafa_cli.engine.options import check_precision, resolve_options
from cafa_cli.jobs.adapt.class_subset import class_subset, norm_moments_of, statistics_of
from cafa_cli.jobs.adapt.job import Adaptation, _geometry
from cafa_cli.jobs.adapt.source_images import size_check, source_images
from cafa_cli.jobs.config import AdaptConfig
from cafa_cli.jobs.config.settings import recorded_values
from cafa_cli.jobs.shared.clean import clean_error
from cafa_cli.jobs.shared.inputs import (
    _check_classes,
    _class_names_of,
    check_apart,
    default_class_names,
    default_preprocessing,
    open_outliers,
    recorded_data,
    resolve_model,
)
from cafa_cli.jobs.shared.monitor import Monitor
from cafa_cli.methods import create, is_plugin, method_class, options_of
from cafa_cli.methods.recipes import Recipe, recipe_for, standard_model
from cafa_cli.model.checkpoints import UntrustedCheckpoint
from cafa_cli.model.features import FeatureClassifier
from cafa_cli.model.loading import ModelSpec, canonical_model, parameters_sha256


def load_for_adaptation(config: AdaptConfig) -> tuple[FeatureClassifier, Artifact | None, ModelSpec]:
    """The model (from the artifact unless overridden) and the artifact, checked against each other."""
    stats, model, method = config.stats, config, config.method
    artifact = None
    stats_path = DEFAULT_ARTIFACT if stats is None else stats
    needed = needs_artifact(config)
    check_model_and_artifact_named(config)
    if stats is not None or needed or model.model is None:
        # else only its model record is used. The Gaussians (GBs at ImageNet scale) are loaded for the methods
        # that use them, and for a plug-in whenever an artifact is read; the class moments come with any read
        artifact = read_artifact(stats_path, load_tensors=is_plugin(method) or method_class(method).needs_statistics)
    named_by_artifact = model.model is None
    if artifact is not None and (named_by_artifact or canonical_model(model.model) == artifact.model.model):
        model = recorded_model(artifact, model)
    class_names = artifact.model_class_names if artifact else default_class_names(model.model, config, config.data)
    try:
        net, spec = resolve_model(model, class_names)
    except UntrustedCheckpoint:
        if config.weights is not None or config.trust_checkpoint:
            raise
        # the user named no weights: do not invite them to trust a file the artifact chose
        raise InputError(
            f"{artifact.path} names the weights {model.weights}, which hold Python objects beyond tensors "
            f"(unpickling them can run code); re-save them as a state dict (.safetensors) and give them "
            f"with `weights`"
        ) from None
    except UsageError as error:
        if not named_by_artifact or isinstance(error, WouldOverwrite):
            raise
        # the user gave no `model`: say where the name came from
        raise InputError(f"the model recorded in {artifact.path}: {error}") from None
    if artifact is not None:
        if net.feature_dim != artifact.feature_dim:
            raise InputError(
                f"the model's features have {net.feature_dim} dimensions but {artifact.path} was made for "
                f"{artifact.feature_dim}; recompute the statistics for this model"
            )
        _check_classes(
            net,
            artifact.model_class_names,
            artifact.path,
            "check `model` and `num_classes`, or compute statistics for this model with cafa stats",
        )
        if not config.allow_weights_mismatch:
            mismatch = model_mismatch(artifact, spec, net)
            if mismatch:
                raise InputError(
                    f"{mismatch}; compute statistics for it with cafa stats, or pass `allow_weights_mismatch`"
                )
    return net, artifact, spec


def check_model_and_artifact_named(config: AdaptConfig) -> None:
    """Refuse a run that names no model (no `model`, and no artifact to name it) or that needs
    an artifact where none is given or here; before anything is read."""
    stats_path = DEFAULT_ARTIFACT if config.stats is None else config.stats
    needed = needs_artifact(config)
    if config.model is None and config.stats is None and not needed and not Path(stats_path).exists():
        standard = standard_model(config.data)
        hint = f" (the standard model of {standard[0]}: `model` {standard[1]})" if standard else ""
        raise UsageError(
            f"give the model with `model` (and `weights`){hint}: `method` {config.method} needs no statistics, "
            f"and there is no {stats_path} to name it"
        )
    if config.stats is None and needed and not Path(stats_path).exists() and not Path(stats_path).is_symlink():
        raise InputError(missing_default_artifact(config))


def needs_artifact(config: AdaptConfig) -> bool:
    """Whether the run must read an artifact: for the method's class Gaussians, or for the
    class moments of the BatchNorms' inputs that `norm` class-balanced corrects with."""
    return method_class(config.method).needs_statistics or config.norm.class_balanced


def missing_default_artifact(config: AdaptConfig) -> str:
    """The error for a run that needs an artifact, given none, with no cafa-stats.safetensors
    here: it says what needs one, since with `model` given a user expects none to be read."""
    create = "cafa stats --norm-moments" if config.norm.class_balanced else "cafa stats"
    why = (
        f"`method` {config.method} needs its class statistics"
        if method_class(config.method).needs_statistics
        else "`norm` class-balanced needs the class moments it records"
    )
    return (
        f"{DEFAULT_ARTIFACT}: no such artifact; create one with {create}, or give the path of one with `stats` ({why})"
    )


def unread_default_artifact(config: AdaptConfig, preprocess: Preprocessing) -> str | None:
    """A warning for `cafa adapt --model M --method bn` (no --stats) beside a cafa-stats.safetensors
    that it does not read: the run then takes the default preprocessing and class names,
    not the artifact's, which for a model trained otherwise is silently another input."""
    stats, model, method = config.stats, config.model, config.method
    if stats is not None or model is None or needs_artifact(config) or not Path(DEFAULT_ARTIFACT).is_file():
        return None
    return (
        f"{DEFAULT_ARTIFACT} is here but not read (with `model`, a method that needs no statistics reads an artifact "
        "only when "
        f"named), so `method` {method} uses {_geometry(preprocess)}, mean {list(preprocess.mean)}, std "
        f"{list(preprocess.std)} "
        f"and the model's or the data's class names; pass `stats` {DEFAULT_ARTIFACT} to use the artifact's"
    )


FIX_CLASSES = "check `num_classes`, or give the class list in output order with `classes`"
FEWER_CLASSES = (
    f"{FIX_CLASSES}; for a test set of some of the model's classes (ImageNet-R's or ImageNet-A's 200 of 1,000) "
    f"give `classes` and the test set's classes as `class_subset` (docs/guides/benchmarks.md, ImageNet-R)"
)


def prepare_adaptation(config: AdaptConfig, monitor: Monitor | None = None) -> Adaptation:
    """The model, its statistics and the test domains, checked against each other, then the
    method and its Adapter, and every setting recorded: the steps below, in this order (each
    error is found at its step, before anything later is read). The monitor shows the
    progress of the `clean` pass."""
    if not config.data:
        raise UsageError("give at least one `data` PATH")
    device = checked_device(config)
    net, artifact, spec = load_for_adaptation(config)
    config, recipe = settled_config(config, net, artifact)
    preprocess = stream_preprocessing(config, artifact, spec)
    data = open_data(config, net, artifact, spec)
    clean = clean_error_of(config, net, artifact, preprocess, data, device, monitor)
    if config.ccc:
        data.domains = ccc_streams(config, net, preprocess, data.domains, device)
    method = build_method(config, recipe, artifact, data, preprocess, device, monitor)
    adapter = build_adapter(config, net, method, device, artifact, data.subset)
    return Adaptation(
        adapter,
        data.domains,
        preprocess,
        data.class_names,
        config,
        recorded_settings(config, device, artifact, spec, preprocess, data.subset, recipe, method),
        statistics_preprocess=artifact.preprocessing if artifact else None,
        statistics_sampling=artifact.sampling if artifact else None,
        groups=data.groups,
        notes=data.notes,
        clean=clean,
        recipe=recipe,
        forgetting=data.forgetting,
        outliers=data.outliers,
    )


def checked_device(config: AdaptConfig) -> torch.device:
    """The device the run takes, and the precision checked against it, before the model is read."""
    device = pick_device(config.device)
    check_precision(config.precision, device.type)
    return device


def settled_config(
    config: AdaptConfig, net: FeatureClassifier, artifact: Artifact | None
) -> tuple[AdaptConfig, Recipe | None]:
    """The settings with the recipe's in place of those the user did not choose (the recipe
    `auto` picks needs the model's class count), and the checks that wait for them."""
    config, recipe = with_recipe(config, net.num_classes)
    config.check_state_reset(origin_of("reset", config, recipe))
    if artifact and config.classes:
        raise UsageError(
            "`classes` names the outputs of a model run without statistics; with an artifact, cafa adapt takes its "
            "class list (cafa stats `classes` sets it): drop `classes`"
        )
    return config, recipe


def stream_preprocessing(config: AdaptConfig, artifact: Artifact | None, spec: ModelSpec) -> Preprocessing:
    """How the test images are prepared: the artifact's preprocessing (else the model's
    defaults) with the options given changed."""
    changes = config.preprocessing_changes()  # each checked by itself: no word about where the others came from
    try:
        if artifact:
            return artifact.preprocessing.with_changes(changes)
        return default_preprocessing(spec.model, spec.weights, config.model_arguments(), changes)
    except UsageError as error:
        source = artifact.path if artifact else f"the defaults of {spec.model}"
        raise UsageError(f"{error} (the options not given come from {source}: give them too)") from None


@dataclass
class OpenedData:
    """The domains a run reads (open_data), opened against the model's classes."""

    domains: list[Domain]  # the test domains in stream order (`gradual` visits a severity twice)
    opened: list[Domain]  # each test domain once, as opened
    class_names: list[str]  # the names of the classes predicted among, in output order
    model_classes: list[str] | None  # the model's own class names, when known before the data is read
    subset: ClassSubset | None  # `class_subset`: the model's outputs predicted among
    ids: tuple[str, set[str]] | None  # `subset`: the file and the image ids kept
    groups: list[int] | None  # `gradual`: the corruption of each domain
    notes: list[str]  # what opening the data noticed
    forgetting: Domain | None = None  # `forgetting`'s clean domain
    source: Domain | None = None  # `source_data`, for a method that takes source images
    outliers: Outliers | None = None  # `outliers`: the images from outside the label set mixed in

    @property
    def model_class_names(self) -> list[str]:
        """The model's class names, else those found in the test data."""
        return self.model_classes or self.class_names


def open_data(config: AdaptConfig, net: FeatureClassifier, artifact: Artifact | None, spec: ModelSpec) -> OpenedData:
    """The test domains, opened against the model's classes (of the `class_subset`, to which the
    model's outputs are then narrowed) and checked before any prediction is written, then the
    `forgetting` domain and the `source_data` images."""
    model_classes = artifact.model_class_names if artifact else default_class_names(spec.model, config, config.data)
    subset = class_subset(config, artifact, model_classes)
    paths, groups, notes = stream_domains(config)
    ids = (config.subset, read_image_ids(config.subset)) if config.subset else None
    opened = {
        path: open_test_domain(path, config.labels, config.severity, model_classes, subset, ids, notes)
        for path in dict.fromkeys(paths)
    }
    check_domain_labels(config, list(opened.values()))
    class_names, domains = settled_class_names(
        config, net, artifact, spec, model_classes, subset, [opened[path] for path in paths]
    )
    if subset:
        net.restrict_outputs(subset.outputs)
    data = OpenedData(domains, list(opened.values()), class_names, model_classes, subset, ids, groups, notes)
    data.forgetting = open_forgetting(config, data)
    data.source = open_source(config, data)
    if config.outliers is not None:
        together = config.rounds if config.mix_domains and len(paths) * config.rounds > 1 else 0
        data.outliers = open_outliers(*config.outlier_source(), data.opened, together)
    return data


def check_domain_labels(config: AdaptConfig, domains: list[Domain]) -> None:
    """Each domain's labels can be streamed in `order`, and with `oracle` every image has one."""
    for domain in domains:
        check_labels(domain.labels, config.order, domain.name)
        if config.oracle:
            check_oracle_labels(domain.name, domain.labels)


def settled_class_names(
    config: AdaptConfig,
    net: FeatureClassifier,
    artifact: Artifact | None,
    spec: ModelSpec,
    model_classes: list[str] | None,
    subset: ClassSubset | None,
    domains: list[Domain],
) -> tuple[list[str], list[Domain]]:
    """The names of the classes predicted among (the subset's, the model's, else the data's,
    the domains then labelled by them), checked against the model's outputs; and the domains."""
    class_names = subset.names if subset else model_classes
    if class_names is None:
        class_names = _class_names_of(domains, net)
        domains = [relabel(d, class_names) for d in domains]
        _check_classes(
            net, class_names, "the data", FEWER_CLASSES if len(class_names) < net.num_classes else FIX_CLASSES
        )
    elif artifact is None:  # the artifact's list was checked with it
        _check_classes(
            net, model_classes, f"the class list {config.classes}" if config.classes else f"{spec.model}'s class list"
        )
    return class_names, domains


def open_forgetting(config: AdaptConfig, data: OpenedData) -> Domain | None:
    """`forgetting`'s clean domain, predicted by the adapted model as a test domain is (the test
    images' preprocessing), apart from the test domains; None without it."""
    if not config.forgetting:
        return None
    forgetting = open_test_domain(
        config.forgetting,
        None,
        None,
        data.model_class_names,
        data.subset,
        None,
        data.notes,
        option="forgetting",
    )
    check_apart("forgetting", config.forgetting, forgetting, data.opened)
    return forgetting


def open_source(config: AdaptConfig, data: OpenedData) -> Domain | None:
    """`source_data`, for a method that takes labelled source images, apart from the test domains; else None."""
    if not (method_class(config.method).without_source_images and config.source_data):
        return None
    source = open_domain(config.source_data, option="source_data")
    check_apart("source_data", config.source_data, source, data.opened)
    return source


def clean_error_of(
    config: AdaptConfig,
    net: FeatureClassifier,
    artifact: Artifact | None,
    preprocess: Preprocessing,
    data: OpenedData,
    device: torch.device,
    monitor: Monitor | None,
) -> dict | None:
    """The source model's error on `clean`, before the Adapter changes it, its images prepared as
    the statistics' training images were; None without `clean`."""
    if not config.clean:
        return None
    domain = open_test_domain(
        config.clean, None, None, data.model_class_names, data.subset, data.ids, data.notes, clean=True, option="clean"
    )
    return clean_error(
        net,
        domain,
        artifact.preprocessing if artifact else preprocess,
        config.batch_size,
        config.num_workers,
        device,
        config.strict,
        monitor or Monitor(),
    )


# each CCC pair's grid of source accuracies, measured once a process (a bench's rows share them), by what
# they depend on (ccc_streams)
_CCC_GRIDS: dict[tuple, dict] = {}


def ccc_streams(
    config: AdaptConfig, net: FeatureClassifier, preprocess: Preprocessing, domains: list[Domain], device: torch.device
) -> list[Domain]:
    """Each domain as the CCC stream of `ccc` images made from its clean images, the walks measured on
    the source model (eval mode, before the Adapter changes it) as the stream's images are prepared."""

    def accuracy(domain: Domain) -> float:
        measured = clean_error(
            net, domain, preprocess, config.batch_size, config.num_workers, device, config.strict, Monitor()
        )
        return 1 - measured["error"]

    made = {}  # a domain visited twice (`rounds`) is one stream
    weights = parameters_sha256(net)
    for domain in domains:
        if id(domain) not in made:
            # the grids depend on the model's values, how its images are prepared, the clean images and the seed
            measured = (weights, repr(preprocess), domain.name, tuple(domain.refs), config.seed, ccc.CALIBRATION_IMAGES)
            made[id(domain)] = ccc.ccc_domain(
                domain,
                config.ccc,
                config.ccc_speed,
                config.ccc_accuracy / 100,
                config.seed,
                accuracy,
                grids=_CCC_GRIDS.setdefault(measured, {}),
            )
    return [made[id(domain)] for domain in domains]


def build_method(
    config: AdaptConfig,
    recipe: Recipe | None,
    artifact: Artifact | None,
    data: OpenedData,
    preprocess: Preprocessing,
    device: torch.device,
    monitor: Monitor | None,
) -> Method:
    """The method: the statistics of the classes predicted among, the recipe's options with the
    user's over them, and the source images it takes."""
    gaussians = statistics_of(artifact, data.subset)
    options = {**(recipe.options if recipe else {}), **config.method_options()}
    if data.source is not None:
        checked = size_check(config.source_data, artifact, monitor.warn if monitor else None)
        options.update(source_images(config, data.source, preprocess, device, data.model_class_names, checked))
    with blamed_on(recipe):  # `method_option` was checked with the settings: a recipe's own option is wrong
        method = create(config.method, gaussians, device, **options)
    if config.oracle and not method.takes_labels:  # a plug-in: known once made
        raise UsageError(
            f"`oracle` gives the true labels to a loss that uses the predicted class; the plug-in {config.method} "
            f"does not say it takes them (a Method's takes_labels, read through class_labels())"
        )
    return method


def build_adapter(
    config: AdaptConfig,
    net: FeatureClassifier,
    method: Method,
    device: torch.device,
    artifact: Artifact | None,
    subset: ClassSubset | None,
) -> Adapter:
    """The Adapter of the method on the model, with the settings and, for `norm` class-balanced,
    the class moments of the classes predicted among."""
    # what a method draws as it is built (RMT's and SANTA's projector, AdaContrast's key queue) follows --seed
    torch.manual_seed(config.seed)
    moments = norm_moments_of(config, artifact, subset)
    return Adapter(net, method, device, **config.adapter_settings(), class_moments=moments)


def with_recipe(config: AdaptConfig, num_classes: int) -> tuple[AdaptConfig, Recipe | None]:
    """`config` with its recipe's settings in place of those the user did not choose
    (`config.chosen()`), and the recipe; as it is and None when `recipe` gives none."""
    recipe = recipe_for(config.recipe, config.method, config.data, num_classes)
    if recipe is None:
        return config, None
    kept = config.chosen()
    try:
        return replace(
            config, **{k: v for k, v in recipe.settings.items() if k not in kept}, given=tuple(sorted(kept))
        ), recipe
    except UsageError as error:
        raise InputError(f"the recipe {recipe.origin}: {error}") from None


def origin_of(setting: str, config: AdaptConfig, recipe: Recipe | None) -> str:
    """Where a setting's value came from, for a message that names it: "" when the user gave
    it, else " (from the recipe X)" or " (the default)"."""
    if setting in config.chosen():
        return ""
    if recipe is not None and setting in recipe.settings:
        return (
            f" (from {recipe.method}'s {recipe.family} recipe)"
            if recipe.origin == "shipped"
            else f" (from the recipe {recipe.origin})"
        )
    return " (the default)"


def check_recipe_file(config: AdaptConfig) -> None:
    """A recipe file's settings and method options, checked as a run checks them, for a caller
    that has work to do first (cafa bench computes statistics, which can take hours). Shipped
    recipes are checked by the tests; `auto` needs the model's class count, so only files."""
    if not config.recipe.endswith(".toml"):
        return
    config, recipe = with_recipe(config, None)
    if recipe is None or is_plugin(config.method):
        return
    with blamed_on(recipe):
        resolve_options(config.method, options_of(config.method), {**recipe.options, **config.method_options()})


@contextmanager
def blamed_on(recipe: Recipe | None):
    """A UsageError raised inside, as an InputError that names the recipe file it came from."""
    try:
        yield
    except UsageError as error:
        if recipe is None:
            raise
        raise InputError(f"{error} (in the recipe {recipe.origin})") from None


def stream_domains(config: AdaptConfig) -> tuple[list[str], list[int] | None, list[str]]:
    """The domains in stream order (a benchmark's ROOT as its corruptions or domains, less the
    `source` domain), with `gradual`
    the corruption each belongs to: fog/1, fog/2, ..., fog/5, ..., fog/1 for `fog`; and
    notes on benchmarks that lack corruptions."""
    data, notes = expand_benchmarks(config.data, config.source)
    twice = repeated([d for d in data if d != "-"], key=recorded_data) if config.mix_domains else []
    if twice:  # interleaved with itself, every image would be read and predicted twice
        raise UsageError(
            f"`mix_domains`: the domain {twice[0]} is given twice (also as a relative and an absolute path, "
            f"or with a trailing /); give each domain once"
        )
    if not config.gradual:
        return data, None, notes
    stages = [gradual_stages(path) for path in data]
    return (
        [stage for corruption in stages for stage in corruption],
        [k for k, corruption in enumerate(stages) for _ in corruption],
        notes,
    )


def check_oracle_labels(name: str, labels: np.ndarray) -> None:
    """`oracle` gives the loss each image's true label: every image of the domain needs one."""
    missing = int((labels < 0).sum())
    if missing:
        raise UsageError(
            f"{name}: `oracle` gives the loss each image's true label, and {missing} of its {len(labels)} "
            f"image(s) have none; give labelled data (one folder per class, or an array with `labels`), or drop "
            f"`oracle`"
        )


def open_test_domain(
    path: str,
    labels: str | None,
    severity: int | None,
    model_classes: list[str] | None,
    subset: ClassSubset | None,
    ids: tuple[str, set[str]] | None,
    notes: list[str],
    clean: bool = False,
    option: str = "data",
) -> Domain:
    """One test domain, its labels as the model's outputs (a subset's positions with one), and
    only the images listed in `ids` (the `subset` file and its ids), with a note on the notes
    for listed images it lacks. The `clean` set keeps the subset's classes only (ImageNet's
    validation images of ImageNet-R's 200 classes); a test domain must hold no others. `option`
    names the value's option in errors."""
    domain = open_domain(path, model_classes, labels, severity, option=option)
    if subset:
        domain = narrow(domain, subset, drop_others=clean)
    if ids is not None:
        domain, note = keep_listed(domain, ids[1], ids[0])
        notes += [note] if note else []
    return domain


def recorded_settings(
    config: AdaptConfig,
    device: torch.device,
    artifact: Artifact | None,
    spec: ModelSpec,
    preprocess: Preprocessing,
    subset: ClassSubset | None,
    recipe: Recipe | None,
    method: Method,
) -> dict:
    """Every setting the results depend on, as resolved, for the metrics JSON."""
    return {
        **recorded_values(config),
        "device": str(device),
        "num_workers": loader_processes(config.num_workers, device),
        # which statistics: the path as resolved, and when they were made (a path can be overwritten)
        "stats": absolute(artifact.path) if artifact else None,
        "stats_created": artifact.metadata.get("created") if artifact else None,
        "covariance": artifact.covariance if artifact else None,
        **spec.recorded(),  # model, weights and their sha256, num_classes, classifier: as resolved
        "classes": absolute(config.classes),
        "labels": absolute(config.labels),
        "source_data": recorded_data(config.source_data) if config.source_data else None,
        "outliers": recorded_outliers(config),
        "severity": effective_severity(config),
        "source": source_of(config),
        "preprocessing": asdict(preprocess),
        "class_subset": (
            {
                "file": absolute(config.class_subset),
                "classes": len(subset.names),
                "model_outputs": len(subset.model_classes),
            }
            if subset
            else None
        ),
        "recipe": {"requested": config.recipe, **(recipe.record() if recipe else {"name": None})},
        "method_options": {option.name: getattr(method, option.name) for option in method.options}
        or (config.method_options() if is_plugin(config.method) else {}),
    }


def recorded_outliers(config, axis: str | None = None) -> dict | None:
    """`outliers` as the JSON records it: the images (a path made absolute) and their share (None
    where a grid `axis` gives each row its own)."""
    source = config.outlier_source()
    if source is None:
        return None
    images, share = source
    data = images if images in GENERATED_OUTLIERS else recorded_data(images)
    return {"data": data, "share": None if axis else share}


def effective_severity(config) -> int | None:
    """`severity`, or the named benchmarks' default when one is among the domains."""
    named = any(has_severities(data) for data in config.data)
    return DEFAULT_SEVERITY if config.severity is None and named else config.severity
