"""Bench results as tables: mean ± std per method and domain, as markdown, CSV, JSON
and a grouped-bar plot."""

from __future__ import annotations

import csv
import os
import statistics as stats_lib
from dataclasses import asdict
from pathlib import Path
from cafa_cli import __version__
from cafa_cli.jobs import report
from cafa_cli.data.loading import loader_processes
from cafa_cli.errors import UsageError
from cafa_cli.files import absolute, atomic_write, open_safetensors
from cafa_cli.models import weights_sha256
from cafa_cli.checkpoints import sha256_of
from cafa_cli.devices import pick_device
from cafa_cli.jobs.bench import BenchPlan, Row, artifact_path, covariances_needed, recipes


def domain_label(path: str) -> str:
    """`.../fog/3` → `fog` (ImageNet-C layout), else the folder or file name."""
    p = Path(path)
    return p.parent.name if p.name.isdigit() and p.parent.name else (p.stem or path)


def domain_labels(domains: list[str]) -> dict[str, str]:
    """Column labels, one per domain (and `mean`): `fog`, or `fog/3` and `fog/5` when
    the short ones would collide (with each other or with `mean`), up to the whole path."""
    labels = {d: domain_label(d) for d in domains}
    paths = {d: Path(os.path.abspath(d)) if Path(d).exists() else Path(d) for d in domains}  # names as given, links not followed
    for depth in range(2, max((len(p.parts) for p in paths.values()), default=0) + 1):
        shown = [*labels.values(), "mean"]
        clashing = {d for d in domains if shown.count(labels[d]) > 1}
        if not clashing:
            break
        labels.update({d: "/".join(paths[d].parts[-depth:]) for d in clashing})
    return {**labels, "mean": "mean"}


def summarise(results: dict, rows: list[Row], domains: list[str], seeds: list[int]) -> list[dict]:
    """Per row: mean and std (over seeds) of the error in % per domain, and of the mean over domains."""
    errors = {key: result.error for key, result in results.items()}
    table = []
    for row in rows:
        cells = {}
        for domain in domains:
            values = [100 * errors[(row.label, domain, s)] for s in seeds]
            cells[domain] = (stats_lib.mean(values), stats_lib.stdev(values) if len(values) > 1 else 0.0)
        per_seed_means = [stats_lib.mean(100 * errors[(row.label, d, s)] for d in domains) for s in seeds]
        cells["mean"] = (stats_lib.mean(per_seed_means), stats_lib.stdev(per_seed_means) if len(seeds) > 1 else 0.0)
        table.append({"method": row.label, "cells": cells})
    return table


def markdown(table: list[dict], domains: list[str], seeds: list[int]) -> str:
    keys = domains + ["mean"]
    labels = domain_labels(domains)
    names = [labels[k] for k in keys]
    best = min(row["cells"]["mean"][0] for row in table)
    lines = ["| method | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for row in table:
        cells = []
        for key in keys:
            mean, std = row["cells"][key]
            text = f"{mean:.2f}" + (f" ± {std:.2f}" if len(seeds) > 1 else "")
            cells.append(f"**{text}**" if key == "mean" and mean == best else text)
        lines.append(f"| {row['method']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_csv(path: str, table: list[dict], domains: list[str]) -> None:
    labels = domain_labels(domains)

    def write(tmp):
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            out = csv.writer(f)
            out.writerow(["method", "domain", "error_mean_percent", "error_std_percent"])
            for row in table:
                for key in domains + ["mean"]:
                    mean, std = row["cells"][key]
                    out.writerow([row["method"], labels[key], f"{mean:.4f}", f"{std:.4f}"])

    atomic_write(path, write)


def write_json(path: str, plan: BenchPlan, table: list[dict], results: dict) -> None:
    """The table, every run (its error, images, skips and time), what each row ran with
    (its method, params, lr, the covariance it asked for and the form its artifact holds:
    `auto` picks one), the artifacts by content, and the options every row shared (each
    run's seed is under "runs")."""
    labels = domain_labels(plan.domains)
    settings = plan.settings
    shared = {k: v for k, v in asdict(settings).items() if k not in ("method", "seed")}
    shared["num_workers"] = loader_processes(settings.num_workers, pick_device(settings.device))
    model, sampling = plan.model, plan.sampling
    artifacts = {covariance: _artifact_record(artifact_path(plan.workdir, covariance)) for covariance in covariances_needed(plan.rows)}
    payload = {
        "cafa_version": __version__,
        "versions": report.software_versions(),
        "unit": "error %",
        "seeds": plan.seeds,
        "domains": [{"data": d, "label": labels[d]} for d in plan.domains],
        "table": [{"method": r["method"], **{labels[k]: {"mean": m, "std": s}
                                             for k, (m, s) in r["cells"].items()}} for r in table],
        "runs": [{"method": m, "seed": s, **report.domain_record(result)} for (m, _, s), result in results.items()],
        "rows": [{"label": r.label, "method": r.method, "covariance": r.covariance,
                  "covariance_used": artifacts[r.covariance]["covariance"] if r.covariance else None,
                  "params": r.settings(settings).params, "lr": r.settings(settings).lr} for r in plan.rows],
        "artifacts": artifacts,
        "settings": {
            **shared, "methods": ",".join(r.label for r in plan.rows), "train": plan.train, "model": model.model,
            "weights": absolute(model.weights),
            "weights_sha256": weights_sha256(model.model, model.weights),
            "classes": absolute(plan.train_choice.classes_file), "labels": absolute(plan.test_choice.labels),
            "severity": plan.test_choice.severity,
            "fraction": sampling.fraction, "per_class": sampling.per_class, "shrinkage": sampling.shrinkage,
            "preprocessing": recipes(model.model, train=plan.train_choice, test=plan.test_choice),
        },
    }
    report.write_json(path, payload)


def _artifact_record(path: Path) -> dict:
    """An artifact the grid has just read and validated, by content: the form it holds,
    when it was made, the model parameters it was made with, and the file's sha256."""
    with open_safetensors(path) as f:
        metadata = f.metadata()
    return {"path": str(path.resolve()), "sha256": sha256_of(path), "covariance": metadata["covariance"],
            "created": metadata.get("created"), "parameters_sha256": metadata.get("parameters_sha256")}


def plot(path: str, table: list[dict], domains: list[str]) -> None:
    """Grouped bars: one group per domain (and the mean), one bar per method."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'cafa-cli[demo]'") from None
    keys = domains + ["mean"]
    width = 0.8 / len(table)
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(keys) * max(1, len(table) / 4)), 4))
    for k, row in enumerate(table):
        means = [row["cells"][key][0] for key in keys]
        stds = [row["cells"][key][1] for key in keys]
        ax.bar([i + k * width for i in range(len(keys))], means, width, yerr=stds, label=row["method"])
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(keys))])
    labels = domain_labels(domains)
    ax.set_xticklabels([labels[k] for k in keys], rotation=45, ha="right")
    ax.set_ylabel("error %")
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120))
    plt.close(fig)
