"""One methods × conditions table from several `cafa bench --json` files.

Each file's rows are NAME[@LR] under a condition: the row's stream order (`--orders`),
with ", continual" added when the bench ran with `--reset never`, and ", batch N" when
it ran a `--batch-sizes` axis. A row run under another `--norm` than batch is named
`NAME --norm SETTING`. The runs of one row and condition are pooled across the files, so
seeds run by separate benches (seed 0 in one, seeds 1 and 2 in another) make one cell: the
mean error over the domains, ± the std over the seeds when there are several. Rows and
columns keep the order they first appear in; a method missing under a condition gets "—".
A (row, condition, seed, domain) given twice counts once when both give the same error
(seed 0 in a first run and again in a three-seed one) and is an error otherwise, as are
seeds of one cell over different domains.

    python benchmarks/combine_tables.py out/methods-orders.json out/methods-continual.json ...
"""

from __future__ import annotations

import json
import statistics
import sys


def condition(row: dict, settings: dict, sizes: bool) -> str:
    words = [row.get("order") or settings.get("order", "iid")]
    if settings.get("reset") == "never":
        words.append("continual")
    if sizes:
        words.append(f"batch {row['batch_size']}")
    return ", ".join(words)


def runs(report: dict) -> list[tuple[str, str, int, str, float]]:
    """(method, condition, seed, domain, error %) of each run of one bench report."""
    settings = report["settings"]
    sizes = settings.get("batch_sizes") is not None
    norm = settings.get("norm", "batch")
    rows = {row["label"]: row for row in report["rows"]}
    found = []
    for run in report["runs"]:
        row = rows[run["method"]]
        method = row["label"].partition(", ")[0] + ("" if norm == "batch" else f" --norm {norm}")
        found.append((method, condition(row, settings, sizes), run["seed"], run["data"], 100 * run["error"]))
    return found


def cell(errors: dict[int, dict[str, float]], name: str) -> str:
    """Mean over the domains, ± the std over the seeds."""
    domains = {seed: sorted(by_domain) for seed, by_domain in errors.items()}
    if len({tuple(d) for d in domains.values()}) > 1:
        raise SystemExit(f"{name}: its seeds ran over different domains; pool benches of the same domains")
    means = [statistics.mean(by_domain.values()) for _, by_domain in sorted(errors.items())]
    return f"{statistics.mean(means):.2f}" + (f" ± {statistics.stdev(means):.2f}" if len(means) > 1 else "")


def combine(reports: list[dict]) -> str:
    pooled: dict[str, dict[str, dict[int, dict[str, float]]]] = {}
    columns: list[str] = []
    for report in reports:
        for method, column, seed, domain, error in runs(report):
            by_domain = pooled.setdefault(method, {}).setdefault(column, {}).setdefault(seed, {})
            if domain in by_domain and by_domain[domain] != error:  # the same run twice counts once
                raise SystemExit(
                    f"{method}, {column}, seed {seed}, {domain}: given twice, with errors "
                    f"{by_domain[domain]:.2f} and {error:.2f}"
                )
            by_domain[domain] = error
            if column not in columns:
                columns.append(column)
    lines = ["| method | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for method, by_column in pooled.items():
        lines.append(
            f"| {method} | "
            + " | ".join(cell(by_column[c], f"{method}, {c}") if c in by_column else "—" for c in columns)
            + " |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    reports = []
    for path in sys.argv[1:]:
        with open(path, encoding="utf-8") as f:
            reports.append(json.load(f))
    print(combine(reports))
