"""TENT: test entropy minimisation (Wang et al., ICLR 2021).

Update rule: BatchNorms use the test batch's statistics; for each batch, one optimiser
step on the normalisation affines (γ, β) minimising the mean entropy of the predictions,

    L_TENT = (1/N) Σ_n −Σ_c p_nc log p_nc,   p_n = softmax(logits_n)

Defaults, as the CAFA paper's CIFAR runs: Adam, lr 1e-3, batch 200 (ImageNet-C: SGD,
lr 0.00025, batch 64; TENT's own code takes Nesterov momentum 0.9, `optimizer` nesterov).
TENT is known to collapse over long continual streams: reset to the source weights
between domains.

Option `entropy`: shannon (TENT's), or come, COME's entropy of opinion in place of it
(shared/losses.py: come_entropies), which ETA, EATA and SAR take too.
"""

from __future__ import annotations

import torch

from cafa_cli.engine.method import Method
from cafa_cli.methods.shared import losses


class Tent(Method):
    name = "tent"
    capturable = True  # a CUDA graph may replay its step (base.py)
    predicts_before_update = True
    options = (losses.ENTROPY,)

    def loss(self, logits: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return losses.ENTROPIES[self.entropy](logits).mean()
