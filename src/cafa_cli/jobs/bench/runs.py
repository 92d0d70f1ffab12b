"""Each bench row as the settings of one `cafa adapt` (and `cafa stats`) run: what a row
shares with the bench, its own method and options, its data, and the standard model of a
named benchmark."""

from __future__ import annotations

import json
from dataclasses import fields, replace
from pathlib import Path

from cafa_cli.core.errors import InputError, UsageError, listing, repeated
from cafa_cli.data.domain import Domain
from cafa_cli.data.pace import parse_step_cost
from cafa_cli.data.sources import gradual_stages, open_domain
from cafa_cli.jobs.adapt.prepare import check_oracle_labels
from cafa_cli.jobs.bench.rows import Row
from cafa_cli.jobs.config import AdaptConfig, BenchConfig, StatsConfig
from cafa_cli.jobs.config.data import InputOptions
from cafa_cli.jobs.config.settings import parse_method_options
from cafa_cli.jobs.shared.inputs import check_apart, open_outliers, recorded_data
from cafa_cli.methods import method_class
from cafa_cli.methods.recipes import standard_model
from cafa_cli.model.loading import bundled_model
from cafa_cli.model.zoo import robustbench
from cafa_cli.statistics.gaussians import auto_shrinkage_method


def check_domains(
    domains: list[str],
    data_choice: InputOptions,
    gradual: bool = False,
    severities: list[int | None] | None = None,
    oracle: bool = False,
) -> list[Domain]:
    """Each test domain given once, readable with its options and labelled (at each of
    `severities`, default `severity`; every image, for the `oracle` rows), before any
    statistics are computed; with `gradual`, each corruption and its severities. The
    domains as opened, every stage and severity."""
    stages = {domain: gradual_stages(domain) if gradual else [domain] for domain in domains}
    # `imgs` and `./imgs/` are one domain; with `gradual`, `fog` and `fog/3` are one corruption
    twice = repeated(domains, key=lambda domain: recorded_data(stages[domain][0]))
    if twice:
        raise UsageError(f"test domain {twice[0]} is given twice; give each domain once")
    opened = []
    for domain in dict.fromkeys(stage for visits in stages.values() for stage in visits):
        for severity in severities or [data_choice.severity]:
            opened.append(open_domain(domain, None, data_choice.labels, severity))
            labels = opened[-1].labels
            if not (labels >= 0).any():
                raise InputError(
                    f"{domain}: no labels, so no error to benchmark; give domains with one folder per class "
                    f"(or an array with `labels`)"
                )
            if oracle:
                check_oracle_labels(domain, labels)
    return opened


def check_apart_from_tests(config: BenchConfig, rows: list[Row], tests: list[Domain]) -> None:
    """`forgetting` and the source images of the rows that take them hold none of the test
    images (`tests`, as check_domains opened them) by any name, before any statistics. A
    row's source images are the training data when `source_data` is not given (source_data)."""
    if config.forgetting:
        check_apart("forgetting", config.forgetting, open_domain(config.forgetting, option="forgetting"), tests)
    taking = [row for row in rows if method_class(row.method).without_source_images]
    for given in dict.fromkeys(source_data(config, row) for row in taking):
        if given is None:
            continue
        option = "source_data" if given == config.source_data else "train"
        fix = None
        if option == "train":
            names = listing(dict.fromkeys(row.method for row in taking if source_data(config, row) == given))
            fix = f"{names} take the training data as their source images without `source_data`: give `source_data`"
            fix += " images none of which is a test image"
        check_apart(option, given, open_domain(given, option=option), tests, fix)


def check_outliers(config: BenchConfig, tests: list[Domain]) -> None:
    """`outliers`' images readable, none a test image, and enough of them at the grid's largest
    share, before any statistics (each run opens them again)."""
    source = config.outlier_source()
    if source is None:
        return
    together = config.rounds if config.mix_domains and len(config.data) * config.rounds > 1 else 0
    open_outliers(source[0], max(config.outlier_share_list()), tests, together)


def same_shrinkage(shrinkage: float | str, metadata: str | None, covariance: str) -> bool:
    """Whether an artifact's `shrinkage` metadata (JSON) is this setting's: the automatic
    estimate of that covariance mode, or one fixed λ (stored as the float it was given);
    a malformed one is not."""
    try:
        recorded = json.loads(metadata)
        method, low, high = recorded["method"], recorded["min"], recorded["max"]
    except (TypeError, ValueError, KeyError):
        return False
    if shrinkage == "auto":
        return method == auto_shrinkage_method(covariance)
    return method == "fixed" and low == high == float(shrinkage)


def shared(source, target_type, **overrides):
    """A `target_type` settings object with every field `source` has too, then `overrides`."""
    common = {
        f.name: getattr(source, f.name) for f in fields(target_type) if f.name in {g.name for g in fields(source)}
    }
    return target_type(**{**common, **overrides})


def stats_config(
    config: BenchConfig, covariance: str, out: Path, subset_seed: int = 0, fraction: float | None = None
) -> StatsConfig:
    """The `cafa stats` run of one covariance mode: the bench's model, training data and
    sampling (at `fraction` on a fraction sweep), on its device, batch size and loader
    processes. `severity` picks the test domains' severity, which the training data has not."""
    return shared(
        config,
        StatsConfig,
        data=config.train,
        covariance=covariance,
        out=str(out),
        seed=subset_seed,
        norm_moments=config.norm.class_balanced,
        severity=None,
        **({"fraction": fraction} if fraction is not None else {}),
    )


def row_config(config: BenchConfig, row: Row, seed: int, stats: str | None, classes: str | None) -> AdaptConfig:
    """The `cafa adapt` run of one row and seed, on the test domains with their geometry.
    With statistics the class list comes from the artifact (made from `classes`). The
    row's recipe fills what neither the bench's options nor the row itself (NAME@LR,
    cafa-full's params, a grid axis) chose; its method options are those of `method_option`
    that name its method or that it takes."""
    own = {
        "lr": row.lr,
        "params": row.params,
        "order": row.order,
        "stream_rate": row.stream_rate,
        "batch_size": row.batch_size,
        "severity": row.severity,
        "outliers": row.outlier_share,
        "method_option": row.option,
    }
    return shared(
        config,
        AdaptConfig,
        method=row.method,
        lr=row.lr_of(config),
        params=row.params_of(config),
        seed=seed,
        order=row.order_of(config),
        stream_rate=row.stream_rate_of(config),
        batch_size=row.batch_size_of(config),
        severity=row.severity_of(config),
        outliers=row.outliers_of(config),
        oracle=row.oracle,
        stats=stats,
        classes=None if stats else classes,
        source_data=source_data(config, row),
        resize=config.resize if config.test_resize is None else config.test_resize,
        crop=config.crop if config.test_crop is None else config.test_crop,
        method_option=row_method_options(config, row.method) + [row.option] * (row.option is not None),
        given=tuple(sorted(config.chosen() | {name for name, value in own.items() if value is not None})),
    )


def row_method_options(config: BenchConfig, method: str) -> list[str]:
    """The `method_option` entries for a row of `method`, as NAME=VALUE: those scoped to
    it (METHOD.NAME=VALUE) and the plain ones it takes."""
    return [
        f"{name}={value}"
        for scope, name, value in parse_method_options(config.method_option)
        if scope == method or (scope is None and name in _options_taken(method))
    ]


def _options_taken(method: str) -> set[str]:
    """The names of a built-in method's own options; a plug-in's are known when it is made."""
    from cafa_cli.methods import is_plugin, options_of

    return set() if is_plugin(method) else {option.name for option in options_of(method)}


def check_method_options(config: BenchConfig, rows: list[Row]) -> None:
    """Each `method_option` entry is taken by some row, and each `step_cost` METHOD=K pair: a
    misspelt method or option is named."""
    methods = {row.method for row in rows}
    for scope, name, value in parse_method_options(config.method_option):
        entry = f"{scope + '.' if scope else ''}{name}={value}"
        if scope is not None and scope not in methods:
            raise UsageError(
                f"`method_option` {entry}: no row runs the method {scope} (rows: {', '.join(sorted(methods))})"
            )
        if scope is None and not any(name in _options_taken(method) for method in methods):
            raise UsageError(
                f"`method_option` {entry}: no row's method takes the option {name}; cafa methods NAME lists "
                f"a method's options"
            )
    unused = sorted(parse_step_cost(config.step_cost)[1].keys() - {None} - methods)
    if unused:  # a METHOD=K pair for no row would be taken and never used
        raise UsageError(
            f"`step_cost` {config.step_cost}: no row runs the method {unused[0]} (rows: {', '.join(sorted(methods))})"
        )


def source_data(config: BenchConfig, row: Row) -> str | None:
    """EATA's source images: --source-data, else the training data when the test images are
    prepared as the training images are (no --test-resize/--test-crop)."""
    if not method_class(row.method).without_source_images or config.source_data:
        return config.source_data
    return config.train if config.test_resize is None and config.test_crop is None else None


def training_data(train: str | None, model: str, data: list[str], rows: list[Row]) -> tuple[str | None, str | None]:
    """--train; else, when a row needs statistics, the bundled model's own training set, or
    a RobustBench CIFAR model's where RobustBench keeps it beside its benchmark among `data`
    (with a line that says so). Without one, an error that says what to give."""
    needing = [row.label for row in rows if row.covariance]
    if train is not None or not needing:
        return train, None
    bundled = bundled_model(model)
    if bundled is not None:
        return bundled.training_data, None
    needed = f"`train` is needed for {', '.join(needing)}: the training data to compute class statistics from"
    if not robustbench.is_robustbench(model):
        raise UsageError(needed)
    found, looked = robustbench.training_set_beside(model, data)
    if found:
        return (
            found,
            f"`train` {found}: the training set of {model}, beside its benchmark as RobustBench keeps it "
            f"(give `train` to change it)",
        )
    dataset = robustbench.lookup(model).dataset
    if dataset not in robustbench.TRAINING_FOLDERS:
        raise UsageError(
            f"{needed}, {model}'s: give `train` ImageNet's training folder of class folders "
            f"(`train` /data/imagenet/train)"
        )
    where = f"; there is no {looked} beside the benchmark" if looked else ""
    raise UsageError(
        f"{needed}, {model}'s: give `train` {dataset}:DIR, DIR holding {robustbench.TRAINING_FOLDERS[dataset]} "
        f"(`train` {dataset}:data){where}"
    )


def with_standard_model(config: BenchConfig) -> tuple[BenchConfig, str | None]:
    """`config` on the standard model of the family whose benchmark the domains name
    (cifar10-c:ROOT: robustbench:cifar10/Standard) when the user chose no `model`, with a
    line that says so; else as it is (the bundled fmnist-resnet by default)."""
    standard = None if "model" in config.chosen() else standard_model(config.data)
    if standard is None:
        return config, None
    family, model = standard
    return replace(config, model=model), f"model: {model}, the standard model of {family} (give `model` to change it)"
