"""A method's degenerate batches (issue 60, §1): one image, images alike, a batch whose
scores do not spread. Each is handled as the authors' code handles it, or left out with a
reason that names the batch; and one failing row never discards a bench's other rows."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from conftest import write_folder
from helpers import adapt, bench, no_traceback, save, solid

from cafa_cli.engine.adapter import Adapter
from cafa_cli.methods import create
from cafa_cli.methods.lame import Lame
from cafa_cli.methods.shared.laplacian import corrected_logits, rbf_affinity


def official_rbf(features: torch.Tensor, k: int = 5) -> torch.Tensor:
    """fiveai/LAME's rbf_affinity (and the benchmark collection's), as written there."""
    dist = torch.norm(features.unsqueeze(0) - features.unsqueeze(1), dim=-1, p=2)
    kth = dist.topk(k=min(k, len(features)), dim=-1, largest=False).values[:, -1]
    return torch.exp(-(dist**2) / (2 * kth.mean() ** 2))


@pytest.mark.parametrize(
    "features",
    [
        torch.tensor([[0.3, -0.2, 0.9]]),  # one image
        torch.tensor([[0.3, -0.2, 0.9]]).repeat(4, 1),  # identical images
        torch.cat([torch.ones(5, 3), -torch.ones(5, 3)]),  # two groups of five alike: each 5th neighbour at 0
    ],
    ids=["one-image", "identical", "groups-of-k"],
)
def test_lame_on_a_batch_whose_sigma_is_zero_keeps_each_source_class_where_the_official_code_is_nan(features):
    """σ is the mean distance to the 5th neighbour: 0 for these batches, and the official
    affinity 0/0. The kernel's limit (1 at distance 0, else 0) is taken; each image keeps its class."""
    assert official_rbf(features).isnan().any()
    kernel = rbf_affinity(torch.nn.functional.normalize(features, dim=1))
    assert torch.equal(kernel, (torch.cdist(features, features) == 0).float())
    # the logits are the classifier's of the features: alike features, alike logits
    logits = features @ torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    corrected = Lame().output(logits, features)
    assert corrected.isfinite().all()
    assert torch.equal(corrected.argmax(1), logits.argmax(1))
    # cafa-robust reports a skewed batch with the same correction (all-black images read as one class)
    assert corrected_logits(logits, features, 1.0).isfinite().all()


def test_lame_on_any_other_batch_is_the_official_affinity_bit_for_bit():
    features = torch.nn.functional.normalize(torch.randn(12, 6, generator=torch.Generator().manual_seed(1)), dim=1)
    assert torch.allclose(rbf_affinity(features), official_rbf(features), atol=1e-6)
    features[3] = features[7]  # two alike, σ > 0: their affinity is 1 either way
    assert torch.allclose(rbf_affinity(features), official_rbf(features), atol=1e-6)


def test_lame_and_cafa_robust_run_through_a_last_batch_of_one_image_and_images_alike(setup, tmp_path):
    """A domain whose last batch holds one image ended with exit 3 blamed on --mean/--std."""
    odd = write_folder(tmp_path / "odd", per_class=3, seed=3)  # 9 images: the last batch of 4 holds one
    black = tmp_path / "black"
    for c in "abc":
        for i in range(4):
            save(black / c / f"{i}.png", solid(0, 16))
    for method in ("lame", "cafa-robust"):
        for data in (odd, black):
            result = adapt(setup, data, "--method", method)
            assert result.exit_code == 0, result.stderr
            assert "NaN" not in result.stderr


@pytest.mark.parametrize("method", ["roid", "cmf"])
def test_roid_and_cmf_leave_out_an_undefined_update_and_say_why_not_lower_lr(trained, method):
    """Their sample weights are min-max normalised over the batch: 0/0 for one image or images
    alike, where the authors' step writes NaN into every trained value. The step is left out
    and counted as undefined, not as a non-finite loss."""
    model, _, x, _ = trained
    adapter = Adapter(copy.deepcopy(model), create(method))
    before = [p.detach().clone() for p in adapter.params]
    adapter.step(x[:1])  # one image
    adapter.step(x[:1].repeat(4, 1, 1, 1))  # images alike
    assert adapter.skipped_steps == 0 and adapter.undefined_batches == 2
    assert all(p.isfinite().all() for p in adapter.params)
    # no step: only the ensembling toward the source (roid) or the filter (cmf), which the model is at
    assert all(torch.allclose(p, b, atol=1e-6) for p, b in zip(adapter.params, before))
    adapter.step(x[:8])
    assert adapter.undefined_batches == 2 and adapter.skipped_steps == 0
    assert not all(torch.allclose(p, b, atol=1e-6) for p, b in zip(adapter.params, before))


@pytest.mark.parametrize("method", ["roid", "cmf"])
def test_roid_and_cmf_at_batch_one_say_the_batches_were_undefined(setup, method):
    result = adapt(setup, setup["train"], "--method", method, "--batch-size", "1")
    assert result.exit_code == 0, result.stderr
    assert "lower --lr" not in result.stderr
    assert f"train: no update on 18 batch(es): {method}'s update is undefined for a batch of one image" in result.stderr


def broken_plugin(tmp_path) -> str:
    path = tmp_path / "broken.py"
    path.write_text(
        "from cafa_cli.engine.method import Method\n\n\n"
        "class Broken(Method):\n"
        "    name = 'broken'\n"
        "    trains = False\n"
        "    adapts_normalisation = False\n\n"
        "    def output(self, logits, features):\n"
        "        return logits * float('nan')\n\n\n"
        "def build(gaussians, device):\n"
        "    return Broken()\n"
    )
    return f"{path}:build"


def test_a_failing_bench_row_is_named_and_the_other_rows_are_written(setup, tmp_path):
    """A row whose run fails (here a plug-in whose outputs are NaN) lost every row: no table,
    no CSV. The others are now written, and the exit says which failed and why."""
    domain = write_folder(tmp_path / "test", per_class=4, seed=2)
    csv, report = tmp_path / "r.csv", tmp_path / "r.json"
    result = bench(
        domain,
        weights=setup["weights"],
        train=setup["train"],
        fraction=1,
        methods=f"source,{broken_plugin(tmp_path)},bn",
        seeds="0,1",
        batch_size=4,
        workdir=tmp_path / "w",
        csv=csv,
        metrics_json=report,
    )
    assert result.exit_code == 3, result.stderr
    no_traceback(result)
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("cafa: error: 1 of 3 rows failed, left out of the outputs written for the others: ")
    assert "broken.py:build (seed 0, 1): " in line and "outputs are NaN or infinite" in line
    assert list(dict.fromkeys(row.split(",")[0] for row in csv.read_text().splitlines()[1:])) == ["source", "bn"]
    assert [row["method"] for row in json.loads(report.read_text())["table"]] == ["source", "bn"]
    assert "| source |" in result.stdout and "| bn |" in result.stdout and "broken" not in result.stdout


def test_a_bench_whose_every_row_fails_writes_nothing(setup, tmp_path):
    domain = write_folder(tmp_path / "test", per_class=2, seed=2)
    csv = tmp_path / "r.csv"
    result = bench(
        domain,
        weights=setup["weights"],
        methods=broken_plugin(tmp_path),
        train=setup["train"],
        fraction=1,
        workdir=tmp_path / "w",
        csv=csv,
    )
    assert result.exit_code == 3 and result.stdout == ""
    no_traceback(result)
    assert "outputs are NaN or infinite" in result.stderr.strip().splitlines()[-1]
    assert not csv.exists()


def test_no_update_on_undefined_batches_keeps_every_defined_prediction(trained):
    """The left-out batches change nothing else: a stream of normal batches predicts as before."""
    model, _, x, _ = trained
    a, b = (Adapter(copy.deepcopy(model), create("roid")) for _ in range(2))
    torch.manual_seed(0)
    first = [a.step(batch) for batch in x[:24].split(8)]
    torch.manual_seed(0)
    second = [b.step(batch) for batch in x[:24].split(8)]
    assert all(torch.equal(p, q) for p, q in zip(first, second))
    assert np.isfinite(np.concatenate([f.numpy() for f in first])).all()
