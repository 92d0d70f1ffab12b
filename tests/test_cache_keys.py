"""Caches keyed by what they were made from (issue 40, section 4): the statistics `cafa bench`
keeps in its workdir are re-used only while the training images are the files they were
made from, by their sizes and modification times (one stat an image, nothing read), and
the bench says on stderr whether it re-uses them, and why not."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import PLAIN, TINY_NET, write_folder
from helpers import make_cifar10
from PIL import Image
from typer.testing import CliRunner

from cafa_cli.artifact.store import read_artifact
from cafa_cli.cli.app import app
from cafa_cli.data.fashion_mnist import DEFAULT_ROOT
from cafa_cli.data.sampling import file_stamps, source_files
from cafa_cli.data.sources import open_domain

runner = CliRunner()
COMPUTING = "computing statistics (--covariance diag)"
CHANGED = (
    "the training images changed since: the same 18 images by name and label, but other sizes or modification times"
)


def bench(tmp_path: Path, weights: Path, train: Path):
    """A small bench with one row that needs statistics, in one workdir; its stderr."""
    test = tmp_path / "test"
    if not test.is_dir():
        write_folder(test, per_class=2, seed=1)
    args = ["bench", test, "--methods", "cafa-diag", "--model", TINY_NET, "--weights", weights, "--train", train,
            *PLAIN, "--per-class", "6", "--workdir", tmp_path / "w"]  # fmt: skip
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.stderr
    return result.stderr


def artifact(tmp_path: Path) -> bytes:
    return (tmp_path / "w" / "stats-diag.safetensors").read_bytes()


def reused(tmp_path: Path) -> str:
    return (
        f"re-using statistics in {tmp_path / 'w' / 'stats-diag.safetensors'}, made from the same 18 images (sizes "
        f"and times unchanged)"
    )


def pngs(train: Path) -> list[Path]:
    return sorted(train.rglob("*.png"))


def test_unchanged_training_images_are_re_used_and_the_bench_says_so(tmp_path, tiny_weights):
    train = write_folder(tmp_path / "train", per_class=6)
    first = bench(tmp_path, tiny_weights, train)
    made = artifact(tmp_path)
    again = bench(tmp_path, tiny_weights, train)
    assert COMPUTING in first and "re-using" not in first
    assert COMPUTING not in again and reused(tmp_path) in again.splitlines()
    assert artifact(tmp_path) == made
    sampling = read_artifact(tmp_path / "w" / "stats-diag.safetensors", load_tensors=False).sampling
    lines = "".join(f"{p}\t{p.stat().st_size}\t{p.stat().st_mtime_ns}\n" for p in pngs(train))  # subset order
    assert sampling["file_stamps"] == hashlib.sha256(lines.encode()).hexdigest()


def test_training_images_edited_in_place_are_computed_again_and_the_bench_says_why(tmp_path, tiny_weights):
    """The issue's case: every PNG of --train inverted under its own name."""
    train = write_folder(tmp_path / "train", per_class=6)
    bench(tmp_path, tiny_weights, train)
    made = artifact(tmp_path)
    for png in pngs(train):
        Image.fromarray(255 - np.asarray(Image.open(png))).save(png)
    again = bench(tmp_path, tiny_weights, train)
    assert COMPUTING in again and "made from the same" not in again
    assert f"not re-using statistics in {tmp_path / 'w' / 'stats-diag.safetensors'}: {CHANGED}" in " ".join(
        again.split()
    )
    assert artifact(tmp_path) != made
    assert reused(tmp_path) in bench(tmp_path, tiny_weights, train).splitlines()  # and then it is re-used


def test_one_image_touched_is_enough(tmp_path, tiny_weights):
    """One image of 18, its bytes the same, its modification time another: computed again
    (an edit in place is told by the time; the bytes are not read)."""
    train = write_folder(tmp_path / "train", per_class=6)
    bench(tmp_path, tiny_weights, train)
    one = pngs(train)[7]
    stamp = one.stat()
    os.utime(one, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 1_000_000_000))
    again = bench(tmp_path, tiny_weights, train)
    assert COMPUTING in again and CHANGED in " ".join(again.split())


def test_an_image_replaced_with_its_size_and_time_kept_is_not_noticed_as_documented(tmp_path, tiny_weights):
    """The limit of a key by size and time (docs/reference/artifact-format.md, file_stamps):
    other bytes of the same size, with the old modification time set back, are not read, so
    not noticed. Uncompressed PNGs of one shape all have one size."""
    train = write_folder(tmp_path / "train", per_class=6)
    for png in pngs(train):
        Image.open(png).save(png, compress_level=0)
    bench(tmp_path, tiny_weights, train)
    made = artifact(tmp_path)
    one = pngs(train)[7]
    stamp, before = one.stat(), one.read_bytes()
    Image.fromarray(255 - np.asarray(Image.open(one))).save(one, compress_level=0)
    os.utime(one, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    assert one.read_bytes() != before and one.stat().st_size == stamp.st_size
    again = bench(tmp_path, tiny_weights, train)
    assert COMPUTING not in again and reused(tmp_path) in again.splitlines()
    assert artifact(tmp_path) == made


def test_an_artifact_without_the_key_is_computed_again_and_says_why(tmp_path, tiny_weights):
    """Statistics made before cafa recorded the sizes and times: computed once more."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    train = write_folder(tmp_path / "train", per_class=6)
    bench(tmp_path, tiny_weights, train)
    path = tmp_path / "w" / "stats-diag.safetensors"
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    sampling = json.loads(metadata["sampling"])
    del sampling["file_stamps"]
    save_file(load_file(path), path, metadata={**metadata, "sampling": json.dumps(sampling)})
    again = bench(tmp_path, tiny_weights, train)
    assert COMPUTING in again
    assert "it was made before cafa recorded the sizes and modification times of the images" in " ".join(again.split())


def test_images_from_arrays_are_keyed_by_their_files(tmp_path):
    """A .npy is one file, CIFAR's python batches a few: a stat of each, not one a row."""
    images = tmp_path / "x.npy"
    np.save(images, np.zeros((4, 8, 8), dtype=np.uint8))
    domain = open_domain(str(images))
    assert source_files(domain, np.arange(4), str(images)) == [str(images)]
    before = file_stamps([str(images)])
    np.save(images, np.ones((4, 8, 8), dtype=np.uint8))  # the same size: the time tells it
    os.utime(images, ns=(0, os.stat(images).st_mtime_ns + 1_000_000_000))
    assert file_stamps([str(images)]) != before

    make_cifar10(tmp_path / "c")
    spec = f"cifar10:{tmp_path / 'c'}"
    batches = tmp_path / "c" / "cifar-10-batches-py"
    files = source_files(open_domain(spec), np.arange(5), spec)
    assert files == [str(batches / f"data_batch_{b}") for b in range(1, 6)] + [str(batches / "batches.meta")]
    # a folder's sample is keyed by the images it draws, each once
    folder = write_folder(tmp_path / "f", per_class=2)
    assert source_files(open_domain(str(folder)), np.array([1, 4]), str(folder)) == [
        str(folder / "a" / "0001.png"),
        str(folder / "c" / "0000.png"),
    ]
    assert file_stamps(["/no/such/file"]) != file_stamps([])  # a file that went missing still counts


@pytest.mark.skipif(not DEFAULT_ROOT.is_dir(), reason="Debian's dataset-fashion-mnist is not installed")
def test_fashion_mnist_is_keyed_by_its_two_files():
    files = source_files(open_domain("fashion-mnist"), np.arange(3), "fashion-mnist")
    assert files == [str(DEFAULT_ROOT / "train-images-idx3-ubyte.gz"), str(DEFAULT_ROOT / "train-labels-idx1-ubyte.gz")]
