"""data.py and preprocessing.py: image sources, labels by name, sampling, CIFAR, preprocessing."""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import write_folder
from PIL import Image, UnidentifiedImageError
from torchvision.transforms import functional as TF

from cafa_cli.data import UNLABELLED, batches, loader_processes, open_domain, read_class_list, stratified_subset
from cafa_cli.errors import InputError, UsageError
from cafa_cli.preprocessing import IMAGENET_MEAN, IMAGENET_STD, Preprocessing, parse_floats, parse_size, to_mode

GREY = Preprocessing(resize=None, crop=None, mean=(0.0,), std=(1.0,), channels=1)


def save(path: Path, pixels: np.ndarray, fmt: str | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path, format=fmt)
    return path


def solid(value: int, size: int = 8) -> np.ndarray:
    return np.full((size, size), value, dtype=np.uint8)


# --- image folders -------------------------------------------------------------------


@pytest.fixture
def mixed_folder(tmp_path) -> Path:
    root = tmp_path / "data"
    save(root / "zebra" / "one.PNG", solid(10), "PNG")
    save(root / "zebra" / "two.JpG", solid(20), "JPEG")
    save(root / "zebra" / "nested" / "three.png", solid(30))
    save(root / "apple" / "four.jpeg", solid(40), "JPEG")
    save(root / "apple" / "five.bmp", solid(50), "BMP")
    (root / "apple" / "notes.txt").write_text("not an image")
    (root / "apple" / "README").write_text("no extension")
    save(root / ".cache" / "hidden.png", solid(60))
    save(root / "top-level.png", solid(70))  # ignored, with a note: the folder has class folders
    return root


def test_image_folder_extensions_and_class_names(mixed_folder):
    domain = open_domain(str(mixed_folder))
    assert domain.class_names == ["apple", "zebra"]
    names = [Path(r).name for r in domain.refs]
    assert sorted(names) == sorted(["one.PNG", "two.JpG", "three.png", "four.jpeg", "five.bmp"])
    by_name = dict(zip(names, domain.labels.tolist()))
    assert by_name == {"four.jpeg": 0, "five.bmp": 0, "one.PNG": 1, "two.JpG": 1, "three.png": 1}
    assert domain.labelled and len(domain) == 5
    values = {Path(domain.refs[i]).name: int(np.asarray(domain.read(i)).mean().round()) for i in range(len(domain))}
    assert values["one.PNG"] == 10 and values["three.png"] == 30 and values["five.bmp"] == 50
    assert abs(values["two.JpG"] - 20) <= 2  # JPEG


def test_hidden_files_are_skipped_and_symlinked_sub_folders_followed_once(mixed_folder, tmp_path):
    save(mixed_folder / "apple" / ".ipynb_checkpoints" / "copy.png", solid(1))
    save(mixed_folder / "apple" / "._four.jpeg", solid(2))  # macOS resource fork
    save(tmp_path / "elsewhere" / "six.png", solid(3))
    (mixed_folder / "apple" / "linked").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (mixed_folder / "apple" / "loop").symlink_to(mixed_folder / "apple", target_is_directory=True)
    (mixed_folder / "apple" / "up").symlink_to(mixed_folder, target_is_directory=True)  # would bring in the other classes
    (mixed_folder / "apple" / "gone.png").symlink_to(tmp_path / "deleted.png")  # broken: listed, then reported unreadable
    domain = open_domain(str(mixed_folder))
    apples = sorted(Path(r).name for r, label in zip(domain.refs, domain.labels) if label == 0)
    assert apples == ["five.bmp", "four.jpeg", "gone.png", "six.png"]
    failures = [why for batch in batches(domain, GREY, batch_size=8) for _, why in batch.failures]
    assert len(failures) == 1 and "FileNotFoundError" in failures[0]


def test_listing_order_is_pathlibs_component_by_component(tmp_path):
    """The order decides the stream and the sampled subset (so an artifact's images_sha256):
    it stays what sorting pathlib paths gave, where a plain string sort would differ
    ('x-1.png' < 'x.png' < 'x/1.png' as strings; 'x/1.png' first by component)."""
    for name in ("x.png", "x-1.png", "x/1.png", "x/sub/2.png", "B.png", "a.png"):
        save(tmp_path / "data" / "cls" / name, solid(1))
    for name in ("x.png", "x-1.png", "b.png"):
        save(tmp_path / "flat" / name, solid(1))
    for root in (tmp_path / "data", tmp_path / "flat"):
        refs = open_domain(str(root)).refs
        assert refs == [str(p) for p in sorted(Path(r) for r in refs)]
    assert [r.split("/cls/")[1] for r in open_domain(str(tmp_path / "data")).refs] == [
        "B.png", "a.png", "x/1.png", "x/sub/2.png", "x-1.png", "x.png"]


def test_a_folder_that_cannot_be_listed_is_an_error_not_skipped(mixed_folder, monkeypatch):
    real_scandir = os.scandir

    def scandir(path="."):
        if Path(path).name == "nested":  # root may list anything, so the refusal is made here
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    with pytest.raises(InputError, match="cannot list the folder .*nested .Permission denied.; fix its permissions"):
        open_domain(str(mixed_folder))


def test_top_level_images_beside_class_folders_are_noted(mixed_folder):
    """Ignored, as they have no class, but never silently: the note reaches the user as a warning."""
    for i in range(3):
        save(mixed_folder / f"loose{i}.png", solid(80))
    domain = open_domain(str(mixed_folder), class_names=["zebra", "apple"])
    assert len(domain) == 5
    assert domain.notes == [
        f"--data {mixed_folder}: ignoring 4 image(s) at the top level, outside the class folders "
        f"(loose0.png, loose1.png, loose2.png, top-level.png); move them into their class folders"
    ]


def test_class_folders_alone_or_a_flat_folder_have_no_notes(tmp_path, mixed_folder):
    (mixed_folder / "top-level.png").unlink()
    assert open_domain(str(mixed_folder)).notes == []
    save(tmp_path / "stream" / "a.png", solid(1))
    assert open_domain(str(tmp_path / "stream")).notes == []


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
    by_folder = {unicodedata.normalize("NFC", Path(ref).parent.name): int(label) for ref, label in zip(domain.refs, domain.labels)}
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


def test_unlabelled_folder(tmp_path):
    for i in range(3):
        save(tmp_path / "stream" / f"{i}.png", solid(i))
    (tmp_path / "stream" / "log.txt").write_text("x")
    domain = open_domain(str(tmp_path / "stream"))
    assert len(domain) == 3 and domain.class_names == []
    assert (domain.labels == UNLABELLED).all() and not domain.labelled
    relabelled = open_domain(str(tmp_path / "stream"), class_names=["a", "b"])
    assert relabelled.class_names == ["a", "b"] and (relabelled.labels == UNLABELLED).all()


def test_folder_without_images(tmp_path):
    (tmp_path / "empty" / "cls").mkdir(parents=True)
    (tmp_path / "empty" / "cls" / "a.txt").write_text("x")
    with pytest.raises(InputError, match="no images found"):
        open_domain(str(tmp_path / "empty"))


def test_missing_path_and_unknown_file_type(tmp_path):
    with pytest.raises(InputError, match="no such file or folder"):
        open_domain(str(tmp_path / "absent"))
    (tmp_path / "x.csv").write_text("1,2")
    with pytest.raises(InputError, match="expected an image folder"):
        open_domain(str(tmp_path / "x.csv"))


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
        f"--classes {path}: not a UTF-8 text file; the class list must be UTF-8 text with one class name per line"
    )


# --- arrays --------------------------------------------------------------------------


def test_grey_array_with_labels(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (6, 5, 7), dtype=np.uint8)
    labels = np.array([0, 2, 1, 2, 0, 1])
    np.save(tmp_path / "x.npy", images)
    np.save(tmp_path / "y.npy", labels)
    domain = open_domain(str(tmp_path / "x.npy"), labels=str(tmp_path / "y.npy"))
    assert len(domain) == 6 and domain.labels.tolist() == labels.tolist()
    assert domain.class_names == ["0", "1", "2"]
    image = domain.read(3)
    assert image.mode == "L" and image.size == (7, 5)
    assert np.array_equal(np.asarray(image), images[3])


def test_rgb_array_unlabelled(tmp_path):
    images = np.random.default_rng(1).integers(0, 256, (4, 6, 6, 3), dtype=np.uint8)
    np.save(tmp_path / "x.npy", images)
    domain = open_domain(str(tmp_path / "x.npy"))
    assert (domain.labels == UNLABELLED).all()
    image = domain.read(2)
    assert image.mode == "RGB" and np.array_equal(np.asarray(image), images[2])


@pytest.mark.parametrize("labels_per_block", [False, True])
def test_severity_picks_one_of_five_blocks(tmp_path, labels_per_block):
    per = 4
    images = np.stack([np.full((3, 3, 3), 10 * s + i, dtype=np.uint8) for s in range(5) for i in range(per)])
    labels = np.tile(np.array([3, 1, 0, 2]), 5)
    np.save(tmp_path / "c.npy", images)
    np.save(tmp_path / "l.npy", labels[:per] if labels_per_block else labels)
    domain = open_domain(str(tmp_path / "c.npy"), labels=str(tmp_path / "l.npy"), severity=3)
    assert len(domain) == per
    assert [int(np.asarray(domain.read(i))[0, 0, 0]) for i in range(per)] == [20, 21, 22, 23]
    assert domain.labels.tolist() == [3, 1, 0, 2]
    assert domain.refs[0].endswith("c.npy#8")


def test_array_errors(tmp_path):
    np.save(tmp_path / "f.npy", np.zeros((5, 4, 4), dtype=np.float32))
    with pytest.raises(InputError, match="expected uint8 images"):
        open_domain(str(tmp_path / "f.npy"))
    np.save(tmp_path / "x.npy", np.zeros((7, 4, 4), dtype=np.uint8))
    with pytest.raises(InputError, match="do not split into 5 severities"):
        open_domain(str(tmp_path / "x.npy"), severity=2)
    np.save(tmp_path / "y.npy", np.zeros((10, 4, 4), dtype=np.uint8))
    with pytest.raises(UsageError, match="--severity must be 1-5"):
        open_domain(str(tmp_path / "y.npy"), severity=6)
    np.save(tmp_path / "l.npy", np.zeros(3, dtype=np.int64))
    with pytest.raises(InputError, match="3 labels for 7 images"):
        open_domain(str(tmp_path / "x.npy"), labels=str(tmp_path / "l.npy"))
    with pytest.raises(UsageError, match="--labels is only for .npy arrays, and --data .* is not one"):
        open_domain(str(tmp_path), labels=str(tmp_path / "l.npy"))
    np.save(tmp_path / "n.npy", np.array([0, -1, 1, 0, 1, 0, 1]))  # -1 would pass for "unlabelled"
    with pytest.raises(InputError, match="labels must be class indices >= 0, not -1"):
        open_domain(str(tmp_path / "x.npy"), labels=str(tmp_path / "n.npy"))
    np.save(tmp_path / "h.npy", np.full(7, 2**40))  # a name per class index up to it would exhaust the memory
    with pytest.raises(InputError, match="class index 1099511627776 is past any classifier's outputs"):
        open_domain(str(tmp_path / "x.npy"), labels=str(tmp_path / "h.npy"))
    np.save(tmp_path / "u.npy", np.full(7, 2**63, dtype=np.uint64))  # int64 would read it as -2**63
    with pytest.raises(InputError, match="class index 9223372036854775808 is past"):
        open_domain(str(tmp_path / "x.npy"), labels=str(tmp_path / "u.npy"))
    np.save(tmp_path / "e.npy", np.zeros((0, 4, 4), dtype=np.uint8))
    with pytest.raises(InputError, match="e.npy: the array holds no images"):
        open_domain(str(tmp_path / "e.npy"))


def test_an_array_suffix_is_matched_in_any_case(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((3, 4, 4), dtype=np.uint8))
    (tmp_path / "x.npy").rename(tmp_path / "X.NPY")
    np.save(tmp_path / "l.npy", np.array([0, 1, 1]))
    domain = open_domain(str(tmp_path / "X.NPY"), labels=str(tmp_path / "l.npy"))
    assert domain.labels.tolist() == [0, 1, 1]


@pytest.mark.parametrize("spec", ["folder", "fashion-mnist", "-"])
def test_severity_without_a_stacked_array_is_a_usage_error(tmp_path, spec):
    """Ignoring it would adapt on every severity while the user believes in one."""
    write_folder(tmp_path / "folder", per_class=2)
    with pytest.raises(UsageError) as info:
        open_domain(str(tmp_path / spec) if spec == "folder" else spec, severity=3, stdin=io.StringIO("a.png\n"))
    assert str(info.value) == (
        "--severity is only for .npy arrays that stack 5 severities (CIFAR-10-C); "
        "for an image folder, give the folder of one severity as --data"
    )
    np.save(tmp_path / "cut.npy", np.zeros((10, 10), dtype=np.uint8))
    (tmp_path / "cut.npy").write_bytes((tmp_path / "cut.npy").read_bytes()[:100])
    with pytest.raises(InputError, match=r"--data .*cut\.npy: not a readable \.npy array \(EOF"):
        open_domain(str(tmp_path / "cut.npy"))


def _object_array(path):
    np.save(path, np.array([1, "a", None], dtype=object), allow_pickle=True)


def _npz(path):
    with open(path, "wb") as f:
        np.savez(f, a=np.zeros(3))


NOT_NPY = {
    "text": (lambda p: p.write_text("0\n1\n2\n"), "not a NumPy .npy array (no .npy header)"),
    "pickle": (lambda p: p.write_bytes(pickle.dumps([0, 1, 2])), "not a NumPy .npy array (no .npy header)"),
    "empty": (lambda p: p.write_bytes(b""), "not a NumPy .npy array (the file is empty)"),
    "npz": (_npz, "not a NumPy .npy array (a .npz archive)"),
    "objects": (_object_array, "the array holds Python objects, which cafa does not load"),
}


@pytest.mark.parametrize("case", NOT_NPY, ids=NOT_NPY.keys())
def test_npy_that_is_not_a_plain_array_never_suggests_allow_pickle(tmp_path, case):
    """numpy's own message advises allow_pickle=, and loading a pickle can run code."""
    make, why = NOT_NPY[case]
    np.save(tmp_path / "x.npy", np.zeros((3, 4, 4), dtype=np.uint8))
    make(tmp_path / "bad.npy")
    with pytest.raises(InputError) as info:
        open_domain(str(tmp_path / "bad.npy"))
    assert str(info.value) == (
        f"--data {tmp_path / 'bad.npy'}: {why}; save the images with numpy.save as a uint8 array, or give an image folder"
    )
    with pytest.raises(InputError) as info:
        open_domain(str(tmp_path / "x.npy"), labels=str(tmp_path / "bad.npy"))
    assert str(info.value) == f"--labels {tmp_path / 'bad.npy'}: {why}; save the labels with numpy.save as a 1-D integer array"
    assert "allow_pickle" not in str(info.value)


def test_array_labels_out_of_range_for_class_list(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((3, 4, 4), dtype=np.uint8))
    np.save(tmp_path / "l.npy", np.array([0, 1, 4]))
    with pytest.raises(InputError, match="label 4 is out of range for 3 classes"):
        open_domain(str(tmp_path / "x.npy"), class_names=["a", "b", "c"], labels=str(tmp_path / "l.npy"))


# --- stdin ---------------------------------------------------------------------------


def test_stdin_list(tmp_path):
    a = save(tmp_path / "a.png", solid(5))
    b = save(tmp_path / "b.png", solid(9))
    domain = open_domain("-", stdin=io.StringIO(f"{a}\n\n  \n  {b} \r\n"))  # spaces around a path that exists without them
    assert domain.refs == [str(a), str(b)]
    assert (domain.labels == UNLABELLED).all()
    assert np.asarray(domain.read(1)).max() == 9
    pipe = tmp_path / "pipe.png"
    os.mkfifo(pipe)  # opening it would wait for a writer forever
    with pytest.raises(UnidentifiedImageError, match="not a regular file"):
        open_domain("-", stdin=io.StringIO(f"{pipe}\n")).read(0)


def test_stdin_paths_are_taken_byte_for_byte(tmp_path):
    """A name may begin with a space or not be UTF-8: a path that exists as written is taken as written."""
    spaced = save(tmp_path / " x.png", solid(5))
    save(tmp_path / "x.png", solid(9))
    latin1 = tmp_path / os.fsdecode(b"caf\xe9.png")
    save(latin1, solid(7))
    stdin = io.TextIOWrapper(io.BytesIO(os.fsencode(spaced) + b"\n" + os.fsencode(latin1) + b"\r\n"))
    domain = open_domain("-", stdin=stdin)
    assert domain.refs == [str(spaced), str(latin1)]
    assert [np.asarray(domain.read(i)).max() for i in range(2)] == [5, 7]


def test_empty_stdin():
    with pytest.raises(InputError, match="stdin held no image paths"):
        open_domain("-", stdin=io.StringIO("\n  \n"))


# --- stratified subsets --------------------------------------------------------------


def labels_with(counts):
    return np.concatenate([np.full(n, c) for c, n in enumerate(counts)])[np.random.default_rng(0).permutation(sum(counts))]


def test_stratified_subset_takes_round_fraction_per_class():
    counts = [10, 30, 7, 100]
    labels = labels_with(counts)
    chosen = stratified_subset(labels, ["a", "b", "c", "d"], fraction=0.3, seed=0)
    assert np.bincount(labels[chosen], minlength=4).tolist() == [3, 9, 2, 30]
    assert np.all(np.diff(chosen) > 0), "sorted, no repeats"


def test_stratified_subset_per_class_caps_at_class_size():
    labels = labels_with([10, 3, 50])
    chosen = stratified_subset(labels, ["a", "b", "c"], per_class=5, seed=0)
    assert np.bincount(labels[chosen]).tolist() == [5, 3, 5]


def test_stratified_subset_seed():
    labels = labels_with([100, 100])
    first = stratified_subset(labels, ["a", "b"], fraction=0.3, seed=1)
    again = stratified_subset(labels, ["a", "b"], fraction=0.3, seed=1)
    other = stratified_subset(labels, ["a", "b"], fraction=0.3, seed=2)
    assert np.array_equal(first, again)
    assert not np.array_equal(first, other)
    assert np.bincount(labels[other]).tolist() == [30, 30]


def test_stratified_subset_names_classes_with_too_few():
    labels = labels_with([40, 7, 40, 3])
    with pytest.raises(InputError, match=r"rare \(1 of 7\), few \(0 of 3\); raise --fraction/--per-class"):
        stratified_subset(labels, ["common", "rare", "other", "few"], fraction=0.1, seed=0)


def test_classes_without_any_image_are_named_not_blamed_on_the_fraction():
    labels = labels_with([40, 7, 0, 0])
    with pytest.raises(InputError) as info:
        stratified_subset(labels, ["common", "rare", "tshirt_top", "bag"], fraction=0.1, seed=0)
    assert str(info.value) == (
        "no images of classes tshirt_top, bag in the data, and statistics need every class; "
        "give each its folder of images (e.g. tshirt_top/ in the --data folder)"
    )
    with pytest.raises(InputError, match=r"^no images of class bag in the data"):
        stratified_subset(labels_with([5, 5, 0]), ["a", "b", "bag"], per_class=2, seed=0)


def test_a_class_folder_that_is_missing_is_named(tmp_path):
    """The way it happens: the model's class list names a folder the data does not have."""
    write_folder(tmp_path / "d", per_class=3, classes=("a", "c"))
    domain = open_domain(str(tmp_path / "d"), class_names=["a", "b", "c"])
    with pytest.raises(InputError, match=r"^no images of class b in the data.*\(e\.g\. b/ in the --data folder\)$"):
        stratified_subset(domain.labels, domain.class_names, per_class=2, seed=0)


# --- CIFAR ---------------------------------------------------------------------------


def _py2_string(b) -> bytes:
    b = b.encode("latin1") if isinstance(b, str) else b
    return b"U" + bytes([len(b)]) + b if len(b) < 256 else b"T" + struct.pack("<i", len(b)) + b


def dumps_py2(obj) -> bytes:
    """A pickle byte for byte in the style of Python 2's cPickle protocol 2, as CIFAR's
    batches were written: str as BINSTRING, arrays via numpy.core.multiarray._reconstruct."""

    def enc(o) -> bytes:
        if o is None:
            return b"N"
        if isinstance(o, bool):
            return b"\x88" if o else b"\x89"
        if isinstance(o, int):
            return b"K" + bytes([o]) if 0 <= o < 256 else b"J" + struct.pack("<i", o)
        if isinstance(o, (str, bytes)):
            return _py2_string(o)
        if isinstance(o, tuple):
            return b"(" + b"".join(map(enc, o)) + b"t"
        if isinstance(o, list):
            return b"](" + b"".join(map(enc, o)) + b"e"
        if isinstance(o, dict):
            return b"}(" + b"".join(enc(k) + enc(v) for k, v in o.items()) + b"u"
        assert isinstance(o, np.ndarray) and o.dtype == np.uint8
        dtype = b"cnumpy\ndtype\n" + enc(("u1", 0, 1)) + b"R" + enc((3, "|", None, None, None, -1, -1, 0)) + b"b"
        head = b"cnumpy.core.multiarray\n_reconstruct\n" + b"cnumpy\nndarray\n" + enc((0,)) + enc("b") + b"\x87R"
        return head + b"(" + enc(1) + enc(tuple(o.shape)) + dtype + b"\x89" + _py2_string(o.tobytes()) + b"tb"

    return b"\x80\x02" + enc(obj) + b"."


CIFAR_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def make_cifar10(root: Path, per_batch: int = 3, style: str = "py2") -> tuple[np.ndarray, np.ndarray]:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    protocol = {"py2": None, "py3": 4, "py3-protocol2": 2, "py3-protocol5": 5}[style]
    dump = dumps_py2 if style == "py2" else lambda o: pickle.dumps(_bytes_keys(o), protocol=protocol)
    all_data, all_labels = [], []
    for b in range(1, 6):
        data = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, per_batch)]
        batch = {"batch_label": f"training batch {b} of 5", "labels": labels, "data": data, "filenames": [f"img_{b}_{i}.png" for i in range(per_batch)]}
        (folder / f"data_batch_{b}").write_bytes(dump(batch))
        all_data.append(data)
        all_labels += labels
    meta = {"num_cases_per_batch": per_batch, "label_names": CIFAR_NAMES, "num_vis": 3072}
    (folder / "batches.meta").write_bytes(dump(meta))
    return np.concatenate(all_data), np.array(all_labels)


def _bytes_keys(o):
    """What a Python 3 re-save of the python batches holds (bytes keys and names)."""
    if isinstance(o, dict):
        return {k.encode(): _bytes_keys(v) for k, v in o.items()}
    if isinstance(o, list):
        return [x.encode() if isinstance(x, str) else x for x in o]
    return o


@pytest.mark.parametrize("style", ["py2", "py3", "py3-protocol2", "py3-protocol5"])
def test_cifar10_python_batches(tmp_path, style):
    data, labels = make_cifar10(tmp_path, style=style)
    domain = open_domain(f"cifar10:{tmp_path}")
    assert len(domain) == 15
    assert domain.class_names == CIFAR_NAMES
    assert domain.labels.tolist() == labels.tolist()
    for i in (0, 7, 14):
        image = domain.read(i)
        assert image.mode == "RGB" and image.size == (32, 32)
        assert np.array_equal(np.asarray(image), data[i].reshape(3, 32, 32).transpose(1, 2, 0))


def test_cifar10_root_may_be_the_batches_folder(tmp_path):
    make_cifar10(tmp_path)
    assert len(open_domain(f"cifar10:{tmp_path / 'cifar-10-batches-py'}")) == 15


def test_cifar10_relabels_through_names(tmp_path):
    _, labels = make_cifar10(tmp_path)
    order = list(reversed(CIFAR_NAMES))
    domain = open_domain(f"cifar10:{tmp_path}", class_names=order)
    assert domain.labels.tolist() == (9 - labels).tolist()


class Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


@pytest.mark.parametrize("target", ["data_batch_3", "batches.meta"])
def test_cifar_pickle_with_code_is_refused(tmp_path, target):
    make_cifar10(tmp_path)
    marker = tmp_path / "pwned"
    payload = {b"data": Evil(marker), b"labels": [0]} if target != "batches.meta" else {b"label_names": Evil(marker)}
    (tmp_path / "cifar-10-batches-py" / target).write_bytes(pickle.dumps(payload, protocol=4))
    with pytest.raises(InputError, match=rf"{target}: not a readable CIFAR batch \(refusing to load posix\.mkdir\)"):
        open_domain(f"cifar10:{tmp_path}")
    assert not marker.exists()


def test_cifar_codecs_encode_only_rebuilds_latin1_bytes(tmp_path):
    make_cifar10(tmp_path)

    class Rot13:
        def __reduce__(self):
            import codecs

            return (codecs.encode, ("payload", "rot13"))

    (tmp_path / "cifar-10-batches-py" / "data_batch_1").write_bytes(pickle.dumps({b"data": Rot13()}, protocol=2))
    with pytest.raises(InputError, match=r"refusing to load _codecs\.encode with encoding 'rot13'"):
        open_domain(f"cifar10:{tmp_path}")


def test_cifar_os_system_reduce_is_refused(tmp_path):
    make_cifar10(tmp_path)

    class System:
        def __reduce__(self):
            return (os.system, ("true",))

    (tmp_path / "cifar-10-batches-py" / "data_batch_1").write_bytes(pickle.dumps({b"data": System()}))
    with pytest.raises(InputError, match=r"refusing to load (posix|os)\.system"):
        open_domain(f"cifar10:{tmp_path}")


def test_cifar_truncated_batch(tmp_path):
    make_cifar10(tmp_path)
    path = tmp_path / "cifar-10-batches-py" / "data_batch_2"
    path.write_bytes(path.read_bytes()[:500])
    with pytest.raises(InputError, match="data_batch_2: not a readable CIFAR batch"):
        open_domain(f"cifar10:{tmp_path}")


def _rewrite_batch(root: Path, name: str, edit) -> None:
    path = root / "cifar-10-batches-py" / name
    with open(path, "rb") as f:
        batch = pickle.load(f, encoding="bytes")
    path.write_bytes(pickle.dumps(edit(batch), protocol=2))


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda b: {**b, b"labels": b[b"labels"][:-1]}, "'labels' must hold one integer per image, 3"),  # would shift every later label
        (lambda b: {**b, b"labels": [12, 0, 1]}, "label 12 is out of range for the 10 classes"),
        (lambda b: {**b, b"labels": [-1, 0, 1]}, "label -1 is out of range"),
        (lambda b: {**b, b"labels": [0.5, 0, 1]}, "'labels' must hold one integer per image"),
        (lambda b: {**b, b"data": b[b"data"].astype(np.float32) / 255}, "'data' must be an N×3072 uint8 array, not float32 (3, 3072)"),  # would be black
        (lambda b: {**b, b"data": b[b"data"][:, :100]}, "not uint8 (3, 100)"),
        (lambda b: {k: v for k, v in b.items() if k != b"data"}, "'data' must be an N×3072 uint8 array, not NoneType"),
        (lambda b: [b], "a pickled list, not a dict"),
    ],
)
def test_a_malformed_cifar_batch_is_refused(tmp_path, edit, needle):
    make_cifar10(tmp_path, style="py3")
    _rewrite_batch(tmp_path, "data_batch_3", edit)
    with pytest.raises(InputError, match="data_batch_3: ") as info:
        open_domain(f"cifar10:{tmp_path}")
    assert needle in str(info.value) and "unpack the python version of the dataset again" in str(info.value)


def test_a_cifar_meta_file_without_names_is_refused(tmp_path):
    make_cifar10(tmp_path, style="py3")
    _rewrite_batch(tmp_path, "batches.meta", lambda meta: {**meta, b"label_names": []})
    with pytest.raises(InputError, match="batches.meta: not CIFAR's meta file"):
        open_domain(f"cifar10:{tmp_path}")


def test_missing_cifar_files_say_where(tmp_path):
    with pytest.raises(InputError) as info:
        open_domain(f"cifar10:{tmp_path}")
    message = str(info.value)
    assert str(tmp_path / "cifar-10-batches-py" / "data_batch_1") in message
    assert "data_batch_5" in message and "batches.meta" in message and "never downloads" in message
    make_cifar10(tmp_path / "partial")
    (tmp_path / "partial" / "cifar-10-batches-py" / "data_batch_4").unlink()
    with pytest.raises(InputError, match=r"missing in .*cifar-10-batches-py: data_batch_4;"):
        open_domain(f"cifar10:{tmp_path / 'partial'}")


def test_cifar100_train_file(tmp_path):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    data = np.random.default_rng(2).integers(0, 256, (4, 3072), dtype=np.uint8)
    names = [f"class{i:03d}" for i in range(100)]
    (folder / "train").write_bytes(dumps_py2({"data": data, "fine_labels": [5, 99, 0, 5], "coarse_labels": [1, 2, 3, 1]}))
    (folder / "meta").write_bytes(dumps_py2({"fine_label_names": names, "coarse_label_names": ["x"] * 20}))
    domain = open_domain(f"cifar100:{tmp_path}")
    assert domain.labels.tolist() == [5, 99, 0, 5] and domain.class_names == names
    assert np.array_equal(np.asarray(domain.read(1)), data[1].reshape(3, 32, 32).transpose(1, 2, 0))


# --- batches -------------------------------------------------------------------------


def test_batches_skip_unreadable_images(tmp_path):
    root = write_folder(tmp_path / "d", per_class=3, classes=("a", "b"), size=8)
    (root / "b" / "0001.png").write_bytes(b"\x89PNG broken")
    domain = open_domain(str(root))
    seen, failures = [], []
    for batch in batches(domain, GREY, batch_size=4):
        assert batch.images.shape == (len(batch.indices), 1, 8, 8)
        seen += batch.indices
        failures += batch.failures
    broken = domain.refs.index(str(root / "b" / "0001.png"))
    assert seen == [i for i in range(6) if i != broken]
    assert [i for i, _ in failures] == [broken]


def test_batches_follow_given_indices(tmp_path):
    images = np.stack([solid(i, 4) for i in range(10)])
    np.save(tmp_path / "x.npy", images)
    domain = open_domain(str(tmp_path / "x.npy"))
    order = np.array([7, 2, 9])
    got = [b for b in batches(domain, GREY, batch_size=2, indices=order)]
    assert [b.indices for b in got] == [[7, 2], [9]]
    assert got[0].images.dtype == torch.uint8
    assert got[0].images[:, 0, 0, 0].tolist() == [7, 2]


def test_batches_of_mixed_sizes_are_an_input_error(tmp_path):
    save(tmp_path / "m" / "a.png", solid(1, 4))
    save(tmp_path / "m" / "b.png", solid(1, 6))
    with pytest.raises(InputError, match="different sizes.*--resize"):
        list(batches(open_domain(str(tmp_path / "m")), GREY, batch_size=2))


def test_loader_processes_default_to_the_cores_on_cuda_and_none_on_the_cpu(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert loader_processes(None, cpu) == 0
    assert loader_processes(None, cuda) == 15  # the main process keeps one core
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun: four ranks share the machine's cores
    assert loader_processes(None, cuda) == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert loader_processes(None, cuda) == 0
    assert loader_processes(6, cuda) == 6 and loader_processes(2, cpu) == 2  # as asked


def test_batches_reject_bad_sizes(tmp_path):
    domain = open_domain("-", stdin=io.StringIO("x.png\n"))
    with pytest.raises(UsageError, match="--batch-size"):
        batches(domain, GREY, batch_size=0)
    with pytest.raises(UsageError, match="--num-workers"):
        batches(domain, GREY, batch_size=1, num_workers=-1)
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(UsageError, match=f"--num-workers {100 * cores} is more than 4 per CPU core"):  # not thousands of forks
        batches(domain, GREY, batch_size=1, num_workers=100 * cores)


# --- preprocessing -------------------------------------------------------------------


def model_input(prep: Preprocessing, image: Image.Image) -> torch.Tensor:
    return prep.normalize(prep.pixels(image))


@pytest.mark.parametrize("channels, mean, std", [(3, IMAGENET_MEAN, IMAGENET_STD), (1, (0.3,), (0.2,)), (3, (0.5,), (0.25,))])
def test_batched_normalisation_equals_per_image_to_tensor_bit_for_bit(channels, mean, std):
    """The loader stops at uint8 and the batch is normalised later; the numbers must be
    exactly those of torchvision's per-image to_tensor + normalize."""
    prep = Preprocessing(resize=12, crop=10, mean=mean, std=std, channels=channels)
    rng = np.random.default_rng(channels)
    images = [Image.fromarray(rng.integers(0, 256, (15, 17, 3), dtype=np.uint8)) for _ in range(4)]
    batch = prep.normalize(torch.stack([prep.pixels(image) for image in images]))
    for image, got in zip(images, batch):
        image = to_mode(image, "L" if channels == 1 else "RGB")
        image = TF.center_crop(TF.resize(image, 12, interpolation=TF.InterpolationMode.BILINEAR), 10)
        expected = TF.normalize(TF.to_tensor(image), list(mean) * (channels // len(mean)), list(std) * (channels // len(std)))
        assert torch.equal(got, expected)


def test_resize_shorter_side_then_centre_crop():
    image = Image.fromarray(np.zeros((20, 40, 3), dtype=np.uint8))  # H 20, W 40
    assert model_input(Preprocessing(resize=10, crop=None), image).shape == (3, 10, 20)
    assert model_input(Preprocessing(resize=10, crop=8), image).shape == (3, 8, 8)
    assert model_input(Preprocessing(resize=None, crop=6, channels=1, mean=(0.5,), std=(0.5,)), image).shape == (1, 6, 6)
    assert model_input(Preprocessing(resize=None, crop=None), image).shape == (3, 20, 40)


def test_centre_crop_takes_the_middle():
    pixels = np.arange(36, dtype=np.uint8).reshape(6, 6)
    out = model_input(Preprocessing(resize=None, crop=2, mean=(0,), std=(1,), channels=1), Image.fromarray(pixels))
    torch.testing.assert_close(out[0], torch.tensor([[14.0, 15.0], [20.0, 21.0]]) / 255)


def test_normalisation_values():
    grey = Image.fromarray(solid(128, 4))
    out = model_input(Preprocessing(resize=None, crop=None, mean=(0.5,), std=(0.25,), channels=1), grey)
    torch.testing.assert_close(out, torch.full((1, 4, 4), (128 / 255 - 0.5) / 0.25))
    rgb = Image.fromarray(np.tile(np.array([255, 0, 51], dtype=np.uint8), (2, 2, 1)))
    out = model_input(Preprocessing(resize=None, crop=None, mean=(0.1, 0.2, 0.3), std=(0.5, 0.25, 0.2)), rgb)
    expected = torch.tensor([(1 - 0.1) / 0.5, (0 - 0.2) / 0.25, (0.2 - 0.3) / 0.2])
    torch.testing.assert_close(out[:, 1, 1], expected)
    shared = model_input(Preprocessing(resize=None, crop=None, mean=(0.5,), std=(0.5,)), rgb)
    torch.testing.assert_close(shared[:, 0, 0], torch.tensor([1.0, -1.0, 0.2 * 2 - 1]))


def test_grey_image_to_rgb_and_rgb_to_grey():
    grey = Image.fromarray(solid(77, 2))
    out = model_input(Preprocessing(resize=None, crop=None, mean=(0,), std=(1,), channels=3), grey)
    assert out.shape == (3, 2, 2)
    torch.testing.assert_close(out, torch.full((3, 2, 2), 77 / 255))
    red = Image.fromarray(np.tile(np.array([255, 0, 0], dtype=np.uint8), (2, 2, 1)))
    assert to_mode(red, "L").getpixel((0, 0)) == 76  # ITU-R 601-2 luma: 0.299 · 255


def test_rgba_is_composited_on_white():
    pixels = np.zeros((1, 3, 4), dtype=np.uint8)
    pixels[0, 0] = (255, 0, 0, 255)  # opaque red
    pixels[0, 1] = (0, 0, 0, 0)  # fully transparent black
    pixels[0, 2] = (0, 0, 0, 128)  # half-transparent black
    image = Image.fromarray(pixels, "RGBA")
    rgb = np.asarray(to_mode(image, "RGB"))
    assert rgb[0, 0].tolist() == [255, 0, 0]
    assert rgb[0, 1].tolist() == [255, 255, 255]
    assert all(abs(v - 127) <= 1 for v in rgb[0, 2])
    grey = np.asarray(to_mode(image, "L"))
    assert grey[0, 1] == 255 and abs(int(grey[0, 2]) - 127) <= 1


def test_palette_images(tmp_path):
    image = Image.new("P", (3, 1))
    image.putpalette([255, 0, 0, 0, 255, 0, 0, 0, 255] + [0] * 759)
    image.putdata([0, 1, 2])
    path = tmp_path / "p.png"
    image.save(path)
    loaded = Image.open(path)
    assert loaded.mode == "P"
    assert np.asarray(to_mode(loaded, "RGB")).tolist() == [[[255, 0, 0], [0, 255, 0], [0, 0, 255]]]
    image.info["transparency"] = 1  # index 1 is transparent: white, not green
    image.save(path, transparency=1)
    loaded = Image.open(path)
    assert np.asarray(to_mode(loaded, "RGB")).tolist() == [[[255, 0, 0], [255, 255, 255], [0, 0, 255]]]


def test_sixteen_bit_png_is_rescaled_not_clipped(tmp_path):
    path = tmp_path / "deep.png"
    Image.fromarray(np.array([[0, 256, 32768, 65535]], dtype=np.uint16)).save(path)
    loaded = Image.open(path)
    assert loaded.mode.startswith("I")
    assert np.asarray(to_mode(loaded, "L")).tolist() == [[0, 1, 128, 255]]
    out = model_input(Preprocessing(resize=None, crop=None, mean=(0,), std=(1,), channels=3), loaded)
    torch.testing.assert_close(out[:, 0, 2], torch.full((3,), 128 / 255))


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"resize": 64}, r"^--crop 224 is larger than --resize 64: the centre crop would pad the image with black; give --crop 64 or less$"),
        ({"channels": 2}, "--channels"),
        ({"mean": (0.1, 0.2)}, r"^--mean needs 1 or 3 values for 3 channels, got 2$"),
        ({"std": (1.0, 0.0, 1.0)}, "--std values must be positive"),
        ({"resize": 0}, "--resize"),
        ({"crop": -3}, "--crop"),
        ({"resize": 100_000, "crop": None}, r"^--resize must be a whole number of pixels from 1 to 4096, or 'none'; not 100000$"),
        ({"channels": 1, "mean": (0.1, 0.2, 0.3)}, r"^--mean needs 1 value for 1 channel, got 3$"),
        ({"channels": 1, "mean": (0.1,), "std": (0.2, 0.3)}, r"^--std needs 1 value for 1 channel, got 2$"),
        # the user gave no --mean: the message must not say they gave three values
        ({"channels": 1}, r"^--channels 1: the default --mean is ImageNet's, with one value per RGB channel; give --mean and --std"),
    ],
)
def test_preprocessing_validation(kwargs, pattern):
    with pytest.raises(UsageError, match=pattern):
        Preprocessing(**kwargs)


def test_preprocessing_round_trip_and_parsers():
    prep = Preprocessing(resize=None, crop=28, mean=(0.3,), std=(0.2,), channels=1)
    assert Preprocessing.from_dict(json.loads(prep.to_json())) == prep
    assert prep.with_changes({"crop": None}).crop is None
    assert parse_size("none", "--crop") is None and parse_size(" NONE ", "--crop") is None and parse_size("224", "--crop") == 224
    with pytest.raises(UsageError, match=r"^--test-resize takes a whole number of pixels or 'none', not '1.5'$"):
        parse_size("1.5", "--test-resize")
    assert parse_floats("0.5,0.25", "--std") == (0.5, 0.25)
    with pytest.raises(UsageError, match="--mean takes comma-separated numbers"):
        parse_floats("0.5;0.2", "--mean")


def test_a_loader_workers_threads_stay_quiet_only_about_a_lost_main_process(monkeypatch):
    """The resource sharer of a worker loses its peer when an interrupted run exits; that is no error to print."""
    import multiprocessing.resource_sharer
    import sys

    from cafa_cli.data import _leave_signals_to_the_main_process, _quiet_when_the_main_process_is_gone

    printed = []
    monkeypatch.setattr(sys, "__excepthook__", lambda *exc: printed.append(exc[0]))
    for error in (ConnectionResetError, BrokenPipeError, EOFError, ValueError):
        _quiet_when_the_main_process_is_gone(error, error(), None)
    assert printed == [ValueError]
    # the hook the resource sharer reports through (multiprocessing/resource_sharer.py, _serve)
    assert "sys.excepthook(*sys.exc_info())" in open(multiprocessing.resource_sharer.__file__).read()
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # restored after the test
    monkeypatch.setattr("signal.signal", lambda *args: None)
    _leave_signals_to_the_main_process(0)
    assert sys.excepthook is _quiet_when_the_main_process_is_gone


def test_the_loader_pins_a_batchs_images(monkeypatch):
    """DataLoader(pin_memory=True) pins what has a pin_memory method and passes a plain
    dataclass through as it is: the GPU copies would then block the host."""
    from torch.utils.data._utils.pin_memory import pin_memory

    from cafa_cli.data import Batch

    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pinned.append(self) or self.clone())  # no CUDA here
    batch = Batch(torch.zeros(2, 1, 4, 4, dtype=torch.uint8), [0, 1], [(2, "bad")])
    out = pin_memory(batch)
    assert len(pinned) == 1 and pinned[0] is batch.images and out.images is not batch.images
    assert (out.indices, out.failures) == ([0, 1], [(2, "bad")])
    assert pin_memory(Batch(None, [], [(0, "bad")])).images is None
