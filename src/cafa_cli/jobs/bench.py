"""`cafa bench`: methods × domains × seeds → a paper-style error table.

Every (row, seed) is one `cafa adapt` run over all the domains, through the same
functions as the CLI. Statistics are computed once per covariance mode and re-used.
"""

from __future__ import annotations

import gc
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from cafa_cli.method.methods import NAMES as METHODS, NEEDS_STATISTICS
from cafa_cli.artifact import read_artifact
from cafa_cli.data.arrays import TRAINING_SETS
from cafa_cli.data.sources import on_disk, open_domain
from cafa_cli.data.domain import read_class_list
from cafa_cli.jobs.distributed import gather_on_root, wait_for_all
from cafa_cli.errors import InputError, UsageError, printable, repeated, undecodable
from cafa_cli.files import atomic_write, make_workdir
from cafa_cli.models import bundled_model
from cafa_cli.checkpoints import check_weights_file
from cafa_cli.jobs.adapt import AdaptSettings, check_adapt_settings, prepare_adaptation
from cafa_cli.jobs.inputs import DataChoice, ModelChoice, check_seed, recorded_data, resolve_model
from cafa_cli.jobs.stats import compute_statistics, sample_sha256, subset_size
from cafa_cli.provenance import model_mismatch
from cafa_cli.jobs.monitor import Monitor
from cafa_cli.method.gaussians import auto_shrinkage_method, check_options
from cafa_cli.jobs.results import DomainResult


# Bench rows beyond the plain methods, as (method, covariance, params): the paper's
# ablations CAFA-Tied, CAFA-Diag (its "variance") and CAFA-Full (every feature-extractor
# parameter updated), and CAFA with the dense or low-rank form forced. The plain
# methods that need statistics use `auto`, as `cafa stats` does by default.
VARIANTS = {"cafa-tied": ("cafa", "tied", None), "cafa-diag": ("cafa", "diag", None), "cafa-full": ("cafa", "auto", "all"),
            "cafa-dense": ("cafa", "full", None), "cafa-lowrank": ("cafa", "lowrank", None)}


DEFAULT_METHODS = "source,bn,pl,tent,cafa,global-fa,intra,euclidean,cafa-tied,cafa-diag"


@dataclass(frozen=True)
class Row:
    label: str  # as shown in the table
    method: str  # passed to cafa adapt --method
    covariance: str | None  # artifact needed, or None
    lr: float | None = None  # this row's learning rate, when it differs from --lr
    params: str | None = None  # this row's --params, when it differs from the bench's

    def settings(self, base: AdaptSettings) -> AdaptSettings:
        return replace(base, method=self.method, lr=self.lr or base.lr, params=self.params or base.params)


def parse_methods(text: str) -> list[Row]:
    """`tent,cafa-tied,cafa@0.01`: a method, a covariance variant, optionally `@lr`."""
    rows = []
    for label in (m.strip() for m in text.split(",") if m.strip()):
        name, at, lr_text = label.partition("@")
        if at and not lr_text:
            raise UsageError(f"--methods: {label!r}: give the learning rate after @ (e.g. {name}@0.001), or drop the @")
        if name in VARIANTS:
            method, covariance, params = VARIANTS[name]
        elif name in METHODS:
            method, covariance, params = name, "auto" if name in NEEDS_STATISTICS else None, None
        else:
            raise UsageError(f"--methods: unknown method {name!r}; choose from {', '.join(METHODS + tuple(VARIANTS))}")
        try:
            lr = float(lr_text) if lr_text else None
        except ValueError:
            raise UsageError(f"--methods: {label!r}: the learning rate after @ is not a number") from None
        if lr is not None and not 0 < lr < float("inf"):
            raise UsageError(f"--methods: {label!r}: the learning rate after @ must be a positive number")
        rows.append(Row(label, method, covariance, lr, params))
    if not rows:
        raise UsageError("--methods names no method")
    twice = repeated([row.label for row in rows])
    if twice:  # the same row twice would be run twice and fill one line of the table
        raise UsageError(f"--methods names {twice[0]} twice; give each row once")
    return rows


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise UsageError(f"--seeds takes comma-separated integers, not {text!r}") from None
    if not seeds:
        raise UsageError("--seeds names no seed")
    for seed in seeds:
        check_seed(seed, "--seeds")
    if repeated(seeds):
        raise UsageError(f"--seeds names a seed twice: {text}")
    return seeds


def check_domains(domains: list[str], data_choice: DataChoice) -> None:
    """Each test domain given once, readable with its options and labelled, before any statistics are computed."""
    twice = repeated(domains, key=recorded_data)  # `imgs` and `./imgs/` are one domain
    if twice:
        raise UsageError(f"test domain {twice[0]} is given twice; give each domain once")
    for domain in domains:
        labels = open_domain(domain, None, data_choice.labels, data_choice.severity).labels
        if not (labels >= 0).any():
            raise InputError(f"{domain}: no labels, so no error to benchmark; give domains with one folder per class "
                             f"(or an array with --labels)")


def recipes(model: str, **choices: DataChoice) -> dict[str, dict]:
    """The preprocessing each side used, in full, for the report: e.g. train and test."""
    return {name: asdict(choice.recipe(model)) for name, choice in choices.items()}


@dataclass(frozen=True)
class Sampling:
    """Which training images the statistics are computed from, and their shrinkage (as cafa stats)."""

    fraction: float | None = None  # DEFAULT_FRACTION unless per_class is given
    per_class: int | None = None
    seed: int = 0
    shrinkage: float | str = "auto"

    def __post_init__(self):
        fraction, per_class = subset_size(self.fraction, self.per_class)
        object.__setattr__(self, "fraction", fraction)
        object.__setattr__(self, "per_class", per_class)

    def same_shrinkage(self, metadata: str | None, covariance: str) -> bool:
        """Whether an artifact's `shrinkage` metadata (JSON) is this setting's: the automatic
        estimate of that covariance mode, or one fixed λ (stored as the float it was given);
        a malformed one is not."""
        try:
            recorded = json.loads(metadata)
            method, low, high = recorded["method"], recorded["min"], recorded["max"]
        except (TypeError, ValueError, KeyError):
            return False
        if self.shrinkage == "auto":
            return method == auto_shrinkage_method(covariance)
        return method == "fixed" and low == high == float(self.shrinkage)

    def recorded(self) -> dict:
        return {"fraction": self.fraction, "per_class": self.per_class, "seed": self.seed}


@dataclass(frozen=True)
class BenchPlan:
    """A benchmark: every row × test domain × seed, and what all of them share."""

    rows: list[Row]
    domains: list[str]
    seeds: list[int]
    settings: AdaptSettings  # every row's options; a row sets its own method, and maybe lr and params
    model: ModelChoice
    train: str | None  # the training data of the statistics (as cafa stats --data)
    train_choice: DataChoice
    test_choice: DataChoice
    sampling: Sampling = Sampling()
    workdir: Path = Path("cafa-bench")


def training_data(train: str | None, model: str, rows: list[Row]) -> str | None:
    """--train, or the bundled model's own training set when a row needs statistics."""
    if train is not None or not any(row.covariance for row in rows):
        return train
    bundled = bundled_model(model)
    if bundled is None:
        raise UsageError(f"--train is needed for {', '.join(r.label for r in rows if r.covariance)}: "
                         f"the training data to compute class statistics from")
    return bundled.training_data


def run_bench(plan: BenchPlan, monitor: Monitor, rank: int = 0, world: int = 1) -> dict[tuple[str, str, int], DomainResult] | None:
    """Every (row label, domain, seed) result: statistics computed once per covariance
    mode the rows need (or re-used from the workdir), then the grid. Under torchrun every
    rank joins the statistics and runs its share of the grid; rank 0 gets every result,
    the other ranks None."""
    # every check before statistics that can take hours, and before the workdir is made
    check_domains(plan.domains, plan.test_choice)
    for row in plan.rows:
        check_adapt_settings(row.settings(plan.settings))
    for covariance in covariances_needed(plan.rows):
        check_options(covariance, plan.sampling.shrinkage)
    if plan.model.weights:
        check_weights_file(plan.model.weights)
    if plan.train and plan.train not in TRAINING_SETS and not Path(on_disk(plan.train)).exists():
        raise InputError(f"--train {plan.train}: no such file or folder")
    make_workdir(plan.workdir)
    artifacts = {covariance: ensure_statistics(plan, covariance, monitor) for covariance in covariances_needed(plan.rows)}
    wait_for_all(world)  # rank 0 has written the artifacts
    without_statistics = any(row.covariance is None for row in plan.rows)
    classes_file = shared_class_list(plan, artifacts, write=rank == 0) if without_statistics else None
    wait_for_all(world)  # and the class list
    mine = run_grid(replace(plan, test_choice=replace(plan.test_choice, classes_file=classes_file)), artifacts, monitor, rank, world)
    parts = gather_on_root(mine, rank, world)
    return None if parts is None else {key: result for part in parts for key, result in part.items()}


def covariances_needed(rows: list[Row]) -> list[str]:
    """The covariance modes of the artifacts the rows use, one each, in a fixed order."""
    return sorted({row.covariance for row in rows if row.covariance})


def artifact_path(workdir: Path, covariance: str) -> Path:
    return workdir / f"stats-{covariance}.safetensors"


def ensure_statistics(plan: BenchPlan, covariance: str, monitor: Monitor) -> Path:
    """The artifact for one covariance mode, re-used when it was made for the same model
    and data; computed on the device, batch size and loader processes of the plan's settings."""
    path = artifact_path(plan.workdir, covariance)
    if path.is_file():
        try:
            if _made_for(read_artifact(path, load_tensors=False), plan):
                return path
        except InputError:
            pass
    monitor.info(f"computing statistics (--covariance {covariance}) → {path}")
    sampling, settings = plan.sampling, plan.settings
    compute_statistics(plan.train, path, plan.model, plan.train_choice, fraction=sampling.fraction, per_class=sampling.per_class,
                       seed=sampling.seed, covariance=covariance, shrinkage=sampling.shrinkage, device=settings.device,
                       batch_size=settings.batch_size, num_workers=settings.num_workers, strict=settings.strict, monitor=monitor)
    return path


def shared_class_list(plan: BenchPlan, artifacts: dict[str, Path], write: bool = True) -> str | None:
    """The class list file every row uses, so that the rows without statistics read the
    labels in the model's output order too. Without it they take the test folders'
    sorted names, which is not the order of every training set (Fashion-MNIST's is not
    alphabetical), while the rows with statistics take the artifact's.
    --classes or a bundled model already fix it; else the training data's order is
    written to WORKDIR/classes.txt (by `write`: rank 0 under torchrun); None when there
    is no training data to ask, or it has no class folders."""
    if plan.train_choice.classes_file or bundled_model(plan.model.model):
        return plan.train_choice.classes_file
    if artifacts:
        names = read_artifact(next(iter(artifacts.values())), load_tensors=False).class_names
    elif plan.train:
        names = open_domain(plan.train, None).class_names
    else:
        return None
    if not names:
        return None
    # the list is a UTF-8 text file of stripped lines: undecodable bytes (as os.fsdecode keeps
    # them), spaces around a name or a line break in it would not come back
    unwritable = [n for n in names if any(undecodable(ch) for ch in n) or n != n.strip() or len(n.splitlines()) > 1]
    if unwritable:
        raise InputError(f"class folder {printable(repr(unwritable[0]))} cannot go into the class list file for the rows without "
                         f"statistics (a name that is not UTF-8, or spaces around it); rename it")
    path = plan.workdir / "classes.txt"
    if write:
        atomic_write(path, lambda tmp: Path(tmp).write_text("".join(f"{name}\n" for name in names), encoding="utf-8"))
    return str(path)


def _made_for(artifact, plan: BenchPlan) -> bool:
    """Whether an artifact holds these statistics, compared as compute_statistics records
    them (absolute paths: a relative --train or --workdir must match on a second run) and
    as cafa adapt checks the model (the same parameters in another file are the same)."""
    model, classes_file = plan.model, plan.train_choice.classes_file
    wanted = {"data": recorded_data(plan.train), **plan.sampling.recorded()}
    if not (
        model.classifier in (None, artifact.model.classifier)
        and (classes_file is None or read_class_list(classes_file) == artifact.class_names)
        and artifact.preprocessing == plan.train_choice.recipe(model.model)
        and all(artifact.sampling.get(key) == value for key, value in wanted.items())
        and plan.sampling.same_shrinkage(artifact.metadata.get("shrinkage"), artifact.covariance)
    ):
        return False
    net, spec = resolve_model(model)
    if model_mismatch(artifact, spec, net) is not None:
        return False
    # the same folder may hold other images since (added, removed, relabelled): compare the sample drawn
    sampling = plan.sampling
    return artifact.sampling.get("images_sha256") == sample_sha256(plan.train, model, plan.train_choice, sampling.fraction,
                                                                   sampling.per_class, sampling.seed)


def run_grid(plan: BenchPlan, artifacts: dict[str, Path], monitor: Monitor, rank: int = 0, world: int = 1) -> dict[tuple[str, str, int], DomainResult]:
    """The result of every (row label, domain, seed) this rank runs: the (row, seed)
    runs are independent, so under torchrun each rank takes every world-th."""
    results, warned = {}, set()
    runs = [(row, seed) for row in plan.rows for seed in plan.seeds]
    for row, seed in runs[rank::world]:
        stats = str(artifacts[row.covariance]) if row.covariance else None
        settings = replace(row.settings(plan.settings), seed=seed)
        # with statistics the class list comes from the artifact (made from --classes)
        data_choice = replace(plan.test_choice, classes_file=None) if stats else plan.test_choice
        job = prepare_adaptation(plan.domains, stats, plan.model, data_choice, settings)
        for caution in job.cautions():
            if caution not in warned:  # each once, not for every seed; rows may differ (a method, a rate)
                warned.add(caution)
                monitor.warn(caution)
        monitor.info(f"{row.label} seed {seed}")
        for domain, result in zip(plan.domains, job.run(monitor=monitor)):
            if result.error is None:
                raise InputError(f"{domain}: no labels, so no error to benchmark; bench needs labelled domains")
            results[(row.label, domain, seed)] = result
        # free this run's model and statistics before the next is built (16.8 GB of dense
        # factors at ImageNet scale); the feature hook makes a reference cycle, so collect
        del job
        gc.collect()
    return results
