"""cafa-robust as docs/design/cafa-robust.md writes it: dense, float64, read top to bottom.

This is the definition of what methods/cafa_robust.py computes in float32 over a whole
network (tests/test_cafa_robust.py checks one against the other). The class distances D
and the CAFA term are reference.py's; the memory bank (which samples a step trains on) is
RoTTA's CSTU, memory_bank.py, and not repeated here. Notation: a BatchNorm's input x
[N, channels, ...], its global statistics (μ_g, σ²_g), C classes.
"""

import math

import torch

from cafa_cli.methods import reference
from cafa_cli.methods.shared import laplacian

SKEW_START, SKEW_FULL = (
    0.25,
    0.65,
)  # the class-balanced correction's (class_balanced.py): where the skew starts to count, and counts fully


def iid_distance(classes: int, n: int) -> float:
    """E[TV] of the label histogram of n labels drawn uniformly from C classes: the skew an
    i.i.d. batch shows from sampling alone, ½·C·Σ_k P(X = k)·|k/n − 1/C|, X ~ Bin(n, 1/C)."""
    p = 1 / classes
    return 0.5 * classes * sum(math.comb(n, k) * p**k * (1 - p) ** (n - k) * abs(k / n - p) for k in range(n + 1))


def skew(probabilities: torch.Tensor, typical: torch.Tensor | None = None) -> torch.Tensor:
    """s ∈ [0, 1] of a batch from its predicted probabilities [n, C]: the total-variation
    distance of their mean from uniform (or from `typical`, the stream's typical class mix
    m_{t−1}), as a share of the way from what an i.i.d. batch of n shows to a batch of one
    class, mapped linearly from 0 at SKEW_START to 1 at SKEW_FULL."""
    n, c = probabilities.shape
    h = probabilities.double().mean(0)
    distance = 0.5 * (h - (1 / c if typical is None else typical.double())).abs().sum()
    noise = iid_distance(c, n)
    relative = (distance - noise) / max(1 - 1 / c - noise, 1e-6)
    return ((relative - SKEW_START) / (SKEW_FULL - SKEW_START)).clamp(0, 1)


def typical_mixes(mixes: list[torch.Tensor], reference: float, window: int) -> list[torch.Tensor]:
    """m_0 … m_T, the typical class mix from the gate's mean softmax h_t of each batch: m_0
    uniform, m_t = m_{t−1} + (h_t − m_{t−1}) / min(t + B, W); batch t is compared with m_{t−1}."""
    typical = [torch.full_like(mixes[0], 1 / mixes[0].numel(), dtype=torch.float64)]
    for t, h in enumerate(mixes, start=1):
        typical.append(typical[-1] + (h.double() - typical[-1]) / min(t + reference, window))
    return typical


def few_classes(global_logits: torch.Tensor, own_logits: torch.Tensor, rise: float) -> torch.Tensor:
    """How surely a batch the gate reads as skewed holds few classes, which scales its skew
    (`entropy_rise` a > 0): clamp((ΔH − a)/a, 0, 1), ΔH the rise in the mean entropy of its
    predictions (reference.entropy, in nats) from the gate's pass (global statistics) to a pass
    with its own statistics."""
    gain = reference.entropy(own_logits) - reference.entropy(global_logits)
    return ((gain - rise) / rise).clamp(0, 1)


def batch_share(n: int, s: torch.Tensor | float, prior: float, power: float) -> torch.Tensor:
    """ρ = n_eff / (n_eff + N₀) with n_eff = n·(1 − s)^p: the batch's share of the statistics."""
    n_eff = n * (1 - torch.as_tensor(s, dtype=torch.float64)) ** power
    return n_eff / (n_eff + prior)


def batch_statistics(x: torch.Tensor, weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per channel, the biased mean and variance of the samples weighted 1 (all, without weights)."""
    x = x.double().transpose(0, 1).reshape(x.shape[1], len(x), -1)  # [channels, N, positions]
    if weights is not None:
        x = x[:, weights.bool()]
    x = x.flatten(1)
    return x.mean(1), x.var(1, unbiased=False)


def shared_statistics(
    x: torch.Tensor, global_mean: torch.Tensor, global_var: torch.Tensor, share, weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """μ = (1 − ρ)μ_g + ρ μ_B and σ² = (1 − ρ)σ²_g + ρ σ²_B."""
    mean, var = batch_statistics(x, weights)
    share = torch.as_tensor(share, dtype=torch.float64)
    return (1 - share) * global_mean.double() + share * mean, (1 - share) * global_var.double() + share * var


def normalise(
    x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    """γ (x − μ) / √(σ² + ε) + β, per channel."""
    shape = [1, -1] + [1] * (x.dim() - 2)
    return (x.double() - mean.view(shape)) / (var.view(shape) + eps).sqrt() * weight.double().view(
        shape
    ) + bias.double().view(shape)


def moved(global_statistic: torch.Tensor, bank_statistic: torch.Tensor, momentum: float) -> torch.Tensor:
    """The global statistic after a step on the bank: (1 − α)·global + α·the bank's."""
    return (1 - momentum) * global_statistic.double() + momentum * bank_statistic.double()


def pulled(parameter: torch.Tensor, source: torch.Tensor, beta: float) -> torch.Tensor:
    """A trained parameter after a step on the bank: θ ← (1 − β)θ + βθ⁰ (ROID's weight ensembling)."""
    return (1 - beta) * parameter.double() + beta * source.double()


def variance_jump(before: torch.Tensor, now: torch.Tensor, eps: float) -> torch.Tensor:
    """The change detector's statistic between two windows of a layer's input [N, channels, ...]:
    the mean over channels of ln²((σ²_now + ε) / (σ²_before + ε)), σ² each window's biased
    variance. Above τ, the statistics return to the source's and the bank empties."""
    _, var_before = batch_statistics(before)
    _, var_now = batch_statistics(now)
    return ((var_now + eps) / (var_before + eps)).log().square().mean()


def reported(
    logits: torch.Tensor, features: torch.Tensor, s: torch.Tensor | float, weight: float, power: float
) -> torch.Tensor:
    """What a batch is reported as, from its logits and features (the pass with its share ρ)
    and the gate's skew s: the logits when λ = λ₀·s^q is 0, else LAME's correction at that λ
    (laplacian.corrected_logits, LAME's definition, checked against its authors' code in
    tests/test_fidelity.py), here in float64."""
    strength = weight * float(s) ** power
    if strength == 0:
        return logits.double()
    return laplacian.corrected_logits(logits.double(), features.double(), strength)


def timeliness(ages: torch.Tensor) -> torch.Tensor:
    """RoTTA's w(A) = exp(−A)/(1 + exp(−A)) of each age A = age/K."""
    return 1 / (1 + torch.exp(ages.double()))


def bank_loss(
    z: torch.Tensor,
    logits: torch.Tensor,
    means: torch.Tensor,
    sigmas: torch.Tensor,
    ages: torch.Tensor,
    filled: torch.Tensor,
) -> torch.Tensor:
    """L = Σ_m w(A_m) · log( D_ŷm(z_m) / Σ_c D_c(z_m) ) / M over the M filled slots of the bank
    (features z and logits of one pass over it, ŷ = argmax of those logits)."""
    distances = reference.mahalanobis(z, means, sigmas)
    own = distances.gather(1, reference.pseudo_labels(logits)[:, None]).squeeze(1)
    terms = (own / distances.sum(1)).log()
    weights = timeliness(ages) * filled.double()
    return (weights * terms).sum() / filled.double().sum()
