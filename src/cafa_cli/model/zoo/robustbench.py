"""RobustBench's corruption-benchmark models by name: `--model robustbench:DATASET/NAME`.

The architectures are defined here, with the parameter names and shapes of RobustBench's
checkpoints (robustbench/model_zoo/architectures/wide_resnet.py and resnext.py, and
torchvision's ResNet-50 for ImageNet), so that its `.pt` files load key for key without
the robustbench package (docs/design/decisions.md says why). Checkpoints are read from `--weights`
or from the folder RobustBench's `load_model` saves them in, `models/<dataset>/corruptions/
<name>.pt` under the working directory; nothing is downloaded.

Where RobustBench normalises inside the network (`mu`/`sigma` buffers in the CIFAR AugMix
nets, an `ImageNormalizer` in front of every ImageNet net), that constant normalisation is
this model's preprocessing (`mean`/`std`) instead, as for every other model of cafa: the
checkpoint files do not hold those buffers (RobustBench loads these nets non-strictly for
that reason), and a `--mean` given by the user then replaces the model's rather than being
applied on top of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from cafa_cli.core.errors import InputError, UsageError
from cafa_cli.data.preprocessing import IMAGENET_MEAN, IMAGENET_STD

PREFIX = "robustbench:"
THREAT_MODEL = "corruptions"  # RobustBench's folder for the common-corruption models
DATASETS = ("cifar10", "cifar100", "imagenet")
# RobustBench's data folder (data_dir='./data') holds CIFAR's python version, which the CIFAR
# models were trained on, beside CIFAR-10-C and CIFAR-100-C: ./data/cifar-10-batches-py, ./data/CIFAR-10-C
TRAINING_FOLDERS = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}


# --- architectures ----------------------------------------------------------------


def _conv3x3(inputs: int, outputs: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(inputs, outputs, 3, stride, padding=1, bias=False)


class PreActBlock(nn.Module):
    """A pre-activation residual block of the TRADES WideResNet: BN-ReLU-conv3x3 twice.
    When the width changes, the shortcut is a 1x1 conv (`convShortcut`) of the *activated*
    input; otherwise the raw input is added."""

    def __init__(self, inputs: int, outputs: int, stride: int):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(inputs)
        self.conv1 = _conv3x3(inputs, outputs, stride)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.conv2 = _conv3x3(outputs, outputs)
        # the checkpoints have this key only in the blocks that change the width
        self.convShortcut = nn.Conv2d(inputs, outputs, 1, stride, bias=False) if inputs != outputs else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        activated = F.relu(self.bn1(x))
        shortcut = x if self.convShortcut is None else self.convShortcut(activated)
        return shortcut + self.conv2(F.relu(self.bn2(self.conv1(activated))))


class WideStage(nn.Module):
    """`blocks` PreActBlocks, the first one strided; held as `.layer` (`block1.layer.0.bn1`)."""

    def __init__(self, blocks: int, inputs: int, outputs: int, stride: int):
        super().__init__()
        self.layer = nn.Sequential(
            *(PreActBlock(inputs if i == 0 else outputs, outputs, stride if i == 0 else 1) for i in range(blocks))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


class WideResNet(nn.Module):
    """WRN-depth-widen for 32x32 images (Zagoruyko & Komodakis), as RobustBench's CIFAR
    models lay it out: conv1, block1-3 (16·k, 32·k, 64·k channels), a final BN (`bn1`)
    and ReLU, global average pooling, `fc`."""

    def __init__(self, depth: int, widen: int, num_classes: int):
        super().__init__()
        if (depth - 4) % 6:
            raise ValueError(f"a WideResNet's depth is 6n+4, not {depth}")
        blocks = (depth - 4) // 6
        widths = (16, 16 * widen, 32 * widen, 64 * widen)
        self.conv1 = _conv3x3(3, widths[0])
        self.block1 = WideStage(blocks, widths[0], widths[1], 1)
        self.block2 = WideStage(blocks, widths[1], widths[2], 2)
        self.block3 = WideStage(blocks, widths[2], widths[3], 2)
        self.bn1 = nn.BatchNorm2d(widths[3])
        self.fc = nn.Linear(widths[3], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block3(self.block2(self.block1(self.conv1(x))))
        # RobustBench pools with an 8x8 window, which at the 32-px input is this global mean
        return self.fc(F.relu(self.bn1(out)).mean(dim=(2, 3)))


class ResNeXtBlock(nn.Module):
    """ResNeXt's bottleneck (type C): 1x1 reduce, grouped 3x3, 1x1 expand to 4·planes."""

    def __init__(self, inputs: int, planes: int, cardinality: int, base_width: int, stride: int):
        super().__init__()
        inner = cardinality * (planes * base_width // 64)
        self.conv_reduce = nn.Conv2d(inputs, inner, 1, bias=False)
        self.bn_reduce = nn.BatchNorm2d(inner)
        self.conv_conv = nn.Conv2d(inner, inner, 3, stride, padding=1, groups=cardinality, bias=False)
        self.bn = nn.BatchNorm2d(inner)
        self.conv_expand = nn.Conv2d(inner, 4 * planes, 1, bias=False)
        self.bn_expand = nn.BatchNorm2d(4 * planes)
        self.downsample: nn.Sequential | None = None
        if stride != 1 or inputs != 4 * planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(inputs, 4 * planes, 1, stride, bias=False), nn.BatchNorm2d(4 * planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn_reduce(self.conv_reduce(x)))
        out = F.relu(self.bn(self.conv_conv(out)))
        out = self.bn_expand(self.conv_expand(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class CifarResNeXt(nn.Module):
    """ResNeXt-depth for 32x32 images, as AugMix trained it and RobustBench lays it out:
    conv_1_3x3 + bn_1, stage_1-3 of (depth-2)/9 blocks on 64, 128, 256 planes, global
    average pooling, `classifier` on 1024 features."""

    def __init__(self, depth: int, cardinality: int, base_width: int, num_classes: int):
        super().__init__()
        if (depth - 2) % 9:
            raise ValueError(f"a CIFAR ResNeXt's depth is 9n+2, not {depth}")
        blocks = (depth - 2) // 9
        self.conv_1_3x3 = _conv3x3(3, 64)
        self.bn_1 = nn.BatchNorm2d(64)
        inputs, stages = 64, []
        for planes, stride in ((64, 1), (128, 2), (256, 2)):
            stages.append(
                nn.Sequential(
                    *(
                        ResNeXtBlock(
                            inputs if i == 0 else 4 * planes, planes, cardinality, base_width, stride if i == 0 else 1
                        )
                        for i in range(blocks)
                    )
                )
            )
            inputs = 4 * planes
        self.stage_1, self.stage_2, self.stage_3 = stages
        self.classifier = nn.Linear(inputs, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn_1(self.conv_1_3x3(x)))
        out = self.stage_3(self.stage_2(self.stage_1(out)))
        return self.classifier(out.mean(dim=(2, 3)))  # RobustBench's 8x8 average pool at 32 px


def _resnet50() -> nn.Module:
    import torchvision  # deferred: importing it takes seconds

    return torchvision.models.resnet50(weights=None)


# --- the models by name ----------------------------------------------------------------

# RobustBench feeds CIFAR nets 32x32 images scaled to [0, 1] (ToTensor only) and ImageNet
# nets Resize(256) + CenterCrop(224) (its 'Res256Crop224', bilinear); mean/std are what the
# net would do inside (nothing, 0.5/0.5, or ImageNet's ImageNormalizer)
CIFAR_RAW = {"resize": 32, "crop": 32, "mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0), "channels": 3}
CIFAR_HALF = {**CIFAR_RAW, "mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5)}
IMAGENET = {
    "resize": 256,
    "crop": 224,
    "mean": IMAGENET_MEAN,
    "std": IMAGENET_STD,
    "channels": 3,
    "interpolation": "bilinear",
}


@dataclass(frozen=True)
class RobustBenchModel:
    dataset: str  # RobustBench's: cifar10, cifar100, imagenet
    name: str  # its model id in the corruptions table (Standard, Hendrycks2020AugMix_WRN, ...)
    architecture: str
    build: Callable[[], nn.Module]  # the architecture with random weights
    preprocessing: dict  # keyword arguments of cafa_cli.data.preprocessing.Preprocessing
    # Standard_R50 is torchvision's ResNet-50 weights, which RobustBench loads through
    # torchvision (resnet50(pretrained=True)), not from a file of its own
    torchvision_weights: str | None = None

    @property
    def model(self) -> str:
        return f"{PREFIX}{self.dataset}/{self.name}"

    def default_weights(self) -> Path:
        """Where RobustBench's load_model keeps the checkpoint (model_dir='./models')."""
        if self.torchvision_weights:
            import torchvision

            member = torchvision.models.get_weight(self.torchvision_weights)
            return Path(torch.hub.get_dir()) / "checkpoints" / Path(member.url).name
        return Path("models") / self.dataset / THREAT_MODEL / f"{self.name}.pt"


def _entries() -> list[RobustBenchModel]:
    models = []
    for dataset, classes in (("cifar10", 10), ("cifar100", 100)):
        models += [
            RobustBenchModel(
                dataset,
                "Hendrycks2020AugMix_WRN",
                "WideResNet-40-2",
                lambda classes=classes: WideResNet(40, 2, classes),
                CIFAR_HALF,
            ),
            RobustBenchModel(
                dataset,
                "Hendrycks2020AugMix_ResNeXt",
                "ResNeXt-29 (cardinality 4, base width 32)",
                lambda classes=classes: CifarResNeXt(29, 4, 32, classes),
                CIFAR_HALF,
            ),
        ]
    models.append(
        RobustBenchModel("cifar10", "Standard", "WideResNet-28-10", lambda: WideResNet(28, 10, 10), CIFAR_RAW)
    )
    models += [
        RobustBenchModel("imagenet", name, "ResNet-50 (torchvision)", _resnet50, IMAGENET)
        for name in ("Hendrycks2020AugMix", "Hendrycks2020Many")
    ]
    models.append(
        RobustBenchModel(
            "imagenet",
            "Standard_R50",
            "ResNet-50 (torchvision)",
            _resnet50,
            IMAGENET,
            torchvision_weights="ResNet50_Weights.IMAGENET1K_V1",
        )
    )
    return models


MODELS: dict[str, RobustBenchModel] = {entry.model: entry for entry in _entries()}


def is_robustbench(model: str | None) -> bool:
    return bool(model) and model.startswith(PREFIX)


def lookup(model: str) -> RobustBenchModel:
    """The model `robustbench:DATASET/NAME` names, or a UsageError that says what exists."""
    if model in MODELS:
        return MODELS[model]
    dataset, slash, name = model[len(PREFIX) :].partition("/")
    if not slash or dataset not in DATASETS:
        raise UsageError(
            f"`model` {model}: give robustbench:DATASET/NAME with DATASET one of {', '.join(DATASETS)} "
            f"(robustbench:cifar10/Standard)"
        )
    names = [entry.name for entry in MODELS.values() if entry.dataset == dataset]
    close = [f"robustbench:{dataset}/{n}" for n in names if n.lower() == name.lower()]
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise UsageError(
        f"`model` {model}: cafa defines no such RobustBench {dataset} corruptions model{hint}; it has "
        f"{', '.join(names)}; for another, write a factory file that builds it"
    )


def build(model: str, model_args: dict | None) -> nn.Module:
    """The architecture of `model` with random weights; RobustBench's nets take no arguments."""
    entry = lookup(model)
    if model_args:
        raise UsageError(f"`model` {model} is built as RobustBench defines it; it takes no `model_arg`")
    return entry.build()


def weights_file(model: str, weights: str | None) -> str:
    """The checkpoint to read: `weights`, else RobustBench's own file, which must exist (a
    `weights` given is checked where any weights file is)."""
    entry = lookup(model)
    if weights is not None:
        return weights
    path = entry.default_weights()
    if not path.is_file():
        if entry.torchvision_weights:
            weights = entry.torchvision_weights
            fetch = f"python -c \"import torchvision; torchvision.models.get_weight('{weights}').get_state_dict()\""
        else:
            fetch = (
                f"python -c \"from robustbench.utils import load_model; load_model('{entry.name}', "
                f"dataset='{entry.dataset}', "
                f"threat_model='{THREAT_MODEL}')\""
            )
        where = (
            "" if path.is_absolute() else f" ({path.resolve()})"
        )  # RobustBench's folder is relative to the working one
        raise InputError(
            f"`model` {model}: its checkpoint {path} is not there{where}; cafa downloads nothing: "
            f"fetch it where there is a network ({fetch}) and copy it there, or give `weights` FILE"
        )
    return str(path)


def training_set_beside(model: str, data: list[str]) -> tuple[str | None, Path | None]:
    """A RobustBench CIFAR model's training set where RobustBench's layout keeps it, beside
    its corruption benchmark among `data` (cifar10-c:data/CIFAR-10-C → cifar10:data):
    (that `data` value, None) when its folder is there, (None, the folder looked for) when
    not, (None, None) where no place is implied (ImageNet, no such benchmark, ROOTs in
    several folders)."""
    from cafa_cli.data.benchmarks import benchmark_of

    dataset = lookup(model).dataset
    if dataset not in TRAINING_FOLDERS:
        return None, None
    roots = [root for kind, root in filter(None, map(benchmark_of, data)) if kind == f"{dataset}-c"]
    # a ROOT, or one corruption of it (ROOT/fog.npy, ROOT/fog)
    places = {(root if root.is_dir() else root.parent).parent for root in roots}
    if len(places) != 1:
        return None, None
    place = places.pop()
    folder = place / TRAINING_FOLDERS[dataset]
    return (f"{dataset}:{place}", None) if folder.is_dir() else (None, folder)


# the buffers by which RobustBench's own nets normalise their input: the AugMix CIFAR nets'
# mu/sigma, and the ImageNormalizer RobustBench puts in front of ImageNet nets
NORMALISERS = {"mu": "mean", "sigma": "std", "normalize.mean": "mean", "normalize.std": "std"}


def checkpoint_state(model: str, state: dict[str, torch.Tensor], path: str) -> dict[str, torch.Tensor]:
    """A RobustBench checkpoint (already unwrapped from 'state_dict' and 'module.') as the
    architecture here names it: without the `model.` that RobustBench's normalising wrapper
    puts before an ImageNet net's keys, and without the normalisation buffers, which must
    hold this model's mean and std (they are its preprocessing here)."""
    entry = lookup(model)
    state = dict(state)
    for key, part in NORMALISERS.items():
        if key not in state:
            continue
        found = state.pop(key).flatten().tolist()
        expected = [float(v) for v in entry.preprocessing[part]]
        if len(found) != len(expected) or any(abs(a - b) > 1e-6 for a, b in zip(found, expected)):
            raise InputError(
                f"`weights` {path}: its {key} is {[round(v, 4) for v in found]}, not the "
                f"{[round(v, 4) for v in expected]} of RobustBench's {entry.name}: not this model's checkpoint; "
                f"check `model`"
            )
    if state and all(key.startswith("model.") for key in state):
        state = {key[len("model.") :]: value for key, value in state.items()}
    return state
