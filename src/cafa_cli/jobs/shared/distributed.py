"""`torchrun` support. `cafa stats`: each rank streams its share of the subset, then
rank 0 merges the class moments and writes the artifact. `cafa bench`: the
(method, seed) runs are spread over the ranks, and with `reset` domain each run's
domains too; rank 0 prints the table. `cafa adapt` (`reset` domain): each rank adapts
its share of the domains and rank 0 writes every record, in stream order.

    torchrun --nproc-per-node 4 -m cafa_cli stats --data ... --out stats.safetensors
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from cafa_cli.core.errors import UsageError
from cafa_cli.jobs.shared.monitor import Monitor
from cafa_cli.methods import REGISTRY, is_plugin, method_class
from cafa_cli.statistics.moments import ClassMoments


def launched_by_torchrun() -> bool:
    return _environment_number("WORLD_SIZE", 1) > 1


def torchrun_rank() -> int:
    """This process's rank, known before it joins the group: warnings are printed by rank 0 only."""
    if not launched_by_torchrun():
        return 0
    rank, world = _environment_number("RANK", -1), _environment_number("WORLD_SIZE", 1)
    if not 0 <= rank < world:
        # a process group would wait for a rank that never comes
        raise UsageError(
            f"RANK={os.environ.get('RANK', '(unset)')} with WORLD_SIZE={world}: launch with torchrun, which sets both, "
            f"or unset WORLD_SIZE to run one process"
        )
    return rank


def _environment_number(name: str, default: int) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"{name}={text!r} is not a whole number; launch with torchrun, or unset {name}") from None


WAIT_FOR_OTHER_RANKS = timedelta(hours=24)


@contextmanager
def process_group(device: torch.device):
    """(rank, world size): (0, 1) when not launched by torchrun."""
    if not launched_by_torchrun():
        yield 0, 1
        return
    torchrun_rank()  # RANK checked against WORLD_SIZE
    if dist.is_initialized():  # inside a command that already joined the group
        yield dist.get_rank(), dist.get_world_size()
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # gloo on every device: the ranks exchange Python objects on the host (class moments,
    # bench results), not GPU tensors, and a rank waits as long as another's share of a
    # benchmark takes, hours perhaps, where NCCL's watchdog would abort after 10 minutes
    dist.init_process_group("gloo", timeout=WAIT_FOR_OTHER_RANKS)
    try:
        yield dist.get_rank(), dist.get_world_size()
        dist.barrier()  # no rank tears its connections down while another is still using them
    finally:
        dist.destroy_process_group()


def rank_device(device: torch.device) -> torch.device:
    """Under torchrun each rank takes the GPU of its LOCAL_RANK."""
    if not (launched_by_torchrun() and device.type == "cuda"):
        return device
    if device.index is not None:  # every rank on one GPU: NCCL refuses it, and they would share its memory
        raise UsageError(
            f"`device` {device} under torchrun would put every rank on one GPU; give `device` cuda "
            f"(or auto): each rank takes the GPU of its LOCAL_RANK"
        )
    local = _environment_number("LOCAL_RANK", 0)
    if not 0 <= local < torch.cuda.device_count():
        raise UsageError(
            f"LOCAL_RANK={local}, but this machine has {torch.cuda.device_count()} GPU(s); "
            f"launch at most that many processes per node (torchrun --nproc-per-node)"
        )
    return torch.device("cuda", local)


def gather_on_root(value, rank: int, world: int) -> list | None:
    """Every rank's `value`, in rank order, on rank 0; None on the other ranks."""
    if world == 1:
        return [value]
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(value, gathered, dst=0)
    return gathered


def merge_on_root(moments: ClassMoments, rank: int, world: int) -> ClassMoments | None:
    """All ranks' moments merged on rank 0 (Chan's update); None on the other ranks."""
    parts = gather_on_root(moments, rank, world)
    if parts is None:
        return None
    merged = parts[0]
    for other in parts[1:]:
        merged.absorb(other)
    return merged


def wait_for_all(world: int) -> None:
    if world > 1:
        dist.barrier()


def why_domains_depend(method: str, reset: str, mix_domains: bool) -> tuple[str, str | None] | None:
    """Why a stream's domains must run one after another in one process, and the setting that
    would free them (None where none would); None when each domain can run by itself (on any
    rank) and give what it gives in the whole stream: it starts from the source weights and
    draws no random numbers that the domains before it drew."""
    if reset not in ("domain", "episodic"):
        return f"`reset` {reset} carries the weights from one domain into the next", "give `reset` domain"
    if mix_domains:
        return "`mix_domains` makes the domains one stream", "drop `mix_domains`"
    # a domain's draws go on from where the domains before it left torch's generator, so adapted
    # by itself on another rank it would draw other numbers; a plug-in may draw too: it is not made yet
    if is_plugin(method) or (method in REGISTRY and method_class(method).draws_random_numbers):
        return f"`method` {method} draws random numbers, each domain from where the one before left them", None
    return None


def block(count: int, rank: int, world: int) -> range:
    """This rank's share of `count` items in order, as one run of consecutive items: rank 0
    the first ones, and the larger shares first, so that what rank 0 writes as it goes
    comes first and is as much as can be."""
    return range(-(-count * rank // world), -(-count * (rank + 1) // world))


class RankMonitor(Monitor):
    """A rank's monitor. Rank 0's shows what it is told as it comes (through `shown`);
    another rank's shows nothing and keeps its notes and warnings (`said`) for rank 0 to
    show once the ranks' results are gathered (show_other_ranks). Each keeps its warnings."""

    def __init__(self, shown: Monitor | None):
        super().__init__()
        self.shown, self.notes, self.warnings = shown, [], []

    def start(self, description: str, total: int) -> None:
        if self.shown:
            self.shown.start(description, total)

    def advance(self, images: int, status: str = "") -> None:
        if self.shown:
            self.shown.advance(images, status)

    def warn(self, message: str) -> None:
        self.warnings.append(message)
        if self.shown:
            self.shown.warn(message)

    def info(self, message: str) -> None:
        if self.shown:
            self.shown.info(message)
        else:
            self.notes.append(message)

    def said(self) -> tuple[list[str], list[str]]:
        return self.notes, self.warnings


def show_other_ranks(root: RankMonitor, said: list[tuple[list[str], list[str]]]) -> None:
    """On rank 0, what every rank said (`said`, in rank order): the other ranks' notes under
    their rank, their warnings once each (not those rank 0 has already given)."""
    given = set(root.warnings)
    for rank, (notes, warnings) in enumerate(said[1:], start=1):
        for note in notes:
            root.info(f"rank {rank}: {note}")
        for warning in warnings:
            if warning not in given:
                given.add(warning)
                root.warn(warning)
