"""T3A: test-time template adjuster (Iwasawa & Matsuo, "Test-Time Classifier Adjustment
Module for Model-Agnostic Domain Generalization", NeurIPS 2021).

Update rule: no gradient, no change to the model (BatchNorms keep their source
statistics). The final linear layer is replaced by prototypes built from a support set:
for each class c a set S_c of L2-normalised features, and

    logits_n = z_n · ( Σ_{s∈S_c} s / ‖Σ_{s∈S_c} s‖ )     for each class c

(no bias). S starts from the classifier's weight rows w_c, each put in the class of its
own prediction argmax(W w_c + b); each test batch's features are added to the class the
model predicts for them, then each S_c keeps the M supports of lowest prediction entropy
(the entropy of the model's own softmax when the support was added). The batch is
classified after its own features were added, as in the official code.

Option: M = `filter_k`, 100 by default (Benchmark-TTA's tuned CIFAR value; the authors give
no default, they choose it per dataset by validation from 1, 5, 20, 50, 100, all), or `all` (their −1:
no filter, every support kept). The supports live on the device as a [C, M, d] tensor
(C = 1000, d = 2048: 0.8 GB) and are merged with topk, so no step reads a device value;
with `all` a prototype is the normalised sum of every support its class received, so
only that sum [C, d] is kept.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cafa_cli.engine.method import Method
from cafa_cli.engine.options import Option
from cafa_cli.methods.shared import losses
from cafa_cli.model.features import FeatureClassifier

FILTER_K = 100


class T3A(Method):
    name = "t3a"
    adapts_normalisation = False
    trains = False
    options = (
        Option(
            "filter_k",
            FILTER_K,
            "M, the supports kept per class (lowest entropy first), or all",
            "count_or_all",
            most=10_000,
        ),
    )

    def setup(self) -> None:
        self.model: FeatureClassifier | None = None
        self.reset()

    def check(self, model: FeatureClassifier, device: torch.device) -> None:
        super().check(model, device)
        self.model = model  # its classifier is moved to the device with it

    def reset(self) -> None:
        self.supports: torch.Tensor | None = (
            None  # [C, M, d], normalised; zeros in empty places (`all`: their sum, [C, d])
        )
        self.entropies: torch.Tensor | None = None  # [C, M]; +inf in empty places (`all`: None)

    def _start(self) -> None:
        # the weight rows and logits of the classes predicted among (a class subset's only)
        weight = self.model.class_weights().detach().float()
        C, d = weight.shape
        if self.filter_k == "all":
            self.supports = weight.new_zeros(C, d)
        else:
            self.supports = weight.new_zeros(C, self.filter_k, d)
            self.entropies = weight.new_full((C, self.filter_k), float("inf"))
        with torch.no_grad():
            self.add(weight, self.model.head(weight).float())

    def add(self, features: torch.Tensor, logits: torch.Tensor) -> None:
        """Put the features in the classes the logits predict; keep the M of lowest entropy in each."""
        if self.filter_k == "all":
            self.supports = self.supports.index_add(0, logits.argmax(1), F.normalize(features, dim=1))
            return
        C, M, d = self.supports.shape
        entropy = losses.entropies(logits).nan_to_num(nan=float("inf"))
        mine = logits.argmax(1).unsqueeze(0) == torch.arange(C, device=logits.device).unsqueeze(1)  # [C, N]
        pool = torch.cat([self.entropies, torch.where(mine, entropy.unsqueeze(0), float("inf"))], 1)  # [C, M + N]
        kept, index = pool.topk(M, dim=1, largest=False)
        old = self.supports.gather(1, index.clamp_max(M - 1).unsqueeze(2).expand(C, M, d))
        new = F.normalize(features, dim=1)[(index - M).clamp_min(0)]
        chosen = torch.where((index < M).unsqueeze(2), old, new)
        self.supports = torch.where(kept.isfinite().unsqueeze(2), chosen, 0.0)
        self.entropies = kept

    def output(self, logits: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        if self.supports is None:
            self._start()
        self.add(features, logits)
        prototypes = F.normalize(self.supports if self.filter_k == "all" else self.supports.sum(1), dim=1)  # [C, d]
        return features @ prototypes.T
