"""What a run produces: one record per image, one result per domain."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from typing import NamedTuple

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
