"""SAR: sharpness-aware and reliable entropy minimisation (Niu et al., "Towards Stable
Test-Time Adaptation in Dynamic Wild World", ICLR 2023).

Update rule: BatchNorms use the test batch's statistics (the paper recommends group- or
layer-normalised models for batch size 1 and label shift); for each batch, with E(x) the
prediction's entropy and E0 = 0.4·ln C:

1. reliable entropy: L(θ) = mean of E(x) over the samples with E(x) < E0;
2. sharpness-aware step (SAM, ρ = 0.05): ε = ρ·g/‖g‖ with g = ∇L(θ) over the trained
   parameters; a second forward pass at θ + ε, whose samples are filtered again (those
   kept in 1. whose new entropy is below E0); the optimiser steps from θ with the
   gradient of that second loss;
3. model recovery: e ← 0.9·e + 0.1·(second loss) (the first value sets e; a batch that
   keeps no sample leaves it); when e < 0.2 the trained parameters, the BatchNorm
   buffers and the optimiser's state go back to the source ones. As in the official
   code, e itself is kept, so recovery repeats until e rises again.

The prediction reported is the first forward pass's. Defaults, as the official code:
E0 = 0.4·ln C, ρ = 0.05, recovery below 0.2; SGD, lr 0.00025 × batch/64, momentum 0.9
(ImageNet-C, batch 64). The official code leaves the last ResNet stage (layer4) and a
ViT's last blocks out of the update; here the `params` option chooses (all
normalisation affines by default). Recovery is made on the device with torch.where, so
no step reads a device value.
"""

from __future__ import annotations

import math

import torch
from cafa_cli.method import losses
from cafa_cli.method.features import FeatureClassifier
from cafa_cli.method.methods.base import Method, resolve_device, select_parameters

MARGIN = 0.4  # E0 = MARGIN · ln C
RHO = 0.05
RESET_BELOW = 0.2
EMA_MOMENTUM = 0.9


def reliable_entropy(logits: torch.Tensor, keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean entropy of the samples below E0 (and in `keep`), and that mask; 0 when none."""
    entropy = losses.entropies(logits)
    below = entropy.detach() < MARGIN * math.log(logits.shape[1])
    mask = below if keep is None else below & keep
    return (entropy * mask).sum() / mask.sum().clamp_min(1), mask


class Sar(Method):
    name = "sar"
    owns_update = True

    def __init__(self, device: torch.device | str = "cpu", rho: float = RHO, reset_below: float = RESET_BELOW):
        self.device, self.rho, self.reset_below = resolve_device(device), rho, reset_below
        self.params: list[torch.nn.Parameter] = []
        self.reset()

    def parameters(self, model: FeatureClassifier, which: str = "norm") -> list[torch.nn.Parameter]:
        self.params = select_parameters(model, which)
        return self.params

    def reset(self) -> None:
        self.ema: torch.Tensor | None = None  # the moving average of the loss, on the device
        self.started: torch.Tensor | None = None

    def update(self, adapter, images: torch.Tensor, skipped: torch.Tensor | None):
        with adapter.autocast:
            logits, features = adapter.forward(images)
        first, keep = reliable_entropy(logits.float())
        # fp16: scaled as the Adapter scales its losses, or small gradients flush to zero;
        # ε = ρ·g/‖g‖ is the same for any scale of g
        scaled = first if adapter.scaler is None else adapter.scaler.scale(first)
        grads = torch.autograd.grad(scaled, self.params, allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(self.params, grads)]
        saved = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            scale = self.rho / (torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])) + 1e-12)
            for p, g in zip(self.params, grads):
                p.add_(g * scale)
        with adapter.autocast:
            perturbed, _ = adapter.forward(images)
        second, kept = reliable_entropy(perturbed.float(), keep)

        def restore():  # the step is taken from θ with the gradient at θ + ε
            with torch.no_grad():
                for p, s in zip(self.params, saved):
                    p.copy_(s)

        flag = adapter.apply(second, skipped, after_backward=restore)
        with torch.no_grad():
            self._recover(adapter, second.detach(), kept.any())
        return logits, features, flag

    def _recover(self, adapter, loss: torch.Tensor, any_kept: torch.Tensor) -> None:
        if self.ema is None:
            self.ema = torch.zeros((), device=loss.device)
            self.started = torch.zeros((), dtype=torch.bool, device=loss.device)
        valid = any_kept & loss.isfinite()
        moved = torch.where(self.started, EMA_MOMENTUM * self.ema + (1 - EMA_MOMENTUM) * loss, loss)
        self.ema = torch.where(valid, moved, self.ema)
        self.started = self.started | valid
        collapsed = self.started & (self.ema < self.reset_below)
        state = adapter.model.state_dict()
        for name, tensor in state.items():
            torch.where(collapsed, adapter.source_state[name], tensor, out=tensor)
        for slots in adapter.optimizer.state.values():  # as a new optimiser's: no step, no moments
            for key, tensor in slots.items():
                if isinstance(tensor, torch.Tensor):
                    start = -0.0 if key == "momentum_buffer" else 0.0
                    torch.where(collapsed.to(tensor.device), torch.full_like(tensor, start), tensor, out=tensor)
