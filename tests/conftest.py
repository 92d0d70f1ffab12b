"""Shared fixtures: a tiny model factory and generated image folders (no downloads)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

ASSETS = Path(__file__).parent / "assets"
TINY_NET = f"{ASSETS / 'tiny_net.py'}:build"
sys.path.insert(0, str(ASSETS))


def class_images(rng: np.random.Generator, label: int, n: int, size: int = 16, shift: float = 0.0) -> np.ndarray:
    """Grey images whose class is a bright square in one of three positions, plus noise."""
    images = rng.normal(60, 25, size=(n, size, size))
    half = size // 2
    corners = [(0, 0), (0, half), (half, 0), (half, half)]
    r, c = corners[label % len(corners)]
    images[:, r : r + half, c : c + half] += 120
    images = images * (1 - shift) + shift * rng.normal(128, 60, size=images.shape)
    return np.clip(images, 0, 255).astype(np.uint8)


def write_folder(root: Path, per_class: int, classes=("a", "b", "c"), seed: int = 0, shift: float = 0.0, size: int = 16) -> Path:
    rng = np.random.default_rng(seed)
    for label, name in enumerate(classes):
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        for i, pixels in enumerate(class_images(rng, label, per_class, size, shift)):
            Image.fromarray(pixels).save(folder / f"{i:04d}.png")
    return root


@pytest.fixture
def image_folder(tmp_path) -> Path:
    return write_folder(tmp_path / "train", per_class=20)


@pytest.fixture
def tiny_weights(tmp_path) -> Path:
    """Random-initialised weights of the tiny net, saved as a plain state_dict."""
    import tiny_net

    torch.manual_seed(0)
    path = tmp_path / "tiny.pt"
    torch.save(tiny_net.build().state_dict(), path)
    return path


PLAIN = ["--resize", "none", "--crop", "none", "--mean", "0", "--std", "1", "--channels", "1"]
