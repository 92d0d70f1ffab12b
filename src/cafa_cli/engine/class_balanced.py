"""`norm` class-balanced (norms.py's module docstring): the batch's own statistics corrected
for the batch's class mix, computed for all the BatchNorms at once (ClassBalancedNorms),
and the corrections' arithmetic. docs/design/class-balanced.md says why.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from functools import lru_cache

import torch
from torch import nn

from cafa_cli.core.errors import UsageError
from cafa_cli.engine.norms import BatchStatisticsNorm, finite_or, moved_statistics, swap_batch_norms
from cafa_cli.engine.options import Norm

BALANCED_MOMENTUM = 0.05  # class-balanced: the momentum once 1/t falls below it (RoTTA's α)
# class-balanced: how far a batch's class histogram must be from uniform (as a share of the
# way from what an i.i.d. batch of its size shows to one class alone) before its correction
# starts, and where it is whole; chosen on the held-out corruptions (docs/design/class-balanced.md)
SKEW_START, SKEW_FULL = 0.25, 0.65


class ClassBalancedNorms:
    """`class-balanced` (module docstring) for every swapped BatchNorm of a net at once. A
    batch's correction is the same few maps in every layer, so they run once on the
    layers' channels laid end to end ([Σ channels] tensors) instead of once a layer: a
    step then launches about what a plain step launches, where 53 layers × a dozen small
    operators left a GPU waiting on the host. Hooks on the net bracket each forward pass:
    the layers' batch statistics land in one flat tensor, and after the pass the running
    statistics move toward the batch's corrected ones, all layers together.

    Per layer the correction is a change of the affine parameters of the fused kernel
    (so no batch statistic is needed for it): with r = √((v_h + ε)/(σ̄² + ε)) and δ = μ̄ − m_h,
        (x − μ)/√(σ² + ε) = r·(x − μ_B)/√(σ²_B + ε) − δ/√(σ̄² + ε),
    where μ, σ² are the corrected statistics (balanced_statistics), m_h, v_h the source
    moments of the batch's class mix and μ̄, σ̄² those of a balanced one."""

    def __init__(
        self, net: nn.Module, layers: list[BatchStatisticsNorm], moments: list[tuple[torch.Tensor, torch.Tensor]]
    ):
        self.layers, self.sizes = layers, [layer.running_mean.numel() for layer in layers]
        device = layers[0].running_mean.device
        means = [m.detach().float().to(device) for m, _ in moments]
        seconds = [v.detach().float().to(device) + m.square() for m, v in zip(means, (v for _, v in moments))]  # E[x²]
        # each layer's own, then laid end to end: a mean over the classes of a wider table rounds differently
        self.class_means, self.class_second = torch.cat(means, 1), torch.cat(seconds, 1)
        self.balanced_mean = torch.cat([m.mean(0) for m in means])
        self.balanced_var = torch.cat(
            [(second.mean(0) - m.mean(0).square()).clamp_min(0) for m, second in zip(means, seconds)]
        )
        self.eps = torch.cat([torch.full((n,), layer.eps, device=device) for n, layer in zip(self.sizes, layers)])
        self.spread = (self.balanced_var + self.eps).rsqrt()
        # the fused kernels write each layer's batch mean and (unbiased) variance into its part
        self.batch_mean, self.batch_var = torch.zeros_like(self.eps), torch.zeros_like(self.eps)
        self.outputs = list(zip(self.batch_mean.split(self.sizes), self.batch_var.split(self.sizes)))
        # a layer without affine parameters: 1 and 0 stand in
        self.affine_parts = [
            (layer.weight, layer.bias)
            if layer.weight is not None
            else (torch.ones(n, device=device), torch.zeros(n, device=device))
            for n, layer in zip(self.sizes, layers)
        ]
        # the t-th batch's momentum max(0.05, 1/t) and 1 − it, read from this table by the batch
        # count, which is kept on the device: the step that reads them is the same at every
        # batch, so that a CUDA graph may replay it (step_graph.py)
        rates = [max(BALANCED_MOMENTUM, 1 / t) for t in range(1, math.ceil(1 / BALANCED_MOMENTUM) + 1)]
        self.schedule = torch.tensor([rates, [1 - rate for rate in rates]], device=device)  # [2, 20]: from then on 0.05
        self.count = torch.zeros((), dtype=torch.int64, device=device)  # batches so far
        self._unbias: dict[tuple[int, ...], torch.Tensor] = {}
        self.counts = [0] * len(layers)  # values a channel in each layer's input this pass
        for index, layer in enumerate(layers):
            layer.balanced, layer.index = self, index
        self.start()
        net.register_forward_pre_hook(self._pass_starts)
        net.register_forward_hook(self._pass_ends)

    def start(self) -> None:
        """A new stream (the Adapter's reset() puts back the running statistics)."""
        self.count.zero_()
        self.before = (torch.empty_like(self.eps), torch.empty_like(self.eps))
        self.histogram, self.begun = None, False  # begun: new_batch() was called in this stream
        self.predicting, self.affines, self.mix, self.fell_back = False, None, None, set()

    def saved(self) -> tuple:
        """What a batch's passes change here, copied (the running statistics are the layers' buffers)."""
        return (
            self.count.clone(),
            tuple(t.clone() for t in self.before),
            None if self.histogram is None else self.histogram.clone(),
            self.begun,
        )

    def restore(self, saved: tuple) -> None:
        """As it was when saved() was called, in the same tensors."""
        count, before, histogram, self.begun = saved
        torch._foreach_copy_([self.count, *self.before], [count, *before])
        if histogram is None:
            self.histogram = None
        else:
            self.set_histogram(histogram)

    @property
    def batches(self) -> int:
        """The batches of this stream so far (reading it waits for the device)."""
        return int(self.count)

    def new_batch(self) -> None:
        """The next forward passes are of a new batch: the running statistics move once a
        batch, from where they are now, with momentum max(0.05, 1/t) at the t-th."""
        self.count += 1
        self.begun = True
        for before, attribute in zip(self.before, ("running_mean", "running_var")):
            torch.cat([getattr(layer, attribute) for layer in self.layers], out=before)

    def _momentum(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This batch's 1 − momentum and momentum, device scalars (BatchStatisticsNorm's keep and rate)."""
        step = (self.count - 1).clamp_max(self.schedule.shape[1] - 1).reshape(1)
        rate, keep = self.schedule.index_select(1, step).reshape(2).unbind()
        return keep, rate

    def set_histogram(self, histogram: torch.Tensor) -> None:
        """The class shares of the batch the next passes correct for (balance_histogram's), kept in one tensor."""
        if self.histogram is None or self.histogram.shape != histogram.shape:
            self.histogram = histogram.clone()
        else:
            self.histogram.copy_(histogram)

    @contextmanager
    def predicting_with_running_statistics(self):
        """Forward passes that normalise with the running statistics as they are (to find the
        batch's class mix) and leave them so."""
        self.predicting = True
        try:
            yield
        finally:
            self.predicting = False

    def normalise(self, layer: BatchStatisticsNorm, x: torch.Tensor) -> torch.Tensor:
        if self.predicting:
            return nn.functional.batch_norm(
                x, layer.running_mean, layer.running_var, layer.weight, layer.bias, training=False, eps=layer.eps
            )
        if self.affines is None:  # a pass the hooks did not start (a layer called on its own)
            self._prepare()
        weight, bias = self.affines[layer.index]
        batch_mean, batch_var = self.outputs[layer.index]
        self.counts[layer.index] = x.numel() // x.shape[1]
        return nn.functional.batch_norm(
            x, batch_mean, batch_var, weight, bias, training=True, momentum=1.0, eps=layer.eps
        )

    def _pass_starts(self, module, inputs) -> None:
        if not self.predicting:
            self._prepare()

    def _prepare(self) -> None:
        """This pass's affine parameters of every layer (they carry the gradient to the
        shared ones), for the batch's class mix."""
        self.mix = class_mix_moments(
            self.histogram, self.class_means, self.class_second, self.balanced_mean, self.balanced_var
        )
        mix_mean, mix_var = self.mix
        scale, shift = (mix_var + self.eps).sqrt() * self.spread, (self.balanced_mean - mix_mean) * self.spread
        weight, bias = (torch.cat(part) for part in zip(*self.affine_parts))
        weights, biases = (weight * scale).split(self.sizes), (bias - weight * shift).split(self.sizes)
        self.affines = list(zip(weights, biases))
        torch._foreach_zero_(
            [self.batch_mean, self.batch_var]
        )  # a non-finite batch's leftovers would stay: 0·NaN is NaN
        self.fell_back = set()

    def _pass_ends(self, module, inputs, output) -> None:
        """The running statistics of every layer, from before this batch, moved toward the
        batch's corrected statistics (the batch's own without a class mix); a layer that
        fell back to the source's keeps its own."""
        if self.predicting or self.affines is None:
            return
        mix, self.affines, self.mix = self.mix, None, None  # nor their graph kept to the next pass
        if not self.begun:  # used outside an Adapter, which calls new_batch()
            self.new_batch()
        with torch.no_grad():
            mean, var = self.batch_mean, self.batch_var * self._unbiasing()
            if self.histogram is not None:
                mean, var = balanced_statistics(mean, var, *mix, self.balanced_mean, self.balanced_var, self.eps)
            moved = finite_or(moved_statistics(self.before, (mean, var), *self._momentum()), self.before)
            for kept, new in zip(self.before, moved):
                for index in self.fell_back:
                    new.split(self.sizes)[index].copy_(kept.split(self.sizes)[index])
            for attribute, new in zip(("running_mean", "running_var"), moved):
                torch._foreach_copy_([getattr(layer, attribute) for layer in self.layers], new.split(self.sizes))

    def _unbiasing(self) -> torch.Tensor:
        """(n − 1)/n of each channel, n the values a channel of its layer's input this pass:
        the kernel's variance is the unbiased one."""
        counts = tuple(self.counts)
        if counts not in self._unbias:  # the same for every batch of one size
            factors = [(n - 1) / n if n else 1.0 for n in counts]
            self._unbias[counts] = torch.cat(
                [torch.full((size,), f, device=self.eps.device) for size, f in zip(self.sizes, factors)]
            )
        return self._unbias[counts]


def use_class_balanced_norms(model: nn.Module, class_moments: dict | None) -> int:
    """norms.use_test_batch_norm under `class-balanced`: the swapped layers joined in one
    ClassBalancedNorms. `class_moments`: {layer name as the bare net names it: (means,
    variances)} of each BatchNorm's input per source class. Returns how many were swapped."""
    names = [name for name, module in model.named_modules() if isinstance(module, nn.modules.batchnorm._BatchNorm)]
    missing = [name for name in names if name not in (class_moments or {})]
    if missing:
        lacking = "none are" if len(missing) == len(names) else f"{len(missing)} layer(s) lack them, e.g. {missing[0]},"
        raise UsageError(
            f"`norm` class-balanced needs the source class moments of every BatchNorm's input, and {lacking} "
            f"given; make the statistics with cafa stats --norm-moments"
        )
    swapped = swap_batch_norms(model, Norm("class-balanced"))
    if swapped:
        layers = [layer for _, layer in swapped]
        ClassBalancedNorms(
            model, layers, [checked_moments(class_moments[name], layer, name) for name, layer in swapped]
        )
    return len(swapped)


def class_balanced_norms(model: nn.Module) -> ClassBalancedNorms | None:
    """The ClassBalancedNorms of a net whose BatchNorms use_class_balanced_norms swapped."""
    return next((m.balanced for m in model.modules() if isinstance(m, BatchStatisticsNorm) and m.balanced), None)


def balanced_statistics(
    mean: torch.Tensor,
    var: torch.Tensor,
    m_h: torch.Tensor,
    v_h: torch.Tensor,
    balanced_mean: torch.Tensor,
    balanced_var: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's statistics (mean, var [channels]) as a class-balanced batch under the same
    covariate shift would have them (docs/design/class-balanced.md). The source's moments of a batch of
    its class mix are m_h and v_h (class_mix_moments); read the batch's as an affine change
    of those, a = √((σ²_B + ε)/(v_h + ε)) and μ_B − a·m_h, and apply the change to the
    balanced source moments μ̄, σ̄²:
        μ = μ_B + a·(μ̄ − m_h),   σ² = a²·(σ̄² + ε) − ε.
    With a uniform mix they are the batch's own."""
    scale = ((var + eps) / (v_h + eps)).sqrt()
    return mean + scale * (balanced_mean - m_h), (scale.square() * (balanced_var + eps) - eps).clamp_min(0)


def class_mix_moments(
    histogram: torch.Tensor | None,
    class_means: torch.Tensor,
    class_second: torch.Tensor,
    balanced_mean: torch.Tensor,
    balanced_var: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(m_h, v_h): the source's mean and variance of a batch with class shares h (None:
    uniform), m_h = Σ h_k μ_k and v_h = Σ h_k E_k[x²] − m_h². h carries no gradient."""
    if histogram is None:
        return balanced_mean, balanced_var
    h = histogram.detach().to(class_means.dtype)
    m_h = h @ class_means
    return m_h, (h @ class_second - m_h.square()).clamp_min(0)


def correction_strength(
    histogram: torch.Tensor, batch_size: int, reference: torch.Tensor | None = None
) -> torch.Tensor:
    """How much of the class-mix correction a batch gets, in [0, 1] (a device scalar). The
    batch's skew is its histogram's total-variation distance from uniform (or from
    `reference`, a class mix the batch is compared with), as a share of the way from what an
    i.i.d. batch of this size shows (sampling noise alone) to a batch of one class; 0 below
    SKEW_START, 1 from SKEW_FULL, linear between."""
    c = histogram.numel()
    distance = 0.5 * (histogram - (1 / c if reference is None else reference)).abs().sum()
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
    log_pmf = (
        torch.lgamma(torch.tensor(n + 1.0))
        - torch.lgamma(k + 1)
        - torch.lgamma(n - k + 1)
        + k * math.log(p)
        + (n - k) * math.log1p(-p)
    )
    return float(0.5 * classes * (log_pmf.exp() * (k / n - p).abs()).sum())


def balance_histogram(histogram: torch.Tensor, batch_size: int) -> torch.Tensor:
    """The class shares the correction uses: the histogram drawn toward uniform by 1 − its strength."""
    strength = correction_strength(histogram, batch_size)
    return strength * histogram + (1 - strength) / histogram.numel()


def checked_moments(
    moments: tuple[torch.Tensor, torch.Tensor], layer: BatchStatisticsNorm, name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(means, variances) of the layer's input per source class, each [C, channels], or a UsageError."""
    means, variances = moments
    if means.shape != variances.shape or means.dim() != 2 or means.shape[1] != layer.running_mean.numel():
        raise UsageError(
            f"the class moments of the BatchNorm at {name or 'the top'} are {list(means.shape)}, not "
            f"[classes, {layer.running_mean.numel()}]; compute them with this model (cafa stats --norm-moments)"
        )
    return means, variances
