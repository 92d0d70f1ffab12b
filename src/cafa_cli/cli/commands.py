"""The commands: each parses its options and calls one job."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional
import typer
from rich.console import Console
from cafa_cli.jobs import bench, tables
from cafa_cli.artifact import DEFAULT_PATH, read_artifact
from cafa_cli.jobs.demo import DemoPlan, run_demo
from cafa_cli.jobs.distributed import launched_by_torchrun, process_group, rank_device, torchrun_rank
from cafa_cli.errors import UsageError
from cafa_cli.jobs.outputs import check_outputs
from cafa_cli.data.fmnist_c import BENCHMARK_CORRUPTIONS, build_corrupted
from cafa_cli.jobs.describe import describe, render
from cafa_cli.devices import pick_device
from cafa_cli.jobs.adapt import AdaptSettings, prepare_adaptation, unread_default_artifact
from cafa_cli.jobs.inputs import DataChoice, ModelChoice
from cafa_cli.jobs.stats import compute_statistics
from cafa_cli.jobs.report import check_format, metrics, prediction_records, summary_table, to_json, write_json
from cafa_cli.jobs.monitor import Monitor
from cafa_cli.method.gaussians import parse_shrinkage
from cafa_cli.cli.options import BatchSizeOpt, BnPriorOpt, ChannelsOpt, ClassifierOpt, CompileOpt, CropOpt, DeviceOpt, FractionOpt, LabelsOpt, LrOpt, MeanOpt, ModelOpt, MomentumOpt, NumClassesOpt, OptimizerOpt, ParamsOpt, PerClassOpt, PrecisionOpt, QuietOpt, ResetOpt, ResizeOpt, SeverityOpt, ShrinkageOpt, StdOpt, StepsOpt, StrictOpt, TrustOpt, WeightsOpt, WorkersOpt, _preprocessing_changes
from cafa_cli.cli.app import _ClosedOutput, _from_config, _stderr, app, reports_errors


def _test_domains(ctx: typer.Context, domains: list[str] | None, data: list[str] | None) -> list[str]:
    """The DOMAIN arguments and --data values. Those typed on the command line replace
    what cafa.toml gives (under either name), as any option typed replaces the file's."""
    typed = [path for name, paths in (("data", data), ("domains", domains)) if not _from_config(ctx, name) for path in paths or []]
    given = typed or [*(data or []), *(domains or [])]
    if not given:
        raise UsageError(f"give the test domains: cafa {ctx.info_name} DOMAIN... (or --data DOMAIN, repeated)")
    return given


@app.command(short_help="Per-class feature Gaussians of training images → an artifact.")
@reports_errors
def stats(
    ctx: typer.Context,
    data: Annotated[str, typer.Option("--data", "-d", help="Training images: an ImageFolder, a .npy array (--labels), or cifar10:ROOT / cifar100:ROOT / fashion-mnist:ROOT.")],
    model: ModelOpt = "resnet50",
    weights: WeightsOpt = None,
    num_classes: NumClassesOpt = None,
    classifier: ClassifierOpt = None,
    trust_checkpoint: TrustOpt = False,
    classes: Annotated[Optional[str], typer.Option("--classes", help="File with one class name per line, in the model's output order (default: a bundled model's own list, else the sorted folder names).")] = None,
    labels: LabelsOpt = None,
    severity: SeverityOpt = None,
    fraction: FractionOpt = None,
    per_class: PerClassOpt = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the stratified subset.")] = 0,
    covariance: Annotated[str, typer.Option("--covariance", help="auto (lowrank when every class has fewer images than feature dimensions, else full), full (per class), lowrank (exact, a·I + low rank per class), tied (one pooled), or diag.")] = "auto",
    shrinkage: ShrinkageOpt = "auto",
    resize: ResizeOpt = None,
    crop: CropOpt = None,
    mean: MeanOpt = None,
    std: StdOpt = None,
    channels: ChannelsOpt = None,
    device: DeviceOpt = "auto",
    batch_size: Annotated[int, typer.Option("--batch-size", help="Images per forward pass.")] = 128,
    num_workers: WorkersOpt = None,
    out: Annotated[str, typer.Option("--out", "-o", help="Artifact to write (atomically).")] = DEFAULT_PATH,
    strict: StrictOpt = False,
    quiet: QuietOpt = False,
):
    """Compute per-class feature Gaussians of a training set into a safetensors artifact."""
    shrink = parse_shrinkage(shrinkage)
    console = _stderr(quiet)
    with Monitor(console, quiet or torchrun_rank() > 0) as monitor:
        artifact = compute_statistics(
            data,
            out,
            ModelChoice(model, weights, num_classes, classifier, trust_checkpoint),
            DataChoice(labels, severity, classes, _preprocessing_changes(resize, crop, mean, std, channels)),
            fraction=fraction,
            per_class=per_class,
            seed=seed,
            covariance=covariance,
            shrinkage=shrink,
            device=device,
            batch_size=batch_size,
            num_workers=num_workers,
            strict=strict,
            monitor=monitor,
        )
    if artifact is None:  # a torchrun rank other than 0
        return
    skipped = artifact.sampling.get("skipped_images") or 0
    monitor.info(
        f"wrote {out}: {artifact.num_classes} classes, d={artifact.feature_dim}, "
        f"{artifact.metadata['num_images']} images, covariance {artifact.covariance}"
        + (f", {skipped} unreadable image{'s' if skipped != 1 else ''} skipped" if skipped else "")
    )


@app.command(short_help="Adapt a model online over test images; one prediction per image.")
@reports_errors
def adapt(
    ctx: typer.Context,
    domains: Annotated[Optional[list[str]], typer.Argument(help="Test domains, e.g. ImageNet-C/*/5 as the shell expands it.", show_default=False)] = None,
    data: Annotated[Optional[list[str]], typer.Option("--data", "-d", help="A test domain (repeatable), as well as or instead of the arguments: ImageFolder, unlabelled folder, .npy array, or '-' for image paths on stdin.")] = None,
    stats: Annotated[Optional[str], typer.Option("--stats", "-s", help=f"Artifact from cafa stats (default: {DEFAULT_PATH}); it also names the model, so --model/--weights can be left out.")] = None,
    method: Annotated[str, typer.Option("--method", help="cafa, source, bn, pl, tent, global-fa, intra, euclidean.")] = "cafa",
    model: ModelOpt = None,
    weights: WeightsOpt = None,
    num_classes: NumClassesOpt = None,
    classifier: ClassifierOpt = None,
    trust_checkpoint: TrustOpt = False,
    allow_weights_mismatch: Annotated[bool, typer.Option("--allow-weights-mismatch", help="Use the artifact with another model or other weights than it was computed with.")] = False,
    classes: Annotated[Optional[str], typer.Option("--classes", help="Class list file, when no artifact gives one.")] = None,
    labels: LabelsOpt = None,
    severity: SeverityOpt = None,
    resize: ResizeOpt = None,
    crop: CropOpt = None,
    mean: MeanOpt = None,
    std: StdOpt = None,
    channels: ChannelsOpt = None,
    batch_size: BatchSizeOpt = 200,
    optimizer: OptimizerOpt = "adam",
    lr: LrOpt = 1e-3,
    momentum: MomentumOpt = 0.9,
    steps: StepsOpt = 1,
    params: ParamsOpt = "norm",
    bn_prior: BnPriorOpt = 0.0,
    reset: ResetOpt = "domain",
    shuffle: Annotated[bool, typer.Option("--shuffle/--no-shuffle", help="Shuffle each domain's stream (seeded).")] = True,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the stream order.")] = 0,
    device: DeviceOpt = "auto",
    precision: PrecisionOpt = "fp32",
    compile_model: CompileOpt = False,
    num_workers: WorkersOpt = None,
    fmt: Annotated[str, typer.Option("--format", help="csv or jsonl.")] = "csv",
    predictions: Annotated[Optional[str], typer.Option("--predictions", help="Write the records to this file instead of stdout.")] = None,
    metrics_json: Annotated[Optional[str], typer.Option("--metrics-json", help="Write errors and settings as JSON.")] = None,
    strict: StrictOpt = False,
    quiet: QuietOpt = False,
):
    """Adapt a model online over test domains; print one prediction per image."""
    data = _test_domains(ctx, domains, data)
    if launched_by_torchrun():
        raise UsageError(
            "cafa adapt runs in one process: under torchrun every rank would adapt the same stream and print it again; "
            "run it without torchrun (one process per domain or GPU), or use cafa bench to spread domains over ranks"
        )
    check_format(fmt)
    predictions = None if predictions == "-" else predictions  # stdout, as without the option
    if predictions is None:
        _stdout_needed()
    outputs = {"--predictions": predictions, "--metrics-json": metrics_json}
    check_outputs(outputs, {"--stats": DEFAULT_PATH if stats is None else stats, "--weights": weights, "--labels": labels, "--classes": classes, "--data": data})
    settings = AdaptSettings(
        method=method, batch_size=batch_size, optimizer=optimizer, lr=lr, momentum=momentum, steps=steps, params=params,
        bn_prior=bn_prior, reset=reset, shuffle=shuffle, seed=seed, device=device, precision=precision,
        num_workers=num_workers, strict=strict, compile=compile_model,
    )
    console = _stderr(quiet)
    if "-" in data and sys.stdin.isatty():  # else a terminal would wait with no word of why
        console.print("reading image paths from standard input, one per line; end with Ctrl-D")
    job = prepare_adaptation(
        data,
        stats,
        ModelChoice(model, weights, num_classes, classifier, trust_checkpoint),
        DataChoice(labels, severity, classes, _preprocessing_changes(resize, crop, mean, std, channels)),
        settings,
        allow_weights_mismatch,
    )
    read_from_stdin = [ref for domain in job.domains if domain.name == "-" for ref in domain.refs]
    if read_from_stdin:
        check_outputs(outputs, {"--data -": read_from_stdin})  # the paths stdin listed, known only now
    with prediction_records(predictions, fmt, job.class_names) as writer, Monitor(console, quiet) as monitor:
        unread = unread_default_artifact(stats, model, method, job.preprocess)
        for caution in [*job.cautions(), *([unread] if unread else [])]:
            monitor.warn(caution)
        results = job.run(writer.write, monitor)
    console.print(summary_table(method, results))
    if metrics_json:
        write_json(metrics_json, metrics(method, results, job.recorded_settings))


@app.command("inspect", short_help="Summarise and validate an artifact.")
@reports_errors
def inspect_command(
    artifact: Annotated[str, typer.Argument(help="A cafa statistics artifact.")] = DEFAULT_PATH,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON on stdout.")] = False,
):
    """Summarise and validate an artifact: classes, counts, dimensions, shrinkage, model, conditioning."""
    summary = describe(read_artifact(artifact))
    if as_json:
        print(to_json(summary, indent=2))
    else:
        Console(highlight=False).print(render(summary))


@app.command(short_help="CAFA on real corrupted images, offline: Fashion-MNIST-C.")
@reports_errors
def demo(
    workdir: Annotated[str, typer.Option("--workdir", help="Where the data and artifacts go (re-used on a second run).")] = "cafa-demo",
    corruptions: Annotated[str, typer.Option("--corruptions", help="Comma-separated corrupt-tta corruptions, or 'all' (the 15 of ImageNet-C).")] = ",".join(DemoPlan.corruptions),
    severity: Annotated[int, typer.Option("--severity", help="Corruption severity 1-5.")] = DemoPlan.severity,
    test_per_class: Annotated[int, typer.Option("--test-per-class", help="Test images per class and domain (0: all 1,000).")] = DemoPlan.test_per_class,
    methods: Annotated[str, typer.Option("--methods", help="Methods to compare.")] = DemoPlan.methods,
    data_only: Annotated[bool, typer.Option("--data-only", help="Only build the image folders (e.g. the full set for cafa bench).")] = False,
    fashion_mnist: Annotated[Optional[str], typer.Option("--fashion-mnist", help="Folder with the Fashion-MNIST idx files (default: $CAFA_FASHION_MNIST, else /usr/share/datasets/fashion-mnist).")] = None,
    quiet: QuietOpt = False,
):
    """Build Fashion-MNIST-C from the Debian package, then run stats and adapt (Source, BN, TENT, CAFA) and print a table."""
    _stdout_needed()
    names = BENCHMARK_CORRUPTIONS if corruptions == "all" else tuple(c.strip() for c in corruptions.split(",") if c.strip())
    plan = DemoPlan(names, severity, DemoPlan.train_per_class, test_per_class or None, methods)
    console = _stderr(quiet)
    with Monitor(console, quiet) as monitor:
        if data_only:
            bench.parse_methods(methods)  # a typo there is not ignored because no method runs
            for folder in build_corrupted(Path(workdir), list(names), severity, plan.test_per_class, plan.seed, fashion_mnist,
                                          on_domain=lambda name: monitor.info(f"corrupting: {name}")):
                print(folder)
            return
        table = run_demo(workdir, plan, fashion_mnist, monitor, echo=lambda line: monitor.info(f"$ {line}"))
    print(table)


@app.command("bench", short_help="Methods × domains × seeds → a paper-style error table.")
@reports_errors
def bench_command(
    ctx: typer.Context,
    domains: Annotated[Optional[list[str]], typer.Argument(help="Labelled test domains, e.g. fashion-mnist-c/*/3 as the shell expands it.", show_default=False)] = None,
    data: Annotated[Optional[list[str]], typer.Option("--data", "-d", help="A labelled test domain (repeatable), as well as or instead of the arguments.")] = None,
    train: Annotated[Optional[str], typer.Option("--train", help="Training data for the statistics (as cafa stats --data). Default for fmnist-resnet: fashion-mnist.")] = None,
    model: ModelOpt = "fmnist-resnet",
    weights: WeightsOpt = None,
    num_classes: NumClassesOpt = None,
    classifier: ClassifierOpt = None,
    trust_checkpoint: TrustOpt = False,
    classes: Annotated[Optional[str], typer.Option("--classes", help="Class list file (as cafa stats).")] = None,
    labels: LabelsOpt = None,
    severity: SeverityOpt = None,
    resize: ResizeOpt = None,
    crop: CropOpt = None,
    mean: MeanOpt = None,
    std: StdOpt = None,
    channels: ChannelsOpt = None,
    test_resize: Annotated[Optional[str], typer.Option("--test-resize", help="--resize for the test domains only (default: --resize). ImageNet-C: none.")] = None,
    test_crop: Annotated[Optional[str], typer.Option("--test-crop", help="--crop for the test domains only (default: --crop). ImageNet-C: none.")] = None,
    methods: Annotated[str, typer.Option("--methods", show_default=False, help="Rows, comma-separated, from source, bn, pl, tent, cafa, global-fa, intra, euclidean (statistics with --covariance auto); cafa-tied, cafa-diag, cafa-dense, cafa-lowrank (that covariance forced); cafa-full (the paper's CAFA-Full: --params all). Default: all but cafa-full, cafa-dense and cafa-lowrank. NAME@LR gives a row its own learning rate.")] = bench.DEFAULT_METHODS,
    seeds: Annotated[str, typer.Option("--seeds", help="Stream-order seeds, comma-separated; mean ± std over them.")] = "0",
    fraction: FractionOpt = None,
    per_class: PerClassOpt = None,
    shrinkage: ShrinkageOpt = "auto",
    workdir: Annotated[str, typer.Option("--workdir", help="Where artifacts are kept and re-used.")] = "cafa-bench",
    batch_size: BatchSizeOpt = 200,
    optimizer: OptimizerOpt = "adam",
    lr: LrOpt = 1e-3,
    momentum: MomentumOpt = 0.9,
    steps: StepsOpt = 1,
    params: ParamsOpt = "norm",
    bn_prior: BnPriorOpt = 0.0,
    reset: ResetOpt = "domain",
    device: DeviceOpt = "auto",
    precision: PrecisionOpt = "fp32",
    compile_model: CompileOpt = False,
    num_workers: WorkersOpt = None,
    strict: StrictOpt = False,
    csv_out: Annotated[Optional[str], typer.Option("--csv", help="Write the table as CSV.")] = None,
    json_out: Annotated[Optional[str], typer.Option("--json", help="Write the table and every run as JSON.")] = None,
    plot_out: Annotated[Optional[str], typer.Option("--plot", help="Write a grouped-bar PNG (needs matplotlib).")] = None,
    quiet: QuietOpt = False,
):
    """Methods × domains × seeds → a paper-style table of errors (%), markdown on stdout."""
    _stdout_needed()
    data = _test_domains(ctx, domains, data)
    rows = bench.parse_methods(methods)
    seed_list = bench.parse_seeds(seeds)
    check_outputs({"--csv": csv_out, "--json": json_out, "--plot": plot_out},
                        {"--train": train, "--weights": weights, "--labels": labels, "--classes": classes, "--data": data,
                         "--workdir": workdir})
    train_choice = DataChoice(classes_file=classes, preprocessing=_preprocessing_changes(resize, crop, mean, std, channels))
    # the test domains may need other geometry than the training data (ImageNet-C is stored already cropped)
    test_changes = {**train_choice.preprocessing, **_preprocessing_changes(test_resize, test_crop, prefix="--test-")}
    target = rank_device(pick_device(device))
    settings = AdaptSettings(batch_size=batch_size, optimizer=optimizer, lr=lr, momentum=momentum, steps=steps, params=params,
                             bn_prior=bn_prior, reset=reset, device=str(target), precision=precision, num_workers=num_workers,
                             strict=strict, compile=compile_model)
    plan = bench.BenchPlan(
        rows=rows,
        domains=data,
        seeds=seed_list,
        settings=settings,
        model=ModelChoice(model, weights, num_classes, classifier, trust_checkpoint),
        train=bench.training_data(train, model, rows),
        train_choice=train_choice,
        test_choice=DataChoice(labels, severity, classes, test_changes),
        sampling=bench.Sampling(fraction, per_class, shrinkage=parse_shrinkage(shrinkage)),
        workdir=Path(workdir),
    )
    with process_group(target) as (rank, world), Monitor(_stderr(quiet), quiet or rank > 0) as monitor:
        results = bench.run_bench(plan, monitor, rank, world)
    if results is None:  # a torchrun rank other than 0: rank 0 reports
        return
    table = tables.summarise(results, rows, data, seed_list)
    print(tables.markdown(table, data, seed_list))
    if csv_out:
        tables.write_csv(csv_out, table, data)
    if json_out:
        tables.write_json(json_out, plan, table, results)
    if plot_out:
        tables.plot(plot_out, table, data)


def _stdout_needed() -> None:
    """For a command whose results go to stdout: fail before the work, not after it."""
    if isinstance(sys.stdout, _ClosedOutput):
        raise UsageError(_ClosedOutput.problem)
