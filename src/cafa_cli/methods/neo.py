"""NEO: no-optimisation test-time adaptation by latent re-centring (Murphy et al., "NEO:
No-Optimization Test-Time Adaptation through Latent Re-Centering", ICLR 2026).

Update rule: no gradient, no change to the model (BatchNorms keep their source
statistics). The features z entering the classifier are moved so that the mean of the
test features seen so far sits at the origin, and classified there:

    μ ← (n/(n + N))·μ + (N/(n + N))·mean(z_batch),   n ← n + N,   logits = W(z − μ) + b

with μ = 0 and n = 0 after each reset, the batch's own features counted before it is
classified (the authors' tta_library/neo.py). So NEO is a per-class shift of the logits,
−Wμ, and takes no source data: it centres on the origin, not on a source mean. Option
`running_mean`: all (the mean of every feature since the reset, NEO), or ema, the
authors' NEO-Continual (tta_library/neo_cont.py) for streams that change domain without
a reset: μ ← (1 − α)·μ + α·mean(z_batch), α = `alpha` (their learning_rate, 0.1).
μ and n live on the device and change in place, so a step reads nothing back.
"""

from __future__ import annotations

import torch

from cafa_cli.engine.method import Method
from cafa_cli.engine.options import Option
from cafa_cli.model.features import FeatureClassifier

ALPHA = 0.1  # NEO-Continual's learning_rate (utils/utils.py get_args)
RUNNING_MEANS = ("all", "ema")


class Neo(Method):
    name = "neo"
    capturable = True  # its centre and count change in place (base.py)
    adapts_normalisation = False
    trains = False
    options = (
        Option(
            "running_mean",
            "all",
            "the centre: all (the mean of every feature since the reset, NEO) or ema (NEO-Continual's moving mean)",
            "choice",
            RUNNING_MEANS,
        ),
        Option("alpha", ALPHA, "ema's α: the weight of each batch's mean features (NEO-Continual's 0.1)", "fraction"),
    )
    unsaved = (*Method.unsaved, "model")  # the adapted model itself, whose weights the Adapter saves

    def setup(self) -> None:
        self.model: FeatureClassifier | None = None
        self.reset()

    def check(self, model: FeatureClassifier, device: torch.device) -> None:
        super().check(model, device)
        self.model = model  # its classifier classifies the centred features

    def reset(self) -> None:
        self.centre: torch.Tensor | None = None  # μ [d], made on the first batch's device
        self.seen: torch.Tensor | None = None  # n, the features μ is the mean of (all)

    def output(self, logits: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        batch_mean = features.mean(0)
        if self.centre is None:
            self.centre = torch.zeros_like(batch_mean)
            self.seen = torch.zeros((), dtype=torch.int64, device=features.device)
        if self.running_mean == "all":
            self.seen += len(features)
            seen = self.seen.to(batch_mean.dtype)
            moved = self.centre * ((seen - len(features)) / seen) + batch_mean * (len(features) / seen)
        else:
            moved = (1 - self.alpha) * self.centre + self.alpha * batch_mean
        self.centre.copy_(moved)  # in place: a replayed step (step_graph.py) reads and writes the same tensor
        return self.model.head(features - self.centre)
