"""`torchrun -m cafa_cli` on 2 CPU processes (gloo) gives what one process gives: the stats
artifact, the bench table and report, adapt's records and metrics."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
import torch
from conftest import PLAIN, TINY_NET, write_folder
from safetensors import safe_open


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def test_torchrun_two_ranks_match_one_process(tmp_path, tiny_weights):
    data = write_folder(tmp_path / "train", per_class=15)
    args = [
        "stats",
        "--model",
        TINY_NET,
        "--weights",
        str(tiny_weights),
        "--data",
        str(data),
        *PLAIN,
        "--per-class",
        "16",
        "--covariance",
        "full",
        "--shrinkage",
        "0.2",
        "--batch-size",
        "4",
    ]
    single, multi = tmp_path / "one.safetensors", tmp_path / "two.safetensors"
    subprocess.run(
        [sys.executable, "-m", "cafa_cli", *args, "--out", str(single)], check=True, timeout=120, capture_output=True
    )
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
    ]
    done = subprocess.run(
        [*launcher, "-m", "cafa_cli", *args, "--out", str(multi)], capture_output=True, text=True, timeout=300
    )
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
    args = [
        "bench",
        "--model",
        TINY_NET,
        "--weights",
        str(tiny_weights),
        "--train",
        str(train),
        "--data",
        str(test),
        *PLAIN,
        "--methods",
        "source,bn,tent,cafa-diag",
        "--seeds",
        "0,1",
        "--per-class",
        "10",
        "--batch-size",
        "10",
        "--quiet",
    ]
    single = subprocess.run(
        [sys.executable, "-m", "cafa_cli", *args, "--workdir", str(tmp_path / "one")],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert single.returncode == 0, single.stderr[-2000:]
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
    ]
    multi = subprocess.run(
        [*launcher, "-m", "cafa_cli", *args, "--workdir", str(tmp_path / "two")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert multi.returncode == 0, multi.stderr[-2000:]
    assert single.stdout.count("| cafa-diag |") == 1
    assert multi.stdout == single.stdout  # the same table, printed once (by rank 0)


def torchrun(*args, ranks: int = 2) -> subprocess.CompletedProcess:
    """`cafa ARGS` under torchrun on `ranks` CPU processes (gloo); one process when `ranks` is 1."""
    launcher = (
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "1",
            "--nproc-per-node",
            str(ranks),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
        ]
        if ranks > 1
        else [sys.executable]
    )
    done = subprocess.run([*launcher, "-m", "cafa_cli", *map(str, args)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def four_domains(tmp_path):
    """Four small labelled test domains, d0 to d3, with 1 to 4 more images of class a than of
    the others: each has its own error even where the model predicts one class for all."""
    domains = []
    for k in range(4):
        domain = write_folder(tmp_path / f"d{k}", per_class=3, seed=k, shift=0.2 * k)
        extra = write_folder(tmp_path / f"extra{k}", per_class=k + 1, classes=("a",), seed=9 + k)
        for i, image in enumerate(sorted((extra / "a").iterdir())):
            image.rename(domain / "a" / f"extra{i}.png")
        domains.append(domain)
    return domains


def without_times(report: dict) -> dict:
    """A bench or metrics report without what differs from run to run: times, the device's rank,
    and the environment (torchrun gives each of several ranks one thread: OMP_NUM_THREADS=1)."""
    return json.loads(
        json.dumps(report),
        object_hook=lambda d: {
            k: v for k, v in d.items() if k not in ("seconds", "images_per_second", "created", "environment")
        },
    )


def test_torchrun_bench_spreads_the_domains_of_a_run_under_reset_domain(tmp_path, tiny_weights):
    """One (method, seed) run over 4 domains: each rank adapts 2 of them, from the source weights,
    and rank 0 prints the one-process table, CSV and JSON runs in the one-process order."""
    domains = four_domains(tmp_path)
    args = [
        "bench",
        "--model",
        TINY_NET,
        "--weights",
        tiny_weights,
        *PLAIN,
        "--methods",
        "tent",
        "--seeds",
        "0",
        "--batch-size",
        "4",
        "--reset",
        "domain",
        *domains,
    ]
    out = {ranks: {kind: tmp_path / f"{ranks}.{kind}" for kind in ("csv", "json")} for ranks in (1, 2)}
    single, multi = (
        torchrun(
            *args,
            "--workdir",
            tmp_path / f"w{ranks}",
            "--csv",
            out[ranks]["csv"],
            "--metrics-json",
            out[ranks]["json"],
            ranks=ranks,
        )
        for ranks in (1, 2)
    )
    assert multi.stdout == single.stdout and single.stdout.count("| tent |") == 1
    assert out[2]["csv"].read_text() == out[1]["csv"].read_text()
    one, two = (json.loads(out[ranks]["json"].read_text()) for ranks in (1, 2))
    assert [run["data"] for run in two["runs"]] == [str(d) for d in domains]
    assert without_times(two["runs"]) == without_times(one["runs"]) and two["table"] == one["table"]
    assert len({run["error"] for run in one["runs"]}) > 1  # the domains differ: a mixed-up order would show
    # rank 0 says what it ran as it goes, and what rank 1 ran after gathering: every other domain each
    assert "tent seed 0: d0, d2\n" in multi.stderr and "rank 1: tent seed 0: d1, d3\n" in multi.stderr, multi.stderr
    assert "tent seed 0\n" in single.stderr and "rank 1" not in single.stderr


def test_torchrun_bench_of_methods_that_draw_random_numbers_prints_the_one_process_table(tmp_path, tiny_weights):
    """roid and deyo draw from torch's generator: each domain's draws go on from the domains
    before it, so a rank that adapted a later domain by itself would predict otherwise (issue 61:
    roid's second domain differed in 61 of 80 scores). Their runs stay whole, on one rank."""
    domains = four_domains(tmp_path)
    args = ["bench", "--model", TINY_NET, "--weights", tiny_weights, *PLAIN, "--methods", "roid,deyo", "--seeds", "0"]
    args += ["--batch-size", "2", "--reset", "domain", *domains]
    single, multi = (
        torchrun(*args, "--workdir", tmp_path / f"w{ranks}", "--metrics-json", tmp_path / f"{ranks}.json", ranks=ranks)
        for ranks in (1, 2)
    )
    assert single.returncode == multi.returncode == 0, multi.stderr[-2000:]
    assert multi.stdout == single.stdout
    one, two = (json.loads((tmp_path / f"{ranks}.json").read_text()) for ranks in (1, 2))
    assert without_times(two["runs"]) == without_times(one["runs"])
    assert "rank 1: deyo seed 0\n" in multi.stderr, multi.stderr  # a whole run each, not a domain each


@pytest.mark.parametrize(
    ("reset", "methods", "domains", "runs"),
    [
        ("domain", "bn,tent", ["a", "b"], [("bn", "a"), ("bn", "b"), ("tent", "a"), ("tent", "b")]),
        ("episodic", "bn", ["a", "b"], [("bn", "a"), ("bn", "b")]),
        ("never", "bn,tent", ["a", "b"], [("bn", None), ("tent", None)]),  # the weights go on from a to b
        (
            "domain",
            "cotta,bn",
            ["a", "b"],
            [("cotta", None), ("bn", "a"), ("bn", "b")],
        ),  # its random draws go on from a to b
        ("domain", "roid,deyo,tent", ["a", "b"], [("roid", None), ("deyo", None), ("tent", "a"), ("tent", "b")]),
        ("domain", "bn", ["a"], [("bn", None)]),
    ],
)
def test_a_bench_spreads_the_domains_of_the_runs_whose_domains_are_independent(reset, methods, domains, runs):
    from cafa_cli.jobs.bench import grid_runs
    from cafa_cli.jobs.bench.rows import parse_methods
    from cafa_cli.jobs.config import BenchConfig

    config = BenchConfig(data=domains, model="m", reset=reset)
    assert [
        (row.label, None if k is None else domains[k])
        for row, seed, k in grid_runs(config, parse_methods(methods), [0])
    ] == runs


def test_each_rank_takes_one_run_of_consecutive_domains_rank_0_the_first():
    from cafa_cli.jobs.shared.distributed import block

    assert [list(block(5, rank, 2)) for rank in range(2)] == [[0, 1, 2], [3, 4]]
    assert [list(block(4, rank, 3)) for rank in range(3)] == [[0, 1], [2], [3]]
    assert [list(block(1, rank, 3)) for rank in range(3)] == [[0], [], []]


def test_rank_0_shows_the_other_ranks_notes_under_their_rank_and_each_warning_once():
    from cafa_cli.jobs.shared.distributed import RankMonitor, show_other_ranks
    from cafa_cli.jobs.shared.monitor import Monitor

    class Shown(Monitor):
        def __init__(self):
            super().__init__()
            self.lines = []

        def info(self, message):
            self.lines.append(message)

        def warn(self, message):
            self.lines.append(f"warning: {message}")

    shown = Shown()
    root, other = RankMonitor(shown), RankMonitor(None)
    root.warn("x")
    other.info("tent seed 0: b")
    for warning in ("x", "y", "y"):
        other.warn(warning)
    assert shown.lines == ["warning: x"]  # another rank's words wait for the gathering
    show_other_ranks(root, [root.said(), other.said()])
    assert shown.lines == ["warning: x", "rank 1: tent seed 0: b", "warning: y"]


def test_a_share_of_a_gradual_stream_keeps_whole_corruptions_each_starting_afresh():
    from cafa_cli.jobs.adapt.job import Adaptation, part_of, stream_units

    stages = ["fog/1", "fog/2", "fog/1", "snow/1", "snow/2", "snow/1", "frost/1"]
    job = Adaptation(None, stages, None, [], None, {}, groups=[0, 0, 0, 1, 1, 1, 2])
    assert stream_units(job) == 3
    part = part_of(job, [0, 2])
    assert part.domains == ["fog/1", "fog/2", "fog/1", "frost/1"] and part.groups == [0, 0, 0, 1]  # reset at frost only
    plain = part_of(Adaptation(None, ["a", "b", "c"], None, [], None, {}), range(1, 3))
    assert plain.domains == ["b", "c"] and plain.groups is None


def test_torchrun_adapt_spreads_the_domains_and_rank_0_prints_every_record_in_order(tmp_path, tiny_weights):
    domains = four_domains(tmp_path)
    args = [
        "adapt",
        "--model",
        TINY_NET,
        "--weights",
        tiny_weights,
        *PLAIN,
        "--method",
        "tent",
        "--batch-size",
        "4",
        *domains,
    ]
    single, multi = (torchrun(*args, "--metrics-json", tmp_path / f"{ranks}.json", ranks=ranks) for ranks in (1, 2))
    assert (
        multi.stdout == single.stdout and single.stdout.count("\n") == 1 + 9 * 4 + 1 + 2 + 3 + 4
    )  # printed once, by rank 0
    one, two = (json.loads((tmp_path / f"{ranks}.json").read_text()) for ranks in (1, 2))
    assert without_times(two) == without_times(one)
    assert "adapting d0, d1\n" in multi.stderr and "rank 1: adapting d2, d3\n" in multi.stderr, multi.stderr
    assert "adapting d0" not in single.stderr


@pytest.mark.parametrize(
    ("option", "needle"),
    [
        (
            ["--reset", "never"],
            "but --reset never carries the weights from one domain into the next: give --reset domain, or run",
        ),
        (
            ["--mix-domains"],
            "but --mix-domains makes the domains one stream: drop --mix-domains, or run it without torchrun",
        ),
        (
            ["--method", "cotta"],
            "but --method cotta draws random numbers, each domain from where the one before left them: run it",
        ),
        (
            ["--data", "-"],
            "but every rank would read --data - (paths on standard input): give the folders or files, or run",
        ),
    ],
)
def test_adapt_under_torchrun_is_refused_instead_of_printing_every_record_twice(tmp_path, monkeypatch, option, needle):
    """Refused where the domains depend on each other (docs/reference/errors.md, 66, cites this name)."""
    from typer.testing import CliRunner

    from cafa_cli.cli.app import app

    monkeypatch.setenv("WORLD_SIZE", "2")
    method = [] if "--method" in option else ["--method", "source"]
    result = CliRunner().invoke(app, ["adapt", "--data", str(tmp_path), *method, "--model", TINY_NET, *option])
    assert result.exit_code == 2 and result.stdout == ""
    assert (
        "cafa adapt under torchrun spreads the domains over the ranks, but" in result.stderr and needle in result.stderr
    )
    assert result.stderr.count("\n") == 1, result.stderr


@pytest.mark.parametrize(
    ("environment", "needle"),
    [
        ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' is not a whole number; launch with torchrun, or unset WORLD_SIZE"),
        (
            {"WORLD_SIZE": "2", "RANK": "5"},
            "RANK=5 with WORLD_SIZE=2: launch with torchrun",
        ),  # a group would wait forever
        ({"WORLD_SIZE": "2"}, "RANK=(unset) with WORLD_SIZE=2"),
    ],
)
def test_torchrun_variables_that_cannot_be_right_are_usage_errors(
    tmp_path, tiny_weights, monkeypatch, environment, needle
):
    from typer.testing import CliRunner

    from cafa_cli.cli.app import app

    data = write_folder(tmp_path / "train", per_class=3)
    monkeypatch.delenv("RANK", raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    result = CliRunner().invoke(
        app,
        [
            "stats",
            "--model",
            TINY_NET,
            "--weights",
            str(tiny_weights),
            "--data",
            str(data),
            *PLAIN,
            "--fraction",
            "1",
            "--out",
            str(tmp_path / "s.safetensors"),
        ],
    )
    assert result.exit_code == 2 and needle in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1


def test_each_rank_takes_the_gpu_of_its_local_rank_and_nothing_else(monkeypatch):
    """Under torchrun --device cuda:0 would put every rank on one GPU; a LOCAL_RANK past
    the GPUs would fail deep in CUDA. No GPU here: the count is what the check reads."""
    import torch

    from cafa_cli.core.errors import UsageError
    from cafa_cli.jobs.shared.distributed import rank_device

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert rank_device(torch.device("cuda")) == torch.device("cuda", 1)
    assert rank_device(torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(
        UsageError, match=r"`device` cuda:0 under torchrun would put every rank on one GPU; give `device` cuda"
    ):
        rank_device(torch.device("cuda", 0))
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(UsageError, match=r"LOCAL_RANK=2, but this machine has 2 GPU\(s\)"):
        rank_device(torch.device("cuda"))
