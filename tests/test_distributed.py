"""`torchrun -m cafa_cli stats` on 2 CPU processes (gloo) gives the one-process artifact."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from conftest import PLAIN, TINY_NET, write_folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def test_torchrun_two_ranks_match_one_process(tmp_path, tiny_weights):
    data = write_folder(tmp_path / "train", per_class=15)
    args = ["stats", "--model", TINY_NET, "--weights", str(tiny_weights), "--data", str(data), *PLAIN,
            "--per-class", "16", "--covariance", "full", "--shrinkage", "0.2", "--batch-size", "4"]
    single, multi = tmp_path / "one.safetensors", tmp_path / "two.safetensors"
    subprocess.run([sys.executable, "-m", "cafa_cli", *args, "--out", str(single)], check=True, timeout=120, capture_output=True)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    done = subprocess.run([*launcher, "-m", "cafa_cli", *args, "--out", str(multi)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.count("--per-class 16: fewer images") == 1, done.stderr  # warned by rank 0 only
    (one, meta_one), (two, meta_two) = read(single), read(multi)
    assert torch.equal(one["counts"], two["counts"]) and int(two["counts"].sum()) == 45
    for name in ("means", "precision_cholesky", "global_mean", "global_covariance"):
        torch.testing.assert_close(one[name], two[name], rtol=1e-5, atol=1e-6)
    assert json.loads(meta_one["class_names"]) == json.loads(meta_two["class_names"])
    assert not list(tmp_path.glob(".two.safetensors.*"))  # only rank 0 wrote, and atomically


def test_torchrun_bench_spreads_runs_and_prints_the_one_process_table(tmp_path, tiny_weights):
    train = write_folder(tmp_path / "train", per_class=12)
    test = write_folder(tmp_path / "test", per_class=10, seed=4, shift=0.3)
    args = ["bench", "--model", TINY_NET, "--weights", str(tiny_weights), "--train", str(train), "--data", str(test), *PLAIN,
            "--methods", "source,bn,tent,cafa-diag", "--seeds", "0,1", "--per-class", "10", "--batch-size", "10", "--quiet"]
    single = subprocess.run([sys.executable, "-m", "cafa_cli", *args, "--workdir", str(tmp_path / "one")],
                            capture_output=True, text=True, timeout=180)
    assert single.returncode == 0, single.stderr[-2000:]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    multi = subprocess.run([*launcher, "-m", "cafa_cli", *args, "--workdir", str(tmp_path / "two")],
                           capture_output=True, text=True, timeout=300)
    assert multi.returncode == 0, multi.stderr[-2000:]
    assert single.stdout.count("| cafa-diag |") == 1
    assert multi.stdout == single.stdout  # the same table, printed once (by rank 0)


def test_adapt_under_torchrun_is_refused_instead_of_printing_every_record_twice(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from cafa_cli.cli.app import app

    monkeypatch.setenv("WORLD_SIZE", "2")
    result = CliRunner().invoke(app, ["adapt", "--data", str(tmp_path), "--method", "source", "--model", TINY_NET])
    assert result.exit_code == 2
    assert "cafa adapt runs in one process" in result.stderr and result.stdout == ""


@pytest.mark.parametrize(("environment", "needle"), [
    ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' is not a whole number; launch with torchrun, or unset WORLD_SIZE"),
    ({"WORLD_SIZE": "2", "RANK": "5"}, "RANK=5 with WORLD_SIZE=2: launch with torchrun"),  # a group would wait forever
    ({"WORLD_SIZE": "2"}, "RANK=(unset) with WORLD_SIZE=2"),
])
def test_torchrun_variables_that_cannot_be_right_are_usage_errors(tmp_path, tiny_weights, monkeypatch, environment, needle):
    from typer.testing import CliRunner

    from cafa_cli.cli.app import app

    data = write_folder(tmp_path / "train", per_class=3)
    monkeypatch.delenv("RANK", raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    result = CliRunner().invoke(app, ["stats", "--model", TINY_NET, "--weights", str(tiny_weights), "--data", str(data), *PLAIN,
                                      "--fraction", "1", "--out", str(tmp_path / "s.safetensors")])
    assert result.exit_code == 2 and needle in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1


def test_each_rank_takes_the_gpu_of_its_local_rank_and_nothing_else(monkeypatch):
    """Under torchrun --device cuda:0 would put every rank on one GPU; a LOCAL_RANK past
    the GPUs would fail deep in CUDA. No GPU here: the count is what the check reads."""
    import torch

    from cafa_cli.jobs.distributed import rank_device
    from cafa_cli.errors import UsageError

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert rank_device(torch.device("cuda")) == torch.device("cuda", 1)
    assert rank_device(torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(UsageError, match=r"`device` cuda:0 under torchrun would put every rank on one GPU; give `device` cuda"):
        rank_device(torch.device("cuda", 0))
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(UsageError, match=r"LOCAL_RANK=2, but this machine has 2 GPU\(s\)"):
        rank_device(torch.device("cuda"))
