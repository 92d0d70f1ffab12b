"""Batches of a domain for the model: a DataLoader over the images, in worker processes
that leave signals to the main one, with unreadable images reported rather than fatal."""

from __future__ import annotations

import os
import signal
import sys
import warnings
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from cafa_cli.core.errors import InputError
from cafa_cli.data.domain import UNREADABLE, Domain
from cafa_cli.data.preprocessing import Preprocessing
from cafa_cli.data.values import check_batch_size, check_num_workers, usable_cores


class _DomainImages(Dataset):
    def __init__(self, domain: Domain, indices: np.ndarray, preprocess: Preprocessing):
        self.domain, self.indices, self.preprocess = domain, indices, preprocess

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, position: int):
        return self.__getitems__([position])[0]

    def __getitems__(self, positions: list[int]) -> list:
        """A batch's (pixels, index, None) or (None, index, why); the DataLoader asks for a
        batch at once, so Pillow's warnings are silenced once a batch, not once an image."""
        items = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for position in positions:
                i = int(self.indices[position])
                try:
                    items.append((self.preprocess.pixels(self.domain.read(i)), i, None))
                except UNREADABLE as error:
                    items.append((None, i, f"{type(error).__name__}: {error}"))
        return items


@dataclass
class Batch:
    images: (
        torch.Tensor | None
    )  # uint8 pixels (Preprocessing.normalize makes them model input); None when every image failed to read
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
        raise InputError(f"{ref}: unreadable image ({why}); remove it, or drop `strict` to skip such files")
    return skipped


def _collate(items) -> Batch:
    good = [(image, i) for image, i, error in items if error is None]
    failures = [(i, error) for _, i, error in items if error is not None]
    shapes = sorted({tuple(image.shape) for image, _ in good})
    if len(shapes) > 1:
        raise InputError(
            f"images of different sizes in one batch ({' and '.join(f'{w}x{h}' for _, h, w in shapes[:2])}); "
            f"set `resize` and `crop` so that every image ends the same size"
        )
    images = torch.stack([image for image, _ in good]) if good else None
    return Batch(images, [i for _, i in good], failures)


def loader_processes(num_workers: int | None, device: torch.device) -> int:
    """`--num-workers`, or by default: on CUDA, every CPU core this process may use but
    one, shared among the ranks torchrun started on this machine (decoding images on
    one core cannot keep a GPU busy); on the CPU none, as the model's threads use the cores."""
    if num_workers is not None:
        return num_workers
    if device.type != "cuda":
        return 0
    return max(usable_cores() // int(os.environ.get("LOCAL_WORLD_SIZE", "1")) - 1, 0)


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
    check_batch_size(batch_size)
    check_num_workers(num_workers)
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
