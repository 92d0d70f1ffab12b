"""`cafa bench`'s settings: rows of methods, the grid's axes, the statistics and the outputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cafa_cli.core.errors import UsageError, repeated
from cafa_cli.data.pace import parse_stream_rates
from cafa_cli.data.values import check_batch_size, check_outlier_share, parse_order
from cafa_cli.jobs.config.checks import (
    _axis,
    check,
    check_gradual_severity,
    check_max_error,
    check_seed,
    factory_file,
    parse_severities,
)
from cafa_cli.jobs.config.data import InputOptions, ModelOptions, TestDataOptions
from cafa_cli.jobs.config.settings import (
    AS_BUILT,
    AS_PATH,
    AS_PREPROCESSING,
    BENCH_METHODS,
    DATA,
    GATE,
    METHOD,
    MODEL,
    OUTPUT,
    OUTPUT_FILE,
    STATISTICS,
    STREAM,
    AdaptationOptions,
    CccOptions,
    MethodDataOptions,
    OracleOptions,
    OutlierOptions,
    RecipeOptions,
    RuntimeOptions,
    SamplingOptions,
    StreamOptions,
    setting,
)
from cafa_cli.jobs.shared.results import METRICS
from cafa_cli.methods.recipes import STANDARD_MODELS

TableMetric = Literal[tuple(METRICS)]  # type: ignore[valid-type]

# how `cafa bench --by` picks a value of `select` (bench/selection.py), held-out taking its domains after a colon
SELECTION_RULES = ("entropy", "consistency", "source-accuracy", "oracle", "held-out")

# why the run's JSON does not keep `max_error` (the exit code, 4, is cli/errors.EXIT_ABOVE_MAX_ERROR)


@dataclass(kw_only=True)
class BenchConfig(
    ModelOptions,
    InputOptions,
    TestDataOptions,
    SamplingOptions,
    AdaptationOptions,
    RecipeOptions,
    MethodDataOptions,
    OracleOptions,
    StreamOptions,
    OutlierOptions,
    CccOptions,
    RuntimeOptions,
):
    """`cafa bench`: methods × domains × seeds → a paper-style table of errors."""

    data: list[str] = setting(
        help="A labelled test domain (repeatable), or a benchmark such as imagenet-c:ROOT (docs/guides/bench.md).",
        factory=list,
        flags=("--data", "-d"),
        metavar="PATH",
        panel=DATA,
        brief=True,
        recorded="resolved: the domains as opened, each with its error",
    )
    train: str | None = setting(
        None,
        "Training images for the statistics (as cafa stats --data). Default: fashion-mnist for fmnist-resnet; CIFAR "
        "beside a RobustBench CIFAR benchmark.",
        metavar="PATH",
        panel=DATA,
        brief=True,
        recorded=AS_PATH,
    )
    model: str | None = setting(
        "fmnist-resnet",
        ModelOptions.__dataclass_fields__["model"].metadata["help"] + " On a "
        "named benchmark the default is its family's standard model: "
        + "; ".join(f"{family}:ROOT, {model}" for family, model in STANDARD_MODELS.items())
        + ".",
        flags=("--model", "-m"),
        metavar="NAME",
        panel=MODEL,
        brief=True,
        names_code=True,
        recorded=AS_BUILT,
    )
    test_resize: str | None = setting(
        None,
        "--resize for the test domains only (default: --resize). ImageNet-C: none.",
        metavar="PX",
        panel=DATA,
        recorded=AS_PREPROCESSING,
    )
    test_crop: str | None = setting(
        None,
        "--crop for the test domains only (default: --crop). ImageNet-C: none.",
        metavar="PX",
        panel=DATA,
        recorded=AS_PREPROCESSING,
    )
    methods: str = setting(
        BENCH_METHODS,
        "Rows, comma-separated: methods, cafa-tied, cafa-diag, cafa-dense, cafa-lowrank, cafa-full, all, or a "
        "plug-in; NAME@LR gives a row its own learning rate.",
        metavar="M[@LR],...",
        panel=METHOD,
        brief=True,
        names_code=True,
        recorded="resolved: the rows, each with its method and settings",
    )
    seeds: str = setting(
        "0",
        "Stream-order seeds, comma-separated; mean ± std over them.",
        metavar="N,...",
        panel=STREAM,
        brief=True,
        recorded="resolved: each run's seed",
    )
    orders: str | None = setting(
        None,
        "Grid axis: stream orders (as --order), comma-separated; every row runs under each.",
        metavar="ORDER,...",
        panel=STREAM,
        show_default=False,
    )
    batch_sizes: str | None = setting(
        None,
        "Grid axis: batch sizes, comma-separated (e.g. 1,2,4,8 with --norm prior:N); every row runs with each.",
        metavar="N,...",
        panel=STREAM,
        show_default=False,
    )
    stream_rates: str | None = setting(
        None,
        "Grid axis: stream rates (as --stream-rate), comma-separated, e.g. inf,1,1/2; every row runs under each.",
        metavar="R,...",
        panel=STREAM,
        show_default=False,
    )
    outlier_shares: str | None = setting(
        None,
        "Grid axis: shares of outliers (as --outliers PATH:SHARE), comma-separated, e.g. 0,0.2,0.5; every row runs "
        "with each, the outliers from --outliers PATH.",
        metavar="S,...",
        panel=STREAM,
        show_default=False,
    )
    severities: str | None = setting(
        None,
        "Grid axis: severities 1-5, comma-separated; every row runs at each.",
        metavar="N,...",
        panel=DATA,
        show_default=False,
    )
    fractions: str | None = setting(
        None,
        "Sweep axis: training fractions, comma-separated: statistics computed at each, rows that use them run with "
        "each.",
        metavar="F,...",
        panel=STATISTICS,
        show_default=False,
    )
    select: str | None = setting(
        None,
        "Label-free selection: NAME=V,... runs every row at each value of `lr` (or of an option of the rows' "
        "method), and `by` picks each row's value from the run itself; a table gives the picked value, the "
        "oracle's and the error between them.",
        metavar="NAME=V,...",
        panel=METHOD,
        show_default=False,
    )
    by: str | None = setting(
        None,
        "How `select` picks: entropy (lowest mean prediction entropy over the stream), consistency (most "
        "predictions kept when the image is flipped), source-accuracy (highest accuracy on `forgetting`'s "
        "labelled source images after each domain), oracle (lowest error: the test labels), or held-out:DOMAINS "
        "(lowest error on those labelled domains, comma-separated, run apart).",
        metavar="RULE",
        panel=METHOD,
        show_default=False,
    )
    batch_size: int = setting(
        200,
        "Images per batch: one forward pass and one adaptation step each (paper: 200; 64 on ImageNet-C); the "
        "statistics are computed in batches of this size too.",
        metavar="N",
        panel=STREAM,
    )
    workdir: str = setting(
        "cafa-bench",
        "Where artifacts are kept and re-used.",
        metavar="DIR",
        panel=OUTPUT,
        recorded="where the statistics are kept, by content",
    )
    metric: TableMetric = setting(
        "error",
        "What the table shows of the labelled images' predictions: error (%), ece (expected calibration error, %, "
        "15 bins), nll (nats) or brier; the CSV and JSON hold all four.",
        panel=OUTPUT,
        recorded="a view of the results, which changes none",
    )
    csv: str | None = setting(
        None, "Write the table as CSV.", metavar="PATH", panel=OUTPUT, recorded=OUTPUT_FILE, brief=True
    )
    metrics_json: str | None = setting(
        None,
        "Write the table, every run's errors and the settings as JSON.",
        metavar="PATH",
        panel=OUTPUT,
        brief=True,
        recorded=OUTPUT_FILE,
    )
    plot: str | None = setting(
        None,
        "Write a figure (SVG for .svg, else PNG; needs matplotlib): bars, or a line per method on a grid axis.",
        metavar="PATH",
        panel=OUTPUT,
        recorded=OUTPUT_FILE,
    )
    max_error: float | None = setting(
        None,
        "A CI gate: exit 4 when a row's mean error over the domains (the table's mean column) is above PCT %, "
        "after every output is written.",
        metavar="PCT",
        panel=OUTPUT,
        recorded=GATE,
    )

    def __post_init__(self):
        check(self)
        check_max_error(self.max_error)
        if self.metric not in METRICS:  # the command line checks its choices; a config built in Python too
            raise UsageError(f"`metric` must be one of {', '.join(METRICS)}, not {self.metric}")
        check_gradual_severity(self)
        self.seed_list()
        self.order_list()
        self.stream_rate_list()
        self.batch_size_list()
        self.outlier_share_list()
        self.severity_list()
        self.fraction_list()
        self.selection()
        InputOptions(resize=self.test_resize, crop=self.test_crop).preprocessing_changes(prefix="test_")

    def outputs(self) -> dict[str, str | None]:
        return {"`csv`": self.csv, "`metrics_json`": self.metrics_json, "`plot`": self.plot}

    def inputs(self) -> dict[str, str | list[str] | None]:
        return {
            "`train`": self.train,
            **self.model_inputs(),
            "`labels`": self.labels,
            "`classes`": self.classes,
            "`class_subset`": self.class_subset,
            "`subset`": self.subset,
            "`clean`": self.clean,
            "`forgetting`": self.forgetting,
            "`data`": self.data,
            "`workdir`": self.workdir,
            "`recipe`": self.recipe_file(),
            "`source_data`": self.source_data,
            **self.outlier_inputs(),
            "`methods`": [
                file
                for file in (
                    factory_file(label.strip().rpartition("@")[0] or label.strip()) for label in self.methods.split(",")
                )
                if file
            ],
        }

    def order_list(self) -> list[str]:
        """The orders the grid runs: `orders`, else `order` alone."""
        if self.orders is None:
            return [self.order]
        if self.order != "iid":
            raise UsageError(
                f"`order` {self.order} and `orders` {self.orders} both say which orders to run; give one of them"
            )
        orders = _axis(self.orders, "orders", "an order")
        # label-shift:1 and label-shift:1.0 are one order: compare what they mean, not how they are spelled
        same = repeated(orders, key=lambda order: parse_order(order, "orders"))
        if same:
            spellings = [order for order in orders if parse_order(order, "orders") == parse_order(same[0], "orders")]
            raise UsageError(f"`orders` names one order twice ({', '.join(spellings)}); give each once")
        return orders

    def stream_rate_list(self) -> list[str]:
        """The stream rates the grid runs: `stream_rates`, else `stream_rate` alone."""
        if self.stream_rates is None:
            return [self.stream_rate]
        if self.stream_rate != "inf":
            raise UsageError(
                f"`stream_rate` {self.stream_rate} and `stream_rates` {self.stream_rates} both say how fast the "
                f"stream is; give one of them"
            )
        parse_stream_rates(self.stream_rates)
        return [part.strip() for part in self.stream_rates.split(",")]

    def batch_size_list(self) -> list[int]:
        """The adaptation batch sizes the grid runs: `batch_sizes`, else `batch_size` alone
        (which also sizes the statistics' batches)."""
        if self.batch_sizes is None:
            return [self.batch_size]
        try:
            sizes = [int(size) for size in _axis(self.batch_sizes, "batch_sizes", "a batch size")]
        except ValueError:
            raise UsageError(f"`batch_sizes` takes comma-separated whole numbers, not {self.batch_sizes!r}") from None
        for size in sizes:
            check_batch_size(size)
        if len(set(sizes)) < len(sizes):
            raise UsageError(f"`batch_sizes` names a batch size twice: {self.batch_sizes}")
        return sizes

    def outlier_share_list(self) -> list[float | None]:
        """The shares of outliers the grid runs: `outlier_shares` (of `outliers`' images), else
        `outliers`' own share alone (None: no outliers)."""
        source = self.outlier_source()
        if self.outlier_shares is None:
            return [source[1] if source else None]
        if source is None:
            raise UsageError(
                f"`outlier_shares` {self.outlier_shares} mixes outliers in at each share, and `outliers` names none; "
                f"give `outliers` PATH (or noise:gaussian)"
            )
        if self.outliers.strip() != source[0]:
            raise UsageError(
                f"`outliers` {self.outliers} and `outlier_shares` {self.outlier_shares} both say how many outliers "
                f"a stream holds; give `outliers` {source[0]} without its share"
            )
        return _number_axis(
            self.outlier_shares,
            "outlier_shares",
            "a share",
            "[0, 1)",
            lambda share: check_outlier_share(share, "outlier_shares"),
        )

    def severity_list(self) -> list[int | None]:
        """The severities the grid runs: `severities`, else `severity` alone (None: the data's own)."""
        if self.severities is None:
            return [self.severity]
        if self.severity is not None:
            raise UsageError(
                f"`severity` {self.severity} and `severities` {self.severities} both say which severities to "
                f"run; give one of them"
            )
        if self.gradual:
            raise UsageError(
                f"`severities` {self.severities} runs each severity apart, and `gradual` visits all five in "
                f"one stream; give one of them"
            )
        return parse_severities(self.severities, "severities")

    def fraction_list(self) -> list[float | None]:
        """The training fractions the statistics are computed at: `fractions`, else [None]
        (`fraction` or `per_class` alone, as `training_sample` reads them)."""
        if self.fractions is None:
            return [None]
        for name in ("fraction", "per_class"):
            if getattr(self, name) is not None:
                raise UsageError(
                    f"`{name}` {getattr(self, name)} and `fractions` {self.fractions} both say how many training "
                    f"images the statistics take; give one of them"
                )
        for name in ("orders", "batch_sizes", "severities", "outlier_shares"):
            if getattr(self, name) is not None:
                raise UsageError(
                    f"`fractions` makes a table of its own (methods × fractions), and so does `{name}`; run "
                    f"them in two benches"
                )
        return _number_axis(self.fractions, "fractions", "a fraction", "(0, 1]", _check_fraction)

    def selection(self) -> tuple[str, list[float], str, list[str]] | None:
        """`select` and `by` as (the setting, its values, the rule, the held-out domains); None without
        `select`. Whether the rows' method takes the setting is checked with the rows (bench/selection.py)."""
        if self.select is None and self.by is None:
            return None
        if self.select is None:
            raise UsageError(
                f"`by` {self.by} picks among the values of `select`, and none is given; give `select` "
                f"NAME=V,... (e.g. lr=1e-4,3e-4,1e-3)"
            )
        if self.by is None:
            raise UsageError(
                f"`select` {self.select} needs a rule to pick by; give `by` ({', '.join(SELECTION_RULES)}:DOMAINS)"
            )
        name, equals, values = self.select.partition("=")
        name = name.strip()
        if not equals or not name:
            raise UsageError(f"`select` takes NAME=V,... (e.g. lr=1e-4,3e-4,1e-3), not {self.select!r}")
        grid = _number_axis(values, "select", f"values of {name} (e.g. {name}=1e-4,1e-3)", "its range", _finite)
        if name == "lr" and not all(value > 0 for value in grid):
            raise UsageError(f"`select` {self.select}: a learning rate is a positive number")
        rule, colon, held_out = self.by.partition(":")
        if rule not in SELECTION_RULES or (rule == "held-out") != bool(colon):
            raise UsageError(
                f"`by` {self.by}: unknown rule; choose from {', '.join(SELECTION_RULES[:-1])} or held-out:DOMAINS"
            )
        domains = [domain.strip() for domain in held_out.split(",") if domain.strip()]
        if rule == "held-out" and not domains:
            raise UsageError(f"`by` {self.by} names no held-out domain; give held-out:PATH,PATH")
        if rule == "source-accuracy" and not self.forgetting:
            raise UsageError(
                "`by` source-accuracy measures the accuracy on held-out labelled source images, and none is given; "
                "give them as `forgetting` (e.g. clean test images the stream does not hold)"
            )
        for option in ("fractions", "oracle"):
            if getattr(self, option):
                raise UsageError(f"`select` and `{option}` each add rows of their own; run them in two benches")
        return name, grid, rule, domains

    def grid_axes(self) -> bool:
        """Whether the grid has an order, stream-rate, batch-size, outlier-share or severity axis (else the table
        is the plain one)."""
        axes = (self.orders, self.stream_rates, self.batch_sizes, self.outlier_shares, self.severities)
        return any(axis is not None for axis in axes)

    def seed_list(self) -> list[int]:
        try:
            seeds = [int(s) for s in self.seeds.split(",") if s.strip()]
        except ValueError:
            raise UsageError(f"`seeds` takes comma-separated integers, not {self.seeds!r}") from None
        if not seeds:
            raise UsageError("`seeds` names no seed")
        for seed in seeds:
            check_seed("seeds", seed)
        if len(set(seeds)) < len(seeds):
            raise UsageError(f"`seeds` names a seed twice: {self.seeds}")
        return seeds

    def test_preprocessing_changes(self) -> dict:
        """The test domains' preprocessing: the shared options, then --test-resize / --test-crop."""
        test = InputOptions(resize=self.test_resize, crop=self.test_crop).preprocessing_changes(prefix="test_")
        return {**self.preprocessing_changes(), **test}


def _number_axis(text: str, name: str, what: str, interval: str, check) -> list[float]:
    """A grid axis of numbers: each parsed, checked by `check` (which raises), and each once as a
    number (0.2 and 0.20 are one value)."""
    try:
        values = [float(value) for value in _axis(text, name, what)]
    except ValueError:
        raise UsageError(f"`{name}` takes comma-separated numbers in {interval}, not {text!r}") from None
    for value in values:
        check(value)
    twice = repeated(values)
    if twice:
        raise UsageError(f"`{name}` names {twice[0]:g} twice ({text}); give each once")
    return values


def _finite(value: float) -> None:
    if not abs(value) < float("inf"):
        raise UsageError(f"`select`: a value is a finite number, not {value:g}")


def _check_fraction(fraction: float) -> None:
    if not 0 < fraction <= 1:
        raise UsageError(f"`fractions`: a fraction is in (0, 1], not {fraction:g}")
