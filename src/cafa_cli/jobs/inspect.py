"""`cafa inspect`: what an artifact holds, and how well conditioned its Gaussians are.
Without torch: the artifact is read and checked as numpy arrays (artifact/reading.py)."""

from __future__ import annotations

import json
from contextlib import nullcontext

import numpy as np
from rich.cells import cell_len
from rich.text import Text
from threadpoolctl import threadpool_limits

from cafa_cli.artifact.reading import Artifact
from cafa_cli.core.errors import printable
from cafa_cli.model.zoo import bundled_model

_CONDITIONING_SAMPLE = 64  # classes whose condition number is computed exactly
_ONE_THREAD_DIM = 256  # up to this feature dim the SVDs run on one thread
_CLASSES_LISTED = 12  # up to this many classes are listed one a line; more are summed up as min, median and max
_SAMPLING_LABELS = {"images_sha256": None, "skipped_images": "skipped"}  # None: shown with the other hashes


def condition_numbers(artifact: Artifact) -> list[float]:
    """cond(Σ_c) = cond(L_c)² for up to 64 evenly spread classes (an SVD per class);
    diag and lowrank: exact for every class from the stored eigenvalues."""
    arrays = artifact.arrays
    if artifact.covariance == "lowrank":
        # eigenvalues of Σ_c are a_c + e_cj on span Q_c and a_c outside it, unless the basis
        # fills all d dimensions (a forced lowrank with N_c > d): exact for every class
        basis = arrays["lowrank_basis"]
        a = arrays["lowrank_isotropic"].astype(np.float64)
        spectrum = np.maximum(arrays["lowrank_spectrum"].astype(np.float64), 0)
        in_basis = np.square(basis).sum(2) > 0.5  # zero rows are padding
        fills_space = in_basis.sum(1) == basis.shape[2]
        smallest = np.where(fills_space, np.where(in_basis, spectrum, np.inf).min(1), 0)
        return ((a + spectrum.max(1)) / (a + smallest)).tolist()
    factors = arrays["precision_cholesky"]
    if artifact.covariance == "diag":
        factors = factors.astype(np.float64)
        return np.square(factors.max(1) / factors.min(1)).tolist()
    picks = np.unique(np.linspace(0, len(factors) - 1, min(len(factors), _CONDITIONING_SAMPLE)).round().astype(int))
    # a small SVD is not split between threads, whose team only adds its overhead: 16 SVDs of
    # 256×256 took 1.2 s with two threads on a busy 2-core machine, 0.11 s on one, the same
    # bits; larger ones keep theirs
    with threadpool_limits(1, user_api="blas") if factors.shape[-1] <= _ONE_THREAD_DIM else nullcontext():
        return [float(np.linalg.cond(factors[i].astype(np.float64)) ** 2) for i in picks]


def describe(artifact: Artifact) -> dict:
    counts = artifact.arrays["counts"]
    conds = sorted(condition_numbers(artifact))
    shrinkage = artifact.arrays["shrinkage"].tolist()
    return {
        "path": artifact.path,
        "format": f"{artifact.metadata['format']} v{artifact.metadata['format_version']}",
        "cafa_version": artifact.metadata.get("cafa_version"),
        "created": artifact.metadata.get("created"),
        "covariance": artifact.covariance,
        "rank": int(artifact.metadata["rank"]) if artifact.covariance == "lowrank" else None,
        "feature_dim": artifact.feature_dim,
        "num_classes": artifact.num_classes,
        "model_outputs": len(artifact.model_class_names),  # more than num_classes for a class subset
        "num_images": int(counts.sum()),
        "shrinkage": json.loads(artifact.metadata["shrinkage"]),
        "model": artifact.model.recorded(),
        "parameters_sha256": artifact.parameters_sha256,
        "preprocessing": json.loads(artifact.preprocessing.to_json()),
        "sampling": artifact.sampling,
        # for --norm class-balanced: {BatchNorm: channels}, or None when the artifact was made without --norm-moments
        "norm_layers": json.loads(artifact.metadata["norm_layers"]) if "norm_layers" in artifact.metadata else None,
        "conditioning": {
            "classes_measured": len(conds),
            "min": conds[0],
            "median": conds[len(conds) // 2],
            "max": conds[-1],
        },
        "classes": [
            {"name": name, "count": int(count), "shrinkage": shrinkage[i] if len(shrinkage) > 1 else shrinkage[0]}
            for i, (name, count) in enumerate(zip(artifact.class_names, counts.tolist()))
        ],
    }


def render(summary: dict) -> Text:
    """The summary for people: "key  value" lines under a few headings, no JSON. Each value
    stays on its line, to be printed without wrapping: a path or a sha256 is never broken
    (a terminal narrower than it wraps it on screen, and a copy of it is still whole)."""
    sections = {
        "artifact": _about(summary),
        "model": _model(summary),
        "training images": _sampling(summary["sampling"]),
        "gaussians": _gaussians(summary),
        "sha256": _hashes(summary),
    }
    if len(summary["classes"]) > _CLASSES_LISTED:
        sections["per class"] = _class_ranges(summary["classes"])
    width = max(cell_len(key) for lines in sections.values() for key, _ in lines)
    text = Text()
    for heading, lines in sections.items():
        if not lines:  # an artifact that recorded no sampling
            continue
        text.append(("\n" if text else "") + heading + "\n", style="bold")
        text.append("".join(f"  {key}{' ' * (width - cell_len(key))}  {printable(value)}\n" for key, value in lines))
    if len(summary["classes"]) <= _CLASSES_LISTED:
        text.append("\nper class\n", style="bold")
        text.append(_class_table(summary["classes"]))
    text.rstrip()
    return text


def _plain(value) -> str:
    """A JSON value in words (none, 0.286, 28, 28): never JSON's braces and quotes."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(map(_plain, value))
    if isinstance(value, dict):
        return ", ".join(f"{key} {_plain(item)}" for key, item in value.items())
    return str(value)


def _about(summary: dict) -> list[tuple[str, str]]:
    return [
        ("file", summary["path"]),
        ("format", summary["format"]),
        ("written", f"by cafa {summary['cafa_version']}, {summary['created']}"),
    ]


def _model(summary: dict) -> list[tuple[str, str]]:
    model, prep = summary["model"], summary["preprocessing"]
    no_file = (
        "(packaged with the bundled model)"
        if bundled_model(model["model"])
        else "(none: the model's own initialisation)"
    )
    args = "".join(f", {key}={value}" for key, value in (model.get("model_args") or {}).items())
    return [
        ("model", f"{model['model']}, classifier {model['classifier']}{args}"),
        ("weights", model["weights"] or no_file),
        (
            "input",
            (
                f"{prep['channels']} channel{'s' if prep['channels'] != 1 else ''}, resize {_plain(prep['resize'])}, "
                f"crop {_plain(prep['crop'])}, {prep['interpolation']}, mean {_plain(prep['mean'])}, std "
                f"{_plain(prep['std'])}"
            ),
        ),
    ]


def _sampling(sampling: dict) -> list[tuple[str, str]]:
    """How the training images were drawn, a line a recorded key (an older or newer cafa
    may record others)."""
    labels = {key: _SAMPLING_LABELS.get(key, printable(key.replace("_", " "))) for key in sampling}
    return [(labels[key], _plain(value)) for key, value in sampling.items() if labels[key]]


def _gaussians(summary: dict) -> list[tuple[str, str]]:
    cond, shrink = summary["conditioning"], summary["shrinkage"]
    subset = (
        f" of the model's {summary['model_outputs']} outputs (a class subset)"
        if summary["model_outputs"] != summary["num_classes"]
        else ""
    )
    rank = f", {summary['rank']} basis rows per class (a·I + low rank, exact)" if summary.get("rank") else ""
    moments = (
        f"{len(summary['norm_layers'])} BatchNorm inputs, each class's mean and variance (for --norm class-balanced)"
        if summary.get("norm_layers")
        else "none (cafa stats --norm-moments records them, for --norm class-balanced)"
    )
    return [
        (
            "classes",
            f"{summary['num_classes']}{subset}, feature dim {summary['feature_dim']}, {summary['num_images']} images",
        ),
        ("covariance", summary["covariance"] + rank),
        (
            "shrinkage",
            (
                f"{shrink['method']} toward {shrink.get('target', 'tr(S)/d I')}: "
                f"λ min {shrink['min']:.4f}, mean {shrink['mean']:.4f}, max {shrink['max']:.4f}"
            ),
        ),
        (
            "conditioning",
            (
                f"cond(Σ) min {cond['min']:.3g}, median {cond['median']:.3g}, max {cond['max']:.3g} "
                + (
                    "of the covariance the classes share"
                    if summary["covariance"] == "tied"
                    else f"over {cond['classes_measured']} classes"
                )
            ),
        ),
        ("norm moments", moments),
    ]


def _hashes(summary: dict) -> list[tuple[str, str]]:
    """The fingerprints in full, each alone on its line: what a reader compares."""
    weights, images = summary["model"]["weights_sha256"], summary["sampling"].get("images_sha256")
    return [
        ("weights", weights or "none"),
        ("parameters", summary["parameters_sha256"] or "none: written before cafa recorded one"),
        *([("images", _plain(images))] if images else []),
    ]


def _class_table(classes: list[dict]) -> str:
    """A few classes, one a line: name, images, λ."""
    names = [printable(c["name"]) for c in classes]
    width = max(map(cell_len, ["class", *names]))
    lines = [f"  class{' ' * (width - 5)}  images  λ"]
    lines += [
        f"  {name}{' ' * (width - cell_len(name))}  {c['count']:>6}  {c['shrinkage']:.4f}"
        for name, c in zip(names, classes)
    ]
    return "\n".join(lines)


def _class_ranges(classes: list[dict]) -> list[tuple[str, str]]:
    """Many classes: the spread of their image counts and λ, not a line each."""

    def spread(values: list, form: str) -> str:
        values = sorted(values)
        return f"min {values[0]:{form}}, median {values[len(values) // 2]:{form}}, max {values[-1]:{form}}"

    return [
        ("images", spread([c["count"] for c in classes], "d")),
        ("λ", spread([c["shrinkage"] for c in classes], ".4f")),
    ]
