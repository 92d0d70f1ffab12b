"""What an artifact records of its model, torch-free: `cafa inspect` reads it without
importing torch (model/loading.py builds the model it names)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    """What the artifact records so that `adapt` can rebuild the exact model."""

    model: str
    weights: str | None = (
        None  # absolute path, or pretrained weights by name (ResNet50_Weights.IMAGENET1K_V2, a timm tag)
    )
    weights_sha256: str | None = None
    num_classes: int | None = None
    classifier: str | None = None
    model_args: dict[str, str] | None = None  # the constructor's or factory's keyword arguments: name -> repr(value)
