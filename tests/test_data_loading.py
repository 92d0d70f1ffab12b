"""data/loading.py: batches of uint8 images, skipped unreadable images, loader processes."""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch
from conftest import write_folder
from helpers import GREY, adapt, fails, rows, save, solid
from PIL import Image

import cafa_cli
from cafa_cli.core.errors import InputError, UsageError
from cafa_cli.data.loading import batches, loader_processes
from cafa_cli.data.sources import open_domain


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
    with pytest.raises(InputError, match="different sizes.*`resize`"):
        list(batches(open_domain(str(tmp_path / "m")), GREY, batch_size=2))


def test_mixed_sizes_in_one_batch(setup, tmp_path):
    data = write_folder(tmp_path / "d", per_class=2, seed=2)
    Image.fromarray(np.zeros((20, 24), np.uint8)).save(data / "a" / "big.png")
    fails(
        adapt(setup, data, "--batch-size", "100"), 3, "different sizes", "16x16", "24x20", "--resize", "--crop"
    )  # width x height, as PIL


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
    with pytest.raises(
        UsageError, match=f"`num_workers` {100 * cores} is more than 4 per CPU core"
    ):  # not thousands of forks
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


def png_header_only(path, width: int, height: int) -> None:
    """A PNG that announces width x height grey pixels and holds none: Pillow refuses it at open."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + header + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


LOAD_UNDER_A_MEMORY_LIMIT = """
import json, resource, sys
from cafa_cli.data.loading import batches
from cafa_cli.data.preprocessing import Preprocessing
from cafa_cli.data.sources import open_domain

prep = Preprocessing(resize=64, crop=64, mean=(0.5,), std=(0.5,), channels=3)
list(batches(open_domain(sys.argv[1]), prep, batch_size=1))  # imports and first allocations, on an ordinary image
data = int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmData:"))) * 1024
# a few GB more than now: without the bound the 1 x 1,000,000 image asks for 12 GB and fails here, not the machine
resource.setrlimit(resource.RLIMIT_DATA, (data + (3 << 30), resource.getrlimit(resource.RLIMIT_DATA)[1]))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
read, failed = [], []
for batch in batches(open_domain(sys.argv[2]), prep, batch_size=1):
    read += [tuple(batch.images.shape)] if batch.images is not None else []
    failed += [why for _, why in batch.failures]
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"read": read, "failed": failed, "growth": peak - before}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and RLIMIT_DATA")
def test_thin_tall_and_huge_images_are_skipped_before_they_take_memory(tmp_path):
    """Issue 18, bug 3: a 1 KB grey PNG of 1 x 1,000,000 pixels resized to 64 on its
    shorter side would be 64 x 64,000,000 pixels (12 GB as RGB). The size is bounded after
    the resize is planned, and such an image is skipped as unreadable; the others are read."""
    save(tmp_path / "warm" / "ok.png", solid(9, 80))
    data = tmp_path / "data"
    save(data / "a-ok.png", solid(9, 80))
    Image.new("L", (1, 1_000_000), 128).save(data / "thin.png")
    Image.new("L", (1_000_000, 1), 128).save(data / "wide.png")
    png_header_only(data / "huge.png", 30_000, 30_000)  # past Pillow's own bound: refused at open
    assert max(os.path.getsize(p) for p in data.iterdir()) < 10_000
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(cafa_cli.__file__)), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", LOAD_UNDER_A_MEMORY_LIMIT, tmp_path / "warm", data],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["read"] == [[1, 3, 64, 64]]
    assert len(result["failed"]) == 3 and all(why.startswith("DecompressionBombError: ") for why in result["failed"])
    assert any(
        "1x1000000 pixels; resized to 64 on its shorter side it would be 64x64000000" in why for why in result["failed"]
    )
    assert any(
        "1000000x1 pixels; resized to 64 on its shorter side it would be 64000000x64" in why for why in result["failed"]
    )
    assert result["growth"] < 512 << 20, result  # a generous bound: the thin images decode to 1 MB each


def test_an_image_the_resize_would_blow_up_is_skipped_and_the_run_goes_on(setup, tmp_path):
    data = write_folder(tmp_path / "d", per_class=2, seed=2)
    Image.new("L", (1, 200_000), 128).save(data / "a" / "thin.png")
    result = adapt(setup, data, "--resize", "64", "--crop", "16")  # 64 x 12,800,000 pixels
    assert result.exit_code == 0, result.stderr
    assert (
        "warning: skipped unreadable image" in result.stderr
        and "thin.png (DecompressionBombError: 1x200000 pixels;" in result.stderr
    )
    assert len(rows(result)) == 6  # the other images are predicted


def test_the_size_bound_passes_ordinary_and_already_large_images():
    """Only a resize that makes an image larger than MAX_PIXELS is refused: a large photo
    is shrunk, as before, and an image without --resize keeps its size."""
    from types import SimpleNamespace

    from cafa_cli.data.preprocessing import Preprocessing
    from cafa_cli.data.values import MAX_PIXELS

    prep = Preprocessing(resize=256, crop=224)
    for size in ((640, 480), (12_000, 9_000), (20, 20_000), (1, 1365)):  # 256 x 349,440 is just below the bound
        prep.check_size(SimpleNamespace(size=size))
    with pytest.raises(
        Image.DecompressionBombError, match=r"^1x400000 pixels; .* 256x102400000, 26,214,400,000 pixels, more than"
    ):
        prep.check_size(SimpleNamespace(size=(1, 400_000)))
    Preprocessing(resize=None, crop=224).check_size(SimpleNamespace(size=(1, 2 * MAX_PIXELS)))
    with pytest.raises(ValueError, match="no pixels"):
        prep.check_size(SimpleNamespace(size=(0, 5)))
