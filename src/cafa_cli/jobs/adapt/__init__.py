"""`cafa adapt`: prepare the job (prepare.py), run the online stream (job.py, stream.py),
write the records and the metrics; under torchrun, the domains spread over the ranks."""

from __future__ import annotations

from dataclasses import replace

from cafa_cli.core.devices import pick_device
from cafa_cli.core.errors import UsageError, listing
from cafa_cli.data.domain import UNLABELLED, Domain
from cafa_cli.jobs.adapt.deployment import check_export, holding_state, load_state, save_state, write_export
from cafa_cli.jobs.adapt.job import part_of, short_name, stream_units
from cafa_cli.jobs.adapt.prepare import prepare_adaptation, unread_default_artifact
from cafa_cli.jobs.config import AdaptConfig
from cafa_cli.jobs.config.checks import factory_file
from cafa_cli.jobs.shared.clean import clean_summary
from cafa_cli.jobs.shared.distributed import (
    RankMonitor,
    block,
    gather_on_root,
    launched_by_torchrun,
    process_group,
    rank_device,
    show_other_ranks,
    why_domains_depend,
)
from cafa_cli.jobs.shared.monitor import Monitor
from cafa_cli.jobs.shared.outputs import check_outputs, guards_outputs
from cafa_cli.jobs.shared.report import metrics, prediction_records, protocol_lines, write_json
from cafa_cli.jobs.shared.results import DomainResult
from cafa_cli.jobs.shared.what_runs import adapting_line, recipe_line


@guards_outputs
def run(config: AdaptConfig, monitor: Monitor) -> list[DomainResult] | None:
    """The whole `adapt` command: the records to `config.predictions` (stdout when None),
    warnings to the monitor, the metrics to `config.metrics_json`; returns the results.
    Under torchrun each rank adapts its share of the domains (they are independent with
    `reset` domain); rank 0 writes every record in stream order and the metrics, and
    returns every result; the other ranks write nothing and return None."""
    if launched_by_torchrun():
        if config.export:
            raise UsageError(
                "`export` writes the network the whole stream arrived at, which torchrun spreads over its "
                "ranks: run it without torchrun"
            )
        check_spread(config)
        config = replace(config, device=str(rank_device(pick_device(config.device))))
    check_outputs(config.outputs(), config.inputs())
    with holding_state(config.state), process_group(pick_device(config.device)) as (rank, world):
        said = RankMonitor(monitor if rank == 0 else None)
        job = prepare_adaptation(config if rank == 0 else replace(config, clean=None), said)
        check_gate_has_labels(config, job.domains)
        if config.export:
            check_export(job.adapter, config.export)  # before any record is written, not after the stream
        # known only now: the paths stdin listed, and the model files an artifact named
        recorded = job.recorded_settings
        check_outputs(
            config.outputs(),
            {
                "`data` -": [ref for domain in job.domains if domain.name == "-" for ref in domain.refs],
                "artifact's model": factory_file(recorded["model"]),
                "artifact's weights": recorded["weights"],
            },
        )
        part = job
        if world > 1:
            part = part_of(job, block(stream_units(job), rank, world))
            said.info(
                f"adapting {', '.join(dict.fromkeys(short_name(domain.name) for domain in part.domains)) or 'nothing'}"
            )
        if rank > 0:
            kept = []  # this rank's records, batch by batch, for rank 0 to write after its own
            gather_on_root((kept, part.run(kept.append, said), said.said()), rank, world)
            return None
        scored = job.outliers is not None and job.outliers.share > 0
        with prediction_records(config.predictions, config.format, job.class_names, scored) as writer:
            unread = unread_default_artifact(config, job.preprocess)
            for caution in [*job.cautions(), *([unread] if unread else [])]:
                said.warn(caution)
            adapted = job.adapter.adapted()
            said.info(recipe_line(config.method, job.recorded_settings, job.adapter.method.trains))
            said.info(adapting_line(adapted, config.method))
            if job.clean:
                said.info(clean_summary(job.clean))
            if config.state:
                # a method whose state cannot be saved (foa's) says so before the first image, not after the last
                job.adapter.method.state_dict()
                went_on = load_state(job.adapter, config.state)
                said.info(
                    f"going on from the state in {config.state}"
                    if went_on
                    else f"no state in {config.state} yet: starting from the source model"
                )
            try:
                results = part.run(writer.write, said)
            except KeyboardInterrupt:
                if config.state:  # between two batches (core/interrupts.py): the state is a whole batch's
                    save_state(job.adapter, config.state)
                    said.info(f"interrupted: the state so far is saved in {config.state}")
                raise
            for line in protocol_lines(job.protocol):
                said.info(line)
            if config.state:
                save_state(job.adapter, config.state)
            if config.export:
                write_export(job, config.export)
            others = gather_on_root(([], results, said.said()), rank, world)[1:]
            for kept, _, _ in others:
                for records in kept:
                    writer.write(records)
        results = [*results, *(result for _, theirs, _ in others for result in theirs)]
        show_other_ranks(said, [said.said(), *(theirs for _, _, theirs in others)])
    if config.metrics_json:
        write_json(
            config.metrics_json,
            {**metrics(config.method, results, job.recorded_settings, job.clean), "adapted": adapted, **job.protocol},
        )
    return results


def check_gate_has_labels(config: AdaptConfig, domains: list[Domain]) -> None:
    """`max_error` gates on the error of the labelled images: with none among the domains
    there is nothing to gate on. Known once the domains are opened; refused before the
    first image is adapted or any record written."""
    if config.max_error is None or any((domain.labels != UNLABELLED).any() for domain in domains):
        return
    names = listing(dict.fromkeys(short_name(domain.name) for domain in domains))
    raise UsageError(
        f"`max_error` gates on the error of the labelled images, and no image of {names} has a label; give "
        f"labelled domains (one folder per class, or an array with `labels`), or leave out `max_error`"
    )


def check_spread(config: AdaptConfig) -> None:
    """Under torchrun the domains are spread over the ranks: each must be independent of those before it."""
    why = why_domains_depend(config.method, config.reset, config.mix_domains)
    if why is None and (config.rounds > 1 or config.forgetting):
        why = "`rounds` and `forgetting` follow the whole sequence of domains in one stream", "leave them out"
    if why is None and "-" in config.data:
        why = "every rank would read `data` - (paths on standard input)", "give the folders or files"
    if why:
        problem, fix = why
        raise UsageError(
            f"cafa adapt under torchrun spreads the domains over the ranks, but {problem}: "
            f"{fix + ', or ' if fix else ''}run it without torchrun"
        )
