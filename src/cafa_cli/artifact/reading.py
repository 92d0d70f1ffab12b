"""Reading an artifact without torch: every check of the file (format.py) on numpy arrays
from safetensors' numpy reader, the factors a slice at a time through the file mapping, so
a multi-gigabyte artifact is never copied whole into memory just to be checked.
`cafa inspect` stops here; store.read_artifact hands the arrays to torch."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from safetensors import SafetensorError

from cafa_cli.artifact.format import (
    bad,
    check_layout,
    check_small_tensors,
    checked_factors,
    checked_metadata,
    expected_tensors,
    read_json,
)
from cafa_cli.core.errors import InputError
from cafa_cli.core.files import open_safetensors, reading
from cafa_cli.data.preprocessing import Preprocessing
from cafa_cli.model.file_kinds import ADAPTER_STATE_HINT, HTML_MARKERS, is_adapter_state
from cafa_cli.model.spec import ModelSpec

if TYPE_CHECKING:
    import torch

    from cafa_cli.statistics.gaussians import ClassGaussians


@dataclass
class Artifact:
    path: str
    class_names: list[str]
    model: ModelSpec
    preprocessing: Preprocessing
    sampling: dict
    metadata: dict[str, str]
    gaussians: ClassGaussians | None  # None when read with load_tensors=False, or by read_arrays
    # {BatchNorm name: (means, variances) [C, channels]} of each class's input to it in the
    # source data (cafa stats --norm-moments), for `norm` class-balanced; None: not recorded
    norm_moments: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
    # the file's tensors by their names in it (docs/reference/artifact-format.md), as numpy arrays: all
    # of them, or with load_tensors=False only the norm moments; `gaussians` and
    # `norm_moments` are torch tensors over the same memory
    arrays: dict[str, np.ndarray] = field(default_factory=dict)

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


def read_arrays(path: str | Path, load_tensors: bool = True) -> Artifact:
    """Read and validate the whole artifact, the factors slice by slice through the file
    mapping; its tensors in `arrays`, numpy's, and no torch imported. `load_tensors=False`
    still validates them but keeps none but the norm moments: for the metadata of a file
    known to be sound."""
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
        with open_safetensors(path, framework="numpy") as f:
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
    # numpy's reader copies each tensor out of the file mapping (torch's can share it, which
    # would keep every page of the factors that validation touched resident)
    small = {name: f.get_tensor(name) for name in expected if name != factor_name}
    check_small_tensors(small, metadata, covariance, path)
    factors = checked_factors(f, path, covariance, factor_name, factor_shape, keep=load_tensors)
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
        arrays = {**small, factor_name: factors}
    else:  # the norm moments are read with the metadata, whatever load_tensors: small, and checked with the rest
        arrays = {name: small[name] for name in small if name.startswith("norm.")}
    return Artifact(
        str(path),
        class_names,
        model,
        preprocessing,
        sampling if isinstance(sampling, dict) else {},
        metadata,
        None,
        None,
        arrays,
    )
