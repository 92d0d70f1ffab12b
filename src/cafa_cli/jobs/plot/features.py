"""`cafa plot features`: one domain's features before and after adaptation, embedded in 2-D
(t-SNE) with the artifact's class means, one panel a method, and two numbers a panel that
say what the picture shows.

Each method runs through the `adapt` job (prepare_adaptation, then Adaptation.run over
the domain's stream). Its panel shows the features of the same images after the stream,
from the model as adapted (Adapter.features): the final model, not the features each
step saw on the way, of which the first batches come from a model barely adapted.
`source` is the model before adaptation."""

from __future__ import annotations

import gc
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from rich.table import Table

from cafa_cli import DEFAULT_ARTIFACT
from cafa_cli.artifact.store import read_artifact
from cafa_cli.core.devices import pick_device
from cafa_cli.core.environment import environment
from cafa_cli.core.errors import InputError
from cafa_cli.data.domain import UNLABELLED
from cafa_cli.data.loading import batches
from cafa_cli.data.orders import stream_order
from cafa_cli.data.subsets import keep
from cafa_cli.jobs.adapt.job import Adaptation, short_name
from cafa_cli.jobs.adapt.prepare import check_model_and_artifact_named, needs_artifact, prepare_adaptation
from cafa_cli.jobs.bench.runs import row_method_options, shared
from cafa_cli.jobs.config import AdaptConfig, FeaturesPlotConfig
from cafa_cli.jobs.plot import figure as feature_figure
from cafa_cli.jobs.shared.monitor import Monitor
from cafa_cli.jobs.shared.outputs import check_outputs, guards_outputs
from cafa_cli.jobs.shared.report import ERROR_FRACTION, percent
from cafa_cli.jobs.shared.what_runs import recipe_line
from cafa_cli.statistics.distances import ClassDistances
from cafa_cli.statistics.gaussians import ClassGaussians


@dataclass
class Panel:
    """One method's features of the sampled images, and what they say."""

    method: str
    features: np.ndarray  # [N, d] float32, of the images read
    labels: np.ndarray  # [N] class indices, UNLABELLED where unknown
    error: float | None  # of the stream, as cafa adapt reports it
    within_between: float | None = None
    mahalanobis: float | None = None


@guards_outputs
def run(config: FeaturesPlotConfig, monitor: Monitor) -> dict:
    """Adapt with each method, draw the figure to `config.out`; return the numbers."""
    check_outputs(config.outputs(), config.inputs())
    plotting = feature_figure.libraries()  # a missing extra is said before any work
    panels, class_names, gaussians = [], None, None
    panel_configs = {method: method_config(config, method) for method in config.method_list()}
    # a panel's missing artifact is said before the earlier panels run, and the panels that
    # need one first, so that the error names what needs it
    for panel_config in sorted(panel_configs.values(), key=lambda c: not needs_artifact(c)):
        check_model_and_artifact_named(panel_config)
    for method, panel_config in panel_configs.items():
        job = sampled(prepare_adaptation(panel_config, monitor), config.max_images, config.seed)
        for caution in job.cautions():
            monitor.warn(caution)
        monitor.info(recipe_line(method, job.recorded_settings, job.adapter.method.trains))
        results = job.run(monitor=monitor)
        features, labels = adapted_features(job)
        panels.append(Panel(method, features, labels, results[0].error if results[0].labelled else None))
        class_names = job.class_names
        del job
        gc.collect()  # one method's model and optimiser at a time
    gaussians = artifact_gaussians(config, class_names, monitor)
    for panel in panels:
        panel.within_between = scatter_ratio(panel.features, panel.labels)
        panel.mahalanobis = (
            None if gaussians is None else mahalanobis_per_dimension(panel.features, panel.labels, gaussians)
        )
    labelled = any((panel.labels != UNLABELLED).any() for panel in panels)
    if not labelled:
        monitor.info(
            "the images have no labels: the points are drawn in one colour, and the scatter and Mahalanobis "
            "numbers (which need each image's class) are not computed"
        )
    means = None if gaussians is None else gaussians.means.numpy()
    embeddings = [feature_figure.embed(panel.features, means, config.seed, config.perplexity) for panel in panels]
    feature_figure.draw(plotting, config.out, panels, embeddings, class_names, config.seed, short_name(config.data[0]))
    return summary(config, panels, class_names, gaussians is not None)


def method_config(config: FeaturesPlotConfig, method: str) -> AdaptConfig:
    """The `cafa adapt` run of one panel: the plot's settings, that method, its own method options."""
    return shared(
        config, AdaptConfig, method=method, method_option=row_method_options(config, method), given=config.given
    )


def sampled(job: Adaptation, count: int | None, seed: int) -> Adaptation:
    """The job on `count` of its domain's images (all for None or 0), a sample stratified by class."""
    domain = job.domains[0]
    if not count or count >= len(domain):
        return job
    return replace(job, domains=[keep(domain, stratified_rows(domain.labels, count, seed))])


def stratified_rows(labels: np.ndarray, count: int, seed: int) -> np.ndarray:
    """`count` positions, each class's share of them its share of the labelled images (largest
    remainders round), the unlabelled images one more class; sorted."""
    rng = np.random.default_rng(seed)
    groups = [np.flatnonzero(labels == value) for value in np.unique(labels)]
    exact = np.array([len(group) for group in groups]) * count / len(labels)
    quotas = np.floor(exact).astype(int)
    quotas[np.argsort(quotas - exact, kind="stable")[: count - quotas.sum()]] += 1
    return np.sort(
        np.concatenate([rng.choice(group, size=quota, replace=False) for group, quota in zip(groups, quotas)])
    )


def adapted_features(job: Adaptation) -> tuple[np.ndarray, np.ndarray]:
    """The features of the domain's images from the adapted model, read again in the stream's
    batches (a BatchNorm normalising with batch statistics sees each image with the same
    others as in the stream); and their labels."""
    s, domain, adapter = job.config, job.domains[0], job.adapter
    order = stream_order(domain.labels, s.order, s.shuffle, s.seed, domain.name)
    features, rows = [], []
    for batch in batches(domain, job.preprocess, s.batch_size, order, s.num_workers, adapter.device):
        if batch.images is None:
            continue
        _, batch_features = adapter.features(job.preprocess.normalize(batch.images.to(adapter.device)))
        features.append(batch_features.cpu().numpy())
        rows.extend(batch.indices)
    if not rows:
        raise InputError(f"{domain.name}: none of its images could be read; check the files")
    rows = np.asarray(rows)
    keep_order = np.argsort(rows, kind="stable")  # the domain's order, the same in every panel
    return np.concatenate(features)[keep_order], domain.labels[rows[keep_order]]


def artifact_gaussians(config: FeaturesPlotConfig, class_names: list[str], monitor: Monitor) -> ClassGaussians | None:
    """The artifact's class Gaussians, when there is one with the domain's classes in order;
    else None, with a note."""
    path = DEFAULT_ARTIFACT if config.stats is None else config.stats
    if config.stats is None and not Path(path).is_file():
        monitor.info(f"no artifact ({path}): no class means are drawn, and no Mahalanobis distance is computed")
        return None
    artifact = read_artifact(path, load_tensors=True)
    if artifact.gaussians is None or list(artifact.class_names) != list(class_names):
        monitor.warn(
            f"{path} holds no class Gaussians of the domain's classes in their order: no class means are drawn"
        )
        return None
    return artifact.gaussians


def scatter_ratio(features: np.ndarray, labels: np.ndarray) -> float | None:
    """tr(S_W) / tr(S_B) of the labelled features: their spread about their own class's mean over
    the spread of the class means about the overall mean (each mean weighted by its class's images);
    lower is tighter, better separated classes. None without two labelled classes."""
    known = labels != UNLABELLED
    features, labels = features[known].astype(np.float64), labels[known]
    classes = np.unique(labels)
    if len(classes) < 2:
        return None
    overall = features.mean(0)
    within = between = 0.0
    for c in classes:
        members = features[labels == c]
        mean = members.mean(0)
        within += float(np.square(members - mean).sum())
        between += len(members) * float(np.square(mean - overall).sum())
    return within / between if between > 0 else None


def mahalanobis_per_dimension(features: np.ndarray, labels: np.ndarray, gaussians: ClassGaussians) -> float | None:
    """The mean squared Mahalanobis distance of each labelled feature to its class's Gaussian in the
    artifact (what CAFA's loss pulls in), over the dimension: at most about 1 for the source's own
    training features (less where shrinkage adds variance they lack). None without labels."""
    known = labels != UNLABELLED
    if not known.any():
        return None
    with torch.no_grad():
        distances = ClassDistances(gaussians)(torch.from_numpy(features[known]))
    own = distances.gather(1, torch.from_numpy(labels[known]).long()[:, None])
    return float(own.double().mean()) / features.shape[1]


def summary(config: FeaturesPlotConfig, panels: list[Panel], class_names: list[str], means: bool) -> dict:
    """What `--json` prints: the figure's inputs and each panel's numbers."""
    return {
        "data": config.data[0],
        "out": config.out,
        "images": len(panels[0].labels),
        "labelled": int((panels[0].labels != UNLABELLED).sum()),
        "classes": len(class_names),
        "class_means_drawn": means,
        "seed": config.seed,
        "environment": environment(pick_device(config.device)),
        "embedding": feature_figure.embedding_record(
            config.perplexity, len(panels[0].labels) + (len(class_names) if means else 0)
        ),
        "panels": [
            {
                "method": p.method,
                "error": p.error,
                "unit": ERROR_FRACTION,  # as every JSON's `error` (docs/guides/adapt.md, Units of the errors)
                "within_between": p.within_between,
                "mahalanobis_per_dimension": p.mahalanobis,
            }
            for p in panels
        ],
    }


def numbers_table(numbers: dict) -> Table:
    """The panels' numbers, for stderr."""
    table = Table(title=f"{numbers['images']} images of {short_name(numbers['data'])}", title_justify="left")
    for column in ("method", "error %", "W/B scatter", "Mahalanobis/d"):
        table.add_column(column, justify="left" if column == "method" else "right")
    for panel in numbers["panels"]:
        table.add_row(
            panel["method"],
            percent(panel["error"]),
            _number(panel["within_between"], 3),
            _number(panel["mahalanobis_per_dimension"], 2),
        )
    return table


def _number(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"
