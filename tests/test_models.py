"""model/loading.py: building models, finding the classifier, loading weights safely, devices."""

from __future__ import annotations

import argparse
import hashlib
import re
from pathlib import Path

import pytest
import tiny_net
import torch
from conftest import ASSETS, TINY_NET, invoke
from helpers import factory, fails, stats_with_model
from safetensors.torch import save_file
from torch import nn

from cafa_cli.core.devices import pick_device
from cafa_cli.core.errors import InputError, UsageError
from cafa_cli.model.checkpoints import read_state_dict
from cafa_cli.model.features import FeatureClassifier, find_classifier
from cafa_cli.model.loading import build_model, resolve


def small_images(n=2, channels=3, size=32):
    return torch.randn(n, channels, size, size, generator=torch.Generator().manual_seed(0))


def assert_features_feed_classifier(wrapped: FeatureClassifier, x: torch.Tensor):
    """forward returns the logits and exactly the tensor the classifier consumed."""
    with torch.no_grad():
        logits, features = wrapped(x)
        assert features.shape == (len(x), wrapped.feature_dim)
        assert logits.shape == (len(x), wrapped.num_classes)
        torch.testing.assert_close(wrapped.classifier(features), logits)
        torch.testing.assert_close(logits, wrapped.model(x))


# --- finding the classifier ------------------------------------------------------


def test_resnet18_classifier_is_fc():
    net = build_model("resnet18", num_classes=5)
    wrapped = FeatureClassifier(net).eval()
    assert wrapped.classifier_name == "fc" and wrapped.classifier is net.fc
    assert wrapped.feature_dim == 512 and wrapped.num_classes == 5
    assert_features_feed_classifier(wrapped, small_images())


def test_mobilenet_v3_small_classifier_is_classifier_3():
    net = build_model("mobilenet_v3_small", num_classes=5)
    wrapped = FeatureClassifier(net).eval()
    assert wrapped.classifier_name == "classifier.3"
    assert wrapped.feature_dim == 1024 and wrapped.num_classes == 5
    assert_features_feed_classifier(wrapped, small_images())


def test_linear_relu_linear_head_uses_the_last_linear():
    net = tiny_net.build()
    wrapped = FeatureClassifier(net).eval()
    assert wrapped.classifier_name == "head.3"
    assert wrapped.feature_dim == 6 and wrapped.num_classes == 3
    assert_features_feed_classifier(wrapped, small_images(channels=1, size=16))
    _, features = wrapped(small_images(channels=1, size=16))
    assert (features >= 0).all(), "head.3's input is the output of the ReLU"


def test_wrapper_keeps_no_features_from_calls_it_did_not_make():
    # a second wrapper on one net (or a direct call to the net) must not leave its
    # features, and the graph behind them, held by the first wrapper
    net = tiny_net.build()
    first, second = FeatureClassifier(net), FeatureClassifier(net)
    second(small_images(channels=1, size=16))
    net(small_images(channels=1, size=16))
    assert first._features is None and second._features is None
    logits, features = first(small_images(channels=1, size=16))
    assert features.shape == (2, 6) and first._features is None


class ProjectedLast(nn.Module):
    """The last Linear registered (proj) is not the one that makes the logits (fc)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 5)
        self.proj = nn.Linear(8, 5)

    def forward(self, x):
        return self.fc(self.proj(x.flatten(1)))


def test_classifier_override():
    assert FeatureClassifier(ProjectedLast()).classifier_name == "proj"  # the default guess; shapes cannot tell
    wrapped = FeatureClassifier(ProjectedLast(), "fc").eval()
    x = torch.randn(2, 8)
    logits, features = wrapped(x)
    torch.testing.assert_close(features, wrapped.model.proj(x))
    torch.testing.assert_close(logits, wrapped.classifier(features))


def test_classifier_override_that_is_not_a_linear():
    with pytest.raises(UsageError, match=r"`classifier` head\.2: no nn\.Linear.*head\.1, head\.3"):
        find_classifier(tiny_net.build(), "head.2")
    with pytest.raises(UsageError, match="`classifier` nope"):
        find_classifier(tiny_net.build(), "nope")


def test_model_without_linear_is_an_input_error():
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    with pytest.raises(InputError, match="no nn.Linear"):
        FeatureClassifier(net)


def test_classifier_not_called_in_forward():
    class Skips(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(4, 4)
            self.unused = nn.Linear(4, 2)

        def forward(self, x):
            return self.body(x)

    with pytest.raises(InputError, match="was not called"):
        FeatureClassifier(Skips())(torch.zeros(2, 4))


@pytest.mark.parametrize(
    ("output", "needle"),
    [
        (lambda y: (y, y), "returns a tuple for a batch of 2"),
        (lambda y: y[:1], "of shape [1, 3] for a batch of 2"),  # a dropped row would drop a record
        (lambda y: y.unsqueeze(1), "of shape [2, 1, 3]"),
        (lambda y: y.long(), "torch.int64 of shape [2, 3]"),
    ],
)
def test_a_forward_that_does_not_return_logits_is_named(output, needle):
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            return output(self.fc(x))

    with pytest.raises(InputError, match=re.escape(needle) + ".*not float logits"):
        FeatureClassifier(Odd())(torch.zeros(2, 4))


def test_features_that_are_not_pooled():
    net = nn.Sequential(nn.Linear(4, 3))
    with pytest.raises(InputError, match=r"shape \(2, 5, 4\)"):
        FeatureClassifier(net)(torch.zeros(2, 5, 4))


# --- building ----------------------------------------------------------------------


def test_factory_from_file_path():
    net = build_model(TINY_NET)
    assert type(net).__name__ == "TinyNet"
    assert build_model(TINY_NET, num_classes=4).head[3].out_features == 4


def test_factory_from_module_path():
    net = build_model("tiny_net:build", num_classes=7)
    assert isinstance(net, tiny_net.TinyNet) and net.head[3].out_features == 7
    assert build_model("tiny_net:build_rgb").stem[0].in_channels == 3


def test_factory_returning_a_non_module():
    with pytest.raises(InputError, match="returned int, not a torch nn.Module"):
        build_model("tiny_net:not_a_module")


@pytest.mark.parametrize(
    "spec, pattern",
    [
        ("tiny_net:missing_function", "has no function missing_function"),
        ("no_such_module_xyz:build", "could not import no_such_module_xyz"),
        ("/nowhere/net.py:build", "no such file"),
    ],
)
def test_bad_factories(spec, pattern):
    with pytest.raises(InputError, match=pattern):
        build_model(spec)


def test_factory_that_raises(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("def build():\n    raise ValueError('bad width')\n")
    with pytest.raises(InputError, match=r"build\(\) failed \(ValueError: bad width\)"):
        build_model(f"{path}:build")
    path.write_text("this is not python\n")
    with pytest.raises(InputError, match="could not import"):
        build_model(f"{path}:build")
    # a script that exits (argparse at import): exit 0 would tell a pipeline the run succeeded
    path.write_text("import sys\nsys.exit(0)\ndef build():\n    pass\n")
    with pytest.raises(InputError, match=r"importing .*broken.py called sys.exit\(0\)"):
        build_model(f"{path}:build")
    path.write_text("import sys\ndef build():\n    sys.exit(0)\n")
    with pytest.raises(InputError, match=r"build\(\) failed \(SystemExit"):
        build_model(f"{path}:build")


def test_malformed_factory_spec():
    with pytest.raises(
        UsageError,
        match=r"^`model` tiny_net:not-an-identifier: expected 'path/to/file\.py:function' or "
        r"'package\.module:function'$",
    ):
        build_model("tiny_net:not-an-identifier")


def test_unknown_architecture():
    with pytest.raises(UsageError, match="unknown architecture.*did you mean.*resnet1"):
        build_model("ResNet")
    for typo in ("resnt50", "resnet-50", "resnet50x"):
        with pytest.raises(UsageError, match=r"unknown architecture \(did you mean resnet50[,?]"):
            build_model(typo)
    with pytest.raises(UsageError, match="unknown architecture;"):
        build_model("definitely_not_a_model")


# --- weights -----------------------------------------------------------------------


def reference_state(seed=1) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return tiny_net.build().state_dict()


def assert_loaded(wrapped: FeatureClassifier, state: dict[str, torch.Tensor]):
    loaded = wrapped.model.state_dict()
    assert set(loaded) == set(state)
    for key, value in state.items():
        assert torch.equal(loaded[key], value), key


@pytest.mark.parametrize(
    "fmt",
    [
        "safetensors",
        "safetensors-named-pth",
        "SAFETENSORS",
        "pt",
        "state_dict",
        "model",
        "module_prefix",
        "wrapped_module_prefix",
        "pth",
    ],
)
def test_weights_formats(tmp_path, fmt):
    """The bytes decide the format, not the name: a .pth that is safetensors loads too."""
    state = reference_state()
    names = {
        "safetensors": "w.safetensors",
        "safetensors-named-pth": "w.pth",
        "SAFETENSORS": "W.SAFETENSORS",
        "pth": "w.pth",
    }
    path = tmp_path / names.get(fmt, "w.pt")
    prefixed = {f"module.{k}": v for k, v in state.items()}
    if fmt.lower().startswith("safetensors"):
        save_file(state, str(path))
    else:
        payload = {
            "pt": state,
            "pth": state,
            "state_dict": {"state_dict": state, "epoch": 3},
            "model": {"model": state, "optimizer": {"lr": 0.1}},
            "module_prefix": prefixed,
            "wrapped_module_prefix": {"state_dict": prefixed},
        }[fmt]
        torch.save(payload, path)
    wrapped, spec = resolve(TINY_NET, str(path))
    assert_loaded(wrapped, state)
    assert not wrapped.training
    assert spec.weights == str(path.resolve())
    assert spec.weights_sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert spec.classifier == "head.3" and spec.model == TINY_NET


def test_relative_factory_path_is_recorded_absolutely(tmp_path, monkeypatch):
    (tmp_path / "net.py").write_text(Path(tiny_net.__file__).read_text())
    monkeypatch.chdir(tmp_path)
    _, spec = resolve("net.py:build")
    assert spec.model == f"{tmp_path.resolve() / 'net.py'}:build"
    monkeypatch.chdir(tmp_path.parent)
    assert type(build_model(spec.model)).__name__ == "TinyNet", "the recorded spec rebuilds from another folder"
    _, spec = resolve("tiny_net:build")
    assert spec.model == "tiny_net:build", "module paths stay as given"


def test_random_init_differs_from_loaded_weights(tmp_path):
    """Guards the loading tests: a fresh build is not accidentally equal to the saved state."""
    state = reference_state(seed=1)
    torch.manual_seed(2)
    wrapped, spec = resolve(TINY_NET)
    assert spec.weights is None and spec.weights_sha256 is None
    assert not torch.equal(wrapped.model.state_dict()["head.3.weight"], state["head.3.weight"])


def test_mismatched_keys_name_missing_and_unexpected(tmp_path):
    state = reference_state()
    state["head.9.weight"] = state.pop("head.3.weight")
    path = tmp_path / "w.pt"
    torch.save(state, path)
    with pytest.raises(InputError, match="keys do not match") as info:
        resolve(TINY_NET, str(path))
    message = str(info.value)
    assert "missing head.3.weight" in message
    assert "unexpected head.9.weight" in message


def test_weights_without_batchnorm_step_counters_load(tmp_path):
    """Old torchvision and converted checkpoints have no num_batches_tracked; nothing else may be missing."""
    state = {k: v for k, v in reference_state().items() if not k.endswith("num_batches_tracked")}
    path = tmp_path / "w.pt"
    torch.save(state, path)
    wrapped, _ = resolve(TINY_NET, str(path))
    assert all(torch.equal(wrapped.model.state_dict()[k], v) for k, v in state.items())
    del state["stem.1.running_var"]
    torch.save(state, path)
    with pytest.raises(InputError, match="missing stem.1.running_var;"):
        resolve(TINY_NET, str(path))


def test_the_parameter_fingerprint_follows_the_values_not_the_file():
    from cafa_cli.model.loading import parameters_sha256

    torch.manual_seed(0)
    net = tiny_net.build()
    before = parameters_sha256(net)
    net.stem[1].num_batches_tracked += 5  # a step counter, not a feature
    assert parameters_sha256(net) == before
    with torch.no_grad():
        net.stem[1].running_mean[0] += 1e-6
    assert parameters_sha256(net) != before


class _WithExtraState(nn.Module):
    """A module whose state_dict holds a non-tensor (get_extra_state) and an integer buffer."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor([1.5, -2.0], dtype=torch.float32))
        self.register_buffer("index", torch.tensor([[3, 1]], dtype=torch.int64))
        self.register_buffer("step", torch.tensor(0.25, dtype=torch.float64))
        self.bn = nn.BatchNorm1d(1)

    def get_extra_state(self):
        return {"note": "not a tensor"}

    def set_extra_state(self, state):
        pass


def test_the_parameter_fingerprint_is_the_documented_digest():
    """docs/reference/artifact-format.md, written out independently: name order, the header line, little-endian bytes."""
    from cafa_cli.model.loading import parameters_sha256

    module = _WithExtraState()
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        if not isinstance(tensor, torch.Tensor) or name.endswith("num_batches_tracked"):
            continue
        dtype = {torch.float32: "float32", torch.float64: "float64", torch.int64: "int64"}[tensor.dtype]
        digest.update(f"{name} {dtype} [{','.join(map(str, tensor.shape))}]\n".encode())
        digest.update(tensor.numpy().astype(tensor.numpy().dtype.newbyteorder("<")).tobytes())
    assert parameters_sha256(module) == digest.hexdigest()
    # pinned: artifacts already written carry this scheme, so any change to it must be a new field
    assert digest.hexdigest() == "00fefae0983c027ddb488dbd2fc9b826a25b240c5a20c524733c8404ce9a68ba"
    with torch.no_grad():  # integer buffers count: they can change what a model computes
        module.index[0, 0] = 4
    assert parameters_sha256(module) != digest.hexdigest()


def test_mismatched_shapes(tmp_path):
    path = tmp_path / "w.pt"
    torch.save(reference_state(), path)
    with pytest.raises(InputError, match=r"shapes do not match.*head\.3\.weight \(3, 6\) vs \(5, 6\)"):
        resolve(TINY_NET, str(path), num_classes=5)


def test_pickled_objects_are_refused_unless_trusted(tmp_path):
    state = reference_state()
    path = tmp_path / "w.pt"
    torch.save({"state_dict": state, "args": argparse.Namespace(lr=0.1)}, path)
    with pytest.raises(InputError, match="`trust_checkpoint`"):
        resolve(TINY_NET, str(path))
    wrapped, _ = resolve(TINY_NET, str(path), trust_checkpoint=True)
    assert_loaded(wrapped, state)


def test_whole_pickled_module_needs_trust(tmp_path):
    torch.manual_seed(1)
    module = tiny_net.build()
    path = tmp_path / "whole.pt"
    torch.save(module, path)
    with pytest.raises(InputError, match="`trust_checkpoint`"):
        read_state_dict(path)
    state = read_state_dict(path, trust_checkpoint=True)
    assert torch.equal(state["head.3.weight"], module.head[3].weight)


@pytest.mark.parametrize("name", ["w.pt", "w.safetensors", "w.pth"])
def test_html_page_as_weights(tmp_path, name):
    path = tmp_path / name
    path.write_text("<!DOCTYPE html>\n<html><head><title>Download</title></head></html>")
    with pytest.raises(InputError, match="web page"):
        read_state_dict(path)


# read as pickle opcodes, each first byte fails its own way inside torch.load: UnpicklingError,
# KeyError (b"hello"), IndexError (b"}", b"\\x80"), struct.error (b"G"), ValueError (b"F"),
# MemoryError (b"\\x8d": a garbage length), and b"c" reads as an unsupported "global"
GARBAGE = {
    "binary": bytes(range(256)) * 4,
    "text": b"404 Not Found\n",
    "empty": b"",
    "hello": b"hello\n",
    "brace": b"}hello\n",
    "proto": b"\x80hello\n",
    "mark": b"(ababab",
    "double": b"G",
    "float": b"Fhello\n",
    "length": b"\x8d" + bytes(range(256)),
    "cat": b"cat: weights.pt: No such file or directory\n",
}


@pytest.mark.parametrize("trust", [False, True], ids=["safe", "trusted"])
@pytest.mark.parametrize("name", ["w.pt", "w.safetensors"])
@pytest.mark.parametrize("data", GARBAGE.values(), ids=GARBAGE.keys())
def test_garbage_weights_are_not_a_checkpoint(tmp_path, name, data, trust):
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(
        InputError, match=r"`weights` .*: (this is not a checkpoint torch can read \(|not a readable safetensors)"
    ) as info:
        read_state_dict(path, trust_checkpoint=trust)
    assert "trust_checkpoint" not in str(info.value), "trusting garbage cannot help"
    assert "\n" not in str(info.value)


def test_struct_error_is_named_with_its_module(tmp_path):
    path = tmp_path / "w.pt"
    path.write_bytes(b"G")
    with pytest.raises(InputError, match=r"not a checkpoint torch can read \(struct\.error\)$"):
        read_state_dict(path)


@pytest.mark.parametrize("name", ["w.pt", "w.safetensors", "w.pth"])
def test_git_lfs_pointer_as_weights(tmp_path, name):
    path = tmp_path / name
    path.write_text(
        "version https://git-lfs.github.com/spec/v1\n"
        "oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\n"
        "size 44605184\n"
    )
    with pytest.raises(InputError) as info:
        read_state_dict(path)
    assert str(info.value) == (
        f"`weights` {path}: this is a Git LFS pointer, not the weights (the clone did not fetch them); "
        f"run git lfs pull in that repository, or download the file itself"
    )


def test_pickled_module_whose_code_is_gone(tmp_path, monkeypatch):
    """A trusted whole-model pickle names the module it needs, not 'not a checkpoint'."""
    (tmp_path / "gone_net.py").write_text("import torch\nclass Net(torch.nn.Linear):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import gone_net

    path = tmp_path / "whole.pt"
    torch.save(gone_net.Net(2, 2), path)
    (tmp_path / "gone_net.py").unlink()
    monkeypatch.delitem(__import__("sys").modules, "gone_net")
    with pytest.raises(InputError) as info:
        read_state_dict(path, trust_checkpoint=True)
    assert str(info.value) == (
        f"`weights` {path}: the checkpoint pickles objects whose code is not importable here (No module named 'gone_net'); "
        f"where that code is, re-save the weights with torch.save(model.state_dict(), ...)"
    )


def test_truncated_checkpoint(tmp_path):
    path = tmp_path / "w.pt"
    torch.save(reference_state(), path)
    path.write_bytes(path.read_bytes()[:300])
    with pytest.raises(InputError, match="not a checkpoint torch can read"):
        read_state_dict(path)


def test_legacy_format_pickle_with_objects_needs_trust(tmp_path):
    state = reference_state()
    path = tmp_path / "legacy.pt"
    torch.save({"model": state, "args": argparse.Namespace(lr=0.1)}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(InputError, match="`trust_checkpoint`") as info:
        read_state_dict(path)
    assert "\n" not in str(info.value)
    loaded = read_state_dict(path, trust_checkpoint=True)
    assert torch.equal(loaded["head.3.weight"], state["head.3.weight"])


def test_weights_that_are_not_a_state_dict(tmp_path):
    path = tmp_path / "w.pt"
    torch.save([torch.zeros(2)], path)
    with pytest.raises(InputError, match="expected a state_dict"):
        read_state_dict(path)


def test_missing_weights_file(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        read_state_dict(tmp_path / "absent.pt")


# --- devices -----------------------------------------------------------------------


def test_pick_device_cpu_and_auto():
    assert pick_device("cpu") == torch.device("cpu")
    assert pick_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_cuda_is_a_usage_error(device):
    with pytest.raises(UsageError, match="CUDA is not available"):
        pick_device(device)


@pytest.mark.parametrize("device", ["tpu", "gpu", "mps"])
def test_unknown_device_is_a_usage_error(device):
    with pytest.raises(UsageError, match="`device` "):
        pick_device(device)


def test_a_linear_that_does_not_make_the_logits_is_named():
    wrapped = FeatureClassifier(tiny_net.build(), "head.1")  # 16 -> 6, before the 6 -> 3 classifier
    with pytest.raises(
        InputError, match="returns 3 logits but head.1 has 6 outputs, so it is not the layer that makes the logits"
    ):
        wrapped(small_images(channels=1, size=16))


def test_images_of_another_dtype_than_the_weights_are_named():
    wrapped = FeatureClassifier(tiny_net.build()).eval()
    with pytest.raises(InputError, match="the images are torch.float64 but the model's weights are torch.float32"):
        wrapped(small_images(channels=1, size=16).double())


# --- through the CLI (from test_errors.py) -------------------------------------------


def test_factory_file_missing(setup, tmp_path):
    fails(stats_with_model(setup, tmp_path, f"{tmp_path / 'absent.py'}:build"), 3, "no such file")


@pytest.mark.parametrize(
    "location, what", [("folder", "is a folder"), ("net.txt", "is not a .py file"), ("nowhere/net", "is no such file")]
)
def test_a_factory_path_that_is_no_python_file_is_named_so(setup, tmp_path, monkeypatch, location, what):
    """`--model ./dir:build` gave importlib's TypeError about relative imports."""
    (tmp_path / "folder").mkdir()
    (tmp_path / "net.txt").write_text("def build(): pass\n")
    monkeypatch.chdir(tmp_path)
    fails(
        stats_with_model(setup, tmp_path, f"./{location}:build"),
        3,
        f"--model ./{location}:build: ./{location} {what}; give 'path/to/file.py:function'",
    )


def test_factory_that_does_not_import(setup, tmp_path):
    spec = factory(tmp_path, "import a_package_that_is_not_installed\n\ndef build():\n    return tiny_net.build()")
    fails(
        stats_with_model(setup, tmp_path, spec),
        3,
        "could not import",
        "ModuleNotFoundError",
        "a_package_that_is_not_installed",
    )


def test_factory_that_does_not_return_a_module(setup, tmp_path):
    fails(
        stats_with_model(setup, tmp_path, f"{ASSETS / 'tiny_net.py'}:not_a_module"),
        3,
        "returned int, not a torch nn.Module",
    )


@pytest.mark.parametrize("count", ["0", "-3"])
def test_num_classes_below_one(setup, tmp_path, count):
    result = invoke(
        "stats",
        "--model",
        "resnet18",
        "--num-classes",
        count,
        "--data",
        setup["train"],
        "--out",
        tmp_path / "s.safetensors",
    )
    fails(result, 2, f"--num-classes must be at least 1, not {count}")
