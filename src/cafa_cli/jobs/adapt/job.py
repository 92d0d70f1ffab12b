"""A prepared `adapt` job (Adaptation): the adapter, its domains and settings; the
cautions worth a warning before and during the stream, and the stream itself."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from cafa_cli.core.errors import UsageError, listing
from cafa_cli.data.benchmarks import benchmark_of
from cafa_cli.data.domain import Domain, padding_note
from cafa_cli.data.outliers import Outliers
from cafa_cli.data.pace import WAITS, Pace, parse_step_cost, parse_stream_rate, rate_label
from cafa_cli.data.preprocessing import Preprocessing
from cafa_cli.engine.adapter import Adapter
from cafa_cli.engine.method import Method
from cafa_cli.jobs.adapt.stream import StreamEvents, adapt_domains
from cafa_cli.jobs.config import AdaptConfig
from cafa_cli.jobs.shared.clean import adapted_error
from cafa_cli.jobs.shared.inputs import _skip_warning
from cafa_cli.jobs.shared.monitor import Monitor
from cafa_cli.jobs.shared.report import ERROR_FRACTION, short_name
from cafa_cli.jobs.shared.results import DomainResult
from cafa_cli.jobs.shared.what_runs import constant_outputs, constant_outputs_note, size_note, statistics_input_size
from cafa_cli.methods import is_plugin
from cafa_cli.methods.recipes import Recipe, table_cost


@dataclass
class Adaptation:
    """A prepared `adapt` job: the model, its domains and class names, ready to run."""

    adapter: Adapter
    domains: list[Domain]
    preprocess: Preprocessing
    class_names: list[str]
    config: AdaptConfig
    recorded_settings: dict  # every setting, for the metrics JSON
    statistics_preprocess: Preprocessing | None = None  # the artifact's, when there is one
    statistics_sampling: dict | None = None  # the artifact's record of the images the statistics came from
    groups: list[int] | None = (
        None  # `gradual`: the corruption of each domain (a severity), which --reset domain resets at
    )
    notes: list[str] = field(default_factory=list)  # what opening the data noticed beyond the domains' own notes
    clean: dict | None = None  # the source model's error on `clean`, when given
    recipe: Recipe | None = None  # the published setting the run took what the user did not choose from
    forgetting: Domain | None = None  # the clean domain predicted after each test domain (`forgetting`)
    outliers: Outliers | None = None  # the images from outside the label set mixed into each stream (`outliers`)
    # what the last run() found beyond the domains' errors: the stream's pace, the forgetting errors
    protocol: dict = field(default_factory=dict)
    consistency: bool = False  # measure each batch's agreement with its flip (StreamSettings.consistency)

    def cautions(self) -> list[str]:
        """What the data or settings do that runs but quietly hurts the results, worth a warning."""
        domains = list({id(domain): domain for domain in self.domains}.values())  # `gradual` visits a severity twice
        notes = [*self.notes, *(note for domain in domains for note in domain.notes)]
        notes += [note for note in (padding_note(domain, self.preprocess) for domain in domains) if note]
        s = self.config
        method = self.adapter.method
        without = method.without_source_images
        if without and not s.source_data:
            notes.append(
                f"--method {s.method} without --source-data {without}; give --source-data PATH (e.g. the "
                f"training images)"
            )
        if (
            self.adapter.batch_norms == 0
            and method.adapts_normalisation
            and not method.trains
            and not method.owns_update
            and type(method).output is Method.output
        ):  # it would only renormalise, and there is nothing to renormalise
            notes.append(
                f"the model has no BatchNorm layers, so `method` {s.method} gives the same predictions as source"
            )
        if s.norm.kind != "batch" and not self.adapter.batch_norms:
            notes.append(
                f"`norm` {s.norm} changes nothing here: "
                + (
                    "the model has no BatchNorm layers"
                    if self.adapter.method.adapts_normalisation
                    else f"`method` {s.method} keeps its own normalisation statistics"
                )
            )
        if s.batch_size == 1 and self._batch_statistics():
            notes.append(
                "`batch_size` 1 normalises each image by its own statistics, which costs accuracy; "
                "add `norm` prior:16 (source statistics as a prior) or raise `batch_size`"
            )
        grouped = [short_name(d.name) for d in domains if _one_class_after_another(d.labels)]
        if not s.shuffle and s.method != "source" and grouped:
            notes.append(
                f"--no-shuffle streams {listing(grouped)} one class after another: each batch holds about one class, "
                f"which its normalisation and updates adapt to, and the error rises; drop --no-shuffle"
            )
        stored_cropped = [d for d in s.data if (benchmark_of(d) or ("",))[0] == "imagenet-c"]
        if stored_cropped and (self.preprocess.resize or self.preprocess.crop):
            # RobustBench #59: resizing and cropping them again zooms in and costs accuracy silently
            notes.append(
                f"{listing(stored_cropped)}: ImageNet-C's images are stored 224x224, already resized and cropped; "
                f"{_geometry(self.preprocess)} changes them again: give `resize` none `crop` none"
            )
        made = self.statistics_preprocess
        if made and (made.resize, made.crop) != (self.preprocess.resize, self.preprocess.crop):
            notes.append(
                f"{_geometry(self.preprocess)} differ from the statistics' ({_geometry(made)}): right for test images "
                "stored already cropped "
                f"(ImageNet-C); otherwise the features will not match the statistics"
            )
        if made and (made.channels, made.per_channel()) != (self.preprocess.channels, self.preprocess.per_channel()):
            notes.append(
                f"`mean`/`std`/`channels` differ from the statistics' (mean {list(made.mean)}, std {list(made.std)}, "
                f"{made.channels} channel(s)): the features will not match the statistics"
            )
        return notes

    def _batch_statistics(self) -> bool:
        """Whether each batch is normalised by its own statistics (class-balanced: corrected, but its own)."""
        return self.adapter.settings.norm.batch_alone and self.adapter.batch_norms > 0

    def batch_cautions(self) -> list[str]:
        """The cautions about how the domains' images fall into batches (a last batch of one
        image, a domain of one batch): said at the first batch read, so that a domain none
        of whose images can be read gets its error alone."""
        s, notes = self.config, []
        domains = list({id(domain): domain for domain in self.domains}.values())

        def streamed(domain) -> int:  # its images, and the outliers mixed in beside them
            return len(domain) + (self.outliers.count(len(domain)) if self.outliers else 0)

        streams = (
            {f"{len(self.domains)} domains mixed": sum(map(streamed, self.domains))}
            if s.mix_domains
            else {short_name(d.name): streamed(d) for d in domains}
        )
        alone = [name for name, n in streams.items() if n % s.batch_size == 1]
        if s.batch_size > 1 and self._batch_statistics() and alone:
            notes.append(
                f"the last batch of {listing(alone)} holds 1 image, normalised by its own statistics; "
                f"choose a `batch_size` that leaves more, or add `norm` prior:16"
            )
        one_batch = [name for name, n in streams.items() if 0 < n <= s.batch_size]
        if self.adapter.method.predicts_before_update and s.reset == "domain" and one_batch:
            # each batch is predicted before the update it gives (the online protocol)
            notes.append(
                f"{listing(one_batch)} fit{'s' if len(one_batch) == 1 else ''} in one batch of `batch_size` "
                f"{s.batch_size}, "
                f"predicted before any update: {s.method} cannot differ from bn there; lower `batch_size`"
            )
        return notes

    def run(
        self, on_records=lambda records: None, monitor: Monitor | None = None, warned: set[str] | None = None
    ) -> list[DomainResult]:
        """The stream; warnings to `monitor`, each of the batch cautions once (not again when in
        `warned`, which gets them: a bench's runs share one)."""
        monitor = monitor or Monitor()
        warned = set() if warned is None else warned
        outputs_checked = []
        statistics_size = statistics_input_size(self.statistics_preprocess, self.statistics_sampling)

        def first_batch(domain, images, logits):
            # once a stream, and the check that reads the logits (a wait for the device) once a run
            note = size_note(short_name(domain.name), images, statistics_size, self.statistics_preprocess)
            if note:
                monitor.warn(note)
            if not outputs_checked:
                outputs_checked.append(True)
                for caution in self.batch_cautions():
                    if caution not in warned:
                        warned.add(caution)
                        monitor.warn(caution)
                if constant_outputs(logits):
                    monitor.warn(constant_outputs_note(short_name(domain.name), len(logits)))

        def records(batch_records, so_far: DomainResult):
            monitor.advance(len(batch_records), f"err {100 * so_far.error:.1f}%" if so_far.labelled else "")
            on_records(batch_records)

        s = self.config
        domains, groups = self._rounds()
        pace = self.pace()
        forgotten = []

        def stream_end(members: list[int]) -> None:
            if self.forgetting is not None:
                error = adapted_error(
                    self.adapter, self.forgetting, self.preprocess, s.batch_size, s.num_workers, s.strict, monitor
                )
                last = members[-1]
                after = domains[last].name if len(members) == 1 else f"{len(members)} domains mixed"
                forgotten.append(
                    {"after": after, "round": last // len(self.domains) + 1, **error, "unit": ERROR_FRACTION}
                )

        events = StreamEvents(
            on_records=records,
            on_skip=lambda ref, why: monitor.warn(_skip_warning(ref, why)),
            on_domain=lambda domain: monitor.start(short_name(domain.name), len(domain)),
            on_first_batch=first_batch,
            on_stream_end=stream_end,
        )
        results = adapt_domains(
            self.adapter,
            domains,
            self.preprocess,
            replace(s.stream_settings(), consistency=self.consistency),
            groups=groups,
            events=events,
            pace=pace,
            typed_options=set(s.method_options()),
            outliers=self.outliers,
        )
        for k, result in enumerate(results):
            result.round = k // len(self.domains) + 1 if s.rounds > 1 else None
            result.paced = not pace.waits
        self.protocol = {
            **({"stream": pace_record(pace, results)} if not pace.waits else {}),
            **({"rounds": round_errors(results)} if s.rounds > 1 else {}),
            **({"forgetting": forgotten} if self.forgetting is not None else {}),
        }
        for result in results:
            # fp16's loss scaler skips a few steps by design while it settles; otherwise a
            # skipped update means the objective itself is broken and the run is bn's
            if result.skipped_steps and s.precision != "fp16":
                monitor.warn(
                    f"{short_name(result.data)}: {result.skipped_steps} update(s) skipped because the loss or its "
                    f"gradients were not finite; check the statistics (cafa inspect) and lower `lr`"
                )
            if result.undefined_batches:
                method = self.adapter.method
                monitor.warn(
                    f"{short_name(result.data)}: no update on {result.undefined_batches} batch(es): "
                    f"{method.name}'s update is undefined for {method.undefined_when}"
                )
            if result.unrefined_batches:
                monitor.warn(
                    f"{short_name(result.data)}: in {result.unrefined_batches} batch(es) more classes needed their "
                    f"distances recomputed against float32 rounding than a batch recomputes; the rest kept the "
                    f"faster form's rounding error"
                )
        self.recorded_settings["step_runner"] = self.adapter.step_runner  # graph, or eager and why (step_graph.py)
        graph = self.adapter.graph
        if graph is not None and graph.failed and graph.failed not in warned:
            warned.add(graph.failed)
            monitor.warn(
                f"the steps ran eagerly: {graph.failed}; the predictions are the eager step's (--no-cuda-graph "
                f"skips the attempt)"
            )
        return results

    def _rounds(self) -> tuple[list[Domain], list[int] | None]:
        """The domains in stream order, the whole sequence `rounds` times, and their groups
        (`reset` domain starts afresh where the group changes: at each domain, or with
        `gradual` at each corruption, of every round)."""
        rounds = self.config.rounds
        if rounds == 1:
            return self.domains, self.groups
        groups = self.groups if self.groups is not None else list(range(len(self.domains)))
        span = max(groups) + 1
        return self.domains * rounds, [group + r * span for r in range(rounds) for group in groups]

    def pace(self) -> Pace:
        """The stream's pace (data/pace.py): a method's step cost from the table, a number
        given, or None to measure it."""
        s = self.config
        rate = parse_stream_rate(s.stream_rate)
        if rate == WAITS:
            return Pace()
        kind, given = parse_step_cost(s.step_cost)
        if kind == "measured":
            return Pace(rate)
        cost = given.get(s.method, given.get(None))
        if cost is not None:
            return Pace(rate, cost, "given")
        cost = None if is_plugin(s.method) else table_cost(s.method)
        if cost is None:
            raise UsageError(
                f"`stream_rate` {s.stream_rate} needs the step cost of {s.method}, which `cafa methods` has no "
                f"cost for; give `step_cost` K (forward passes of the source model) or measured"
            )
        return Pace(rate, cost, "table")


def pace_record(pace: Pace, results: list[DomainResult]) -> dict:
    """What the JSON and the summary report of a stream that does not wait: the rate, the
    step cost k and where it came from, and the share of batches adapted on."""
    batches = sum(r.batches for r in results)
    return {
        "rate": rate_label(pace.rate),
        "cost": pace.mean_cost(),
        "cost_from": pace.cost_source(),
        "adapted_share": sum(r.adapted_batches for r in results) / batches if batches else None,
    }


def round_errors(results: list[DomainResult]) -> list[dict]:
    """The error of each pass over the domains (`rounds`), over its labelled images."""
    rounds: dict[int, list[DomainResult]] = {}
    for result in results:
        rounds.setdefault(result.round, []).append(result)
    return [
        {
            "round": number,
            "n": sum(r.n for r in part),
            "error": sum(r.errors for r in part) / labelled if (labelled := sum(r.labelled for r in part)) else None,
            "unit": ERROR_FRACTION,
        }
        for number, part in rounds.items()
    ]


def stream_units(job: Adaptation) -> int:
    """How many parts the stream starts afresh at under `reset` domain: its corruptions with
    `gradual` (each a run of severities), else its domains."""
    return len(set(job.groups)) if job.groups is not None else len(job.domains)


def part_of(job: Adaptation, units) -> Adaptation:
    """The job on the domains of `units` only (stream_units' numbers, in stream order), the
    same adapter starting afresh at each unit as the whole stream does at `reset` domain;
    with `gradual`, each unit's severities numbered as a corruption of the part."""
    units = list(units)
    groups = job.groups if job.groups is not None else range(len(job.domains))
    kept = [k for k, group in enumerate(groups) if group in units]
    return replace(
        job,
        domains=[job.domains[k] for k in kept],
        groups=[units.index(groups[k]) for k in kept] if job.groups is not None else None,
    )


# what to do when the test data has another number of classes than the model's outputs


def _one_class_after_another(labels: np.ndarray) -> bool:
    """Labels in runs of one class each (class folders, in whatever order the folder names
    sort against the model's classes), over more than one class."""
    known = labels[labels >= 0]
    classes = len(np.unique(known))
    return classes > 1 and int((np.diff(known) != 0).sum()) == classes - 1


def _geometry(recipe: Preprocessing) -> str:
    return f"resize {recipe.resize or 'none'}, crop {recipe.crop or 'none'}"
