"""Normalisation layers at test time: which statistics a BatchNorm normalises with (`norm`).

- `batch`: the test batch's own (BN, TENT and CAFA as published);
- `prior:N`: the source running statistics count as N samples mixed with the batch's n
  (Schneider et al. 2020): μ = (N·μ_s + n·μ_t)/(N + n), likewise the variance, which
  makes batch size 1 usable;
- `source`: the source running statistics, frozen: only the affine parameters adapt;
- `ema:M`: running statistics, starting from the source's and moved toward each batch's
  by momentum M, μ ← (1 − M)μ + M·μ_B; the batch is normalised with the moved ones and
  the gradient flows through the batch's part (RoTTA's robust BN, Yuan et al. 2023);
- `class-balanced`: the batch's own statistics, corrected for the batch's class mix so
  that a batch of one class is normalised as a balanced batch under the same shift would
  be (docs/design.md, "Class-balanced normalisation"). The class mix is the mean
  prediction of one extra forward pass a batch (no gradient) with running statistics:
  the corrected statistics of the batches so far, averaged (momentum max(0.05, 1/t) at
  the t-th batch), from the source's. It needs each class's moments of every BatchNorm's
  input in the source data (`cafa stats --norm-moments`). A batch whose class mix looks
  i.i.d. is normalised with exactly its own statistics, as `batch`.

A batch may take several forward passes (`steps`, SAR's two passes): the running
statistics move once a batch, from where they were before it (`new_batch`).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from cafa_cli.errors import UsageError
from cafa_cli.method.options import parse_norm


NORM_LAYERS = (_BatchNorm, nn.LayerNorm, nn.GroupNorm)
RUNNING = ("ema", "class-balanced")  # the settings that keep statistics from batch to batch
BALANCED_MOMENTUM = 0.05  # class-balanced: the momentum once 1/t falls below it (RoTTA's α)
# class-balanced: how far a batch's class histogram must be from uniform (as a share of the
# way from what an i.i.d. batch of its size shows to one class alone) before its correction
# starts, and where it is whole; chosen on the held-out corruptions (docs/design.md)
SKEW_START, SKEW_FULL = 0.25, 0.65


class BatchStatisticsNorm(nn.Module):
    """A BatchNorm (its affine parameters shared) that normalises with the statistics
    `norm` says (module docstring). `class_moments`: (means, variances), each [C, channels],
    of the layer's input per source class, for `class-balanced`."""

    def __init__(self, bn: _BatchNorm, norm: str = "batch", class_moments: tuple[torch.Tensor, torch.Tensor] | None = None,
                 name: str = ""):
        super().__init__()
        self.source_type = type(bn).__name__  # what it replaced (BatchNorm2d), for saying which layers adapt
        self.weight, self.bias, self.eps = bn.weight, bn.bias, bn.eps
        self.kind, value = parse_norm(norm)
        if bn.running_mean is None and self.kind != "batch":
            raise UsageError(f"`norm` {norm} needs the running statistics of every BatchNorm, and the one at {name or 'the top'} "
                             f"keeps none (track_running_stats=False); use `norm` batch")
        self.prior = value if self.kind == "prior" else 0.0
        self.momentum = value if self.kind == "ema" else BALANCED_MOMENTUM
        if bn.running_mean is not None:
            self.register_buffer("source_mean", bn.running_mean.detach().clone())
            self.register_buffer("source_var", bn.running_var.detach().clone())
        if self.kind in RUNNING:  # in the state dict, so that the Adapter's reset() puts the source's back
            self.register_buffer("running_mean", bn.running_mean.detach().clone().float())
            self.register_buffer("running_var", bn.running_var.detach().clone().float())
            # this batch's momentum and 1 − it, as device scalars that new_batch fills: a Python
            # number that changes every batch would make torch.compile compile every batch again
            self.register_buffer("rate", torch.full((), self.momentum, device=bn.running_mean.device), persistent=False)
            self.register_buffer("keep", torch.full((), 1 - self.momentum, device=bn.running_mean.device), persistent=False)
        if self.kind == "class-balanced":
            if class_moments is None:
                raise UsageError(f"`norm` class-balanced needs the source class moments of the BatchNorm at {name or 'the top'}")
            means, variances = (m.detach().float().to(bn.running_mean.device) for m in class_moments)
            if means.shape != variances.shape or means.dim() != 2 or means.shape[1] != bn.running_mean.numel():
                raise UsageError(f"the class moments of the BatchNorm at {name or 'the top'} are {list(means.shape)}, not "
                                 f"[classes, {bn.running_mean.numel()}]; compute them with this model (cafa stats --norm-moments)")
            # constants: outside the state dict, which reset() loads
            self.register_buffer("class_means", means, persistent=False)
            self.register_buffer("class_second", variances + means.square(), persistent=False)  # E[x²] of each class
            self.register_buffer("balanced_mean", means.mean(0), persistent=False)
            self.register_buffer("balanced_var", (self.class_second.mean(0) - means.mean(0).square()).clamp_min(0), persistent=False)
        self.batches = 0  # batches since the start (new_batch), for class-balanced's 1/t momentum
        self.before: tuple[torch.Tensor, torch.Tensor] | None = None  # running statistics before this batch
        self.histogram: torch.Tensor | None = None  # class-balanced: this batch's class shares, [C]
        self.predicting = False  # the pass that finds the histogram: running statistics as they are

    def start(self) -> None:
        """A new stream from the source statistics (the Adapter's reset() puts back the buffers)."""
        self.batches, self.before, self.histogram = 0, None, None

    def new_batch(self) -> None:
        """The next forward passes are of a new batch."""
        if self.kind in RUNNING:
            self.batches += 1
            self.before = (self.running_mean.clone(), self.running_var.clone())
            if self.kind == "class-balanced":
                rate = max(self.momentum, 1 / self.batches)
                self.rate.fill_(rate)
                self.keep.fill_(1 - rate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == x.shape[1] and hasattr(self, "source_mean"):
            # one value per channel (one image, 1×1 maps) has no variance: the source statistics stand in
            return nn.functional.batch_norm(x, self.source_mean, self.source_var, self.weight, self.bias, training=False, eps=self.eps)
        if self.kind == "batch" or self.kind == "prior" and self.prior == 0:
            # the fused kernel: normalise by the batch's statistics, gradients through them
            return nn.functional.batch_norm(x, None, None, self.weight, self.bias, training=True, eps=self.eps)
        if self.kind == "source":
            return nn.functional.batch_norm(x, self.source_mean, self.source_var, self.weight, self.bias, training=False, eps=self.eps)
        if self.predicting:
            return nn.functional.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, training=False, eps=self.eps)
        if self.kind == "class-balanced":
            return self._class_balanced(x)
        dims = [0] + list(range(2, x.dim()))
        # in float32 under autocast too, as the fused kernel keeps them: a bf16 mean has ~3
        # significant digits, and an fp16 variance overflows above 65504
        var, mean = torch.var_mean(x.float(), dims, unbiased=False)
        if self.kind == "prior":
            n = x.shape[0]
            mean = (self.prior * self.source_mean + n * mean) / (self.prior + n)
            var = (self.prior * self.source_var + n * var) / (self.prior + n)
        else:
            mean, var = self._move(mean, var)
        shape = [1, -1] + [1] * (x.dim() - 2)
        out = (x - mean.view(shape)) * (var.view(shape) + self.eps).rsqrt()
        if self.weight is not None:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out

    def _class_balanced(self, x: torch.Tensor) -> torch.Tensor:
        """The batch normalised with its statistics corrected for its class mix
        (balanced_statistics), μ and σ², by the fused kernel: with r = √((v_h + ε)/(σ̄² + ε))
        and δ = μ̄ − m_h,
            (x − μ)/√(σ² + ε) = r·(x − μ_B)/√(σ²_B + ε) − δ/√(σ̄² + ε),
        so the correction is a change of the affine parameters that needs no batch
        statistic. The kernel also returns μ_B and σ²_B, from which the corrected
        statistics move the running ones (max(0.05, 1/t)) for the next batch's class mix."""
        mix_mean, mix_var = class_mix_moments(self.histogram, self.class_means, self.class_second,
                                              self.balanced_mean, self.balanced_var)
        spread = (self.balanced_var + self.eps).rsqrt()
        scale, shift = (mix_var + self.eps).sqrt() * spread, (self.balanced_mean - mix_mean) * spread
        weight, bias = (scale, -shift) if self.weight is None else (self.weight * scale, self.bias - self.weight * shift)
        batch_mean, batch_var = torch.zeros_like(self.running_mean), torch.zeros_like(self.running_var)  # the kernel fills them
        out = nn.functional.batch_norm(x, batch_mean, batch_var, weight, bias, training=True, momentum=1.0, eps=self.eps)
        n = x.numel() // x.shape[1]
        mean, var = batch_mean, batch_var * ((n - 1) / n)
        if self.histogram is not None:  # else the batch's own
            mean, var = balanced_statistics(mean, var, mix_mean, mix_var, self.balanced_mean, self.balanced_var, self.eps)
        self._move(mean, var)
        return out

    def _move(self, mean: torch.Tensor, var: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The running statistics from before this batch, moved toward (mean, var) by this
        batch's momentum (`rate`): kept, and returned."""
        if self.before is None:  # used outside an Adapter, which calls new_batch()
            self.new_batch()
        before_mean, before_var = self.before
        mean = self.keep * before_mean + self.rate * mean
        var = self.keep * before_var + self.rate * var
        with torch.no_grad():  # a non-finite batch must not poison the statistics for good
            self.running_mean.copy_(torch.where(mean.isfinite(), mean, before_mean))
            self.running_var.copy_(torch.where(var.isfinite(), var, before_var))
        return mean, var


def balanced_statistics(mean: torch.Tensor, var: torch.Tensor, m_h: torch.Tensor, v_h: torch.Tensor,
                        balanced_mean: torch.Tensor, balanced_var: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's statistics (mean, var [channels]) as a class-balanced batch under the same
    covariate shift would have them (docs/design.md). The source's moments of a batch of
    its class mix are m_h and v_h (class_mix_moments); read the batch's as an affine change
    of those, a = √((σ²_B + ε)/(v_h + ε)) and μ_B − a·m_h, and apply the change to the
    balanced source moments μ̄, σ̄²:
        μ = μ_B + a·(μ̄ − m_h),   σ² = a²·(σ̄² + ε) − ε.
    With a uniform mix they are the batch's own."""
    scale = ((var + eps) / (v_h + eps)).sqrt()
    return mean + scale * (balanced_mean - m_h), (scale.square() * (balanced_var + eps) - eps).clamp_min(0)


def class_mix_moments(histogram: torch.Tensor | None, class_means: torch.Tensor, class_second: torch.Tensor,
                      balanced_mean: torch.Tensor, balanced_var: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(m_h, v_h): the source's mean and variance of a batch with class shares h (None:
    uniform), m_h = Σ h_k μ_k and v_h = Σ h_k E_k[x²] − m_h². h carries no gradient."""
    if histogram is None:
        return balanced_mean, balanced_var
    h = histogram.detach().to(class_means.dtype)
    m_h = h @ class_means
    return m_h, (h @ class_second - m_h.square()).clamp_min(0)


def correction_strength(histogram: torch.Tensor, batch_size: int) -> torch.Tensor:
    """How much of the class-mix correction a batch gets, in [0, 1] (a device scalar). The
    batch's skew is its histogram's total-variation distance from uniform, as a share of
    the way from what an i.i.d. batch of this size shows (sampling noise alone) to a batch
    of one class; 0 below SKEW_START, 1 from SKEW_FULL, linear between."""
    c = histogram.numel()
    distance = 0.5 * (histogram - 1 / c).abs().sum()
    noise = iid_distance(c, batch_size)
    skew = (distance - noise) / max(1 - 1 / c - noise, 1e-6)
    return ((skew - SKEW_START) / (SKEW_FULL - SKEW_START)).clamp(0, 1)


@lru_cache(maxsize=64)
def iid_distance(classes: int, batch_size: int) -> float:
    """The expected total-variation distance from uniform of the label histogram of
    `batch_size` labels drawn uniformly from `classes`: ½·C·E|X/n − 1/C|, X ~ Bin(n, 1/C)."""
    if classes < 2:
        return 0.0
    n, p = batch_size, 1 / classes
    k = torch.arange(n + 1, dtype=torch.float64)
    log_pmf = torch.lgamma(torch.tensor(n + 1.0)) - torch.lgamma(k + 1) - torch.lgamma(n - k + 1) + k * math.log(p) + (n - k) * math.log1p(-p)
    return float(0.5 * classes * (log_pmf.exp() * (k / n - p).abs()).sum())


def balance_histogram(histogram: torch.Tensor, batch_size: int) -> torch.Tensor:
    """The class shares the correction uses: the histogram drawn toward uniform by 1 − its strength."""
    strength = correction_strength(histogram, batch_size)
    return strength * histogram + (1 - strength) / histogram.numel()


def use_test_batch_norm(model: nn.Module, norm: str = "batch", class_moments: dict | None = None) -> int:
    """Swap every BatchNorm (found by type, so those inside ResNet `downsample` too)
    for a BatchStatisticsNorm sharing its affine parameters. `class_moments`: {layer name
    as the bare net names it: (means, variances)}, for `class-balanced`. Returns how many were swapped."""
    swaps = [(name, module) for name, module in model.named_modules() if isinstance(module, _BatchNorm)]
    if parse_norm(norm)[0] == "class-balanced":
        missing = [name for name, _ in swaps if name not in (class_moments or {})]
        if missing:
            raise UsageError(f"`norm` class-balanced needs the source class moments of every BatchNorm's input, and "
                             f"{'none are' if len(missing) == len(swaps) else f'{len(missing)} layer(s) lack them, e.g. ' + missing[0] + ','} "
                             f"given; make the statistics with cafa stats --norm-moments")
    for name, module in swaps:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, BatchStatisticsNorm(module, norm, (class_moments or {}).get(name), name))
    return len(swaps)


def norm_layers(model: nn.Module) -> list[BatchStatisticsNorm]:
    return [m for m in model.modules() if isinstance(m, BatchStatisticsNorm)]
