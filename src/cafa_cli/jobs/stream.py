"""The online loop: domains in, one record per image and per-domain results out."""

from __future__ import annotations

import time
from collections.abc import Callable
import numpy as np
import torch
from cafa_cli.jobs.results import DomainResult, Record
from cafa_cli.method.adapter import Adapter
from cafa_cli.data.domain import UNLABELLED, Domain
from cafa_cli.data.loading import Batch, batches, unreadable
from cafa_cli.errors import InputError, UsageError
from cafa_cli.data.preprocessing import Preprocessing


RESET_POLICIES = ("domain", "episodic", "never")


def check_reset(reset: str) -> None:
    if reset not in RESET_POLICIES:
        raise UsageError(f"--reset must be one of {', '.join(RESET_POLICIES)}, not {reset}")


def stream_order(n: int, shuffle: bool, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).permutation(n) if shuffle else np.arange(n)


def adapt_domains(
    adapter: Adapter,
    domains: list[Domain],
    preprocess: Preprocessing,
    batch_size: int = 200,
    reset: str = "domain",
    shuffle: bool = True,
    seed: int = 0,
    num_workers: int | None = None,
    strict: bool = False,
    on_records: Callable[[list[Record], DomainResult], None] = lambda records, so_far: None,
    on_skip: Callable[[str, str], None] = lambda ref, why: None,
    on_domain: Callable[[Domain], None] = lambda domain: None,
) -> list[DomainResult]:
    """Adapt over the domains in order, predicting each batch before updating on it.

    reset: `domain` starts each domain from the source weights, `episodic` restores
    them after every batch, `never` adapts continually across domains. `on_records`
    gets each batch's records and the domain's result so far.
    """
    check_reset(reset)
    # the stream order has its own generator; this one is for whatever else draws from
    # torch's (a factory model's noise, the loader's worker seeds): --seed repeats a run
    torch.manual_seed(seed)
    results = []
    for k, domain in enumerate(domains):
        if reset == "domain" and k > 0:
            adapter.reset()
        on_domain(domain)
        result = DomainResult(domain.name)
        # each count is read once before and once after the domain: a read waits for the device
        start, skipped_before, unrefined_before = time.perf_counter(), adapter.skipped_steps, adapter.unrefined_batches
        order = stream_order(len(domain), shuffle, seed)
        for batch in batches(domain, preprocess, batch_size, order, num_workers, adapter.device):
            for ref, why in unreadable(domain, batch, strict):
                result.skipped_images.append(ref)
                on_skip(ref, why)
            records = _step(adapter, domain, preprocess, batch)
            for record in records:
                result.n += 1
                if record.label != UNLABELLED:
                    result.labelled += 1
                    result.errors += record.prediction != record.label
            on_records(records, result)
            if reset == "episodic":
                adapter.reset()
        if result.n == 0 and result.skipped_images:
            raise InputError(
                f"{domain.name}: none of its {len(result.skipped_images)} image(s) could be read (see the warnings); "
                f"check the files, or leave the domain out"
            )
        result.skipped_steps = adapter.skipped_steps - skipped_before
        result.unrefined_batches = adapter.unrefined_batches - unrefined_before
        result.seconds = time.perf_counter() - start
        results.append(result)
    return results


def _step(adapter: Adapter, domain: Domain, preprocess: Preprocessing, batch: Batch) -> list[Record]:
    if batch.images is None:
        return []
    logits = adapter.step(preprocess.normalize(batch.images.to(adapter.device, non_blocking=True)))
    if bool(logits.isnan().any() | logits.isposinf().any() | (logits.amax(1) == float("-inf")).any()):
        # every prediction would be class 0 with confidence NaN, and the error a number;
        # -inf alone is a masked class, which some models use
        raise InputError(f"{domain.name}: the model's outputs are NaN or infinite; check --mean and --std (a tiny --std "
                         f"overflows) and the weights (out-of-range or non-float values), or lower --lr")
    probabilities = logits.softmax(1)
    confidence, prediction = probabilities.max(1)
    return [
        Record(domain.refs[i], int(p), int(domain.labels[i]), float(c))
        for i, p, c in zip(batch.indices, prediction.tolist(), confidence.tolist())
    ]
