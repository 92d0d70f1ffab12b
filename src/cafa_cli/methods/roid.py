"""ROID: universal test-time adaptation through weight ensembling, diversity weighting and
prior correction (Marsden, Döbler and Yang, "Universal Test-time Adaptation through Weight
Ensembling, Diversity Weighting, and Prior Correction", WACV 2024).

Update rule: BatchNorms use the test batch's statistics and the normalisation affines θ
train. For each batch x of N samples, with logits z = f_θ(x), p = softmax(z) and m the
moving average of the batch-mean prediction (m₀ = 1/C, uniform):

1. weights (no gradient), from min-max-normalised scores over the batch, norm(s) =
   (s − min s)/(max s − min s):
       diversity  d = norm(1 − cos(m, p_n)),   certainty  c = norm(−H(p_n)),
       w_n = exp(d_n c_n / T)  where d_n ≥ mean(d),  w_n = 0 where d_n < mean(d);
   then m ← μ m + (1 − μ) mean_n p_n over the whole batch;
2. the soft likelihood ratio loss, with p̃ = clamp(p, max 0.99):
       L_SLR = (1/N) Σ_n w_n · −Σ_c p̃_nc log(p̃_nc / (1 − p̃_nc) + 1e-5);
3. consistency: the kept samples (w_n > 0 by 1.) through the model again as one random
   view each (methods/shared/augment.py), x̂, normalised with the statistics of that batch of views:
       L_CON = (1/N) Σ_kept w_n · SCE(f_θ(x̂_n), z_n),
       SCE(a, b) = −½ Σ_c softmax(b)_c log softmax(a)_c − ½ Σ_c softmax(a)_c log softmax(b)_c,
   the gradient through both a and b;
4. one optimiser step on L_SLR + L_CON, then weight ensembling toward the source weights
   θ⁰ (which the model started from): θ ← α θ + (1 − α) θ⁰;
5. prior correction of the prediction reported (the step's forward pass, before its update),
   with the batch prior π = mean_n p_n and s = max(1/N, 1/C) / max_c π_c:
       z ← z ⊙ (π + s) / (1 + s·C)   (output()).

Options and their defaults, the benchmark collection's (conf.py's ROID section, which no
roid.yaml overrides): `weighting`, `consistency` and `prior_correction` on, α = 0.99
(`source_momentum`), μ = 0.9 (`probs_momentum`), T = 1/3 (`temperature`). The recipes
(recipes/roid.toml) hold the optimiser, rate and batch size.

As the authors' code (mariodoebler/test-time-adaptation classification/methods/roid.py):
step 5 multiplies the logits by the smoothed prior, not the probabilities (the paper writes
it on probabilities), and the reported prediction is that product; step 3's views are of the
kept samples alone, so the views' batch statistics are theirs. Deviations: the sums of 2. and
3. are divided by the batch's size, where theirs divide by the configured batch size (the
same but for a short last batch); the views are drawn per image (theirs: one draw a batch)
by augment(noise=False, padding="reflection"), on normalised values and without hue and
gamma (augment.py says why); without `weighting` every sample counts with w_n = 1 in both
sums (their code needs it for `consistency`). Steps 1-4 repeat for each of the Adapter's
`steps`, as theirs do; 5 is applied once, to the last step's prediction.

Cost: two forward passes (the second of the kept samples, typically about half the batch)
and one backward pass through both: about 1.5x TENT's step on the CPU. Selecting the kept
samples for the second pass reads their indices from the device once a step, so a step is
not replayable as a CUDA graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cafa_cli.engine.method import AdapterSurface, Method
from cafa_cli.engine.options import Option
from cafa_cli.methods.shared import losses
from cafa_cli.methods.shared.augment import augment
from cafa_cli.methods.shared.teacher_student import follow
from cafa_cli.model.features import FeatureClassifier

SOURCE_MOMENTUM = 0.99  # α, of the weight ensemble
PROBS_MOMENTUM = 0.9  # μ, of the moving mean prediction
TEMPERATURE = 1 / 3  # T


class Roid(Method):
    name = "roid"
    draws_random_numbers = True  # from torch's generator (base.py)
    owns_update = True  # a second forward pass (the views) and the ensembling after each step
    filters_samples = True
    undefined_when = losses.MIN_MAX_UNDEFINED
    options = (
        Option("weighting", True, "weight samples by certainty and diversity, and drop the least diverse", "flag"),
        Option("consistency", True, "add the symmetric cross-entropy to a random view of each kept sample", "flag"),
        Option("prior_correction", True, "multiply the reported logits by the batch's smoothed prior", "flag"),
        Option(
            "source_momentum",
            SOURCE_MOMENTUM,
            "α: after each step θ ← αθ + (1 − α)θ⁰ (1: no ensembling)",
            "fraction",
        ),
        Option("probs_momentum", PROBS_MOMENTUM, "μ: the moving mean prediction's momentum", "fraction"),
        Option("temperature", TEMPERATURE, "T: the weights are exp(diversity·certainty/T)", "positive"),
    )

    def setup(self) -> None:
        self.source: list[torch.Tensor] = []  # θ⁰, the trained parameters' source values
        self.class_probs: torch.Tensor | None = None  # m, made on the first batch

    def attach(self, model: FeatureClassifier) -> None:
        """The trained parameters' source values to ensemble with (the model is at them now)."""
        self.source = [p.detach().clone() for p in self.params]

    def reset(self) -> None:
        if self.class_probs is not None:
            self.class_probs.fill_(1 / len(self.class_probs))

    def update(self, adapter: AdapterSurface, images: torch.Tensor, skipped: torch.Tensor | None):
        with adapter.autocast:
            logits, features = adapter.forward(images)
        z = logits.float()
        n = len(z)
        undefined = None
        if self.weighting:
            weights, keep, undefined = self.weigh(z.detach())
            self.count_kept(keep.sum())
            if skipped is None:  # the batch's first step: a batch is counted once
                self.count_undefined(undefined)
        else:  # every sample kept, with weight 1
            weights, keep = torch.ones(n, device=z.device), None
            self.count_kept(torch.full((), n, dtype=torch.int64, device=z.device))
        loss = (losses.soft_likelihood_ratio(z) * weights).sum() / n
        if self.consistency:
            # the one read of a device value a batch: which samples the views are of, for the
            # views' batch statistics are those of the kept samples alone
            chosen = None if keep is None else keep.nonzero().squeeze(1)
            originals = z if chosen is None else z.index_select(0, chosen)
            kept_images = images if chosen is None else images.index_select(0, chosen)
            kept_weights = weights if chosen is None else weights.index_select(0, chosen)
            with adapter.autocast:
                views, _ = adapter.forward(augment(kept_images, noise=False, padding="reflection"))
            loss = loss + (losses.symmetric_cross_entropy(views.float(), originals) * kept_weights).sum() / n
        flag = adapter.apply(loss, skipped, leave_out=undefined)
        # θ ← αθ + (1 − α)θ⁰, in place, after each step (one left out too: theirs ensemble after every step)
        if self.source_momentum < 1:
            follow(self.params, self.source, self.source_momentum)
        return logits, features, flag

    def weigh(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each sample's weight (0 where dropped), whether it is kept, and whether the weights
        are undefined (`undefined_when`: every weight is then 0, for a finite loss whose step
        is left out); moves m."""
        with torch.no_grad():
            probs = logits.softmax(1)
            if self.class_probs is None:
                self.class_probs = torch.full((logits.shape[1],), 1 / logits.shape[1], device=logits.device)
            dissimilarity = 1 - F.cosine_similarity(self.class_probs.unsqueeze(0), probs, dim=1)
            diversity = losses.min_max(dissimilarity)
            keep = ~(diversity < diversity.mean())  # as theirs: NaN scores (a constant batch) drop nothing
            certainty = -losses.entropies(logits)
            undefined = losses.alike(dissimilarity, certainty)
            weights = torch.exp(diversity * losses.min_max(certainty) / self.temperature)
            weights = torch.where(keep & ~undefined, weights, 0.0)
            momentum = self.probs_momentum
            self.class_probs.mul_(momentum).add_(probs.mean(0), alpha=1 - momentum)
        return weights, keep, undefined

    def output(self, logits: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The step's logits times the batch's smoothed prior (prior correction), as the
        authors' code reports them."""
        return logits * losses.smoothed_prior(logits) if self.prior_correction else logits
