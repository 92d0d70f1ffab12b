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
    # a CLIP model's (openclip:ARCH): how its classes were worded, and a fingerprint of every class's prompts
    templates: str | None = None  # single, imagenet80, or a file's absolute path
    prompts_sha256: str | None = None

    def recorded(self) -> dict:
        """As an artifact's metadata holds it: without the CLIP fields for a model that has none."""
        fields = dict(vars(self))
        for name in CLIP_FIELDS:
            if fields[name] is None:
                del fields[name]
        return fields


CLIP_FIELDS = ("templates", "prompts_sha256")
