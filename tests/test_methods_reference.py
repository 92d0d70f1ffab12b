"""The site's methods reference (docs/reference/methods/, made at build time by the mkdocs hook
docs/hooks/methods_reference.py from jobs/methods.reference_pages): every registered method,
each of its options and each family its recipe file holds are on its page, read here from
the registry, the classes and the recipe files themselves, not from the renderer."""

from __future__ import annotations

import importlib.util
import tomllib
from importlib import resources
from pathlib import Path

import pytest
import yaml

from cafa_cli.jobs.methods import reference_pages
from cafa_cli.methods import REGISTRY, method_class

ROOT = Path(__file__).parents[1]
PAGES = reference_pages()


def recipe_file(name: str) -> dict:
    return tomllib.loads((resources.files("cafa_cli.methods.recipes") / f"{name}.toml").read_text(encoding="utf-8"))


def hook():
    spec = importlib.util.spec_from_file_location("methods_reference", ROOT / "docs" / "hooks" / "methods_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_there_is_a_page_for_each_registered_method_and_the_index_links_each():
    assert set(PAGES) == {"index.md", *(f"{name}.md" for name in REGISTRY)}
    for name in REGISTRY:
        assert PAGES[f"{name}.md"].startswith(f"# {name}\n")
        assert f"[{name}]({name}.md)" in PAGES["index.md"]


@pytest.mark.parametrize("name", REGISTRY)
def test_a_methods_page_has_each_option_each_recipe_family_and_its_notes(name):
    page, about = PAGES[f"{name}.md"], recipe_file(name)
    options = page[page.index("## Options") : page.index("## Recipes")]
    recipes = page[page.index("## Recipes") : page.index("## Notes")]
    for option in method_class(name).options:
        assert f"| `{option.name}` |" in options and f"| `{option.name}` |" in recipes, option.name
    families = [key for key in about if key != "method"]
    assert families and f"|  | {' | '.join(families)} |" in recipes
    for family in families:
        assert f"- **{family}**: " in recipes
    assert about["method"]["notes"].strip() in page  # every method says how it is run
    assert (about["method"].get("deviations") or "None recorded.").strip() in page


def test_the_hook_makes_the_methods_nav_section_from_the_registry():
    from mkdocs.exceptions import PluginError

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    hook().on_config({"nav": nav})
    reference = next(entry["Reference"] for entry in nav if "Reference" in entry)
    section = next(entry["Methods"] for entry in reference if "Methods" in entry)
    assert section == ["reference/methods/index.md", *(f"reference/methods/{name}.md" for name in REGISTRY)]
    with pytest.raises(PluginError, match="no entry for reference/methods/index.md"):
        hook().on_config({"nav": [{"Home": "index.md"}]})  # the pages would be left out of the site
