"""The methods reference, docs/reference/methods/: made at build time from the method registry
and the recipes by cafa_cli.jobs.methods.reference_pages (nothing of it is committed), with
methods_reference.md beside this file as its index's hand-written prose. Its navigation is
made here too: the entry for the index becomes a section of the index and every method's
page, in the registry's order."""

from __future__ import annotations

import sys
from pathlib import Path

from mkdocs.structure.files import File

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1] / "src"), str(HERE)]  # this checkout's package, whichever one is installed

from navigation import expand_section  # noqa: E402

from cafa_cli.jobs.methods import reference_pages  # noqa: E402
from cafa_cli.methods import REGISTRY  # noqa: E402

FOLDER = "reference/methods"
INDEX = f"{FOLDER}/index.md"


def on_config(config):
    expand_section(config, INDEX, [INDEX, *(f"{FOLDER}/{name}.md" for name in REGISTRY)], "methods_reference")
    return config


def on_files(files, config):
    intro = (HERE / "methods_reference.md").read_text(encoding="utf-8")
    for name, page in reference_pages(intro).items():
        files.append(File.generated(config, f"{FOLDER}/{name}", content=page))
    return files
