"""model/checkpoints.py through the CLI: weights files that are refused, and never unpickled unless trusted."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
from conftest import TINY_NET, invoke
from helpers import fails, stats_with_model


def test_weights_that_are_a_folder_are_named_so(setup):
    fails(
        invoke("adapt", "--model", TINY_NET, "--weights", setup["root"], "--method", "source", setup["train"]),
        3,
        "a folder; give the weights file in it",
    )


def test_weights_whose_keys_do_not_match(setup, tmp_path):
    state = torch.load(setup["weights"])
    state["head.9.weight"] = state.pop("head.3.weight")
    weights = tmp_path / "renamed.pt"
    torch.save(state, weights)
    fails(
        stats_with_model(setup, tmp_path, TINY_NET, "--weights", weights),
        3,
        "keys do not match",
        "missing head.3.weight",
        "unexpected head.9.weight",
    )


@pytest.mark.parametrize("kind", ["sparse", "meta", "complex"])
def test_weights_that_are_not_dense_real_tensors(setup, tmp_path, kind):
    state = torch.load(setup["weights"])
    key = "head.3.weight"
    state[key] = {
        "sparse": lambda t: t.to_sparse(),
        "meta": lambda t: t.to("meta"),
        "complex": lambda t: t.to(torch.complex64),
    }[kind](state[key])
    weights = tmp_path / f"{kind}.pt"
    torch.save(state, weights)
    result = stats_with_model(setup, tmp_path, TINY_NET, "--weights", weights)
    fails(result, 3, f"{key} ({kind}", "not a dense real tensor")
    assert "UserWarning" not in result.stderr


class Payload:
    """Creates a marker file when unpickled: the test fails if that file ever appears."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("how", ["torch.save", "pickle.dump"])
def test_checkpoint_carrying_code_is_refused_and_never_runs(setup, tmp_path, how):
    marker = tmp_path / "payload-ran"
    state = {**torch.load(setup["weights"]), "extra": Payload(marker)}
    weights = tmp_path / "evil.pt"
    if how == "torch.save":
        torch.save(state, weights)
        needles = ("--trust-checkpoint", "arbitrary code")
    else:
        with open(weights, "wb") as f:
            pickle.dump(state, f, protocol=5)
        needles = ("plain Python pickle, not a torch checkpoint", "arbitrary code")
    fails(stats_with_model(setup, tmp_path, TINY_NET, "--weights", weights), 3, str(weights), *needles)
    assert not marker.exists(), "the checkpoint's code ran"
    if how == "pickle.dump":  # trusted, it is unpickled: the error must not suggest that nothing ran
        fails(
            stats_with_model(setup, tmp_path, TINY_NET, "--weights", weights, "--trust-checkpoint"),
            3,
            "--trust-checkpoint unpickled it, so any code it carries has run",
        )
        assert marker.exists()


@pytest.mark.parametrize("name", ["net.pt", "net.safetensors"])
def test_html_page_saved_as_a_checkpoint(setup, tmp_path, name):
    weights = tmp_path / name
    weights.write_text("<!DOCTYPE html>\n<html><head><title>Sign in</title></head><body></body></html>\n")
    fails(stats_with_model(setup, tmp_path, TINY_NET, "--weights", weights), 3, "this is a web page, not a checkpoint")


@pytest.mark.parametrize("data", [b"404 Not Found\n", bytes(range(256)) * 8], ids=["text", "binary"])
def test_other_non_checkpoint(setup, tmp_path, data):
    weights = tmp_path / "net.pt"
    weights.write_bytes(data)
    message = fails(
        stats_with_model(setup, tmp_path, TINY_NET, "--weights", weights), 3, "not a checkpoint torch can read"
    )
    assert "--trust-checkpoint" not in message, "trusting garbage cannot help"


def test_a_zip_checkpoint_that_would_expand_a_thousandfold_is_refused_before_it_is_read(setup, tmp_path):
    """Issue 18, bug 4, for the other compressed input: torch.load reads deflated zip entries
    and allocates what they announce, so 64 MB of zeros in 70 KB would load."""
    import zipfile

    plain = tmp_path / "plain.pt"
    torch.save({**torch.load(setup["weights"]), "zeros": torch.zeros(1 << 24)}, plain)
    bomb = tmp_path / "bomb.pt"
    with zipfile.ZipFile(plain) as source, zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as packed:
        for entry in source.infolist():
            packed.writestr(entry.filename, source.read(entry.filename))
    assert bomb.stat().st_size < 200_000 and torch.load(bomb)["zeros"].numel() == 1 << 24  # torch itself reads it
    fails(
        stats_with_model(setup, tmp_path, TINY_NET, "--weights", bomb),
        3,
        f"--weights {bomb}: a zip archive whose compressed entries would expand",
        "torch.save stores tensors uncompressed",
    )
    deflated = tmp_path / "deflated.pt"  # real weights deflated by hand expand little, and load
    with (
        zipfile.ZipFile(setup["weights"]) as source,
        zipfile.ZipFile(deflated, "w", compression=zipfile.ZIP_DEFLATED) as packed,
    ):
        for entry in source.infolist():
            packed.writestr(entry.filename, source.read(entry.filename))
    result = stats_with_model(setup, tmp_path, TINY_NET, "--weights", deflated)
    assert result.exit_code == 0, result.stderr
    from cafa_cli.artifact.store import read_artifact

    # the same parameters as the plain file's (whose statistics the setup made): the deflated entries were read whole
    made, plain_artifact = (
        read_artifact(path, load_tensors=False) for path in (tmp_path / "s.safetensors", setup["artifact"])
    )
    assert made.parameters_sha256 == plain_artifact.parameters_sha256


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.uint8, torch.qint8, "safetensors-int32"])
def test_weights_that_are_not_floating_point_are_refused(setup, tmp_path, dtype):
    """Issue 18, bug 5: torch casts integer weights on copy, and the model then predicted
    class 0 for every image with exit 0; quantized ones failed inside load_state_dict."""
    state = torch.load(setup["weights"])
    if dtype == torch.qint8:
        cast = {
            k: torch.quantize_per_tensor(v, 0.01, 0, torch.qint8) if v.is_floating_point() else v
            for k, v in state.items()
        }
    else:
        cast = {
            k: v.round().to(torch.int32 if dtype == "safetensors-int32" else dtype) if v.is_floating_point() else v
            for k, v in state.items()
        }
    if dtype == "safetensors-int32":
        from safetensors.torch import save_file

        weights = tmp_path / "net.safetensors"
        save_file(cast, weights)
    else:
        weights = tmp_path / "net.pt"
        torch.save(cast, weights)
    name = "int32" if dtype == "safetensors-int32" else str(dtype).removeprefix("torch.")
    result = stats_with_model(setup, tmp_path, TINY_NET, "--weights", weights)
    fails(
        result,
        3,
        f"--weights {weights}: ",
        f"({name})",
        "not floating-point, for floating-point parameters of the model",
    )
    assert not (tmp_path / "s.safetensors").exists()
