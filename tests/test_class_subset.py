"""Class subsets (`--class-subset`): a test set of some of the model's classes, as
ImageNet-R's 200 of ImageNet's 1,000. The logits are those classes' only, the statistics
hold them only, and the artifact records which model outputs they are."""

from __future__ import annotations

import json

import pytest
import tiny_net
import torch
from conftest import PLAIN, TINY_NET, invoke, write_folder
from helpers import fails, rows
from safetensors import safe_open

from cafa_cli.artifact.store import read_artifact
from cafa_cli.core.errors import InputError
from cafa_cli.model.features import FeatureClassifier

CLASSES = ("apple", "banana", "cherry", "damson")


@pytest.fixture(scope="module")
def subset_setup(tmp_path_factory):
    """A 4-class tiny net whose classifier strongly prefers `banana`, so that any prediction
    outside a subset without banana shows that the logits were not restricted."""
    root = tmp_path_factory.mktemp("subset")
    train = write_folder(root / "train", per_class=8, classes=CLASSES)
    test = write_folder(root / "test", per_class=6, classes=("apple", "cherry"), seed=2)
    torch.manual_seed(0)
    net = tiny_net.build(num_classes=4)
    with torch.no_grad():
        net.head[-1].bias.copy_(torch.tensor([0.0, 50.0, 0.0, 0.0]))
    weights = root / "net.pt"
    torch.save(net.state_dict(), weights)
    (root / "subset.txt").write_text("cherry\napple\n")  # not in output order: the outputs' order wins
    (root / "classes.txt").write_text("".join(f"{name}\n" for name in CLASSES))
    model = ["--model", TINY_NET, "--num-classes", "4", "--weights", weights]
    full, sub = root / "full.safetensors", root / "sub.safetensors"
    for out, extra in ((full, []), (sub, ["--class-subset", root / "subset.txt"])):
        result = invoke("stats", *model, "--data", train, *PLAIN, "--fraction", "1", "--out", out, *extra, "--quiet")
        assert result.exit_code == 0, result.stderr
    return {"root": root, "test": test, "model": model, "full": full, "sub": sub, "train": train}


def adapt(setup, stats, *args):
    return invoke(
        "adapt", "--stats", stats, "--model", TINY_NET, "--data", setup["test"], "--batch-size", "4", "--quiet", *args
    )


def test_stats_with_a_subset_hold_its_classes_only_and_record_their_outputs(subset_setup):
    artifact = read_artifact(subset_setup["sub"])
    assert artifact.class_names == ["apple", "cherry"]
    assert artifact.outputs == [0, 2] and artifact.model_class_names == list(CLASSES)
    assert artifact.gaussians.counts.tolist() == [8, 8]  # banana's and damson's images left out
    full = read_artifact(subset_setup["full"])
    assert "class_subset" not in full.metadata  # an artifact without a subset is as before
    assert full.outputs == [0, 1, 2, 3] and full.model_class_names == full.class_names == list(CLASSES)
    # the subset's statistics are the full artifact's rows of its classes
    torch.testing.assert_close(artifact.gaussians.means, full.gaussians.means[[0, 2]])
    summary = json.loads(invoke("inspect", subset_setup["sub"], "--json").stdout)
    assert summary["num_classes"] == 2 and summary["model_outputs"] == 4


@pytest.mark.parametrize("method", ["source", "tent", "cafa", "t3a"])
def test_predictions_fall_in_the_subset_only(subset_setup, method):
    without = adapt(subset_setup, subset_setup["full"], "--method", method)
    assert without.exit_code == 0, without.stderr
    assert {row["prediction"] for row in rows(without)} == {"banana"}  # the bias wins everywhere
    result = adapt(subset_setup, subset_setup["sub"], "--method", method)
    assert result.exit_code == 0, result.stderr
    predictions = {row["prediction"] for row in rows(result)}
    assert predictions and predictions <= {"apple", "cherry"}


def test_a_subset_given_to_adapt_restricts_a_full_artifact_and_is_recorded(subset_setup, tmp_path):
    metrics = tmp_path / "m.json"
    result = adapt(
        subset_setup,
        subset_setup["full"],
        "--class-subset",
        subset_setup["root"] / "subset.txt",
        "--metrics-json",
        metrics,
    )
    assert result.exit_code == 0, result.stderr
    assert {row["prediction"] for row in rows(result)} <= {"apple", "cherry"}
    recorded = json.loads(metrics.read_text())["settings"]["class_subset"]
    assert recorded["classes"] == 2 and recorded["model_outputs"] == 4
    # the same classes as the subset artifact's: the same statistics rows, the same predictions
    same = adapt(subset_setup, subset_setup["sub"])
    assert same.stdout == result.stdout


def test_the_logits_are_the_subset_outputs_of_the_full_logits():
    torch.manual_seed(0)
    net = FeatureClassifier(tiny_net.build(num_classes=4)).eval()
    x = torch.randn(5, 1, 16, 16)
    with torch.no_grad():
        full, features = net(x)
        net.restrict_outputs([1, 3])
        logits, same_features = net(x)
    assert torch.equal(logits, full[:, [1, 3]]) and torch.equal(features, same_features)
    assert net.num_classes == 2 and net.model_outputs == 4
    assert torch.equal(net.class_weights(), net.classifier.weight[[1, 3]])


def test_a_test_set_of_fewer_classes_suggests_a_class_subset(subset_setup):
    common = ["adapt", *subset_setup["model"], "--data", subset_setup["test"], *PLAIN, "--method", "bn", "--quiet"]
    fails(invoke(*common), 3, "has 2 classes but the model's classifier has 4 outputs", "--class-subset")
    subset = subset_setup["root"] / "subset.txt"
    fails(invoke(*common, "--class-subset", subset), 2, "--class-subset", "--classes")
    result = invoke(*common, "--class-subset", subset, "--classes", subset_setup["root"] / "classes.txt")
    assert result.exit_code == 0, result.stderr
    assert {row["prediction"] for row in rows(result)} <= {"apple", "cherry"}


def test_a_misspelt_subset_class_gets_a_did_you_mean(subset_setup, tmp_path):
    typo = tmp_path / "typo.txt"
    typo.write_text("apple\ncheery\n")
    fails(
        adapt(subset_setup, subset_setup["full"], "--class-subset", typo),
        3,
        "cheery is not among the model's 4 classes",
        "did you mean cherry for cheery?",
    )


def test_test_images_of_a_class_outside_the_subset_are_refused(subset_setup, tmp_path):
    test = write_folder(tmp_path / "test", per_class=2, classes=("apple", "banana", "cherry"))
    fails(
        invoke("adapt", "--stats", subset_setup["sub"], "--model", TINY_NET, "--data", test, "--quiet"),
        3,
        "2 image(s) of class(es) banana, which --class-subset leaves out",
    )


def test_a_subset_class_the_statistics_lack_is_named(subset_setup, tmp_path):
    other = tmp_path / "other.txt"
    other.write_text("apple\ndamson\n")
    fails(
        adapt(subset_setup, subset_setup["sub"], "--class-subset", other),
        3,
        "damson is not among the 2 classes of the statistics' own class subset",
    )


def test_bench_with_a_class_subset(subset_setup, tmp_path):
    result = invoke(
        "bench",
        subset_setup["test"],
        *subset_setup["model"],
        "--train",
        subset_setup["train"],
        *PLAIN,
        "--fraction",
        "1",
        "--class-subset",
        subset_setup["root"] / "subset.txt",
        "--methods",
        "source,cafa",
        "--batch-size",
        "4",
        "--workdir",
        tmp_path / "w",
        "--quiet",
    )
    assert result.exit_code == 0, result.stderr
    artifact = read_artifact(tmp_path / "w" / "stats-auto.safetensors", load_tensors=False)
    assert artifact.class_names == ["apple", "cherry"]
    # the rows without statistics read the labels through all the model's classes
    assert (tmp_path / "w" / "classes.txt").read_text().split() == list(CLASSES)


def test_a_malformed_class_subset_record_is_refused(subset_setup, tmp_path):
    with safe_open(subset_setup["sub"], "pt") as f:
        metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    from safetensors.torch import save_file

    record = json.loads(metadata["class_subset"])
    for broken in ({**record, "outputs": [2, 0]}, {**record, "outputs": [0, 1]}, {**record, "model_classes": "x"}, []):
        path = tmp_path / "bad.safetensors"
        save_file(tensors, str(path), metadata={**metadata, "class_subset": json.dumps(broken)})
        with pytest.raises(InputError, match="metadata 'class_subset'"):
            read_artifact(path)
