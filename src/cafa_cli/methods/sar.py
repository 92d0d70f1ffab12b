"""SAR: sharpness-aware and reliable entropy minimisation (Niu et al., "Towards Stable
Test-Time Adaptation in Dynamic Wild World", ICLR 2023).

Update rule: BatchNorms use the test batch's statistics (the paper recommends group- or
layer-normalised models for batch size 1 and label shift); for each batch, with E(x) the
prediction's entropy and E0 = e·ln C (e = `entropy_margin`):

1. reliable entropy: L(θ) = mean of E(x) over the samples with E(x) < E0;
2. sharpness-aware step (SAM, ρ = `rho`): ε = ρ·g/‖g‖ with g = ∇L(θ) over the trained
   parameters; a second forward pass at θ + ε, whose samples are filtered again (those
   kept in 1. whose new entropy is below E0); the optimiser steps from θ with the
   gradient of that second loss;
3. model recovery: e ← 0.9·e + 0.1·(second loss) (the first value sets e; a batch that
   keeps no sample leaves it); when e < 0.2 the trained parameters, the BatchNorm
   buffers and the optimiser's state go back to the source ones. As in the official
   code, e itself is kept, so recovery repeats until e rises again.

The prediction reported is the first forward pass's. Options and their defaults, the
official code's: `entropy_margin` e = 0.4, `rho` ρ = 0.05, `reset_below` 0.2, and
`frozen`, the modules whose parameters stay fixed: a ResNet's top stage (layer4) and a
ViT-Base's last three blocks and final norm, as the official code skips them by name
(base.in_frozen; a model with none of those names adapts every normalisation layer, as
the official code does with a WideResNet). The optimiser SAM steps with is the
Adapter's: the recipes (recipes/sar.toml) give the official SGD with momentum 0.9.
Recovery is made on the device with torch.where, so no step reads a device value. Option
`entropy`: shannon, or come, COME's entropy of opinion (shared/losses.py) in place of E in
both filters, both losses and the recovery's moving average, as COME's authors run SAR.
"""

from __future__ import annotations

import math

import torch

from cafa_cli.engine.method import AdapterSurface, Method
from cafa_cli.engine.options import Option
from cafa_cli.methods.shared import losses
from cafa_cli.methods.shared.sam import FROZEN_OPTION, ascend, descend_from, unfrozen_parameters
from cafa_cli.model.features import FeatureClassifier

MARGIN = 0.4  # E0 = MARGIN · ln C
RHO = 0.05
RESET_BELOW = 0.2
EMA_MOMENTUM = 0.9


def reliable_entropy(
    logits: torch.Tensor, keep: torch.Tensor | None = None, margin: float = MARGIN, entropies=losses.entropies
) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean entropy (Shannon's, or that `entropies` computes) of the samples below E0 =
    margin·ln C (and in `keep`), and that mask; 0 when none."""
    entropy = entropies(logits)
    below = entropy.detach() < margin * math.log(logits.shape[1])
    mask = below if keep is None else below & keep
    return (entropy * mask).sum() / mask.sum().clamp_min(1), mask


class Sar(Method):
    name = "sar"
    owns_update = True
    capturable = True  # its state changes in place (base.py)
    predicts_before_update = True
    filters_samples = True
    options = (
        Option(
            "entropy_margin",
            MARGIN,
            "E0 as a share of ln C: a sample is reliable when its entropy is below E0",
            "positive",
        ),
        Option("rho", RHO, "ρ, the radius of the sharpness-aware perturbation", "positive"),
        Option(
            "reset_below",
            RESET_BELOW,
            "recover the source model when the loss's moving average falls below this",
            "weight",
        ),
        FROZEN_OPTION,
        losses.ENTROPY,
    )

    def setup(self) -> None:
        self.reset()

    def choose_parameters(self, model: FeatureClassifier, which: str = "norm") -> list[torch.nn.Parameter]:
        return unfrozen_parameters(model, which, self.frozen, "sar")

    def reset(self) -> None:
        self.ema: torch.Tensor | None = None  # the moving average of the loss, on the device
        self.started: torch.Tensor | None = None
        self.saved: list[torch.Tensor] | None = None  # θ while the step is taken at θ + ε
        self.starts: dict[tuple, torch.Tensor] = {}

    def update(self, adapter: AdapterSurface, images: torch.Tensor, skipped: torch.Tensor | None):
        with adapter.autocast:
            logits, features = adapter.forward(images)
        entropies = losses.ENTROPIES[self.entropy]
        first, keep = reliable_entropy(logits.float(), margin=self.entropy_margin, entropies=entropies)
        # fp16: scaled as the Adapter scales its losses, or small gradients flush to zero;
        # ε = ρ·g/‖g‖ is the same for any scale of g
        scaled = first if adapter.scaler is None else adapter.scaler.scale(first)
        if self.saved is None:
            self.saved = [torch.empty_like(p) for p in self.params]
        ascend(self.params, scaled, self.rho, self.saved)
        with adapter.autocast:
            perturbed, _ = adapter.forward(images)
        second, kept = reliable_entropy(perturbed.float(), keep, self.entropy_margin, entropies)
        self.count_kept(kept.sum())
        # the step is taken from θ with the gradient at θ + ε
        flag = adapter.apply(second, skipped, after_backward=descend_from(self.params, self.saved))
        with torch.no_grad():
            self._recover(adapter, second.detach(), kept.any())
        return logits, features, flag

    def _recover(self, adapter, loss: torch.Tensor, any_kept: torch.Tensor) -> None:
        if self.ema is None:
            self.ema = torch.zeros((), device=loss.device)
            self.started = torch.zeros((), dtype=torch.bool, device=loss.device)
        valid = any_kept & loss.isfinite()
        moved = torch.where(self.started, EMA_MOMENTUM * self.ema + (1 - EMA_MOMENTUM) * loss, loss)
        # in place: a replayed step (step_graph.py) reads and writes the same tensors
        self.ema.copy_(torch.where(valid, moved, self.ema))
        self.started.logical_or_(valid)
        collapsed = self.started & (self.ema < self.reset_below)
        # what a step can change: the trained parameters and the buffers (running statistics);
        # the other parameters are the source's already
        trained = {id(p) for p in self.params}
        state = adapter.model.state_dict(keep_vars=True)
        for name, tensor in state.items():
            if id(tensor) in trained or not isinstance(tensor, torch.nn.Parameter):
                torch.where(collapsed, adapter.source_state[name], tensor, out=tensor)
        for slots in adapter.optimizer.state.values():  # as a new optimiser's: no step, no moments
            for key, tensor in slots.items():
                if isinstance(tensor, torch.Tensor):
                    start = self._start(-0.0 if key == "momentum_buffer" else 0.0, tensor)
                    torch.where(collapsed.to(tensor.device), start, tensor, out=tensor)

    def _start(self, value: float, like: torch.Tensor) -> torch.Tensor:
        """A 0-d tensor of `value` with the dtype and device of `like`, made once."""
        key = (value, like.dtype, like.device)
        if key not in self.starts:
            self.starts[key] = torch.full((), value, dtype=like.dtype, device=like.device)
        return self.starts[key]
