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
from cafa_cli.cli.defaults import CommandOptions, defaults_source, read_defaults
from cafa_cli.errors import EXIT_INPUT, EXIT_RUNTIME, CafaError, UsageError, printable
from cafa_cli.devices import GPU_OUT_OF_MEMORY
from cafa_cli.jobs.report import ESCAPE_FOR_OUTPUT, is_utf8
from cafa_cli.jobs.monitor import stderr_console


EXIT_INTERRUPTED = 130


EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a tool killed by it


def _stderr(quiet: bool) -> Console:
    """The console for humans; --quiet also silences the warnings torch logs itself
    (e.g. torch.compile's set-up) for the rest of the command."""
    if quiet:
        logging.getLogger("torch").setLevel(logging.ERROR)
    return stderr_console(quiet)


def as_flags(message: str) -> str:
    """The library names a setting in backticks (`lr`); on the command line it is --lr."""
    return re.sub(r"`([a-z][a-z0-9_]*)`", lambda m: "--" + m.group(1).replace("_", "-"), message)


def _fail(message: str, code: int) -> typer.Exit:
    """Print the tool's one-line error and return the Exit to raise."""
    typer.echo(f"cafa: error: {printable(as_flags(message))}", err=True)
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
            message = as_flags(str(error))
            raise _fail(f"{message}{_config_hint(kwargs.get('ctx'), message)}", error.exit_code) from None
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


from cafa_cli.cli import commands  # noqa: E402,F401  (registers the commands on app)
