"""What a run produces: one record per image, one result per domain."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

# equal-width confidence bins of the expected calibration error, as Guo et al. (2017) and the
# test-time adaptation papers after them (FOA, TTA-VLM) count it
CALIBRATION_BINS = 15
# the inner edges m/15; a confidence on an edge is in the bin below it: ((m − 1)/15, m/15]
_EDGES = [m / CALIBRATION_BINS for m in range(1, CALIBRATION_BINS)]


@dataclass
class Record:
    ref: str
    prediction: int
    label: int  # UNLABELLED when unknown
    confidence: float  # the largest of the reported probabilities, the prediction's
    # of a labelled image, for its calibration: −log of its label's probability (nats), and
    # its Brier score Σ_k (p_k − y_k)² with y the label one-hot; None when unlabelled
    nll: float | None = None
    brier: float | None = None
    outlier: bool | None = None  # with `outliers`: whether the image is one of them; None without
    id_score: float | None = None  # with `outliers`: the method's in-distribution score (Method.id_score)
    entropy: float = 0.0  # of the reported probabilities, in nats: a label-free surrogate of the error


@dataclass
class Calibration:
    """Running sums over labelled images, from which their expected calibration error, mean
    negative log-likelihood and mean Brier score follow, in memory of the bins' size however
    long the stream. ECE = Σ_b |B_b|/n · |acc(B_b) − conf(B_b)| over the 15 bins of the
    confidence (Guo et al. 2017; Naeini et al. 2015), which is Σ_b |right_b − Σ conf_b| / n."""

    images: list[int] = field(default_factory=lambda: [0] * CALIBRATION_BINS)
    right: list[int] = field(default_factory=lambda: [0] * CALIBRATION_BINS)
    confidence: list[float] = field(default_factory=lambda: [0.0] * CALIBRATION_BINS)
    nll_sum: float = 0.0
    brier_sum: float = 0.0

    def add(self, record: Record) -> None:
        """A labelled image's record."""
        b = bisect_left(_EDGES, record.confidence)
        self.images[b] += 1
        self.right[b] += record.prediction == record.label
        self.confidence[b] += record.confidence
        self.nll_sum += record.nll
        self.brier_sum += record.brier

    def merge(self, other: Calibration) -> None:
        """Another's images counted in too (a corruption's severities as one, rounds as one)."""
        for b in range(CALIBRATION_BINS):
            self.images[b] += other.images[b]
            self.right[b] += other.right[b]
            self.confidence[b] += other.confidence[b]
        self.nll_sum += other.nll_sum
        self.brier_sum += other.brier_sum

    @property
    def n(self) -> int:
        return sum(self.images)

    @property
    def ece(self) -> float | None:
        """A fraction, from 0 to 1; None without a labelled image."""
        n = self.n
        return sum(abs(right - confidence) for right, confidence in zip(self.right, self.confidence)) / n if n else None

    @property
    def nll(self) -> float | None:
        """In nats a labelled image; infinite when an image's label had a probability of 0."""
        return self.nll_sum / self.n if self.n else None

    @property
    def brier(self) -> float | None:
        """The multi-class sum over the classes (Brier 1950), from 0 to 2, a labelled image."""
        return self.brier_sum / self.n if self.n else None

    @classmethod
    def of(cls, results) -> Calibration:
        """Theirs as one (the images of several domains)."""
        whole = cls()
        for result in results:
            whole.merge(result.calibration)
        return whole


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
    calibration: Calibration = field(default_factory=Calibration)  # of the labelled images
    # with `outliers` (a share above 0): the in-distribution scores of the domain's own images and of the
    # outliers (of `n`, the images read, these are the outliers); None without
    inlier_scores: list[float] | None = None
    outlier_scores: list[float] | None = None
    # label-free surrogates of the error (`cafa bench --select`), over every image read: the sum of the
    # prediction entropies (nats), and with StreamSettings.consistency the images predicted alike when flipped
    entropy_sum: float = 0.0
    consistent: int | None = None

    @property
    def error(self) -> float | None:
        return self.errors / self.labelled if self.labelled else None

    # the calibration of the labelled images, by the names `cafa bench --metric` takes
    @property
    def ece(self) -> float | None:
        return self.calibration.ece

    @property
    def nll(self) -> float | None:
        return self.calibration.nll

    @property
    def brier(self) -> float | None:
        return self.calibration.brier

    @property
    def outliers(self) -> int:
        return len(self.outlier_scores or ())

    @property
    def auroc(self) -> float | None:
        return None if self.outlier_scores is None else auroc(self.inlier_scores, self.outlier_scores)

    @property
    def h_score(self) -> float | None:
        return h_score(self.error, self.auroc)


class Metric(NamedTuple):
    """What a bench table's cells can be (`cafa bench --metric`): the DomainResult property
    read, how much it is scaled by for the table, its unit there, its decimals and its CSV
    columns' suffix."""

    name: str
    scale: float
    unit: str
    digits: int
    csv_unit: str


# every one is the lower the better, as the bold best of each table takes it
METRICS = {
    metric.name: metric
    for metric in (
        Metric("error", 100, "error %", 2, "_percent"),
        Metric("ece", 100, "ECE %", 2, "_percent"),
        Metric("nll", 1, "NLL (nats)", 3, "_nats"),
        Metric("brier", 1, "Brier score", 3, ""),
    )
}


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
