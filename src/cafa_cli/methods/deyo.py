"""DeYO: destruction-based sample selection and weighting for entropy minimisation (Lee et
al., "Entropy is not Enough for Test-Time Adaptation: From the Perspective of Disentangled
Factors", ICLR 2024; the authors' code is Jhyun17/DeYO methods/deyo.py).

Update rule: normalisation layers use the test batch's statistics; for each batch, with
p(x) = softmax(f(x)), E(x) its entropy, C classes and ŷ = argmax p(x):

1. entropy filter: S₁ = {x : E(x) < τ_E·ln C} (τ_E = `entropy_margin`);
2. PLPD, the pseudo-label probability difference: x' is x with its object shape destroyed
   (`aug_type` patch: the image cut into a `patch_len` × `patch_len` grid of patches put
   back in a random order; pixel: every pixel position permuted; occ: a square window
   filled with the image's mean), and PLPD(x) = p_ŷ(x) − p_ŷ(x'), the second pass made
   without gradient on the images of S₁ alone (so BatchNorms normalise that pass with the
   statistics of S₁'s shuffled images, as in the authors' code);
3. PLPD filter: S = {x ∈ S₁ : PLPD(x) > τ_PLPD} (`plpd_threshold`);
4. one optimiser step on the normalisation affines minimising

       L = (1/|S|) Σ_{x∈S} α(x)·E(x),
       α(x) = r_E·exp(−(E(x) − E₀)) + r_P·exp(PLPD(x))   (E₀ = `weight_margin`·ln C)

   where r_E, r_P are 1 or 0 (`reweight_ent`, `reweight_plpd`; α = 1 when both are 0)
   and α carries no gradient. No step is taken when S is empty.

The prediction reported is the first forward pass's. As in the authors' collect_params,
`frozen` leaves out a ResNet's layer4 and a ViT-Base's blocks 9-11 and final norm (as
SAR); BatchNorm, LayerNorm and GroupNorm affines elsewhere adapt (base.select_parameters).

Any input size: the grid has min(`patch_len`, H) rows of ⌊H/rows⌋ pixels and
min(`patch_len`, W) columns of ⌊W/columns⌋ pixels over the image's top-left corner; the
remaining bottom rows and right columns (fewer than one patch) stay where they are.
The authors' code instead resizes the image to a square of the nearest multiple of
`patch_len` below its width and back (bilinear; square images only); on the 224- and
32-pixel images they ran, both cut the same grid and neither resizes. The occlusion
window (`occlusion_size`, at `occlusion_row`, `occlusion_column`, in pixels as the
authors') is clipped to the image, and refused when it misses it.

Random draws (one uniform vector per image of S₁, argsorted into its patch order, as the
authors draw them; one permutation per batch for pixel) come from `generator` when it is
set (a torch.Generator: tests fix it) and torch's own otherwise, which a run seeds. The
size of S₁ is read on the host once a batch (the second pass is made on that many
images), so the step is not replayed from a CUDA graph. The second pass changes no
statistics kept from batch to batch (`norm` ema, unmix, the served estimate): it runs on
copies of the BatchNorms' buffers. Under `norm` class-balanced, whose passes share scratch
statistics, the selection's passes come before the gradient pass (one more forward pass).
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch

from cafa_cli.core.errors import UsageError
from cafa_cli.engine.method import AdapterSurface, Method, select_parameters
from cafa_cli.engine.norms import BatchStatisticsNorm
from cafa_cli.engine.options import Option
from cafa_cli.methods.shared import losses
from cafa_cli.model.features import FeatureClassifier

ENTROPY_MARGIN = 0.5  # τ_E, a share of ln C
WEIGHT_MARGIN = 0.4  # E₀, a share of ln C
PLPD_THRESHOLD = 0.2  # τ_PLPD: the authors' default and their wild settings' (0.3 for ResNet-50 BN on ImageNet-C)
PATCH_LEN = 4
AUG_TYPES = ("patch", "pixel", "occ")
OCCLUSION = (112, 56, 56)  # size, first row, first column: the authors' (the middle half of a 224-pixel image)
FROZEN = ("layer4", "blocks.9", "blocks.10", "blocks.11", "norm")  # the authors' collect_params skips these


def shuffle_patches(images: torch.Tensor, grid: int, order: torch.Tensor) -> torch.Tensor:
    """`images` [N, C, H, W] cut into a grid (module docstring) whose patches, numbered row by
    row, are put back so that patch k of image n is its former patch order[n, k]."""
    n, c, h, w = images.shape
    rows, cols = min(grid, h), min(grid, w)
    ph, pw = h // rows, w // cols
    body = images[:, :, : rows * ph, : cols * pw]
    patches = body.reshape(n, c, rows, ph, cols, pw).permute(0, 2, 4, 1, 3, 5).reshape(n, rows * cols, c, ph, pw)
    picked = patches.gather(1, order.view(n, rows * cols, 1, 1, 1).expand_as(patches))
    shuffled = picked.reshape(n, rows, cols, c, ph, pw).permute(0, 3, 1, 4, 2, 5).reshape(n, c, rows * ph, cols * pw)
    if (rows * ph, cols * pw) == (h, w):
        return shuffled
    out = images.clone()  # the remainder strips stay in place
    out[:, :, : rows * ph, : cols * pw] = shuffled
    return out


def shuffle_pixels(images: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Pixel k of every image and channel becomes its former pixel order[k] ([H·W])."""
    return images.flatten(2)[:, :, order].view(images.shape)


def occlude(images: torch.Tensor, size: int, row: int, column: int) -> torch.Tensor:
    """A copy with the window [row, row + size) × [column, column + size) (clipped to the image)
    filled with each image's per-channel mean."""
    h, w = images.shape[-2:]
    if row >= h or column >= w or size == 0:
        raise UsageError(
            f"deyo's occlusion window ({size} pixels at row {row}, column {column}) misses the {h}×{w} images; "
            f"set occlusion_size, occlusion_row and occlusion_column for them"
        )
    out = images.clone()
    out[:, :, row : row + size, column : column + size] = images.mean((2, 3), keepdim=True)
    return out


@contextmanager
def statistics_aside(model: torch.nn.Module):
    """Within the block, the swapped BatchNorms' buffers that a forward pass changes (running,
    served and unmix statistics) are copies: the originals stay as they were, and so does the
    autograd graph of a pass made before, which holds them."""
    held = [
        (layer, name, buffer)
        for layer in model.modules()
        if isinstance(layer, BatchStatisticsNorm)
        for name, buffer in layer.named_buffers(recurse=False)
        if not name.startswith("source_")  # the source's, which no pass changes
    ]
    for layer, name, buffer in held:
        setattr(layer, name, buffer.clone())
    try:
        yield
    finally:
        for layer, name, buffer in held:
            setattr(layer, name, buffer)


def class_balanced(model: torch.nn.Module) -> bool:
    """Whether the model's BatchNorms are class-balanced (norms.py), whose passes share scratch statistics."""
    return any(isinstance(m, BatchStatisticsNorm) and m.balanced is not None for m in model.modules())


class DeYO(Method):
    name = "deyo"
    draws_random_numbers = True  # from torch's generator (base.py)
    owns_update = True
    filters_samples = True
    predicts_before_update = True
    generator: torch.Generator | None = None  # the random draws' source; None: torch's own
    unsaved = (*Method.unsaved, "generator")
    options = (
        Option(
            "entropy_margin",
            ENTROPY_MARGIN,
            "τ_E as a share of ln C: the entropy filter keeps E < τ_E·ln C",
            "positive",
        ),
        Option("weight_margin", WEIGHT_MARGIN, "E₀ as a share of ln C, in the entropy weight exp(E₀ − E)", "positive"),
        Option("plpd_threshold", PLPD_THRESHOLD, "τ_PLPD: the PLPD filter keeps PLPD > τ_PLPD", "fraction"),
        Option("reweight_ent", True, "weight each sample by exp(E₀ − E)", "flag"),
        Option("reweight_plpd", True, "weight each sample by exp(PLPD)", "flag"),
        Option(
            "aug_type",
            "patch",
            "how x' destroys the object's shape: patch shuffle, pixel shuffle or occlusion",
            "choice",
            AUG_TYPES,
        ),
        Option("patch_len", PATCH_LEN, "patch: the grid's rows and columns", "count"),
        Option("occlusion_size", OCCLUSION[0], "occ: the window's side, in pixels", "count"),
        Option("occlusion_row", OCCLUSION[1], "occ: the window's first row", "count0"),
        Option("occlusion_column", OCCLUSION[2], "occ: the window's first column", "count0"),
        Option(
            "frozen", FROZEN, "modules left out of the update, by name (whole dotted components); empty: none", "names"
        ),
    )

    def choose_parameters(self, model: FeatureClassifier, which: str = "norm") -> list[torch.nn.Parameter]:
        return select_parameters(model, which, self.frozen)

    def update(self, adapter: AdapterSurface, images: torch.Tensor, skipped: torch.Tensor | None):
        if class_balanced(adapter.model):
            # its passes write statistics that the gradient pass's graph holds: the
            # selection's two passes come first, and the gradient pass after them
            with torch.no_grad(), statistics_aside(adapter.model), adapter.autocast:
                reliable, plpd = self.select(adapter, images, adapter.forward(images)[0].float())
            with adapter.autocast:
                logits, features = adapter.forward(images)
        else:  # the authors' order: the gradient pass, then the shuffled one
            with adapter.autocast:
                logits, features = adapter.forward(images)
            with torch.no_grad(), statistics_aside(adapter.model), adapter.autocast:
                reliable, plpd = self.select(adapter, images, logits.detach().float())
        entropy = losses.entropies(logits.float()).index_select(0, reliable)
        keep = plpd > self.plpd_threshold
        if self.reweight_ent or self.reweight_plpd:
            e0 = self.weight_margin * math.log(logits.shape[1])
            weight = self.reweight_ent * torch.exp(e0 - entropy.detach()) + self.reweight_plpd * torch.exp(plpd)
            entropy = entropy * weight
        loss = (entropy * keep).sum() / keep.sum().clamp_min(1)
        self.count_kept(keep.sum())
        flag = adapter.apply(loss, skipped, leave_out=keep.any().logical_not())
        return logits, features, flag

    def select(
        self, adapter: AdapterSurface, images: torch.Tensor, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The indices of the samples below the entropy threshold (read on the host) and their
        PLPD, from the batch's logits (float32, no gradient)."""
        threshold = self.entropy_margin * math.log(logits.shape[1])
        reliable = (losses.entropies(logits) < threshold).nonzero().squeeze(1)
        if len(reliable) == 0:  # nothing to shuffle: no step
            return reliable, logits.new_zeros(0)
        probabilities = logits.index_select(0, reliable).softmax(1)
        destroyed, _ = adapter.forward(self.destroy(images.index_select(0, reliable)))
        label = probabilities.argmax(1, keepdim=True)
        return reliable, (probabilities.gather(1, label) - destroyed.float().softmax(1).gather(1, label)).squeeze(1)

    def destroy(self, images: torch.Tensor) -> torch.Tensor:
        """x': `images` [n, C, H, W] with their shape destroyed as `aug_type` says."""
        if images.dim() != 4:
            raise UsageError(f"deyo shuffles image patches: it needs [N, C, H, W] images, not {list(images.shape)}")
        if self.aug_type == "occ":
            return occlude(images, self.occlusion_size, self.occlusion_row, self.occlusion_column)
        n, _, h, w = images.shape
        if self.aug_type == "pixel":
            return shuffle_pixels(images, self._draw(lambda **kw: torch.randperm(h * w, **kw), images.device))
        patches = min(self.patch_len, h) * min(self.patch_len, w)
        return shuffle_patches(
            images, self.patch_len, self._draw(lambda **kw: torch.rand(n, patches, **kw), images.device).argsort(1)
        )

    def _draw(self, draw, device: torch.device) -> torch.Tensor:
        """draw(generator=, device=) from `generator` where set (on its device), else from torch's on `device`."""
        if self.generator is None:
            return draw(device=device)
        return draw(generator=self.generator, device=self.generator.device).to(device)
