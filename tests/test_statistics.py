"""statistics.py against float64 NumPy / scikit-learn references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.covariance import OAS, ShrunkCovariance

from cafa_cli.core.errors import InputError, UsageError
from cafa_cli.statistics.gaussians import estimate, oas_shrinkage, precision_cholesky, shrink
from cafa_cli.statistics.moments import ClassMoments

D = 5


def random_features(seed: int, counts: list[int], dim: int = D, offset: float = 20.0):
    """float32 features with a class-dependent mean and correlated covariance, shuffled."""
    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for c, n in enumerate(counts):
        mixing = rng.normal(size=(dim, dim)) + 2 * np.eye(dim)
        xs.append(rng.normal(size=(n, dim)) @ mixing + offset * rng.normal(size=dim))
        ys.append(np.full(n, c))
    x, y = np.concatenate(xs).astype(np.float32), np.concatenate(ys)
    order = rng.permutation(len(y))
    return x[order], y[order]


def feed(moments: ClassMoments, x: np.ndarray, y: np.ndarray, sizes=(1, 7, 2, 13, 3, 5, 11)) -> None:
    """Uneven batches, cycling through `sizes`."""
    start, i = 0, 0
    while start < len(y):
        stop = start + sizes[i % len(sizes)]
        moments.update(torch.from_numpy(x[start:stop]), torch.from_numpy(y[start:stop]))
        start, i = stop, i + 1


def moments_of(x, y, num_classes, dim=D) -> ClassMoments:
    moments = ClassMoments(num_classes, dim)
    feed(moments, x, y)
    return moments


def reference_cov(rows: np.ndarray) -> np.ndarray:
    return np.cov(rows.astype(np.float64), rowvar=False, bias=True)


def reference_shrunk(rows: np.ndarray, lam: float) -> np.ndarray:
    s = reference_cov(rows)
    return (1 - lam) * s + lam * np.trace(s) / s.shape[0] * np.eye(s.shape[0])


def mahalanobis_from_artifact(z: np.ndarray, mean32: torch.Tensor, factor32: torch.Tensor) -> np.ndarray:
    """‖Lᵀ(z − μ)‖² evaluated in float64 from the stored float32 tensors."""
    diff = z - mean32.double().numpy()
    return ((diff @ factor32.double().numpy()) ** 2).sum(-1)


def mahalanobis_reference(z: np.ndarray, mean: np.ndarray, cov: np.ndarray) -> np.ndarray:
    diff = z - mean
    return np.einsum("nd,de,ne->n", diff, np.linalg.inv(cov), diff)


# --- streaming moments -----------------------------------------------------------


def test_moments_match_numpy_with_fold_and_pending_paths():
    # class 0: many more rows than dims (several Chan folds), class 1: fewer rows than
    # dims (never folded until asked), class 2: a few folds plus a pending remainder
    counts = [47, 3, 13]
    x, y = random_features(0, counts)
    moments = moments_of(x, y, 3)
    assert 0 in moments.scatter and 2 in moments.scatter, "the Chan fold path did not run"
    assert 1 not in moments.scatter and moments.pending_rows[1] == 3
    for c, n in enumerate(counts):
        count, mean, scatter = moments.moments(c)
        rows = x[y == c].astype(np.float64)
        assert count == n
        assert mean.dtype == torch.float64 and scatter.dtype == torch.float64
        np.testing.assert_allclose(mean.numpy(), rows.mean(0), rtol=1e-10, atol=0)
        np.testing.assert_allclose(
            (scatter / n).numpy(), reference_cov(rows), rtol=1e-10, atol=1e-10 * np.abs(reference_cov(rows)).max()
        )


def test_moments_do_not_depend_on_batching():
    x, y = random_features(1, [30, 9])
    one = ClassMoments(2, D)
    one.update(torch.from_numpy(x), torch.from_numpy(y))
    many = moments_of(x, y, 2)
    for c in range(2):
        n1, m1, s1 = one.moments(c)
        n2, m2, s2 = many.moments(c)
        assert n1 == n2
        torch.testing.assert_close(m1, m2, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(s1, s2, rtol=1e-10, atol=1e-9)


@pytest.mark.parametrize(
    "features,labels,match",
    [
        (torch.zeros(4, 5), torch.zeros(4, dtype=torch.int64), r"features \[n, 3\] and labels \[n\], not \[4, 5\]"),
        (torch.zeros(4, 3), torch.zeros(3, dtype=torch.int64), r"not \[4, 3\] and \[3\]"),
        (torch.zeros(4, 3), torch.tensor([0, 1, 2, 1]), r"in \[0, 2\), not 0\.\.2"),
        (torch.zeros(2, 3), torch.tensor([-1, 0]), r"not -1\.\.0"),
    ],
)
def test_moments_refuse_features_or_labels_that_do_not_fit(features, labels, match):
    with pytest.raises(UsageError, match=match):
        ClassMoments(2, 3).update(features, labels)


def test_moments_are_estimated_once_and_a_second_estimate_says_so():
    moments = ClassMoments(2, 3)
    moments.update(torch.randn(20, 3), torch.arange(20) % 2)
    assert estimate(moments).covariance == "full"  # auto: 10 samples per class > 3 dimensions
    with pytest.raises(UsageError, match="already estimated"):
        estimate(moments, "diag")


def test_moments_of_an_unseen_class_are_empty_and_release_frees_scatter():
    x, y = random_features(2, [20])
    moments = ClassMoments(2, D)
    feed(moments, x, y)
    n, mean, scatter = moments.moments(1)
    assert n == 0 and not mean.any() and not scatter.any()
    moments.moments(0)
    assert 0 in moments.scatter
    moments.release(0)
    assert 0 not in moments.scatter


# --- shrinkage -------------------------------------------------------------------


@pytest.mark.parametrize("n, d", [(200, 5), (12, 5), (4, 10), (3, 30)])
def test_oas_matches_scikit_learn(n, d):
    rng = np.random.default_rng(n * 100 + d)
    x = rng.normal(size=(n, d)) @ (rng.normal(size=(d, d)) + np.eye(d))
    sample = torch.from_numpy(reference_cov(x))
    reference = OAS().fit(x)
    lam = oas_shrinkage(sample, n)
    assert 0 <= lam <= 1
    assert lam == pytest.approx(reference.shrinkage_, rel=1e-10, abs=1e-12)
    np.testing.assert_allclose(shrink(sample, lam).numpy(), reference.covariance_, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("lam", [0.0, 0.1, 0.5, 1.0])
def test_shrink_matches_scikit_learn(lam):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(40, 6)) * np.arange(1, 7)
    sample = torch.from_numpy(reference_cov(x))
    expected = ShrunkCovariance(shrinkage=lam).fit(x).covariance_
    before = sample.clone()
    np.testing.assert_allclose(shrink(sample, lam).numpy(), expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(sample, before), "shrink must not modify its input"


# --- precision factor ------------------------------------------------------------


@pytest.mark.parametrize("d", [1, 2, 7, 32])
def test_precision_cholesky_is_lower_triangular_and_inverts(d):
    rng = np.random.default_rng(d)
    a = rng.normal(size=(d, d))
    cov = a @ a.T + d * np.eye(d)
    factor, ok = precision_cholesky(torch.from_numpy(cov))
    assert ok
    f = factor.numpy()
    assert np.all(np.triu(f, 1) == 0)
    assert np.all(np.diag(f) > 0)
    inverse = np.linalg.inv(cov)
    np.testing.assert_allclose(f @ f.T, inverse, rtol=1e-8, atol=1e-8 * np.abs(inverse).max())


def test_precision_cholesky_reports_non_positive_definite():
    cov = torch.tensor([[1.0, 2.0], [2.0, 1.0]], dtype=torch.float64)  # eigenvalues 3, -1
    factor, ok = precision_cholesky(cov)
    assert not ok
    assert torch.isnan(factor).all()
    _, ok = precision_cholesky(torch.zeros(3, 3, dtype=torch.float64))
    assert not ok


# --- estimate --------------------------------------------------------------------


COUNTS = [60, 45, 80]


def well_conditioned():
    return random_features(4, COUNTS, offset=5.0)


def probe_points(x):
    rng = np.random.default_rng(9)
    return np.concatenate([x[:20].astype(np.float64), x.mean(0) + 3 * rng.normal(size=(20, x.shape[1]))])


@pytest.mark.parametrize("shrinkage", [0.0, 0.2, "auto"])
def test_estimate_full_distances_match_direct_inverse(shrinkage):
    x, y = well_conditioned()
    g = estimate(moments_of(x, y, 3), "full", shrinkage, ["a", "b", "c"])
    assert g.covariance == "full"
    assert g.means.dtype == torch.float32 and g.factors.dtype == torch.float32
    assert g.factors.shape == (3, D, D) and g.means.shape == (3, D)
    assert g.counts.tolist() == COUNTS
    assert g.shrinkage_method == ("oas" if shrinkage == "auto" else "fixed")
    z = probe_points(x)
    for c in range(3):
        rows = x[y == c].astype(np.float64)
        lam = OAS().fit(rows).shrinkage_ if shrinkage == "auto" else float(shrinkage)
        assert float(g.shrinkage[c]) == pytest.approx(lam, rel=1e-9, abs=1e-12)
        np.testing.assert_allclose(g.means[c].numpy(), rows.mean(0), rtol=1e-6)
        factor = g.factors[c].numpy()
        assert np.all(np.triu(factor, 1) == 0) and np.all(np.diag(factor) > 0)
        got = mahalanobis_from_artifact(z, g.means[c], g.factors[c])
        expected = mahalanobis_reference(z, rows.mean(0), reference_shrunk(rows, lam))
        np.testing.assert_allclose(got, expected, rtol=1e-5)


@pytest.mark.parametrize("shrinkage", [0.0, 0.3, "auto"])
def test_estimate_tied_distances_match_pooled_reference(shrinkage):
    x, y = well_conditioned()
    g = estimate(moments_of(x, y, 3), "tied", shrinkage)
    assert g.factors.shape == (1, D, D) and g.shrinkage.shape == (1,)
    centred = np.concatenate([x[y == c].astype(np.float64) - x[y == c].astype(np.float64).mean(0) for c in range(3)])
    lam = OAS(assume_centered=True).fit(centred).shrinkage_ if shrinkage == "auto" else float(shrinkage)
    assert float(g.shrinkage[0]) == pytest.approx(lam, rel=1e-9, abs=1e-12)
    pooled = centred.T @ centred / len(centred)
    cov = (1 - lam) * pooled + lam * np.trace(pooled) / D * np.eye(D)
    z = probe_points(x)
    for c in range(3):
        got = mahalanobis_from_artifact(z, g.means[c], g.factors[0])
        expected = mahalanobis_reference(z, x[y == c].astype(np.float64).mean(0), cov)
        np.testing.assert_allclose(got, expected, rtol=1e-5)


@pytest.mark.parametrize("shrinkage", [0.0, 0.25, "auto"])
def test_estimate_diag_distances_match_reference(shrinkage):
    x, y = well_conditioned()
    g = estimate(moments_of(x, y, 3), "diag", shrinkage)
    assert g.factors.shape == (3, D)
    z = probe_points(x)
    assert g.shrinkage_method == ("lw-variances" if shrinkage == "auto" else "fixed")
    for c in range(3):
        rows = x[y == c].astype(np.float64)
        lam = reference_variance_shrinkage(rows) if shrinkage == "auto" else float(shrinkage)
        assert float(g.shrinkage[c]) == pytest.approx(lam, rel=1e-9, abs=1e-12)
        variances = np.diag(reference_shrunk(rows, lam))
        got = (((z - g.means[c].double().numpy()) * g.factors[c].double().numpy()) ** 2).sum(-1)
        expected = (((z - rows.mean(0)) ** 2) / variances).sum(-1)
        np.testing.assert_allclose(got, expected, rtol=1e-5)


def reference_variance_shrinkage(rows: np.ndarray) -> float:
    """Ledoit–Wolf intensity for the variances alone, Var(s_j) = 2·s_j²/(N + 1) (Gaussian)."""
    s = rows.var(axis=0)
    return min(float(np.sum(2 * s**2 / (len(rows) + 1)) / np.sum((s - s.mean()) ** 2)), 1.0)


def test_diag_recovers_the_variances_with_fewer_samples_than_dimensions():
    """CAFA-Diag models per-unit variances; they are well estimated from 64 samples even
    at d = 512, where the full matrix's OAS λ is near 1 and would flatten them all."""
    rng = np.random.default_rng(0)
    d, n = 512, 64
    true_variances = np.geomspace(0.01, 10, d)
    x = (rng.normal(size=(2 * n, d)) * np.sqrt(true_variances)).astype(np.float32)
    y = np.repeat([0, 1], n)
    g = estimate(moments_of(x, y, 2, d), "diag", "auto")
    whole_matrix = oas_shrinkage(torch.from_numpy(np.cov(x[:n].astype(np.float64), rowvar=False, bias=True)), n)
    assert whole_matrix > 0.5 and float(g.shrinkage.max()) < 0.1
    ratio = 1 / g.factors.double().numpy() ** 2 / true_variances
    assert np.median(np.abs(np.log(ratio))) < 0.3
    # shrinking toward the mean lifts the smallest variances most: 7x here, 100x with OAS's λ
    assert ratio.min() > 0.4 and ratio.max() < 10
    same = (rng.normal(size=(2 * n, d))).astype(np.float32)  # equal variances: only noise spreads them
    assert float(estimate(moments_of(same, y, 2, d), "diag", "auto").shrinkage.min()) > 0.9


@pytest.mark.parametrize("covariance", ["full", "tied", "diag"])
def test_global_mean_and_covariance_match_pooled_data(covariance):
    x, y = well_conditioned()
    g = estimate(moments_of(x, y, 3), covariance, 0.1)
    all_rows = x.astype(np.float64)
    np.testing.assert_allclose(g.global_mean.numpy(), all_rows.mean(0), rtol=1e-6, atol=1e-6)
    expected = reference_cov(all_rows)
    np.testing.assert_allclose(g.global_covariance.numpy(), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    assert g.global_mean.dtype == torch.float32 and g.global_covariance.dtype == torch.float32


def test_auto_shrinkage_handles_fewer_samples_than_dimensions():
    x, y = random_features(5, [4, 3, 30], dim=8)
    g = estimate(moments_of(x, y, 3, dim=8), "full", "auto")
    assert torch.isfinite(g.factors).all()
    assert (g.shrinkage[:2] > 0).all()
    rows = x[y == 1].astype(np.float64)
    lam = float(g.shrinkage[1])
    got = mahalanobis_from_artifact(rows, g.means[1], g.factors[1])
    expected = mahalanobis_reference(rows, rows.mean(0), reference_shrunk(rows, lam))
    np.testing.assert_allclose(got, expected, rtol=1e-4)


@pytest.mark.parametrize("covariance", ["full", "diag"])
def test_zero_shrinkage_with_constant_feature_names_the_class(covariance):
    x, y = random_features(6, [40, 40])
    x[y == 1, 2] = 3.0  # a unit that never varies within class "dog"
    with pytest.raises(InputError, match=r"singular for dog \(N=40") as info:
        estimate(moments_of(x, y, 2), covariance, 0.0, ["cat", "dog"])
    assert "cat" not in str(info.value)
    assert "`shrinkage`" in str(info.value)


def test_zero_shrinkage_with_too_few_samples_names_the_class():
    x, y = random_features(7, [40, D])  # N_c = d: rank d - 1
    with pytest.raises(InputError, match=rf"dog \(N={D}, d={D}\)"):
        estimate(moments_of(x, y, 2), "full", 0.0, ["cat", "dog"])
    # a little shrinkage makes the same data usable
    g = estimate(moments_of(x, y, 2), "full", 0.05, ["cat", "dog"])
    assert torch.isfinite(g.factors).all()


def test_zero_shrinkage_tied_with_constant_feature_everywhere_fails():
    x, y = random_features(8, [30, 30])
    x[:, 0] = 1.0
    with pytest.raises(InputError, match="pooled"):
        estimate(moments_of(x, y, 2), "tied", 0.0)


def test_class_with_fewer_than_two_samples_is_named():
    x, y = random_features(9, [20, 1])
    with pytest.raises(InputError, match=r"class rare has 1 feature vector"):
        estimate(moments_of(x, y, 2), "full", "auto", ["common", "rare"])
    x, y = random_features(9, [20, 5])
    with pytest.raises(InputError, match=r"class missing has 0"):
        estimate(moments_of(x, y, 3), "full", "auto", ["common", "other", "missing"])


@pytest.mark.parametrize("covariance", ["spherical", "", "FULL"])
def test_invalid_covariance_is_a_usage_error(covariance):
    x, y = random_features(10, [20, 20])
    with pytest.raises(UsageError, match="`covariance` must be one of"):
        estimate(moments_of(x, y, 2), covariance, "auto")


@pytest.mark.parametrize("shrinkage", [-0.1, 1.5, float("nan"), "lots"])
def test_invalid_shrinkage_is_a_usage_error(shrinkage):
    x, y = random_features(11, [20, 20])
    with pytest.raises(UsageError, match="`shrinkage` must be"):
        estimate(moments_of(x, y, 2), "full", shrinkage)


@pytest.mark.parametrize("covariance", ["full", "diag"])
def test_a_variance_too_small_to_square_its_factor_is_refused(covariance):
    """A unit varying by 1e-21 within a class gives a factor of 1e21, finite in float32,
    whose square is not: every distance would be inf and adaptation would stop silently."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, D))
    x[:, 0] *= 1e-21
    y = np.repeat([0, 1], 20)
    with pytest.raises(InputError, match="overflow float32 when squared.*raise `shrinkage`"):
        estimate(moments_of(x.astype(np.float32), y, 2), covariance, 0.0)
    estimate(moments_of(x.astype(np.float32), y, 2), covariance, "auto")  # shrinkage lifts it


@pytest.mark.parametrize("labels", [torch.tensor([0.0, 1.0, 1.0]), torch.tensor([True, False, True])])
def test_labels_that_are_not_integers_are_refused(labels):
    with pytest.raises(UsageError, match=f"labels must be integer class indices, not {labels.dtype}"):
        ClassMoments(2, 4).update(torch.randn(3, 4), labels)


def test_an_estimate_refused_for_too_few_vectors_leaves_the_moments_usable():
    torch.manual_seed(0)
    moments = ClassMoments(2, 3)
    moments.update(torch.randn(3, 3), torch.tensor([0, 0, 1]))
    with pytest.raises(InputError, match="class 1 has 1 feature vector"):
        estimate(moments)
    moments.update(torch.randn(4, 3), torch.tensor([1, 1, 0, 1]))  # more data, as the message invites
    assert estimate(moments).counts.tolist() == [3, 4]
    with pytest.raises(UsageError, match="already estimated, which freed them"):
        moments.update(torch.randn(2, 3), torch.tensor([0, 1]))  # would vanish from any later estimate
