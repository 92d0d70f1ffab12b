"""The corruption benchmarks by name (`imagenet-c:ROOT`, `cifar10-c:ROOT`), RobustBench's
image-id subset (`--subset`) and the clean-set check (`--clean`), on small synthetic files
laid out as the real ones are."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import PLAIN, TINY_NET, class_images, invoke, write_folder
from helpers import CALIBRATION_COLUMNS, adapt, fails, make_cifar10, rows
from PIL import Image

from cafa_cli.core.errors import InputError, UsageError
from cafa_cli.data.benchmarks import CORRUPTIONS, expand_benchmarks
from cafa_cli.data.sources import open_domain

FOUND = ("gaussian_noise", "fog", "contrast")  # listed out of the benchmark's order: fog comes after gaussian_noise


@pytest.fixture
def imagenet_c(tmp_path) -> Path:
    """ROOT/<corruption>/<severity>/<class>/*.JPEG for 3 of the 15 corruptions, severities 3 and 5."""
    root = tmp_path / "ImageNet-C"
    for k, corruption in enumerate(reversed(FOUND)):
        for severity in (3, 5):
            write_folder(root / corruption / str(severity), per_class=3, seed=10 * k + severity, shift=0.1 * severity)
    return root


@pytest.fixture
def cifar10_c(tmp_path) -> Path:
    """ROOT/<corruption>.npy of 5 severities × 6 images and ROOT/labels.npy."""
    root = tmp_path / "CIFAR-10-C"
    root.mkdir()
    rng = np.random.default_rng(0)
    labels = np.tile(np.repeat(np.arange(3), 2), 5)
    np.save(root / "labels.npy", labels)
    for corruption in ("fog", "snow"):
        np.save(
            root / f"{corruption}.npy",
            np.concatenate([class_images(rng, int(label), 1, shift=0.05 * (i // 6)) for i, label in enumerate(labels)]),
        )
    return root


def test_imagenet_c_root_is_its_corruptions_in_the_benchmarks_order(imagenet_c):
    domains, notes = expand_benchmarks([f"imagenet-c:{imagenet_c}"])
    assert domains == [f"imagenet-c:{imagenet_c / c}" for c in ("gaussian_noise", "fog", "contrast")]
    assert len(notes) == 1 and "3 of the 15 corruptions found" in notes[0] and "shot_noise" in notes[0]
    assert len(CORRUPTIONS) == 15
    assert open_domain(domains[1]).name == str(imagenet_c / "fog" / "5")  # severity 5 by default
    assert open_domain(domains[1], severity=3).name == str(imagenet_c / "fog" / "3")
    assert expand_benchmarks([f"imagenet-c:{imagenet_c}/fog"])[0] == [f"imagenet-c:{imagenet_c}/fog"]


def test_imagenet_c_predicts_as_the_severity_folders_do(setup, imagenet_c):
    """The same predictions, preprocessing included, as the folders ROOT/<corruption>/<severity>."""
    for severity, extra in ((5, []), (3, ["--severity", "3"])):
        named = adapt(setup, f"imagenet-c:{imagenet_c}", *extra)
        assert named.exit_code == 0, named.stderr
        assert "recipe imagenet-c (auto, from the named benchmark) for cafa: optimizer sgd, lr 0.0025" in named.stderr
        folders = [str(imagenet_c / c / str(severity)) for c in ("gaussian_noise", "fog", "contrast")]
        plain = invoke(
            "adapt",
            "--stats",
            setup["artifact"],
            "--model",
            TINY_NET,
            *folders,
            "--batch-size",
            "4",
            "--quiet",
            "--recipe",
            "imagenet-c",
        )
        assert plain.exit_code == 0, plain.stderr
        assert named.stdout == plain.stdout
        assert {Path(row["path"]).parent.parent.name for row in rows(named)} == {str(severity)}
        assert "ImageNet-C's images are stored 224x224" not in named.stderr  # the artifact's resize and crop are none
    resized = adapt(setup, f"imagenet-c:{imagenet_c}", "--resize", "16", "--crop", "16")
    assert resized.exit_code == 0, resized.stderr
    assert (
        "already resized and cropped; resize 16, crop 16 changes them again: give --resize none --crop none"
        in resized.stderr
    )


def test_cifar10_c_root_reads_each_stack_at_its_severity(setup, cifar10_c, tmp_path):
    metrics = tmp_path / "m.json"
    named = adapt(setup, f"cifar10-c:{cifar10_c}", "--severity", "2", "--quiet", "--metrics-json", metrics)
    assert named.exit_code == 0, named.stderr
    plain = invoke(
        "adapt",
        "--stats",
        setup["artifact"],
        "--model",
        TINY_NET,
        "--batch-size",
        "4",
        "--quiet",
        "--data",
        cifar10_c / "snow.npy",
        "--data",
        cifar10_c / "fog.npy",
        "--labels",
        cifar10_c / "labels.npy",
        "--severity",
        "2",
    )
    assert plain.exit_code == 0, plain.stderr
    # the benchmark's order (snow before fog), each stack's rows 6..11 (severity 2), labelled: the same predictions
    assert named.stdout == plain.stdout and len(rows(named)) == 12
    assert {r["path"].rsplit("#", 1)[1] for r in rows(named)} == {str(i) for i in range(6, 12)}
    assert [d["data"] for d in json.loads(metrics.read_text())["domains"]] == [
        str(cifar10_c / "snow.npy"),
        str(cifar10_c / "fog.npy"),
    ]
    assert all(r["label"] for r in rows(named))
    default = adapt(setup, f"cifar10-c:{cifar10_c}", "--quiet", "--metrics-json", metrics)
    assert json.loads(metrics.read_text())["settings"]["severity"] == 5
    assert {r["path"].rsplit("#", 1)[1] for r in rows(default)} == {str(i) for i in range(24, 30)}


def test_cifar10_test_is_the_clean_set_of_cifar10_c(tmp_path):
    make_cifar10(tmp_path)
    shutil.copy(tmp_path / "cifar-10-batches-py" / "data_batch_2", tmp_path / "cifar-10-batches-py" / "test_batch")
    domain = open_domain(f"cifar10-test:{tmp_path}")
    assert len(domain) == 3 and domain.refs[0] == "cifar-10-batches-py/test_batch#0"
    assert open_domain(f"cifar10:{tmp_path}").refs[0] == "cifar-10-batches-py#0"  # the training set's refs as before


def test_the_subset_keeps_the_listed_images_by_path_or_file_name(setup, imagenet_c, tmp_path):
    ids = tmp_path / "ids.txt"
    ids.write_text("a/0000.png\nb/0002.png\nc/0001.png\nc/0009.png\n")
    result = adapt(setup, f"imagenet-c:{imagenet_c}/fog", "--subset", ids)
    assert result.exit_code == 0, result.stderr
    kept = sorted(str(Path(r["path"]).relative_to(imagenet_c / "fog" / "5")) for r in rows(result))
    assert kept == ["a/0000.png", "b/0002.png", "c/0001.png"]
    assert "3 of its 4 images are in" in result.stderr  # c/0009.png is not there
    ids.write_text("0001.png\n")  # a file name: one in each class folder here
    by_name = adapt(setup, f"imagenet-c:{imagenet_c}/fog", "--subset", ids, "--quiet")
    assert sorted(Path(r["path"]).name for r in rows(by_name)) == ["0001.png"] * 3
    ids.write_text("z/none.png\n")
    fails(adapt(setup, f"imagenet-c:{imagenet_c}/fog", "--subset", ids), 3, "none of its 1 image ids is an image of")
    fails(
        adapt(setup, f"imagenet-c:{imagenet_c}/fog", "--subset", tmp_path),
        3,
        f"--subset {tmp_path}: not a regular file (a folder, a device or a pipe); write the image ids to a file",
    )
    fails(adapt(setup, f"imagenet-c:{imagenet_c}/fog", "--subset", tmp_path / "gone.txt"), 3, "gone.txt: no such file")


def test_clean_prints_the_source_models_error_on_the_clean_set(setup, tmp_path):
    clean = write_folder(tmp_path / "val", per_class=4, seed=9)
    metrics, source = tmp_path / "m.json", tmp_path / "s.json"
    result = adapt(setup, setup["train"], "--clean", clean, "--metrics-json", metrics)
    assert result.exit_code == 0, result.stderr
    measured = json.loads(metrics.read_text())["clean"]
    assert measured["n"] == 12 and "source model's clean error on" in result.stderr
    # the error of `cafa adapt --method source` on the same images
    reference = adapt(setup, clean, "--method", "source", "--quiet", "--metrics-json", source)
    assert reference.exit_code == 0, reference.stderr
    assert measured["error"] == json.loads(source.read_text())["error"]
    flat = tmp_path / "flat"
    flat.mkdir()
    for path in sorted((clean / "a").iterdir()):
        shutil.copy(path, flat / path.name)
    fails(adapt(setup, setup["train"], "--clean", flat), 3, "--clean", "no labels, so no error")


def test_bench_takes_a_benchmark_root_as_a_column_per_corruption(setup, imagenet_c, tmp_path):
    report = tmp_path / "r.json"
    result = invoke(
        "bench",
        f"imagenet-c:{imagenet_c}",
        "--model",
        TINY_NET,
        "--weights",
        setup["weights"],
        "--train",
        setup["train"],
        *PLAIN,
        "--methods",
        "source,bn",
        "--batch-size",
        "4",
        "--workdir",
        tmp_path / "w",
        "--metrics-json",
        report,
        "--clean",
        setup["train"],
    )
    assert result.exit_code == 0, result.stderr
    header = result.stdout.splitlines()[0]
    assert header == "| method | gaussian_noise | fog | contrast | mean |"
    payload = json.loads(report.read_text())
    assert payload["clean"]["n"] == 18 and payload["settings"]["severity"] == 5
    assert result.stderr.count("source model's clean error") == 1


def test_benchmark_layout_errors(imagenet_c, cifar10_c, tmp_path):
    with pytest.raises(InputError, match="none of the 15 imagenet-c corruptions"):
        expand_benchmarks([f"imagenet-c:{tmp_path}"])
    with pytest.raises(InputError, match="no severity folder"):
        open_domain(f"imagenet-c:{imagenet_c}/fog", severity=2)
    with pytest.raises(UsageError, match="`severity` must be 1-5"):
        open_domain(f"imagenet-c:{imagenet_c}/fog", severity=6)
    with pytest.raises(UsageError, match="labels.npy"):
        open_domain(f"cifar10-c:{cifar10_c}/fog.npy", labels=str(cifar10_c / "labels.npy"))
    (cifar10_c / "labels.npy").unlink()
    with pytest.raises(InputError, match="no labels.npy beside fog.npy"):
        open_domain(f"cifar10-c:{cifar10_c}/fog.npy")
    with pytest.raises(InputError, match="no such folder"):
        expand_benchmarks([f"imagenet-c:{tmp_path / 'nowhere'}"])
    (tmp_path / "contrast").write_text("not a folder")  # it said "none of the 15 corruptions is in .../contrast"
    with pytest.raises(InputError, match="contrast is a file; imagenet-c is folders"):
        expand_benchmarks([f"imagenet-c:{tmp_path / 'contrast'}"])


def test_gradual_on_a_benchmark_needs_folders_and_no_severity(setup, imagenet_c, cifar10_c):
    fails(
        adapt(setup, f"imagenet-c:{imagenet_c}/fog", "--gradual", "--severity", "3"),
        2,
        "--severity 3 picks one severity",
    )
    fails(adapt(setup, f"cifar10-c:{cifar10_c}/fog.npy", "--gradual"), 2, "--gradual visits the severity folders")


def test_a_misspelt_class_folder_gets_a_did_you_mean(setup, tmp_path):
    test = write_folder(tmp_path / "test", per_class=2, classes=("a", "b", "cc"))
    fails(adapt(setup, test), 3, "class folder(s) cc not in the model's class list")
    named = write_folder(tmp_path / "named", per_class=2, classes=("apple", "banana", "cherry"))
    (tmp_path / "classes.txt").write_text("apple\nbanana\ncherry\n")
    result = invoke(
        "stats",
        "--model",
        TINY_NET,
        "--weights",
        setup["weights"],
        "--data",
        named,
        *PLAIN,
        "--fraction",
        "1",
        "--out",
        tmp_path / "s.safetensors",
        "--quiet",
    )
    assert result.exit_code == 0, result.stderr
    (named / "cherry").rename(named / "chery")
    fails(
        invoke("adapt", "--stats", tmp_path / "s.safetensors", "--model", TINY_NET, "--data", named),
        3,
        "class folder(s) chery not in the model's class list (3 classes) (did you mean cherry for chery?)",
    )


def test_bench_severities_make_a_row_per_severity_as_each_severity_alone(setup, imagenet_c, trained, tmp_path):
    """One command, a row per method and severity; each row's errors are those of a bench at that `--severity`."""
    out = {k: tmp_path / f"r.{k}" for k in ("csv", "json")}
    weights = tmp_path / "trained.pt"  # a net that tells the classes apart, so that harder images cost it
    torch.save(trained[0].model.state_dict(), weights)
    base = [
        "bench",
        f"imagenet-c:{imagenet_c}",
        "--model",
        TINY_NET,
        "--weights",
        weights,
        "--train",
        setup["train"],
        *PLAIN,
        "--methods",
        "source,bn",
        "--batch-size",
        "4",
        "--workdir",
        tmp_path / "w",
    ]
    result = invoke(*base, "--severities", "3,5", "--csv", out["csv"], "--metrics-json", out["json"])
    assert result.exit_code == 0, result.stderr
    long_table, by_condition = result.stdout.strip().split("\n\n")
    assert [line.split(" | ")[0] for line in long_table.splitlines()[2:]] == [
        "| source, severity 3",
        "| bn, severity 3",
        "| source, severity 5",
        "| bn, severity 5",
    ]
    assert by_condition.splitlines()[0] == "| condition | source | bn |"
    assert [line.split(" | ")[0] for line in by_condition.splitlines()[2:]] == ["| severity 3", "| severity 5"]
    table = list(csv.DictReader(out["csv"].open()))
    assert list(table[0]) == [
        "method",
        "order",
        "batch_size",
        "severity",
        "domain",
        "error_mean_percent",
        "error_std_percent",
        *CALIBRATION_COLUMNS,
    ]
    errors = {(r["method"], r["severity"], r["domain"]): r["error_mean_percent"] for r in table}
    # the severity folders hold other images (the fixture's seeds and shifts differ): so do the errors
    assert [errors[("source", "3", d)] for d in FOUND] != [errors[("source", "5", d)] for d in FOUND]
    for severity in ("3", "5"):
        alone = invoke(*base, "--severity", severity, "--quiet")
        assert alone.exit_code == 0, alone.stderr
        for line in alone.stdout.splitlines()[2:]:
            method, *cells = [cell.strip(" *") for cell in line.strip("|").split("|")]
            assert cells == [f"{float(errors[(method, severity, d)]):.2f}" for d in (*FOUND, "mean")]
    report = json.loads(out["json"].read_text())
    assert [(r["label"], r["severity"]) for r in report["rows"]] == [
        ("source, severity 3", 3),
        ("bn, severity 3", 3),
        ("source, severity 5", 5),
        ("bn, severity 5", 5),
    ]
    assert (report["settings"]["severities"], report["settings"]["severity"]) == ("3,5", None)


def test_bench_severity_is_the_test_domains_not_the_training_datas(setup, imagenet_c, tmp_path):
    """`--severity` reached the statistics' training folder too, which refused it (an image folder has none)."""
    result = invoke(
        "bench",
        f"imagenet-c:{imagenet_c}",
        "--severity",
        "3",
        "--methods",
        "cafa",
        "--model",
        TINY_NET,
        "--weights",
        setup["weights"],
        "--train",
        setup["train"],
        *PLAIN,
        "--fraction",
        "1",
        "--batch-size",
        "4",
        "--workdir",
        tmp_path / "w",
        "--quiet",
    )
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines()[0] == "| method | gaussian_noise | fog | contrast | mean |"


def test_a_severity_axis_needs_data_with_severities(setup, imagenet_c, tmp_path):
    base = [
        "bench",
        "--model",
        TINY_NET,
        "--weights",
        setup["weights"],
        "--train",
        setup["train"],
        *PLAIN,
        "--methods",
        "source",
        "--workdir",
        tmp_path / "w",
    ]
    fails(
        invoke(*base, setup["train"], "--severities", "3,5"),
        2,
        "--severity is only for .npy arrays that stack 5 severities",
    )
    fails(invoke(*base, f"imagenet-c:{imagenet_c}", "--severities", "3,4"), 3, "no severity folder", "gaussian_noise/4")
    fails(
        invoke(*base, f"imagenet-c:{imagenet_c}", "--severities", "3,5", "--severity", "3"),
        2,
        "--severity 3 and --severities 3,5 both say which severities to run",
    )
    assert not (tmp_path / "w").exists()  # refused before any statistics


# --- ImageNet's natural-shift sets: one domain each, labelled as ImageNet's 1,000 classes ----------


def _png(path: Path, value: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((8, 8, 3), value, np.uint8)).save(path)


def test_imagenet_v2_folders_are_output_indices_and_sketch_folders_wnids(tmp_path):
    from cafa_cli.data.benchmarks import expand_benchmarks, imagenet_classes, open_benchmark

    wnids = list(imagenet_classes())
    assert len(wnids) == 1000 and wnids == sorted(wnids)
    for folder, value in (("0", 10), ("999", 20), ("10", 30)):  # "10" sorts before "999" and after "0"
        _png(tmp_path / "v2" / folder / "a.jpeg", value)
    v2 = open_benchmark(f"imagenet-v2:{tmp_path / 'v2'}", None, None)
    assert v2.class_names == wnids
    by_file = {Path(ref).parent.name: wnids[label] for ref, label in zip(v2.refs, v2.labels)}
    assert by_file == {"0": wnids[0], "10": wnids[10], "999": wnids[999]}
    for wnid in (wnids[3], wnids[7]):
        _png(tmp_path / "sketch" / wnid / "a.JPEG", 5)
    sketch = open_benchmark(f"imagenet-sketch:{tmp_path / 'sketch'}", None, None)
    assert [sketch.class_names[label] for label in sketch.labels] == [wnids[3], wnids[7]]
    assert expand_benchmarks([f"imagenet-sketch:{tmp_path / 'sketch'}"]) == (
        [f"imagenet-sketch:{tmp_path / 'sketch'}"],
        [],
    )


def test_imagenet_v2_refuses_a_folder_that_is_no_output_index_and_a_severity(tmp_path):
    _png(tmp_path / "v2" / "cat" / "a.jpeg", 1)
    fails(
        invoke("adapt", "--model", "fmnist-resnet", "--method", "source", "--data", f"imagenet-v2:{tmp_path / 'v2'}"),
        3,
        "'cat' is not an ImageNet output index",
    )
    _png(tmp_path / "ok" / "5" / "a.jpeg", 1)
    fails(
        invoke(
            "adapt",
            "--model",
            "fmnist-resnet",
            "--method",
            "source",
            "--data",
            f"imagenet-v2:{tmp_path / 'ok'}",
            "--severity",
            "3",
        ),
        2,
        "--severity is not for imagenet-v2",
    )
