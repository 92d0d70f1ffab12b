"""The online loop: domains in, one record per image and per-domain results out."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cafa_cli.core.errors import InputError
from cafa_cli.core.interrupts import whole
from cafa_cli.data.domain import UNLABELLED, Domain
from cafa_cli.data.loading import Batch, batches, unreadable
from cafa_cli.data.orders import stream_order
from cafa_cli.data.outliers import Outliers, with_outliers
from cafa_cli.data.pace import Pace
from cafa_cli.data.preprocessing import Preprocessing
from cafa_cli.data.values import parse_reset
from cafa_cli.engine.adapter import Adapter
from cafa_cli.engine.method import Method
from cafa_cli.engine.options import shown
from cafa_cli.jobs.config.settings import StreamSettings
from cafa_cli.jobs.shared.results import DomainResult, Record


@dataclass(frozen=True)
class StreamEvents:
    """What the loop tells its caller as it goes; each does nothing unless given. `on_records`
    gets each batch's records and the result so far of their domain (of the whole stream when
    mixed); `on_skip` each unreadable image and why; `on_domain` each stream as it starts (a
    domain, or the mixed one); `on_first_batch` each stream's first batch of images (uint8
    pixels) and their logits, before their records are made; `on_stream_end` the domains of each
    stream as it ends (one, or all when mixed)."""

    on_records: Callable[[list[Record], DomainResult], None] = lambda records, so_far: None
    on_skip: Callable[[str, str], None] = lambda ref, why: None
    on_domain: Callable[[Domain], None] = lambda domain: None
    on_first_batch: Callable[[Domain, torch.Tensor, torch.Tensor], None] | None = None
    on_stream_end: Callable[[list[int]], None] = lambda members: None


def adapt_domains(
    adapter: Adapter,
    domains: list[Domain],
    preprocess: Preprocessing,
    settings: StreamSettings = StreamSettings(),
    *,
    groups: Sequence[int] | None = None,
    events: StreamEvents = StreamEvents(),
    pace: Pace | None = None,
    typed_options: Collection[str] | None = None,
    outliers: Outliers | None = None,
) -> list[DomainResult]:
    """Adapt over the domains in order, predicting each batch before updating on it;
    one result per domain.

    `settings.reset`: `domain` starts each domain from the source weights, `episodic` restores
    them after every batch, `never` adapts continually across domains, `every:N` too but
    restores them after every N batches that updated (RDumb's schedule), counted across
    domains. With `groups` (a number per domain) `domain` resets only where the number
    changes: at each corruption of the gradual setting, not at each of its severities.
    `settings.order` orders each domain's images (data/orders.py). `settings.mix_domains` makes
    the domains one stream, ordered as one. `settings.oracle` gives the method each batch's true
    labels for its loss (CAFA-Oracle; every image must be labelled). `events` hears of the
    records, the skipped images and the streams as they go (StreamEvents). `pace`: a stream
    that does not wait (data/pace.py): the batches that arrive while the method is busy are
    predicted by the model as adapted so far, without adapting.
    `typed_options`: the method options the user gave, which outputs that turn NaN name as a
    suspect when away from their defaults (None: every option away from its default, as the
    caller built the method). `outliers`: images from outside the label set mixed into each
    stream (data/outliers.py), unlabelled, adapted on as the others, and marked in the records
    with their in-distribution score (Method.id_score); the results keep every image's score.
    """
    pace = pace or Pace()
    policy, period = parse_reset(settings.reset)
    updates = 0  # batches adapted on since the last reset (`every:N`)
    groups = list(range(len(domains))) if groups is None else list(groups)
    # the stream order has its own generator; this one is for whatever else draws from
    # torch's (a factory model's noise, the loader's worker seeds): --seed repeats a run
    torch.manual_seed(settings.seed)
    open_world = outliers is not None and outliers.share > 0
    results = [_result(domain.name, open_world) for domain in domains]
    one_stream = settings.mix_domains and len(domains) > 1
    streams = [list(range(len(domains)))] if one_stream else [[k] for k in range(len(domains))]
    for members in streams:
        first = members[0]
        if policy == "domain" and first > 0 and groups[first] != groups[first - 1]:
            adapter.reset()
            pace.restart()  # a stream afresh, as each domain is run on its own
        if len(members) == 1:
            domain, owner, so_far = domains[first], np.full(len(domains[first]), first), results[first]
        else:
            domain, owner = mixed([domains[k] for k in members])
            so_far = _result(domain.name, open_world)
        if domain.ordered:
            positions = np.arange(len(domain))
        else:
            positions = stream_order(domain.labels, settings.order, settings.shuffle, settings.seed, domain.name)
        inliers = len(domain)  # the positions from here on are outliers'
        if open_world:
            counts = [outliers.count(len(domains[k])) for k in members]  # each domain its share
            domain, positions = with_outliers(
                domain, positions, outliers, sum(counts), settings.seed, preprocess.channels
            )
            owner = np.concatenate([owner, np.repeat(members, counts)])
        events.on_domain(domain)
        # the counts live on the device and are read before and after the stream (a read waits
        # for it); a mixed stream reads them after every batch, to give each domain its batches'
        clock, before = time.perf_counter(), _counts(adapter)
        first = events.on_first_batch
        for batch in batches(domain, preprocess, settings.batch_size, positions, settings.num_workers, adapter.device):
            for (i, _), (ref, why) in zip(batch.failures, unreadable(domain, batch, settings.strict)):
                for result in _tallies(results[owner[i]], so_far):
                    result.skipped_images.append(ref)
                events.on_skip(ref, why)
            adapts = batch.images is None or pace.adapts()
            flipped = _flipped_predictions(adapter, preprocess, batch) if settings.consistency else None
            records = _step(
                adapter,
                domain,
                preprocess,
                batch,
                first,
                settings.oracle,
                pace if adapts else None,
                typed_options,
                inliers if open_world else None,
            )
            first = first if batch.images is None else None
            for k, (i, record) in enumerate(zip(batch.indices, records)):
                for result in _tallies(results[owner[i]], so_far):
                    result.n += 1
                    result.entropy_sum += record.entropy
                    if flipped is not None:
                        result.consistent = (result.consistent or 0) + (record.prediction == flipped[k])
                    if record.label != UNLABELLED:
                        result.labelled += 1
                        result.errors += record.prediction != record.label
                        result.calibration.add(record)
                    if open_world:
                        (result.outlier_scores if record.outlier else result.inlier_scores).append(record.id_score)
            if batch.images is not None:
                for k in np.unique(owner[batch.indices]):
                    for result in _tallies(results[k], so_far):
                        result.batches += 1
                        result.adapted_batches += adapts
            events.on_records(records, so_far)
            if not adapts:  # predicted while the method was busy: nothing changed, nothing to reset or count
                pass
            elif policy == "episodic":
                adapter.reset()
            elif policy == "every" and batch.images is not None:
                updates += 1
                if updates == period:
                    adapter.reset()
                    updates = 0
            if len(members) > 1:  # the batch's time and skipped updates go to the domains of its images
                now, in_batch = (
                    time.perf_counter(),
                    np.bincount(owner[[*batch.indices, *(i for i, _ in batch.failures)]], minlength=len(domains)),
                )
                counts = _counts(adapter)
                for k in np.flatnonzero(in_batch):
                    results[k].seconds += (now - clock) * in_batch[k] / in_batch.sum()
                    _add_counts(results[k], counts, before)
                clock, before = now, counts
        if len(members) == 1:
            so_far.seconds = time.perf_counter() - clock
            _add_counts(so_far, _counts(adapter), before)
        for k in members:
            if results[k].n == results[k].outliers and results[k].skipped_images:
                raise InputError(
                    f"{domains[k].name}: none of its {len(results[k].skipped_images)} image(s) could be read (see the "
                    f"warnings); check the files, or leave the domain out"
                )
        events.on_stream_end(members)
    return results


def _result(name: str, open_world: bool) -> DomainResult:
    """A domain's result to tally into; with outliers in the stream, with its images' scores."""
    return DomainResult(name, inlier_scores=[], outlier_scores=[]) if open_world else DomainResult(name)


def _tallies(result: DomainResult, stream: DomainResult) -> tuple[DomainResult, ...]:
    """Where an image counts: its domain's result, and the whole stream's when mixed."""
    return (result,) if result is stream else (result, stream)


def mixed(domains: list[Domain]) -> tuple[Domain, np.ndarray]:
    """The domains as one (`mix_domains`), and the domain each of its positions comes from."""
    owner = np.concatenate([np.full(len(domain), k) for k, domain in enumerate(domains)])
    offsets = np.cumsum([0, *(len(domain) for domain in domains)])

    def read(i: int):
        k = owner[i]
        return domains[k].read(int(i - offsets[k]))

    whole = Domain(
        f"{len(domains)} domains mixed",
        [ref for domain in domains for ref in domain.refs],
        np.concatenate([domain.labels for domain in domains]),
        domains[0].class_names,
        read,
    )
    return whole, owner


def _step(
    adapter: Adapter,
    domain: Domain,
    preprocess: Preprocessing,
    batch: Batch,
    on_logits: Callable[[Domain, torch.Tensor, torch.Tensor], None] | None = None,
    oracle: bool = False,
    pace: Pace | None = None,
    typed_options: Collection[str] | None = None,
    outliers_from: int | None = None,
) -> list[Record]:
    """The batch's records: from an adaptation step, told to `pace`; without one (the method
    busy), from the model as adapted so far, changing nothing (Adapter.features). With
    `outliers_from`, the domain's positions from it on are outliers, and each record says
    whether it is one, with its in-distribution score."""
    if batch.images is None:
        return []
    images = preprocess.normalize(batch.images.to(adapter.device, non_blocking=True))
    if pace is None:
        logits, _ = adapter.features(images)
    else:
        logits = _adapt(adapter, domain, batch, images, oracle, pace)
    if on_logits is not None:
        on_logits(domain, batch.images, logits)
    return _records(domain, batch, logits, adapter.method, typed_options, outliers_from)


def _flipped_predictions(adapter: Adapter, preprocess: Preprocessing, batch: Batch) -> list[int] | None:
    """The batch's predictions by the model as the step will find it, each image flipped left to
    right, changing nothing (Adapter.features): the consistency surrogate of Cygert et al. (2024)
    under the one augmentation every image keeps its class through."""
    if batch.images is None:
        return None
    images = preprocess.normalize(batch.images.to(adapter.device, non_blocking=True))
    return adapter.features(images.flip(-1))[0].argmax(1).tolist()


def _adapt(
    adapter: Adapter, domain: Domain, batch: Batch, images: torch.Tensor, oracle: bool, pace: Pace
) -> torch.Tensor:
    """One adaptation step's logits; its cost in forward passes told to `pace` (measured when
    it has none: the step's time over a forward pass of the same batch, as Alfarra et al. time it)."""
    if oracle:  # the labels of the images read, in the batch's order; only the method's loss reads them
        adapter.method.oracle_labels = torch.as_tensor(domain.labels[batch.indices], dtype=torch.int64).to(
            adapter.device, non_blocking=True
        )
    measure = pace.cost is None and not pace.waits
    started = _now(adapter) if measure else 0.0
    with whole():  # a signal waits for the step: the state is never half a batch's (core/interrupts.py)
        logits = adapter.step(images)
    if measure:
        step = _now(adapter) - started
        if pace.twin is None:  # made once: the network as the stream found it, with its normalisation
            pace.twin = copy.deepcopy(adapter.model).requires_grad_(False)
        pace.step_done(step / _forward_seconds(adapter, pace.twin, images))
    elif not pace.waits:
        pace.step_done()
    return logits


def _forward_seconds(adapter: Adapter, twin: torch.nn.Module, images: torch.Tensor) -> float:
    """A forward pass of the batch through a copy of the network (so that no statistics of
    the adapter's move), timed as the step was."""
    started = _now(adapter)
    with torch.no_grad(), adapter.autocast:
        twin(images)
    return max(_now(adapter) - started, 1e-9)


def _now(adapter: Adapter) -> float:
    """The time once the device has finished what was queued (a GPU runs ahead of the host)."""
    if adapter.device.type == "cuda":
        torch.cuda.synchronize(adapter.device)
    return time.perf_counter()


def _records(
    domain: Domain,
    batch: Batch,
    logits: torch.Tensor,
    method: Method,
    typed_options: Collection[str] | None = None,
    outliers_from: int | None = None,
) -> list[Record]:
    if bool(logits.isnan().any() | logits.isposinf().any() | (logits.amax(1) == float("-inf")).any()):
        # every prediction would be class 0 with confidence NaN, and the error a number;
        # -inf alone is a masked class, which some models use. A recipe's options are its
        # published values, not a slip to point at: only those the user gave are named
        changed = [
            f"{option.name}={shown(getattr(method, option.name))}"
            for option in method.options
            if getattr(method, option.name, option.default) != option.default
            and (typed_options is None or option.name in typed_options)
        ]
        raise InputError(
            f"{domain.name}: the model's outputs are NaN or infinite; check "
            + (f"the method's options set away from their defaults ({', '.join(changed)}), " if changed else "")
            + "`mean` and `std` (a tiny `std` overflows) and the weights (out-of-range or non-float values), "
            "or lower `lr`"
        )
    probabilities = logits.softmax(1)
    confidence, prediction = probabilities.max(1)
    entropy = torch.special.entr(probabilities).sum(1)  # 0 log 0 = 0: a masked class adds nothing
    labels = domain.labels[batch.indices]
    nll, brier = calibration_terms(logits, labels)
    records = []
    for i, p, label, c, n, b, h in zip(
        batch.indices,
        prediction.tolist(),
        labels.tolist(),
        confidence.tolist(),
        nll.tolist(),
        brier.tolist(),
        entropy.tolist(),
    ):
        labelled = label != UNLABELLED
        records.append(Record(domain.refs[i], p, label, c, n if labelled else None, b if labelled else None, entropy=h))
    if outliers_from is not None:
        for record, i, score in zip(records, batch.indices, method.id_score(logits).tolist()):
            record.outlier, record.id_score = i >= outliers_from, float(score)
    return records


def calibration_terms(logits: torch.Tensor, labels: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Each image's −log of its label's probability (nats) and its Brier score Σ_k (p_k − y_k)²,
    of the probabilities the method reports (the softmax of its outputs), in float64 so that a
    confident right answer's NLL is not rounded to 0; an unlabelled image's are meaningless."""
    log_probabilities = logits.double().log_softmax(1)
    target = torch.as_tensor(labels, dtype=torch.int64).clamp_min(0).to(logits.device)
    one_hot = torch.nn.functional.one_hot(target, logits.shape[1])
    nll = -log_probabilities.gather(1, target[:, None]).squeeze(1)
    brier = (log_probabilities.exp() - one_hot).square().sum(1)
    return nll.cpu(), brier.cpu()


# the Adapter's counts a DomainResult sums
COUNTS = (
    "skipped_steps",
    "undefined_batches",
    "unrefined_batches",
    "kept_samples",
    "domain_changes",
    "source_restarts",
)


def _counts(adapter: Adapter) -> dict[str, int | None]:
    return {name: getattr(adapter, name) for name in COUNTS}


def _add_counts(result: DomainResult, counts: dict, before: dict) -> None:
    """The counts since `before` added to a domain's; kept_samples, domain_changes and
    source_restarts stay None for a method that filters nothing or detects no change."""
    for name in COUNTS:
        if counts[name] is not None:
            setattr(result, name, (getattr(result, name) or 0) + counts[name] - before[name])
