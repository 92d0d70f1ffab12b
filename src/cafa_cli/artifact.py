"""The class-statistics artifact: a self-describing safetensors file.

The format is specified in docs/artifact-format.md. Reading validates every field
and checks the tensors a slice at a time, so a multi-gigabyte artifact is never
copied whole into memory just to be checked.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, fields, replace
from datetime import datetime, timezone
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from cafa_cli import __version__
from cafa_cli.errors import CafaError, InputError, UsageError, listing
from cafa_cli.files import atomic_write, open_safetensors
from cafa_cli.checkpoints import HTML_MARKERS
from cafa_cli.models import ModelSpec
from cafa_cli.data.preprocessing import Preprocessing
from cafa_cli.method.gaussians import ClassGaussians
from cafa_cli.method.options import COVARIANCE_MODES

FORMAT = "cafa-stats"
FORMAT_VERSION = 2  # what the writer writes and the reader reads (version 1 was never released)
_SLICE_BYTES = 256 << 20  # validate factors in pieces of about this size


@dataclass
class Artifact:
    path: str
    class_names: list[str]
    model: ModelSpec
    preprocessing: Preprocessing
    sampling: dict
    metadata: dict[str, str]
    gaussians: ClassGaussians | None  # None when read with load_tensors=False

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
) -> Artifact:
    """Write atomically: a temporary file in the same folder, read back and checked as
    `adapt` will check it, then renamed over `path` (an invalid one never replaces a good
    file). Returns the artifact as read, without its tensors. With a class subset,
    `class_names` are its classes, `outputs` their model outputs and `model_classes` the
    names of all the model's outputs."""
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
        **({"class_subset": json.dumps({"model_classes": model_classes, "outputs": outputs})} if outputs is not None else {}),
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
        "num_images": str(int(gaussians.counts.sum())),
        "cafa_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    factors = (
        {"lowrank_basis": gaussians.factors, "lowrank_isotropic": gaussians.isotropic, "lowrank_spectrum": gaussians.spectrum}
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
    written = []

    def write_and_check(tmp: str) -> None:
        try:
            save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
        except SafetensorError as error:  # a full disk, a quota: safetensors reports the OS error in its own type
            raise CafaError(f"cannot write {path} ({str(error).splitlines()[0][:200]}); check the free space of its folder") from None
        try:
            written.append(read_artifact(tmp, load_tensors=False))
        except InputError as error:
            reason = str(error).removeprefix(f"{tmp}: ")
            raise InputError(f"{path} not written: the statistics fail the artifact's own checks ({reason})") from None

    atomic_write(path, write_and_check)
    return replace(written[0], path=str(path))


# --- reading ---------------------------------------------------------------------


def unusable_class_names(names: list[str]) -> list[str]:
    """Names that would break the records: blank (a prediction of "" reads as "no label"
    in the CSV) or with a line break (it splits a record)."""
    return [name for name in names if not name.strip() or "\n" in name or "\r" in name]


def _bad(path, why: str) -> InputError:
    return InputError(f"{path}: {why}")


def _json(metadata: dict, key: str, path):
    try:
        return json.loads(metadata[key])
    except (KeyError, TypeError, json.JSONDecodeError):
        raise _bad(path, f"metadata field '{key}' is missing or not valid JSON; re-create the artifact with cafa stats") from None


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
        raise InputError(f"{path}: a symbolic link that leads nowhere (its target is missing, or the links form a loop); "
                         f"give the artifact file itself")
    if path.exists() and not path.is_file():
        raise InputError(f"{path}: not a regular file (a device or a pipe); give the artifact file cafa stats wrote")
    if not path.is_file():
        raise InputError(f"{path}: no such artifact; create one with cafa stats, or give the path of one")
    with open(path, "rb") as f:
        head = f.read(512).lstrip().lower()
    if head.startswith(HTML_MARKERS):
        raise _bad(path, "this is a web page saved as a file, not a cafa artifact; download the file itself")
    try:
        with open_safetensors(path) as f:
            return _read_open(f, path, load_tensors)
    except SafetensorError as error:
        if _is_torch_checkpoint(path):
            raise _bad(path, "this is a torch checkpoint, not a cafa artifact: give it as `weights`, and the file cafa stats wrote as `stats`") from None
        raise _bad(path, f"not a readable safetensors file ({str(error).splitlines()[0][:120]}); re-create it with cafa stats") from None
    except (OSError, ValueError, RuntimeError, OverflowError) as error:
        raise _bad(path, f"unreadable artifact ({type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}); re-create it with cafa stats") from None


def _is_torch_checkpoint(path: Path) -> bool:
    """torch.save's zip archive (its first entry is `<name>/data.pkl`) or legacy pickle."""
    with open(path, "rb") as f:
        head = f.read(512)
    return (head.startswith(b"PK\x03\x04") and b"data.pkl" in head) or head[:1] == b"\x80" and head[1:2] in b"\x02\x03\x04\x05"


def _read_open(f, path: Path, load_tensors: bool) -> Artifact:
    metadata = f.metadata() or {}
    covariance, C, d, class_names, model, preprocessing, sampling = _checked_metadata(metadata, path)
    factor_name, factor_shape, expected = _expected_tensors(metadata, covariance, C, d, path)
    _check_layout(f, expected, path)
    # copies: a tensor from get_tensor can share the file mapping, which would keep every
    # page of the (large) factors that validation touched resident for the artifact's life
    small = {name: f.get_tensor(name).clone() for name in expected if name != factor_name}
    _check_small_tensors(small, metadata, covariance, path)
    factors = _checked_factors(f, path, covariance, factor_name, factor_shape, keep=load_tensors)

    gaussians = None
    if load_tensors:
        shrink_info = _json(metadata, "shrinkage", path)
        numbers = isinstance(shrink_info, dict) and all(
            isinstance(shrink_info.get(k), (int, float)) and 0 <= shrink_info[k] <= 1 for k in ("min", "mean", "max"))
        if not numbers or not isinstance(shrink_info.get("method"), str):
            raise _bad(path, "metadata 'shrinkage' must hold the method and the min, mean and max λ, in [0, 1]; re-create the artifact with cafa stats")
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
    return Artifact(str(path), class_names, model, preprocessing, sampling if isinstance(sampling, dict) else {}, metadata, gaussians)


def _checked_metadata(metadata: dict, path: Path):
    """(covariance, C, d, class names, model, preprocessing, sampling) from valid metadata."""
    if metadata.get("format") != FORMAT:
        raise _bad(path, "a safetensors file, but not a cafa statistics artifact (metadata 'format' is not 'cafa-stats')")
    version = metadata.get("format_version")
    if version is None:
        raise _bad(path, "metadata field 'format_version' is missing; the file was edited or damaged: re-create it with cafa stats")
    if version != str(FORMAT_VERSION):
        raise _bad(path, f"artifact format version {version!r} is not supported by cafa {__version__} (it reads version "
                         f"{FORMAT_VERSION}); re-create it or upgrade cafa")
    covariance = metadata.get("covariance")
    if covariance not in COVARIANCE_MODES:
        raise _bad(path, f"unknown covariance mode {covariance!r} (expected one of {', '.join(COVARIANCE_MODES)}); re-create it with cafa stats")
    try:
        d = int(metadata["feature_dim"])
        C = int(metadata["num_classes"])
    except (KeyError, ValueError):
        raise _bad(path, "metadata 'feature_dim' / 'num_classes' missing or not integers") from None
    if d < 1 or C < 1:
        raise _bad(path, f"metadata says {C} classes of dimension {d}")
    class_names = _json(metadata, "class_names", path)
    if not isinstance(class_names, list) or len(class_names) != C or not all(isinstance(n, str) for n in class_names):
        raise _bad(path, f"metadata 'class_names' must be a list of {C} strings")
    if len(set(class_names)) != C:
        raise _bad(path, "metadata 'class_names' repeats a name")
    if unusable_class_names(class_names):
        raise _bad(path, "metadata 'class_names' holds an empty name or one with a line break; re-create the artifact "
                         "with class folders (or a `classes` list) named otherwise")
    if "class_subset" in metadata:
        _check_class_subset(_json(metadata, "class_subset", path), class_names, path)
    model_fields = _json(metadata, "model", path)
    prep_fields = _json(metadata, "preprocessing", path)
    sampling = _json(metadata, "sampling", path)
    if not isinstance(model_fields, dict) or not isinstance(prep_fields, dict):
        raise _bad(path, "metadata 'model' and 'preprocessing' must be JSON objects; re-create the artifact with cafa stats")
    unknown = set(model_fields) - {field.name for field in fields(ModelSpec)}
    if unknown or "model" not in model_fields:
        raise _bad(path, f"metadata 'model' has {'unknown fields ' + listing(sorted(unknown)) if unknown else 'no model name'}; "
                         f"re-create the artifact with cafa stats")
    try:
        model = ModelSpec(**model_fields)
        preprocessing = Preprocessing.from_dict(prep_fields)
    except (TypeError, KeyError, ValueError, AttributeError) as error:
        raise _bad(path, f"metadata 'model' or 'preprocessing' is malformed ({error})") from None
    except UsageError as error:  # Preprocessing's own checks
        raise _bad(path, f"metadata 'preprocessing' is invalid ({error})") from None
    if not _valid_spec(model):
        raise _bad(path, "metadata 'model' has fields of the wrong type; re-create the artifact with cafa stats")
    for key in ("parameters_sha256", "factory_sha256"):
        digest = metadata.get(key)
        if (digest is not None or key == "parameters_sha256") and not re.fullmatch("[0-9a-f]{64}", digest or ""):
            raise _bad(path, f"metadata '{key}' is {'missing' if digest is None else 'not a hex SHA-256'}; the file was edited or "
                             f"damaged: re-create it with cafa stats")
    return covariance, C, d, class_names, model, preprocessing, sampling


def _check_class_subset(subset, class_names: list[str], path: Path) -> None:
    """A class subset's record: every model output's name, and the (increasing) output of
    each class of the statistics, whose names they must be."""
    model_classes = subset.get("model_classes") if isinstance(subset, dict) else None
    outputs = subset.get("outputs") if isinstance(subset, dict) else None
    valid = (isinstance(model_classes, list) and all(isinstance(n, str) for n in model_classes)
             and len(set(model_classes)) == len(model_classes) and not unusable_class_names(model_classes)
             and isinstance(outputs, list) and len(outputs) == len(class_names)
             and all(type(o) is int and 0 <= o < len(model_classes) for o in outputs)
             and all(a < b for a, b in zip(outputs, outputs[1:]))
             and [model_classes[o] for o in outputs] == class_names)
    if not valid:
        raise _bad(path, "metadata 'class_subset' must hold the model's class names and, in increasing order, the output of "
                         "each of 'class_names'; re-create the artifact with cafa stats")


def _expected_tensors(metadata: dict, covariance: str, C: int, d: int, path: Path):
    """(factor tensor name, its shape, {name: (shape, dtype)} of every tensor) the metadata implies."""
    if covariance == "lowrank":
        try:
            k = int(metadata["rank"])
        except (KeyError, ValueError):
            raise _bad(path, "metadata 'rank' (the low-rank basis size k) missing or not an integer") from None
        if not 0 < k <= d:
            raise _bad(path, f"metadata 'rank' is {k}; it must be in [1, feature_dim = {d}]")
        factor_name, factor_shape = "lowrank_basis", (C, k, d)
        factors = {
            "lowrank_basis": ((C, k, d), torch.float32),
            "lowrank_isotropic": ((C,), torch.float32),
            "lowrank_spectrum": ((C, k), torch.float32),
        }
    else:
        factor_name, factor_shape = "precision_cholesky", {"full": (C, d, d), "tied": (1, d, d), "diag": (C, d)}[covariance]
        factors = {"precision_cholesky": (factor_shape, torch.float32)}
    expected = {
        "means": ((C, d), torch.float32),
        **factors,
        "counts": ((C,), torch.int64),
        "shrinkage": ((1 if covariance == "tied" else C,), torch.float64),
        "global_mean": ((d,), torch.float32),
        "global_covariance": ((d, d), torch.float32),
    }
    return factor_name, factor_shape, expected


def _check_layout(f, expected: dict, path: Path) -> None:
    """Every expected tensor is there with its shape and dtype (read from the header only)."""
    missing = sorted(set(expected) - set(f.keys()))
    if missing:
        raise _bad(path, f"tensors missing: {', '.join(missing)}")
    for name, (shape, dtype) in expected.items():
        piece = f.get_slice(name)
        actual_shape = tuple(piece.get_shape())
        actual_dtype = piece.get_dtype()
        if actual_shape != shape:
            raise _bad(path, f"tensor '{name}' has shape {actual_shape}, metadata implies {shape}")
        wanted = {torch.float32: "F32", torch.int64: "I64", torch.float64: "F64"}[dtype]
        if actual_dtype != wanted:
            raise _bad(path, f"tensor '{name}' has dtype {actual_dtype}, expected {wanted}")


def _check_small_tensors(small: dict, metadata: dict, covariance: str, path: Path) -> None:
    """The values of everything but the factors: finite, counts ≥ 2 adding up, λ in [0, 1]."""
    for name, tensor in small.items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise _bad(path, f"tensor '{name}' holds NaN or inf values")
    if (small["counts"] < 2).any():
        raise _bad(path, "tensor 'counts' has classes with fewer than 2 samples")
    if metadata.get("num_images") != str(int(small["counts"].sum())):
        raise _bad(path, f"metadata 'num_images' ({metadata.get('num_images')}) is not the sum of the tensor 'counts' "
                         f"({int(small['counts'].sum())}); the file was edited or damaged: re-create it with cafa stats")
    if ((small["shrinkage"] < 0) | (small["shrinkage"] > 1)).any():
        raise _bad(path, "tensor 'shrinkage' has values outside [0, 1]")
    if covariance == "lowrank":
        if (small["lowrank_isotropic"] <= 0).any():
            raise _bad(path, "tensor 'lowrank_isotropic' has values ≤ 0; the covariance a·I + QᵀdiagQ(e) would be singular")
        if (small["lowrank_spectrum"] < 0).any():
            raise _bad(path, "tensor 'lowrank_spectrum' has negative values")


_ORTHONORMAL_TOLERANCE = 1e-3  # |Q Qᵀ − I| allowed in a stored low-rank basis


def _valid_spec(m: ModelSpec) -> bool:
    """A model name, optional strings, and an optional positive class count (JSON can hold anything)."""
    strings = all(v is None or isinstance(v, str) for v in (m.weights, m.weights_sha256, m.classifier))
    count = m.num_classes is None or (type(m.num_classes) is int and m.num_classes >= 1)
    arguments = m.model_args is None or (isinstance(m.model_args, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in m.model_args.items()))
    return isinstance(m.model, str) and bool(m.model) and strings and count and arguments


def _checked_factors(f, path, covariance: str, name: str, shape: tuple, keep: bool) -> torch.Tensor | None:
    """Check the factors slice by slice: finite, lower-triangular, positive diagonal;
    a low-rank basis: finite, each row unit-length and orthogonal to the others or all zero.
    Kept slices are copied into one preallocated tensor (no second full-size copy)."""
    piece = f.get_slice(name)
    per_class_bytes = 4 * max(1, int(torch.tensor(shape[1:]).prod()))
    step = max(1, _SLICE_BYTES // per_class_bytes)
    kept = torch.empty(shape, dtype=torch.float32) if keep else None
    for start in range(0, shape[0], step):
        block = piece[start : start + step]
        if covariance == "lowrank":
            _check_basis(path, block)
        else:
            if not torch.isfinite(block).all():
                raise _bad(path, "precision factors hold NaN or inf values")
            diagonal = block if covariance == "diag" else block.diagonal(dim1=-2, dim2=-1)
            if (diagonal <= 0).any():
                raise _bad(path, "precision factors have a non-positive diagonal; not a valid Cholesky factor")
            if covariance != "diag" and torch.triu(block, diagonal=1).any():
                raise _bad(path, "precision factors are not lower-triangular")
        if keep:
            kept[start : start + len(block)] = block
    return kept


def _check_basis(path, block: torch.Tensor) -> None:
    if not torch.isfinite(block).all():
        raise _bad(path, "tensor 'lowrank_basis' holds NaN or inf values")
    gram = torch.bmm(block, block.transpose(1, 2))  # [c, k, k]: identity on the used rows
    used = (gram.diagonal(dim1=1, dim2=2) > 0.5).float()
    if (gram - torch.diag_embed(used)).abs().amax() > _ORTHONORMAL_TOLERANCE:
        raise _bad(path, "tensor 'lowrank_basis' is not orthonormal (each row must be a unit vector orthogonal to the others, or zero)")
