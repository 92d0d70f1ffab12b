"""mkdocs hook: the page reference/cli.md, generated at each build from the typer app
(cafa_cli.cli.reference), so the reference of the options cannot drift from them."""

from __future__ import annotations

import sys
from pathlib import Path

from mkdocs.structure.files import File

# the checkout's own code, not whichever cafa the environment installed (a worktree, a fresh clone)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from cafa_cli.cli.reference import cli_reference  # noqa: E402

PAGE = "reference/cli.md"


def on_files(files, config):
    files.append(File.generated(config, PAGE, content=cli_reference()))
    return files
