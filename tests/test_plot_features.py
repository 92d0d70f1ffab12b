"""`cafa plot features`: the figure (PNG, SVG, byte for byte the same for a seed), the panels'
numbers, the unlabelled path, and its errors; the feature pass after the stream changes nothing."""

from __future__ import annotations

import builtins
import json
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY_NET, invoke, write_folder
from helpers import check_environment, unless_given
from PIL import Image

from cafa_cli.engine.adapter import Adapter
from cafa_cli.jobs.plot import features as plot_features
from cafa_cli.jobs.plot import figure as feature_figure
from cafa_cli.methods import REGISTRY, create

SMALL = ["--batch-size", "15", "--max-images", "45", "--quiet"]


@pytest.fixture(scope="module")
def domain(setup):
    """A shifted labelled test folder of 3 x 20 images beside the conftest's artifact."""
    return write_folder(setup["root"] / "test", per_class=20, seed=3, shift=0.3)


def model_of(setup) -> list:
    return ["--model", TINY_NET, "--weights", setup["weights"], "--stats", setup["artifact"]]


def test_png_and_svg_are_valid_and_the_same_seed_gives_the_same_bytes(setup, domain, tmp_path):
    files = {}
    for name in ("a.png", "b.png", "a.svg", "b.svg", "other-seed.png"):
        seed = ["--seed", "1"] if name.startswith("other") else []
        result = invoke(
            "plot",
            "features",
            domain,
            *model_of(setup),
            *SMALL,
            *seed,
            "--methods",
            "source,tent",
            "-o",
            tmp_path / name,
        )
        assert result.exit_code == 0, result.stderr
        files[name] = (tmp_path / name).read_bytes()
    assert files["a.png"] == files["b.png"] and files["a.svg"] == files["b.svg"]
    assert files["other-seed.png"] != files["a.png"]  # the seed does reach the sample, the stream and the embedding
    with Image.open(tmp_path / "a.png") as image:
        assert image.format == "PNG" and image.size == (720, 440)  # two panels of 3.6 x 4 inches, a legend row, 100 dpi
        assert "Software" not in image.info  # no tool version in the file
    svg = ElementTree.parse(tmp_path / "a.svg").getroot()
    assert svg.tag.endswith("svg") and b"<dc:date>" not in files["a.svg"]
    assert not list(tmp_path.glob(".*.tmp"))  # written atomically: no temporary file left


def test_json_gives_each_panels_numbers_its_environment_and_the_stars_are_the_artifacts_means(
    setup, domain, tmp_path, monkeypatch
):
    drawn = {}
    draw = feature_figure.draw
    monkeypatch.setattr(
        feature_figure, "draw", lambda *args: drawn.update(embeddings=args[3], panels=args[2]) or draw(*args)
    )
    result = invoke(
        "plot",
        "features",
        domain,
        *model_of(setup),
        *SMALL,
        "--methods",
        "source,tent,cafa",
        "--json",
        "-o",
        tmp_path / "f.png",
    )
    assert result.exit_code == 0, result.stderr
    numbers = json.loads(result.stdout)
    assert numbers["images"] == numbers["labelled"] == 45 and numbers["classes"] == 3 and numbers["class_means_drawn"]
    assert [p["method"] for p in numbers["panels"]] == ["source", "tent", "cafa"]
    check_environment(numbers["environment"])  # what computed the numbers, as every JSON of cafa's says
    # 48 points cap t-SNE's perplexity below (48 - 1) / 3: the JSON gives the one used beside the one asked for
    asked = numbers["embedding"]["perplexity_asked"]
    assert asked > 47 / 3 and numbers["embedding"]["perplexity"] == 47 / 3
    for panel in numbers["panels"]:
        assert 0 <= panel["error"] <= 1 and panel["within_between"] > 0 and panel["mahalanobis_per_dimension"] > 0
        assert panel["unit"] == "error fraction"
    # 45 images and 3 class means in each panel; adapting moves the features, so the embeddings differ
    source, tent, cafa = drawn["embeddings"]
    assert source.shape == tent.shape == (48, 2)
    assert not np.allclose(source, tent) and not np.allclose(tent, cafa)
    assert not np.allclose(drawn["panels"][0].features, drawn["panels"][1].features)
    assert numbers["panels"][0]["within_between"] != numbers["panels"][1]["within_between"]
    # every panel shows the same images in the same order
    assert all(np.array_equal(drawn["panels"][0].labels, p.labels) for p in drawn["panels"])


def test_unlabelled_images_are_drawn_in_one_colour_and_said_so(setup, domain, tmp_path):
    flat = tmp_path / "flat"
    flat.mkdir()
    for p in sorted(Path(domain).rglob("*.png"))[::2]:
        (flat / f"{p.parent.name}-{p.name}").write_bytes(p.read_bytes())
    result = invoke(
        "plot",
        "features",
        flat,
        *model_of(setup),
        "--batch-size",
        "15",
        "--methods",
        "source,bn",
        "--json",
        "-o",
        tmp_path / "u.svg",
    )
    assert result.exit_code == 0, result.stderr
    assert "the images have no labels: the points are drawn in one colour" in result.stderr
    numbers = json.loads(result.stdout)
    assert numbers["labelled"] == 0 and numbers["images"] == 30
    assert all(
        p["error"] is None and p["within_between"] is None and p["mahalanobis_per_dimension"] is None
        for p in numbers["panels"]
    )
    ElementTree.parse(tmp_path / "u.svg")


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--methods", "source,magic"],
            f"--methods names magic, which is no method; give some of {', '.join(REGISTRY)} (or a "
            "plug-in module:factory)",
        ),
        (["--methods", "tent,tent"], "--methods names tent twice; give each once"),
        (
            ["-o", "f.pdf"],
            "--out f.pdf: the figure is written as PNG or SVG by its extension; give a name ending in .png or .svg",
        ),
        (["--max-images", "-1"], "--max-images must be 0 (all) or more, not -1"),
        (["--perplexity", "0"], "--perplexity must be a positive number, not 0.0"),
    ],
)
def test_bad_options_are_one_line_usage_errors(setup, domain, tmp_path, args, message):
    result = invoke("plot", "features", domain, *model_of(setup), *unless_given(SMALL[:-1], args), "--quiet", *args)
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [f"cafa: error: {message}"]


def test_two_domains_and_an_order_by_class_without_labels_are_refused(setup, domain, tmp_path):
    result = invoke("plot", "features", domain, domain, *model_of(setup), *SMALL)
    assert result.exit_code == 2
    assert (
        result.stderr.strip() == "cafa: error: cafa plot features embeds one domain, and 2 are given; give one DOMAIN"
    )
    flat = tmp_path / "flat"
    flat.mkdir()
    for p in sorted(Path(domain).rglob("*.png"))[:20]:
        (flat / f"{p.parent.name}-{p.name}").write_bytes(p.read_bytes())
    result = invoke(
        "plot", "features", flat, *model_of(setup), *SMALL, "--order", "label-shift:1.0", "-o", tmp_path / "x.png"
    )
    assert result.exit_code == 3 and not (tmp_path / "x.png").exists()
    assert result.stderr.strip() == (
        f"cafa: error: {flat} has no labels, and --order label-shift:1.0 orders the stream by "
        f"class; give labelled data (one folder per class, or an array with --labels), or use "
        f"--order iid"
    )


def test_without_matplotlib_or_scikit_learn_the_error_names_the_extra(setup, domain, tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_sklearn(name, *args, **kwargs):
        if name.startswith("sklearn"):
            raise ModuleNotFoundError(f"No module named '{name}'", name=name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_sklearn)
    result = invoke("plot", "features", domain, *model_of(setup), *SMALL, "-o", tmp_path / "x.png")
    assert result.exit_code == 2 and not (tmp_path / "x.png").exists()
    assert result.stderr.strip() == (
        "cafa: error: cafa plot features needs matplotlib and scikit-learn (sklearn is missing): "
        "pip install 'cafa-cli[plot]'"
    )


def test_the_feature_pass_after_the_stream_changes_no_weight_nor_running_statistic(trained):
    """Adapter.features reads the model as adapted: no update, and `norm` ema's running
    statistics, which a forward pass moves, put back."""
    import copy

    model, gaussians, xt, _ = trained
    adapter = Adapter(copy.deepcopy(model), create("cafa", gaussians), "cpu", norm="ema:0.1", lr=1e-2)
    adapter.step(xt[:50])
    before = {k: v.clone() for k, v in adapter.model.state_dict().items()}
    logits, features = adapter.features(xt[50:100])
    again = adapter.features(xt[50:100])
    assert (
        features.shape == (50, model.feature_dim) and torch.equal(features, again[1]) and torch.equal(logits, again[0])
    )
    assert all(torch.equal(before[k], v) for k, v in adapter.model.state_dict().items())


def test_a_teacher_student_method_reports_its_teachers_features(trained):
    import copy

    model, _, xt, _ = trained
    adapter = Adapter(copy.deepcopy(model), create("cotta", augmentations=0), "cpu", lr=1e-2)
    adapter.step(xt[:30])
    with torch.no_grad():
        _, teacher = adapter.method.teacher(xt[30:60])
        _, student = adapter.forward(xt[30:60])
    _, features = adapter.features(xt[30:60])
    assert torch.equal(features, teacher) and not torch.equal(features, student)


def test_the_sample_is_stratified_and_repeats_with_its_seed():
    labels = np.repeat([0, 1, 2, -1], [50, 30, 15, 5])
    rows = plot_features.stratified_rows(labels, 20, seed=4)
    assert len(rows) == 20 and len(set(rows)) == 20 and np.all(np.diff(rows) > 0)
    assert np.bincount(labels[rows] + 1).tolist() == [1, 10, 6, 3]  # each group's share: 1, 10, 6, 3 of 20
    assert np.array_equal(rows, plot_features.stratified_rows(labels, 20, seed=4))
    assert not np.array_equal(rows, plot_features.stratified_rows(labels, 20, seed=5))


def test_scatter_ratio_and_mahalanobis_distance_mean_what_they_say(trained):
    features = np.array([[0.0, 0], [0, 2], [10, 0], [10, 2]])
    labels = np.array([0, 0, 1, 1])
    # within: 4 · 1² = 4; between: 4 · 5² = 100
    assert plot_features.scatter_ratio(features, labels) == pytest.approx(0.04)
    assert plot_features.scatter_ratio(features, np.array([0, 0, 0, -1])) is None  # one class: no between-class spread
    model, gaussians, shifted, shifted_labels = trained
    x, y = trained_images()
    with torch.no_grad():
        _, own = model(x)
        _, other = model(shifted)
    # the source's own training features: at most about one unit a dimension from their class's Gaussian
    # (less where shrinkage adds variance the features lack); the shifted test images' lie farther
    own_distance = plot_features.mahalanobis_per_dimension(own.numpy(), y.numpy(), gaussians)
    assert 0.1 < own_distance < 1.05
    assert plot_features.mahalanobis_per_dimension(other.numpy(), shifted_labels.numpy(), gaussians) > 2 * own_distance


def trained_images():
    """The conftest `trained` fixture's training images (its seed 0), rebuilt."""
    from conftest import class_images

    rng = np.random.default_rng(0)
    x = np.concatenate([class_images(rng, c, 100) for c in range(3)]).astype(np.float32) / 255
    return torch.tensor(x)[:, None], torch.arange(3).repeat_interleave(100)


def test_without_a_domain_the_error_names_the_whole_command(setup):
    result = invoke("plot", "features", *model_of(setup))
    assert result.exit_code == 2 and result.stdout == ""
    assert (
        result.stderr.strip()
        == "cafa: error: give the test domains: cafa plot features DOMAIN... (or --data DOMAIN, repeated)"
    )


def test_a_panel_without_its_artifact_is_refused_before_any_panel_runs(setup, domain, tmp_path, monkeypatch):
    """source and tent would run first (minutes on real data) and cafa then fail: the error
    comes first, and names the panel that needs the artifact."""
    monkeypatch.chdir(tmp_path)  # no cafa-stats.safetensors here
    model = ["--model", TINY_NET, "--weights", setup["weights"]]
    result = invoke("plot", "features", domain, *model, *SMALL[:-1], "-o", "f.png")
    assert result.exit_code == 3 and result.stdout == "" and not (tmp_path / "f.png").exists()
    assert result.stderr.strip().splitlines() == [  # no recipe line: no panel ran
        "cafa: error: cafa-stats.safetensors: no such artifact; create one with cafa stats, or give the path of one with "
        "--stats (--method cafa needs its class statistics)"
    ]
    result = invoke("plot", "features", domain, *SMALL, "-o", "f.png")  # no model either: still what cafa needs
    assert result.exit_code == 3 and "(--method cafa needs its class statistics)" in result.stderr
