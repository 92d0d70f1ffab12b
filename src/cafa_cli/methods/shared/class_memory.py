"""A memory of test samples kept per predicted class, on the device, whose bookkeeping
is on the host: SoTTA's HUS and STAMP's RBM hold their samples so and differ only in which
sample they remove (their methods decide).

Each class keeps its samples oldest first; `samples()` is the whole memory class by class,
as both authors' get_memory / get_data concatenate it. A removed sample's slot takes the
next sample stored; the slots exist as far as the stored samples need them (doubled, at
most `capacity`), so that a memory of 10,000 images costs what it holds.
"""

from __future__ import annotations

import torch


def removal_draws(n: int, device: torch.device) -> torch.Tensor:
    """[n, 2] uniforms from torch's generator, two for each sample offered: the random class
    and the random sample a removal for it takes (`pick`), drawn whether or not one is needed,
    so that the draws of a batch do not depend on what the memory holds, and read with the
    batch's one transfer."""
    return torch.rand(n, 2, device=device, dtype=torch.float64)


def pick(u: float, n: int) -> int:
    """The index below n that uniform u picks (the authors' random.choice, random.randrange)."""
    return min(int(u * n), n - 1)


class ClassMemory:
    def __init__(self, num_classes: int, capacity: int):
        self.capacity = capacity
        self.slots: torch.Tensor | None = None  # [rows, ...] on the device
        self.stored: list[list[int]] = [[] for _ in range(num_classes)]  # each class's slots, oldest first
        self.free: list[int] = []  # slots whose sample was removed

    def __len__(self) -> int:
        return sum(self.counts())

    def counts(self) -> list[int]:
        return [len(slots) for slots in self.stored]

    def remove(self, c: int, index: int) -> None:
        """Class c's sample at `index` (0: its oldest)."""
        self.free.append(self.stored[c].pop(index))

    def add(self, sample: torch.Tensor, c: int) -> None:
        """`sample` (one image, on the device) into class c; the caller has made room."""
        if self.free:
            slot = self.free.pop()
        else:
            slot = len(self)
            rows = 0 if self.slots is None else len(self.slots)
            if slot >= rows:
                grown = sample.new_zeros((min(self.capacity, max(slot + 1, 2 * rows)), *sample.shape))
                if rows:
                    grown[:rows] = self.slots
                self.slots = grown
        self.slots[slot].copy_(sample)
        self.stored[c].append(slot)

    def samples(self) -> torch.Tensor | None:
        """The stored samples, class by class, oldest first in each; None when empty."""
        order = [slot for slots in self.stored for slot in slots]
        return self.slots[torch.tensor(order, device=self.slots.device)] if order else None
