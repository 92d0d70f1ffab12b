"""The protocol tables of docs/results/protocols.md from benchmarks/protocols_table.sh's bench JSON files:

1. rate.json: each row's error over the 15 domains (mean ± std over the seeds) under a stream
   that does not wait, per order, with the share of batches it adapted on, beside the
   waiting stream's error of the same seeds from the bench JSON files given after OUT (the
   recipes table's: the first file that has a row NAME[@LR], ORDER wins);
2. rounds.json: the error of each round of the long continual stream, and the last round
   against the first;
3. rounds.json: forgetting, the error on the clean domain after the first domain, after the
   first round and after the last;

and OUT/rounds-all.svg, every method's error against round (cafa importable: PYTHONPATH=src).

    python benchmarks/protocols_tables.py OUT [WAITING.json ...]   # OUT/rate*.json and OUT/rounds*.json
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


def _tail(path: str) -> str:
    """A domain by its last three parts (fashion-mnist-c-300/fog/3), wherever its workdir was."""
    return "/".join(Path(path).parts[-3:])


def waiting_errors(files: list[str], seeds: list[int], domains: set[str]) -> dict[tuple[str, str], float]:
    """{(method, order): error % over `domains`, mean over `seeds`} of the waiting stream, from
    bench JSON files whose rows are `NAME[@LR], ORDER` on the same domains; the first file
    with a row wins."""
    found: dict[tuple[str, str], float] = {}
    for path in files:
        runs: dict[tuple[str, str], dict[int, list[float]]] = {}
        for run in json.loads(Path(path).read_text())["runs"]:
            label, _, order = run["method"].rpartition(", ")
            if run["seed"] in seeds and _tail(run["data"]) in domains:
                runs.setdefault((label.partition("@")[0], order), {}).setdefault(run["seed"], []).append(run["error"])
        for key, by_seed in runs.items():
            whole = set(by_seed) == set(seeds) and all(len(errors) == len(domains) for errors in by_seed.values())
            if key not in found and whole:
                found[key] = statistics.mean(100 * statistics.mean(errors) for errors in by_seed.values())
    return found


def rate_table(saved: dict, waiting: dict[tuple[str, str], float]) -> str:
    """Rows `NAME, ORDER` on a bench with an order axis, `NAME` without one."""
    orders = list(dict.fromkeys(row["order"] for row in saved["rows"]))
    axis = any(row["label"].endswith(f", {row['order']}") for row in saved["rows"])
    names = list(dict.fromkeys(row["label"].rpartition(", ")[0] if axis else row["label"] for row in saved["rows"]))
    cells = {row["method"]: row["mean"] for row in saved["table"]}
    shares: dict[str, list[float]] = {}
    for record in saved.get("protocols", []):
        shares.setdefault(record["method"], []).append(100 * record["stream"]["adapted_share"])
    rate = saved["rows"][0].get("stream_rate", "?")
    header = " | ".join(f"{order}, waiting | {order}, rate {rate} | adapted %" for order in orders)
    lines = [f"| method | {header} |", "|---|" + "---:|---:|---:|" * len(orders)]
    for name in names:
        row = []
        for order in orders:
            label = f"{name}, {order}" if axis else name
            cell = cells[label]
            row.append(f"{waiting[(name, order)]:.2f}" if (name, order) in waiting else "—")
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


def merged(paths: list[Path]) -> dict | None:
    """Bench JSON files of one grid run in parts (rows split between processes) as one: their
    rows, cells, runs and protocol records together; the seeds and domains must agree."""
    parts = [json.loads(path.read_text()) for path in paths]
    if not parts:
        return None
    whole = parts[0]
    for part in parts[1:]:
        if part["seeds"] != whole["seeds"] or part["domains"] != whole["domains"]:
            raise SystemExit(f"{paths[0]} and another part ran other seeds or domains; merge only parts of one grid")
        for key in ("rows", "table", "runs", "protocols"):
            whole[key] = whole.get(key, []) + part.get(key, [])
    return whole


def main(out: str, waiting_files: list[str]) -> None:
    """OUT's rate*.json and rounds*.json, each kind merged (a grid split between processes)."""
    saved = merged(sorted(Path(out).glob("rate*.json")))
    if saved:
        domains = {_tail(domain["data"]) for domain in saved["domains"]}
        table = rate_table(saved, waiting_errors(waiting_files, saved["seeds"], domains))
        print("## A stream that does not wait\n\n" + table + "\n")
    saved = merged(sorted(Path(out).glob("rounds*.json")))
    if saved:
        print("## Error by round\n\n" + rounds_table(saved) + "\n")
        print("## Forgetting: error % on clean Fashion-MNIST\n\n" + forgetting_table(saved) + "\n")
        plot_rounds(saved, Path(out) / "rounds-all.svg")


def plot_rounds(saved: dict, path: Path) -> None:
    """Every method's error against round in one figure, as `cafa bench --plot` draws one bench's."""
    # internal (tests/test_api.py lists it): the figure `cafa bench --plot` draws, for the merged rounds
    from cafa_cli.jobs.bench import tables

    first = saved["seeds"][0]
    runs = {record["method"]: record for record in saved["protocols"] if record["seed"] == first}
    tables.plot_rounds(str(path), {m: [(100 * r["error"], 0.0) for r in rec["rounds"]] for m, rec in runs.items()})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
