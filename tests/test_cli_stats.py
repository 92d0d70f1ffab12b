"""`cafa stats` and `cafa inspect` end to end through the typer app, against a float64 reference."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tiny_net
import torch
from conftest import PLAIN, TINY_NET, invoke, write_folder
from helpers import unless_given
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file

from cafa_cli.artifact.store import read_artifact
from cafa_cli.model.loading import parameters_sha256, resolve

CLASSES = ["a", "b", "c"]
PER_CLASS = 12
D = 6  # the tiny net's feature dimension


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """One training folder, weights, and reference float64 features for the whole module."""
    root = tmp_path_factory.mktemp("stats")
    data = write_folder(root / "train", per_class=PER_CLASS)
    torch.manual_seed(0)
    net = tiny_net.build()
    weights = root / "net.pt"
    torch.save(net.state_dict(), weights)
    features, labels = reference_features(net.eval(), data)
    return root, data, weights, features, labels


def reference_features(net, data: Path) -> tuple[np.ndarray, np.ndarray]:
    """The input of the last Linear, computed directly from the PNGs (pixels / 255)."""
    rows, labels = [], []
    for label, name in enumerate(CLASSES):
        for path in sorted((data / name).glob("*.png")):
            rows.append(np.asarray(Image.open(path), dtype=np.float32) / 255)
            labels.append(label)
    x = torch.from_numpy(np.stack(rows))[:, None]
    with torch.no_grad():
        features = net.head[:3](net.pool(net.block(net.stem(x))))
    return features.double().numpy(), np.array(labels)


def shrunk(rows: np.ndarray, lam: float) -> np.ndarray:
    s = np.cov(rows, rowvar=False, bias=True)
    return (1 - lam) * s + lam * np.trace(s) / s.shape[0] * np.eye(s.shape[0])


def stats(setup, out: Path, *extra):
    root, data, weights, _, _ = setup
    defaults = unless_given([*PLAIN, "--seed", "0"], extra)
    return invoke("stats", "--model", TINY_NET, "--weights", weights, "--data", data, *defaults, "--out", out, *extra)


def squared_distances(z, mean32, factor32):
    diff = z - mean32.double().numpy()
    return ((diff @ factor32.double().numpy()) ** 2).sum(-1)


def test_acceptance_command_matches_float64_reference(setup, tmp_path):
    root, data, weights, features, labels = setup
    out = tmp_path / "s.safetensors"
    result = invoke(
        "stats", "--model", TINY_NET, "--weights", weights, "--data", data,
        "--resize", "none", "--crop", "none", "--mean", "0", "--std", "1", "--channels", "1",
        "--fraction", "1", "--seed", "0", "--shrinkage", "0.1", "--out", out,
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "", "stats prints nothing on stdout"
    assert f"wrote {out}" in result.stderr
    artifact = read_artifact(out)
    g = artifact.gaussians
    assert artifact.class_names == CLASSES
    assert g.counts.tolist() == [PER_CLASS] * 3
    assert g.covariance == "full" and g.factors.shape == (3, D, D)
    assert g.shrinkage.tolist() == [0.1] * 3 and g.shrinkage_method == "fixed"
    probe = np.concatenate(
        [features, features.mean(0) + np.random.default_rng(0).normal(size=(10, D)) * features.std(0)]
    )
    for c in range(3):
        rows = features[labels == c]
        np.testing.assert_allclose(g.means[c].numpy(), rows.mean(0), rtol=1e-5, atol=1e-6 * np.abs(rows).max())
        cov = shrunk(rows, 0.1)
        diff = probe - rows.mean(0)
        expected = np.einsum("nd,de,ne->n", diff, np.linalg.inv(cov), diff)
        np.testing.assert_allclose(squared_distances(probe, g.means[c], g.factors[c]), expected, rtol=1e-4)
    np.testing.assert_allclose(g.global_mean.numpy(), features.mean(0), rtol=1e-5, atol=1e-6)


def test_artifact_records_model_preprocessing_and_sampling(setup, tmp_path):
    root, data, weights, _, _ = setup
    out = tmp_path / "s.safetensors"
    assert stats(setup, out, "--fraction", "1", "--shrinkage", "0.1").exit_code == 0
    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
    assert json.loads(meta["class_names"]) == CLASSES
    model = json.loads(meta["model"])
    assert model["model"] == TINY_NET
    assert model["weights"] == str(weights.resolve())
    assert model["weights_sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert model["classifier"] == "head.3"
    net, _ = resolve(TINY_NET, str(weights))
    assert meta["parameters_sha256"] == parameters_sha256(net.model)
    assert json.loads(meta["preprocessing"]) == {
        "resize": None,
        "crop": None,
        "mean": [0.0],
        "std": [1.0],
        "channels": 1,
        "interpolation": "bilinear",
    }
    listed = "".join(
        f"{name}/{image.name}\t{label}\n"
        for label, name in enumerate(CLASSES)
        for image in sorted((data / name).iterdir())
    )
    # the size and modification time of each image read, by absolute path: an edit in place is another sample
    stamped = "".join(
        f"{image}\t{image.stat().st_size}\t{image.stat().st_mtime_ns}\n"
        for name in CLASSES
        for image in sorted((data / name).iterdir())
    )
    assert json.loads(meta["sampling"]) == {
        "data": str(data),
        "fraction": 1.0,
        "per_class": None,
        "seed": 0,
        "batch_size": 128,
        "images_sha256": hashlib.sha256(listed.encode()).hexdigest(),
        "file_stamps": hashlib.sha256(stamped.encode()).hexdigest(),
        "skipped_images": 0,
        "input_size": [16, 16],
    }
    assert json.loads(meta["shrinkage"])["method"] == "fixed"
    assert meta["num_images"] == str(3 * PER_CLASS) and meta["feature_dim"] == str(D)


def test_default_shrinkage_is_oas(setup, tmp_path):
    _, _, _, features, labels = setup
    from sklearn.covariance import OAS

    out = tmp_path / "s.safetensors"
    assert stats(setup, out, "--fraction", "1").exit_code == 0
    g = read_artifact(out).gaussians
    assert g.shrinkage_method == "oas"
    expected = [OAS().fit(features[labels == c]).shrinkage_ for c in range(3)]
    np.testing.assert_allclose(g.shrinkage.numpy(), expected, rtol=1e-4)


def test_tied_covariance(setup, tmp_path):
    _, _, _, features, labels = setup
    out = tmp_path / "t.safetensors"
    result = stats(setup, out, "--fraction", "1", "--shrinkage", "0.2", "--covariance", "tied")
    assert result.exit_code == 0, result.stderr
    g = read_artifact(out).gaussians
    assert g.covariance == "tied" and g.factors.shape == (1, D, D) and g.shrinkage.tolist() == [0.2]
    centred = np.concatenate([features[labels == c] - features[labels == c].mean(0) for c in range(3)])
    pooled = centred.T @ centred / len(centred)
    cov = 0.8 * pooled + 0.2 * np.trace(pooled) / D * np.eye(D)
    for c in range(3):
        diff = features - features[labels == c].mean(0)
        expected = np.einsum("nd,de,ne->n", diff, np.linalg.inv(cov), diff)
        np.testing.assert_allclose(squared_distances(features, g.means[c], g.factors[0]), expected, rtol=1e-4)


def test_diag_covariance(setup, tmp_path):
    _, _, _, features, labels = setup
    out = tmp_path / "d.safetensors"
    result = stats(setup, out, "--fraction", "1", "--shrinkage", "0.3", "--covariance", "diag")
    assert result.exit_code == 0, result.stderr
    g = read_artifact(out).gaussians
    assert g.covariance == "diag" and g.factors.shape == (3, D)
    for c in range(3):
        variances = np.diag(shrunk(features[labels == c], 0.3))
        np.testing.assert_allclose(g.factors[c].double().numpy(), 1 / np.sqrt(variances), rtol=1e-4)


def test_per_class_selects_that_many_and_is_seeded(setup, tmp_path):
    outs = {}
    moved = shutil.copytree(setup[1], tmp_path / "elsewhere")
    for name, data, seed in [("one", setup[1], 0), ("again", moved, 0), ("other", setup[1], 1)]:
        outs[name] = tmp_path / f"{name}.safetensors"
        result = invoke("stats", "--model", TINY_NET, "--weights", setup[2], "--data", data, *PLAIN,
                        "--per-class", "5", "--seed", seed, "--out", outs[name])  # fmt: skip
        assert result.exit_code == 0, result.stderr
    a, again, other = (read_artifact(outs[name]) for name in ("one", "again", "other"))
    assert a.gaussians.counts.tolist() == [5, 5, 5]
    assert {k: a.sampling[k] for k in ("data", "fraction", "per_class", "seed")} == {
        "data": str(setup[1]),
        "fraction": None,
        "per_class": 5,
        "seed": 0,
    }
    assert torch.equal(a.gaussians.means, again.gaussians.means)
    assert not torch.equal(a.gaussians.means, other.gaussians.means)
    # the same images in another folder are the same sample; another seed is not
    assert a.sampling["images_sha256"] == again.sampling["images_sha256"] != other.sampling["images_sha256"]


def test_fraction_selects_round_fraction_per_class(setup, tmp_path):
    out = tmp_path / "f.safetensors"
    assert stats(setup, out, "--fraction", "0.5").exit_code == 0
    assert read_artifact(out).gaussians.counts.tolist() == [6, 6, 6]


@pytest.mark.parametrize("fraction", ["0", "1.5", "-0.2"])
def test_fraction_out_of_range_is_a_usage_error(setup, tmp_path, fraction):
    out = tmp_path / "s.safetensors"
    result = stats(setup, out, "--fraction", fraction)
    assert result.exit_code == 2
    assert "--fraction" in result.stderr and "Traceback" not in result.output
    assert not out.exists()


@pytest.mark.parametrize(
    "extra, pattern",
    [
        (["--covariance", "spherical"], "--covariance"),
        (["--shrinkage", "lots"], "--shrinkage"),
        (["--shrinkage", "1.5", "--fraction", "1"], "--shrinkage"),
        (["--per-class", "1"], "--per-class"),
        (["--channels", "2"], "--channels"),
        (["--device", "tpu"], "--device"),
    ],
)
def test_bad_options_exit_2(setup, tmp_path, extra, pattern):
    result = stats(setup, tmp_path / "s.safetensors", *extra)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("cafa: error:") and pattern in result.stderr


def test_shrinkage_out_of_range_fails_before_reading_data(setup, tmp_path):
    result = invoke(
        "stats",
        "--model",
        TINY_NET,
        "--data",
        tmp_path / "absent",
        *PLAIN,
        "--shrinkage",
        "1.5",
        "--out",
        tmp_path / "s.safetensors",
    )
    assert result.exit_code == 2 and "--shrinkage" in result.stderr


def test_unshrunk_singular_covariance_exits_3_naming_classes(setup, tmp_path):
    result = stats(setup, tmp_path / "s.safetensors", "--per-class", "5", "--shrinkage", "0")  # N_c = 5 < d = 6
    assert result.exit_code == 3
    assert "covariance is singular for a (N=5, d=6)" in result.stderr
    assert "Traceback" not in result.output


def test_relative_model_file_is_recorded_absolutely(setup, tmp_path, monkeypatch):
    _, data, weights, _, _ = setup
    (tmp_path / "net.py").write_text(Path(tiny_net.__file__).read_text())
    monkeypatch.chdir(tmp_path)
    result = invoke(
        "stats",
        "--model",
        "net.py:build",
        "--weights",
        weights,
        "--data",
        data,
        *PLAIN,
        "--fraction",
        "1",
        "--out",
        "s.safetensors",
    )
    assert result.exit_code == 0, result.stderr
    assert read_artifact(tmp_path / "s.safetensors").model.model == f"{tmp_path.resolve() / 'net.py'}:build"


def test_missing_data_and_weights_exit_3(setup, tmp_path):
    root, data, weights, _, _ = setup
    result = invoke(
        "stats",
        "--model",
        TINY_NET,
        "--weights",
        weights,
        "--data",
        tmp_path / "absent",
        *PLAIN,
        "--out",
        tmp_path / "s.safetensors",
    )
    assert result.exit_code == 3 and "no such file or folder" in result.stderr
    result = invoke(
        "stats",
        "--model",
        TINY_NET,
        "--weights",
        tmp_path / "absent.pt",
        "--data",
        data,
        *PLAIN,
        "--out",
        tmp_path / "s.safetensors",
    )
    assert result.exit_code == 3 and "--weights" in result.stderr


def test_class_count_mismatch_exits_3(tmp_path, tiny_weights):
    data = write_folder(tmp_path / "four", per_class=4, classes=("a", "b", "c", "d"), size=16)
    result = invoke(
        "stats",
        "--model",
        TINY_NET,
        "--weights",
        tiny_weights,
        "--data",
        data,
        *PLAIN,
        "--fraction",
        "1",
        "--out",
        tmp_path / "s.safetensors",
    )
    assert result.exit_code == 3 and "4 classes but the model's classifier has 3 outputs" in result.stderr


# --- inspect -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def artifact_path(setup):
    out = setup[0] / "inspect.safetensors"
    result = stats(setup, out, "--fraction", "1", "--shrinkage", "0.1")
    assert result.exit_code == 0, result.stderr
    return out


def test_inspect_text(artifact_path, setup, monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")  # narrower than a sha256 line: rich would wrap it there
    result = invoke("inspect", artifact_path)
    assert result.exit_code == 0, result.stderr
    text = result.stdout
    for needle in ["covariance", "full", "feature dim 6", "36 images", "fixed", "0.1000", "head.3", str(setup[1])]:
        assert needle in text, needle
    assert not {"{", "}", '"'} & set(text), "no JSON: the preprocessing and sampling in words"
    assert "over 3 classes" in " ".join(text.split())
    lines = text.splitlines()
    assert all(line == line.strip() or line.startswith("  ") for line in lines), (
        "headings, then indented lines under them"
    )
    assert {"artifact", "model", "training images", "gaussians", "sha256", "per class"} <= {
        line for line in lines if line and line == line.strip()
    }
    weights = hashlib.sha256(setup[2].read_bytes()).hexdigest()
    sample = read_artifact(artifact_path, load_tensors=False).sampling["images_sha256"]
    for sha in (weights, sample):  # each whole on its line, never broken or cut to '…'
        assert any(line.split()[-1:] == [sha] for line in lines), sha
    classes = lines[lines.index("per class") + 1 :]
    assert [line.split() for line in classes] == [["class", "images", "λ"]] + [
        [name, str(PER_CLASS), "0.1000"] for name in CLASSES
    ]


def test_inspect_text_sums_many_classes_up(artifact_path):
    from cafa_cli.jobs.inspect import describe, render

    summary = describe(read_artifact(artifact_path))
    summary["classes"] = [{"name": f"class{i}", "count": 10 + i, "shrinkage": i / 100} for i in range(20)]
    text = render(summary).plain
    assert "class7" not in text
    assert (
        "  images        min 10, median 20, max 29" in text
        and "  λ             min 0.0000, median 0.1000, max 0.1900" in text
    )


def test_inspect_says_a_tied_covariance_is_one_the_classes_share(setup):
    out = setup[0] / "tied.safetensors"
    assert stats(setup, out, "--fraction", "1", "--covariance", "tied").exit_code == 0
    text = " ".join(invoke("inspect", out).stdout.split())
    assert "of the covariance the classes share" in text and "over 1 classes" not in text


def test_inspect_json(artifact_path, setup):
    result = invoke("inspect", artifact_path, "--json")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["num_classes"] == 3 and summary["feature_dim"] == D and summary["num_images"] == 36
    assert summary["covariance"] == "full"
    assert [c["name"] for c in summary["classes"]] == CLASSES
    assert [c["count"] for c in summary["classes"]] == [PER_CLASS] * 3
    assert all(c["shrinkage"] == pytest.approx(0.1) for c in summary["classes"])
    assert summary["shrinkage"]["method"] == "fixed" and summary["shrinkage"]["min"] == pytest.approx(0.1)
    assert summary["model"]["classifier"] == "head.3"
    assert summary["sampling"]["fraction"] == 1.0
    cond = summary["conditioning"]
    assert cond["classes_measured"] == 3 and 1 <= cond["min"] <= cond["median"] <= cond["max"]
    # cond(Σ_c) from the factors must agree with the reference shrunk covariance
    _, _, _, features, labels = setup
    expected = sorted(np.linalg.cond(shrunk(features[labels == c], 0.1)) for c in range(3))
    np.testing.assert_allclose([cond["min"], cond["median"], cond["max"]], expected, rtol=1e-3)


@pytest.mark.parametrize("as_json", [False, True])
def test_inspect_does_not_import_torch(artifact_path, as_json):
    """Importing torch would be most of its time: the checks and the conditioning run on numpy's arrays."""
    code = (
        "import sys\n"
        "from cafa_cli.cli.app import main\n"
        "sys.argv = ['cafa', 'inspect', *sys.argv[1:]]\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as done:\n"
        "    assert not done.code, done.code\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    shown = subprocess.run(
        [sys.executable, "-c", code, str(artifact_path), *(["--json"] if as_json else [])],
        capture_output=True,
        text=True,
    )
    assert shown.returncode == 0, shown.stderr
    assert "conditioning" in shown.stdout


@pytest.mark.parametrize("damage", ["truncate", "garbage", "html", "missing", "not-an-artifact", "metadata"])
def test_inspect_bad_artifact_is_one_line_exit_3(artifact_path, tmp_path, damage):
    path = tmp_path / "bad.safetensors"
    if damage in ("not-an-artifact", "metadata"):
        with safe_open(str(artifact_path), framework="pt") as f:
            meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
        meta = {} if damage == "not-an-artifact" else {**meta, "shrinkage": "{}"}
        save_file(tensors, str(path), metadata=meta)
    elif damage == "truncate":
        path.write_bytes(artifact_path.read_bytes()[:200])
    elif damage == "garbage":
        path.write_bytes(np.random.default_rng(0).integers(0, 256, 2048, dtype=np.uint8).tobytes())
    elif damage == "html":
        path.write_text("<!doctype html><html><body>404</body></html>")
    result = invoke("inspect", path)
    assert result.exit_code == 3
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cafa: error:") and str(path) in lines[0]
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


@pytest.mark.parametrize("with_class_list", [False, True])
def test_stats_on_unlabelled_images_names_the_missing_labels(tmp_path, tiny_weights, with_class_list):
    flat = tmp_path / "flat"
    flat.mkdir()
    for i in range(4):
        Image.fromarray(np.full((16, 16), 30 * i, np.uint8)).save(flat / f"{i}.png")
    classes = tmp_path / "classes.txt"
    classes.write_text("a\nb\nc\n")
    extra = ["--classes", classes] if with_class_list else []
    result = invoke(
        "stats",
        "--model",
        TINY_NET,
        "--weights",
        tiny_weights,
        "--data",
        flat,
        *PLAIN,
        "--out",
        tmp_path / "s.safetensors",
        *extra,
    )
    assert result.exit_code == 3
    assert "has no labels (unlabelled images), and class statistics need them" in result.stderr
    assert not (tmp_path / "s.safetensors").exists()


def test_training_data_is_recorded_by_absolute_path_even_behind_a_set_name(tmp_path, monkeypatch):
    """Two CIFAR copies under the same relative path are two training sets to bench's re-use check."""
    from cafa_cli.jobs.shared.inputs import recorded_data

    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder").mkdir()
    assert recorded_data("cifar10:data/cifar") == f"cifar10:{tmp_path / 'data' / 'cifar'}"
    assert recorded_data("folder") == str(tmp_path / "folder")
    assert recorded_data("fashion-mnist") == "fashion-mnist"  # Debian's copy, no ROOT given


def test_names_that_are_not_utf8_are_written_and_read_back(setup, tmp_path):
    """safetensors only opens names it can encode as UTF-8; cafa reads such files through a
    file descriptor, so an artifact and weights named in Latin-1 work like any other."""
    out = tmp_path / os.fsdecode(b"caf\xe9.safetensors")
    weights = tmp_path / os.fsdecode(b"r\xe9seau.safetensors")
    save_file(torch.load(setup[2], weights_only=True), weights)
    result = invoke(
        "stats", "--model", TINY_NET, "--weights", weights, "--data", setup[1], *PLAIN, "--fraction", "1", "--out", out
    )
    assert result.exit_code == 0, result.stderr
    assert read_artifact(out).num_classes == 3
    assert read_artifact(out).model.weights == str(weights)  # the name's bytes recorded as they are
    shown = invoke(
        "inspect", "--json", out
    )  # (the text form writes the name's byte as it is, which the runner's strict UTF-8 refuses)
    assert shown.exit_code == 0, shown.stderr
    summary = json.loads(shown.stdout)  # standard JSON: the byte that is not UTF-8 is the text \xe9
    assert summary["path"] == str(tmp_path / "caf\\xe9.safetensors")
    assert summary["model"]["weights"] == str(tmp_path / "r\\xe9seau.safetensors") and summary["num_classes"] == 3
