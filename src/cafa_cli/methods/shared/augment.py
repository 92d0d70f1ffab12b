"""Random augmentations of a normalised image batch, for the teacher-student methods
(CoTTA's augmentation-averaged pseudo-labels, RoTTA's strong view of its memory bank).

Both official codes use the same torchvision pipeline on [0, 1] pixels: colour jitter
(brightness 0.6–1.4, contrast 0.7–1.3, saturation 0.5–1.5, hue ±0.06, gamma 0.7–1.3),
edge padding by half the size on each side, a random affine map of the padded image
(±15°, translation 1/16 of its size, scale 0.9–1.1, bilinear) and a centre crop back to
the size, so a translation of up to 1/8 of the image itself,
a Gaussian blur (5×5, σ ≤ 0.5), a horizontal flip (p = 0.5), Gaussian noise (σ = 0.005)
and clipping to [0, 1]. Here the images are already normalised and their pixel range is
not known, so each step is its counterpart on the normalised values, computed with torch
ops on the device, one random draw per image (theirs: one per batch) from torch's
generator, so that a run is a function of its seed (adapt_domains seeds it):

- contrast c ∈ [0.7, 1.3] and brightness b ∈ [−0.4, 0.4]: x ← m + c(x − m) + b·s, with m
  and s each channel's mean and standard deviation over the image (brightness becomes a
  shift by a share of the image's spread, since "black" is unknown after normalisation);
- saturation (three channels only) σ ∈ [0.5, 1.5]: x ← g + σ(x − g), g the mean over channels;
- one affine map for rotation, scale, translation and the flip (a single grid_sample,
  bilinear, border padding as the official edge padding);
- Gaussian noise of 0.02·s (0.005 of the [0, 1] range is about 0.02 of a typical
  image's spread).

Hue and gamma need pixel values and are left out, as is the blur (σ ≤ 0.5 pixel changes
little and costs a convolution per view). Inputs that are not images ([N, d]) get the
colour and noise steps only.

The benchmark collection's lighter pipeline (get_tta_transforms with cotta_augs=False, which
CMF and ROID use) has no blur and no noise and pads by reflection: `noise=False,
padding="reflection"` (no noise is drawn then).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

CONTRAST = (0.7, 1.3)
BRIGHTNESS = (-0.4, 0.4)  # shift, in units of the image's per-channel standard deviation
SATURATION = (0.5, 1.5)
DEGREES = 15.0
TRANSLATE = 1 / 8  # of the image: the official 1/16 of an image padded to twice its size
SCALE = (0.9, 1.1)
FLIP = 0.5
NOISE = 0.02  # of the per-channel standard deviation


def _uniform(n: int, bounds: tuple[float, float], like: torch.Tensor) -> torch.Tensor:
    low, high = bounds
    return torch.rand(n, device=like.device, dtype=torch.float32) * (high - low) + low


def augment(images: torch.Tensor, views: int = 1, *, noise: bool = True, padding: str = "border") -> torch.Tensor:
    """`views` random views of each image of `images` ([N, C, H, W] or [N, d], normalised):
    [N·views, ...], each image's views together (row n·views + v is view v of image n).
    The random numbers are drawn view after view, in the order `views` calls of
    augment(images) draw them, so view v is what the v-th of those calls returns; the
    rest is computed once for all the views. `noise` False leaves the noise out (none drawn);
    `padding` is grid_sample's for the affine map: border (edge) or reflection."""
    n = len(images)
    x = images.float()
    dims = tuple(range(2, x.dim())) or (1,)
    spread, mean = torch.std_mean(x, dim=dims, correction=0, keepdim=True)
    colour, image = x.dim() == 4 and x.shape[1] == 3, x.dim() == 4
    draws = [_draws(n, x, colour, image, noise) for _ in range(views)]
    # [N, views, ...]: per-image values along dim 1, each draw's tensor one column
    grid = (n, views) + (1,) * (x.dim() - 1)
    contrast, brightness = (torch.stack([d[k] for d in draws], 1).view(grid) for k in ("contrast", "brightness"))
    spread, mean = spread.unsqueeze(1), mean.unsqueeze(1)
    x = mean + contrast * (x.unsqueeze(1) - mean) + brightness * spread
    if colour:
        grey = x.mean(2, keepdim=True)
        x = grey + torch.stack([d["saturation"] for d in draws], 1).view(grid) * (x - grey)
    x = x.flatten(0, 1)
    if image:
        angle, scale, shift, flip = (
            torch.stack([d[k] for d in draws], 1).flatten(0, 1) for k in ("angle", "scale", "shift", "flip")
        )
        x = F.grid_sample(
            x,
            F.affine_grid(_affine(angle, scale, shift, flip), list(x.shape), align_corners=False),
            mode="bilinear",
            padding_mode=padding,
            align_corners=False,
        )
    if noise:
        x = (x.unflatten(0, (n, views)) + NOISE * spread * torch.stack([d["noise"] for d in draws], 1)).flatten(0, 1)
    return x.to(images.dtype).contiguous(memory_format=_memory_format(images))


def _draws(n: int, x: torch.Tensor, colour: bool, image: bool, noise: bool = True) -> dict[str, torch.Tensor]:
    """One view's random numbers, in the order the steps use them."""
    draws = {"contrast": _uniform(n, CONTRAST, x), "brightness": _uniform(n, BRIGHTNESS, x)}
    if colour:
        draws["saturation"] = _uniform(n, SATURATION, x)
    if image:
        draws["angle"] = _uniform(n, (-DEGREES, DEGREES), x) * (math.pi / 180)
        draws["scale"] = _uniform(n, SCALE, x)
        draws["shift"] = (
            _uniform(2 * n, (-TRANSLATE, TRANSLATE), x).view(n, 2) * 2
        )  # a share of the size; [-1, 1] spans 2
        draws["flip"] = torch.where(torch.rand(n, device=x.device) < FLIP, -1.0, 1.0)
    if noise:  # as randn_like(x) of the image grid_sample returns
        draws["noise"] = torch.randn(x.shape, device=x.device, dtype=torch.float32)
    return draws


def _affine(angle: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, flip: torch.Tensor) -> torch.Tensor:
    """[N, 2, 3] maps from output to input coordinates (affine_grid's convention, [-1, 1]):
    a rotation, a scale, a translation and a horizontal flip per image."""
    cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
    rows = [torch.stack([cos * flip, -sin, shift[:, 0]], 1), torch.stack([sin * flip, cos, shift[:, 1]], 1)]
    return torch.stack(rows, 1)


def _memory_format(images: torch.Tensor) -> torch.memory_format:
    if images.dim() == 4 and images.is_contiguous(memory_format=torch.channels_last) and not images.is_contiguous():
        return torch.channels_last
    return torch.contiguous_format


def padded_crop_and_flip(images: torch.Tensor, padding: int = 4) -> torch.Tensor:
    """torchvision's RandomCrop(size, padding) and RandomHorizontalFlip() of each image of
    `images` ([N, C, H, W]): a shift of up to `padding` pixels each way over zero padding, which
    on normalised images is the mean colour (on the authors' [0, 1] pixels, black), then a flip
    with p = 0.5. One torch.randint and one torch.rand draw a call."""
    n, _, h, w = images.shape
    offsets = torch.randint(0, 2 * padding + 1, (2, n), device=images.device)
    flip = torch.rand(n, device=images.device) < FLIP
    padded = F.pad(images, (padding,) * 4)
    rows = (offsets[0, :, None] + torch.arange(h, device=images.device))[:, :, None]  # [N, H, 1]
    cols = (offsets[1, :, None] + torch.arange(w, device=images.device))[:, None, :]  # [N, 1, W]
    cols = torch.where(flip[:, None, None], cols.flip(2), cols)
    out = padded[torch.arange(n, device=images.device)[:, None, None], :, rows, cols]  # [N, H, W, C]
    return out.permute(0, 3, 1, 2).contiguous(memory_format=_memory_format(images))
