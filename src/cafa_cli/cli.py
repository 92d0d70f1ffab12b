"""The `cafa` command: parses options, calls one function per command (pipeline's
stats and adapt jobs, bench, demo, inspect), and turns errors into one line on stderr
and an exit code."""

from __future__ import annotations

import functools
import io
import logging
import os
import re
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from typer.core import TyperGroup

from cafa_cli import __version__
from cafa_cli import bench
from cafa_cli.artifact import DEFAULT_PATH, read_artifact
from cafa_cli.config import CommandOptions, defaults_source, read_defaults
from cafa_cli.demo import DemoPlan, run_demo
from cafa_cli.distributed import (
    launched_by_torchrun,
    process_group,
    rank_device,
    torchrun_rank,
)
from cafa_cli.errors import EXIT_INPUT, EXIT_RUNTIME, CafaError, UsageError, printable
from cafa_cli.files import check_outputs
from cafa_cli.fmnist_c import BENCHMARK_CORRUPTIONS, build_corrupted
from cafa_cli.inspect import describe, render
from cafa_cli.models import GPU_OUT_OF_MEMORY, pick_device
from cafa_cli.pipeline import (
    AdaptSettings,
    DataChoice,
    ModelChoice,
    compute_statistics,
    prepare_adaptation,
    unread_default_artifact,
)
from cafa_cli.preprocessing import parse_floats, parse_size
from cafa_cli.report import (
    ESCAPE_FOR_OUTPUT,
    Monitor,
    check_format,
    is_utf8,
    metrics,
    prediction_records,
    stderr_console,
    summary_table,
    to_json,
    write_json,
)
from cafa_cli.statistics import parse_shrinkage

EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a tool killed by it


def _stderr(quiet: bool) -> Console:
    """The console for humans; --quiet also silences the warnings torch logs itself
    (e.g. torch.compile's set-up) for the rest of the command."""
    if quiet:
        logging.getLogger("torch").setLevel(logging.ERROR)
    return stderr_console(quiet)


def _fail(message: str, code: int) -> typer.Exit:
    """Print the tool's one-line error and return the Exit to raise."""
    typer.echo(f"cafa: error: {printable(message)}", err=True)
    return typer.Exit(code=code)


@contextmanager
def _one_line_usage_errors():
    """Click's own usage errors (a missing option, a value of the wrong type, an unknown
    command) as one `cafa: error:` line and exit 2, like every other error of the tool."""
    try:
        yield
    except Exception as error:
        # typer vendors click, so its classes are matched by name; cafa's own UsageError
        # only gets here on --debug, to show its traceback
        usage = any(k.__name__ == "UsageError" for k in type(error).__mro__) and not isinstance(error, CafaError)
        if not usage or type(error).__name__ == "NoArgsIsHelpError":
            raise
        ctx, param = getattr(error, "ctx", None), getattr(error, "param", None)
        hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        if ctx is not None and param is not None and param.name and _from_config(ctx, param.name):  # the user typed no such value: say where it is
            hint = f" (set in {defaults_source(Path.cwd())})"
        raise _fail(f"{error.format_message()}{hint}", error.exit_code) from None


def _config_hint(ctx: typer.Context | None, message: str) -> str:
    """' (--batch-size set in cafa.toml)' when the option a message starts with was not typed
    but came from the defaults file: else the user looks for it on the command line."""
    named = re.match(r"--[a-z][a-z-]*", message)
    if ctx is None or named is None:
        return ""
    param = next((p for p in ctx.command.params if named.group() in p.opts), None)
    return f" ({named.group()} set in {defaults_source(Path.cwd())})" if param is not None and _from_config(ctx, param.name) else ""


def _from_config(ctx: typer.Context, name: str) -> bool:
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "DEFAULT_MAP"


def _test_domains(ctx: typer.Context, domains: list[str] | None, data: list[str] | None) -> list[str]:
    """The DOMAIN arguments and --data values. Those typed on the command line replace
    what cafa.toml gives (under either name), as any option typed replaces the file's."""
    typed = [path for name, paths in (("data", data), ("domains", domains)) if not _from_config(ctx, name) for path in paths or []]
    given = typed or [*(data or []), *(domains or [])]
    if not given:
        raise UsageError(f"give the test domains: cafa {ctx.info_name} DOMAIN... (or --data DOMAIN, repeated)")
    return given


class _Group(TyperGroup):
    def make_context(self, *args, **kwargs):
        with _one_line_usage_errors():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx):
        with _one_line_usage_errors():
            return super().invoke(ctx)


app = typer.Typer(
    cls=_Group,
    name="cafa",
    help="Test-time adaptation of image classifiers with Class-Aware Feature Alignment (CAFA, ICCV 2023).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # click's plain help: rich's boxed tables cut option names short at 80 columns
    # (--allow-weights-m…) and show every flag as taking a <bool> value
    rich_markup_mode=None,
)
_debug = {"on": False}


def _version(value: bool):
    if value:
        print(f"cafa {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    debug: Annotated[bool, typer.Option("--debug", help="Show Python tracebacks for errors.")] = False,
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")] = None,
):
    _debug["on"] = debug


def _reader_gone() -> int:
    """The reader of stdout went away: stop quietly, as a tool killed by SIGPIPE would,
    with its exit code, and keep Python from failing on the final flush."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_BROKEN_PIPE


def reports_errors(command):
    """Turn CafaError into one line on stderr and its exit code; Ctrl-C into exit 130."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except CafaError as error:
            if _debug["on"]:
                raise
            raise _fail(f"{error}{_config_hint(kwargs.get('ctx'), str(error))}", error.exit_code) from None
        except KeyboardInterrupt:
            typer.echo("cafa: interrupted", err=True)
            raise typer.Exit(code=EXIT_INTERRUPTED) from None
        except BrokenPipeError:  # `cafa adapt ... | head`
            raise typer.Exit(code=_reader_gone()) from None
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except (MemoryError, GPU_OUT_OF_MEMORY):  # the host's or the GPU's
            raise _fail("out of memory; lower --batch-size, or use a smaller artifact (cafa stats --covariance lowrank, tied or diag)", EXIT_RUNTIME) from None
        except Exception as error:  # a bug or an environment failure: one line, traceback on --debug
            if _debug["on"]:
                raise
            if isinstance(error, OSError) and error.filename:
                # a path the tool was given: missing, unreadable, not writable, or the disk is full
                given = isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError))
                raise _fail(f"{error.filename}: {error.strerror or error}", EXIT_INPUT if given else EXIT_RUNTIME) from None
            first = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
            raise _fail(f"{type(error).__name__}: {first} (run with --debug for the traceback)", EXIT_RUNTIME) from None

    return wrapper


# --- shared options --------------------------------------------------------------
# The preprocessing defaults: cafa adapt uses the recipe its artifact recorded, the
# others the bundled model's, else ImageNet's (resize 256, crop 224, RGB mean and std).

ModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help="torchvision architecture (resnet50, ...), a bundled model (fmnist-resnet), or a factory: file.py:function or package.module:function.")]
WeightsOpt = Annotated[Optional[str], typer.Option("--weights", "-w", help="State dict: .safetensors, or .pt/.pth (read with weights_only=True).")]
NumClassesOpt = Annotated[Optional[int], typer.Option("--num-classes", help="Outputs of a torchvision architecture or factory.")]
ClassifierOpt = Annotated[Optional[str], typer.Option("--classifier", help="Name of the final nn.Linear (default: the last one).")]
TrustOpt = Annotated[bool, typer.Option("--trust-checkpoint", help="Allow .pt/.pth files that hold Python objects. Unpickling them can run arbitrary code: only for files you trust.")]
LabelsOpt = Annotated[Optional[str], typer.Option("--labels", help="Labels .npy for a --data .npy array.")]
SeverityOpt = Annotated[Optional[int], typer.Option("--severity", help="Pick severity 1-5 from an array stacking five (CIFAR-10-C layout).")]
ResizeOpt = Annotated[Optional[str], typer.Option("--resize", help="Resize the shorter side to this (int or 'none'). Default: the artifact's (adapt), the bundled model's, or 256.")]
CropOpt = Annotated[Optional[str], typer.Option("--crop", help="Centre crop (int or 'none'); default as --resize's, or 224. ImageNet-C is already 224x224: use --resize none --crop none.")]
MeanOpt = Annotated[Optional[str], typer.Option("--mean", help="Normalisation mean, one value or one per channel; default as --resize's, or ImageNet's.")]
StdOpt = Annotated[Optional[str], typer.Option("--std", help="Normalisation std, one value or one per channel; default as --mean's.")]
ChannelsOpt = Annotated[Optional[int], typer.Option("--channels", help="1 (grey) or 3 (RGB).")]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto, cpu, cuda or cuda:N.")]
WorkersOpt = Annotated[Optional[int], typer.Option("--num-workers", show_default=False, help="Data loading processes. Default: on CUDA the CPU cores this process may use, divided among torchrun's ranks on the machine, minus one; on the CPU 0.")]
FractionOpt = Annotated[Optional[float], typer.Option("--fraction", show_default=False, help="Stratified fraction of each class's training images for the statistics, in (0, 1]; default 0.05.")]
PerClassOpt = Annotated[Optional[int], typer.Option("--per-class", help="This many training images per class instead of a --fraction.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress or summary on stderr.")]
ShrinkageOpt = Annotated[str, typer.Option("--shrinkage", help="'auto' (OAS per class; diag: a λ for the variances alone) or λ in [0, 1]: Σ = (1-λ)S + λ tr(S)/d I. 0 is the paper's unregularised estimate.")]
StrictOpt = Annotated[bool, typer.Option("--strict", help="Fail on the first unreadable image instead of skipping it.")]
# how a model adapts, shared by adapt and bench
BatchSizeOpt = Annotated[int, typer.Option("--batch-size", help="Images per adaptation batch (paper: 200; 64 on ImageNet-C); bench also computes its statistics in batches of this size.")]
OptimizerOpt = Annotated[str, typer.Option("--optimizer", help="adam, sgd, or nesterov (SGD with Nesterov momentum, as TENT's ImageNet-C code).")]
LrOpt = Annotated[float, typer.Option("--lr", help="Learning rate.")]
MomentumOpt = Annotated[float, typer.Option("--momentum", help="Momentum of sgd and nesterov (adam ignores it).")]
StepsOpt = Annotated[int, typer.Option("--steps", help="Gradient steps per batch.")]
ParamsOpt = Annotated[str, typer.Option("--params", help="norm (normalisation affines) or all (the whole feature extractor).")]
BnPriorOpt = Annotated[float, typer.Option("--bn-prior", help="Source BN statistics count as this many samples (0: test batch only).")]
ResetOpt = Annotated[str, typer.Option("--reset", help="domain (each --data from the source weights), episodic (every batch), never (continual).")]
PrecisionOpt = Annotated[str, typer.Option("--precision", help="fp32, bf16 or fp16 (autocast, CUDA only).")]
CompileOpt = Annotated[bool, typer.Option("--compile", help="torch.compile the model (pays a compilation on the first batches).")]


def _preprocessing_changes(resize=None, crop=None, mean=None, std=None, channels=None, prefix: str = "--") -> dict:
    """The preprocessing options given (None: not given), parsed; `prefix` names them in
    errors (`--test-` for bench's test geometry)."""
    texts = {"resize": (resize, parse_size), "crop": (crop, parse_size), "mean": (mean, parse_floats), "std": (std, parse_floats)}
    changes = {key: parse(text, f"{prefix}{key}") for key, (text, parse) in texts.items() if text is not None}
    return changes if channels is None else {**changes, "channels": channels}


# --- commands --------------------------------------------------------------------


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
    table = bench.summarise(results, rows, data, seed_list)
    print(bench.markdown(table, data, seed_list))
    if csv_out:
        bench.write_csv(csv_out, table, data)
    if json_out:
        bench.write_json(json_out, plan, table, results)
    if plot_out:
        bench.plot(plot_out, table, data)


def _interrupt(signum, frame):
    if not _debug["on"]:
        # Unwinding stops the loader workers mid-transfer: the errors that background
        # threads and finalisers then raise are noise once the run is being interrupted.
        threading.excepthook = sys.unraisablehook = lambda *args: None
    raise KeyboardInterrupt(signal.Signals(signum).name)


class _ClosedOutput(io.TextIOBase):
    """Standard output closed by the shell (`>&-`): Python sets sys.stdout to None, and
    print() then drops everything silently. A command that writes there fails instead."""

    problem = "standard output is closed (>&-); redirect it to a file, or to /dev/null to discard it"

    def write(self, text: str) -> int:
        raise UsageError(self.problem)


def _stdout_needed() -> None:
    """For a command whose results go to stdout: fail before the work, not after it."""
    if isinstance(sys.stdout, _ClosedOutput):
        raise UsageError(_ClosedOutput.problem)


def _standard_streams() -> None:
    """An output encoding other than UTF-8 (PYTHONIOENCODING=ascii, a latin-1 locale) gets
    escapes for what it cannot encode instead of an exception in the middle of a run; a
    closed stdout fails at its first write."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper) and not is_utf8(stream):
            stream.reconfigure(errors=ESCAPE_FOR_OUTPUT)
    if sys.stdout is None:
        sys.stdout = _ClosedOutput()


def main() -> None:
    # SIGTERM (a CI timeout, `kill`) ends the run like Ctrl-C: `finally` blocks run, so an
    # atomic write removes its temporary file and the predictions made so far are flushed.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    _standard_streams()
    try:
        defaults = read_defaults(Path.cwd(), _command_options())
    except CafaError as error:
        if not {"--help", "--version"} & set(sys.argv[1:]):
            _fail(str(error), error.exit_code)
            raise SystemExit(error.exit_code) from None
        defaults = {}  # the help that would show how to fix the file stays readable
    try:
        app(default_map=defaults)
    except BrokenPipeError:  # --help or --version into `| head`
        raise SystemExit(_reader_gone()) from None
    except CafaError as error:  # --help into a closed stdout (a command's own errors are handled inside it)
        _fail(str(error), error.exit_code)
        raise SystemExit(error.exit_code) from None
    except OSError as error:  # --help into a full disk (a command's own errors are handled inside it)
        _fail(f"cannot write the output: {error.strerror or error}", EXIT_RUNTIME)
        raise SystemExit(EXIT_RUNTIME) from None


def _command_options() -> dict[str, CommandOptions]:
    """What cafa.toml may set for each command, read off the commands themselves."""
    return {
        name: CommandOptions(
            keys={key: p.name for p in command.params for key in ([o[2:] for o in p.opts if o.startswith("--")] or [p.name])},
            lists={p.name for p in command.params if p.multiple or p.nargs == -1},
            flags={p.name for p in command.params if getattr(p, "is_flag", False)},
        )
        for name, command in typer.main.get_command(app).commands.items()
    }
