"""Fashion-MNIST-C rebuilds byte for byte: every corruption's randomness follows the builder's seed (issue 40, 8)."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

from cafa_cli.cli.app import app
from cafa_cli.data.fashion_mnist import DEFAULT_ROOT
from cafa_cli.data.fmnist_c import BENCHMARK_CORRUPTIONS

runner = CliRunner()
needs_fashion_mnist = pytest.mark.skipif(
    not DEFAULT_ROOT.is_dir(), reason="Debian's dataset-fashion-mnist is not installed"
)


def png_bytes(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.png"))}


@needs_fashion_mnist
def test_every_corruption_rebuilds_byte_identical(tmp_path):
    pytest.importorskip("corrupt_tta")
    built = []
    for name in ("first", "second"):
        args = ["demo", "--data-only", "--corruptions", "all", "--test-per-class", "2", "--workdir", tmp_path / name]
        result = runner.invoke(app, [str(a) for a in args])
        assert result.exit_code == 0, result.stderr
        built.append(png_bytes(tmp_path / name))
    first, second = built
    assert len(first) == len(BENCHMARK_CORRUPTIONS) * 20 and first.keys() == second.keys()
    differ = sorted({path.split("/")[1] for path in first if first[path] != second[path]})
    assert differ == [], f"rebuilt differently: {', '.join(differ)}"


def test_seeding_reaches_impulse_noise_and_leaves_global_generators_as_found():
    corrupt_tta = pytest.importorskip("corrupt_tta")
    from cafa_cli.data.fmnist_c import corrupt_grey

    images = np.random.default_rng(0).integers(0, 255, size=(3, 28, 28), dtype=np.uint8)
    np.random.seed(7)
    expected = np.random.random()
    np.random.seed(7)
    unseeded = corrupt_tta.corruptions.random_noise
    first = corrupt_grey(images, "impulse_noise", 3, seed=1)
    assert np.random.random() == expected  # NumPy's global state restored
    assert corrupt_tta.corruptions.random_noise is unseeded
    assert np.array_equal(first, corrupt_grey(images, "impulse_noise", 3, seed=1))
    assert not np.array_equal(first, corrupt_grey(images, "impulse_noise", 3, seed=2))  # the seed reaches it
