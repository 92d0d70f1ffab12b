"""CAFA-robust (`cafa-robust`): CAFA's class-aware alignment made safe for the streams a
deployment meets: i.i.d., class-sorted (label shift), Dirichlet-correlated, continual, and
batches of any size down to one image. docs/design/cafa-robust.md (and the pages it links) gives every choice
and the measurement that chose it; reference_robust.py spells the step out in float64.

Normalisation. Every BatchNorm keeps global statistics (μ_g, σ²_g), starting from the
source running statistics, and normalises a batch B of n images with

    μ = (1 − ρ) μ_g + ρ μ_B,    σ² = (1 − ρ) σ²_g + ρ σ²_B,    ρ = n_eff / (n_eff + N₀)

(μ_B, σ²_B the batch's biased statistics; N₀ the prior's weight, Schneider et al.'s prior
with the global statistics in place of the source's). n_eff = n·(1 − s)^p shrinks the
batch's share when its class mix is skewed: s ∈ [0, 1] is the class-balanced correction's
skew strength (class_balanced.correction_strength) of the mean softmax of a first, no-gradient pass
normalised with the global statistics alone. An i.i.d. batch of 200 is normalised 93 % by
its own statistics (as BN), a one-class batch by the global ones, one image mostly by them.
With `mix_reference` B > 0 (off by default; issue 43) s measures the distance from the
stream's typical class mix m_t instead of from uniform: m_0 uniform, then after each batch
m_t = m_{t−1} + (h_t − m_{t−1}) / min(t + B, W), h_t the batch's mean softmax of that pass
and W `mix_window`; a domain the source statistics predict as a few classes for every
batch then stops reading as label shift (docs/design/cafa-robust-second-design.md). With
`entropy_rise` a > 0 (issue 43),
a batch read as skewed (s > 0) is predicted once more, normalised with its own statistics
alone, and its skew is scaled by clamp((ΔH − a)/a, 0, 1), ΔH the rise in its predictions'
mean entropy from the first pass to this one. Centred on its own mean, a batch of few classes
loses what tells them apart and its entropy rises (by 0.2–1.7 nats on the held-out
corruptions, batches of 64 and 200); an i.i.d. batch's hardly moves (at most 0.23), also on
a domain the global statistics get mostly wrong, which the first pass alone reads as skewed.
On such a domain a class-sorted batch rises by 0–1.3, so some of its batches read as i.i.d.

Memory and update. Each image is offered to RoTTA's category-balanced memory bank (CSTU,
memory_bank.py) with its predicted class and entropy; with `memory_expiry` E > 0 (issue 43),
a sample stored for more than E images may give way to one of any class, so that a domain
whose images are predicted as few classes still replaces the last domain's images of the others.
After every `update_every` images (counted over the stream, so at any batch size), one
training step on the bank's M filled slots: normalised as above with ρ = M / (M + N₀) (the
bank is class-balanced, so no gate), the loss is CAFA's, each sample weighted by its
timeliness w(age) (RoTTA's):

    L = Σ_m w(A_m) · log( D_ŷm(z_m) / Σ_c D_c(z_m) ) / M,    ŷ_m = argmax of the same pass

and the global statistics move toward the bank's, μ_g ← (1 − α) μ_g + α μ_bank (likewise
σ²_g), where non-finite values keep the old ones. After each step the trained parameters
move back toward the source's, θ ← (1 − β)θ + βθ⁰ (ROID's weight ensembling), so that a long
stream cannot carry them away. No teacher, no augmentation.

A change of domain (issue 43). The first normalisation layer's input is watched over windows
of `update_every` images: when its per-channel variance jumps between two windows, mean over
channels of ln²(σ²_now / σ²_before) > τ (`change_threshold`), the global statistics return to
the source's and the bank empties, before the batch that completed the window is predicted:
the last domain's statistics and images would otherwise linger. A corruption changes that
variance (noise raises it, blur lowers it) far more than a change of class does
(docs/design/cafa-robust-second-design.md).
The trained parameters then follow `restart_weights`: carried on (the class default), back to
the source's with a new optimiser state, or (`fitter`) whichever of the two gives the batch the
lower CAFA loss, normalised with its own statistics alone: the affines one corruption taught
help some next corruptions and harm others (docs/design/cafa-robust-restarts.md).

Predictions of a skewed batch (issue 43). A batch whose class mix the gate reads as skewed
by s > 0 is reported with LAME's Laplacian correction (methods/shared/laplacian.py, LAME's defaults: rbf
affinity of the features, k = 5) at λ = λ₀·s^q (`laplacian_weight`, `laplacian_power`): the
batch holds few classes, so neighbours in feature space should share one; an i.i.d. batch
(s = 0) is reported as it is.

Defaults (chosen on the four held-out corruptions, docs/design/cafa-robust.md): K = 64 (`memory_size`),
a step every 64 images (`update_every`), α = 0.05 (`statistics_momentum`), N₀ = 16 (`prior`),
p = 8 (`gate_power`), β = 0.01 (`source_pull`), τ = 1 (`change_threshold`), λ₀ = 1
(`laplacian_weight`), q = 4 (`laplacian_power`), λ_t = λ_u = 1 (the bank's); β = τ = λ₀ = 0
give the first design's predictions (issue 30); its recipes (recipes/cafa-robust.toml)
add CAFA's optimiser, rate and batch (Adam, lr 1e-3, batch 200 for CIFAR), the typical mix,
B = 10, a step every 32 images, a = 0.15, E = 320, β = 0.02 and `restart_weights` fitter
(chosen there too). It trains the normalisation affines (`params` norm).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from cafa_cli.core.errors import InputError
from cafa_cli.engine.class_balanced import correction_strength
from cafa_cli.engine.method import AdapterSurface
from cafa_cli.engine.norms import plain_batch_norm, replace_submodule, weighted_statistics
from cafa_cli.engine.optimiser import restart_state
from cafa_cli.engine.options import Option
from cafa_cli.methods.cafa import Cafa
from cafa_cli.methods.shared import losses
from cafa_cli.methods.shared.laplacian import corrected_logits
from cafa_cli.methods.shared.memory_bank import (
    SCHEDULE_OPTIONS,
    SCORE_OPTIONS,
    MemoryBank,
    timeliness_weights,
)
from cafa_cli.methods.shared.teacher_student import follow
from cafa_cli.model.features import FeatureClassifier

MOMENTUM = 0.05  # α
PRIOR = 16.0  # N₀
GATE_POWER = 8.0  # p
MIX_REFERENCE = 0.0  # B: 0 compares a batch's class mix with uniform
MIX_WINDOW = 50  # W
SOURCE_PULL = 0.01  # β
CHANGE_THRESHOLD = 1.0  # τ
LAPLACIAN_WEIGHT = 1.0  # λ₀ (LAME's λ)
LAPLACIAN_POWER = 4.0  # q
ENTROPY_RISE = 0.0  # a: 0 takes the skew from the global statistics' pass alone
MEMORY_EXPIRY = 0  # E: 0 keeps RoTTA's class quota for every stored sample
RESTART_WEIGHTS = ("carry", "source", "fitter")  # what a change of domain does with the trained parameters


class SharedStatisticsNorm(nn.Module):
    """A BatchNorm that normalises with global statistics, or, while `share` is set (a
    float or a device scalar ρ), with (1 − ρ)·global + ρ·the batch's (of the samples
    `weights` marks 1, when set); while `momentum` is set, it also moves the global
    statistics toward the batch's by that much."""

    def __init__(self, bn: _BatchNorm, name: str = ""):
        super().__init__()
        if bn.running_mean is None:
            raise InputError(
                f"cafa-robust needs the running statistics of every BatchNorm, and the one at {name or 'the top'} "
                f"keeps none (track_running_stats=False); use a model trained with them, or another method"
            )
        self.weight, self.bias, self.eps = bn.weight, bn.bias, bn.eps
        self.plain_type = type(
            bn
        ).__name__  # for a plain one of the same kind (frozen); not `source_type`, which says what adapts
        self.register_buffer("global_mean", bn.running_mean.detach().clone().float())
        self.register_buffer("global_var", bn.running_var.detach().clone().float())
        # the source's, for a change of domain (not state: the model's own source values)
        self.register_buffer("source_mean", self.global_mean.clone(), persistent=False)
        self.register_buffer("source_var", self.global_var.clone(), persistent=False)
        self.share: float | torch.Tensor | None = None
        self.weights: torch.Tensor | None = None
        self.momentum: float | None = None
        self.watch: VarianceWatch | None = None  # while set, takes in this layer's input

    def frozen(self) -> nn.Module:
        """A plain eval-mode BatchNorm with these affines and the global statistics the stream
        arrived at, for serving (Adapter.export)."""
        return plain_batch_norm(self.plain_type, self.weight, self.bias, self.global_mean, self.global_var, self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = [1, -1] + [1] * (x.dim() - 2)
        xf = x.float()  # statistics in float32 under autocast too
        if self.watch is not None:
            self.watch.add(xf)
        mean, var = self.global_mean, self.global_var
        if self.share is not None:
            batch_mean, batch_var = self.batch_statistics(xf)
            mean = (1 - self.share) * mean + self.share * batch_mean
            var = (1 - self.share) * var + self.share * batch_var
            if self.momentum is not None:
                self.move(batch_mean.detach(), batch_var.detach())
        out = (xf - mean.view(shape)) * (var.view(shape) + self.eps).rsqrt()
        if self.weight is not None:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out.to(x.dtype)

    def batch_statistics(self, xf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.weights is None:
            dims = [0] + list(range(2, xf.dim()))
            return xf.mean(dims), xf.var(dims, unbiased=False)
        return weighted_statistics(xf, self.weights)

    @torch.no_grad()
    def restart(self) -> None:
        """The global statistics back to the source's."""
        self.global_mean.copy_(self.source_mean)
        self.global_var.copy_(self.source_var)

    @torch.no_grad()
    def move(self, batch_mean: torch.Tensor, batch_var: torch.Tensor) -> None:
        """μ_g ← (1 − α)μ_g + α μ_B, likewise σ²_g; a non-finite batch keeps the old values."""
        for held, new in ((self.global_mean, batch_mean), (self.global_var, batch_var)):
            moved = (1 - self.momentum) * held + self.momentum * new
            held.copy_(torch.where(moved.isfinite(), moved, held))


def variance_jump(variance: torch.Tensor, before: torch.Tensor, eps: float) -> float:
    """The change detector's statistic: the mean over channels of ln² of the ratio of two
    per-channel variances (a host value)."""
    return float(((variance + eps) / (before + eps)).log().square().mean())


class VarianceWatch:
    """The change detector's window: a layer input's per-channel mean and variance over the
    images taken in since the window opened (float64, merged batch by batch), and the variance
    of the window before."""

    def __init__(self, eps: float):
        self.eps = eps
        self.images = 0
        self.count = 0.0  # values per channel taken in
        self.mean: torch.Tensor | None = None
        self.squares: torch.Tensor | None = None  # Σ (x − mean)² per channel
        self.before: torch.Tensor | None = None  # the last closed window's variance
        self.jump: float | None = None  # the last closed window's, for a reader (a host value)

    def add(self, x: torch.Tensor) -> None:
        dims = [0] + list(range(2, x.dim()))
        n = float(x.numel() // x.shape[1])
        mean, var = x.mean(dims).double(), x.var(dims, unbiased=False).double()
        if self.mean is None:
            self.count, self.mean, self.squares = n, mean, var * n
        else:  # Chan et al.'s merge of two sets' means and sums of squares
            total = self.count + n
            delta = mean - self.mean
            self.mean = self.mean + delta * (n / total)
            self.squares = self.squares + var * n + delta.square() * (self.count * n / total)
            self.count = total
        self.images += len(x)

    def closes(self, window: int, threshold: float) -> bool:
        """Whether the window holds `window` images and its variance jumped from the last
        window's by more than `threshold` (it then closes, and the next one opens)."""
        if self.images < window:
            return False
        var = self.squares / self.count
        before, self.before = self.before, var
        self.images, self.count, self.mean, self.squares = 0, 0.0, None, None
        if before is None:
            return False
        self.jump = variance_jump(var, before, self.eps)  # one host read a window
        return self.jump > threshold


class CafaRobust(Cafa):
    name = "cafa-robust"
    owns_update = True
    adapts_normalisation = False  # its own normalisation layers, swapped in by attach()
    takes_labels = False  # its loss is on the bank, whose samples carry no true labels
    predicts_before_update = False  # its layers mix statistics of their own with the batch's: not bn's prediction
    unsaved = (*Cafa.unsaved, "source")  # the trained parameters' source values
    per_batch = (*Cafa.per_batch, "skew", "strength")  # the gate's, for the batch's reported predictions
    reported: tuple | None = None  # the batch's reported logits and features, for its later `steps`
    options = (
        SCHEDULE_OPTIONS
        + (
            Option(
                "statistics_momentum",
                MOMENTUM,
                "α: the global statistics move this far toward the bank's at each step on the bank",
                "fraction",
            ),
            Option("prior", PRIOR, "N₀: a batch of n images gets the share n/(n + N₀) of the statistics", "positive"),
            Option(
                "gate_power",
                GATE_POWER,
                "p: a batch whose class mix is skewed by s counts as n(1 − s)^p images",
                "weight",
            ),
            Option(
                "mix_reference",
                MIX_REFERENCE,
                "B: 0 measures a batch's skew from uniform; above 0, from the stream's typical class mix "
                "(the gate's predictions, averaged from uniform counted as B batches)",
                "weight",
            ),
            Option("mix_window", MIX_WINDOW, "W: the typical class mix averages about the last W batches", "count"),
            Option(
                "entropy_rise",
                ENTROPY_RISE,
                "a: a batch read as skewed is predicted again with its own statistics; unless its mean entropy "
                "rises by 2a or more there (as a batch of few classes does), its skew shrinks, to 0 at a rise of a "
                "(0: never)",
                "weight",
            ),
            Option(
                "source_pull",
                SOURCE_PULL,
                "β: after each step the trained parameters move this far back toward the source's (0: never)",
                "fraction",
            ),
            Option(
                "change_threshold",
                CHANGE_THRESHOLD,
                "τ: a change of domain, when the first BatchNorm's input variance jumps between two windows of "
                "update_every images by more than τ (mean of ln² of the ratio): back to the source statistics and "
                "an empty bank (0: never)",
                "weight",
            ),
            Option(
                "laplacian_weight",
                LAPLACIAN_WEIGHT,
                "λ₀: a batch whose class mix is skewed by s is reported with LAME's correction at λ = λ₀·s^q "
                "(0: never)",
                "weight",
            ),
            Option("laplacian_power", LAPLACIAN_POWER, "q: the power of the skew in LAME's λ", "weight"),
            Option(
                "memory_expiry",
                MEMORY_EXPIRY,
                "E: a sample stored in the bank for more than E images may be replaced by one of any class, "
                "whatever the class quota (0: never)",
                "count0",
            ),
            Option(
                "restart_weights",
                RESTART_WEIGHTS[0],
                "at a change of domain, the trained parameters: carry them on, return to the source's (with a "
                "new optimiser state), or keep whichever of the two gives the batch the lower class-aware loss "
                "(fitter)",
                "choice",
                choices=RESTART_WEIGHTS,
            ),
        )
        + SCORE_OPTIONS
    )

    def setup(self) -> None:
        super().setup()
        self.layers: list[SharedStatisticsNorm] = []
        self.model: FeatureClassifier | None = None
        self.bank: MemoryBank | None = None
        self.offered = 0  # images offered to the bank since the last reset (a host count)
        self.fresh = False  # a new batch, not yet offered (the Adapter's `steps` call update again)
        self.typical_mix: torch.Tensor | None = None  # the gate's mean class mix so far (mix_reference > 0)
        self.gated = 0  # batches the typical mix has taken in
        self.last_mix: torch.Tensor | None = None
        self.skew: torch.Tensor | None = None  # the gate's s of the batch last predicted
        self.strength = 0.0  # LAME's λ for this batch's reported predictions (a host value)
        self.source: list[torch.Tensor] = []  # θ⁰, the trained parameters' source values
        self.watch: VarianceWatch | None = None
        self.domain_changes = 0 if self.change_threshold else None  # since it was made (reset keeps the count)
        self.source_restarts = 0 if self.change_threshold else None  # of those, returns to the source's weights

    def attach(self, model: FeatureClassifier) -> None:
        """Every BatchNorm swapped for a SharedStatisticsNorm (after the parameters are chosen:
        the new layers share them), and an empty bank."""
        self.source = [p.detach().clone() for p in self.params]
        net = model.model  # the bare net: names as its state dict has them
        for name, module in [(name, module) for name, module in net.named_modules() if isinstance(module, _BatchNorm)]:
            replace_submodule(net, name, SharedStatisticsNorm(module, name))
        self.layers = [m for m in net.modules() if isinstance(m, SharedStatisticsNorm)]
        if not self.layers:  # its gate and its restarts read the global statistics of BatchNorms
            raise InputError(
                "cafa-robust shares BatchNorm statistics between the batch and a global estimate, and the model has "
                "no BatchNorm layers (a ViT or CLIP's LayerNorms); use `method` cafa"
            )
        self.model = model
        self.bank = MemoryBank(model.num_classes, self.memory_size, self.lambda_t, self.lambda_u, self.memory_expiry)
        self.watch = VarianceWatch(self.layers[0].eps) if self.change_threshold and self.layers else None

    def reset(self) -> None:
        """An empty bank (the Adapter has put the source's weights and statistics back)."""
        self.offered = 0
        self.typical_mix, self.gated = None, 0
        self.skew, self.strength = None, 0.0
        if self.bank is not None:
            self.bank.reset()
        if self.watch is not None:
            self.watch = VarianceWatch(self.watch.eps)

    def before_step(self, images: torch.Tensor) -> None:
        self.fresh = True

    def normalising(self, share=None, weights: torch.Tensor | None = None, momentum: float | None = None) -> None:
        for layer in self.layers:
            layer.share, layer.weights, layer.momentum = share, weights, momentum

    def batch_share(self, adapter, images: torch.Tensor, watch: VarianceWatch | None = None) -> torch.Tensor:
        """ρ of the batch (a device scalar), from the class mix the global statistics predict
        (a pass that also feeds `watch`, the change detector's window, when given)."""
        self.layers[0].watch = watch
        try:
            with adapter.autocast:
                logits, _ = self.model(images)
        finally:
            self.layers[0].watch = None
        mix = self.last_mix = logits.float().softmax(1).mean(0)
        if self.mix_reference and self.typical_mix is None:
            self.typical_mix = torch.full_like(mix, 1 / len(mix))
        skew = correction_strength(mix, len(images), self.typical_mix if self.mix_reference else None)
        if self.entropy_rise and float(skew) > 0:  # one host read; an unskewed batch needs no second pass
            skew = skew * self.few_classes(adapter, images, logits)
        self.skew = skew
        n_eff = len(images) * (1 - skew) ** self.gate_power
        return n_eff / (n_eff + self.prior)

    def few_classes(self, adapter, images: torch.Tensor, global_logits: torch.Tensor) -> torch.Tensor:
        """How surely a batch read as skewed holds few classes (a device scalar in [0, 1]): its
        predictions normalised with its own statistics alone, against `global_logits`, are
        less certain by ΔH nats of mean entropy; clamp((ΔH − a)/a, 0, 1)."""
        own_logits, _ = self.own_statistics_pass(adapter, images)
        rise = losses.entropy(own_logits.float()) - losses.entropy(global_logits.float())
        return ((rise - self.entropy_rise) / self.entropy_rise).clamp(0, 1)

    def own_statistics_pass(self, adapter, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's logits and features normalised with its own statistics alone."""
        self.normalising(1.0)
        try:
            with adapter.autocast:
                return self.model(images)
        finally:
            self.normalising()

    def predict(self, adapter, images: torch.Tensor, watching: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's logits and features (no gradient), normalised with its share ρ; while
        `watching`, the gate's pass also feeds the change detector, and a change of domain
        restarts the statistics and the bank before the batch is predicted."""
        watch = self.watch if watching else None
        try:
            with torch.no_grad():  # the layers are left normalising with the global statistics (finally)
                share = self.batch_share(adapter, images, watch)
                if watch is not None and watch.closes(self.update_every, self.change_threshold):
                    self.restart(adapter, images)
                    share = self.batch_share(adapter, images)
                self.normalising(share)
                with adapter.autocast:
                    logits, features = self.model(images)
        finally:
            self.normalising()
        return logits.float(), features.float()

    def output(self, logits: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The batch's logits, or, when the gate read its class mix as skewed, LAME's
        correction of them at λ = λ₀·s^q."""
        return corrected_logits(logits, features, self.strength) if self.strength else logits

    @torch.no_grad()
    def restart(self, adapter: AdapterSurface, images: torch.Tensor) -> None:
        """A change of domain, seen at `images`: the source statistics, an empty bank, and the
        trained parameters as `restart_weights` says."""
        for layer in self.layers:
            layer.restart()
        self.bank.reset()
        self.domain_changes += 1
        if self.restart_weights == "carry":
            return
        fitter = self.restart_weights == "fitter"
        if fitter:
            carried = [p.clone() for p in self.params]
            carried_loss = self.alignment_loss(adapter, images)
        torch._foreach_copy_(self.params, self.source)
        if fitter and self.alignment_loss(adapter, images) >= carried_loss:
            torch._foreach_copy_(self.params, carried)  # the carried ones fit the new domain at least as well
        else:
            restart_state(adapter.optimizer)
            self.source_restarts += 1

    def alignment_loss(self, adapter, images: torch.Tensor) -> float:
        """CAFA's loss of the batch normalised with its own statistics alone (a host value): how
        far the current parameters leave its features from the source's class-conditionals."""
        logits, features = self.own_statistics_pass(adapter, images)
        return float(losses.cafa_terms(self.distances(features.float()), logits.float().argmax(1)).mean())

    def reporting_network(self, adapter: AdapterSurface) -> nn.Module:
        return SharedPrediction(self, adapter)

    def update(self, adapter: AdapterSurface, images: torch.Tensor, skipped: torch.Tensor | None):
        if not self.fresh:  # the Adapter's later `steps` on this batch: taken on the bank already
            return self.reported + (skipped,)
        self.fresh = False
        logits, features = self.reported = self.predict(adapter, images, watching=True)
        # LAME's λ for `output`, read here, where it waits for no more work than the bank's read below
        self.strength = 0.0
        if self.laplacian_weight and len(images) > 1:
            self.strength = self.laplacian_weight * float(self.skew) ** self.laplacian_power
        if self.mix_reference:  # after the batch's own gate: it is compared with the batches before it
            self.gated += 1
            weight = 1 / min(self.gated + self.mix_reference, self.mix_window)
            self.typical_mix += weight * (self.last_mix - self.typical_mix)
        probabilities = logits.softmax(1)
        uncertainties = -(probabilities * (probabilities + 1e-6).log()).sum(1)
        flag = skipped
        for _ in self.bank.offer(images, probabilities.argmax(1), uncertainties, self.offered, self.update_every):
            flag = self.train_on_bank(adapter, flag)
        self.offered += len(images)
        return logits, features, flag

    def train_on_bank(self, adapter, flag: torch.Tensor | None) -> torch.Tensor:
        """`steps` optimiser steps on the bank; the first moves the global statistics."""
        bank = self.bank
        filled = bank.occupied.float()
        weights = timeliness_weights(bank.ages) * filled
        held = bank.filled  # a host count
        for step in range(adapter.steps):
            try:
                self.normalising(held / (held + self.prior), filled, self.statistics_momentum if step == 0 else None)
                with adapter.autocast:
                    logits, features = adapter.forward(bank.samples)
            finally:
                self.normalising()
            terms = losses.cafa_terms(self.distances(features.float()), logits.detach().argmax(1))
            flag = adapter.apply((terms * weights).sum() / filled.sum().clamp_min(1), flag)
            if self.source_pull:  # θ ← (1 − β)θ + βθ⁰, after a left-out step too (as ROID's)
                follow(self.params, self.source, 1 - self.source_pull)
        return flag


class SharedPrediction(nn.Module):
    """The model as cafa-robust predicts with it (its gate, then the batch's share of the
    statistics), for Adapter.features: the state is the model's."""

    def __init__(self, method: CafaRobust, adapter):
        super().__init__()
        self.model, self.method, self.adapter = method.model, method, adapter

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.method.predict(self.adapter, images)
