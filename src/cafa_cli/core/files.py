"""Files the commands write and read: outputs checked before a long job, written
atomically, small text inputs read only when regular and bounded, and safetensors files
opened whatever their names' encoding."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tempfile
from pathlib import Path

from cafa_cli.core.errors import CafaError, InputError, WouldOverwrite


def check_writable(path: str | Path) -> Path:
    """A file name in an existing folder where a file can be made; checked before a long job
    as well as at the write."""
    target = _file_name(path)
    fd, probe = _temporary_beside(target)
    os.close(fd)
    os.unlink(probe)
    return target


def _file_name(path: str | Path) -> Path:
    """`path` as a file to write: not a folder, in a folder that exists."""
    target = Path(path)
    if target.is_dir():
        raise InputError(f"{target} is a folder; give a file name to write to")
    if str(path).endswith(os.sep):  # Path() drops the slash, and would write a file named as the folder
        raise InputError(f"{path} names a folder (it ends with {os.sep}); give a file name to write to")
    if target.parent.exists() and not target.parent.is_dir():
        raise InputError(f"cannot write {target}: {target.parent} is a file, not a folder; give a path in a folder")
    if not target.parent.exists():
        raise InputError(f"cannot write {target}: folder {target.parent} does not exist")
    return target


def _temporary_beside(target: Path) -> tuple[int, str]:
    """A new file in `target`'s folder, made as the write will make its own: permission bits
    do not tell for root, a read-only mount or a kernel file system such as /sys."""
    try:
        return tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as error:
        raise InputError(
            f"cannot write {target}: folder {target.parent} does not take new files ({error.strerror or error}); "
            f"give a path in a folder you can write"
        ) from None


def absolute(path: str | Path | None) -> str | None:
    """A path as the JSON outputs and artifacts record it (absolute, so it can be followed
    from anywhere), or None when none was given."""
    return str(Path(path).resolve()) if path else None


def make_workdir(path: str | Path) -> Path:
    """The --workdir of bench and demo: made when missing, else re-used with what an
    earlier run left there."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise InputError(f"`workdir` {folder} is a file; give a folder (it is made when missing)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise InputError(f"`workdir` {folder}: cannot create it ({error.strerror or error})") from None
    return folder


# The outputs of the job running (option -> path), while it runs (`writing`): every input
# opened through `reading` is compared with them, so that an input the up-front check
# (jobs/outputs.check_outputs) could not know (a module's file, a data set found through an
# environment variable, a plug-in's source) can no more be overwritten than a declared one.
_OUTPUTS: dict[str, str] = {}


# the names standard output and standard error go by among the outputs (`writing`): a file behind
# one (`>> file`) is written as much as an output option's
STREAM_PATHS = {"standard output": "/dev/fd/1", "standard error": "/dev/fd/2"}


@contextlib.contextmanager
def writing(outputs: dict[str, str | None]):
    """While the block runs, the files it will write are `outputs` (None, `-` and devices aside),
    and the regular files standard output and standard error go to (standard_streams)."""
    before = dict(_OUTPUTS)
    _OUTPUTS.update({option: path for option, path in outputs.items() if path and path != "-" and not is_device(path)})
    _OUTPUTS.update({name: STREAM_PATHS[name] for name in standard_streams(regular_only=True).values()})
    try:
        yield
    finally:
        _OUTPUTS.clear()
        _OUTPUTS.update(before)


def reading(path: str | Path | None, what: str) -> None:
    """The command is about to read the file `path` (as `what`): a UsageError, before any
    output is written, when one of its outputs is that file (by name, through a symlink,
    or as a hard link)."""
    if path is None or not _OUTPUTS:
        return
    identity, name = file_identity(str(path)), os.path.realpath(path)
    for option, output in _OUTPUTS.items():
        if file_identity(output) == identity or os.path.realpath(output) == name:
            named, fix = _output_and_fix(option, output)
            raise WouldOverwrite(
                f"{named} is also {what}'s file {path}, which this command reads; writing it would destroy that: {fix}"
            )


def _output_and_fix(option: str, output: str) -> tuple[str, str]:
    """How an error names an output, and the fix: another path for an option's, elsewhere for
    a stream's file."""
    if option in STREAM_PATHS:
        return f"{option} (redirected to {os.path.realpath(output)})", f"send {option} elsewhere"
    return f"{option} {output}", f"give {option} another path"


def reading_images(paths, what: str) -> None:
    """The command is about to read these image files (a domain's, reached through links, list
    lines or `..`): a UsageError, before any output is written, when one of its outputs is
    one of them. Costs a stat an image only when an output file exists already (a rerun over
    earlier results, or standard output sent to a file): a file that does not exist yet is no image."""
    existing = {}
    for option, output in _OUTPUTS.items():
        try:
            found = os.stat(output)
        except OSError:
            continue
        existing[(found.st_dev, found.st_ino)] = (option, output)
    if not existing:
        return
    for path in paths:
        try:
            found = os.stat(path)
        except (OSError, ValueError):  # an array's `file#3`, a name with a NUL: not a file of its own
            continue
        hit = existing.get((found.st_dev, found.st_ino))
        if hit:
            named, fix = _output_and_fix(*hit)
            raise WouldOverwrite(
                f"{named} is also the image {path} of {what}, which this command reads (through a link, a list line "
                f"or a redirection); writing it would destroy that: {fix}"
            )


def image_identity(ref: str, arrays: dict[str, tuple]) -> tuple:
    """The image a domain's `ref` names, whatever the name it is reached by (a relative path,
    `..`, a symlinked folder or class folder, a hard link): a file's (device, inode); an array
    row's `FILE.npy#3`, that file's identity and the row; a built-in set's row
    (`fashion-mnist-train#3`, no file), its name. `arrays` keeps each array file's identity
    (one stat a file, not a row)."""
    try:
        found = os.stat(ref)
    except (OSError, ValueError):
        head, mark, row = ref.rpartition("#")
        if not (mark and row.isdigit()):
            return (os.path.realpath(ref),)
        if head not in arrays:
            arrays[head] = file_identity(head)
        return (*arrays[head], int(row))
    return (found.st_dev, found.st_ino)


def standard_streams(regular_only: bool = False) -> dict[tuple, str]:
    """{identity: name} of the files behind standard output (whatever it is: a file, a pipe,
    a terminal; a regular file only, with `regular_only`) and standard error (when a regular
    file: a log the command appends to); /dev/null is none of them, as writing there loses nothing."""
    streams = {}
    null = os.stat(os.devnull)
    for fd, name in ((2, "standard error"), (1, "standard output")):
        try:
            found = os.fstat(fd)
        except OSError:
            continue
        if (found.st_dev, found.st_ino) == (null.st_dev, null.st_ino):
            continue
        if (fd == 1 and not regular_only) or stat.S_ISREG(found.st_mode):
            streams[(found.st_dev, found.st_ino)] = name
    return streams


def file_identity(path: str) -> tuple:
    """The file itself, whatever its name: a hard link or symlink to an input is that input."""
    try:
        found = os.stat(path)
    except OSError:
        return (os.path.realpath(path),)  # not there yet: its name is all it has
    return (found.st_dev, found.st_ino)


def is_device(path: str | Path) -> bool:
    """/dev/null, /dev/stdout, a FIFO: something that exists and is not a regular file."""
    return Path(path).exists() and not Path(path).is_file() and not Path(path).is_dir()


def read_small_text(path: str | Path, what: str, limit: int, fix: str, *, error: type = InputError) -> str:
    """The text of a small input (a recipe, cafa.toml, a list of classes, image ids or images),
    read only when `path` is a regular file of at most `limit` bytes, as UTF-8 less the
    byte-order mark some Windows editors put first (a BOM, quoted, made the first line a mystery).

    A FIFO is never opened (open() would wait for a writer for ever), nor a folder, device or
    socket: each is refused on its os.stat. A size over `limit` is refused before reading,
    and the reading stops at limit + 1 bytes all the same, for files whose size lies (/proc).
    Every failure is one `error` line `WHAT PATH: PROBLEM; FIX` (`what` as `reading` takes it,
    '' for a file named by its path alone)."""
    name = f"{what} {path}" if what else str(path)
    try:
        found = os.stat(path)
    except FileNotFoundError:
        problem = "a symbolic link that leads nowhere" if os.path.islink(path) else "no such file"
        raise error(f"{name}: {problem}; {fix}") from None
    except OSError as failure:
        raise error(f"{name}: cannot read it ({failure.strerror or failure}); {fix}") from None
    if not stat.S_ISREG(found.st_mode):
        raise error(f"{name}: not a regular file ({_kind(found.st_mode)}); {fix}")
    if found.st_size > limit:
        raise error(
            f"{name}: {found.st_size:,} bytes, over the limit of {_size(limit)} (no real one comes near it); {fix}"
        )
    # O_NONBLOCK: should a FIFO take the file's place after the stat, opening it returns at once
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        descriptor = os.open(path, flags)
    except OSError as failure:
        raise error(f"{name}: cannot read it ({failure.strerror or failure}); {fix}") from None
    with os.fdopen(descriptor, "rb", buffering=0) as file:
        mode = os.fstat(file.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise error(f"{name}: not a regular file ({_kind(mode)}); {fix}")
        chunks, total = [], 0
        try:
            while total <= limit:
                chunk = file.read(min(1 << 20, limit + 1 - total))
                if not chunk:
                    break
                chunks.append(chunk)
                total += len(chunk)
        except OSError as failure:
            raise error(f"{name}: cannot read it ({failure.strerror or failure}); {fix}") from None
    if total > limit:
        raise error(f"{name}: more than the limit of {_size(limit)} to read (its size said less); {fix}")
    try:
        return b"".join(chunks).decode("utf-8-sig")
    except UnicodeDecodeError:
        raise error(f"{name}: not a UTF-8 text file; {fix}") from None


def _kind(mode: int) -> str:
    """What a file that is not a regular one is, for the messages of read_small_text."""
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a special file"


def _size(limit: int) -> str:
    """1 MiB, 16 MiB, 512 KiB: a limit as the messages state it."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if limit >= scale and limit % scale == 0:
            return f"{limit // scale} {unit}"
    return f"{limit:,} bytes"


# outputs this command has completed: an interrupted command names them (cli/errors.py)
completed: list[str] = []


def atomic_write(path: str | Path, write) -> None:
    """Call write(temp_path), then move the result over `path`; see `replacing`."""
    with replacing(path) as tmp, naming_failures(path):
        write(tmp)


@contextlib.contextmanager
def replacing(path: str | Path):
    """A temporary file to write, moved over `path` when the block completes; on any failure
    (including KeyboardInterrupt) it is removed and the old `path` kept.

    A device or FIFO (/dev/null, /dev/stdout) is written in place: renaming over it would
    replace the device node itself. The writer gets a temporary file even then, which is
    copied to the device, because some writers (safetensors' save_file) do their own
    rename. A symlink's target is replaced, not the link."""
    if is_device(path):
        with tempfile.TemporaryDirectory(prefix="cafa-") as folder:
            tmp = os.path.join(folder, "output")
            yield tmp
            with naming_failures(path), open(tmp, "rb") as source, open(path, "wb") as device:
                shutil.copyfileobj(source, device)
        return
    target = _file_name(Path(os.path.realpath(path)) if os.path.islink(path) else path)
    fd, tmp = _temporary_beside(target)
    os.close(fd)
    try:
        yield tmp
        with contextlib.suppress(OSError):  # a file system without modes (FAT, some mounts) keeps its own
            os.chmod(tmp, _new_file_mode(target))
        try:
            os.replace(tmp, target)
        except OSError as error:  # an immutable or busy target: name it, not the temporary file
            raise InputError(
                f"cannot write {target}: {error.strerror or error}; check the file's permissions and attributes"
            ) from None
        completed.append(str(path))
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def naming_failures(path: str | Path):
    """A failed write (no space left, a file size limit) as an error that names the output
    `path`, not a temporary file or nothing at all. Only around code that writes it."""
    try:
        yield
    except OSError as error:
        fix = "; free space or give a path on another disk" if error.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        raise CafaError(f"cannot write {path}: {error.strerror or error}{fix}") from None


def _new_file_mode(target: Path) -> int:
    """The mode open(target, 'w') would give: the replaced file's, else 0o666 less the umask
    (mkstemp makes its file 0o600, which would hide artifacts from the group for good)."""
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except OSError:
        pass
    # the umask can only be read by setting it; set a strict one for that instant, so that
    # a file another thread creates meanwhile gets fewer permissions, never more
    umask = os.umask(0o077)
    os.umask(umask)
    return 0o666 & ~umask


@contextlib.contextmanager
def open_safetensors(path: str | Path, framework: str = "pt"):
    """safetensors' safe_open, also for a file name that is not UTF-8: safetensors takes the
    name as a Rust string, so such a file is opened here and read through its /dev/fd link.
    `framework` "numpy" reads numpy arrays, without importing torch."""
    from safetensors import safe_open

    try:
        os.fsencode(path).decode("utf-8")
    except UnicodeDecodeError:
        with open(path, "rb") as file, safe_open(f"/dev/fd/{file.fileno()}", framework=framework) as f:
            yield f
        return
    with safe_open(str(path), framework=framework) as f:
        yield f


def toml_problem(error: ValueError) -> str:
    """Why tomllib refused a text, in words: its own message, or for an integer beyond
    Python's conversion limit (4,300 digits) that it is too long, not Python's advice."""
    if "integer string conversion" in str(error):
        return "an integer of more than 4,300 digits"
    return str(error)


def open_lock_file(path: Path) -> int | None:
    """The hidden lock file beside `path` (`.NAME.lock`), for flock: made when missing,
    read-only when another user made it (flock needs no write access); None in a folder this
    process can neither write nor read."""
    for flags in (os.O_RDWR | os.O_CREAT, os.O_RDONLY):
        try:
            return os.open(path.with_name(f".{path.name}.lock"), flags, 0o666)
        except OSError:
            continue
    return None
