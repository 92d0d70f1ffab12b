"""EATA and ETA: efficient anti-forgetting test-time adaptation (Niu et al., "Efficient
Test-Time Model Adaptation without Forgetting", ICML 2022).

Update rule: BatchNorms use the test batch's statistics; for each batch, with E(x) the
entropy of a prediction p(x) = softmax(logits) and E0 = e·ln C (C classes; e =
`entropy_margin`),

1. reliable samples: those with E(x) < E0;
2. non-redundant ones among them: |cos(p(x), m)| < ε, where m is the moving average of
   the mean probability vector of the samples kept so far (m ← 0.9·m + 0.1·mean p over
   this batch's kept samples; the first batch that keeps any sets m, and filters by E alone);
3. one optimiser step on the normalisation affines minimising, over the kept set S,

       L = (1/|S|) Σ_{x∈S} E(x) / exp(E(x) − E0)   +   β Σ_i F_i (θ_i − θ⁰_i)²

   (the weights 1/exp(E − E0) carry no gradient). ETA is the first term alone; EATA
   adds the anti-forgetting term, F the diagonal Fisher information at the source
   weights θ⁰: the mean over batches of the squared gradient of the cross-entropy against
   the model's own predictions, on `fisher_samples` clean in-distribution images (BN on
   batch statistics, as when adapting). Without such images EATA is ETA (the command
   line says so in one warning). No step is taken for a batch that keeps no sample.

Options (`options`) and their defaults, the official ImageNet code's: `entropy_margin`
e = 0.4, `redundancy_margin` ε = 0.05, `fisher_alpha` β = 2000 (Fisher images: the
`fisher_samples` setting, 2000, in a random order as the authors' loader gives them);
and `keep_mean_on_reset`, whether a reset (`--reset domain`) keeps m, as the authors'
reset() does (their ImageNet recipe: true), or clears it, as the benchmark collection does
(the default, false); `entropy`, shannon, or come: COME's entropy of opinion
(shared/losses.py) in place of E in the filter, the weights and the loss, as COME's
authors run EATA. With C = 10 an ε of 0.05 keeps almost nothing after the first batch
(the cosine between a softmax and a near-uniform mean is at least about 0.3),
which is why the CIFAR recipes (recipes/eata.toml) use ε = 0.4 and 0.1. The recipes hold
the optimiser, rate and batch size. Everything stays on the device: the filters are
masks, the kept samples are counted in `kept`, and the "no sample kept" case leaves the
step out through `leave_out` (base.py).
"""

from __future__ import annotations

import torch

from cafa_cli.engine.method import Method
from cafa_cli.engine.options import Option
from cafa_cli.methods.shared import losses
from cafa_cli.methods.shared.fisher import FISHER_ALPHA, fisher_information, fisher_penalty
from cafa_cli.methods.shared.selection import SELECTION_OPTIONS, Selection
from cafa_cli.model.features import FeatureClassifier

# The authors' reset() (mr-eggplant/EATA eata.py) puts back the weights and the optimiser and keeps
# the redundancy filter's moving mean across corruptions; the benchmark collection clears it.
KEEP_MEAN = Option(
    "keep_mean_on_reset",
    False,
    "keep the redundancy filter's moving mean when the model is reset (the authors': true; the collection's: false)",
    "flag",
)


class Eta(Method):
    name = "eta"
    capturable = True  # a CUDA graph may replay its step (base.py)
    predicts_before_update = True
    options = (*SELECTION_OPTIONS, KEEP_MEAN, losses.ENTROPY)
    filters_samples = True
    fingerprinted = (*Method.fingerprinted, "fisher")  # EATA's, from clean images: made once

    def setup(self) -> None:
        self.selection = Selection(self.entropy_margin, self.redundancy_margin)
        self.fisher: list[torch.Tensor] | None = None

    def loss(self, logits: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        entropy, weights, kept = self.selection.select(logits, losses.ENTROPIES[self.entropy])
        self.leave_out = kept == 0
        self.count_kept(kept)
        return (entropy * weights).sum() / kept.clamp_min(1)

    def reset(self) -> None:
        if not self.keep_mean_on_reset:
            self.selection.reset()


class Eata(Eta):
    """ETA plus the Fisher regulariser when `fisher_batches` (normalised images of clean
    source data) are given; ETA otherwise."""

    name = "eata"
    capturable = True  # its loss keeps its state in place (base.py)
    options = (
        *SELECTION_OPTIONS,
        Option("fisher_alpha", FISHER_ALPHA, "β, the weight of the Fisher anti-forgetting term", "weight"),
        KEEP_MEAN,
        losses.ENTROPY,
    )
    inputs = ("fisher_batches",)  # normalised clean source images, an iterable of batches
    without_source_images = "runs as eta: its Fisher anti-forgetting term needs clean source images"

    def setup(self) -> None:
        super().setup()
        self.anchor: list[torch.Tensor] = []

    def attach(self, model: FeatureClassifier) -> None:
        """The parameters' Fisher information at the source weights (the model is already as
        it adapts: on the device, BatchNorms on batch statistics)."""
        if self.fisher_batches is not None:
            self.fisher = fisher_information(model, self.params, self.fisher_batches, self.params[0].device)
            self.anchor = [p.detach().clone() for p in self.params]

    def loss(self, logits: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        loss = super().loss(logits, features)
        if self.fisher is None:
            return loss
        return loss + self.fisher_alpha * fisher_penalty(self.fisher, self.params, self.anchor)
