"""An adapted network leaves as ONNX (issue 62): `cafa adapt --export net.onnx` and
Adapter.export_onnx write torch's export of Adapter.export()'s network, the batch size free and
the model's preprocessing in the metadata; ONNX Runtime on the CPU predicts as that network."""

from __future__ import annotations

import copy
import json
import sys

import pytest
import torch
from test_class_subset import subset_setup  # noqa: F401  (a 4-output net, an artifact of 2 of its classes)
from test_cli_adapt import setup  # noqa: F401  (its trained net, artifact and shifted test folder)

from cafa_cli.core.errors import CafaError, UsageError
from cafa_cli.data.preprocessing import Preprocessing
from cafa_cli.engine.adapter import Adapter
from cafa_cli.methods import create
from cafa_cli.model.features import FeatureClassifier

ort = pytest.importorskip("onnxruntime", reason="the `onnx` extra (pip install 'cafa-cli[onnx]') is not installed")

# float32 on the CPU: the graph's kernels are ONNX Runtime's, not torch's, and sum in another
# order (each BatchNorm folded into the convolution before it); measured at most 3.8e-6 (the
# CNN, logits up to 10.4) and 2.1e-7 (the ViT, logits up to 0.34) at batches of 1, 7 and all
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def run_onnx(path, images: torch.Tensor) -> torch.Tensor:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return torch.from_numpy(session.run(["logits"], {"images": images.numpy()})[0])


def metadata_of(path) -> dict[str, str]:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).get_modelmeta().custom_metadata_map


def adapted_cnn(trained) -> tuple[Adapter, torch.Tensor]:
    """The tiny BatchNorm CNN after TENT's stream: its exported BatchNorms hold the statistics the stream arrived at."""
    model, _, x, _ = trained
    adapter = Adapter(copy.deepcopy(model), create("tent"), "cpu", lr=1e-2)
    for batch in x.split(50):
        adapter.step(batch)
    return adapter, x


def adapted_vit(trained) -> tuple[Adapter, torch.Tensor]:
    """timm's tiny test ViT (LayerNorms, no BatchNorm) after two TENT steps on its 32-pixel images."""
    timm = pytest.importorskip("timm", reason="the small ViT is timm's test_vit")
    torch.manual_seed(0)
    vit = timm.create_model("test_vit", img_size=32, num_classes=3)
    adapter = Adapter(FeatureClassifier(vit), create("tent"), "cpu", optimizer="sgd", lr=0.01)
    x = torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    for batch in x.split(8):
        adapter.step(batch)
    return adapter, x


@pytest.mark.parametrize("adapted", [adapted_cnn, adapted_vit], ids=["batchnorm-cnn", "vit"])
def test_onnx_runtime_predicts_as_the_exported_network_at_any_batch_size(trained, adapted, tmp_path):
    adapter, x = adapted(trained)
    served = adapter.export()
    path = tmp_path / "net.onnx"
    adapter.export_onnx(path, x[:1])
    for size in (1, 7):  # traced on a batch of two: the batch size is free
        with torch.no_grad():
            expected = served(x[:size])
        got = run_onnx(path, x[:size])
        torch.testing.assert_close(got, expected, **TOLERANCE)
        assert torch.equal(got.argmax(1), expected.argmax(1))
    # no statistic of the batch's: an image alone is predicted as inside a batch, as a server feeds them
    alone = torch.cat([run_onnx(path, image[None]) for image in x[:7]])
    torch.testing.assert_close(alone, run_onnx(path, x[:7]), **TOLERANCE)
    batch = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).get_inputs()[0]
    assert batch.name == "images" and batch.shape == ["batch", *x.shape[1:]]


def test_the_metadata_holds_the_preprocessing_and_class_names_a_serving_stack_applies(trained, tmp_path):
    adapter, _ = adapted_cnn(trained)
    preprocessing = Preprocessing(resize=20, crop=16, mean=(0.5,), std=(0.25,), channels=1, interpolation="bicubic")
    path = tmp_path / "net.onnx"
    adapter.export_onnx(path, preprocessing=preprocessing, class_names=["a", "b", "c"], metadata={"note": "mine"})
    metadata = metadata_of(path)
    assert json.loads(metadata["preprocessing"]) == {
        "resize": 20, "crop": 16, "interpolation": "bicubic", "channels": 1, "mean": [0.5], "std": [0.25]
    }  # fmt: skip
    assert json.loads(metadata["class_names"]) == ["a", "b", "c"] and metadata["note"] == "mine"
    assert Preprocessing.from_dict(json.loads(metadata["preprocessing"])) == preprocessing
    rgb = Preprocessing(resize=None, crop=8, mean=(0.5,), std=(0.2,), channels=3)  # one value given for three channels
    assert json.loads(cafa_metadata(rgb)["preprocessing"])["mean"] == [0.5, 0.5, 0.5]


def cafa_metadata(preprocessing: Preprocessing) -> dict[str, str]:
    from cafa_cli.engine.serving import serving_metadata

    return serving_metadata(preprocessing, None)


def test_the_python_api_refuses_what_it_cannot_export_in_one_line(trained, tmp_path, capsys):
    adapter, x = adapted_cnn(trained)
    path = tmp_path / "net.onnx"
    with pytest.raises(UsageError, match="the ONNX graph takes images of one size: give an `example`"):
        adapter.export_onnx(path)  # neither an example nor a crop
    model, gaussians, _, _ = trained
    for name in ("lame", "t3a"):  # the very message of export()
        refused = Adapter(copy.deepcopy(model), create(name, gaussians, "cpu"), "cpu")
        with pytest.raises(UsageError) as plain:
            refused.export()
        with pytest.raises(UsageError) as onnx:
            refused.export_onnx(path, x[:1])
        assert str(onnx.value) == str(plain.value) and f"{name} predicts with more than its network" in str(plain.value)

    class Branching(torch.nn.Module):  # a branch on the data's values, which torch.export cannot trace
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x

    branching = torch.nn.Sequential(Branching(), torch.nn.Flatten(), torch.nn.Linear(4, 3))
    wrapped = Adapter(FeatureClassifier(branching), create("source"), "cpu")
    capsys.readouterr()
    with pytest.raises(
        CafaError, match=r"cannot trace this network \(GuardOnDataDependentSymNode: Could not guard on "
    ):
        wrapped.export_onnx(path, torch.ones(1, 1, 2, 2))
    assert capsys.readouterr() == ("", "")  # the exporter's pages on its tries: not shown
    assert not path.exists() and not list(tmp_path.iterdir())  # nothing half-written


def test_cafa_adapt_export_onnx_predicts_as_the_safetensors_export_of_the_same_run(setup, tmp_path):
    import tiny_net
    from helpers import adapt
    from safetensors.torch import load_file

    onnx, state = tmp_path / "served.onnx", tmp_path / "served.safetensors"
    runs = [adapt(setup, setup["test"], "--method", "tent", "-q", "--export", path) for path in (onnx, state)]
    assert all(run.exit_code == 0 for run in runs), [run.stderr for run in runs]
    assert runs[0].stdout == runs[1].stdout and runs[0].stderr == ""  # the records only: no word of the exporter
    net = tiny_net.build().eval()
    net.load_state_dict(load_file(state))
    x = torch.rand(5, 1, 16, 16) * 4 - 2
    with torch.no_grad():
        torch.testing.assert_close(run_onnx(onnx, x), net(x), **TOLERANCE)
    metadata = metadata_of(onnx)
    assert json.loads(metadata["class_names"]) == ["a", "b", "c"]
    assert json.loads(metadata["preprocessing"])["crop"] is None  # the artifact's: images as they are, 16 x 16
    assert metadata["format"] == "cafa-export" and metadata["method"] == "tent"
    assert json.loads(metadata["settings"])["norm"] == metadata["norm"]


def test_cafa_adapt_export_onnx_refusals_are_those_of_the_safetensors_export(setup, tmp_path):
    """A method that predicts with more than its network, a folder that does not exist: the same
    line and exit code whatever the format, before any record; a suffix of no format is refused."""
    from helpers import adapt, fails

    def refusal(path, *method):
        result = adapt(setup, setup["test"], *(method or ("--method", "tent")), "--export", path)
        assert result.stdout == "" and not path.exists()
        return result.exit_code, result.stderr.replace(str(path), "PATH")

    for where in (tmp_path, tmp_path / "missing"):
        assert refusal(where / "x.onnx", "--method", "lame") == refusal(where / "x.safetensors", "--method", "lame")
    code, message = refusal(tmp_path / "missing" / "x.onnx")
    assert (code, message) == refusal(tmp_path / "missing" / "x.safetensors") and code == 3, message
    fails(
        adapt(setup, setup["test"], "--method", "tent", "--export", tmp_path / "net.pt"),
        2,
        f"--export {tmp_path / 'net.pt'}: its suffix says the format, .safetensors (a state dict of the model's "
        f"architecture) or .onnx",
    )


def test_without_onnx_installed_the_error_names_the_extra_before_any_record(setup, tmp_path, monkeypatch):
    from helpers import adapt, fails

    monkeypatch.setitem(sys.modules, "onnxscript", None)  # import onnxscript now raises ImportError
    path = tmp_path / "net.onnx"
    result = adapt(setup, setup["test"], "--method", "tent", "--export", path)
    fails(
        result,
        2,
        f"--export {path} needs onnx and onnxscript (onnxscript is not installed): pip install 'cafa-cli[onnx]'",
    )
    assert result.stdout == "" and not path.exists()


def test_weights_over_protobufs_two_gib_are_refused_before_any_record(setup, tmp_path, monkeypatch):
    from helpers import adapt, fails

    from cafa_cli.engine import serving

    monkeypatch.setattr(serving, "ONNX_MAX_BYTES", 1000)  # the tiny net's weights stand in for a 2 GiB network
    path = tmp_path / "net.onnx"
    result = adapt(setup, setup["test"], "--method", "tent", "--export", path)
    fails(result, 2, f"--export {path}: the network's 0.0 GiB of weights do not fit one ONNX file (2 GiB at most)")
    assert result.stdout == "" and not path.exists()


def test_with_a_class_subset_the_metadata_names_the_outputs_predicted_among(subset_setup, tmp_path):
    """The graph gives all the model's outputs; `class_subset` says which of them cafa predicted
    among: the source model's records are those of the graph's logits narrowed to them."""
    from helpers import rows
    from PIL import Image
    from test_class_subset import adapt

    path = tmp_path / "net.onnx"
    result = adapt(subset_setup, subset_setup["sub"], "--method", "source", "--export", path)
    assert result.exit_code == 0, result.stderr
    metadata = metadata_of(path)
    subset = json.loads(metadata["class_subset"])
    assert subset == {"outputs": [0, 2], "class_names": ["apple", "cherry"]} and "class_names" not in metadata
    preprocessing = Preprocessing.from_dict(json.loads(metadata["preprocessing"]))
    records = rows(result)
    images = torch.stack([preprocessing.normalize(preprocessing.pixels(Image.open(r["path"]))) for r in records])
    logits = run_onnx(path, images)
    assert logits.shape == (len(records), 4)
    served = [subset["class_names"][i] for i in logits[:, subset["outputs"]].argmax(1)]
    assert served == [r["prediction"] for r in records]
