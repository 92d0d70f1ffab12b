"""The class-statistics artifact: a self-describing safetensors file, written here, and
read here as torch tensors for the engine.

The format is specified in docs/reference/artifact-format.md. Reading (reading.py, without torch)
validates every field and checks the tensors a slice at a time, so a multi-gigabyte
artifact is never copied whole into memory just to be checked.
"""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from cafa_cli import __version__
from cafa_cli.artifact.format import FORMAT, FORMAT_VERSION, norm_layers, read_json
from cafa_cli.artifact.reading import Artifact, read_arrays
from cafa_cli.core.errors import CafaError, InputError
from cafa_cli.core.files import atomic_write
from cafa_cli.data.preprocessing import Preprocessing
from cafa_cli.model.spec import ModelSpec
from cafa_cli.statistics.gaussians import ClassGaussians


def write_artifact(
    path: str | Path,
    gaussians: ClassGaussians,
    class_names: list[str],
    model: ModelSpec,
    preprocessing: Preprocessing,
    sampling: dict,
    parameters_sha256: str,
    factory_sha256: str | None = None,
    model_classes: list[str] | None = None,
    outputs: list[int] | None = None,
    norm_moments: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    environment: dict | None = None,
) -> Artifact:
    """Write atomically: a temporary file in the same folder, read back and checked as
    `adapt` will check it, then renamed over `path` (an invalid one never replaces a good
    file). Returns the artifact as read, without its tensors. With a class subset,
    `class_names` are its classes, `outputs` their model outputs and `model_classes` the
    names of all the model's outputs. `norm_moments`: {BatchNorm name: (means, variances)
    [C, channels]}, the classes' moments of each BatchNorm's input, for `norm` class-balanced.
    `environment`: what computed them (cafa_cli.core.environment), whose sums round with the threads."""
    C, d = gaussians.means.shape
    lambdas = gaussians.shrinkage
    lowrank = gaussians.covariance == "lowrank"
    metadata = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "covariance": gaussians.covariance,
        **({"rank": str(gaussians.factors.shape[1])} if lowrank else {}),
        "feature_dim": str(d),
        "num_classes": str(C),
        "class_names": json.dumps(class_names),
        **(
            {"class_subset": json.dumps({"model_classes": model_classes, "outputs": outputs})}
            if outputs is not None
            else {}
        ),
        "shrinkage": json.dumps(
            {
                "method": gaussians.shrinkage_method,
                "target": "tr(S)/d * I",
                "min": float(lambdas.min()),
                "max": float(lambdas.max()),
                "mean": float(lambdas.mean()),
            }
        ),
        "model": json.dumps(model.recorded()),
        "parameters_sha256": parameters_sha256,
        **({"factory_sha256": factory_sha256} if factory_sha256 else {}),
        "preprocessing": preprocessing.to_json(),
        "sampling": json.dumps(sampling),
        **(
            {"norm_layers": json.dumps({name: int(mean.shape[1]) for name, (mean, _) in norm_moments.items()})}
            if norm_moments
            else {}
        ),
        "num_images": str(int(gaussians.counts.sum())),
        "cafa_version": __version__,
        **({"environment": json.dumps(environment)} if environment else {}),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    factors = (
        {
            "lowrank_basis": gaussians.factors,
            "lowrank_isotropic": gaussians.isotropic,
            "lowrank_spectrum": gaussians.spectrum,
        }
        if lowrank
        else {"precision_cholesky": gaussians.factors}
    )
    tensors = {
        "means": gaussians.means,
        **factors,
        "counts": gaussians.counts,
        "shrinkage": gaussians.shrinkage,
        "global_mean": gaussians.global_mean,
        "global_covariance": gaussians.global_covariance,
    }
    for name, (mean, var) in (norm_moments or {}).items():
        tensors[f"norm.{name}.mean"], tensors[f"norm.{name}.var"] = mean.float(), var.float()
    written = []

    def write_and_check(tmp: str) -> None:
        try:
            save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
        except SafetensorError as error:  # a full disk, a quota: safetensors reports the OS error in its own type
            raise CafaError(
                f"cannot write {path} ({str(error).splitlines()[0][:200]}); check the free space of its folder"
            ) from None
        try:
            written.append(read_artifact(tmp, load_tensors=False))
        except InputError as error:
            reason = str(error).removeprefix(f"{tmp}: ")
            raise InputError(f"{path} not written: the statistics fail the artifact's own checks ({reason})") from None

    atomic_write(path, write_and_check)
    return replace(written[0], path=str(path))


# --- reading ---------------------------------------------------------------------


def read_artifact(path: str | Path, load_tensors: bool = True) -> Artifact:
    """Read and validate the whole artifact (reading.read_arrays: every check, the factors
    slice by slice through the file mapping), its Gaussians and norm moments as torch
    tensors over the arrays read. `load_tensors=False` still validates them but keeps none
    (`gaussians` is None): for the metadata of a file known to be sound."""
    artifact = read_arrays(path, load_tensors)
    tensors = {name: torch.from_numpy(array) for name, array in artifact.arrays.items()}
    gaussians = None
    if load_tensors:
        factors = "lowrank_basis" if artifact.covariance == "lowrank" else "precision_cholesky"
        gaussians = ClassGaussians(
            means=tensors["means"],
            factors=tensors[factors],
            counts=tensors["counts"],
            shrinkage=tensors["shrinkage"],
            covariance=artifact.covariance,
            global_mean=tensors["global_mean"],
            global_covariance=tensors["global_covariance"],
            shrinkage_method=read_json(artifact.metadata, "shrinkage", artifact.path)["method"],
            isotropic=tensors.get("lowrank_isotropic"),
            spectrum=tensors.get("lowrank_spectrum"),
        )
    moments = None
    if "norm_layers" in artifact.metadata:
        moments = {
            name: (tensors[f"norm.{name}.mean"], tensors[f"norm.{name}.var"])
            for name in norm_layers(artifact.metadata, artifact.path)
        }
    return replace(artifact, gaussians=gaussians, norm_moments=moments)
