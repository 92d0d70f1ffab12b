"""The protocol tables of docs/results.md from benchmarks/protocols_table.sh's bench JSON files:

1. rate.json: each row's error over the 15 domains (mean ± std over the seeds) under a stream
   that does not wait, per order, with the share of batches it adapted on;
2. rounds.json: the error of each round of the long continual stream, and the last round
   against the first;
3. rounds.json: forgetting, the error on the clean domain after the first domain, after the
   first round and after the last.

    python benchmarks/protocols_tables.py OUT      # reads OUT/rate.json and OUT/rounds.json, where present
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def mean_std(values: list[float]) -> str:
    values = list(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.2f}" + (f" ± {std:.2f}" if len(values) > 1 else "")


def rate_table(saved: dict) -> str:
    orders = list(dict.fromkeys(row["order"] for row in saved["rows"]))
    names = list(dict.fromkeys(row["label"].rpartition(", ")[0] for row in saved["rows"]))
    cells = {row["method"]: row["mean"] for row in saved["table"]}
    shares: dict[str, list[float]] = {}
    for record in saved.get("protocols", []):
        shares.setdefault(record["method"], []).append(100 * record["stream"]["adapted_share"])
    rate = saved["rows"][0].get("stream_rate", "?")
    header = " | ".join(f"{order}, rate {rate} | adapted %" for order in orders)
    lines = [f"| method | {header} |", "|---|" + "---:|---:|" * len(orders)]
    for name in names:
        row = []
        for order in orders:
            label = f"{name}, {order}"
            cell = cells[label]
            row.append(f"{cell['mean']:.2f}" + (f" ± {cell['std']:.2f}" if len(saved["seeds"]) > 1 else ""))
            row.append(f"{statistics.mean(shares[label]):.1f}" if label in shares else "—")
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def rounds_table(saved: dict) -> str:
    runs = {record["method"]: record for record in saved["protocols"] if record["seed"] == saved["seeds"][0]}
    count = max(len(record["rounds"]) for record in runs.values())
    lines = [
        "| method | " + " | ".join(str(k + 1) for k in range(count)) + " | last − first |",
        "|---|" + "---:|" * (count + 1),
    ]
    for method, record in runs.items():
        errors = [100 * r["error"] for r in record["rounds"]]
        cells = [f"{e:.2f}" for e in errors]
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {errors[-1] - errors[0]:+.2f} |")
    return "\n".join(lines)


def forgetting_table(saved: dict) -> str:
    runs = {record["method"]: record for record in saved["protocols"] if record["seed"] == saved["seeds"][0]}
    lines = [
        "| method | after the first domain | after round 1 | after the last round | highest |",
        "|---|---:|---:|---:|---:|",
    ]
    for method, record in runs.items():
        forgetting = record["forgetting"]
        first_round = [f for f in forgetting if f["round"] == 1]
        errors = [100 * f["error"] for f in forgetting]
        lines.append(
            f"| {method} | {100 * forgetting[0]['error']:.2f} | {100 * first_round[-1]['error']:.2f} | "
            f"{errors[-1]:.2f} | {max(errors):.2f} |"
        )
    return "\n".join(lines)


def main(out: str) -> None:
    rate, rounds = Path(out) / "rate.json", Path(out) / "rounds.json"
    if rate.exists():
        print("## A stream that does not wait\n\n" + rate_table(json.loads(rate.read_text())) + "\n")
    if rounds.exists():
        saved = json.loads(rounds.read_text())
        print("## Error by round\n\n" + rounds_table(saved) + "\n")
        print("## Forgetting: error % on clean Fashion-MNIST\n\n" + forgetting_table(saved) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
