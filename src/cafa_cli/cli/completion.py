"""Shell completion of method and recipe names (`cafa --install-completion` installs it)."""

from __future__ import annotations

from pathlib import Path

from cafa_cli.methods import REGISTRY
from cafa_cli.methods.recipes import NAMES as RECIPES


def complete_method(incomplete: str) -> list[str]:
    return [name for name in REGISTRY if name.startswith(incomplete)]


def complete_methods(incomplete: str) -> list[str]:
    """A comma-separated list (`--methods tent,ca`): the names that complete its last entry."""
    done, _, last = incomplete.rpartition(",")
    return [f"{done},{name}" if done else name for name in (*REGISTRY, "all") if name.startswith(last)]


def complete_recipe(incomplete: str) -> list[str]:
    files = sorted(str(path) for path in Path(".").glob(f"{incomplete}*.toml") if path.is_file()) if incomplete else []
    return [name for name in RECIPES if name.startswith(incomplete)] + files
