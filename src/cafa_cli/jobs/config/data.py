"""The option groups that say which model and which images: the model and its weights,
how images are read and prepared, and the test data beyond the domains. Torch-free, as
the command line builds its options from them (settings.py has `setting()`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cafa_cli.core.factories import parse_model_args
from cafa_cli.data.values import (
    check_preprocessing,
    parse_floats,
    parse_size,
)
from cafa_cli.engine.options import OPTIMIZERS, PARAM_SETS, PRECISIONS
from cafa_cli.jobs.config.checks import at_least, factory_file
from cafa_cli.jobs.config.settings import AS_BUILT, AS_PATH, AS_PREPROCESSING, DATA, MODEL, setting

Optimizer = Literal[OPTIMIZERS]  # type: ignore[valid-type]  (the Adapter's names)
ParamSet = Literal[PARAM_SETS]  # type: ignore[valid-type]
Precision = Literal[PRECISIONS]  # type: ignore[valid-type]


@dataclass(kw_only=True)
class ModelOptions:
    """Which model: a torchvision name, a bundled model, or a factory, with its weights."""

    model: str | None = setting(
        None,
        "torchvision architecture (resnet50), bundled model (fmnist-resnet), timm:NAME, robustbench:DATASET/NAME, or "
        "a factory file.py:function (its code runs; command line only); docs/guides/adapt.md.",
        flags=("--model", "-m"),
        metavar="NAME",
        panel=MODEL,
        brief=True,
        names_code=True,
        recorded=AS_BUILT,
    )
    weights: str | None = setting(
        None,
        "State dict (.safetensors, or .pt/.pth read with weights_only=True), or pretrained weights by name from the "
        "local cache, never downloaded (IMAGENET1K_V2, a timm tag).",
        flags=("--weights", "-w"),
        metavar="PATH|NAME",
        panel=MODEL,
        brief=True,
        recorded=AS_BUILT,
    )
    model_args: list[str] = setting(
        help="A keyword argument of the model's constructor or factory, KEY=VALUE "
        "(repeatable): image_size=64, drop_rate=0.1; a value is a Python literal, else text.",
        factory=list,
        flags=("--model-arg",),
        metavar="KEY=VALUE",
        panel=MODEL,
        recorded=AS_BUILT,
    )
    num_classes: int | None = setting(
        None, "Outputs of a torchvision architecture or factory.", metavar="N", panel=MODEL, recorded=AS_BUILT
    )
    classifier: str | None = setting(
        None, "Name of the final nn.Linear (default: the last one).", metavar="NAME", panel=MODEL, recorded=AS_BUILT
    )
    templates: str | None = setting(
        None,
        "A CLIP model's prompts: single ('a photo of a {}.'), imagenet80 (the CLIP paper's 80), or a file of "
        "templates with {} (one a line, or a JSON list), or CuPL's JSON {class: [descriptions]} (default: the "
        "artifact's, else single); docs/guides/clip.md.",
        metavar="NAME|PATH",
        panel=MODEL,
        recorded=AS_BUILT,
    )
    trust_checkpoint: bool = setting(
        False,
        "Allow .pt/.pth files that hold Python objects. Unpickling them can run "
        "arbitrary code: only for files you trust.",
        panel=MODEL,
        command_line_only=True,
        recorded="lets a checkpoint's code run, and changes no result",
    )

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

    classes: str | None = setting(
        None,
        "File with one class name per line (or a .json list), in the model's output order (default: the artifact's "
        "with cafa adapt, a bundled model's list, else the sorted folder names; a CLIP model needs it).",
        metavar="PATH",
        panel=DATA,
        recorded=AS_PATH,
    )
    class_subset: str | None = setting(
        None,
        "File of the classes to predict among, one name a line (ImageNet-R's 200 of 1000): docs/guides/benchmarks.md.",
        metavar="PATH",
        panel=DATA,
        recorded=AS_PATH,
    )
    labels: str | None = setting(
        None, "Labels .npy for a .npy array of images.", metavar="PATH", panel=DATA, recorded=AS_PATH
    )
    severity: int | None = setting(
        None,
        "Severity 1-5 of a named benchmark or a stacked array (default 5 there).",
        metavar="N",
        panel=DATA,
        recorded="resolved: with the named benchmarks' default filled in",
    )
    resize: str | None = setting(
        None,
        "Resize the shorter side to this (pixels or 'none'). Default: the artifact's "
        "(adapt), the bundled model's, or 256.",
        metavar="PX",
        panel=DATA,
        recorded=AS_PREPROCESSING,
    )
    crop: str | None = setting(
        None,
        "Centre crop (pixels or 'none'); default as --resize's, or 224. ImageNet-C is "
        "already 224x224: use --resize none --crop none.",
        metavar="PX",
        panel=DATA,
        recorded=AS_PREPROCESSING,
    )
    mean: str | None = setting(
        None,
        "Normalisation mean, one value or one per channel; default as --resize's, or ImageNet's.",
        metavar="X[,X,X]",
        panel=DATA,
        recorded=AS_PREPROCESSING,
    )
    std: str | None = setting(
        None,
        "Normalisation std, one value or one per channel; default as --mean's.",
        metavar="X[,X,X]",
        panel=DATA,
        recorded=AS_PREPROCESSING,
    )
    channels: int | None = setting(None, "1 (grey) or 3 (RGB).", metavar="N", panel=DATA, recorded=AS_PREPROCESSING)
    interpolation: str | None = setting(
        None,
        "Resize filter: bilinear, bicubic or nearest. Default: the artifact's "
        "(adapt), the model's own (timm, torchvision weights by name), or bilinear.",
        metavar="MODE",
        panel=DATA,
        recorded=AS_PREPROCESSING,
    )

    def preprocessing_changes(self, prefix: str = "") -> dict:
        """The preprocessing values given (None: not given), parsed and each checked by itself."""
        texts = {
            "resize": (self.resize, parse_size),
            "crop": (self.crop, parse_size),
            "mean": (self.mean, parse_floats),
            "std": (self.std, parse_floats),
        }
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

    subset: str | None = setting(
        None,
        "File of image ids to keep in each test domain, one a line (RobustBench's 5,000-image ImageNet-C list).",
        metavar="PATH",
        panel=DATA,
        recorded=AS_PATH,
    )
    clean: str | None = setting(
        None,
        "The benchmark's clean test set: the source model's error on it is printed first, as a sanity check.",
        metavar="PATH",
        panel=DATA,
        recorded="resolved: the source model's error on it",
    )
    forgetting: str | None = setting(
        None,
        "A clean (source-distribution) labelled domain, predicted after each test domain with the weights as adapted "
        "so far, without adapting on it: the error on it after each domain measures forgetting.",
        metavar="PATH",
        panel=DATA,
        recorded=AS_PATH,
    )
    source: str | None = setting(
        None,
        "The source domain of a domain-adaptation benchmark (office-home, domainnet): left out of the targets.",
        metavar="DOMAIN",
        panel=DATA,
        recorded="resolved: the source domain the benchmark names",
    )
