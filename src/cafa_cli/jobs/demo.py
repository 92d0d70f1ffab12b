"""`cafa demo`: CAFA on real images with nothing but this package and Debian's
Fashion-MNIST — build the data, compute statistics, adapt, print a table.

It runs `cafa stats` and `cafa adapt` through the same functions as the CLI and
prints their command lines, so every number can be reproduced by hand.
"""

from __future__ import annotations

import shlex
from dataclasses import fields
from pathlib import Path

from cafa_cli.core.files import make_workdir
from cafa_cli.data.fashion_mnist import check_installed
from cafa_cli.data.fmnist_c import BENCHMARK_CORRUPTIONS, build_corrupted, build_training_subset, check_corruptions
from cafa_cli.jobs.bench import run_bench, tables
from cafa_cli.jobs.bench.rows import parse_methods
from cafa_cli.jobs.bench.runs import row_config
from cafa_cli.jobs.bench.statistics import artifact_path, covariances_needed
from cafa_cli.jobs.config import AdaptConfig, BenchConfig, DemoConfig
from cafa_cli.jobs.config.settings import recorded_as_given
from cafa_cli.jobs.shared.monitor import Monitor

MODEL = "fmnist-resnet"


def corruption_names(config: DemoConfig) -> list[str]:
    if config.corruptions == "all":
        return list(BENCHMARK_CORRUPTIONS)
    return [c.strip() for c in config.corruptions.split(",") if c.strip()]


def command_line(*words) -> str:
    return " ".join(shlex.quote(str(w)) for w in words)


def adapt_words(config: AdaptConfig) -> list[str]:
    """The `cafa adapt` options that give this run's settings: --method, then those chosen
    (off their defaults, or named in `given`: a recipe leaves those), its recipe and method options."""
    words = ["--method", config.method]
    defaults, chosen = {f.name: f.default for f in fields(AdaptConfig)}, config.chosen()
    words += ["--recipe", config.recipe] if config.recipe != defaults["recipe"] else []
    words += [word for entry in config.method_option for word in ("--method-option", entry)]
    for name in recorded_as_given(AdaptConfig):
        value = getattr(config, name)
        if name in ("method", "recipe", "method_option") or (value == defaults[name] and name not in chosen):
            continue
        flag = name.replace("_", "-")
        if isinstance(value, bool):
            words.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            words += [f"--{flag}", str(value)]
    return words


def build_data_only(config: DemoConfig, monitor: Monitor) -> list[Path]:
    """Only the corrupted image folders (e.g. the full set for cafa bench), at each severity
    asked for: corruption by corruption within a severity."""
    parse_methods(config.methods)  # a typo there is not ignored because no method runs
    severities, corruptions = config.severity_list(), corruption_names(config)
    for severity in severities:  # every value checked before the first image is built
        check_corruptions(corruptions, severity, config.test_per_class or None)
    return [
        folder
        for severity in severities
        for folder in build_corrupted(
            Path(config.workdir),
            corruptions,
            severity,
            config.test_per_class or None,
            config.seed,
            config.fashion_mnist,
            on_domain=lambda name, s=severity: monitor.info(
                f"corrupting: {name}" + (f"/{s}" if len(severities) > 1 else "")
            ),
        )
    ]


def run_demo(config: DemoConfig = DemoConfig(), monitor: Monitor | None = None, echo=print) -> str:
    """Returns the results table (markdown); `echo` receives the command lines run."""
    monitor = monitor or Monitor()
    rows = parse_methods(config.methods)
    config.severity_list()  # `severities` is for `data_only`
    corruptions, test_per_class, root = corruption_names(config), config.test_per_class or None, config.fashion_mnist
    check_corruptions(corruptions, config.severity, test_per_class)
    check_installed(root)
    workdir = make_workdir(config.workdir)
    monitor.info(f"building data in {workdir} (re-used when already there)")
    train = build_training_subset(workdir, config.train_per_class, config.seed, root)
    domains = [
        str(p)
        for p in build_corrupted(
            workdir,
            corruptions,
            config.severity,
            test_per_class,
            config.seed,
            root,
            on_domain=lambda name: monitor.info(f"corrupting test images: {name}"),
        )
    ]
    bench = BenchConfig(
        data=domains,
        train=str(train),
        model=MODEL,
        methods=config.methods,
        seeds=str(config.seed),
        fraction=1.0,
        batch_size=config.batch_size,
        lr=config.lr,
        workdir=str(workdir),
    )
    for covariance in covariances_needed(rows):
        echo(
            command_line(
                "cafa",
                "stats",
                "--model",
                MODEL,
                "--data",
                train,
                "--fraction",
                1,
                "--seed",
                0,
                "--covariance",
                covariance,
                "--out",
                artifact_path(workdir, covariance),
            )
        )
    data_args = [w for d in domains for w in ("--data", d)]
    for row in rows:
        stats_args = ["--stats", artifact_path(workdir, row.covariance)] if row.covariance else ["--model", MODEL]
        echo(
            command_line(
                "cafa", "adapt", *stats_args, *data_args, *adapt_words(row_config(bench, row, config.seed, None, None))
            )
        )
    results = run_bench(bench, rows, [config.seed], monitor)
    return tables.markdown(tables.summarise(results, rows, domains, [config.seed]), domains, [config.seed])
