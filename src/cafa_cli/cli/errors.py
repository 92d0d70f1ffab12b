"""Errors as a command-line tool reports them: one `cafa: error:` line on stderr that
names the option (the library's `lr` is the command line's --lr), and an exit code."""

from __future__ import annotations

import errno
import functools
import os
import re
import sys
from contextlib import contextmanager
from pathlib import Path

import typer

from cafa_cli.cli.defaults import defaults_source
from cafa_cli.core.errors import EXIT_INPUT, EXIT_RUNTIME, CafaError, listing, out_of_memory, printable
from cafa_cli.core.files import completed

EXIT_ABOVE_MAX_ERROR = 4  # --max-error: the run worked, and its error is above the threshold a CI job gates on
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a tool killed by it
OUT_OF_MEMORY = (
    "out of memory; lower --batch-size, or use a smaller artifact (cafa stats --covariance lowrank, tied or diag)"
)
debug = {"on": False}  # set by the root command's --debug


def as_flags(message: str) -> str:
    """The library names a setting in backticks (`lr`); on the command line it is --lr."""
    return re.sub(r"`([a-z][a-z0-9_]*)`", lambda m: "--" + m.group(1).replace("_", "-"), message)


def fail(message: str, code: int) -> typer.Exit:
    """Print the tool's one-line error and return the Exit to raise."""
    typer.echo(f"cafa: error: {printable(as_flags(message))}", err=True)
    return typer.Exit(code=code)


def gate(reason: str | None) -> None:
    """--max-error, called once every output is written: the one-line reason and its own exit
    code when the run's error is above the threshold (a CI job tells it from a failure)."""
    if reason:
        raise fail(reason, EXIT_ABOVE_MAX_ERROR)


def from_config(ctx: typer.Context, name: str) -> bool:
    """Whether a parameter's value came from cafa.toml rather than the command line."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "DEFAULT_MAP"


def _config_hint(ctx: typer.Context | None, message: str) -> str:
    """' (--batch-size set in cafa.toml)' when the option a message starts with was not typed
    but came from the defaults file: else the user looks for it on the command line."""
    named = re.match(r"--[a-z][a-z-]*", message)
    if ctx is None or named is None:
        return ""
    param = next((p for p in ctx.command.params if named.group() in p.opts), None)
    return (
        f" ({named.group()} set in {defaults_source(Path.cwd())})"
        if param is not None and from_config(ctx, param.name)
        else ""
    )


@contextmanager
def one_line_usage_errors():
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
        if (
            ctx is not None and param is not None and param.name and from_config(ctx, param.name)
        ):  # the user typed no such value: say where it is
            hint = f" (set in {defaults_source(Path.cwd())})"
        # typer checks choices through pydantic, which puts "Value error, " before the reason
        message = error.format_message().replace(": Value error, ", ": ", 1)
        raise fail(f"{message}{hint}", error.exit_code) from None


def reader_gone() -> int:
    """The reader of stdout went away: stop quietly, as a tool killed by SIGPIPE would,
    with its exit code, and keep Python from failing on the final flush."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_BROKEN_PIPE


def reports_errors(command):
    """Turn CafaError into one line on stderr and its exit code; Ctrl-C into exit 130."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        completed.clear()
        try:
            return command(*args, **kwargs)
        except CafaError as error:
            if debug["on"]:
                raise
            message = as_flags(str(error))
            raise fail(f"{message}{_config_hint(kwargs.get('ctx'), message)}", error.exit_code) from None
        except KeyboardInterrupt:
            # an output renamed into place before the signal is whole and new; say so, as
            # exit 130 otherwise promises every output is as it was
            done = f" after writing {listing(completed)} completely" if completed else ""
            typer.echo(printable(f"cafa: interrupted{done}"), err=True)
            raise typer.Exit(code=EXIT_INTERRUPTED) from None
        except BrokenPipeError:  # `cafa adapt ... | head`
            raise typer.Exit(code=reader_gone()) from None
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except Exception as error:  # a bug or an environment failure: one line, traceback on --debug
            if out_of_memory(error):
                raise fail(OUT_OF_MEMORY, EXIT_RUNTIME) from None
            if debug["on"]:
                raise
            if (
                isinstance(error, OSError)
                and error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
                and not error.filename
            ):
                # the files cafa writes name themselves (files.naming_failures): this is stdout
                raise fail(f"cannot write standard output: {error.strerror}", EXIT_RUNTIME) from None
            if isinstance(error, OSError) and error.filename:
                # a path the tool was given: missing, unreadable, not writable, or the disk is full
                given = isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError))
                raise fail(
                    f"{error.filename}: {error.strerror or error}", EXIT_INPUT if given else EXIT_RUNTIME
                ) from None
            first = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
            raise fail(f"{type(error).__name__}: {first} (run with --debug for the traceback)", EXIT_RUNTIME) from None

    return wrapper
