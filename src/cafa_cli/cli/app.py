"""The `cafa` application: the commands with their help, the root options, and `main`,
which installs the signal handlers and reads cafa.toml's defaults."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer.core import TyperGroup

from cafa_cli import __version__
from cafa_cli.cli import commands
from cafa_cli.cli.defaults import CommandOptions, read_defaults
from cafa_cli.cli.errors import EXIT_RUNTIME, debug, fail, one_line_usage_errors, reader_gone, reports_errors
from cafa_cli.cli.options import PanelledCommand
from cafa_cli.cli.renamed import renamed_keys
from cafa_cli.cli.streams import prepare_standard_streams
from cafa_cli.core.errors import CafaError
from cafa_cli.core.interrupts import interrupt
from cafa_cli.data.values import decode_budget
from cafa_cli.jobs.config import AdaptConfig, BenchConfig, DemoConfig, StatsConfig, command_line_only, names_code

# each a line a terminal shows whole; a long one continues after a backslash
EXAMPLES = {
    "stats": [
        "cafa stats --model resnet50 --weights r50.safetensors --data ImageNet/train",
        "cafa stats --model fmnist-resnet --data fashion-mnist --per-class 300 \\",
        "    --covariance tied -o tied.safetensors",
    ],
    "adapt": [
        "cafa adapt ImageNet-C/fog/5 --resize none --crop none > fog5.csv",
        "cafa adapt cafa-demo/fashion-mnist-c-300/*/3 --method tent --format jsonl",
    ],
    "inspect": ["cafa inspect cafa-stats.safetensors --json | jq .classes"],
    "demo": ["cafa demo", "cafa demo --corruptions all --data-only"],
    "methods": [
        "cafa methods",
        "cafa methods eata --recipe cifar10-c > my.toml   # edit it, then:",
        "cafa adapt DOMAIN --method eata --recipe my.toml",
    ],
    "plot features": [
        "cafa plot features cafa-demo/fashion-mnist-c-300/gaussian_noise/3 \\",
        "    --methods source,tent,cafa -o tsne.png",
    ],
    "bench": [
        "cafa bench cafa-demo/fashion-mnist-c-300/*/3 --seeds 0,1,2 --csv table.csv",
        "cafa bench ImageNet-C/*/5 --model resnet50 --weights r50.safetensors \\",
        "    --train ImageNet/train --test-resize none --test-crop none",
    ],
}


# the page of the docs that explains each command (docs/reference/cli/index.md lists every option)
GUIDES = {
    "cafa": "docs/getting-started.md",
    "stats": "docs/guides/adapt.md",
    "adapt": "docs/guides/adapt.md",
    "inspect": "docs/reference/artifact-format.md",
    "demo": "docs/getting-started.md",
    "bench": "docs/guides/bench.md",
    "methods": "docs/reference/methods/index.md",
    "plot": "docs/guides/plot.md",
    "plot features": "docs/guides/plot.md",
}


def _epilog(name: str) -> str:
    """The help's last lines: the command's examples (after \b, click keeps their lines), then its guide."""
    lines = [f"  {line}" for line in EXAMPLES.get(name, [])]
    examples = "\b\nExamples:\n" + "\n".join(lines) + "\n\n" if lines else ""
    return f"{examples}Guide: {GUIDES[name]}"


HELP = {"help_option_names": ["-h", "--help"]}  # every command's, the subcommands' too


class _Group(TyperGroup):
    def make_context(self, *args, **kwargs):
        with one_line_usage_errors():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx):
        with one_line_usage_errors():
            return super().invoke(ctx)


app = typer.Typer(
    cls=_Group,
    name="cafa",
    help="Test-time adaptation of image classifiers with Class-Aware Feature Alignment (CAFA, ICCV 2023).",
    epilog=_epilog("cafa") + "; reference: docs/reference/cli/index.md",
    no_args_is_help=True,
    add_completion=True,  # --install-completion: method and recipe names complete (cli/completion.py)
    pretty_exceptions_enable=False,
    # click's plain help: rich's boxed tables cut option names short at 80 columns
    rich_markup_mode=None,
    context_settings=HELP,
)


def _version(value: bool):
    if value:
        print(f"cafa {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    debug_: Annotated[bool, typer.Option("--debug", help="Show Python tracebacks for errors.")] = False,
    version: Annotated[
        Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = None,
):
    debug["on"] = debug_


for _name, _command, _summary in [
    ("stats", commands.stats, "Per-class feature Gaussians of training images → an artifact."),
    ("adapt", commands.adapt, "Adapt a model online over test images; one prediction per image."),
    ("inspect", commands.inspect, "Summarise and validate an artifact."),
    ("demo", commands.demo, "CAFA on real corrupted images, offline: Fashion-MNIST-C."),
    ("bench", commands.bench, "Methods × domains × seeds → a paper-style error table."),
    ("methods", commands.methods, "The methods, their options and their published recipes."),
]:
    app.command(_name, cls=PanelledCommand, short_help=_summary, epilog=_epilog(_name))(reports_errors(_command))

plot = typer.Typer(
    cls=_Group,
    name="plot",
    help="Figures of what adaptation does.",
    epilog=_epilog("plot"),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings=HELP,
)
plot.command(
    "features",
    cls=PanelledCommand,
    short_help="A domain's features before and after adaptation, in 2-D (t-SNE).",
    epilog=_epilog("plot features"),
)(reports_errors(commands.plot_features))
app.add_typer(plot, short_help="Figures: plot features (t-SNE of features before and after adaptation).")


def _interrupt(signum, frame):
    if not debug["on"]:
        # Unwinding stops the loader workers mid-transfer: the errors that background
        # threads and finalisers then raise are noise once the run is being interrupted.
        threading.excepthook = sys.unraisablehook = lambda *args: None
    interrupt(signum)  # at once, or when the adaptation step under way is whole


def main() -> None:
    # SIGTERM (a CI timeout, `kill`) ends the run like Ctrl-C: `finally` blocks run, so an
    # atomic write removes its temporary file and the predictions made so far are flushed.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    prepare_standard_streams()
    try:
        decode_budget()  # CAFA_DECODE_BUDGET_MB, checked once here rather than in each loader process
        defaults = read_defaults(Path.cwd(), command_options())
    except CafaError as error:
        if not {"-h", "--help", "--version"} & set(sys.argv[1:]):
            fail(str(error), error.exit_code)
            raise SystemExit(error.exit_code) from None
        defaults = {}  # the help that would show how to fix the file stays readable
    try:
        app(default_map=defaults)
    except BrokenPipeError:  # --help or --version into `| head`
        raise SystemExit(reader_gone()) from None
    except CafaError as error:  # --help into a closed stdout (a command's own errors are handled inside it)
        if debug["on"]:  # a command's error, re-raised by reports_errors to show its traceback
            raise
        fail(str(error), error.exit_code)
        raise SystemExit(error.exit_code) from None
    except OSError as error:  # --help into a full disk (a command's own errors are handled inside it)
        if debug["on"]:
            raise
        fail(f"cannot write the output: {error.strerror or error}", EXIT_RUNTIME)
        raise SystemExit(EXIT_RUNTIME) from None
    finally:
        # The command is over: its outputs are written and its exit code said. The teardown
        # after it (seconds of native libraries unloading) runs with Python's handlers reset,
        # so a signal there killed the process by the signal, as exit 130 with no word; ignored,
        # it leaves the exit code the command said.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)


SETTINGS = {"stats": StatsConfig, "adapt": AdaptConfig, "bench": BenchConfig, "demo": DemoConfig}


def command_options() -> dict[str, CommandOptions]:
    """What cafa.toml may set for each command, read off the commands themselves."""
    return {
        name: CommandOptions(
            keys={
                key: p.name
                for p in command.params
                for key in ([o[2:] for o in p.opts if o.startswith("--")] or [p.name])
            },
            lists={p.name for p in command.params if p.multiple or p.nargs == -1},
            flags={p.name for p in command.params if getattr(p, "is_flag", False)},
            command_line_only=command_line_only(SETTINGS[name]) if name in SETTINGS else set(),
            renamed=renamed_keys(name),
            names_code=names_code(SETTINGS[name]) if name in SETTINGS else set(),
        )
        for name, command in typer.main.get_command(app).commands.items()
    }
