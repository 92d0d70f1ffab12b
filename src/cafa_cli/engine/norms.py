"""Normalisation layers at test time: which statistics a BatchNorm normalises with (`norm`).

- `batch`: the test batch's own (BN, TENT and CAFA as published);
- `prior:N`: the source running statistics count as N samples mixed with the batch's n
  (Schneider et al. 2020): μ = (N·μ_s + n·μ_t)/(N + n), likewise the variance (the
  batch's unbiased one), which makes batch size 1 usable; as their code
  (bethgelab/robustness, and MEMO's _modified_bn_forward, zhangmarvin/memo
  imagenet-exps/utils/train_helpers.py) computes it, the batch's statistics are those a
  BatchNorm of momentum 1 records, which carry no gradient: it flows through the
  normalised input alone;
- `source`: the source running statistics, frozen: only the affine parameters adapt;
- `ema:M`: running statistics, starting from the source's and moved toward each batch's
  by momentum M, μ ← (1 − M)μ + M·μ_B; the batch is normalised with the moved ones and
  the gradient flows through the batch's part (RoTTA's robust BN, Yuan et al. 2023);
- `class-balanced`: the batch's own statistics, corrected for the batch's class mix so
  that a batch of one class is normalised as a balanced batch under the same shift would
  be (docs/design/class-balanced.md). The class mix is the mean
  prediction of one extra forward pass a batch (no gradient) with running statistics:
  the corrected statistics of the batches so far, averaged (momentum max(0.05, 1/t) at
  the t-th batch), from the source's. It needs each class's moments of every BatchNorm's
  input in the source data (`cafa stats --norm-moments`). A batch whose class mix looks
  i.i.d. is normalised with exactly its own statistics, as `batch`. The correction is
  computed for all the layers at once (ClassBalancedNorms);
- `alpha:A`: α-BN (You et al. 2021, "Test-time batch statistics calibration for covariate
  shift"), a fixed mix of the source's and the batch's statistics, A the batch's share:
  μ = (1 − A)·μ_s + A·μ_B, σ² = (1 − A)·σ_s² + A·σ_B², σ_B² the batch's unbiased variance,
  as the benchmark collection's AlphaBatchNorm (mariodoebler/test-time-adaptation,
  classification/methods/bn.py) computes it: from a BatchNorm's recorded statistics, so no
  gradient flows through the batch's part (until issue 60 it did, here and under prior:N);
- `unmix:K`: UnMix-TNS (Tomar et al., ICLR 2024), K statistics components (μ_k, σ²_k)
  in place of the batch's. They start around the source's: μ_k = μ_s + √(c·K/(K − 1))·σ_s·ε_k
  (ε_k ~ N(0, 1), drawn once from a fixed seed), σ²_k = (1 − c)·σ_s², c = 0.5; K ≥ 2 (with
  one component p_b1 = 1, and each sample would be normalised by its own statistics alone).
  Each sample b, with its own mean m_b and variance v_b over the positions, is assigned
  p_bk = softmax_k(cos(m_b, μ_k)/0.07) (no gradient) and normalised with the K components
  each mixed with it by p_bk:
  μ̃_bk = (1 − p_bk)·μ_k + p_bk·m_b, σ̃²_bk = (1 − p_bk)·σ²_k + p_bk·v_b,
  μ_b = mean_k μ̃_bk, σ²_b = mean_k σ̃²_bk + mean_k μ̃²_bk − μ_b²;
  then the components move toward the samples assigned to them, by BatchNorm's momentum m
  (the layer's own, 0.1 in torchvision and timm): μ_k ← μ_k + m·mean_b p_bk·(m_b − μ_k),
  likewise σ²_k with v_b (devavratTomar/unmixtns, tta_experiments/unmixtns.py). A
  BatchNorm1d normalises with the source statistics, as theirs does.

Every forward pass moves the statistics `ema` and `unmix` keep, from where the pass
before left them, as the authors' UnMixTNS2d.forward and RoTTA's robust BN in train mode
do: a batch that takes several passes (`steps`, SAR's two, ROID's views of the samples it
kept) moves them once for each, in order (until issue 60 each pass moved them from where
they were before the batch, so the batch's last pass alone counted). `class-balanced`
moves once a batch (class_balanced.py).
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from cafa_cli.core.errors import UsageError
from cafa_cli.engine.options import Norm

NORM_LAYERS = (_BatchNorm, nn.LayerNorm, nn.GroupNorm)
# the settings whose layers keep an estimate for serving (BatchStatisticsNorm.frozen)
SERVED = ("batch", "prior", "alpha")
SERVED_MOMENTUM = 0.1  # that estimate's momentum: BatchNorm's own
# unmix:K, the authors' constants (devavratTomar/unmixtns, tta_experiments/unmixtns.py)
UNMIX_SPREAD = 0.5  # c: the share of the source variance that the components' means spread over
UNMIX_TEMPERATURE = 0.07  # of the softmax over the cosine similarities
UNMIX_SEED = 0  # the components' starting noise: drawn from this seed, the same in every run


class BatchStatisticsNorm(nn.Module):
    """A BatchNorm (its affine parameters shared) that normalises with the statistics
    `norm` says (module docstring; a Norm, or its text). Under `class-balanced` it belongs to the
    net's ClassBalancedNorms (`balanced`: class_balanced.py, which makes it), a group that
    normalises its layers together."""

    def __init__(
        self, bn: _BatchNorm, norm: Norm | str = Norm(), name: str = "", generator: torch.Generator | None = None
    ):
        super().__init__()
        self.source_type = type(bn).__name__  # what it replaced (BatchNorm2d), for saying which layers adapt
        self.weight, self.bias, self.eps = bn.weight, bn.bias, bn.eps
        norm = Norm.parse(norm)
        self.kind, value = norm.kind, norm.value
        if bn.running_mean is None and self.kind != "batch":
            raise UsageError(
                f"`norm` {norm} needs the running statistics of every BatchNorm, and the one at {name or 'the top'} "
                f"keeps none (track_running_stats=False); use `norm` batch"
            )
        self.prior = value if self.kind == "prior" else 0.0
        if bn.running_mean is not None:
            self.register_buffer("source_mean", bn.running_mean.detach().clone())
            self.register_buffer("source_var", bn.running_var.detach().clone())
        if self.kind in ("ema", "class-balanced"):  # in the state dict: the Adapter's reset() puts the source's back
            self.register_buffer("running_mean", bn.running_mean.detach().clone().float())
            self.register_buffer("running_var", bn.running_var.detach().clone().float())
        if self.kind == "unmix":  # likewise: reset() puts back where they started
            means, variances = unmix_start(
                bn.running_mean, bn.running_var, int(value), generator or torch.Generator().manual_seed(UNMIX_SEED)
            )
            self.register_buffer("component_means", means)
            self.register_buffer("component_vars", variances)
            value = SERVED_MOMENTUM if bn.momentum is None else bn.momentum  # what the components move by
        if self.kind in ("ema", "alpha", "unmix"):
            # the momentum (alpha: the batch's share) and 1 − it, as device scalars: a Python
            # number would make torch.compile compile again for every value
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
        self.balanced = None  # its ClassBalancedNorms, under `class-balanced`
        self.index = 0  # its place among the balanced layers
        # `batch`: the batch's rows are this many groups (row n·groups + g: group g of sample
        # n), each normalised with its own statistics, as that many forward passes would
        # (CoTTA's augmented views, several in one pass)
        self.groups = 1
        # eval_statistics(): BatchNorm's own running statistics kept besides, moved by the passes
        # within moving_eval_statistics() and normalised with within predicting_in_eval_mode()
        self.eval_momentum = SERVED_MOMENTUM if bn.momentum is None else bn.momentum
        self.moving_eval, self.in_eval = False, False

    def keep_eval_statistics(self) -> None:
        """Keep what a torch BatchNorm in train mode keeps besides, `eval_mean` and `eval_var`
        (buffers, from the source's): AdaContrast's authors train in train mode and predict in
        eval mode with them. A layer that keeps no running statistics keeps none here either."""
        if hasattr(self, "source_mean") and not hasattr(self, "eval_mean"):
            self.register_buffer("eval_mean", self.source_mean.detach().clone().float())
            self.register_buffer("eval_var", self.source_var.detach().clone().float())

    def _kept(self) -> list[torch.Tensor]:
        """The statistics kept from batch to batch (ema, unmix), in the state dict."""
        if self.kind == "unmix":
            return [self.component_means, self.component_vars]
        return [self.running_mean, self.running_var]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "eval_mean"):
            if self.in_eval:
                return nn.functional.batch_norm(
                    x, self.eval_mean, self.eval_var, self.weight, self.bias, training=False, eps=self.eps
                )
            if self.moving_eval and x.numel() > x.shape[1]:  # as train mode moves them (torch refuses one value)
                with torch.no_grad():
                    var, mean = torch.var_mean(x.float(), [0, *range(2, x.dim())], unbiased=True)
                    self.eval_mean.lerp_(mean, self.eval_momentum)
                    self.eval_var.lerp_(var, self.eval_momentum)
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
        if self.kind == "unmix":
            if self.source_type == "BatchNorm1d" or x.dim() == 2:  # the authors' UnMixTNS1d: the source statistics
                return nn.functional.batch_norm(
                    x, self.source_mean, self.source_var, self.weight, self.bias, training=False, eps=self.eps
                )
            return self._unmix(x)
        dims = [0] + list(range(2, x.dim()))
        # in float32 under autocast too, as the fused kernel keeps them: a bf16 mean has ~3
        # significant digits, and an fp16 variance overflows above 65504
        if self.kind in ("prior", "alpha"):
            mean, var = self._mixed(x, dims)
        else:
            var, mean = torch.var_mean(x.float(), dims, unbiased=False)
            mean, var = self._move(mean, var)
        shape = [1, -1] + [1] * (x.dim() - 2)
        out = (x - mean.view(shape)) * (var.view(shape) + self.eps).rsqrt()
        if self.weight is not None:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out

    def frozen(self) -> nn.Module:
        """A plain BatchNorm in eval mode with this layer's affines and the statistics the stream
        arrived at, for serving: `batch` and `prior` their running estimate of the test
        statistics, `alpha` that estimate mixed with the source's as a batch's are, `ema` and
        `class-balanced` their running statistics, `unmix` the mixture of its components (what
        a sample assigned to none would be normalised with), `source` the source's; a layer that
        keeps eval statistics (keep_eval_statistics) those, which its method predicts with."""
        if hasattr(self, "eval_mean"):  # what the method predicts with (keep_eval_statistics)
            mean, var = self.eval_mean, self.eval_var
        elif self.kind in ("ema", "class-balanced"):
            mean, var = self.running_mean, self.running_var
        elif self.kind == "unmix":
            if self.source_type == "BatchNorm1d":
                mean, var = self.source_mean, self.source_var
            else:
                mean = self.component_means.mean(0)
                var = self.component_vars.mean(0) + self.component_means.var(0, unbiased=False)
        elif self.kind == "source" or (self.kind in SERVED and int(self.served_passes) == 0):
            # no test batch seen: the source's (a layer that keeps none normalises as a fresh BatchNorm)
            if hasattr(self, "source_mean"):
                mean, var = self.source_mean, self.source_var
            else:
                mean, var = torch.zeros_like(self.served_mean), torch.ones_like(self.served_var)
        else:
            started = 1 - (1 - SERVED_MOMENTUM) ** int(self.served_passes)  # the share the passes have
            mean, var = self.served_mean / started, self.served_var / started
            if self.kind == "alpha":
                mean = self.keep * self.source_mean + self.rate * mean
                var = self.keep * self.source_var + self.rate * var
        return plain_batch_norm(self.source_type, self.weight, self.bias, mean, var, self.eps)

    def _unmix(self, x: torch.Tensor) -> torch.Tensor:
        """unmix: each sample normalised with the components mixed with it (module docstring),
        then the components moved toward the batch's samples, in place (a replayed step,
        step_graph.py, reads them there).

        The means over the K components are sums of [B, K] @ [K, C] products, not the
        authors' [B, K, C] tensors (128 components of 2048 channels at batch 64 would hold 64
        MB a layer for the backward pass); the same values, computed about the components'
        average c so that the variance is not a difference of large squares."""
        means, variances = self.component_means, self.component_vars
        k = means.shape[0]
        # in float32 under autocast too: the products would otherwise run in bf16
        with torch.autocast(x.device.type, enabled=False):
            var, mean = torch.var_mean(x.float(), list(range(2, x.dim())), unbiased=False)  # each sample's, [B, C]
            with torch.no_grad():
                similarity = nn.functional.normalize(mean, dim=1) @ nn.functional.normalize(means, dim=1).T
                p = (similarity / UNMIX_TEMPERATURE).softmax(1)  # [B, K]
                centre = means.mean(0)
                a = means - centre  # the components about their average: they sum to 0
                rest = 1 - p
            s = mean - centre
            # mean_k μ̃_bk − c = (s_b − Σ_k p_bk·a_k)/K, as Σ_k a_k = 0 and Σ_k p_bk = 1
            shift = (s - p @ a) / k
            # mean_k (μ̃_bk − c)² = [Σ_k (1 − p)²a² + 2·s·Σ_k p(1 − p)a + s²·Σ_k p²]/K
            spread = (rest.square() @ a.square() + 2 * s * ((p * rest) @ a) + s.square() * p.square().sum(1, True)) / k
            # mean_k σ̃²_bk = [Σ_k σ²_k − Σ_k p·σ²_k + v_b]/K
            within = (variances.sum(0) - p @ variances + var) / k
            out_mean, out_var = centre + shift, within + spread - shift.square()
            with torch.no_grad():
                # mean_b p_bk·(m_b − μ_k) = [Σ_b p_bk·s_b − (Σ_b p_bk)·a_k]/B, and likewise for the variances
                assigned, n = p.sum(0).unsqueeze(1), x.shape[0]  # Σ_b p_bk, [K, 1]
                moved = [
                    means + self.rate * (p.T @ s.detach() - assigned * a) / n,
                    variances + self.rate * (p.T @ var.detach() - assigned * variances) / n,
                ]
                torch._foreach_copy_(self._kept(), finite_or(moved, (means, variances)))
        shape = list(out_mean.shape) + [1] * (x.dim() - 2)
        out = (x - out_mean.view(shape)) * (out_var.view(shape) + self.eps).rsqrt()
        if self.weight is not None:
            affine = [1, -1] + [1] * (x.dim() - 2)
            out = out * self.weight.view(affine) + self.bias.view(affine)
        return out

    def _mixed(self, x: torch.Tensor, dims: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """prior, alpha: the source statistics mixed with the batch's, which are what a
        BatchNorm of momentum 1 records, as the authors' layers take them: the unbiased
        variance, and no gradient (it flows through the normalised input alone)."""
        n, count = x.shape[0], x.numel() // x.shape[1]  # count > 1: forward() gave one value a channel the source's
        with torch.no_grad():
            var, mean = torch.var_mean(x.float(), dims, unbiased=False)
            var = var * count / (count - 1)
            self.served_passes += 1  # as the fused kernel moves them for `batch`
            self.served_mean.lerp_(mean.to(self.served_mean.dtype), SERVED_MOMENTUM)
            self.served_var.lerp_(var.to(self.served_var.dtype), SERVED_MOMENTUM)
            if self.kind == "prior":
                return (self.prior * self.source_mean + n * mean) / (self.prior + n), (
                    self.prior * self.source_var + n * var
                ) / (self.prior + n)
            return self.keep * self.source_mean + self.rate * mean, self.keep * self.source_var + self.rate * var

    def _move(self, mean: torch.Tensor, var: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ema: the running statistics moved toward (mean, var): kept, in place, and returned."""
        kept = (self.running_mean, self.running_var)
        moved = moved_statistics(kept, (mean, var), self.keep, self.rate)
        with torch.no_grad():
            torch._foreach_copy_(list(kept), finite_or(moved, kept))
        return moved[0], moved[1]


@contextmanager
def moving_eval_statistics(layers: list[BatchStatisticsNorm]):
    """Within the block the layers' forward passes move their eval statistics toward each
    pass's batch statistics (unbiased variance, the layer's momentum), as a torch BatchNorm in
    train mode does; the passes normalise as they would without it."""
    for layer in layers:
        layer.moving_eval = True
    try:
        yield
    finally:
        for layer in layers:
            layer.moving_eval = False


@contextmanager
def predicting_in_eval_mode(layers: list[BatchStatisticsNorm]):
    """Within the block the layers normalise with their eval statistics, as a torch BatchNorm in eval mode."""
    for layer in layers:
        layer.in_eval = True
    try:
        yield
    finally:
        for layer in layers:
            layer.in_eval = False


def unmix_start(
    mean: torch.Tensor, var: torch.Tensor, components: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """unmix:K's components at the start, [K, channels] each, float32 on the statistics'
    device: the source mean plus noise that spreads them by the share c of the source
    variance, each keeping the rest, so that their mixture has the source's variance (for
    K > 1 in expectation). The noise is drawn on the CPU, the same on every device."""
    mean, var = mean.detach().float(), var.detach().float()
    noise = torch.randn(components, mean.numel(), generator=generator).to(mean.device)
    spread = math.sqrt(UNMIX_SPREAD * components / (components - 1))
    return mean + spread * var.sqrt() * noise, ((1 - UNMIX_SPREAD) * var).expand(components, -1).clone()


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


def use_test_batch_norm(model: nn.Module, norm: Norm | str = Norm()) -> int:
    """Swap every BatchNorm (found by type, so those inside ResNet `downsample` too) for a
    BatchStatisticsNorm sharing its affine parameters. Returns how many were swapped.
    `class-balanced` layers work as one group: class_balanced.use_class_balanced_norms swaps them."""
    norm = Norm.parse(norm)
    if norm.class_balanced:
        raise UsageError(
            "`norm` class-balanced needs the source class moments of every BatchNorm's input; "
            "swap its layers with class_balanced.use_class_balanced_norms(model, class_moments)"
        )
    return len(swap_batch_norms(model, norm))


def swap_batch_norms(model: nn.Module, norm: Norm) -> list[tuple[str, BatchStatisticsNorm]]:
    """use_test_batch_norm's swap: each swapped layer with its name as the bare net names it."""
    swapped = []
    generator = torch.Generator().manual_seed(UNMIX_SEED)  # unmix: the layers' starting noise, in turn
    for name, module in [(name, m) for name, m in model.named_modules() if isinstance(m, _BatchNorm)]:
        swapped.append((name, BatchStatisticsNorm(module, norm, name, generator)))
        replace_submodule(model, name, swapped[-1][1])
    return swapped


def replace_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put `module` where `model` holds the submodule called `name` (as named_modules names it)."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def norm_layers(model: nn.Module) -> list[BatchStatisticsNorm]:
    return [m for m in model.modules() if isinstance(m, BatchStatisticsNorm)]


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
