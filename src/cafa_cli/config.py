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

import tomllib
from pathlib import Path

from cafa_cli.errors import UsageError

CONFIG_FILE = "cafa.toml"


def read_defaults(folder: str | Path, options: dict[str, dict[str, str]], repeatable: dict[str, set[str]] | None = None,
                  flags: dict[str, set[str]] | None = None) -> dict[str, dict]:
    """{command: {parameter: value}} for typer's default_map. `options` maps each
    command's keys (long options without the dashes) to its parameter names, so a
    misspelt key is an error rather than ignored; `repeatable` names the parameters
    that take a list (where one string means a list of one), `flags` those that take
    true or false (any other takes true as the number 1)."""
    folder = Path(folder)
    path, table, prefix = folder / CONFIG_FILE, None, ""
    if path.is_file():
        table = _load(path)
    elif (folder / "pyproject.toml").is_file():
        path, prefix = folder / "pyproject.toml", "tool.cafa."
        tool = _load(path).get("tool", {})
        table = tool.get("cafa") if isinstance(tool, dict) else None
    if not table:
        return {}
    if not isinstance(table, dict):
        raise UsageError(f"{path}: [tool.cafa] must be a table of commands, e.g. [tool.cafa.adapt]")
    defaults: dict[str, dict] = {}
    for command, values in table.items():
        if command not in options:
            raise UsageError(f"{path}: [{prefix}{command}] is not a cafa command; use one of {', '.join(sorted(options))}")
        if not isinstance(values, dict):
            raise UsageError(f"{path}: {prefix}{command} = {values!r} must be a table of its options, e.g. [{prefix}{command}] on a line of its own")
        defaults[command] = {}
        for key, value in values.items():
            name = options[command].get(key.replace("_", "-"))  # batch_size as well as batch-size
            if name is None:
                raise UsageError(f"{path}: [{prefix}{command}] has no option {key!r}")
            if name in defaults[command]:
                raise UsageError(f"{path}: [{prefix}{command}] sets {key!r} twice (with - and with _); keep one")
            if flags is not None and isinstance(value, bool) and name not in flags.get(command, set()):
                raise UsageError(f"{path}: [{prefix}{command}] {key} = {str(value).lower()}: {key} takes a value, not true or false")
            many = name in (repeatable or {}).get(command, set())
            if isinstance(value, str) and many:
                value = [value]
            elif isinstance(value, list) and not many:
                # an option that takes a comma-separated list (seeds, methods, mean) written as a TOML array
                value = ",".join(str(item) for item in value)
            defaults[command][name] = value
    return defaults


def defaults_source(folder: str | Path) -> str:
    """Where read_defaults found the defaults, for errors about their values."""
    return CONFIG_FILE if (Path(folder) / CONFIG_FILE).is_file() else "[tool.cafa] in pyproject.toml"


def _load(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise UsageError(f"{path}: not valid TOML ({error})") from None
    except OSError as error:
        raise UsageError(f"{path}: cannot read it ({error.strerror or error}); fix its permissions, or move it away") from None
