"""data/loading.py: batches of uint8 images, skipped unreadable images, loader processes."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
import torch
from conftest import write_folder
from helpers import GREY, adapt, fails, save, solid
from PIL import Image

from cafa_cli.data.loading import batches, loader_processes
from cafa_cli.data.sources import open_domain
from cafa_cli.errors import InputError, UsageError


def test_batches_skip_unreadable_images(tmp_path):
    root = write_folder(tmp_path / "d", per_class=3, classes=("a", "b"), size=8)
    (root / "b" / "0001.png").write_bytes(b"\x89PNG broken")
    domain = open_domain(str(root))
    seen, failures = [], []
    for batch in batches(domain, GREY, batch_size=4):
        assert batch.images.shape == (len(batch.indices), 1, 8, 8)
        seen += batch.indices
        failures += batch.failures
    broken = domain.refs.index(str(root / "b" / "0001.png"))
    assert seen == [i for i in range(6) if i != broken]
    assert [i for i, _ in failures] == [broken]


def test_batches_follow_given_indices(tmp_path):
    images = np.stack([solid(i, 4) for i in range(10)])
    np.save(tmp_path / "x.npy", images)
    domain = open_domain(str(tmp_path / "x.npy"))
    order = np.array([7, 2, 9])
    got = [b for b in batches(domain, GREY, batch_size=2, indices=order)]
    assert [b.indices for b in got] == [[7, 2], [9]]
    assert got[0].images.dtype == torch.uint8
    assert got[0].images[:, 0, 0, 0].tolist() == [7, 2]


def test_batches_of_mixed_sizes_are_an_input_error(tmp_path):
    save(tmp_path / "m" / "a.png", solid(1, 4))
    save(tmp_path / "m" / "b.png", solid(1, 6))
    with pytest.raises(InputError, match="different sizes.*--resize"):
        list(batches(open_domain(str(tmp_path / "m")), GREY, batch_size=2))


def test_mixed_sizes_in_one_batch(setup, tmp_path):
    data = write_folder(tmp_path / "d", per_class=2, seed=2)
    Image.fromarray(np.zeros((20, 24), np.uint8)).save(data / "a" / "big.png")
    fails(adapt(setup, data, "--batch-size", "100"), 3, "different sizes", "16x16", "20x24", "--resize", "--crop")


def test_loader_processes_default_to_the_cores_on_cuda_and_none_on_the_cpu(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert loader_processes(None, cpu) == 0
    assert loader_processes(None, cuda) == 15  # the main process keeps one core
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun: four ranks share the machine's cores
    assert loader_processes(None, cuda) == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert loader_processes(None, cuda) == 0
    assert loader_processes(6, cuda) == 6 and loader_processes(2, cpu) == 2  # as asked


def test_batches_reject_bad_sizes(tmp_path):
    domain = open_domain("-", stdin=io.StringIO("x.png\n"))
    with pytest.raises(UsageError, match="`batch_size`"):
        batches(domain, GREY, batch_size=0)
    with pytest.raises(UsageError, match="`num_workers`"):
        batches(domain, GREY, batch_size=1, num_workers=-1)
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(UsageError, match=f"`num_workers` {100 * cores} is more than 4 per CPU core"):  # not thousands of forks
        batches(domain, GREY, batch_size=1, num_workers=100 * cores)


def test_a_loader_workers_threads_stay_quiet_only_about_a_lost_main_process(monkeypatch):
    """The resource sharer of a worker loses its peer when an interrupted run exits; that is no error to print."""
    import multiprocessing.resource_sharer
    import sys

    from cafa_cli.data.loading import _leave_signals_to_the_main_process, _quiet_when_the_main_process_is_gone

    printed = []
    monkeypatch.setattr(sys, "__excepthook__", lambda *exc: printed.append(exc[0]))
    for error in (ConnectionResetError, BrokenPipeError, EOFError, ValueError):
        _quiet_when_the_main_process_is_gone(error, error(), None)
    assert printed == [ValueError]
    # the hook the resource sharer reports through (multiprocessing/resource_sharer.py, _serve)
    assert "sys.excepthook(*sys.exc_info())" in open(multiprocessing.resource_sharer.__file__).read()
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # restored after the test
    monkeypatch.setattr("signal.signal", lambda *args: None)
    _leave_signals_to_the_main_process(0)
    assert sys.excepthook is _quiet_when_the_main_process_is_gone


def test_the_loader_pins_a_batchs_images(monkeypatch):
    """DataLoader(pin_memory=True) pins what has a pin_memory method and passes a plain
    dataclass through as it is: the GPU copies would then block the host."""
    from torch.utils.data._utils.pin_memory import pin_memory

    from cafa_cli.data.loading import Batch

    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pinned.append(self) or self.clone())  # no CUDA here
    batch = Batch(torch.zeros(2, 1, 4, 4, dtype=torch.uint8), [0, 1], [(2, "bad")])
    out = pin_memory(batch)
    assert len(pinned) == 1 and pinned[0] is batch.images and out.images is not batch.images
    assert (out.indices, out.failures) == ([0, 1], [(2, "bad")])
    assert pin_memory(Batch(None, [], [(0, "bad")])).images is None
