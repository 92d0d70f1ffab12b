"""What the reference hooks share: a nav entry that becomes a section of generated pages."""

from __future__ import annotations

from mkdocs.exceptions import PluginError


def expand_section(config, index: str, pages: list[str], hook: str) -> None:
    """Make the nav's entry `Title: index` a section of `pages` (each titled by its heading);
    the build stops if the nav has no such entry, for the pages would be left out."""
    if not _expand(config["nav"] or [], index, pages):
        raise PluginError(f"{hook}: the nav has no entry for {index}, where its generated pages go")


def _expand(nav: list, index: str, pages: list[str]) -> bool:
    for entry in nav:
        for title, value in entry.items() if isinstance(entry, dict) else ():
            if value == index:
                entry[title] = pages
                return True
            if isinstance(value, list) and _expand(value, index, pages):
                return True
    return False
