"""Progress, warnings and notes for people: a rich console on stderr, quiet when asked."""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from cafa_cli.core.errors import printable


def stderr_console(quiet: bool = False) -> Console:
    return Console(stderr=True, quiet=quiet, highlight=False)


def progress_bar(console: Console, quiet: bool = False) -> Progress:
    """A progress bar on stderr, silent when stderr is not a terminal or with --quiet."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]:>8} img/s"),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),  # from rich's own speed estimate over the last 30 s
        console=console,
        disable=quiet or not console.is_terminal,
        transient=False,
        redirect_stdout=False,  # stdout is the data (demo --data-only prints paths while a bar is live)
    )


class Monitor:
    """Progress and warnings for a long job, on stderr; silent when `console` is quiet."""

    def __init__(self, console: Console | None = None, quiet: bool = True, render: Callable[[str], str] = str):
        """`render` turns the library's words into the reader's: the command line shows a
        setting named `lr` as --lr (cli/errors.as_flags)."""
        self.console = console or stderr_console(quiet=True)
        self.quiet, self.render = quiet, render
        self._progress = progress_bar(self.console, quiet)
        self._task = None
        self._started = 0.0
        self._done = 0

    def __enter__(self) -> Monitor:
        self._progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.__exit__(*exc)

    def start(self, description: str, total: int) -> None:
        self._task = self._progress.add_task(escape(printable(description)), total=total, rate="-", status="")
        self._started, self._done = time.perf_counter(), 0

    def advance(self, images: int, status: str = "") -> None:
        self._done += images
        elapsed = time.perf_counter() - self._started
        rate = f"{self._done / elapsed:.0f}" if elapsed > 0 else "-"
        self._progress.update(self._task, advance=images, rate=rate, status=status)

    def warn(self, message: str) -> None:
        if not self.quiet:
            # a path may hold [brackets] that rich would read as markup
            self.console.print(
                f"[yellow]warning:[/] {escape(printable(self.render(message)))}",
                markup=True,
                highlight=False,
                soft_wrap=True,
            )

    def info(self, message: str) -> None:
        if not self.quiet:
            self.console.print(printable(self.render(message)), markup=False, highlight=False, soft_wrap=True)
