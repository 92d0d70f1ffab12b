"""Errors a user can cause, each mapped to one exit code.

Messages are one line that names the problem and the fix; the CLI prints them
without a traceback.
"""

import difflib
import unicodedata
from collections import Counter

EXIT_RUNTIME = 1  # the tool failed (out of memory, a bug, the environment); Ctrl-C exits 130
EXIT_USAGE = 2  # an option value is wrong
EXIT_INPUT = 3  # a file or folder given to the tool is missing or unreadable


class CafaError(Exception):
    """An error the command line reports as one line, without a traceback (exit 1; its subclasses 2 and 3)."""

    exit_code = EXIT_RUNTIME


class UsageError(CafaError):
    """A bad argument or option value (exit 2); the message names the setting as its keyword is called."""

    exit_code = EXIT_USAGE


class WouldOverwrite(UsageError):
    """An output that is a file the command reads (files.reading): the user's choice of
    output, however deep the reading that found it."""


class InputError(CafaError):
    """A file or input that cannot be used: an artifact, weights, images, a model that does not fit them (exit 3)."""

    exit_code = EXIT_INPUT


def out_of_memory(error: BaseException) -> bool:
    """The host's MemoryError; the GPU's (torch.cuda.OutOfMemoryError, a RuntimeError); torch's
    CPU allocator failing (a RuntimeError: "[enforce fail at alloc_cpu.cpp:127] err == 0.
    DefaultCPUAllocator: can't allocate memory: you tried to allocate ..."). Matched by name
    and text, so that the command line need not import torch."""
    return (
        isinstance(error, MemoryError)
        or type(error).__name__ == "OutOfMemoryError"
        or (isinstance(error, RuntimeError) and "DefaultCPUAllocator" in str(error))
    )


def listing(items, limit: int = 5) -> str:
    """'a, b, c' or 'a, b, c, d, e and 7 more': names in a one-line message."""
    items = [str(item) for item in items]
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _close_names(name: str, names: list[str]) -> list[str]:
    """Names a mistyped one may mean: those that contain it, or spell it nearly alike,
    ignoring case, `-` and `_` (resnet-50, ResNet50, resnt50 → resnet50)."""

    def plain_of(text: str) -> str:
        return text.lower().replace("-", "").replace("_", "")

    plain = {plain_of(n): n for n in names}  # the names spelt as `wanted` is (ViT-B-32 as vitb32)
    wanted = plain_of(name)
    exact = [n for key, n in plain.items() if key == wanted]
    containing = [n for key, n in plain.items() if wanted in key]
    close = [plain[key] for key in difflib.get_close_matches(wanted, plain, n=5, cutoff=0.8)]
    return (exact or containing or close)[:5]


def did_you_mean(name: str, names: list[str]) -> str:
    """' (did you mean resnet50?)' for a mistyped name among `names`, else ''."""
    close = _close_names(name, names)
    return f" (did you mean {', '.join(close)}?)" if close else ""


def repeated(items, key=lambda item: item) -> list:
    """The items whose `key` occurs more than once, each once, in the order first given:
    for the messages that name what a list repeats."""
    keys = [key(item) for item in items]
    counts = Counter(keys)
    found, named = [], set()
    for item, k in zip(items, keys):
        if counts[k] > 1 and k not in named:
            named.add(k)
            found.append(item)
    return found


def undecodable(ch: str) -> bool:
    """A byte of a file name that is not UTF-8, as os.fsdecode keeps it: a lone surrogate."""
    return "\udc80" <= ch <= "\udcff"


def printable(text: str) -> str:
    """`text` with control characters and bidi controls shown as escapes (`\\x1b`, `\\n`,
    `\\u202e`): a file name or an artifact's metadata is not to move the cursor, recolour
    or clear the terminal, reverse the text around it, or break a one-line message."""
    return "".join(ch.encode("unicode_escape").decode() if _unprinted(ch) else ch for ch in text)


# bidi embeddings, overrides, isolates and marks: they reorder the text around them
BIDI_CONTROLS = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def _unprinted(ch: str) -> bool:
    """Controls, line and paragraph separators, bidi controls; not the joiners that
    Persian names and emoji need."""
    return unicodedata.category(ch) in ("Cc", "Zl", "Zp") or ch in BIDI_CONTROLS
