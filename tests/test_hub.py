"""Models as researchers name them: torchvision:NAME and timm:NAME with --model-arg, pretrained
weights by name from the local cache (never downloaded), the preprocessing they declare,
module:function from the working folder, and what an adapt run says it adapts."""

from __future__ import annotations

import hashlib
import json
import os
import sys

import numpy as np
import pytest
import torch
import torchvision
from conftest import PLAIN, TINY_NET, invoke, write_folder
from helpers import factory, fails, rows
from PIL import Image
from safetensors.torch import save_file

from cafa_cli.core.errors import UsageError
from cafa_cli.core.factories import parse_model_args
from cafa_cli.data.preprocessing import Preprocessing
from cafa_cli.jobs.shared.inputs import default_preprocessing
from cafa_cli.model.loading import resolve

RGB = ["--resize", "none", "--crop", "none", "--mean", "0.5", "--std", "0.25", "--channels", "3"]


def metrics(path) -> dict:
    return json.loads(path.read_text())


# --- --model-arg ---------------------------------------------------------------------


def test_model_args_are_python_literals_else_text():
    assert parse_model_args(
        ["image_size=64", "drop=0.1", "act=gelu", "name='x y'", "size=(32, 32)", "bias=False", "extra=None"]
    ) == {"image_size": 64, "drop": 0.1, "act": "gelu", "name": "x y", "size": (32, 32), "bias": False, "extra": None}


@pytest.mark.parametrize(
    "texts, needle",
    [(["image_size"], "expected KEY=VALUE"), (["1x=2"], "expected KEY=VALUE"), (["a=1", "a=2"], "gives a twice")],
)
def test_malformed_model_args_are_usage_errors(setup, texts, needle):
    result = invoke(
        "stats",
        "--model",
        TINY_NET,
        "--weights",
        setup["weights"],
        "--data",
        setup["train"],
        *PLAIN,
        *[arg for text in texts for arg in ("--model-arg", text)],
    )
    fails(result, 2, needle)


def test_a_torchvision_model_by_name_takes_factory_arguments_and_adapt_rebuilds_it(tmp_path):
    # width_mult changes every layer's shape: weights made with it load into no other model
    train = write_folder(tmp_path / "train", per_class=6)
    torch.manual_seed(0)
    weights = tmp_path / "mnv3.safetensors"
    save_file(torchvision.models.mobilenet_v3_small(width_mult=0.5, num_classes=3).state_dict(), weights)
    model = [
        "--model",
        "torchvision:mobilenet_v3_small",
        "--model-arg",
        "width_mult=0.5",
        "--model-arg",
        "num_classes=3",
    ]
    artifact = tmp_path / "s.safetensors"
    made = invoke(
        "stats", *model, "--weights", weights, "--data", train, *RGB, "--fraction", "1", "--out", artifact, "-q"
    )
    assert made.exit_code == 0, made.stderr
    recorded = json.loads(invoke("inspect", artifact, "--json").stdout)["model"]
    assert recorded["model"] == "torchvision:mobilenet_v3_small" and recorded["num_classes"] == 3
    assert recorded["model_args"] == {"width_mult": "0.5"}

    # the artifact alone names the model: no --model, and no code of a file runs for it
    result = invoke(
        "adapt", "--stats", artifact, "--data", train, "--batch-size", "6", "--metrics-json", tmp_path / "m.json"
    )
    assert result.exit_code == 0, result.stderr
    assert len(rows(result)) == 18
    assert metrics(tmp_path / "m.json")["settings"]["model_args"] == {"width_mult": "0.5"}

    # named again, the model takes the artifact's arguments, as it takes its weights; built without them it is another
    again = invoke(
        "adapt",
        "--model",
        "torchvision:mobilenet_v3_small",
        "--stats",
        artifact,
        "--data",
        train,
        "--batch-size",
        "6",
        "-q",
    )
    assert again.exit_code == 0 and again.stdout == result.stdout, again.stderr
    without = invoke(
        "adapt",
        "--model",
        "torchvision:mobilenet_v3_small",
        "--num-classes",
        "3",
        "--weights",
        weights,
        "--method",
        "source",
        "--data",
        train,
    )
    fails(without, 3, "--weights", "shapes do not match the model")
    other = invoke(
        "adapt",
        "--model",
        "torchvision:mobilenet_v3_small",
        "--model-arg",
        "width_mult=0.5",
        "--model-arg",
        "dropout=0.5",
        "--num-classes",
        "3",
        "--weights",
        weights,
        "--stats",
        artifact,
        "--data",
        train,
    )
    fails(other, 3, "with --model-arg width_mult=0.5, not width_mult=0.5 dropout=0.5")


def test_a_keyword_the_constructor_does_not_take_is_named(setup):
    result = invoke(
        "stats",
        "--model",
        "torchvision:resnet18",
        "--model-arg",
        "depth=3",
        "--weights",
        setup["weights"],
        "--data",
        setup["train"],
    )
    fails(result, 2, "--model torchvision:resnet18:", "depth", "check --model-arg")


def test_an_unknown_torchvision_name_gets_a_did_you_mean(setup):
    result = invoke(
        "stats", "--model", "torchvision:resnet-18", "--weights", setup["weights"], "--data", setup["train"]
    )
    fails(result, 2, "no such torchvision classification model", "did you mean resnet18")


# --- timm ---------------------------------------------------------------------------


def test_a_timm_model_by_name_with_its_declared_preprocessing(tmp_path):
    timm = pytest.importorskip("timm")
    train = write_folder(tmp_path / "train", per_class=6)
    torch.manual_seed(0)
    weights = tmp_path / "vit.pt"
    torch.save(timm.create_model("test_vit", img_size=32, num_classes=3).state_dict(), weights)
    model = ["--model", "timm:test_vit", "--model-arg", "img_size=32", "--num-classes", "3"]
    artifact = tmp_path / "s.safetensors"
    made = invoke("stats", *model, "--weights", weights, "--data", train, "--fraction", "1", "--out", artifact, "-q")
    assert made.exit_code == 0, made.stderr
    summary = json.loads(invoke("inspect", artifact, "--json").stdout)
    # timm's pretrained config: crop_pct 0.95, bicubic, mean and std 0.5; the input is img_size's 32
    assert summary["preprocessing"] == {
        "resize": 33,
        "crop": 32,
        "mean": [0.5] * 3,
        "std": [0.5] * 3,
        "channels": 3,
        "interpolation": "bicubic",
    }
    assert summary["sampling"]["input_size"] == [32, 32]
    result = invoke(
        "adapt", "--stats", artifact, "--data", train, "--batch-size", "6", "--metrics-json", tmp_path / "m.json"
    )
    assert result.exit_code == 0, result.stderr
    assert len(rows(result)) == 18
    assert "in LayerNorm" in result.stderr  # a ViT adapts its LayerNorms
    assert metrics(tmp_path / "m.json")["adapted"]["layers"] == {
        "LayerNorm": metrics(tmp_path / "m.json")["adapted"]["tensors"]
    }
    changed = invoke(
        "adapt",
        "--stats",
        artifact,
        "--data",
        train,
        "--interpolation",
        "bilinear",
        "--metrics-json",
        tmp_path / "b.json",
        "-q",
    )
    assert changed.exit_code == 0, changed.stderr
    assert metrics(tmp_path / "b.json")["settings"]["preprocessing"]["interpolation"] == "bilinear"


def test_without_timm_the_error_names_the_extra_to_install(setup, monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)  # import timm now raises ImportError
    result = invoke("stats", "--model", "timm:resnet18", "--weights", setup["weights"], "--data", setup["train"])
    fails(result, 2, "--model timm:resnet18 needs timm, which is not installed: pip install 'cafa-cli[timm]'")


def _hf_cache(root, repo: str, file: str, data: bytes, blob: str | None = None):
    """A Hugging Face hub cache holding one file of `repo` at revision main: the snapshot's
    name links to a blob named by the file's sha256 (or `blob`), as the hub stores LFS files."""
    folder = root / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("0" * 40)
    (folder / "blobs").mkdir()
    stored = folder / "blobs" / (blob or hashlib.sha256(data).hexdigest())
    stored.write_bytes(data)
    snapshot = folder / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / file).symlink_to(stored)


def test_timm_pretrained_weights_come_from_the_hugging_face_cache_only(tmp_path, monkeypatch):
    timm = pytest.importorskip("timm")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    missing = invoke("stats", "--model", "timm:test_vit", "--weights", "r160_in1k", "--data", tmp_path)
    fails(
        missing,
        3,
        "--weights r160_in1k: timm's timm/test_vit.r160_in1k",
        f"hub cache {tmp_path / 'hub'}",
        "cafa downloads nothing",
    )

    torch.manual_seed(0)
    state = timm.create_model("test_vit").state_dict()
    save_file(state, tmp_path / "w.safetensors")
    _hf_cache(
        tmp_path / "hub", "timm/test_vit.r160_in1k", "model.safetensors", (tmp_path / "w.safetensors").read_bytes()
    )
    net, spec = resolve("timm:test_vit", "r160_in1k")
    assert (
        spec.weights == "r160_in1k"
        and spec.weights_sha256 == hashlib.sha256((tmp_path / "w.safetensors").read_bytes()).hexdigest()
    )
    assert all(torch.equal(net.model.state_dict()[name], value) for name, value in state.items())
    with pytest.raises(
        UsageError, match="has 1000 outputs, and `num_classes` 10 would put an untrained, random classifier"
    ):
        resolve("timm:test_vit", "r160_in1k", num_classes=10)  # timm would drop the pretrained head for a random one

    altered = tmp_path / "altered"
    _hf_cache(
        altered,
        "timm/test_vit.r160_in1k",
        "model.safetensors",
        (tmp_path / "w.safetensors").read_bytes(),
        blob="ab" * 32,
    )
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(altered))
    fails(
        invoke("stats", "--model", "timm:test_vit", "--weights", "r160_in1k", "--data", tmp_path),
        3,
        "has sha256",
        "not the abababababab... its name promises (a partial or altered download)",
    )


# --- torchvision weights by name ----------------------------------------------------


@pytest.fixture
def torch_home(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    return tmp_path / "torch" / "hub" / "checkpoints"


def cache_resnet18(cache, monkeypatch) -> dict:
    """resnet18 weights in torch's hub cache, under a name whose hash part is their sha256's
    start, as torchvision names its files; the enum's URL names that file."""
    torch.manual_seed(0)
    state = torchvision.models.resnet18().state_dict()
    cache.mkdir(parents=True)
    torch.save(state, cache / "tmp.pth")
    digest = hashlib.sha256((cache / "tmp.pth").read_bytes()).hexdigest()
    (cache / "tmp.pth").rename(cache / f"resnet18-{digest[:8]}.pth")
    member = torchvision.models.ResNet18_Weights.IMAGENET1K_V1
    monkeypatch.setattr(member.value, "url", f"https://download.pytorch.org/models/resnet18-{digest[:8]}.pth")
    return state


def test_torchvision_weights_by_name_come_from_the_hub_cache_with_their_preprocessing(
    tmp_path, torch_home, monkeypatch
):
    state = cache_resnet18(torch_home, monkeypatch)
    net, spec = resolve("resnet18", "IMAGENET1K_V1")
    assert spec.weights == "ResNet18_Weights.IMAGENET1K_V1"
    assert all(torch.equal(net.model.state_dict()[name], value) for name, value in state.items())

    data = write_folder(tmp_path / "test", per_class=2, classes=("n01", "n02"))
    classes = tmp_path / "classes.txt"
    classes.write_text("".join(f"n{i:02d}\n" for i in range(1000)))
    result = invoke(
        "adapt",
        "--model",
        "torchvision:resnet18",
        "--weights",
        "ResNet18_Weights.IMAGENET1K_V1",
        "--method",
        "source",
        "--classes",
        classes,
        "--data",
        data,
        "--metrics-json",
        tmp_path / "m.json",
    )
    assert result.exit_code == 0, result.stderr
    settings = metrics(tmp_path / "m.json")["settings"]
    assert settings["weights"] == "ResNet18_Weights.IMAGENET1K_V1"
    assert settings["preprocessing"] == {
        "resize": 256,
        "crop": 224,
        "mean": [0.485, 0.456, 0.406],
        "std": [0.229, 0.224, 0.225],
        "channels": 3,
        "interpolation": "bilinear",
    }
    assert "adapting nothing: --method source" in result.stderr


def test_the_preprocessing_torchvision_weights_declare_and_flags_override():
    declared = default_preprocessing("torchvision:efficientnet_b1", "IMAGENET1K_V1")
    assert (declared.resize, declared.crop, declared.interpolation) == (256, 240, "bicubic")
    assert default_preprocessing("resnet50", "DEFAULT").resize == 232  # IMAGENET1K_V2's
    assert default_preprocessing("resnet50", None) == Preprocessing()  # no weights named: as before, bilinear 256/224
    assert declared.with_changes({"interpolation": "nearest"}).interpolation == "nearest"


def test_weights_missing_from_the_cache_name_the_file_and_the_folder(setup, torch_home):
    result = invoke("stats", "--model", "resnet18", "--weights", "IMAGENET1K_V1", "--data", setup["train"])
    fails(
        result,
        3,
        "--weights ResNet18_Weights.IMAGENET1K_V1: resnet18-f37072fd.pth is not in torch's hub cache",
        str(torch_home),
        "cafa downloads nothing",
    )
    unknown = invoke("stats", "--model", "resnet18", "--weights", "IMAGENET1K_V9", "--data", setup["train"])
    fails(unknown, 2, "--weights IMAGENET1K_V9: no such file, nor weights of resnet18 by that name", "IMAGENET1K_V1")


def test_a_cached_file_whose_sha256_differs_from_its_name_is_refused(setup, torch_home, monkeypatch):
    cache_resnet18(torch_home, monkeypatch)
    (path,) = torch_home.iterdir()
    path.write_bytes(path.read_bytes()[:-10] + b"0123456789")
    result = invoke("stats", "--model", "resnet18", "--weights", "IMAGENET1K_V1", "--data", setup["train"])
    fails(result, 3, f"{path} has sha256", "its name promises (a partial or altered download)")


# --- module:function from the working folder ------------------------------------------


def test_a_module_in_the_working_folder_is_importable_and_takes_model_args(setup, tmp_path, monkeypatch):
    (tmp_path / "cwd_models.py").write_text(
        f"import sys\nsys.path.insert(0, {str(TINY_NET.rpartition('/')[0])!r})\n"
        "import tiny_net\n\ndef small(num_classes=3, width=8):\n"
        "    return tiny_net.TinyNet(num_classes=num_classes, width=width)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    torch.manual_seed(0)
    import tiny_net

    torch.save(tiny_net.TinyNet(width=4).state_dict(), tmp_path / "w4.pt")
    result = invoke(
        "stats",
        "--model",
        "cwd_models:small",
        "--model-arg",
        "width=4",
        "--weights",
        tmp_path / "w4.pt",
        "--data",
        setup["train"],
        *PLAIN,
        "--fraction",
        "1",
        "--out",
        tmp_path / "s.safetensors",
        "-q",
    )
    assert result.exit_code == 0, result.stderr
    shown = json.loads(invoke("inspect", tmp_path / "s.safetensors", "--json").stdout)
    # recorded by the name typed and with its argument, so that adapt can build the same model again
    assert shown["model"]["model"] == "cwd_models:small" and shown["model"]["model_args"] == {"width": "4"}
    from cafa_cli.model.loading import parameters_sha256

    four = tiny_net.TinyNet(width=4)
    four.load_state_dict(torch.load(tmp_path / "w4.pt"))
    assert shown["parameters_sha256"] == parameters_sha256(four)  # statistics of the width-4 model


# --- what runs ----------------------------------------------------------------------


def test_adapt_says_what_it_adapts_on_stderr_and_in_the_metrics(setup, tmp_path):
    result = invoke(
        "adapt",
        "--stats",
        setup["artifact"],
        "--model",
        TINY_NET,
        "--data",
        setup["train"],
        "--batch-size",
        "6",
        "--metrics-json",
        tmp_path / "m.json",
    )
    assert result.exit_code == 0, result.stderr
    # tiny_net: three BatchNorm2d (8, 16 and 16 channels), a weight and a bias each
    assert "adapting 6 tensors (80 parameters) in BatchNorm2d\n" in result.stderr
    assert metrics(tmp_path / "m.json")["adapted"] == {
        "tensors": 6,
        "parameters": 80,
        "layers": {"BatchNorm2d": 6},
        "batch_norms": 3,
    }
    every = invoke(
        "adapt",
        "--stats",
        setup["artifact"],
        "--model",
        TINY_NET,
        "--data",
        setup["train"],
        "--params",
        "all",
        "--batch-size",
        "6",
    )
    assert "adapting 11 tensors (1,534 parameters) in BatchNorm2d (6), Conv2d (3), Linear (2)" in every.stderr
    assert "warning" not in result.stderr + every.stderr


def test_outputs_constant_across_the_first_batch_get_a_warning(setup, tmp_path):
    zero_head = factory(
        tmp_path,
        "def build():\n    net = tiny_net.build()\n    torch.nn.init.zeros_(net.head[3].weight)\n"
        "    torch.nn.init.zeros_(net.head[3].bias)\n    return net",
    )
    result = invoke("adapt", "--model", zero_head, "--method", "source", "--data", setup["train"], *PLAIN)
    assert result.exit_code == 0, result.stderr
    assert result.stderr.count("the same outputs") == 1, result.stderr
    assert "train: the model gave all 18 images of the first batch the same outputs" in result.stderr
    plain = invoke(
        "adapt",
        "--model",
        TINY_NET,
        "--weights",
        setup["weights"],
        "--method",
        "source",
        "--data",
        setup["train"],
        *PLAIN,
    )
    assert plain.exit_code == 0 and "the same outputs" not in plain.stderr


def test_test_images_of_another_size_than_the_statistics_get_a_warning(setup, tmp_path):
    larger = write_folder(tmp_path / "larger", per_class=2, size=24)
    result = invoke("adapt", "--stats", setup["artifact"], "--model", TINY_NET, "--data", larger)
    assert result.exit_code == 0, result.stderr
    assert (
        "larger: its images enter the model at 24x24 pixels, the statistics' at 16x16 (resize none, crop none): "
        "the features will not match the statistics"
    ) in result.stderr


# --- --interpolation ------------------------------------------------------------------


def test_interpolation_is_a_setting_recorded_with_the_preprocessing(setup, tmp_path):
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (20, 30, 3), dtype=np.uint8))
    resized = {
        mode: Preprocessing(resize=12, crop=None, interpolation=mode).pixels(image)
        for mode in ("bilinear", "bicubic", "nearest")
    }
    assert not torch.equal(resized["bilinear"], resized["bicubic"]) and not torch.equal(
        resized["bilinear"], resized["nearest"]
    )
    assert (
        Preprocessing.from_dict({"resize": 8, "crop": None, "mean": [0], "std": [1], "channels": 1}).interpolation
        == "bilinear"
    )
    result = invoke(
        "stats",
        "--model",
        TINY_NET,
        "--weights",
        setup["weights"],
        "--data",
        setup["train"],
        *PLAIN,
        "--resize",
        "12",
        "--interpolation",
        "nearest",
        "--fraction",
        "1",
        "--out",
        tmp_path / "s.safetensors",
        "-q",
    )
    assert result.exit_code == 0, result.stderr
    assert (
        json.loads(invoke("inspect", tmp_path / "s.safetensors", "--json").stdout)["preprocessing"]["interpolation"]
        == "nearest"
    )
    wrong = invoke(
        "stats",
        "--model",
        TINY_NET,
        "--weights",
        setup["weights"],
        "--data",
        setup["train"],
        "--interpolation",
        "lanczos",
    )
    fails(wrong, 2, "--interpolation must be one of bilinear, bicubic, nearest, not 'lanczos'")


def test_an_unknown_timm_tag_is_a_usage_error_naming_the_tags():
    """timm 1.x raises RuntimeError for an unknown tag where earlier versions returned None;
    either way the user reads which tags there are, from the option that named the tag."""
    pytest.importorskip("timm")
    from cafa_cli.model.hub import timm_config

    with pytest.raises(UsageError, match=r"^`weights` a1_in1x: no such file, nor a pretrained tag of timm's resnet50 "):
        timm_config("resnet50", "a1_in1x")
    with pytest.raises(UsageError, match=r"^`model` timm:resnet18\.bogus: bogus is not a pretrained tag .*tv_in1k"):
        timm_config("resnet18.bogus")
