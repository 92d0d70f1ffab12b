"""The classes an `adapt` job predicts among (`class_subset`, or the statistics' own subset),
and the artifact's statistics and class moments of those classes only."""

from __future__ import annotations

import torch

from cafa_cli.artifact.store import Artifact
from cafa_cli.core.errors import InputError, UsageError, listing
from cafa_cli.data.subsets import ClassSubset, read_class_subset
from cafa_cli.jobs.config import AdaptConfig


def class_subset(config: AdaptConfig, artifact: Artifact | None, model_classes: list[str] | None) -> ClassSubset | None:
    """The classes predicted among: `class_subset`'s, within the statistics' own subset when
    they are of one; the statistics' subset; or None (every output)."""
    recorded = (
        ClassSubset(artifact.class_names, artifact.outputs, artifact.model_class_names)
        if artifact and artifact.outputs != list(range(len(artifact.model_class_names)))
        else None
    )
    if not config.class_subset:
        return recorded
    if model_classes is None:
        raise UsageError(
            f"`class_subset` {config.class_subset} names classes, and the model's class list is not known; give "
            f"the names of all its outputs in order with `classes` (ImageNet: the sorted wnids, ls train/)"
        )
    return read_class_subset(config.class_subset, model_classes, within=recorded)


def statistics_of(artifact: Artifact | None, subset: ClassSubset | None):
    """The artifact's Gaussians (None without them), of the subset's classes only."""
    if artifact is None or artifact.gaussians is None or subset is None or subset.outputs == artifact.outputs:
        return None if artifact is None else artifact.gaussians
    return artifact.gaussians.select_classes(subset_rows(artifact, subset))


def subset_rows(artifact: Artifact, subset: ClassSubset) -> list[int]:
    """The artifact's row of each of the subset's classes; an error naming those it lacks."""
    where = {output: row for row, output in enumerate(artifact.outputs)}
    missing = [name for name, output in zip(subset.names, subset.outputs) if output not in where]
    if missing:
        raise InputError(f"{artifact.path} holds no statistics of {listing(missing)}; compute them with those classes")
    return [where[output] for output in subset.outputs]


def norm_moments_of(config: AdaptConfig, artifact: Artifact | None, subset: ClassSubset | None) -> dict | None:
    """The class moments of the BatchNorms' inputs, of the subset's classes, for `norm`
    class-balanced (None for the other settings)."""
    if not config.norm.class_balanced or artifact is None:
        return None
    if artifact.norm_moments is None:
        raise InputError(
            f"{artifact.path} holds no class moments of the BatchNorms' inputs, which `norm` class-balanced "
            f"corrects with; re-create it with cafa stats --norm-moments, or choose another `norm`"
        )
    if subset is None or subset.outputs == artifact.outputs:
        return artifact.norm_moments
    rows = torch.as_tensor(subset_rows(artifact, subset))
    return {name: (mean[rows], var[rows]) for name, (mean, var) in artifact.norm_moments.items()}
