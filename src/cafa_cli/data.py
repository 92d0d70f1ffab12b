"""Where images come from: image folders, CIFAR-style arrays, training sets, stdin.

Every source becomes a `Domain`: a list of references (paths), integer labels that
index `class_names` (-1 when unknown), and a function that reads one image. Labels
are always resolved through class *names*, never by re-enumerating the folders a
test set happens to have.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import signal
import sys
import unicodedata
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import DataLoader, Dataset

from cafa_cli.errors import InputError, UsageError, listing, repeated
from cafa_cli.preprocessing import Preprocessing

MAX_CLASSES = 1_000_000  # class indices in a labels array; ImageNet-21k has 21,841 classes
IMAGE_EXTENSIONS = {".jpg", ".jpeg", ".png", ".webp", ".bmp"}
# what reading a damaged, truncated or hostile image file raises
UNREADABLE = (OSError, UnidentifiedImageError, ValueError, SyntaxError, Image.DecompressionBombError)
UNLABELLED = -1


@dataclass
class Domain:
    name: str
    refs: list[str]
    labels: np.ndarray  # int64, indexes class_names; UNLABELLED where unknown
    class_names: list[str]
    read: Callable[[int], Image.Image]
    indexed_labels: bool = False  # labels are output indices (arrays), not names
    # what opening it noticed but let pass (one line each); the caller shows them as warnings
    notes: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.refs)

    @property
    def labelled(self) -> bool:
        return bool(len(self.labels)) and bool((self.labels != UNLABELLED).all())


def open_domain(
    spec: str,
    class_names: Sequence[str] | None = None,
    labels: str | None = None,
    severity: int | None = None,
    stdin=None,
) -> Domain:
    """Open one `--data` value.

    `class_names`, when given, is the model's output order (from `--classes` or the
    artifact); labels are mapped into it by name. Without it, an image folder's
    sorted folder names become the class list.
    """
    is_array = Path(spec).suffix.lower() == ".npy"
    if labels is not None and not is_array:
        raise UsageError(f"--labels is only for .npy arrays, and --data {spec} is not one; image folders take labels from class folders")
    if severity is not None and not is_array:
        raise UsageError(
            "--severity is only for .npy arrays that stack 5 severities (CIFAR-10-C); "
            "for an image folder, give the folder of one severity as --data"
        )
    kind, _, root = spec.partition(":")
    if kind in TRAINING_SETS and (root or not Path(spec).exists()):
        domain = TRAINING_SETS[kind](Path(root) if root else None)
    elif spec == "-":
        domain = _stdin_domain(stdin if stdin is not None else sys.stdin)
    else:
        path = Path(spec)
        if not path.exists():
            raise InputError(f"--data {spec}: no such file or folder")
        if path.is_dir():
            domain = _folder_domain(path)
        elif path.suffix.lower() == ".npy":
            domain = _array_domain(path, labels, severity)
        else:
            raise InputError(
                f"--data {spec}: expected an image folder, a .npy array, '-' (paths on stdin) "
                f"or one of {', '.join(k + ':ROOT' for k in TRAINING_SETS)}"
            )
    if class_names is not None:
        domain = relabel(domain, list(class_names))
    return domain


def on_disk(spec: str) -> str:
    """Where a --data value lies in the file system: ROOT for `cifar10:ROOT` and the like."""
    kind, _, root = spec.partition(":")
    return root if kind in TRAINING_SETS and root else spec


def relabel(domain: Domain, class_names: list[str]) -> Domain:
    """Map the domain's labels into `class_names` by name.

    Arrays carry label indices, not names: those are checked against the class count.
    """
    if domain.class_names == class_names or not domain.class_names:
        return replace(domain, class_names=class_names)
    if domain.indexed_labels:
        if int(domain.labels.max(initial=-1)) >= len(class_names):
            raise InputError(
                f"{domain.name}: label {int(domain.labels.max())} is out of range for {len(class_names)} classes"
            )
        return replace(domain, class_names=class_names)
    find = _class_finder(class_names)
    unknown = sorted(n for n in set(domain.class_names) if find(n) is None)
    used = set(domain.labels[domain.labels != UNLABELLED].tolist())
    unknown_used = [n for n in unknown if domain.class_names.index(n) in used]
    if unknown_used:
        shown = listing(unknown_used)
        plain = {_plain(name): name for name in class_names}
        near = [f"{plain[_plain(n)]} for {n}" for n in unknown_used if _plain(n) in plain]
        hint = f" (did you mean {listing(near)}?)" if near else ""
        raise InputError(
            f"{domain.name}: class folder(s) {shown} not in the model's class list ({len(class_names)} classes){hint}; "
            f"rename them to the model's class names, or compute the statistics with their class list (cafa stats --classes)"
        )
    positions = [find(n) for n in domain.class_names]
    lookup = np.array([UNLABELLED if p is None else p for p in positions] + [UNLABELLED], dtype=np.int64)
    return replace(domain, labels=lookup[domain.labels], class_names=class_names)


def _class_finder(class_names: list[str]) -> Callable[[str], int | None]:
    """A name's class position: by the exact name, else by its composed Unicode form where
    that form is one class's only. macOS writes folder names decomposed (NFD), most other
    systems and class lists composed (NFC), and the two print the same."""
    exact = {name: i for i, name in enumerate(class_names)}
    composed: dict[str, int | None] = {}
    for i, name in enumerate(class_names):
        key = unicodedata.normalize("NFC", name)
        composed[key] = None if key in composed else i  # two classes of one form: neither is found by it

    def find(name: str) -> int | None:
        return exact[name] if name in exact else composed.get(unicodedata.normalize("NFC", name))

    return find


def _plain(name: str) -> str:
    """A class name without case, spaces, hyphens or underscores, to suggest near misses."""
    return "".join(ch for ch in name.lower() if ch not in " -_")


def read_class_list(path: str) -> list[str]:
    file = Path(path)
    if file.exists() and not file.is_file():
        # a pipe (`--classes <(...)`) can be read only once, and the list is read more than once
        raise InputError(f"--classes {path}: not a regular file (a folder or a pipe); write the class list to a file")
    if not file.is_file():
        raise InputError(f"--classes {path}: no such file (give one class name per line, in output order)")
    try:
        text = file.read_text(encoding="utf-8-sig")  # a byte-order mark (Windows editors) is not part of the first name
        binary = "\0" in text  # valid UTF-8 can still be binary: a safetensors header starts with NUL bytes
    except UnicodeDecodeError:
        binary = True
    if binary:
        raise InputError(f"--classes {path}: not a UTF-8 text file; the class list must be UTF-8 text with one class name per line")
    names = [line.strip() for line in text.splitlines() if line.strip()]
    if not names:
        raise InputError(f"--classes {path}: the file lists no class names")
    duplicates = sorted(repeated(names))
    if duplicates:
        raise InputError(f"--classes {path}: class names repeat: {', '.join(duplicates[:5])}")
    return names


# --- image folders ---------------------------------------------------------------


def is_image(path: str) -> bool:
    """An image file by its extension; hidden files (macOS `._x.jpg`) are not data. A broken
    symlink counts, so that it is reported as unreadable rather than dropped unseen.
    Plain strings, not Paths: an ImageNet-C domain lists 50,000 of them (about 2x faster)."""
    name = os.path.basename(path)
    return (not name.startswith(".") and os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS
            and (os.path.isfile(path) or os.path.islink(path)))


def _path_order(path: str) -> list[str]:
    """Sort key: the order of pathlib's paths (component by component), so that listings,
    stream orders and sampled subsets stay those of earlier versions."""
    return os.path.normcase(path).split(os.sep)


def _images_below(folder: Path) -> list[str]:
    """Every image in a class folder and its sub-folders, symlinked ones included (each
    real folder once, so a link loop ends); hidden folders (.ipynb_checkpoints) are skipped,
    and so is a link up to a folder that holds this one (it would bring in the other classes)."""
    found, seen, top = [], set(), os.path.realpath(folder)

    def unreadable(error: OSError) -> None:
        raise InputError(f"cannot list the folder {error.filename} ({error.strerror}); fix its permissions, or move it out of the data")

    for here, subfolders, files in os.walk(folder, followlinks=True, onerror=unreadable):
        real = os.path.realpath(here)
        if real in seen:
            subfolders.clear()
            continue
        seen.add(real)
        subfolders[:] = [name for name in subfolders if not name.startswith(".") and not _holds(os.path.join(here, name), top)]
        found += [path for path in (os.path.join(here, name) for name in files) if is_image(path)]
    return sorted(found, key=_path_order)


def _holds(folder: str, inner: str) -> bool:
    real = os.path.realpath(folder)
    return os.path.commonpath([real, inner]) == real


def padding_note(domain: Domain, preprocess: Preprocessing) -> str | None:
    """Preprocessing.padding_note for a domain's first readable image (one image: cheap)."""
    for i in range(min(len(domain), 8)):
        try:
            return preprocess.padding_note(domain.read(i), domain.name)
        except UNREADABLE:
            continue
    return None


# Raster formats Pillow decodes itself. Pillow picks the decoder from the bytes, not the
# name: without this list a PostScript file named .jpg in an untrusted folder would be
# handed to Ghostscript (EPS), a program outside this process.
DECODERS = ("JPEG", "PNG", "WEBP", "AVIF", "BMP", "DIB", "GIF", "TIFF", "PPM", "TGA", "JPEG2000", "ICO", "PCX", "SGI", "QOI", "DDS")


def read_image(path: str) -> Image.Image:
    if os.path.exists(path) and not os.path.isfile(path):  # a FIFO or a device would block or never end
        raise UnidentifiedImageError("not a regular file")
    try:
        with Image.open(path, formats=DECODERS) as image:
            image.load()  # decode now so that truncated files fail here, not later
            return image
    except UnidentifiedImageError:
        empty = Path(path).stat().st_size == 0
        raise UnidentifiedImageError("empty file (0 bytes)" if empty else f"not an image in a format cafa reads: {', '.join(DECODERS)}") from None


def _folder_domain(root: Path) -> Domain:
    """root/<class>/<images> is labelled; root/<images> is an unlabelled stream."""
    class_dirs = sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    refs: list[str] = []
    labels: list[int] = []
    class_names = [d.name for d in class_dirs]
    for label, folder in enumerate(class_dirs):
        images = _images_below(folder)
        refs += images
        labels += [label] * len(images)
    top = sorted((path for path in (os.path.join(root, name) for name in os.listdir(root)) if is_image(path)), key=_path_order)
    notes = []
    if refs and top:
        # they have no label, and a labelled run cannot mix in unlabelled images: say so, not drop them unseen
        notes.append(
            f"--data {root}: ignoring {len(top)} image(s) at the top level, outside the class folders "
            f"({listing(os.path.basename(path) for path in top)}); move them into their class folders"
        )
    if not refs:
        if not top and class_dirs:
            shown = listing(d.name for d in class_dirs)
            raise InputError(
                f"--data {root}: no images found in the class folders {shown} "
                f"(looked for {', '.join(sorted(IMAGE_EXTENSIONS))})"
            )
        if not top:
            raise InputError(
                f"--data {root}: no images found (looked for {', '.join(sorted(IMAGE_EXTENSIONS))} "
                f"in class sub-folders and at the top level)"
            )
        refs = top
        labels = [UNLABELLED] * len(refs)
        class_names = []
    return Domain(str(root), refs, np.asarray(labels, dtype=np.int64), class_names, lambda i: read_image(refs[i]), notes=notes)


def _stdin_domain(stream) -> Domain:
    # bytes decoded as the file system does, so that any file name comes through; a name
    # may begin or end with a space, so spaces are cut only when the path as written is not there
    lines = (os.fsdecode(line) for line in stream.buffer) if hasattr(stream, "buffer") else stream
    written = [ref for ref in (line.rstrip("\r\n") for line in lines) if ref.strip()]
    refs = [ref if os.path.lexists(ref) or not os.path.lexists(ref.strip()) else ref.strip() for ref in written]
    if not refs:
        raise InputError("--data -: stdin held no image paths (give one path per line)")
    return Domain("-", refs, np.full(len(refs), UNLABELLED, dtype=np.int64), [], lambda i: read_image(refs[i]))


# --- arrays ----------------------------------------------------------------------


NPY_MAGIC = b"\x93NUMPY"
NPY_INSTEAD = {
    "--data": "save the images with numpy.save as a uint8 array, or give an image folder",
    "--labels": "save the labels with numpy.save as a 1-D integer array",
}


def _load_npy(path: Path, what: str) -> np.ndarray:
    # numpy's own errors for these advise allow_pickle=, which would let the file run code
    instead = NPY_INSTEAD[what]
    try:
        with open(path, "rb") as f:
            magic = f.read(len(NPY_MAGIC))
        if magic != NPY_MAGIC:
            why = "the file is empty" if not magic else "a .npz archive" if magic.startswith(b"PK") else "no .npy header"
            raise InputError(f"{what} {path}: not a NumPy .npy array ({why}); {instead}")
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as error:
        if "Python objects" in str(error) or "pickle" in str(error):
            raise InputError(f"{what} {path}: the array holds Python objects, which cafa does not load; {instead}") from None
        raise InputError(f"{what} {path}: not a readable .npy array ({error}); the file is damaged or cut short: save it again with numpy.save") from None


def _array_domain(path: Path, labels_path: str | None, severity: int | None) -> Domain:
    images = _load_npy(path, "--data")
    if images.dtype != np.uint8 or images.ndim not in (3, 4) or (images.ndim == 4 and images.shape[-1] not in (1, 3)):
        raise InputError(
            f"--data {path}: expected uint8 images shaped N×H×W or N×H×W×C (C = 1 or 3), "
            f"got {images.dtype} {tuple(images.shape)}"
        )
    if not len(images):
        raise InputError(f"--data {path}: the array holds no images")
    if labels_path is None:
        labels = np.full(len(images), UNLABELLED, dtype=np.int64)
    else:
        raw = _load_npy(Path(labels_path), "--labels")
        if raw.ndim != 1 or not np.issubdtype(raw.dtype, np.integer):
            raise InputError(f"--labels {labels_path}: expected a 1-D integer array, got {raw.dtype} {raw.shape}")
        # checked in the file's own type: uint64 2**63 would wrap to a negative int64
        if raw.min(initial=0) < 0:  # -1 too: it would pass for "unlabelled" and leave images out of the error
            raise InputError(f"--labels {labels_path}: labels must be class indices >= 0, not {int(raw.min())}")
        if raw.max(initial=0) >= MAX_CLASSES:  # one name is made per class index: 2**40 of them exhaust the memory
            raise InputError(f"--labels {labels_path}: class index {int(raw.max())} is past any classifier's outputs "
                             f"(at most {MAX_CLASSES:,}); check that the file holds class indices")
        labels = np.asarray(raw, dtype=np.int64)
    rows = np.arange(len(images))
    if severity is not None:
        if not 1 <= severity <= 5:
            raise UsageError(f"--severity must be 1-5, not {severity}")
        if len(images) % 5:
            raise InputError(f"--data {path}: {len(images)} rows do not split into 5 severities; "
                             f"--severity is for arrays that stack 5 severities of equal size (CIFAR-10-C): leave it out for one")
        per = len(images) // 5
        rows = rows[(severity - 1) * per : severity * per]
    if len(labels) == len(images):
        labels = labels[rows]
    elif len(labels) != len(rows):
        raise InputError(f"--labels {labels_path}: {len(labels)} labels for {len(rows)} images")
    count = int(labels.max(initial=-1)) + 1
    refs = [f"{path}#{int(r)}" for r in rows]

    def read(i: int) -> Image.Image:
        pixels = np.asarray(images[rows[i]])
        return Image.fromarray(pixels[..., 0] if pixels.ndim == 3 and pixels.shape[-1] == 1 else pixels)

    return Domain(str(path), refs, labels, [str(c) for c in range(count)], read, indexed_labels=True)


# --- standard training sets (never downloaded) -----------------------------------


def _latin1_bytes(text: str, encoding: str = "latin1") -> bytes:
    """What a protocol-2 pickle written by Python 3 calls to rebuild bytes (as `_codecs.encode`)."""
    if encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"refusing to load _codecs.encode with encoding {encoding!r}")
    return text.encode("latin1")


class _ArrayOnlyUnpickler(pickle.Unpickler):
    """CIFAR's python batches are pickles: allow numpy arrays and plain data only,
    so that a tampered file cannot run code. Besides the original Python 2 files,
    re-saves by Python 3 load: protocol 2 (bytes via `_codecs.encode`) up to 5
    (arrays via `_frombuffer`)."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
    }

    def find_class(self, module, name):
        if (module, name) == ("_codecs", "encode"):
            return _latin1_bytes
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


CIFAR_AGAIN = "unpack the python version of the dataset again"


def _read_cifar_batch(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            batch = _ArrayOnlyUnpickler(f, encoding="bytes").load()
    except (OSError, pickle.UnpicklingError, EOFError, ValueError) as error:
        raise InputError(f"{path}: not a readable CIFAR batch ({error})") from None
    if not isinstance(batch, dict):
        raise InputError(f"{path}: not a CIFAR batch (a pickled {type(batch).__name__}, not a dict); {CIFAR_AGAIN}")
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in batch.items()}


def _cifar_images(path: Path, label_key: str, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """A batch's N×3072 uint8 pixels and its N labels in [0, num_classes), checked: a cast
    would turn float pixels black, and a short label list would shift every later label."""
    batch = _read_cifar_batch(path)
    pixels, labels = batch.get("data"), batch.get(label_key)
    if not (isinstance(pixels, np.ndarray) and pixels.dtype == np.uint8 and pixels.ndim == 2 and pixels.shape[1] == 3072):
        found = f"{pixels.dtype} {pixels.shape}" if isinstance(pixels, np.ndarray) else type(pixels).__name__
        raise InputError(f"{path}: not a CIFAR batch ('data' must be an N×3072 uint8 array, not {found}); {CIFAR_AGAIN}")
    labels = np.asarray(labels) if isinstance(labels, (list, np.ndarray)) else np.empty(0, dtype=object)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer) or len(labels) != len(pixels):
        raise InputError(f"{path}: not a CIFAR batch ('{label_key}' must hold one integer per image, {len(pixels)}); {CIFAR_AGAIN}")
    if len(labels) and not 0 <= labels.min() <= labels.max() < num_classes:
        bad = int(labels.min()) if labels.min() < 0 else int(labels.max())
        raise InputError(f"{path}: label {bad} is out of range for the {num_classes} classes its meta file names; {CIFAR_AGAIN}")
    return pixels, labels.astype(np.int64)


def _cifar(root: Path | None, folder: str, files: list[str], meta: str, label_key: str, names_key: str) -> Domain:
    if root is None:
        raise UsageError(f"give the folder that holds {folder}: e.g. --data {'cifar10' if '10' in folder else 'cifar100'}:/data")
    base = root / folder if (root / folder).is_dir() else root
    missing = [f for f in files + [meta] if not (base / f).is_file()]
    if missing:
        raise InputError(
            f"CIFAR files missing in {base}: {', '.join(missing)}; unpack the python version "
            f"of the dataset so that {root}/{folder}/{files[0]} exists (cafa never downloads)"
        )
    names = _read_cifar_batch(base / meta).get(names_key)
    if not isinstance(names, list) or not names or not all(isinstance(n, (bytes, str)) for n in names):
        raise InputError(f"{base / meta}: not CIFAR's meta file ('{names_key}' must list the class names); {CIFAR_AGAIN}")
    names = [n.decode() if isinstance(n, bytes) else n for n in names]
    batches = [_cifar_images(base / f, label_key, len(names)) for f in files]
    images = np.concatenate([pixels for pixels, _ in batches]).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    labels = np.concatenate([labels for _, labels in batches])
    refs = [f"{folder}#{i}" for i in range(len(images))]
    return Domain(f"{folder}", refs, labels, names, lambda i: Image.fromarray(images[i]))


def _cifar10(root: Path) -> Domain:
    files = [f"data_batch_{i}" for i in range(1, 6)]
    return _cifar(root, "cifar-10-batches-py", files, "batches.meta", "labels", "label_names")


def _cifar100(root: Path) -> Domain:
    return _cifar(root, "cifar-100-python", ["train"], "meta", "fine_labels", "fine_label_names")


def _fashion_mnist(root: Path | None, split: str) -> Domain:
    from cafa_cli.fashion_mnist import FASHION_MNIST_CLASSES, load_fashion_mnist

    images, labels = load_fashion_mnist(root, split)
    refs = [f"fashion-mnist-{split}#{i}" for i in range(len(images))]
    return Domain(f"fashion-mnist-{split}", refs, labels.astype(np.int64), list(FASHION_MNIST_CLASSES),
                  lambda i: Image.fromarray(images[i]))


TRAINING_SETS: dict[str, Callable[[Path | None], Domain]] = {
    "cifar10": _cifar10,
    "cifar100": _cifar100,
    "fashion-mnist": lambda root: _fashion_mnist(root, "train"),
    "fashion-mnist-test": lambda root: _fashion_mnist(root, "test"),
}


# --- sampling and loading ---------------------------------------------------------


def stratified_subset(
    labels: np.ndarray,
    class_names: Sequence[str],
    fraction: float | None = None,
    per_class: int | None = None,
    seed: int = 0,
) -> np.ndarray:
    """Indices of a per-class random subset: round(fraction·N_c) or min(per_class, N_c).

    Reproducible: the same seed gives the same subset, whatever else the folder holds.
    """
    counts = np.bincount(labels[labels >= 0], minlength=len(class_names))
    empty = [name for c, name in enumerate(class_names) if counts[c] == 0]
    if empty:
        # a larger fraction of nothing is nothing: the images themselves are missing
        noun = "class" if len(empty) == 1 else "classes"
        raise InputError(
            f"no images of {noun} {listing(empty)} in the data, and statistics need every class; "
            f"give each its folder of images (e.g. {empty[0]}/ in the --data folder)"
        )
    generator = np.random.default_rng(seed)
    chosen: list[np.ndarray] = []
    too_few: list[str] = []
    for c, name in enumerate(class_names):
        members = np.flatnonzero(labels == c)
        take = min(per_class, len(members)) if per_class is not None else int(round(fraction * len(members)))
        if take < 2:
            too_few.append(f"{name} ({take} of {len(members)})")
            continue
        chosen.append(np.sort(generator.choice(members, size=take, replace=False)))
    if too_few:
        shown = listing(too_few)
        raise InputError(
            f"classes with fewer than 2 selected images: {shown}; "
            f"raise --fraction/--per-class or add images"
        )
    return np.sort(np.concatenate(chosen))


def subset_sha256(domain: Domain, indices: np.ndarray) -> str:
    """Which images a subset holds, wherever the data lies: each one's path below the
    domain (a row for arrays) and its class index, so two artifacts can be checked to
    come from the same sample."""
    digest = hashlib.sha256()
    for i in indices:
        ref = domain.refs[i]
        below = ref[len(domain.name):].lstrip("/") if ref.startswith(domain.name) else ref
        digest.update(f"{below}\t{domain.labels[i]}\n".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()


class _DomainImages(Dataset):
    def __init__(self, domain: Domain, indices: np.ndarray, preprocess: Preprocessing):
        self.domain, self.indices, self.preprocess = domain, indices, preprocess

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, position: int):
        i = int(self.indices[position])
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                image = self.preprocess.pixels(self.domain.read(i))
        except UNREADABLE as error:
            return None, i, f"{type(error).__name__}: {error}"
        return image, i, None


@dataclass
class Batch:
    images: torch.Tensor | None  # uint8 pixels (Preprocessing.normalize makes them model input); None when every image failed to read
    indices: list[int]  # positions in the domain of the images that were read
    failures: list[tuple[int, str]]  # (position, why) of the images that were not

    def pin_memory(self) -> Batch:
        """What DataLoader(pin_memory=True) calls; without it a dataclass passes through
        unpinned, and every non_blocking copy to the GPU would block the host."""
        return replace(self, images=None if self.images is None else self.images.pin_memory())


def unreadable(domain: Domain, batch: Batch, strict: bool) -> list[tuple[str, str]]:
    """(path, why) of the batch's images that could not be read; with `strict`, the
    first one is an error instead."""
    skipped = [(domain.refs[i], why) for i, why in batch.failures]
    if strict and skipped:
        ref, why = skipped[0]
        raise InputError(f"{ref}: unreadable image ({why}); remove it, or drop --strict to skip such files")
    return skipped


def _collate(items) -> Batch:
    good = [(image, i) for image, i, error in items if error is None]
    failures = [(i, error) for _, i, error in items if error is not None]
    shapes = sorted({tuple(image.shape) for image, _ in good})
    if len(shapes) > 1:
        raise InputError(
            f"images of different sizes in one batch ({' and '.join('x'.join(map(str, s[1:])) for s in shapes[:2])}); "
            f"set --resize and --crop so that every image ends the same size"
        )
    images = torch.stack([image for image, _ in good]) if good else None
    return Batch(images, [i for _, i in good], failures)


def check_loading(batch_size: int, num_workers: int | None) -> None:
    """Also called by the pipeline's jobs before any model or data is read."""
    if not 1 <= batch_size < 2**31:
        raise UsageError(f"--batch-size must be at least 1 and below 2**31, not {batch_size}")
    if num_workers is not None and num_workers < 0:
        raise UsageError(f"--num-workers must be 0 or more, not {num_workers}")
    if num_workers is not None and num_workers > 4 * _usable_cores():
        # each is a process with its own copy of the interpreter: thousands exhaust the memory
        raise UsageError(f"--num-workers {num_workers} is more than 4 per CPU core ({_usable_cores()} here); "
                         f"loader processes beyond the cores only compete for them: give {_usable_cores()} or fewer")


def loader_processes(num_workers: int | None, device: torch.device) -> int:
    """`--num-workers`, or by default: on CUDA, every CPU core this process may use but
    one, shared among the ranks torchrun started on this machine (decoding images on
    one core cannot keep a GPU busy); on the CPU none, as the model's threads use the cores."""
    if num_workers is not None:
        return num_workers
    if device.type != "cuda":
        return 0
    return max(_usable_cores() // int(os.environ.get("LOCAL_WORLD_SIZE", "1")) - 1, 0)


def _usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def batches(
    domain: Domain,
    preprocess: Preprocessing,
    batch_size: int,
    indices: np.ndarray | None = None,
    num_workers: int | None = None,
    device: torch.device = torch.device("cpu"),
) -> DataLoader:
    """Batches of resized and cropped uint8 images in the order of `indices` (default:
    all, in order), loaded for `device` (pinned memory and loader processes on CUDA)."""
    check_loading(batch_size, num_workers)
    if indices is None:
        indices = np.arange(len(domain))
    workers = loader_processes(num_workers, device)
    return DataLoader(
        _DomainImages(domain, indices, preprocess),
        batch_size=batch_size,
        shuffle=False,
        num_workers=workers,
        collate_fn=_collate,
        pin_memory=device.type == "cuda",
        persistent_workers=False,
        worker_init_fn=_leave_signals_to_the_main_process if workers else None,
    )


def _leave_signals_to_the_main_process(worker_id: int) -> None:
    """A SIGTERM or Ctrl-C sent to the whole process group would kill the workers first,
    and the main process would then report a dead worker (with a traceback) instead of
    an interruption. The main process stops them when it unwinds; if it is killed
    outright, each worker's parent watchdog ends it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.excepthook = _quiet_when_the_main_process_is_gone


def _quiet_when_the_main_process_is_gone(exc_type, value, traceback) -> None:
    """multiprocessing's resource sharer, a worker thread that hands batch memory to the
    main process, loses its peer when an interrupted main process exits, and reports that
    through sys.excepthook: a traceback would then follow "cafa: interrupted" on stderr.
    Other errors print."""
    if not issubclass(exc_type, (ConnectionError, EOFError)):
        sys.__excepthook__(exc_type, value, traceback)
