"""The Fashion-MNIST reader and the bundled model."""

from __future__ import annotations

import gzip
import re
import struct

import numpy as np
import pytest
import torch

from cafa_cli.core.errors import InputError
from cafa_cli.data.fashion_mnist import (
    DEFAULT_ROOT,
    FASHION_MNIST_CLASSES,
    FASHION_MNIST_MEAN,
    FASHION_MNIST_STD,
    load_fashion_mnist,
)
from cafa_cli.model.zoo import BUNDLED, load_bundled

DEBIAN_FILES_PRESENT = (DEFAULT_ROOT / "t10k-images-idx3-ubyte.gz").is_file()
needs_fashion_mnist = pytest.mark.skipif(
    not DEBIAN_FILES_PRESENT, reason="Fashion-MNIST absent: apt-get install dataset-fashion-mnist"
)


def write_idx(path, magic: int, dims: tuple[int, ...], payload: bytes, compress: bool) -> None:
    data = struct.pack(f">I{len(dims)}I", magic, *dims) + payload
    if compress:
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)


@needs_fashion_mnist
def test_reads_test_split_shapes_and_dtypes():
    images, labels = load_fashion_mnist(DEFAULT_ROOT, "test")
    assert images.shape == (10_000, 28, 28) and images.dtype == np.uint8
    assert labels.shape == (10_000,) and labels.dtype == np.int64
    assert set(np.unique(labels)) == set(range(len(FASHION_MNIST_CLASSES)))


def test_reads_uncompressed_files_and_env_root(tmp_path, monkeypatch):
    pixels = np.arange(2 * 28 * 28, dtype=np.uint8)
    write_idx(tmp_path / "t10k-images-idx3-ubyte", 0x803, (2, 28, 28), pixels.tobytes(), False)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", 0x801, (2,), bytes([3, 9]), True)
    monkeypatch.setenv("CAFA_FASHION_MNIST", str(tmp_path))
    images, labels = load_fashion_mnist(split="test")
    assert np.array_equal(images.reshape(-1), pixels)
    assert labels.tolist() == [3, 9]


def test_missing_root_names_the_debian_package(tmp_path):
    with pytest.raises(InputError) as caught:
        load_fashion_mnist(tmp_path / "nowhere", "train")
    message = str(caught.value)
    assert "dataset-fashion-mnist" in message and "\n" not in message
    assert "CAFA_FASHION_MNIST" in message


@pytest.mark.parametrize(
    "magic, dims, payload, reason",
    [
        (
            0x801,
            (1, 28, 28),
            bytes(28 * 28),
            "magic number 0x00000801, expected 0x00000803",
        ),  # label magic on an image file
        (
            0x803,
            (2, 28, 28),
            bytes(28 * 28),
            "784 data bytes, the header announces 1568",
        ),  # more images announced than present
        (0x803, (1, 14, 14), bytes(14 * 14), "images are 14x14, expected 28x28"),  # wrong image size
    ],
)
def test_malformed_image_file_raises_input_error(tmp_path, magic, dims, payload, reason):
    images = tmp_path / "train-images-idx3-ubyte.gz"
    write_idx(images, magic, dims, payload, True)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", 0x801, (1,), bytes([0]), True)
    with pytest.raises(InputError, match=re.escape(f"Fashion-MNIST file {images} is malformed: {reason}; reinstall")):
        load_fashion_mnist(tmp_path, "train")


@pytest.mark.parametrize("keep", [20, -8], ids=["cut-in-the-header", "cut-before-the-trailer"])
def test_truncated_gzip_raises_input_error(tmp_path, keep):
    """A valid idx file, gzipped and cut short: the gzip error is named, not a magic number
    (a cut gzip of zeros would decode to a zero magic and never reach the truncation)."""
    images = tmp_path / "train-images-idx3-ubyte.gz"
    write_idx(images, 0x803, (1, 28, 28), bytes(range(256)) * 3 + bytes(16), True)
    images.write_bytes(images.read_bytes()[:keep])
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", 0x801, (1,), bytes([0]), True)
    with pytest.raises(
        InputError,
        match=rf"^cannot read Fashion-MNIST file {re.escape(str(images))} \(.+\); "
        "reinstall dataset-fashion-mnist or replace the file$",
    ):
        load_fashion_mnist(tmp_path, "train")


ZEROS_MB = gzip.compress(bytes(1 << 20))  # 1 MiB of zeros in about 1 KB; gzip members concatenate


def gzip_bomb(path, magic: int, dims: tuple[int, ...], zeros_mb: int) -> None:
    """A valid idx header followed by far more zeros than it announces, a few hundred KB on disk."""
    path.write_bytes(gzip.compress(struct.pack(f">I{len(dims)}I", magic, *dims)) + ZEROS_MB * zeros_mb)


@pytest.mark.parametrize("kind", ["images", "labels"])
def test_a_gzip_bomb_is_read_no_further_than_its_header_announces(tmp_path, kind):
    """Issue 18, bug 4: 300 MB of zeros after a header that announces 60,000 images (47 MB)
    or labels (60 KB) was read whole before being refused. Now the header is read, then what
    it announces and one byte more, and the file is refused for the excess."""
    import tracemalloc

    images, labels = tmp_path / "train-images-idx3-ubyte.gz", tmp_path / "train-labels-idx1-ubyte.gz"
    if kind == "images":
        gzip_bomb(images, 0x803, (60_000, 28, 28), zeros_mb=300)
        write_idx(labels, 0x801, (60_000,), bytes(60_000), True)
        announced = 60_000 * 28 * 28
    else:
        write_idx(images, 0x803, (1, 28, 28), bytes(28 * 28), True)
        gzip_bomb(labels, 0x801, (60_000,), zeros_mb=300)
        announced = 60_000
    bomb = images if kind == "images" else labels
    assert bomb.stat().st_size < 400_000
    tracemalloc.start()
    try:
        with pytest.raises(
            InputError, match=rf"{bomb.name} is malformed: more data bytes than the {announced} the header announces"
        ):
            load_fashion_mnist(tmp_path, "train")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < announced + (16 << 20), peak  # the announced bytes and a few blocks; not the 300 MB


@pytest.mark.parametrize("compress", [True, False])
def test_a_header_that_announces_billions_is_refused_before_anything_is_read(tmp_path, compress):
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", 0x803, (1, 28, 28), bytes(28 * 28), True)
    write_idx(tmp_path / "train-labels-idx1-ubyte", 0x801, (2**32 - 1,), bytes(100), compress)
    if compress:
        (tmp_path / "train-labels-idx1-ubyte").rename(tmp_path / "train-labels-idx1-ubyte.gz")
    with pytest.raises(
        InputError, match=r"the header announces 4,294,967,295 items, more than the 1,000,000 cafa reads"
    ):
        load_fashion_mnist(tmp_path, "train")


def test_excess_bytes_in_an_uncompressed_file_and_sizes_as_width_x_height(tmp_path):
    write_idx(tmp_path / "train-labels-idx1-ubyte", 0x801, (1,), bytes(2), False)
    write_idx(tmp_path / "train-images-idx3-ubyte", 0x803, (1, 28, 28), bytes(28 * 28 + 5), False)
    with pytest.raises(InputError, match="more data bytes than the 784 the header announces"):
        load_fashion_mnist(tmp_path, "train")
    write_idx(tmp_path / "train-images-idx3-ubyte", 0x803, (1, 28, 14), bytes(28 * 14), False)  # 28 rows of 14
    with pytest.raises(InputError, match="images are 14x28, expected 28x28"):
        load_fashion_mnist(tmp_path, "train")


def test_bundled_model_loads_and_has_the_feature_layer():
    entry = BUNDLED["fmnist-resnet"]
    assert entry.weights.stat().st_size < 2_000_000
    assert entry.class_names == tuple(FASHION_MNIST_CLASSES)
    assert entry.preprocessing["channels"] == 1
    model = load_bundled("fmnist-resnet")
    assert not model.training
    assert isinstance(model.fc, torch.nn.Linear) and model.fc.out_features == 10
    with torch.no_grad():
        assert model(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


@needs_fashion_mnist
def test_bundled_model_classifies_real_test_images():
    images, labels = load_fashion_mnist(DEFAULT_ROOT, "test")
    # Same arithmetic as ToTensor + Normalize at use time.
    inputs = torch.from_numpy(images[:500]).unsqueeze(1).float() / 255.0
    inputs = (inputs - FASHION_MNIST_MEAN) / FASHION_MNIST_STD
    model = load_bundled("fmnist-resnet")
    with torch.no_grad():
        predictions = model(inputs).argmax(1).numpy()
    assert (predictions == labels[:500]).mean() > 0.8


@needs_fashion_mnist
def test_artifact_of_the_bundled_model_records_its_packaged_weights_and_adapt_notices_a_change(tmp_path, monkeypatch):
    import dataclasses

    from PIL import Image
    from safetensors.torch import load_file, save_file
    from typer.testing import CliRunner

    from cafa_cli.artifact.store import read_artifact
    from cafa_cli.cli.app import app
    from cafa_cli.model.checkpoints import sha256_of

    runner = CliRunner()
    stats = tmp_path / "s.safetensors"
    made = runner.invoke(
        app,
        [
            "stats",
            "--model",
            "fmnist-resnet",
            "--data",
            "fashion-mnist",
            "--per-class",
            "3",
            "--out",
            str(stats),
            "--quiet",
        ],
    )
    assert made.exit_code == 0, made.stderr
    bundled = BUNDLED["fmnist-resnet"]
    recorded = read_artifact(stats, load_tensors=False).model
    assert (recorded.weights, recorded.weights_sha256) == (None, sha256_of(bundled.weights))
    shown = runner.invoke(app, ["inspect", str(stats)])
    assert "weights       (packaged with the bundled model)" in shown.stdout
    assert f"weights       {recorded.weights_sha256}" in shown.stdout
    assert f"parameters    {read_artifact(stats, load_tensors=False).parameters_sha256}" in shown.stdout
    images = tmp_path / "test"
    images.mkdir()
    for i in range(4):
        Image.fromarray(np.full((28, 28), 40 * i, np.uint8)).save(images / f"{i}.png")
    adapt = ["adapt", "--stats", str(stats), "--data", str(images), "--quiet"]
    assert runner.invoke(app, adapt).exit_code == 0

    changed = load_file(str(bundled.weights))
    first = next(k for k, v in changed.items() if v.is_floating_point())
    changed[first] = changed[first] * 2
    other = tmp_path / "other.safetensors"
    save_file(changed, str(other))
    refused = runner.invoke(app, [*adapt, "--model", "fmnist-resnet", "--weights", str(other)])
    assert refused.exit_code == 3
    assert f"holds statistics of fmnist-resnet with its packaged weights, not with {other}" in refused.stderr

    state = load_file(str(bundled.weights))
    first = next(k for k, v in state.items() if v.is_floating_point())  # a step counter would not change the model
    state[first] = state[first] + 1
    retrained = tmp_path / "retrained.safetensors"
    save_file(state, str(retrained))
    monkeypatch.setitem(BUNDLED, "fmnist-resnet", dataclasses.replace(bundled, weights=retrained))
    refused = runner.invoke(app, adapt)
    assert refused.exit_code == 3
    assert (
        "the bundled fmnist-resnet weights have changed" in refused.stderr
        and "--allow-weights-mismatch" in refused.stderr
    )
    assert runner.invoke(app, [*adapt, "--allow-weights-mismatch"]).exit_code == 0
