"""RoTTA's category-balanced sampling with timeliness and uncertainty (CSTU): a memory
bank of test samples, kept on the device so that adding to it reads no device value.

Each stored sample has its pseudo-label c (the teacher's), its uncertainty u (the entropy
of the teacher's prediction) and its age a (the samples offered since it was stored, its
own offer included: 1 right after it enters). Its heuristic score, higher meaning more
worth replacing, is

    H = λ_t · 1/(1 + exp(−a/K)) + λ_u · u / ln C        (K the capacity, C the classes)

and a new sample (a = 0) of class c enters when:
- its class holds fewer than K/C samples and the bank is not full: it is added;
- its class holds fewer than K/C and the bank is full: the sample of highest H among the
  classes holding the most samples is replaced, if its H is above the new sample's;
- its class holds K/C or more: its own class's sample of highest H is replaced, likewise;
otherwise it is dropped. Ties go to the last in the official code's order (by class,
then by arrival). Then every stored sample ages by one.

Defaults, as the official code: K = 64, λ_t = λ_u = 1.
"""

from __future__ import annotations

import math

import torch

CAPACITY = 64
LAMBDA_T = 1.0
LAMBDA_U = 1.0
_CLASS_KEY = 1 << 40  # (class, arrival) as one integer: arrival counts stay far below it


class MemoryBank:
    """The CSTU bank: `add(sample, label, uncertainty, arrival)` one sample at a time,
    `samples`/`occupied`/`ages` for a training step. Slots are allocated on the first add."""

    def __init__(self, num_classes: int, capacity: int = CAPACITY, lambda_t: float = LAMBDA_T, lambda_u: float = LAMBDA_U):
        self.num_classes, self.capacity, self.lambda_t, self.lambda_u = num_classes, capacity, lambda_t, lambda_u
        self.per_class = capacity / num_classes
        self.reset()

    def reset(self) -> None:
        self.slots: torch.Tensor | None = None  # [K + 1, ...]: the last one takes the samples that do not enter

    def _allocate(self, sample: torch.Tensor) -> None:
        K, device = self.capacity, sample.device
        self.slots = sample.new_zeros((K + 1, *sample.shape))
        self.labels = torch.full((K,), -1, dtype=torch.int64, device=device)  # -1: empty
        self.uncertainties = torch.zeros(K, dtype=torch.float64, device=device)
        self.age_counts = torch.zeros(K, dtype=torch.int64, device=device)
        self.arrivals = torch.zeros(K, dtype=torch.int64, device=device)
        self.slot_numbers = torch.arange(K, device=device)
        self.class_numbers = torch.arange(self.num_classes, device=device)

    @property
    def samples(self) -> torch.Tensor:
        """[K, ...]: the stored samples (zeros where empty)."""
        return self.slots[: self.capacity]

    @property
    def occupied(self) -> torch.Tensor:
        return self.labels >= 0

    @property
    def ages(self) -> torch.Tensor:
        """Each slot's age over the capacity, a/K (float32, as the official weights take it)."""
        return self.age_counts.float() / self.capacity

    def scores(self, ages: torch.Tensor, uncertainties: torch.Tensor) -> torch.Tensor:
        return (self.lambda_t / (1 + torch.exp(-ages.double() / self.capacity))
                + self.lambda_u * uncertainties.double() / math.log(self.num_classes))

    def add(self, sample: torch.Tensor, label: torch.Tensor, uncertainty: torch.Tensor, arrival: int) -> None:
        """Offer one sample (its pseudo-label and uncertainty: 0-d device tensors); `arrival`
        numbers it among all samples offered (a host count)."""
        if self.slots is None:
            self._allocate(sample)
        occupied = self.occupied
        counts = ((self.labels.unsqueeze(1) == self.class_numbers) & occupied.unsqueeze(1)).sum(0)  # [C]
        own = counts.gather(0, label.view(1)).squeeze(0)
        room_in_class = own < self.per_class
        room = occupied.sum() < self.capacity
        majority = (counts == counts.max()).gather(0, self.labels.clamp_min(0))
        candidates = occupied & torch.where(room_in_class, majority, self.labels == label)
        scores = torch.where(candidates, self.scores(self.age_counts, self.uncertainties), -math.inf)
        best = scores.max()
        ties = candidates & (scores == best)
        victim = torch.where(ties, self.labels * _CLASS_KEY + self.arrivals, -1).argmax()
        new_score = self.scores(torch.zeros_like(self.age_counts[0]), uncertainty)
        replace = ~(room_in_class & room) & (best > new_score)
        enters = (room_in_class & room) | replace
        first_empty = (~occupied).int().argmax()
        slot = torch.where(replace, victim, first_empty)
        self.slots.index_copy_(0, torch.where(enters, slot, self.capacity).view(1), sample.unsqueeze(0).to(self.slots.dtype))
        here = enters & (self.slot_numbers == slot)
        self.labels = torch.where(here, label, self.labels)
        self.uncertainties = torch.where(here, uncertainty.double(), self.uncertainties)
        self.arrivals = torch.where(here, arrival, self.arrivals)
        self.age_counts = torch.where(here, 0, self.age_counts) + self.occupied.long()  # all age, the new one to 1
