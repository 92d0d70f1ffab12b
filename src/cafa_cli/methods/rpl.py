"""RPL: robust pseudo-labelling (Rusak et al., "If your data distribution shifts, use
self-learning", TMLR 2022).

Update rule: BatchNorms use the test batch's statistics; for each batch, one optimiser
step on the normalisation affines (γ, β: BatchNorm, LayerNorm and GroupNorm) minimising
the generalised cross-entropy (Zhang & Sabuncu, NeurIPS 2018) of the predictions against
their own hard labels ŷ = argmax logits (no gradient through ŷ):

    L_RPL = (1/N) Σ_n (1 − p_nŷ^q) / q,   p_n = softmax(logits_n),

which tends to the cross-entropy as q → 0 and to the mean absolute error at q = 1; a
wrong pseudo-label's gradient is damped by p_nŷ^q, so noisy labels pull less than under
plain pseudo-labelling (pl). q = 0.8 (`q`), the authors' and the benchmark collection's.

The prediction reported is the forward pass's before the update. Recipes
(recipes/rpl.toml): the collection's configs (mariodoebler/test-time-adaptation
classification/cfgs/*/rpl.yaml): Adam lr 1e-3, batch 200 on CIFAR; SGD with Nesterov
momentum 0.9, lr 5e-4, batch 64 on ImageNet-C.
"""

from __future__ import annotations

import torch

from cafa_cli.engine.method import Method
from cafa_cli.engine.options import Option

Q = 0.8


def generalised_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, q: float = Q) -> torch.Tensor:
    """Each sample's (1 − p_y^q)/q, [N], with p = softmax(logits) and y = `labels` (no gradient)."""
    # p^q as exp(q·log p): finite for a probability that underflows to 0
    log_p = logits.log_softmax(1).gather(1, labels.detach().view(-1, 1)).squeeze(1)
    return (1 - torch.exp(q * log_p)) / q


class Rpl(Method):
    name = "rpl"
    capturable = True  # a CUDA graph may replay its step (base.py)
    predicts_before_update = True
    options = (Option("q", Q, "q of the generalised cross-entropy (1 − p_ŷ^q)/q: toward 0, cross-entropy", "positive"),)

    def loss(self, logits: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return generalised_cross_entropy(logits, logits.detach().argmax(1), self.q).mean()
