"""SPA: self-bootstrapping with deteriorated views (Niu et al., "Self-Bootstrapping for Versatile
Test-Time Adaptation", ICML 2025; the authors' mr-eggplant/SPA tta_library/spa.py,
models/byol_wrapper.py, models/maskers.py and main.py).

Update rule: the normalisation affines (BatchNorms on the test batch's statistics) and a
predictor P, a d×d linear layer without bias that starts as the identity, inserted between the
features and the classifier for the deteriorated views only (the authors' BYOLWrapper). For
each batch x, logits s = f(x) (the prediction reported, made before the update), and two views
of x that keep its geometry:

1. x_F, its low-frequency amplitudes masked at random: in the centred spectrum of each image
   and channel, the central ⌊0.2·H⌋ × ⌊0.2·W⌋ square of amplitudes is kept with probability
   1 − `frequency_mask`, point-symmetrically (the upper half's draws mirrored onto the lower
   half, so the spectrum stays Hermitian), the rest kept, the phase unchanged:
   x_F = Re IFFT(mask · FFT(x));
2. x_N, noise injected with a learnt strength: the image cut into `patch_size` squares, patch
   k mixed as (1 − α_k²)·x + α_k²·v with v ~ N(0, 1) (one draw per pixel and channel, the
   same for every image of the batch), clipped to [−1, 1] as the authors' (their ViT's input
   range; their ResNet's too);

with s_V = head(P(z_V)) a view's logits through the predictor, each view is pulled toward the
prediction on x where that prediction is the more confident one:

    L_V = (1/|S_V|) Σ_{n∈S_V} KL(softmax(s_n) ‖ softmax(s_V,n)),   S_V = {n : max p(x_n) > max p(x_V,n)}

(the target softmax(s) carries no gradient; 0 where S_V is empty, where the authors' mean over
no sample is NaN and their step goes on with zero gradients), and one optimiser step on

    L = L_F + L_N + 0.1 · L_base,

L_base by `base`: none (the authors' `spa`), tent (the mean entropy of s), eta (ETA's
selected and weighted entropy, shared/selection.py, its moving mean cleared at each reset as
the authors' SPA does) or eata (ETA's loss and EATA's Fisher term, shared/fisher.py, both
inside the 0.1, from `fisher_batches`; without them eata runs as eta). The predictor steps at `predictor_rate` times
the rate (the authors' second parameter group: 0.05 against 0.01 on ViT-B/16, 0.025 against
0.0025 on ResNet-50-GN), by its gradient scaled so before the optimiser's step: the same step
under sgd and nesterov (linear in the gradient), none under adam and adamw (which divide the
scale out). The noise strengths α ascend the gradient of L (SGD, rate 1, momentum 0.9, their
own optimiser), then are rescaled so that mean α² = `noise`, and clipped to [−1, 1].

A reset puts the predictor back to the identity (with the weights), α back to √`noise` and its
momentum to none, and clears ETA's moving mean. The grid of α is made at the first batch after
a reset, from its image size (⌈H/P⌉ × ⌈W/P⌉, the last row and column of patches cut by the
image's edge where P does not divide it; the authors' needs it to). The views' draws come from
torch's generator through keep_draws and noise_draws (tests replace them), so a step is not
replayed as a CUDA graph.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from cafa_cli.engine.method import AdapterSurface, Method
from cafa_cli.engine.options import Option
from cafa_cli.methods.shared import losses
from cafa_cli.methods.shared.fisher import FISHER_ALPHA, fisher_information, fisher_penalty
from cafa_cli.methods.shared.selection import SELECTION_OPTIONS, Selection
from cafa_cli.model.features import FeatureClassifier

BASES = ("none", "tent", "eta", "eata")  # main.py's spa, spa+tent, spa+eta, spa+eata
BASE_WEIGHT = 0.1  # get_auxiliary_loss: 0.1 · the base method's loss
LOW_FREQUENCIES = 0.2  # Prompt(prompt_alpha=0.2): the side of the masked square, a share of the image's
NOISE_RATE, NOISE_MOMENTUM = 1.0, 0.9  # the noise strengths' own SGD (patch_optimizer)
# main.py's ViT-B/16 setting (the ResNet-50-GN one: 0.1, 0.1 and 10)
NOISE, FREQUENCY_MASK, PREDICTOR_RATE, PATCH_SIZE = 0.4, 0.2, 5.0, 16


def keep_draws(shape: tuple[int, ...], keep: float, like: torch.Tensor) -> torch.Tensor:
    """Which low-frequency amplitudes a view keeps: 1 with probability `keep`, else 0."""
    return torch.empty(shape, dtype=like.dtype, device=like.device).bernoulli_(keep)


def noise_draws(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """The noise the noisy view mixes in, one standard normal value per pixel and channel."""
    return torch.randn(shape, dtype=like.dtype, device=like.device)


def low_frequency_masked(images: torch.Tensor, keep: float) -> torch.Tensor:
    """The images with their low-frequency amplitudes masked at random (module docstring, 1)."""
    height, width = images.shape[-2:]
    rows, columns = max(int(height * LOW_FREQUENCIES), 1), max(int(width * LOW_FREQUENCIES), 1)
    top, left = height - (height - rows) // 2 - rows, width - (width - columns) // 2 - columns
    mask = torch.ones_like(images)
    mask[..., top : top + rows, left : left + columns] = keep_draws((*images.shape[:-2], rows, columns), keep, images)
    mask = point_symmetric(mask)
    spectrum = torch.fft.fft2(images) * torch.fft.ifftshift(mask, dim=(-2, -1))
    return torch.fft.ifft2(spectrum).real


def point_symmetric(mask: torch.Tensor) -> torch.Tensor:
    """A centred spectrum's mask made symmetric about the zero frequency: the upper half (and the
    centre row's right half) as drawn, mirrored onto the rest. An even side's first row or column
    (the Nyquist frequency) has no mirror and stays as it is."""
    top, left = 1 - mask.shape[-2] % 2, 1 - mask.shape[-1] % 2
    inner = mask[..., top:, left:].clone()
    middle_row, middle_column = inner.shape[-2] // 2, inner.shape[-1] // 2
    inner[..., middle_row + 1 :, :] = 1
    inner[..., middle_row, :middle_column] = 1
    mask[..., top:, left:] = inner * inner.flip(-2, -1)
    return mask


def noisy(images: torch.Tensor, strengths: torch.Tensor, patch_size: int) -> torch.Tensor:
    """The images mixed with noise, patch k by α_k², and clipped to [−1, 1] (module docstring, 2);
    `strengths` α holds one value per patch, by rows."""
    height, width = images.shape[-2:]
    grid = strengths.square().view(math.ceil(height / patch_size), math.ceil(width / patch_size))
    share = grid.repeat_interleave(patch_size, 0).repeat_interleave(patch_size, 1)[:height, :width]
    return ((1 - share) * images + share * noise_draws(tuple(images.shape[1:]), images)).clamp(-1, 1)


def consistency(viewed: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(softmax(s) ‖ softmax(s_V)) averaged over the samples whose prediction on the image is
    more confident than on its view (0 when there is none); the target carries no gradient."""
    target = logits.detach().softmax(1)
    chosen = target.amax(1) > viewed.detach().softmax(1).amax(1)
    divergence = F.kl_div(viewed.log_softmax(1), target, reduction="none").sum(1)
    return (divergence * chosen).sum() / chosen.sum().clamp_min(1)


class Spa(Method):
    name = "spa"
    owns_update = True  # three forward passes a step, and the noise strengths' own ascent
    draws_random_numbers = True  # the views' masks and noise, from torch's generator
    predicts_before_update = True
    running_norms = "its two views pass through the BatchNorms each step, which would move their running statistics"
    options = (
        Option(
            "base", "none", "another method's loss added at weight 0.1 (the authors' spa+tent, ...)", "choice", BASES
        ),
        Option("noise", NOISE, "the mean share α² of noise in the noisy view", "fraction"),
        Option("frequency_mask", FREQUENCY_MASK, "the share of the low-frequency amplitudes masked", "fraction"),
        Option(
            "predictor_rate",
            PREDICTOR_RATE,
            "the predictor's learning rate as a multiple of `lr` (sgd and nesterov; adam divides it out)",
            "positive",
        ),
        Option(
            "patch_size",
            PATCH_SIZE,
            "the side in pixels of the squares whose noise strength is learnt",
            "count",
            most=4096,
        ),
        *SELECTION_OPTIONS,
        Option("fisher_alpha", FISHER_ALPHA, "β, the weight of the Fisher term (base eata)", "weight"),
    )
    inputs = ("fisher_batches",)  # normalised clean source images, for base eata's Fisher term
    without_source_images = "runs base eata as eta: its Fisher term needs clean source images"
    fingerprinted = (*Method.fingerprinted, "fisher")  # base eata's, from clean images: made once
    unsaved = (*Method.unsaved, "without_source_images")

    def setup(self) -> None:
        if self.base != "eata":  # a run of another base takes no source images, and needs no warning
            self.without_source_images = None
        self.selection = Selection(self.entropy_margin, self.redundancy_margin)
        self.fisher: list[torch.Tensor] | None = None
        self.anchor: list[torch.Tensor] = []
        self.predictor: nn.Linear | None = None
        self.reset()

    def parameters(self, model: FeatureClassifier, which: str = "norm") -> list[nn.Parameter]:
        """The normalisation affines (or, with `all`, the feature extractor), then the predictor's
        weight, which the same optimiser trains (its rate: after_backward's scale)."""
        return [*super().parameters(model, which), self.predictor.weight]

    def attach(self, model: FeatureClassifier) -> None:
        """The predictor, and base eata's Fisher information at the source weights (of the
        normalisation affines alone, as the authors' get_fisher)."""
        weight = model.classifier.weight
        self.predictor = nn.Linear(model.feature_dim, model.feature_dim, bias=False).to(weight.device, weight.dtype)
        with torch.no_grad():
            self.predictor.weight.copy_(torch.eye(model.feature_dim))
        if self.base == "eata" and self.fisher_batches is not None:
            self.fisher = fisher_information(model, self.params, self.fisher_batches, weight.device)
            self.anchor = [p.detach().clone() for p in self.params]

    def reset(self) -> None:
        self.strengths: torch.Tensor | None = None  # α, made from the first batch's image size
        self.velocity: torch.Tensor | None = None  # α's momentum
        self.selection.reset()
        if self.predictor is not None:
            with torch.no_grad():
                self.predictor.weight.copy_(torch.eye(len(self.predictor.weight)))

    def update(self, adapter: AdapterSurface, images: torch.Tensor, skipped: torch.Tensor | None):
        cells = math.ceil(images.shape[-2] / self.patch_size) * math.ceil(images.shape[-1] / self.patch_size)
        if self.strengths is None or len(self.strengths) != cells:  # a new grid for another image size
            self.strengths = torch.full((cells,), math.sqrt(self.noise), dtype=images.dtype, device=images.device)
            self.velocity = torch.full_like(self.strengths, -0.0)  # as start_state's: its first step is the gradient
        strengths = self.strengths.clone().requires_grad_(True)
        masked = low_frequency_masked(images, 1 - self.frequency_mask)
        mixed = noisy(images, strengths, self.patch_size)
        with adapter.autocast:
            logits, features = adapter.forward(images)
            viewed = [adapter.model.head(self.predictor(adapter.forward(view)[1])) for view in (masked, mixed)]
        wide = torch.promote_types(logits.dtype, torch.float32)  # a float64 model's stay float64
        logits = logits.to(wide)
        loss = sum(consistency(view.to(wide), logits) for view in viewed) + BASE_WEIGHT * self.base_loss(logits)
        flag = adapter.apply(loss, skipped, after_backward=self.scale_predictor_gradient)
        self.ascend(strengths.grad, flag)
        return logits.detach(), features.detach(), flag

    def base_loss(self, logits: torch.Tensor) -> torch.Tensor:
        if self.base == "none":
            return logits.new_zeros(())
        if self.base == "tent":
            return losses.entropy(logits)
        entropy, weights, kept = self.selection.select(logits)
        loss = (entropy * weights).sum() / kept.clamp_min(1)
        if self.fisher is not None:
            loss = loss + self.fisher_alpha * fisher_penalty(self.fisher, self.params, self.anchor)
        return loss

    def scale_predictor_gradient(self) -> None:
        if self.predictor.weight.grad is not None:
            self.predictor.weight.grad.mul_(self.predictor_rate)

    def ascend(self, gradient: torch.Tensor | None, flag: torch.Tensor) -> None:
        """One step of the noise strengths up the loss's gradient, rescaled to mean α² = `noise` and
        clipped to [−1, 1]; left out with the optimiser's step (`flag`)."""
        if gradient is None:
            return
        with torch.no_grad():
            velocity = NOISE_MOMENTUM * self.velocity - gradient
            strengths = self.strengths - NOISE_RATE * velocity
            mean = strengths.square().mean()
            strengths = (strengths / (mean.clamp_min(torch.finfo(mean.dtype).tiny) / self.noise).sqrt()).clamp(-1, 1)
            keep = flag.bool().reshape(())
            torch.where(keep, self.velocity, velocity, out=self.velocity)
            torch.where(keep, self.strengths, strengths, out=self.strengths)
