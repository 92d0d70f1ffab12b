"""cafa bench and cafa demo: method parsing, tables, and a small real run on Fashion-MNIST-C."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import invoke, write_folder
from helpers import CALIBRATION_COLUMNS, adapt_args, bench, bench_args, unless_given

from cafa_cli.artifact.store import read_artifact
from cafa_cli.core.errors import UsageError
from cafa_cli.data.fashion_mnist import DEFAULT_ROOT
from cafa_cli.jobs.bench.rows import Row, parse_methods
from cafa_cli.jobs.bench.runs import row_config
from cafa_cli.jobs.bench.tables import domain_label, domain_labels, markdown, summarise
from cafa_cli.jobs.config import BenchConfig
from cafa_cli.jobs.shared.results import DomainResult
from cafa_cli.model.checkpoints import sha256_of

needs_fashion_mnist = pytest.mark.skipif(
    not DEFAULT_ROOT.is_dir(), reason="Debian's dataset-fashion-mnist is not installed"
)


def test_parse_methods_knows_variants_and_per_row_learning_rates():
    rows = parse_methods(
        "source, tent@0.01, cafa, intra, cafa-tied,cafa-diag@1e-3,cafa-lowrank,cafa-dense,cafa-full@0.01"
    )
    assert rows == [
        Row("source", "source", None),
        Row("tent@0.01", "tent", None, 0.01),
        Row("cafa", "cafa", "auto"),  # as cafa stats by default: low-rank when classes have N_c < d
        Row("intra", "intra", "auto"),
        Row("cafa-tied", "cafa", "tied"),
        Row("cafa-diag@1e-3", "cafa", "diag", 1e-3),
        Row("cafa-lowrank", "cafa", "lowrank"),
        Row("cafa-dense", "cafa", "full"),
        Row("cafa-full@0.01", "cafa", "auto", 0.01, "all"),  # the paper's CAFA-Full: every feature-extractor parameter
    ]
    base = BenchConfig(lr=1e-3, params="norm", momentum=0.5)
    full, tent = row_config(base, rows[-1], 0, None, None), row_config(base, rows[1], 0, None, None)
    assert (full.method, full.lr, full.params, full.momentum) == ("cafa", 0.01, "all", 0.5)
    assert (tent.method, tent.lr, tent.params, tent.momentum) == ("tent", 0.01, "norm", 0.5)
    with pytest.raises(UsageError, match="unknown method 'sgd'"):
        parse_methods("tent,sgd")
    with pytest.raises(UsageError, match="not a number"):
        parse_methods("tent@fast")
    with pytest.raises(UsageError, match="names tent twice"):  # it would run twice and fill one line
        parse_methods("tent,bn,tent")
    with pytest.raises(UsageError, match=r"give the learning rate after @ \(e.g. cafa@0.001\)"):
        parse_methods("cafa@")
    assert len(parse_methods("tent,tent@0.01")) == 2  # two learning rates: two rows
    assert BenchConfig(seeds="0, 1,2").seed_list() == [0, 1, 2]


def test_domain_labels_follow_the_imagenet_c_layout():
    assert domain_label("ImageNet-C/fog/5") == "fog"
    assert domain_label("data/CIFAR-10-C/fog.npy") == "fog"
    assert domain_label("test-folder") == "test-folder"


def test_domain_labels_grow_until_they_differ(tmp_path):
    assert domain_labels(["x/fog/3", "x/snow/3"]) == {"x/fog/3": "fog", "x/snow/3": "snow", "mean": "mean"}
    assert domain_labels(["x/fog/3", "x/fog/5", "x/snow/3"]) == {
        "x/fog/3": "fog/3",
        "x/fog/5": "fog/5",
        "x/snow/3": "snow",
        "mean": "mean",
    }
    assert domain_labels(["a/fog/3", "b/fog/3"])["b/fog/3"] == "b/fog/3"
    # links are not followed: the columns are named as the user named the folders
    (tmp_path / "exp").mkdir()
    for name, run in (("baseline", "run-7f3a"), ("ours", "run-91bc")):
        (tmp_path / "store" / run / "fog").mkdir(parents=True)
        (tmp_path / "exp" / name).symlink_to(tmp_path / "store" / run)
    domains = [str(tmp_path / "exp" / name / "fog") for name in ("baseline", "ours")]
    assert [domain_labels(domains)[d] for d in domains] == ["baseline/fog", "ours/fog"]
    # a folder named `mean` must not share the column of the average
    assert domain_labels(["x/fog", "x/mean"]) == {"x/fog": "fog", "x/mean": "x/mean", "mean": "mean"}


def test_bad_seeds_are_usage_errors():
    with pytest.raises(UsageError, match=r"`seeds` must be 0 or more and below 2\*\*63, not -1"):
        BenchConfig(seeds="0,-1")
    with pytest.raises(UsageError, match="names a seed twice"):
        BenchConfig(seeds="1,1")
    with pytest.raises(UsageError, match="must be a positive number"):
        parse_methods("tent@nan")


def one_error_line(result, code: int, needle: str) -> None:
    assert result.exit_code == code, result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and needle in result.stderr, result.stderr
    assert result.stdout == ""


def test_bench_checks_its_outputs_domains_and_workdir_before_running(tmp_path):
    domain = write_folder(tmp_path / "test", per_class=4)

    def bench_with(*extra):
        """bench with `extra`; an option in `extra` replaces the default one (an option is taken once)."""
        kept = unless_given(["--methods", "source", "--workdir", str(tmp_path / "w")], extra)
        return invoke(*bench_args(domain), *kept, *extra)

    for flag in ("--csv", "--metrics-json", "--plot"):
        one_error_line(bench_with(flag, str(tmp_path / "nope" / "r")), 3, "does not exist")
    one_error_line(bench_with(str(domain)), 2, "is given twice")
    one_error_line(bench_with(f"{domain}/"), 2, "is given twice")  # the same folder, written otherwise
    one_error_line(
        bench_with("--methods", "cafa", "--train", str(domain), "--severity", "5"),
        2,
        "--severity is only for .npy arrays",
    )  # before the statistics are computed
    one_error_line(bench_with("--optimizer", "lbfgs"), 2, "--optimizer")
    one_error_line(
        bench_with("--methods", "cafa", "--train", str(tmp_path / "nope")),
        3,
        f"--train {tmp_path / 'nope'}: no such",
    )
    one_error_line(bench_with("--weights", str(tmp_path / "nope.pt")), 3, "--weights")
    for option in ("--forgetting", "--source-data", "--clean"):  # named as theirs, before the statistics
        one_error_line(
            bench_with("--methods", "cafa", "--train", str(domain), option, str(tmp_path / "nope")),
            3,
            f"{option} {tmp_path / 'nope'}: no such",
        )
    flat = tmp_path / "flat"
    flat.mkdir()
    for image in (domain / "a").glob("*.png"):
        (flat / image.name).write_bytes(image.read_bytes())
    one_error_line(
        bench_with(str(flat), "--methods", "cafa", "--train", str(domain)),
        3,
        f"{flat}: no labels, so no error to benchmark",
    )  # before the statistics
    assert not (tmp_path / "w").exists()  # nothing made for a run that cannot start
    (tmp_path / "file").write_text("")
    one_error_line(bench_with("--workdir", str(tmp_path / "file")), 3, "--workdir")
    # source and bn need no statistics, so no --train either
    ok = bench_with("--methods", "source,bn")
    assert ok.exit_code == 0, ok.stderr
    assert ok.stdout.startswith("| method | test | mean |")
    kept = tmp_path / "w" / "stats-auto.safetensors"
    kept.write_text("an artifact bench keeps")
    one_error_line(bench_with("--metrics-json", str(kept)), 2, "is a file inside an input folder")
    assert kept.read_text() == "an artifact bench keeps"


@pytest.mark.parametrize(
    "args,code,needle",
    [
        (["--severity", "6"], 2, "--severity must be 1-5, not 6"),
        (["--test-per-class", "-1", "--data-only"], 2, "--test-per-class must be 0 (all) or more"),
        (["--test-per-class", "-1"], 2, "--test-per-class must be 0 (all) or more"),  # not after the training images
        (["--methods", "cafa,magic"], 2, "unknown method 'magic'"),
        (["--corruptions", "fog,rain"], 2, "unknown corruption 'rain'"),
        (["--corruptions", "fog,fog", "--data-only"], 2, "--corruptions names fog twice"),
        (["--methods", "magic", "--data-only"], 2, "unknown method 'magic'"),
        (["--fashion-mnist", "/nonexistent"], 3, "Fashion-MNIST not found"),
        (["--severities", "1,2"], 2, "--severities builds the test folders of several severities, with --data-only"),
        (["--severities", "1,7", "--data-only"], 2, "--severities: a severity is 1-5, not 7"),
        (["--severities", "2,2", "--data-only"], 2, "--severities names 2 twice"),
    ],
)
def test_demo_rejects_bad_options_before_building_anything(tmp_path, args, code, needle):
    pytest.importorskip("corrupt_tta")
    result = invoke("demo", "--workdir", str(tmp_path / "demo"), *args)
    one_error_line(result, code, needle)
    assert not (tmp_path / "demo").exists()


def test_summary_is_mean_and_std_over_seeds_and_the_mean_column_averages_domains():
    rows = parse_methods("bn,cafa")
    errors = {
        ("bn", "a/1", 0): 0.2,
        ("bn", "a/1", 1): 0.4,
        ("bn", "b/1", 0): 0.1,
        ("bn", "b/1", 1): 0.1,
        ("cafa", "a/1", 0): 0.1,
        ("cafa", "a/1", 1): 0.1,
        ("cafa", "b/1", 0): 0.1,
        ("cafa", "b/1", 1): 0.1,
    }
    results = {key: DomainResult(key[1], n=10, labelled=10, errors=round(10 * error)) for key, error in errors.items()}
    table = summarise(results, rows, ["a/1", "b/1"], [0, 1])
    bn = table[0]["cells"]
    assert bn["a/1"] == pytest.approx((30.0, np.std([20, 40], ddof=1)))
    assert bn["mean"][0] == pytest.approx(20.0)  # mean over seeds of (mean over domains)
    text = markdown(table, ["a/1", "b/1"], [0, 1])
    assert text.splitlines()[0] == "| method | a | b | mean |"
    assert "| cafa | 10.00 ± 0.00 | 10.00 ± 0.00 | **10.00 ± 0.00** |" in text


def test_corruption_is_reproducible_and_changes_the_images():
    pytest.importorskip("corrupt_tta")
    from cafa_cli.data.fmnist_c import corrupt_grey

    images = np.random.default_rng(0).integers(0, 255, size=(4, 28, 28), dtype=np.uint8)
    first = corrupt_grey(images, "gaussian_noise", 3, seed=5)
    assert first.dtype == np.uint8 and first.shape == images.shape
    assert np.array_equal(first, corrupt_grey(images, "gaussian_noise", 3, seed=5))
    assert not np.array_equal(first, images)
    with pytest.raises(UsageError, match="unknown corruption"):
        corrupt_grey(images, "rain", 3, seed=0)


@needs_fashion_mnist
def test_demo_builds_real_folders_runs_and_reuses_them(tmp_path, monkeypatch):
    pytest.importorskip("corrupt_tta")
    monkeypatch.chdir(tmp_path)  # the default workdir is relative: re-use must see through that
    args = [
        "demo",
        "--workdir",
        "demo",
        "--corruptions",
        "contrast,fog",
        "--test-per-class",
        "20",
        "--methods",
        "source,bn,cafa,cafa-tied@0.01,cafa-full",
        "--train-per-class",
        "30",  # the statistics' images (300 by default): what is checked here holds for any number
    ]
    result = invoke(*args)
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "| method | contrast | fog | mean |"
    assert [line.split("|")[1].strip() for line in lines[2:]] == ["source", "bn", "cafa", "cafa-tied@0.01", "cafa-full"]
    assert "$ cafa stats --model fmnist-resnet" in result.stderr and "$ cafa adapt --stats" in result.stderr
    tied = next(line for line in result.stderr.splitlines() if "--stats demo/stats-tied.safetensors" in line)
    assert "--method cafa" in tied and "--lr 0.01" in tied  # the row's own learning rate, as it ran
    adapt_lines = [line for line in result.stderr.splitlines() if "$ cafa adapt" in line]
    assert ["--params all" in line for line in adapt_lines] == [
        False,
        False,
        False,
        False,
        True,
    ]  # CAFA-Full, as it ran
    assert "--covariance tied --out demo/stats-tied.safetensors" in result.stderr
    pngs = list((tmp_path / "demo" / "fashion-mnist-c-20" / "fog" / "3").rglob("*.png"))
    assert len(pngs) == 200
    stamp = pngs[0].stat().st_mtime_ns
    again = invoke(*args)
    assert again.exit_code == 0 and again.stdout == result.stdout  # same numbers, data not rebuilt
    assert pngs[0].stat().st_mtime_ns == stamp
    assert "corrupting" not in again.stderr
    assert "computing statistics (--covariance tied)" in result.stderr and "computing" not in again.stderr


@needs_fashion_mnist
def test_demo_data_only_builds_every_severity_asked_for(tmp_path):
    """The folders cafa bench imagenet-c:ROOT --severities reads, at each severity."""
    pytest.importorskip("corrupt_tta")
    args = ["demo", "--data-only", "--workdir", str(tmp_path), "--corruptions", "contrast", "--test-per-class", "2"]
    result = invoke(*args, "--severities", "1,5")
    assert result.exit_code == 0, result.stderr
    root = tmp_path / "fashion-mnist-c-2"
    assert result.stdout.splitlines() == [str(root / "contrast" / "1"), str(root / "contrast" / "5")]
    assert "corrupting: contrast/1" in result.stderr
    mild, harsh = (sorted((root / "contrast" / s).rglob("*.png")) for s in ("1", "5"))
    assert len(mild) == len(harsh) == 20 and mild[0].read_bytes() != harsh[0].read_bytes()
    alone = invoke(*args, "--severity", "5")  # the folder a single severity builds, re-used
    assert (
        alone.exit_code == 0
        and alone.stdout.splitlines() == [str(root / "contrast" / "5")]
        and "corrupting" not in alone.stderr
    )


@pytest.fixture(scope="module")
def contrast_domain(tmp_path_factory) -> str:
    """The demo's contrast domain, 20 Fashion-MNIST-C images a class, built once for the bench runs that read it."""
    if not DEFAULT_ROOT.is_dir():
        pytest.skip("Debian's dataset-fashion-mnist is not installed")
    pytest.importorskip("corrupt_tta")
    workdir = tmp_path_factory.mktemp("demo")
    built = invoke("demo", "--workdir", workdir, "--data-only", "--corruptions", "contrast", "--test-per-class", "20")
    assert built.exit_code == 0, built.stderr
    return built.stdout.strip()


def test_bench_writes_consistent_markdown_csv_json_and_plot(tmp_path, contrast_domain):
    pytest.importorskip("matplotlib")
    domain = contrast_domain
    out = {k: tmp_path / f"r.{k}" for k in ("csv", "json", "png")}
    result = bench(
        domain,
        model=None,  # the bundled model, with its own preprocessing
        preprocessing=(),
        methods="source,cafa-diag",
        seeds="0,1",
        per_class=20,
        workdir=tmp_path / "art",
        csv=out["csv"],
        metrics_json=out["json"],
        plot=out["png"],
    )
    assert result.exit_code == 0, result.stderr
    report = json.loads(out["json"].read_text())
    runs = {(r["method"], r["seed"]): r["error"] for r in report["runs"]}
    assert set(runs) == {("source", 0), ("source", 1), ("cafa-diag", 0), ("cafa-diag", 1)}
    assert runs[("source", 0)] == runs[("source", 1)]  # no adaptation: the order does not matter
    rows = list(csv.DictReader(out["csv"].open()))
    source_mean = next(r for r in rows if r["method"] == "source" and r["domain"] == "mean")
    assert float(source_mean["error_mean_percent"]) == pytest.approx(100 * runs[("source", 0)], abs=1e-3)
    assert f"{100 * runs[('source', 0)]:.2f} ± 0.00" in result.stdout
    assert out["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "art" / "stats-diag.safetensors").is_file() and not (
        tmp_path / "art" / "stats-auto.safetensors"
    ).exists()


def test_bench_preprocesses_test_domains_on_their_own_and_recomputes_for_new_training_geometry(
    tmp_path, contrast_domain
):
    """ImageNet-C's case: statistics from resized + cropped training images, test images
    stored already cropped, so the test side must not be resized again."""
    domain = contrast_domain
    report = tmp_path / "r.json"
    common = bench_args(  # the bundled model, with its own preprocessing
        domain,
        model=None,
        preprocessing=(),
        methods="source,cafa-diag",
        per_class=20,
        workdir=tmp_path / "art",
        metrics_json=report,
    )
    result = invoke(*common, "--resize", "32", "--crop", "28", "--test-resize", "none", "--test-crop", "none")
    assert result.exit_code == 0, result.stderr
    used = json.loads(report.read_text())["settings"]["preprocessing"]
    assert (used["train"]["resize"], used["train"]["crop"]) == (32, 28)
    assert (used["test"]["resize"], used["test"]["crop"]) == (None, None)
    assert used["test"]["mean"] == used["train"]["mean"]  # only the geometry was split
    artifact = read_artifact(tmp_path / "art" / "stats-diag.safetensors", load_tensors=False)
    assert (artifact.preprocessing.resize, artifact.preprocessing.crop) == (32, 28)
    source_error = json.loads(report.read_text())["runs"][0]["error"]
    alone = invoke(
        *adapt_args(
            domain,
            model="fmnist-resnet",
            preprocessing=(),
            method="source",
            quiet=True,
            metrics_json=tmp_path / "m.json",
        )
    )
    assert alone.exit_code == 0, alone.stderr
    assert json.loads((tmp_path / "m.json").read_text())["domains"][0]["error"] == pytest.approx(source_error)

    again = invoke(*common)  # the bundled model's own geometry: new statistics
    assert again.exit_code == 0, again.stderr
    assert "computing statistics (--covariance diag)" in again.stderr
    artifact = read_artifact(tmp_path / "art" / "stats-diag.safetensors", load_tensors=False)
    assert (artifact.preprocessing.resize, artifact.preprocessing.crop) == (None, None)


def test_run_grid_gives_each_rank_every_world_th_run(monkeypatch):
    from types import SimpleNamespace

    from cafa_cli.jobs import bench
    from cafa_cli.jobs.shared.monitor import Monitor

    calls = []

    def fake_prepare(config, monitor=None):
        calls.append((config.method, config.seed))
        return SimpleNamespace(
            run=lambda monitor, warned: [SimpleNamespace(error=0.5) for _ in config.data],
            cautions=lambda: [],
            groups=None,
            clean=None,
            protocol={},
        )

    monkeypatch.setattr(bench, "prepare_adaptation", fake_prepare)
    config, rows = BenchConfig(data=["d"], model="m"), parse_methods("source,bn,tent")
    mine = bench.run_grid(config, rows, [0, 1], {}, None, Monitor(), rank=1, world=2)
    assert calls == [("source", 1), ("bn", 1), ("tent", 1)]  # runs 1, 3, 5 of (row, seed) in order
    assert set(mine) == {("source", "d", 1), ("bn", "d", 1), ("tent", "d", 1)}
    calls.clear()
    assert len(bench.run_grid(config, rows, [0, 1], {}, None, Monitor())) == 6 and len(calls) == 6


def test_statistics_run_on_the_benchs_device_batch_size_and_loader_processes(tmp_path, monkeypatch):
    from cafa_cli.jobs.bench import statistics
    from cafa_cli.jobs.shared.monitor import Monitor

    seen = {}
    monkeypatch.setattr(statistics, "compute_statistics", lambda config, monitor: seen.update(vars(config)))
    config = BenchConfig(
        batch_size=7, device="cpu", num_workers=1, model="m", train="train", per_class=5, workdir=str(tmp_path)
    )
    path = statistics.ensure_statistics(config, "tied", Monitor())
    assert path == tmp_path / "stats-tied.safetensors"
    assert {k: seen[k] for k in ("device", "batch_size", "num_workers", "per_class", "covariance", "data")} == {
        "device": "cpu",
        "batch_size": 7,
        "num_workers": 1,
        "per_class": 5,
        "covariance": "tied",
        "data": "train",
    }


def test_bench_without_domains_is_a_usage_error():
    result = invoke("bench", "--methods", "source")
    assert result.exit_code == 2
    assert (
        result.stderr.strip() == "cafa: error: give the test domains: cafa bench DOMAIN... (or --data DOMAIN, repeated)"
    )


def test_bench_recomputes_statistics_for_another_class_list(tmp_path, tiny_weights):
    train = write_folder(tmp_path / "train", per_class=6)
    test = write_folder(tmp_path / "test", per_class=2, seed=1)
    orders = {}
    for name, order in (("abc", "a\nb\nc\n"), ("cab", "c\na\nb\n")):
        orders[name] = tmp_path / f"{name}.txt"
        orders[name].write_text(order)

    def computed(classes: str) -> bool:
        result = bench(
            test,
            methods="cafa-diag",
            weights=tiny_weights,
            train=train,
            per_class=6,
            workdir=tmp_path / "w",
            classes=orders[classes],
        )
        assert result.exit_code == 0, result.stderr
        return "computing statistics (--covariance diag)" in result.stderr

    assert computed("abc") and not computed("abc")
    assert computed("cab") and not computed("cab")


@pytest.mark.parametrize("methods", ["source,cafa-diag", "source,bn"])
def test_rows_without_statistics_read_labels_in_the_training_order(tmp_path, tiny_weights, methods):
    """A test domain without class b: its folders, sorted, would make c label 1. Every row
    takes the training data's class list (written to the workdir), with statistics or not."""
    train = write_folder(tmp_path / "train", per_class=6)
    test = write_folder(tmp_path / "test", per_class=4, seed=1, classes=("a", "c"))
    report = tmp_path / "r.json"
    result = bench(
        test,
        methods=methods,
        weights=tiny_weights,
        train=train,
        per_class=6,
        workdir=tmp_path / "w",
        metrics_json=report,
    )
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "w" / "classes.txt").read_text() == "a\nb\nc\n"
    order = tmp_path / "order.txt"
    order.write_text("a\nb\nc\n")
    alone = invoke(
        *adapt_args(
            test, method="source", weights=tiny_weights, classes=order, quiet=True, metrics_json=tmp_path / "m.json"
        )
    )
    assert alone.exit_code == 0, alone.stderr
    source = next(r["error"] for r in json.loads(report.read_text())["runs"] if r["method"] == "source")
    assert source == pytest.approx(json.loads((tmp_path / "m.json").read_text())["domains"][0]["error"])


def test_a_flat_training_folder_gives_no_class_list_to_rows_without_statistics(tmp_path, tiny_weights):
    """`--train` without class folders is only a problem for rows that need statistics."""
    flat = tmp_path / "flat"
    flat.mkdir()
    for image in (write_folder(tmp_path / "src", per_class=2) / "a").iterdir():
        image.rename(flat / image.name)
    test = write_folder(tmp_path / "test", per_class=4, seed=1)
    result = bench(test, methods="source,bn", weights=tiny_weights, train=flat, workdir=tmp_path / "w")
    assert result.exit_code == 0, result.stderr
    assert not (tmp_path / "w" / "classes.txt").exists()
    table = result.stdout.splitlines()  # both rows ran and have an error, with no class list written for them
    assert table[0] == "| method | test | mean |" and [line.split(" | ")[0] for line in table[2:]] == [
        "| source",
        "| bn",
    ]
    assert all(re.fullmatch(r"\| \w+ \| \d+\.\d\d \| \*\*\d+\.\d\d\*\* \|", line) for line in table[2:]), table


def test_bench_passes_the_adapt_options_to_every_row_and_records_what_ran(tmp_path, tiny_weights):
    """A bench cell is the cafa adapt run with the same options; the JSON says which options those were."""
    test = write_folder(tmp_path / "test", per_class=4, seed=1, shift=0.3)
    shared = dict(
        weights=tiny_weights,
        optimizer="sgd",
        momentum=0.5,
        params="all",
        norm="prior:4",
        reset="episodic",
        batch_size=5,
    )
    report = tmp_path / "r.json"
    result = bench(test, methods="tent@0.05", **shared, device="cpu", workdir=tmp_path / "w", metrics_json=report)
    assert result.exit_code == 0, result.stderr
    alone = invoke(*adapt_args(test, method="tent", lr=0.05, **shared, quiet=True, metrics_json=tmp_path / "m.json"))
    assert alone.exit_code == 0, alone.stderr
    saved = json.loads(report.read_text())
    metrics = json.loads((tmp_path / "m.json").read_text())
    run = saved["runs"][0]
    assert run["error"] == pytest.approx(metrics["error"])
    assert {k: run[k] for k in ("method", "seed", "n", "labelled", "skipped_images")} == {
        "method": "tent@0.05",
        "seed": 0,
        "n": metrics["n"],
        "labelled": 12,
        "skipped_images": 0,
    }
    assert saved["settings"]["weights_sha256"] == metrics["settings"]["weights_sha256"] == sha256_of(tiny_weights)
    assert saved["artifacts"] == {}
    assert saved["rows"] == [
        {
            "label": "tent@0.05",
            "method": "tent",
            "covariance": None,
            "covariance_used": None,
            "order": "iid",
            "recipe": {"requested": "auto", "name": None},
            "optimizer": "sgd",
            "lr": 0.05,
            "momentum": 0.5,
            "batch_size": 5,
            "steps": 1,
            "params": "all",
            "norm": "prior:4",
            "fisher_samples": 2000,
            "source_data": None,
            "reset": "episodic",
            "stream_rate": "inf",
            "step_cost": "table",
            "outliers": None,
            "method_options": {"entropy": "shannon"},
        }
    ]
    assert [saved["rows"][0][k] for k in ("optimizer", "lr", "momentum", "batch_size", "params")] == [
        metrics["settings"][k] for k in ("optimizer", "lr", "momentum", "batch_size", "params")
    ]
    used = saved["settings"]
    assert "method" not in used and "seed" not in used  # each row and run names its own
    assert {k: used[k] for k in ("optimizer", "momentum", "params", "norm", "reset", "device", "num_workers")} == {
        "optimizer": "sgd",
        "momentum": 0.5,
        "params": "all",
        "norm": "prior:4",
        "reset": "episodic",
        "device": "cpu",
        "num_workers": 0,
    }


def test_bench_shrinkage_reaches_the_statistics_and_their_reuse_check(tmp_path, tiny_weights):
    train = write_folder(tmp_path / "train", per_class=6)
    test = write_folder(tmp_path / "test", per_class=2, seed=1)
    base = bench_args(test, weights=tiny_weights, train=train, per_class=6)

    def computed(*args: str) -> bool:
        result = invoke(*base, "--methods", "cafa-diag", "--workdir", tmp_path / "w", *args)
        assert result.exit_code == 0, result.stderr
        return "computing statistics (--covariance diag)" in result.stderr

    assert computed("--shrinkage", "0.25") and not computed("--shrinkage", "0.25")
    shrink = json.loads(
        read_artifact(tmp_path / "w" / "stats-diag.safetensors", load_tensors=False).metadata["shrinkage"]
    )
    assert (shrink["method"], shrink["min"], shrink["max"]) == ("fixed", pytest.approx(0.25), pytest.approx(0.25))
    assert computed("--shrinkage", "0.5") and computed() and not computed("--shrinkage", "auto")
    result = invoke(*base, "--methods", "cafa-lowrank", "--shrinkage", "0", "--workdir", tmp_path / "x")
    one_error_line(result, 2, "--covariance lowrank needs shrinkage")
    assert not (tmp_path / "x").exists()


def test_bench_recomputes_statistics_when_the_training_folder_holds_other_images(tmp_path, tiny_weights):
    train = write_folder(tmp_path / "train", per_class=4)
    test = write_folder(tmp_path / "test", per_class=2, seed=1)

    def computed() -> bool:
        result = bench(test, methods="cafa-diag", weights=tiny_weights, train=train, fraction=1, workdir=tmp_path / "w")
        assert result.exit_code == 0, result.stderr
        return "computing statistics (--covariance diag)" in result.stderr

    assert computed() and not computed()
    write_folder(tmp_path / "more", per_class=2, seed=5)
    for image in (tmp_path / "more" / "a").iterdir():  # the same path, fraction and seed: only the sample differs
        image.rename(train / "a" / f"new-{image.name}")
    assert computed()
    assert read_artifact(tmp_path / "w" / "stats-diag.safetensors").gaussians.counts.tolist() == [6, 4, 4]
    assert not computed()


def test_every_run_gets_its_rows_method_lr_and_params_over_the_shared_options(monkeypatch):
    from types import SimpleNamespace

    from cafa_cli.jobs import bench
    from cafa_cli.jobs.shared.monitor import Monitor

    ran = []

    def fake_prepare(config, monitor=None):
        ran.append((config.stats, config))
        return SimpleNamespace(
            run=lambda monitor, warned: [SimpleNamespace(error=0.5) for _ in config.data],
            cautions=lambda: [],
            groups=None,
            clean=None,
            protocol={},
        )

    monkeypatch.setattr(bench, "prepare_adaptation", fake_prepare)
    shared = BenchConfig(
        data=["d"], model="m", optimizer="sgd", momentum=0.5, norm="prior:4", reset="episodic", lr=1e-3
    )
    bench.run_grid(
        shared,
        parse_methods("tent@0.05,cafa-full,cafa-dense"),
        [3],
        {("auto", None): Path("a"), ("full", None): Path("f")},
        None,
        Monitor(),
    )
    assert [(stats, s.method, s.lr, s.params, s.seed) for stats, s in ran] == [
        (None, "tent", 0.05, "norm", 3),
        ("a", "cafa", 1e-3, "all", 3),
        ("f", "cafa", 1e-3, "norm", 3),
    ]
    assert all((s.optimizer, s.momentum, str(s.norm), s.reset) == ("sgd", 0.5, "prior:4", "episodic") for _, s in ran)


def test_a_class_folder_whose_name_is_not_utf8_is_named(tmp_path, tiny_weights):
    import os

    train = write_folder(tmp_path / "train", per_class=6, classes=("a", "b", os.fsdecode(b"caf\xe9")))
    shared = dict(weights=tiny_weights, train=train, per_class=6, workdir=tmp_path / "w")
    result = bench(train, methods="source,cafa-diag", **shared)
    assert result.exit_code == 3 and "cannot go into the class list file" in result.stderr, result.stderr
    only_statistics = bench(train, methods="cafa-diag", **shared)
    assert only_statistics.exit_code == 0, only_statistics.stderr  # no row reads the file


def test_bench_reuses_statistics_for_the_same_parameters_in_another_file(tmp_path, tiny_weights):
    import shutil

    train = write_folder(tmp_path / "train", per_class=6)
    test = write_folder(tmp_path / "test", per_class=2, seed=1)
    weights = tmp_path / "w.pt"
    shutil.copy(tiny_weights, weights)

    def computed(path) -> bool:
        result = bench(test, methods="cafa-diag", weights=path, train=train, per_class=6, workdir=tmp_path / "w")
        assert result.exit_code == 0, result.stderr
        return "computing statistics" in result.stderr

    assert computed(weights)
    resaved = tmp_path / "resaved.pt"
    torch.save({"state_dict": torch.load(weights)}, resaved)
    assert not computed(resaved)  # the same parameters in another file
    state = torch.load(weights)
    state["head.3.bias"] = state["head.3.bias"] + 1
    torch.save(state, weights)
    assert computed(weights)  # the file changed in place


def test_bench_json_says_which_covariance_form_auto_chose(tmp_path, tiny_weights):
    """Fewer images per class (4) than feature dimensions (6): auto stores the low-rank form."""
    train = write_folder(tmp_path / "train", per_class=4)
    test = write_folder(tmp_path / "test", per_class=2, seed=1)
    report = tmp_path / "r.json"
    result = bench(
        test,
        methods="cafa,cafa-diag",
        weights=tiny_weights,
        train=train,
        per_class=4,
        workdir=tmp_path / "w",
        metrics_json=report,
    )
    assert result.exit_code == 0, result.stderr
    saved = json.loads(report.read_text())
    assert [(r["covariance"], r["covariance_used"]) for r in saved["rows"]] == [("auto", "lowrank"), ("diag", "diag")]
    for covariance, form in (("auto", "lowrank"), ("diag", "diag")):  # each artifact by its content
        path = tmp_path / "w" / f"stats-{covariance}.safetensors"
        assert saved["artifacts"][covariance] == {
            "path": str(path.resolve()),
            "sha256": sha256_of(path),
            "covariance": form,
            "created": read_artifact(path, load_tensors=False).metadata["created"],
            "parameters_sha256": read_artifact(path, load_tensors=False).metadata["parameters_sha256"],
        }


def test_bench_reads_a_checkpoint_with_python_objects_only_when_trusted(tmp_path, tiny_weights):
    import argparse

    train = write_folder(tmp_path / "train", per_class=6)
    test = write_folder(tmp_path / "test", per_class=2, seed=1)
    weights = tmp_path / "w.pt"
    torch.save({"state_dict": torch.load(tiny_weights), "args": argparse.Namespace(lr=0.1)}, weights)
    args = bench_args(test, methods="bn,cafa-diag", weights=weights, train=train, per_class=6, workdir=tmp_path / "w")
    refused = invoke(*args)
    assert refused.exit_code == 3 and refused.stdout == ""
    assert "--trust-checkpoint" in refused.stderr.strip().splitlines()[-1]
    trusted = invoke(*args, "--trust-checkpoint")
    assert trusted.exit_code == 0, trusted.stderr
    assert "| cafa-diag |" in trusted.stdout


def test_each_rows_warnings_are_shown_once_whichever_row_runs_first(tmp_path, tiny_weights):
    """The first run's warnings were the only ones: tent's 'fits in one batch' never showed after source."""
    test = write_folder(tmp_path / "test", per_class=3)
    result = bench(test, methods="source,tent", seeds="0,1", weights=tiny_weights, workdir=tmp_path / "w")
    assert result.exit_code == 0, result.stderr
    assert result.stderr.count("predicted before any update: tent cannot differ from bn there") == 1


def test_an_interrupted_domain_build_leaves_no_half_folder(tmp_path, monkeypatch):
    """A `.partial` folder left by Ctrl-C would be picked up by a glob such as W/*/*/* as a domain."""
    from PIL import Image

    from cafa_cli.data import fmnist_c

    saved = []

    def save_then_interrupt(self, path, *args, **kwargs):
        if len(saved) == 3:
            raise KeyboardInterrupt
        saved.append(path)
        Path(path).write_bytes(b"")

    monkeypatch.setattr(Image.Image, "save", save_then_interrupt)
    images, labels = np.zeros((10, 28, 28), np.uint8), np.arange(10)
    with pytest.raises(KeyboardInterrupt):
        fmnist_c.write_image_folder(tmp_path / "fog" / "3", images, labels)
    assert len(saved) == 3 and list((tmp_path / "fog").iterdir()) == []


def test_the_progress_bar_leaves_stdout_to_the_data(capsys):
    """With a live bar on a terminal, rich would send print() to stderr: demo --data-only's paths would miss the pipe."""
    import io

    from rich.console import Console

    from cafa_cli.jobs.shared.monitor import progress_bar

    bar = progress_bar(Console(file=io.StringIO(), force_terminal=True))
    with bar:
        bar.add_task("x", total=1, rate="", status="")
        print("fashion-mnist-c/fog/3")
    assert capsys.readouterr().out == "fashion-mnist-c/fog/3\n"


# --- stream settings and the order / batch-size axes ---------------------------------------


@pytest.fixture
def trained_weights(trained, tmp_path) -> Path:
    """The tiny net trained on generated images (conftest's `trained`), as a weights file."""
    path = tmp_path / "trained.pt"
    torch.save(trained[0].model.state_dict(), path)
    return path


def test_grid_rows_run_every_method_under_every_condition_and_name_only_the_axes_given():
    from cafa_cli.jobs.bench.rows import grid_rows

    rows = parse_methods("tent,cafa")
    assert grid_rows(BenchConfig(), rows) == rows  # no axis: the table of earlier versions
    grid = grid_rows(BenchConfig(orders="iid,label-shift:1.0", batch_sizes="8,1"), rows)
    assert [r.label for r in grid] == [
        "tent, iid, batch 8",
        "cafa, iid, batch 8",
        "tent, iid, batch 1",
        "cafa, iid, batch 1",
        "tent, label-shift:1.0, batch 8",
        "cafa, label-shift:1.0, batch 8",
        "tent, label-shift:1.0, batch 1",
        "cafa, label-shift:1.0, batch 1",
    ]
    assert [(r.name, r.condition) for r in grid[:2]] == [("tent", "iid, batch 8"), ("cafa", "iid, batch 8")]
    config = BenchConfig(batch_sizes="4,2", batch_size=64)
    cells = [row_config(config, row, 0, None, None) for row in grid_rows(config, rows)]
    assert [(c.method, c.batch_size, c.order) for c in cells] == [
        ("tent", 4, "iid"),
        ("cafa", 4, "iid"),
        ("tent", 2, "iid"),
        ("cafa", 2, "iid"),
    ]
    assert [r.label for r in grid_rows(BenchConfig(order="dirichlet:0.1", batch_sizes="2"), rows)] == [
        "tent, batch 2",
        "cafa, batch 2",
    ]


@pytest.mark.parametrize(
    "options, needle",
    [
        ({"orders": "iid,sorted"}, "`orders` must be iid, label-shift:S"),
        ({"orders": "iid,iid"}, "`orders` names iid twice"),
        (
            {"orders": "label-shift:1,dirichlet:0.1,label-shift:1.0"},
            "`orders` names one order twice (label-shift:1, label-shift:1.0)",
        ),
        ({"orders": " , "}, "`orders` names no value"),
        ({"orders": "iid", "order": "label-shift:1"}, "`order` label-shift:1 and `orders` iid both say"),
        ({"batch_sizes": "1,x"}, "`batch_sizes` takes comma-separated whole numbers"),
        ({"batch_sizes": "0"}, "`batch_size` must be a whole number, at least 1"),
        ({"batch_sizes": "2,02"}, "`batch_sizes` names a batch size twice"),
        ({"severities": "1,x"}, "`severities` takes comma-separated whole numbers 1-5"),
        ({"severities": "0,5"}, "`severities`: a severity is 1-5, not 0"),
        ({"severities": "3,03"}, "`severities` names a severity twice"),
        ({"severities": "3", "severity": 5}, "`severity` 5 and `severities` 3 both say which severities to run"),
        (
            {"severities": "3", "gradual": True},
            "`severities` 3 runs each severity apart, and `gradual` visits all five",
        ),
    ],
)
def test_bad_grid_axes_are_usage_errors(options, needle):
    with pytest.raises(UsageError, match=re.escape(needle)):
        BenchConfig(**options)


def test_bench_axes_make_the_papers_condition_table_with_csv_json_and_plot(tmp_path, trained_weights):
    """One command, a table per condition and method as the paper's, the long table beside it."""
    pytest.importorskip("matplotlib")
    test = write_folder(tmp_path / "test", per_class=6, seed=1, shift=0.3)
    out = {k: tmp_path / f"r.{k}" for k in ("csv", "json", "png")}
    result = bench(
        test,
        methods="source,bn",
        weights=trained_weights,
        orders="iid,label-shift:1.0",
        batch_sizes="6,3",
        seeds="0,1",
        workdir=tmp_path / "w",
        csv=out["csv"],
        metrics_json=out["json"],
        plot=out["png"],
    )
    assert result.exit_code == 0, result.stderr
    long_table, by_condition = result.stdout.strip().split("\n\n")
    assert len(long_table.splitlines()) == 2 + 8 and "| bn, label-shift:1.0, batch 3 |" in long_table
    lines = by_condition.splitlines()
    assert lines[0] == "| condition | source | bn |"
    assert [line.split(" | ")[0] for line in lines[2:]] == [
        "| iid, batch 6",
        "| iid, batch 3",
        "| label-shift:1.0, batch 6",
        "| label-shift:1.0, batch 3",
    ]
    rows = list(csv.DictReader(out["csv"].open()))
    assert list(rows[0]) == [
        "method",
        "order",
        "batch_size",
        "domain",
        "error_mean_percent",
        "error_std_percent",
        *CALIBRATION_COLUMNS,
    ]
    means = {
        (r["method"], r["order"], r["batch_size"]): float(r["error_mean_percent"])
        for r in rows
        if r["domain"] == "mean"
    }
    assert (
        len(means) == 8 and len({v for (m, _, _), v in means.items() if m == "source"}) == 1
    )  # source: no batch statistics
    assert (
        means[("bn", "label-shift:1.0", "3")] != means[("bn", "iid", "3")]
    )  # batches of one class normalise otherwise
    report = json.loads(out["json"].read_text())
    assert {(r["order"], r["batch_size"]) for r in report["rows"]} == {
        ("iid", 6),
        ("iid", 3),
        ("label-shift:1.0", 6),
        ("label-shift:1.0", 3),
    }
    assert report["settings"]["orders"] == "iid,label-shift:1.0" and report["settings"]["batch_sizes"] == "6,3"
    assert report["settings"]["methods"] == "source,bn"  # the rows asked for, not each row under each condition
    assert len(report["runs"]) == 8 * 2
    assert out["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_runs_continual_across_domains_in_the_order_given_with_an_error_per_domain(tmp_path, trained_weights):
    mild = write_folder(tmp_path / "mild", per_class=6, seed=1, shift=0.2)
    harsh = write_folder(tmp_path / "harsh", per_class=6, seed=2, shift=0.7)
    base = bench_args(methods="tent@0.05", weights=trained_weights, batch_size=6, workdir=tmp_path / "w")

    def errors(*args: str) -> dict[str, float]:
        report = tmp_path / "r.json"
        result = invoke(*base, *args, "--metrics-json", str(report))
        assert result.exit_code == 0, result.stderr
        saved = json.loads(report.read_text())
        assert [d["label"] for d in saved["domains"]] == [
            Path(a).name for a in args if not a.startswith("-") and "/" in a
        ]
        return {Path(run["data"]).name: run["error"] for run in saved["runs"]}

    per_domain = errors(str(harsh), str(mild))
    continual = errors(str(harsh), str(mild), "--reset", "never")
    assert continual["harsh"] == per_domain["harsh"]  # the first domain starts from the source weights either way
    assert continual["mild"] != per_domain["mild"]  # the second carries the first's updates
    assert (
        errors(str(mild), str(harsh), "--reset", "never")["mild"] == per_domain["mild"]
    )  # the order given is the order run


def test_bench_mixes_domains_into_one_stream_and_still_reports_each(tmp_path, trained_weights):
    one = write_folder(tmp_path / "one", per_class=6, seed=1, shift=0.2)
    two = write_folder(tmp_path / "two", per_class=6, seed=2, shift=0.6)
    base = bench_args(one, two, weights=trained_weights, batch_size=6, workdir=tmp_path / "w")
    apart = invoke(*base, "--methods", "source")
    mixed = invoke(*base, "--methods", "source", "--mix-domains")
    assert apart.exit_code == mixed.exit_code == 0, mixed.stderr
    assert (
        mixed.stdout == apart.stdout and "| one | two | mean |" in mixed.stdout
    )  # source: per domain, the same errors
    bn_apart = invoke(*base, "--methods", "bn")
    bn_mixed = invoke(*base, "--methods", "bn", "--mix-domains")
    assert bn_apart.exit_code == bn_mixed.exit_code == 0, bn_mixed.stderr
    assert bn_mixed.stdout != bn_apart.stdout  # batches mix both domains' statistics
    for table in (bn_apart.stdout, bn_mixed.stdout):  # and each domain is still reported in its own column
        assert table.splitlines()[0] == "| method | one | two | mean |" and table.splitlines()[2].startswith("| bn | ")


def test_bench_gradual_reports_each_corruption_over_its_severity_visits(tmp_path, tiny_weights):
    for name in ("fog", "snow"):
        for severity in range(1, 6):
            write_folder(tmp_path / name / str(severity), per_class=2, seed=severity, shift=0.1 * severity)
    report = tmp_path / "r.json"
    result = bench(
        tmp_path / "fog" / "3",
        tmp_path / "snow",
        gradual=True,
        methods="bn",
        weights=tiny_weights,
        batch_size=3,
        workdir=tmp_path / "w",
        metrics_json=report,
    )
    assert result.exit_code == 0, result.stderr
    runs = json.loads(report.read_text())["runs"]
    assert [(Path(r["data"]).name, r["n"]) for r in runs] == [("3", 9 * 6), ("snow", 9 * 6)]
    twice = bench(tmp_path / "fog" / "3", tmp_path / "fog", gradual=True, methods="bn", workdir=tmp_path / "w")
    one_error_line(twice, 2, "is given twice")


def test_the_old_spelling_json_path_still_writes_the_record_with_a_warning(tmp_path, tiny_weights, capsys):
    """bench --json PATH is now --metrics-json PATH (as adapt's): the old spelling works for a
    release, on the command line and in cafa.toml, and says so in one line."""
    from cafa_cli.cli.app import command_options
    from cafa_cli.cli.defaults import read_defaults

    train = write_folder(tmp_path / "train", per_class=6)
    common = bench_args(train, methods="source", weights=tiny_weights, per_class=6, workdir=tmp_path / "w", quiet=True)
    old = invoke(*common, "--json", str(tmp_path / "old.json"))
    new = invoke(*common, f"--metrics-json={tmp_path / 'new.json'}")
    assert old.exit_code == new.exit_code == 0, old.stderr
    assert old.stderr.splitlines() == [
        "warning: --json is now --metrics-json; the old spelling goes in a later release"
    ]
    assert new.stderr == "" and old.stdout == new.stdout
    assert (
        json.loads((tmp_path / "old.json").read_text())["table"]
        == json.loads((tmp_path / "new.json").read_text())["table"]
    )
    (tmp_path / "cafa.toml").write_text('[bench]\njson = "t.json"\n')
    capsys.readouterr()
    defaults = read_defaults(tmp_path, command_options())
    assert defaults["bench"] == {"metrics_json": "t.json"}
    assert (
        capsys.readouterr().err == f"warning: {tmp_path / 'cafa.toml'}: [bench] json is now metrics-json; the old "
        f"spelling goes in a later release\n"
    )
