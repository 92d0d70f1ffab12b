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


def _fmnist_resnet() -> nn.Module:
    # deferred: the architecture imports torch, which naming the bundled models
    # (`cafa inspect`) does not need
    from cafa_cli.model.zoo.fmnist_resnet import FmnistResNet

    return FmnistResNet()


@dataclass(frozen=True)
class BundledModel:
    build: Callable[[], nn.Module]  # the architecture with random weights
    weights: Path  # safetensors file inside the package
    class_names: tuple[str, ...]
    preprocessing: dict  # keyword arguments of cafa_cli.preprocessing.Preprocessing
    training_data: str  # what cafa bench computes its statistics from when no --train is given


BUNDLED: dict[str, BundledModel] = {
    # a small ResNet (BatchNorm, 64 features) trained on Fashion-MNIST's 28×28 grey images;
    # retrain it with python -m cafa_cli.model.zoo.train_fmnist
    "fmnist-resnet": BundledModel(
        build=_fmnist_resnet,
        weights=ZOO_DIR / "fmnist_resnet.safetensors",
        class_names=tuple(FASHION_MNIST_CLASSES),
        preprocessing={
            "resize": None,
            "crop": None,
            "mean": [FASHION_MNIST_MEAN],
            "std": [FASHION_MNIST_STD],
            "channels": 1,
        },
        training_data="fashion-mnist",
    ),
}


def bundled_model(model: str | None) -> BundledModel | None:
    """The bundled model of this name (its weights, class names, preprocessing and training
    data), else None."""
    return BUNDLED.get(model)


def load_bundled(name: str) -> nn.Module:
    """Build a bundled model, load its packaged weights strictly and put it in eval mode."""
    from safetensors.torch import load_file  # deferred: only needed when a model is loaded

    if name not in BUNDLED:
        raise UsageError(f"no bundled model {name!r}; choose one of: {', '.join(sorted(BUNDLED))}")
    entry = BUNDLED[name]
    if not entry.weights.is_file():
        raise CafaError(
            f"weights of bundled model {name!r} are missing ({entry.weights}): reinstall "
            f"cafa-cli or run python -m cafa_cli.model.zoo.train_fmnist"
        )
    model = entry.build()
    model.load_state_dict(load_file(str(entry.weights)), strict=True)
    return model.eval()
