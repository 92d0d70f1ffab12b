"""What `cafa adapt` keeps of an adaptation for later: the adapted network for serving
(`export`: by the file's suffix a safetensors state dict of the model's own architecture, or an
ONNX graph with the model's preprocessing in its metadata) and the adaptation's whole state
(`state`, to go on with a continual stream after a restart)."""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file

from cafa_cli import __version__
from cafa_cli.core.environment import environment
from cafa_cli.core.errors import InputError, UsageError
from cafa_cli.core.files import atomic_write, is_device, open_lock_file
from cafa_cli.data.loading import batches
from cafa_cli.engine.adapter import Adapter
from cafa_cli.engine.serving import check_exportable, check_onnx_writer
from cafa_cli.jobs.adapt.job import Adaptation
from cafa_cli.model.checkpoints import check_expansion

EXPORT_FORMAT = "cafa-export"
EXPORT_SUFFIXES = {".safetensors": "safetensors", ".onnx": "onnx"}
MAX_STATE_BYTES = 64 << 30  # a state holds the weights, the optimiser's moments and a method's banks


def export_format(path: str) -> str:
    """safetensors or onnx, as the suffix of `export` says (a device such as /dev/null, which
    has none, takes safetensors, as before ONNX)."""
    if is_device(path):
        return "safetensors"
    suffix = Path(path).suffix.lower()
    if suffix not in EXPORT_SUFFIXES:
        raise UsageError(
            f"`export` {path}: its suffix says the format, .safetensors (a state dict of the model's architecture) "
            f"or .onnx (a graph for ONNX Runtime, TensorRT, Triton); give a path ending in one of them"
        )
    return EXPORT_SUFFIXES[suffix]


def check_export(adapter: Adapter, path: str) -> None:
    """`export` can be written once the stream is over, as far as can be known before it: the
    method's predictions are its network's, the suffix names a format, and for ONNX the `onnx`
    extra is installed and the weights fit one file."""
    check_exportable(adapter.method)
    if export_format(path) == "onnx":
        check_onnx_writer(f"`export` {path}", adapter.model.model)


def write_export(job: Adaptation, path: str) -> None:
    """The served network (Adapter.export), atomically, with what made it in the metadata: a
    state dict that loads into the plain architecture with load_state_dict, or an ONNX graph
    that also records the preprocessing and the class names (Adapter.export_onnx)."""
    adapter, settings = job.adapter, job.recorded_settings
    metadata = {
        "format": EXPORT_FORMAT,
        "cafa_version": __version__,
        "method": settings["method"],
        "model": str(settings.get("model")),
        "norm": settings["norm"],
        "settings": json.dumps(settings, default=str),
        "environment": json.dumps(environment(adapter.device)),
    }
    if export_format(path) == "onnx":
        outputs = adapter.model.outputs  # a class subset: the network's outputs are all the model's
        if outputs is not None:
            metadata["class_subset"] = json.dumps({"outputs": outputs.tolist(), "class_names": job.class_names})
        adapter.export_onnx(
            path,
            None if job.preprocess.crop else first_image(job),
            preprocessing=job.preprocess,
            class_names=job.class_names if outputs is None else None,
            metadata=metadata,
        )
        return
    network = adapter.export()
    tensors = {name: value.detach().contiguous().cpu() for name, value in network.state_dict().items()}
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


def first_image(job: Adaptation) -> torch.Tensor:
    """The first image of the stream that can be read, as the network's input: without a `crop`
    the images keep their size, which the ONNX graph takes."""
    for domain in job.domains:
        for batch in batches(domain, job.preprocess, 1, num_workers=0):
            if batch.images is not None:
                return job.preprocess.normalize(batch.images)
    raise InputError("no image of the stream could be read to size the ONNX graph's input")


@contextmanager
def holding_state(path: str | None) -> Iterator[None]:
    """An exclusive lock on the state file's lock file (beside it, hidden) from before the state
    is read until it is saved: a second run on the same state would go on from the same point
    and the last to save would win, so it is refused at once. The lock goes with the process
    however it ends; the lock file stays (as the bench's statistics lock, bench/statistics.py)."""
    if not path:
        yield
        return
    lock = open_lock_file(Path(path))
    try:
        if lock is not None:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise UsageError(
                    f"`state` {path} is in use by another run of cafa adapt, which will save it when it ends; wait "
                    f"for it, or give each run its own state file"
                ) from None
            except OSError:  # a file system without locks (some network mounts)
                pass
        yield
    finally:
        if lock is not None:
            os.close(lock)


def load_state(adapter: Adapter, path: str) -> bool:
    """The state saved at `path` put into `adapter`; False when there is none yet (a first run).
    Read as untrusted input: no code unpickled (weights_only), no archive that would inflate,
    and every entry checked against the adaptation before it is poured in (serving.load_state)."""
    file = Path(path)
    if not file.exists():
        return False
    fix = "remove it to start from the source model"
    if not file.is_file() or file.stat().st_size > MAX_STATE_BYTES:
        raise InputError(f"`state` {path}: not a file cafa adapt saved a state in; give another path")
    check_expansion(file, "state", f"not a state cafa adapt saved; {fix}")
    try:
        state = torch.load(file, map_location=adapter.device, weights_only=True)
    except Exception as error:  # a torn or foreign file fails in torch's own ways: one line
        raise InputError(f"`state` {path}: not a state cafa adapt saved ({type(error).__name__}); {fix}") from None
    try:
        adapter.load_state_dict(state)
    except InputError as error:
        raise InputError(f"`state` {path}: {error}; {fix}") from None
    return True


def save_state(adapter: Adapter, path: str) -> None:
    """The adaptation's state, atomically (a crash leaves the previous one)."""
    state = adapter.state_dict()
    atomic_write(path, lambda tmp: torch.save(state, tmp))
