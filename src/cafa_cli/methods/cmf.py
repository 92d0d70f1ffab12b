"""CMF: continual momentum filtering (Lee and Chang, "Continual Momentum Filtering on
Parameter Space for Online Test-time Adaptation", ICLR 2024), as the benchmark collection
runs it (mariodoebler/test-time-adaptation classification/methods/cmf.py, ported from the
authors' OpenReview code).

The student θ (the normalisation affines; BatchNorms on the test batch's statistics) takes
one optimiser step a batch on a ROID-style loss, and then a Kalman filter in parameter
space fuses it with a hidden model h, which tracks a source-anchored version of it.

Loss, for a batch of N with p_n = softmax(f_θ(x_n)) and m the moving mean prediction
(m ← μ m + (1 − μ) mean_n p_n after the weights are taken; uniform at the start):

    d_n = 1 − cos(m, p_n),   c_n = −H(p_n),   each min-max normalised over the batch;
    kept: d_n ≥ mean(d);     w_n = exp(d_n c_n / T) on the kept samples (no gradient);
    SLR_n = −Σ_c q_nc log(q_nc / (1 − q_nc) + 1e-5),  q = clamp(p, 0, 0.99);
    L = (1/N) Σ_kept w_n [SLR_n + SCE(f_θ(A(x_n)), f_θ(x_n))],

A a random augmentation of the kept images (one forward pass of them alone, so that its
BatchNorms take their statistics), SCE the symmetric cross-entropy with weight ½ each way
and gradients through both logits, as the collection writes it.

Filter, after each optimiser step (trained values only; P a scalar, 0 at the start;
q = Q · (trained values) / 38,400, the count of a ViT-B/16's LayerNorm affines):

    predict:  h ← α h + (1 − α) θ_source,     P ← α² P + q;
    update:   β = (1 − q) / (P + 1 − q), at least 0.89 and 1 from 0.9999 on;
              P ← β P,   h ← β h + (1 − β) θ        (1 − β: the Kalman gain);
    fuse:     θ ← γ θ + (1 − γ) h.

The prediction reported is the student's forward pass before the step, with ROID's prior
correction: logits · (π + s)/(1 + s C), π the batch's mean prediction and
s = max(1/N, 1/C) / max π (the logits scaled class by class, as the collection does).

Options and their defaults, the collection's conf.py: α 0.99 (`alpha`), γ 0.99
(`gamma`), Q 0.005 (`q`); ROID's T 1/3 (`temperature`), μ 0.9 (`probs_momentum`) and the
three switches `weighting`, `consistency`, `prior_correction` (all on). Without
`weighting` every sample is kept with w = 1. The collection's CMF.TYPE (lp, op) changes
nothing there (both name the same hidden model once the update step has run), so there is
no such option. As its reset does, reset() puts h and m back and keeps P.

Not replayable as a CUDA graph: the augmentation draws random numbers, the kept samples
are chosen on the host (their forward pass has its own size) and P is a Python number.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cafa_cli.engine.method import AdapterSurface, Method
from cafa_cli.engine.options import Option
from cafa_cli.methods.shared import losses
from cafa_cli.methods.shared.augment import augment
from cafa_cli.model.features import FeatureClassifier

ALPHA, GAMMA, Q = 0.99, 0.99, 0.005
TEMPERATURE, PROBS_MOMENTUM = 1 / 3, 0.9
Q_REFERENCE = 38400  # trained values of a ViT-B/16 (25 LayerNorms × 768 × 2), which Q is given for
BETA_FLOOR, BETA_ONE = 0.89, 0.9999  # the collection's bounds on β


def blend(target: list[torch.Tensor], other: list[torch.Tensor], momentum: float) -> None:
    """target ← m·target + (1 − m)·other, in place; nothing at m = 1, as the collection skips it."""
    if momentum < 1.0:
        torch._foreach_mul_(target, momentum)
        torch._foreach_add_(target, torch._foreach_mul(other, 1 - momentum))


class CMF(Method):
    name = "cmf"
    draws_random_numbers = True  # from torch's generator (base.py)
    owns_update = True
    undefined_when = losses.MIN_MAX_UNDEFINED
    options = (
        Option("alpha", ALPHA, "α: the hidden model's pull toward the source, h ← αh + (1 − α)θ_source", "fraction"),
        Option("gamma", GAMMA, "γ: the student's fusion with the hidden model, θ ← γθ + (1 − γ)h", "fraction"),
        Option("q", Q, "Q: the hidden model's process noise, per 38,400 trained values", "weight"),
        Option("temperature", TEMPERATURE, "T: the sample weights' temperature, exp(d·c/T)", "positive"),
        Option("probs_momentum", PROBS_MOMENTUM, "μ: the moving mean prediction's momentum", "fraction"),
        Option(
            "weighting",
            True,
            "weigh samples by certainty and diversity; keep those of at least the mean diversity",
            "flag",
        ),
        Option("consistency", True, "add the symmetric cross-entropy to an augmented view", "flag"),
        Option("prior_correction", True, "scale the reported logits by the batch's smoothed prior", "flag"),
    )
    unsaved = (*Method.unsaved, "params", "source")

    def setup(self) -> None:
        # with the augmented pass on, no run of its authors keeps statistics from batch to batch
        # (ROID's does: devavratTomar/unmixtns runs it with UnMix-TNS, whose every pass moves
        # them); class-balanced's would be left at that pass, the batch's last
        self.running_norms = (
            "no run of its authors keeps statistics across batches, and class-balanced's would be left at its "
            "augmented pass"
            if self.consistency
            else True
        )
        self.source: list[torch.Tensor] = []  # θ_source of the trained values
        self.hidden: list[torch.Tensor] = []  # h
        self.variance = 0.0  # P, the same for every value: a number on the host, no device read
        self.noise = 0.0  # q, Q scaled by the trained count
        self.class_probs: torch.Tensor | None = None  # m

    def attach(self, model: FeatureClassifier) -> None:
        self.source = [p.detach().clone() for p in self.params]
        self.hidden = [p.detach().clone() for p in self.params]
        self.noise = self.q * sum(p.numel() for p in self.params) / Q_REFERENCE
        self.class_probs = torch.full((model.num_classes,), 1 / model.num_classes, device=self.params[0].device)

    def reset(self) -> None:
        """h back to the source and m to uniform; P goes on, as the collection's reset leaves it."""
        if self.hidden:
            torch._foreach_copy_(self.hidden, self.source)
        if self.class_probs is not None:
            self.class_probs.fill_(1 / len(self.class_probs))

    def update(self, adapter: AdapterSurface, images: torch.Tensor, skipped: torch.Tensor | None):
        with adapter.autocast:
            logits, features = adapter.forward(images)
        outputs = logits.float()
        weights, kept, undefined = self.weigh(outputs)
        if skipped is None:  # the batch's first step: a batch is counted once
            self.count_undefined(undefined)
        n = len(images)
        loss = torch.where(kept, losses.soft_likelihood_ratio(outputs) * weights, 0.0).sum() / n
        if self.consistency:
            chosen = kept.nonzero().squeeze(1)  # a host read: the view's forward pass has their number of rows
            if len(chosen):
                views = augment(images[chosen], noise=False, padding="reflection")
                with adapter.autocast:
                    augmented, _ = adapter.forward(views)
                consistency = losses.symmetric_cross_entropy(augmented.float(), outputs[chosen]) * weights[chosen]
                loss = loss + consistency.sum() / n
        flag = adapter.apply(loss, skipped, leave_out=undefined)
        with torch.no_grad():
            self.filter()
        return logits, features, flag

    @torch.no_grad()
    def weigh(self, outputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Each sample's weight w_n and whether it is kept, [N] each, and whether the weights
        are undefined (`undefined_when`: every weight is then 0, for a finite loss whose step
        is left out; None without `weighting`); moves m."""
        probs = outputs.softmax(1)
        if not self.weighting:
            return torch.ones_like(outputs[:, 0]), torch.ones_like(outputs[:, 0], dtype=torch.bool), None
        dissimilarity = 1 - F.cosine_similarity(self.class_probs.unsqueeze(0), probs, dim=1)
        diversity = losses.min_max(dissimilarity)
        kept = ~(diversity < diversity.mean())  # NaN (all alike) keeps them all, as the collection's mask
        certainty = (probs * outputs.log_softmax(1)).sum(1)  # −H(p)
        undefined = losses.alike(dissimilarity, certainty)
        weights = torch.exp(diversity * losses.min_max(certainty) / self.temperature)
        weights = torch.where(kept & ~undefined, weights, 0.0)
        self.class_probs.mul_(self.probs_momentum).add_((1 - self.probs_momentum) * probs.mean(0))
        return weights, kept, undefined

    def filter(self) -> None:
        """The Kalman filter's predict and update steps on h, then θ fused with it."""
        blend(self.hidden, self.source, self.alpha)
        self.variance = self.alpha**2 * self.variance + self.noise
        r = 1 - self.noise
        beta = max(r / (self.variance + r), BETA_FLOOR)
        beta = beta if beta < BETA_ONE else 1.0
        self.variance = beta * self.variance
        blend(self.hidden, [p.detach() for p in self.params], beta)
        blend([p.detach() for p in self.params], self.hidden, self.gamma)

    def output(self, logits: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return logits * losses.smoothed_prior(logits) if self.prior_correction else logits
