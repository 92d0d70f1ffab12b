"""The command-line reference as markdown, generated from the typer app: every command and
subcommand with its usage, summary, arguments, every option by help panel (flags and
metavar, default, help) and its examples. The docs' hook (docs/hooks/cli_reference.py) makes
it the pages reference/cli/ at each build, so they cannot drift from the options: an index
with the root command, and a page a command (a group's subcommands on the group's page)."""

from __future__ import annotations

import posixpath
import re

import typer

from cafa_cli.cli.app import EXAMPLES, GUIDES, app
from cafa_cli.cli.options import help_sections, split_extra

FOLDER = "reference/cli"

INTRO = """\
Every command and option of `cafa`, generated from the command line itself when the site is
built. On a terminal, `cafa COMMAND -h` shows the options a user decides first and
`cafa COMMAND --help` all of them, as listed on each command's page; an option typed on the
command line wins over [cafa.toml](../../guides/configuration.md), which wins over the
default shown there."""


def cli_reference() -> dict[str, str]:
    """The pages by file name: index.md, the root command with a link to each command's
    page; then NAME.md a command, its subcommands (`plot features`) on its page."""
    root = typer.main.get_command(app)
    root_ctx = _context(root, "cafa")
    pages = {"index.md": _page("Command line", INTRO, _command_section(root, root_ctx, 2, lambda sub: f"{sub}.md"))}
    for name in _subcommands(root, root_ctx):
        command = root.get_command(root_ctx, name)
        ctx = _context(command, name, root_ctx)
        sections = [
            _command_section(sub, sub_ctx, 1 if sub is command else 2, lambda sub: f"#{_anchor(f'cafa {name} {sub}')}")
            for sub, sub_ctx in _commands(command, ctx)
        ]
        pages[f"{name}.md"] = "\n\n".join(sections) + "\n"
    return pages


def _page(title: str, *parts: str) -> str:
    return "\n\n".join([f"# {title}", *parts]) + "\n"


def _context(command, name: str, parent=None):
    return command.context_class(command, info_name=name, parent=parent, **command.context_settings)


def _commands(command, ctx):
    yield command, ctx
    for name in _subcommands(command, ctx):
        sub = command.get_command(ctx, name)
        yield from _commands(sub, _context(sub, name, ctx))


def _subcommands(command, ctx) -> list[str]:
    """A group's commands, in the order of its help; a command has none."""
    return command.list_commands(ctx) if hasattr(command, "list_commands") else []


def _command_section(command, ctx, level: int, link) -> str:
    """A command's section under a heading of `level`; `link(sub)` is where a subcommand's row points."""
    path = ctx.command_path
    name = path.partition(" ")[2] or "cafa"
    parts = [
        f"{'#' * level} {path}",
        _text(command.help or ""),
        f"```text\n{path} {' '.join(command.collect_usage_pieces(ctx))}\n```",
    ]
    if _subcommands(command, ctx):
        rows = [
            (f"[`{path} {sub}`]({link(sub)})", command.get_command(ctx, sub).get_short_help_str(200))
            for sub in _subcommands(command, ctx)
        ]
        parts.append(_table(("Command", "What it does"), [(link, _text(help)) for link, help in rows], "Commands"))
    for title, rows in help_sections(command, ctx):
        if title == "Arguments":
            parts.append(_table(("Argument", "Description"), [(f"`{n}`", _text(h)) for n, h in rows], title))
        else:
            parts.append(_table(("Option", "Default", "Description"), [_option_row(n, h) for n, h in rows], title))
    if name in EXAMPLES:
        parts.append("**Examples**\n\n```sh\n" + "\n".join(EXAMPLES[name]) + "\n```")
    if name in GUIDES:
        page = GUIDES[name].removeprefix("docs/")
        parts.append(f"Guide: [{page}]({posixpath.relpath(page, FOLDER)})")  # a link from a page of reference/cli/
    return "\n\n".join(part for part in parts if part)


def _option_row(names: str, help: str) -> tuple[str, str, str]:
    text, extra = split_extra(help)
    default = extra[1:-1].removeprefix("default: ")
    is_value = default and default != "required" and " " not in default  # else words: "the recipe's, else 200"
    return f"`{names}`", f"`{default}`" if is_value else _text(default), _text(text)


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]], title: str) -> str:
    lines = [f"**{title}**", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]  # the cells are escaped (_text) or code
    return "\n".join(lines)


def _text(help: str) -> str:
    """Help text as markdown shows it as typed: its paragraphs kept, no emphasis or HTML made of
    its characters (ImageNet-C/*/5, <csv|jsonl>)."""
    paragraphs = [" ".join(p.split()) for p in help.split("\n\n")]
    return "\n\n".join(re.sub(r"([\\`*_\[\]<>|])", r"\\\1", p) for p in paragraphs if p)


def _anchor(heading: str) -> str:
    """The id mkdocs' toc gives a heading: lower case, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).strip().replace(" ", "-")
