"""The `environment` block of every metrics and bench JSON (and of an export's and an artifact's
metadata, and plot's JSON): what a table needs to be rerun exactly, each field true of the run
that wrote it (issue 60)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch
from conftest import PLAIN, TINY_NET, invoke
from helpers import PACKAGE, adapt, check_environment, checkout, git

from cafa_cli.core import environment as env_module


@pytest.fixture
def threads():
    """Sets torch's intra-op threads for one test, and puts them back."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("count", [1, 2])
def test_adapts_metrics_json_records_the_code_torchs_build_and_the_threads_it_ran_with(setup, tmp_path, threads, count):
    threads(count)
    metrics = tmp_path / "m.json"
    result = adapt(setup, setup["train"], "--method", "tent", "--device", "cpu", "-q", "--metrics-json", metrics)
    assert result.exit_code == 0, result.stderr
    recorded = json.loads(metrics.read_text())["environment"]
    assert recorded["threads"] == count
    check_environment(recorded)


def test_the_environment_records_the_deterministic_algorithms_setting(setup, tmp_path):
    metrics = tmp_path / "m.json"
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        result = adapt(setup, setup["train"], "--method", "bn", "--device", "cpu", "-q", "--metrics-json", metrics)
        assert result.exit_code == 0, result.stderr
        recorded = json.loads(metrics.read_text())["environment"]
        assert recorded["deterministic"] is True
        check_environment(recorded)
    finally:
        torch.use_deterministic_algorithms(False)


def test_benchs_json_an_export_and_a_statistics_artifact_record_the_same_environment(setup, tmp_path, threads):
    from safetensors import safe_open

    with safe_open(str(setup["artifact"]), "pt") as statistics:  # cafa stats' artifact, made in this process
        check_environment(json.loads(statistics.metadata()["environment"]))
    threads(1)
    report = tmp_path / "b.json"
    result = invoke(
        "bench",
        "--model",
        TINY_NET,
        "--weights",
        setup["weights"],
        *PLAIN,
        "--methods",
        "source,bn",
        "--seeds",
        "0",
        "--batch-size",
        "8",
        "--device",
        "cpu",
        "--workdir",
        tmp_path / "w",
        "--metrics-json",
        report,
        "-q",
        setup["train"],
    )
    assert result.exit_code == 0, result.stderr
    check_environment(json.loads(report.read_text())["environment"])
    exported = tmp_path / "served.safetensors"
    result = adapt(setup, setup["train"], "--method", "tent", "--device", "cpu", "-q", "--export", exported)
    assert result.exit_code == 0, result.stderr
    with safe_open(str(exported), "pt") as served:
        check_environment(json.loads(served.metadata()["environment"]))


@pytest.fixture
def fresh_commit():
    """source_commit() asked again (it is asked once a process), and again after the test."""
    env_module.source_commit.cache_clear()
    yield env_module.source_commit
    env_module.source_commit.cache_clear()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_no_commit_is_recorded_for_a_package_no_checkout_tracks(tmp_path, monkeypatch, fresh_commit):
    outside = tmp_path / "site-packages" / "cafa_cli"  # an installed copy: no repository around it
    outside.mkdir(parents=True)
    monkeypatch.setattr(env_module, "PACKAGE", outside)
    assert fresh_commit() is None
    fresh_commit.cache_clear()
    # a virtual environment inside a checkout: the repository is there but does not track the package
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True, timeout=30)
    assert fresh_commit() is None
    fresh_commit.cache_clear()
    ours = git("describe", "--always", "--dirty", "--abbrev=40").stdout.strip() if checkout() else None
    monkeypatch.setattr(env_module, "PACKAGE", PACKAGE)
    monkeypatch.setenv("GIT_DIR", str(tmp_path / ".git"))  # a hook's GIT_DIR names another repository
    assert fresh_commit() == ours


@pytest.mark.parametrize(
    "failure", [FileNotFoundError("git"), subprocess.TimeoutExpired("git", 5), PermissionError("git")]
)
def test_no_commit_is_recorded_when_git_is_missing_or_slow(monkeypatch, fresh_commit, failure):
    def run(*args, **kwargs):
        raise failure

    monkeypatch.setattr(env_module.subprocess, "run", run)
    assert fresh_commit() is None
    assert "commit" not in env_module.environment("cpu")


def test_a_gpu_run_records_the_gpus_name(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: asked.append(device) or "NVIDIA H100 80GB HBM3")
    recorded = env_module.environment("cuda:0")
    assert (recorded["device"], recorded["device_name"]) == ("cuda:0", "NVIDIA H100 80GB HBM3")
    assert asked == [torch.device("cuda:0")]
