"""Normalisation layers at test time: BatchNorm that uses the test batch's statistics,
optionally mixed with the source statistics as a prior."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


NORM_LAYERS = (_BatchNorm, nn.LayerNorm, nn.GroupNorm)


class BatchStatisticsNorm(nn.Module):
    """BatchNorm that normalises with the test batch's statistics.

    With `prior` = N > 0 the source running statistics count as N samples and are
    mixed with the batch's n (Schneider et al. 2020): μ = (N·μ_s + n·μ_t)/(N + n),
    likewise the variance — which makes batch size 1 usable.
    """

    def __init__(self, bn: _BatchNorm, prior: float = 0.0):
        super().__init__()
        self.source_type = type(bn).__name__  # what it replaced (BatchNorm2d), for saying which layers adapt
        self.weight, self.bias, self.eps = bn.weight, bn.bias, bn.eps
        self.prior = prior if bn.running_mean is not None else 0.0
        if bn.running_mean is not None:
            self.register_buffer("source_mean", bn.running_mean.detach().clone())
            self.register_buffer("source_var", bn.running_var.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == x.shape[1] and hasattr(self, "source_mean"):
            # one value per channel (one image, 1×1 maps) has no variance: the source statistics stand in
            return nn.functional.batch_norm(x, self.source_mean, self.source_var, self.weight, self.bias, training=False, eps=self.eps)
        if self.prior == 0:
            # the fused kernel: normalise by the batch's statistics, gradients through them
            return nn.functional.batch_norm(x, None, None, self.weight, self.bias, training=True, eps=self.eps)
        dims = [0] + list(range(2, x.dim()))
        # in float32 under autocast too, as the fused kernel keeps them: a bf16 mean has ~3
        # significant digits, and an fp16 variance overflows above 65504
        var, mean = torch.var_mean(x.float(), dims, unbiased=False)
        n = x.shape[0]
        mean = (self.prior * self.source_mean + n * mean) / (self.prior + n)
        var = (self.prior * self.source_var + n * var) / (self.prior + n)
        shape = [1, -1] + [1] * (x.dim() - 2)
        out = (x - mean.view(shape)) * (var.view(shape) + self.eps).rsqrt()
        if self.weight is not None:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out


def use_test_batch_norm(model: nn.Module, prior: float = 0.0) -> int:
    """Swap every BatchNorm (found by type, so those inside ResNet `downsample` too)
    for a BatchStatisticsNorm sharing its affine parameters. Returns how many were swapped."""
    swaps = [(name, module) for name, module in model.named_modules() if isinstance(module, _BatchNorm)]
    for name, module in swaps:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, BatchStatisticsNorm(module, prior))
    return len(swaps)
