"""RoTTA: robust test-time adaptation (Yuan et al., "Robust Test-Time Adaptation in
Dynamic Scenarios", CVPR 2023), for correlated (non-i.i.d.) and changing test streams.

Update rule. Every BatchNorm becomes a robust BatchNorm (RBN) holding global statistics
(μ, σ²), starting from the source running statistics. A student θ (trained) and a
teacher θ' (its moving average) share that structure. For each batch:

1. the teacher predicts it with the RBNs' global statistics; that prediction is reported;
2. each sample is offered in turn to the memory bank (CSTU, methods/shared/memory_bank.py) with
   the teacher's pseudo-label and the entropy −Σ p log(p + 1e-6) of its prediction;
3. after every `update_every` samples offered (counted over the stream, so also within
   a batch), one training step on the bank's M samples: the teacher sees them as they
   are (weak view), the student a strong view (methods/shared/augment.py); in both, each RBN
   normalises with μ ← (1 − α)μ + α μ_B, σ² ← (1 − α)σ² + α σ²_B (μ_B, σ²_B the biased
   statistics of the bank's samples; the gradient flows through them) and keeps the new
   values; the loss is the time-aware reweighted cross-entropy
       L = (1/M) Σ_m w(A_m) · −Σ_c softmax(f_θ'(x_m))_c log softmax(f_θ(aug(x_m)))_c,
       w(A) = exp(−A)/(1 + exp(−A)),   A = age/K;
   then the teacher follows, θ' ← (1 − ν)θ' + νθ over the trained parameters.

Options and their defaults, the official code's: α = 0.05 (`bn_momentum`), ν = 0.001
(`teacher_momentum` = 1 − ν = 0.999), bank of K = 64 (`memory_size`), a step every 64
samples (`update_every`), λ_t = λ_u = 1 (`lambda_t`, `lambda_u`); its recipes
(recipes/rotta.toml) add the official Adam, lr 1e-3, batch 64.
The official code trains the RBN affines only; `params` norm (the default) trains the
normalisation affines (LayerNorm and GroupNorm ones too), `all` the feature extractor.
With `steps` N, each training step on the bank is N optimiser steps. Dropout stays off
(the official code's train mode would turn it on while training on the bank).

A step reads one device value: the batch's pseudo-labels and uncertainties, in one
transfer, after which the bank decides each sample on the host (memory_bank.py); the
schedule is a count of samples known on the host, and the bank's empty slots (it fills
up over the first samples, and a skewed stream may leave it part empty) ride along in
the training step with weight 0, the RBN statistics taken over the filled ones only: as
the official code's step on the stored samples alone, but for the augmentation's draws.
The slots exist as far as the stored samples and the first batch need them
(memory_bank.py), so a step's work follows those, not `memory_size`.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from cafa_cli.core.errors import InputError
from cafa_cli.engine.method import AdapterSurface, Method
from cafa_cli.engine.norms import plain_batch_norm, replace_submodule, weighted_statistics
from cafa_cli.engine.options import Option
from cafa_cli.methods.shared.augment import augment
from cafa_cli.methods.shared.memory_bank import (
    SCHEDULE_OPTIONS,
    SCORE_OPTIONS,
    MemoryBank,
    timeliness_weights,
)
from cafa_cli.methods.shared.teacher_student import follow, frozen_copy, named, names_of, soft_cross_entropy
from cafa_cli.model.features import FeatureClassifier

BN_MOMENTUM = 0.05  # α
TEACHER_MOMENTUM = 0.999  # 1 − ν


class RobustBatchNorm(nn.Module):
    """RoTTA's RBN: normalises with global statistics; while `weights` is set (a float
    0/1 tensor, one per sample), first moves them toward the statistics of those samples
    by `momentum` and normalises with the moved ones (gradients through the batch's part)."""

    def __init__(self, bn: _BatchNorm, momentum: float, name: str = ""):
        super().__init__()
        if bn.running_mean is None:
            raise InputError(
                f"rotta needs the running statistics of every BatchNorm, and the one at {name or 'the top'} keeps "
                f"none (track_running_stats=False); use a model trained with them, or another method"
            )
        self.weight, self.bias, self.eps, self.momentum = bn.weight, bn.bias, bn.eps, momentum
        self.plain_type = type(
            bn
        ).__name__  # for a plain one of the same kind (frozen); not `source_type`, which says what adapts
        self.register_buffer("global_mean", bn.running_mean.detach().clone().float())
        self.register_buffer("global_var", bn.running_var.detach().clone().float())
        self.weights: torch.Tensor | None = None

    def frozen(self) -> nn.Module:
        """A plain eval-mode BatchNorm with these affines and the global statistics the stream
        arrived at, for serving (Adapter.export)."""
        return plain_batch_norm(self.plain_type, self.weight, self.bias, self.global_mean, self.global_var, self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weights is None:
            return nn.functional.batch_norm(
                x, self.global_mean, self.global_var, self.weight, self.bias, False, 0.0, self.eps
            )
        shape = [1, -1] + [1] * (x.dim() - 2)
        xf = x.float()  # statistics in float32 under autocast too
        batch_mean, batch_var = weighted_statistics(xf, self.weights)
        mean = (1 - self.momentum) * self.global_mean + self.momentum * batch_mean
        var = (1 - self.momentum) * self.global_var + self.momentum * batch_var
        with torch.no_grad():  # a non-finite batch must not poison the statistics for good
            self.global_mean.copy_(torch.where(mean.isfinite(), mean, self.global_mean))
            self.global_var.copy_(torch.where(var.isfinite(), var, self.global_var))
        out = (xf - mean.view(shape)) * (var.view(shape) + self.eps).rsqrt()
        if self.weight is not None:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out.to(x.dtype)


def use_robust_batch_norm(model: nn.Module, momentum: float) -> int:
    """Swap every BatchNorm (by type) for a RobustBatchNorm sharing its affine parameters."""
    swaps = [(name, module) for name, module in model.named_modules() if isinstance(module, _BatchNorm)]
    for name, module in swaps:
        replace_submodule(model, name, RobustBatchNorm(module, momentum, name))
    return len(swaps)


@contextmanager
def on_samples(model: nn.Module, weights: torch.Tensor):
    """The model's RBNs move their statistics toward those of the samples weighted 1."""
    layers = [m for m in model.modules() if isinstance(m, RobustBatchNorm)]
    for layer in layers:
        layer.weights = weights
    try:
        yield
    finally:
        for layer in layers:
            layer.weights = None


class RoTTA(Method):
    name = "rotta"
    draws_random_numbers = True  # from torch's generator (base.py)
    owns_update = True
    reported: tuple | None = None  # the batch's reported logits and features, for its later `steps`
    adapts_normalisation = False  # its own normalisation layers: RBN, swapped in by parameters()
    options = (
        SCHEDULE_OPTIONS
        + (
            Option(
                "teacher_momentum",
                TEACHER_MOMENTUM,
                "1 − ν: the teacher's moving average θ' ← (1 − ν)θ' + νθ",
                "fraction",
            ),
            Option("bn_momentum", BN_MOMENTUM, "α, the robust BatchNorms' momentum", "fraction"),
        )
        + SCORE_OPTIONS
    )

    def setup(self) -> None:
        self.names: list[str] = []
        self.student: FeatureClassifier | None = None
        self.teacher: FeatureClassifier | None = None
        self.bank: MemoryBank | None = None
        self.offered = 0  # samples offered to the bank since the last reset (a host count)
        self.fresh = False  # a new batch, not yet added (the Adapter's `steps` call update again)

    def attach(self, model: FeatureClassifier) -> None:
        """The RBNs (swapped in after the parameters are chosen: they share them), and the teacher."""
        use_robust_batch_norm(model.model, self.bn_momentum)  # on the bare net: names as its state dict has them
        self.names = names_of(model, self.params)
        self.student, self.teacher = model, frozen_copy(model)
        self.bank = MemoryBank(model.num_classes, self.memory_size, self.lambda_t, self.lambda_u)

    def reset(self) -> None:
        """An empty bank, and the teacher (weights and statistics) back to the source's,
        which the Adapter has just put back in the student."""
        self.offered = 0
        if self.bank is not None:
            self.bank.reset()
            self.teacher.load_state_dict(self.student.state_dict())

    def reporting_network(self, adapter: AdapterSurface) -> torch.nn.Module:
        return self.teacher  # its predictions are reported, the student only trains

    def served_network(self, adapter: AdapterSurface) -> FeatureClassifier:
        return self.teacher

    def before_step(self, images: torch.Tensor) -> None:
        self.fresh = True

    def update(self, adapter: AdapterSurface, images: torch.Tensor, skipped: torch.Tensor | None):
        if not self.fresh:  # the Adapter's later `steps` on this batch: taken on the bank already
            return self.reported + (skipped,)
        self.fresh = False
        with torch.no_grad(), adapter.autocast:
            logits, features = self.teacher(images)
        logits, features = logits.float(), features.float()
        self.reported = (logits, features)
        probabilities = logits.softmax(1)
        labels = probabilities.argmax(1)
        uncertainties = -(probabilities * (probabilities + 1e-6).log()).sum(1)
        flag = skipped
        for _ in self.bank.offer(images, labels, uncertainties, self.offered, self.update_every):
            flag = self.train_on_bank(adapter)
        self.offered += len(images)
        return logits, features, flag

    def train_on_bank(self, adapter) -> torch.Tensor:
        """`steps` optimiser steps on the bank, then the teacher follows the student."""
        bank, flag = self.bank, None
        filled = bank.occupied.float()
        weights = timeliness_weights(bank.ages) * filled
        for _ in range(adapter.steps):
            strong = augment(bank.samples)
            with torch.no_grad(), adapter.autocast, on_samples(self.teacher, filled):
                target, _ = self.teacher(bank.samples)
            with adapter.autocast, on_samples(adapter.model, filled):
                student, _ = adapter.forward(strong)
            loss = (soft_cross_entropy(student.float(), target.float()) * weights).sum() / filled.sum().clamp_min(1)
            flag = adapter.apply(loss, flag)
        follow(named(self.teacher, self.names), self.params, self.teacher_momentum)
        return flag
