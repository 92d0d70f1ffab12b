"""A model by name: a torchvision architecture, a bundled model, `timm:NAME` /
`torchvision:NAME` (model/hub.py), `openclip:ARCH` (model/openclip.py: the zero-shot classifier of
the classes named), `robustbench:DATASET/NAME` (model/zoo/robustbench.py), or a factory
(`file.py:fn`, `package.module:fn`), built with
its keyword arguments, loaded with its weights and wrapped so that it returns its
features too; and the fingerprints an artifact records of it.

Public (docs/reference/python-api.md): `load_model`, which loads a model as `--model`/`--weights` do,
`model_spec`, what an artifact records of it, `ModelSpec` and `parameters_sha256`."""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from cafa_cli.core.errors import InputError, UsageError, did_you_mean, listing
from cafa_cli.core.factories import import_factory, is_factory, parse_model_args
from cafa_cli.core.files import absolute
from cafa_cli.model import hub, libraries, openclip
from cafa_cli.model.checkpoints import check_weights_file, is_step_counter, load_weights, read_state_dict, sha256_of
from cafa_cli.model.clip import Prompting, ZeroShotClassifier, prompts_sha256
from cafa_cli.model.features import FeatureClassifier
from cafa_cli.model.spec import ModelSpec
from cafa_cli.model.zoo import bundled_model, robustbench


def build_model(
    model: str,
    num_classes: int | None = None,
    model_args: dict | None = None,
    weights: hub.CachedWeights | None = None,
    prompting: Prompting | None = None,
) -> nn.Module:
    """A torchvision architecture name, a bundled model name, `timm:NAME`, `torchvision:NAME`,
    `openclip:ARCH`, `robustbench:DATASET/NAME`, or `file.py:fn` / `pkg.mod:fn`, called with
    `model_args` (and `num_classes`); `weights` are pretrained weights by name, which the
    library's builder loads (an open_clip model's file too); `prompting` names a CLIP model's classes."""
    from cafa_cli.model.zoo import BUNDLED, load_bundled

    kwargs = {**(model_args or {}), **({"num_classes": num_classes} if num_classes is not None else {})}
    library, name = hub.library_of(model)
    if library == "openclip":
        return openclip.build(name, model_args or {}, weights, prompting)  # its outputs are the classes named
    if model in BUNDLED:
        if model_args:
            raise UsageError(f"`model` {model} is a bundled model, built as it was trained; it takes no `model_arg`")
        return load_bundled(model)  # a `num_classes` other than its outputs is named by resolve()
    if robustbench.is_robustbench(model):
        return robustbench.build(model, model_args)  # its weights are read by resolve(), as a --weights file
    if library == "timm":
        return hub.build_timm(name, kwargs, weights)
    if is_factory(model):
        return _from_factory(model, kwargs)
    if library is None and model not in hub.torchvision_names():
        raise UsageError(
            f"`model` {model}: unknown architecture{did_you_mean(model, [*BUNDLED, *hub.torchvision_names()])}; "
            f"give a torchvision classification model, one of {', '.join(sorted(BUNDLED))}, timm:NAME, "
            "robustbench:DATASET/NAME, or a factory 'file.py:function'"
        )
    return hub.build_torchvision(name, kwargs, weights)


def _from_factory(spec: str, kwargs: dict) -> nn.Module:
    factory, function = import_factory(spec, "`model`", "function")
    try:
        model = factory(**kwargs)
    except (Exception, SystemExit) as error:
        raise InputError(f"`model` {spec}: {function}() failed ({type(error).__name__}: {error})") from None
    if not isinstance(model, nn.Module):
        raise InputError(f"`model` {spec}: {function}() returned {type(model).__name__}, not a torch nn.Module")
    return model


def parameters_sha256(module: nn.Module) -> str:
    """A fingerprint of the values the features depend on, whatever file they came from;
    docs/reference/artifact-format.md specifies it byte for byte."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        if not isinstance(tensor, torch.Tensor) or is_step_counter(name):  # extra state of a module is not a tensor
            continue
        shape = ",".join(str(n) for n in tensor.shape)
        digest.update(f"{name} {str(tensor.dtype).removeprefix('torch.')} [{shape}]\n".encode())
        raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        if sys.byteorder == "big":  # the bytes as a little-endian machine holds them
            raw = raw.reshape(-1, tensor.element_size() // (2 if tensor.is_complex() else 1)).flip(1).reshape(-1)
        digest.update(raw.numpy())
    return digest.hexdigest()


def canonical_model(model: str) -> str:
    """`--model` as an artifact records it: a factory file by its absolute path (as the
    weights), so that adapt works from any folder and `net.py:build` names the same model; so
    is an open_clip model config file (`openclip:tiny.json`)."""
    if openclip.is_openclip(model) and model.lower().endswith(".json"):
        return openclip.PREFIX + str(Path(model.removeprefix(openclip.PREFIX)).resolve())
    location, _, function = model.rpartition(":")
    if location.endswith(".py"):
        return f"{Path(location).resolve()}:{function}"
    return model


def resolve(
    model: str,
    weights: str | None = None,
    num_classes: int | None = None,
    classifier: str | None = None,
    trust_checkpoint: bool = False,
    model_args: dict | None = None,
    prompting: Prompting | None = None,
) -> tuple[FeatureClassifier, ModelSpec]:
    """Build, load and wrap a model; return it (eval mode, CPU) with its reproducible spec.
    `model_args` are the keyword arguments of its constructor or factory (parsed values);
    `prompting` names the classes of a CLIP model (its `templates` are for no other)."""
    if prompting is not None and prompting.templates is not None and not openclip.is_openclip(model):
        raise UsageError(f"`templates` words a CLIP model's classes, and `model` {model} is none (openclip:ARCH)")
    model_args = dict(model_args or {})
    if "num_classes" in model_args:  # --model-arg num_classes=10 is --num-classes 10, recorded as such
        given = model_args.pop("num_classes")
        if num_classes is not None and given != num_classes:
            raise UsageError(
                f"`num_classes` {num_classes} and `model_arg` num_classes={given!r} disagree; give it once"
            )
        num_classes = given
    if num_classes is not None and type(num_classes) is not int:  # --model-arg num_classes=1.5
        raise UsageError(f"`num_classes` must be a whole number, not {num_classes!r}")
    if num_classes is not None and num_classes < 1:
        raise UsageError(f"`num_classes` must be at least 1, not {num_classes}")
    weights = model_weights(model, weights)
    cached = libraries.cached_weights(model, weights) if pretrained_by_name(model, weights) else None
    if openclip.is_openclip(model) and weights is not None and cached is None:
        cached = openclip.weights_file(check_weights_file(weights))  # the CLIP model, before its text head is made
    net = build_model(model, num_classes, model_args, cached, prompting)
    if weights is not None and cached is None:
        state = read_state_dict(weights, trust_checkpoint)
        if robustbench.is_robustbench(model):
            state = robustbench.checkpoint_state(model, state, weights)
        load_weights(net, state, weights)
    wrapped = FeatureClassifier(net, classifier).eval()
    if num_classes is not None and wrapped.num_classes != num_classes:
        raise UsageError(f"`num_classes` {num_classes} but the model's classifier has {wrapped.num_classes} outputs")
    recorded_weights = (cached.name, cached.sha256) if cached else weights_record(model, weights)
    return wrapped, _spec(wrapped, model, recorded_weights, num_classes, model_args, prompting)


def load_model(
    model: str,
    weights: str | None = None,
    *,
    num_classes: int | None = None,
    classifier: str | None = None,
    model_args: dict | None = None,
    trust_checkpoint: bool = False,
    class_names: list[str] | None = None,
    templates: str | None = None,
) -> FeatureClassifier:
    """The model `cafa adapt --model MODEL --weights WEIGHTS` runs, wrapped as the Adapter
    takes it (FeatureClassifier), in eval mode on the CPU: a bundled model with its packaged
    weights (fmnist-resnet), a torchvision architecture with a weights file or pretrained
    weights by name from the local cache (never downloaded), timm:NAME, torchvision:NAME,
    robustbench:DATASET/NAME, or a factory file.py:fn. The keywords are the options of the
    same names (`model_args`: {name: value}, Python literals as --model-arg takes them).
    Resolved as the command line resolves it (checked_model), its
    checks included: an architecture without weights (random, different in every run) and
    weights that are not float32 or not finite are refused. An `openclip:ARCH` model needs
    `class_names` (in output order) and takes `templates` (single, imagenet80 or a file).
    Errors are CafaErrors."""
    if num_classes is not None and (
        isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1
    ):
        raise UsageError(f"`num_classes` must be a whole number of at least 1, not {num_classes!r}")
    arguments = parse_model_args(_model_arg_texts(model_args), "`model_args`")
    weights = None if weights is None else os.fspath(weights)  # a Path as well as a str, as read_artifact takes
    prompting = Prompting(tuple(class_names), templates) if class_names is not None else None
    return checked_model(model, weights, num_classes, classifier, trust_checkpoint, arguments, prompting)[0]


def model_spec(
    model: FeatureClassifier,
    name: str,
    weights: str | None = None,
    *,
    num_classes: int | None = None,
    model_args: dict | None = None,
    templates: str | None = None,
) -> ModelSpec:
    """What an artifact records of `model` (the FeatureClassifier of the network that `name`,
    `weights`, `num_classes` and `model_args` build, as load_model takes them), as `cafa stats`
    records it: a factory file and a weights file by their absolute paths, the weights' sha256
    (or pretrained weights' full name), and the classifier layer the FeatureClassifier uses,
    so that `cafa adapt` and `cafa inspect` find what the statistics were made with; of a CLIP
    model, its `templates` as load_model took them and its prompts' fingerprint."""
    if not isinstance(model, FeatureClassifier):
        raise UsageError(
            f"model_spec takes the FeatureClassifier the statistics were made with, not {type(model).__name__}: "
            f"wrap the network, FeatureClassifier(net), or load it with load_model"
        )
    _model_arg_texts(model_args)  # literals only: the artifact records them as texts to read back
    weights = None if weights is None else os.fspath(weights)
    if weights is not None and not pretrained_by_name(name, weights) and not Path(weights).is_file():
        raise InputError(f"`weights` {weights}: no such file (model_spec records the file the weights came from)")
    texts = model.model.text if isinstance(model.model, ZeroShotClassifier) else None
    prompting = Prompting(tuple(texts.class_names), templates) if texts is not None else None
    return _spec(model, name, weights_record(name, weights), num_classes, model_args or {}, prompting)


def _spec(
    wrapped: FeatureClassifier,
    model: str,
    recorded_weights: tuple[str | None, str | None],
    num_classes: int | None,
    model_args: dict,
    prompting: Prompting | None = None,
) -> ModelSpec:
    weights, sha256 = recorded_weights
    recorded_args = {key: repr(value) for key, value in model_args.items()} or None  # texts parse_model_args reads back
    spec = ModelSpec(canonical_model(model), weights, sha256, num_classes, wrapped.classifier_name, recorded_args)
    texts = wrapped.model.text if isinstance(wrapped.model, ZeroShotClassifier) else None
    if texts is None or prompting is None:
        return spec
    # a bundled CLIP model's prompts are its own (fmnist-clip's): their fingerprint, and no `templates` to give back
    templates = prompting.recorded_templates if openclip.is_openclip(model) else None
    return replace(spec, templates=templates, prompts_sha256=prompts_sha256(texts))


def _model_arg_texts(model_args: dict | None) -> list[str]:
    """`model_args` as --model-arg's KEY=VALUE texts; each value must come back from its text
    (a Python literal), as the command line and an artifact's record give it."""
    if model_args is None:
        return []
    if not isinstance(model_args, dict):
        raise UsageError(f"`model_args` must be a dict of keyword arguments, {{name: value}}, not {model_args!r}")
    texts = [f"{key}={value!r}" for key, value in model_args.items()]
    parsed = parse_model_args(texts, "`model_args`")
    changed = [
        key for key, value in model_args.items() if parsed.get(key) != value or type(parsed.get(key)) is not type(value)
    ]
    if changed:
        raise UsageError(
            f"`model_args` {changed[0]}={model_args[changed[0]]!r} is not a Python literal; give numbers, text, "
            f"True/False/None, or tuples and lists of them, as --model-arg takes them"
        )
    return texts


def model_weights(model: str | None, weights: str | None) -> str | None:
    """`weights` as given; for a `robustbench:` model without them, the file RobustBench
    keeps its checkpoint in (which must exist: nothing is downloaded)."""
    return robustbench.weights_file(model, weights) if robustbench.is_robustbench(model) else weights


def pretrained_by_name(model: str | None, weights: str | None) -> bool:
    """Whether `weights` names pretrained weights of a library's model (IMAGENET1K_V2, a timm
    tag) rather than a file: only for timm:, torchvision: and torchvision names."""
    if not model or weights is None or not hub.is_weights_name(weights) or is_factory(model) or bundled_model(model):
        return False
    return hub.library_of(model)[0] is not None or model in hub.torchvision_names()


def factory_sha256(model: str) -> str | None:
    """The SHA-256 of the file of a `file.py:fn` model (its code), else None."""
    location, _, _ = model.rpartition(":")
    return sha256_of(location) if location.endswith(".py") and Path(location).is_file() else None


def weights_record(model: str, weights: str | None) -> tuple[str | None, str | None]:
    """The weights as an artifact and the metrics record them, and their sha256: a file by
    its absolute path, pretrained weights by their full name (ResNet50_Weights.IMAGENET1K_V2)."""
    weights = model_weights(model, weights)
    if pretrained_by_name(model, weights):
        cached = libraries.cached_weights(model, weights)
        return cached.name, cached.sha256
    return absolute(weights), weights_sha256(model, weights)


def weights_sha256(model: str, weights: str | None) -> str | None:
    """What an artifact records to notice changed weights: the sha256 of the weights file,
    or of a bundled model's packaged weights (a newer cafa may retrain them); else None."""
    weights = model_weights(model, weights)
    if pretrained_by_name(model, weights):
        return libraries.cached_weights(model, weights).sha256
    if weights is not None:
        return sha256_of(weights)
    bundled = bundled_model(model)
    return sha256_of(bundled.weights) if bundled is not None else None


def checked_model(
    model: str,
    weights: str | None,
    num_classes: int | None,
    classifier: str | None,
    trust_checkpoint: bool,
    model_args: dict,
    prompting: Prompting | None = None,
) -> tuple[FeatureClassifier, ModelSpec]:
    """resolve()'s model and spec, refused when it could not give reproducible results: an
    architecture without weights, weights that are not float32 or not finite."""
    net, spec = resolve(model, weights, num_classes, classifier, trust_checkpoint, model_args, prompting)
    if spec.weights is None and not is_factory(spec.model) and bundled_model(spec.model) is None:
        # torchvision's and timm's own initialisation is random: statistics and adaptation
        # would each see another network, and no result could be reproduced
        raise UsageError(
            f"`model` {spec.model} without `weights` is an untrained network with random weights, different in "
            f"every run; give `weights` FILE (a state dict of this architecture), or pretrained weights by name from "
            f"the local cache (IMAGENET1K_V2, a timm tag)"
        )
    _check_parameters(net.model)
    return net, spec


def _check_parameters(model: torch.nn.Module) -> None:
    """float32 values, all finite: other dtypes meet float32 images and fail with a message
    about the input, and NaN weights make every prediction NaN, with exit 0."""
    kinds = {
        "meta" if p.is_meta else str(p.dtype).removeprefix("torch.")
        for p in model.parameters()
        if p.is_floating_point() or p.is_meta
    }
    if kinds - {"float32"}:
        raise InputError(
            f"the model's parameters are {listing(sorted(kinds))}, not float32; return a float32 model "
            f"(model.float(), with its values) — mixed precision on CUDA is `precision` bf16 or fp16"
        )
    broken = [
        name
        for name, tensor in model.state_dict().items()
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())
    ]
    if broken:
        raise InputError(
            f"the model's weights hold NaN or infinite values in {listing(broken)}; "
            f"the checkpoint is damaged or was saved after training diverged: use another"
        )
    # a variance below 0 normalises to NaN: every prediction of a method on the source
    # statistics would be NaN, which a check of the outputs would blame on `mean`/`std`
    negative = [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm)
        and module.running_var is not None
        and bool((module.running_var < 0).any())
    ]
    if negative:
        raise InputError(
            f"the model's BatchNorm running variances are negative in {listing(negative)}; the checkpoint "
            f"is damaged (a variance is never below 0): use another"
        )
