"""The 2-D embedding of features (scikit-learn's t-SNE) and the figure of `cafa plot features`
(matplotlib), both from the optional extra `plot`. Deterministic: the same features and seed
give the same file, byte for byte (no date or software version in it, SVG ids salted with
the seed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cafa_cli.core.errors import InputError, UsageError
from cafa_cli.core.files import atomic_write
from cafa_cli.data.domain import UNLABELLED

INSTALL = "pip install 'cafa-cli[plot]'"
MIN_POINTS = 5  # t-SNE's perplexity must stay below a third of the points, and be at least 1
LEGEND_CLASSES = 20  # a legend of more class names would hide the panels


def libraries():
    """matplotlib's Figure and scikit-learn's TSNE, or a one-line error naming the extra."""
    try:
        from matplotlib.figure import Figure
        from sklearn.manifold import TSNE
    except ImportError as error:
        raise UsageError(
            f"cafa plot features needs matplotlib and scikit-learn ({(error.name or 'a module').split('.')[0]} is "
            f"missing): {INSTALL}"
        ) from None
    return Figure, TSNE


def embedding_record(perplexity: float, points: int) -> dict:
    """What embedded the points: the perplexity used (capped, perplexity_used) and the one asked for."""
    import sklearn

    return {
        "library": f"scikit-learn {sklearn.__version__}",
        "method": "t-SNE (Barnes-Hut, PCA initialisation)",
        "perplexity": perplexity_used(perplexity, points),
        "perplexity_asked": perplexity,
    }


def perplexity_used(perplexity: float, points: int) -> float:
    """t-SNE's perplexity must stay below a third of the points: the one asked for, capped there."""
    return min(perplexity, (points - 1) / 3)


def embed(features: np.ndarray, means: np.ndarray | None, seed: int, perplexity: float) -> np.ndarray:
    """2-D coordinates of the features and, after them, of the class means, embedded together so
    that a mean lands among the features near it. The perplexity is capped below a third of the
    points (t-SNE's bound)."""
    from sklearn.manifold import TSNE

    points = features if means is None else np.concatenate([features, means.astype(features.dtype)])
    if len(points) < MIN_POINTS:
        raise InputError(
            f"{len(points)} points (images and class means) are too few to embed; give at least {MIN_POINTS}"
        )
    tsne = TSNE(
        n_components=2,
        perplexity=perplexity_used(perplexity, len(points)),
        init="pca",
        learning_rate="auto",
        random_state=seed,
    )
    return tsne.fit_transform(points.astype(np.float64))


def draw(
    libraries, path: str, panels, embeddings: list[np.ndarray], class_names: list[str], seed: int, title: str
) -> None:
    """One panel a method, side by side: the images coloured by class (grey without labels), the
    class means as large stars of their class's colour; written to `path` as PNG or SVG."""
    Figure, _ = libraries
    import matplotlib

    colours = class_colours(matplotlib, len(class_names))
    figure = Figure(figsize=(3.6 * len(panels), 4.0 + (0.4 if len(class_names) <= LEGEND_CLASSES else 0)))
    axes = figure.subplots(1, len(panels), squeeze=False)[0]
    for ax, panel, xy in zip(axes, panels, embeddings):
        n = len(panel.labels)
        points, means = xy[:n], xy[n:]
        known = panel.labels != UNLABELLED
        ax.scatter(points[~known, 0], points[~known, 1], s=5, color="0.55", linewidths=0, alpha=0.7)
        ax.scatter(points[known, 0], points[known, 1], s=5, color=colours[panel.labels[known]], linewidths=0, alpha=0.7)
        if len(means):
            ax.scatter(
                means[:, 0],
                means[:, 1],
                s=220,
                marker="*",
                color=colours[: len(means)],
                edgecolors="black",
                linewidths=0.9,
                zorder=3,
            )
        ax.set_title(panel_title(panel), fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
    if (panels[0].labels != UNLABELLED).any() and len(class_names) <= LEGEND_CLASSES:
        handles = [
            matplotlib.lines.Line2D([], [], linestyle="", marker="o", markersize=5, color=colours[c], label=name)
            for c, name in enumerate(class_names)
        ]
        figure.legend(handles=handles, loc="lower center", ncol=min(len(class_names), 10), fontsize=7, frameon=False)
    notes = [
        "stars are the artifact's class means" if len(embeddings[0]) > len(panels[0].labels) else "",
        "" if (panels[0].labels != UNLABELLED).any() else "no labels: one colour",
    ]
    figure.suptitle("; ".join([f"{title}: features (t-SNE)", *filter(None, notes)]), fontsize=10)
    figure.tight_layout(rect=(0, 0.08 if len(class_names) <= LEGEND_CLASSES else 0, 1, 1))
    save(figure, path, seed)


def panel_title(panel) -> str:
    name = "source (before)" if panel.method == "source" else panel.method
    numbers = [
        f"error {100 * panel.error:.1f}%" if panel.error is not None else None,
        f"W/B {panel.within_between:.3f}" if panel.within_between is not None else None,
        f"Mahalanobis/d {panel.mahalanobis:.2f}" if panel.mahalanobis is not None else None,
    ]
    shown = [text for text in numbers if text]
    return name + ("\n" + ", ".join(shown) if shown else "")


def class_colours(matplotlib, count: int) -> np.ndarray:
    """RGBA rows, one a class: tab10, tab20 up to 20 classes, beyond that spread over a hue circle."""
    if count <= 20:
        cmap = matplotlib.colormaps["tab10" if count <= 10 else "tab20"]
        return np.array([cmap(k) for k in range(count)])
    return matplotlib.colormaps["hsv"](np.linspace(0, 1, count, endpoint=False))


def save(figure, path: str, seed: int) -> None:
    """PNG or SVG by the extension, atomically, with nothing in the file that changes from run to run."""
    import matplotlib

    kind = Path(path).suffix.lower().lstrip(".")
    # SVG: no date; its element ids are hashes salted with a random value unless a salt is set
    metadata = {"Date": None, "Creator": None} if kind == "svg" else {"Software": None}
    with matplotlib.rc_context({"svg.hashsalt": f"cafa-{seed}"}):
        atomic_write(path, lambda tmp: figure.savefig(tmp, format=kind, dpi=100, metadata=metadata))
