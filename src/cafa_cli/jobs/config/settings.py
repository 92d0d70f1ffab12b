"""The option groups the jobs' settings are made of (jobs/config.py): which model, how
images are read, how the method adapts, the stream, the training subset, the runtime;
each field with its default, help, metavar and help panel (`setting`), and the checks
that need no model or data. Torch-free, as the command line builds its options from them.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Literal

from cafa_cli.core.errors import UsageError
from cafa_cli.data.pace import parse_step_cost, parse_stream_rate
from cafa_cli.data.values import (
    GENERATED_OUTLIERS,
    check_batch_size,
    check_num_workers,
    check_rounds,
    parse_order,
    parse_outliers,
    parse_reset,
)
from cafa_cli.engine.options import OPTIMIZERS, PARAM_SETS, PRECISIONS, AdapterSettings, Norm
from cafa_cli.jobs.config.checks import at_least, parse_shrinkage
from cafa_cli.statistics import COVARIANCE_CHOICES

Optimizer = Literal[OPTIMIZERS]  # type: ignore[valid-type]  (the Adapter's names)
ParamSet = Literal[PARAM_SETS]  # type: ignore[valid-type]
Precision = Literal[PRECISIONS]  # type: ignore[valid-type]
RECORD_FORMATS = ("csv", "jsonl")
Covariance = Literal[COVARIANCE_CHOICES]  # type: ignore[valid-type]
RecordFormat = Literal[RECORD_FORMATS]  # type: ignore[valid-type]

DEFAULT_FRACTION = 0.05  # of each class's training images: the paper's
BENCH_METHODS = "source,bn,pl,tent,cafa,global-fa,intra,euclidean,cafa-tied,cafa-diag"
DEMO_CORRUPTIONS = "gaussian_noise,defocus_blur,frost,contrast"  # one of each ImageNet-C family

# help panels, in the order --help shows them: as a user decides, what to adapt with first,
# and last the settings a recipe gives (docs/reference/cli/index.md lists each option, the guides explain them)
METHOD, DATA, MODEL, STREAM, STATISTICS, OUTPUT, RUNTIME, ADAPTATION = (
    "Method",
    "Data",
    "Model",
    "Stream",
    "Statistics",
    "Output",
    "Runtime",
    "Adaptation (a recipe sets these; what you give wins)",
)
PANELS = (METHOD, DATA, MODEL, STREAM, STATISTICS, OUTPUT, RUNTIME, ADAPTATION)


# what the run's JSON record keeps of a setting (`recorded`): True, its value as given; else why not,
# mostly because the job records it resolved (a path made absolute, defaults filled in, a file hashed)
AS_BUILT = "resolved: the model as built, with its weights' sha256"
AS_PATH = "resolved: an absolute path"
AS_PREPROCESSING = "resolved: as `preprocessing`, defaults filled in"
AS_SAMPLE = "resolved: the training sample, a fraction or a count"
OUTPUT_FILE = "an output"
GATE = "a check of the result after the run, which changes no result"


def setting(
    default=MISSING,
    help: str = "",
    *,
    factory=MISSING,
    flags: tuple[str, ...] = (),
    metavar: str | None = None,
    panel: str | None = None,
    brief: bool = False,
    show_default: bool = True,
    command_line_only: bool = False,
    names_code: bool = False,
    option: bool = True,
    recorded: bool | str = True,
):
    """A config field with what its command-line option needs. `flags` replaces the
    generated `--name` (e.g. a short form, or `--x/--no-x`); `brief` one a user decides first,
    which the short help (-h) shows too (--help shows every one); `command_line_only` marks a
    setting that lets code run or lifts a safety check, which no config file may set;
    `names_code` one whose value may name code to import (module:function), which a config
    file may set to a plain name only; `option` False, a field the command fills itself.
    `recorded` True: the run's JSON record keeps the value as given (recorded_as_given);
    else the reason it does not, which tests/test_jobs_config.py requires of every field."""
    metadata = {
        "help": help,
        "flags": flags,
        "metavar": metavar,
        "panel": panel,
        "brief": brief,
        "show_default": show_default,
        "command_line_only": command_line_only,
        "names_code": names_code,
        "option": option,
        "recorded": recorded,
    }
    if factory is not MISSING:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def recorded_as_given(config_type) -> tuple[str, ...]:
    """The settings a run's JSON record keeps as given, in field order: those whose field
    says `recorded` True (the adapt metrics' and the bench JSON's `settings`)."""
    return tuple(f.name for f in fields(config_type) if f.metadata.get("recorded", True) is True)


def recorded_values(config) -> dict:
    """Those settings of `config` (recorded_as_given) with their values as JSON keeps them: a Norm as its text."""
    values = {name: getattr(config, name) for name in recorded_as_given(type(config))}
    return {name: str(value) if isinstance(value, Norm) else value for name, value in values.items()}


@dataclass(frozen=True, kw_only=True)
class StreamSettings:
    """What the online loop (jobs/adapt/stream.adapt_domains) is told: how each domain's images are
        ordered (`order`, `shuffle` and `seed`, data/orders.py), batched and read (`num_workers`,
        `strict`), whether the domains make one stream (`mix_domains`), when the adaptation starts
        afresh (`reset`), whether the loss is given the true labels (`oracle`), and whether the consistency
    under a flip is measured (`consistency`, which `cafa bench --by consistency` asks for). The command line's
        options of the same names take their defaults from here; AdaptConfig.stream_settings() makes one."""

    batch_size: int = 200
    order: str = "iid"
    shuffle: bool = True
    seed: int = 0
    mix_domains: bool = False
    reset: str = "domain"
    oracle: bool = False
    num_workers: int | None = None
    strict: bool = False
    # each batch also predicted flipped left-right, the agreement counted (DomainResult.consistent)
    consistency: bool = False


@dataclass(kw_only=True)
class RuntimeOptions:
    device: str = setting("auto", "auto, cpu, cuda or cuda:N.", metavar="DEVICE", panel=RUNTIME)
    num_workers: int | None = setting(
        StreamSettings.num_workers,
        "Data loading processes. Default: on CUDA the cores this process may use, less one (shared among torchrun's "
        "ranks); on the CPU 0.",
        metavar="N",
        panel=RUNTIME,
        show_default=False,
    )
    strict: bool = setting(
        StreamSettings.strict, "Fail on the first unreadable image instead of skipping it.", panel=RUNTIME
    )

    def _check_runtime(self) -> None:
        if self.device != "auto" and self.device.partition(":")[0] not in ("cpu", "cuda"):
            raise UsageError(f"`device` {self.device}: expected auto, cpu, cuda or cuda:N")
        check_num_workers(self.num_workers)


@dataclass(kw_only=True)
class AdaptationOptions:
    """How the model adapts: the Adapter's settings (engine/options.AdapterSettings, which holds
    their defaults), one to one; `norm` given as text is parsed once, when the settings are checked."""

    params: ParamSet = setting(
        AdapterSettings.params, "norm (normalisation affines) or all (the whole feature extractor).", panel=ADAPTATION
    )
    optimizer: Optimizer = setting(
        AdapterSettings.optimizer,
        "adam, sgd, nesterov (SGD with Nesterov momentum, as TENT's ImageNet-C code), or adamw (TPT's).",
        panel=ADAPTATION,
    )
    lr: float = setting(AdapterSettings.lr, "Learning rate.", metavar="LR", panel=ADAPTATION)
    momentum: float = setting(
        AdapterSettings.momentum,
        "Momentum of sgd and nesterov (adam and adamw ignore it).",
        metavar="M",
        panel=ADAPTATION,
    )
    steps: int = setting(AdapterSettings.steps, "Gradient steps per batch.", metavar="N", panel=ADAPTATION)
    norm: Norm = setting(
        AdapterSettings.norm,
        "What BatchNorms normalise with: batch, prior:N (small batches), source, ema:M, class-balanced (label shift; "
        "needs cafa stats --norm-moments), alpha:A (α-BN), unmix:K (UnMix-TNS); docs/guides/streams.md.",
        metavar="NORM",
        panel=ADAPTATION,
    )
    precision: Precision = setting(
        AdapterSettings.precision, "Autocast precision (bf16, fp16: CUDA only).", panel=RUNTIME
    )
    compile: bool = setting(
        AdapterSettings.compile,
        "torch.compile the model, with the loss of a method that trains (pays a compilation on the first batches).",
        panel=RUNTIME,
    )
    cuda_graph: bool = setting(
        AdapterSettings.cuda_graph,
        "On CUDA, replay each step from a CUDA graph where the method allows it, checked against an eager step once "
        "(1.0-1.6x faster steps on an H200; --no-cuda-graph: every step eager).",
        flags=("--cuda-graph/--no-cuda-graph",),
        panel=RUNTIME,
    )

    def adapter_settings(self) -> AdapterSettings:
        """The Adapter's settings: `Adapter(model, method, **config.adapter_settings())`."""
        return AdapterSettings(**{f.name: getattr(self, f.name) for f in fields(AdaptationOptions)})

    def _check_adaptation(self) -> None:
        self.norm = Norm.parse(self.norm)  # text from the command line, a cafa.toml or a recipe
        self.adapter_settings()


@dataclass(kw_only=True)
class RecipeOptions:
    """Which published setting a method runs with, and its own options beyond it."""

    recipe: str = setting(
        "auto",
        "The methods' published settings: auto (from the benchmark or the class count), imagenet-c, cifar10-c, "
        "cifar100-c, none, or a .toml file (cafa methods NAME --recipe R prints one).",
        metavar="NAME|FILE",
        panel=METHOD,
        brief=True,
    )
    method_option: list[str] = setting(
        help="A method's own option NAME=VALUE (repeatable), e.g. redundancy_margin=0.4; METHOD.NAME=VALUE for one "
        "of several methods (bench, plot features). cafa methods NAME lists them.",
        factory=list,
        flags=("--method-option",),
        metavar="NAME=VALUE",
        panel=METHOD,
    )
    # the settings the user chose, which a recipe does not replace (the command line fills it);
    # None: those that differ from their defaults
    given: tuple[str, ...] | None = setting(
        None, option=False, recorded="what the user typed, which a recipe leaves as it is"
    )

    def recipe_file(self) -> str | None:
        return self.recipe if self.recipe.endswith(".toml") else None

    def chosen(self) -> set[str]:
        """The settings a recipe leaves as they are."""
        if self.given is not None:
            return set(self.given)
        return {f.name for f in fields(self) if f.default is not MISSING and getattr(self, f.name) != f.default}

    def _check_recipe(self) -> None:
        from cafa_cli.methods.recipes import check_name

        self.method_option = list(self.method_option or [])  # none given on the command line: None
        check_name(self.recipe)
        parse_method_options(self.method_option)


def parse_method_options(entries: list[str]) -> list[tuple[str | None, str, str]]:
    """`--method-option` entries as (method or None, option, value text)."""
    parsed = []
    for entry in entries:
        key, equals, value = str(entry).partition("=")
        method, dot, name = key.strip().rpartition(".")
        if not equals or not name.isidentifier() or (dot and not method):
            raise UsageError(
                f"`method_option` {entry!r}: expected NAME=VALUE (e.g. redundancy_margin=0.4), or "
                f"METHOD.NAME=VALUE for one method of a bench"
            )
        parsed.append((method or None, name, value.strip()))
    twice = [
        f"{m + '.' if m else ''}{n}"
        for k, (m, n, _) in enumerate(parsed)
        if (m, n) in [(a, b) for a, b, _ in parsed[:k]]
    ]
    if twice:
        raise UsageError(f"`method_option` gives {twice[0]} twice; give each once")
    return parsed


@dataclass(kw_only=True)
class MethodDataOptions:
    """What a method needs beyond the model, its statistics and the test data."""

    source_data: str | None = setting(
        None,
        "Clean labelled source images (as --data), for the methods that use them: eata's Fisher anti-forgetting term "
        "(without them eata runs as eta), foa's and dpcore's source statistics (they need them), rmt's warm-up and "
        "source replay (without them it runs source-free). "
        "--fisher-data is another name for it.",
        metavar="PATH",
        flags=("--source-data", "--fisher-data"),
        panel=ADAPTATION,
        recorded="resolved: the data as opened",
    )
    fisher_samples: int = setting(
        2000,
        "eata, foa and dpcore: how many --source-data images (at random, seed 0) the Fisher term (eata) or the "
        "source statistics (foa; dpcore's confident ones among them) use.",
        metavar="N",
        panel=ADAPTATION,
    )

    def _check_method_data(self) -> None:
        at_least("fisher_samples", self.fisher_samples, 1)


@dataclass(kw_only=True)
class StreamOptions:
    """The order and grouping of the test images, and the pace and length of the stream."""

    batch_size: int = setting(
        StreamSettings.batch_size,
        "Images per batch: one forward pass and one adaptation step each (paper: 200; 64 on ImageNet-C).",
        metavar="N",
        panel=STREAM,
    )
    reset: str = setting(
        StreamSettings.reset,
        "domain (each domain from the source weights), episodic (every batch), never (continual), every:N "
        "(continual, back to the source weights after every N updates: RDumb's schedule).",
        metavar="RESET",
        panel=STREAM,
    )
    order: str = setting(
        StreamSettings.order,
        "Order of each domain's images: iid, label-shift:S (the paper's), or dirichlet:D (NOTE's and RoTTA's; 0.1, "
        "0.01); docs/guides/streams.md.",
        metavar="ORDER",
        panel=STREAM,
    )
    mix_domains: bool = setting(
        StreamSettings.mix_domains, "All domains interleaved into one stream (errors still per domain).", panel=STREAM
    )
    gradual: bool = setting(
        False,
        "Visit each corruption at severities 1,2,3,4,5,4,3,2,1 (CoTTA's gradual setting); DOMAIN is the corruption's "
        "folder.",
        panel=STREAM,
    )
    rounds: int = setting(
        1,
        "Run the whole sequence of domains this many times in one stream (a long horizon; with `reset` never, the "
        "persistent setting), the error of each round reported.",
        metavar="N",
        panel=STREAM,
    )
    stream_rate: str = setting(
        "inf",
        "A stream that does not wait: a batch arrives every R forward passes of the source model (1, 1/2, ...); those "
        "that arrive while the method is busy are predicted without adapting (Alfarra et al., ICML 2024). inf: the "
        "stream waits for each step.",
        metavar="R",
        panel=STREAM,
    )
    step_cost: str = setting(
        "table",
        "Under `stream_rate`, a step's cost in forward passes of the source model: table (from cafa methods' "
        "step ÷ TENT column), measured (in this run), a number, or METHOD=K pairs.",
        metavar="table|measured|K",
        panel=STREAM,
    )

    def _check_stream(self) -> None:
        check_batch_size(self.batch_size)
        parse_order(self.order)
        parse_reset(self.reset)
        check_rounds(self.rounds)
        parse_stream_rate(self.stream_rate)
        check_step_cost_names(self.step_cost)
        if self.mix_domains and self.gradual:
            raise UsageError(
                "`mix_domains` and `gradual` are two ways to make one stream of the domains; give one of them"
            )


def check_step_cost_names(step_cost: str) -> None:
    """`step_cost`'s METHOD=K pairs each name a method (a misspelt one would be taken and never
    used: the table's cost would stand in for it)."""
    from cafa_cli.methods import REGISTRY, is_plugin

    _, given = parse_step_cost(step_cost)
    for name in given:
        if name is not None and name not in REGISTRY and not is_plugin(name):
            raise UsageError(
                f"`step_cost` {step_cost}: {name!r} is no method; a METHOD=K pair names one of {', '.join(REGISTRY)}, "
                f"or a plug-in module:factory"
            )


@dataclass(kw_only=True)
class OutlierOptions:
    """Images from outside the label set in each stream (data/outliers.py), for `adapt` and `bench`
    alone: the statistics (`cafa stats`, a bench's `train`) never see them."""

    outliers: str | None = setting(
        None,
        "Images from outside the label set mixed into each domain's stream, SHARE of its images (default 0.2; "
        "[0, 1)): any data cafa reads, or generated noise:gaussian or noise:uniform; unlabelled, adapted on, kept "
        "out of the error and scored (AUROC); docs/guides/streams.md.",
        metavar="PATH[:SHARE]",
        panel=STREAM,
        recorded="resolved: the images' absolute path and their share",
    )

    def outlier_source(self) -> tuple[str, float] | None:
        """`outliers` as (its images, their share), None without it."""
        return None if self.outliers is None else parse_outliers(self.outliers)

    def outlier_inputs(self) -> dict[str, str | None]:
        """The outlier images' file or folder, which no output may replace; none when generated."""
        source = self.outlier_source()
        return {"`outliers`": source[0] if source and source[0] not in GENERATED_OUTLIERS else None}

    def _check_outliers(self) -> None:
        if self.outlier_source() is not None and getattr(self, "oracle", False):
            raise UsageError(
                "`oracle` gives the loss each image's true label, and the images of `outliers` have none; give one "
                "of them"
            )


@dataclass(kw_only=True)
class CccOptions:
    """A continuously changing corruption stream made from each domain's clean images (data/ccc.py)."""

    ccc: int | None = setting(
        None,
        "Make each domain a CCC stream of N images (Press et al., NeurIPS 2023): its clean images corrupted on "
        "the fly by two corruptions at once, their severities walked so the source model's accuracy stays near "
        "`ccc_accuracy`; needs corrupt-tta; docs/guides/streams.md.",
        metavar="N",
        panel=STREAM,
        show_default=False,
    )
    ccc_speed: int = setting(
        1000, "Under `ccc`, images per step of the walk (CCC: 1000, 2000, 5000).", metavar="N", panel=STREAM
    )
    ccc_accuracy: float = setting(
        40.0,
        "Under `ccc`, the source model's accuracy (%) the walks keep near (CCC-Easy 40, Medium 20, Hard 1).",
        metavar="PCT",
        panel=STREAM,
    )

    def _check_ccc(self) -> None:
        if self.ccc_speed < 1:
            raise UsageError(f"`ccc_speed` {self.ccc_speed}: a walk of no image a step never moves; give 1 or more")
        if not 0 < self.ccc_accuracy < 100:
            raise UsageError(f"`ccc_accuracy` is a percentage in (0, 100), not {self.ccc_accuracy:g}")
        if self.ccc is None:
            return
        if self.ccc < 1:
            raise UsageError(f"`ccc` {self.ccc}: a stream holds 1 image or more")
        for name, why in (
            ("gradual", "walks the severities of one corruption"),
            ("mix_domains", "interleaves the domains' images"),
        ):
            if getattr(self, name, False):
                raise UsageError(f"`ccc` streams its images in the order of its walk, and `{name}` {why}; give one")
        if getattr(self, "orders", None) is not None:
            raise UsageError("`ccc` streams its images in the order of its walk; leave `orders` out")
        if getattr(self, "order", "iid") != "iid":
            raise UsageError(
                f"`ccc` draws each step's images at random, in the order of its walk, and `order` {self.order} "
                f"orders them otherwise; leave `order` out"
            )
        if getattr(self, "severity", None) is not None:
            raise UsageError("`ccc` walks the severities itself; give the clean images as `data`, without `severity`")


@dataclass(kw_only=True)
class OracleOptions:
    """An analysis of labelled streams: the paper's CAFA-Oracle."""

    oracle: bool = setting(
        StreamSettings.oracle,
        "CAFA-Oracle: the class-aware loss takes the true labels in place of the predictions; the predictions "
        "reported are still the model's. For cafa, intra, euclidean and cafa-eata; bench adds a NAME-oracle row after "
        "each of theirs.",
        panel=ADAPTATION,
    )


def oracle_methods() -> list[str]:
    """The built-in methods whose loss uses the predicted class, which `oracle` replaces."""
    from cafa_cli.methods import REGISTRY, method_class

    return [name for name in REGISTRY if method_class(name).takes_labels]


def check_oracle(method: str) -> None:
    """`oracle` replaces the pseudo-labels of a class-aware loss: a built-in method whose loss
    takes none is refused here (a plug-in when it is made, by the same class attribute)."""
    from cafa_cli.methods import is_plugin

    if not is_plugin(method) and method not in oracle_methods():
        raise UsageError(
            f"`oracle` gives the true labels to a loss that uses the predicted class ({', '.join(oracle_methods())}); "
            f"`method` {method} takes none, so the oracle would change nothing"
        )


@dataclass(kw_only=True)
class SamplingOptions:
    """Which training images the statistics come from, and how they are regularised."""

    fraction: float | None = setting(
        None,
        f"Stratified fraction of each class's training images, in (0, 1]; default {DEFAULT_FRACTION}.",
        metavar="F",
        panel=STATISTICS,
        brief=True,
        show_default=False,
        recorded=AS_SAMPLE,
    )
    per_class: int | None = setting(
        None,
        "This many training images per class instead of a --fraction.",
        metavar="N",
        panel=STATISTICS,
        recorded=AS_SAMPLE,
    )
    shrinkage: str = setting(
        "auto",
        "'auto' (OAS per class; diag: a λ for the variances alone) or λ in [0, 1]: "
        "Σ = (1-λ)S + λ tr(S)/d I. 0 is the paper's unregularised estimate.",
        metavar="auto|λ",
        panel=STATISTICS,
        recorded="resolved: a number, or auto",
    )

    def training_sample(self) -> tuple[float | None, int | None]:
        """(fraction, None) or (None, per_class): a fraction of 0.05 when neither is given."""
        if self.fraction is not None and self.per_class is not None:
            raise UsageError("`fraction` and `per_class` both say how many training images to use; give one of them")
        if self.per_class is not None:
            at_least("per_class", self.per_class, 2)
            return None, self.per_class
        fraction = DEFAULT_FRACTION if self.fraction is None else self.fraction
        if not 0 < fraction <= 1:
            raise UsageError(f"`fraction` must be in (0, 1], not {fraction}")
        return fraction, None

    def shrinkage_value(self) -> float | str:
        """'auto', or λ in [0, 1] as a float."""
        return parse_shrinkage(self.shrinkage)

    def _check_sampling(self) -> None:
        self.training_sample()
        self.shrinkage_value()
