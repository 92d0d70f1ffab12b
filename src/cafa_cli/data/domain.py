"""A `Domain`: references to images, their labels as indices into the model's class
names, and a reader. Labels always go through class *names*, never through the order
of whatever folders a test set happens to have."""

from __future__ import annotations

import difflib
import json
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from cafa_cli.core.errors import InputError, listing, repeated
from cafa_cli.core.files import read_small_text
from cafa_cli.data.preprocessing import Preprocessing

# what reading a damaged, truncated or hostile image file raises
UNREADABLE = (OSError, UnidentifiedImageError, ValueError, SyntaxError, Image.DecompressionBombError)
MAX_CLASSES = 1_000_000  # class indices in a labels array; ImageNet-21k has 21,841 classes
# The most a class list (`classes`, `class_subset`) may hold: ImageNet's 1,000 names are 10 KB
# as wnids and 30 KB as words, ImageNet-21k's 21,841 under 1 MB; a file over 16 MiB is no
# class list (a link to /dev/zero, a sparse file) and is refused unread.
CLASS_LIST_LIMIT = 16 << 20


UNLABELLED = -1


@dataclass
class Domain:
    name: str
    refs: list[str]
    labels: np.ndarray  # int64, indexes class_names; UNLABELLED where unknown
    class_names: list[str]
    read: Callable[[int], Image.Image]
    indexed_labels: bool = False  # labels are output indices (arrays), not names
    ordered: bool = False  # a stream in time (data/ccc.py): read in its own order, whatever `order` says
    # what opening it noticed but let pass (one line each); the caller shows them as warnings
    notes: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.refs)

    @property
    def labelled(self) -> bool:
        return bool(len(self.labels)) and bool((self.labels != UNLABELLED).all())


def relabel(domain: Domain, class_names: list[str], listed_as: str = "the model's class list") -> Domain:
    """Map the domain's labels into `class_names` by name.

    Arrays carry label indices, not names: those are checked against the class count.
    `listed_as` says in an error what `class_names` is (a class subset, ...).
    """
    if domain.class_names == class_names or not domain.class_names:
        return replace(domain, class_names=class_names)
    if domain.indexed_labels:
        if int(domain.labels.max(initial=-1)) >= len(class_names):
            raise InputError(
                f"{domain.name}: label {int(domain.labels.max())} is out of range for {len(class_names)} classes"
            )
        return replace(domain, class_names=class_names)
    find = _class_finder(class_names)
    unknown = sorted(n for n in set(domain.class_names) if find(n) is None)
    used = set(domain.labels[domain.labels != UNLABELLED].tolist())
    unknown_used = [n for n in unknown if domain.class_names.index(n) in used]
    if unknown_used:
        shown = listing(unknown_used)
        remedy = (
            _severity_remedy(domain.name, unknown_used)
            or "rename them to the model's class names, or compute the statistics with their class list (cafa stats "
            "`classes`)"
        )
        raise InputError(
            f"{domain.name}: class folder(s) {shown} not in {listed_as} ({len(class_names)} "
            f"classes){did_you_mean(unknown_used, class_names)}; "
            f"{remedy}"
        )
    positions = [find(n) for n in domain.class_names]
    lookup = np.array([UNLABELLED if p is None else p for p in positions] + [UNLABELLED], dtype=np.int64)
    return replace(domain, labels=lookup[domain.labels], class_names=class_names)


def _severity_remedy(name: str, unknown: list[str]) -> str | None:
    """What to do when every unknown class folder is a severity, 1-5: the domain is a
    corruption folder (`ROOT/fog`, holding `3/`), given where one severity (`ROOT/fog/3`)
    was meant. Renaming the folders, the usual remedy, would be wrong there."""
    if not all(folder in ("1", "2", "3", "4", "5") for folder in unknown):
        return None
    return (
        f"they look like severity folders: give one of them ({name.rstrip('/')}/{unknown[0]}), "
        f"or `gradual` to visit them all"
    )


def _class_finder(class_names: list[str]) -> Callable[[str], int | None]:
    """A name's class position: by the exact name, else by its composed Unicode form where
    that form is one class's only. macOS writes folder names decomposed (NFD), most other
    systems and class lists composed (NFC), and the two print the same."""
    exact = {name: i for i, name in enumerate(class_names)}
    composed: dict[str, int | None] = {}
    for i, name in enumerate(class_names):
        key = unicodedata.normalize("NFC", name)
        composed[key] = None if key in composed else i  # two classes of one form: neither is found by it

    def find(name: str) -> int | None:
        return exact[name] if name in exact else composed.get(unicodedata.normalize("NFC", name))

    return find


def did_you_mean(unknown: list[str], known: list[str]) -> str:
    """' (did you mean coat for Coat?)' for the unknown names that are near a known one: the
    same but for case, spaces, hyphens or underscores, else close in spelling (difflib); ''
    when none is."""
    plain = {_plain(name): name for name in known}
    near = []
    for name in unknown[:5]:  # as many as a message lists; difflib compares each with every known name
        match = plain.get(_plain(name)) or next(iter(difflib.get_close_matches(name, known, n=1, cutoff=0.75)), None)
        if match is not None:
            near.append(f"{match} for {name}")
    return f" (did you mean {listing(near)}?)" if near else ""


def _plain(name: str) -> str:
    """A class name without case, spaces, hyphens or underscores, to suggest near misses."""
    return "".join(ch for ch in name.lower() if ch not in " -_")


def read_class_list(path: str, setting: str = "classes") -> list[str]:
    """One name a line (blank lines skipped); `setting` names the option in messages."""
    file = Path(path)
    if file.exists() and not file.is_file():
        # a pipe (`--classes <(...)`) can be read only once, and the list is read more than once
        raise InputError(f"`{setting}` {path}: not a regular file (a folder or a pipe); write the class list to a file")
    if not file.is_file():
        raise InputError(
            f"`{setting}` {path}: no such file (give one class name per line"
            f"{', in output order' if setting == 'classes' else ''})"
        )
    fix = "the class list must be UTF-8 text with one class name per line"
    # utf-8-sig: a byte-order mark (Windows editors) is not part of the first name
    text = read_small_text(path, f"`{setting}`", CLASS_LIST_LIMIT, fix)
    if "\0" in text:  # valid UTF-8 can still be binary: a safetensors header starts with NUL bytes
        raise InputError(f"`{setting}` {path}: not a UTF-8 text file; {fix}")
    names = _json_names(path, text, setting) if file.suffix.lower() == ".json" else text.splitlines()
    names = [name.strip() for name in names if name.strip()]
    if not names:
        raise InputError(f"`{setting}` {path}: the file lists no class names")
    duplicates = sorted(repeated(names))
    if duplicates:
        raise InputError(f"`{setting}` {path}: class names repeat: {', '.join(duplicates[:5])}")
    return names


def _json_names(path: str, text: str, setting: str) -> list[str]:
    """A .json class list: a list of names (CLIP's class name files are often so)."""
    try:
        names = json.loads(text)
    except json.JSONDecodeError as error:
        raise InputError(
            f"`{setting}` {path}: not JSON ({error.msg}, line {error.lineno}); give a list of names"
        ) from None
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise InputError(f'`{setting}` {path}: not a JSON list of names; give ["name", ...], in output order')
    return names


def padding_note(domain: Domain, preprocess: Preprocessing) -> str | None:
    """Preprocessing.padding_note for a domain's first readable image (one image: cheap)."""
    for i in range(min(len(domain), 8)):
        try:
            return preprocess.padding_note(domain.read(i), domain.name)
        except UNREADABLE:
            continue
    return None
