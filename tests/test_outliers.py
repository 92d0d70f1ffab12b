"""Images from outside the label set in the stream (`outliers`, issue 64): mixed in at a share,
deterministic for a seed, kept out of the error and the statistics, and scored (AUROC, H)."""

from __future__ import annotations

import copy
import csv
import io
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import invoke, write_folder
from helpers import adapt, bench_args, fails, rows
from safetensors.numpy import load_file
from sklearn.metrics import roc_auc_score
from test_stream import PIXELS, domain

from cafa_cli.core.errors import UsageError
from cafa_cli.data.outliers import Outliers
from cafa_cli.data.values import parse_outliers
from cafa_cli.engine.adapter import Adapter
from cafa_cli.jobs.adapt.stream import StreamEvents, adapt_domains
from cafa_cli.jobs.config import BenchConfig, StatsConfig
from cafa_cli.jobs.config.settings import StreamSettings
from cafa_cli.jobs.shared.results import auroc, h_score
from cafa_cli.methods import create


@pytest.fixture(scope="module")
def domain_and_outliers(tmp_path_factory):
    """A labelled test domain of 30 images, and 40 grey 12x12 outliers of another size in an array."""
    root = tmp_path_factory.mktemp("outliers")
    outliers = root / "outliers.npy"
    np.save(outliers, np.random.default_rng(0).integers(0, 256, (40, 12, 12), dtype=np.uint8))
    return write_folder(root / "test", per_class=10, seed=3, shift=0.3), outliers


def metrics(path: Path) -> dict:
    return json.loads(path.read_text())


def test_auroc_is_the_mann_whitney_statistic_as_sklearn_computes_it_ties_included():
    rng = np.random.default_rng(0)
    cases = [
        ([0.9, 0.8, 0.7], [0.1, 0.2]),  # apart: 1
        ([0.1, 0.2], [0.9, 0.8, 0.7]),  # the wrong way round: 0
        ([0.5, 0.5, 0.5], [0.5, 0.5]),  # all tied: one half
        ([0.3, 0.5, 0.5, 0.9, 0.2], [0.5, 0.2, 0.1, 0.5]),  # ties across the two kinds and within each
        (rng.integers(0, 5, 300) / 4, rng.integers(0, 4, 200) / 4),  # many ties
        (rng.random(500), rng.random(300) * 0.8),
    ]
    for inside, outside in cases:
        truth = np.r_[np.ones(len(inside)), np.zeros(len(outside))]
        assert auroc(inside, outside) == pytest.approx(roc_auc_score(truth, np.r_[inside, outside]), abs=1e-12)
    assert auroc([0.5], []) is None and auroc([], [0.5]) is None
    assert h_score(0.2, 0.6) == pytest.approx(2 * 0.8 * 0.6 / 1.4)
    assert h_score(1.0, 0.0) == 0.0 and h_score(None, 0.5) is None and h_score(0.5, None) is None


@pytest.mark.parametrize(
    "text, parsed",
    [
        ("svhn/", ("svhn/", 0.2)),
        ("noise:gaussian", ("noise:gaussian", 0.2)),
        ("noise:uniform:0.5", ("noise:uniform", 0.5)),
        ("fashion-mnist:/data/fm:0", ("fashion-mnist:/data/fm", 0.0)),
        ("x.npy:0.25", ("x.npy", 0.25)),
    ],
)
def test_the_share_is_the_number_after_the_last_colon(text, parsed):
    assert parse_outliers(text) == parsed


def test_the_share_is_the_share_of_the_streams_images():
    """STAMP's 2,500 outliers beside 10,000 images at 0.2, SoTTA's one beside each image at 0.5."""
    assert Outliers("x", 0.2).count(10_000) == 2_500
    assert Outliers("x", 0.5).count(10_000) == 10_000
    assert Outliers("x", 0.0).count(10_000) == 0


def test_outliers_never_count_in_the_error_and_the_records_mark_them(setup, domain_and_outliers, tmp_path):
    data, outliers = domain_and_outliers
    out = tmp_path / "m.json"
    result = adapt(setup, data, "--method", "tent", "--outliers", f"{outliers}:0.25", "--metrics-json", out)
    assert result.exit_code == 0, result.stderr
    records, m = rows(result), metrics(out)
    marked = [r for r in records if r["outlier"] == "1"]
    own = [r for r in records if r["outlier"] == "0"]
    assert len(own) == 30 and len(marked) == 10 == m["outliers"] == m["domains"][0]["outliers"]  # 30·0.25/0.75
    assert all(r["label"] == "" and r["path"].startswith(str(outliers) + "#") for r in marked)
    assert m["n"] == 40 and m["labelled"] == 30
    assert m["error"] == sum(r["prediction"] != r["label"] for r in own) / 30
    assert all(float(r["id_score"]) == float(r["confidence"]) for r in records)  # tent's score: its softmax maximum
    scores = [float(r["id_score"]) for r in records]
    truth = [r["outlier"] == "0" for r in records]
    assert m["auroc"] == pytest.approx(roc_auc_score(truth, scores), abs=1e-6)
    assert m["h_score"] == pytest.approx(h_score(m["error"], m["auroc"]))
    assert m["settings"]["outliers"] == {"data": str(outliers), "share": 0.25}
    assert "outliers" in result.stderr and "AUROC %" in result.stderr  # the summary's columns


def test_the_batch_cautions_count_the_outliers_in_the_stream(setup, domain_and_outliers):
    """30 images fit in one batch of 32, but not beside their 10 outliers: no caution then."""
    data, outliers = domain_and_outliers
    alone = adapt(setup, data, "--method", "tent", "--batch-size", "32")
    mixed = adapt(setup, data, "--method", "tent", "--batch-size", "32", "--outliers", f"{outliers}:0.25")
    assert alone.exit_code == mixed.exit_code == 0, mixed.stderr
    assert "fits in one batch" in alone.stderr and "fits in one batch" not in mixed.stderr


def test_a_share_of_0_is_byte_identical_to_a_run_without(setup, domain_and_outliers, tmp_path):
    """Records and JSON as without `outliers`, but for the setting recorded (and the times)."""
    data, outliers = domain_and_outliers
    runs = {}
    for name, extra in {
        "none": [],
        "noise": ["--outliers", "noise:gaussian:0"],
        "array": ["--outliers", f"{outliers}:0"],
    }.items():
        out = tmp_path / f"{name}.json"
        result = adapt(setup, data, "--method", "tent", "--seed", "3", "--metrics-json", out, *extra)
        assert result.exit_code == 0, result.stderr
        runs[name] = result.stdout, metrics(out)
    plain_records, plain = runs["none"]
    for name in ("noise", "array"):
        records, m = runs[name]
        assert records == plain_records
        assert {k for k in m["settings"] if m["settings"][k] != plain["settings"][k]} == {"outliers"}
        assert without_times(m) == without_times(plain)
    assert plain["settings"]["outliers"] is None and "outliers" not in plain


def without_times(m: dict) -> dict:
    timed = ("seconds", "images_per_second")
    return {
        **{k: v for k, v in m.items() if k not in (*timed, "settings")},
        "domains": [{k: v for k, v in d.items() if k not in timed} for d in m["domains"]],
    }


def test_one_seed_gives_one_stream_and_the_domains_images_keep_their_order(setup, domain_and_outliers):
    data, _ = domain_and_outliers

    def stream(seed, *extra):
        result = adapt(setup, data, "--method", "bn", "--seed", seed, *extra)
        assert result.exit_code == 0, result.stderr
        return result.stdout

    first, again, other = (stream(seed, "--outliers", "noise:uniform:0.4") for seed in (0, 0, 1))
    assert first == again and first != other
    places = [[k for k, r in enumerate(parsed(text)) if r["outlier"] == "1"] for text in (first, other)]
    assert len(places[0]) == len(places[1]) == 20 and places[0] != places[1]
    # the outliers take places among the domain's images, which stream in the order they have without them
    own = [r["path"] for r in parsed(first) if r["outlier"] == "0"]
    assert own == [r["path"] for r in parsed(stream(0))]


def parsed(text: str) -> list[dict]:
    return list(csv.DictReader(io.StringIO(text)))


def test_outlier_images_are_the_same_for_a_seed_and_drawn_without_repeats(setup, domain_and_outliers):
    data, outliers = domain_and_outliers
    taken = []
    for seed in (0, 0, 5):
        result = adapt(setup, data, "--method", "source", "--seed", seed, "--outliers", f"{outliers}:0.5")
        assert result.exit_code == 0, result.stderr
        taken.append([r["path"] for r in rows(result) if r["outlier"] == "1"])
    assert taken[0] == taken[1] != taken[2]
    assert len(taken[0]) == len(set(taken[0])) == 30  # of the array's 40, each once


def test_a_methods_own_score_is_what_the_records_and_the_auroc_take(trained):
    """Method.id_score is the hook: a method with a score of its own (STAMP's) overrides it."""
    model, gaussians, x, y = trained
    method = create("bn", gaussians)
    method.id_score = lambda logits: -logits.softmax(1).amax(1)  # the reverse of the default
    seen = []
    results = adapt_domains(
        Adapter(copy.deepcopy(model), method),
        [domain("a", x[:60], y[:60])],
        PIXELS,
        StreamSettings(batch_size=20),
        events=StreamEvents(on_records=lambda records, so_far: seen.extend(records)),
        outliers=Outliers("noise:gaussian", 0.2, noise="gaussian"),
    )
    assert len(seen) == 75 and sum(r.outlier for r in seen) == 15 == results[0].outliers
    assert all(r.id_score == pytest.approx(-r.confidence, abs=1e-6) for r in seen)
    assert results[0].auroc == pytest.approx(auroc(results[0].inlier_scores, results[0].outlier_scores))
    assert results[0].inlier_scores == [r.id_score for r in seen if not r.outlier]


def test_mixed_domains_each_bring_their_share(trained):
    model, gaussians, x, y = trained
    domains = [domain("a", x[:40], y[:40]), domain("b", x[40:100], y[40:100])]
    results = adapt_domains(
        Adapter(copy.deepcopy(model), create("bn", gaussians)),
        domains,
        PIXELS,
        StreamSettings(batch_size=20, mix_domains=True),
        outliers=Outliers("noise:uniform", 0.5, noise="uniform"),
    )
    assert [(r.n, r.labelled, r.outliers) for r in results] == [(80, 40, 40), (120, 60, 60)]


def test_the_statistics_never_see_outliers(setup, domain_and_outliers, tmp_path):
    """`cafa stats` has no such option, and a bench's statistics from --train are the same file
    with outliers as without."""
    data, outliers = domain_and_outliers
    assert "outliers" not in StatsConfig.__dataclass_fields__
    fails(invoke("stats", "--data", setup["train"], "--outliers", outliers), 2, "--outliers")
    made = {}
    for name, extra in {"without": [], "with": ["--outliers", f"{outliers}:0.5"]}.items():
        args = bench_args(
            data,
            weights=setup["weights"],
            train=setup["train"],
            fraction=1,
            methods="cafa",
            batch_size=10,
            workdir=tmp_path / name,
            metrics_json=tmp_path / f"{name}.json",
        )
        result = invoke(*args, *extra)
        assert result.exit_code == 0, result.stderr
        made[name] = load_file(metrics(tmp_path / f"{name}.json")["artifacts"]["auto"]["path"])
    assert made["with"].keys() == made["without"].keys()
    for key, tensor in made["without"].items():  # the file differs in its creation time alone
        assert np.array_equal(made["with"][key], tensor), key


def test_bench_takes_the_share_as_a_grid_axis(setup, domain_and_outliers, tmp_path):
    data, outliers = domain_and_outliers
    out = tmp_path / "b.json"
    common = dict(weights=setup["weights"], methods="source,tent", batch_size=10, workdir=tmp_path / "w")
    result = invoke(*bench_args(data, **common, outliers=outliers, outlier_shares="0,0.5", metrics_json=out))
    assert result.exit_code == 0, result.stderr
    m = metrics(out)
    labels = [row["method"] for row in m["table"]]
    assert labels == ["source, outliers 0.0", "tent, outliers 0.0", "source, outliers 0.5", "tent, outliers 0.5"]
    assert [row["outlier_share"] for row in m["rows"]] == [0.0, 0.0, 0.5, 0.5]
    runs = {run["method"]: run for run in m["runs"]}
    assert "auroc" not in runs["tent, outliers 0.0"] and runs["tent, outliers 0.5"]["outliers"] == 30
    assert [row["method"] for row in m["open_world"]] == ["source, outliers 0.5", "tent, outliers 0.5"]
    assert m["open_world"][1]["auroc"]["mean"] == pytest.approx(100 * runs["tent, outliers 0.5"]["auroc"])
    assert "| method | error % | AUROC % | H % |" in result.stdout
    # the share-0 row is the run without outliers
    plain = invoke(*bench_args(data, **common, metrics_json=tmp_path / "plain.json"))
    assert plain.exit_code == 0, plain.stderr
    errors = {run["method"]: run["error"] for run in metrics(tmp_path / "plain.json")["runs"]}
    assert runs["tent, outliers 0.0"]["error"] == errors["tent"]


def test_outlier_share_axis_values_are_checked_with_the_settings():
    with pytest.raises(UsageError, match="outlier_shares.*names none"):
        BenchConfig(data=["x"], outlier_shares="0,0.2")
    with pytest.raises(UsageError, match="both say how many outliers"):
        BenchConfig(data=["x"], outliers="noise:gaussian:0.3", outlier_shares="0,0.2")
    with pytest.raises(UsageError, match=r"\[0, 1\)"):
        BenchConfig(data=["x"], outliers="noise:gaussian", outlier_shares="0,1")
    with pytest.raises(UsageError, match="names 0.2 twice"):
        BenchConfig(data=["x"], outliers="noise:gaussian", outlier_shares="0.2,0.20")
    assert BenchConfig(data=["x"], outliers="noise:gaussian", outlier_shares="0,0.5").outlier_share_list() == [0, 0.5]


def test_the_oracle_is_refused_with_outliers_which_have_no_label(setup, domain_and_outliers):
    data, _ = domain_and_outliers
    fails(adapt(setup, data, "--method", "cafa", "--oracle", "--outliers", "noise:gaussian"), 2, "--oracle")
    with pytest.raises(UsageError, match="oracle"):
        BenchConfig(data=["x"], oracle=True, outliers="noise:gaussian", outlier_shares="0,0.2")


@pytest.mark.parametrize("share", ["1", "1.5", "-0.1", "nan", "inf"])
def test_a_share_outside_0_to_1_is_a_usage_error(setup, domain_and_outliers, share):
    data, _ = domain_and_outliers
    fails(adapt(setup, data, "--outliers", f"noise:gaussian:{share}"), 2, "--outliers", "[0, 1)")


def test_bad_outlier_sources_are_one_line_each(setup, domain_and_outliers, tmp_path):
    data, outliers = domain_and_outliers
    fails(adapt(setup, data, "--outliers", "noise:pink"), 2, "noise:gaussian and noise:uniform")
    fails(adapt(setup, data, "--outliers", "-"), 2, "--outliers")
    fails(adapt(setup, data, "--outliers", tmp_path / "missing"), 3, "--outliers", "no such file or folder")
    (tmp_path / "empty").mkdir()
    fails(adapt(setup, data, "--outliers", tmp_path / "empty"), 3, "--outliers", "no images found")
    # 40 images, and a share of 0.6 mixes 45 beside the domain's 30: each is drawn once a stream
    fails(adapt(setup, data, "--outliers", f"{outliers}:0.6"), 3, "40 images", "mixes 45", "lower share")
    fails(adapt(setup, data, "--outliers", data), 2, "--outliers", "images of the test domain")


def test_bench_refuses_too_few_outliers_for_its_largest_share_before_any_statistics(
    setup, domain_and_outliers, tmp_path
):
    data, outliers = domain_and_outliers
    args = bench_args(
        data,
        weights=setup["weights"],
        train=setup["train"],
        methods="cafa",
        outliers=outliers,
        outlier_shares="0.2,0.6",
        workdir=tmp_path / "w",
    )
    fails(invoke(*args), 3, "40 images", "mixes 45")
    assert not (tmp_path / "w").exists()


def test_jsonl_records_mark_outliers_too(setup, domain_and_outliers):
    data, _ = domain_and_outliers
    result = adapt(setup, data, "--method", "bn", "--format", "jsonl", "--outliers", "noise:gaussian")
    assert result.exit_code == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert sum(line["outlier"] for line in lines) == 8 and all(
        line["label"] is None for line in lines if line["outlier"]
    )
    assert list(lines[0]) == ["path", "prediction", "label", "confidence", "outlier", "id_score"]


def test_a_model_on_its_training_distribution_tells_noise_apart(trained):
    """A sanity check of the score: the trained tiny net is surer of its own images than of uniform noise."""
    model, gaussians, x, y = trained
    results = adapt_domains(
        Adapter(copy.deepcopy(model), create("source", gaussians)),
        [domain("a", x[:100], y[:100])],
        PIXELS,
        StreamSettings(batch_size=50),
        outliers=Outliers("noise:uniform", 0.2, noise="uniform"),
    )
    assert results[0].auroc > 0.5 and results[0].outliers == 25
