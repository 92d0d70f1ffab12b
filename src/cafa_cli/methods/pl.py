"""PL: pseudo-labelling (Lee, ICML 2013 workshop), a baseline of the CAFA paper.

Update rule: BatchNorms use the test batch's statistics; for each batch, one optimiser
step on the normalisation affines (γ, β) minimising the cross-entropy of the logits
against their own hard predictions, ŷ = argmax logits (no gradient through ŷ):

    L_PL = −(1/N) Σ_n log softmax(logits_n)[ŷ_n]

Defaults, as the CAFA paper's CIFAR runs: Adam, lr 1e-3, batch 200.
"""

from __future__ import annotations

import torch

from cafa_cli.engine.method import Method
from cafa_cli.methods.shared import losses


class PseudoLabel(Method):
    name = "pl"
    capturable = True  # a CUDA graph may replay its step (base.py)
    predicts_before_update = True

    def loss(self, logits: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return losses.pseudo_label(logits)
