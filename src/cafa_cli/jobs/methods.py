"""`cafa methods`: every method with what it does, its paper, what it adapts, whether it
needs an artifact and its step cost; one method's options and a recipe as TOML."""

from __future__ import annotations

from dataclasses import fields

from rich.table import Column, Table
from rich.text import Text

from cafa_cli.core.errors import InputError, UsageError, printable
from cafa_cli.engine.options import resolve_options, shown
from cafa_cli.jobs.config import AdaptConfig
from cafa_cli.methods import REGISTRY, method_class
from cafa_cli.methods.recipes import FAMILIES, SETTINGS, description, recipe_for, shipped, to_toml

COLUMNS = ("method", "summary", "paper", "adapts", "artifact", "cost")  # the keys of a row, and of --json's
HEADERS = {"cost": "step ÷ TENT (CPU)"}  # a table's words for a key, where they differ from it
_STACKED_BELOW = 72  # terminal columns; narrower, each method's facts stack in one cell
TRAINING_SETTINGS = ("optimizer", "lr", "momentum", "steps", "params")  # meaningless for a method that does not train


def methods_table() -> list[dict]:
    """One row per built-in method: the [method] table of its recipe file, and whether it
    needs an artifact (cafa stats)."""
    rows = []
    for name in REGISTRY:
        about = description(name)
        cost = about["cost"]
        rows.append(
            {
                "method": name,
                "summary": about["summary"],
                "paper": about["paper"],
                "adapts": about["adapts"],
                "artifact": method_class(name).needs_statistics,
                "cost": None if cost is None else float(cost),
            }
        )
    return rows


def cell(value) -> str:
    """A value as both tables show it: yes/no, two decimals, — for none."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.2f}"
    return "—" if value is None else str(value)


def markdown(rows: list[dict]) -> str:
    """The table as markdown, one method a line: for a file, a pipe or a document."""
    lines = ["| " + " | ".join(HEADERS.get(c, c) for c in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(row[column]).replace("|", "\\|") for column in COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def terminal_table(rows: list[dict], width: int) -> Table:
    """The table for a terminal `width` columns wide: each cell wraps inside its column, where
    a markdown line of ~300 characters wraps across the whole screen. Below 72 columns six
    columns would leave a few letters a line: each method's facts stack in one cell."""
    if width < _STACKED_BELOW:
        table = Table(Column("method", no_wrap=True), "about", show_lines=True, show_edge=False)
        for row in rows:
            about = [
                cell(row["summary"]),
                f"paper: {cell(row['paper'])}",
                f"adapts: {cell(row['adapts'])}",
                f"artifact: {cell(row['artifact'])}; {HEADERS['cost']}: {cell(row['cost'])}",
            ]
            table.add_row(Text(printable(row["method"])), Text("\n".join(map(printable, about)), overflow="fold"))
        return table
    table = Table(
        Column("method", no_wrap=True),
        "summary",
        "paper",
        Column("adapts", max_width=24),
        "artifact",
        Column("step ÷ TENT", justify="right", max_width=6),
        show_lines=True,
        show_edge=False,
        caption="step ÷ TENT: the time of one step over TENT's, on the CPU",
        caption_justify="left",
    )
    for row in rows:
        table.add_row(*(Text(printable(cell(row[column])), overflow="fold") for column in COLUMNS))
    return table


def method_recipe(name: str, recipe: str = "none") -> str:
    """`name`'s options and the setting `recipe` gives it (a family, a file, or none: the
    settings' own defaults), as TOML that `--recipe FILE` reads back: the method described
    in comments, each option's help after its value."""
    if name not in REGISTRY:
        raise UsageError(f"no method {name!r}; the methods: {', '.join(REGISTRY)}")
    if recipe == "auto":
        raise UsageError(
            "`recipe` auto chooses a family from the test data and the model; name one: "
            f"{', '.join(FAMILIES)} (or none, or a .toml file)"
        )
    if recipe not in (*FAMILIES, "none") and not recipe.endswith(".toml"):
        raise UsageError(f"`recipe` must be one of {', '.join(FAMILIES)}, none, or a .toml file, not {recipe!r}")
    chosen = recipe_for(recipe, name, [], None)  # None for `none`
    method = method_class(name)
    defaults = {f.name: f.default for f in fields(AdaptConfig) if f.name in SETTINGS}
    relevant = [
        key
        for key in SETTINGS
        if (method.trains or key not in TRAINING_SETTINGS)
        and (key != "fisher_samples" or method_class(name).without_source_images)
    ]
    settings = {key: (chosen.settings if chosen else {}).get(key, defaults[key]) for key in relevant}
    if chosen:  # a file's values are checked as a run checks them: what is printed reads back and runs
        try:
            AdaptConfig(method=name, **{key: value for key, value in chosen.settings.items()})
        except UsageError as error:
            raise InputError(f"the recipe {chosen.origin}: {error}") from None
    options = resolve_options(name, method.options, chosen.options if chosen else {})
    about = description(name)
    header = [
        f"# {name}: {about['summary']}",
        f"# paper: {about['paper']}",
        f"# adapts: {about['adapts']}",
        f"# needs an artifact (cafa stats): {'yes' if method_class(name).needs_statistics else 'no'}",
        f"# recipes: {', '.join(family for family in FAMILIES if shipped(name, family))}",
        "# each option: its value here, then what it does and accepts (default)",
    ]
    comments = {
        option.name: f"{option.help}; {option.accepts()} (default {shown(option.default)})" for option in method.options
    }
    source = chosen.source if chosen else "none: the settings' own defaults"
    return (
        "\n".join(header)
        + "\n\n"
        + to_toml(name, settings, options, family=chosen and chosen.family, source=source, comments=comments)
    )
