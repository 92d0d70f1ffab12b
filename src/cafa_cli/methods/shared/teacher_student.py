"""What the teacher-student methods (CoTTA, RoTTA) share: the soft cross-entropy against
the teacher, frozen copies of the model, the teacher's moving average."""

from __future__ import annotations

import copy

import torch

from cafa_cli.model.features import FeatureClassifier


def soft_cross_entropy(student_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Each sample's −Σ_c softmax(target)_c log softmax(student)_c, [N]; the target carries no gradient."""
    return -(target_logits.detach().softmax(1) * student_logits.log_softmax(1)).sum(1)


def frozen_copy(model: FeatureClassifier) -> FeatureClassifier:
    """A copy of `model` (its normalisation layers as they are) that takes no gradient."""
    twin = copy.deepcopy(model)
    twin.requires_grad_(False)
    return twin


def names_of(model: FeatureClassifier, params: list[torch.nn.Parameter]) -> list[str]:
    """The names of `params` in `model`, in the model's order: what `named` finds them by in a copy."""
    chosen = {id(p) for p in params}
    return [name for name, p in model.named_parameters() if id(p) in chosen]


def named(model: FeatureClassifier, names: list[str]) -> list[torch.nn.Parameter]:
    """The parameters of `model` called `names`, in that order (the student's trained
    ones, found in a copy of it)."""
    own = dict(model.named_parameters())
    return [own[name] for name in names]


def follow(teacher: list[torch.Tensor], student: list[torch.Tensor], momentum: float) -> None:
    """The teacher's moving average, in place: θ' ← m θ' + (1 − m) θ."""
    with torch.no_grad():
        torch._foreach_mul_(teacher, momentum)
        torch._foreach_add_(teacher, [p.detach() for p in student], alpha=1 - momentum)
