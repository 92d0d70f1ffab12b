"""The standard streams of a pipeline tool: data on stdout, people on stderr."""

from __future__ import annotations

import io
import logging
import sys

from rich.console import Console

from cafa_cli.core.errors import UsageError
from cafa_cli.jobs.shared.monitor import stderr_console
from cafa_cli.jobs.shared.report import ESCAPE_FOR_OUTPUT, is_utf8


def stderr(quiet: bool) -> Console:
    """The console for people; --quiet also silences the warnings torch logs itself
    (e.g. torch.compile's set-up) for the rest of the command."""
    if quiet:
        logging.getLogger("torch").setLevel(logging.ERROR)
    return stderr_console(quiet)


class ClosedOutput(io.TextIOBase):
    """Standard output closed by the shell (`>&-`): Python sets sys.stdout to None, and
    print() then drops everything silently. A command that writes there fails instead."""

    problem = "standard output is closed (>&-); redirect it to a file, or to /dev/null to discard it"

    def write(self, text: str) -> int:
        raise UsageError(self.problem)


def stdout_needed() -> None:
    """For a command whose results go to stdout: fail before the work, not after it."""
    if isinstance(sys.stdout, ClosedOutput):
        raise UsageError(ClosedOutput.problem)


def prepare_standard_streams() -> None:
    """An output encoding other than UTF-8 (PYTHONIOENCODING=ascii, a latin-1 locale) gets
    escapes for what it cannot encode instead of an exception in the middle of a run; a
    closed stdout fails at its first write."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper) and not is_utf8(stream):
            stream.reconfigure(errors=ESCAPE_FOR_OUTPUT)
    if sys.stdout is None:
        sys.stdout = ClosedOutput()
