"""data/domain.py: labels mapped into the model's class list by name, and class list files."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import save, solid

from cafa_cli.core.errors import InputError
from cafa_cli.data.domain import read_class_list
from cafa_cli.data.sources import open_domain


def test_relabel_by_name_into_the_model_order(mixed_folder):
    domain = open_domain(str(mixed_folder), class_names=["zebra", "mango", "apple"])
    assert domain.class_names == ["zebra", "mango", "apple"]
    by_name = {Path(r).name: int(label) for r, label in zip(domain.refs, domain.labels)}
    assert by_name["one.PNG"] == 0 and by_name["four.jpeg"] == 2


def test_class_folders_match_the_class_list_in_either_unicode_form(tmp_path):
    """macOS writes café as c-a-f-e + combining accent (NFD); a class list has é (NFC)."""
    import unicodedata

    for name in ("café", "naïve"):
        save(tmp_path / "d" / unicodedata.normalize("NFD", name) / "x.png", solid(1))
    domain = open_domain(str(tmp_path / "d"), class_names=["naïve", "café"])
    by_folder = {
        unicodedata.normalize("NFC", Path(ref).parent.name): int(label)
        for ref, label in zip(domain.refs, domain.labels)
    }
    assert by_folder == {"naïve": 0, "café": 1} and domain.class_names == ["naïve", "café"]


def test_two_classes_of_one_unicode_form_are_matched_exactly_only(tmp_path):
    """An artifact may hold café twice, composed and decomposed: a folder matches its own."""
    import unicodedata

    decomposed = unicodedata.normalize("NFD", "café")
    save(tmp_path / "d" / decomposed / "x.png", solid(1))
    domain = open_domain(str(tmp_path / "d"), class_names=["café", decomposed, "x"])
    assert domain.labels.tolist() == [1]


def test_folder_missing_from_class_list_is_named(mixed_folder):
    with pytest.raises(InputError, match=r"class folder\(s\) zebra not in the model's class list \(2 classes\)"):
        open_domain(str(mixed_folder), class_names=["apple", "pear"])


def test_empty_folder_missing_from_class_list_is_fine(mixed_folder):
    (mixed_folder / "empty").mkdir()
    domain = open_domain(str(mixed_folder), class_names=["zebra", "apple"])
    assert domain.class_names == ["zebra", "apple"] and set(domain.labels.tolist()) == {0, 1}


def test_array_labels_out_of_range_for_class_list(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((3, 4, 4), dtype=np.uint8))
    np.save(tmp_path / "l.npy", np.array([0, 1, 4]))
    with pytest.raises(InputError, match="label 4 is out of range for 3 classes"):
        open_domain(str(tmp_path / "x.npy"), class_names=["a", "b", "c"], labels=str(tmp_path / "l.npy"))


def test_read_class_list(tmp_path):
    path = tmp_path / "classes.txt"
    path.write_text("cat\n\n dog \nemu\n")
    assert read_class_list(str(path)) == ["cat", "dog", "emu"]
    path.write_bytes("\ufeffcat\r\ndog\r\n".encode())  # Notepad: a byte-order mark and CRLF
    assert read_class_list(str(path)) == ["cat", "dog"]
    path.write_text("cat\ndog\ncat\n")
    with pytest.raises(InputError, match="repeat: cat"):
        read_class_list(str(path))
    path.write_text("\n\n")
    with pytest.raises(InputError, match="no class names"):
        read_class_list(str(path))
    with pytest.raises(InputError, match="no such file"):
        read_class_list(str(tmp_path / "absent.txt"))
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)  # as `--classes <(...)` gives: readable once, and the list is read more than once
    with pytest.raises(InputError, match="not a regular file .a folder or a pipe.; write the class list to a file"):
        read_class_list(str(pipe))


@pytest.mark.parametrize("kind", ["safetensors", "latin-1", "nul"])
def test_binary_class_list_is_an_input_error(tmp_path, kind):
    path = tmp_path / "classes.txt"
    if kind == "safetensors":  # the weights given by mistake
        from safetensors.torch import save_file

        save_file({"w": torch.randn(4, 4)}, str(path))
    else:
        path.write_bytes("café\nthé\n".encode("latin-1") if kind == "latin-1" else b"cat\x00\ndog\n")
    with pytest.raises(InputError) as info:
        read_class_list(str(path))
    assert str(info.value) == (
        f"`classes` {path}: not a UTF-8 text file; the class list must be UTF-8 text with one class name per line"
    )
