"""mkdocs hook: the pages reference/cli/, generated at each build from the typer app
(cafa_cli.cli.reference), so the reference of the options cannot drift from them. Its
navigation is made here too: the entry for the index becomes a section of the index and
each command's page, in the order of `cafa --help`."""

from __future__ import annotations

import sys
from pathlib import Path

from mkdocs.structure.files import File

HERE = Path(__file__).resolve().parent
# the checkout's own code, not whichever cafa the environment installed (a worktree, a fresh clone)
sys.path[:0] = [str(HERE.parents[1] / "src"), str(HERE)]

from navigation import expand_section  # noqa: E402

from cafa_cli.cli.reference import FOLDER, cli_reference  # noqa: E402

INDEX = f"{FOLDER}/index.md"


def on_config(config):
    expand_section(config, INDEX, [f"{FOLDER}/{name}" for name in cli_reference()], "cli_reference")
    return config


def on_files(files, config):
    for name, page in cli_reference().items():
        files.append(File.generated(config, f"{FOLDER}/{name}", content=page))
    return files
