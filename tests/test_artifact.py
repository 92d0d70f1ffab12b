"""artifact/store.py: round trip, atomic writes, and a one-line InputError for each kind of bad file."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load, save_file

import cafa_cli.artifact.format as artifact_format
import cafa_cli.artifact.store as artifact_module
from cafa_cli.artifact.store import read_artifact, write_artifact
from cafa_cli.core.errors import CafaError, InputError
from cafa_cli.core.files import atomic_write
from cafa_cli.data.preprocessing import Preprocessing
from cafa_cli.model.loading import ModelSpec
from cafa_cli.statistics.gaussians import estimate
from cafa_cli.statistics.moments import ClassMoments

NAMES = ["cat", "dog", "émeu"]
D = 4
SPEC = ModelSpec("resnet18", "/models/net.pt", "ab" * 32, 3, "fc")
PREP = Preprocessing(resize=None, crop=32, mean=(0.5,), std=(0.25,), channels=1)
SAMPLING = {"data": "/data/train", "fraction": 0.5, "per_class": None, "seed": 7}
FINGERPRINT = "cd" * 32


def gaussians(covariance: str = "full", shrinkage="auto"):
    gen = torch.Generator().manual_seed(0)
    counts = [20, 15, 30]
    x = torch.cat([torch.randn(n, D, generator=gen) + c for c, n in enumerate(counts)])
    y = torch.cat([torch.full((n,), c) for c, n in enumerate(counts)])
    moments = ClassMoments(3, D)
    moments.update(x, y)
    return estimate(moments, covariance, shrinkage, NAMES)


def write(path: Path, covariance: str = "full", shrinkage="auto"):
    g = gaussians(covariance, shrinkage)
    write_artifact(path, g, NAMES, SPEC, PREP, SAMPLING, FINGERPRINT)
    return g


# --- round trip ------------------------------------------------------------------


@pytest.mark.parametrize("covariance", ["full", "tied", "diag"])
def test_round_trip_keeps_every_tensor_and_field(tmp_path, covariance):
    path = tmp_path / "s.safetensors"
    g = write(path, covariance, "auto" if covariance != "diag" else 0.3)
    a = read_artifact(path)
    assert a.path == str(path)
    assert a.class_names == NAMES
    assert a.model == SPEC
    assert a.preprocessing == PREP
    assert a.sampling == SAMPLING
    assert a.parameters_sha256 == FINGERPRINT
    assert a.covariance == covariance and a.feature_dim == D and a.num_classes == 3
    r = a.gaussians
    for name in ("means", "factors", "counts", "shrinkage", "global_mean", "global_covariance"):
        original, back = getattr(g, name), getattr(r, name)
        assert back.dtype == original.dtype, name
        assert torch.equal(back, original), name
    assert r.covariance == covariance
    assert r.shrinkage_method == g.shrinkage_method == ("oas" if covariance != "diag" else "fixed")
    assert a.metadata["format"] == "cafa-stats" and a.metadata["format_version"] == "2"
    assert a.metadata["num_images"] == "65"
    shrink = json.loads(a.metadata["shrinkage"])
    assert shrink["min"] == pytest.approx(float(g.shrinkage.min()))
    assert shrink["max"] == pytest.approx(float(g.shrinkage.max()))


@pytest.mark.parametrize("key", ["parameters_sha256", "factory_sha256"])
@pytest.mark.parametrize("fingerprint", ["CD" * 32, "cd" * 31, "zz" * 32, ""])
def test_a_malformed_parameter_fingerprint_is_refused(tmp_path, fingerprint, key):
    path = tmp_path / "s.safetensors"
    write(path)
    with safe_open(str(path), framework="pt") as f:
        metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(path), metadata={**metadata, key: fingerprint})
    with pytest.raises(InputError, match=f"'{key}' is not a hex SHA-256"):
        read_artifact(path)


def test_read_without_tensors_still_validates(tmp_path):
    path = tmp_path / "s.safetensors"
    write(path)
    a = read_artifact(path, load_tensors=False)
    assert a.gaussians is None and a.class_names == NAMES and a.feature_dim == D
    corrupt(path, path, factors=lambda f: f.fill_(float("nan")))
    with pytest.raises(InputError, match="NaN"):
        read_artifact(path, load_tensors=False)


def test_factors_are_validated_in_slices(tmp_path, monkeypatch):
    path = tmp_path / "s.safetensors"
    write(path)
    per_class = 4 * D * D
    monkeypatch.setattr(artifact_format, "_SLICE_BYTES", per_class)  # one class per slice
    assert torch.equal(read_artifact(path).gaussians.factors, gaussians().factors)
    bad = tmp_path / "bad.safetensors"
    corrupt(path, bad, factors=lambda f: f[2, 0].__setitem__(1, 0.5))  # only the last class is wrong
    with pytest.raises(InputError, match="lower-triangular"):
        read_artifact(bad)


# --- atomic writes ---------------------------------------------------------------


def test_failing_writer_keeps_old_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "s.safetensors"
    write(path)
    before = path.read_bytes()

    def half_then_fail(tmp):
        Path(tmp).write_bytes(b"partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(path, half_then_fail)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.safetensors"]


def test_an_artifact_that_fails_its_checks_never_replaces_the_old_one(tmp_path):
    path = tmp_path / "s.safetensors"
    g = write(path)
    before = path.read_bytes()
    broken = replace(g, global_covariance=torch.full_like(g.global_covariance, float("inf")))
    with pytest.raises(InputError, match=rf"{path} not written: .*'global_covariance' holds NaN or inf"):
        write_artifact(path, broken, NAMES, SPEC, PREP, SAMPLING, FINGERPRINT)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.safetensors"]


def test_a_full_disk_is_one_clear_error_and_the_old_artifact_stays(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    from cafa_cli.core.errors import CafaError

    path = tmp_path / "s.safetensors"
    g = write(path)
    before = path.read_bytes()

    def full(*args, **kwargs):
        raise SafetensorError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        )

    monkeypatch.setattr(artifact_module, "save_file", full)
    with pytest.raises(
        CafaError,
        match=rf"^cannot write {path} \(Error while serializing: .*No space left on device.*check the free space",
    ):
        write_artifact(path, g, NAMES, SPEC, PREP, SAMPLING, FINGERPRINT)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["s.safetensors"]


def test_atomic_write_writes_a_fifo_in_place_and_a_symlinks_target(tmp_path):
    """Renaming over /dev/null (as root) would replace the device node with a file."""
    import threading

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    atomic_write(fifo, lambda tmp: Path(tmp).write_text("hello"))
    reader.join(10)
    assert got == ["hello"] and stat.S_ISFIFO(os.stat(fifo).st_mode)
    # safetensors' save_file renames its own temporary file over the path it is given
    got.clear()
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    atomic_write(fifo, lambda tmp: save_file({"x": torch.ones(3)}, tmp))
    reader.join(10)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and torch.equal(load(got[0])["x"], torch.ones(3))
    target, link = tmp_path / "real.json", tmp_path / "link.json"
    target.write_text("old")
    link.symlink_to(target)
    atomic_write(link, lambda tmp: Path(tmp).write_text("new"))
    assert link.is_symlink() and target.read_text() == "new"


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)], ids=["022", "002", "077"])
def test_atomic_write_gives_the_mode_open_would(tmp_path, umask, mode):
    """mkstemp's 0o600 must not leak into the result: artifacts are shared like any file."""
    path = tmp_path / "s.json"
    old = os.umask(umask)
    try:
        atomic_write(path, lambda tmp: Path(tmp).write_text("{}"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == mode


def test_a_failed_rename_names_the_target_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    def immutable(source, target):  # as `chattr +i` makes the target
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "replace", immutable)
    with pytest.raises(
        CafaError, match=rf"^cannot write {tmp_path / 'x.json'}: Operation not permitted; check the file's permissions"
    ):
        atomic_write(tmp_path / "x.json", lambda tmp: Path(tmp).write_text("{}"))
    assert list(tmp_path.iterdir()) == []


def test_atomic_write_keeps_the_mode_of_the_file_it_replaces(tmp_path):
    path = tmp_path / "s.safetensors"
    write(path)
    path.chmod(0o640)
    old = os.umask(0o022)
    try:
        write(path, "diag", 0.1)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert read_artifact(path).covariance == "diag"


def test_interrupted_write_artifact_keeps_old_file(tmp_path, monkeypatch):
    path = tmp_path / "s.safetensors"
    write(path)
    before = path.read_bytes()

    def interrupted(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 100)
        raise KeyboardInterrupt

    monkeypatch.setattr(artifact_module, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write(path, "diag", 0.1)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["s.safetensors"]
    assert read_artifact(path).covariance == "full"


def test_write_replaces_an_existing_artifact(tmp_path):
    path = tmp_path / "s.safetensors"
    write(path, "full")
    write(path, "tied")
    assert read_artifact(path).covariance == "tied"
    assert [p.name for p in tmp_path.iterdir()] == ["s.safetensors"]


def test_write_into_a_folder_or_missing_folder_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="is a folder"):
        write(tmp_path)
    with pytest.raises(InputError, match="does not exist"):
        write(tmp_path / "nowhere" / "s.safetensors")


# --- validation ------------------------------------------------------------------


def corrupt(source: Path, target: Path, metadata: dict | None = None, drop=(), factors=None, **tensors):
    """Rewrite a valid artifact with save_file, changing metadata fields and tensors."""
    with safe_open(str(source), framework="pt") as f:
        meta = dict(f.metadata())
        stored = {k: f.get_tensor(k) for k in f.keys()}
    meta.update(metadata or {})
    meta = {k: v for k, v in meta.items() if v is not None}
    if factors is not None:
        factors(stored["precision_cholesky"])
    stored.update(tensors)
    for key in drop:
        stored.pop(key)
    save_file({k: v.contiguous() for k, v in stored.items()}, str(target), metadata=meta)
    return target


@pytest.fixture
def valid(tmp_path) -> Path:
    path = tmp_path / "valid.safetensors"
    write(path)
    return path


def fails(path: Path, pattern: str) -> str:
    with pytest.raises(InputError, match=pattern) as info:
        read_artifact(path)
    message = str(info.value)
    assert "\n" not in message, "messages must be one line"
    assert "Traceback" not in message
    return message


def test_missing_file(tmp_path):
    message = fails(tmp_path / "absent.safetensors", "no such artifact")
    assert "cafa stats" in message


def test_folder_instead_of_file(tmp_path):
    fails(tmp_path, "is a folder; give the artifact file")
    (tmp_path / "stats-full.safetensors").write_bytes(b"")
    fails(tmp_path, r"is a folder; give the artifact file \(it holds stats-full\.safetensors\)")


@pytest.mark.parametrize("keep", [0, 5, 40, 0.6, -1])  # bytes kept, a fraction, or all but the last byte
def test_truncated_file(valid, keep):
    data = valid.read_bytes()
    valid.write_bytes(data[: int(keep * len(data)) if isinstance(keep, float) else keep])
    fails(valid, "not a readable safetensors file .*re-create it")


def test_garbage_bytes(tmp_path):
    path = tmp_path / "g.safetensors"
    path.write_bytes(
        bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8).tolist())
    )
    fails(path, "not a readable safetensors|unreadable")


def test_garbage_with_small_header_length(tmp_path):
    path = tmp_path / "g.safetensors"
    path.write_bytes((20).to_bytes(8, "little") + b"{not json at all!!!}" + b"\0" * 50)
    fails(path, "not a readable safetensors|unreadable")


@pytest.mark.parametrize(
    "page", [b"<!DOCTYPE html><html><body>Sign in</body></html>", b"\n  <html><head></head></html>"]
)
def test_html_page(tmp_path, page):
    path = tmp_path / "s.safetensors"
    path.write_bytes(page)
    fails(path, "web page")


def test_safetensors_file_that_is_not_an_artifact(tmp_path):
    path = tmp_path / "weights.safetensors"
    save_file({"fc.weight": torch.zeros(3, 4)}, str(path))
    fails(path, "not a cafa statistics artifact")
    save_file({"fc.weight": torch.zeros(3, 4)}, str(path), metadata={"format": "pt"})
    fails(path, "not a cafa statistics artifact")


@pytest.mark.parametrize("version", ["3", "1", "0", "one"])
def test_unknown_format_version(valid, tmp_path, version):
    message = fails(corrupt(valid, tmp_path / "v.safetensors", {"format_version": version}), "format version")
    assert repr(version) in message and "reads version 2" in message


def test_missing_format_version(valid, tmp_path):
    fails(
        corrupt(valid, tmp_path / "v.safetensors", {"format_version": None}),
        "metadata field 'format_version' is missing",
    )


def test_missing_parameter_fingerprint(valid, tmp_path):
    """Every released artifact records the model's parameters: without them no check of the model is possible."""
    fails(
        corrupt(valid, tmp_path / "v.safetensors", {"parameters_sha256": None}),
        "metadata 'parameters_sha256' is missing",
    )


def test_a_symlink_that_leads_nowhere_says_so(tmp_path):
    loop = tmp_path / "loop.safetensors"
    loop.symlink_to(loop)
    dangling = tmp_path / "dangling.safetensors"
    dangling.symlink_to(tmp_path / "gone.safetensors")
    for link in (loop, dangling):
        with pytest.raises(InputError, match="a symbolic link that leads nowhere"):
            read_artifact(link)


def test_unknown_covariance_mode(valid, tmp_path):
    fails(corrupt(valid, tmp_path / "c.safetensors", {"covariance": "spherical"}), "covariance mode 'spherical'")


def test_nan_in_means(valid, tmp_path):
    means = read_artifact(valid).gaussians.means.clone()
    means[1, 2] = float("nan")
    fails(corrupt(valid, tmp_path / "m.safetensors", means=means), "'means' holds NaN")


def test_inf_in_global_covariance(valid, tmp_path):
    cov = read_artifact(valid).gaussians.global_covariance.clone()
    cov[0, 0] = float("inf")
    fails(corrupt(valid, tmp_path / "m.safetensors", global_covariance=cov), "'global_covariance' holds NaN or inf")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_factors(valid, tmp_path, value):
    fails(
        corrupt(valid, tmp_path / "f.safetensors", factors=lambda f: f[0, 3].__setitem__(0, value)),
        "precision factors hold NaN",
    )


def test_shapes_disagree_with_metadata(valid, tmp_path):
    fails(
        corrupt(valid, tmp_path / "a.safetensors", {"num_classes": "4", "class_names": json.dumps(NAMES + ["x"])}),
        r"'means' has shape \(3, 4\), metadata implies \(4, 4\)",
    )
    fails(corrupt(valid, tmp_path / "b.safetensors", {"feature_dim": "5"}), "has shape")
    g = read_artifact(valid).gaussians
    fails(
        corrupt(valid, tmp_path / "c.safetensors", precision_cholesky=g.factors[:2].clone()),
        r"'precision_cholesky' has shape \(2, 4, 4\)",
    )
    fails(
        corrupt(valid, tmp_path / "d.safetensors", {"covariance": "diag"}),
        r"'precision_cholesky' has shape \(3, 4, 4\), metadata implies \(3, 4\)",
    )


def test_wrong_dtype(valid, tmp_path):
    g = read_artifact(valid).gaussians
    fails(corrupt(valid, tmp_path / "d.safetensors", means=g.means.double()), "'means' has dtype F64")


def test_missing_tensor(valid, tmp_path):
    fails(corrupt(valid, tmp_path / "m.safetensors", drop=["global_mean"]), "tensors missing: global_mean")


def test_class_names_disagree_with_num_classes(valid, tmp_path):
    fails(corrupt(valid, tmp_path / "n.safetensors", {"class_names": json.dumps(NAMES[:2])}), "list of 3 strings")
    fails(corrupt(valid, tmp_path / "r.safetensors", {"class_names": json.dumps(["a", "a", "b"])}), "repeats")


def test_factor_not_lower_triangular(valid, tmp_path):
    fails(
        corrupt(valid, tmp_path / "u.safetensors", factors=lambda f: f[1, 0].__setitem__(3, 1e-3)),
        "not lower-triangular",
    )


@pytest.mark.parametrize("value", [0.0, -1.0])
def test_factor_with_non_positive_diagonal(valid, tmp_path, value):
    fails(
        corrupt(valid, tmp_path / "p.safetensors", factors=lambda f: f[2, 1].__setitem__(1, value)),
        "non-positive diagonal",
    )


def test_diag_factor_with_non_positive_entry(tmp_path):
    path = tmp_path / "diag.safetensors"
    write(path, "diag", 0.2)
    fails(
        corrupt(path, tmp_path / "p.safetensors", factors=lambda f: f[0].__setitem__(2, 0.0)), "non-positive diagonal"
    )


def test_counts_and_shrinkage_out_of_range(valid, tmp_path):
    g = read_artifact(valid).gaussians
    fails(corrupt(valid, tmp_path / "c.safetensors", counts=torch.tensor([20, 1, 30])), "fewer than 2 samples")
    fails(corrupt(valid, tmp_path / "s.safetensors", shrinkage=g.shrinkage + 2), "outside")


def test_num_images_must_be_the_sum_of_the_counts(valid, tmp_path):
    fails(corrupt(valid, tmp_path / "n.safetensors", {"num_images": "1000"}), r"'num_images' \(1000\) is not the sum")
    fails(
        corrupt(valid, tmp_path / "c.safetensors", counts=torch.tensor([20, 5, 30])),
        "is not the sum of the tensor 'counts'",
    )


@pytest.mark.parametrize("field", ["class_names", "model", "preprocessing", "sampling", "shrinkage"])
def test_malformed_json_metadata(valid, tmp_path, field):
    message = fails(
        corrupt(valid, tmp_path / "j.safetensors", {field: "{not json"}), f"'{field}' is missing or not valid JSON"
    )
    assert "cafa stats" in message


@pytest.mark.parametrize("value", ["{}", "3", json.dumps({"method": "oas", "min": "low", "mean": 0.1, "max": 0.2})])
def test_shrinkage_metadata_without_its_fields(valid, tmp_path, value):
    fails(corrupt(valid, tmp_path / "s.safetensors", {"shrinkage": value}), "metadata 'shrinkage' must hold")


def test_a_device_is_not_an_artifact():
    fails(Path("/dev/null"), r"^/dev/null: not a regular file \(a device or a pipe\)")


@pytest.mark.parametrize("name", ["", "  ", "two\nlines"])
def test_class_names_that_would_break_the_records_are_refused(valid, tmp_path, name):
    fails(
        corrupt(valid, tmp_path / "c.safetensors", {"class_names": json.dumps(["cat", "dog", name])}),
        "empty name or one with a line break",
    )


def test_metadata_with_wrong_fields(valid, tmp_path):
    fails(
        corrupt(valid, tmp_path / "m.safetensors", {"model": json.dumps({"model": "x", "architecture": "x"})}),
        "metadata 'model' has unknown fields architecture;",
    )
    fails(
        corrupt(valid, tmp_path / "n.safetensors", {"model": json.dumps({"weights": None})}),
        "metadata 'model' has no model name",
    )
    fails(corrupt(valid, tmp_path / "l.safetensors", {"model": "[1, 2]"}), "must be JSON objects")
    bad_prep = json.dumps({"resize": None, "crop": None, "mean": [0], "std": [0], "channels": 1})
    fails(corrupt(valid, tmp_path / "p.safetensors", {"preprocessing": bad_prep}), "preprocessing")
    text_mean = json.dumps({"resize": None, "crop": None, "mean": "0.5", "std": [1], "channels": 1})
    fails(
        corrupt(valid, tmp_path / "t.safetensors", {"preprocessing": text_mean}),
        r"'mean' must be a list of numbers, not '0.5'",
    )


def test_non_integer_dimensions(valid, tmp_path):
    fails(corrupt(valid, tmp_path / "d.safetensors", {"feature_dim": "four"}), "not integers")
    fails(corrupt(valid, tmp_path / "z.safetensors", {"num_classes": "0"}), "0 classes")
