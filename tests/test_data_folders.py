"""data/folders.py: image folders, paths on stdin, and the images they read."""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import write_folder
from helpers import GREY, _bad_image, adapt, fails, rows, save, solid, stats
from PIL import Image, UnidentifiedImageError

from cafa_cli.core.errors import InputError
from cafa_cli.data.domain import UNLABELLED
from cafa_cli.data.loading import batches
from cafa_cli.data.sources import open_domain

# --- image folders -------------------------------------------------------------------


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
    (mixed_folder / "apple" / "up").symlink_to(
        mixed_folder, target_is_directory=True
    )  # would bring in the other classes
    (mixed_folder / "apple" / "gone.png").symlink_to(
        tmp_path / "deleted.png"
    )  # broken: listed, then reported unreadable
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
        "B.png",
        "a.png",
        "x/1.png",
        "x/sub/2.png",
        "x-1.png",
        "x.png",
    ]


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
        f"`data` {mixed_folder}: ignoring 4 image(s) at the top level, outside the class folders "
        f"(loose0.png, loose1.png, loose2.png, top-level.png); move them into their class folders"
    ]


def test_class_folders_alone_or_a_flat_folder_have_no_notes(tmp_path, mixed_folder):
    (mixed_folder / "top-level.png").unlink()
    assert open_domain(str(mixed_folder)).notes == []
    save(tmp_path / "stream" / "a.png", solid(1))
    assert open_domain(str(tmp_path / "stream")).notes == []


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


# --- stdin ---------------------------------------------------------------------------


def test_stdin_list(tmp_path):
    a = save(tmp_path / "a.png", solid(5))
    b = save(tmp_path / "b.png", solid(9))
    domain = open_domain(
        "-", stdin=io.StringIO(f"{a}\n\n  \n  {b} \r\n")
    )  # spaces around a path that exists without them
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


# --- through the CLI (from test_errors.py) --------------------------------------------


def test_empty_data_folder(setup, tmp_path):
    (tmp_path / "empty").mkdir()
    fails(stats(setup, tmp_path / "empty", "--out", tmp_path / "s.safetensors"), 3, "no images found")


def test_class_folders_without_images(setup, tmp_path):
    for name in ("a", "b"):
        (tmp_path / "d" / name).mkdir(parents=True)
    (tmp_path / "d" / "a" / "readme.txt").write_text("x")
    fails(adapt(setup, tmp_path / "d"), 3, "no images found in the class folders a, b")


@pytest.mark.parametrize("command", ["adapt", "stats"])
def test_images_outside_the_class_folders_get_one_warning(setup, tmp_path, command):
    data = write_folder(tmp_path / "mixed", per_class=6)
    shutil.copy(next((data / "a").glob("*.png")), data / "loose.png")
    result = adapt(setup, data) if command == "adapt" else stats(setup, data, "--out", tmp_path / "s.safetensors")
    assert result.exit_code == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == [
        f"warning: --data {data}: ignoring 1 image(s) at the top level, outside the class folders "
        f"(loose.png); move them into their class folders"
    ]
    if command == "adapt":
        assert len(rows(result)) == 18


def test_postscript_is_a_format_pillow_would_open(tmp_path):
    """What makes the postscript case meaningful: Image.open alone takes it for an image."""
    path = _bad_image(write_folder(tmp_path / "d", per_class=1), "postscript")
    with Image.open(path) as image:
        assert image.format == "EPS"


@pytest.mark.parametrize(
    "orientation, turn",
    [(1, None), (3, Image.Transpose.ROTATE_180), (6, Image.Transpose.ROTATE_270), (8, Image.Transpose.ROTATE_90)],
)
@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_an_exif_orientation_turns_the_image_as_a_viewer_shows_it(tmp_path, orientation, turn, fmt):
    """A phone stores a photo as the sensor read it and a tag that says how to turn it;
    the image went into the model sideways."""
    from cafa_cli.data.folders import read_image

    pixels = np.kron(np.arange(6, dtype=np.uint8).reshape(2, 3) * 40, np.ones((8, 8), np.uint8))  # 24 wide, 16 high
    exif = Image.Exif()
    exif[0x0112] = orientation
    Image.fromarray(pixels).save(
        tmp_path / "photo.img", fmt, exif=exif.tobytes(), **({"quality": 100} if fmt == "JPEG" else {})
    )
    stored = Image.fromarray(pixels)
    expected = np.asarray(stored.transpose(turn) if turn is not None else stored)
    got = np.asarray(read_image(str(tmp_path / "photo.img")))
    assert got.shape == expected.shape
    assert np.abs(got.astype(int) - expected).max() <= (0 if fmt == "PNG" else 8)


@pytest.mark.filterwarnings("ignore:Corrupt EXIF data")
def test_a_damaged_exif_block_leaves_the_image_as_it_is(tmp_path):
    from cafa_cli.data.folders import read_image

    Image.fromarray(solid(90, 4)).save(
        tmp_path / "a.png", exif=b"Exif\x00\x00MM\x00*\x00\x00\x00\x08\xff\xff"
    )  # 65535 entries, none there
    assert np.asarray(read_image(str(tmp_path / "a.png"))).tolist() == solid(90, 4).tolist()


def test_a_folder_finds_every_format_a_list_of_paths_may_name(tmp_path):
    """TIFF and GIF were read from stdin's paths but not found in folders."""
    from PIL import Image

    from cafa_cli.data.sources import open_domain

    for k, suffix in enumerate((".tif", ".tiff", ".gif", ".png", ".jpg", ".bmp", ".webp")):
        (tmp_path / "a").mkdir(exist_ok=True)
        Image.new("L", (8, 8), 10 * k).save(tmp_path / "a" / f"{k}{suffix}")
    domain = open_domain(str(tmp_path))
    assert sorted(Path(ref).suffix for ref in domain.refs) == sorted(
        (".tif", ".tiff", ".gif", ".png", ".jpg", ".bmp", ".webp")
    )
