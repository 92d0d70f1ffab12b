"""What an `adapt` run does, said before it starts, and what its first batch shows: the
parameters it adapts, a classifier whose outputs do not depend on the image (random or
zeroed head), and test images that enter the model at another size than the statistics'.

The first-batch checks read values from the device once (a host synchronisation), at a
stream's first batch only: the steady-state step never waits (tests/test_host_sync.py).
"""

from __future__ import annotations

import torch

from cafa_cli.data.preprocessing import Preprocessing
from cafa_cli.engine.options import shown


def adapting_line(adapted: dict, method: str) -> str:
    """'adapting 53 tensors (106,496 parameters) in BatchNorm2d', or what a method that
    trains nothing does instead."""
    if adapted["tensors"]:
        layers = adapted["layers"]
        kinds = ", ".join(kind if len(layers) == 1 else f"{kind} ({count})" for kind, count in layers.items())
        return f"adapting {adapted['tensors']} tensors ({adapted['parameters']:,} parameters) in {kinds}"
    norms = adapted["batch_norms"]
    if norms:
        return (
            f"adapting no parameters: `method` {method} normalises with test-batch statistics in {norms} BatchNorm "
            f"layers"
        )
    return f"adapting nothing: `method` {method} predicts with the source model as it is"


def constant_outputs(logits: torch.Tensor) -> bool:
    """Every image of a batch of two or more got the same outputs (within float32 rounding):
    a randomly initialised or zeroed classifier head, or inputs that all look alike."""
    if logits.shape[0] < 2:
        return False
    spread = (logits - logits[:1]).abs().amax()
    return bool(spread <= 1e-6 * (1 + logits.abs().amax()))


def constant_outputs_note(where: str, count: int) -> str:
    return (
        f"{where}: the model gave all {count} images of the first batch the same outputs, so every image gets the same "
        f"prediction, whatever the method (a randomly initialised or zero classifier head?); check `weights` "
        f"(a pretrained head), `classifier` and `model_arg`"
    )


def statistics_input_size(preprocessing: Preprocessing | None, sampling: dict | None) -> tuple[int, int] | None:
    """(height, width) of the images the statistics were computed from, as they entered the
    model: recorded by cafa stats, else the centre crop's square; None when unknown."""
    recorded = (sampling or {}).get("input_size")
    if isinstance(recorded, list) and len(recorded) == 2 and all(type(v) is int for v in recorded):
        return recorded[0], recorded[1]
    if preprocessing is not None and preprocessing.crop is not None:
        return preprocessing.crop, preprocessing.crop
    return None


def size_note(
    where: str, images: torch.Tensor, statistics: tuple[int, int] | None, made: Preprocessing | None
) -> str | None:
    """A warning when the test images enter the model at another size than the statistics'
    (a 64-px test set against statistics at 224 px): the features then differ in kind."""
    size = tuple(images.shape[-2:])
    if statistics is None or size == tuple(statistics):
        return None
    recipe = f" (resize {made.resize or 'none'}, crop {made.crop or 'none'})" if made else ""
    return (
        f"{where}: its images enter the model at {size[1]}x{size[0]} pixels, the statistics' at "
        f"{statistics[1]}x{statistics[0]}{recipe}: the features will not match the statistics; give `resize`/`crop` "
        f"that make them {statistics[1]}x{statistics[0]}, or compute statistics at this size"
    )


def recipe_line(method: str, recorded: dict, trains: bool = True) -> str:
    """'recipe cifar10-c for eata: optimizer adam, lr 0.001, ...; redundancy_margin 0.4, ...':
    the settings the run took, as resolved; those of the optimiser only for a method that
    `trains`. A value the user chose over the recipe's says so, so that it is not read as
    published: 'lr 0.01 (yours; the recipe's 0.001)'."""
    recipe, options = recorded["recipe"], recorded["method_options"]
    published, published_options = recipe.get("settings", {}), recipe.get("options", {})
    keys = ("optimizer", "lr", "momentum", "batch_size", "params") if trains else ("batch_size",)
    # the settings only some recipes set (MEMO's steps and norm, EATA's fisher_samples, RDumb's reset): where one does
    keys += tuple(
        key for key in (("steps",) if trains else ()) + ("norm", "fisher_samples", "reset") if key in published
    )
    # momentum is SGD's: shown where the recipe sets it, or where the user's SGD takes the default
    values = ", ".join(
        _setting(key, recorded[key], published)
        for key in keys
        if recipe.get("origin") is None
        or key in published
        or (key == "momentum" and recorded["optimizer"] != published.get("optimizer", recorded["optimizer"]))
    )
    chosen = "; ".join(
        filter(
            None, [values, ", ".join(_setting(key, value, published_options, shown) for key, value in options.items())]
        )
    )
    if recipe.get("origin") is None:
        why = "`recipe` none" if recipe["requested"] == "none" else "no family for this model's class count"
        return f"no recipe for {method} ({why}): {chosen}"
    name = recipe["name"] or recipe["origin"]
    if recipe.get("chosen_by"):  # how auto chose, so that a family is not taken for the user's choice
        name += f" (auto, from {recipe['chosen_by']})"
    return f"recipe {name} for {method}: {chosen}"


def _setting(key: str, value, published: dict, text=str) -> str:
    said = f"{key} {text(value)}"
    return said if published.get(key, value) == value else f"{said} (yours; the recipe's {text(published[key])})"
