"""The CLIP test-time methods from the command line and the Python API: each runs through
`cafa adapt --model FILE.py:build` on a tiny open_clip zero-shot classifier, takes its `clip`
recipe under `auto`, and refuses a model that is no CLIP model in one line."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_NET, write_folder
from helpers import fails, invoke, tiny_clip

from cafa_cli.engine.adapter import Adapter
from cafa_cli.methods import REGISTRY, create, method_class
from cafa_cli.methods.recipes import recipe_for, shipped, shipped_families
from cafa_cli.model.clip import ClassTexts, zero_shot_classifier
from cafa_cli.model.features import FeatureClassifier

pytest.importorskip("open_clip")

CLIP_METHODS = ("tpt", "zero", "tda", "dmn-zs", "boostadapter")
FACTORY = """
import sys
sys.path.insert(0, {tests!r})
from helpers import tiny_clip
from cafa_cli.model.clip import ClassTexts, zero_shot_classifier


def build():
    clip, tokenizer = tiny_clip()
    return zero_shot_classifier(clip, ClassTexts(clip, tokenizer, ("a", "b", "c")))
"""
# the grey test images as three channels, read as they are; few views, so that a run is quick
READ = ["--resize", "none", "--crop", "none", "--mean", "0", "--std", "1", "--channels", "3"]


@pytest.fixture(scope="module")
def clip_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("clip")
    (root / "clipnet.py").write_text(FACTORY.format(tests=str(__import__("pathlib").Path(__file__).parent)))
    return {"model": f"{root / 'clipnet.py'}:build", "data": write_folder(root / "data", per_class=2)}


def test_the_clip_methods_are_listed_and_marked():
    assert set(CLIP_METHODS) <= set(REGISTRY)
    assert {name for name in REGISTRY if method_class(name).needs_clip} == set(CLIP_METHODS)
    listed = {row["method"]: row for row in json.loads(invoke("methods", "--json").stdout)}
    assert all("CLIP models only" in listed[name]["adapts"] for name in CLIP_METHODS)


@pytest.mark.parametrize("name", CLIP_METHODS)
def test_each_runs_from_the_command_line_on_a_clip_factory(clip_run, name):
    result = invoke(
        "adapt", "--model", clip_run["model"], "--data", clip_run["data"], *READ, "--method", name,
        "--recipe", "none", "--batch-size", "3", "--method-option", "views=3",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) == 1 + 6  # a header and one row an image


@pytest.mark.parametrize("name", CLIP_METHODS)
def test_each_refuses_a_model_that_is_no_clip_model(clip_run, name):
    result = invoke("adapt", "--model", TINY_NET, "--data", clip_run["data"], *READ[:-1], "1", "--method", name)
    fails(result, 2, f"{name} needs a CLIP model (its text embeddings), not a TinyNet: give --model openclip:ARCH")


def test_auto_takes_the_clip_family_for_them_and_only_it_ships():
    for name in CLIP_METHODS:
        assert shipped_families(name) == ("clip",)
        recipe = recipe_for("auto", name, ["imagenet-c:/data"], 1000)
        assert recipe.family == "clip" and recipe.chosen_by == "the CLIP method's one family"
        assert shipped(name, "clip").source.startswith("authors: ")
    assert recipe_for("auto", "tent", ["imagenet-c:/data"], 1000).family == "imagenet-c"
    with pytest.raises(Exception, match="the method tent has no recipe for clip"):
        recipe_for("clip", "tent", [], 10)
    tpt = shipped("tpt", "clip")
    assert (tpt.settings["optimizer"], tpt.settings["lr"], tpt.settings["steps"]) == ("adamw", 0.005, 1)
    assert (tpt.options["views"], tpt.options["share"]) == (63, 0.1)
    assert shipped("zero", "clip").options["share"] == 0.3
    assert shipped("tda", "clip").options["negative_alpha"] == 0.117
    assert (shipped("dmn-zs", "clip").options["memory"], shipped("dmn-zs", "clip").options["beta"]) == (50, 5.5)
    assert shipped("boostadapter", "clip").options["boost_shots"] == 3


def test_the_python_api_runs_them_and_reset_empties_what_they_keep():
    clip, tokenizer = tiny_clip()
    images = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    for name in CLIP_METHODS:
        model = FeatureClassifier(zero_shot_classifier(clip, ClassTexts(clip, tokenizer, ("a", "b", "c"))))
        method = create(name, views=3)
        method.generator = torch.Generator().manual_seed(0)
        adapter = Adapter(model, method, **({"optimizer": "adamw", "lr": 5e-3} if name == "tpt" else {}))
        first = adapter.step(images)
        assert first.shape == (4, 3) and torch.isfinite(first.softmax(1)).all()
        adapter.reset()
        method.generator = torch.Generator().manual_seed(0)
        assert torch.equal(adapter.step(images), first), name  # nothing kept past reset


@pytest.mark.parametrize("name", CLIP_METHODS)
def test_what_their_classes_say_is_observed_on_a_clip_model(name):
    """As tests/test_registry.py observes it of the others: whether it draws from torch's
    generator, needs no statistics, and predicts otherwise than the zero-shot model on a first batch."""
    clip, tokenizer = tiny_clip()
    images = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    model = FeatureClassifier(zero_shot_classifier(clip, ClassTexts(clip, tokenizer, ("a", "b", "c"))))
    kind = method_class(name)
    assert not kind.needs_statistics and not kind.predicts_before_update
    method = create(name, views=3, share=0.5)
    adapter = Adapter(model, method, **({"optimizer": "adamw", "lr": 5e-2} if name == "tpt" else {}))
    before = torch.get_rng_state()
    predicted = adapter.step(images)
    assert (not torch.equal(before, torch.get_rng_state())) == kind.draws_random_numbers
    with torch.no_grad():
        zero_shot, _ = model(images)
    assert not torch.equal(predicted, zero_shot)
