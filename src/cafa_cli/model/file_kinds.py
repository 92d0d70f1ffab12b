"""What a file is, told from its first bytes without importing torch: the signatures
that reading weights (checkpoints.py) and an artifact (artifact/reading.py) name a wrong
file by."""

from __future__ import annotations

import zipfile
from pathlib import Path

# the "format" of an Adapter state (engine/serving.py), in every version: such a file is no weights file
ADAPTER_STATE_FAMILY = "cafa-adapter-state-"


HTML_MARKERS = (b"<!doctype", b"<html", b"<?xml", b"<head")


# what a clone without git-lfs leaves in place of a large file: a few lines of text
LFS_POINTER = b"version https://git-lfs.github.com/spec/"


# torch.save writes a zip archive, or (legacy format) a pickle of protocol 2 or later
TORCH_SAVE_MARKERS = (b"PK", b"\x80")


PLAIN_PICKLE = (b"\x80\x04", b"\x80\x05")  # pickle protocol 4/5: pickle.dump's, never torch.save's


# running out of memory reading a file this small comes from a garbage length field, not from the weights
SMALL_FILE = 1 << 20


# what a user gave where an adaptation state cannot go: the options that take one
ADAPTER_STATE_HINT = (
    "give it as `state` to go on adapting (with `reset` never), or serve the adapted network from the file `export` "
    "writes"
)


def is_adapter_state(path: Path) -> bool:
    """Whether `path` is torch.save's archive of an Adapter.state_dict(): its pickle (stored,
    not compressed) holds the format's name. Read without unpickling anything."""
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [name for name in archive.namelist() if name.endswith("/data.pkl")]
            if len(pickles) != 1 or archive.getinfo(pickles[0]).file_size > SMALL_FILE:
                return False
            return ADAPTER_STATE_FAMILY.encode() in archive.read(pickles[0])
    except (OSError, zipfile.BadZipFile, ValueError):
        return False
