"""The method registry: a method is its file, its recipe and one registry entry; methods
stand alone and use only the Adapter surface written in base.py."""

from __future__ import annotations

import ast
import csv
import io
import json
from pathlib import Path

import pytest
import torch
from conftest import TINY_NET, invoke

from cafa_cli.cli.completion import complete_method
from cafa_cli.engine.method import AdapterSurface
from cafa_cli.methods import REGISTRY, Entry, create

METHODS = Path(__file__).parents[1] / "src" / "cafa_cli" / "method" / "methods"

MODULE = '''
from cafa_cli.methods.tent import Tent


class Sharpen(Tent):
    """TENT under another name: what it predicts must be TENT's, byte for byte."""

    name = "sharpen"
'''

RECIPE = """
[method]
summary = "entropy minimisation, registered from another package"
paper = "none: a test of the registry"
adapts = "normalisation affines"
cost = 1.0

[cifar10-c]
source = "the registry test's own"
optimizer = "sgd"
lr = 0.05
"""


@pytest.fixture
def registered(tmp_path, monkeypatch):
    """A package outside cafa_cli holding a method and its recipe, and its one registry entry."""
    package = tmp_path / "outside"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "sharpen.py").write_text(MODULE)
    (package / "sharpen.toml").write_text(RECIPE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(
        REGISTRY, "sharpen", Entry("outside.sharpen", "Sharpen", predicts_as_bn=True, recipe="outside:sharpen.toml")
    )
    return "sharpen"


def test_a_method_added_by_one_registry_entry_runs_through_cafa_adapt_with_its_recipe(registered, setup, tmp_path):
    common = [
        "adapt",
        "--stats",
        setup["artifact"],
        "--model",
        TINY_NET,
        "--data",
        setup["train"],
        "--batch-size",
        "6",
        "--recipe",
        "cifar10-c",
        "-q",
    ]
    mine = invoke(*common, "--method", registered, "--metrics-json", tmp_path / "m.json")
    assert mine.exit_code == 0, mine.stderr
    recorded = json.loads((tmp_path / "m.json").read_text())["settings"]
    assert recorded["method"] == "sharpen"
    assert recorded["recipe"]["source"] == "the registry test's own"
    assert (recorded["optimizer"], recorded["lr"]) == ("sgd", 0.05)  # its recipe's, not the defaults
    tent = invoke(*common, "--method", "tent", "--optimizer", "sgd", "--lr", "0.05")
    assert tent.exit_code == 0, tent.stderr
    assert len(list(csv.DictReader(io.StringIO(mine.stdout)))) == 18
    assert mine.stdout == tent.stdout  # TENT's update, so TENT's predictions: it really ran as a method


def test_a_registered_method_is_listed_completed_and_printed_with_its_recipe(registered):
    listed = invoke("methods", "--json")
    assert listed.exit_code == 0, listed.stderr
    row = next(row for row in json.loads(listed.stdout) if row["method"] == "sharpen")
    assert row["summary"] == "entropy minimisation, registered from another package" and row["artifact"] is False
    assert complete_method("shar") == ["sharpen"]
    recipe = invoke("methods", "sharpen", "--recipe", "cifar10-c")
    assert recipe.exit_code == 0, recipe.stderr
    assert "lr = 0.05" in recipe.stdout and "the registry test's own" in recipe.stdout


def test_every_built_in_entry_names_a_class_of_its_recipes_name():
    for name, entry in REGISTRY.items():
        method = create(name, None, "cpu") if not entry.needs_statistics else None
        assert method is None or type(method).__name__ == entry.cls
        assert (Path(__file__).parents[1] / "src" / "cafa_cli" / "methods" / "recipes" / f"{name}.toml").is_file(), name


def surface() -> set[str]:
    members = set(AdapterSurface.__annotations__)
    return members | {name for name in vars(AdapterSurface) if not name.startswith("_")}


@pytest.mark.parametrize("path", sorted(METHODS.glob("*.py")), ids=lambda path: path.name)
def test_methods_use_only_the_adapter_surface_and_import_no_other_methods_helpers(path):
    tree = ast.parse(path.read_text())
    used = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "adapter"
    }
    assert used <= surface(), f"{path.name} uses {sorted(used - surface())} of the Adapter, beyond AdapterSurface"
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cafa_cli.methods."):
            other = node.module.rsplit(".", 1)[1]
            # a method may build on another method's class (intra on cafa), not on its helpers
            assert other == "base" or all(
                alias.name[0].isupper() and alias.name != alias.name.upper() for alias in node.names
            ), (path.name, node.module, [a.name for a in node.names])


def test_the_surface_is_what_the_adapter_has():
    import torch
    from tiny_net import build

    from cafa_cli.engine.adapter import Adapter
    from cafa_cli.model.features import FeatureClassifier

    adapter = Adapter(FeatureClassifier(build()), create("tent"), torch.device("cpu"))
    assert all(hasattr(adapter, name) for name in surface())


@pytest.mark.parametrize("name", list(REGISTRY))
def test_a_method_draws_random_numbers_exactly_when_its_class_says_so(trained, name):
    """`draws_random_numbers` is observed, not trusted: three steps move torch's generator or
    leave it (torchrun keeps a drawing method's domains in one process: distributed.py)."""
    from test_deployment import adapter_of

    from cafa_cli.methods import method_class

    adapter = adapter_of(trained, name)
    before = torch.get_rng_state()
    for batch in trained[2].split(25)[:3]:
        adapter.step(batch)
    assert (not torch.equal(before, torch.get_rng_state())) == method_class(name).draws_random_numbers
