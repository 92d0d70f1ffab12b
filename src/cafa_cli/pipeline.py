"""The two jobs, `stats` and `adapt`, as functions of plain arguments.

The CLI, the demo and the benchmark all call these, so they run the same code.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch

from cafa_cli import statistics
from cafa_cli.adaptation import NEEDS_STATISTICS, Adapter, check_settings
from cafa_cli.artifact import DEFAULT_PATH, Artifact, read_artifact, unusable_class_names, write_artifact
from cafa_cli.distributed import merge_on_root, process_group, rank_device
from cafa_cli.data import (
    Domain,
    batches,
    check_loading,
    loader_processes,
    on_disk,
    open_domain,
    padding_note,
    read_class_list,
    relabel,
    stratified_subset,
    subset_sha256,
    unreadable,
)
from cafa_cli.errors import InputError, UsageError, listing
from cafa_cli.files import absolute, check_outputs
from cafa_cli.models import (
    FeatureClassifier,
    ModelSpec,
    bundled_model,
    canonical_model,
    factory_sha256,
    parameters_sha256,
    pick_device,
    resolve,
)
from cafa_cli.preprocessing import Preprocessing, check_values
from cafa_cli.report import Monitor
from cafa_cli.stream import DomainResult, adapt_domains, check_reset


@dataclass(frozen=True)
class ModelChoice:
    """What `--model`, `--weights` and friends say; None means "from the artifact"."""

    model: str | None = None
    weights: str | None = None
    num_classes: int | None = None
    classifier: str | None = None
    trust_checkpoint: bool = False


@dataclass(frozen=True)
class DataChoice:
    labels: str | None = None
    severity: int | None = None
    classes_file: str | None = None
    preprocessing: dict = field(default_factory=dict)  # only the options given

    def recipe(self, model: str | None) -> Preprocessing:
        """The preprocessing these options give for `model`: its defaults, then the options."""
        return default_preprocessing(model).with_changes(self.preprocessing)


def default_preprocessing(model: str | None) -> Preprocessing:
    bundled = bundled_model(model)
    return Preprocessing.from_dict(bundled.preprocessing) if bundled else Preprocessing()


def default_class_names(model: str | None, data: DataChoice) -> list[str] | None:
    if data.classes_file:
        return read_class_list(data.classes_file)
    bundled = bundled_model(model)
    return list(bundled.class_names) if bundled else None


def resolve_model(model: ModelChoice) -> tuple[FeatureClassifier, ModelSpec]:
    net, spec = resolve(model.model, model.weights, model.num_classes, model.classifier, model.trust_checkpoint)
    if spec.weights is None and ":" not in spec.model and bundled_model(spec.model) is None:
        # torchvision's own initialisation is random: statistics and adaptation would
        # each see another network, and no result could be reproduced
        raise UsageError(
            f"--model {spec.model} without --weights is an untrained network with random weights, different in "
            f"every run; give --weights FILE (a state dict of this architecture)"
        )
    _check_parameters(net.model)
    return net, spec


def _check_parameters(model: torch.nn.Module) -> None:
    """float32 values, all finite: other dtypes meet float32 images and fail with a message
    about the input, and NaN weights make every prediction NaN, with exit 0."""
    kinds = {"meta" if p.is_meta else str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.is_floating_point() or p.is_meta}
    if kinds - {"float32"}:
        raise InputError(f"the model's parameters are {listing(sorted(kinds))}, not float32; return a float32 model "
                         f"(model.float(), with its values) — mixed precision on CUDA is --precision bf16 or fp16")
    broken = [name for name, tensor in model.state_dict().items()
              if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())]
    if broken:
        raise InputError(f"the model's weights hold NaN or infinite values in {listing(broken)}; "
                         f"the checkpoint is damaged or was saved after training diverged: use another")


def _class_names_of(domains: list[Domain], net: FeatureClassifier) -> list[str]:
    """The class list when no artifact, --classes or bundled model gives one: the sorted
    class folders; else the model's output indices, as arrays label by index (a test
    array may lack the last classes) and unlabelled data has none."""
    folders = [d.class_names for d in domains if d.class_names and not d.indexed_labels]
    if any(names != folders[0] for names in folders):
        raise InputError("the --data folders have different class folders; give the class list with --classes")
    return folders[0] if folders else [str(i) for i in range(net.num_classes)]


def _check_classes(
    model: FeatureClassifier, class_names: list[str], where: str,
    fix: str = "check --num-classes, or give the class list in output order with --classes",
) -> None:
    if model.num_classes != len(class_names):
        raise InputError(f"{where} has {len(class_names)} classes but the model's classifier has {model.num_classes} outputs; {fix}")


# --- stats -----------------------------------------------------------------------


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
    statistics.check_options(covariance, shrinkage)
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
    gaussians = statistics.estimate(moments, covariance, shrinkage, class_names)
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
    moments = statistics.accumulate_features(net_on_pixels, loader, labels, len(class_names), net.feature_dim, target, on_batch)
    moments.skipped_images = skipped
    return moments


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


def check_seed(seed: int, option: str = "--seed") -> None:
    if not 0 <= seed < 2**63:  # torch's and numpy's generators take 64-bit seeds
        raise UsageError(f"{option} must be 0 or more and below 2**63, not {seed}")


# --- adapt -----------------------------------------------------------------------


@dataclass
class AdaptSettings:
    method: str = "cafa"
    batch_size: int = 200
    optimizer: str = "adam"
    lr: float = 1e-3
    momentum: float = 0.9
    steps: int = 1
    params: str = "norm"
    bn_prior: float = 0.0
    reset: str = "domain"
    shuffle: bool = True
    seed: int = 0
    device: str = "auto"
    precision: str = "fp32"
    num_workers: int | None = None  # None: data.loader_processes' default for the device
    strict: bool = False
    compile: bool = False

    def options(self) -> list[str]:
        """The `cafa adapt` options that give these settings: --method, then those off their defaults."""
        words = ["--method", self.method]
        for option in fields(self):
            value = getattr(self, option.name)
            if option.name == "method" or value == option.default:
                continue
            flag = option.name.replace("_", "-")
            if isinstance(value, bool):
                words.append(f"--{flag}" if value else f"--no-{flag}")
            else:
                words += [f"--{flag}", str(value)]
        return words


def check_adapt_settings(settings: AdaptSettings) -> torch.device:
    """Every option value of an adapt run, before any model or data is read; returns the device."""
    s = settings
    check_seed(s.seed)
    check_loading(s.batch_size, s.num_workers)
    check_reset(s.reset)
    device = pick_device(s.device)
    check_settings(s.method, s.params, s.optimizer, s.lr, s.momentum, s.steps, s.bn_prior, s.precision, device)
    return device


def load_for_adaptation(
    stats: str | None,
    model: ModelChoice,
    method: str,
    allow_weights_mismatch: bool = False,
) -> tuple[FeatureClassifier, Artifact | None, ModelSpec]:
    """The model (from the artifact unless overridden) and the artifact, checked against each other."""
    artifact = None
    stats_path = DEFAULT_PATH if stats is None else stats
    if model.model is None and stats is None and method not in NEEDS_STATISTICS and not Path(stats_path).exists():
        raise UsageError(f"give the model with --model (and --weights): --method {method} needs no statistics, "
                         f"and there is no {stats_path} to name it")
    if stats is not None or method in NEEDS_STATISTICS or model.model is None:
        artifact = read_artifact(stats_path, load_tensors=method in NEEDS_STATISTICS)  # else only its model record is used
    named_by_artifact = model.model is None
    if artifact is not None and (named_by_artifact or canonical_model(model.model) == artifact.model.model):
        model = _recorded_model(artifact, model)
    try:
        net, spec = resolve_model(model)
    except UsageError as error:
        if not named_by_artifact:
            raise
        # the user gave no --model: say where the name came from
        raise InputError(f"the model recorded in {artifact.path}: {error}") from None
    if artifact is not None:
        if net.feature_dim != artifact.feature_dim:
            raise InputError(
                f"the model's features have {net.feature_dim} dimensions but {artifact.path} was made for "
                f"{artifact.feature_dim}; recompute the statistics for this model"
            )
        _check_classes(net, artifact.class_names, artifact.path,
                       "check --model and --num-classes, or compute statistics for this model with cafa stats")
        if not allow_weights_mismatch:
            mismatch = model_mismatch(artifact, spec, net)
            if mismatch:
                raise InputError(f"{mismatch}; compute statistics for it with cafa stats, or pass --allow-weights-mismatch")
    return net, artifact, spec


def unread_default_artifact(stats: str | None, model: str | None, method: str, preprocess: Preprocessing) -> str | None:
    """A warning for `cafa adapt --model M --method bn` (no --stats) beside a cafa-stats.safetensors
    that it does not read: the run then takes the default preprocessing and class names,
    not the artifact's, which for a model trained otherwise is silently another input."""
    if stats is not None or model is None or method in NEEDS_STATISTICS or not Path(DEFAULT_PATH).is_file():
        return None
    return (f"{DEFAULT_PATH} is here but not read (with --model, a method that needs no statistics reads an artifact only when "
            f"named), so --method {method} uses {_geometry(preprocess)}, mean {list(preprocess.mean)}, std {list(preprocess.std)} "
            f"and the model's or the data's class names; pass --stats {DEFAULT_PATH} to use the artifact's")


def _recorded_model(artifact: Artifact, given: ModelChoice) -> ModelChoice:
    """The artifact's model, with what the user gave in its place.

    A factory (`file.py:fn`) named by an artifact would run code from a file the
    artifact merely points to: it runs only when the user names it with --model too
    (or passes --trust-checkpoint).
    """
    recorded = artifact.model
    if ":" in recorded.model and given.model is None and not given.trust_checkpoint:
        raise InputError(
            f"{artifact.path} names the model factory {recorded.model}, whose code would run; "
            f"pass --model {recorded.model} to run it (or --trust-checkpoint)"
        )
    weights = given.weights or recorded.weights
    if weights and given.weights is None and not Path(weights).is_file():
        raise InputError(
            f"the artifact's weights {weights} are not there; pass --weights FILE (the same file) "
            f"or --model/--weights to use another model"
        )
    num_classes = given.num_classes or recorded.num_classes
    return ModelChoice(recorded.model, weights, num_classes, given.classifier or recorded.classifier, given.trust_checkpoint)


def model_mismatch(artifact: Artifact, spec: ModelSpec, net: FeatureClassifier) -> str | None:
    """Why the artifact does not hold statistics of this model with these parameters, or
    None when it does. They describe the features of one model with one set of weights:
    another architecture or other weights (a changed file, --weights, a retrained bundled
    model) would be aligned to the wrong Gaussians without any error. The same parameters
    re-saved or converted to another format are the same model (the artifact's parameter
    fingerprint recognises them), and so is a factory file copied elsewhere."""
    recorded = artifact.model
    same_code = artifact.factory_sha256 is not None and factory_sha256(spec.model) == artifact.factory_sha256
    same_function = recorded.model.rpartition(":")[2] == spec.model.rpartition(":")[2]
    if spec.model != recorded.model and not (same_code and same_function):  # a factory file copied elsewhere is the same model
        # its code may compute other features from the same parameters
        return f"{artifact.path} holds statistics of the model {recorded.model}, not of {spec.model}"
    if artifact.factory_sha256 is not None and not same_code:
        # the same parameters through edited code can give other features
        return f"{spec.model.rpartition(':')[0]} has changed since the statistics in {artifact.path} were computed (its sha256 differs)"
    if spec.weights_sha256 is not None and spec.weights_sha256 == recorded.weights_sha256:
        return None  # the same file
    if artifact.parameters_sha256 is None:
        if recorded.weights_sha256 is None and recorded.weights is None and spec.weights is None:
            return None  # from before weights were hashed: a factory's own initialisation or a bundled model
        differ = "sha256 differs; the artifact predates parameter fingerprints, so re-saved weights are not recognised"
    elif parameters_sha256(net.model) == artifact.parameters_sha256:
        return None  # the same parameters from another file
    else:
        differ = "parameters differ"
    if spec.weights is None and recorded.weights is None:
        what = f"the bundled {spec.model} weights have changed" if bundled_model(spec.model) else (
            f"{spec.model} initialised its parameters differently (it draws them at random? give --weights)")
        return f"{what} since the statistics in {artifact.path} were computed ({differ})"
    if spec.weights == recorded.weights:
        return f"{spec.weights} has changed since the statistics were computed ({differ})"
    own = "its packaged weights" if bundled_model(spec.model) else "the model's own initialisation (no --weights)"
    made_with, given = recorded.weights or own, spec.weights or own
    return f"{artifact.path} holds statistics of {spec.model} with {made_with}, not with {given} ({differ})"


@dataclass
class Adaptation:
    """A prepared `adapt` job: the model, its domains and class names, ready to run."""

    adapter: Adapter
    domains: list[Domain]
    preprocess: Preprocessing
    class_names: list[str]
    settings: AdaptSettings
    recorded_settings: dict  # every setting, for the metrics JSON
    statistics_preprocess: Preprocessing | None = None  # the artifact's, when there is one

    def cautions(self) -> list[str]:
        """What the data or settings do that runs but quietly hurts the results, worth a warning."""
        notes = [note for domain in self.domains for note in domain.notes]
        notes += [note for note in (padding_note(domain, self.preprocess) for domain in self.domains) if note]
        s = self.settings
        if s.method == "bn" and self.adapter.batch_norms == 0:
            notes.append("the model has no BatchNorm layers, so --method bn gives the same predictions as source")
        batch_statistics = s.bn_prior == 0 and s.method != "source" and self.adapter.batch_norms > 0
        if s.batch_size == 1 and batch_statistics:
            notes.append("--batch-size 1 normalises each image by its own statistics, which costs accuracy; "
                         "add --bn-prior 16 (source statistics as a prior) or raise --batch-size")
        alone = [_short_name(d.name) for d in self.domains if len(d) % s.batch_size == 1]
        if s.batch_size > 1 and batch_statistics and alone:
            notes.append(f"the last batch of {listing(alone)} holds 1 image, normalised by its own statistics; "
                         f"choose a --batch-size that leaves more, or add --bn-prior 16")
        grouped = [_short_name(d.name) for d in self.domains if _one_class_after_another(d.labels)]
        if not s.shuffle and s.method != "source" and grouped:
            notes.append(f"--no-shuffle streams {listing(grouped)} one class after another: each batch holds about one class, "
                         f"which its normalisation and updates adapt to, and the error rises; drop --no-shuffle")
        one_batch = [_short_name(d.name) for d in self.domains if 0 < len(d) <= s.batch_size]
        if s.method not in ("source", "bn") and s.reset == "domain" and one_batch:
            # each batch is predicted before the update it gives (the online protocol)
            notes.append(f"{listing(one_batch)} fit{'s' if len(one_batch) == 1 else ''} in one batch of --batch-size {s.batch_size}, "
                         f"predicted before any update: {s.method} cannot differ from bn there; lower --batch-size")
        made = self.statistics_preprocess
        if made and (made.resize, made.crop) != (self.preprocess.resize, self.preprocess.crop):
            notes.append(f"{_geometry(self.preprocess)} differ from the statistics' ({_geometry(made)}): right for test images stored already cropped "
                         f"(ImageNet-C); otherwise the features will not match the statistics")
        if made and (made.channels, made.per_channel()) != (self.preprocess.channels, self.preprocess.per_channel()):
            notes.append(f"--mean/--std/--channels differ from the statistics' (mean {list(made.mean)}, std {list(made.std)}, "
                         f"{made.channels} channel(s)): the features will not match the statistics")
        return notes

    def run(self, on_records=lambda records: None, monitor: Monitor | None = None) -> list[DomainResult]:
        monitor = monitor or Monitor()

        def records(batch_records, so_far: DomainResult):
            monitor.advance(len(batch_records), f"err {100 * so_far.error:.1f}%" if so_far.labelled else "")
            on_records(batch_records)

        s = self.settings
        results = adapt_domains(
            self.adapter,
            self.domains,
            self.preprocess,
            s.batch_size,
            s.reset,
            s.shuffle,
            s.seed,
            s.num_workers,
            s.strict,
            on_records=records,
            on_skip=lambda ref, why: monitor.warn(_skip_warning(ref, why)),
            on_domain=lambda domain: monitor.start(_short_name(domain.name), len(domain)),
        )
        for result in results:
            # fp16's loss scaler skips a few steps by design while it settles; otherwise a
            # skipped update means the objective itself is broken and the run is bn's
            if result.skipped_steps and s.precision != "fp16":
                monitor.warn(f"{_short_name(result.data)}: {result.skipped_steps} update(s) skipped because the loss or its "
                             f"gradients were not finite; check the statistics (cafa inspect) and lower --lr")
        return results


def _one_class_after_another(labels: np.ndarray) -> bool:
    """Labels in runs of one class each (class folders, in whatever order the folder names
    sort against the model's classes), over more than one class."""
    known = labels[labels >= 0]
    classes = len(np.unique(known))
    return classes > 1 and int((np.diff(known) != 0).sum()) == classes - 1


def _geometry(recipe: Preprocessing) -> str:
    return f"resize {recipe.resize or 'none'}, crop {recipe.crop or 'none'}"


def _short_name(name: str) -> str:
    """`…/fog/5` → `fog/5` (the ImageNet-C layout), else the folder or file name."""
    path = Path(name)
    return f"{path.parent.name}/{path.name}" if path.name.isdigit() and path.parent.name else (path.name or name)


def prepare_adaptation(
    data: list[str],
    stats: str | None = None,
    model: ModelChoice = ModelChoice(),
    data_choice: DataChoice = DataChoice(),
    settings: AdaptSettings = AdaptSettings(),
    allow_weights_mismatch: bool = False,
) -> Adaptation:
    if not data:
        raise UsageError("give at least one --data PATH")
    if data.count("-") > 1:
        raise UsageError("--data - (image paths on stdin) is given more than once; stdin can be read once")
    device = check_adapt_settings(settings)
    net, artifact, spec = load_for_adaptation(stats, model, settings.method, allow_weights_mismatch)
    if artifact and data_choice.classes_file:
        raise UsageError("--classes is for cafa stats; cafa adapt takes the class list from the artifact")
    base = artifact.preprocessing if artifact else default_preprocessing(spec.model)
    check_values(data_choice.preprocessing)  # wrong by itself: no word about where the others came from
    try:
        preprocess = base.with_changes(data_choice.preprocessing)
    except UsageError as error:
        source = artifact.path if artifact else f"the defaults of {spec.model}"
        raise UsageError(f"{error} (the options not given come from {source}: give them too)") from None
    class_names = artifact.class_names if artifact else default_class_names(spec.model, data_choice)
    domains = [open_domain(d, class_names, data_choice.labels, data_choice.severity) for d in data]
    if class_names is None:
        class_names = _class_names_of(domains, net)
        domains = [relabel(d, class_names) for d in domains]
        _check_classes(net, class_names, "the data")
    elif artifact is None:  # the artifact's list was checked with it
        _check_classes(net, class_names, f"the class list {data_choice.classes_file}" if data_choice.classes_file else f"{spec.model}'s class list")
    adapter = Adapter(
        net,
        settings.method,
        artifact.gaussians if artifact else None,
        device,
        params=settings.params,
        optimizer=settings.optimizer,
        lr=settings.lr,
        momentum=settings.momentum,
        steps=settings.steps,
        bn_prior=settings.bn_prior,
        precision=settings.precision,
        compile=settings.compile,
    )
    recorded = _recorded_settings(settings, allow_weights_mismatch, device, artifact, spec, data_choice, preprocess)
    return Adaptation(adapter, domains, preprocess, class_names, settings, recorded, artifact.preprocessing if artifact else None)


def _recorded_settings(settings: AdaptSettings, allow_weights_mismatch: bool, device: torch.device, artifact: Artifact | None,
                       spec: ModelSpec, data_choice: DataChoice, preprocess: Preprocessing) -> dict:
    """Every setting the results depend on, as resolved, for the metrics JSON."""
    return {
        **asdict(settings),
        "allow_weights_mismatch": allow_weights_mismatch,
        "device": str(device),
        "num_workers": loader_processes(settings.num_workers, device),
        # which statistics: the path as resolved, and when they were made (a path can be overwritten)
        "stats": absolute(artifact.path) if artifact else None,
        "stats_created": artifact.metadata.get("created") if artifact else None,
        "covariance": artifact.covariance if artifact else None,
        **asdict(spec),  # model, weights and their sha256, num_classes, classifier: as resolved
        "classes": absolute(data_choice.classes_file),
        "labels": absolute(data_choice.labels),
        "severity": data_choice.severity,
        "preprocessing": asdict(preprocess),
    }
