"""Defaults from `cafa.toml` (or `[tool.cafa]` in pyproject.toml) in the working directory.

A CI pipeline sets once what it would otherwise repeat on every line:

    [adapt]
    batch-size = 64
    optimizer = "sgd"
    lr = 0.0025

Tables are commands, keys are their long options without the dashes. Options on the
command line win over the file.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from cafa_cli.cli.renamed import warn_renamed
from cafa_cli.core.errors import UsageError, did_you_mean
from cafa_cli.core.factories import is_factory
from cafa_cli.core.files import read_small_text, toml_problem

CONFIG_FILE = "cafa.toml"
# The most cafa.toml or pyproject.toml may hold: a cafa.toml is a few lines, and the
# pyproject.toml files of large projects are tens of KB; a file over 4 MiB is none of them
# (a link to /dev/zero, a sparse file) and is refused unread, before every command.
CONFIG_LIMIT = 4 << 20


@dataclass
class CommandOptions:
    """What a command's table in the file may hold."""

    keys: dict[str, str]  # its long options without the dashes (an argument by its name) -> parameter names
    lists: set[str] = field(default_factory=set)  # parameters that take several values: one string is a list of one
    flags: set[str] = field(default_factory=set)  # parameters that take true or false; any other would take true as 1
    # parameters that let code run or lift a safety check: a file in the working folder
    # (a cloned repository, a downloaded results folder) must not set them for the user
    command_line_only: set[str] = field(default_factory=set)
    # parameters whose value may name code to import (`--method module:factory`): a file may give a plain name only
    names_code: set[str] = field(default_factory=set)
    renamed: dict[str, str] = field(default_factory=dict)  # old keys -> their new ones (cli/renamed.py)


def read_defaults(folder: str | Path, commands: dict[str, CommandOptions]) -> dict[str, dict]:
    """{command: {parameter: value}} for typer's default_map, checked against each
    command's options, so that a misspelt key is an error rather than ignored."""
    path, table, prefix = defaults_file(folder), None, ""
    if path is not None and path.name == CONFIG_FILE:
        table = _load(path)
    elif path is not None:
        prefix = "tool.cafa."
        tool = _load(path).get("tool", {})
        table = tool.get("cafa") if isinstance(tool, dict) else None
    if not table:
        return {}
    if not isinstance(table, dict):
        raise UsageError(f"{path}: [tool.cafa] must be a table of commands, e.g. [tool.cafa.adapt]")
    defaults: dict[str, dict] = {}
    for command, values in table.items():
        if command not in commands:
            raise UsageError(
                f"{path}: [{prefix}{command}] is not a cafa command; use one of {', '.join(sorted(commands))}"
            )
        if not isinstance(values, dict):
            raise UsageError(
                f"{path}: {prefix}{command} = {values!r} must be a table of its options, e.g. [{prefix}{command}] on "
                "a line of its own"
            )
        defaults[command], options = {}, commands[command]
        for key, value in values.items():
            new = options.renamed.get(key.replace("_", "-"))
            if new:
                warn_renamed(key, new, f"{path}: [{prefix}{command}] ")
                key = new
            name = options.keys.get(key.replace("_", "-"))  # batch_size as well as batch-size
            if name is None:
                raise UsageError(
                    f"{path}: [{prefix}{command}] has no option {key!r}{did_you_mean(key, list(options.keys))}"
                )
            if name in options.command_line_only:
                raise UsageError(
                    f"{path}: [{prefix}{command}] sets {key!r}, which lets code run or lifts a safety check; "
                    f"a config file may not: remove it and give --{name.replace('_', '-')} on the command line"
                )
            if name in options.names_code and names_code(value):
                raise UsageError(
                    f"{path}: [{prefix}{command}] {key} = {value!r} names code to run, which a config file may "
                    f"not (code runs only when named on the command line); remove it and give "
                    f"--{name.replace('_', '-')} on the command line"
                )
            if name in defaults[command]:
                raise UsageError(f"{path}: [{prefix}{command}] sets {key!r} twice (with - and with _); keep one")
            if isinstance(value, bool) and name not in options.flags:
                raise UsageError(
                    f"{path}: [{prefix}{command}] {key} = {str(value).lower()}: {key} takes a value, not true or false"
                )
            if isinstance(value, str) and name in options.lists:
                value = [value]
            elif isinstance(value, list) and name not in options.lists:
                # an option that takes a comma-separated list (seeds, methods, mean) written as a TOML array
                value = ",".join(str(item) for item in value)
            defaults[command][name] = value
    return defaults


def names_code(value) -> bool:
    """Whether a config value names code to import, in any type or spelling: a text, a
    list's items, a table's keys and values, each comma-separated entry of a text, that is
    a factory or plug-in (`file.py:fn`, `module:fn`; `timm:NAME` names no code)."""
    if isinstance(value, dict):
        return any(names_code(item) for pair in value.items() for item in pair)
    if isinstance(value, (list, tuple)):
        return any(names_code(item) for item in value)
    return any(is_factory(entry.strip()) for entry in str(value).split(","))


def defaults_file(folder: str | Path) -> Path | None:
    """The file read_defaults reads: cafa.toml, else pyproject.toml, else None. Anything by
    that name counts (a folder, a pipe, a dangling link too), so that _load refuses it rather
    than the defaults being quietly taken from elsewhere or not at all."""
    return next(
        (Path(folder) / name for name in (CONFIG_FILE, "pyproject.toml") if os.path.lexists(Path(folder) / name)), None
    )


def defaults_source(folder: str | Path) -> str:
    """Where read_defaults found the defaults, for errors about their values."""
    return CONFIG_FILE if os.path.lexists(Path(folder) / CONFIG_FILE) else "[tool.cafa] in pyproject.toml"


def _load(path: Path) -> dict:
    text = read_small_text(path, "", CONFIG_LIMIT, "fix it, or move it away", error=UsageError)
    try:
        return tomllib.loads(text)
    except ValueError as error:  # TOMLDecodeError, or an integer past Python's 4,300 digits
        raise UsageError(f"{path}: not valid TOML ({toml_problem(error)})") from None
