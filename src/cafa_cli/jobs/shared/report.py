"""What pipelines read: prediction records (CSV or JSONL), summaries and metrics JSON."""

from __future__ import annotations

import codecs
import csv
import io
import json
import math
import sys
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import IO

from rich.console import Console
from rich.table import Table
from rich.text import Text

from cafa_cli.core.environment import environment
from cafa_cli.core.errors import UsageError, printable, undecodable
from cafa_cli.core.files import atomic_write, is_device, naming_failures, replacing
from cafa_cli.jobs.config.settings import RECORD_FORMATS
from cafa_cli.jobs.shared.results import CALIBRATION_BINS, Calibration, DomainResult, Record, auroc, h_score

FIELDS = ("path", "prediction", "label", "confidence")
OUTLIER_FIELDS = ("outlier", "id_score")  # with `outliers` in the stream: whether the image is one, and its score
# The units of the errors in the JSON outputs, named by a `unit` key in each object that
# holds errors: every `error` is a fraction of the labelled images (as it has always been,
# so readers that multiply by 100 stay right); bench's `table` holds the percentages its
# markdown table shows (docs/guides/adapt.md, Units of the errors)
ERROR_FRACTION = "error fraction"
ERROR_PERCENT = "error %"
# the units of a `calibration` object's values (docs/guides/adapt.md, Calibration)
CALIBRATION_UNITS = {
    "ece": "fraction",
    "nll": "nats per image",
    "brier": "sum over the classes per image, from 0 to 2",
}


def check_format(fmt: str) -> None:
    if fmt not in RECORD_FORMATS:
        raise UsageError(f"`format` must be one of {', '.join(RECORD_FORMATS)}, not {fmt}")


class RecordWriter:
    """One line per image, in stream order, flushed after every batch so that a
    pipeline (or an interrupted run) sees every line already promised. With `outliers`,
    two fields more: whether the image is an outlier, and its in-distribution score."""

    def __init__(self, stream: IO[str], fmt: str, class_names: Sequence[str], outliers: bool = False):
        check_format(fmt)
        self.stream, self.fmt, self.class_names, self.outliers = stream, fmt, list(class_names), outliers
        self._csv = csv.writer(stream, lineterminator="\n") if fmt == "csv" else None
        self._started = False  # the CSV header waits for the first records: a run that fails first writes nothing

    def _start(self) -> None:
        if not self._started and self._csv is not None:
            self._csv.writerow(FIELDS + OUTLIER_FIELDS * self.outliers)
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
                self._csv.writerow(row + ((int(r.outlier), f"{r.id_score:.6f}") if self.outliers else ()))
            else:
                record = dict(zip(FIELDS, row[:3]), confidence=round(r.confidence, 6))
                if self.outliers:
                    record.update(outlier=r.outlier, id_score=round(r.id_score, 6))
                self.stream.write(to_json({**record, "label": record["label"] or None}) + "\n")
        self.stream.flush()


class _NamedOutput:
    """A text file whose failed writes (a full disk) name the output, not a temporary file."""

    def __init__(self, file: IO[str], path: str):
        self.file, self.path = file, path

    def write(self, text: str) -> int:
        with naming_failures(self.path):
            return self.file.write(text)

    def flush(self) -> None:
        with naming_failures(self.path):
            self.file.flush()

    def close(self) -> None:
        with naming_failures(self.path):
            self.file.close()


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


@contextmanager
def _records_output(path: str | None) -> Iterator[IO[str]]:
    """stdout; a device or FIFO, written in place as the records come; or a file, written
    beside it and renamed over it when the run completes (a failed or interrupted run
    leaves an existing file as it was). Flushed however the run ends."""
    if path is None or path == "-":
        # a file name that is not valid UTF-8 comes out as its own bytes, as ls prints it
        if isinstance(sys.stdout, io.TextIOWrapper) and is_utf8(sys.stdout):
            sys.stdout.reconfigure(errors="surrogateescape")
        try:
            yield sys.stdout
        finally:
            sys.stdout.flush()
        return
    with ExitStack() as stack:
        target = path if is_device(path) else stack.enter_context(replacing(path))
        with naming_failures(path):
            output = _NamedOutput(open(target, "w", encoding="utf-8", errors="surrogateescape", newline=""), path)
        stack.callback(output.close)
        try:
            yield output
        finally:
            output.flush()


@contextmanager
def prediction_records(
    path: str | None, fmt: str, class_names: Sequence[str], outliers: bool = False
) -> Iterator[RecordWriter]:
    """The records' writer, on stdout or into `path`: finished (a CSV gets its header even
    with no record) when the run completes; with `outliers`, the fields that mark them."""
    with _records_output(path) as output:
        writer = RecordWriter(output, fmt, class_names, outliers)
        yield writer
        writer.finish()


def overall(results: Sequence[DomainResult]) -> dict:
    n = sum(r.n for r in results)
    labelled = sum(r.labelled for r in results)
    errors = sum(r.errors for r in results)
    return {
        "n": n,
        "labelled": labelled,
        "error": errors / labelled if labelled else None,
        "unit": ERROR_FRACTION,
        "calibration": calibration_record(Calibration.of(results)),
        "skipped_images": sum(len(r.skipped_images) for r in results),
        "skipped_steps": sum(r.skipped_steps for r in results),
        **_total("domain_changes", results),
        **_total("source_restarts", results),
        **open_world(results),
        "seconds": round(sum(r.seconds for r in results), 3),
    }


def open_world(results: Sequence[DomainResult]) -> dict:
    """With outliers in the streams: how many, the AUROC of telling them from the domains' own images by
    their scores, over every image of `results` together, and its harmonic mean with the accuracy
    (fractions); nothing without."""
    if not results or results[0].outlier_scores is None:
        return {}
    area = auroc([s for r in results for s in r.inlier_scores], [s for r in results for s in r.outlier_scores])
    labelled = sum(r.labelled for r in results)
    error = sum(r.errors for r in results) / labelled if labelled else None
    return {"outliers": sum(r.outliers for r in results), "auroc": area, "h_score": h_score(error, area)}


def _present(result: DomainResult, *fields: str) -> dict:
    """{field: its value} for each of `fields` the domain has (not None: the method or the
    stream setting has it), in that order."""
    return {field: getattr(result, field) for field in fields if getattr(result, field) is not None}


def _total(count: str, results: Sequence[DomainResult]) -> dict:
    """{count: its sum over the domains}, or nothing when no domain has it (the method lacks it)."""
    values = [getattr(r, count) for r in results if getattr(r, count) is not None]
    return {count: sum(values)} if values else {}


def metrics(method: str, results: Sequence[DomainResult], settings: dict, clean: dict | None = None) -> dict:
    """`clean`: the source model's error on the clean test set, when one was given."""
    return {
        "method": method,
        "environment": environment(settings["device"]),
        **overall(results),
        "domains": [domain_record(r) for r in results],
        "settings": settings,
        **({"clean": with_unit(clean)} if clean else {}),
    }


def with_unit(record: dict) -> dict:
    """An `error` record made elsewhere (the clean set's, clean.clean_error), with its unit."""
    return {**record, "unit": ERROR_FRACTION}


def domain_record(r: DomainResult) -> dict:
    return {
        "data": r.data,
        "n": r.n,
        "labelled": r.labelled,
        "error": r.error,
        "unit": ERROR_FRACTION,
        "calibration": calibration_record(r.calibration),
        "skipped_images": len(r.skipped_images),
        "skipped_steps": r.skipped_steps,
        **({"undefined_batches": r.undefined_batches} if r.undefined_batches else {}),
        **open_world([r]),
        **_present(r, "kept_samples", "domain_changes", "source_restarts", "round"),
        **({"adapted_share": r.adapted_batches / r.batches if r.batches else None} if r.paced else {}),
        "seconds": round(r.seconds, 3),
        "images_per_second": round(r.n / r.seconds, 1) if r.seconds else None,
    }


def calibration_record(calibration: Calibration) -> dict | None:
    """The calibration of a domain's (or a run's) labelled images, each value with its unit;
    None without a labelled image, as its `error` is."""
    if not calibration.n:
        return None
    return {
        "ece": calibration.ece,
        "nll": calibration.nll,
        "brier": calibration.brier,
        "bins": CALIBRATION_BINS,
        "units": CALIBRATION_UNITS,
    }


def to_json(payload, **options) -> str:
    """Standard JSON that every parser reads: a non-finite number (Python's json writes NaN
    and Infinity, which jq rejects) is null, and a file name's bytes that are not UTF-8
    (lone surrogates, which json writes as invalid escapes) are the text `\\xNN`."""
    return json.dumps(_standard(payload), allow_nan=False, **options)


def _standard(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, str) and any(undecodable(ch) for ch in value):
        return value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    if isinstance(value, dict):
        return {_standard(key): _standard(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_standard(item) for item in value]
    return value


def write_json(path: str, payload: dict) -> None:
    def write(tmp: str) -> None:
        Path(tmp).write_text(to_json(payload, indent=2) + "\n", encoding="utf-8")

    atomic_write(path, write)


def percent(error: float | None) -> str:
    return "n/a" if error is None else f"{100 * error:.2f}"


def above(error_percent: float, max_error: float) -> bool:
    """Whether an error (%) is above `max_error` by more than the rounding of the ×100 and
    the means (7 % comes out as 7.000000000000001): an error at the threshold passes."""
    return error_percent > max_error + 1e-9


def above_max_error(results: Sequence[DomainResult], max_error: float | None, method: str) -> str | None:
    """Why `cafa adapt --max-error` fails the run, in one line; None when it passes (or is not
    asked for). The error is over every labelled image read, as the summary's `all` row."""
    if max_error is None:
        return None
    labelled = sum(r.labelled for r in results)
    # the domains have labels (adapt checked them), and a domain with no readable image is refused: only
    # a domain whose labelled images all failed while its unlabelled ones were read gets here; fail closed
    if not labelled:
        return f"no labelled image could be read, so there is no error to hold to `max_error` {max_error:g}"
    error = 100 * sum(r.errors for r in results) / labelled
    return f"error {error:.2f} % is above `max_error` {max_error:g} ({method})" if above(error, max_error) else None


# columns for a table printed into a log or a pipe: more than any row needs, so that rich
# lays the table out at its own width instead of the 80 columns it assumes there
UNWRAPPED = 100_000


def print_table(console: Console, table: Table) -> None:
    """On a terminal the table fits the window (a long path folds onto more lines); into a
    log or a pipe each row stays on one line, whole, for grep and diff."""
    if console.is_terminal:
        console.print(table)
    else:
        Console(file=console.file, width=UNWRAPPED, quiet=console.quiet, highlight=False).print(table)


def summary_table(method: str, results: Sequence[DomainResult], source: str | None = None) -> Table:
    title = f"cafa adapt --method {method}" + (f", source: {source}" if source else "")
    table = Table(title=title, title_justify="left")
    table.add_column("data", overflow="fold")  # a long path folds onto more lines rather than losing its end
    paced = any(r.paced for r in results)  # a stream that does not wait: the share of batches adapted on
    labelled = any(r.labelled for r in results)  # the calibration's columns, where there are labels
    scored = bool(open_world(results))  # outliers in the streams: their count, the AUROC and H
    for column in (
        "images",
        *(["outliers"] * scored),
        "error %",
        *(CALIBRATION_COLUMNS * labelled),
        *(["AUROC %", "H %"] * scored),
        *(["adapted %"] * paced),
        "skipped",
        "img/s",
    ):
        table.add_column(column, justify="right")
    for r in results:
        rate = f"{r.n / r.seconds:.0f}" if r.seconds else "-"
        name = printable(r.data) + (f" (round {r.round})" if r.round is not None else "")
        shares = [adapted_percent(r.adapted_batches, r.batches)] * paced
        calibration = calibration_cells(r.calibration) * labelled
        outliers, scores = _scored_cells(open_world([r]))
        table.add_row(
            Text(name),
            str(r.n),
            *outliers,
            percent(r.error),
            *calibration,
            *scores,
            *shares,
            str(len(r.skipped_images)),
            rate,
        )
    if len(results) > 1:
        total = overall(results)
        rate = f"{total['n'] / total['seconds']:.0f}" if total["seconds"] else "-"
        shares = [adapted_percent(sum(r.adapted_batches for r in results), sum(r.batches for r in results))] * paced
        calibration = calibration_cells(Calibration.of(results)) * labelled
        outliers, scores = _scored_cells(total)
        table.add_row(
            "all",
            str(total["n"]),
            *outliers,
            percent(total["error"]),
            *calibration,
            *scores,
            *shares,
            str(total["skipped_images"]),
            rate,
            style="bold",
        )
    return table


CALIBRATION_COLUMNS = ("ECE %", "NLL", "Brier")


def calibration_cells(calibration: Calibration) -> list[str]:
    """The summary's ECE (%), NLL (nats) and Brier score of a domain's labelled images."""
    if not calibration.n:
        return ["n/a"] * 3
    return [percent(calibration.ece), f"{calibration.nll:.3f}", f"{calibration.brier:.3f}"]


def _scored_cells(record: dict) -> tuple[list[str], list[str]]:
    """The summary's outlier count, and its AUROC and H in %, of an `open_world` record (none without)."""
    if "auroc" not in record:
        return [], []
    return [str(record["outliers"])], [percent(record["auroc"]), percent(record["h_score"])]


def adapted_percent(adapted: int, batches: int) -> str:
    return f"{100 * adapted / batches:.0f}" if batches else "-"


def protocol_lines(protocol: dict) -> list[str]:
    """The summary's lines on a stream that does not wait, the rounds and forgetting (the JSON's keys)."""
    lines = []
    if "stream" in protocol:
        stream = protocol["stream"]
        cost = "no step" if stream["cost"] is None else f"{stream['cost']:.2f} forward passes a step"
        lines.append(
            f"stream rate {stream['rate']} (a batch every {stream['rate']} forward passes of the source model): "
            f"{cost} ({stream['cost_from']}), adapted on {100 * (stream['adapted_share'] or 0):.0f}% of the batches"
        )
    if "rounds" in protocol:
        rounds = protocol["rounds"]
        lines.append("error by round: " + ", ".join(f"{r['round']}: {percent(r['error'])}%" for r in rounds))
    if "forgetting" in protocol:
        lines.append(
            "forgetting, the error on the clean domain after each domain: "
            + ", ".join(
                printable(short_name(f["after"]))
                + (f" (round {f['round']})" if len(protocol.get("rounds", [])) > 1 else "")
                + f": {percent(f['error'])}%"
                for f in protocol["forgetting"]
            )
        )
    return lines


def short_name(name: str) -> str:
    """`…/fog/5` → `fog/5` (the ImageNet-C layout), else the folder or file name."""
    path = Path(name)
    return f"{path.parent.name}/{path.name}" if path.name.isdigit() and path.parent.name else (path.name or name)
