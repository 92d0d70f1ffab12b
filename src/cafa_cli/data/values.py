"""Preprocessing and loading values checked each by itself, and parsed from text;
torch-free, so that the settings (jobs/config.py) check them without importing torch.
A setting is named in backticks (`resize`), as the command line shows it: --resize."""

from __future__ import annotations

import math
import os

from cafa_cli.core.errors import UsageError
from cafa_cli.core.numbers import read_whole, sane

MAX_SIDE = 4096  # pixels; a resize to 100000 would ask for 10 GB per image and end out of memory
# The most pixels a resize may make of one image: Pillow's own decompression-bomb threshold
# (Image.MAX_IMAGE_PIXELS). `resize` sets the shorter side, so a 1 x 1,000,000 image (1 KB as
# a PNG) resized to 64 would be 64 x 64,000,000 pixels: 4 GB in grey, 12 GB in RGB.
MAX_PIXELS = 89_478_485


def parse_size(text: str | int, name: str) -> int | None:
    """'224' -> 224, 'none' -> None."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    if str(text).strip().lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"`{name}` takes a whole number of pixels or 'none', not {text!r}") from None


def parse_floats(text: str | float | tuple, name: str) -> tuple[float, ...]:
    if isinstance(text, (tuple, list)):
        text = ",".join(str(v) for v in text)
    try:
        return tuple(float(v) for v in str(text).split(","))
    except ValueError:
        raise UsageError(f"`{name}` takes comma-separated numbers, got {text!r}") from None


INTERPOLATIONS = ("bilinear", "bicubic", "nearest")  # the resize filters (torchvision's InterpolationMode values)


def check_preprocessing(values: dict, prefix: str = "") -> None:
    """Each value wrong by itself, whatever the others (the recipe checks the combination)."""
    if "interpolation" in values and values["interpolation"] not in INTERPOLATIONS:
        raise UsageError(
            f"`{prefix}interpolation` must be one of {', '.join(INTERPOLATIONS)}, not {values['interpolation']!r}"
        )
    if "channels" in values and values["channels"] not in (1, 3):
        raise UsageError(f"`{prefix}channels` must be 1 or 3, not {values['channels']}")
    if not all(math.isfinite(v) for name in ("mean", "std") for v in values.get(name, ())):
        raise UsageError("`mean` and `std` values must be finite numbers")
    if any(s <= 0 for s in values.get("std", ())):
        raise UsageError("`std` values must be positive")
    for name in ("resize", "crop"):
        value = values.get(name)
        if value is not None and (type(value) is not int or not 1 <= value <= MAX_SIDE):
            raise UsageError(
                f"`{prefix}{name}` must be a whole number of pixels from 1 to {MAX_SIDE}, or 'none'; not {value}"
            )


def check_batch_size(batch_size: int) -> None:
    """A whole number (not 10.0, true or "10", as a TOML file may write it), 1 to 2**31 - 1."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size < 2**31:
        raise UsageError(f"`batch_size` must be a whole number, at least 1 and below 2**31, not {batch_size!r}")


def check_num_workers(num_workers: int | None) -> None:
    if num_workers is None:
        return
    if num_workers < 0:
        raise UsageError(f"`num_workers` must be 0 or more, not {num_workers}")
    cores = usable_cores()
    if num_workers > 4 * cores:
        # each is a process with its own copy of the interpreter: thousands exhaust the memory
        raise UsageError(
            f"`num_workers` {num_workers} is more than 4 per CPU core ({cores} here); loader processes "
            f"beyond the cores only compete for them: give {cores} or fewer"
        )


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# --order: how a domain's images follow each other in the stream (data/orders.py builds it)
ORDER_FORMS = "iid, label-shift:S (S 0 or from 0.000001 to 1) or dirichlet:D (D from 0.000001 to 1,000,000)"


def parse_order(text: str, name: str = "order") -> tuple[str, float | None]:
    """'iid' -> ('iid', None); 'label-shift:0.5' -> ('label-shift', 0.5); 'dirichlet:0.1' -> ('dirichlet', 0.1)."""
    kind, colon, value_text = str(text).strip().partition(":")
    if kind == "iid" and not colon:
        return kind, None
    try:
        value = float(value_text) if kind in ("label-shift", "dirichlet") and colon else float("nan")
    except ValueError:
        value = float("nan")
    if kind == "label-shift" and sane(value, 1, zero=True):
        return kind, value
    if kind == "dirichlet" and sane(value):
        return kind, value
    raise UsageError(f"`{name}` must be {ORDER_FORMS}, not {text!r}")


# --reset: when the model goes back to the source weights (jobs/adapt/stream.py)
RESET_FORMS = "domain, episodic, never or every:N (N updates, N >= 1)"


def parse_reset(text: str, name: str = "reset") -> tuple[str, int | None]:
    """'domain' -> ('domain', None), likewise 'episodic' and 'never'; 'every:1000' -> ('every', 1000)."""
    kind, colon, value_text = str(text).strip().partition(":")
    if kind in ("domain", "episodic", "never") and not colon:
        return kind, None
    every = read_whole(value_text, signed=False) if kind == "every" else None
    if every is not None and every >= 1:
        return kind, every
    raise UsageError(f"`{name}` must be {RESET_FORMS}, not {text!r}")


MAX_ROUNDS = 1000  # a long horizon: CoTTA and RoTTA report 10 rounds, the persistent-TTA papers up to 20


def check_rounds(rounds: int, name: str = "rounds") -> None:
    """How many times the whole domain sequence runs in one stream: a whole number, 1 to MAX_ROUNDS."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or not 1 <= rounds <= MAX_ROUNDS:
        raise UsageError(
            f"`{name}` must be a whole number from 1 to {MAX_ROUNDS} (1: the sequence once), not {rounds!r}"
        )


# Decoding budget: the most memory one image's decoded pixels may take, per loader
# process (CAFA_DECODE_BUDGET_MB, default 150 MB: 50 megapixels of 8-bit RGB). The header
# is read first; a JPEG above the budget is decoded at 1/2, 1/4 or 1/8 of its size by its
# own DCT scaling (Image.draft), anything else is skipped as unreadable with its size named.
# Pillow's own limit (about 179 megapixels) would let a 373 KB PNG take gigabytes.
BUDGET_VARIABLE = "CAFA_DECODE_BUDGET_MB"
DEFAULT_BUDGET_MB = 150
BYTES_PER_PIXEL = {
    "1": 1,
    "L": 1,
    "P": 1,
    "LA": 2,
    "PA": 2,
    "La": 2,
    "RGB": 3,
    "YCbCr": 3,
    "LAB": 3,
    "HSV": 3,
    "RGBA": 4,
    "RGBa": 4,
    "RGBX": 4,
    "CMYK": 4,
    "I;16": 2,
    "I;16L": 2,
    "I;16B": 2,
    "I;16N": 2,
    "I": 4,
    "F": 4,
}


def decode_budget() -> int:
    """The decoding budget in bytes, from CAFA_DECODE_BUDGET_MB (a positive number of MB)."""
    text = os.environ.get(BUDGET_VARIABLE)
    try:
        megabytes = float(text) if text else DEFAULT_BUDGET_MB
    except ValueError:
        megabytes = math.nan
    if not 0 < megabytes < math.inf:
        raise UsageError(
            f"{BUDGET_VARIABLE}={text!r}: give the decoding budget in MB, a positive number (default "
            f"{DEFAULT_BUDGET_MB})"
        )
    return int(megabytes * 2**20)


# --outliers PATH[:SHARE]: images from outside the label set mixed into each stream (data/outliers.py mixes them)
DEFAULT_OUTLIER_SHARE = 0.2  # STAMP's: 2,500 outliers beside CIFAR-C's 10,000 images
GENERATED_OUTLIERS = ("noise:gaussian", "noise:uniform")  # made on the fly, as STAMP's data/Gaussian.py makes them


def parse_outliers(text: str, name: str = "outliers") -> tuple[str, float]:
    """'svhn/' -> ('svhn/', 0.2); 'noise:gaussian:0.5' -> ('noise:gaussian', 0.5): the text after the last
    colon is the share when it reads as a number, else part of the path (fashion-mnist:ROOT)."""
    text = str(text).strip()
    source, colon, tail = text.rpartition(":")
    try:
        share = float(tail) if colon else None
    except ValueError:
        share = None
    if share is None:
        source, share = text, DEFAULT_OUTLIER_SHARE
    check_outlier_share(share, name)
    if not source or source == "-":
        raise UsageError(
            f"`{name}` {text!r}: give the outlier images as PATH[:SHARE], a folder, an array or a data set, or "
            f"noise:gaussian:0.2"
        )
    if source.startswith("noise:") and source not in GENERATED_OUTLIERS:
        raise UsageError(
            f"`{name}` {source}: the generated outliers are {' and '.join(GENERATED_OUTLIERS)}; give one of them, "
            f"or a folder or array of images"
        )
    return source, share


def check_outlier_share(share: float, name: str = "outliers") -> None:
    """The share of a stream's images that are outliers: [0, 1), 0 mixing none (a share of 1 would be a
    stream of outliers alone, and the count share / (1 - share) of in-distribution images infinite)."""
    if not 0 <= share < 1:  # NaN fails both
        raise UsageError(
            f"`{name}`: the share of the stream's images that are outliers is in [0, 1) (0.2: one image in five), "
            f"not {share:g}"
        )
