"""Image folders (one subfolder per class, or unlabelled) and image paths on stdin."""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

from cafa_cli.core.errors import InputError, listing, printable
from cafa_cli.data.domain import UNLABELLED, Domain
from cafa_cli.data.values import BUDGET_VARIABLE, BYTES_PER_PIXEL, decode_budget

# Raster formats Pillow decodes itself. Pillow picks the decoder from the bytes, not the
# name: without this list a PostScript file named .jpg in an untrusted folder would be
# handed to Ghostscript (EPS), a program outside this process.
DECODERS = (
    "JPEG",
    "PNG",
    "WEBP",
    "AVIF",
    "BMP",
    "DIB",
    "GIF",
    "TIFF",
    "PPM",
    "TGA",
    "JPEG2000",
    "ICO",
    "PCX",
    "SGI",
    "QOI",
    "DDS",
)


def _extensions_of(formats: tuple[str, ...]) -> set[str]:
    Image.init()  # every plug-in registered, so that the table is complete
    return {extension for extension, name in Image.registered_extensions().items() if name in formats}


# The files a folder's images are found by: the extensions Pillow gives those formats
# (.tif and .gif too), so that a folder holds what a list of paths on stdin may name.
IMAGE_EXTENSIONS = _extensions_of(DECODERS)
LOOKED_FOR = f"files of {', '.join(DECODERS)} by their extensions"


def is_image(path: str) -> bool:
    """An image file by its extension; hidden files (macOS `._x.jpg`) are not data. A broken
    symlink counts, so that it is reported as unreadable rather than dropped unseen.
    Plain strings, not Paths: an ImageNet-C domain lists 50,000 of them (about 2x faster)."""
    name = os.path.basename(path)
    return (
        not name.startswith(".")
        and os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS
        and (os.path.isfile(path) or os.path.islink(path))
    )


def _path_order(path: str) -> list[str]:
    """Sort key: the order of pathlib's paths (component by component), so that listings,
    stream orders and sampled subsets stay those of earlier versions."""
    return os.path.normcase(path).split(os.sep)


def _images_below(folder: Path, classes: Sequence[Path]) -> list[str]:
    """Every image in a class folder and its sub-folders, symlinked ones included (each
    real folder once, so a link loop ends); hidden folders (.ipynb_checkpoints) are skipped,
    and so is a link up to a folder that holds this one (it would bring in the other classes).
    A link sideways, to another of the domain's `classes` or to a folder of class folders (another
    domain), is refused: its images would take this folder's label."""
    found, seen, top = [], set(), os.path.realpath(folder)

    def unreadable(error: OSError) -> None:
        raise InputError(
            f"cannot list the folder {error.filename} ({error.strerror}); fix its permissions, or move it out of the "
            "data"
        )

    for here, subfolders, files in os.walk(folder, followlinks=True, onerror=unreadable):
        real = os.path.realpath(here)
        if real in seen:
            subfolders.clear()
            continue
        seen.add(real)
        subfolders[:] = [
            name for name in subfolders if not name.startswith(".") and not _holds(os.path.join(here, name), top)
        ]
        for name in subfolders:
            _check_sideways(os.path.join(here, name), folder, classes)
        found += [path for path in (os.path.join(here, name) for name in files) if is_image(path)]
    return sorted(found, key=_path_order)


def _check_sideways(path: str, folder: Path, classes: Sequence[Path]) -> None:
    """A linked sub-folder of the class folder `folder` that is (or is inside) another class's
    folder, is named as another class, or holds folders named as the other classes (another
    domain): its images would take this folder's label."""
    if not os.path.islink(path):
        return
    real = os.path.realpath(path)
    others = [other for other in classes if other.name != folder.name]
    inside = next((other.name for other in others if _holds(str(other), real)), None)
    named = next((other.name for other in others if other.name == os.path.basename(real)), None)
    holds = any(os.path.isdir(os.path.join(real, other.name)) for other in others)
    if inside or named or holds:
        what = (
            f"the class folder {inside}"
            if inside
            else f"a folder of the class {named}"
            if named
            else "a folder of class folders (another domain)"
        )
        raise InputError(
            f"`data` {folder.parent}: {printable(path)} links to {printable(real)}, {what}; its images would "
            f"be labelled {printable(folder.name)}: remove the link (a class folder may itself be a link)"
        )


def _holds(folder: str, inner: str) -> bool:
    real = os.path.realpath(folder)
    return os.path.commonpath([real, inner]) == real


def within_budget(image: Image.Image, budget: int) -> Image.Image:
    """The opened (not yet decoded) image, set to decode within `budget` bytes: as it is, a
    JPEG reduced by its DCT scaling, or an error (DecompressionBombError: skipped as unreadable)."""
    width, height = image.size
    per_pixel = BYTES_PER_PIXEL.get(image.mode, 4)
    if width * height * per_pixel <= budget:
        return image
    if image.format == "JPEG":
        scale = next((s for s in (2, 4, 8) if math.ceil(width / s) * math.ceil(height / s) * per_pixel <= budget), None)
        if scale is not None:
            # draft picks the largest scale whose result is at least the size asked: ask the floor
            image.draft(image.mode, (max(1, width // scale), max(1, height // scale)))
            if image.size[0] * image.size[1] * per_pixel <= budget:
                return image
    raise Image.DecompressionBombError(
        f"{width}x{height} pixels ({image.mode}) would take {width * height * per_pixel / 2**20:,.0f} MB decoded, "
        "above the "
        f"decoding budget of {budget / 2**20:,.0f} MB ({BUDGET_VARIABLE}); shrink the image, or raise the budget"
    )


def read_image(path: str) -> Image.Image:
    try:
        kind = os.stat(path).st_mode
    except OSError:  # missing or unreachable: Image.open says which, as for any file it cannot open
        kind = stat.S_IFREG
    if not stat.S_ISREG(kind):  # a FIFO or a device would block or never end
        raise UnidentifiedImageError("not a regular file")
    budget = decode_budget()
    try:
        with Image.open(path, formats=DECODERS) as image:
            within_budget(image, budget).load()  # decode now so that truncated files fail here, not later
            return upright(image)
    except UnidentifiedImageError:
        empty = Path(path).stat().st_size == 0
        raise UnidentifiedImageError(
            "empty file (0 bytes)" if empty else f"not an image in a format cafa reads: {', '.join(DECODERS)}"
        ) from None


def upright(image: Image.Image) -> Image.Image:
    """The image turned as its EXIF orientation says (ImageOps.exif_transpose): a phone
    stores a photo as the sensor read it, sideways or upside down, and a tag that says how
    to show it. Without the tag (or with a damaged EXIF block) the image is returned as it
    is, the same object."""
    try:
        orientation = image.getexif().get(ExifTags.Base.Orientation, 1)
        return ImageOps.exif_transpose(image) if orientation in range(2, 9) else image
    except Exception:  # EXIF parsing fails in many ways (SyntaxError, struct.error, KeyError...): the pixels are fine
        return image


def _folder_domain(root: Path) -> Domain:
    """root/<class>/<images> is labelled; root/<images> is an unlabelled stream."""
    class_dirs = sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    refs: list[str] = []
    labels: list[int] = []
    class_names = [d.name for d in class_dirs]
    for label, folder in enumerate(class_dirs):
        images = _images_below(folder, class_dirs)
        refs += images
        labels += [label] * len(images)
    top = sorted(
        (path for path in (os.path.join(root, name) for name in os.listdir(root)) if is_image(path)), key=_path_order
    )
    notes = []
    if refs and top:
        # they have no label, and a labelled run cannot mix in unlabelled images: say so, not drop them unseen
        notes.append(
            f"`data` {root}: ignoring {len(top)} image(s) at the top level, outside the class folders "
            f"({listing(os.path.basename(path) for path in top)}); move them into their class folders"
        )
    if not refs:
        if not top and class_dirs:
            shown = listing(d.name for d in class_dirs)
            raise InputError(f"`data` {root}: no images found in the class folders {shown} (looked for {LOOKED_FOR})")
        if not top:
            raise InputError(
                f"`data` {root}: no images found (looked for {LOOKED_FOR}, in class sub-folders and at the top level)"
            )
        refs = top
        labels = [UNLABELLED] * len(refs)
        class_names = []
    return Domain(
        str(root), refs, np.asarray(labels, dtype=np.int64), class_names, lambda i: read_image(refs[i]), notes=notes
    )


def _stdin_domain(stream) -> Domain:
    # bytes decoded as the file system does, so that any file name comes through; a name
    # may begin or end with a space, so spaces are cut only when the path as written is not there
    lines = (os.fsdecode(line) for line in stream.buffer) if hasattr(stream, "buffer") else stream
    written = [ref for ref in (line.rstrip("\r\n") for line in lines) if ref.strip()]
    refs = [ref if os.path.lexists(ref) or not os.path.lexists(ref.strip()) else ref.strip() for ref in written]
    if not refs:
        raise InputError("`data` -: stdin held no image paths (give one path per line)")
    return Domain("-", refs, np.full(len(refs), UNLABELLED, dtype=np.int64), [], lambda i: read_image(refs[i]))
