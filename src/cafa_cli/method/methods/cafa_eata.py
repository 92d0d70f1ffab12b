"""CAFA with EATA's sample selection (`cafa-eata`): the CAFA paper argues that feature
alignment and sample selection are complementary; this row measures it.

Update rule: BatchNorms use the test batch's statistics; for each batch, EATA's filters
(eata.py: entropy below E0 = 0.4·ln C, then not redundant with the moving mean
probability vector, ε = 0.05) choose the kept set S, each kept sample weighted by
w(x) = 1/exp(E(x) − E0) (no gradient), and one step minimises

    L = (1/|S|) Σ_{x∈S} w(x) · log( D_ŷ(z) / Σ_c D_c(z) )

the CAFA term of each kept sample (cafa.py, the class Gaussians of `cafa stats`). No
Fisher term (that is EATA's, and needs source images); no step when S is empty.
Defaults: CAFA's (Adam, lr 1e-3, batch 200) with EATA's E0 and ε.
"""

from __future__ import annotations

import torch
from cafa_cli.method import losses
from cafa_cli.method.methods.cafa import Cafa
from cafa_cli.method.methods.eata import Selection


class CafaEata(Cafa):
    name = "cafa-eata"

    def __init__(self, gaussians, device: torch.device | str = "cpu"):
        super().__init__(gaussians, device)
        self.selection = Selection()

    def loss(self, logits: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        _, weights, kept = self.selection.select(logits)
        self.leave_out = kept == 0
        terms = losses.cafa_terms(self.distances(features), logits.detach().argmax(1))
        return (terms * weights).sum() / kept.clamp_min(1)

    def reset(self) -> None:
        self.selection.reset()
