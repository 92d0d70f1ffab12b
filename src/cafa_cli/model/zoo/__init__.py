"""Models shipped inside the package, so the demo needs no download."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cafa_cli.core.errors import CafaError, UsageError
from cafa_cli.data.fashion_mnist import FASHION_MNIST_CLASSES, FASHION_MNIST_MEAN, FASHION_MNIST_STD

if TYPE_CHECKING:
    from torch import nn

ZOO_DIR = Path(__file__).resolve().parent


# The loaders defer their imports: the architectures import torch (and open_clip), which naming
# the bundled models (`cafa inspect`) does not need.


def _fmnist_resnet(weights: Path) -> nn.Module:
    from safetensors.torch import load_file

    from cafa_cli.model.zoo.fmnist_resnet import FmnistResNet

    model = FmnistResNet()
    model.load_state_dict(load_file(str(weights)), strict=True)
    return model


def _fmnist_clip(weights: Path) -> nn.Module:
    from cafa_cli.model.zoo.fmnist_clip import load_fmnist_clip

    return load_fmnist_clip(weights)


def _fmnist_vit(weights: Path) -> nn.Module:
    from cafa_cli.model.zoo.fmnist_vit import load_fmnist_vit

    return load_fmnist_vit(weights)


@dataclass(frozen=True)
class BundledModel:
    load: Callable[[Path], nn.Module]  # the model with these weights, loaded strictly
    weights: Path  # safetensors file inside the package
    retrain: str  # the module that reproduces the weights
    class_names: tuple[str, ...]
    preprocessing: dict  # keyword arguments of cafa_cli.preprocessing.Preprocessing
    training_data: str  # what cafa bench computes its statistics from when no --train is given


def _fashion_mnist_preprocessing(channels: int) -> dict:
    """Fashion-MNIST's 28×28 images as they are, with its pixel mean and std, in `channels`."""
    mean, std = [FASHION_MNIST_MEAN], [FASHION_MNIST_STD]
    return {"resize": None, "crop": None, "mean": mean, "std": std, "channels": channels}


BUNDLED: dict[str, BundledModel] = {
    # a small ResNet (BatchNorm, 64 features) trained on Fashion-MNIST's 28×28 grey images;
    # retrain it with python -m cafa_cli.model.zoo.train_fmnist
    "fmnist-resnet": BundledModel(
        load=_fmnist_resnet,
        weights=ZOO_DIR / "fmnist_resnet.safetensors",
        retrain="cafa_cli.model.zoo.train_fmnist",
        class_names=tuple(FASHION_MNIST_CLASSES),
        preprocessing=_fashion_mnist_preprocessing(channels=1),
        training_data="fashion-mnist",
    ),
    # a small CLIP-style dual encoder (open_clip, the `clip` extra): a 4-layer ViT on the same
    # images, 3 equal channels as open_clip's ViT takes RGB, and a 2-layer text tower trained
    # on prompts of the class names; the model is its zero-shot classifier (model/clip.py).
    # Retrain it with python -m cafa_cli.model.zoo.train_fmnist_clip
    "fmnist-clip": BundledModel(
        load=_fmnist_clip,
        weights=ZOO_DIR / "fmnist_clip.safetensors",
        retrain="cafa_cli.model.zoo.train_fmnist_clip",
        class_names=tuple(FASHION_MNIST_CLASSES),
        preprocessing=_fashion_mnist_preprocessing(channels=3),
        training_data="fashion-mnist",
    ),
    # a small timm VisionTransformer (the `timm` extra: 4 blocks of width 96, 7×7 patches, a
    # class token) on the same grey images, for the methods that prompt a ViT's tokens (FOA,
    # DPCore), which the ResNet has none of; retrain it with python -m cafa_cli.model.zoo.train_fmnist_vit
    "fmnist-vit": BundledModel(
        load=_fmnist_vit,
        weights=ZOO_DIR / "fmnist_vit.safetensors",
        retrain="cafa_cli.model.zoo.train_fmnist_vit",
        class_names=tuple(FASHION_MNIST_CLASSES),
        preprocessing=_fashion_mnist_preprocessing(channels=1),
        training_data="fashion-mnist",
    ),
}


def bundled_model(model: str | None) -> BundledModel | None:
    """The bundled model of this name (its weights, class names, preprocessing and training
    data), else None."""
    return BUNDLED.get(model)


def load_bundled(name: str) -> nn.Module:
    """A bundled model with its packaged weights, loaded strictly, in eval mode."""
    if name not in BUNDLED:
        raise UsageError(f"no bundled model {name!r}; choose one of: {', '.join(sorted(BUNDLED))}")
    entry = BUNDLED[name]
    if not entry.weights.is_file():
        raise CafaError(
            f"weights of bundled model {name!r} are missing ({entry.weights}): reinstall "
            f"cafa-cli or run python -m {entry.retrain}"
        )
    return entry.load(entry.weights).eval()
