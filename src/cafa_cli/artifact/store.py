"""The class-statistics artifact: a self-describing safetensors file.

The format is specified in docs/reference/artifact-format.md. Reading validates every field
and checks the tensors a slice at a time, so a multi-gigabyte artifact is never
copied whole into memory just to be checked.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from cafa_cli import __version__
from cafa_cli.artifact.format import (
    FORMAT,
    FORMAT_VERSION,
    bad,
    check_layout,
    check_small_tensors,
    checked_factors,
    checked_metadata,
    expected_tensors,
    norm_layers,
    read_json,
)
from cafa_cli.core.errors import CafaError, InputError
from cafa_cli.core.files import atomic_write, open_safetensors, reading
from cafa_cli.data.preprocessing import Preprocessing
from cafa_cli.model.checkpoints import ADAPTER_STATE_HINT, HTML_MARKERS, is_adapter_state
from cafa_cli.model.loading import ModelSpec
from cafa_cli.statistics.gaussians import ClassGaussians


@dataclass
class Artifact:
    path: str
    class_names: list[str]
    model: ModelSpec
    preprocessing: Preprocessing
    sampling: dict
    metadata: dict[str, str]
    gaussians: ClassGaussians | None  # None when read with load_tensors=False
    # {BatchNorm name: (means, variances) [C, channels]} of each class's input to it in the
    # source data (cafa stats --norm-moments), for `norm` class-balanced; None: not recorded
    norm_moments: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def covariance(self) -> str:
        return self.metadata["covariance"]

    @property
    def feature_dim(self) -> int:
        return int(self.metadata["feature_dim"])

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def model_class_names(self) -> list[str]:
        """The names of all the model's outputs: `class_names`, or more when the statistics
        are of a class subset (ImageNet-R's 200 of 1,000)."""
        return self._class_subset["model_classes"] if "class_subset" in self.metadata else self.class_names

    @property
    def outputs(self) -> list[int]:
        """The model output of each class of the statistics (a class subset's), in order."""
        return self._class_subset["outputs"] if "class_subset" in self.metadata else list(range(self.num_classes))

    @property
    def _class_subset(self) -> dict:
        return json.loads(self.metadata["class_subset"])  # checked when the artifact was read

    @property
    def parameters_sha256(self) -> str:
        """The model's parameter fingerprint (models.parameters_sha256)."""
        return self.metadata["parameters_sha256"]

    @property
    def factory_sha256(self) -> str | None:
        """The SHA-256 of a `file.py:fn` model's file; None for other models."""
        return self.metadata.get("factory_sha256")


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
        "model": json.dumps(asdict(model)),
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
    """Read and validate the whole artifact, the factors slice by slice through the file
    mapping. `load_tensors=False` still validates them but keeps none (`gaussians` is
    None): for the metadata of a file known to be sound."""
    path = Path(path)
    if path.is_dir():
        found = sorted(p.name for p in path.glob("*.safetensors"))[:3]
        hint = f" (it holds {', '.join(found)})" if found else ""
        raise InputError(f"{path} is a folder; give the artifact file{hint}")
    if path.is_symlink() and not path.exists():
        raise InputError(
            f"{path}: a symbolic link that leads nowhere (its target is missing, or the links form a loop); "
            f"give the artifact file itself"
        )
    if path.exists() and not path.is_file():
        raise InputError(f"{path}: not a regular file (a device or a pipe); give the artifact file cafa stats wrote")
    if not path.is_file():
        raise InputError(f"{path}: no such artifact; create one with cafa stats, or give the path of one")
    reading(path, "`stats`")
    with open(path, "rb") as f:
        head = f.read(512).lstrip().lower()
    if head.startswith(HTML_MARKERS):
        raise bad(path, "this is a web page saved as a file, not a cafa artifact; download the file itself")
    try:
        with open_safetensors(path) as f:
            return _read_open(f, path, load_tensors)
    except SafetensorError as error:
        if is_adapter_state(path):
            raise bad(
                path, f"this is an adaptation state cafa adapt saved, not a cafa artifact: {ADAPTER_STATE_HINT}"
            ) from None
        if _is_torch_checkpoint(path):
            raise bad(
                path,
                "this is a torch checkpoint, not a cafa artifact: give it as `weights`, and the file cafa stats wrote "
                "as `stats`",
            ) from None
        raise bad(
            path,
            f"not a readable safetensors file ({str(error).splitlines()[0][:120]}); give the artifact cafa stats "
            "wrote, or re-create it with cafa stats",
        ) from None
    except (OSError, ValueError, RuntimeError, OverflowError) as error:
        raise bad(
            path,
            f"unreadable artifact ({type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}); "
            "re-create it with cafa stats",
        ) from None


def _is_torch_checkpoint(path: Path) -> bool:
    """torch.save's zip archive (its first entry is `<name>/data.pkl`) or legacy pickle."""
    with open(path, "rb") as f:
        head = f.read(512)
    return (
        (head.startswith(b"PK\x03\x04") and b"data.pkl" in head)
        or head[:1] == b"\x80"
        and head[1:2] in b"\x02\x03\x04\x05"
    )


def _read_open(f, path: Path, load_tensors: bool) -> Artifact:
    metadata = f.metadata() or {}
    covariance, C, d, class_names, model, preprocessing, sampling = checked_metadata(metadata, path)
    factor_name, factor_shape, expected = expected_tensors(metadata, covariance, C, d, path)
    check_layout(f, expected, path)
    # copies: a tensor from get_tensor can share the file mapping, which would keep every
    # page of the (large) factors that validation touched resident for the artifact's life
    small = {name: f.get_tensor(name).clone() for name in expected if name != factor_name}
    check_small_tensors(small, metadata, covariance, path)
    factors = checked_factors(f, path, covariance, factor_name, factor_shape, keep=load_tensors)

    gaussians = None
    if load_tensors:
        shrink_info = read_json(metadata, "shrinkage", path)
        numbers = isinstance(shrink_info, dict) and all(
            isinstance(shrink_info.get(k), (int, float)) and 0 <= shrink_info[k] <= 1 for k in ("min", "mean", "max")
        )
        if not numbers or not isinstance(shrink_info.get("method"), str):
            raise bad(
                path,
                "metadata 'shrinkage' must hold the method and the min, mean and max λ, in [0, 1]; re-create the "
                "artifact with cafa stats",
            )
        gaussians = ClassGaussians(
            means=small["means"],
            factors=factors,
            counts=small["counts"],
            shrinkage=small["shrinkage"],
            covariance=covariance,
            global_mean=small["global_mean"],
            global_covariance=small["global_covariance"],
            shrinkage_method=shrink_info["method"],
            isotropic=small.get("lowrank_isotropic"),
            spectrum=small.get("lowrank_spectrum"),
        )
    moments = None  # read with the metadata, whatever load_tensors: small, and checked with the other small tensors
    if "norm_layers" in metadata:
        moments = {
            name: (small[f"norm.{name}.mean"], small[f"norm.{name}.var"]) for name in norm_layers(metadata, path)
        }
    return Artifact(
        str(path),
        class_names,
        model,
        preprocessing,
        sampling if isinstance(sampling, dict) else {},
        metadata,
        gaussians,
        moments,
    )
