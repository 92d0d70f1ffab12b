"""The production method (float32, structured covariances, chunks) against methods/reference.py,
the paper's definitions written densely in float64."""

from __future__ import annotations

import pytest
import torch

from cafa_cli.methods import REGISTRY, create, reference
from cafa_cli.methods.shared import losses
from cafa_cli.statistics.distances import ClassDistances
from cafa_cli.statistics.gaussians import estimate
from cafa_cli.statistics.moments import ClassMoments

NAMES = tuple(REGISTRY)

C, D = 4, 6
SHRINKAGE = 0.1


def source_features(per_class: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Classes with their own means and correlated, unequal spreads, as float32 features are."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(C).repeat_interleave(per_class)
    mixing = torch.randn(C, D, D, generator=g, dtype=torch.float64) * 0.5 + torch.eye(D, dtype=torch.float64)
    z = torch.einsum("nd,nde->ne", torch.randn(len(labels), D, generator=g, dtype=torch.float64), mixing[labels])
    return (z + 3 * torch.randn(C, D, generator=g, dtype=torch.float64)[labels]).float(), labels


def shifted_features(n: int = 24, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Shifted test features and logits that disagree with the nearest class now and then."""
    x, _ = source_features(n // C, seed)
    g = torch.Generator().manual_seed(seed)
    return x * 1.3 + 0.5, torch.randn(len(x), C, generator=g)


def gaussians_and_reference(covariance: str, per_class: int):
    """The production estimate and the reference's means and covariances of the same features."""
    x, y = source_features(per_class)
    moments = ClassMoments(C, D)
    moments.update(x, y)
    gaussians = estimate(moments, covariance, SHRINKAGE)
    assert gaussians.covariance == covariance
    # the low-rank form is the same shrunk covariance, stored as a_c·I + Q_cᵀ diag(e_c) Q_c
    means, sigmas = reference.class_gaussians(x, y, C, SHRINKAGE, "full" if covariance == "lowrank" else covariance)
    return gaussians, means, sigmas, x


# (covariance, images per class): lowrank below d (thin SVD of the rows) and above it (eigh of the scatter)
FORMS = [("full", 30), ("tied", 30), ("diag", 30), ("lowrank", 5), ("lowrank", 30)]


@pytest.mark.parametrize("covariance, per_class", FORMS)
def test_the_estimate_and_its_distances_match_the_reference(covariance, per_class):
    gaussians, means, sigmas, _ = gaussians_and_reference(covariance, per_class)
    torch.testing.assert_close(gaussians.means.double(), means, rtol=1e-5, atol=1e-5)
    z, _ = shifted_features()
    expected = reference.mahalanobis(z, means, sigmas)
    got = ClassDistances(gaussians)(z)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-5 * float(expected.max()))
    torch.testing.assert_close(
        ClassDistances(gaussians, metric="euclidean")(z).double(), reference.euclidean(z, means), rtol=1e-5, atol=1e-4
    )


@pytest.mark.parametrize("covariance, per_class", FORMS)
def test_the_cafa_and_intra_losses_and_the_cafa_gradient_match_the_reference(covariance, per_class):
    gaussians, means, sigmas, _ = gaussians_and_reference(covariance, per_class)
    z, logits = shifted_features()
    z32 = z.clone().requires_grad_(True)
    loss = losses.cafa(ClassDistances(gaussians)(z32), logits.argmax(1))
    loss.backward()
    z64 = z.double().requires_grad_(True)
    expected = reference.cafa_loss(reference.mahalanobis(z64, means, sigmas), logits)
    expected.backward()
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(expected.item(), rel=1e-5, abs=1e-6)
    assert z64.grad.abs().max() > 0
    torch.testing.assert_close(z32.grad.double(), z64.grad, rtol=1e-3, atol=1e-4 * float(z64.grad.abs().max()))
    intra = losses.intra(ClassDistances(gaussians)(z), logits.argmax(1))
    assert float(intra) == pytest.approx(
        float(reference.intra_loss(reference.mahalanobis(z, means, sigmas), logits)), rel=1e-4
    )


def test_the_stored_factor_is_a_precision_factor_as_the_reference_defines_it():
    gaussians, means, sigmas, _ = gaussians_and_reference("full", 30)
    z, _ = shifted_features()
    factors = reference.precision_factor(sigmas)
    eye = torch.eye(D, dtype=torch.float64).expand(C, D, D)
    torch.testing.assert_close(factors @ factors.mT @ sigmas, eye, rtol=0, atol=1e-10)  # Σ⁻¹ = L Lᵀ
    expected = reference.mahalanobis(z, means, sigmas)
    torch.testing.assert_close(reference.mahalanobis_from_factors(z, means, factors), expected)
    # the artifact's factor is another one (lower triangular), with the same distances
    assert torch.equal(gaussians.factors, gaussians.factors.tril())
    torch.testing.assert_close(
        reference.mahalanobis_from_factors(z, gaussians.means, gaussians.factors), expected, rtol=1e-5, atol=1e-5
    )


def test_global_alignment_and_its_source_moments_match_the_reference():
    gaussians, _, _, x = gaussians_and_reference("full", 30)
    source_mean, source_sigma = reference.moments(x)
    torch.testing.assert_close(gaussians.global_mean.double(), source_mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gaussians.global_covariance.double(), source_sigma, rtol=1e-5, atol=1e-5)
    z, _ = shifted_features()
    z32, z64 = z.clone().requires_grad_(True), z.double().requires_grad_(True)
    loss = losses.global_alignment(z32, gaussians.global_mean, gaussians.global_covariance)
    expected = reference.global_alignment(z64, source_mean, source_sigma)
    loss.backward()
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    torch.testing.assert_close(z32.grad.double(), z64.grad, rtol=1e-4, atol=1e-5 * float(z64.grad.abs().max()))


@pytest.mark.parametrize("name", ["entropy", "pseudo_label"])
def test_the_baselines_losses_and_gradients_match_the_reference(name):
    logits = torch.randn(32, 10, generator=torch.Generator().manual_seed(2)) * 3
    got, expected = logits.clone().requires_grad_(True), logits.double().requires_grad_(True)
    loss, reference_loss = getattr(losses, name)(got), getattr(reference, name)(expected)
    loss.backward()
    reference_loss.backward()
    assert loss.item() == pytest.approx(reference_loss.item(), rel=1e-5)
    torch.testing.assert_close(got.grad.double(), expected.grad, rtol=1e-4, atol=1e-7)


REFERENCE_LOSSES = {
    "pl": lambda logits, z, means, sigmas, source: reference.pseudo_label(logits),
    "tent": lambda logits, z, means, sigmas, source: reference.entropy(logits),
    "cafa": lambda logits, z, means, sigmas, source: reference.cafa_loss(
        reference.mahalanobis(z, means, sigmas), logits
    ),
    "intra": lambda logits, z, means, sigmas, source: reference.intra_loss(
        reference.mahalanobis(z, means, sigmas), logits
    ),
    "euclidean": lambda logits, z, means, sigmas, source: reference.cafa_loss(reference.euclidean(z, means), logits),
    "global-fa": lambda logits, z, means, sigmas, source: reference.global_alignment(z, *source),
}


# the baselines whose updates are more than a loss (filters, SAM, prototypes, output adjustment,
# teachers and memory banks): tests/test_tta_methods.py and tests/test_tta_teacher_student.py
# check each against its own float64 computation; cafa-robust, tests/test_cafa_robust.py against
# methods/reference_robust.py
TESTED_ELSEWHERE = (
    *("eta", "eata", "cafa-eata", "sar", "t3a", "lame", "cotta", "rotta", "cafa-robust", "rdumb"),
    # issue 41's, each in tests/test_fidelity_NAME.py
    *("cmf", "roid", "deyo", "rmt", "adacontrast", "santa", "rpl", "memo", "ttaug"),
    *("shot-im", "shot"),  # issue 63's, in tests/test_fidelity_shot.py
    # issue 63's, in tests/test_fidelity_neo_come.py
    "neo",
    *("sotta", "stamp"),  # issue 63's outlier-aware methods, in tests/test_fidelity_openworld.py
    "owttt",  # and in tests/test_fidelity_owttt.py
    # issue 66's CLIP methods, in tests/test_fidelity_clip.py
    *("tpt", "zero", "tda", "dmn-zs", "boostadapter"),
    *("foa", "dpcore"),  # issue 63's ViT prompt methods, in tests/test_fidelity_foa.py and test_fidelity_dpcore.py
    "spa",  # issue 63's, in tests/test_fidelity_spa.py
)


def test_every_registered_method_has_a_reference():
    assert set(NAMES) == {"source", "bn", *REFERENCE_LOSSES, *TESTED_ELSEWHERE}


@pytest.mark.parametrize("name", [name for name in NAMES if name not in TESTED_ELSEWHERE])
def test_each_registered_method_minimises_the_reference_loss_of_its_name(name):
    gaussians, means, sigmas, x = gaussians_and_reference("full", 30)
    method = create(name, gaussians)
    assert method.name == name
    if not method.trains:
        assert name in ("source", "bn") and method.adapts_normalisation == (name == "bn")
        return
    z, logits = shifted_features()
    expected = REFERENCE_LOSSES[name](logits, z, means, sigmas, reference.moments(x))
    assert float(method.loss(logits, z)) == pytest.approx(float(expected), rel=1e-4)
