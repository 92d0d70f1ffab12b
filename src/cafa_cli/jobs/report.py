"""What pipelines read: prediction records (CSV or JSONL), summaries and metrics JSON."""

from __future__ import annotations

import codecs
import importlib.metadata
import csv
import io
import json
import math
import platform
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO
from rich.table import Table
from rich.text import Text
from cafa_cli import __version__
from cafa_cli.files import atomic_write, check_writable
from cafa_cli.errors import UsageError, printable, undecodable
from cafa_cli.jobs.results import DomainResult, Record


FORMATS = ("csv", "jsonl")


FIELDS = ("path", "prediction", "label", "confidence")


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise UsageError(f"--format must be one of {', '.join(FORMATS)}, not {fmt}")


class RecordWriter:
    """One line per image, in stream order, flushed after every batch so that a
    pipeline (or an interrupted run) sees every line already promised."""

    def __init__(self, stream: IO[str], fmt: str, class_names: Sequence[str]):
        check_format(fmt)
        self.stream, self.fmt, self.class_names = stream, fmt, list(class_names)
        self._csv = csv.writer(stream, lineterminator="\n") if fmt == "csv" else None
        self._started = False  # the CSV header waits for the first records: a run that fails first writes nothing

    def _start(self) -> None:
        if not self._started and self._csv is not None:
            self._csv.writerow(FIELDS)
        self._started = True

    def finish(self) -> None:
        """A run without a single record still gives a CSV with its header."""
        self._start()
        self.stream.flush()

    def _name(self, index: int) -> str:
        return self.class_names[index] if 0 <= index < len(self.class_names) else ""

    def write(self, records: list[Record]) -> None:
        if not records:  # a batch of unreadable images: no header yet, nothing truncated
            return
        self._start()
        for r in records:
            row = (r.ref, self._name(r.prediction), self._name(r.label), f"{r.confidence:.6f}")
            if self._csv is not None:
                self._csv.writerow(row)
            else:
                record = dict(zip(FIELDS, row[:3]), confidence=round(r.confidence, 6))
                self.stream.write(to_json({**record, "label": record["label"] or None}) + "\n")
        self.stream.flush()


class _OpenedOnFirstWrite:
    """A file that is only created (or truncated) when the first line comes, so a run
    that fails before its first prediction leaves an existing file as it was."""

    def __init__(self, path: Path):
        self.path, self._file = path, None

    def write(self, text: str) -> int:
        if self._file is None:
            self._file = open(self.path, "w", encoding="utf-8", errors="surrogateescape", newline="")
        return self._file.write(text)

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def is_utf8(stream: io.TextIOWrapper) -> bool:
    return codecs.lookup(stream.encoding).name == "utf-8"


def _escape_for_output(error: UnicodeError):
    """For an output encoding other than UTF-8: a file name's undecodable bytes (lone
    surrogates) go out as those bytes, as surrogateescape writes them; any other character
    the encoding lacks as a backslash escape (caf\\xe9) instead of an exception mid-run."""
    if isinstance(error, UnicodeEncodeError):
        text = error.object[error.start : error.end]
        if all(undecodable(ch) for ch in text):
            return bytes(ord(ch) - 0xDC00 for ch in text), error.end
    return codecs.backslashreplace_errors(error)


ESCAPE_FOR_OUTPUT = "cafa-escape"


codecs.register_error(ESCAPE_FOR_OUTPUT, _escape_for_output)


def open_output(path: str | None) -> IO[str]:
    if path is None or path == "-":
        # a file name that is not valid UTF-8 comes out as its own bytes, as ls prints it
        if isinstance(sys.stdout, io.TextIOWrapper) and is_utf8(sys.stdout):
            sys.stdout.reconfigure(errors="surrogateescape")
        return sys.stdout
    return _OpenedOnFirstWrite(check_writable(path))


@contextmanager
def prediction_records(path: str | None, fmt: str, class_names: Sequence[str]) -> Iterator[RecordWriter]:
    """The records' writer, on stdout or into `path`: finished (a CSV gets its header even
    with no record) when the run completes, flushed and closed however it ends."""
    output = open_output(path)
    writer = RecordWriter(output, fmt, class_names)
    try:
        yield writer
        writer.finish()
    finally:
        output.flush()
        if output is not sys.stdout:
            output.close()


def overall(results: Sequence[DomainResult]) -> dict:
    n = sum(r.n for r in results)
    labelled = sum(r.labelled for r in results)
    errors = sum(r.errors for r in results)
    return {
        "n": n,
        "labelled": labelled,
        "error": errors / labelled if labelled else None,
        "skipped_images": sum(len(r.skipped_images) for r in results),
        "skipped_steps": sum(r.skipped_steps for r in results),
        "seconds": round(sum(r.seconds for r in results), 3),
    }


def software_versions() -> dict[str, str]:
    """What ran: results can change with torch's kernels as well as with cafa."""
    return {"cafa": __version__, "python": platform.python_version(),
            **{package: importlib.metadata.version(package) for package in ("torch", "torchvision")}}


def metrics(method: str, results: Sequence[DomainResult], settings: dict) -> dict:
    return {
        "method": method,
        "versions": software_versions(),
        **overall(results),
        "domains": [domain_record(r) for r in results],
        "settings": settings,
    }


def domain_record(r: DomainResult) -> dict:
    return {
        "data": r.data,
        "n": r.n,
        "labelled": r.labelled,
        "error": r.error,
        "skipped_images": len(r.skipped_images),
        "skipped_steps": r.skipped_steps,
        "seconds": round(r.seconds, 3),
        "images_per_second": round(r.n / r.seconds, 1) if r.seconds else None,
    }


def to_json(payload, **options) -> str:
    """Standard JSON, which has no NaN or Infinity (Python's json writes them, and jq and
    most parsers reject them): a non-finite number is written as null."""
    return json.dumps(_finite(payload), allow_nan=False, **options)


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def write_json(path: str, payload: dict) -> None:
    def write(tmp: str) -> None:
        Path(tmp).write_text(to_json(payload, indent=2) + "\n", encoding="utf-8")

    atomic_write(path, write)


def percent(error: float | None) -> str:
    return "n/a" if error is None else f"{100 * error:.2f}"


def summary_table(method: str, results: Sequence[DomainResult]) -> Table:
    table = Table(title=f"cafa adapt --method {method}", title_justify="left")
    table.add_column("data", overflow="fold")  # a long path folds onto more lines rather than losing its end
    for column in ("images", "error %", "skipped", "img/s"):
        table.add_column(column, justify="right")
    for r in results:
        rate = f"{r.n / r.seconds:.0f}" if r.seconds else "-"
        table.add_row(Text(printable(r.data)), str(r.n), percent(r.error), str(len(r.skipped_images)), rate)
    if len(results) > 1:
        total = overall(results)
        rate = f"{total['n'] / total['seconds']:.0f}" if total["seconds"] else "-"
        table.add_row("all", str(total["n"]), percent(total["error"]), str(total["skipped_images"]), rate, style="bold")
    return table
