"""A model by name: a torchvision architecture, a bundled model, or a factory
(`file.py:fn`, `package.module:fn`), loaded with its weights and wrapped so that it
returns its features too; and the fingerprints an artifact records of it."""

from __future__ import annotations

import difflib
import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path
import torch
from torch import nn
from cafa_cli.errors import InputError, UsageError
from cafa_cli.factories import import_factory
from cafa_cli.files import absolute
from cafa_cli.method.features import FeatureClassifier
from cafa_cli.checkpoints import is_step_counter, load_weights, read_state_dict, sha256_of


@dataclass(frozen=True)
class ModelSpec:
    """What the artifact records so that `adapt` can rebuild the exact model."""

    model: str
    weights: str | None = None  # absolute path
    weights_sha256: str | None = None
    num_classes: int | None = None
    classifier: str | None = None


def build_model(model: str, num_classes: int | None = None) -> nn.Module:
    """A torchvision architecture name, a bundled model name, or `file.py:fn` / `pkg.mod:fn`."""
    from cafa_cli.zoo import BUNDLED, load_bundled

    if model in BUNDLED:
        return load_bundled(model)
    if ":" in model:
        return _from_factory(model, num_classes)
    import torchvision

    names = torchvision.models.list_models(module=torchvision.models)
    if model not in names:
        hint = f" (did you mean {', '.join(close)}?)" if (close := _close_names(model, names)) else ""
        raise UsageError(
            f"`model` {model}: unknown architecture{hint}; give a torchvision classification model, "
            f"one of {', '.join(sorted(BUNDLED))}, or a factory 'file.py:function'"
        )
    kwargs = {"num_classes": num_classes} if num_classes is not None else {}
    return torchvision.models.get_model(model, weights=None, **kwargs)


def _close_names(name: str, names: list[str]) -> list[str]:
    """Architectures a mistyped --model may mean: the names that contain it, or spell it
    nearly alike, ignoring case, `-` and `_` (resnet-50, ResNet50, resnt50 → resnet50)."""
    plain = {n.replace("_", ""): n for n in names}
    wanted = name.lower().replace("-", "").replace("_", "")
    containing = [n for key, n in plain.items() if wanted in key]
    return (containing or [plain[key] for key in difflib.get_close_matches(wanted, plain, n=5, cutoff=0.8)])[:5]


def _from_factory(spec: str, num_classes: int | None) -> nn.Module:
    factory, function = import_factory(spec, "`model`", "function")
    try:
        model = factory(num_classes=num_classes) if num_classes is not None else factory()
    except (Exception, SystemExit) as error:
        raise InputError(f"`model` {spec}: {function}() failed ({type(error).__name__}: {error})") from None
    if not isinstance(model, nn.Module):
        raise InputError(f"`model` {spec}: {function}() returned {type(model).__name__}, not a torch nn.Module")
    return model


def parameters_sha256(module: nn.Module) -> str:
    """A fingerprint of the values the features depend on, whatever file they came from;
    docs/artifact-format.md specifies it byte for byte."""
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
    weights), so that adapt works from any folder and `net.py:build` names the same model."""
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
) -> tuple[FeatureClassifier, ModelSpec]:
    """Build, load and wrap a model; return it (eval mode, CPU) with its reproducible spec."""
    if num_classes is not None and num_classes < 1:
        raise UsageError(f"`num_classes` must be at least 1, not {num_classes}")
    net = build_model(model, num_classes)
    if weights is not None:
        load_weights(net, read_state_dict(weights, trust_checkpoint), weights)
    wrapped = FeatureClassifier(net, classifier).eval()
    if num_classes is not None and wrapped.num_classes != num_classes:
        raise UsageError(f"`num_classes` {num_classes} but the model's classifier has {wrapped.num_classes} outputs")
    spec = ModelSpec(canonical_model(model), absolute(weights), weights_sha256(model, weights), num_classes, wrapped.classifier_name)
    return wrapped, spec


def factory_sha256(model: str) -> str | None:
    """The SHA-256 of the file of a `file.py:fn` model (its code), else None."""
    location, _, _ = model.rpartition(":")
    return sha256_of(location) if location.endswith(".py") and Path(location).is_file() else None


def weights_sha256(model: str, weights: str | None) -> str | None:
    """What an artifact records to notice changed weights: the sha256 of the weights file,
    or of a bundled model's packaged weights (a newer cafa may retrain them); else None."""
    if weights is not None:
        return sha256_of(weights)
    bundled = bundled_model(model)
    return sha256_of(bundled.weights) if bundled is not None else None


def bundled_model(model: str | None):
    """The bundled model of this name (its weights, class names, preprocessing and training
    data), else None."""
    from cafa_cli.zoo import BUNDLED

    return BUNDLED.get(model)
