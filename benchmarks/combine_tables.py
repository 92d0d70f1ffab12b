"""One methods × conditions table from several `cafa bench --json` files.

Each file's rows are NAME[@LR] under a condition: the row's stream order (`--orders`),
with ", continual" added when the bench ran with `--reset never`, and ", batch N" when
it ran a `--batch-sizes` axis. A cell is the mean error over the domains, ± the std over
seeds when a file has more than one. Rows and columns keep the order they first appear
in; a method missing under a condition gets "—".

    python benchmarks/combine_tables.py out/methods-orders.json out/methods-continual.json ...
"""

from __future__ import annotations

import json
import sys


def condition(row: dict, settings: dict, sizes: bool) -> str:
    words = [row.get("order") or settings.get("order", "iid")]
    if settings.get("reset") == "never":
        words.append("continual")
    if sizes:
        words.append(f"batch {row['batch_size']}")
    return ", ".join(words)


def cells(report: dict) -> list[tuple[str, str, str]]:
    """(method, condition, cell) for each row of one bench report."""
    settings, seeds = report["settings"], report["seeds"]
    sizes = settings.get("batch_sizes") is not None
    found = []
    for row, line in zip(report["rows"], report["table"]):
        method = row["label"].partition(", ")[0]
        mean = line["mean"]
        cell = f"{mean['mean']:.2f}" + (f" ± {mean['std']:.2f}" if len(seeds) > 1 else "")
        found.append((method, condition(row, settings, sizes), cell))
    return found


def combine(reports: list[dict]) -> str:
    table: dict[str, dict[str, str]] = {}
    columns: list[str] = []
    for report in reports:
        for method, column, cell in cells(report):
            table.setdefault(method, {})[column] = cell
            if column not in columns:
                columns.append(column)
    lines = ["| method | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    lines += [f"| {method} | " + " | ".join(row.get(c, "—") for c in columns) + " |" for method, row in table.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    reports = []
    for path in sys.argv[1:]:
        with open(path, encoding="utf-8") as f:
            reports.append(json.load(f))
    print(combine(reports))
