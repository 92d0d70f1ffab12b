"""The same images by another name (issue 60, §1): `forgetting` and `source_data` are compared
with the test domains by the image files as opened (device, inode), not by folder path, so the
test images reached through a relative path, a symlinked folder, a folder of symlinked class
folders or hard links are refused, in cafa adapt and in cafa bench, before anything is computed
or written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import PLAIN, TINY_NET, invoke, write_folder
from helpers import fails


def _spelling(how: str, test: Path, tmp_path: Path) -> str:
    """The test domain's images under another name."""
    if how == "the same folder":
        return str(test)
    if how == "a relative path":  # the tests run with tmp_path as the working folder
        return os.path.relpath(test, tmp_path)
    other = tmp_path / "other"
    if how == "a symlinked folder":
        other.symlink_to(test, target_is_directory=True)
    elif how == "symlinked class folders":
        other.mkdir()
        for folder in test.iterdir():
            (other / folder.name).symlink_to(folder, target_is_directory=True)
    elif how == "hard links":
        for image in test.rglob("*.png"):
            (other / image.parent.name).mkdir(parents=True, exist_ok=True)
            os.link(image, other / image.parent.name / image.name)
    return str(other)


SPELLINGS = ["the same folder", "a relative path", "a symlinked folder", "symlinked class folders", "hard links"]
CASES = [("--forgetting", "cafa"), ("--source-data", "eata"), ("--source-data", "rmt")]


@pytest.mark.parametrize("how", SPELLINGS)
@pytest.mark.parametrize("option, method", CASES)
def test_adapt_refuses_the_test_images_by_another_name(setup, tmp_path, monkeypatch, how, option, method):
    monkeypatch.chdir(tmp_path)
    test = write_folder(tmp_path / "test", per_class=3)
    metrics = tmp_path / "m.json"
    result = invoke(
        "adapt", "--stats", setup["artifact"], "--model", TINY_NET, "--data", test, "--method", method,
        option, _spelling(how, test, tmp_path), "--batch-size", "3", "--metrics-json", metrics,
    )  # fmt: skip
    line = fails(result, 2, option, "--data", "are images of the test domain", "compared as files")
    assert "9 of its 9 images" in line
    assert result.stdout == "" and not metrics.exists()


def test_adapt_takes_a_copy_apart_and_refuses_one_shared_image(setup, tmp_path):
    """Only the very files count: another folder passes; one hard-linked image among others is named."""
    test = write_folder(tmp_path / "test", per_class=3)
    clean = write_folder(tmp_path / "clean", per_class=3, seed=5)
    run = ["adapt", "--stats", setup["artifact"], "--model", TINY_NET, "--data", test, "--batch-size", "3", "-q"]
    assert invoke(*run, "--forgetting", clean).exit_code == 0
    os.link(test / "b" / "0001.png", clean / "b" / "extra.png")
    line = fails(invoke(*run, "--forgetting", clean), 2, "--forgetting", "1 of its 10 images")
    assert f"({clean / 'b' / 'extra.png'} is {test / 'b' / '0001.png'})" in line


@pytest.mark.parametrize("how", ["a relative path", "symlinked class folders", "hard links"])
@pytest.mark.parametrize("option, method", [("--forgetting", "tent"), ("--source-data", "eata"), (None, "rmt")])
def test_bench_refuses_the_test_images_by_another_name_before_its_statistics(
    tmp_path, tiny_weights, monkeypatch, how, option, method
):
    """`None`: rmt's source images are the training data when --source-data is not given."""
    monkeypatch.chdir(tmp_path)
    test = write_folder(tmp_path / "test", per_class=3)
    other = _spelling(how, test, tmp_path)
    workdir, table = tmp_path / "w", tmp_path / "t.csv"
    args = ["bench", test, "--methods", method, "--model", TINY_NET, "--weights", tiny_weights, *PLAIN]
    args += ["--batch-size", "3", "--workdir", workdir, "--csv", table]
    train = ["--train", other] if option is None else ["--train", write_folder(tmp_path / "train", per_class=3)]
    line = fails(
        invoke(*args, *train, *([option, other] if option else [])), 2, "--data", "are images of the test domain"
    )
    assert (option or "--train") in line and (option or "give --source-data") in line
    assert not workdir.exists() and not table.exists()
