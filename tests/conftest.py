"""Shared fixtures: a tiny model factory and generated image folders (no downloads)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from cafa_cli.cli.app import app
from cafa_cli.model.features import FeatureClassifier
from cafa_cli.statistics.gaussians import estimate
from cafa_cli.statistics.moments import ClassMoments

ASSETS = Path(__file__).parent / "assets"
TINY_NET = f"{ASSETS / 'tiny_net.py'}:build"
sys.path.insert(0, str(ASSETS))
import tiny_net  # noqa: E402  (found through the line above)

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # two workers on two cores: one thread each, not two fighting for each core
    os.environ["OMP_NUM_THREADS"] = "1"  # and so for the cafa, torchrun and benchmark processes the tests start


def invoke(*args, input=None):
    """`cafa ARGS...` in this process; arguments may be paths or numbers."""
    return CliRunner().invoke(app, [str(a) for a in args], input=input)


def class_images(rng: np.random.Generator, label: int, n: int, size: int = 16, shift: float = 0.0) -> np.ndarray:
    """Grey images whose class is a bright square in one of three positions, plus noise."""
    images = rng.normal(60, 25, size=(n, size, size))
    half = size // 2
    corners = [(0, 0), (0, half), (half, 0), (half, half)]
    r, c = corners[label % len(corners)]
    images[:, r : r + half, c : c + half] += 120
    images = images * (1 - shift) + shift * rng.normal(128, 60, size=images.shape)
    return np.clip(images, 0, 255).astype(np.uint8)


def write_folder(
    root: Path, per_class: int, classes=("a", "b", "c"), seed: int = 0, shift: float = 0.0, size: int = 16
) -> Path:
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
    torch.manual_seed(0)
    path = tmp_path / "tiny.pt"
    torch.save(tiny_net.build().state_dict(), path)
    return path


PLAIN = ["--resize", "none", "--crop", "none", "--mean", "0", "--std", "1", "--channels", "1"]


@pytest.fixture(scope="session")
def trained():
    """A tiny CNN trained here on generated images, its class statistics, and a shifted test set."""
    torch.manual_seed(0)

    def make(n, seed):
        rng = np.random.default_rng(seed)
        x = np.concatenate([class_images(rng, c, n) for c in range(3)]).astype(np.float32) / 255
        return torch.tensor(x)[:, None], torch.arange(3).repeat_interleave(n)

    x, y = make(100, 0)
    net = tiny_net.build()
    optimizer = torch.optim.Adam(net.parameters(), 1e-2)
    for _ in range(15):
        for idx in torch.randperm(len(x)).split(50):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
            optimizer.step()
    model = FeatureClassifier(net).eval()
    with torch.no_grad():
        _, features = model(x)
    moments = ClassMoments(3, model.feature_dim)
    moments.update(features, y)
    gaussians = estimate(moments, "full", "auto")
    xt, yt = make(100, 5)
    # a contrast and brightness shift with noise: the kind of shift BN statistics correct
    xt = xt * 0.35 + 0.45 + torch.from_numpy(np.random.default_rng(7).normal(0, 0.08, xt.shape).astype(np.float32))
    order = torch.randperm(len(xt), generator=torch.Generator().manual_seed(1))
    return model, gaussians, xt[order], yt[order]


# --- shared by the test files split from test_errors.py and test_data.py -------------------


def tiny_training_set(root: Path) -> tuple[Path, Path]:
    """Six images of each class in root/train, and the tiny net's seeded weights in root/net.pt."""
    train = write_folder(root / "train", per_class=6)
    torch.manual_seed(0)
    weights = root / "net.pt"
    torch.save(tiny_net.build().state_dict(), weights)
    return train, weights


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("errors")
    train, weights = tiny_training_set(root)
    artifact = root / "s.safetensors"
    result = invoke(
        "stats",
        "--model",
        TINY_NET,
        "--weights",
        weights,
        "--data",
        train,
        *PLAIN,
        "--fraction",
        "1",
        "--out",
        artifact,
        "--quiet",
    )
    assert result.exit_code == 0, result.stderr
    return {"root": root, "train": train, "weights": weights, "artifact": artifact}


@pytest.fixture
def mixed_folder(tmp_path) -> Path:
    from helpers import save, solid

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


@pytest.fixture(scope="session")
def vit_run(tmp_path_factory):
    """A tiny timm ViT saved as a file (the options naming it), a test folder and a source folder:
    the prompt-token methods (foa, dpcore) through the command line."""
    timm = pytest.importorskip("timm")
    root = tmp_path_factory.mktemp("vit")
    torch.manual_seed(0)
    weights = root / "vit.pt"
    torch.save(timm.create_model("test_vit", img_size=32, num_classes=3).state_dict(), weights)
    return {
        "model": ["--model", "timm:test_vit", "--model-arg", "img_size=32", "--num-classes", "3", "--weights", weights],
        "data": write_folder(root / "test", per_class=3, seed=1, shift=0.3),
        "source": write_folder(root / "train", per_class=4),
    }
