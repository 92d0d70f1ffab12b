"""files.py through the CLI: output paths checked before the run, work folders, devices."""

from __future__ import annotations

import os
from pathlib import Path

from conftest import invoke
from helpers import adapt, fails, stats


def test_output_folder_missing_fails_before_the_run(setup, tmp_path):
    out = tmp_path / "nowhere" / "s.safetensors"
    fails(stats(setup, setup["train"], "--out", out), 3, "folder", "does not exist")
    result = adapt(setup, setup["train"], "--metrics-json", tmp_path / "nowhere" / "m.json")
    fails(result, 3, "does not exist")
    assert result.stdout == "", "no predictions before the output paths are checked"
    fails(adapt(setup, setup["train"], "--predictions", tmp_path / "nowhere" / "p.csv"), 3, "cannot write", "does not exist")


def test_output_that_is_a_folder(setup, tmp_path):
    fails(stats(setup, setup["train"], "--out", tmp_path), 3, "is a folder")
    # Path() drops a trailing slash: a file named as the folder would be written
    fails(adapt(setup, setup["train"], "--metrics-json", f"{tmp_path / 'newdir'}/"), 3, "names a folder (it ends with /)")
    assert not (tmp_path / "newdir").exists()


def test_an_output_in_a_folder_that_cannot_be_written_fails_before_the_run(setup, tmp_path, monkeypatch):
    import cafa_cli.files

    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access  # root passes every permission check, so the folder's answer is given here
    monkeypatch.setattr(cafa_cli.files.os, "access", lambda path, mode: Path(path) != locked and real_access(path, mode))
    result = adapt(setup, setup["train"], "--metrics-json", locked / "m.json")
    fails(result, 3, f"cannot write {locked / 'm.json'}: folder {locked} is not writable")
    assert result.stdout == ""  # not after printing every prediction


def test_demo_workdir_that_is_a_file(tmp_path):
    (tmp_path / "file").write_text("")
    fails(invoke("demo", "--workdir", tmp_path / "file"), 3, "--workdir", "is a file; give a folder")


def test_stats_into_a_device_writes_it_and_succeeds(setup):
    """The artifact is checked as written, before the copy to the device, not read back from it."""
    result = stats(setup, setup["train"], "--out", "/dev/null", "--quiet")
    assert result.exit_code == 0, result.stderr
