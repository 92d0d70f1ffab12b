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
  i.i.d. is normalised with exactly its own statistics, as `batch`. The correction is
  computed for all the layers at once (ClassBalancedNorms).

A batch may take several forward passes (`steps`, SAR's two passes): the running
statistics move once a batch, from where they were before it (`new_batch`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from cafa_cli.errors import UsageError
from cafa_cli.method.options import parse_norm

if TYPE_CHECKING:
    from cafa_cli.method.class_balanced import ClassBalancedNorms

NORM_LAYERS = (_BatchNorm, nn.LayerNorm, nn.GroupNorm)
RUNNING = ("ema", "class-balanced")  # the settings that keep statistics from batch to batch
SERVED = ("batch", "prior")  # the settings whose layers keep an estimate for serving (BatchStatisticsNorm.frozen)
SERVED_MOMENTUM = 0.1  # that estimate's momentum: BatchNorm's own


class BatchStatisticsNorm(nn.Module):
    """A BatchNorm (its affine parameters shared) that normalises with the statistics
    `norm` says (module docstring). Under `class-balanced` it belongs to the net's
    ClassBalancedNorms (`balanced`), which use_test_batch_norm makes."""

    def __init__(self, bn: _BatchNorm, norm: str = "batch", name: str = ""):
        super().__init__()
        self.source_type = type(bn).__name__  # what it replaced (BatchNorm2d), for saying which layers adapt
        self.weight, self.bias, self.eps = bn.weight, bn.bias, bn.eps
        self.kind, value = parse_norm(norm)
        if bn.running_mean is None and self.kind != "batch":
            raise UsageError(
                f"`norm` {norm} needs the running statistics of every BatchNorm, and the one at {name or 'the top'} "
                f"keeps none (track_running_stats=False); use `norm` batch"
            )
        self.prior = value if self.kind == "prior" else 0.0
        if bn.running_mean is not None:
            self.register_buffer("source_mean", bn.running_mean.detach().clone())
            self.register_buffer("source_var", bn.running_var.detach().clone())
        if self.kind in RUNNING:  # in the state dict, so that the Adapter's reset() puts the source's back
            self.register_buffer("running_mean", bn.running_mean.detach().clone().float())
            self.register_buffer("running_var", bn.running_var.detach().clone().float())
        if self.kind == "ema":
            # its momentum and 1 − it, as device scalars: a Python number would make
            # torch.compile compile again for every value
            self.register_buffer("rate", torch.full((), value, device=bn.running_mean.device), persistent=False)
            self.register_buffer("keep", torch.full((), 1 - value, device=bn.running_mean.device), persistent=False)
        if self.kind in SERVED:
            # what a model exported for serving normalises with (Adapter.export, frozen): an average
            # of the test batches' statistics, each forward pass moving it by BatchNorm's own
            # momentum, from 0 and corrected for that start as Adam corrects its moments, so that
            # no share of it is the source's; it changes no prediction of the stream. In the
            # running statistics' dtype, which the fused kernel needs them in
            like = bn.running_mean if bn.running_mean is not None else torch.empty(0, device=bn.weight.device)
            self.register_buffer("served_mean", like.new_zeros(bn.num_features))
            self.register_buffer("served_var", like.new_zeros(bn.num_features))
            self.register_buffer("served_passes", torch.zeros((), dtype=torch.int64, device=like.device))
        self.before: tuple[torch.Tensor, torch.Tensor] | None = None  # ema: running statistics before this batch
        self.balanced: ClassBalancedNorms | None = None
        self.index = 0  # its place among the balanced layers
        # `batch`: the batch's rows are this many groups (row n·groups + g: group g of sample
        # n), each normalised with its own statistics, as that many forward passes would
        # (CoTTA's augmented views, several in one pass)
        self.groups = 1

    def start(self) -> None:
        """A new stream from the source statistics (the Adapter's reset() puts back the buffers)."""
        self.before = None

    def new_batch(self) -> None:
        """The next forward passes are of a new batch."""
        if self.kind == "ema":
            # copied into the same tensors from the second batch on: a replayed step (step_graph.py) reads them there
            if self.before is None:
                self.before = (self.running_mean.clone(), self.running_var.clone())
            else:
                torch._foreach_copy_(list(self.before), [self.running_mean, self.running_var])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == x.shape[1] * self.groups and hasattr(self, "source_mean"):
            # one value per channel (one image, 1×1 maps) has no variance: the source statistics stand in
            if self.balanced is not None:
                self.balanced.fell_back.add(self.index)
            return nn.functional.batch_norm(
                x, self.source_mean, self.source_var, self.weight, self.bias, training=False, eps=self.eps
            )
        if self.kind == "batch" or self.kind == "prior" and self.prior == 0:
            # the fused kernel: normalise by the batch's statistics, gradients through them
            if self.groups > 1:  # over the rows seen as [N, groups·channels, ...]: a view, no copy, when contiguous
                grouped = x.reshape(x.shape[0] // self.groups, self.groups * x.shape[1], *x.shape[2:])
                weight = None if self.weight is None else self.weight.repeat(self.groups)
                bias = None if self.bias is None else self.bias.repeat(self.groups)
                return nn.functional.batch_norm(grouped, None, None, weight, bias, training=True, eps=self.eps).view(
                    x.shape
                )
            self.served_passes += 1
            return nn.functional.batch_norm(
                x, self.served_mean, self.served_var, self.weight, self.bias, True, SERVED_MOMENTUM, self.eps
            )
        if self.kind == "source":
            return nn.functional.batch_norm(
                x, self.source_mean, self.source_var, self.weight, self.bias, training=False, eps=self.eps
            )
        if self.kind == "class-balanced":
            return self.balanced.normalise(self, x)
        dims = [0] + list(range(2, x.dim()))
        # in float32 under autocast too, as the fused kernel keeps them: a bf16 mean has ~3
        # significant digits, and an fp16 variance overflows above 65504
        var, mean = torch.var_mean(x.float(), dims, unbiased=False)
        if self.kind == "prior":
            n = x.shape[0]
            with torch.no_grad():  # as the fused kernel moves them for `batch`, with the unbiased variance
                self.served_passes += 1
                count = x.numel() // x.shape[1]
                self.served_mean.lerp_(mean.detach().to(self.served_mean.dtype), SERVED_MOMENTUM)
                unbiased = var.detach() * count / max(count - 1, 1)
                self.served_var.lerp_(unbiased.to(self.served_var.dtype), SERVED_MOMENTUM)
            mean = (self.prior * self.source_mean + n * mean) / (self.prior + n)
            var = (self.prior * self.source_var + n * var) / (self.prior + n)
        else:
            mean, var = self._move(mean, var)
        shape = [1, -1] + [1] * (x.dim() - 2)
        out = (x - mean.view(shape)) * (var.view(shape) + self.eps).rsqrt()
        if self.weight is not None:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out

    def frozen(self) -> nn.Module:
        """A plain BatchNorm in eval mode with this layer's affines and the statistics the stream
        arrived at, for serving: `batch` and `prior` their running estimate of the test
        statistics, `ema` and `class-balanced` their running statistics, `source` the source's."""
        if self.kind in RUNNING:
            mean, var = self.running_mean, self.running_var
        elif self.kind == "source" or (self.kind in SERVED and int(self.served_passes) == 0):
            # no test batch seen: the source's (a layer that keeps none normalises as a fresh BatchNorm)
            if hasattr(self, "source_mean"):
                mean, var = self.source_mean, self.source_var
            else:
                mean, var = torch.zeros_like(self.served_mean), torch.ones_like(self.served_var)
        else:
            started = 1 - (1 - SERVED_MOMENTUM) ** int(self.served_passes)  # the share the passes have
            mean, var = self.served_mean / started, self.served_var / started
        return plain_batch_norm(self.source_type, self.weight, self.bias, mean, var, self.eps)

    def _move(self, mean: torch.Tensor, var: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ema: the running statistics from before this batch moved toward (mean, var): kept, and returned."""
        if self.before is None:  # used outside an Adapter, which calls new_batch()
            self.new_batch()
        moved = moved_statistics(self.before, (mean, var), self.keep, self.rate)
        with torch.no_grad():
            torch._foreach_copy_([self.running_mean, self.running_var], finite_or(moved, self.before))
        return moved[0], moved[1]


def moved_statistics(
    before: tuple[torch.Tensor, torch.Tensor],
    new: tuple[torch.Tensor, torch.Tensor],
    keep: torch.Tensor,
    rate: torch.Tensor,
) -> list[torch.Tensor]:
    """The running (mean, var) from before a batch moved toward `new` by `rate`: keep·old + rate·new."""
    return [keep * old + rate * value for old, value in zip(before, new)]


def finite_or(values: list[torch.Tensor], fallback: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """Each value where finite, else the fallback's: a non-finite batch must not poison the statistics for good."""
    return [torch.where(value.isfinite(), value, old) for value, old in zip(values, fallback)]


def use_test_batch_norm(model: nn.Module, norm: str = "batch", class_moments: dict | None = None) -> int:
    """Swap every BatchNorm (found by type, so those inside ResNet `downsample` too)
    for a BatchStatisticsNorm sharing its affine parameters. `class_moments`: {layer name
    as the bare net names it: (means, variances)}, for `class-balanced`. Returns how many were swapped."""
    swaps = [(name, module) for name, module in model.named_modules() if isinstance(module, _BatchNorm)]
    if parse_norm(norm)[0] == "class-balanced":
        missing = [name for name, _ in swaps if name not in (class_moments or {})]
        if missing:
            lacking = (
                "none are" if len(missing) == len(swaps) else f"{len(missing)} layer(s) lack them, e.g. {missing[0]},"
            )
            raise UsageError(
                f"`norm` class-balanced needs the source class moments of every BatchNorm's input, and {lacking} "
                f"given; make the statistics with cafa stats --norm-moments"
            )
    layers = []
    for name, module in swaps:
        layers.append(BatchStatisticsNorm(module, norm, name))
        replace_submodule(model, name, layers[-1])
    if parse_norm(norm)[0] == "class-balanced" and layers:
        from cafa_cli.method.class_balanced import ClassBalancedNorms, checked_moments

        ClassBalancedNorms(
            model,
            layers,
            [checked_moments(class_moments[name], layer, name) for (name, _), layer in zip(swaps, layers)],
        )
    return len(swaps)


def replace_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put `module` where `model` holds the submodule called `name` (as named_modules names it)."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def norm_layers(model: nn.Module) -> list[BatchStatisticsNorm]:
    return [m for m in model.modules() if isinstance(m, BatchStatisticsNorm)]


def class_balanced_norms(model: nn.Module) -> ClassBalancedNorms | None:
    """The ClassBalancedNorms of a net whose BatchNorms use_test_batch_norm swapped under `class-balanced`."""
    return next((m.balanced for m in model.modules() if isinstance(m, BatchStatisticsNorm) and m.balanced), None)


def weighted_statistics(x: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per channel, the biased mean and variance of the samples of `x` [N, channels, ...] that
    the float 0/1 `weights` [N] mark (gradients flow through both)."""
    dims = [0] + list(range(2, x.dim()))
    w = weights.view([-1] + [1] * (x.dim() - 1))
    count = (w.sum() * (x[0].numel() / x.shape[1])).clamp_min(1)
    mean = (x * w).sum(dims) / count
    return mean, ((x - mean.view([1, -1] + [1] * (x.dim() - 2))).square() * w).sum(dims) / count


def plain_batch_norm(
    kind: str,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    var: torch.Tensor,
    eps: float,
) -> nn.Module:
    """An eval-mode torch BatchNorm of `kind` (BatchNorm2d, ...) holding these values, detached."""
    layer = getattr(nn, kind, nn.BatchNorm2d)(len(mean), eps=eps, affine=weight is not None)
    with torch.no_grad():
        if weight is not None:
            layer.weight.copy_(weight)
            layer.bias.copy_(bias)
        layer.running_mean.copy_(mean)
        layer.running_var.copy_(var)
    return layer.to(mean.device).eval()
