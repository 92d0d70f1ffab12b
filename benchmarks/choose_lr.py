"""Pick each method's learning rate from a held-out `cafa bench --json` run.

Reads the JSON of a bench whose rows are NAME@LR (several learning rates per
method) on held-out corruptions, and prints the `--methods` string for the
reported benchmark: each method with the learning rate of its lowest held-out
mean error (the first on a tie). Rows without @LR (source, bn) pass through unchanged.
It picks as `cafa bench --select lr=... --by held-out:DOMAINS` does (the same function),
which does it in one bench; this script gives the rows to benches of other settings.

    python benchmarks/choose_lr.py heldout.json
"""

from __future__ import annotations

import json
import sys

from cafa_cli.jobs.bench.selection import best


def choose(report: dict) -> list[str]:
    errors: dict[str, dict[str, float]] = {}  # by method, in the table's order: each learning rate's error
    for row in report["table"]:
        name, _, lr = row["method"].partition("@")
        errors.setdefault(name, {})[lr] = row["mean"]["mean"]
    return [f"{name}@{lr}" if (lr := best(by_lr)) else name for name, by_lr in errors.items()]


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as f:
        print(",".join(choose(json.load(f))))
