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
    unrefined_batches: int = 0  # distances left partly in the expanded form (distances.refine_capacity)
    kept_samples: int | None = None  # samples a filtering method (EATA, SAR) kept for its updates; None: it keeps all
    seconds: float = 0.0

    @property
    def error(self) -> float | None:
        return self.errors / self.labelled if self.labelled else None
