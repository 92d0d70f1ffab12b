"""`cafa bench`: methods × domains × seeds → a paper-style error table.

Every (row, seed) is one `cafa adapt` run over all the domains, through the same
functions as the CLI. Statistics are computed once per covariance mode (and training
fraction, on a fraction sweep) and re-used.
Under torchrun the runs are spread over the ranks, and so are the domains of a run
whose domains are independent (`reset` domain).
"""

from __future__ import annotations

import gc
import json
from dataclasses import asdict, fields, replace
from itertools import groupby
from pathlib import Path
from cafa_cli.artifact import read_artifact
from cafa_cli.data.arrays import TRAINING_SETS
from cafa_cli.data.sources import gradual_stages, on_disk, open_domain
from cafa_cli.data.domain import read_class_list
from cafa_cli.jobs.distributed import RankMonitor, gather_on_root, show_other_ranks, wait_for_all, why_domains_depend
from cafa_cli.errors import InputError, UsageError, printable, repeated, undecodable
from cafa_cli.files import atomic_write, make_workdir
from cafa_cli.models import bundled_model
from cafa_cli.checkpoints import check_weights_file
from cafa_cli.devices import pick_device
from cafa_cli.jobs import tables
from cafa_cli.jobs.rows import Row, grid_rows, parse_methods, with_fractions, with_norm_statistics, with_oracle
from cafa_cli.method.options import parse_norm
from cafa_cli.jobs.adapt import check_oracle_labels, effective_severity, part_of, prepare_adaptation
from cafa_cli.jobs.clean import clean_summary
from cafa_cli.data.benchmarks import expand_benchmarks, source_of
from cafa_cli.jobs.config import AdaptConfig, BenchConfig, StatsConfig
from cafa_cli.jobs.settings import InputOptions, parse_method_options
from cafa_cli.jobs.distributed import process_group, rank_device
from cafa_cli.jobs.outputs import check_outputs, guards_outputs
from cafa_cli import __version__
from cafa_cli.jobs import report
from cafa_cli.data.loading import loader_processes
from cafa_cli.files import absolute, open_safetensors
from cafa_cli.models import pretrained_by_name, weights_record
from cafa_cli.checkpoints import sha256_of
from cafa_cli.jobs.inputs import recipe, recorded_data, resolve_model
from cafa_cli.jobs.stats import compute_statistics, sample_sha256
from cafa_cli.provenance import model_mismatch
from cafa_cli.jobs.monitor import Monitor
from cafa_cli.method.gaussians import auto_shrinkage_method, check_options
from cafa_cli.jobs.results import DomainResult
from cafa_cli.recipes import standard_model
from cafa_cli.zoo import robustbench


def check_domains(domains: list[str], data_choice: InputOptions, gradual: bool = False,
                  severities: list[int | None] | None = None, oracle: bool = False) -> None:
    """Each test domain given once, readable with its options and labelled (at each of
    `severities`, default `severity`; every image, for the `oracle` rows), before any
    statistics are computed; with `gradual`, each corruption and its severities."""
    stages = {domain: gradual_stages(domain) if gradual else [domain] for domain in domains}
    # `imgs` and `./imgs/` are one domain; with `gradual`, `fog` and `fog/3` are one corruption
    twice = repeated(domains, key=lambda domain: recorded_data(stages[domain][0]))
    if twice:
        raise UsageError(f"test domain {twice[0]} is given twice; give each domain once")
    for domain in dict.fromkeys(stage for visits in stages.values() for stage in visits):
        for severity in severities or [data_choice.severity]:
            labels = open_domain(domain, None, data_choice.labels, severity).labels
            if not (labels >= 0).any():
                raise InputError(f"{domain}: no labels, so no error to benchmark; give domains with one folder per class "
                                 f"(or an array with `labels`)")
            if oracle:
                check_oracle_labels(domain, labels)


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
    common = {f.name: getattr(source, f.name) for f in fields(target_type) if f.name in {g.name for g in fields(source)}}
    return target_type(**{**common, **overrides})


def stats_config(config: BenchConfig, covariance: str, out: Path, subset_seed: int = 0,
                 fraction: float | None = None) -> StatsConfig:
    """The `cafa stats` run of one covariance mode: the bench's model, training data and
    sampling (at `fraction` on a fraction sweep), on its device, batch size and loader
    processes. `severity` picks the test domains' severity, which the training data has not."""
    return shared(config, StatsConfig, data=config.train, covariance=covariance, out=str(out), seed=subset_seed,
                  norm_moments=parse_norm(config.norm)[0] == "class-balanced", severity=None,
                  **({"fraction": fraction} if fraction is not None else {}))


def row_config(config: BenchConfig, row: Row, seed: int, stats: str | None, classes: str | None) -> AdaptConfig:
    """The `cafa adapt` run of one row and seed, on the test domains with their geometry.
    With statistics the class list comes from the artifact (made from `classes`). The
    row's recipe fills what neither the bench's options nor the row itself (NAME@LR,
    cafa-full's params, a grid axis) chose; its method options are those of `method_option`
    that name its method or that it takes."""
    own = {"lr": row.lr, "params": row.params, "order": row.order, "batch_size": row.batch_size, "severity": row.severity}
    return shared(config, AdaptConfig, method=row.method, lr=row.lr_of(config), params=row.params_of(config), seed=seed,
                  order=row.order_of(config), batch_size=row.batch_size_of(config), severity=row.severity_of(config),
                  oracle=row.oracle, stats=stats, classes=None if stats else classes,
                  fisher_data=fisher_data(config, row),
                  resize=config.resize if config.test_resize is None else config.test_resize,
                  crop=config.crop if config.test_crop is None else config.test_crop,
                  method_option=row_method_options(config, row.method),
                  given=tuple(sorted(config.chosen() | {name for name, value in own.items() if value is not None})))


def row_method_options(config: BenchConfig, method: str) -> list[str]:
    """The `method_option` entries for a row of `method`, as NAME=VALUE: those scoped to
    it (METHOD.NAME=VALUE) and the plain ones it takes."""
    return [f"{name}={value}" for scope, name, value in parse_method_options(config.method_option)
            if scope == method or (scope is None and name in _options_taken(method))]


def _options_taken(method: str) -> set[str]:
    """The names of a built-in method's own options; a plug-in's are known when it is made."""
    from cafa_cli.method.methods import is_plugin, options_of

    return set() if is_plugin(method) else {option.name for option in options_of(method)}


def check_method_options(config: BenchConfig, rows: list[Row]) -> None:
    """Each `method_option` entry is taken by some row: a misspelt method or option is named."""
    methods = {row.method for row in rows}
    for scope, name, value in parse_method_options(config.method_option):
        entry = f"{scope + '.' if scope else ''}{name}={value}"
        if scope is not None and scope not in methods:
            raise UsageError(f"`method_option` {entry}: no row runs the method {scope} (rows: {', '.join(sorted(methods))})")
        if scope is None and not any(name in _options_taken(method) for method in methods):
            raise UsageError(f"`method_option` {entry}: no row's method takes the option {name}; cafa methods NAME lists "
                             f"a method's options")


def fisher_data(config: BenchConfig, row: Row) -> str | None:
    """EATA's source images: --fisher-data, else the training data when the test images are
    prepared as the training images are (no --test-resize/--test-crop)."""
    if row.method != "eata" or config.fisher_data:
        return config.fisher_data
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
        return found, f"`train` {found}: the training set of {model}, beside its benchmark as RobustBench keeps it " \
                      f"(give `train` to change it)"
    dataset = robustbench.lookup(model).dataset
    if dataset not in robustbench.TRAINING_FOLDERS:
        raise UsageError(f"{needed}, {model}'s: give `train` ImageNet's training folder of class folders "
                         f"(`train` /data/imagenet/train)")
    where = f"; there is no {looked} beside the benchmark" if looked else ""
    raise UsageError(f"{needed}, {model}'s: give `train` {dataset}:DIR, DIR holding {robustbench.TRAINING_FOLDERS[dataset]} "
                     f"(`train` {dataset}:data){where}")


def with_standard_model(config: BenchConfig) -> tuple[BenchConfig, str | None]:
    """`config` on the standard model of the family whose benchmark the domains name
    (cifar10-c:ROOT: robustbench:cifar10/Standard) when the user chose no `model`, with a
    line that says so; else as it is (the bundled fmnist-resnet by default)."""
    standard = None if "model" in config.chosen() else standard_model(config.data)
    if standard is None:
        return config, None
    family, model = standard
    return replace(config, model=model), f"model: {model}, the standard model of {family} (give `model` to change it)"


@guards_outputs
def run(config: BenchConfig, monitor: Monitor) -> str | None:
    """The whole `bench` command: the grid, then the table as markdown (returned) and as
    the CSV, JSON and plot files the config names; None on a torchrun rank other than 0."""
    config, model_line = with_standard_model(config)
    rows = with_fractions(config, with_norm_statistics(config, grid_rows(config, with_oracle(config, parse_methods(config.methods)))))
    seeds = config.seed_list()
    check_outputs(config.outputs(), config.inputs())
    if config.plot:
        tables.check_plotting()
    target = rank_device(pick_device(config.device))
    domains, notes = expand_benchmarks(config.data, config.source)  # a benchmark's ROOT: a column per corruption or domain
    train, train_line = training_data(config.train, config.model, config.data, rows)
    config = replace(config, device=str(target), train=train, data=domains)
    clean, settings = {}, {}
    with process_group(target) as (rank, world):
        for line in [model_line, train_line] if rank == 0 else []:
            if line:
                monitor.info(line)
        for note in notes if rank == 0 else []:
            monitor.warn(note)
        results = run_bench(config, rows, seeds, monitor, rank, world, clean, settings)
    if results is None:
        return None
    table = tables.summarise(results, rows, config.data, seeds)
    axes, sweep = config.grid_axes(), config.fractions is not None
    if config.csv:
        tables.write_csv(config.csv, table, config.data, rows if axes or sweep else None)
    if config.json:
        write_json(config.json, config, rows, seeds, table, results, clean or None, settings)
    if config.plot:
        if sweep:
            tables.plot_fractions(config.plot, table, rows)
        else:
            (tables.plot_conditions if axes else tables.plot)(config.plot, table, rows if axes else config.data)
    text = tables.markdown(table, config.data, seeds)
    if config.source:  # the columns are the targets; the model and its statistics are the source's
        text = f"source: {source_of(config)}\n\n{text}"
    if sweep:
        return f"{text}\n\n{tables.markdown_by_fraction(table, rows, seeds)}"
    return f"{text}\n\n{tables.markdown_by_condition(table, rows, seeds)}" if axes else text


def run_bench(config: BenchConfig, rows: list[Row], seeds: list[int], monitor: Monitor, rank: int = 0,
              world: int = 1, clean: dict | None = None,
              settings: dict | None = None) -> dict[tuple[str, str, int], DomainResult] | None:
    """Every (row label, domain, seed) result: statistics computed once per covariance
    mode (and fraction) the rows need (or re-used from the workdir), then the grid. Under torchrun every
    rank joins the statistics and runs its share of the grid; rank 0 gets every result,
    the other ranks None, and shows what the other ranks' runs said. With `clean` set, the
    source model's clean error goes into `clean`; with `settings`, each row's settings as its
    runs resolved them (ROW_SETTINGS), on rank 0."""
    monitor = RankMonitor(monitor if rank == 0 else None)
    # every check before statistics that can take hours, and before the workdir is made
    check_domains(config.data, config, config.gradual, config.severity_list(), config.oracle)
    check_method_options(config, rows)
    for row in rows:
        row_config(config, row, seeds[0], None, None)
    for covariance in covariances_needed(rows):
        check_options(covariance, config.shrinkage_value())
    if config.weights and not pretrained_by_name(config.model, config.weights):
        check_weights_file(config.weights)
    if config.train and config.train not in TRAINING_SETS and not Path(on_disk(config.train)).exists():
        raise InputError(f"`train` {config.train}: no such file or folder")
    workdir = make_workdir(config.workdir)
    artifacts = {(covariance, fraction): ensure_statistics(config, covariance, monitor, fraction)
                 for covariance, fraction in statistics_needed(rows)}
    wait_for_all(world)  # rank 0 has written the artifacts
    without_statistics = any(row.covariance is None for row in rows)
    classes = shared_class_list(config, workdir, artifacts, write=rank == 0) if without_statistics else None
    wait_for_all(world)  # and the class list
    resolved = {}
    mine = run_grid(config, rows, seeds, artifacts, classes, monitor, rank, world, clean, resolved)
    parts = gather_on_root((mine, resolved, monitor.said()), rank, world)
    if parts is None:
        return None
    show_other_ranks(monitor, [said for _, _, said in parts])
    if settings is not None:
        settings.update({label: row for _, part, _ in parts for label, row in part.items()})
    gathered = {key: result for part, _, _ in parts for key, result in part.items()}
    # in the order one process runs them: the JSON report lists the runs in this order
    return {(row.label, domain, seed): gathered[(row.label, domain, seed)] for row in rows for seed in seeds for domain in config.data}


def covariances_needed(rows: list[Row]) -> list[str]:
    """The covariance modes of the artifacts the rows use, one each, in a fixed order."""
    return sorted({row.covariance for row in rows if row.covariance})


def statistics_needed(rows: list[Row]) -> list[tuple[str, float | None]]:
    """The artifacts the rows read, as (covariance, fraction on a sweep), each once, in a fixed order."""
    return sorted({row.statistics for row in rows if row.statistics}, key=lambda key: (key[0], key[1] or 0))


def artifact_path(workdir: Path, covariance: str, fraction: float | None = None) -> Path:
    """One artifact a covariance mode, and on a fraction sweep one a fraction too (`stats-auto-fraction0.01`)."""
    return workdir / (f"stats-{covariance}.safetensors" if fraction is None else f"stats-{covariance}-fraction{fraction}.safetensors")


def ensure_statistics(config: BenchConfig, covariance: str, monitor: Monitor, fraction: float | None = None) -> Path:
    """The artifact for one covariance mode (at `fraction`, on a sweep), re-used when it was
    made for the same model and data; computed on the device, batch size and loader
    processes of the bench."""
    path = artifact_path(Path(config.workdir), covariance, fraction)
    stats = stats_config(config, covariance, path, fraction=fraction)
    if path.is_file():
        try:
            if _made_for(read_artifact(path, load_tensors=False), stats):
                return path
        except InputError:
            pass
    at = "" if fraction is None else f", `fraction` {fraction}"
    monitor.info(f"computing statistics (`covariance` {covariance}{at}) → {path}")
    compute_statistics(stats, monitor)
    return path


def shared_class_list(config: BenchConfig, workdir: Path, artifacts: dict[str, Path], write: bool = True) -> str | None:
    """The class list file every row uses, so that the rows without statistics read the
    labels in the model's output order too. Without it they take the test folders'
    sorted names, which is not the order of every training set (Fashion-MNIST's is not
    alphabetical), while the rows with statistics take the artifact's.
    --classes or a bundled model already fix it; else the training data's order is
    written to WORKDIR/classes.txt (by `write`: rank 0 under torchrun); None when there
    is no training data to ask, or it has no class folders."""
    if config.classes or bundled_model(config.model):
        return config.classes
    if artifacts:  # the names of all the model's outputs: a class subset's artifact has the subset's as class_names
        names = read_artifact(next(iter(artifacts.values())), load_tensors=False).model_class_names
    elif config.train:
        names = open_domain(config.train, None).class_names
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
    path = workdir / "classes.txt"
    if write:
        atomic_write(path, lambda tmp: Path(tmp).write_text("".join(f"{name}\n" for name in names), encoding="utf-8"))
    return str(path)


def _made_for(artifact, stats: StatsConfig) -> bool:
    """Whether an artifact holds these statistics, compared as compute_statistics records
    them (absolute paths: a relative --train or --workdir must match on a second run) and
    as cafa adapt checks the model (the same parameters in another file are the same)."""
    fraction, per_class = stats.training_sample()
    wanted = {"data": recorded_data(stats.data), "fraction": fraction, "per_class": per_class, "seed": stats.seed}
    if not (
        stats.classifier in (None, artifact.model.classifier)
        and (stats.classes is None or read_class_list(stats.classes) == artifact.model_class_names)
        and (set(read_class_list(stats.class_subset, "class_subset")) if stats.class_subset else None)
        == (set(artifact.class_names) if "class_subset" in artifact.metadata else None)
        and artifact.preprocessing == recipe(stats, stats.model)
        and all(artifact.sampling.get(key) == value for key, value in wanted.items())
        and same_shrinkage(stats.shrinkage_value(), artifact.metadata.get("shrinkage"), artifact.covariance)
        and ("norm_layers" in artifact.metadata or not stats.norm_moments)
    ):
        return False
    net, spec = resolve_model(stats)
    if model_mismatch(artifact, spec, net) is not None:
        return False
    # the same folder may hold other images since (added, removed, relabelled): compare the sample drawn
    return artifact.sampling.get("images_sha256") == sample_sha256(stats)


def run_grid(config: BenchConfig, rows: list[Row], seeds: list[int], artifacts: dict[str, Path], classes: str | None,
             monitor: Monitor, rank: int = 0, world: int = 1, clean: dict | None = None,
             settings: dict | None = None) -> dict[tuple[str, str, int], DomainResult]:
    """The result of every (row label, domain, seed) this rank runs: the grid's runs
    (grid_runs) are independent, so under torchrun each rank takes every world-th, and
    adapts those of one (row, seed) in one stream, starting afresh at each domain. The
    first (rank 0's) also measures the source model on `clean`, into `clean`; each row's
    resolved settings (its recipe's and the bench's) go into `settings`."""
    results, warned = {}, set()
    labels = tables.domain_labels(config.data)
    mine = groupby(grid_runs(config, rows, seeds)[rank::world], key=lambda run: run[:2])
    for k, ((row, seed), share) in enumerate(mine):
        stats = str(artifacts[row.statistics]) if row.statistics else None
        run = row_config(config, row, seed, stats, classes)
        job = prepare_adaptation(replace(run, clean=config.clean if k == 0 and rank == 0 else None), monitor)
        if job.clean:
            monitor.info(clean_summary(job.clean))
            if clean is not None:
                clean.update(job.clean)
        for caution in job.cautions():
            if caution not in warned:  # each once, not for every seed; rows may differ (a method, a rate)
                warned.add(caution)
                monitor.warn(caution)
        domains = [domain for _, _, domain in share]
        whole = domains == [None] or len(domains) == len(config.data)
        data = config.data if whole else [config.data[domain] for domain in domains]
        monitor.info(f"{row.label} seed {seed}" + ("" if whole else f": {', '.join(labels[name] for name in data)}"))
        if settings is not None:
            settings[row.label] = {key: job.recorded_settings[key] for key in ROW_SETTINGS}
        part = job if whole else part_of(job, domains)
        for domain, result in zip(data, per_domain(part.run(monitor=monitor, warned=warned), part.groups, data)):
            if result.error is None:
                raise InputError(f"{domain}: no labels, so no error to benchmark; bench needs labelled domains")
            results[(row.label, domain, seed)] = result
        # free this run's model and statistics before the next is built (16.8 GB of dense
        # factors at ImageNet scale); the feature hook makes a reference cycle, so collect
        del job, part
        gc.collect()
    return results


def grid_runs(config: BenchConfig, rows: list[Row], seeds: list[int]) -> list[tuple[Row, int, int | None]]:
    """The grid's independent runs in the order one process runs them: (row, seed, the
    index of the domain it adapts), one per domain where each starts from the source
    weights by itself (`reset` domain), else one (row, seed, None) over every domain."""
    apart = len(config.data) > 1
    return [(row, seed, domain) for row in rows for seed in seeds
            for domain in (range(len(config.data)) if apart and not why_domains_depend(row.method, config.reset, config.mix_domains)
                           else [None])]


def per_domain(results: list[DomainResult], groups: list[int] | None, domains: list[str]) -> list[DomainResult]:
    """One result per bench domain: with `gradual`, a corruption's nine severity visits as one."""
    if groups is None:
        return results
    merged = [DomainResult(domain) for domain in domains]
    for group, result in zip(groups, results):
        whole = merged[group]
        whole.n, whole.labelled, whole.errors = whole.n + result.n, whole.labelled + result.labelled, whole.errors + result.errors
        whole.skipped_images += result.skipped_images
        whole.skipped_steps += result.skipped_steps
        whole.seconds += result.seconds
    return merged


# the settings every row shares, as the JSON report lists them
SHARED = ("recipe", "method_option", "batch_size", "optimizer", "lr", "momentum", "steps", "params", "norm", "reset", "shuffle", "order", "mix_domains",
          "gradual", "orders", "batch_sizes", "severities", "fractions", "oracle", "device", "precision", "num_workers", "strict", "compile", "cuda_graph")


# what the JSON report records of each row's settings, as its runs resolved them
ROW_SETTINGS = ("recipe", "optimizer", "lr", "momentum", "batch_size", "steps", "params", "fisher_samples", "method_options")


def write_json(path: str, config: BenchConfig, rows: list[Row], seeds: list[int], table: list[dict], results: dict,
               clean: dict | None = None, settings: dict | None = None) -> None:
    """The table, every run (its error, images, skips and time), what each row ran with
    (its method, params, lr, the covariance it asked for and the form its artifact holds:
    `auto` picks one), the artifacts by content, and the options every row shared (each
    run's seed is under "runs")."""
    labels = tables.domain_labels(config.data)
    shared = {name: getattr(config, name, True) for name in SHARED}  # bench streams are shuffled
    shared["num_workers"] = loader_processes(config.num_workers, pick_device(config.device))
    fraction, per_class = (None, None) if config.fractions else config.training_sample()  # else each row's
    artifacts = {artifact_key(*key): _artifact_record(artifact_path(Path(config.workdir), *key), key[1])
                 for key in statistics_needed(rows)}
    payload = {
        "cafa_version": __version__,
        "versions": report.software_versions(),
        "unit": "error %",
        "seeds": seeds,
        "domains": [{"data": d, "label": labels[d]} for d in config.data],
        "table": [{"method": r["method"], **{labels[k]: {"mean": m, "std": s}
                                             for k, (m, s) in r["cells"].items()}} for r in table],
        "runs": [{"method": m, "seed": s, **report.domain_record(result)} for (m, _, s), result in results.items()],
        "rows": [{"label": r.label, "method": r.method, "covariance": r.covariance,
                  "covariance_used": artifacts[artifact_key(*r.statistics)]["covariance"] if r.statistics else None,
                  "order": r.order_of(config),
                  # on a severity axis or with the oracle twins, each row's own
                  **({"severity": r.severity} if config.severities else {}), **({"oracle": r.oracle} if config.oracle else {}),
                  **({"fraction": r.fraction} if config.fractions else {}),
                  **(settings or {}).get(r.label, {"params": r.params_of(config), "lr": r.lr_of(config),
                                                   "batch_size": r.batch_size_of(config)})} for r in rows],
        "artifacts": artifacts,
        **({"clean": clean} if clean else {}),
        "settings": {
            **shared, "methods": ",".join(dict.fromkeys(r.name for r in rows if not r.oracle)), "train": config.train, "model": config.model,
            **dict(zip(("weights", "weights_sha256"), weights_record(config.model, config.weights))),
            "model_args": config.model_args,
            "classes": absolute(config.classes), "labels": absolute(config.labels),
            "severity": None if config.severities else effective_severity(config),  # else each row's
            "source": source_of(config),
            **({"class_subset": absolute(config.class_subset)} if config.class_subset else {}),
            **({"subset": absolute(config.subset)} if config.subset else {}),
            "fraction": fraction, "per_class": per_class, "shrinkage": config.shrinkage_value(),
            "preprocessing": {"train": asdict(recipe(config, config.model)),
                              "test": asdict(recipe(config, config.model, config.test_preprocessing_changes()))},
        },
    }
    report.write_json(path, payload)


def artifact_key(covariance: str, fraction: float | None) -> str:
    """An artifact's key in the JSON report: its covariance mode (`auto`), and its fraction on a sweep (`auto, fraction 0.01`)."""
    return covariance if fraction is None else f"{covariance}, fraction {fraction}"


def _artifact_record(path: Path, fraction: float | None = None) -> dict:
    """An artifact the grid has just read and validated, by content: the form it holds,
    when it was made, the model parameters it was made with, the file's sha256, and its
    training fraction on a fraction sweep."""
    with open_safetensors(path) as f:
        metadata = f.metadata()
    return {"path": str(path.resolve()), "sha256": sha256_of(path), "covariance": metadata["covariance"],
            "created": metadata.get("created"), "parameters_sha256": metadata.get("parameters_sha256"),
            **({"fraction": fraction} if fraction is not None else {})}
