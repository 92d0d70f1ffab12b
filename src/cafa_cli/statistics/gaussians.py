"""Class-conditional Gaussians of the features: streaming moments, shrinkage, factors.

Numerics (docs/design/decisions.md): moments are accumulated and covariances formed and factored
in float64; only the final factors are stored in float32.

Covariance modes: `full` (a precision Cholesky factor per class), `tied`, `diag`, and
`lowrank` — the exact structured form of the same shrunk covariance when a class has
fewer samples than dimensions: Σ_c = a_c·I + Q_cᵀ diag(e_c) Q_c with Q_c the k×d
orthonormal basis of the class's centred rows (docs/reference/artifact-format.md).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from cafa_cli.core.errors import InputError, UsageError, listing
from cafa_cli.statistics import COVARIANCE_CHOICES
from cafa_cli.statistics.moments import SQUARABLE, ClassMoments


def oas_shrinkage(covariance: torch.Tensor, n: int) -> float:
    """Oracle Approximating Shrinkage toward tr(S)/d·I (Chen et al. 2010), the formula
    scikit-learn's `OAS` uses; needs only S and n, so it works on streamed moments."""
    return oas_from_spectrum(float(torch.trace(covariance)), float((covariance**2).sum()), covariance.shape[0], n)


def oas_from_spectrum(trace: float, frobenius_sq: float, d: int, n: int) -> float:
    """OAS from tr(S) and ‖S‖_F² alone: for S = XᵀX/n both come from the eigenvalues
    of the small n×n Gram matrix XXᵀ, so no d×d matrix is needed."""
    mu = trace / d
    alpha = frobenius_sq / d**2
    numerator = alpha + mu**2
    denominator = (n + 1) * (alpha - mu**2 / d)
    if denominator <= 0:
        return 1.0
    return float(min(numerator / denominator, 1.0))


def variance_shrinkage(variances: torch.Tensor, n: int) -> float:
    """λ for shrinking per-unit variances alone toward their mean tr(S)/d: the
    Ledoit–Wolf optimal intensity Σ_j Var(s_j) / Σ_j (s_j − mean)², as Opgen-Rhein and
    Strimmer (2007) shrink variances, with Var(s_j) = 2·s_j²/(N + 1) for Gaussian
    features (the assumption OAS makes too). OAS's λ is for the whole matrix and tends
    to 1 as d/N grows, driven by noise in covariances the diagonal ablation never uses."""
    spread = float(((variances - variances.mean()) ** 2).sum())
    noise = float((2 * variances**2 / (n + 1)).sum())
    if spread <= 0:
        return 1.0  # equal variances: the target is the estimate
    return min(noise / spread, 1.0)


def auto_shrinkage_method(covariance: str) -> str:
    """The name recorded for shrinkage "auto" with each covariance mode."""
    return "lw-variances" if covariance == "diag" else "oas"


def shrink(covariance: torch.Tensor, shrinkage: float) -> torch.Tensor:
    """scikit-learn's ShrunkCovariance: (1 − λ)·S + λ·(tr(S)/d)·I."""
    d = covariance.shape[0]
    target = torch.trace(covariance) / d
    shrunk = (1 - shrinkage) * covariance
    shrunk.diagonal().add_(shrinkage * target)
    return shrunk


def precision_cholesky(covariance: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Lower-triangular L with Σ⁻¹ = L Lᵀ, without forming Σ⁻¹.

    With J the order-reversing permutation, chol(JΣJ) = K gives
    Σ⁻¹ = (J K⁻ᵀ J)(J K⁻¹ J), and J K⁻ᵀ J is lower triangular.
    Returns (L, ok); ok is False when Σ is not positive definite.
    """
    flipped = covariance.flip(0, 1)
    k, info = torch.linalg.cholesky_ex(flipped)
    if int(info) != 0:
        return torch.full_like(covariance, float("nan")), False
    eye = torch.eye(covariance.shape[0], dtype=covariance.dtype)
    k_inv = torch.linalg.solve_triangular(k, eye, upper=False)
    factor = k_inv.T.flip(0, 1)
    return factor, bool(torch.isfinite(factor).all())


@dataclass
class ClassGaussians:
    """What the artifact stores: everything the distances and losses need."""

    means: torch.Tensor  # [C, d] float32
    # full [C, d, d], tied [1, d, d], diag [C, d]; lowrank: the basis Q_c, orthonormal
    # rows, zero rows as padding [C, k, d]; float32
    factors: torch.Tensor
    counts: torch.Tensor  # [C] int64
    shrinkage: torch.Tensor  # [C] (or [1] when tied) float64, the λ used
    covariance: str  # full | tied | diag | lowrank
    global_mean: torch.Tensor  # [d] float32, for Global FA
    global_covariance: torch.Tensor  # [d, d] float32, for Global FA
    shrinkage_method: str = "oas"
    isotropic: torch.Tensor | None = None  # lowrank: a_c = λ_c·tr(S_c)/d [C] float32
    spectrum: torch.Tensor | None = None  # lowrank: e_cj = (1 − λ_c)·eig_j(S_c) [C, k] float32, 0 as padding

    def select_classes(self, rows: list[int]) -> ClassGaussians:
        """The Gaussians of these classes only (a class subset), in this order. The tied
        covariance and the global moments stay those of every class: they describe the source
        features as a whole, which a subset of the classes does not change."""
        count = len(self.means)
        outside = [row for row in rows if not 0 <= int(row) < count]
        if outside:
            raise UsageError(f"select_classes takes class rows 0 to {count - 1}, not {listing(outside)}")
        index = torch.as_tensor(rows, dtype=torch.long)

        def per_class(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor.index_select(0, index)

        return replace(
            self,
            means=per_class(self.means),
            counts=per_class(self.counts),
            factors=self.factors if self.covariance == "tied" else per_class(self.factors),
            shrinkage=self.shrinkage if self.covariance == "tied" else per_class(self.shrinkage),
            isotropic=per_class(self.isotropic),
            spectrum=per_class(self.spectrum),
        )


def check_options(covariance: str, shrinkage: float | str) -> None:
    """Reject a bad `covariance` or `shrinkage` before any image is read."""
    if covariance not in COVARIANCE_CHOICES:
        raise UsageError(f"`covariance` must be one of {', '.join(COVARIANCE_CHOICES)}, not {covariance}")
    # text such as "0.1" is the caller's to parse; λ outside [0, 1] would weight S negatively
    number = isinstance(shrinkage, (int, float)) and not isinstance(shrinkage, bool)
    if shrinkage != "auto" and not (number and 0 <= shrinkage <= 1):
        raise UsageError(f"`shrinkage` must be 'auto' or a number in [0, 1], not {shrinkage!r}")
    if shrinkage != "auto" and shrinkage == 0 and covariance == "lowrank":
        raise UsageError(
            "`covariance` lowrank needs shrinkage: with `shrinkage` 0 the isotropic part a = λ·tr(S)/d is 0 "
            "and the covariance is singular; use `shrinkage` auto (or a value > 0), or `covariance` full"
        )


def choose_covariance(moments: ClassMoments, shrinkage: float | str) -> str:
    """What covariance "auto" means: `lowrank` when every class has fewer samples than
    dimensions (its shrunk covariance is then a_c·I plus a rank < d part) and that form
    is smaller than the dense one; otherwise `full`. Never lowrank without shrinkage."""
    C, d = moments.num_classes, moments.dim
    if shrinkage != "auto" and float(shrinkage) == 0:
        return "full"
    totals = [moments.total(c) for c in range(C)]
    if any(n >= d for n in totals):  # a class is only folded into a d×d scatter from d rows on
        return "full"
    k_max = max(max(totals) - 1, 1)  # centred rows have rank ≤ N_c − 1
    lowrank_numbers = k_max * d + k_max + 1  # basis, spectrum, a_c (per class)
    return "lowrank" if lowrank_numbers < d * d else "full"


def text_gaussians(class_embeddings: torch.Tensor) -> ClassGaussians:
    """Class Gaussians without a source image, for a CLIP model's unit-norm image features:
    class c's mean is its unit text embedding (the direction its zero-shot logit measures),
    and the covariance, shared, is I/d, that of features spread evenly over the unit sphere:
    nothing is known of their spread. Tied and isotropic, the Mahalanobis distance is then
    d·‖z − t_c‖² = 2d·(1 − cos(z, t_c)), so CAFA's ratio of distances is one of the very
    cosines the zero-shot head compares (the scale cancels). Stored as shrinkage λ = 1,
    the isotropic target alone, with no images counted."""
    means = torch.nn.functional.normalize(class_embeddings.double(), dim=-1)
    C, d = means.shape
    global_mean = means.mean(0)
    between = (means - global_mean).T @ (means - global_mean) / C
    return ClassGaussians(
        means=means.float(),
        factors=(d**0.5 * torch.eye(d)).unsqueeze(0),  # L with L Lᵀ = (I/d)⁻¹
        counts=torch.zeros(C, dtype=torch.int64),
        shrinkage=torch.ones(1, dtype=torch.float64),
        covariance="tied",
        global_mean=global_mean.float(),
        global_covariance=(between + torch.eye(d, dtype=torch.float64) / d).float(),
        shrinkage_method="text",
    )


def estimate(
    moments: ClassMoments,
    covariance: str = "auto",
    shrinkage: float | str = "auto",
    class_names: list[str] | None = None,
) -> ClassGaussians:
    """Shrunk class covariances from streamed moments, factored as precision Cholesky
    factors (or, for `lowrank`, as a_c, Q_c, e_c). `covariance="auto"` picks the mode
    with `choose_covariance`; the result records the mode used. It consumes the moments:
    each class's scatter is freed once its factor is made, so that only one d×d matrix
    is held at a time."""
    check_options(covariance, shrinkage)
    if moments.consumed:
        raise UsageError(
            "these moments were already estimated (estimate frees them as it goes); accumulate them again for another "
            "estimate"
        )
    names = class_names or [str(c) for c in range(moments.num_classes)]
    counts = _checked_counts(moments, names)  # before anything is freed: more data can still be added
    moments.consumed = True
    if covariance == "auto":
        covariance = choose_covariance(moments, shrinkage)
    if covariance == "lowrank":
        return _estimate_lowrank(moments, shrinkage, names, counts)
    return _estimate_dense(moments, covariance, shrinkage, names, counts)


def _estimate_dense(
    moments: ClassMoments, covariance: str, shrinkage: float | str, names: list[str], counts: torch.Tensor
) -> ClassGaussians:
    """The full, tied and diag forms: Cholesky factors of the shrunk precisions (diag: 1/σ)."""
    C, d = moments.num_classes, moments.dim
    pooled = torch.zeros(d, d, dtype=torch.float64)
    class_mean64 = torch.zeros(C, d, dtype=torch.float64)
    per_class_factors = torch.zeros((C, d, d) if covariance == "full" else (C, d), dtype=torch.float32)
    lambdas = torch.zeros(C if covariance != "tied" else 1, dtype=torch.float64)
    failed: list[str] = []

    for c in range(C):
        n, class_mean64[c], scatter = moments.moments(c)
        pooled += scatter
        if covariance != "tied":
            sample_cov = scatter / n
            lam = lambdas[c] = _shrinkage_of(sample_cov, n, covariance, shrinkage)
            factor, ok = _factor(shrink(sample_cov, lam), covariance)
            # with no shrinkage, N ≤ d samples give a rank-deficient S even when
            # rounding lets the Cholesky through
            if not ok or (lam == 0 and covariance == "full" and n <= d):
                failed.append(f"{names[c]} (N={n}, d={d})")
            per_class_factors[c] = factor.float()
        moments.release(c)

    total = int(counts.sum())
    if covariance == "tied":
        sample_cov = pooled / total
        lam = lambdas[0] = _shrinkage_of(sample_cov, total, covariance, shrinkage)
        factor, ok = _factor(shrink(sample_cov, lam), "full")
        if not ok or (lam == 0 and total - C < d):
            failed.append(f"pooled (N={total}, d={d})")
        per_class_factors = factor.float().unsqueeze(0)
    if failed:
        shown = listing(failed)
        raise InputError(
            f"covariance is singular for {shown}: some feature units never vary within a class "
            f"or there are fewer samples than dimensions; use `shrinkage` auto (or a value > 0)"
        )
    # the distances square the factors in float32: above ~1.8e19 (a variance below ~3e-39)
    # they are inf, every gradient vanishes and the run would end with no error
    if not float(per_class_factors.abs().amax()) <= SQUARABLE:
        raise InputError(
            "precision factors overflow float32 when squared (near-zero feature variance); raise `shrinkage`"
        )

    return _gaussians(covariance, class_mean64, counts, pooled, per_class_factors, lambdas, shrinkage)


def _shrinkage_of(sample_cov: torch.Tensor, n: int, covariance: str, shrinkage: float | str) -> float:
    """λ: the fixed value, or the automatic estimate for this covariance mode."""
    if shrinkage != "auto":
        return float(shrinkage)
    if covariance == "diag":
        return variance_shrinkage(sample_cov.diagonal(), n)
    return oas_shrinkage(sample_cov, n)


def _checked_counts(moments: ClassMoments, names: list[str]) -> torch.Tensor:
    counts = torch.tensor([moments.total(c) for c in range(moments.num_classes)], dtype=torch.int64)
    for c, n in enumerate(counts.tolist()):
        if n < 2:
            raise InputError(f"class {names[c]} has {n} feature vector(s); at least 2 are needed for a covariance")
    return counts


def _gaussians(
    covariance: str,
    class_mean64: torch.Tensor,
    counts: torch.Tensor,
    pooled: torch.Tensor,
    factors: torch.Tensor,
    lambdas: torch.Tensor,
    shrinkage: float | str,
    **lowrank: torch.Tensor,
) -> ClassGaussians:
    """The estimate, with the mean and total covariance of all features (for Global FA)
    from the class means and the pooled within-class scatter."""
    total = int(counts.sum())
    global_mean = (counts.double() / total) @ class_mean64
    between = (class_mean64 - global_mean).T @ ((class_mean64 - global_mean) * counts.double()[:, None])
    return ClassGaussians(
        means=class_mean64.float(),
        factors=factors,
        counts=counts,
        shrinkage=lambdas,
        covariance=covariance,
        global_mean=global_mean.float(),
        global_covariance=((pooled + between) / total).float(),
        shrinkage_method=auto_shrinkage_method(covariance) if shrinkage == "auto" else "fixed",
        **lowrank,
    )


_POOL_ROWS = 1024  # centred rows gathered before one rank-k update of the pooled scatter


@contextmanager
def _one_thread():
    """Small LAPACK calls (the SVD of a 2048×64 matrix) run about 3x slower with a team
    of threads than on one, and tens of times slower when the cores are shared; the
    GEMMs around them keep every thread."""
    before = torch.get_num_threads()
    if before > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if before > 1:
            torch.set_num_threads(before)


def _estimate_lowrank(
    moments: ClassMoments, shrinkage: float | str, names: list[str], counts: torch.Tensor
) -> ClassGaussians:
    """Σ_c = (1 − λ_c)·S_c + a_c·I = a_c·I + Q_cᵀ diag(e_c) Q_c, a_c = λ_c·tr(S_c)/d.

    A class never folded (N_c < d) goes through the thin SVD of its N_c×d centred rows:
    S_c = Vᵀ diag(s²/N_c) V, so Q_c = V, e_c = (1 − λ_c)·s²/N_c, and OAS needs only
    tr(S_c) = Σ s²/N_c and ‖S_c‖_F² = Σ s⁴/N_c² — no d×d matrix for that class. A class
    that was folded (N_c ≥ d, only when lowrank is forced) uses the eigenvectors of its
    scatter. All in float64; a_c, Q_c (rows, zero-padded to k) and e_c stored as float32.
    """
    C, d = moments.num_classes, moments.dim
    k = min(int(counts.max()) - 1, d)  # centred rows have rank ≤ N_c − 1
    class_mean64 = torch.zeros(C, d, dtype=torch.float64)
    basis = torch.zeros(C, k, d, dtype=torch.float32)
    spectrum = torch.zeros(C, k, dtype=torch.float32)
    isotropic = torch.zeros(C, dtype=torch.float64)
    lambdas = torch.zeros(C, dtype=torch.float64)
    pooled = torch.zeros(d, d, dtype=torch.float64)
    blocks: list[torch.Tensor] = []
    eps = torch.finfo(torch.float64).eps
    rank_used, failed, constant = 0, [], True

    def pool(flush: bool = False) -> None:
        if blocks and (flush or sum(len(b) for b in blocks) >= _POOL_ROWS):
            stacked = torch.cat(blocks)
            pooled.addmm_(stacked.T, stacked)  # in place: no d×d temporary per class
            blocks.clear()

    for c in range(C):
        n = int(counts[c])
        rows = moments.rows(c)
        if rows is not None:
            mean = rows.mean(0)
            centred = rows - mean
            # SVD of the tall d×N transpose: same factors, ~10x faster in LAPACK than N×d
            with _one_thread():
                u, s, _ = torch.linalg.svd(centred.T, full_matrices=False)
            keep = s > s[0] * max(centred.shape) * eps
            eigenvalues, vectors = s[keep].square() / n, u[:, keep].T
            blocks.append(centred)
            pool()
        else:
            n, mean, scatter = moments.moments(c)
            pooled += scatter
            w, v = torch.linalg.eigh(scatter / n)  # d×d: worth the threads
            w, v = w.flip(0), v.flip(1)
            keep = w > w[0] * d * eps
            eigenvalues, vectors = w[keep], v[:, keep].T
            del scatter, v
        eigenvalues, vectors = eigenvalues[:k], _signs_fixed(vectors[:k])
        trace = float(eigenvalues.sum())
        lam = (
            oas_from_spectrum(trace, float(eigenvalues.square().sum()), d, n)
            if shrinkage == "auto"
            else float(shrinkage)
        )
        a = lam * trace / d
        if not (a > 0 and torch.isfinite(torch.tensor(1 / a, dtype=torch.float32))):
            failed.append(f"{names[c]} (N={n}, d={d})")
            constant = constant and trace == 0
        r = len(eigenvalues)
        rank_used = max(rank_used, r)
        class_mean64[c] = mean
        lambdas[c], isotropic[c] = lam, a
        basis[c, :r] = vectors.float()
        spectrum[c, :r] = ((1 - lam) * eigenvalues).float()
        moments.release(c)
    pool(flush=True)
    if failed:
        shown = listing(failed)
        why = (
            "its features do not vary (tr(S) = 0), so the isotropic part of the low-rank form is 0"
            if constant
            else "the isotropic part of the low-rank form, λ·tr(S)/d, is too small to invert in float32"
        )
        raise InputError(
            f"covariance is singular for {shown}: {why}; use `shrinkage` auto (or a larger value), or check the "
            "features"
        )
    if rank_used < k:  # duplicate rows everywhere: drop padding no class uses
        basis, spectrum = basis[:, :rank_used].clone(), spectrum[:, :rank_used].clone()
    return _gaussians(
        "lowrank",
        class_mean64,
        counts,
        pooled,
        basis,
        lambdas,
        shrinkage,
        isotropic=isotropic.float(),
        spectrum=spectrum,
    )


def _signs_fixed(vectors: torch.Tensor) -> torch.Tensor:
    """Eigenvectors (rows) with their largest component positive. An eigenvector's sign is
    arbitrary, and LAPACK's choice follows rounding: rows from another BLAS, or merged from
    torchrun's ranks, came out flipped, so equal statistics made unequal artifact files."""
    largest = vectors.abs().argmax(1, keepdim=True)
    return vectors * torch.sign(vectors.gather(1, largest))


def _factor(covariance: torch.Tensor, mode: str) -> tuple[torch.Tensor, bool]:
    if mode == "diag":
        variances = covariance.diagonal()
        ok = bool((variances > 0).all())
        return variances.clamp_min(torch.finfo(torch.float64).tiny).rsqrt(), ok
    return precision_cholesky(covariance)
