"""Pick each method's learning rate from a held-out `cafa bench --json` run.

Reads the JSON of a bench whose rows are NAME@LR (several learning rates per
method) on held-out corruptions, and prints the `--methods` string for the
reported benchmark: each method with the learning rate of its lowest held-out
mean error. Rows without @LR (source, bn) pass through unchanged.

    python benchmarks/choose_lr.py heldout.json
"""

from __future__ import annotations

import json
import sys


def choose(report: dict) -> list[str]:
    best: dict[str, tuple[float, str]] = {}
    order: list[str] = []
    for row in report["table"]:
        name, _, lr = row["method"].partition("@")
        if name not in order:
            order.append(name)
        error = row["mean"]["mean"]
        if name not in best or error < best[name][0]:
            best[name] = (error, lr)
    return [f"{name}@{best[name][1]}" if best[name][1] else name for name in order]


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as f:
        print(",".join(choose(json.load(f))))
