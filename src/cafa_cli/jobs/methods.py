"""`cafa methods`: every method with what it does, its paper, what it adapts, whether it
needs an artifact, its step cost and its peak memory; one method's options and a recipe as TOML."""

from __future__ import annotations

import re
from dataclasses import fields

from rich.table import Column, Table
from rich.text import Text

from cafa_cli.core.errors import InputError, UsageError, printable
from cafa_cli.engine.options import resolve_options, shown
from cafa_cli.jobs.config import AdaptConfig
from cafa_cli.methods import REGISTRY, method_class
from cafa_cli.methods.recipes import FAMILIES, SETTINGS, Recipe, description, recipe_for, shipped, to_toml

COLUMNS = ("method", "summary", "paper", "adapts", "artifact", "cost", "memory_mib")  # a row's keys, and --json's
HEADERS = {"cost": "step ÷ TENT (CPU)", "memory_mib": "peak MiB (CPU)"}  # a table's words for a key, where not it
FACTS = {"artifact": "needs an artifact (cafa stats)"}  # a method's page's words for a key, where a table's are terse
COST_MEANS = "step ÷ TENT: the time of one step over TENT's, on the CPU"
MEMORY_MEANS = (
    "peak MiB: the most memory the method's Adapter takes above the loaded model (its build and four steps, "
    "peak RSS), on the CPU, on the bundled fmnist-resnet at batch 64; the ViT methods' on a tiny ViT, the CLIP "
    "methods' on a tiny CLIP (source's and tent's on each: docs/performance/methods.md)"
)
_STACKED_BELOW = 80  # terminal columns; narrower, each method's facts stack in one cell
NOT_MEASURED = "—"  # a recipe file's `memory_mib` for a method without a figure (its notes say why)
TRAINING_SETTINGS = ("optimizer", "lr", "momentum", "steps", "params")  # meaningless for a method that does not train


def methods_table() -> list[dict]:
    """One row per built-in method (method_row)."""
    return [method_row(name) for name in REGISTRY]


def method_row(name: str) -> dict:
    """A built-in method's row: the [method] table of its recipe file, and whether it needs an
    artifact (cafa stats)."""
    about = description(name)
    cost, memory = about["cost"], about["memory_mib"]
    return {
        "method": name,
        "summary": about["summary"],
        "paper": about["paper"],
        "adapts": about["adapts"],
        "artifact": method_class(name).needs_statistics,
        "cost": None if cost is None else float(cost),
        "memory_mib": None if memory in (None, NOT_MEASURED) else memory,  # whole MiB
    }


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
    a markdown line of ~300 characters wraps across the whole screen. Below 80 columns seven
    columns would leave a few letters a line: each method's facts stack in one cell."""
    if width < _STACKED_BELOW:
        table = Table(Column("method", no_wrap=True), "about", show_lines=True, show_edge=False)
        for row in rows:
            about = [
                cell(row["summary"]),
                f"paper: {cell(row['paper'])}",
                f"adapts: {cell(row['adapts'])}",
                f"artifact: {cell(row['artifact'])}; {HEADERS['cost']}: {cell(row['cost'])}; "
                f"{HEADERS['memory_mib']}: {cell(row['memory_mib'])}",
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
        Column("peak MiB", justify="right", max_width=6),
        show_lines=True,
        show_edge=False,
        caption=f"{COST_MEANS}; {MEMORY_MEANS}",
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
    if chosen:  # a file's values are checked as a run checks them: what is printed reads back and runs
        try:
            AdaptConfig(method=name, **{key: value for key, value in chosen.settings.items()})
        except UsageError as error:
            raise InputError(f"the recipe {chosen.origin}: {error}") from None
    settings, options = recipe_values(name, chosen)
    method = method_class(name)
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


def recipe_values(name: str, chosen: Recipe | None) -> tuple[dict, dict]:
    """What `name` runs with under the recipe `chosen` (None: no recipe): the settings that
    matter to it and every option of its own, each the recipe's or else its default."""
    method = method_class(name)
    defaults = {f.name: f.default for f in fields(AdaptConfig) if f.name in SETTINGS}
    relevant = [
        key
        for key in SETTINGS
        if (method.trains or key not in TRAINING_SETTINGS) and (key != "fisher_samples" or method.without_source_images)
    ]
    given = chosen.settings if chosen else {}
    settings = {key: given.get(key, defaults[key]) for key in relevant}
    return settings, resolve_options(name, method.options, chosen.options if chosen else {})


# --- the site's methods reference (docs/hooks/methods_reference.py adds its pages at build time) ---


def reference_pages(intro: str = "") -> dict[str, str]:
    """The methods reference as markdown, {file name: page}: index.md, `cafa methods`' table
    with each method linked to its page, `intro` (the hand-written prose on recipes), then
    each family's recipes side by side; and NAME.md for each method (method_page)."""
    pages = {"index.md": index_page(intro)}
    pages.update({f"{name}.md": method_page(name) for name in REGISTRY})
    return pages


def index_page(intro: str = "") -> str:
    rows = [
        {key: _escaped(value) if isinstance(value, str) else value for key, value in row.items()}
        | {"method": f"[{row['method']}]({row['method']}.md)"}
        for row in methods_table()
    ]
    parts = ["# Methods", markdown(rows), f"*{COST_MEANS}; {MEMORY_MEANS}.*", intro.strip(), "## Recipes by family"]
    for family in FAMILIES:
        recipes = {name: shipped(name, family) for name in REGISTRY}
        keys = [key for key in SETTINGS if any(recipe and key in recipe.settings for recipe in recipes.values())]
        lines = [_row(["method", *keys]), _row(["---"] * (len(keys) + 1))]
        lines += [
            _row(
                [
                    f"[{name}]({name}.md)",
                    *(_code(recipe.settings[key]) if key in recipe.settings else "" for key in keys),
                ]
            )
            for name, recipe in recipes.items()
            if recipe
        ]
        parts += [f"### {family}", "\n".join(lines)]
    parts.append("An empty cell is the setting's default, or a setting the method does not use.")
    return "\n\n".join(part for part in parts if part) + "\n"


def method_page(name: str) -> str:
    """One method's page: what `cafa methods` says of it, its options, its recipe for each
    family with their sources, and the notes and deviations of its recipe file's [method] table."""
    row, about, method = method_row(name), description(name), method_class(name)
    facts = "\n".join(f"- **{FACTS.get(c, HEADERS.get(c, c))}**: {_escaped(cell(row[c]))}" for c in COLUMNS[2:])
    summary = _escaped(cell(row["summary"]))
    parts = [f"# {name}", summary[:1].upper() + summary[1:] + ".", facts, f"*{COST_MEANS}; {MEMORY_MEANS}.*"]
    parts.append("## Options")
    if method.options:
        lines = [_row(["option", "default", "accepts", "what it does"]), _row(["---"] * 4)]
        lines += [
            _row([f"`{option.name}`", _code(option.default), _escaped(option.accepts()), _escaped(option.help)])
            for option in method.options
        ]
        parts.append("\n".join(lines))
    else:
        parts.append("None of its own.")
    recipes = {family: recipe for family in FAMILIES if (recipe := shipped(name, family))}
    parts.append("## Recipes")
    if recipes:
        values = [recipe_values(name, recipe) for recipe in recipes.values()]
        lines = [_row(["", *recipes]), _row(["---"] * (len(recipes) + 1))]
        lines += [_row([key, *(_code(settings[key]) for settings, _ in values)]) for key in values[0][0]]
        lines += [_row([f"`{o.name}`", *(_code(options[o.name]) for _, options in values)]) for o in method.options]
        sources = [f"- **{family}**: {_escaped(recipe.source)}" for family, recipe in recipes.items()]
        parts += ["\n".join(lines), "Sources:\n\n" + "\n".join(sources)]
    else:
        parts.append("None shipped.")
    if about["notes"]:
        parts += ["## Notes", about["notes"].strip()]
    parts += ["## Deviations from the authors' code", (about["deviations"] or "None recorded.").strip()]
    return "\n\n".join(parts) + "\n"


def _row(cells) -> str:
    return "| " + " | ".join(text.replace("|", "\\|") for text in cells) + " |"


def _code(value) -> str:
    return f"`{shown(value)}`"


def _escaped(text: str) -> str:
    """Text from a recipe file as markdown shows it literally (`cfgs/*/x.yaml`, `<dataset>`)."""
    return re.sub(r"([\\`*_\[\]])", r"\\\1", text).replace("<", "&lt;")
