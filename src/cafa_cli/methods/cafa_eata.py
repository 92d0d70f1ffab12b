"""CAFA with EATA's sample selection (`cafa-eata`): the CAFA paper argues that feature
alignment and sample selection are complementary; this row measures it.

Update rule: BatchNorms use the test batch's statistics; for each batch, EATA's filters
(eata.py: entropy below E0 = 0.4·ln C, then not redundant with the moving mean
probability vector, ε = 0.05) choose the kept set S, each kept sample weighted by
w(x) = 1/exp(E(x) − E0) (no gradient), and one step minimises

    L = (1/|S|) Σ_{x∈S} w(x) · log( D_ŷ(z) / Σ_c D_c(z) )

the CAFA term of each kept sample (cafa.py, the class Gaussians of `cafa stats`). No
Fisher term (that is EATA's, and needs source images); no step when S is empty.
Options: EATA's `entropy_margin` and `redundancy_margin` (eata.py); its recipes are
CAFA's with EATA's margins for the benchmark family (recipes/cafa-eata.toml).
"""

from __future__ import annotations

import torch

from cafa_cli.methods.cafa import Cafa
from cafa_cli.methods.shared import losses
from cafa_cli.methods.shared.selection import SELECTION_OPTIONS, Selection


class CafaEata(Cafa):
    name = "cafa-eata"
    capturable = True  # its loss keeps its state in place (base.py)
    options = SELECTION_OPTIONS
    filters_samples = True
    takes_labels = True  # the oracle replaces ŷ; EATA's selection still reads the model's entropy

    def setup(self) -> None:
        super().setup()
        self.selection = Selection(self.entropy_margin, self.redundancy_margin)

    def loss(self, logits: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        _, weights, kept = self.selection.select(logits)
        self.leave_out = kept == 0
        self.count_kept(kept)
        terms = losses.cafa_terms(self.distances(features), self.class_labels(logits))
        return (terms * weights).sum() / kept.clamp_min(1)

    def reset(self) -> None:
        self.selection.reset()
