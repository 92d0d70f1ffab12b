"""Label-free selection of a hyperparameter (`cafa bench --select NAME=V,... --by RULE`, issue 64):
every row at each value, one value picked per row by a rule read off the run, beside the oracle's."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest
import torch
from conftest import invoke, write_folder
from helpers import bench_args, fails

from cafa_cli.jobs.bench.selection import best

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def weights(trained, tmp_path_factory) -> Path:
    """The tiny net trained on the generated images (conftest's `trained`): its error depends on the lr."""
    path = tmp_path_factory.mktemp("trained") / "net.pt"
    torch.save(trained[0].model.state_dict(), path)
    return path


@pytest.fixture(scope="module")
def domains(tmp_path_factory):
    """Two labelled test domains and a third held out, 24 shifted images each."""
    root = tmp_path_factory.mktemp("selection")
    return [write_folder(root / name, per_class=8, seed=k, shift=0.3) for k, name in enumerate(("a", "b", "c"))]


def run(weights, tmp_path, domains, **given) -> tuple[dict, str]:
    out = tmp_path / "b.json"
    common = dict(weights=weights, methods="tent", batch_size=8, workdir=tmp_path / "w", metrics_json=out)
    result = invoke(*bench_args(*domains, **{**common, **given}))
    assert result.exit_code == 0, result.stderr
    return json.loads(out.read_text()), result.stdout


def test_oracle_picks_the_lowest_error_value(weights, domains, tmp_path):
    m, text = run(weights, tmp_path, domains[:1], select="lr=1e-4,0.1,3", by="oracle")
    errors = {row["method"]: row["mean"]["mean"] for row in m["table"]}
    assert list(errors) == ["tent lr=0.0001", "tent lr=0.1", "tent lr=3"]
    assert len(set(errors.values())) > 1  # a choice that matters
    (picked,) = m["selection"]
    lowest = min(errors, key=errors.get)
    assert picked["picked"] == picked["oracle"] == float(lowest.rpartition("=")[2])
    assert picked["picked_error"] == errors[lowest] and picked["gap"] == 0
    assert "selection of lr by oracle" in text and "| tent |" in text


def test_one_bench_scores_every_rule_from_its_runs(weights, domains, tmp_path):
    """Entropy and consistency from each run's images, source accuracy from `forgetting`, held-out
    from the held-out domains' runs; each picks its lowest score, beside the oracle's value."""
    m, text = run(
        weights, tmp_path, domains[:1], select="lr=1e-4,1", by=f"held-out:{domains[2]}", forgetting=domains[1]
    )
    (picked,) = m["selection"]
    rules = picked["by_rule"]
    assert list(rules) == ["entropy", "consistency", "source-accuracy", "oracle", "held-out"]
    runs = {str(float(run["method"].rpartition("=")[2])): run for run in m["runs"]}
    assert rules["entropy"]["scores"] == pytest.approx({lr: run["entropy"] for lr, run in runs.items()})
    assert rules["consistency"]["scores"] == pytest.approx({lr: -run["consistency"] for lr, run in runs.items()})
    assert all(-1 <= score <= 0 for score in rules["source-accuracy"]["scores"].values())
    for rule in rules.values():
        assert rule["picked"] == float(best(rule["scores"]))
        assert rule["gap"] == pytest.approx(rule["picked_error"] - picked["oracle_error"]) and rule["gap"] >= 0
    assert picked["picked"] == rules["held-out"]["picked"] and rules["oracle"]["gap"] == 0
    assert "every rule the runs scored" in text


def test_a_method_option_is_selected_like_lr(weights, domains, tmp_path):
    m, _ = run(weights, tmp_path, domains[:1], methods="sar", select="rho=0.01,0.05", by="oracle")
    assert [row["method"] for row in m["table"]] == ["sar rho=0.01", "sar rho=0.05"]
    assert [row["method_options"]["rho"] for row in m["rows"]] == [0.01, 0.05]


@pytest.mark.parametrize(
    "given, needles",
    [
        (dict(select="lr=", by="oracle"), ("select names no value",)),
        (dict(select="lr=1e-3"), ("needs a rule",)),
        (dict(by="entropy"), ("entropy picks among",)),
        (dict(select="lr=1e-3,1e-2", by="likelihood"), ("unknown rule",)),
        (dict(select="lr=1e-3,1e-2", by="held-out"), ("unknown rule",)),
        (dict(select="lr=1e-3,-1", by="oracle"), ("positive",)),
        (dict(select="lr=1e-3,1e-3", by="oracle"), ("twice",)),
        (dict(select="lr=1e-3,1e-2", by="source-accuracy"), ("--forgetting",)),
        (dict(select="alpha=0.1,0.2", by="oracle"), ("tent has no option alpha",)),
        (dict(methods="source,tent", select="lr=1e-3,1e-2", by="oracle"), ("source trains nothing",)),
        (dict(methods="tent@0.01", select="lr=1e-3,1e-2", by="oracle"), ("sets its own lr",)),
    ],
)
def test_bad_values_are_one_line_errors(weights, domains, tmp_path, given, needles):
    args = dict(weights=weights, methods="tent", workdir=tmp_path / "w")
    fails(invoke(*bench_args(domains[0], **{**args, **given})), 2, *needles)
    assert not (tmp_path / "w").exists()


def test_held_out_domains_must_not_be_test_domains(weights, domains, tmp_path):
    given = dict(weights=weights, methods="tent", select="lr=1e-3,1e-2", workdir=tmp_path / "w")
    fails(invoke(*bench_args(domains[0], **given, by=f"held-out:{domains[0]}")), 2, "also a test domain")


def test_choose_lr_picks_as_held_out_does():
    """benchmarks/choose_lr.py keeps its output: each method at its lowest held-out mean error, the first on a tie."""
    report = {
        "table": [
            {"method": "source", "mean": {"mean": 30.0}},
            {"method": "tent@0.001", "mean": {"mean": 20.0}},
            {"method": "tent@0.003", "mean": {"mean": 19.0}},
            {"method": "tent@0.01", "mean": {"mean": 19.0}},
            {"method": "cafa@0.001", "mean": {"mean": 18.0}},
        ]
    }
    choose_lr = runpy.run_path(str(ROOT / "benchmarks" / "choose_lr.py"))
    assert ",".join(choose_lr["choose"](report)) == "source,tent@0.003,cafa@0.001"
