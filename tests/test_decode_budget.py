"""The decoding budget (issue 31, class 3): an image whose decoded pixels would take more
memory than CAFA_DECODE_BUDGET_MB is decoded reduced (a JPEG, by its DCT scaling) or
skipped with its size named, never decoded whole. Headers are crafted (a few hundred bytes
claiming up to Pillow's limit), so the tests themselves stay small."""

from __future__ import annotations

import io
import os
import struct
import subprocess
import sys
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from cafa_cli.data.folders import read_image, within_budget
from cafa_cli.data.values import BYTES_PER_PIXEL, DEFAULT_BUDGET_MB

BUDGET = DEFAULT_BUDGET_MB * 2**20
PILLOW_LIMIT = 2 * Image.MAX_IMAGE_PIXELS  # beyond it Pillow refuses the header itself


def png_header(width: int, height: int, depth: int, colour: int) -> bytes:
    """A PNG of `width` x `height` whose data is one empty compressed row: what a 373 KB
    PNG of zeros looks like to the decoder before it allocates."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b"")


def jpeg_header(width: int, height: int, mode: str) -> bytes:
    """A small JPEG whose frame header (SOF0) claims `width` x `height`: 333 bytes can claim 12,000²."""
    buffer = io.BytesIO()
    Image.new(mode, (8, 8)).save(buffer, format="JPEG")
    data = bytearray(buffer.getvalue())
    at = data.index(b"\xff\xc0")
    data[at + 5 : at + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def tiff_header(width: int, height: int, mode: str) -> bytes:
    """A small TIFF whose ImageWidth and ImageLength tags claim `width` x `height`."""
    buffer = io.BytesIO()
    Image.new(mode, (2, 2)).save(buffer, format="TIFF")
    data = bytearray(buffer.getvalue())
    assert data[:2] == b"II"
    ifd = struct.unpack_from("<I", data, 4)[0]
    for k in range(struct.unpack_from("<H", data, ifd)[0]):
        entry = ifd + 2 + 12 * k
        tag, kind = struct.unpack_from("<HH", data, entry)
        if tag in (256, 257):  # ImageWidth, ImageLength
            value = width if tag == 256 else height
            if kind == 3:  # SHORT: make it a LONG, which holds any size
                struct.pack_into("<HHII", data, entry, tag, 4, 1, value)
            else:
                struct.pack_into("<I", data, entry + 8, value)
    return bytes(data)


FORMATS = {
    "png": ([("L", 8, 0), ("LA", 8, 4), ("RGB", 8, 2), ("RGBA", 8, 6), ("I;16", 16, 0)], png_header),
    "jpeg": (["L", "RGB", "CMYK"], jpeg_header),
    "tiff": (["L", "RGB", "RGBA", "I;16", "I", "F"], tiff_header),
}


@st.composite
def headers(draw):
    kind = draw(st.sampled_from(sorted(FORMATS)))
    modes, make = FORMATS[kind]
    mode = draw(st.sampled_from(modes))
    width = draw(st.integers(1, 20_000))
    height = draw(st.integers(1, max(1, min(20_000, PILLOW_LIMIT // width))))
    if kind == "png":
        name, depth, colour = mode
        return kind, name, width, height, make(width, height, depth, colour)
    if kind == "jpeg":
        width, height = min(width, 65_535), min(height, 65_535)
    return kind, mode, width, height, make(width, height, mode)


@settings(max_examples=150, deadline=None)
@given(headers())
def test_no_header_gets_more_than_the_budget_decoded(case):
    kind, mode, width, height, data = case
    with Image.open(io.BytesIO(data)) as image:
        assert image.size == (width, height)
        try:
            planned = within_budget(image, BUDGET)
        except Image.DecompressionBombError as error:
            assert width * height * BYTES_PER_PIXEL.get(image.mode, 4) > BUDGET
            assert f"{width}x{height} pixels" in str(error) and "CAFA_DECODE_BUDGET_MB" in str(error)
            assert kind != "jpeg" or -(-width // 8) * -(-height // 8) * BYTES_PER_PIXEL[image.mode] > BUDGET
            return
        w, h = planned.size  # what load() will allocate
        assert w * h * BYTES_PER_PIXEL.get(planned.mode, 4) <= BUDGET
        if kind != "jpeg":
            assert (w, h) == (width, height)  # only a JPEG is reduced


PEAK = """
import resource, sys
from cafa_cli.data.folders import read_image
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    read_image(sys.argv[1])
except Exception as error:
    print(type(error).__name__, error)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


@pytest.mark.parametrize(
    "name, data",
    [
        ("rgba.png", png_header(9_500, 9_500, 8, 6)),  # 2.2 GB peak before (alpha compositing copied it)
        ("grey16.png", png_header(9_500, 9_500, 16, 0)),
        ("grey.png", png_header(13_000, 13_000, 8, 0)),
        ("claims.jpg", jpeg_header(12_000, 12_000, "RGB")),  # 333 bytes that decoded to 1 GB
    ],
)
def test_the_peak_memory_of_reading_one_image_stays_within_the_budget(tmp_path, name, data):
    path = tmp_path / name
    path.write_bytes(data)
    run = subprocess.run([sys.executable, "-c", PEAK, str(path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    *said, grown = run.stdout.strip().split("\n")
    assert int(grown) <= DEFAULT_BUDGET_MB + 64, (name, said, grown)  # MB: the budget, and the decoder's own buffers
    if name.endswith(".png"):
        assert said and "above the decoding budget" in said[0]


def test_a_budget_that_is_no_number_is_one_line_at_the_start(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "cafa_cli", "inspect", "x"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CAFA_DECODE_BUDGET_MB": "lots"},
    )
    assert run.returncode == 2 and run.stderr.strip() == (
        "cafa: error: CAFA_DECODE_BUDGET_MB='lots': give the decoding budget in MB, a positive number (default 150)"
    )


def test_a_reduced_jpeg_still_reads_as_its_picture(tmp_path, monkeypatch):
    """Decoded at a quarter of its size under a small budget, as a JPEG's own DCT scaling gives."""
    path = tmp_path / "photo.jpg"
    Image.new("RGB", (800, 600), (200, 40, 90)).save(path, quality=95)
    monkeypatch.setenv("CAFA_DECODE_BUDGET_MB", str(300 * 200 * 3 / 2**20))
    image = read_image(str(path))
    assert image.size == (200, 150)
    assert all(abs(a - b) <= 3 for a, b in zip(image.getpixel((100, 75)), (200, 40, 90)))
