"""`cafa bench`: methods × domains × seeds → a paper-style error table.

Every (row, seed) is one `cafa adapt` run over all the domains, through the same
functions as the CLI. Statistics are computed once per covariance mode (and training
fraction, on a fraction sweep) and re-used.
Under torchrun the runs are spread over the ranks, and so are the domains of a run
whose domains are independent (`reset` domain).
"""

from __future__ import annotations

import gc
from dataclasses import replace
from itertools import groupby
from pathlib import Path
from typing import NamedTuple

from cafa_cli.core.devices import pick_device
from cafa_cli.core.errors import CafaError, InputError, UsageError, listing
from cafa_cli.core.files import make_workdir
from cafa_cli.data.arrays import TRAINING_SETS
from cafa_cli.data.benchmarks import expand_benchmarks, source_of
from cafa_cli.data.sources import on_disk
from cafa_cli.jobs.adapt.job import part_of
from cafa_cli.jobs.adapt.prepare import check_recipe_file, prepare_adaptation
from cafa_cli.jobs.bench import selection, tables
from cafa_cli.jobs.bench.record import ROW_SETTINGS, write_json
from cafa_cli.jobs.bench.rows import Row, grid_rows, parse_methods, with_fractions, with_norm_statistics, with_oracle
from cafa_cli.jobs.bench.runs import (
    check_apart_from_tests,
    check_domains,
    check_method_options,
    check_outliers,
    row_config,
    training_data,
    with_standard_model,
)
from cafa_cli.jobs.bench.selection import with_selection
from cafa_cli.jobs.bench.statistics import covariances_needed, ensure_statistics, shared_class_list, statistics_needed
from cafa_cli.jobs.config import BenchConfig
from cafa_cli.jobs.shared.clean import clean_summary
from cafa_cli.jobs.shared.distributed import (
    RankMonitor,
    gather_on_root,
    process_group,
    rank_device,
    show_other_ranks,
    wait_for_all,
    why_domains_depend,
)
from cafa_cli.jobs.shared.monitor import Monitor
from cafa_cli.jobs.shared.outputs import check_outputs, guards_outputs
from cafa_cli.jobs.shared.report import above
from cafa_cli.jobs.shared.results import DomainResult
from cafa_cli.methods import is_plugin
from cafa_cli.methods.recipes import FAMILIES, shipped
from cafa_cli.model.checkpoints import check_weights_file
from cafa_cli.model.loading import pretrained_by_name
from cafa_cli.statistics.gaussians import check_options


class BenchReport(NamedTuple):
    text: str  # the markdown for stdout
    table: list[dict]  # tables.summarise's: each row's errors in %, which `max_error` gates on
    failed: CafaError | None = None  # why rows failed, once the others' outputs are written (failed_rows)


@guards_outputs
def run(config: BenchConfig, monitor: Monitor) -> BenchReport | None:
    """The whole `bench` command: the grid, then the table as markdown (returned, with the
    table) and as the CSV, JSON and plot files the config names; None on a torchrun rank
    other than 0."""
    config, model_line = with_standard_model(config)
    methods = with_selection(config, parse_methods(config.methods))
    rows = with_fractions(config, with_norm_statistics(config, grid_rows(config, with_oracle(config, methods))))
    chosen = config.selection()
    seeds = config.seed_list()
    check_outputs(config.outputs(), config.inputs())
    if config.plot:
        tables.check_plotting()
    target = rank_device(pick_device(config.device))
    domains, notes = expand_benchmarks(
        config.data, config.source
    )  # a benchmark's ROOT: a column per corruption or domain
    held_out = held_out_domains(chosen, config)
    train, train_line = training_data(config.train, config.model, config.data, rows)
    config = replace(config, device=str(target), train=train, data=domains)
    clean, settings, protocols, failed = {}, {}, {}, {}
    held_out_results = {}
    with process_group(target) as (rank, world):
        for line in [model_line, train_line] if rank == 0 else []:
            if line:
                monitor.info(line)
        for note in notes if rank == 0 else []:
            monitor.warn(note)
        if held_out:  # first: a mistake in them is found before the test domains' runs
            monitor.info(f"held out for `by`: {', '.join(tables.domain_labels(held_out).values())}")
            held_out_results = run_bench(
                replace(config, data=held_out), rows, seeds, monitor, rank, world, failed=failed
            )
        results = run_bench(config, rows, seeds, monitor, rank, world, clean, settings, protocols, failed)
    if results is None:
        return None
    total = len(rows)
    rows = [row for row in rows if not any(label == row.label for label, _ in failed)]
    by_metric = {metric: tables.summarise(results, rows, config.data, seeds, metric) for metric in tables.METRICS}
    table, shown, metric = by_metric["error"], by_metric[config.metric], config.metric
    scored = tables.open_world(results, rows, config.data, seeds)
    picked = None
    if chosen:
        held_table = tables.summarise(held_out_results, rows, held_out, seeds) if held_out else None
        picked = selection.select(config, rows, table, results, protocols, seeds, held_table)
    axes, sweep = config.grid_axes(), config.fractions is not None
    if config.csv:
        tables.write_csv(config.csv, by_metric, config.data, rows if axes or sweep else None)
    if config.metrics_json:
        write_json(
            config.metrics_json,
            config,
            rows,
            seeds,
            by_metric,
            results,
            clean or None,
            settings,
            protocols,
            scored,
            picked,
        )
    rounds = tables.by_round(protocols, rows, seeds) if config.rounds > 1 else None
    if config.plot:
        if rounds:
            tables.plot_rounds(config.plot, rounds)
        elif sweep:
            tables.plot_fractions(config.plot, shown, rows, metric)
        else:
            (tables.plot_conditions if axes else tables.plot)(config.plot, shown, rows if axes else config.data, metric)
    text = tables.markdown(shown, config.data, seeds, metric)
    if metric != "error":  # the error's table is the one a reader expects unnamed
        text = f"{tables.METRICS[metric].unit}, of the labelled images' predictions\n\n{text}"
    if config.source:  # the columns are the targets; the model and its statistics are the source's
        text = f"source: {source_of(config)}\n\n{text}"
    if sweep:
        text = f"{text}\n\n{tables.markdown_by_fraction(shown, rows, seeds, metric)}"
    elif axes:
        text = f"{text}\n\n{tables.markdown_by_condition(shown, rows, seeds, metric)}"
    if rounds:
        text = f"{text}\n\n{tables.markdown_by_round(rounds, seeds)}"
    if scored:
        text = f"{text}\n\n{tables.markdown_open_world(table, scored, seeds)}"
    if picked:
        text = f"{text}\n\n{selection.markdown(picked)}"
    shares = tables.adapted_shares(protocols, rows, seeds)
    if shares:
        text = f"{text}\n\n{tables.markdown_shares(shares)}"
    differing = tables.differing_settings(settings, skip=("batch_size",) if config.batch_sizes else ())
    if differing:
        text = f"{text}\n\n{differing}"
    return BenchReport(text, table, failed_rows(failed, total))


def held_out_domains(chosen: tuple | None, config: BenchConfig) -> list[str]:
    """`by` held-out:DOMAINS's domains (a benchmark's ROOT: its corruptions), none of them a test
    domain; [] under another rule."""
    if not chosen or chosen[2] != "held-out":
        return []
    domains, _ = expand_benchmarks(chosen[3], config.source)
    tests, _ = expand_benchmarks(config.data, config.source)
    shared = [domain for domain in domains if domain in tests]
    if shared:
        raise UsageError(
            f"`by` {config.by}: {shared[0]} is also a test domain; hold out domains the table does not report"
        )
    return domains


def failed_rows(failed: dict[tuple[str, int], CafaError], rows: int) -> CafaError | None:
    """One error for the rows whose runs failed (of `rows`), of the first one's kind, naming
    each with its reason; None when none did."""
    if not failed:
        return None
    seeds: dict[tuple[str, str], list[str]] = {}  # a row's seeds that failed alike, named once
    for (label, seed), error in failed.items():
        seeds.setdefault((label, str(error)), []).append(str(seed))
    reasons = listing(f"{label} (seed {', '.join(each)}): {why}" for (label, why), each in seeds.items())
    error = CafaError(
        f"{len({label for label, _ in failed})} of {rows} rows failed, left out of the outputs written for the "
        f"others: {reasons}"
    )
    error.exit_code = next(iter(failed.values())).exit_code
    return error


def above_max_error(table: list[dict], max_error: float | None) -> str | None:
    """Why `cafa bench --max-error` fails the run, in one line naming the rows whose mean
    error over the domains (the table's mean column, %, mean over the seeds) is above it;
    None when none is (or it is not asked for)."""
    if max_error is None:
        return None
    over = [(row["method"], row["cells"]["mean"][0]) for row in table if above(row["cells"]["mean"][0], max_error)]
    if len(over) == 1:
        return f"mean error {over[0][1]:.2f} % is above `max_error` {max_error:g} ({over[0][0]})"
    if over:
        rows = listing(f"{label} {error:.2f} %" for label, error in over)
        return f"mean error is above `max_error` {max_error:g} in {len(over)} of {len(table)} rows: {rows}"
    return None


def run_bench(
    config: BenchConfig,
    rows: list[Row],
    seeds: list[int],
    monitor: Monitor,
    rank: int = 0,
    world: int = 1,
    clean: dict | None = None,
    settings: dict | None = None,
    protocols: dict | None = None,
    failed: dict | None = None,
) -> dict[tuple[str, str, int], DomainResult] | None:
    """Every (row label, domain, seed) result: statistics computed once per covariance
    mode (and fraction) the rows need (or re-used from the workdir), then the grid. Under torchrun every
    rank joins the statistics and runs its share of the grid; rank 0 gets every result,
    the other ranks None, and shows what the other ranks' runs said. With `clean` set, the
    source model's clean error goes into `clean`; with `settings`, each row's settings as its
    runs resolved them (ROW_SETTINGS), and with `protocols` each run's protocol results (the
    stream's pace, the error by round, forgetting: Adaptation.protocol), on rank 0. A row
    whose run failed is left out, its error in `failed` by (row label, seed); when every row
    failed, the first error is raised."""
    monitor = RankMonitor(monitor if rank == 0 else None)
    # every check before statistics that can take hours, and before the workdir is made
    tests = check_domains(config.data, config, config.gradual, config.severity_list(), config.oracle)
    check_method_options(config, rows)
    for row in rows:
        check_recipe_file(row_config(config, row, seeds[0], None, None))
    for covariance in covariances_needed(rows):
        check_options(covariance, config.shrinkage_value())
    if config.weights and not pretrained_by_name(config.model, config.weights):
        check_weights_file(config.weights)
    for option in ("train", "clean", "source_data", "forgetting"):  # the data options besides the domains
        given = getattr(config, option)
        if given and given not in TRAINING_SETS and given != "-" and not Path(on_disk(given)).exists():
            raise InputError(f"`{option}` {given}: no such file or folder")
    check_apart_from_tests(config, rows, tests)
    check_outliers(config, tests)
    for method, reset in dict.fromkeys((row.method, row_reset(config, row)) for row in rows):
        if reset != config.reset:  # a per-domain column is then one stream through the domains
            monitor.info(
                f"{method} runs under its recipe's reset {reset}, not the bench's {config.reset} (its authors' "
                f"protocol); give `reset` to choose one for every row"
            )
    workdir = make_workdir(config.workdir)
    artifacts = {
        (covariance, fraction): ensure_statistics(config, covariance, monitor, fraction, rank, world)
        for covariance, fraction in statistics_needed(rows)
    }
    wait_for_all(world)  # rank 0 has written the artifacts
    without_statistics = any(row.covariance is None for row in rows)
    classes = shared_class_list(config, workdir, artifacts, write=rank == 0) if without_statistics else None
    wait_for_all(world)  # and the class list
    resolved, found, failures = {}, {}, {}
    mine = run_grid(config, rows, seeds, artifacts, classes, monitor, rank, world, clean, resolved, found, failures)
    parts = gather_on_root((mine, resolved, found, failures, monitor.said()), rank, world)
    if parts is None:
        return None
    show_other_ranks(monitor, [said for *_, said in parts])
    errors = {key: error for _, _, _, part, _ in parts for key, error in part.items()}
    if failed is not None:
        failed.update(errors)
    lost = {label for label, _ in errors}
    if len(lost) == len(rows):
        raise next(iter(errors.values()))
    if settings is not None:
        settings.update({label: row for _, part, *_ in parts for label, row in part.items() if label not in lost})
    if protocols is not None:
        protocols.update(
            {key: record for _, _, part, *_ in parts for key, record in part.items() if key[0] not in lost}
        )
    gathered = {key: result for part, *_ in parts for key, result in part.items()}
    # in the order one process runs them: the JSON report lists the runs in this order
    return {
        (row.label, domain, seed): gathered[(row.label, domain, seed)]
        for row in rows
        if row.label not in lost
        for seed in seeds
        for domain in config.data
    }


def run_grid(
    config: BenchConfig,
    rows: list[Row],
    seeds: list[int],
    artifacts: dict[str, Path],
    classes: str | None,
    monitor: Monitor,
    rank: int = 0,
    world: int = 1,
    clean: dict | None = None,
    settings: dict | None = None,
    protocols: dict | None = None,
    failed: dict | None = None,
) -> dict[tuple[str, str, int], DomainResult]:
    """The result of every (row label, domain, seed) this rank runs: the grid's runs
    (grid_runs) are independent, so under torchrun each rank takes every world-th, and
    adapts those of one (row, seed) in one stream, starting afresh at each domain. The
    first (rank 0's) also measures the source model on `clean`, into `clean`; each row's
    resolved settings (its recipe's and the bench's) go into `settings`, and each (row label,
    seed)'s protocol results into `protocols`. A run that fails (a CafaError) goes into
    `failed` by (row label, seed), and the others go on."""
    results, warned = {}, set()
    mine = groupby(grid_runs(config, rows, seeds)[rank::world], key=lambda run: run[:2])
    measures_clean = rank == 0  # the first run that gets through measures it
    for (row, seed), share in mine:
        try:
            ran = run_once(
                config,
                row,
                seed,
                share,
                artifacts,
                classes,
                monitor,
                measures_clean,
                warned,
                clean,
                settings,
                protocols,
            )
        except CafaError as error:  # the row fails; the others go on (run_bench drops it from the table)
            monitor.warn(f"{row.label} seed {seed} failed: {error}")
            if failed is not None:  # without its traceback, whose frames would keep the run's model alive
                failed[(row.label, seed)] = error.with_traceback(None)
        else:
            results.update(ran)
            measures_clean = False
        # free this run's model and statistics before the next is built (16.8 GB of dense
        # factors at ImageNet scale); the feature hook makes a reference cycle, so collect
        gc.collect()
    return results


def run_once(
    config: BenchConfig,
    row: Row,
    seed: int,
    share: list,
    artifacts: dict[str, Path],
    classes: str | None,
    monitor: Monitor,
    first: bool,
    warned: set,
    clean: dict | None,
    settings: dict | None,
    protocols: dict | None,
) -> dict[tuple[str, str, int], DomainResult]:
    """The results of one (row, seed) run over its domains (`share`, grid_runs'); the first
    run of rank 0 also measures the source model on `clean`."""
    labels = tables.domain_labels(config.data)
    stats = str(artifacts[row.statistics]) if row.statistics else None
    run = row_config(config, row, seed, stats, classes)
    job = prepare_adaptation(replace(run, clean=config.clean if first else None), monitor)
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
    job.consistency = config.select is not None  # one more forward pass a batch: every rule scored at once
    part = job if whole else part_of(job, domains)
    visits = across_rounds(part.run(monitor=monitor, warned=warned), run.rounds)
    results = {}
    for domain, result in zip(data, per_domain(visits, part.groups, data)):
        if result.error is None:
            raise InputError(f"{domain}: no labels, so no error to benchmark; bench needs labelled domains")
        results[(row.label, domain, seed)] = result
    if settings is not None:
        settings[row.label] = {key: job.recorded_settings[key] for key in ROW_SETTINGS}
    if protocols is not None and part.protocol:
        protocols[(row.label, seed)] = part.protocol
    return results


def grid_runs(config: BenchConfig, rows: list[Row], seeds: list[int]) -> list[tuple[Row, int, int | None]]:
    """The grid's independent runs in the order one process runs them: (row, seed, the
    index of the domain it adapts), one per domain where each starts from the source
    weights by itself (`reset` domain), else one (row, seed, None) over every domain."""
    apart = len(config.data) > 1
    return [
        (row, seed, domain)
        for row in rows
        for seed in seeds
        for domain in (
            range(len(config.data))
            if apart
            and config.rounds == 1
            and not config.forgetting
            and not why_domains_depend(row.method, row_reset(config, row), config.mix_domains)
            else [None]
        )
    ]


def row_reset(config: BenchConfig, row: Row) -> str:
    """The `reset` a row runs under: the bench's when chosen, else its method's schedule
    where a shipped recipe gives one (rdumb's every:N, the same in every family)."""
    if "reset" in config.chosen() or is_plugin(row.method):
        return config.reset
    schedules = {recipe.settings.get("reset") for family in FAMILIES if (recipe := shipped(row.method, family))}
    return next(iter(schedules - {None}), config.reset)


def across_rounds(results: list[DomainResult], rounds: int) -> list[DomainResult]:
    """With `rounds`, each visit's results of every round as one: a cell of the table is the
    error over all rounds (the error of each round is the run's protocol)."""
    if rounds == 1:
        return results
    visits = len(results) // rounds
    return per_domain(results, [k % visits for k in range(len(results))], [r.data for r in results[:visits]])


def per_domain(results: list[DomainResult], groups: list[int] | None, domains: list[str]) -> list[DomainResult]:
    """One result per bench domain: with `gradual`, a corruption's nine severity visits as one."""
    if groups is None:
        return results
    merged = [DomainResult(domain) for domain in domains]
    for group, result in zip(groups, results):
        whole = merged[group]
        whole.n, whole.labelled, whole.errors = (
            whole.n + result.n,
            whole.labelled + result.labelled,
            whole.errors + result.errors,
        )
        whole.calibration.merge(result.calibration)
        whole.entropy_sum += result.entropy_sum
        if result.consistent is not None:
            whole.consistent = (whole.consistent or 0) + result.consistent
        whole.skipped_images += result.skipped_images
        whole.skipped_steps += result.skipped_steps
        whole.undefined_batches += result.undefined_batches
        whole.seconds += result.seconds
        whole.batches += result.batches
        whole.adapted_batches += result.adapted_batches
        whole.paced = result.paced
        if result.outlier_scores is not None:
            whole.inlier_scores = [*(whole.inlier_scores or []), *result.inlier_scores]
            whole.outlier_scores = [*(whole.outlier_scores or []), *result.outlier_scores]
    return merged
