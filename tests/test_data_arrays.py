"""data/arrays.py: .npy arrays (CIFAR-10-C severities included) and the CIFAR python batches."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY_NET, invoke
from helpers import CIFAR_NAMES, dumps_py2, fails, make_cifar10

from cafa_cli.core.errors import InputError, UsageError
from cafa_cli.data.domain import UNLABELLED
from cafa_cli.data.sources import open_domain

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
    with pytest.raises(UsageError, match="`severity` must be 1-5"):
        open_domain(str(tmp_path / "y.npy"), severity=6)
    np.save(tmp_path / "l.npy", np.zeros(3, dtype=np.int64))
    with pytest.raises(InputError, match="3 labels for 7 images"):
        open_domain(str(tmp_path / "x.npy"), labels=str(tmp_path / "l.npy"))
    with pytest.raises(UsageError, match="`labels` is only for .npy arrays, and `data` .* is not one"):
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
        f"`data` {tmp_path / 'bad.npy'}: {why}; save the images with numpy.save as a uint8 array, or give an image folder"
    )
    with pytest.raises(InputError) as info:
        open_domain(str(tmp_path / "x.npy"), labels=str(tmp_path / "bad.npy"))
    assert (
        str(info.value)
        == f"`labels` {tmp_path / 'bad.npy'}: {why}; save the labels with numpy.save as a 1-D integer array"
    )
    assert "allow_pickle" not in str(info.value)


# --- CIFAR ---------------------------------------------------------------------------


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
        (
            lambda b: {**b, b"labels": b[b"labels"][:-1]},
            "'labels' must hold one integer per image, 3",
        ),  # would shift every later label
        (lambda b: {**b, b"labels": [12, 0, 1]}, "label 12 is out of range for the 10 classes"),
        (lambda b: {**b, b"labels": [-1, 0, 1]}, "label -1 is out of range"),
        (lambda b: {**b, b"labels": [0.5, 0, 1]}, "'labels' must hold one integer per image"),
        (
            lambda b: {**b, b"data": b[b"data"].astype(np.float32) / 255},
            "'data' must be an N×3072 uint8 array, not float32 (3, 3072)",
        ),  # would be black
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
    (folder / "train").write_bytes(
        dumps_py2({"data": data, "fine_labels": [5, 99, 0, 5], "coarse_labels": [1, 2, 3, 1]})
    )
    (folder / "meta").write_bytes(dumps_py2({"fine_label_names": names, "coarse_label_names": ["x"] * 20}))
    domain = open_domain(f"cifar100:{tmp_path}")
    assert domain.labels.tolist() == [5, 99, 0, 5] and domain.class_names == names
    assert np.array_equal(np.asarray(domain.read(1)), data[1].reshape(3, 32, 32).transpose(1, 2, 0))


def test_hostile_or_undecodable_cifar_files_are_input_errors_naming_the_file(setup, tmp_path):
    """They exited 1 with a bare UnicodeDecodeError or TypeError text that named no file."""
    make_cifar10(tmp_path, style="py3")
    folder = tmp_path / "cifar-10-batches-py"
    # numpy.dtype('xyz', False, True): a call the sandbox admits, with an argument numpy refuses
    (folder / "data_batch_2").write_bytes(b"\x80\x02cnumpy\ndtype\nX\x03\x00\x00\x00xyz\x89\x88\x87R.")
    with pytest.raises(
        InputError, match=r"data_batch_2: not a readable CIFAR batch \(TypeError: data type 'xyz' not understood\)"
    ):
        open_domain(f"cifar10:{tmp_path}")
    (folder / "batches.meta").write_bytes(pickle.dumps({b"\xffkey": 1, b"label_names": [b"a"]}, protocol=2))
    with pytest.raises(InputError, match=r"batches\.meta: a key is not UTF-8 text"):
        open_domain(f"cifar10:{tmp_path}")
    _rewrite_batch(tmp_path, "batches.meta", lambda meta: {b"label_names": [b"\xff\xfeplane", *CIFAR_NAMES[1:]]})
    with pytest.raises(
        InputError, match=r"batches\.meta: a class name is not UTF-8 text \(b'\\xff\\xfeplane'\); unpack the python"
    ):
        open_domain(f"cifar10:{tmp_path}")
    result = invoke(
        "stats",
        "--model",
        TINY_NET,
        "--weights",
        setup["weights"],
        "--data",
        f"cifar10:{tmp_path}",
        "--out",
        tmp_path / "s.safetensors",
    )
    fails(result, 3, f"{folder / 'batches.meta'}: a class name is not UTF-8 text")
