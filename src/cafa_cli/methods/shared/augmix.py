"""AugMix views of a normalised image batch: the augmentation that MEMO's marginal entropy
averages over and that test-time augmentation (ttaug) averages its prediction over.

MEMO's authors (zhangmarvin/memo, cifar-10-exps/utils/third_party.py and
imagenet-exps/utils/third_party.py) and the benchmark collection
(mariodoebler/test-time-adaptation, classification/augmentations/transforms_augmix.py and
augmix_ops.py) draw each view of an image x on PIL images as:

1. a random crop and a horizontal flip (p = 0.5), the view's base x0: `padded`, a crop of
   the image's size from the image padded with black by 1/8 of its size on each side
   (RandomCrop(32, padding=4), CIFAR); `resized`, a crop of 8-100 % of the area with an
   aspect ratio in 3/4-4/3, scaled back to the image's size (RandomResizedCrop, ImageNet);
2. three chains, each of 1-3 operations drawn from nine (AugMix at severity 1, without
   those that overlap ImageNet-C's corruptions): autocontrast, equalize, posterize (4
   bits), rotate (0-2 degrees), solarize (threshold 231-254 of 255), shear x or y
   (0.003-0.03), translate x or y (whole pixels, up to 1/30 of the size);
3. the chains mixed with Dirichlet(1, 1, 1) weights w, and the mix with the base by
   m ~ Beta(1, 1):  view = m·x0 + (1 − m)·Σ_i w_i·chain_i(x0).

Here the images are already normalised, so their pixel range is not known: the smallest
and the largest value of each image (over all its channels) stand for black and white.
The colour operations map that range as PIL maps 0-255 (autocontrast stretches each
channel to it; equalize maps each value to its rank among its channel's values; posterize
and solarize act on the value's place in it, on a 0-255 scale); the geometric ones fill
what they uncover with grey, the range's midpoint (the authors' fill 128; the collection's
PIL default is black), and the padded crop pads with black. Each operation is its
counterpart on tensors, computed on the device for all the views at once: one affine
grid_sample a chain step for the geometric ones (bilinear), and the colour ones chosen per
view with torch.where, so no step reads a device value or sizes a tensor from one.

Random numbers: one torch.rand draw a call, [views, K], on the images' device, from
`generator` (None: that device's default generator, which the run's seed seeds), so that
a test can fix the views with a generator of its own.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from cafa_cli.core.errors import UsageError

CROPS = ("padded", "resized")
OPERATIONS = (
    "autocontrast",
    "equalize",
    "posterize",
    "rotate",
    "solarize",
    "shear_x",
    "shear_y",
    "translate_x",
    "translate_y",
)  # the collection's augmix_ops.augmentations, in its order
GEOMETRIC = ("rotate", "shear_x", "shear_y", "translate_x", "translate_y")
CHAINS = 3  # AugMix's width
DEPTH = 3  # each chain has 1 to DEPTH operations
PAD = 1 / 8  # `padded`: of the size, on each side (4 pixels at 32)
AREA = (0.08, 1.0)  # `resized`: RandomResizedCrop's scale and ratio, and its tries before the centre crop
RATIO = (3 / 4, 4 / 3)
TRIES = 10
DEGREES = 30  # at level 1 of 10: rotate by int(level·3) degrees, level ~ U(0.1, 1)
SHEAR = 0.3  # at level 1 of 10: 0.03·level
POSTERIZE_BITS = 4  # 4 − int(level·4/10): always 4 at severity 1
SOLARIZE = 256  # threshold 256 − int(level·25.6)


def augmix(
    images: torch.Tensor, copies: int, generator: torch.Generator | None = None, crop: str = "padded"
) -> torch.Tensor:
    """`copies` AugMix views of each image of `images` ([N, C, H, W], normalised):
    [N·copies, C, H, W], each image's views together (row n·copies + b is view b of image n)."""
    if images.dim() != 4:
        raise UsageError(
            f"AugMix views are of images [N, channels, height, width], not of inputs shaped {list(images.shape)}; "
            f"use a method that does not augment its inputs"
        )
    if crop not in CROPS:
        raise UsageError(f"the crop must be one of {', '.join(CROPS)}, not {crop!r}")
    n, c, h, w = images.shape
    views = n * copies
    x = images.float()
    # black and white: each image's extremes, for all its views
    lo = x.amin((1, 2, 3)).view(n, 1).expand(n, copies).reshape(views, 1, 1, 1)
    hi = x.amax((1, 2, 3)).view(n, 1).expand(n, copies).reshape(views, 1, 1, 1)
    span = (hi - lo).clamp_min(torch.finfo(torch.float32).tiny)
    x = x.unsqueeze(1).expand(n, copies, c, h, w).reshape(views, c, h, w)
    crop_columns = 2 if crop == "padded" else 4 * TRIES
    u = torch.rand(
        views, crop_columns + 1 + CHAINS + 1 + CHAINS + 3 * CHAINS * DEPTH, generator=generator, device=x.device
    )
    crop_draws, u = u[:, :crop_columns], u[:, crop_columns:]
    flip, weights, m, depths = u[:, 0], u[:, 1 : 1 + CHAINS], u[:, 1 + CHAINS], u[:, 2 + CHAINS : 2 + 2 * CHAINS]
    steps = u[:, 2 + 2 * CHAINS :].view(views, CHAINS, DEPTH, 3)  # each step's operation, level and sign
    theta = _padded(crop_draws, h, w) if crop == "padded" else _resized(crop_draws, h, w)
    theta[:, :, 0] *= torch.where(flip < 0.5, -1.0, 1.0).unsqueeze(1)  # the flip: out(X, Y) = crop(−X, Y)
    base = _warp(x, theta, lo)  # padded with black
    weights = -torch.log1p(-weights)  # Exp(1) draws, normalised: Dirichlet(1, 1, 1)
    weights = weights / weights.sum(1, keepdim=True)
    depths = (depths * DEPTH).floor() + 1  # 1 to DEPTH operations
    mix = torch.zeros_like(base)
    for i in range(CHAINS):
        chain = base
        for d in range(DEPTH):
            operation = (steps[:, i, d, 0] * len(OPERATIONS)).floor().clamp_max(len(OPERATIONS) - 1)
            operation = torch.where(d < depths[:, i], operation, -1.0)  # -1: the chain has ended
            level = 0.1 + 0.9 * steps[:, i, d, 1]  # U(0.1, 1), as sample_level(1)
            sign = torch.where(steps[:, i, d, 2] > 0.5, -1.0, 1.0)
            chain = _step(chain, operation, level, sign, lo, hi, span)
        mix = mix + weights[:, i].view(views, 1, 1, 1) * chain
    m = m.view(views, 1, 1, 1)
    out = m * base + (1 - m) * mix
    return out.to(images.dtype).contiguous(memory_format=_memory_format(images))


def crop_and_flip(images: torch.Tensor, copies: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """`copies` views of each image of `images` ([N, C, H, W]) made by the first step above
    alone, `resized`: RandomResizedCrop to the image's size and a horizontal flip (p = 0.5),
    the views TPT, ZERO and DMN take on ImageNet and its variants (their AugMixAugmenter with
    augmix False). [N·copies, C, H, W], each image's views together; one torch.rand draw a call."""
    n, c, h, w = images.shape
    views = n * copies
    x = images.float().unsqueeze(1).expand(n, copies, c, h, w).reshape(views, c, h, w)
    u = torch.rand(views, 4 * TRIES + 1, generator=generator, device=x.device, dtype=torch.float32)
    theta = _resized(u[:, : 4 * TRIES], h, w)
    theta[:, :, 0] *= torch.where(u[:, 4 * TRIES] < 0.5, -1.0, 1.0).unsqueeze(1)
    out = _warp(x, theta, torch.zeros((), device=x.device))  # inside the image: no fill is seen
    return out.to(images.dtype).contiguous(memory_format=_memory_format(images))


def _step(x, operation, level, sign, lo, hi, span) -> torch.Tensor:
    """One chain step: each view's operation (-1: none) on it."""
    views, _, h, w = x.shape
    is_op = {name: (operation == k).view(views, 1, 1, 1) for k, name in enumerate(OPERATIONS)}
    identity = torch.tensor([[1.0, 0, 0], [0, 1.0, 0]], device=x.device).repeat(views, 1, 1)
    # rotate: PIL's rotate(int(level·3)°), about the centre, in pixel units (aspect kept)
    angle = sign * (level * DEGREES / 10).floor() * (math.pi / 180)
    cos, sin = torch.cos(angle), torch.sin(angle)
    rotate = torch.stack([torch.stack([cos, sin * h / w, 0 * cos], 1), torch.stack([-sin * w / h, cos, 0 * cos], 1)], 1)
    # shear: PIL's affine (1, t, 0, 0, 1, 0) shears about the top-left corner: x_in = x + t·y
    t = sign * level * SHEAR / 10
    shear_x, shear_y = identity.clone(), identity.clone()
    shear_x[:, 0, 1], shear_x[:, 0, 2] = t * h / w, t * h / w
    shear_y[:, 1, 0], shear_y[:, 1, 2] = t * w / h, t * w / h
    # translate: whole pixels, int(level·size/30)
    translate_x, translate_y = identity.clone(), identity.clone()
    translate_x[:, 0, 2] = 2 * sign * (level * (w / 3) / 10).floor() / w
    translate_y[:, 1, 2] = 2 * sign * (level * (h / 3) / 10).floor() / h
    theta = identity
    for name, candidate in zip(GEOMETRIC, (rotate, shear_x, shear_y, translate_x, translate_y)):
        theta = torch.where(is_op[name].view(views, 1, 1), candidate, theta)
    geometric = sum(is_op[name] for name in GEOMETRIC).bool()
    out = torch.where(geometric, _warp(x, theta, lo + span / 2), x)  # grey fill
    pixels = ((x - lo) / span * 255).round().clamp(0, 255)  # the value on a 0-255 scale
    out = torch.where(is_op["autocontrast"], _autocontrast(x, lo, span), out)
    out = torch.where(is_op["equalize"], _equalize(pixels, lo, span), out)
    posterized = lo + span * (pixels / 2 ** (8 - POSTERIZE_BITS)).floor() * 2 ** (8 - POSTERIZE_BITS) / 255
    out = torch.where(is_op["posterize"], posterized, out)
    threshold = (SOLARIZE - (level * SOLARIZE / 10).floor()).view(views, 1, 1, 1)
    solarized = torch.where(pixels >= threshold, lo + hi - x, x)
    return torch.where(is_op["solarize"], solarized, out)


def _autocontrast(x, lo, span) -> torch.Tensor:
    """Each channel stretched from its own extremes to the image's range (a flat channel stays)."""
    low, high = x.amin((2, 3), keepdim=True), x.amax((2, 3), keepdim=True)
    spread = high - low
    stretched = lo + (x - low) * span / spread.clamp_min(torch.finfo(torch.float32).tiny)
    return torch.where(spread > 0, stretched, x)


def _equalize(pixels, lo, span) -> torch.Tensor:
    """PIL's equalize of each channel's 0-255 values (ImageOps.equalize): a value v goes to
    (⌊step/2⌋ + the count of values below v) // step, step = ⌊(count − count of the top value)/255⌋
    (no step: the channel stays), then back onto the image's range."""
    flat = pixels.flatten(2).long()  # [views, channels, H·W]
    counts = torch.zeros(*flat.shape[:2], 256, device=flat.device, dtype=torch.float32)
    counts.scatter_add_(2, flat, torch.ones_like(flat, dtype=torch.float32))
    top = counts.gather(2, flat.amax(2, keepdim=True))
    step = ((flat.shape[2] - top) / 255).floor()
    below = counts.cumsum(2) - counts
    lut = ((step / 2).floor() + below).div(step.clamp_min(1)).floor().clamp_max(255)
    lut = torch.where(step > 0, lut, torch.arange(256, device=flat.device, dtype=torch.float32))
    return lo + span * lut.gather(2, flat).view_as(pixels) / 255


def _warp(x: torch.Tensor, theta: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """x sampled (bilinear) at the affine map `theta` of its output grid, `fill` outside it."""
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x - fill, grid, mode="bilinear", padding_mode="zeros", align_corners=False) + fill


def _padded(draws: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """RandomCrop(size, padding=size/8): a whole-pixel shift of up to the padding each way."""
    pad_h, pad_w = round(h * PAD), round(w * PAD)
    dy = (draws[:, 0] * (2 * pad_h + 1)).floor() - pad_h
    dx = (draws[:, 1] * (2 * pad_w + 1)).floor() - pad_w
    one, zero = torch.ones_like(dx), torch.zeros_like(dx)
    return torch.stack([torch.stack([one, zero, 2 * dx / w], 1), torch.stack([zero, one, 2 * dy / h], 1)], 1)


def _resized(draws: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """RandomResizedCrop's box: the first of TRIES draws that fits, else its centre crop."""
    draws = draws.view(-1, TRIES, 4)
    area = h * w * (AREA[0] + (AREA[1] - AREA[0]) * draws[..., 0])
    log_low, log_high = math.log(RATIO[0]), math.log(RATIO[1])
    ratio = torch.exp(log_low + (log_high - log_low) * draws[..., 1])
    crop_w, crop_h = torch.sqrt(area * ratio).round(), torch.sqrt(area / ratio).round()
    fits = (crop_w > 0) & (crop_w <= w) & (crop_h > 0) & (crop_h <= h)
    top = (draws[..., 2] * (h - crop_h + 1)).floor()
    left = (draws[..., 3] * (w - crop_w + 1)).floor()
    first = fits.float().argmax(1, keepdim=True)  # the first try that fits (argmax: the first maximum)
    crop_h, crop_w, top, left = (value.gather(1, first).squeeze(1) for value in (crop_h, crop_w, top, left))
    # no try fits: the whole image, cut to the nearest allowed ratio, centred
    if w / h < RATIO[0]:
        fallback_w, fallback_h = w, round(w / RATIO[0])
    elif w / h > RATIO[1]:
        fallback_w, fallback_h = round(h * RATIO[1]), h
    else:
        fallback_w, fallback_h = w, h
    any_fits = fits.any(1)
    crop_h = torch.where(any_fits, crop_h, float(fallback_h))
    crop_w = torch.where(any_fits, crop_w, float(fallback_w))
    top = torch.where(any_fits, top, float((h - fallback_h) // 2))
    left = torch.where(any_fits, left, float((w - fallback_w) // 2))
    zero = torch.zeros_like(crop_w)
    return torch.stack(
        [
            torch.stack([crop_w / w, zero, (2 * left + crop_w) / w - 1], 1),
            torch.stack([zero, crop_h / h, (2 * top + crop_h) / h - 1], 1),
        ],
        1,
    )


def _memory_format(images: torch.Tensor) -> torch.memory_format:
    if images.is_contiguous(memory_format=torch.channels_last) and not images.is_contiguous():
        return torch.channels_last
    return torch.contiguous_format
