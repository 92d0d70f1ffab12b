"""Each benchmark family's standard model: `cafa bench cifar10-c:ROOT` with no `--model`
runs RobustBench's `Standard` from ./models/cifar10/corruptions/Standard.pt, with CIFAR-10
from beside the benchmark (RobustBench's ./data layout) for the statistics; an explicit
`--model` wins; the bundled demo's fashion-mnist-c:ROOT and plain folders keep fmnist-resnet.

WideResNet-28-10 (36.5 M parameters) would take most of a minute on a two-core machine, so
the end-to-end runs put a WRN-10-1 of the same layout under Standard's name."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import PLAIN, TINY_NET, class_images, invoke, tiny_net, write_folder
from helpers import fails, make_cifar10

from cafa_cli.data.fashion_mnist import FASHION_MNIST_CLASSES
from cafa_cli.jobs.bench.runs import with_standard_model
from cafa_cli.jobs.config import BenchConfig
from cafa_cli.methods.recipes import STANDARD_MODELS, standard_model
from cafa_cli.model.zoo import robustbench

STANDARD = "robustbench:cifar10/Standard"


def test_each_family_names_a_model_cafa_defines():
    assert set(STANDARD_MODELS) == {"cifar10-c", "cifar100-c", "imagenet-c"}
    for family, model in STANDARD_MODELS.items():
        assert robustbench.lookup(model).dataset == family.removesuffix("-c")


@pytest.mark.parametrize(
    "data, expected",
    [
        (["cifar10-c:data/CIFAR-10-C"], ("cifar10-c", STANDARD)),
        (["cifar100-c:data/CIFAR-100-C/fog.npy"], ("cifar100-c", "robustbench:cifar100/Hendrycks2020AugMix_ResNeXt")),
        (
            ["imagenet-c:/data/ImageNet-C", "imagenet-c:/data/ImageNet-C/spatter"],
            ("imagenet-c", "robustbench:imagenet/Standard_R50"),
        ),
        (["fashion-mnist-c:cafa-demo/fashion-mnist-c-300"], None),  # the bundled demo's: fmnist-resnet's own data
        (["cafa-demo/fashion-mnist-c-300/fog/3"], None),
        (["data/CIFAR-10-C/fog.npy"], None),  # an array by path: nothing says which model it is for
        (["cifar10-c:a", "cifar100-c:b"], None),  # two families: no one model fits both
    ],
)
def test_only_a_named_benchmark_of_a_family_implies_a_model(data, expected):
    assert standard_model(data) == expected


@pytest.mark.parametrize("recipe", ["auto", "cifar10-c", "none"])
def test_the_standard_model_replaces_the_default_only(recipe):
    config, line = with_standard_model(BenchConfig(data=["cifar10-c:data/CIFAR-10-C"], recipe=recipe, given=()))
    assert config.model == STANDARD
    assert line == f"model: {STANDARD}, the standard model of cifar10-c (give `model` to change it)"
    # chosen (on the command line or in cafa.toml): kept, even when it is the default's name
    for model in ("fmnist-resnet", "resnet18"):
        kept, line = with_standard_model(BenchConfig(data=["cifar10-c:d"], model=model, given=("model",)))
        assert kept.model == model and line is None
    # an explicit recipe on the demo's folders (docs/results/recipes.md's methods table) keeps fmnist-resnet
    demo, line = with_standard_model(
        BenchConfig(data=["fm/fashion-mnist-c-100/fog/3"], recipe="cifar10-c", given=("recipe",))
    )
    assert demo.model == "fmnist-resnet" and line is None


def test_the_training_set_is_taken_from_beside_the_benchmark_only_where_robustbench_keeps_it(tmp_path):
    (tmp_path / "data" / "CIFAR-10-C").mkdir(parents=True)
    assert robustbench.training_set_beside(STANDARD, [f"cifar10-c:{tmp_path}/data/CIFAR-10-C"]) == (
        None,
        tmp_path / "data" / "cifar-10-batches-py",
    )
    (tmp_path / "data" / "cifar-10-batches-py").mkdir()
    found = (f"cifar10:{tmp_path / 'data'}", None)
    assert robustbench.training_set_beside(STANDARD, [f"cifar10-c:{tmp_path}/data/CIFAR-10-C"]) == found
    assert robustbench.training_set_beside(STANDARD, [f"cifar10-c:{tmp_path}/data/CIFAR-10-C/fog.npy"]) == found
    assert (
        robustbench.training_set_beside(
            "robustbench:cifar10/Hendrycks2020AugMix_WRN", [f"cifar10-c:{tmp_path}/data/CIFAR-10-C"]
        )
        == found
    )
    # another dataset's benchmark, no benchmark, ImageNet (its training set lives anywhere): no place implied
    assert robustbench.training_set_beside(
        "robustbench:cifar100/Hendrycks2020AugMix_WRN", [f"cifar10-c:{tmp_path}/data/CIFAR-10-C"]
    ) == (None, None)
    assert robustbench.training_set_beside(STANDARD, [f"{tmp_path}/data/CIFAR-10-C/fog.npy"]) == (None, None)
    assert robustbench.training_set_beside("robustbench:imagenet/Standard_R50", ["imagenet-c:/data/ImageNet-C"]) == (
        None,
        None,
    )


# --- end to end, in RobustBench's layout -----------------------------------------------------


@pytest.fixture
def robustbench_folder(tmp_path, monkeypatch) -> Path:
    """RobustBench's working folder: models/cifar10/corruptions/Standard.pt (a small net of
    Standard's layout put under its name), data/cifar-10-batches-py and data/CIFAR-10-C of 2
    corruptions × 5 severities × 6 images."""
    monkeypatch.chdir(tmp_path)
    small = dataclasses.replace(robustbench.MODELS[STANDARD], build=lambda: robustbench.WideResNet(10, 1, 10))
    monkeypatch.setitem(robustbench.MODELS, STANDARD, small)
    torch.manual_seed(0)
    checkpoint = tmp_path / "models" / "cifar10" / "corruptions" / "Standard.pt"
    checkpoint.parent.mkdir(parents=True)
    torch.save({"state_dict": {f"module.{k}": v for k, v in small.build().state_dict().items()}}, checkpoint)
    make_cifar10(tmp_path / "data", per_batch=6)  # 30 images, every class
    root = tmp_path / "data" / "CIFAR-10-C"
    root.mkdir()
    rng = np.random.default_rng(0)
    labels = np.tile(np.repeat(np.arange(3), 2), 5)
    np.save(root / "labels.npy", labels)
    for corruption in ("fog", "snow"):
        grey = np.concatenate([class_images(rng, int(label), 1, size=32) for label in labels])
        np.save(root / f"{corruption}.npy", np.repeat(grey[..., None], 3, axis=-1))
    return tmp_path


def test_bench_on_cifar10_c_runs_the_standard_model_with_cifar10_beside_it(robustbench_folder):
    result = invoke(
        "bench",
        "cifar10-c:data/CIFAR-10-C",
        "--recipe",
        "cifar10-c",
        "--methods",
        "source,cafa",
        "--fraction",
        "1",
        "--batch-size",
        "6",
        "--metrics-json",
        "r.json",
    )
    assert result.exit_code == 0, result.stderr
    assert f"model: {STANDARD}, the standard model of cifar10-c (give --model to change it)" in result.stderr
    assert (
        "--train cifar10:data: the training set of robustbench:cifar10/Standard, beside its benchmark" in result.stderr
    )
    settings = json.loads(Path("r.json").read_text())["settings"]
    assert settings["model"] == STANDARD and settings["train"] == "cifar10:data"
    assert Path(settings["weights"]) == (robustbench_folder / "models/cifar10/corruptions/Standard.pt").resolve()
    assert result.stdout.splitlines()[0] == "| method | snow | fog | mean |"  # the benchmark's order


def test_an_explicit_model_or_train_wins(robustbench_folder):
    torch.save(tiny_net.build(num_classes=10).state_dict(), "tiny.pt")
    result = invoke(
        "bench",
        "cifar10-c:data/CIFAR-10-C",
        "--model",
        TINY_NET,
        "--weights",
        "tiny.pt",
        "--num-classes",
        "10",
        "--methods",
        "source",
        "--json",
        "r.json",
        *PLAIN,
    )
    assert result.exit_code == 0, result.stderr
    assert "standard model" not in result.stderr
    assert json.loads(Path("r.json").read_text())["settings"]["model"] == TINY_NET
    # --train given: used as it is, said by nobody
    given = invoke(
        "bench", "cifar10-c:data/CIFAR-10-C/fog.npy", "--train", "cifar10:data", "--methods", "bn", "--json", "g.json"
    )
    assert given.exit_code == 0, given.stderr
    assert "standard model of cifar10-c" in given.stderr and "beside its benchmark" not in given.stderr


def test_without_cifar10_beside_the_benchmark_the_error_names_the_flag_and_its_value(robustbench_folder):
    for batch in (robustbench_folder / "data" / "cifar-10-batches-py").iterdir():
        batch.unlink()
    (robustbench_folder / "data" / "cifar-10-batches-py").rmdir()
    fails(
        invoke("bench", "cifar10-c:data/CIFAR-10-C", "--methods", "source,cafa"),
        2,
        "--train is needed for cafa: the training data to compute class statistics from, robustbench:cifar10/Standard's: "
        "give --train cifar10:DIR, DIR holding cifar-10-batches-py (--train cifar10:data); there is no "
        "data/cifar-10-batches-py beside the benchmark",
    )
    # no row needs statistics: no training data either
    assert invoke("bench", "cifar10-c:data/CIFAR-10-C", "--methods", "source").exit_code == 0
    # a model of no known training set: the flag alone
    torch.save(tiny_net.build().state_dict(), "tiny.pt")
    assert (
        fails(
            invoke(
                "bench", "cifar10-c:data/CIFAR-10-C", "--model", TINY_NET, "--weights", "tiny.pt", "--methods", "cafa"
            ),
            2,
        )
        == "cafa: error: --train is needed for cafa: the training data to compute class statistics from"
    )


def test_imagenet_c_takes_standard_r50_and_asks_for_imagenets_training_folder(tmp_path):
    write_folder(tmp_path / "ImageNet-C" / "fog" / "5", per_class=1)
    fails(
        invoke("bench", f"imagenet-c:{tmp_path / 'ImageNet-C'}", "--methods", "cafa"),
        2,
        "robustbench:imagenet/Standard_R50's: give --train ImageNet's training folder of class folders "
        "(--train /data/imagenet/train)",
    )


def test_the_demos_benchmark_keeps_the_bundled_model(tmp_path):
    root = tmp_path / "fashion-mnist-c-2"
    write_folder(root / "fog" / "3", per_class=2, classes=FASHION_MNIST_CLASSES, size=28)
    result = invoke(
        "bench",
        f"fashion-mnist-c:{root}",
        "--severity",
        "3",
        "--methods",
        "source",
        "--recipe",
        "cifar10-c",
        "--json",
        tmp_path / "r.json",
        "--workdir",
        tmp_path / "w",
    )
    assert result.exit_code == 0, result.stderr
    assert "standard model" not in result.stderr
    assert json.loads((tmp_path / "r.json").read_text())["settings"]["model"] == "fmnist-resnet"


def test_adapt_without_a_model_names_the_benchmarks_standard_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no cafa-stats.safetensors here
    write_folder(tmp_path / "ImageNet-C" / "fog" / "5", per_class=1)
    fails(
        invoke("adapt", "imagenet-c:ImageNet-C", "--method", "tent"),
        2,
        "give the model with --model (and --weights) (the standard model of imagenet-c: --model "
        "robustbench:imagenet/Standard_R50): --method tent needs no statistics",
    )
