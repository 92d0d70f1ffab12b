"""What a valid artifact holds (docs/reference/artifact-format.md): the format's name and version,
and the checks of a file's metadata and tensors that reading applies, the factors a slice
at a time through the file mapping. The checks take numpy arrays (safetensors' numpy
reader): `cafa inspect` runs them without importing torch, and `read_artifact` runs the
same ones before it hands the arrays to torch."""

from __future__ import annotations

import json
import math
import re
from dataclasses import fields
from pathlib import Path

import numpy as np

from cafa_cli import __version__
from cafa_cli.core.errors import InputError, UsageError, listing
from cafa_cli.data.preprocessing import Preprocessing
from cafa_cli.model.spec import ModelSpec
from cafa_cli.statistics import COVARIANCE_MODES

FORMAT = "cafa-stats"
FORMAT_VERSION = 2  # what the writer writes and the reader reads (version 1 was never released)
_SLICE_BYTES = 256 << 20  # validate factors in pieces of about this size


def unusable_class_names(names: list[str]) -> list[str]:
    """Names that would break the records: blank (a prediction of "" reads as "no label"
    in the CSV) or with a line break (it splits a record)."""
    return [name for name in names if not name.strip() or "\n" in name or "\r" in name]


def bad(path, why: str) -> InputError:
    return InputError(f"{path}: {why}")


def read_json(metadata: dict, key: str, path):
    try:
        return json.loads(metadata[key])
    except (KeyError, TypeError, json.JSONDecodeError):
        raise bad(
            path, f"metadata field '{key}' is missing or not valid JSON; re-create the artifact with cafa stats"
        ) from None


def checked_metadata(metadata: dict, path: Path):
    """(covariance, C, d, class names, model, preprocessing, sampling) from valid metadata."""
    if metadata.get("format") != FORMAT:
        raise bad(
            path, "a safetensors file, but not a cafa statistics artifact (metadata 'format' is not 'cafa-stats')"
        )
    version = metadata.get("format_version")
    if version is None:
        raise bad(
            path,
            "metadata field 'format_version' is missing; the file was edited or damaged: re-create it with cafa stats",
        )
    if version != str(FORMAT_VERSION):
        raise bad(
            path,
            f"artifact format version {version!r} is not supported by cafa {__version__} (it reads version "
            f"{FORMAT_VERSION}); re-create it or upgrade cafa",
        )
    covariance = metadata.get("covariance")
    if covariance not in COVARIANCE_MODES:
        raise bad(
            path,
            f"unknown covariance mode {covariance!r} (expected one of {', '.join(COVARIANCE_MODES)}); re-create it "
            "with cafa stats",
        )
    try:
        d = int(metadata["feature_dim"])
        C = int(metadata["num_classes"])
    except (KeyError, ValueError):
        raise bad(path, "metadata 'feature_dim' / 'num_classes' missing or not integers") from None
    if d < 1 or C < 1:
        raise bad(path, f"metadata says {C} classes of dimension {d}")
    class_names = read_json(metadata, "class_names", path)
    if not isinstance(class_names, list) or len(class_names) != C or not all(isinstance(n, str) for n in class_names):
        raise bad(path, f"metadata 'class_names' must be a list of {C} strings")
    if len(set(class_names)) != C:
        raise bad(path, "metadata 'class_names' repeats a name")
    if unusable_class_names(class_names):
        raise bad(
            path,
            "metadata 'class_names' holds an empty name or one with a line break; re-create the artifact "
            "with class folders (or a `classes` list) named otherwise",
        )
    if "class_subset" in metadata:
        _check_class_subset(read_json(metadata, "class_subset", path), class_names, path)
    model_fields = read_json(metadata, "model", path)
    prep_fields = read_json(metadata, "preprocessing", path)
    sampling = read_json(metadata, "sampling", path)
    if not isinstance(model_fields, dict) or not isinstance(prep_fields, dict):
        raise bad(
            path, "metadata 'model' and 'preprocessing' must be JSON objects; re-create the artifact with cafa stats"
        )
    unknown = set(model_fields) - {field.name for field in fields(ModelSpec)}
    if unknown or "model" not in model_fields:
        raise bad(
            path,
            f"metadata 'model' has {'unknown fields ' + listing(sorted(unknown)) if unknown else 'no model name'}; "
            f"re-create the artifact with cafa stats",
        )
    try:
        model = ModelSpec(**model_fields)
        preprocessing = Preprocessing.from_dict(prep_fields)
    except (TypeError, KeyError, ValueError, AttributeError) as error:
        raise bad(path, f"metadata 'model' or 'preprocessing' is malformed ({error})") from None
    except UsageError as error:  # Preprocessing's own checks
        raise bad(path, f"metadata 'preprocessing' is invalid ({error})") from None
    if not _valid_spec(model):
        raise bad(path, "metadata 'model' has fields of the wrong type; re-create the artifact with cafa stats")
    for key in ("parameters_sha256", "factory_sha256"):
        digest = metadata.get(key)
        if (digest is not None or key == "parameters_sha256") and not re.fullmatch("[0-9a-f]{64}", digest or ""):
            raise bad(
                path,
                f"metadata '{key}' is {'missing' if digest is None else 'not a hex SHA-256'}; the file was edited or "
                f"damaged: re-create it with cafa stats",
            )
    return covariance, C, d, class_names, model, preprocessing, sampling


def _check_class_subset(subset, class_names: list[str], path: Path) -> None:
    """A class subset's record: every model output's name, and the (increasing) output of
    each class of the statistics, whose names they must be."""
    model_classes = subset.get("model_classes") if isinstance(subset, dict) else None
    outputs = subset.get("outputs") if isinstance(subset, dict) else None
    valid = (
        isinstance(model_classes, list)
        and all(isinstance(n, str) for n in model_classes)
        and len(set(model_classes)) == len(model_classes)
        and not unusable_class_names(model_classes)
        and isinstance(outputs, list)
        and len(outputs) == len(class_names)
        and all(type(o) is int and 0 <= o < len(model_classes) for o in outputs)
        and all(a < b for a, b in zip(outputs, outputs[1:]))
        and [model_classes[o] for o in outputs] == class_names
    )
    if not valid:
        raise bad(
            path,
            "metadata 'class_subset' must hold the model's class names and, in increasing order, the output of "
            "each of 'class_names'; re-create the artifact with cafa stats",
        )


def expected_tensors(metadata: dict, covariance: str, C: int, d: int, path: Path):
    """(factor tensor name, its shape, {name: (shape, safetensors dtype)} of every tensor) the metadata implies."""
    if covariance == "lowrank":
        try:
            k = int(metadata["rank"])
        except (KeyError, ValueError):
            raise bad(path, "metadata 'rank' (the low-rank basis size k) missing or not an integer") from None
        if not 0 < k <= d:
            raise bad(path, f"metadata 'rank' is {k}; it must be in [1, feature_dim = {d}]")
        factor_name, factor_shape = "lowrank_basis", (C, k, d)
        factors = {
            "lowrank_basis": ((C, k, d), "F32"),
            "lowrank_isotropic": ((C,), "F32"),
            "lowrank_spectrum": ((C, k), "F32"),
        }
    else:
        factor_name, factor_shape = (
            "precision_cholesky",
            {"full": (C, d, d), "tied": (1, d, d), "diag": (C, d)}[covariance],
        )
        factors = {"precision_cholesky": (factor_shape, "F32")}
    expected = {
        "means": ((C, d), "F32"),
        **factors,
        "counts": ((C,), "I64"),
        "shrinkage": ((1 if covariance == "tied" else C,), "F64"),
        "global_mean": ((d,), "F32"),
        "global_covariance": ((d, d), "F32"),
    }
    for name, channels in norm_layers(metadata, path).items():
        expected[f"norm.{name}.mean"] = expected[f"norm.{name}.var"] = ((C, channels), "F32")
    return factor_name, factor_shape, expected


def norm_layers(metadata: dict, path: Path) -> dict[str, int]:
    """{BatchNorm name: channels} whose class moments the artifact holds (`cafa stats
    --norm-moments`), from the optional metadata field 'norm_layers'; {} without it."""
    if "norm_layers" not in metadata:
        return {}
    layers = read_json(metadata, "norm_layers", path)
    if not (
        isinstance(layers, dict) and all(isinstance(k, str) and type(v) is int and v >= 1 for k, v in layers.items())
    ):
        raise bad(
            path,
            "metadata 'norm_layers' must map each BatchNorm's name to its channel count; re-create the artifact "
            "with cafa stats --norm-moments",
        )
    return layers


def check_layout(f, expected: dict, path: Path) -> None:
    """Every expected tensor is there with its shape and dtype (read from the header only)."""
    missing = sorted(set(expected) - set(f.keys()))
    if missing:
        raise bad(path, f"tensors missing: {', '.join(missing)}")
    for name, (shape, dtype) in expected.items():
        piece = f.get_slice(name)
        actual_shape = tuple(piece.get_shape())
        actual_dtype = piece.get_dtype()
        if actual_shape != shape:
            raise bad(path, f"tensor '{name}' has shape {actual_shape}, metadata implies {shape}")
        if actual_dtype != dtype:
            raise bad(path, f"tensor '{name}' has dtype {actual_dtype}, expected {dtype}")


def check_small_tensors(small: dict, metadata: dict, covariance: str, path: Path) -> None:
    """The values of everything but the factors: finite, counts ≥ 2 adding up, λ in [0, 1]."""
    for name, tensor in small.items():
        if tensor.dtype.kind == "f" and not np.isfinite(tensor).all():
            raise bad(path, f"tensor '{name}' holds NaN or inf values")
    if (small["counts"] < 2).any() and not _from_text(small, metadata, path):
        raise bad(path, "tensor 'counts' has classes with fewer than 2 samples")
    if metadata.get("num_images") != str(int(small["counts"].sum())):
        raise bad(
            path,
            f"metadata 'num_images' ({metadata.get('num_images')}) is not the sum of the tensor 'counts' "
            f"({int(small['counts'].sum())}); the file was edited or damaged: re-create it with cafa stats",
        )
    negative = [
        name
        for name, tensor in small.items()
        if name.startswith("norm.") and name.endswith(".var") and (tensor < 0).any()
    ]
    if negative:
        raise bad(path, f"tensor '{negative[0]}' has negative variances")
    _check_covariance(small["global_covariance"], path)
    if ((small["shrinkage"] < 0) | (small["shrinkage"] > 1)).any():
        raise bad(path, "tensor 'shrinkage' has values outside [0, 1]")
    if covariance == "lowrank":
        if (small["lowrank_isotropic"] <= 0).any():
            raise bad(
                path, "tensor 'lowrank_isotropic' has values ≤ 0; the covariance a·I + QᵀdiagQ(e) would be singular"
            )
        if (small["lowrank_spectrum"] < 0).any():
            raise bad(path, "tensor 'lowrank_spectrum' has negative values")


def _from_text(small: dict, metadata: dict, path: Path) -> bool:
    """Statistics from a CLIP model's text embeddings (`cafa stats --from-text`): no image counted."""
    sampling = read_json(metadata, "sampling", path)
    return isinstance(sampling, dict) and "from_text" in sampling and not small["counts"].any()


_ORTHONORMAL_TOLERANCE = 1e-3  # |Q Qᵀ − I| allowed in a stored low-rank basis
_SYMMETRY_TOLERANCE = 1e-5  # |Σ − Σᵀ| allowed, relative to the largest |Σ| (float32 rounding)


def _check_covariance(sigma: np.ndarray, path) -> None:
    """Global FA's covariance: symmetric and positive semi-definite, as the factors are checked
    (a Cholesky factorisation with a jitter of d·1e-7 of its largest entry, the most that
    float32 rounding of a singular covariance can push an eigenvalue below 0: a valid one
    passes, one with an eigenvalue of the order of -max|Σ| fails)."""
    scale = float(np.abs(sigma).max()) or 1.0
    if float(np.abs(sigma - sigma.T).max()) > _SYMMETRY_TOLERANCE * scale:
        raise bad(path, "tensor 'global_covariance' is not symmetric; re-create the artifact with cafa stats")
    sigma64 = sigma.astype(np.float64)
    jitter = len(sigma64) * 1e-7 * scale
    try:
        np.linalg.cholesky(sigma64 + jitter * np.eye(len(sigma64)))
        factorised = True
    except np.linalg.LinAlgError:
        factorised = False
    if not factorised or (sigma64.diagonal() < 0).any():
        raise bad(
            path,
            "tensor 'global_covariance' is not positive semi-definite (a covariance never is otherwise); "
            "re-create the artifact with cafa stats",
        )


def _valid_spec(m: ModelSpec) -> bool:
    """A model name, optional strings, and an optional positive class count (JSON can hold anything)."""
    strings = all(
        v is None or isinstance(v, str)
        for v in (m.weights, m.weights_sha256, m.classifier, m.templates, m.prompts_sha256)
    )
    count = m.num_classes is None or (type(m.num_classes) is int and m.num_classes >= 1)
    arguments = m.model_args is None or (
        isinstance(m.model_args, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in m.model_args.items())
    )
    return isinstance(m.model, str) and bool(m.model) and strings and count and arguments


def checked_factors(f, path, covariance: str, name: str, shape: tuple, keep: bool) -> np.ndarray | None:
    """Check the factors slice by slice: finite, lower-triangular, positive diagonal;
    a low-rank basis: finite, each row unit-length and orthogonal to the others or all zero.
    Kept slices are copied into one preallocated array (no second full-size copy)."""
    piece = f.get_slice(name)
    per_class_bytes = 4 * max(1, math.prod(shape[1:]))
    step = max(1, _SLICE_BYTES // per_class_bytes)
    kept = np.empty(shape, dtype=np.float32) if keep else None
    for start in range(0, shape[0], step):
        block = piece[start : min(start + step, shape[0])]  # numpy's reader refuses a slice past the end
        if covariance == "lowrank":
            _check_basis(path, block)
        else:
            if not np.isfinite(block).all():
                raise bad(path, "precision factors hold NaN or inf values")
            diagonal = block if covariance == "diag" else block.diagonal(axis1=-2, axis2=-1)
            if (diagonal <= 0).any():
                raise bad(path, "precision factors have a non-positive diagonal; not a valid Cholesky factor")
            if covariance != "diag" and np.triu(block, k=1).any():
                raise bad(path, "precision factors are not lower-triangular")
        if keep:
            kept[start : start + len(block)] = block
    return kept


def _check_basis(path, block: np.ndarray) -> None:
    if not np.isfinite(block).all():
        raise bad(path, "tensor 'lowrank_basis' holds NaN or inf values")
    gram = block @ block.transpose(0, 2, 1)  # [c, k, k]: identity on the used rows
    used = gram.diagonal(axis1=1, axis2=2) > 0.5
    if np.abs(gram - used[:, :, None] * np.eye(gram.shape[-1], dtype=gram.dtype)).max() > _ORTHONORMAL_TOLERANCE:
        raise bad(
            path,
            "tensor 'lowrank_basis' is not orthonormal (each row must be a unit vector orthogonal to the others, or "
            "zero)",
        )
