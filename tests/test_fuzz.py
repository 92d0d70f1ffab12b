"""Fuzz the artifact reader: every mutated file is either a valid artifact or an InputError.

The in-suite run is short (about 300 examples in all). For a long run, raise the
number of examples per test with an environment variable:

    CAFA_FUZZ_EXAMPLES=4000 .venv/bin/python -m pytest -q tests/test_fuzz.py

(docs/reference/security.md records the last long run.)
"""

from __future__ import annotations

import atexit
import io
import json
import math
import os
import re
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from rich.console import Console
from test_artifact import write

from cafa_cli.artifact.store import Artifact, read_artifact
from cafa_cli.core.errors import InputError
from cafa_cli.jobs.inspect import describe, render

EXAMPLES = int(os.environ.get("CAFA_FUZZ_EXAMPLES", "50"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)


def _valid_bytes(covariance: str) -> bytes:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "valid.safetensors"
        write(path, covariance, "auto" if covariance != "diag" else 0.3)
        return path.read_bytes()


VALID = {cov: _valid_bytes(cov) for cov in ("full", "tied", "diag", "lowrank")}
WORK = Path(tempfile.mkdtemp(prefix="cafa-fuzz-"))
atexit.register(shutil.rmtree, WORK, ignore_errors=True)


def split(data: bytes) -> tuple[dict, bytes]:
    """A safetensors file: 8-byte little-endian header length, JSON header, tensor bytes."""
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def join(header, body: bytes) -> bytes:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return struct.pack("<Q", len(raw)) + raw + body


def check(data: bytes, load_tensors: bool = True) -> None:
    """The property: a valid, self-consistent Artifact, or an InputError — nothing else."""
    path = WORK / "fuzzed.safetensors"
    path.write_bytes(data)
    try:
        artifact = read_artifact(path, load_tensors=load_tensors)
    except InputError as error:
        message = str(error)
        assert message and "\n" not in message and "Traceback" not in message
        event("InputError: " + re.sub(r"[\d.]+|'[^']*'", "#", message.removeprefix(f"{path}: "))[:60])
        return
    event("valid artifact")
    assert isinstance(artifact, Artifact)
    C, d = artifact.num_classes, artifact.feature_dim
    assert len(artifact.class_names) == C == len(set(artifact.class_names))
    # every field that adapt uses has the type and range it expects
    m = artifact.model
    assert isinstance(m.model, str) and m.model
    assert all(v is None or isinstance(v, str) for v in (m.weights, m.weights_sha256, m.classifier))
    assert m.num_classes is None or (type(m.num_classes) is int and m.num_classes >= 1)
    p = artifact.preprocessing
    assert all(v is None or (type(v) is int and v >= 1) for v in (p.resize, p.crop))
    assert p.channels in (1, 3) and all(math.isfinite(v) for v in p.mean + p.std) and all(v > 0 for v in p.std)
    if load_tensors:
        g = artifact.gaussians
        assert g.means.shape == (C, d) and torch.isfinite(g.means).all()
        assert torch.isfinite(g.factors).all() and (g.counts >= 2).all()
        # and `cafa inspect` can show it, as text and as JSON
        summary = describe(artifact)
        json.dumps(summary)
        Console(file=io.StringIO(), width=120).print(render(summary))


covariances = st.sampled_from(sorted(VALID))


@FUZZ
@given(
    covariances, st.lists(st.tuples(st.integers(0, 10**9), st.integers(0, 7)), min_size=1, max_size=8), st.booleans()
)
def test_bit_flips(covariance, flips, load_tensors):
    data = bytearray(VALID[covariance])
    for position, bit in flips:
        data[position % len(data)] ^= 1 << bit
    check(bytes(data), load_tensors)


@FUZZ
@given(
    covariances,
    st.integers(0, 10**9),
    st.integers(0, 10**9),
    st.binary(max_size=64),
    st.sampled_from(["insert", "delete", "overwrite", "truncate"]),
)
def test_truncations_insertions_deletions(covariance, where, length, chunk, how):
    data = VALID[covariance]
    at = where % (len(data) + 1)
    if how == "insert":
        data = data[:at] + chunk + data[at:]
    elif how == "delete":
        data = data[:at] + data[at + length % 64 :]
    elif how == "overwrite":
        data = data[:at] + chunk + data[at + len(chunk) :]
    else:
        data = data[:at]
    check(data)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=12,
)
METADATA_KEYS = sorted({key for data in VALID.values() for key in split(data)[0]["__metadata__"]})
metadata_values = st.one_of(
    st.text(max_size=40),
    json_values.map(lambda v: json.dumps(v)),  # valid JSON of the wrong shape
    st.sampled_from(
        [
            "0",
            "-1",
            "1e400",
            "NaN",
            "Infinity",
            "99999999999999999999",
            "3.0",
            " 3",
            "[]",
            "{}",
            "null",
            '["a","a","b"]',
        ]
    ),
)


# the JSON fields with structure: the right keys holding values of any type
STRUCTURED = {
    "model": ["model", "weights", "weights_sha256", "num_classes", "classifier"],
    "preprocessing": ["resize", "crop", "mean", "std", "channels"],
    "shrinkage": ["method", "target", "min", "max", "mean"],
    "sampling": ["data", "fraction", "per_class", "seed"],
}
VALID_METADATA = split(VALID["full"])[0]["__metadata__"]
DROP = object()


def _mutated_field(key: str):
    """The valid JSON object of `key` with a few of its fields replaced by any JSON value, or dropped."""
    base = json.loads(VALID_METADATA[key])
    edits = st.dictionaries(st.sampled_from(STRUCTURED[key]), json_values | st.just(DROP), min_size=1, max_size=3)
    return edits.map(lambda edit: json.dumps({k: v for k, v in {**base, **edit}.items() if v is not DROP}))


structured = st.sampled_from(sorted(STRUCTURED)).flatmap(lambda key: st.tuples(st.just(key), _mutated_field(key)))
changes = st.lists(
    st.tuples(st.sampled_from(METADATA_KEYS + ["extra"]), metadata_values | st.none()) | structured,
    min_size=1,
    max_size=4,
)


@FUZZ
@given(covariances, changes, st.booleans())
def test_metadata_keys_get_random_values(covariance, changes, load_tensors):
    header, body = split(VALID[covariance])
    meta = header["__metadata__"]
    for key, value in changes:
        if value is None:
            meta.pop(key, None)
        else:
            meta[key] = value
    check(join(header, body), load_tensors)


def tensor_names(covariance: str) -> list[str]:
    return sorted(k for k in split(VALID[covariance])[0] if k != "__metadata__")


@FUZZ
@given(
    covariances, st.integers(0, 99), st.sampled_from(["dtype", "shape", "data_offsets", "drop", "replace"]), json_values
)
def test_tensor_entries_and_metadata_types(covariance, pick, field, value):
    header, body = split(VALID[covariance])
    names = tensor_names(covariance) + ["__metadata__"]
    name = names[pick % len(names)]
    if field == "drop":
        header.pop(name)
    elif field == "replace" or name == "__metadata__":
        header[name] = value
    else:
        header[name][field] = value
    try:
        data = join(header, body)
    except (TypeError, ValueError):  # floats json cannot write (nan keys etc.): nothing to test
        return
    check(data)


@FUZZ
@given(covariances, st.one_of(st.integers(0, 2**64 - 1), st.integers(0, 4096)), st.binary(max_size=200))
def test_random_header_lengths(covariance, length, tail):
    header, body = split(VALID[covariance])
    raw = json.dumps(header).encode()
    check(struct.pack("<Q", length) + raw + body + tail)
    check(struct.pack("<Q", length) + tail)


special_floats = st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, -1.0, 1e-45, 3.4e38, 1e300])


@FUZZ
@given(
    covariances,
    st.integers(0, 99),
    st.integers(0, 10**6),
    special_floats | st.floats(width=32),
    st.sampled_from([-(2**63), -1, 0, 1, 2, 2**62]) | st.integers(-(2**63), 2**63 - 1),
)
def test_tensor_values(covariance, pick, index, value, integer):
    """NaN/inf, zero or negative diagonals, out-of-range counts and shrinkage in the data."""
    header, body = split(VALID[covariance])
    name = tensor_names(covariance)[pick % len(tensor_names(covariance))]
    start, end = header[name]["data_offsets"]
    dtype = header[name]["dtype"]
    size = {"F32": 4, "F64": 8, "I64": 8}[dtype]
    at = start + (index % ((end - start) // size)) * size
    with np.errstate(over="ignore"):  # a float64 beyond float32's range becomes inf: one more bad value
        packed = (
            np.array([integer if dtype == "I64" else value])
            .astype({"F32": "<f4", "F64": "<f8", "I64": "<i8"}[dtype])
            .tobytes()
        )
    check(join(header, body[:at] + packed + body[at + size :]))


def test_the_valid_files_are_valid():
    for data in VALID.values():
        path = WORK / "valid.safetensors"
        path.write_bytes(data)
        assert read_artifact(path).gaussians is not None
