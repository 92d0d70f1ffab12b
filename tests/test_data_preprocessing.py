"""data/preprocessing.py: resize, crop, channels and normalisation, and their options."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import adapt, solid, stats
from PIL import Image
from torchvision.transforms import functional as TF

from cafa_cli.core.errors import UsageError
from cafa_cli.data.preprocessing import IMAGENET_MEAN, IMAGENET_STD, Preprocessing, to_mode
from cafa_cli.data.values import parse_floats, parse_size


def model_input(prep: Preprocessing, image: Image.Image) -> torch.Tensor:
    return prep.normalize(prep.pixels(image))


@pytest.mark.parametrize(
    "channels, mean, std", [(3, IMAGENET_MEAN, IMAGENET_STD), (1, (0.3,), (0.2,)), (3, (0.5,), (0.25,))]
)
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
        expected = TF.normalize(
            TF.to_tensor(image), list(mean) * (channels // len(mean)), list(std) * (channels // len(std))
        )
        assert torch.equal(got, expected)


def test_resize_shorter_side_then_centre_crop():
    image = Image.fromarray(np.zeros((20, 40, 3), dtype=np.uint8))  # H 20, W 40
    assert model_input(Preprocessing(resize=10, crop=None), image).shape == (3, 10, 20)
    assert model_input(Preprocessing(resize=10, crop=8), image).shape == (3, 8, 8)
    assert model_input(Preprocessing(resize=None, crop=6, channels=1, mean=(0.5,), std=(0.5,)), image).shape == (
        1,
        6,
        6,
    )
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


def test_a_float_tiff_in_0_to_1_is_scaled_not_turned_black(tmp_path):
    """PIL's conversion of mode F clips: values in 0..1 became 0 or 1 out of 255, an all-black image."""
    path = tmp_path / "float.tif"
    Image.fromarray(np.array([[0.0, 0.25, 0.5, 1.0]], dtype=np.float32), "F").save(path)
    loaded = Image.open(path)
    assert loaded.mode == "F"
    assert np.asarray(to_mode(loaded, "L")).tolist() == [[0, 63, 127, 255]]  # truncated, as PIL converts 0..255 floats
    assert np.asarray(
        to_mode(Image.fromarray(np.array([[0.0, 63.0, 127.5, 255.0]], dtype=np.float32), "F"), "L")
    ).tolist() == [[0, 63, 127, 255]]


@pytest.mark.parametrize(
    "values, message",
    [
        ([-1.0, 0.5], "values from -1 to 0.5; cafa reads floats in 0..1 or 0..255"),
        ([0.0, 300.0], "values from 0 to 300;"),
        ([float("nan"), 0.0], "NaN or infinite"),
    ],
)
def test_a_float_image_outside_0_to_1_and_0_to_255_is_unreadable(tmp_path, values, message):
    with pytest.raises(ValueError, match=message):  # the loader skips it with a warning, as any unreadable image
        to_mode(Image.fromarray(np.array([values], dtype=np.float32), "F"), "L")


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (
            {"resize": 64},
            r"^`crop` 224 is larger than `resize` 64: the centre crop would pad the image with black; give `crop` 64 or less$",
        ),
        ({"channels": 2}, "`channels`"),  # a value wrong by itself is named as the library names settings
        ({"mean": (0.1, 0.2)}, r"^`mean` needs 1 or 3 values for 3 channels, got 2$"),
        ({"std": (1.0, 0.0, 1.0)}, "`std` values must be positive"),
        ({"resize": 0}, "`resize`"),
        ({"crop": -3}, "`crop`"),
        (
            {"resize": 100_000, "crop": None},
            r"^`resize` must be a whole number of pixels from 1 to 4096, or 'none'; not 100000$",
        ),
        ({"channels": 1, "mean": (0.1, 0.2, 0.3)}, r"^`mean` needs 1 value for 1 channel, got 3$"),
        ({"channels": 1, "mean": (0.1,), "std": (0.2, 0.3)}, r"^`std` needs 1 value for 1 channel, got 2$"),
        # the user gave no --mean: the message must not say they gave three values
        (
            {"channels": 1},
            r"^`channels` 1: the default `mean` is ImageNet's, with one value per RGB channel; give `mean` and `std`",
        ),
    ],
)
def test_preprocessing_validation(kwargs, pattern):
    with pytest.raises(UsageError, match=pattern):
        Preprocessing(**kwargs)


def test_preprocessing_round_trip_and_parsers():
    prep = Preprocessing(resize=None, crop=28, mean=(0.3,), std=(0.2,), channels=1)
    assert Preprocessing.from_dict(json.loads(prep.to_json())) == prep
    assert prep.with_changes({"crop": None}).crop is None
    assert (
        parse_size("none", "crop") is None and parse_size(" NONE ", "crop") is None and parse_size("224", "crop") == 224
    )
    with pytest.raises(UsageError, match=r"^`test_resize` takes a whole number of pixels or 'none', not '1.5'$"):
        parse_size("1.5", "test_resize")
    assert parse_floats("0.5,0.25", "std") == (0.5, 0.25)
    with pytest.raises(UsageError, match="`mean` takes comma-separated numbers"):
        parse_floats("0.5;0.2", "mean")


@pytest.mark.parametrize("command", ["adapt", "stats"])
def test_a_crop_larger_than_the_images_is_a_warning(setup, tmp_path, command):
    if command == "adapt":
        result = adapt(setup, setup["train"], "--crop", "20")
    else:
        result = stats(setup, setup["train"], "--crop", "20", "--out", tmp_path / "s.safetensors")
    assert result.exit_code == 0, result.stderr
    assert (
        f"warning: {setup['train']}: --crop 20 is larger than its images (16x16 after --resize none), "
        f"so the crop pads them with black; give --crop 16 or less"
    ) in result.stderr
