"""cli/reference.py: the command-line reference the docs site generates (reference/cli/)
names every command and every option of each, walked here from click's command tree rather
than through the renderer, so a command or option the renderer skipped fails."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer

from cafa_cli.cli.app import EXAMPLES, app
from cafa_cli.cli.reference import cli_reference

ROOT = Path(__file__).resolve().parents[1]


def _every_command(command, path="cafa"):
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _every_command(sub, f"{path} {name}")


def _sections(pages: dict[str, str]) -> dict[str, str]:
    """The pages' text under each `# cafa ...` (or `## cafa ...`) heading."""
    parts = re.split(r"^#+ (cafa.*)$", "\n".join(pages.values()), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_every_command_and_every_option_of_it_is_in_the_reference():
    sections = _sections(cli_reference())
    commands = dict(_every_command(typer.main.get_command(app)))
    assert set(sections) == set(commands)
    for path, command in commands.items():
        text = sections[path]
        assert f"```text\n{path} " in text, path  # its usage
        for param in command.params:
            if param.param_type_name == "option":
                for flag in [*param.opts, *param.secondary_opts]:
                    assert re.search(rf"`[^`]*(?<![\w-]){re.escape(flag)}(?![\w-])[^`]*`", text), f"{path}: {flag}"
            else:
                assert f"`{param.metavar}" in text, f"{path}: {param.metavar}"
        assert "`-h, --help`" in text


def test_each_option_is_one_row_with_its_metavar_default_and_help_under_its_panel():
    adapt = _sections(cli_reference())["cafa adapt"]
    method_panel = adapt[adapt.index("**Method**") : adapt.index("**Data**")]
    assert re.search(
        r"^\| `--method NAME` \| `cafa` \| The method, one of the \d+ that cafa methods lists", method_panel, re.M
    )
    assert "| `--lr LR` | the recipe's, else 0.001 | Learning rate. |" in adapt
    assert "| `--format <csv|jsonl>` | `csv` |" in adapt  # a pipe in a code span stays in its cell
    assert r"ImageNet-C/\*/5" in adapt  # help text is text, not emphasis
    stats = _sections(cli_reference())["cafa stats"]
    assert "| `-d, --data PATH` |  | Training images: " in stats  # required unless --from-text: the job says so


def test_every_command_shows_its_examples():
    sections = _sections(cli_reference())
    for name, lines in EXAMPLES.items():
        assert "\n".join(lines) in sections[f"cafa {name}"], name


def test_a_page_a_command_and_the_index_links_each():
    pages = cli_reference()
    commands = typer.main.get_command(app).commands
    assert set(pages) == {"index.md", *(f"{name}.md" for name in commands)}
    for name in commands:
        assert pages[f"{name}.md"].startswith(f"# cafa {name}\n")
        assert f"[`cafa {name}`]({name}.md)" in pages["index.md"]
    assert "[`cafa plot features`](#cafa-plot-features)" in pages["plot.md"]  # a subcommand on its group's page


def test_the_docs_hook_adds_the_generated_pages_and_their_nav_section():
    """As mkdocs runs it: mkdocs.yml names the hook, which adds the pages to the site's files
    and makes the nav's entry for the index a section of every page."""
    pytest.importorskip("mkdocs")
    from mkdocs.config import load_config
    from mkdocs.structure.files import Files

    config = load_config(str(ROOT / "mkdocs.yml"))
    config = config.plugins.on_config(config)
    files = config.plugins.on_files(Files([]), config=config)
    for name, page in cli_reference().items():
        assert files.get_file_from_path(f"reference/cli/{name}").content_string == page
    reference = next(entry["Reference"] for entry in config["nav"] if "Reference" in entry)
    section = next(entry["Command line"] for entry in reference if "Command line" in entry)
    assert section == [f"reference/cli/{name}" for name in cli_reference()]
