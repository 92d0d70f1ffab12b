"""LAME: Laplacian adjusted maximum-likelihood estimation (Boudiaf et al., "Parameter-free
Online Test-time Adaptation", CVPR 2022).

Update rule: the model is not changed (no gradient; BatchNorms keep their source
statistics); only its outputs are. For a batch with source probabilities p_n and
L2-normalised features z_n, an affinity W [N, N] (`affinity`):

- rbf (the default, the official code's): W_nm = exp(−‖z_n − z_m‖² / 2σ²), σ the mean over
  the batch of each sample's distance to its k-th nearest neighbour, itself counted as the
  first (`sigma` auto; or a fixed σ);
- knn: W_nm = 1 when z_m is among the k nearest neighbours of z_n, itself excluded;
- linear: W_nm = z_n·z_m;

made symmetric, W ← (W + Wᵀ)/2, only with `symmetric` (the official default leaves it).
LAME minimises over the assignments Y (rows on the simplex)

    E(Y) = Σ_n [ −Y_nᵀ log p_n + Y_nᵀ log Y_n ] − λ Σ_{n,m} W_nm Y_nᵀ Y_m

by the fixed-point (bound-optimisation) iterations Y_n ← softmax(log p_n + λ Σ_m W_nm Y_m),
from Y = p, stopping when E changes by at most 1e-8·|E| (after the third iteration) or
after `max_steps` iterations. Y is reported (as log Y, whose softmax is Y).

Defaults, as the official code: rbf, k = 5 (`knn`), not symmetric, λ = 1
(`bound_lambda`), 100 iterations, log p = log(p + 1e-10). The stop is found on the device,
after all the iterations have run, so the result is the official one without reading a
value back.
"""

from __future__ import annotations

import torch

from cafa_cli.engine.method import Method
from cafa_cli.engine.options import Option
from cafa_cli.methods.shared.laplacian import AFFINITIES, KNN, LAMBDA, MAX_STEPS, corrected_logits


class Lame(Method):
    name = "lame"
    capturable = True  # it keeps nothing from batch to batch (base.py)
    adapts_normalisation = False
    trains = False
    options = (
        Option("affinity", "rbf", "the affinity of the batch's features", "choice", AFFINITIES),
        Option(
            "knn", KNN, "k: rbf's σ is the mean distance to the k-th neighbour; knn's neighbours", "count", most=1024
        ),
        Option("sigma", "auto", "rbf's σ: auto (from knn, as the official code), or a fixed one", "positive_or_auto"),
        Option("symmetric", False, "make the affinity symmetric, (W + Wᵀ)/2", "flag"),
        Option("bound_lambda", LAMBDA, "λ, the weight of the Laplacian term", "weight"),
        Option("max_steps", MAX_STEPS, "the most fixed-point iterations a batch", "count", most=10_000),
    )

    def output(self, logits: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return corrected_logits(
            logits, features, self.bound_lambda, self.affinity, self.knn, self.sigma, self.symmetric, self.max_steps
        )
