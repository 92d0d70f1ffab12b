"""Image preprocessing: one explicit, serialisable recipe shared by `stats` and `adapt`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

from cafa_cli.core.errors import UsageError
from cafa_cli.data.values import MAX_PIXELS, check_preprocessing

if TYPE_CHECKING:
    import torch

IMAGENET_MEAN = (0.485, 0.456, 0.406)


IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class Preprocessing:
    """PIL image -> uint8 pixels (in the loader) -> normalised float batch (on the device).

    Loader processes stop at uint8: a quarter of the bytes to pass between processes
    and to copy to the GPU, and the float arithmetic is done once per batch where it
    is cheapest. The result is bit for bit the per-image `to_tensor` + `normalize`.

    `resize` scales the shorter side, `crop` takes the centre square; either may be
    None. ImageNet-C images are already 224x224 (made by resize 256 + crop 224), so
    for them resize and crop must both be None (or 224) — resizing them again costs
    accuracy.
    """

    resize: int | None = 256
    crop: int | None = 224
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    channels: int = 3
    interpolation: str = "bilinear"  # of the resize: bilinear, bicubic or nearest (timm's models declare bicubic)

    def __post_init__(self):
        check_preprocessing(asdict(self))
        for name in ("mean", "std"):
            values = getattr(self, name)
            if len(values) not in (1, self.channels) and values == getattr(Preprocessing, name):
                raise UsageError(
                    f"`channels` {self.channels}: the default `{name}` is ImageNet's, with one value per RGB channel; "
                    f"give `mean` and `std` for your images, one value each"
                )
            if len(values) not in (1, self.channels):
                counts = (
                    "1 value for 1 channel"
                    if self.channels == 1
                    else f"1 or {self.channels} values for {self.channels} channels"
                )
                raise UsageError(f"`{name}` needs {counts}, got {len(values)}")
        if self.resize is not None and self.crop is not None and self.crop > self.resize:
            raise UsageError(
                f"`crop` {self.crop} is larger than `resize` {self.resize}: the centre crop would pad the image with "
                "black; "
                f"give `crop` {self.resize} or less"
            )

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> Preprocessing:
        return cls(
            resize=d.get("resize"),
            crop=d.get("crop"),
            mean=_numbers(d["mean"], "mean"),
            std=_numbers(d["std"], "std"),
            channels=int(d["channels"]),
            interpolation=d.get("interpolation", "bilinear"),  # artifacts made before it was a setting: bilinear
        )

    def with_changes(self, changes: dict) -> Preprocessing:
        """A copy with the options a user gave (None is a value here: "no resize")."""
        return replace(self, **changes)

    def pixels(self, image: Image.Image) -> torch.Tensor:
        """The image resized and cropped: uint8, [channels, height, width]."""
        import torch  # deferred: an artifact's preprocessing is read (`cafa inspect`) without torch

        self.check_size(image)
        image = to_mode(image, "L" if self.channels == 1 else "RGB")
        if self.resize is not None or self.crop is not None:
            # deferred: importing torchvision takes a tenth of a second, which a model that
            # takes its images as they are (the bundled ones) should not pay
            from torchvision.transforms import functional as TF

            if self.resize is not None:
                image = TF.resize(image, self.resize, interpolation=TF.InterpolationMode(self.interpolation))
            if self.crop is not None:
                image = TF.center_crop(image, self.crop)
        # torchvision's pil_to_tensor, without its import: the same values and strides
        width, height = image.size
        return torch.from_numpy(np.array(image)).view(height, width, self.channels).permute(2, 0, 1)

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) after `resize`, as torchvision's resize sizes it."""
        if not width or not height:
            raise ValueError(f"an image of no pixels ({width}x{height})")
        if self.resize is None:
            return width, height
        longer = int(self.resize * max(width, height) / min(width, height))
        return (self.resize, longer) if width <= height else (longer, self.resize)

    def check_size(self, image: Image.Image) -> None:
        """Refuse, as Pillow refuses a decompression bomb, an image that the resize would
        make larger than MAX_PIXELS (a 1 x 1,000,000 line resized to 64 on its shorter side
        is 64 x 64,000,000): the loader skips it as unreadable, before any pixel is made.
        An image already that large is only ever shrunk, and passes."""
        width, height = image.size
        new_width, new_height = self.resized_size(width, height)
        if new_width * new_height > max(MAX_PIXELS, width * height):
            raise Image.DecompressionBombError(
                f"{width}x{height} pixels; resized to {self.resize} on its shorter side it would be "
                f"{new_width}x{new_height}, "
                f"{new_width * new_height:,} pixels, more than the {MAX_PIXELS:,} cafa makes of one image"
            )

    def padding_note(self, image: Image.Image, where: str) -> str | None:
        """A warning when the centre crop is larger than this image after the resize:
        torchvision pads it with black, which no model has seen."""
        if self.crop is None:
            return None
        width, height = self.resized_size(*image.size)
        if self.crop <= min(width, height):
            return None
        return (
            f"{where}: `crop` {self.crop} is larger than its images ({width}x{height} after `resize` "
            f"{self.resize or 'none'}), so the crop pads them with black; give `crop` {min(width, height)} or less"
        )

    def per_channel(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(mean, std) with one value per channel: `--mean 0.5` is `--mean 0.5,0.5,0.5` for RGB."""
        return self.mean * (self.channels // len(self.mean)), self.std * (self.channels // len(self.std))

    def normalize(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 pixels, one image or a batch, on any device -> the model's float input."""
        import torch  # deferred: an artifact's preprocessing is read (`cafa inspect`) without torch

        mean, std = (torch.tensor(values, device=pixels.device).reshape(-1, 1, 1) for values in self.per_channel())
        return pixels.float().div_(255).sub_(mean).div_(std)


def _numbers(values, name: str) -> tuple[float, ...]:
    # float() would take the text "0.5" one character at a time and fail on the "."
    if not isinstance(values, (list, tuple)) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in values
    ):
        raise ValueError(f"'{name}' must be a list of numbers, not {values!r}")
    return tuple(float(v) for v in values)


def to_mode(image: Image.Image, mode: str) -> Image.Image:
    """Convert any PIL image to 8-bit grey or RGB.

    Integer images are rescaled to 8 bits as `_integer_to_grey` says (PIL's own conversion
    clips them), floating-point ones as `_float_to_grey` says, and transparency is
    composited on white rather than dropped to black.
    """
    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        image = _integer_to_grey(image)
    elif image.mode == "F":
        image = _float_to_grey(image)
    if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        image = Image.alpha_composite(background, rgba)
    return image if image.mode == mode else image.convert(mode)  # a converted copy is the same pixels


INTEGER_RANGES = (255, 65535, 2**31 - 1)  # the largest value of 8 and 16 bits, and of mode I (signed 32 bits)


def _integer_to_grey(image: Image.Image) -> Image.Image:
    """A 16- or 32-bit integer image as 8-bit grey, each value scaled by 255/max of its range.
    A 16-bit mode (I;16) declares 0..65535. The 32-bit mode I holds what files store in
    8, 16 or 32 bits (Pillow reads integer TIFFs as I): its range is the smallest of
    0..255, 0..65535, 0..2³¹−1 (mode I is signed) that holds its largest value, so that an
    8-bit picture stored in 32 bits is not divided into black. Negative values have no
    meaning as pixels: the image is refused (ValueError: skipped as unreadable)."""
    low, high = image.getextrema()
    if low < 0:
        raise ValueError(f"an integer image with negative values (down to {low}); save it with values of 0 or more")
    top = 65535 if image.mode.startswith("I;16") else next(r for r in INTEGER_RANGES if high <= r)
    if top == 255:  # mode I only: a 16-bit mode's range is 65535
        return image.convert("L")
    return image.point(lambda v: v * (255 / top) + 0.5).convert("L")


def _float_to_grey(image: Image.Image) -> Image.Image:
    """A 32-bit float image (a TIFF of mode F) as 8-bit grey. Values in 0..1, as most tools
    write floats, are scaled by 255 (PIL's own conversion rounds them to 0 or 1 out of 255:
    an all-black image); values in 0..255 are taken as they are; so an image whose largest
    value is at most 1 is read as 0..1. Negative, larger or non-finite values have no
    meaning as pixels: the image is refused (ValueError: skipped as unreadable)."""
    values = np.asarray(image)
    if not np.isfinite(values).all():
        raise ValueError("a floating-point image with NaN or infinite values")
    low, high = float(values.min()), float(values.max())
    if low < 0 or high > 255:
        raise ValueError(
            f"a floating-point image with values from {low:g} to {high:g}; cafa reads floats in 0..1 "
            f"or 0..255: scale it to one of those, or save it as an 8- or 16-bit image"
        )
    return (image.point(lambda v: v * 255) if high <= 1 else image).convert("L")
