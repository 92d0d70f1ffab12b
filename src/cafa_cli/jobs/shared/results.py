"""What a run produces: one record per image, one result per domain."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Record:
    ref: str
    prediction: int
    label: int  # UNLABELLED when unknown
    confidence: float


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

    @property
    def error(self) -> float | None:
        return self.errors / self.labelled if self.labelled else None
