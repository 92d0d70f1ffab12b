"""Arrays of images: .npy stacks (CIFAR-10-C layout), CIFAR's python batches (read
with an unpickler that admits NumPy arrays only) and Fashion-MNIST."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

from cafa_cli.core.errors import InputError, UsageError
from cafa_cli.core.files import reading
from cafa_cli.data.domain import MAX_CLASSES, UNLABELLED, Domain

NPY_MAGIC = b"\x93NUMPY"


NPY_INSTEAD = {
    "`data`": "save the images with numpy.save as a uint8 array, or give an image folder",
    "`labels`": "save the labels with numpy.save as a 1-D integer array",
}


def _load_npy(path: Path, what: str) -> np.ndarray:
    # numpy's own errors for these advise allow_pickle=, which would let the file run code
    instead = NPY_INSTEAD[what]
    reading(path, what)
    try:
        with open(path, "rb") as f:
            magic = f.read(len(NPY_MAGIC))
        if magic != NPY_MAGIC:
            why = (
                "the file is empty" if not magic else "a .npz archive" if magic.startswith(b"PK") else "no .npy header"
            )
            raise InputError(f"{what} {path}: not a NumPy .npy array ({why}); {instead}")
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as error:
        if "Python objects" in str(error) or "pickle" in str(error):
            raise InputError(
                f"{what} {path}: the array holds Python objects, which cafa does not load; {instead}"
            ) from None
        raise InputError(
            f"{what} {path}: not a readable .npy array ({error}); the file is damaged or cut short: save it again "
            "with numpy.save"
        ) from None


def _array_domain(path: Path, labels_path: str | None, severity: int | None) -> Domain:
    images = _load_npy(path, "`data`")
    if images.dtype != np.uint8 or images.ndim not in (3, 4) or (images.ndim == 4 and images.shape[-1] not in (1, 3)):
        raise InputError(
            f"`data` {path}: expected uint8 images shaped N×H×W or N×H×W×C (C = 1 or 3), "
            f"got {images.dtype} {tuple(images.shape)}"
        )
    if not len(images):
        raise InputError(f"`data` {path}: the array holds no images")
    if labels_path is None:
        labels = np.full(len(images), UNLABELLED, dtype=np.int64)
    else:
        raw = _load_npy(Path(labels_path), "`labels`")
        if raw.ndim != 1 or not np.issubdtype(raw.dtype, np.integer):
            raise InputError(f"`labels` {labels_path}: expected a 1-D integer array, got {raw.dtype} {raw.shape}")
        # checked in the file's own type: uint64 2**63 would wrap to a negative int64
        if raw.min(initial=0) < 0:  # -1 too: it would pass for "unlabelled" and leave images out of the error
            raise InputError(f"`labels` {labels_path}: labels must be class indices >= 0, not {int(raw.min())}")
        if raw.max(initial=0) >= MAX_CLASSES:  # one name is made per class index: 2**40 of them exhaust the memory
            raise InputError(
                f"`labels` {labels_path}: class index {int(raw.max())} is past any classifier's outputs "
                f"(at most {MAX_CLASSES:,}); check that the file holds class indices"
            )
        labels = np.asarray(raw, dtype=np.int64)
    rows = np.arange(len(images))
    if severity is not None:
        if not 1 <= severity <= 5:
            raise UsageError(f"`severity` must be 1-5, not {severity}")
        if len(images) % 5:
            raise InputError(
                f"`data` {path}: {len(images)} rows do not split into 5 severities; "
                f"`severity` is for arrays that stack 5 severities of equal size (CIFAR-10-C): leave it out for one"
            )
        per = len(images) // 5
        rows = rows[(severity - 1) * per : severity * per]
    if len(labels) == len(images):
        labels = labels[rows]
    elif len(labels) != len(rows):
        raise InputError(f"`labels` {labels_path}: {len(labels)} labels for {len(rows)} images")
    count = int(labels.max(initial=-1)) + 1
    refs = [f"{path}#{int(r)}" for r in rows]

    def read(i: int) -> Image.Image:
        pixels = np.asarray(images[rows[i]])
        return Image.fromarray(pixels[..., 0] if pixels.ndim == 3 and pixels.shape[-1] == 1 else pixels)

    return Domain(str(path), refs, labels, [str(c) for c in range(count)], read, indexed_labels=True)


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
    reading(path, "a data set")
    try:
        with open(path, "rb") as f:
            batch = _ArrayOnlyUnpickler(f, encoding="bytes").load()
    except MemoryError:
        raise
    except (OSError, pickle.UnpicklingError, EOFError, ValueError) as error:
        raise InputError(f"{path}: not a readable CIFAR batch ({error})") from None
    except Exception as error:  # what the admitted calls raise on hostile arguments: numpy.dtype('xyz') is a TypeError
        raise InputError(f"{path}: not a readable CIFAR batch ({type(error).__name__}: {error})") from None
    if not isinstance(batch, dict):
        raise InputError(f"{path}: not a CIFAR batch (a pickled {type(batch).__name__}, not a dict); {CIFAR_AGAIN}")
    return {_text(k, path, "a key"): v for k, v in batch.items()}


def _text(value: bytes | str, path: Path, what: str) -> str:
    """A Python 2 string of a CIFAR file as text; one that is not UTF-8 names the file."""
    try:
        return value.decode() if isinstance(value, bytes) else value
    except UnicodeDecodeError:
        raise InputError(f"{path}: {what} is not UTF-8 text ({value[:40]!r}); {CIFAR_AGAIN}") from None


def _cifar_images(path: Path, label_key: str, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """A batch's N×3072 uint8 pixels and its N labels in [0, num_classes), checked: a cast
    would turn float pixels black, and a short label list would shift every later label."""
    batch = _read_cifar_batch(path)
    pixels, labels = batch.get("data"), batch.get(label_key)
    if not (
        isinstance(pixels, np.ndarray) and pixels.dtype == np.uint8 and pixels.ndim == 2 and pixels.shape[1] == 3072
    ):
        found = f"{pixels.dtype} {pixels.shape}" if isinstance(pixels, np.ndarray) else type(pixels).__name__
        raise InputError(
            f"{path}: not a CIFAR batch ('data' must be an N×3072 uint8 array, not {found}); {CIFAR_AGAIN}"
        )
    labels = np.asarray(labels) if isinstance(labels, (list, np.ndarray)) else np.empty(0, dtype=object)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer) or len(labels) != len(pixels):
        raise InputError(
            f"{path}: not a CIFAR batch ('{label_key}' must hold one integer per image, {len(pixels)}); {CIFAR_AGAIN}"
        )
    if len(labels) and not 0 <= labels.min() <= labels.max() < num_classes:
        bad = int(labels.min()) if labels.min() < 0 else int(labels.max())
        raise InputError(
            f"{path}: label {bad} is out of range for the {num_classes} classes its meta file names; {CIFAR_AGAIN}"
        )
    return pixels, labels.astype(np.int64)


def _cifar(
    root: Path | None, folder: str, files: list[str], meta: str, label_key: str, names_key: str, name: str = ""
) -> Domain:
    """CIFAR's python version; `name` tells its test set from its training set ("": training)."""
    if root is None:
        raise UsageError(
            f"give the folder that holds {folder}: e.g. `data` "
            f"{'cifar10' if '10' in folder else 'cifar100'}{name}:/data"
        )
    base = root / folder if (root / folder).is_dir() else root
    missing = [f for f in files + [meta] if not (base / f).is_file()]
    if missing:
        raise InputError(
            f"CIFAR files missing in {base}: {', '.join(missing)}; unpack the python version "
            f"of the dataset so that {root}/{folder}/{files[0]} exists (cafa never downloads)"
        )
    names = _read_cifar_batch(base / meta).get(names_key)
    if not isinstance(names, list) or not names or not all(isinstance(n, (bytes, str)) for n in names):
        raise InputError(
            f"{base / meta}: not CIFAR's meta file ('{names_key}' must list the class names); {CIFAR_AGAIN}"
        )
    names = [_text(n, base / meta, "a class name") for n in names]
    batches = [_cifar_images(base / f, label_key, len(names)) for f in files]
    images = np.concatenate([pixels for pixels, _ in batches]).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    labels = np.concatenate([labels for _, labels in batches])
    domain_name = (
        f"{folder}/{files[0]}" if name else folder
    )  # the training set's as in earlier versions (artifacts' hashes)
    refs = [f"{domain_name}#{i}" for i in range(len(images))]
    return Domain(domain_name, refs, labels, names, lambda i: Image.fromarray(images[i]))


def _cifar10(root: Path) -> Domain:
    files = [f"data_batch_{i}" for i in range(1, 6)]
    return _cifar(root, "cifar-10-batches-py", files, "batches.meta", "labels", "label_names")


def _cifar100(root: Path) -> Domain:
    return _cifar(root, "cifar-100-python", ["train"], "meta", "fine_labels", "fine_label_names")


def _cifar10_test(root: Path) -> Domain:
    """The clean test images that CIFAR-10-C corrupts."""
    return _cifar(root, "cifar-10-batches-py", ["test_batch"], "batches.meta", "labels", "label_names", "-test")


def _cifar100_test(root: Path) -> Domain:
    return _cifar(root, "cifar-100-python", ["test"], "meta", "fine_labels", "fine_label_names", "-test")


def _fashion_mnist(root: Path | None, split: str) -> Domain:
    from cafa_cli.data.fashion_mnist import FASHION_MNIST_CLASSES, load_fashion_mnist

    images, labels = load_fashion_mnist(root, split)
    refs = [f"fashion-mnist-{split}#{i}" for i in range(len(images))]
    return Domain(
        f"fashion-mnist-{split}",
        refs,
        labels.astype(np.int64),
        list(FASHION_MNIST_CLASSES),
        lambda i: Image.fromarray(images[i]),
    )


TRAINING_SETS: dict[str, Callable[[Path | None], Domain]] = {
    "cifar10": _cifar10,
    "cifar100": _cifar100,
    "cifar10-test": _cifar10_test,
    "cifar100-test": _cifar100_test,
    "fashion-mnist": lambda root: _fashion_mnist(root, "train"),
    "fashion-mnist-test": lambda root: _fashion_mnist(root, "test"),
}
