"""The public loader of docs/reference/python-api.md: `load_model` gives the model the command line
runs, already wrapped, and `model_spec` records it as `cafa stats` does."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_NET

from cafa_cli.core.errors import CafaError, InputError, UsageError
from cafa_cli.model.features import FeatureClassifier
from cafa_cli.model.loading import load_model, model_spec, resolve
from cafa_cli.model.zoo import load_bundled


def test_the_bundled_model_loads_with_its_packaged_weights_as_the_internal_path_gives_it():
    model = load_model("fmnist-resnet")
    assert isinstance(model, FeatureClassifier) and not model.training
    assert model.num_classes == 10 and model.classifier_name == "fc"
    assert all(p.device.type == "cpu" for p in model.parameters())
    images = torch.randn(8, 1, 28, 28, generator=torch.Generator().manual_seed(0))  # a Fashion-MNIST batch
    internal = FeatureClassifier(load_bundled("fmnist-resnet")).eval()
    with torch.no_grad():
        logits, features = model(images)
        expected_logits, expected_features = internal(images)
    assert torch.equal(logits, expected_logits) and torch.equal(features, expected_features)
    assert model_spec(model, "fmnist-resnet") == resolve("fmnist-resnet")[1]  # as cafa stats records it


def test_a_factory_with_a_weights_file_loads_and_is_recorded_as_the_command_line_records_it(tiny_weights):
    model = load_model(TINY_NET, str(tiny_weights), classifier="head.3", model_args={"num_classes": 3})
    assert model.classifier_name == "head.3"
    net, spec = resolve(TINY_NET, str(tiny_weights), classifier="head.3", model_args={"num_classes": 3})
    assert model_spec(model, TINY_NET, str(tiny_weights), num_classes=3) == spec
    assert spec.classifier == "head.3" and spec.weights_sha256 is not None
    for mine, theirs in zip(model.state_dict().values(), net.state_dict().values(), strict=True):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize(
    ("arguments", "error", "fix"),
    [
        ({"model": "fmnist-resnt"}, UsageError, "did you mean fmnist-resnet"),
        ({"model": "resnet18"}, UsageError, "give `weights` FILE"),  # random weights, as the CLI refuses
        ({"model": "fmnist-resnet", "weights": "missing.safetensors"}, InputError, "no such file"),
        ({"model": "fmnist-resnet", "num_classes": 5}, UsageError, "has 10 outputs"),
        ({"model": "fmnist-resnet", "classifier": "head"}, UsageError, "linear layers: fc"),
        ({"model": TINY_NET, "model_args": {"act": object()}}, UsageError, "not a Python literal"),
    ],
)
def test_a_model_that_cannot_load_is_a_one_line_cafa_error_naming_the_fix(arguments, error, fix):
    with pytest.raises(error) as raised:
        load_model(**arguments)
    assert isinstance(raised.value, CafaError)
    assert fix in str(raised.value) and "\n" not in str(raised.value)


def test_model_spec_takes_the_wrapped_model():
    with pytest.raises(UsageError, match=r"FeatureClassifier\(net\)"):
        model_spec(load_bundled("fmnist-resnet"), "fmnist-resnet")


def test_paths_and_wrong_objects_get_cafa_errors_not_python_ones(tiny_weights, tmp_path):
    """A pathlib.Path where a path goes (read_artifact took one, load_model did not); a missing
    weights file, an unknown method's options, an artifact where its gaussians go and a model
    wrapped twice each get one CafaError that names the fix."""
    from pathlib import Path

    from cafa_cli.methods import create, options_of
    from cafa_cli.statistics.gaussians import ClassGaussians

    model = load_model(TINY_NET, Path(tiny_weights), model_args={"num_classes": 3})
    spec = model_spec(model, TINY_NET, Path(tiny_weights), num_classes=3)
    assert spec == model_spec(model, TINY_NET, str(tiny_weights), num_classes=3)
    with pytest.raises(InputError, match=r"`weights` .*nowhere\.pt: no such file"):
        model_spec(model, TINY_NET, tmp_path / "nowhere.pt", num_classes=3)
    with pytest.raises(UsageError, match="no built-in method 'nope'; the methods: source"):
        options_of("nope")

    class Artifact:  # what read_artifact returns, as far as create can tell
        gaussians: ClassGaussians | None = None

    with pytest.raises(UsageError, match=r"create\('cafa', artifact.gaussians\)"):
        create("cafa", Artifact())
    with pytest.raises(UsageError, match="a FeatureClassifier already"):
        FeatureClassifier(model)


def test_select_classes_names_rows_outside_the_statistics():
    from cafa_cli.statistics.gaussians import estimate
    from cafa_cli.statistics.moments import ClassMoments

    moments = ClassMoments(3, 2)
    moments.update(torch.randn(30, 2, generator=torch.Generator().manual_seed(0)), torch.arange(30) % 3)
    gaussians = estimate(moments, covariance="diag", shrinkage=0.1)
    assert torch.equal(gaussians.select_classes([2, 0]).means, gaussians.means[[2, 0]])
    with pytest.raises(UsageError, match=r"^select_classes takes class rows 0 to 2, not 3, -1$"):
        gaussians.select_classes([0, 3, -1])
