"""The methods reference, docs/reference/methods/: made at build time from the method registry
and the recipes by cafa_cli.jobs.methods.reference_pages (nothing of it is committed), with
methods_reference.md beside this file as its index's hand-written prose. Its navigation is
made here too: the entry for the index becomes a section of the index and every method's
page, in the registry's order."""

from __future__ import annotations

import sys
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "src"))  # this checkout's package, whichever one is installed

from cafa_cli.jobs.methods import reference_pages  # noqa: E402
from cafa_cli.methods import REGISTRY  # noqa: E402

FOLDER = "reference/methods"
INDEX = f"{FOLDER}/index.md"


def on_config(config):
    if not expand_nav(config["nav"] or []):
        raise PluginError(f"methods_reference: the nav has no entry for {INDEX}, where the methods' pages go")
    return config


def on_files(files, config):
    intro = (HERE / "methods_reference.md").read_text(encoding="utf-8")
    for name, page in reference_pages(intro).items():
        files.append(File.generated(config, f"{FOLDER}/{name}", content=page))
    return files


def expand_nav(nav: list) -> bool:
    """Make the entry `Title: INDEX` a section of the index and each method's page (titled by
    its heading, the method's name); False when `nav` has no such entry."""
    for entry in nav:
        for title, value in entry.items() if isinstance(entry, dict) else ():
            if value == INDEX:
                entry[title] = [INDEX, *(f"{FOLDER}/{name}.md" for name in REGISTRY)]
                return True
            if isinstance(value, list) and expand_nav(value):
                return True
    return False
