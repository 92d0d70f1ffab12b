"""EATA's anti-forgetting term (Niu et al., ICML 2022): the diagonal Fisher information of the
parameters at the source weights, from clean source images, and the penalty it weights, for
EATA (methods/eata.py) and SPA's base eata (methods/spa.py)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from cafa_cli.model.features import FeatureClassifier

FISHER_ALPHA = 2000.0  # β, the authors' weight of the penalty


def fisher_information(
    model: FeatureClassifier, params: list[torch.nn.Parameter], batches: Iterable[torch.Tensor], device: torch.device
) -> list[torch.Tensor]:
    """Each parameter's diagonal Fisher information: the mean over `batches` of the squared
    gradient of the batch's cross-entropy against the model's own predictions."""
    fisher = [torch.zeros_like(p) for p in params]
    count = 0
    with torch.inference_mode(False), torch.enable_grad():
        for images in batches:
            logits, _ = model(images.to(device))
            loss = F.cross_entropy(logits, logits.detach().argmax(1))
            for total, grad in zip(fisher, torch.autograd.grad(loss, params)):
                total += grad.square()
            count += 1
    return [total / max(count, 1) for total in fisher]


def fisher_penalty(fisher: list[torch.Tensor], params: list[torch.nn.Parameter], anchor: list[torch.Tensor]):
    """Σ_i F_i (θ_i − θ⁰_i)²: how far the parameters moved from the source's `anchor`, by their Fisher."""
    return sum((f * (p - p0).square()).sum() for f, p, p0 in zip(fisher, params, anchor))
