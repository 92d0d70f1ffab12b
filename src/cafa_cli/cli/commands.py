"""The commands. Each builds its settings object from the options and calls its job.

Jobs are imported inside the commands: they import torch, which `cafa --help` must not
wait for.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Literal, Optional

import typer

from cafa_cli import DEFAULT_ARTIFACT
from cafa_cli.cli.completion import complete_method, complete_recipe
from cafa_cli.cli.defaults import defaults_file
from cafa_cli.cli.errors import as_flags, from_config, gate
from cafa_cli.cli.options import chosen_settings, domains_given, with_settings
from cafa_cli.cli.streams import stderr, stdout_needed
from cafa_cli.jobs.config import AdaptConfig, BenchConfig, DemoConfig, FeaturesPlotConfig, StatsConfig
from cafa_cli.jobs.config.settings import OUTPUT

Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress or summary on stderr.", rich_help_panel=OUTPUT)]
Domains = Annotated[
    Optional[list[str]],
    typer.Argument(
        metavar="DOMAIN", show_default=False, help="Test domains, e.g. ImageNet-C/*/5 as the shell expands it."
    ),
]
OneDomain = Annotated[
    Optional[list[str]],
    typer.Argument(metavar="DOMAIN", show_default=False, help="The test domain (one), as for cafa adapt."),
]


def keep_defaults_file(outputs: dict[str, str | None]) -> None:
    """The file the defaults came from is an input the jobs never see: no output may replace it."""
    from cafa_cli.jobs.shared.outputs import check_outputs

    config_file = defaults_file(Path.cwd())
    check_outputs(outputs, {"config": str(config_file) if config_file else None})


@with_settings(StatsConfig)
def stats(ctx: typer.Context, quiet: Quiet = False, **settings):
    """Compute per-class feature Gaussians of a training set into a safetensors artifact."""
    from cafa_cli.jobs.shared.distributed import torchrun_rank
    from cafa_cli.jobs.shared.monitor import Monitor
    from cafa_cli.jobs.stats import compute_statistics

    config = StatsConfig(**settings)
    keep_defaults_file(config.outputs())
    with Monitor(stderr(quiet), quiet or torchrun_rank() > 0, as_flags) as monitor:
        artifact = compute_statistics(config, monitor)
    if artifact is None:  # a torchrun rank other than 0
        return
    skipped = artifact.sampling.get("skipped_images") or 0
    monitor.info(
        f"wrote {config.out}: {artifact.num_classes} classes, d={artifact.feature_dim}, "
        f"{artifact.metadata['num_images']} images, covariance {artifact.covariance}"
        + (f", {skipped} unreadable image{'s' if skipped != 1 else ''} skipped" if skipped else "")
    )


@with_settings(AdaptConfig)
def adapt(ctx: typer.Context, domains: Domains = None, quiet: Quiet = False, **settings):
    """Adapt a model online over test domains; print one prediction per image (CSV or JSONL)
    on stdout and a summary on stderr."""
    from cafa_cli.data.benchmarks import source_of
    from cafa_cli.jobs import adapt as adapt_job
    from cafa_cli.jobs.shared.monitor import Monitor
    from cafa_cli.jobs.shared.report import above_max_error, print_table, summary_table

    config = AdaptConfig(
        **{
            **settings,
            "data": domains_given(ctx, domains, settings["data"], from_config),
            "given": chosen_settings(ctx, settings),
        }
    )
    keep_defaults_file(config.outputs())
    if config.predictions is None:
        stdout_needed()
    console = stderr(quiet)
    if "-" in config.data and sys.stdin.isatty():  # else a terminal would wait with no word of why
        console.print("reading image paths from standard input, one per line; end with Ctrl-D")
    with Monitor(console, quiet, as_flags) as monitor:
        results = adapt_job.run(config, monitor)
    if results is not None:  # None: a torchrun rank other than 0, whose results rank 0 shows
        # the title names what the errors are of: CAFA-Oracle's are not the method's own
        method = config.method + (" --oracle" if config.oracle else "")
        print_table(console, summary_table(method, results, source_of(config)))
        gate(above_max_error(results, config.max_error, method))  # last: every output is written


def inspect(
    artifact: Annotated[str, typer.Argument(metavar="ARTIFACT", help="A cafa statistics artifact.")] = DEFAULT_ARTIFACT,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON on stdout.")] = False,
):
    """Summarise and validate an artifact: classes, counts, dimensions, shrinkage, model, conditioning."""
    from rich.console import Console

    from cafa_cli.artifact.reading import read_arrays
    from cafa_cli.jobs.inspect import describe, render
    from cafa_cli.jobs.shared.report import to_json

    summary = describe(read_arrays(artifact))  # numpy's arrays: inspect never imports torch
    if as_json:
        print(to_json(summary, indent=2))
    else:
        Console(highlight=False).print(render(summary), soft_wrap=True)  # a long value is never broken


def methods(
    name: Annotated[
        Optional[str],
        typer.Argument(
            metavar="METHOD",
            show_default=False,
            autocompletion=complete_method,
            help="A method: print its options and a recipe as TOML.",
        ),
    ] = None,
    recipe: Annotated[
        str,
        typer.Option(
            "--recipe",
            metavar="NAME|FILE",
            autocompletion=complete_recipe,
            help="With METHOD: the recipe to print, imagenet-c, cifar10-c, cifar100-c, a "
            ".toml file, or none (the settings' own defaults).",
        ),
    ] = "none",
    output: Annotated[
        Optional[Literal["table", "markdown", "json"]],
        typer.Option(
            "--format",
            show_default=False,
            help="Without METHOD: the table drawn to fit the terminal, markdown, or JSON "
            "(default: table on a terminal, markdown into a file or pipe).",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Without METHOD: the table as JSON (--format json).")] = False,
):
    """List the methods (what each does, its paper, what it adapts, whether it needs an
    artifact, its step cost and peak memory); with METHOD, its options and a recipe as TOML
    for --recipe."""
    from rich.console import Console

    from cafa_cli.core.errors import UsageError
    from cafa_cli.jobs.methods import markdown, method_recipe, methods_table, terminal_table
    from cafa_cli.jobs.shared.report import to_json

    stdout_needed()
    if as_json and output not in (None, "json"):
        raise UsageError(f"--json is --format json; give one of --json and --format {output}")
    if name is not None:
        if as_json or output is not None:  # ignored, the user would read TOML as the JSON asked for
            raise UsageError(
                f"--{'json' if as_json else 'format'} is for the table of methods; with a METHOD the output is its "
                f"options and recipe as TOML: drop it, or drop {name}"
            )
        print(method_recipe(name, recipe), end="")
        return
    rows = methods_table()
    output = "json" if as_json else output or ("table" if sys.stdout.isatty() else "markdown")
    if output == "table":
        console = Console(highlight=False)
        console.print(terminal_table(rows, console.width))
    else:
        print(to_json(rows, indent=2) if output == "json" else markdown(rows))


@with_settings(DemoConfig)
def demo(quiet: Quiet = False, **settings):
    """Build Fashion-MNIST-C from the Debian package, then run stats and adapt (Source, BN,
    TENT, CAFA) and print a table."""
    from cafa_cli.jobs.demo import build_data_only, run_demo
    from cafa_cli.jobs.shared.monitor import Monitor

    config = DemoConfig(**settings)
    stdout_needed()
    with Monitor(stderr(quiet), quiet, as_flags) as monitor:
        if config.data_only:
            for folder in build_data_only(config, monitor):
                print(folder)
            return
        table = run_demo(config, monitor, echo=lambda line: monitor.info(f"$ {line}"))
    print(table)


@with_settings(BenchConfig)
def bench(ctx: typer.Context, domains: Domains = None, quiet: Quiet = False, **settings):
    """Methods × domains × seeds → a paper-style table of errors (%), markdown on stdout."""
    from cafa_cli.jobs import bench as bench_job
    from cafa_cli.jobs.shared.monitor import Monitor

    config = BenchConfig(
        **{
            **settings,
            "data": domains_given(ctx, domains, settings["data"], from_config),
            "given": chosen_settings(ctx, settings),
        }
    )
    keep_defaults_file(config.outputs())
    stdout_needed()
    with Monitor(stderr(quiet), quiet, as_flags) as monitor:
        report = bench_job.run(config, monitor)
    if report is not None:  # None on a torchrun rank other than 0: rank 0 reports
        print(report.text, flush=True)
        if report.failed is not None:  # the other rows' outputs are written
            raise report.failed
        gate(bench_job.above_max_error(report.table, config.max_error))  # last: every output is written


@with_settings(FeaturesPlotConfig, skip=("reset", "mix_domains", "gradual", "rounds"))  # one domain, one pass
def plot_features(ctx: typer.Context, domains: OneDomain = None, quiet: Quiet = False, **settings):
    """Embed one domain's features in 2-D (t-SNE) before and after adaptation, one panel a
    method, with the artifact's class means; each panel's error and feature scatter on stderr
    (--json: stdout)."""
    from cafa_cli.jobs.plot import features as plot_job
    from cafa_cli.jobs.shared.monitor import Monitor
    from cafa_cli.jobs.shared.report import to_json

    config = FeaturesPlotConfig(
        **{
            **settings,
            "data": domains_given(ctx, domains, settings["data"], from_config),
            "given": chosen_settings(ctx, settings),
        }
    )
    keep_defaults_file(config.outputs())
    if config.json:
        stdout_needed()
    console = stderr(quiet)
    with Monitor(console, quiet, as_flags) as monitor:
        numbers = plot_job.run(config, monitor)
    console.print(plot_job.numbers_table(numbers))
    console.print(f"wrote {config.out}")
    if config.json:
        print(to_json(numbers, indent=2))
