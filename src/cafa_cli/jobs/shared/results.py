"""What a run produces: one record per image, one result per domain."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Record:
    ref: str
    prediction: int
    label: int  # UNLABELLED when unknown
    confidence: float
    outlier: bool | None = None  # with `outliers`: whether the image is one of them; None without
    id_score: float | None = None  # with `outliers`: the method's in-distribution score (Method.id_score)


@dataclass
class DomainResult:
    data: str
    n: int = 0
    labelled: int = 0
    errors: int = 0
    skipped_images: list[str] = field(default_factory=list)
    skipped_steps: int = 0
    undefined_batches: int = 0  # batches whose update the method left out as undefined (Method.undefined_when)
    unrefined_batches: int = 0  # distances left partly in the expanded form (distances.refine_capacity)
    kept_samples: int | None = None  # samples a filtering method (EATA, SAR) kept for its updates; None: it keeps all
    domain_changes: int | None = None  # changes of domain a method's detector saw (cafa-robust); None: it has none
    source_restarts: int | None = None  # of those, the ones that put the source's weights back; None: it has none
    seconds: float = 0.0
    batches: int = 0  # batches with an image read
    adapted_batches: int = 0  # of those, the ones adapted on (all but under a stream that does not wait)
    round: int | None = None  # with `rounds` > 1, which pass over the domains (from 1)
    paced: bool = False  # streamed without waiting for the method (`stream_rate`): its adapted share is reported
    # with `outliers` (a share above 0): the in-distribution scores of the domain's own images and of the
    # outliers (of `n`, the images read, these are the outliers); None without
    inlier_scores: list[float] | None = None
    outlier_scores: list[float] | None = None

    @property
    def error(self) -> float | None:
        return self.errors / self.labelled if self.labelled else None

    @property
    def outliers(self) -> int:
        return len(self.outlier_scores or ())

    @property
    def auroc(self) -> float | None:
        return None if self.outlier_scores is None else auroc(self.inlier_scores, self.outlier_scores)

    @property
    def h_score(self) -> float | None:
        return h_score(self.error, self.auroc)


def auroc(inliers, outliers) -> float | None:
    """The area under the ROC curve of telling `inliers` from `outliers` by their scores (higher:
    in-distribution): the Mann-Whitney U statistic over the pairs, a tie counting one half,
    U / (n_in · n_out) from the inliers' mean ranks; None without images of both kinds."""
    inside, outside = np.asarray(inliers, dtype=np.float64), np.asarray(outliers, dtype=np.float64)
    if not len(inside) or not len(outside):
        return None
    _, where, counts = np.unique(np.concatenate([inside, outside]), return_inverse=True, return_counts=True)
    mean_ranks = np.cumsum(counts) - (counts - 1) / 2  # of each distinct score, from 1: ties share their mean
    u = mean_ranks[where[: len(inside)]].sum() - len(inside) * (len(inside) + 1) / 2
    return float(u / (len(inside) * len(outside)))


def h_score(error: float | None, area: float | None) -> float | None:
    """The harmonic mean of the in-distribution accuracy (1 − error) and the AUROC: both high, or it is low."""
    if error is None or area is None:
        return None
    accuracy = 1 - error
    return 2 * accuracy * area / (accuracy + area) if accuracy + area else 0.0
