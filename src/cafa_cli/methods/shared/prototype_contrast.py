"""Contrast to the source prototypes, the target-alignment term RMT and SANTA share (Döbler et
al., CVPR 2023; Chakrabarty et al., TMLR 2023; the benchmark collection trains it alike).

Each sample's features z, those of its view z̃, and its nearest source prototype μ_k (the
class means; k = argmax_c cos(z, μ_c), no gradient) are the 3N vectors (μ_k1..μ_kN, z_1..z_N,
z̃_1..z̃_N); a projector g (Linear d→p, ReLU, Linear p→p, trained with the model at the same
rate) maps them, normalised, to e_i, and with a_ij = e_i·e_j/τ and P(i) the two other
vectors of the same sample (SupCon, contrast mode `all`):

    L_con = −(1/3N) Σ_i (1/2) Σ_{j∈P(i)} [a_ij − log Σ_{k≠i} exp a_ik]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cafa_cli.engine.options import Option

# the term's options, as both methods declare them (conf.py's CONTRAST defaults)
TEMPERATURE_OPTION = Option("temperature", 0.1, "τ, the contrastive loss's temperature", "positive")
PROJECTION_OPTION = Option(
    "projection_dim", 128, "p, the projector's width (Linear d→p, ReLU, Linear p→p)", "count", most=8192
)
LAMBDA_CONT_OPTION = Option(
    "lambda_cont", 1.0, "λ_cont, the weight of the contrastive loss to the source prototypes", "weight"
)


def projector(feature_dim: int, width: int, device: torch.device) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """g with torch's default initialisation, from its generator (seed it first to repeat a
    run), and a copy of its first weights, which a reset puts back."""
    made = nn.Sequential(nn.Linear(feature_dim, width), nn.ReLU(), nn.Linear(width, width)).to(device)
    return made, {k: v.detach().clone() for k, v in made.state_dict().items()}


def prototype_contrast(
    features: torch.Tensor, viewed: torch.Tensor, prototypes: torch.Tensor, projector: nn.Module, temperature: float
) -> torch.Tensor:
    """L_con (module docstring): each sample, its view and its nearest source prototype are
    the positives of one another, every other of the 3N projected vectors a negative."""
    n = len(features)
    with torch.no_grad():  # the nearest prototype by cosine, on the features themselves (not projected)
        nearest = F.cosine_similarity(features.unsqueeze(1), prototypes.unsqueeze(0), dim=2).argmax(1)
    embedded = F.normalize(projector(torch.cat([prototypes[nearest], features, viewed])), dim=1)
    similarity = embedded @ embedded.T / temperature
    itself = torch.eye(3 * n, dtype=torch.bool, device=features.device)
    log_probability = similarity - torch.logsumexp(similarity.masked_fill(itself, -torch.inf), 1, keepdim=True)
    sample = torch.arange(3 * n, device=features.device) % n
    positive = (sample.unsqueeze(0) == sample.unsqueeze(1)) & ~itself  # the two other views of its sample
    return -(log_probability * positive).sum(1).div(2).mean()
