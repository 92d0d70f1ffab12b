"""core/files.py through the CLI: output paths checked before the run, work folders, devices."""

from __future__ import annotations

import json
import os
import struct
import tempfile
import threading
from pathlib import Path

import pytest
from conftest import invoke
from helpers import adapt, fails, stats


def test_output_folder_missing_fails_before_the_run(setup, tmp_path):
    out = tmp_path / "nowhere" / "s.safetensors"
    fails(stats(setup, setup["train"], "--out", out), 3, "folder", "does not exist")
    result = adapt(setup, setup["train"], "--metrics-json", tmp_path / "nowhere" / "m.json")
    fails(result, 3, "does not exist")
    assert result.stdout == "", "no predictions before the output paths are checked"
    fails(
        adapt(setup, setup["train"], "--predictions", tmp_path / "nowhere" / "p.csv"),
        3,
        "cannot write",
        "does not exist",
    )


def test_output_that_is_a_folder(setup, tmp_path):
    fails(stats(setup, setup["train"], "--out", tmp_path), 3, "is a folder")
    # Path() drops a trailing slash: a file named as the folder would be written
    fails(
        adapt(setup, setup["train"], "--metrics-json", f"{tmp_path / 'newdir'}/"), 3, "names a folder (it ends with /)"
    )
    assert not (tmp_path / "newdir").exists()


def test_an_output_in_a_folder_that_cannot_be_written_fails_before_the_run(setup, tmp_path, monkeypatch):
    import cafa_cli.core.files

    locked = tmp_path / "locked"
    locked.mkdir()
    real_mkstemp = tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):  # root writes any folder, so the folder's answer is given here
        if Path(dir) == locked:
            raise PermissionError(13, "Permission denied")
        return real_mkstemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(cafa_cli.core.files.tempfile, "mkstemp", mkstemp)
    result = adapt(setup, setup["train"], "--metrics-json", locked / "m.json")
    fails(result, 3, f"cannot write {locked / 'm.json'}: folder {locked} does not take new files (Permission denied)")
    assert result.stdout == ""  # not after printing every prediction


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_folder_that_looks_writable_but_takes_no_files_fails_before_the_run(setup):
    """Permission bits say yes to root in /proc or /sys; making a file there is the only test that tells."""
    result = adapt(setup, setup["train"], "--metrics-json", "/proc/m.json")
    fails(result, 3, "cannot write /proc/m.json: folder /proc does not take new files")
    assert result.stdout == ""


def test_an_output_under_a_file_names_the_file_not_a_folder(setup, tmp_path):
    (tmp_path / "mk.py").write_text("")
    fails(
        stats(setup, setup["train"], "--out", tmp_path / "mk.py" / "x.safetensors"),
        3,
        f"cannot write {tmp_path / 'mk.py' / 'x.safetensors'}: {tmp_path / 'mk.py'} is a file, not a folder",
    )


def test_demo_workdir_that_is_a_file(tmp_path):
    (tmp_path / "file").write_text("")
    fails(invoke("demo", "--workdir", tmp_path / "file"), 3, "--workdir", "is a file; give a folder")


def test_stats_into_a_device_writes_it_and_succeeds(setup, tmp_path):
    """The artifact is checked as written, before the copy to the device, not read back from it."""
    result = stats(setup, setup["train"], "--out", "/dev/null", "--quiet")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == result.stderr == ""
    # a FIFO is a device as well, and what comes out of it is the whole artifact, as a file would hold it
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received = {}
    reader = threading.Thread(target=lambda: received.update(data=fifo.read_bytes()), daemon=True)
    reader.start()
    try:
        result = stats(setup, setup["train"], "--out", fifo, "--quiet")
    finally:
        if reader.is_alive():  # nothing opened the FIFO for writing: let the reader see an end of file
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(timeout=60)
    assert result.exit_code == 0, result.stderr
    assert fifo.exists() and not fifo.is_file()  # written in place, not renamed over
    # the same artifact as the regular file the same command wrote earlier (safetensors orders the metadata freely)
    assert _safetensors_parts(received["data"]) == _safetensors_parts(setup["artifact"].read_bytes())


def _safetensors_parts(data: bytes) -> tuple[dict, bytes]:
    """A safetensors file as (its header, parsed, less the time it was made; its tensor bytes)."""
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    del header["__metadata__"]["created"]  # a second apart in a busy suite
    return header, data[8 + length :]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_disk_names_the_output(setup, tmp_path):
    """/dev/full answers every write with ENOSPC: the error names the output, exit 1."""
    for option in ("--predictions", "--metrics-json"):
        fails(
            adapt(setup, setup["train"], option, "/dev/full"),
            1,
            "cannot write /dev/full: No space left on device; free space",
        )
    fails(stats(setup, setup["train"], "--out", "/dev/full"), 1, "cannot write /dev/full: No space left on device")


SIZE_LIMITED = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (200, 200))
sys.argv = ["cafa", *sys.argv[1:]]
from cafa_cli.cli.app import main
main()
"""


def test_a_write_that_fails_midway_names_the_output_and_keeps_the_old_file(setup, tmp_path):
    """A file size limit (as a full disk) while the records stream into --predictions: the old
    file is kept byte for byte, no partial or temporary file is left, and the message names it."""
    import subprocess
    import sys

    from conftest import TINY_NET

    old = tmp_path / "p.csv"
    old.write_text("previous results\n")
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            SIZE_LIMITED,
            "adapt",
            "--stats",
            str(setup["artifact"]),
            "--model",
            TINY_NET,
            "--data",
            str(setup["train"]),
            "--batch-size",
            "4",
            "--predictions",
            str(old),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 1, run.stderr
    assert run.stderr.strip().splitlines()[-1] == f"cafa: error: cannot write {old}: File too large"
    assert old.read_text() == "previous results\n"
    assert [p.name for p in tmp_path.iterdir()] == ["p.csv"]


def test_predictions_replace_the_file_only_when_the_run_completes(setup, tmp_path):
    old = tmp_path / "p.csv"
    old.write_text("previous results\n")
    fails(
        adapt(setup, setup["train"], "--predictions", old, "--resize", "8", "--crop", "16"), 2
    )  # fails before any record
    assert old.read_text() == "previous results\n"
    result = adapt(setup, setup["train"], "--predictions", old, "--quiet")
    assert result.exit_code == 0 and result.stdout == ""
    assert old.read_text().startswith("path,prediction,label,confidence\n") and len(old.read_text().splitlines()) == 19
    assert [p.name for p in tmp_path.iterdir()] == ["p.csv"]


def test_an_interrupt_after_an_output_is_complete_says_so(setup, tmp_path, monkeypatch):
    """Exit 130 promises every output is as it was, unless the message names it as written completely."""
    import cafa_cli.jobs.shared.report

    real_write_json = cafa_cli.jobs.shared.report.write_json

    def write_then_interrupt(path, payload):
        real_write_json(path, payload)
        raise KeyboardInterrupt  # the signal that lands just after the rename

    monkeypatch.setattr("cafa_cli.jobs.adapt.write_json", write_then_interrupt)
    metrics = tmp_path / "m.json"
    result = adapt(setup, setup["train"], "--metrics-json", metrics, "--quiet")
    assert result.exit_code == 130
    assert result.stderr.strip() == f"cafa: interrupted after writing {metrics} completely"
    assert metrics.is_file()
    monkeypatch.setattr(
        "cafa_cli.jobs.adapt.write_json", lambda path, payload: (_ for _ in ()).throw(KeyboardInterrupt)
    )
    result = adapt(setup, setup["train"], "--metrics-json", tmp_path / "other.json", "--quiet")
    assert result.exit_code == 130 and result.stderr.strip() == "cafa: interrupted"
