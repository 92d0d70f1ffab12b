"""The CI gate (issue 44): `--max-error` on adapt and bench, exit 4 after every output is
written; the unit of every error in the JSON outputs; the summary unwrapped off a terminal;
the lock on a shared bench workdir's statistics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import invoke, write_folder
from helpers import adapt, bench_args, fails
from typer.testing import CliRunner

from cafa_cli.cli.app import app, command_options
from cafa_cli.cli.defaults import read_defaults
from cafa_cli.cli.errors import EXIT_ABOVE_MAX_ERROR
from cafa_cli.core.errors import UsageError
from cafa_cli.jobs.bench.statistics import artifact_path, statistics_lock
from cafa_cli.jobs.config import AdaptConfig, BenchConfig
from cafa_cli.jobs.shared.monitor import Monitor
from cafa_cli.jobs.shared.report import ERROR_FRACTION, ERROR_PERCENT

GATE_LINE = "cafa: error: "


@pytest.fixture(scope="module")
def test_folder(setup) -> Path:
    return write_folder(setup["root"] / "gate-test", per_class=4, seed=3)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(GATE_LINE)]


# --- cafa adapt --max-error ------------------------------------------------------


def test_adapt_above_max_error_exits_4_after_writing_the_records_metrics_and_summary(setup, test_folder, tmp_path):
    out = {"predictions": tmp_path / "p.csv", "metrics": tmp_path / "m.json"}
    result = adapt(
        setup, test_folder, "--predictions", out["predictions"], "--metrics-json", out["metrics"], "--max-error", "0"
    )
    assert EXIT_ABOVE_MAX_ERROR == 4
    metrics = json.loads(out["metrics"].read_text())
    assert 0 < metrics["error"] <= 1 and metrics["labelled"] == 12
    assert result.exit_code == 4, result.stderr
    # the summary first, then one line naming the error (as the summary shows it) and the threshold, last
    assert result.stderr.strip().splitlines()[-1] == (
        f"cafa: error: error {100 * metrics['error']:.2f} % is above --max-error 0 (cafa)"
    )
    assert "error %" in result.stderr  # the summary table was printed before
    assert len(out["predictions"].read_text().splitlines()) == 1 + 12  # header and every record


def test_adapt_quiet_above_max_error_prints_the_one_line_alone(setup, test_folder):
    fails(adapt(setup, test_folder, "--max-error", "0", "-q"), 4, "is above --max-error 0 (cafa)")


def test_adapt_at_or_below_max_error_exits_0_without_a_message(setup, test_folder, tmp_path):
    metrics = tmp_path / "m.json"
    first = adapt(setup, test_folder, "--metrics-json", metrics)
    assert first.exit_code == 0, first.stderr
    error = 100 * json.loads(metrics.read_text())["error"]
    # the error exactly at the threshold passes, as the JSON gives it back (8 of 12 is 66.66666666666667 %)
    for threshold in (repr(error), "100"):
        result = adapt(setup, test_folder, "--max-error", threshold)
        assert result.exit_code == 0, (threshold, result.stderr)
        assert not error_lines(result.stderr) and result.stdout == first.stdout


def test_adapt_max_error_without_labels_is_a_usage_error_before_any_record(setup, tmp_path):
    flat = tmp_path / "flat"
    flat.mkdir()
    for image in sorted((setup["train"] / "a").iterdir())[:4]:  # images with no class folders: no labels
        (flat / image.name).write_bytes(image.read_bytes())
    predictions = tmp_path / "p.csv"
    fails(
        adapt(setup, flat, "--max-error", "20", "--predictions", predictions),
        2,
        "--max-error gates on the error of the labelled images, and no image of flat has a label",
    )
    assert not predictions.exists()


@pytest.mark.parametrize("value", ["150", "-1", "nan"])
def test_max_error_outside_0_to_100_is_a_usage_error_before_anything_is_read(value):
    for command in ("adapt", "bench"):
        fails(
            invoke(command, "missing-folder", "--max-error", value), 2, "--max-error must be a percentage in [0, 100]"
        )


def test_max_error_is_checked_in_the_settings_from_the_python_api_and_cafa_toml(tmp_path, monkeypatch):
    for config in (AdaptConfig, BenchConfig):
        for wrong in (101, -0.5, float("nan"), "20", True):
            with pytest.raises(UsageError, match="`max_error` must be a percentage in"):
                config(data=["x"], max_error=wrong)
        assert config(data=["x"], max_error=0).max_error == 0 and config(data=["x"], max_error=100.0)
    monkeypatch.chdir(tmp_path)  # where cafa.toml is looked for, as the entry point reads it
    (tmp_path / "cafa.toml").write_text("[adapt]\nmax-error = 150\n[bench]\nmax-error = -1\n")
    defaults = read_defaults(tmp_path, command_options())
    for command, value in (("adapt", "150.0"), ("bench", "-1.0")):
        from_file = CliRunner().invoke(app, [command, "x"], default_map=defaults)
        assert from_file.exit_code == 2 and from_file.stderr.strip() == (
            f"cafa: error: --max-error must be a percentage in [0, 100], not {value} (--max-error set in cafa.toml)"
        ), from_file.stderr


# --- cafa bench --max-error --------------------------------------------------------


def bench(tmp_path, weights, *args):
    train = write_folder(tmp_path / "train", per_class=6)
    return invoke(*bench_args(train, weights=weights, per_class=6, workdir=tmp_path / "w"), *args)


def test_bench_above_max_error_names_the_rows_and_exits_4_after_every_output(tmp_path, tiny_weights):
    out = {k: tmp_path / f"r.{k}" for k in ("csv", "json", "svg")}
    result = bench(
        tmp_path,
        tiny_weights,
        "--methods",
        "source,bn",
        "--csv",
        out["csv"],
        "--metrics-json",
        out["json"],
        "--plot",
        out["svg"],
        "--max-error",
        "0",
    )
    assert result.exit_code == 4, result.stderr
    report = json.loads(out["json"].read_text())
    means = {row["method"]: row["mean"]["mean"] for row in report["table"]}
    assert result.stderr.strip().splitlines()[-1] == (
        f"cafa: error: mean error is above --max-error 0 in 2 of 2 rows: source {means['source']:.2f} %, "
        f"bn {means['bn']:.2f} %"
    )
    assert "| source |" in result.stdout and "| bn |" in result.stdout  # the table came first
    assert out["csv"].read_text().count("\n") > 2 and out["svg"].read_text().lstrip().startswith("<?xml")


def test_bench_names_only_the_rows_above_and_passes_at_the_threshold(tmp_path, tiny_weights):
    report = tmp_path / "r.json"
    first = bench(tmp_path, tiny_weights, "--methods", "source", "--metrics-json", report, "-q")
    assert first.exit_code == 0 and first.stderr == "", first.stderr
    mean = json.loads(report.read_text())["table"][0]["mean"]["mean"]
    assert mean > 0
    at = bench(tmp_path, tiny_weights, "--methods", "source", "--max-error", repr(mean), "-q")
    assert at.exit_code == 0 and at.stderr == "" and at.stdout == first.stdout, at.stderr
    below = bench(tmp_path, tiny_weights, "--methods", "source", "--max-error", f"{mean - 0.01:.2f}", "-q")
    fails(below, 4, f"mean error {mean:.2f} % is above --max-error {mean - 0.01:.2f} (source)")


# --- one unit, named, in every JSON --------------------------------------------------


def test_every_json_output_names_the_unit_of_its_errors(setup, test_folder, tmp_path, tiny_weights):
    metrics = tmp_path / "m.json"
    done = adapt(setup, test_folder, "--metrics-json", metrics, "--clean", test_folder, "-q")
    assert done.exit_code == 0, done.stderr
    saved = json.loads(metrics.read_text())
    assert saved["unit"] == ERROR_FRACTION == "error fraction"
    assert saved["error"] == sum(d["error"] * d["labelled"] for d in saved["domains"]) / saved["labelled"]
    assert [d["unit"] for d in saved["domains"]] == [ERROR_FRACTION] and saved["clean"]["unit"] == ERROR_FRACTION
    assert 0 <= saved["clean"]["error"] <= 1

    report = tmp_path / "b.json"
    done = bench(tmp_path, tiny_weights, "--methods", "source,bn", "--seeds", "0,1", "--metrics-json", report, "-q")
    assert done.exit_code == 0, done.stderr
    saved = json.loads(report.read_text())
    assert saved["unit"] == ERROR_PERCENT == "error %"  # the table's, as the markdown table shows it
    assert {run["unit"] for run in saved["runs"]} == {ERROR_FRACTION}
    for row in saved["table"]:  # the units as named: the table's mean is 100 × the runs' mean fraction
        errors = [run["error"] for run in saved["runs"] if run["method"] == row["method"]]
        assert row["mean"]["mean"] == pytest.approx(100 * sum(errors) / len(errors))


# --- the summary off a terminal ---------------------------------------------------


def test_the_summary_keeps_a_long_domain_path_on_one_line_when_stderr_is_no_terminal(setup, tmp_path):
    deep = tmp_path / "a-rather-long-folder-name-for-the-corrupted-test-images" / "gaussian_noise_severity" / "5"
    write_folder(deep, per_class=2, seed=4)
    assert len(str(deep)) > 100
    result = adapt(setup, deep, "--data", setup["train"])  # two domains: an `all` row too
    assert result.exit_code == 0, result.stderr
    row = next(line for line in result.stderr.splitlines() if str(deep) in line)
    assert row.split("│")[2].strip() == "6"  # the images column on the same line as the whole path
    assert all(len(line) <= len(row) for line in result.stderr.splitlines() if "│" in line)


# --- the lock on a shared workdir's statistics --------------------------------------


def test_two_benches_sharing_a_workdir_compute_the_statistics_once(tmp_path, tiny_weights):
    """The test holds the artifact's lock until both benches say they wait for it: then one
    computes the statistics and the other re-uses them, whichever comes first."""
    train = write_folder(tmp_path / "train", per_class=6)
    workdir = tmp_path / "w"
    workdir.mkdir()
    command = [
        sys.executable,
        "-m",
        "cafa_cli",
        *bench_args(train, methods="cafa-diag", train=train, weights=tiny_weights, per_class=6, workdir=workdir),
    ]
    logs = [tmp_path / f"bench{k}.err" for k in range(2)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    processes = []
    try:
        with statistics_lock(artifact_path(workdir, "diag"), Monitor()):
            for log in logs:
                with log.open("w") as stderr:  # the child has its own copy
                    processes.append(
                        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, env=env, cwd=tmp_path)
                    )
            deadline = time.monotonic() + 120  # against a hang, not a measurement
            while not all("waiting for another process" in log.read_text() for log in logs):
                assert all(p.poll() is None for p in processes), [log.read_text() for log in logs]
                assert time.monotonic() < deadline, [log.read_text() for log in logs]
                time.sleep(0.1)
        outputs = [p.communicate(timeout=120)[0] for p in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()
    errors = [log.read_text() for log in logs]
    assert [p.returncode for p in processes] == [0, 0], errors
    assert sum(e.count("computing statistics") for e in errors) == 1, errors
    assert all("(a bench with the same --workdir) that holds the lock on" in e for e in errors)
    assert outputs[0] == outputs[1] and b"| cafa-diag |" in outputs[0]
