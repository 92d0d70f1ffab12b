"""distances.py: squared Mahalanobis distances from stored factors, against float64."""

from __future__ import annotations

import pytest
import torch

import cafa_cli.statistics.distances as distances
from cafa_cli.methods import reference
from cafa_cli.statistics.distances import ClassDistances
from cafa_cli.statistics.gaussians import ClassGaussians, estimate
from cafa_cli.statistics.moments import ClassMoments

C, D, N = 7, 6, 8


def make_gaussians(covariance: str, seed: int = 0) -> ClassGaussians:
    """Random means and random valid factors (lower-triangular, positive diagonal)."""
    g = torch.Generator().manual_seed(seed)
    means = torch.randn(C, D, generator=g, dtype=torch.float64)
    if covariance == "diag":
        factors = torch.rand(C, D, generator=g, dtype=torch.float64) + 0.5
    else:
        k = 1 if covariance == "tied" else C
        factors = torch.randn(k, D, D, generator=g, dtype=torch.float64).tril(-1) * 0.3
        factors += torch.diag_embed(torch.rand(k, D, generator=g, dtype=torch.float64) + 0.5)
    return ClassGaussians(
        means=means.float(),
        factors=factors.float(),
        counts=torch.full((C,), 10),
        shrinkage=torch.zeros(1 if covariance == "tied" else C, dtype=torch.float64),
        covariance=covariance,
        global_mean=torch.zeros(D),
        global_covariance=torch.eye(D),
    )


def expected_distances(z: torch.Tensor, gaussians: ClassGaussians, metric: str = "mahalanobis") -> torch.Tensor:
    """D[n, c] = ‖L_cᵀ(z_n − μ_c)‖² in float64, by reference.py's definition, from the stored factors."""
    if metric == "euclidean":
        return reference.euclidean(z, gaussians.means)
    factors = gaussians.factors.double()
    if gaussians.covariance == "diag":
        factors = torch.diag_embed(factors)  # the stored 1/σ_c as a diagonal factor
    return reference.mahalanobis_from_factors(z, gaussians.means, factors.expand(C, D, D))


def probes(seed: int = 1, n: int = N, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(n, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


CASES = [("full", "mahalanobis"), ("tied", "mahalanobis"), ("diag", "mahalanobis"), ("full", "euclidean")]


@pytest.mark.parametrize("covariance, metric", CASES)
def test_distances_match_float64_reference(covariance, metric):
    g = make_gaussians(covariance)
    dist = ClassDistances(g, metric=metric)
    assert dist.num_classes == C
    z = probes()
    got = dist(z)
    assert got.shape == (N, C) and got.dtype == torch.float32
    expected = expected_distances(z, g, metric)
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-5 * float(expected.max()))
    assert (got >= 0).all()


@pytest.mark.parametrize("covariance, metric", CASES)
def test_distance_to_own_mean_is_zero(covariance, metric):
    g = make_gaussians(covariance)
    got = ClassDistances(g, metric=metric)(g.means)
    expected = expected_distances(g.means, g, metric)
    assert got.diagonal().abs().max() < 1e-4
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4)


def test_euclidean_ignores_the_factors():
    a, b = make_gaussians("full", seed=0), make_gaussians("full", seed=5)
    b.means = a.means.clone()
    z = probes()
    torch.testing.assert_close(ClassDistances(a, metric="euclidean")(z), ClassDistances(b, metric="euclidean")(z))
    assert not torch.allclose(ClassDistances(a)(z), ClassDistances(b)(z))
    # nor does it copy them to the device (16.8 GB for a dense ImageNet artifact): a factor
    # tensor with no data, which any copy would fail on, is never touched
    a.factors = torch.empty(a.factors.shape, device="meta")
    torch.testing.assert_close(ClassDistances(a, metric="euclidean")(z), ClassDistances(b, metric="euclidean")(z))


def test_float64_input_is_accepted():
    g = make_gaussians("full")
    z = probes(dtype=torch.float64)
    torch.testing.assert_close(ClassDistances(g)(z).double(), expected_distances(z, g), rtol=1e-4, atol=1e-5)


def counting_chunks(monkeypatch) -> list[int]:
    """Patch _full_chunk so that each call records how many classes it covered."""
    calls: list[int] = []
    original = distances._full_chunk

    def spy(z, means, factors):
        calls.append(len(means))
        return original(z, means, factors)

    monkeypatch.setattr(distances, "_full_chunk", spy)
    return calls


def test_chunked_full_path_matches_reference(monkeypatch):
    g = make_gaussians("full")
    z = probes()
    whole = ClassDistances(g)(z)
    calls = counting_chunks(monkeypatch)
    monkeypatch.setattr(distances, "CHUNK_BYTES", 2 * 4 * N * D)  # two classes per chunk
    chunked = ClassDistances(g)(z)
    assert calls == [2, 2, 2, 1]
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(chunked.double(), expected_distances(z, g), rtol=1e-4, atol=1e-5)


def test_chunk_budget_below_one_class_still_works(monkeypatch):
    g = make_gaussians("full")
    calls = counting_chunks(monkeypatch)
    monkeypatch.setattr(distances, "CHUNK_BYTES", 1)
    z = probes()
    torch.testing.assert_close(ClassDistances(g)(z).double(), expected_distances(z, g), rtol=1e-4, atol=1e-5)
    assert calls == [1] * C


def test_the_tied_form_refines_fewer_classes_a_batch_for_their_d_by_d_work(monkeypatch):
    """The refinement's fixed work: N·d elements a class, N·d² for the tied form's exact
    distance, against one chunk, and never fewer classes than the batch has samples."""
    z = probes(n=2)
    monkeypatch.setattr(distances, "CHUNK_BYTES", 3 * 4 * 2 * D * D)  # 3 tied classes, or 18 of the others
    calls = counting_chunks(monkeypatch)  # the tied form's exact distances go through _full_chunk
    ClassDistances(make_gaussians("tied"))(z)
    assert sum(calls) == 3 and distances.refine_capacity(C, 2, 2 * D * D) == 3
    assert distances.refine_capacity(C, 2, 2 * D) == C and distances.refine_capacity(C, 5, 5 * D * D) == 5


# --- gradients -------------------------------------------------------------------


def grad_check(g: ClassGaussians, metric: str = "mahalanobis"):
    weights = torch.rand(N, C, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    z = probes().double().requires_grad_(True)
    (ClassDistances(g, metric=metric)(z).double() * weights).sum().backward()
    got = z.grad.clone()
    z_ref = z.detach().clone().requires_grad_(True)
    (expected_distances(z_ref, g, metric) * weights).sum().backward()
    expected = z_ref.grad
    assert got.abs().max() > 0
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


@pytest.mark.parametrize("covariance, metric", CASES)
def test_gradient_matches_float64_reference(covariance, metric):
    grad_check(make_gaussians(covariance), metric)


def test_gradient_through_chunked_checkpointed_path(monkeypatch):
    calls = counting_chunks(monkeypatch)
    monkeypatch.setattr(distances, "CHUNK_BYTES", 3 * 4 * N * D)  # three classes per chunk
    monkeypatch.setattr(distances, "KEEP_BYTES", 6 * 4 * N * D)  # all seven classes do not fit
    grad_check(make_gaussians("full"))
    # forward 3 chunks; the non-reentrant checkpoint recomputes each one in backward
    assert calls[:3] == [3, 3, 1] and len(calls) == 6


def test_gradient_through_kept_chunks_reads_each_chunk_once(monkeypatch):
    calls = counting_chunks(monkeypatch)
    monkeypatch.setattr(distances, "CHUNK_BYTES", 3 * 4 * N * D)
    monkeypatch.setattr(distances, "KEEP_BYTES", C * 4 * N * D)  # exactly fits: keep, no recompute
    grad_check(make_gaussians("full"))
    assert calls == [3, 3, 1]


def test_gradient_closed_form_for_full():
    """∂/∂z Σ_c D_c(z) = 2 Σ_c L_c L_cᵀ (z − μ_c)."""
    g = make_gaussians("full")
    z = probes(n=1).requires_grad_(True)
    ClassDistances(g)(z).sum().backward()
    L, mu = g.factors.double(), g.means.double()
    expected = 2 * torch.einsum("cde,cfe,cf->d", L, L, z.detach().double()[0] - mu)
    torch.testing.assert_close(z.grad[0].double(), expected, rtol=1e-4, atol=1e-5)


# --- from estimated statistics ---------------------------------------------------


@pytest.mark.parametrize("covariance", ["full", "tied", "diag"])
def test_distances_from_estimate_match_the_reference(covariance):
    gen = torch.Generator().manual_seed(4)
    counts = [50, 40, 60]
    x = torch.cat(
        [torch.randn(n, D, generator=gen, dtype=torch.float64) * (c + 1) + 3 * c for c, n in enumerate(counts)]
    )
    y = torch.cat([torch.full((n,), c) for c, n in enumerate(counts)])
    moments = ClassMoments(3, D)
    moments.update(x.float(), y)
    lam = 0.2
    g = estimate(moments, covariance, lam)
    means, covs = reference.class_gaussians(x.float(), y, 3, lam, covariance)
    z = x.float().double()[::7]
    got = ClassDistances(g)(z).double()
    torch.testing.assert_close(got, reference.mahalanobis(z, means, covs), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("covariance, metric", [*CASES, ("lowrank", "mahalanobis")])
def test_distances_near_a_class_mean_keep_their_relative_accuracy(covariance, metric):
    """Expanded forms (‖a‖² − 2a·b + ‖b‖²) cancel near a mean; such classes are recomputed
    from explicit differences, so a point 0.001σ from a mean far from the origin is still
    within 1e-4 of the float64 distance (it was 0.24 off for diag, 8e-3 for tied)."""
    g = torch.Generator().manual_seed(3)
    d, n = 64, 32
    features = torch.randn(400, d, generator=g, dtype=torch.float64) * (
        torch.rand(d, generator=g, dtype=torch.float64) + 0.2
    )
    labels = torch.arange(400) % 4
    features += 5 * torch.randn(4, d, generator=g, dtype=torch.float64)[labels]  # class means off the global mean
    moments = ClassMoments(4, d)
    moments.update(features.float(), labels)
    gaussians = estimate(moments, "lowrank" if covariance == "lowrank" else covariance, "auto")
    z = (
        (gaussians.means[1].double() + 1e-3 * torch.randn(n, d, generator=g, dtype=torch.float64))
        .float()
        .requires_grad_()
    )
    got = ClassDistances(gaussians, metric=metric)(z)[:, 1]
    got.sum().backward()
    z64 = z.detach().double().requires_grad_()
    diff = z64 - gaussians.means[1].double()
    factors = gaussians.factors.double()
    if metric == "euclidean":
        expected = diff.square().sum(1)
    elif covariance == "lowrank":
        a, q, e = gaussians.isotropic[1].double(), factors[1], gaussians.spectrum[1].double()
        sigma = a * torch.eye(d, dtype=torch.float64) + q.T @ torch.diag(e) @ q
        expected = reference.mahalanobis(z64, gaussians.means[1:2], sigma[None])[:, 0]
    elif covariance == "diag":
        expected = (diff * factors[1]).square().sum(1)
    else:
        expected = (diff @ factors[0 if covariance == "tied" else 1]).square().sum(1)
    assert ((got.detach().double() - expected.detach()).abs() / expected.detach()).max() < 1e-4
    expected.sum().backward()  # the gradient flows through the recomputed classes too
    torch.testing.assert_close(z.grad.double(), z64.grad, rtol=1e-3, atol=1e-3 * float(z64.grad.abs().max()))


def test_a_misspelt_metric_and_features_of_another_width_are_usage_errors():
    from cafa_cli.core.errors import UsageError

    torch.manual_seed(0)
    moments = ClassMoments(2, 4)
    moments.update(torch.randn(20, 4), torch.arange(20) % 2)
    gaussians = estimate(moments, "full", 0.1)
    with pytest.raises(UsageError, match="metric must be one of mahalanobis, euclidean, not 'euclidian'"):
        ClassDistances(gaussians, metric="euclidian")  # used to fall back to Mahalanobis silently
    with pytest.raises(UsageError, match=r"distances take features \[N, 4\], not \[3, 7\]"):
        ClassDistances(gaussians)(torch.randn(3, 7))
