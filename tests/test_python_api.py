"""docs/reference/python-api.md runs as written, and agrees with the CLI on the same data."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import numpy as np
import pytest
import tiny_net
import torch
from conftest import PLAIN, TINY_NET, write_folder
from PIL import Image
from typer.testing import CliRunner

from cafa_cli.artifact.store import read_artifact
from cafa_cli.cli.app import app
from cafa_cli.engine.norms import BatchStatisticsNorm
from cafa_cli.statistics.distances import ClassDistances

DOC = Path(__file__).parents[1] / "docs" / "reference" / "python-api.md"


def doc_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def loader(folder: Path, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The images as `cafa --resize none --crop none --mean 0 --std 1 --channels 1` reads them."""
    classes = sorted(p.name for p in folder.iterdir())
    files = [(f, label) for label, name in enumerate(classes) for f in sorted((folder / name).glob("*.png"))]
    images = torch.stack([torch.from_numpy(np.asarray(Image.open(f), dtype=np.float32) / 255)[None] for f, _ in files])
    labels = torch.tensor([label for _, label in files])
    return [(images[i : i + batch_size], labels[i : i + batch_size]) for i in range(0, len(files), batch_size)]


@pytest.fixture
def api_run(tmp_path, tiny_weights, monkeypatch):
    """Execute the doc's blocks one after another in one namespace, keeping what each made."""
    # 5 images per class, fewer than the tiny net's 6 feature dimensions: both sides choose lowrank
    train = write_folder(tmp_path / "train", per_class=5)
    test = write_folder(tmp_path / "test", per_class=12, seed=1, shift=0.5)
    artifact_path = tmp_path / "stats.safetensors"
    result = CliRunner().invoke(
        app,
        [
            "stats",
            "--model",
            TINY_NET,
            "--weights",
            str(tiny_weights),
            "--data",
            str(train),
            *PLAIN,
            "--fraction",
            "1",
            "--out",
            str(artifact_path),
        ],
    )
    assert result.exit_code == 0, result.output
    net = tiny_net.build()
    net.load_state_dict(torch.load(tiny_weights, weights_only=True))
    scope = {
        "net": net,
        "train_loader": loader(train, 16),
        "test_loader": loader(test, 12),
        "artifact_path": str(artifact_path),
        "image_folder": str(test),
        "class_names": ["a", "b", "c"],
        "model_name": TINY_NET,
        "weights_path": str(tiny_weights),
    }
    kept, printed = [], []
    monkeypatch.chdir(tmp_path)  # where the doc saves its artifact
    for block in doc_blocks():
        if "model" in scope and "model" in block:
            scope["model"].zero_grad(set_to_none=True)  # each block's gradients are its own
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(block, str(DOC), "exec"), scope)
        kept.append({k: v for k, v in scope.items() if k in ("gaussians", "adapter", "loss", "model")})
        printed.append(out.getvalue())
    return kept, printed, scope


def test_the_doc_has_the_blocks_this_test_expects():
    assert len(doc_blocks()) == 7


def test_statistics_from_the_api_equal_the_cli_artifact(api_run):
    kept, _, _ = api_run
    from_api, from_cli = kept[0]["gaussians"], kept[2]["gaussians"]
    assert from_api.covariance == from_cli.covariance == "lowrank"  # the default is auto, as cafa stats'
    torch.testing.assert_close(from_api.means, from_cli.means, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(from_api.shrinkage, from_cli.shrinkage, rtol=1e-6, atol=1e-9)
    assert from_api.counts.tolist() == [5, 5, 5]
    # the bases may differ in sign and order of rows; the distances they give may not
    z = from_api.means[[0, 1, 2, 0]] + 0.3 * torch.randn(
        4, from_api.means.shape[1], generator=torch.Generator().manual_seed(0)
    )
    torch.testing.assert_close(ClassDistances(from_api)(z), ClassDistances(from_cli)(z), rtol=1e-4, atol=1e-5)


def test_adapting_prints_an_error_and_reset_restores_the_source_weights(api_run, tiny_weights):
    kept, printed, _ = api_run
    assert re.fullmatch(r"error \d+\.\d\d%\n", printed[3])
    adapter = kept[3]["adapter"]
    assert any(isinstance(m, BatchStatisticsNorm) for m in adapter.model.modules())
    assert adapter.skipped_steps == 0
    after_reset = adapter.model.state_dict()
    source = torch.load(tiny_weights, weights_only=True)
    shared = [name for name in source if f"model.{name}" in after_reset]
    assert any(name.endswith("bn.weight") for name in shared)  # the adapted affines are among them
    for name in shared:
        torch.testing.assert_close(after_reset[f"model.{name}"], source[name], rtol=0, atol=0)


def test_the_loss_is_a_log_ratio_and_reaches_the_normalisation_affines(api_run):
    _, _, scope = api_run
    loss = scope["loss"]
    assert torch.isfinite(loss) and loss.item() <= 0  # log(D_ŷ / Σ_c D_c) ≤ 0
    grads = [m.weight.grad for m in scope["model"].modules() if isinstance(m, BatchStatisticsNorm)]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


def test_statistics_saved_from_the_api_serve_cafa_adapt(api_run, tiny_weights, tmp_path):
    kept, _, _ = api_run
    saved = tmp_path / "my-stats.safetensors"
    torch.testing.assert_close(read_artifact(saved).gaussians.means, kept[0]["gaussians"].means)
    test = write_folder(tmp_path / "more", per_class=4, seed=2)
    result = CliRunner().invoke(
        app,
        [
            "adapt",
            "--stats",
            str(saved),
            "--model",
            TINY_NET,
            "--weights",
            str(tiny_weights),
            "--data",
            str(test),
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.stderr  # the model and its parameters are recognised, the preprocessing taken
    assert len(result.stdout.splitlines()) == 1 + 12 and ",a," in result.stdout  # a header and one record per image


def test_an_artifact_written_the_documented_way_records_the_classifier_as_cafa_stats_does(api_run, tmp_path):
    from cafa_cli.jobs.inspect import describe

    saved, made_by_cli = read_artifact(tmp_path / "my-stats.safetensors"), read_artifact(tmp_path / "stats.safetensors")
    assert describe(saved)["model"]["classifier"] == "head.3"  # cafa inspect: "classifier head.3", not None
    assert saved.model == made_by_cli.model  # model, weights and their sha256, classifier: as cafa stats records them
    shown = CliRunner().invoke(app, ["inspect", str(tmp_path / "my-stats.safetensors")])
    assert shown.exit_code == 0, shown.output
    assert "classifier head.3" in shown.output


def test_a_folder_read_through_the_api_gives_the_images_and_labels_the_command_line_reads(api_run):
    """Section 5's `test_loader`: the folder's images as `cafa --resize none --crop none --mean 0
    --std 1 --channels 1` reads them (the artifact's preprocessing), labelled by class name."""
    _, _, scope = api_run
    expected = loader(Path(scope["image_folder"]), 36)
    images, labels = (torch.cat(parts) for parts in zip(*scope["test_loader"], strict=True))
    assert torch.equal(images, expected[0][0]) and torch.equal(labels, expected[0][1])
