"""`cafa inspect`: what an artifact holds, and how well conditioned its Gaussians are."""

from __future__ import annotations

import json
import torch
from rich.console import Group
from rich.table import Table
from rich.text import Text
from cafa_cli.artifact import Artifact
from cafa_cli.errors import printable
from cafa_cli.models import bundled_model


_CONDITIONING_SAMPLE = 64  # classes whose condition number is computed exactly


def condition_numbers(artifact: Artifact) -> list[float]:
    """cond(Σ_c) = cond(L_c)² for up to 64 evenly spread classes (an SVD per class);
    diag and lowrank: exact for every class from the stored eigenvalues."""
    g = artifact.gaussians
    if g.covariance == "lowrank":
        # eigenvalues of Σ_c are a_c + e_cj on span Q_c and a_c outside it, unless the basis
        # fills all d dimensions (a forced lowrank with N_c > d): exact for every class
        a, spectrum = g.isotropic.double(), g.spectrum.double().clamp_min(0)
        in_basis = g.factors.square().sum(2) > 0.5  # zero rows are padding
        fills_space = in_basis.sum(1) == g.factors.shape[2]
        smallest = torch.where(fills_space, spectrum.masked_fill(~in_basis, torch.inf).amin(1), 0)
        return ((a + spectrum.amax(1)) / (a + smallest)).tolist()
    if g.covariance == "diag":
        return (g.factors.double().amax(1) / g.factors.double().amin(1)).square().tolist()
    picks = torch.linspace(0, len(g.factors) - 1, min(len(g.factors), _CONDITIONING_SAMPLE)).round().long().unique()
    return [float(torch.linalg.cond(g.factors[i].double()) ** 2) for i in picks]


def describe(artifact: Artifact) -> dict:
    g = artifact.gaussians
    conds = sorted(condition_numbers(artifact))
    shrinkage = g.shrinkage.tolist()
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
        "num_images": int(g.counts.sum()),
        "shrinkage": json.loads(artifact.metadata["shrinkage"]),
        "model": vars(artifact.model),
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
            for i, (name, count) in enumerate(zip(artifact.class_names, g.counts.tolist()))
        ],
    }


def render(summary: dict) -> Group:
    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="bold")
    facts.add_column()
    model = summary["model"]
    cond = summary["conditioning"]
    shrink = summary["shrinkage"]
    no_file = "(packaged with the bundled model)" if bundled_model(model["model"]) else "(none: the model's own initialisation)"
    rows = [
        ("artifact", summary["path"]),
        ("format", f"{summary['format']} (cafa {summary['cafa_version']}, {summary['created']})"),
        ("model", f"{model['model']}, classifier {model['classifier']}"
                  + "".join(f", {key}={value}" for key, value in (model.get("model_args") or {}).items())),
        ("weights", f"{model['weights'] or no_file}" + (f"  sha256 {model['weights_sha256'][:16]}…" if model["weights_sha256"] else "")),
        ("parameters", f"sha256 {summary['parameters_sha256'][:16]}…" if summary["parameters_sha256"] else "(no fingerprint: written before cafa recorded one)"),
        ("classes", f"{summary['num_classes']}"
         + (f" of the model's {summary['model_outputs']} outputs (a class subset)" if summary["model_outputs"] != summary["num_classes"] else "")
         + f", feature dim {summary['feature_dim']}, {summary['num_images']} images"),
        ("covariance", summary["covariance"] + (f", {summary['rank']} basis rows per class (a·I + low rank, exact)" if summary.get("rank") else "")),
        ("shrinkage", f"{shrink['method']} toward {shrink.get('target', 'tr(S)/d I')}: λ min {shrink['min']:.4f}, mean {shrink['mean']:.4f}, max {shrink['max']:.4f}"),
        ("conditioning", f"cond(Σ) over {cond['classes_measured']} classes: min {cond['min']:.3g}, median {cond['median']:.3g}, max {cond['max']:.3g}"),
        ("preprocessing", json.dumps(summary["preprocessing"])),
        ("sampling", json.dumps(summary["sampling"])),
        ("norm moments", f"{len(summary['norm_layers'])} BatchNorm inputs, each class's mean and variance (for --norm class-balanced)"
         if summary.get("norm_layers") else "none (cafa stats --norm-moments records them, for --norm class-balanced)"),
    ]
    for key, value in rows:
        facts.add_row(key, Text(printable(str(value)), overflow="fold"))  # a long hash wraps, never cut to "…"
    classes = Table("class", "count", "λ", title="per class", title_justify="left")
    shown = summary["classes"]
    for c in shown[:20]:
        classes.add_row(Text(printable(c["name"])), str(c["count"]), f"{c['shrinkage']:.4f}")
    if len(shown) > 20:
        classes.add_row(f"… {len(shown) - 20} more", "", "")
    return Group(facts, classes)
