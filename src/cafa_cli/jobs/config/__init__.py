"""One settings object per job: every option, its default, its help, and its check.

`StatsConfig`, `AdaptConfig`, `BenchConfig` and `DemoConfig` are the single source of
defaults. The command line generates its options from their fields (cli/options.py),
cafa.toml sets the same names, and the Python API builds them directly:

    AdaptConfig(data=["ImageNet-C/fog/5"], lr=0.0025, optimizer="sgd", batch_size=64)

Construction checks every value that can be checked without a model or data, and
names a wrong one in backticks (`lr`), which the command line shows as `--lr`.
Adding an option is two edits: a field here, and the code that uses it.

This module imports neither torch nor the jobs, so that `cafa --help` stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from cafa_cli import DEFAULT_ARTIFACT
from cafa_cli.data.values import check_batch_size, parse_order
from cafa_cli.errors import UsageError, repeated
from cafa_cli.jobs.config.settings import (
    ADAPTATION,
    AS_BUILT,
    AS_PATH,
    AS_PREPROCESSING,
    BENCH_METHODS,
    DATA,
    DEMO_CORRUPTIONS,
    METHOD,
    MODEL,
    OUTPUT,
    OUTPUT_FILE,
    RUNTIME,
    STATISTICS,
    STREAM,
    AdaptationOptions,
    Covariance,
    InputOptions,
    MethodDataOptions,
    ModelOptions,
    OracleOptions,
    RecipeOptions,
    RecordFormat,
    RuntimeOptions,
    SamplingOptions,
    StreamOptions,
    TestDataOptions,
    _axis,
    check_covariance,
    check_gradual_severity,
    check_oracle,
    check_seed,
    factory_file,
    parse_method_options,
    parse_severities,
    setting,
)
from cafa_cli.method.methods import REGISTRY, is_plugin
from cafa_cli.recipes import STANDARD_MODELS

# why the run's JSON does not keep `max_error` (the exit code, 4, is cli/errors.EXIT_ABOVE_MAX_ERROR)
GATE = "a check of the result after the run, which changes no result"


@dataclass(kw_only=True)
class StatsConfig(ModelOptions, InputOptions, SamplingOptions, RuntimeOptions):
    """`cafa stats`: per-class feature Gaussians of training images, into an artifact."""

    data: str = setting(
        help="Training images: an ImageFolder, a .npy array (--labels), or cifar10:ROOT / cifar100:ROOT "
        "/ fashion-mnist:ROOT.",
        flags=("--data", "-d"),
        metavar="PATH",
        panel=DATA,
        recorded="resolved: the domains as opened, each with its error",
    )
    model: str | None = setting(
        "resnet50",
        ModelOptions.__dataclass_fields__["model"].metadata["help"],
        flags=("--model", "-m"),
        metavar="NAME",
        panel=MODEL,
        names_code=True,
        recorded=AS_BUILT,
    )
    seed: int = setting(0, "Seed of the stratified subset.", metavar="N", panel=STATISTICS)
    covariance: Covariance = setting(
        "auto",
        "auto (lowrank when every class has fewer images than feature dimensions, "
        "else full), full (per class), lowrank (exact, a·I + low rank per class), tied "
        "(one pooled), or diag.",
        panel=STATISTICS,
        recorded="resolved: the form the artifact holds",
    )
    norm_moments: bool = setting(
        False,
        "Also record each class's mean and variance of every BatchNorm's input, which "
        "adapt --norm class-balanced needs (2·C·channels values a layer).",
        panel=STATISTICS,
    )
    batch_size: int = setting(
        128,
        "Images per batch: one forward pass each (memory and speed; the statistics are the same up to float64 "
        "rounding).",
        metavar="N",
        panel=RUNTIME,
    )
    out: str = setting(
        DEFAULT_ARTIFACT,
        "Artifact to write (atomically).",
        flags=("--out", "-o"),
        metavar="PATH",
        panel=OUTPUT,
        recorded=OUTPUT_FILE,
    )

    def __post_init__(self):
        check(self)
        check_seed("seed", self.seed)
        check_batch_size(self.batch_size)
        check_covariance(self.covariance, self.shrinkage_value())

    def outputs(self) -> dict[str, str | None]:
        return {"`out`": self.out}

    def inputs(self) -> dict[str, str | list[str] | None]:
        return {
            **self.model_inputs(),
            "`classes`": self.classes,
            "`class_subset`": self.class_subset,
            "`labels`": self.labels,
            "`data`": self.data,
        }


@dataclass(kw_only=True)
class AdaptConfig(
    ModelOptions,
    InputOptions,
    TestDataOptions,
    AdaptationOptions,
    RecipeOptions,
    MethodDataOptions,
    OracleOptions,
    StreamOptions,
    RuntimeOptions,
):
    """`cafa adapt`: adapt online over test domains, one prediction per image."""

    data: list[str] = setting(
        help="A test domain (repeatable): image folder, unlabelled folder, .npy array, - (paths on stdin), or a "
        "benchmark such as imagenet-c:ROOT. docs/usage.md, Data",
        factory=list,
        flags=("--data", "-d"),
        metavar="PATH",
        panel=DATA,
        recorded="resolved: the domains as opened, each with its error",
    )
    stats: str | None = setting(
        None,
        f"Artifact from cafa stats (default: {DEFAULT_ARTIFACT}); it also names the model, "
        f"so --model/--weights can be left out.",
        flags=("--stats", "-s"),
        metavar="PATH",
        panel=MODEL,
        recorded="resolved: the artifact's absolute path, creation time and form",
    )
    method: str = setting(
        "cafa",
        f"The method: {', '.join(REGISTRY)} (cafa methods describes each); or a plug-in, package.module:factory or "
        f"file.py:factory (its code runs; the command line only).",
        metavar="NAME",
        panel=METHOD,
        names_code=True,
    )
    allow_weights_mismatch: bool = setting(
        False,
        "Use the artifact with another model or other weights than it was computed with.",
        panel=MODEL,
        command_line_only=True,
    )
    shuffle: bool = setting(
        True, "Shuffle each domain's stream (seeded).", flags=("--shuffle/--no-shuffle",), panel=STREAM
    )
    seed: int = setting(0, "Seed of the stream order.", metavar="N", panel=STREAM)
    format: RecordFormat = setting("csv", "Prediction records as csv or jsonl.", panel=OUTPUT, recorded=OUTPUT_FILE)
    predictions: str | None = setting(
        None, "Write the records to this file instead of stdout.", metavar="PATH", panel=OUTPUT, recorded=OUTPUT_FILE
    )
    metrics_json: str | None = setting(
        None, "Write errors and settings as JSON.", metavar="PATH", panel=OUTPUT, recorded=OUTPUT_FILE
    )
    max_error: float | None = setting(
        None,
        "A CI gate: exit 4 when the error over the labelled images is above PCT %, after every output is written.",
        metavar="PCT",
        panel=OUTPUT,
        recorded=GATE,
    )
    export: str | None = setting(
        None,
        "Write the adapted network for serving, at the end of the stream: a safetensors state dict of the model's "
        "own architecture, its BatchNorms holding the statistics the stream arrived at (docs/python-api.md, Serving).",
        metavar="PATH",
        panel=OUTPUT,
        recorded=OUTPUT_FILE,
    )
    state: str | None = setting(
        None,
        "Go on from the adaptation state saved in this file (when it is there) and save it there at the end, and "
        "when interrupted: a continual stream (`reset` never) across restarts.",
        metavar="PATH",
        panel=STREAM,
    )

    def __post_init__(self):
        if self.predictions == "-":  # stdout, as without the option
            self.predictions = None
        check_max_error(self.max_error)
        if self.state is not None and self.reset != "never":
            raise UsageError(
                f"`state` goes on with a continual stream, and `reset` {self.reset} starts each "
                f"{'batch' if self.reset == 'episodic' else 'domain'} from the source model: give `reset` never"
            )
        if self.method not in REGISTRY and not is_plugin(self.method):
            raise UsageError(
                f"`method` must be one of {', '.join(REGISTRY)}, or a plug-in module:factory, not {self.method}"
            )
        check(self)
        check_seed("seed", self.seed)
        if self.data.count("-") > 1:
            raise UsageError("`data` - (image paths on stdin) is given more than once; stdin can be read once")
        check_gradual_severity(self)
        self.method_options()
        if self.oracle:
            check_oracle(self.method)
        if not self.shuffle and self.order != "iid":
            raise UsageError(
                f"`order` {self.order} shuffles in its own way, and `shuffle` is off (the data's own order); "
                f"give one of them"
            )

    def outputs(self) -> dict[str, str | None]:
        # `state` is read and written again by design: an output, kept from every input
        return {
            "`predictions`": self.predictions,
            "`metrics_json`": self.metrics_json,
            "`export`": self.export,
            "`state`": self.state,
        }

    def inputs(self) -> dict[str, str | list[str] | None]:
        return {
            "`stats`": DEFAULT_ARTIFACT if self.stats is None else self.stats,
            **self.model_inputs(),
            "`labels`": self.labels,
            "`classes`": self.classes,
            "`class_subset`": self.class_subset,
            "`subset`": self.subset,
            "`clean`": self.clean,
            "`data`": self.data,
            "`recipe`": self.recipe_file(),
            "`method`": factory_file(self.method),
            "`fisher_data`": self.fisher_data,
        }

    def method_options(self) -> dict:
        """`method_option` as {option: value} for `method`, each checked against the
        options a built-in method declares (a plug-in's are checked when it is made)."""
        given = {}
        for method, name, value in parse_method_options(self.method_option):
            if method not in (None, self.method):
                raise UsageError(
                    f"`method_option` {method}.{name}={value} is for the method {method}, and `method` is "
                    f"{self.method}; give it as {name}={value} with `method` {method}, or drop it"
                )
            given[name] = value
        if given and not is_plugin(self.method):
            from cafa_cli.method.methods import options_of
            from cafa_cli.method.options import resolve_options

            resolve_options(self.method, options_of(self.method), given)
        return given

    def stream_options(self) -> dict:
        return {
            "batch_size": self.batch_size,
            "reset": self.reset,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "order": self.order,
            "mix_domains": self.mix_domains,
        }


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
    RuntimeOptions,
):
    """`cafa bench`: methods × domains × seeds → a paper-style table of errors."""

    data: list[str] = setting(
        help="A labelled test domain (repeatable), or a benchmark such as imagenet-c:ROOT. docs/usage.md, Data",
        factory=list,
        flags=("--data", "-d"),
        metavar="PATH",
        panel=DATA,
        recorded="resolved: the domains as opened, each with its error",
    )
    train: str | None = setting(
        None,
        "Training images for the statistics (as cafa stats --data). Default: fashion-mnist for fmnist-resnet; CIFAR "
        "beside a RobustBench CIFAR benchmark.",
        metavar="PATH",
        panel=DATA,
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
        names_code=True,
        recorded="resolved: the rows, each with its method and settings",
    )
    seeds: str = setting(
        "0",
        "Stream-order seeds, comma-separated; mean ± std over them.",
        metavar="N,...",
        panel=STREAM,
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
    csv: str | None = setting(None, "Write the table as CSV.", metavar="PATH", panel=OUTPUT, recorded=OUTPUT_FILE)
    metrics_json: str | None = setting(
        None,
        "Write the table, every run's errors and the settings as JSON.",
        metavar="PATH",
        panel=OUTPUT,
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
        check_gradual_severity(self)
        self.seed_list()
        self.order_list()
        self.batch_size_list()
        self.severity_list()
        self.fraction_list()
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
            "`data`": self.data,
            "`workdir`": self.workdir,
            "`recipe`": self.recipe_file(),
            "`fisher_data`": self.fisher_data,
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
        for name in ("orders", "batch_sizes", "severities"):
            if getattr(self, name) is not None:
                raise UsageError(
                    f"`fractions` makes a table of its own (methods × fractions), and so does `{name}`; run "
                    f"them in two benches"
                )
        try:
            fractions = [float(value) for value in _axis(self.fractions, "fractions", "a fraction")]
        except ValueError:
            raise UsageError(f"`fractions` takes comma-separated numbers in (0, 1], not {self.fractions!r}") from None
        wrong = [f for f in fractions if not 0 < f <= 1]
        if wrong:
            raise UsageError(f"`fractions`: a fraction is in (0, 1], not {wrong[0]:g}")
        twice = repeated(fractions)
        if twice:
            raise UsageError(f"`fractions` names {twice[0]:g} twice ({self.fractions}); give each once")
        return fractions

    def grid_axes(self) -> bool:
        """Whether the grid has an order, batch-size or severity axis (else the table is the plain one)."""
        return self.orders is not None or self.batch_sizes is not None or self.severities is not None

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


@dataclass(kw_only=True)
class DemoConfig:
    """`cafa demo`: Fashion-MNIST-C built from Debian's package, then stats, adapt and a table."""

    workdir: str = setting(
        "cafa-demo",
        "Where the data and artifacts go (re-used on a second run).",
        metavar="DIR",
        panel=OUTPUT,
        recorded="where the statistics are kept, by content",
    )
    corruptions: str = setting(
        DEMO_CORRUPTIONS,
        "Comma-separated corrupt-tta corruptions, or 'all' (the 15 of ImageNet-C).",
        metavar="NAME,...",
        panel=DATA,
    )
    severity: int = setting(
        3,
        "Corruption severity 1-5.",
        metavar="N",
        panel=DATA,
        recorded="resolved: with the named benchmarks' default filled in",
    )
    severities: str | None = setting(
        None,
        "With --data-only: build each of these severities, comma-separated (1,2,3,4,5 "
        "for cafa bench --severities), in place of --severity.",
        metavar="N,...",
        panel=DATA,
        show_default=False,
    )
    train_per_class: int = setting(300, "Training images per class for the statistics.", metavar="N", panel=DATA)
    test_per_class: int = setting(300, "Test images per class and domain (0: all 1,000).", metavar="N", panel=DATA)
    methods: str = setting(
        "source,bn,tent,cafa",
        "Methods to compare.",
        metavar="M,...",
        panel=METHOD,
        names_code=True,
        recorded="resolved: the rows, each with its method and settings",
    )
    batch_size: int = setting(200, "Images per adaptation batch.", metavar="N", panel=ADAPTATION)
    lr: float = setting(1e-3, "Learning rate.", metavar="LR", panel=ADAPTATION)
    seed: int = setting(0, "Seed of the data, the subset and the stream.", metavar="N", panel=ADAPTATION)
    data_only: bool = setting(False, "Only build the image folders (e.g. the full set for cafa bench).", panel=OUTPUT)
    fashion_mnist: str | None = setting(
        None,
        "Folder with the Fashion-MNIST idx files (default: $CAFA_FASHION_MNIST, "
        "else /usr/share/datasets/fashion-mnist).",
        metavar="DIR",
        panel=DATA,
    )

    def severity_list(self) -> list[int]:
        """The severities to build: `severities` (with `data_only`), else `severity` alone."""
        if self.severities is None:
            return [self.severity]
        if not self.data_only:
            raise UsageError(
                f"`severities` builds the test folders of several severities, with `data_only`; then compare "
                f"them with cafa bench fashion-mnist-c:{self.workdir}/fashion-mnist-c-N --severities "
                f"{self.severities}"
            )
        return parse_severities(self.severities, "severities")


PLOT_FORMATS = (".png", ".svg")  # what `cafa plot features --out` writes, by its extension


@dataclass(kw_only=True)
class FeaturesPlotConfig(
    ModelOptions, InputOptions, AdaptationOptions, RecipeOptions, MethodDataOptions, StreamOptions, RuntimeOptions
):
    """`cafa plot features`: a 2-D embedding (t-SNE) of one domain's features before and after
    adaptation, one panel a method, each run as `cafa adapt` runs it."""

    data: list[str] = setting(
        help="The test domain: an ImageFolder (one folder per class colours the points by class), "
        "an unlabelled folder, or a .npy array.",
        factory=list,
        flags=("--data", "-d"),
        metavar="PATH",
        panel=DATA,
        recorded="resolved: the domains as opened, each with its error",
    )
    stats: str | None = setting(
        None,
        f"Artifact from cafa stats (default: {DEFAULT_ARTIFACT}): it names the model, and its "
        f"class means are drawn among the features.",
        flags=("--stats", "-s"),
        metavar="PATH",
        panel=MODEL,
        recorded="resolved: the artifact's absolute path, creation time and form",
    )
    allow_weights_mismatch: bool = setting(
        False,
        "Use the artifact with another model or other weights than it was computed with.",
        panel=MODEL,
        command_line_only=True,
    )
    methods: str = setting(
        "source,tent,cafa",
        "One panel per method, comma-separated, each adapted over the domain as cafa "
        "adapt --method would; source is the model before adaptation.",
        metavar="M,...",
        panel=METHOD,
        names_code=True,
        recorded="resolved: the rows, each with its method and settings",
    )
    out: str = setting(
        "features.png",
        "The figure, PNG or SVG by its extension (written atomically).",
        flags=("--out", "-o"),
        metavar="FILE",
        panel=OUTPUT,
        recorded=OUTPUT_FILE,
    )
    seed: int = setting(
        0,
        "Seed of the image sample, the stream order and the embedding: the same seed gives the same "
        "file, byte for byte.",
        metavar="N",
        panel=STREAM,
    )
    max_images: int | None = setting(
        1000,
        "Images of the domain to adapt on and embed, a stratified sample (t-SNE's time grows with them); 0: all.",
        metavar="N",
        panel=DATA,
    )
    perplexity: float = setting(
        30.0, "t-SNE's perplexity (at most a third of the images and class means).", metavar="P", panel=OUTPUT
    )
    json: bool = setting(
        False,
        "Print each panel's numbers (error, feature scatter, Mahalanobis distance) as JSON on stdout.",
        panel=OUTPUT,
        recorded=OUTPUT_FILE,
    )

    def __post_init__(self):
        check(self)
        check_seed("seed", self.seed)
        if len(self.data) != 1:
            raise UsageError(f"cafa plot features embeds one domain, and {len(self.data)} are given; give one DOMAIN")
        if Path(self.out).suffix.lower() not in PLOT_FORMATS:
            raise UsageError(
                f"`out` {self.out}: the figure is written as PNG or SVG by its extension; give a name ending in "
                f"{' or '.join(PLOT_FORMATS)}"
            )
        if self.max_images is not None and self.max_images < 0:
            raise UsageError(f"`max_images` must be 0 (all) or more, not {self.max_images}")
        if not self.perplexity > 0:
            raise UsageError(f"`perplexity` must be a positive number, not {self.perplexity}")
        for method in self.method_list():
            if method not in REGISTRY and not is_plugin(method):
                raise UsageError(
                    f"`methods` names {method}, which is no method; give some of {', '.join(REGISTRY)} (or a "
                    f"plug-in module:factory)"
                )

    def method_list(self) -> list[str]:
        """The panels' methods, in order, each once."""
        return _axis(self.methods, "methods", "a method")

    def outputs(self) -> dict[str, str | None]:
        return {"`out`": self.out}

    def inputs(self) -> dict[str, str | list[str] | None]:
        return {
            "`stats`": DEFAULT_ARTIFACT if self.stats is None else self.stats,
            **self.model_inputs(),
            "`labels`": self.labels,
            "`classes`": self.classes,
            "`class_subset`": self.class_subset,
            "`data`": self.data,
            "`recipe`": self.recipe_file(),
            "`fisher_data`": self.fisher_data,
            "`methods`": [file for file in map(factory_file, self.method_list()) if file],
        }


def check_max_error(value: float | None) -> None:
    """`max_error` is a percentage, as the summary and the bench table show the error (NaN compares with nothing)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 100:
        raise UsageError(f"`max_error` must be a percentage in [0, 100], not {value!r}")


def check(config) -> None:
    """Every group's own check, in field order: the first wrong value is the one named."""
    for group in type(config).__mro__:
        for name, method in vars(group).items():
            if name.startswith("_check_"):
                method(config)


def command_line_only(config_type) -> set[str]:
    return {f.name for f in fields(config_type) if f.metadata.get("command_line_only")}


def names_code(config_type) -> set[str]:
    return {f.name for f in fields(config_type) if f.metadata.get("names_code")}
