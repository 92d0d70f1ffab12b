"""OWTTT: open-world test-time training (Li et al., "On the Robustness of Open-World Test-Time
Training: Self-Training with Dynamic Prototype Expansion", ICCV 2023), for streams that mix
images from outside the label set (outliers) into the test data.

Prediction. The classifier is the source's class means, L2-normalised (the prototypes w_c,
the means of the `cafa stats` artifact): the logits of an image with features z are
cos(z, w_c)/δ (δ = `delta`), its in-distribution score (`id_score`) the largest cosine,
max_c cos(z, w_c), whose complement is the authors' outlier score o = 1 − max_c cos(z, w_c).
The batch is predicted after its step; the BatchNorms normalise with their running
statistics, which the alignment pass (3.) moves.

Update rule, for each batch x (features z from a forward pass with the running statistics):

1. o joins a queue of the last N_m scores (`queue_length`); the threshold τ* is the one of
   0, 0.01, ..., 0.99 that minimises the within-group variance of the queue split at it
   (Otsu's rule); an image is seen (a weak outlier, or of the label set) when o < τ*,
   unseen (a strong outlier) otherwise;
2. prototype expansion: the strong-outlier prototypes (at most `max_prototypes`, the oldest
   leaving first) add one logit, max_k cos(z, s_k)/δ. Where some image is unseen, the images
   with o > τ* are visited from the largest o down, and one joins the prototypes (as z/‖z‖)
   when 1 − max(cos to the w_c and the s_k so far) > τ_pro, τ_pro Otsu's threshold of that
   complement over the unseen images;
3. distribution alignment, when some image is seen: a second forward pass of the seen images
   with the BatchNorms in train mode (batch statistics; their running statistics move by the
   model's momentum) gives features f; a moving Gaussian N(μ_t, Σ_t) of them,
       n ← n + b, α = 1/min(n, 1280), Δ = α Σ_i (f_i − μ), μ_t = μ + Δ,
       Σ_t = Σ + α (Σ_i (f_i − μ)(f_i − μ)ᵀ − b Σ) − ΔΔᵀ
   (μ, Σ kept without gradient for the next batch), and the loss
       λ_DA · 0.05 · (KL(N_s ‖ N_t) + KL(N_t ‖ N_s)),
   N_s = N(μ_s, Σ_s + εI), N_t = N(μ_t, Σ_t + εI), μ_s and Σ_s the mean and covariance of all
   source features (the artifact's global moments), ε = max(Σ_s)/30 (λ_DA = `da_scale`);
4. self-training, once the batch began with some strong-outlier prototype: where both groups
   are there, a seen image is kept when its o is below the ⌊n_seen/2⌋-th smallest, an unseen
   one when above the (⌊n_unseen/2⌋+1)-th largest; the loss gains
       λ_CE · (CE(seen logits over the C classes, their argmax) + CE(unseen logits over the
       C + 1, the outlier class)) / 2
   (λ_CE = `ce_scale`; a group with no image adds nothing, as an empty mean adds no gradient
   in the authors' code);

then one optimiser step (none when no image is seen and no prototype was there).

Transcribed from Yushu-Li/OWTTT cifar/OURS.py and imagenet/OURS.py (the training loop,
Prototype_Pool, append_prototypes, compute_os_variance) and cifar/utils/offline.py (the
source statistics). STAMP's authors rerun it (yuyongcan/STAMP src/methods/OWTTT.py) with the
KL's source mean the mean of the normalised prototypes, the alignment pass over the whole
batch, their DA_SCALE never passed on and CE_SCALE 1; these follow the OWTTT authors' code.
The decisions (1., 2., 4.) are made on the host from one transfer a batch: the outlier
scores, the cosines to the strong-outlier prototypes and between the batch's features.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from cafa_cli.engine.method import AdapterSurface, Method
from cafa_cli.engine.options import Option
from cafa_cli.methods.shared.running_norms import training_norms

DELTA = 0.1
CE_SCALE = 0.2  # the authors' CIFAR scripts
DA_SCALE = 1.0
QUEUE_LENGTH = 512  # N_m
MAX_PROTOTYPES = 100
ALIGNMENT_SCALE = 0.05  # their loss_scale
MOVING_LENGTH = 1280  # the moving Gaussian's α is 1/n up to n = 1280, then 1/1280
TEMPLATE_FRACTION = 30  # ε = max(Σ_s)/30, added to both covariances
THRESHOLDS = np.arange(0, 1, 0.01)  # the authors' threshold_range, as np.arange makes it


def otsu_threshold(scores: np.ndarray) -> float:
    """The threshold of THRESHOLDS minimising w₀·Var(scores < th) + w₁·Var(scores ≥ th), the
    first of equals; a split that leaves a side empty is never chosen (0 when every split
    does), as the authors' compute_os_variance and argmin."""
    above = scores[None, :] >= THRESHOLDS[:, None]  # [T, n]
    counts = above.sum(1)

    def variance(mask: np.ndarray, n: np.ndarray) -> np.ndarray:
        mean = (scores * mask).sum(1) / np.maximum(n, 1)
        return (((scores - mean[:, None]) ** 2) * mask).sum(1) / np.maximum(n, 1)

    n = len(scores)
    criteria = ((n - counts) * variance(~above, n - counts) + counts * variance(above, counts)) / n
    criteria[(counts == 0) | (counts == n)] = np.inf
    return float(THRESHOLDS[int(np.argmin(criteria))])


def symmetric_kl(
    mean_s: torch.Tensor,
    cholesky_s: torch.Tensor,
    precision_s: torch.Tensor,
    mean_t: torch.Tensor,
    covariance_t: torch.Tensor,
) -> torch.Tensor:
    """KL(N_s ‖ N_t) + KL(N_t ‖ N_s) = ½(tr(Σ_t⁻¹Σ_s) + tr(Σ_s⁻¹Σ_t) + Δᵀ(Σ_t⁻¹ + Σ_s⁻¹)Δ) − d:
    the log-determinants cancel. Σ_s given by its Cholesky factor and inverse; NaN where Σ_t is
    not positive definite (the step is then left out)."""
    d = len(mean_s)
    cholesky_t, info = torch.linalg.cholesky_ex(covariance_t)
    gap = mean_t - mean_s
    solved = torch.linalg.solve_triangular(cholesky_t, torch.cat([cholesky_s, gap[:, None]], 1), upper=False)
    traces = solved[:, :d].square().sum() + (precision_s * covariance_t).sum()
    mahalanobis = solved[:, d].square().sum() + gap @ precision_s @ gap
    kl = 0.5 * (traces + mahalanobis) - d
    return torch.where(info == 0, kl, torch.full_like(kl, float("nan")))


class Owttt(Method):
    name = "owttt"
    needs_statistics = True
    owns_update = True
    adapts_normalisation = False  # it predicts with the running statistics, which its alignment pass moves
    running_norms = "it keeps the BatchNorms' running statistics itself, moved by its alignment pass"
    not_served = "the cosine of its features to the source's class means, not its network's classifier"
    options = (
        Option("delta", DELTA, "δ, the temperature of the cosine logits", "positive"),
        Option("ce_scale", CE_SCALE, "λ_CE, the weight of the self-training cross-entropy", "weight"),
        Option("da_scale", DA_SCALE, "λ_DA, the weight of the global distribution alignment", "weight"),
        Option("queue_length", QUEUE_LENGTH, "N_m, the outlier scores kept for the threshold", "count", most=100_000),
        Option("max_prototypes", MAX_PROTOTYPES, "strong-outlier prototypes kept, oldest out", "count", most=10_000),
    )
    # the source's, from the statistics: never changed
    unsaved = (*Method.unsaved, "prototypes", "source_mean", "source_cholesky", "source_precision", "template")

    def setup(self) -> None:
        g = self.gaussians
        self.prototypes = F.normalize(g.means.to(self.device, torch.float32), dim=1)  # [C, d]
        covariance = g.global_covariance.double()
        d = len(covariance)
        template = covariance.max() / TEMPLATE_FRACTION * torch.eye(d, dtype=torch.float64)
        cholesky = torch.linalg.cholesky(covariance + template)
        self.source_mean = g.global_mean.to(self.device, torch.float32)
        self.source_cholesky = cholesky.to(self.device, torch.float32)
        self.source_precision = torch.cholesky_inverse(cholesky).to(self.device, torch.float32)
        self.template = template.to(self.device, torch.float32)
        self.reported: tuple | None = None  # the batch's logits and features, for its later `steps`
        self.fresh = False
        self.reset()

    def reset(self) -> None:
        d = self.prototypes.shape[1]
        self.outliers = self.prototypes.new_zeros(0, d)  # the strong-outlier prototypes s_k, oldest first
        self.queue: list[float] = []  # the last N_m outlier scores
        self.moving_count = 0.0  # n
        self.moving_mean = self.prototypes.new_zeros(d)  # μ
        self.moving_covariance = self.prototypes.new_zeros(d, d)  # Σ

    def id_score(self, logits: torch.Tensor) -> torch.Tensor:
        """The largest cosine to a source prototype (1 − the authors' outlier score)."""
        return logits.amax(1) * self.delta

    def before_step(self, images: torch.Tensor) -> None:
        self.fresh = True

    def update(self, adapter: AdapterSurface, images: torch.Tensor, skipped: torch.Tensor | None):
        if not self.fresh:  # the Adapter's later `steps`: one step a batch, as the authors'
            return self.reported + (skipped,)
        self.fresh = False
        with adapter.autocast:
            features = adapter.forward(images)[1].float()
        unit = F.normalize(features, dim=1)
        cosines = unit @ self.prototypes.T  # [N, C]
        to_outliers = unit @ self.outliers.T  # [N, P]
        detached = unit.detach()
        nearest = cosines.detach().amax(1, keepdim=True)
        # one transfer: [N, 1 + P + N], the nearest class's cosine, those to the prototypes and within the batch
        host = np.array(torch.cat([nearest, to_outliers.detach(), detached @ detached.T], 1).double().tolist())
        had_outliers = len(self.outliers) > 0
        scores = 1 - host[:, 0]
        self.queue = (self.queue + scores.tolist())[-self.queue_length :]
        threshold = otsu_threshold(np.array(self.queue))
        seen = np.flatnonzero(scores < threshold)
        unseen = np.flatnonzero(scores >= threshold)
        if len(unseen):
            self._expand(host, threshold, unseen, detached)

        loss = None
        if len(seen):
            loss = self.da_scale * ALIGNMENT_SCALE * self._alignment(adapter, images, seen)
        if had_outliers:
            if len(seen) and len(unseen):
                seen, unseen = self._far_from_threshold(scores, seen, unseen)
            logits = torch.cat([cosines, to_outliers.amax(1, keepdim=True)], 1) / self.delta
            classes = len(self.prototypes)
            seen_term = self._mean_cross_entropy(logits[:, :classes], cosines.detach().argmax(1), seen)
            outlier_class = torch.full((len(images),), classes, dtype=torch.long, device=images.device)
            unseen_term = self._mean_cross_entropy(logits, outlier_class, unseen)
            training = self.ce_scale * (seen_term + unseen_term) / 2
            loss = training if loss is None else loss + training
        flag = skipped if loss is None else adapter.apply(loss, skipped)

        with torch.no_grad(), adapter.autocast:
            features = adapter.forward(images)[1].float()
        self.reported = (F.normalize(features, dim=1) @ self.prototypes.T / self.delta, features)
        return self.reported + (flag,)

    def _expand(self, host: np.ndarray, threshold: float, unseen: np.ndarray, unit: torch.Tensor) -> None:
        """append_prototypes: the batch's strong outliers, the farthest first, each joining the
        prototypes when far enough from the source's and the strong outliers' so far."""
        old = len(self.outliers)
        nearest_source, to_old, between = host[:, 0], host[:, 1 : 1 + old], host[:, 1 + old :]
        nearest_any = np.maximum(nearest_source, to_old.max(1, initial=-np.inf))
        expansion = otsu_threshold(1 - nearest_any[unseen])
        pool = list(range(old))  # rows of cat([outliers, unit]): the old prototypes, then the batch's
        remaining = nearest_source.copy()
        while True:
            i = int(np.argmin(remaining))
            if not 1 - remaining[i] > threshold:
                break
            remaining[i] = 1  # visited
            columns = [to_old[i, k] if k < old else between[i, k - old] for k in pool]
            if 1 - max([nearest_source[i], *columns]) > expansion:
                pool = (pool + [old + i])[-self.max_prototypes :]
        if pool != list(range(old)):
            index = torch.tensor(pool, device=unit.device)
            self.outliers = F.normalize(torch.cat([self.outliers, unit]).index_select(0, index), dim=1)

    def _alignment(self, adapter: AdapterSurface, images: torch.Tensor, seen: np.ndarray) -> torch.Tensor:
        """The symmetric KL between the source Gaussian and the moving one of the seen images'
        features, from a pass with the BatchNorms on the batch's statistics."""
        index = torch.tensor(seen, device=images.device)
        with training_norms(adapter.model), adapter.autocast:
            features = adapter.forward(images.index_select(0, index))[1].float()
        b = len(seen)
        self.moving_count += b
        alpha = 1 / MOVING_LENGTH if self.moving_count > MOVING_LENGTH else 1 / self.moving_count
        centred = features - self.moving_mean
        shift = alpha * centred.sum(0)
        mean = self.moving_mean + shift
        covariance = (
            self.moving_covariance
            + alpha * (centred.T @ centred - b * self.moving_covariance)
            - shift[:, None] @ shift[None, :]
        )
        self.moving_mean, self.moving_covariance = mean.detach(), covariance.detach()
        return symmetric_kl(
            self.source_mean,
            self.source_cholesky,
            self.source_precision,
            mean,
            covariance + self.template,
        )

    @staticmethod
    def _far_from_threshold(scores: np.ndarray, seen: np.ndarray, unseen: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The authors' filter: of the seen, those whose score is below the ⌊n/2⌋-th smallest
        (a[−⌊n/2⌋] of the descending sort: the largest when ⌊n/2⌋ = 0); of the unseen, those
        above the (⌊n/2⌋+1)-th largest."""
        down = np.sort(scores[seen])[::-1][-(len(seen) // 2)]
        up = np.sort(scores[unseen])[::-1][len(unseen) // 2]
        return seen[scores[seen] < down], unseen[scores[unseen] > up]

    @staticmethod
    def _mean_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, chosen: np.ndarray) -> torch.Tensor:
        index = torch.tensor(chosen, dtype=torch.long, device=logits.device)
        picked = F.cross_entropy(logits.index_select(0, index), labels.index_select(0, index), reduction="sum")
        return picked / max(len(chosen), 1)
