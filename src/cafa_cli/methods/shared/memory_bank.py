"""RoTTA's category-balanced sampling with timeliness and uncertainty (CSTU): a memory
bank of test samples on the device, whose bookkeeping is kept on the host.

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
then by arrival). Then every stored sample ages by one. With an `expiry` E > 0 (not
RoTTA's; cafa-robust's `memory_expiry`), a sample older than E joins the candidates whatever
its class: a bank that a new domain refreshes in only the classes it predicts would otherwise
keep the old domain's images of every other class for good.

A slot, once filled, is only ever replaced, never emptied (but by `reset`), and an empty one
is filled lowest first, so the stored samples are the first `filled` slots. The slots exist
as far as they are needed: room for the first batch offered (at most K), doubled (at most
K) whenever the stored samples outgrow it. A training step runs over those slots, its empty
ones with weight 0, so that its work and memory follow the samples stored and the batch
size, not K (a bank of K = 10,000 once ran the networks over 10,000 slots, empty ones
included, after 20 images); once the slots reach K, the step is what it always was.

Whether a sample enters depends on the bank as the previous one left it, so the samples
of a batch are decided one after the other, but on the host: the batch's labels and
λ_u·u/ln C come over in one transfer, the timeliness term is a table of every age's value
made once on the device (past 40·K ages it is λ_t exactly: exp(−40) vanishes next to 1),
and each decision is arithmetic on Python numbers. The same device ops make both terms as
before and their sum is one IEEE addition, on the host as on the device, so the bank
keeps exactly the samples it kept when it decided on the device. The samples are then
written with one index_copy_, and the labels and ages the training step reads with one
host-to-device copy.

Defaults, as the official code: K = 64, λ_t = λ_u = 1.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from cafa_cli.engine.options import Option

CAPACITY = 64
UPDATE_EVERY = 64  # a training step on the bank after every this many samples
LAMBDA_T = 1.0
LAMBDA_U = 1.0
# the options of a method that trains on the bank (rotta, cafa-robust): its size and schedule, then its score's weights
SCHEDULE_OPTIONS = (
    Option("memory_size", CAPACITY, "K, the samples the category-balanced memory bank holds", "count", most=10_000),
    Option("update_every", UPDATE_EVERY, "a training step on the bank after every this many samples", "count"),
)
SCORE_OPTIONS = (
    Option("lambda_t", LAMBDA_T, "λ_t, the weight of a sample's age in the bank's replacement score", "weight"),
    Option("lambda_u", LAMBDA_U, "λ_u, the weight of a sample's uncertainty in that score", "weight"),
)
SATURATION = 40  # ages of SATURATION·K and more: exp(−a/K) < 2^−53, so 1 + it rounds to 1


class MemoryBank:
    """The CSTU bank: `offer(samples, labels, uncertainties, arrival, every)` for a batch
    (`add` when no step interleaves), `samples`/`occupied`/`ages` for a training step.
    Slots are allocated as they are needed (module docstring)."""

    # made with the slots, on the first offer (_allocate): declared here, as a saved state may hold them
    labels: torch.Tensor | None = None
    age_counts: torch.Tensor | None = None
    timeliness: list[float] | None = None

    def __init__(
        self,
        num_classes: int,
        capacity: int = CAPACITY,
        lambda_t: float = LAMBDA_T,
        lambda_u: float = LAMBDA_U,
        expiry: int = 0,
    ):
        self.num_classes, self.capacity, self.lambda_t, self.lambda_u = num_classes, capacity, lambda_t, lambda_u
        self.expiry = expiry
        self.per_class = capacity / num_classes
        self.reset()

    def reset(self) -> None:
        self.slots: torch.Tensor | None = None  # [R ≤ K, ...] on the device
        K = self.capacity
        # the host's bookkeeping, per slot: pseudo-label (-1: empty), λ_u·u/ln C, arrival, and
        # the offers made before it entered (its age is `clock` minus that)
        self.host_labels, self.host_terms, self.host_arrivals, self.entered = [-1] * K, [0.0] * K, [0] * K, [0] * K
        self.class_counts = [0] * self.num_classes
        self.filled = 0
        self.clock = 0  # offers made

    def _allocate(self, samples: torch.Tensor) -> None:
        K, device = self.capacity, samples.device
        rows = min(K, max(len(samples), 1))  # the first batch's room
        self.slots = samples.new_zeros((rows, *samples.shape[1:]))
        self.labels = torch.full((rows,), -1, dtype=torch.int64, device=device)  # -1: empty
        self.age_counts = torch.zeros(rows, dtype=torch.int64, device=device)
        ages = torch.arange(SATURATION * K + 1, device=device)
        self.timeliness = self.timeliness_terms(ages).tolist()  # one transfer per bank

    def _room(self) -> None:
        """Slots for the `filled` samples: doubled (at most K) when they outgrow them, so that
        filling the bank copies each stored sample about once."""
        rows = len(self.slots)
        if self.filled > rows:
            grown = self.slots.new_zeros((min(self.capacity, max(self.filled, 2 * rows)), *self.slots.shape[1:]))
            grown[:rows] = self.slots
            self.slots = grown

    @property
    def samples(self) -> torch.Tensor:
        """[R, ...]: the slots, the stored samples first (zeros where empty)."""
        return self.slots

    @property
    def occupied(self) -> torch.Tensor:
        return self.labels >= 0

    @property
    def ages(self) -> torch.Tensor:
        """Each slot's age over the capacity, a/K (float32, as the official weights take it)."""
        return self.age_counts.float() / self.capacity

    def timeliness_terms(self, ages: torch.Tensor) -> torch.Tensor:
        """λ_t · 1/(1 + exp(−a/K)) of each age (float64)."""
        return self.lambda_t / (1 + torch.exp(-ages.double() / self.capacity))

    def uncertainty_terms(self, uncertainties: torch.Tensor) -> torch.Tensor:
        """λ_u · u / ln C of each uncertainty (float64)."""
        return self.lambda_u * uncertainties.double() / math.log(self.num_classes)

    def scores(self, ages: torch.Tensor, uncertainties: torch.Tensor) -> torch.Tensor:
        """H of each (age, uncertainty), on the device."""
        return self.timeliness_terms(ages) + self.uncertainty_terms(uncertainties)

    def add(self, samples: torch.Tensor, labels: torch.Tensor, uncertainties: torch.Tensor, arrival: int) -> None:
        """Offer `samples` [B, ...] in order (pseudo-labels and uncertainties [B], device tensors);
        `arrival` numbers the first among all samples offered (a host count)."""
        for _ in self.offer(samples, labels, uncertainties, arrival):
            pass

    def offer(
        self, samples: torch.Tensor, labels: torch.Tensor, uncertainties: torch.Tensor, arrival: int, every: int = 0
    ) -> Iterator[int]:
        """As `add`, pausing after each sample whose number (arrival + 1 for the first) is a
        multiple of `every` (0: never), with the bank as that sample left it: yields that
        number. The samples are all offered once the iterator is exhausted."""
        if self.slots is None:
            self._allocate(samples)
        both = torch.stack([labels.double(), self.uncertainty_terms(uncertainties)])
        new_labels, new_terms = both.tolist()  # the one device-to-host transfer
        written: dict[int, int] = {}  # slot: index in `samples` of what goes there
        for n, (c, term) in enumerate(zip(new_labels, new_terms)):
            slot = self._decide(int(c), term, arrival + n)
            if slot is not None:
                written[slot] = n
            number = arrival + n + 1
            if every and number % every == 0:
                self._write(samples, written)
                written = {}
                yield number
        if len(samples) and not (every and (arrival + len(samples)) % every == 0):
            self._write(samples, written)

    def _decide(self, c: int, term: float, arrival: int) -> int | None:
        """Decide one sample of class c (and λ_u·u/ln C `term`) on the host: the slot it
        takes, or None; then every stored sample ages by one (the clock moves)."""
        labels = self.host_labels
        room_in_class = self.class_counts[c] < self.per_class
        if room_in_class and self.filled < self.capacity:
            slot = self.filled  # the first empty one: the stored samples come first
        else:
            slot = self._victim(c, room_in_class, self.timeliness[0] + term)
        if slot is not None:
            old = labels[slot]
            if old >= 0:
                self.class_counts[old] -= 1
            else:
                self.filled += 1
            self.class_counts[c] += 1
            labels[slot], self.host_terms[slot], self.host_arrivals[slot], self.entered[slot] = (
                c,
                term,
                arrival,
                self.clock,
            )
        self.clock += 1
        return slot

    def _victim(self, c: int, room_in_class: bool, new_score: float) -> int | None:
        """The slot of highest H among the candidates (the classes holding the most samples
        when c is below its share, else c's own; and any sample older than `expiry`), ties to
        the highest (class, arrival), if that H is above the new sample's. A NaN among them
        blocks, as max does on the device."""
        labels, table, last = self.host_labels, self.timeliness, len(self.timeliness) - 1
        if room_in_class:
            most = max(self.class_counts)
            pool = {k for k, n in enumerate(self.class_counts) if n == most}
        else:
            pool = {c}
        best, victim, key = -math.inf, None, (-1, -1)
        for k in range(self.filled):  # the stored ones (module docstring)
            label, age = labels[k], self.clock - self.entered[k]
            if label not in pool and not (self.expiry and age > self.expiry):
                continue
            score = table[min(age, last)] + self.host_terms[k]
            if score != score:  # NaN
                return None
            if score > best or score == best and (label, self.host_arrivals[k]) > key:
                best, victim, key = score, k, (label, self.host_arrivals[k])
        return victim if best > new_score else None

    @property
    def host_ages(self) -> list[int]:
        return [self.clock - e if label >= 0 else 0 for label, e in zip(self.host_labels, self.entered)]

    def _write(self, samples: torch.Tensor, written: dict[int, int]) -> None:
        """The decided samples into their slots, and the slots' labels and ages to the device,
        in one host-to-device copy (asynchronous on a GPU)."""
        self._room()
        K, device = len(self.slots), samples.device
        host = torch.tensor(
            list(written) + list(written.values()) + self.host_labels[:K] + self.host_ages[:K], dtype=torch.int64
        )
        if device.type == "cuda":
            host = host.pin_memory()
        moved = host.to(device, non_blocking=True)
        m = len(written)
        if m:
            slots, sources = moved[:m], moved[m : 2 * m]
            self.slots.index_copy_(0, slots, samples.index_select(0, sources).to(self.slots.dtype))
        self.labels, self.age_counts = moved[2 * m : 2 * m + K], moved[2 * m + K :]


def timeliness_weights(ages: torch.Tensor) -> torch.Tensor:
    """w(A) = exp(−A)/(1 + exp(−A)) of each age A = age/K."""
    return torch.exp(-ages) / (1 + torch.exp(-ages))
