"""The bench's JSON record: the table, every run's errors, and the settings, recipes and
artifacts they came from."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from cafa_cli import __version__
from cafa_cli.core.devices import pick_device
from cafa_cli.core.environment import environment
from cafa_cli.core.files import absolute, open_safetensors
from cafa_cli.data.benchmarks import source_of
from cafa_cli.data.loading import loader_processes
from cafa_cli.jobs.adapt.prepare import effective_severity, recorded_outliers
from cafa_cli.jobs.bench import tables
from cafa_cli.jobs.bench.rows import Row
from cafa_cli.jobs.bench.statistics import artifact_path, statistics_needed
from cafa_cli.jobs.config import BenchConfig
from cafa_cli.jobs.config.settings import recorded_values
from cafa_cli.jobs.shared import report
from cafa_cli.jobs.shared.inputs import recipe
from cafa_cli.jobs.shared.results import CALIBRATION_BINS
from cafa_cli.model.checkpoints import sha256_of
from cafa_cli.model.loading import weights_record

# what the JSON report records of each row's settings, as its runs resolved them
ROW_SETTINGS = (
    "recipe",
    "optimizer",
    "lr",
    "momentum",
    "batch_size",
    "steps",
    "params",
    "norm",
    "fisher_samples",
    "source_data",  # EATA's Fisher images, RMT's warm-up and replay: the training data unless given
    "reset",
    "stream_rate",
    "step_cost",
    "outliers",  # the images from outside the label set and their share: the bench's, or the row's on an axis
    "method_options",
)


def write_json(
    path: str,
    config: BenchConfig,
    rows: list[Row],
    seeds: list[int],
    tables_by_metric: dict[str, list[dict]],
    results: dict,
    clean: dict | None = None,
    settings: dict | None = None,
    protocols: dict | None = None,
    scored: dict | None = None,
    selection: list[dict] | None = None,
) -> None:
    """The table, every run (its error, images, skips and time), what each row ran with
    (its method, params, lr, the covariance it asked for and the form its artifact holds:
    `auto` picks one), the artifacts by content, and the options every row shared (each
    run's seed is under "runs")."""
    labels = tables.domain_labels(config.data)
    shared = {
        **recorded_values(config),
        "shuffle": True,
    }  # bench streams are shuffled
    shared["num_workers"] = loader_processes(config.num_workers, pick_device(config.device))
    fraction, per_class = (None, None) if config.fractions else config.training_sample()  # else each row's
    artifacts = {
        artifact_key(*key): _artifact_record(artifact_path(Path(config.workdir), *key), key[1])
        for key in statistics_needed(rows)
    }
    payload = {
        "cafa_version": __version__,
        "environment": environment(pick_device(config.device)),
        "unit": report.ERROR_PERCENT,  # the table's; each run's and the clean set's `error` is a fraction, named there
        "seeds": seeds,
        "domains": [{"data": d, "label": labels[d]} for d in config.data],
        "table": _table_record(tables_by_metric["error"], labels),
        # the same for the calibration of the labelled images' predictions, each in its unit
        "calibration": {
            "bins": CALIBRATION_BINS,
            **{
                metric: {"unit": tables.METRICS[metric].unit, "table": _table_record(table, labels)}
                for metric, table in tables_by_metric.items()
                if metric != "error"
            },
        },
        "runs": [
            {"method": m, "seed": s, **report.domain_record(result), **(surrogates(result) if selection else {})}
            for (m, _, s), result in results.items()
        ],
        "rows": [
            {
                "label": r.label,
                "method": r.method,
                "covariance": r.covariance,
                "covariance_used": artifacts[artifact_key(*r.statistics)]["covariance"] if r.statistics else None,
                "order": r.order_of(config),
                # on a severity axis or with the oracle twins, each row's own
                **({"severity": r.severity} if config.severities else {}),
                **({"outlier_share": r.outlier_share} if config.outlier_shares else {}),
                **({"oracle": r.oracle} if config.oracle else {}),
                **({"fraction": r.fraction} if config.fractions else {}),
                **(settings or {}).get(
                    r.label,
                    {"params": r.params_of(config), "lr": r.lr_of(config), "batch_size": r.batch_size_of(config)},
                ),
            }
            for r in rows
        ],
        "artifacts": artifacts,
        # each run's stream pace, error by round and forgetting, where it ran under those protocols
        **(
            {"protocols": [{"method": m, "seed": s, **record} for (m, s), record in protocols.items()]}
            if protocols
            else {}
        ),
        **({"clean": report.with_unit(clean)} if clean else {}),
        # with outliers: each row's AUROC and H in % (tables.open_world); each run's, fractions, under "runs"
        **(
            {
                "open_world": [
                    {"method": label, **{name: {"mean": m, "std": s} for name, (m, s) in values.items()}, "unit": "%"}
                    for label, values in scored.items()
                ]
            }
            if scored
            else {}
        ),
        # with `select`: each row's picked value and the oracle's, errors in % (bench/selection.py)
        **({"selection": selection} if selection else {}),
        "settings": {
            **shared,
            "methods": ",".join(dict.fromkeys(r.candidate_of or r.name for r in rows if not r.oracle)),
            "train": config.train,
            "model": config.model,
            **dict(zip(("weights", "weights_sha256"), weights_record(config.model, config.weights))),
            "model_args": config.model_args,
            "classes": absolute(config.classes),
            "labels": absolute(config.labels),
            "severity": None if config.severities else effective_severity(config),  # else each row's
            "outliers": recorded_outliers(config, "outlier_shares" if config.outlier_shares else None),
            "source": source_of(config),
            **({"class_subset": absolute(config.class_subset)} if config.class_subset else {}),
            **({"subset": absolute(config.subset)} if config.subset else {}),
            "fraction": fraction,
            "per_class": per_class,
            "shrinkage": config.shrinkage_value(),
            "preprocessing": {
                "train": asdict(recipe(config, config.model)),
                "test": asdict(recipe(config, config.model, config.test_preprocessing_changes())),
            },
        },
    }
    report.write_json(path, payload)


def surrogates(result) -> dict:
    """A run's label-free surrogates of its error (`select`), over every image read: the mean
    prediction entropy (nats) and, where measured, the share of predictions a flip keeps."""
    return {
        "entropy": result.entropy_sum / result.n if result.n else None,
        **({"consistency": result.consistent / result.n} if result.consistent is not None and result.n else {}),
    }


def _table_record(table: list[dict], labels: dict[str, str]) -> list[dict]:
    """tables.summarise's table as the JSON keeps it: per row, each column's mean and std."""
    return [
        {"method": r["method"], **{labels[k]: {"mean": m, "std": s} for k, (m, s) in r["cells"].items()}} for r in table
    ]


def artifact_key(covariance: str, fraction: float | None) -> str:
    """An artifact's key in the JSON report: its covariance mode (`auto`), and its fraction
    on a sweep (`auto, fraction 0.01`)."""
    return covariance if fraction is None else f"{covariance}, fraction {fraction}"


def _artifact_record(path: Path, fraction: float | None = None) -> dict:
    """An artifact the grid has just read and validated, by content: the form it holds,
    when it was made, the model parameters it was made with, the file's sha256, and its
    training fraction on a fraction sweep."""
    with open_safetensors(path) as f:
        metadata = f.metadata()
    return {
        "path": str(path.resolve()),
        "sha256": sha256_of(path),
        "covariance": metadata["covariance"],
        "created": metadata.get("created"),
        "parameters_sha256": metadata.get("parameters_sha256"),
        **({"fraction": fraction} if fraction is not None else {}),
    }
