"""Sample selection and weighting by entropy and redundancy (EATA's, Niu et al., ICML
2022), kept on the device, for any method that adapts on a chosen share of each batch:
EATA and ETA (methods/eata.py) and CAFA-EATA (methods/cafa_eata.py)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from cafa_cli.engine.options import Option
from cafa_cli.methods.shared import losses

MARGIN = 0.4  # E0 = MARGIN · ln C
REDUNDANCY = 0.05  # ε: a sample whose probabilities are this close (cosine) to the moving mean is redundant
MOMENTUM = 0.9  # of the moving mean probability vector

SELECTION_OPTIONS = (
    Option(
        "entropy_margin", MARGIN, "E0 as a share of ln C: a sample is reliable when its entropy is below E0", "positive"
    ),
    Option(
        "redundancy_margin",
        REDUNDANCY,
        "ε: a sample is redundant when the cosine of its probabilities and their moving mean is ε or more",
        "weight",
    ),
)


class Selection:
    """EATA's sample selection and weighting, kept on the device: `select(logits)` gives
    each sample's entropy (with its gradient; Shannon's, or that `entropies` computes: COME's),
    its weight 1/exp(E − E0) where kept and 0 where not (no gradient), and how many were kept
    (a device scalar). The redundancy filter compares softmax probabilities whatever the entropy."""

    def __init__(self, margin: float = MARGIN, redundancy: float = REDUNDANCY):
        self.margin, self.redundancy = margin, redundancy
        self.reset()

    def reset(self) -> None:
        self.mean_probs: torch.Tensor | None = None  # m, made on the first batch's device
        self.started: torch.Tensor | None = None  # whether m holds a mean yet

    def select(
        self, logits: torch.Tensor, entropies=losses.entropies
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        e0 = self.margin * math.log(logits.shape[1])
        entropy = entropies(logits)
        with torch.no_grad():
            probs = logits.detach().softmax(1)
            if self.mean_probs is None:
                self.mean_probs = torch.zeros(logits.shape[1], device=logits.device)
                self.started = torch.zeros((), dtype=torch.bool, device=logits.device)
            similarity = F.cosine_similarity(self.mean_probs.unsqueeze(0), probs, dim=1)
            keep = (entropy.detach() < e0) & ((similarity.abs() < self.redundancy) | ~self.started)
            kept = keep.sum()
            batch_mean = (probs * keep.unsqueeze(1)).sum(0) / kept.clamp_min(1)
            moved = torch.where(self.started, MOMENTUM * self.mean_probs + (1 - MOMENTUM) * batch_mean, batch_mean)
            # in place: a replayed step (step_graph.py) reads and writes the same tensors
            self.mean_probs.copy_(torch.where(kept > 0, moved, self.mean_probs))
            self.started.logical_or_(kept > 0)
            weights = keep * torch.exp(-(entropy.detach() - e0))
        return entropy, weights, kept
