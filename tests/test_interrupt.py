"""Killing a run loses nothing: `cafa stats` keeps the old artifact and leaves no
temporary file; `cafa adapt` flushes every prediction it made. Real processes, real signals.

The scenarios start together (each pays Python's and torch's start-up once, in parallel)
and are signalled as soon as each is mid-run.
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import ASSETS, PLAIN, TINY_NET, tiny_training_set
from typer.testing import CliRunner

from cafa_cli.cli.app import app

EXIT_INTERRUPTED = 130

SLOW_NET = """
import os, sys, time
from pathlib import Path
sys.path.insert(0, {assets!r})
import tiny_net


class Slow(tiny_net.TinyNet):
    def forward(self, x):
        Path(os.environ["CAFA_TEST_MARKER"]).touch()
        time.sleep(float(os.environ.get("CAFA_TEST_SLEEP", "0.5")))
        return super().forward(x)


def build(num_classes=3):
    return Slow(num_classes)
"""

# `python -m cafa_cli`, with the artifact writer slowed down: it writes the temporary file in
# full, says so, and waits to be killed before the rename.
SLOW_WRITE = """
import os, runpy, sys, time
from pathlib import Path
import cafa_cli.artifact.store as artifact

real_save = artifact.save_file


def slow_save(tensors, filename, metadata=None):
    real_save(tensors, filename, metadata=metadata)
    Path(os.environ["CAFA_TEST_MARKER"]).touch()
    time.sleep(60)


artifact.save_file = slow_save
sys.argv = ["cafa"] + sys.argv[1:]
runpy.run_module("cafa_cli", run_name="__main__")
"""


class Run:
    """One `cafa` process, signalled with `sig` once `ready(run)` holds."""

    def __init__(
        self, folder: Path, args: list, ready, sig: signal.Signals, slow_write: bool = False, group: bool = False
    ):
        self.folder, self.ready, self.sig, self.group = folder, ready, sig, group
        self.marker = folder / "marker"
        self.stdout, self.stderr = folder / "stdout", folder / "stderr"
        env = {**os.environ, "CAFA_TEST_MARKER": str(self.marker), "CAFA_TEST_SLEEP": "0.4", "OMP_NUM_THREADS": "1"}
        command = (
            [sys.executable, "-c", textwrap.dedent(SLOW_WRITE)] if slow_write else [sys.executable, "-m", "cafa_cli"]
        )
        with open(self.stdout, "wb") as out, open(self.stderr, "wb") as err:
            # a session of its own: `group` signals reach the loader workers too, as Ctrl-C does
            self.process = subprocess.Popen(
                command + [str(a) for a in args], stdout=out, stderr=err, env=env, cwd=folder, start_new_session=True
            )
        self.signalled = False
        self.before = None  # the artifact's bytes before the run

    def poll(self) -> None:
        if not self.signalled and self.process.poll() is None and self.ready(self):
            if self.group:
                os.killpg(self.process.pid, self.sig)
            else:
                self.process.send_signal(self.sig)
            self.signalled = True


def _temporary_file_written(run: Run) -> bool:
    """The writer has the new artifact complete on disk, not yet renamed over the old one."""
    return run.marker.exists() and any(run.folder.glob(".s.safetensors.*.tmp"))


def _some_records_out(run: Run) -> bool:
    return run.stdout.read_bytes().count(b"\n") >= 4  # the header and three records


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    root = tmp_path_factory.mktemp("interrupt")
    train, weights = tiny_training_set(root)
    slow = root / "slow.py"
    slow.write_text(SLOW_NET.format(assets=str(ASSETS)))

    started: dict[str, Run] = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        folder = root / f"stats-{sig.name}"
        folder.mkdir()
        out = folder / "s.safetensors"
        args = [
            "stats",
            "--model",
            TINY_NET,
            "--weights",
            weights,
            *PLAIN,
            "--data",
            train,
            "--fraction",
            "1",
            "--out",
            out,
        ]
        result = CliRunner().invoke(app, [str(a) for a in args] + ["--quiet"])  # the artifact a killed run must keep
        assert result.exit_code == 0, result.stderr
        before = out.read_bytes()
        started[folder.name] = Run(folder, args, _temporary_file_written, sig, slow_write=True)
        started[folder.name].before = before
    for sig in (signal.SIGINT, signal.SIGTERM):
        folder = root / f"adapt-{sig.name}"
        folder.mkdir()
        args = ["adapt", "--model", f"{slow}:build", "--weights", weights, *PLAIN, "--method", "tent",
                "--data", train, "--batch-size", "2", "--no-shuffle"]  # fmt: skip
        started[folder.name] = Run(folder, args, _some_records_out, sig)
    for sig in (signal.SIGINT, signal.SIGTERM):  # to the whole process group, loader workers included
        folder = root / f"adapt-workers-{sig.name}"
        folder.mkdir()
        args = ["adapt", "--model", f"{slow}:build", "--weights", weights, *PLAIN, "--method", "tent",
                "--data", train, "--batch-size", "2", "--no-shuffle", "--num-workers", "2"]  # fmt: skip
        started[folder.name] = Run(folder, args, _some_records_out, sig, group=True)

    deadline = time.monotonic() + 300  # six torch processes start at once: generous on a loaded machine
    while any(r.process.poll() is None for r in started.values()) and time.monotonic() < deadline:
        for run in started.values():
            run.poll()
        time.sleep(0.05)
    for run in started.values():
        if run.process.poll() is None:
            run.process.kill()
            run.process.wait()
    return started


@pytest.mark.parametrize("name", ["stats-SIGTERM", "stats-SIGINT"])
def test_killed_stats_keeps_the_old_artifact_and_leaves_no_temporary_file(runs, name):
    run = runs[name]
    stderr = run.stderr.read_text()
    assert run.signalled, f"never reached mid-run: {stderr}"
    assert run.process.returncode == EXIT_INTERRUPTED, stderr
    assert (run.folder / "s.safetensors").read_bytes() == run.before, "the old artifact changed"
    assert not list(run.folder.glob(".s.safetensors.*.tmp")), "a temporary file was left behind"
    assert stderr.strip().endswith("cafa: interrupted") and "Traceback" not in stderr


def _processes_in(folder: Path) -> list[int]:
    """Live processes whose working directory is `folder` (a run and its loader workers)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and Path(os.readlink(proc / "cwd")) == folder:
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


@pytest.mark.parametrize("name", ["adapt-SIGINT", "adapt-SIGTERM", "adapt-workers-SIGINT", "adapt-workers-SIGTERM"])
def test_interrupted_adapt_flushes_complete_records_and_exits_130(runs, name):
    run = runs[name]
    stderr = run.stderr.read_text()
    assert run.signalled, f"never reached mid-run: {stderr}"
    assert run.process.returncode == EXIT_INTERRUPTED, stderr
    assert "cafa: interrupted" in stderr and "Traceback" not in stderr
    text = run.stdout.read_text()
    assert text.endswith("\n"), "the last record is cut"
    rows = list(csv.reader(text.splitlines()))
    assert rows[0] == ["path", "prediction", "label", "confidence"]
    records = rows[1:]
    assert 3 <= len(records) < 18, len(records)  # some, but not all: it was stopped mid-stream
    for path, prediction, label, confidence in records:
        assert Path(path).is_file() and prediction in "abc" and label in "abc" and 0 < float(confidence) <= 1
    deadline = time.monotonic() + 10
    while _processes_in(run.folder) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _processes_in(run.folder), "a loader worker outlived the run"


def _catches_sigterm(pid: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    return False


def _torch_loaded(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.skipif(
    not Path("/proc/self/status").exists(), reason="reads /proc to catch the process while it imports torch"
)
def test_sigterm_while_torch_is_still_importing_exits_130(tmp_path):
    process = subprocess.Popen(
        [sys.executable, "-m", "cafa_cli", "inspect", tmp_path / "absent.safetensors"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 30
        while not _catches_sigterm(process.pid) and time.monotonic() < deadline:
            time.sleep(0.002)
        # the handler must be in place before the seconds-long torch import, not after it
        assert not _torch_loaded(process.pid), "SIGTERM is only caught once torch has loaded"
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == EXIT_INTERRUPTED
    assert stderr.decode() == "cafa: interrupted\n" and stdout == b""


# `cafa`, with a teardown after the command made long enough to be signalled in (the real one
# is seconds of native libraries unloading, after Python has reset its handlers, where the
# signal killed the process; here the handlers the command left are what is tested)
LINGERING = """
import os, sys, time
from pathlib import Path

sys.argv = ["cafa", *sys.argv[1:]]
from cafa_cli.cli.app import main

try:
    main()
finally:
    Path(os.environ["CAFA_TEST_MARKER"]).touch()
    time.sleep(1)
"""


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_a_signal_after_the_command_is_over_leaves_its_exit_code(tmp_path, name):
    """A bench interrupted once its outputs were written and its table printed exited 130
    (killed by the signal in the teardown) without a word. The run is over then: its exit
    code stands."""
    marker = tmp_path / "torn-down"
    process = subprocess.Popen(
        [sys.executable, "-c", LINGERING, "methods"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
        env={**os.environ, "CAFA_TEST_MARKER": str(marker)},
    )
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        process.send_signal(getattr(signal, name))
        stdout, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert marker.exists()
    assert process.returncode == 0 and "source" in stdout.decode()
    assert "KeyboardInterrupt" not in stderr.decode() and "Traceback" not in stderr.decode()
