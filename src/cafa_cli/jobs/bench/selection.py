"""Label-free selection of a hyperparameter (`cafa bench --select NAME=V,... --by RULE`), as
Cygert et al. ("Realistic evaluation of test-time adaptation algorithms: unsupervised
hyperparameter selection", 2024) evaluate it: every row runs at
each value, a rule picks one value per row from the runs themselves, and the table says how far the
picked value's error is from the best one's (the oracle, which reads the test labels).

The rules, each a score of one (row, value), the lowest picked, the first value on a tie:
- entropy: the mean entropy of the predicted probabilities over every image of the stream (nats);
- consistency: minus the share of images whose prediction stays when the image is flipped left to
  right, predicted by the model as the step finds it (Cygert et al.'s consistency under augmentation,
  with the one augmentation every image keeps its class through);
- source-accuracy: minus the accuracy on held-out labelled source images (`forgetting`), the mean of
  its measurements after each domain;
- oracle: the error on the test domains (the table's mean column);
- held-out: the error on other labelled domains, run apart (benchmarks/choose_lr.py's protocol).
Each is the mean over the seeds.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from cafa_cli.core.errors import UsageError
from cafa_cli.jobs.bench.rows import Row
from cafa_cli.jobs.bench.runs import _options_taken
from cafa_cli.jobs.config import BenchConfig
from cafa_cli.jobs.config.bench import SELECTION_RULES
from cafa_cli.methods import is_plugin, method_class


def with_selection(config: BenchConfig, rows: list[Row]) -> list[Row]:
    """Under `select`, each row at each value of the setting, value by value within the row
    (`tent lr=0.0001`, `tent lr=0.001`); without it, the rows as they are. Refused when a row's
    method does not take the setting, or when the row or `method_option` sets it already."""
    chosen = config.selection()
    if chosen is None:
        return rows
    name, values, _, _ = chosen
    given = {entry.partition("=")[0].strip().rpartition(".")[2] for entry in config.method_option}
    if name in given:
        raise UsageError(f"`method_option` sets {name} and `select` chooses it; drop one of them")
    expanded = []
    for row in rows:
        if name == "lr":
            if row.lr is not None:
                raise UsageError(
                    f"`methods` {row.label} sets its own lr and `select` chooses it; drop the @ or `select`"
                )
            if not is_plugin(row.method) and not method_class(row.method).trains:
                raise UsageError(
                    f"`select` lr: {row.method} trains nothing, so lr is not one of its settings; leave it out of "
                    f"`methods` (run it in a bench of its own)"
                )
        elif not is_plugin(row.method) and name not in _options_taken(row.method):
            raise UsageError(
                f"`select` {name}: {row.method} has no option {name}; cafa methods {row.method} lists its options"
            )
        for value in values:
            shown = f"{value:g}"
            expanded.append(
                replace(
                    row,
                    label=f"{row.label} {name}={shown}",
                    lr=value if name == "lr" else row.lr,
                    option=None if name == "lr" else f"{name}={shown}",
                    candidate_of=row.label,
                    candidate=value,
                )
            )
    return expanded


def best(scores: dict) -> object:
    """The key of the lowest score, the first one on a tie."""
    return min(scores, key=lambda key: scores[key])


def select(
    config: BenchConfig,
    rows: list[Row],
    table: list[dict],
    results: dict,
    protocols: dict,
    seeds: list[int],
    held_out: list[dict] | None = None,
) -> list[dict]:
    """Per row of `methods` (and grid condition): the value `by` picks, the oracle's, their errors
    (%, the table's mean column) and the gap between them, with every value's score; and under
    `by_rule` the same of every rule the runs can score (all but source-accuracy without
    `forgetting`, and held-out without its domains), so that one bench compares them. `table` is
    tables.summarise's error table; `held_out` the same on the held-out domains under held-out."""
    name, _, rule, _ = config.selection()
    errors = {row["method"]: row["cells"]["mean"][0] for row in table}
    on_held_out = {row["method"]: row["cells"]["mean"][0] for row in held_out or []}
    scored = [
        each
        for each in SELECTION_RULES
        if (each != "source-accuracy" or config.forgetting) and (each != "held-out" or held_out)
    ]
    groups: dict[tuple[str, str], list[Row]] = {}
    for row in rows:
        groups.setdefault((row.candidate_of, row.condition), []).append(row)
    picked = []
    for (label, condition), candidates in groups.items():
        values = {row.label: row.candidate for row in candidates}
        oracle = best({row.label: errors[row.label] for row in candidates})
        by_rule = {}
        for each in scored:
            scores = {
                row.label: _score(each, row, results, protocols, config.data, seeds, errors, on_held_out)
                for row in candidates
            }
            chosen = best(scores)
            by_rule[each] = {
                "picked": values[chosen],
                "picked_error": errors[chosen],
                "gap": errors[chosen] - errors[oracle],
                "scores": {str(values[key]): score for key, score in scores.items()},
            }
        picked.append(
            {
                "method": f"{label}, {condition}" if condition else label,
                "setting": name,
                "by": config.by,
                **by_rule[rule],
                "oracle": values[oracle],
                "oracle_error": errors[oracle],
                "by_rule": by_rule,
            }
        )
    return picked


def _score(rule, row, results, protocols, domains, seeds, errors, on_held_out) -> float:
    if rule == "oracle":
        return errors[row.label]
    if rule == "held-out":
        return on_held_out[row.label]
    per_seed = []
    for seed in seeds:
        runs = [results[(row.label, domain, seed)] for domain in domains]
        images = sum(run.n for run in runs)
        if rule == "entropy":
            per_seed.append(sum(run.entropy_sum for run in runs) / images)
        elif rule == "consistency":
            per_seed.append(-sum(run.consistent or 0 for run in runs) / images)
        else:  # source-accuracy: the accuracy on `forgetting` after each domain
            measured = protocols[(row.label, seed)]["forgetting"]
            per_seed.append(-statistics.mean(1 - each["error"] for each in measured))
    return statistics.mean(per_seed)


# each rule's score as the table shows it: its name, and the sign that makes it read as measured
SHOWN = {
    "entropy": ("mean entropy (nats)", 1),
    "consistency": ("flip consistency %", -100),
    "source-accuracy": ("source accuracy %", -100),
    "oracle": ("error %", 1),
    "held-out": ("held-out error %", 1),
}


def markdown(picked: list[dict]) -> str:
    """Cygert et al.'s table: a line per row, the value picked and its error, the oracle's value
    and error, and the gap; then each value's score; then, where the runs scored other rules
    too, the value each rule picks and its gap."""
    rule = picked[0]["by"].partition(":")[0]
    what, sign = SHOWN[rule]
    name = picked[0]["setting"]
    lines = [
        f"selection of {name} by {picked[0]['by']} (error %, mean over the domains)",
        "",
        f"| method | picked {name} | error | oracle {name} | error | gap | {what} by value |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    digits = 3 if rule == "entropy" else 2
    for row in picked:
        scores = ", ".join(f"{value}: {sign * score:.{digits}f}" for value, score in row["scores"].items())
        lines.append(
            f"| {row['method']} | {row['picked']:g} | {row['picked_error']:.2f} | {row['oracle']:g} | "
            f"{row['oracle_error']:.2f} | {row['gap']:.2f} | {scores} |"
        )
    rules = list(picked[0]["by_rule"])
    if len(rules) > 2:  # besides `by` and the oracle
        lines += [
            "",
            f"every rule the runs scored: the {name} it picks (the gap to the oracle's error, points)",
            "",
            "| method | " + " | ".join(rules) + " |",
            "|---|" + "---:|" * len(rules),
        ]
        for row in picked:
            cells = [f"{each['picked']:g} ({each['gap']:.2f})" for each in row["by_rule"].values()]
            lines.append(f"| {row['method']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
