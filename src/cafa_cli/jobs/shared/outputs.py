"""Outputs checked against inputs before any work: a result file must never replace
what the command reads, nor land in a folder it reads images from."""

from __future__ import annotations

import functools
import os
from pathlib import Path

from cafa_cli.core.errors import UsageError
from cafa_cli.core.files import check_writable, file_identity, is_device, standard_streams, writing
from cafa_cli.data.folders import IMAGE_EXTENSIONS
from cafa_cli.data.sources import on_disk

IMAGE_INPUTS = ("`data`", "`train`", "`clean`")  # the options whose folders are searched for images


def _each_path(options: dict[str, str | list[str] | None]) -> list[tuple[str, str]]:
    """(option, path) for every path given, an option that takes several once for each."""
    return [
        (option, path)
        for option, paths in options.items()
        for path in ([paths] if isinstance(paths, str) else paths or [])
    ]


def check_outputs(outputs: dict[str, str | None], inputs: dict[str, str | list[str] | None]) -> None:
    """Every output file can be written, and is neither an input nor another output (`--out`
    naming the `--weights` file would replace the checkpoint with an artifact), nor a file
    the next run would read as an image of the data: checked before any work, not after a
    long run. `-` (stdout) is for the records only; callers map it before they get here."""
    empty = [option for option, path in _each_path({**outputs, **inputs}) if not path.strip()]
    if empty:  # Path("") is the working directory: an unset shell variable would read or write there
        raise UsageError(f"{empty[0]} is given an empty path (an unset shell variable?); give a file or folder")
    given = [(option, on_disk(path)) for option, path in _each_path(inputs)]
    taken = {file_identity(path): option for option, path in given if path != "-" and Path(path).is_file()}
    folders = [(option, os.path.realpath(path)) for option, path in given if Path(path).is_dir()]
    streams = standard_streams()
    for option, path in outputs.items():
        if path is None:
            continue
        stream = streams.get(file_identity(path))  # a file not there yet has its name for identity: no stream
        if stream and not (option == "`predictions`" and stream == "standard output"):
            # the records, the tables or the log go there too: one would replace or garble the other
            raise UsageError(
                f"{option} {path} is the file {stream} goes to (a redirection, /dev/stdout, /dev/fd/N); give "
                f"{option} another path, or send {stream} elsewhere"
            )
        if is_device(path):
            continue
        if path == "-":
            raise UsageError(
                f"{option} -: only the records of cafa adapt (`predictions`) go to standard output; give {option} a "
                "file name"
            )
        check_writable(path)
        key = os.path.realpath(path)
        inside = [folder_option for folder_option, folder in folders if key.startswith(folder + os.sep)]
        if inside and Path(path).is_file():
            raise UsageError(f"{option} {path} is a file inside an input folder; give {option} a path outside the data")
        read_by = [folder_option for folder_option in inside if folder_option in IMAGE_INPUTS]
        if read_by and Path(path).suffix.lower() in IMAGE_EXTENSIONS:
            raise UsageError(
                f"{option} {path} would be read as an image of {read_by[0]} next time; give {option} a path outside "
                "the data"
            )
        identity = file_identity(path)
        if identity in taken:
            raise UsageError(
                f"{option} {path} is also the {taken[identity]} file; writing it would destroy that: give {option} "
                "another path"
            )
        taken[identity] = option


def guards_outputs(job):
    """A job `job(config, ...)` during which every input it opens (files.reading) is checked
    against `config.outputs()`: the inputs that check_outputs, before the work, cannot know."""

    @functools.wraps(job)
    def run(config, *args, **kwargs):
        with writing(config.outputs()):
            return job(config, *args, **kwargs)

    return run
