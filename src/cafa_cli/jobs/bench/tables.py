"""Bench results as tables: mean ± std per method and domain, as markdown, CSV, JSON
and a plot (grouped bars, a line per method over a grid's conditions, or error against
training fraction)."""

from __future__ import annotations

import csv
import os
import statistics as stats_lib
from pathlib import Path

from cafa_cli.core.errors import UsageError
from cafa_cli.core.files import atomic_write
from cafa_cli.jobs.shared.results import METRICS


def domain_label(path: str) -> str:
    """`.../fog/3` → `fog` (ImageNet-C layout), else the folder or file name."""
    p = Path(path)
    return p.parent.name if p.name.isdigit() and p.parent.name else (p.stem or path)


def domain_labels(domains: list[str]) -> dict[str, str]:
    """Column labels, one per domain (and `mean`): `fog`, or `fog/3` and `fog/5` when
    the short ones would collide (with each other or with `mean`), up to the whole path."""
    labels = {d: domain_label(d) for d in domains}
    paths = {
        d: Path(os.path.abspath(d)) if Path(d).exists() else Path(d) for d in domains
    }  # names as given, links not followed
    for depth in range(2, max((len(p.parts) for p in paths.values()), default=0) + 1):
        shown = [*labels.values(), "mean"]
        clashing = {d for d in domains if shown.count(labels[d]) > 1}
        if not clashing:
            break
        labels.update({d: "/".join(paths[d].parts[-depth:]) for d in clashing})
    return {**labels, "mean": "mean"}


def summarise(results: dict, rows: list, domains: list[str], seeds: list[int], metric: str = "error") -> list[dict]:
    """Per row: mean and std (over seeds) of the metric (METRICS: the error in %, by default)
    per domain, and of the mean over domains."""
    scale = METRICS[metric].scale
    values = {key: scale * getattr(result, metric) for key, result in results.items()}
    table = []
    for row in rows:
        cells = {}
        for domain in domains:
            cells[domain] = _mean_std([values[(row.label, domain, s)] for s in seeds])
        cells["mean"] = _mean_std([stats_lib.mean(values[(row.label, d, s)] for d in domains) for s in seeds])
        table.append({"method": row.label, "cells": cells})
    return table


def _cell(mean: float, std: float, seeds: list[int], digits: int = 2) -> str:
    return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if len(seeds) > 1 else "")


def open_world(results: dict, rows: list, domains: list[str], seeds: list[int]) -> dict[str, dict] | None:
    """With outliers in the streams: per row that had any, the AUROC and H in %, each the mean over
    the domains, then mean and std over the seeds; None when no run had outliers."""
    scored = {}
    for row in rows:
        runs = [[results[(row.label, d, s)] for d in domains] for s in seeds]
        if runs[0][0].outlier_scores is None:
            continue
        scored[row.label] = {
            name: _mean_std([stats_lib.mean(100 * getattr(r, name) for r in run) for run in runs])
            for name in ("auroc", "h_score")
            if all(getattr(r, name) is not None for run in runs for r in run)
        }
    return scored or None


def markdown_open_world(table: list[dict], scored: dict[str, dict], seeds: list[int]) -> str:
    """The open-world papers' table: a line per row with outliers, its error on the domains' own
    images, the AUROC of telling the outliers apart and their harmonic mean H (% , means over the
    domains)."""
    errors = {row["method"]: row["cells"]["mean"] for row in table}
    lines = ["| method | error % | AUROC % | H % |", "|---|---:|---:|---:|"]
    for label, values in scored.items():
        cells = [errors[label], values.get("auroc"), values.get("h_score")]
        texts = ["-" if cell is None else _cell(*cell, seeds) for cell in cells]
        lines.append(f"| {label} | " + " | ".join(texts) + " |")
    return "\n".join(lines)


def markdown(table: list[dict], domains: list[str], seeds: list[int], metric: str = "error") -> str:
    keys = domains + ["mean"]
    labels = domain_labels(domains)
    names = [labels[k] for k in keys]
    best = min(row["cells"]["mean"][0] for row in table)
    lines = ["| method | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for row in table:
        cells = []
        for key in keys:
            mean, std = row["cells"][key]
            text = _cell(mean, std, seeds, METRICS[metric].digits)
            cells.append(f"**{text}**" if key == "mean" and mean == best else text)
        lines.append(f"| {row['method']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_by_condition(table: list[dict], rows: list, seeds: list[int], metric: str = "error") -> str:
    """The paper's layout for a grid with an order or batch-size axis: a line per
    condition, a column per method, each cell the error over all domains (mean ± std over
    seeds), the best of each line in bold."""
    conditions, names = list(dict.fromkeys(r.condition for r in rows)), list(dict.fromkeys(r.name for r in rows))
    means = {(r.condition, r.name): entry["cells"]["mean"] for r, entry in zip(rows, table)}
    lines = ["| condition | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for condition in conditions:
        best = min(means[(condition, name)][0] for name in names)
        cells = []
        for name in names:
            mean, std = means[(condition, name)]
            text = _cell(mean, std, seeds, METRICS[metric].digits)
            cells.append(f"**{text}**" if mean == best else text)
        lines.append(f"| {condition} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _condition_columns(rows: list | None) -> list[str]:
    """The Row fields the CSV gives columns of their own: none without axes; on a fraction
    sweep the fraction (empty for a row without statistics); on a grid the order and batch
    size, and the severity on a severity axis."""
    if not rows:
        return []
    if any(row.fraction is not None for row in rows):
        return ["fraction"]
    rates = ["stream_rate"] * any(row.stream_rate is not None for row in rows)
    shares = ["outlier_share"] * any(row.outlier_share is not None for row in rows)
    return ["order", *rates, "batch_size", *shares, *["severity"] * any(row.severity is not None for row in rows)]


def _fraction_sweep(table: list[dict], rows: list) -> tuple[list[float], list[str], dict]:
    """A fraction sweep's (fractions, method names in the rows' order, {(name, fraction):
    (mean, std)} of the error over all domains); a row without statistics under fraction None."""
    fractions = list(dict.fromkeys(row.fraction for row in rows if row.fraction is not None))
    names = list(dict.fromkeys(row.name for row in rows))
    return fractions, names, {(row.name, row.fraction): entry["cells"]["mean"] for row, entry in zip(rows, table)}


def markdown_by_fraction(table: list[dict], rows: list, seeds: list[int], metric: str = "error") -> str:
    """The paper's figure as a table: a line per method, a column per training fraction,
    each cell the error over all domains (mean ± std over seeds), the best of each column
    in bold. A method without statistics ran once: its error stands in every column, as
    the note under the table says."""
    fractions, names, means = _fraction_sweep(table, rows)
    flat = [name for name in names if (name, None) in means]
    lines = [
        "| method / fraction | " + " | ".join(str(f) for f in fractions) + " |",
        "|---|" + "---:|" * len(fractions),
    ]
    cell = {(name, f): means[(name, None if name in flat else f)] for name in names for f in fractions}
    best = {f: min(cell[(name, f)][0] for name in names) for f in fractions}
    for name in names:
        texts = []
        for f in fractions:
            mean, std = cell[(name, f)]
            text = _cell(mean, std, seeds, METRICS[metric].digits)
            texts.append(f"**{text}**" if mean == best[f] else text)
        lines.append(f"| {name} | " + " | ".join(texts) + " |")
    if flat:
        lines += [
            "",
            f"({', '.join(flat)}: no statistics, so not run per fraction; the same {metric} stands under every "
            f"fraction.)",
        ]
    return "\n".join(lines)


def write_csv(path: str, tables: dict[str, list[dict]], domains: list[str], rows: list | None = None) -> None:
    """A line per row and domain (and the mean), with the mean and std of every metric of
    `tables` (summarise's, by metric: METRICS, in their order); on a grid with axes or a
    fraction sweep (`rows` given) the method and its conditions in columns of their own
    (_condition_columns)."""
    labels = domain_labels(domains)
    conditions = _condition_columns(rows)
    metrics = [METRICS[name] for name in METRICS if name in tables]
    columns = [f"{m.name}_{part}{m.csv_unit}" for m in metrics for part in ("mean", "std")]

    def write(tmp):
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            out = csv.writer(f)
            out.writerow(["method", *conditions, "domain", *columns])
            for k, row in enumerate(tables["error"]):
                named = [rows[k].name, *[getattr(rows[k], name) for name in conditions]] if rows else [row["method"]]
                for key in domains + ["mean"]:
                    cells = [tables[m.name][k]["cells"][key] for m in metrics]
                    out.writerow([*named, labels[key], *(f"{value:.4f}" for cell in cells for value in cell)])

    atomic_write(path, write)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("`plot` needs matplotlib: pip install 'cafa-cli[demo]'") from None
    return plt


def check_plotting() -> None:
    """Before a bench that ends in a plot: matplotlib is there, so that a missing one is
    said before the runs, not after them."""
    _pyplot()


# error bars in black over coloured bars, with caps: visible on any bar colour
ERROR_BARS = {"ecolor": "black", "elinewidth": 1.2, "capsize": 3, "capthick": 1.2}


def _colours(plt, count: int) -> list:
    """One colour a method: tab10, or tab20 past 10 methods (the default cycle repeats after 10)."""
    cmap = plt.get_cmap("tab10" if count <= 10 else "tab20")
    return [cmap(k % cmap.N) for k in range(count)]


def _legend_outside(ax, handles: list | None = None) -> None:
    """The legend right of the axes, where it covers no bar or line (the figure is saved
    with bbox_inches="tight", which widens it to hold the legend); `handles` in their order."""
    ax.legend(
        **({"handles": handles} if handles else {}),
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        borderaxespad=0.0,
        frameon=False,
        fontsize="small",
    )


def _save(plt, fig, path: str) -> None:
    """SVG for a .svg file, else PNG (whatever the name, as before SVG was offered); the
    same bytes for the same figure: SVG without its date and with fixed element ids (matplotlib salts them
    with a random uuid unless svg.hashsalt is set)."""
    svg = Path(path).suffix.lower() == ".svg"
    with plt.rc_context({"svg.hashsalt": "cafa"}):
        atomic_write(
            path,
            lambda tmp: fig.savefig(
                tmp,
                format="svg" if svg else "png",
                dpi=120,
                bbox_inches="tight",
                metadata={"Date": None} if svg else None,
            ),
        )
    plt.close(fig)


def plot_conditions(path: str, table: list[dict], rows: list, metric: str = "error") -> None:
    """A grid with axes: the error over all domains per condition, a line per method."""
    plt = _pyplot()
    conditions, names = list(dict.fromkeys(r.condition for r in rows)), list(dict.fromkeys(r.name for r in rows))
    means = {(r.condition, r.name): entry["cells"]["mean"] for r, entry in zip(rows, table)}
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(conditions)), 4))
    for name, colour in zip(names, _colours(plt, len(names))):
        ax.errorbar(
            range(len(conditions)),
            [means[(c, name)][0] for c in conditions],
            yerr=[means[(c, name)][1] for c in conditions],
            marker="o",
            color=colour,
            capsize=4,
            capthick=1.2,
            elinewidth=1.2,
            label=name,
        )
    ax.set_xticks(range(len(conditions)))
    ax.set_xticklabels(conditions, rotation=45, ha="right")
    ax.set_ylabel(f"{METRICS[metric].unit} (mean over domains)")
    ax.grid(axis="y", alpha=0.3)
    _legend_outside(ax)
    fig.tight_layout()
    _save(plt, fig, path)


def plot(path: str, table: list[dict], domains: list[str], metric: str = "error") -> None:
    """Grouped bars: one group per domain (and the mean), one bar per method; mean ± std
    over the seeds as black error bars, the legend outside the axes."""
    plt = _pyplot()
    keys = domains + ["mean"]
    width = 0.8 / len(table)
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(keys) * max(1, len(table) / 4)), 4))
    for k, (row, colour) in enumerate(zip(table, _colours(plt, len(table)))):
        means = [row["cells"][key][0] for key in keys]
        stds = [row["cells"][key][1] for key in keys]
        ax.bar(
            [i + k * width for i in range(len(keys))],
            means,
            width,
            color=colour,
            label=row["method"],
            yerr=stds if any(stds) else None,
            error_kw=ERROR_BARS,
        )
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(keys))])
    labels = domain_labels(domains)
    ax.set_xticklabels([labels[k] for k in keys], rotation=45, ha="right")
    ax.set_ylabel(f"{METRICS[metric].unit} (mean ± std over seeds)")
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    _legend_outside(ax)
    fig.tight_layout()
    _save(plt, fig, path)


def plot_fractions(path: str, table: list[dict], rows: list, metric: str = "error") -> None:
    """A fraction sweep: the error over all domains against the training fraction (log
    axis), a line per method, its CAFA-Oracle twin dashed in the same colour, and a
    dotted flat line for a method without statistics (run once); mean ± std over seeds
    as error bars. The figure's size is fixed, whatever the number of methods."""
    plt = _pyplot()
    fractions, names, means = _fraction_sweep(table, rows)
    oracle = {row.name: row.oracle for row in rows}
    fig, ax = plt.subplots(figsize=(6.4, 4))
    colours = iter(_colours(plt, sum(not oracle[name] for name in names)))
    colour, handles = None, []
    for name in names:
        colour = colour if oracle[name] else next(colours)  # a twin follows its row (rows.with_oracle)
        if (name, None) in means:
            handles.append(
                ax.axhline(
                    means[(name, None)][0], color=colour, linestyle=":", linewidth=1.5, label=f"{name} (no statistics)"
                )
            )
            continue
        stds = [means[(name, f)][1] for f in fractions]
        handles.append(
            ax.errorbar(
                fractions,
                [means[(name, f)][0] for f in fractions],
                yerr=stds if any(stds) else None,
                color=colour,
                marker="o",
                linestyle="--" if oracle[name] else "-",
                capsize=3,
                label=name,
            )
        )
    ax.set_xscale("log")
    ax.set_xticks(fractions, labels=[str(f) for f in fractions])
    ax.minorticks_off()  # the fractions are the ticks; the log axis's minor ticks would be unlabelled clutter
    ax.set_xlabel("fraction of each class's training images (log scale)")
    ax.set_ylabel(f"{METRICS[metric].unit} (mean over domains)")
    ax.grid(alpha=0.3)
    _legend_outside(ax, handles)  # in the table's order, lines and flat lines mixed
    fig.tight_layout()
    _save(plt, fig, path)


def by_round(protocols: dict, rows: list, seeds: list[int]) -> dict[str, list[tuple[float, float]]]:
    """With `rounds`: per row, the error % of each round over all its domains, mean and std over the seeds."""
    table = {}
    for row in rows:
        per_seed = [[100 * r["error"] for r in protocols[(row.label, seed)]["rounds"]] for seed in seeds]
        table[row.label] = [_mean_std(list(values)) for values in zip(*per_seed)]
    return table


def markdown_by_round(rounds: dict[str, list[tuple[float, float]]], seeds: list[int]) -> str:
    """The long-horizon table: a line per method, a column per round (the error over all domains)."""
    count = max(len(errors) for errors in rounds.values())
    lines = ["| method | " + " | ".join(f"round {k + 1}" for k in range(count)) + " |", "|---|" + "---:|" * count]
    for label, errors in rounds.items():
        cells = [f"{mean:.2f}" + (f" ± {std:.2f}" if len(seeds) > 1 else "") for mean, std in errors]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_rounds(path: str, rounds: dict[str, list[tuple[float, float]]]) -> None:
    """The long-horizon figure (RDumb's, the persistent-TTA papers'): error against round, a line per method."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for (label, errors), colour in zip(rounds.items(), _colours(plt, len(rounds))):
        numbers = range(1, len(errors) + 1)
        ax.errorbar(numbers, [m for m, _ in errors], yerr=[s for _, s in errors], marker="o", color=colour, label=label)
    ax.set_xlabel("round (one pass over every domain)")
    ax.set_ylabel("error % (over the round's domains)")
    ax.grid(axis="y", alpha=0.3)
    _legend_outside(ax)
    fig.tight_layout()
    _save(plt, fig, path)


def adapted_shares(protocols: dict, rows: list, seeds: list[int]) -> dict[str, tuple[float, float]]:
    """Under a stream that does not wait: per row, the % of batches adapted on, mean and std over the seeds."""
    shares = {}
    for row in rows:
        streams = [protocols.get((row.label, seed), {}).get("stream") for seed in seeds]
        if all(streams):
            shares[row.label] = _mean_std([100 * (stream["adapted_share"] or 0) for stream in streams])
    return shares


def markdown_shares(shares: dict[str, tuple[float, float]]) -> str:
    lines = ["| method | adapted on, % of batches |", "|---|---:|"]
    lines += [f"| {label} | {mean:.1f} |" for label, (mean, _) in shares.items()]
    return "\n".join(lines)


def _mean_std(values: list[float]) -> tuple[float, float]:
    return stats_lib.mean(values), stats_lib.stdev(values) if len(values) > 1 else 0.0


def differing_settings(settings: dict[str, dict], skip: tuple[str, ...] = ()) -> str:
    """A line under the table when its rows ran with different batch sizes or optimisers
    (their recipes'), so that the table is not read as one setting: 'Rows differ in
    batch_size: 200 (tent, cafa), 64 (rotta).' Empty when they agree; `skip` the settings a
    grid axis varies on purpose."""
    lines = []
    for key in ("batch_size", "optimizer"):
        if key in skip:
            continue
        groups: dict = {}
        for label, row in settings.items():
            groups.setdefault(row.get(key), []).append(label)
        if len(groups) > 1:
            values = "; ".join(f"{value} ({', '.join(labels)})" for value, labels in groups.items())
            lines.append(f"Rows differ in {key}: {values}.")
    return "\n".join(lines)
