"""Outputs never over anything the command reads (issue 40, §1): an image reached through a
symlink, a hard link or a `..` list line, and the files behind standard output and standard
error, are refused as outputs before anything is written."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY_NET, invoke, write_folder


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def victim(tmp_path) -> Path:
    """An image outside the data that the data reaches; its bytes must survive every run."""
    images = write_folder(tmp_path / "elsewhere", per_class=1)
    return next(images.rglob("*.png"))


def _adapt(setup, data, *extra, input=None):
    return invoke("adapt", "--stats", setup["artifact"], "--model", TINY_NET, "--data", data, "-q", *extra, input=input)


@pytest.mark.parametrize("how", ["symlink", "hard link"])
def test_an_image_reached_through_a_link_is_never_an_output(setup, tmp_path, victim, how):
    data = write_folder(tmp_path / "data", per_class=3)
    link = data / "a" / "reached.png"
    if how == "symlink":
        link.symlink_to(os.path.relpath(victim, link.parent))
    else:
        os.link(victim, link)
    before = _digest(victim)
    for option in ("--metrics-json", "--predictions", "--export"):
        result = _adapt(setup, data, option, victim)
        assert result.exit_code == 2, (option, result.stderr)
        assert "is also the image" in result.stderr and "reached.png" in result.stderr
        assert result.stdout == "" and _digest(victim) == before


def test_an_image_reached_through_a_dotdot_list_line_is_never_an_output(setup, tmp_path, victim):
    climbing = tmp_path / "data" / ".." / victim.relative_to(tmp_path)
    (tmp_path / "data").mkdir()
    before = _digest(victim)
    result = _adapt(setup, "-", "--metrics-json", victim, input=f"{climbing}\n")
    assert result.exit_code == 2 and "is also the image" in result.stderr, result.stderr
    assert _digest(victim) == before


@pytest.mark.parametrize("stream", ["/dev/stdout", "/dev/fd/1"])
def test_an_output_on_the_file_of_standard_output_is_refused(setup, tmp_path, stream):
    result = _adapt(setup, setup["train"], "--metrics-json", stream)
    assert result.exit_code == 2 and "is the file standard output goes to" in result.stderr, result.stderr
    assert _adapt(setup, setup["train"], "--metrics-json", os.devnull).exit_code == 0  # loses nothing


def test_shell_redirections_onto_an_output_are_refused(setup, tmp_path):
    """`cafa adapt ... --metrics-json same.out > same.out` left only the JSON; `2> log` with
    `--metrics-json log` replaced the log. A process of its own, so that its standard streams
    are the files themselves."""
    command = [sys.executable, "-m", "cafa_cli", "adapt", "--stats", str(setup["artifact"]), "--model", TINY_NET]
    command += ["--data", str(setup["train"]), "-q"]
    environment = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    same = tmp_path / "same.out"
    with open(same, "w") as out:
        run = subprocess.run(
            [*command, "--metrics-json", str(same)], stdout=out, stderr=subprocess.PIPE, env=environment
        )
    assert run.returncode == 2 and b"standard output goes to" in run.stderr, run.stderr
    log = tmp_path / "log"
    log.write_text("an earlier line of the log\n")
    with open(log, "a") as err:
        run = subprocess.run(
            [*command, "--metrics-json", str(log)], stdout=subprocess.DEVNULL, stderr=err, env=environment
        )
    assert run.returncode == 2 and log.read_text().startswith("an earlier line of the log\n")
    assert "standard error goes to" in log.read_text()
    records = tmp_path / "records.csv"
    with open(records, "w") as out:  # the records themselves may go to standard output's file by name
        run = subprocess.run([*command, "--predictions", "/dev/stdout"], stdout=out, env=environment)
    assert run.returncode == 0 and records.read_text().startswith("path,prediction,label,confidence\n")


def test_standard_output_appended_to_an_input_is_refused_before_it_is_written(setup, tmp_path):
    """`cafa adapt ... --stats s.safetensors >> s.safetensors` appended the records to the
    artifact; `>> one/of/the/images.png` to an image. The files behind the standard streams are
    outputs like any option's (files.writing), checked as each input is read."""
    artifact = tmp_path / "stats.safetensors"
    artifact.write_bytes(Path(setup["artifact"]).read_bytes())
    image = next(iter(sorted(Path(setup["train"]).rglob("*.png"))))
    kept = {path: path.read_bytes() for path in (artifact, image)}
    environment = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    command = [sys.executable, "-m", "cafa_cli", "adapt", "--model", TINY_NET, "--data", str(setup["train"]), "-q"]
    for target, stats in ((artifact, artifact), (image, setup["artifact"])):
        with open(target, "ab") as out:
            run = subprocess.run([*command, "--stats", str(stats)], stdout=out, stderr=subprocess.PIPE, env=environment)
        assert run.returncode == 2, run.stderr
        assert f"standard output (redirected to {os.path.realpath(target)}) is also".encode() in run.stderr
        assert run.stderr.rstrip().endswith(b"send standard output elsewhere")
        assert target.read_bytes() == kept[target]
