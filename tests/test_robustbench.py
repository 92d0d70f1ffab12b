"""`--model robustbench:DATASET/NAME`: RobustBench's corruption-benchmark models, defined in
cafa (model/zoo/robustbench.py) with the key-for-key layout of RobustBench's checkpoints, read
from `--weights` or from RobustBench's own folder (models/<dataset>/corruptions/<name>.pt),
never downloaded, with their preprocessing. No real checkpoint is needed: random weights
are saved in the forms RobustBench's files and its loaded models have."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import invoke, write_folder
from helpers import fails

from cafa_cli.core.errors import InputError, UsageError
from cafa_cli.core.factories import is_factory
from cafa_cli.data.preprocessing import Preprocessing
from cafa_cli.jobs.shared.inputs import default_preprocessing
from cafa_cli.model.checkpoints import sha256_of
from cafa_cli.model.loading import resolve
from cafa_cli.model.zoo import robustbench

# The published layouts, from RobustBench's architectures (model_zoo/architectures/wide_resnet.py,
# resnext.py; torchvision's resnet50 for ImageNet) and its model tables (model_zoo/cifar10.py,
# cifar100.py, imagenet.py): state-dict keys, parameters, and keys with their shapes, present
# or (None) absent. WRN-28-10's 36.5 M and WRN-40-2's 2.2 M parameters are the papers' figures.
WRN_28_10 = (
    155,
    36_479_194,
    {
        "conv1.weight": (16, 3, 3, 3),
        "block1.layer.0.bn1.weight": (16,),
        "block1.layer.0.conv1.weight": (160, 16, 3, 3),
        "block1.layer.0.convShortcut.weight": (160, 16, 1, 1),
        "block1.layer.1.convShortcut.weight": None,
        "block1.layer.3.conv2.weight": (160, 160, 3, 3),
        "block2.layer.0.convShortcut.weight": (320, 160, 1, 1),
        "block3.layer.3.bn2.running_var": (640,),
        "block3.layer.4.conv1.weight": None,
        "bn1.num_batches_tracked": (),
        "fc.weight": (10, 640),
        "fc.bias": (10,),
        "sub_block1.layer.0.conv1.weight": None,
        "mu": None,
        "sigma": None,
    },
)


def wrn_40_2(classes: int, parameters: int):
    return (
        227,
        parameters,
        {
            "conv1.weight": (16, 3, 3, 3),
            "block1.layer.0.convShortcut.weight": (32, 16, 1, 1),
            "block1.layer.5.conv2.weight": (32, 32, 3, 3),
            "block2.layer.0.conv1.weight": (64, 32, 3, 3),
            "block3.layer.5.conv2.weight": (128, 128, 3, 3),
            "block3.layer.6.conv2.weight": None,
            "bn1.running_mean": (128,),
            "fc.weight": (classes, 128),
            "fc.bias": (classes,),
            "mu": None,
            "sigma": None,
        },
    )


def resnext_29(classes: int, parameters: int):
    # cardinality 4, base width 32: grouped 3x3 convs of 128, 256, 512 channels (32, 64, 128 per group)
    return (
        188,
        parameters,
        {
            "conv_1_3x3.weight": (64, 3, 3, 3),
            "bn_1.weight": (64,),
            "stage_1.0.conv_reduce.weight": (128, 64, 1, 1),
            "stage_1.0.conv_conv.weight": (128, 32, 3, 3),
            "stage_1.0.bn.running_var": (128,),
            "stage_1.0.conv_expand.weight": (256, 128, 1, 1),
            "stage_1.0.downsample.0.weight": (256, 64, 1, 1),
            "stage_1.0.downsample.1.running_mean": (256,),
            "stage_1.1.downsample.0.weight": None,
            "stage_2.0.downsample.0.weight": (512, 256, 1, 1),
            "stage_3.2.conv_conv.weight": (512, 128, 3, 3),
            "stage_3.2.bn_expand.weight": (1024,),
            "stage_3.3.conv_reduce.weight": None,
            "classifier.weight": (classes, 1024),
            "classifier.bias": (classes,),
            "mu": None,
        },
    )


RESNET_50 = (
    320,
    25_557_032,
    {
        "conv1.weight": (64, 3, 7, 7),
        "bn1.running_var": (64,),
        "layer1.0.downsample.0.weight": (256, 64, 1, 1),
        "layer3.5.conv2.weight": (256, 256, 3, 3),
        "layer4.2.conv3.weight": (2048, 512, 1, 1),
        "fc.weight": (1000, 2048),
        "fc.bias": (1000,),
        "normalize.mean": None,
        "model.conv1.weight": None,
    },
)

LAYOUTS = {
    "robustbench:cifar10/Standard": WRN_28_10,
    "robustbench:cifar10/Hendrycks2020AugMix_WRN": wrn_40_2(10, 2_243_546),
    "robustbench:cifar100/Hendrycks2020AugMix_WRN": wrn_40_2(100, 2_255_156),
    "robustbench:cifar10/Hendrycks2020AugMix_ResNeXt": resnext_29(10, 6_807_882),
    "robustbench:cifar100/Hendrycks2020AugMix_ResNeXt": resnext_29(100, 6_900_132),
    "robustbench:imagenet/Standard_R50": RESNET_50,
    "robustbench:imagenet/Hendrycks2020AugMix": RESNET_50,
    "robustbench:imagenet/Hendrycks2020Many": RESNET_50,
}

# RobustBench feeds CIFAR nets [0, 1] pixels (the AugMix nets subtract 0.5 and divide by 0.5
# inside), ImageNet nets Resize(256) + CenterCrop(224) through an ImageNormalizer
CIFAR_RAW = Preprocessing(resize=32, crop=32, mean=(0.0,) * 3, std=(1.0,) * 3)
CIFAR_HALF = Preprocessing(resize=32, crop=32, mean=(0.5,) * 3, std=(0.5,) * 3)
IMAGENET = Preprocessing(resize=256, crop=224)
PREPROCESSING = {
    "cifar10/Standard": CIFAR_RAW,
    "cifar10/Hendrycks2020AugMix_WRN": CIFAR_HALF,
    "cifar100/Hendrycks2020AugMix_WRN": CIFAR_HALF,
    "cifar10/Hendrycks2020AugMix_ResNeXt": CIFAR_HALF,
    "cifar100/Hendrycks2020AugMix_ResNeXt": CIFAR_HALF,
    "imagenet/Standard_R50": IMAGENET,
    "imagenet/Hendrycks2020AugMix": IMAGENET,
    "imagenet/Hendrycks2020Many": IMAGENET,
}


def test_the_models_are_the_ones_with_a_published_layout_here():
    assert set(robustbench.MODELS) == set(LAYOUTS) == {f"robustbench:{name}" for name in PREPROCESSING}


@pytest.mark.parametrize("model", sorted(LAYOUTS))
def test_each_architecture_has_robustbenchs_layout_key_for_key(model):
    keys, parameters, sample = LAYOUTS[model]
    net = robustbench.build(model, None)
    state = net.state_dict()
    assert len(state) == keys
    assert sum(p.numel() for p in net.parameters()) == parameters
    for key, shape in sample.items():
        assert (tuple(state[key].shape) if key in state else None) == shape, key


@pytest.mark.parametrize("name", sorted(PREPROCESSING))
def test_each_model_brings_its_preprocessing(name):
    assert default_preprocessing(f"robustbench:{name}") == PREPROCESSING[name]


def test_a_robustbench_name_is_no_code_to_import():
    assert not is_factory("robustbench:cifar10/Standard")


# --- checkpoints in RobustBench's forms --------------------------------------------------


def augmix_checkpoint(net: torch.nn.Module) -> dict:
    """What AugMix's training scripts save (the source of the Hendrycks2020 files): the
    DataParallel state ('module.' keys) under 'state_dict', beside plain values and the
    optimiser's state, all of which torch.load reads with weights_only=True."""
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    last = list(net.parameters())[-1]
    last.grad = torch.ones_like(last)
    optimizer.step()  # a momentum buffer in the optimiser's state
    return {
        "epoch": 99,
        "dataset": "cifar10",
        "model": "wrn",
        "best_acc": 0.95,
        "optimizer": optimizer.state_dict(),
        "state_dict": {f"module.{key}": value for key, value in net.state_dict().items()},
    }


def loaded_model_state(net: torch.nn.Module, model: str) -> dict:
    """The state_dict of the net RobustBench's load_model returns: the AugMix CIFAR nets hold
    their mu/sigma buffers, ImageNet nets are Sequential(normalize=ImageNormalizer, model=net)."""
    state = net.state_dict()
    if "imagenet" in model:
        return {
            "normalize.mean": torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1),
            "normalize.std": torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1),
            **{f"model.{key}": value for key, value in state.items()},
        }
    return {"mu": torch.full((1, 3, 1, 1), 0.5), "sigma": torch.full((1, 3, 1, 1), 0.5), **state}


FORMS = {
    "plain": lambda net, model: net.state_dict(),
    "augmix": lambda net, model: augmix_checkpoint(net),
    "model_state_dict": lambda net, model: {"model_state_dict": net.state_dict()},
    "loaded": loaded_model_state,
}


def default_file(tmp_path: Path, model: str) -> Path:
    dataset, name = model.removeprefix("robustbench:").split("/")
    path = tmp_path / "models" / dataset / "corruptions" / f"{name}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


@pytest.mark.parametrize(
    "model, form",
    [
        ("robustbench:cifar10/Standard", "plain"),
        ("robustbench:cifar10/Hendrycks2020AugMix_WRN", "augmix"),
        ("robustbench:cifar10/Hendrycks2020AugMix_WRN", "loaded"),
        ("robustbench:cifar100/Hendrycks2020AugMix_ResNeXt", "augmix"),
        ("robustbench:cifar100/Hendrycks2020AugMix_WRN", "model_state_dict"),
        ("robustbench:imagenet/Hendrycks2020Many", "augmix"),
        ("robustbench:imagenet/Hendrycks2020AugMix", "loaded"),
    ],
)
def test_a_checkpoint_in_robustbenchs_folder_loads_by_name_safely(tmp_path, monkeypatch, model, form):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    saved = robustbench.build(model, None)
    path = default_file(tmp_path, model)
    torch.save(FORMS[form](saved, model), path)
    monkeypatch.setattr(torch, "load", _weights_only(torch.load))
    net, spec = resolve(model)
    state = net.model.state_dict()
    assert set(state) == set(saved.state_dict())
    assert all(torch.equal(state[key], value) for key, value in saved.state_dict().items())
    assert spec.model == model and spec.weights == str(path) and spec.weights_sha256 == sha256_of(path)
    assert net.classifier_name == ("classifier" if "ResNeXt" in model else "fc")


def _weights_only(load):
    """torch.load that fails the test if cafa ever asks it to unpickle objects."""

    def checked(*args, **kwargs):
        assert kwargs.get("weights_only") is True
        return load(*args, **kwargs)

    return checked


@pytest.mark.parametrize(
    "model, size, features",
    [
        ("robustbench:cifar10/Standard", 32, 640),
        ("robustbench:cifar100/Hendrycks2020AugMix_ResNeXt", 32, 1024),
        ("robustbench:imagenet/Standard_R50", 64, 2048),
    ],
)
def test_cafa_finds_the_feature_layer_of_each_family(tmp_path, model, size, features):
    weights = tmp_path / "w.pt"
    torch.save(robustbench.build(model, None).state_dict(), weights)
    net, _ = resolve(model, str(weights))
    with torch.no_grad():
        logits, found = net(torch.rand(2, 3, size, size))
    assert found.shape == (2, features) and logits.shape == (2, net.num_classes)


def test_standard_r50_is_torchvisions_resnet50_from_the_torch_hub_cache(tmp_path, monkeypatch):
    # RobustBench builds it with torchvision's resnet50(pretrained=True): IMAGENET1K_V1, no file of its own
    monkeypatch.setattr(torch.hub, "_hub_dir", str(tmp_path / "hub"))
    path = tmp_path / "hub" / "checkpoints" / "resnet50-0676ba61.pth"
    path.parent.mkdir(parents=True)
    torch.save(robustbench.build("robustbench:imagenet/Standard_R50", None).state_dict(), path)
    _, spec = resolve("robustbench:imagenet/Standard_R50")
    assert spec.weights == str(path)


def test_stats_and_adapt_run_on_a_robustbench_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = "robustbench:cifar10/Hendrycks2020AugMix_WRN"
    torch.save(augmix_checkpoint(robustbench.build(model, None)), default_file(tmp_path, model))
    train = write_folder(tmp_path / "train", per_class=2, classes=[f"c{i}" for i in range(10)], size=32)
    made = invoke("stats", "--model", model, "--data", train, "--fraction", "1", "--out", "s.safetensors", "-q")
    assert made.exit_code == 0, made.stderr
    # bn: no backward pass, which on a busy two-core machine takes seconds; cafa's feature layer is tested above
    adapted = invoke("adapt", "--stats", "s.safetensors", "--data", train, "--batch-size", "10", "--method", "bn")
    assert adapted.exit_code == 0, adapted.stderr
    assert len(adapted.stdout.strip().splitlines()) == 21  # a header and a prediction per image


# --- mistakes ------------------------------------------------------------------------------


def test_a_missing_checkpoint_names_the_path_and_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_folder(tmp_path / "train", per_class=2, size=32)
    result = invoke("stats", "--model", "robustbench:cifar10/Standard", "--data", tmp_path / "train")
    fails(
        result,
        3,
        "models/cifar10/corruptions/Standard.pt is not there",
        "cafa downloads nothing",
        "load_model('Standard', dataset='cifar10', threat_model='corruptions')",
        "--weights FILE",
    )


@pytest.mark.parametrize(
    "model, needle",
    [
        ("robustbench:cifar10/standard", "did you mean robustbench:cifar10/Standard?"),
        ("robustbench:Standard", "robustbench:DATASET/NAME"),
        ("robustbench:cifar100/Standard", "it has Hendrycks2020AugMix_WRN, Hendrycks2020AugMix_ResNeXt"),
    ],
)
def test_a_name_cafa_does_not_define_says_what_exists(tmp_path, model, needle):
    write_folder(tmp_path / "train", per_class=2, size=32)
    fails(invoke("stats", "--model", model, "--data", tmp_path / "train"), 2, needle)


def test_the_nets_take_no_arguments_and_their_own_class_count():
    with pytest.raises(UsageError, match="takes no `model_arg`"):
        robustbench.build("robustbench:cifar10/Standard", {"depth": 34})


def test_num_classes_other_than_the_models_is_refused(tmp_path):
    weights = tmp_path / "w.pt"
    model = "robustbench:cifar10/Hendrycks2020AugMix_WRN"
    torch.save(robustbench.build(model, None).state_dict(), weights)
    with pytest.raises(UsageError, match="`num_classes` 100 but the model's classifier has 10 outputs"):
        resolve(model, str(weights), num_classes=100)


def test_another_models_checkpoint_is_refused_by_its_keys(tmp_path):
    weights = tmp_path / "w.pt"
    torch.save(robustbench.build("robustbench:cifar10/Hendrycks2020AugMix_WRN", None).state_dict(), weights)
    with pytest.raises(InputError, match="keys do not match the model: unexpected block1.layer.4"):
        resolve("robustbench:cifar10/Standard", str(weights))


def test_normalisation_buffers_of_another_model_are_refused(tmp_path):
    # mu/sigma become the preprocessing's mean/std: other values would be dropped silently
    model = "robustbench:cifar10/Hendrycks2020AugMix_WRN"
    state = {
        **robustbench.build(model, None).state_dict(),
        "mu": torch.zeros(1, 3, 1, 1),
        "sigma": torch.ones(1, 3, 1, 1),
    }
    weights = tmp_path / "w.pt"
    torch.save(state, weights)
    with pytest.raises(InputError, match=r"its mu is \[0.0, 0.0, 0.0\], not the \[0.5, 0.5, 0.5\]"):
        resolve(model, str(weights))
