"""The low-rank covariance form: the same distances as the dense shrunk covariance,
`--covariance auto`, artifact format version 2 (and reading version 1), validation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import PLAIN, TINY_NET, invoke, write_folder
from safetensors import safe_open
from safetensors.torch import save_file

import cafa_cli.artifact.format as artifact_format
import cafa_cli.statistics.distances as distances
from cafa_cli.artifact.store import read_artifact, write_artifact
from cafa_cli.core.errors import InputError, UsageError
from cafa_cli.data.preprocessing import Preprocessing
from cafa_cli.jobs.inspect import condition_numbers
from cafa_cli.model.loading import ModelSpec
from cafa_cli.statistics.distances import ClassDistances
from cafa_cli.statistics.gaussians import check_options, choose_covariance, estimate
from cafa_cli.statistics.moments import ClassMoments

C, D = 5, 40
COUNTS = [12, 9, 12, 15, 5]  # every class has fewer samples than dimensions
NAMES = [f"class{c}" for c in range(C)]
SPEC = ModelSpec("resnet18", "/models/net.pt", "ab" * 32, C, "fc")
PREP = Preprocessing(resize=None, crop=32, mean=(0.5,), std=(0.25,), channels=1)
SAMPLING = {"data": "/data/train", "fraction": 0.5, "per_class": None, "seed": 7}
FINGERPRINT = "cd" * 32


def features(counts=COUNTS, dim=D, seed=0):
    """Correlated, unevenly scaled float32 features with class offsets, shuffled."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.linspace(0.1, 3.0, dim, dtype=torch.float64)
    xs, ys = [], []
    for c, n in enumerate(counts):
        mixing = torch.eye(dim, dtype=torch.float64) + 0.3 * torch.randn(dim, dim, generator=g, dtype=torch.float64)
        xs.append(
            (torch.randn(n, dim, generator=g, dtype=torch.float64) * scales) @ mixing
            + 4 * torch.randn(dim, generator=g, dtype=torch.float64)
        )
        ys.append(torch.full((n,), c))
    x, y = torch.cat(xs).float(), torch.cat(ys)
    order = torch.randperm(len(y), generator=g)
    return x[order], y[order]


def moments_of(x, y, num_classes=C, dim=D) -> ClassMoments:
    moments = ClassMoments(num_classes, dim)
    for start in range(0, len(y), 7):  # uneven, mixed-class batches
        moments.update(x[start : start + 7], y[start : start + 7])
    return moments


def probes(x, n=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    spread = x.std(0)
    return torch.cat([x[:n], x.mean(0) + 2 * spread * torch.randn(n, x.shape[1], generator=g)])


def dense_reference(z, x, y, lambdas):
    """D[n, c] in float64 from the direct inverse of (1 − λ)S + λ tr(S)/d I."""
    z, out = z.double(), []
    for c in range(len(lambdas)):
        rows = x[y == c].double()
        centred = rows - rows.mean(0)
        s = centred.T @ centred / len(rows)
        lam = float(lambdas[c])
        cov = (1 - lam) * s + lam * torch.trace(s) / s.shape[0] * torch.eye(s.shape[0], dtype=torch.float64)
        diff = z - rows.mean(0)
        out.append(torch.einsum("nd,de,ne->n", diff, torch.linalg.inv(cov), diff))
    return torch.stack(out, 1)


# --- the same distances as the dense form ------------------------------------------


def test_the_basis_signs_are_fixed_so_equal_statistics_make_equal_files():
    """An eigenvector's sign is LAPACK's to choose, and rounding (another BLAS, the moments
    merged from torchrun's ranks) flipped about half of them: the same distances, another file."""
    x, y = features()
    basis = estimate(moments_of(x, y), "lowrank", "auto").factors
    used = basis.abs().amax(2) > 0
    largest = basis.gather(2, basis.abs().argmax(2, keepdim=True)).squeeze(2)
    assert bool((largest[used] > 0).all())
    flipped = estimate(moments_of(-x, y), "lowrank", "auto").factors  # every direction reversed
    torch.testing.assert_close(flipped, basis, rtol=0, atol=1e-5)


@pytest.mark.parametrize("shrinkage", ["auto", 0.3, 0.01, 1e-4])
def test_lowrank_distances_equal_the_dense_full_form(shrinkage):
    x, y = features()
    low = estimate(moments_of(x, y), "lowrank", shrinkage, NAMES)
    full = estimate(moments_of(x, y), "full", shrinkage, NAMES)
    assert low.covariance == "lowrank" and full.covariance == "full"
    assert low.factors.shape == (C, max(COUNTS) - 1, D) and low.factors.dtype == torch.float32
    assert low.spectrum.shape == (C, max(COUNTS) - 1) and low.isotropic.shape == (C,)
    torch.testing.assert_close(low.shrinkage, full.shrinkage, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(low.means, full.means)
    torch.testing.assert_close(low.global_covariance, full.global_covariance, rtol=1e-5, atol=1e-5)
    z = probes(x)
    got, dense = ClassDistances(low)(z).double(), ClassDistances(full)(z).double()
    torch.testing.assert_close(got, dense, rtol=1e-4, atol=0)
    torch.testing.assert_close(got, dense_reference(z, x, y, low.shrinkage), rtol=1e-4, atol=0)


@pytest.mark.parametrize("shrinkage", ["auto", 0.001])  # 0.001: training points go through the exact refinement
def test_lowrank_gradients_equal_the_dense_form(shrinkage):
    x, y = features()
    low = ClassDistances(estimate(moments_of(x, y), "lowrank", shrinkage))
    full = ClassDistances(estimate(moments_of(x, y), "full", shrinkage))
    z = probes(x)
    weights = torch.rand(len(z), C, generator=torch.Generator().manual_seed(3))
    grads = []
    for dist in (low, full):
        zz = z.clone().requires_grad_(True)
        (dist(zz) * weights).sum().backward()
        grads.append(zz.grad)
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-4 * float(grads[1].abs().max()))


def test_chunked_checkpointed_lowrank_path_matches(monkeypatch):
    x, y = features()
    g = estimate(moments_of(x, y), "lowrank", "auto")
    z = probes(x)
    whole = ClassDistances(g)(z)
    k = g.factors.shape[1]
    monkeypatch.setattr(distances, "CHUNK_BYTES", 2 * 4 * len(z) * k)  # two classes per chunk
    monkeypatch.setattr(distances, "KEEP_BYTES", 0)  # recompute in backward rather than keep
    calls = []
    original = distances._lowrank_chunk
    monkeypatch.setattr(distances, "_lowrank_chunk", lambda *a: calls.append(len(a[1])) or original(*a))
    zz = z.clone().requires_grad_(True)
    chunked = ClassDistances(g)(zz)
    assert calls == [2, 2, 1]
    torch.testing.assert_close(chunked.detach(), whole, rtol=1e-6, atol=1e-5)
    chunked.sum().backward()
    assert len(calls) == 6  # each chunk recomputed in backward
    z2 = z.clone().requires_grad_(True)
    monkeypatch.setattr(distances, "CHUNK_BYTES", 64 << 20)
    ClassDistances(g)(z2).sum().backward()
    torch.testing.assert_close(zz.grad, z2.grad, rtol=1e-5, atol=1e-4)


def test_exact_refinement_only_where_rounding_could_matter(monkeypatch):
    """The refinement's work is fixed (here every class: C is under the batch size), so no
    host synchronisation sizes it; its exact values replace the expanded ones only where
    the rounding bound exceeds the tolerance."""
    x, y = features()
    g = estimate(moments_of(x, y), "lowrank", 0.001)
    refined = []
    original = distances._lowrank_exact_chunk
    monkeypatch.setattr(distances, "_lowrank_exact_chunk", lambda *a: refined.append(len(a[1])) or original(*a))
    dist = ClassDistances(g)
    away = probes(x)[16:]  # points away from every class's training span
    near = x[y == 3][:4]  # training points of class 3: inside its span, a_3 ≪ e_3
    monkeypatch.setattr(distances, "REFINE_TOLERANCE", float("inf"))  # no class at risk: the expanded form alone
    expanded_away, expanded_near = dist(away), dist(near)
    monkeypatch.setattr(distances, "REFINE_TOLERANCE", 1e-5)
    assert torch.equal(dist(away), expanded_away)
    got = dist(near)
    exact = dist._lowrank_exact(near - dist.centre, torch.arange(C))
    others = torch.arange(C) != 3
    assert torch.equal(got[:, 3], exact[:, 3]) and not torch.equal(got[:, 3], expanded_near[:, 3])
    assert torch.equal(got[:, others], expanded_near[:, others])
    assert refined == [C] * 5 and int(dist.unrefined) == 0


def test_more_classes_at_risk_than_the_refinement_holds_are_counted(monkeypatch):
    """Past refine_capacity classes at risk, the most at risk are refined, the others keep
    the expanded form, and the batch is counted in `unrefined` (on the device)."""
    x, y = features()
    g = estimate(moments_of(x, y), "lowrank", 0.001)
    z = x[:2]
    monkeypatch.setattr(distances, "CHUNK_BYTES", 4 * len(z) * D)  # one class a chunk: capacity max(N, 1) = 2 of C = 5
    monkeypatch.setattr(distances, "REFINE_TOLERANCE", 1e-30)  # every class at risk
    assert distances.refine_capacity(C, len(z), len(z) * D) == 2
    dist = ClassDistances(g)
    got = dist(z)
    assert int(dist.unrefined) == 1
    zc = z - dist.centre
    exact = dist._lowrank_exact(zc, torch.arange(C))
    monkeypatch.setattr(distances, "REFINE_TOLERANCE", float("inf"))
    expanded = dist._lowrank(zc)
    bound = 4 * distances._EPS32 * (zc.square().sum(1, keepdim=True) + dist.mean_norms) * dist.inv_isotropic
    most = set((bound / expanded).amax(0).argsort(descending=True)[:2].tolist())
    for c in range(C):
        assert torch.equal(got[:, c], exact[:, c] if c in most else expanded[:, c])


def test_lowrank_never_forms_a_class_scatter(monkeypatch):
    x, y = features()
    moments = moments_of(x, y)

    def no_dense(*args):
        raise AssertionError("a d×d scatter was formed")

    monkeypatch.setattr(ClassMoments, "moments", no_dense)
    monkeypatch.setattr(ClassMoments, "_fold", no_dense)
    g = estimate(moments, "auto", "auto")
    assert g.covariance == "lowrank"


def test_forced_lowrank_with_a_folded_class_is_still_exact():
    counts = [50, 9, 12, 45, 5]  # classes 0 and 3 have more samples than dimensions
    x, y = features(counts)
    moments = moments_of(x, y)
    assert choose_covariance(moments, "auto") == "full"
    low = estimate(moments, "lowrank", "auto")
    assert low.factors.shape == (C, 40, D)  # k = min(max N_c − 1, d)
    z = probes(x)
    torch.testing.assert_close(
        ClassDistances(low)(z).double(), dense_reference(z, x, y, low.shrinkage), rtol=1e-4, atol=0
    )


@pytest.mark.parametrize("fill", [False, True], ids=["below d", "some classes fill d"])
def test_conditioning_of_lowrank_is_exact(tmp_path, fill):
    x, y = features()
    if fill:  # a forced lowrank where classes have N_c > d: no direction is left at a_c
        g = torch.Generator().manual_seed(5)
        y = torch.tensor([0] * (D + 20) + [1] * 9 + [2] * (D + 5) + [3] * 15 + [4] * 5)
        x = (torch.randn(len(y), D, generator=g) + 3 * torch.randn(C, D, generator=g)[y]).float()
    path = tmp_path / "s.safetensors"
    write_artifact(path, estimate(moments_of(x, y), "lowrank", 0.2), NAMES, SPEC, PREP, SAMPLING, FINGERPRINT)
    conds = condition_numbers(read_artifact(path))
    expected = []
    for c in range(C):
        rows = x[y == c].double()
        s = torch.cov(rows.T, correction=0)
        expected.append(
            torch.linalg.cond(0.8 * s + 0.2 * torch.trace(s) / D * torch.eye(D, dtype=torch.float64)).item()
        )
    np.testing.assert_allclose(conds, expected, rtol=1e-4)


# --- auto ----------------------------------------------------------------------------


def test_auto_picks_lowrank_below_d_and_full_otherwise():
    x, y = features()
    assert choose_covariance(moments_of(x, y), "auto") == "lowrank"
    assert estimate(moments_of(x, y), "auto", "auto").covariance == "lowrank"
    assert choose_covariance(moments_of(x, y), 0.0) == "full"  # no shrinkage: lowrank impossible
    x, y = features([12, 9, D, 15, 5])  # one class with N_c = d
    assert choose_covariance(moments_of(x, y), "auto") == "full"
    assert estimate(moments_of(x, y), "auto", "auto").covariance == "full"


def test_lowrank_without_shrinkage_is_a_usage_error():
    x, y = features()
    with pytest.raises(UsageError, match="lowrank needs shrinkage"):
        estimate(moments_of(x, y), "lowrank", 0.0)
    with pytest.raises(UsageError, match="lowrank needs shrinkage"):
        check_options("lowrank", 0)
    check_options("auto", 0.0)  # auto falls back to full


def test_lowrank_constant_class_is_named():
    x, y = features()
    x[y == 2] = 1.5  # no variance at all: a_c = 0
    with pytest.raises(InputError, match=r"singular for class2 \(N=12.*do not vary"):
        estimate(moments_of(x, y), "lowrank", "auto", NAMES)


def test_lowrank_with_a_shrinkage_too_small_for_float32_says_so():
    x, y = features()
    with pytest.raises(
        InputError, match=r"too small to invert in float32; use `shrinkage` auto \(or a larger value\)"
    ) as info:
        estimate(moments_of(x, y), "lowrank", 1e-320, NAMES)
    assert "do not vary" not in str(info.value)


# --- artifact format version 2 -------------------------------------------------------


def write_lowrank(path: Path, shrinkage="auto"):
    x, y = features()
    g = estimate(moments_of(x, y), "lowrank", shrinkage, NAMES)
    write_artifact(path, g, NAMES, SPEC, PREP, SAMPLING, FINGERPRINT)
    return g


def test_v2_round_trip(tmp_path):
    path = tmp_path / "s.safetensors"
    g = write_lowrank(path)
    a = read_artifact(path)
    assert a.metadata["format_version"] == "2" and a.covariance == "lowrank"
    assert a.metadata["rank"] == str(max(COUNTS) - 1)
    r = a.gaussians
    for name in (
        "means",
        "factors",
        "counts",
        "shrinkage",
        "global_mean",
        "global_covariance",
        "isotropic",
        "spectrum",
    ):
        assert getattr(r, name).dtype == getattr(g, name).dtype, name
        assert torch.equal(getattr(r, name), getattr(g, name)), name
    with safe_open(str(path), framework="pt") as f:
        assert "precision_cholesky" not in f.keys()
    assert read_artifact(path, load_tensors=False).gaussians is None


def test_version_1_was_never_released_and_is_refused(tmp_path):
    path = tmp_path / "s.safetensors"
    write_lowrank(path)
    with pytest.raises(InputError, match="artifact format version '1' is not supported .* reads version 2"):
        read_artifact(rewrite(path, tmp_path / "b.safetensors", {"format_version": "1"}))


def rewrite(source: Path, target: Path, metadata: dict | None = None, edit=None, drop=()) -> Path:
    with safe_open(str(source), framework="pt") as f:
        meta = {**f.metadata(), **(metadata or {})}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if edit:
        edit(tensors)
    for key in drop:
        tensors.pop(key)
    meta = {k: v for k, v in meta.items() if v is not None}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(target), metadata=meta)
    return target


def _set(name, index, value):
    def edit(tensors):
        tensors[name][index] = value

    return edit


BAD = [
    ("nan-basis", {}, _set("lowrank_basis", (3, 2, 7), float("nan")), "'lowrank_basis' holds NaN"),
    ("nan-isotropic", {}, _set("lowrank_isotropic", 1, float("nan")), "'lowrank_isotropic' holds NaN"),
    ("inf-spectrum", {}, _set("lowrank_spectrum", (0, 0), float("inf")), "'lowrank_spectrum' holds NaN"),
    ("zero-isotropic", {}, _set("lowrank_isotropic", 2, 0.0), "'lowrank_isotropic' has values ≤ 0"),
    ("negative-isotropic", {}, _set("lowrank_isotropic", 4, -1.0), "'lowrank_isotropic' has values ≤ 0"),
    ("negative-spectrum", {}, _set("lowrank_spectrum", (1, 0), -0.5), "'lowrank_spectrum' has negative"),
    ("not-orthonormal", {}, _set("lowrank_basis", (4, 0, 0), 0.9), "not orthonormal"),
    (
        "rank-disagrees",
        {"rank": "13"},
        None,
        r"'lowrank_basis' has shape \(5, 14, 40\), metadata implies \(5, 13, 40\)",
    ),
    ("rank-missing", {"rank": None}, None, "metadata 'rank'"),
    ("rank-too-big", {"rank": "41"}, None, "metadata 'rank' is 41"),
    (
        "spectrum-shape",
        {},
        lambda t: t.__setitem__("lowrank_spectrum", t["lowrank_spectrum"][:, :3].clone()),
        r"'lowrank_spectrum' has shape \(5, 3\)",
    ),
    (
        "basis-dtype",
        {},
        lambda t: t.__setitem__("lowrank_basis", t["lowrank_basis"].double()),
        "'lowrank_basis' has dtype F64",
    ),
    ("missing", {}, lambda t: t.pop("lowrank_isotropic"), "tensors missing: lowrank_isotropic"),
]


@pytest.mark.parametrize("case, metadata, edit, pattern", BAD, ids=[b[0] for b in BAD])
def test_lowrank_validation_errors(tmp_path, case, metadata, edit, pattern):
    path = tmp_path / "s.safetensors"
    write_lowrank(path)
    bad = rewrite(path, tmp_path / "bad.safetensors", metadata, edit)
    for load in (True, False):
        with pytest.raises(InputError, match=pattern) as info:
            read_artifact(bad, load_tensors=load)
        assert "\n" not in str(info.value)


def test_lowrank_basis_is_validated_in_slices(tmp_path, monkeypatch):
    path = tmp_path / "s.safetensors"
    g = write_lowrank(path)
    monkeypatch.setattr(artifact_format, "_SLICE_BYTES", 4 * g.factors[0].numel())  # one class per slice
    assert torch.equal(read_artifact(path).gaussians.factors, g.factors)
    bad = rewrite(path, tmp_path / "bad.safetensors", edit=_set("lowrank_basis", (C - 1, 0, 0), float("inf")))
    with pytest.raises(InputError, match="'lowrank_basis' holds NaN"):
        read_artifact(bad)


# --- through the CLI -----------------------------------------------------------------


def test_cli_auto_writes_lowrank_and_adapt_runs_with_it(tmp_path, tiny_weights):
    train = write_folder(tmp_path / "train", per_class=4)  # 4 images per class < d = 6
    test = write_folder(tmp_path / "test", per_class=6, seed=3, shift=0.3)
    out = tmp_path / "s.safetensors"
    result = invoke(
        "stats",
        "--model",
        TINY_NET,
        "--weights",
        tiny_weights,
        "--data",
        train,
        *PLAIN,
        "--fraction",
        "1",
        "--out",
        out,
    )
    assert result.exit_code == 0, result.stderr
    assert "covariance lowrank" in result.stderr
    artifact = read_artifact(out)
    assert artifact.metadata["covariance"] == "lowrank" and artifact.metadata["format_version"] == "2"
    assert artifact.gaussians.factors.shape == (3, 3, 6)
    result = invoke(
        "adapt",
        "--stats",
        out,
        "--model",
        TINY_NET,
        "--data",
        test,
        "--batch-size",
        "6",
        "--quiet",
        "--metrics-json",
        tmp_path / "m.json",
    )
    assert result.exit_code == 0, result.stderr
    assert len(result.stdout.strip().splitlines()) == 1 + 18
    assert json.loads((tmp_path / "m.json").read_text())["settings"]["covariance"] == "lowrank"
    result = invoke("inspect", out, "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["conditioning"]["classes_measured"] == 3
    assert json.loads(result.stdout)["rank"] == 3
    result = invoke("inspect", out)
    assert result.exit_code == 0 and "lowrank, 3 basis rows per class" in result.stdout
    forced = tmp_path / "full.safetensors"
    result = invoke(
        "stats",
        "--model",
        TINY_NET,
        "--weights",
        tiny_weights,
        "--data",
        train,
        *PLAIN,
        "--fraction",
        "1",
        "--covariance",
        "full",
        "--out",
        forced,
    )
    assert result.exit_code == 0, result.stderr
    assert read_artifact(forced).covariance == "full"


def test_cli_lowrank_with_zero_shrinkage_is_a_usage_error(tmp_path, tiny_weights):
    train = write_folder(tmp_path / "train", per_class=4)
    out = tmp_path / "s.safetensors"
    result = invoke(
        "stats",
        "--model",
        TINY_NET,
        "--weights",
        tiny_weights,
        "--data",
        train,
        *PLAIN,
        "--covariance",
        "lowrank",
        "--shrinkage",
        "0",
        "--out",
        out,
    )
    assert result.exit_code == 2
    assert "lowrank needs shrinkage" in result.stderr
    assert not out.exists()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc")
def test_read_artifact_does_not_keep_the_file_mapped(tmp_path):
    """Tensors that shared safetensors' mmap would keep every validated page of a
    multi-gigabyte file resident for as long as the artifact lives."""
    path = tmp_path / "mapped.safetensors"
    write_lowrank(path)
    artifact = read_artifact(path)
    assert artifact.gaussians is not None
    assert str(path) not in Path("/proc/self/maps").read_text()
