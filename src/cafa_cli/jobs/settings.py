"""The option groups the jobs' settings are made of (jobs/config.py): which model, how
images are read, how the method adapts, the stream, the training subset, the runtime;
each field with its default, help, metavar and help panel (`setting`), and the checks
that need no model or data. Torch-free, as the command line builds its options from them.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Literal

from cafa_cli.data.values import (check_batch_size, check_num_workers, check_preprocessing, parse_floats, parse_order,
                                  parse_size)
from cafa_cli.errors import UsageError
from cafa_cli.factories import code_file, parse_model_args
from cafa_cli.method.options import COVARIANCE_CHOICES, OPTIMIZERS, PARAM_SETS, PRECISIONS, check_adapter_options

Optimizer = Literal[OPTIMIZERS]  # type: ignore[valid-type]  (the Adapter's names)
ParamSet = Literal[PARAM_SETS]  # type: ignore[valid-type]
Precision = Literal[PRECISIONS]  # type: ignore[valid-type]
RESET_POLICIES = ("domain", "episodic", "never")  # when the model goes back to the source weights
RECORD_FORMATS = ("csv", "jsonl")
Reset = Literal[RESET_POLICIES]  # type: ignore[valid-type]
Covariance = Literal[COVARIANCE_CHOICES]  # type: ignore[valid-type]
RecordFormat = Literal[RECORD_FORMATS]  # type: ignore[valid-type]

DEFAULT_FRACTION = 0.05  # of each class's training images: the paper's
BENCH_METHODS = "source,bn,pl,tent,cafa,global-fa,intra,euclidean,cafa-tied,cafa-diag"
DEMO_CORRUPTIONS = "gaussian_noise,defocus_blur,frost,contrast"  # one of each ImageNet-C family

# help panels, in the order --help shows them
MODEL, DATA, ADAPTATION, STREAM, STATISTICS, OUTPUT, RUNTIME = (
    "Model", "Data", "Adaptation", "Stream", "Statistics", "Output", "Runtime")


def setting(default=MISSING, help: str = "", *, factory=MISSING, flags: tuple[str, ...] = (), metavar: str | None = None,
            panel: str | None = None, show_default: bool = True, command_line_only: bool = False, names_code: bool = False,
            option: bool = True):
    """A config field with what its command-line option needs. `flags` replaces the
    generated `--name` (e.g. a short form, or `--x/--no-x`); `command_line_only` marks a
    setting that lets code run or lifts a safety check, which no config file may set;
    `names_code` one whose value may name code to import (module:function), which a config
    file may set to a plain name only; `option` False, a field the command fills itself."""
    metadata = {"help": help, "flags": flags, "metavar": metavar, "panel": panel, "show_default": show_default,
                "command_line_only": command_line_only, "names_code": names_code, "option": option}
    if factory is not MISSING:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(kw_only=True)
class ModelOptions:
    """Which model: a torchvision name, a bundled model, or a factory, with its weights."""

    model: str | None = setting(None, "torchvision architecture (resnet50, ...), a bundled model (fmnist-resnet), "
                                "timm:NAME (pip install 'cafa-cli[timm]'), torchvision:NAME, robustbench:DATASET/NAME (RobustBench's "
                                "corruption models, e.g. robustbench:cifar10/Standard; checkpoint from --weights or "
                                "./models/DATASET/corruptions/NAME.pt), or a factory: file.py:function "
                                "or package.module:function (its code runs; the command line only, never a config file).",
                                flags=("--model", "-m"), metavar="NAME", panel=MODEL, names_code=True)
    weights: str | None = setting(None, "State dict: .safetensors, or .pt/.pth (read with weights_only=True); or "
                                  "pretrained weights by name from the local cache, never downloaded: a torchvision weights "
                                  "enum (IMAGENET1K_V2, ResNet50_Weights.IMAGENET1K_V2, DEFAULT) or a timm tag (a1_in1k).",
                                  flags=("--weights", "-w"), metavar="PATH|NAME", panel=MODEL)
    model_args: list[str] = setting(help="A keyword argument of the model's constructor or factory, KEY=VALUE "
                                    "(repeatable): image_size=64, drop_rate=0.1; a value is a Python literal, else text.",
                                    factory=list, flags=("--model-arg",), metavar="KEY=VALUE", panel=MODEL)
    num_classes: int | None = setting(None, "Outputs of a torchvision architecture or factory.", metavar="N", panel=MODEL)
    classifier: str | None = setting(None, "Name of the final nn.Linear (default: the last one).", metavar="NAME", panel=MODEL)
    trust_checkpoint: bool = setting(False, "Allow .pt/.pth files that hold Python objects. Unpickling them can run "
                                     "arbitrary code: only for files you trust.", panel=MODEL, command_line_only=True)

    def model_inputs(self) -> dict[str, str | None]:
        """The files the model is read from, which no output may replace."""
        return {"`model`": factory_file(self.model), "`weights`": self.weights}

    def model_arguments(self) -> dict:
        """`model_args` parsed: {KEY: value}."""
        return parse_model_args(self.model_args, "`model_arg`")

    def _check_model(self) -> None:
        self.model_args = list(self.model_args or [])  # none given on the command line: None
        if self.num_classes is not None:
            at_least("num_classes", self.num_classes, 1)
        self.model_arguments()


@dataclass(kw_only=True)
class InputOptions:
    """How images are read and preprocessed. None: the artifact's, the bundled model's, or ImageNet's."""

    classes: str | None = setting(None, "File with one class name per line, in the model's output order (default: an "
                                  "artifact's or a bundled model's list, else the sorted folder names).", metavar="PATH",
                                  panel=DATA)
    class_subset: str | None = setting(None, "File with the classes to predict among, one name (wnid) a line, e.g. "
                                       "ImageNet-R's 200 of a 1000-class model: the logits are those classes' only, and "
                                       "cafa stats keeps their images only (see docs/usage.md, Benchmarks).",
                                       metavar="PATH", panel=DATA)
    labels: str | None = setting(None, "Labels .npy for a .npy array of images.", metavar="PATH", panel=DATA)
    severity: int | None = setting(None, "Pick severity 1-5 from an array stacking five (CIFAR-10-C layout), or of "
                                   "imagenet-c:ROOT / fashion-mnist-c:ROOT / cifar10-c:ROOT / cifar100-c:ROOT (default 5 there).",
                                   metavar="N", panel=DATA)
    resize: str | None = setting(None, "Resize the shorter side to this (pixels or 'none'). Default: the artifact's "
                                 "(adapt), the bundled model's, or 256.", metavar="PX", panel=DATA)
    crop: str | None = setting(None, "Centre crop (pixels or 'none'); default as --resize's, or 224. ImageNet-C is "
                               "already 224x224: use --resize none --crop none.", metavar="PX", panel=DATA)
    mean: str | None = setting(None, "Normalisation mean, one value or one per channel; default as --resize's, or "
                               "ImageNet's.", metavar="X[,X,X]", panel=DATA)
    std: str | None = setting(None, "Normalisation std, one value or one per channel; default as --mean's.",
                              metavar="X[,X,X]", panel=DATA)
    channels: int | None = setting(None, "1 (grey) or 3 (RGB).", metavar="N", panel=DATA)
    interpolation: str | None = setting(None, "Resize filter: bilinear, bicubic or nearest. Default: the artifact's "
                                        "(adapt), the model's own (timm, torchvision weights by name), or bilinear.",
                                        metavar="MODE", panel=DATA)

    def preprocessing_changes(self, prefix: str = "") -> dict:
        """The preprocessing values given (None: not given), parsed and each checked by itself."""
        texts = {"resize": (self.resize, parse_size), "crop": (self.crop, parse_size),
                 "mean": (self.mean, parse_floats), "std": (self.std, parse_floats)}
        changes = {key: parse(text, prefix + key) for key, (text, parse) in texts.items() if text is not None}
        if self.channels is not None:
            changes["channels"] = self.channels
        if self.interpolation is not None:
            changes["interpolation"] = self.interpolation
        check_preprocessing(changes, prefix)
        return changes

    def _check_input(self) -> None:
        self.preprocessing_changes()


@dataclass(kw_only=True)
class TestDataOptions:
    """Which test images, beyond the domains: an image-id list, and a clean set to check the model on."""

    subset: str | None = setting(None, "File of image ids to keep in each test domain, one a line: CLASS/FILE as below "
                                 "the domain's folder, or FILE (RobustBench's 5,000-image ImageNet-C list).",
                                 metavar="PATH", panel=DATA)
    clean: str | None = setting(None, "The clean test set of the benchmark (ImageNet's val folder, cifar10-test:ROOT): "
                                "the source model's error on it is printed before adapting, as a sanity check. Prepared "
                                "as the statistics' training images.", metavar="PATH", panel=DATA)
    source: str | None = setting(None, "The source domain of a domain-adaptation benchmark among the domains "
                                 "(office-home:ROOT, domainnet:ROOT, domainnet126:ROOT): left out of the targets, and "
                                 "named in the table and the JSON. The model and its statistics are the source's.",
                                 metavar="DOMAIN", panel=DATA)


@dataclass(kw_only=True)
class RuntimeOptions:
    device: str = setting("auto", "auto, cpu, cuda or cuda:N.", metavar="DEVICE", panel=RUNTIME)
    num_workers: int | None = setting(None, "Data loading processes. Default: on CUDA the CPU cores this process may use, "
                                      "divided among torchrun's ranks on the machine, minus one; on the CPU 0.",
                                      metavar="N", panel=RUNTIME, show_default=False)
    strict: bool = setting(False, "Fail on the first unreadable image instead of skipping it.", panel=RUNTIME)

    def _check_runtime(self) -> None:
        if self.device != "auto" and self.device.partition(":")[0] not in ("cpu", "cuda"):
            raise UsageError(f"`device` {self.device}: expected auto, cpu, cuda or cuda:N")
        check_num_workers(self.num_workers)


@dataclass(kw_only=True)
class AdaptationOptions:
    """How the model adapts: the Adapter's keyword arguments, one to one."""

    params: ParamSet = setting("norm", "norm (normalisation affines) or all (the whole feature extractor).", panel=ADAPTATION)
    optimizer: Optimizer = setting("adam", "adam, sgd, or nesterov (SGD with Nesterov momentum, as TENT's ImageNet-C "
                                   "code).", panel=ADAPTATION)
    lr: float = setting(1e-3, "Learning rate.", metavar="LR", panel=ADAPTATION)
    momentum: float = setting(0.9, "Momentum of sgd and nesterov (adam ignores it).", metavar="M", panel=ADAPTATION)
    steps: int = setting(1, "Gradient steps per batch.", metavar="N", panel=ADAPTATION)
    norm: str = setting("batch", "The statistics BatchNorms normalise with: batch (the test batch's); prior:N (the source's "
                        "count as N samples, for small batches); source (frozen; only the affines adapt); ema:M (running, "
                        "moved by momentum M, as RoTTA's); class-balanced (the batch's, corrected for its class mix: for "
                        "label shift; needs cafa stats --norm-moments). See docs/usage.md.", metavar="NORM", panel=ADAPTATION)
    precision: Precision = setting("fp32", "Autocast precision (bf16, fp16: CUDA only).", panel=ADAPTATION)
    compile: bool = setting(False, "torch.compile the model, with the loss of a method that trains (pays a compilation on the first batches).", panel=ADAPTATION)
    cuda_graph: bool = setting(True, "On CUDA, replay each step from a CUDA graph where the method allows it (one launch a "
                               "batch instead of hundreds; checked against an eager step once). --no-cuda-graph: every step "
                               "eager.", flags=("--cuda-graph/--no-cuda-graph",), panel=ADAPTATION)

    def adapter_options(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(AdaptationOptions)}

    def _check_adaptation(self) -> None:
        check_adapter_options(**self.adapter_options())


@dataclass(kw_only=True)
class RecipeOptions:
    """Which published setting a method runs with, and its own options beyond it."""

    recipe: str = setting("auto", "The methods' published settings (recipes/*.toml; cafa methods NAME --recipe R prints "
                          "one): imagenet-c, cifar10-c, cifar100-c; auto (from a named benchmark among the domains, else "
                          "the model's 10, 100 or 1000 classes; other models: none); none (the defaults shown here); or a "
                          ".toml file of method tables. Options given (command line, cafa.toml) win over it, one by one.",
                          metavar="NAME|FILE", panel=ADAPTATION)
    method_option: list[str] = setting(help="One of the method's own options, NAME=VALUE (repeatable), over its recipe's: "
                                       "redundancy_margin=0.4, affinity=knn, frozen=layer4,layer3; METHOD.NAME=VALUE for "
                                       "one method of a bench. cafa methods NAME lists them.", factory=list,
                                       flags=("--method-option",), metavar="NAME=VALUE", panel=ADAPTATION)
    # the settings the user chose, which a recipe does not replace (the command line fills it);
    # None: those that differ from their defaults
    given: tuple[str, ...] | None = setting(None, option=False)

    def recipe_file(self) -> str | None:
        return self.recipe if self.recipe.endswith(".toml") else None

    def chosen(self) -> set[str]:
        """The settings a recipe leaves as they are."""
        if self.given is not None:
            return set(self.given)
        return {f.name for f in fields(self) if f.default is not MISSING and getattr(self, f.name) != f.default}

    def _check_recipe(self) -> None:
        from cafa_cli.recipes import check_name

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
            raise UsageError(f"`method_option` {entry!r}: expected NAME=VALUE (e.g. redundancy_margin=0.4), or "
                             f"METHOD.NAME=VALUE for one method of a bench")
        parsed.append((method or None, name, value.strip()))
    twice = [f"{m + '.' if m else ''}{n}" for k, (m, n, _) in enumerate(parsed) if (m, n) in [(a, b) for a, b, _ in parsed[:k]]]
    if twice:
        raise UsageError(f"`method_option` gives {twice[0]} twice; give each once")
    return parsed


@dataclass(kw_only=True)
class MethodDataOptions:
    """What a method needs beyond the model, its statistics and the test data."""

    fisher_data: str | None = setting(None, "eata: clean source images (a folder or array, as --data) for its Fisher "
                                      "anti-forgetting term; without it eata runs as eta. Prepared as the test images.",
                                      metavar="PATH", panel=ADAPTATION)
    fisher_samples: int = setting(2000, "eata: how many --fisher-data images (at random, seed 0) the Fisher term uses.",
                                  metavar="N", panel=ADAPTATION)

    def _check_method_data(self) -> None:
        at_least("fisher_samples", self.fisher_samples, 1)


@dataclass(kw_only=True)
class StreamOptions:
    """The order and grouping of the test images: adapt_domains' keyword arguments."""

    batch_size: int = setting(200, "Images per adaptation batch (paper: 200; 64 on ImageNet-C).", metavar="N", panel=STREAM)
    reset: Reset = setting("domain", "domain (each domain from the source weights), episodic (every batch), never "
                           "(continual).", panel=STREAM)
    order: str = setting("iid", "Order of each domain's images: iid (shuffled); label-shift:S, the paper's label shift "
                         "(the class distribution peaks at S + (1-S)/c on one class, the peak moving through the classes "
                         "over the stream); dirichlet:D, NOTE's and RoTTA's correlated stream (each class spread over time "
                         "slots by Dirichlet(D); 0.1 and 0.01 usual). Both need labels; see docs/usage.md.",
                         metavar="ORDER", panel=STREAM)
    mix_domains: bool = setting(False, "All domains interleaved into one stream, ordered as one (the test-time-adaptation "
                                "benchmark's mixed_domains); errors still per domain.", panel=STREAM)
    gradual: bool = setting(False, "Each domain is a corruption (DIR holding DIR/1 ... DIR/5, or one of them), visited at "
                            "severities 1,2,3,4,5,4,3,2,1 as in CoTTA's gradual setting; --reset domain resets per "
                            "corruption.", panel=STREAM)

    def _check_stream(self) -> None:
        check_batch_size(self.batch_size)
        parse_order(self.order)
        if self.mix_domains and self.gradual:
            raise UsageError("`mix_domains` and `gradual` are two ways to make one stream of the domains; give one of them")


@dataclass(kw_only=True)
class OracleOptions:
    """An analysis of labelled streams: the paper's CAFA-Oracle."""

    oracle: bool = setting(False, "CAFA-Oracle, an analysis for labelled streams: the class-aware loss takes each image's "
                           "true label in place of the model's prediction (its pseudo-label); the predictions reported are "
                           "still the model's. For cafa, intra, euclidean and cafa-eata; cafa bench adds a NAME-oracle row after each "
                           "row of those (cafa-tied-oracle, ...).", panel=ADAPTATION)


def oracle_methods() -> list[str]:
    """The built-in methods whose loss uses the predicted class, which `oracle` replaces."""
    from cafa_cli.method.methods import NAMES, method_class

    return [name for name in NAMES if method_class(name).takes_labels]


def check_oracle(method: str) -> None:
    """`oracle` replaces the pseudo-labels of a class-aware loss: a built-in method whose loss
    takes none is refused here (a plug-in when it is made, by the same class attribute)."""
    from cafa_cli.method.methods import is_plugin

    if not is_plugin(method) and method not in oracle_methods():
        raise UsageError(f"`oracle` gives the true labels to a loss that uses the predicted class ({', '.join(oracle_methods())}); "
                         f"`method` {method} takes none, so the oracle would change nothing")


@dataclass(kw_only=True)
class SamplingOptions:
    """Which training images the statistics come from, and how they are regularised."""

    fraction: float | None = setting(None, f"Stratified fraction of each class's training images, in (0, 1]; default "
                                     f"{DEFAULT_FRACTION}.", metavar="F", panel=STATISTICS, show_default=False)
    per_class: int | None = setting(None, "This many training images per class instead of a --fraction.", metavar="N",
                                    panel=STATISTICS)
    shrinkage: str = setting("auto", "'auto' (OAS per class; diag: a λ for the variances alone) or λ in [0, 1]: "
                             "Σ = (1-λ)S + λ tr(S)/d I. 0 is the paper's unregularised estimate.", metavar="auto|λ",
                             panel=STATISTICS)

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

def factory_file(spec: str | None) -> str | None:
    """The file of a `file.py:function` or `module:function` model or plug-in, else None:
    code the command reads and runs."""
    return code_file(spec)


def at_least(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise UsageError(f"`{name}` must be a whole number, not {value!r}")
    if value < low:
        raise UsageError(f"`{name}` must be at least {low}, not {value}" if low else f"`{name}` must be 0 or more, not {value}")


def parse_shrinkage(value: float | str) -> float | str:
    if value == "auto":
        return value
    try:
        lam = float(value)
    except (TypeError, ValueError):
        lam = float("nan")
    if not 0.0 <= lam <= 1.0:
        raise UsageError(f"`shrinkage` must be 'auto' or a number in [0, 1], not {value!r}")
    return lam
