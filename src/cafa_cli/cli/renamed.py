"""Option spellings that changed, kept working for one release with a one-line warning on
stderr, on the command line and in cafa.toml alike.

One meaning per flag name across the commands: `--json` prints JSON on stdout (inspect,
methods, plot features), `--metrics-json PATH` writes a run's JSON record to a file
(adapt, bench).
"""

from __future__ import annotations

import sys

# command (as `cafa COMMAND`) -> {old flag: new flag}
RENAMED: dict[str, dict[str, str]] = {
    "bench": {"--json": "--metrics-json"},
}


def warn_renamed(old: str, new: str, where: str = "") -> None:
    print(f"warning: {where}{old} is now {new}; the old spelling goes in a later release", file=sys.stderr)


def respelled(command: str, args: list[str]) -> list[str]:
    """`args` of `cafa COMMAND` with each old spelling replaced by its new one (warned once
    each); what follows `--` is left as it is."""
    renamed, out = RENAMED.get(command, {}), []
    for k, arg in enumerate(args):
        if str(arg) == "--":
            return out + args[k:]
        flag, equals, value = str(arg).partition("=")
        if flag in renamed:
            warn_renamed(flag, renamed[flag])
            arg = renamed[flag] + equals + value
        out.append(arg)
    return out


def renamed_keys(command: str) -> dict[str, str]:
    """The old cafa.toml keys of `command` -> their new keys (option names without dashes)."""
    return {old[2:]: new[2:] for old, new in RENAMED.get(command, {}).items()}
