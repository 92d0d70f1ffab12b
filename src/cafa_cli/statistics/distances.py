"""Squared Mahalanobis distances D_c(z) = ‖L_cᵀ(z − μ_c)‖² from the stored factors.

Never forms a precision or an inverse. The per-class (full) form works through the
classes in chunks whose intermediate [N, chunk, d] tensor stays under a byte
budget. The backward pass needs every chunk's intermediate: they are kept while all
of them together fit KEEP_BYTES (1 GiB; 0.5 GB at C = 1000, d = 2048, N = 64), so the
factors are read twice per step (forward, backward); past that budget each chunk is
recomputed in the backward pass instead (a third read), so memory stays at one chunk.

The low-rank form (Σ_c = a_c·I + Q_cᵀ diag(e_c) Q_c, Q_c orthonormal k×d rows) gives
the same distances through the Woodbury identity, with t = Q_c(z − μ_c):

    D_c(z) = (‖z − μ_c‖² − ‖t‖²) / a_c + Σ_j t_j² / (a_c + e_cj)

Both terms are non-negative. All Q_c(z) come from one GEMM against the [C·k, d] view of
the stored basis, so the backward pass needs no [N, C, d] tensor either.

The tied, diagonal, Euclidean and low-rank forms expand ‖a − b‖² as ‖a‖² − 2a·b + ‖b‖²
(a GEMM instead of an [N, C, d] difference). In float32 that sum's rounding error is about
4·eps times the squared norms that cancel (measured constant ≤ 2.4, not 4), which is
negligible next to D_c unless z sits close to μ_c, or (low-rank) almost inside the span of
class c's training rows with a_c small next to e_c. The classes where that bound exceeds
REFINE_TOLERANCE·D_c are recomputed from explicit differences, in chunks, so every
distance is within about 1e-5 of the direct form — as the full form always is.

That refinement takes no host synchronisation, so that a GPU never waits for the host to
learn how many classes need it: every batch recomputes the same number of classes,
`refine_capacity` — all C when C ≤ max(N, one chunk's classes), else that many, the most
at risk first, where a class counts the multiply-adds of its exact distance: N·d, N·d·k
for the low-rank form (two products with its basis), N·d² for the tied form (one with
L) — and the exact values are used only where the bound says so. A
batch with more classes at risk than that (each sample would have to sit close to
several class means) leaves the least at risk in the expanded form; `unrefined` counts
such batches, on the device.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from cafa_cli.core.errors import UsageError
from cafa_cli.statistics.gaussians import ClassGaussians

CHUNK_BYTES = 64 << 20  # one chunk's intermediate


KEEP_BYTES = 1 << 30  # all chunks' intermediates kept for backward; above it, recompute


METRICS = ("mahalanobis", "euclidean")


REFINE_TOLERANCE = 1e-5  # expanded forms: relative rounding bound above which a class is recomputed exactly


_EPS32 = torch.finfo(torch.float32).eps


class ClassDistances:
    """Callable: features [N, d] -> squared distances [N, C] to every class Gaussian.

    `metric="euclidean"` ignores the covariances (the paper's Euclidean ablation).
    """

    def __init__(self, gaussians: ClassGaussians, device: torch.device | str = "cpu", metric: str = "mahalanobis"):
        if metric not in METRICS:
            raise UsageError(f"metric must be one of {', '.join(METRICS)}, not {metric!r}")
        self.mode = "euclidean" if metric == "euclidean" else gaussians.covariance
        # Distances are invariant to a common shift; centring on the global mean keeps
        # the expanded forms below (‖a‖² − 2a·b + ‖b‖²) from cancelling in float32.
        self.centre = gaussians.global_mean.to(device)
        self.means = gaussians.means.to(device) - self.centre
        if self.mode == "tied":
            self.factor = gaussians.factors[0].to(device)
            self.whitened_means = self.means @ self.factor
        elif self.mode == "diag":
            self.precision_diag = gaussians.factors.to(device).square()  # [C, d]
        elif self.mode == "full":
            self.factors = gaussians.factors.to(device)
        elif self.mode == "lowrank":
            factors = self.basis = gaussians.factors.to(device)  # [C, k, d], orthonormal rows, zero rows as padding
            isotropic = gaussians.isotropic.to(device)
            self.inv_isotropic = 1 / isotropic  # [C]
            self.inv_eigen = 1 / (isotropic[:, None] + gaussians.spectrum.to(device))  # [C, k]
            self.projected_means = torch.bmm(factors, self.means.unsqueeze(2)).squeeze(2)  # Q_c μ_c  [C, k]
            self.mean_norms = self.means.square().sum(1)  # [C]
        # batches whose risky classes outnumbered refine_capacity, counted where the distances are
        self.unrefined = torch.zeros((), dtype=torch.int64, device=self.means.device)

    @property
    def num_classes(self) -> int:
        return self.means.shape[0]

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        if z.dim() != 2 or z.shape[1] != self.means.shape[1]:
            raise UsageError(f"distances take features [N, {self.means.shape[1]}], not {list(z.shape)}")
        forms = {
            "full": self._full,
            "lowrank": self._lowrank,
            "diag": self._diag,
            "tied": self._tied,
            "euclidean": self._euclidean,
        }
        return forms[self.mode](z.float() - self.centre)

    def _diag(self, z: torch.Tensor) -> torch.Tensor:
        """Σ_j p_cj (z_j − μ_cj)², expanded so that no [N, C, d] tensor is formed."""
        p = self.precision_diag
        weighted_z = (z * z) @ p.T
        weighted_means = (p * self.means.square()).sum(1)
        dist = (weighted_z - 2 * z @ (p * self.means).T + weighted_means).clamp_min(0)
        return self._refined(
            dist, weighted_z.detach() + weighted_means, lambda classes: self._exact(z, self.means, classes, p)
        )

    def _tied(self, z: torch.Tensor) -> torch.Tensor:
        whitened = z @ self.factor
        dist = _expanded_square_distance(whitened, self.whitened_means)
        magnitude = whitened.detach().square().sum(1, keepdim=True) + self.whitened_means.square().sum(1)
        return self._refined(
            dist, magnitude, lambda classes: self._tied_exact(z, classes), work=len(z) * z.shape[1] ** 2
        )

    def _euclidean(self, z: torch.Tensor) -> torch.Tensor:
        dist = _expanded_square_distance(z, self.means)
        magnitude = z.detach().square().sum(1, keepdim=True) + self.means.square().sum(1)
        return self._refined(dist, magnitude, lambda classes: self._exact(z, self.means, classes))

    def _exact(
        self, z: torch.Tensor, means: torch.Tensor, classes: torch.Tensor, weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Σ_j w_cj (z_j − μ_cj)² from explicit differences for the given classes, [N, len(classes)]."""
        n, d = z.shape
        return _by_class_chunks(
            _difference_chunk,
            z,
            len(classes),
            4 * n * d,
            lambda part: (means[classes[part]], None if weights is None else weights[classes[part]]),
        )

    def _tied_exact(self, z: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
        """‖Lᵀ(z − μ_c)‖², subtracting before whitening, for the given classes."""
        n, d = z.shape
        return _by_class_chunks(
            _full_chunk,
            z,
            len(classes),
            4 * n * d,
            lambda part: (self.means[classes[part]], self.factor.expand(len(classes[part]), d, d)),
        )

    def _full(self, z: torch.Tensor) -> torch.Tensor:
        n, d = z.shape
        return _by_class_chunks(
            _full_chunk, z, self.num_classes, 4 * n * d, lambda part: (self.means[part], self.factors[part])
        )

    def _lowrank(self, z: torch.Tensor) -> torch.Tensor:
        n, k = len(z), self.basis.shape[1]
        # [N, chunk, k] intermediates: at C = 1000, k = 63, N = 64 one chunk (16 MB) holds every class
        dist = _by_class_chunks(
            _lowrank_chunk,
            z,
            self.num_classes,
            4 * n * k,
            lambda part: (
                self.means[part],
                self.basis[part],
                self.projected_means[part],
                self.inv_isotropic[part],
                self.inv_eigen[part],
            ),
        )
        magnitude = (z.detach().square().sum(1, keepdim=True) + self.mean_norms) * self.inv_isotropic
        return self._refined(dist, magnitude, lambda classes: self._lowrank_exact(z, classes), work=n * z.shape[1] * k)

    def _lowrank_exact(self, z: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
        """D for the given classes from the explicit residual, [N, len(classes)]."""
        n, d = z.shape
        return _by_class_chunks(
            _lowrank_exact_chunk,
            z,
            len(classes),
            4 * n * d,
            lambda part: (
                self.means[classes[part]],
                self.basis[classes[part]],
                self.inv_isotropic[classes[part]],
                self.inv_eigen[classes[part]],
            ),
        )

    def _refined(self, dist: torch.Tensor, magnitude: torch.Tensor, exact, work: int | None = None) -> torch.Tensor:
        """Replace the classes whose expanded-form distance may be off by more than
        REFINE_TOLERANCE (its float32 rounding error is about 4·eps·magnitude, the sum of
        the squared norms that cancelled) with `exact(classes)`, computed without cancelling.

        No host synchronisation sizes the work: `exact` always runs on refine_capacity
        classes, chosen on the device, most at risk first; the exact values of those not at
        risk are not used (nor their gradients, which are zero). `work`: elements of work
        per class, N·d unless said."""
        n, num_classes = dist.shape
        capacity = refine_capacity(num_classes, n, work or n * self.means.shape[1])
        with torch.no_grad():
            bound = 4 * _EPS32 * magnitude
            risky = (bound > REFINE_TOLERANCE * dist).any(0)  # [C]
            if capacity < num_classes:
                classes = torch.argsort((bound / dist).amax(0), descending=True)[:capacity]
                self.unrefined += risky.sum() > capacity
                risky &= torch.zeros_like(risky).index_fill_(0, classes, True)  # those past capacity stay expanded
            else:
                classes = torch.arange(num_classes, device=dist.device)
        refined = torch.zeros_like(dist).index_copy(1, classes, exact(classes))
        return torch.where(risky, refined, dist)


def refine_capacity(num_classes: int, batch: int, work: int) -> int:
    """How many classes each batch's refinement recomputes, given the multiply-adds each
    takes (N·d; N·d·k low-rank; N·d² tied), counted as float32 elements against a chunk:
    every class when there are no more than the batch's samples or than one chunk of that
    work holds; else the larger of those two."""
    return min(num_classes, max(batch, CHUNK_BYTES // (4 * work)))


def _by_class_chunks(fn, z: torch.Tensor, num_classes: int, bytes_per_class: int, class_args) -> torch.Tensor:
    """fn(z, *class_args(part)) over slices of the classes, concatenated into [N, C].

    Chunks keep each intermediate under CHUNK_BYTES; when all of them would not fit
    KEEP_BYTES, they are checkpointed (recomputed in backward) instead of kept.
    """
    chunk = max(1, CHUNK_BYTES // max(1, bytes_per_class))
    recompute = z.requires_grad and num_classes * bytes_per_class > KEEP_BYTES
    pieces = []
    for start in range(0, num_classes, chunk):
        args = class_args(slice(start, start + chunk))
        pieces.append(checkpoint(fn, z, *args, use_reentrant=False) if recompute else fn(z, *args))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)


def _lowrank_chunk(
    z: torch.Tensor,
    means: torch.Tensor,
    basis: torch.Tensor,
    projected_means: torch.Tensor,
    inv_isotropic: torch.Tensor,
    inv_eigen: torch.Tensor,
) -> torch.Tensor:
    c, k, d = basis.shape
    # t = Q_c(z − μ_c) for every class: one [N, d] × [d, c·k] GEMM on a view of the basis
    t = (z @ basis.reshape(c * k, d).T).view(len(z), c, k) - projected_means
    squared = t.square()
    outside = (_expanded_square_distance(z, means) - squared.sum(-1)).clamp_min(0)
    return outside * inv_isotropic + (squared * inv_eigen).sum(-1)


def _lowrank_exact_chunk(
    z: torch.Tensor, means: torch.Tensor, basis: torch.Tensor, inv_isotropic: torch.Tensor, inv_eigen: torch.Tensor
) -> torch.Tensor:
    diff = z.unsqueeze(0) - means.unsqueeze(1)  # [c, N, d]
    t = torch.bmm(diff, basis.transpose(1, 2))  # [c, N, k]
    residual = diff - torch.bmm(t, basis)  # the part of z − μ_c outside span Q_c
    dist = residual.square().sum(-1) * inv_isotropic[:, None] + (t.square() * inv_eigen[:, None, :]).sum(-1)
    return dist.T  # [N, c]


def _difference_chunk(z: torch.Tensor, means: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    squared = (z.unsqueeze(0) - means.unsqueeze(1)).square()  # [c, N, d]
    if weights is not None:
        squared = squared * weights.unsqueeze(1)
    return squared.sum(-1).T  # [N, c]


def _full_chunk(z: torch.Tensor, means: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    diff = z.unsqueeze(0) - means.unsqueeze(1)  # [c, N, d]
    whitened = torch.bmm(diff, factors)  # rows (z − μ_c)ᵀ L_c
    return whitened.square().sum(-1).T  # [N, c]


def _expanded_square_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """‖a_n − b_c‖² for all pairs via ‖a‖² − 2a·b + ‖b‖², clamped at 0 against rounding."""
    return (a.square().sum(1, keepdim=True) - 2 * a @ b.T + b.square().sum(1)).clamp_min(0)
