"""Sharpness-aware minimisation (SAM, Foret et al. 2021) as the entropy methods that use it
step (SAR, SoTTA, STAMP; their authors' sam.py, davda54/sam's first_step and second_step):
the loss's gradient g at θ moves the trained parameters to θ + ε, ε = ρ·g/(‖g‖ + 1e-12)
with ‖g‖ the norm over all of them; a second forward pass there gives the gradient the
optimiser steps with, from θ.

And the modules those authors leave out of the update (their collect_params).
"""

from __future__ import annotations

import torch

from cafa_cli.engine.method import check_module_names, select_parameters
from cafa_cli.engine.options import Option
from cafa_cli.model.features import FeatureClassifier

# the authors' collect_params skips these: a ResNet's layer4, a ViT-Base's blocks 9-11 and final norm
FROZEN = ("layer4", "blocks.9", "blocks.10", "blocks.11", "norm")
FROZEN_OPTION = Option(
    "frozen", FROZEN, "modules left out of the update, by name (whole dotted components); empty: none", "names"
)


def unfrozen_parameters(
    model: FeatureClassifier, which: str, frozen: tuple[str, ...], method: str
) -> list[torch.nn.Parameter]:
    """select_parameters without the `frozen` modules; names other than the defaults are checked
    to hold some module (the defaults name ResNets' and ViTs' modules: a model has some)."""
    if tuple(frozen) != FROZEN:
        check_module_names(model, frozen, f"{method}'s option frozen")
    return select_parameters(model, which, frozen)


def ascend(params: list[torch.nn.Parameter], loss: torch.Tensor, rho: float, saved: list[torch.Tensor]) -> None:
    """θ → θ + ρ·g/(‖g‖ + 1e-12), g = ∇loss over `params`, θ kept in `saved` (same shapes)."""
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
    with torch.no_grad():
        torch._foreach_copy_(saved, params)
        scale = rho / (torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))) + 1e-12)
        torch._foreach_add_(params, torch._foreach_mul(grads, scale))


def descend_from(params: list[torch.nn.Parameter], saved: list[torch.Tensor]):
    """The after_backward of the step at θ + ε: back to θ, where the optimiser steps."""

    def restore():
        with torch.no_grad():
            torch._foreach_copy_(params, saved)

    return restore
