"""The method registry: a method is its file, its recipe and one registry entry; methods
stand alone and use only the Adapter surface written in engine/method.py. What the rest of
the tool must know of a method is on its class, and each such fact is observed here, not
trusted; no list of method names is kept anywhere else in src/."""

from __future__ import annotations

import ast
import copy
import csv
import io
import json
from pathlib import Path

import pytest
import torch
from conftest import TINY_NET, invoke

from cafa_cli.cli.completion import complete_method
from cafa_cli.core.errors import UsageError
from cafa_cli.engine.method import AdapterSurface, Method
from cafa_cli.methods import REGISTRY, Entry, create, method_class

SRC = Path(__file__).parents[1] / "src" / "cafa_cli"
METHODS = SRC / "methods"

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
    monkeypatch.setitem(REGISTRY, "sharpen", Entry("outside.sharpen", "Sharpen", recipe="outside:sharpen.toml"))
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
        method = method_class(name)
        assert method.__name__ == entry.cls and method.name == name
        assert (METHODS / "recipes" / f"{name}.toml").is_file(), name


def test_a_method_class_is_a_plugin_factory_and_one_that_needs_statistics_is_refused_without(trained, tmp_path):
    """A plug-in is made as a built-in is: the class itself is a factory; its refusal for want
    of statistics is the one line a built-in gives, not a failed factory."""
    path = tmp_path / "mine.py"
    path.write_text("from cafa_cli.methods.cafa import Cafa\n\n\nclass Mine(Cafa):\n    name = 'mine'\n")
    with pytest.raises(UsageError, match="the method mine needs class statistics"):
        create(f"{path}:Mine")
    made = create(f"{path}:Mine", trained[1], "cpu")
    assert type(made).__name__ == "Mine" and made.gaussians is trained[1]


@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_method_is_made_by_the_one_constructor_from_its_declared_options(trained, name):
    """No method file forwards its options by hand: the base class sets each declared option
    (its default where not given, the given value converted and checked), and a method that
    makes more from them writes setup()."""
    _, gaussians, _, _ = trained
    method = method_class(name)
    assert method.__init__ is Method.__init__, f"{name} writes its own constructor"
    made = method(gaussians, "cpu")
    assert all(getattr(made, option.name) == option.default for option in method.options)
    for option in method.options[:1]:
        given = {"count0": "0", "count": "2", "flag": "false", "fraction": "0.5"}.get(option.kind)
        if given is not None:  # text, as --method-option gives it: converted by the option's kind
            assert getattr(method(gaussians, "cpu", **{option.name: given}), option.name) == option.value(name, given)
    with pytest.raises(UsageError, match=f"the method {name} has no option nope"):
        method(gaussians, "cpu", nope=1)


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
        module = (node.module or "") if isinstance(node, ast.ImportFrom) else ""
        if module.startswith("cafa_cli.methods.") and not module.startswith("cafa_cli.methods.shared"):
            # a method may build on another method's class (intra on cafa), not on its helpers
            assert all(alias.name[0].isupper() and alias.name != alias.name.upper() for alias in node.names), (
                path.name,
                node.module,
                [a.name for a in node.names],
            )


def test_the_surface_is_what_the_adapter_has():
    import torch
    from tiny_net import build

    from cafa_cli.engine.adapter import Adapter
    from cafa_cli.model.features import FeatureClassifier

    adapter = Adapter(FeatureClassifier(build()), create("tent"), torch.device("cpu"))
    assert all(hasattr(adapter, name) for name in surface())


# a CLIP method runs on a CLIP model alone (tests/test_clip_methods.py observes its attributes there), a
# method that needs tokens on a ViT alone (tests/test_fidelity_foa.py)
ON_ANY_CLASSIFIER = [name for name in REGISTRY if method_class(name).on_any_classifier()]


@pytest.mark.parametrize("name", ON_ANY_CLASSIFIER)
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


@pytest.mark.parametrize("name", ON_ANY_CLASSIFIER)
def test_a_method_runs_without_statistics_exactly_when_its_class_says_it_needs_none(trained, name):
    """`needs_statistics` is observed: a method that says it needs none steps without them,
    and one that says it needs them is refused without them, in one line."""
    from test_deployment import OPTIONS

    from cafa_cli.engine.adapter import Adapter

    model, _, x, _ = trained
    if method_class(name).needs_statistics:
        with pytest.raises(UsageError, match=f"the method {name} needs class statistics"):
            create(name, None, "cpu", **OPTIONS.get(name, {}))
        return
    method = create(name, None, "cpu", **OPTIONS.get(name, {}))
    assert method.gaussians is None
    assert Adapter(copy.deepcopy(model), method, "cpu", lr=1e-2).step(x[:25]).isfinite().all()


@pytest.mark.parametrize("name", [name for name in ON_ANY_CLASSIFIER if name != "bn"])  # bn: the reference
def test_a_method_predicts_as_bn_on_a_stream_of_one_batch_exactly_when_its_class_says_so(trained, name):
    """`predicts_before_update` is observed: the first batch's prediction is bn's, bit for
    bit, where it says so (`cafa adapt` then warns that a one-batch domain cannot differ from
    bn), and differs where it says not."""
    from test_deployment import adapter_of

    first = trained[2][:10]  # memo updates for each image
    predicted, bn = adapter_of(trained, name).step(first), adapter_of(trained, "bn").step(first)
    assert torch.equal(predicted, bn) == method_class(name).predicts_before_update


@pytest.mark.parametrize("name", list(REGISTRY))
def test_a_method_says_what_it_runs_as_exactly_when_it_takes_source_images(name):
    method = method_class(name)
    assert bool(method.without_source_images) == bool(method.inputs), (name, method.inputs)


def name_lists(path: Path) -> list[tuple[int, list[str]]]:
    """The literals in a source file that list two or more method names and nothing else:
    tuples, lists, sets, and the keys of dicts."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        items = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
        if not isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)) or not items or len(items) < 2:
            continue
        texts = [item.value for item in items if isinstance(item, ast.Constant) and isinstance(item.value, str)]
        if len(texts) == len(items) and all(text in REGISTRY for text in texts):
            found.append((node.lineno, texts))
    return found


def test_no_list_of_method_names_is_kept_outside_the_registry():
    """A fact kept as a list of names goes stale as methods are added (distributed.py's list of
    the methods that draw random numbers missed nine): it belongs on the classes."""
    registry = METHODS / "__init__.py"
    assert name_lists(registry)  # the check finds the registry's own
    kept = {
        f"{path.relative_to(SRC)}:{line}": names
        for path in sorted(SRC.rglob("*.py"))
        if path != registry
        for line, names in name_lists(path)
    }
    assert not kept, f"method names listed outside methods/__init__.py (a class attribute says it): {kept}"
