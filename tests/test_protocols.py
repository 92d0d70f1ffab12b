"""Evaluation as deployments see it (issue 42): a stream that does not wait for the method
(data/pace.py), long horizons (`rounds`) and forgetting (`forgetting`)."""

from __future__ import annotations

import copy
import csv
import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY_NET, invoke, write_folder
from test_stream import PIXELS, domain

from cafa_cli.core.errors import UsageError
from cafa_cli.data.pace import Pace, parse_step_cost, parse_stream_rate, rate_label
from cafa_cli.engine.adapter import Adapter
from cafa_cli.jobs.adapt.stream import StreamEvents, adapt_domains
from cafa_cli.jobs.config.settings import StreamSettings
from cafa_cli.jobs.shared.clean import adapted_error
from cafa_cli.jobs.shared.monitor import Monitor
from cafa_cli.methods import create
from cafa_cli.methods.recipes import description, table_cost


@pytest.mark.parametrize(
    "text, rate", [("inf", math.inf), ("1", 1.0), ("1/2", 0.5), ("0.25", 0.25), (" 1/4 ", 0.25), ("16", 16.0)]
)
def test_a_rate_is_forward_passes_between_batches(text, rate):
    assert parse_stream_rate(text) == rate


@pytest.mark.parametrize(
    "text", ["0", "-1", "nan", "NaN", "1/0", "", "fast", "1e7", "-inf", "0/1", "1e-310", "4.9e-324", "1e-7", "1/1e7"]
)
def test_a_rate_that_is_not_positive_or_finite_is_refused(text):
    with pytest.raises(UsageError, match="stream_rate"):
        parse_stream_rate(text)


def test_step_costs_come_from_the_table_a_measure_or_the_user():
    assert parse_step_cost("table") == ("table", {})
    assert parse_step_cost("measured") == ("measured", {})
    assert parse_step_cost("3") == ("given", {None: 3.0})
    assert parse_step_cost("cotta=100,4") == ("given", {"cotta": 100.0, None: 4.0})
    for bad in ("0", "-2", "nan", "cotta=", "=3", "cotta=1,cotta=2", "fast", "1e9", "1e-310", "tent=1e-7", "9" * 5000):
        with pytest.raises(UsageError, match="step_cost"):
            parse_step_cost(bad)
    assert parse_step_cost("0.000001,tent=1e6") == ("given", {None: 1e-6, "tent": 1e6})
    # the table's k: the method's step over the source model's forward pass, both ÷ TENT's
    assert table_cost("tent") == pytest.approx(1 / description("source")["cost"])
    assert table_cost("cotta") > table_cost("tent") > table_cost("source") == 1.0
    assert [rate_label(r) for r in (math.inf, 1.0, 0.5, 0.25, 0.3)] == ["inf", "1", "1/2", "1/4", "3/10"]


@pytest.mark.parametrize(
    "rate, cost, adapted",
    [
        (1, 3, [0, 3, 6, 9]),  # busy for two more batches after each
        (1, 1, list(range(10))),  # as fast as the stream: every batch
        (1, 0.5, list(range(10))),  # faster than a forward pass (t3a, lame): every batch
        (0.5, 3, [0, 6]),  # a stream twice as fast: busy for five more
        (2, 3, [0, 2, 4, 6, 8]),  # twice as slow: ceil(1.5) = 2 intervals
        (0.1, 0.3, [0, 3, 6, 9]),  # 0.3 / 0.1 is 3 (2.9999999999999996 in floats), not 4
        (math.inf, 500, list(range(10))),  # a stream that waits
    ],
)
def test_a_method_adapts_on_the_batches_it_is_free_for(rate, cost, adapted):
    pace, seen = Pace(rate, cost), []
    for k in range(10):
        if pace.adapts():
            seen.append(k)
            pace.step_done()
    assert seen == adapted


def test_at_rate_1_a_cost_of_3_adapts_every_third_batch_as_a_hand_written_loop(trained):
    """The stream's records at R = 1, k = 3 against a loop written out here: batches 0, 3, 6
    adapted (Adapter.step), the others predicted by the weights adapted so far (features)."""
    model, gaussians, x, y = trained
    test = domain("a", x[:160], y[:160])
    seen = []
    streamed = Adapter(copy.deepcopy(model), create("tent", gaussians), lr=1e-2)
    results = adapt_domains(
        streamed,
        [test],
        PIXELS,
        StreamSettings(batch_size=20, shuffle=False),
        events=StreamEvents(on_records=lambda records, so_far: seen.extend(r.confidence for r in records)),
        pace=Pace(1.0, 3.0),
    )
    by_hand, expected = Adapter(copy.deepcopy(model), create("tent", gaussians), lr=1e-2), []
    images = PIXELS.normalize(torch.stack([torch.as_tensor(np.array(test.read(i)))[None] for i in range(160)]))
    for k in range(8):
        batch = images[20 * k : 20 * (k + 1)]
        logits = by_hand.step(batch) if k % 3 == 0 else by_hand.features(batch)[0]
        expected.extend(logits.softmax(1).max(1).values.tolist())
    assert seen == pytest.approx(expected, abs=1e-6)
    assert (results[0].batches, results[0].adapted_batches) == (8, 3)
    for name, value in streamed.model.state_dict().items():
        assert torch.equal(value, by_hand.model.state_dict()[name]), name
    waiting = Adapter(copy.deepcopy(model), create("tent", gaussians), lr=1e-2)
    adapt_domains(waiting, [test], PIXELS, StreamSettings(batch_size=20, shuffle=False))
    assert any(not torch.equal(v, waiting.model.state_dict()[k]) for k, v in streamed.model.state_dict().items())


def test_the_clean_domain_of_forgetting_changes_nothing(trained):
    """Predicting the clean domain leaves every weight and statistic as it was, and the error
    is the model's as adapted so far."""
    model, gaussians, x, y = trained
    adapter = Adapter(copy.deepcopy(model), create("tent", gaussians), lr=1e-2, norm="ema:0.1")
    adapt_domains(adapter, [domain("a", x[:100], y[:100])], PIXELS, StreamSettings(batch_size=25, shuffle=False))
    before = {k: v.clone() for k, v in adapter.model.state_dict().items()}
    optimiser = copy.deepcopy(adapter.optimizer.state_dict())
    error = adapted_error(adapter, domain("clean", x[100:], y[100:]), PIXELS, 25, 0, False, Monitor())
    assert error["n"] == len(y) - 100 and 0 <= error["error"] <= 1
    for name, value in adapter.model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert str(adapter.optimizer.state_dict()) == str(optimiser)


def _adapt(setup, *extra, data=None):
    data = data or ["--data", setup["train"]]
    args = ["adapt", "--stats", setup["artifact"], "--model", TINY_NET, *data, "--batch-size", "6"]
    return invoke(*args, "--method", "tent", "--recipe", "none", *extra)


def test_a_waiting_stream_is_todays_and_rounds_are_the_sequence_again(setup, tmp_path):
    plain = _adapt(setup, "--reset", "never")
    waits = _adapt(setup, "--reset", "never", "--stream-rate", "inf")
    assert plain.exit_code == waits.exit_code == 0, plain.stderr
    assert waits.stdout == plain.stdout
    twice = _adapt(setup, "--reset", "never", data=["--data", setup["train"], "--data", setup["train"]])
    rounds = _adapt(setup, "--reset", "never", "--rounds", "2", "--metrics-json", tmp_path / "r.json")
    assert rounds.exit_code == 0, rounds.stderr
    assert rounds.stdout == twice.stdout and len(list(csv.DictReader(io.StringIO(rounds.stdout)))) == 36
    metrics = json.loads((tmp_path / "r.json").read_text())
    assert [d["round"] for d in metrics["domains"]] == [1, 2]
    assert [r["error"] for r in metrics["rounds"]] == [d["error"] for d in metrics["domains"]]
    assert metrics["settings"]["rounds"] == 2 and "error by round: 1: " in rounds.stderr


def test_a_paced_run_reports_its_cost_and_the_share_it_adapted_on(setup, tmp_path):
    table = _adapt(setup, "--stream-rate", "1", "--metrics-json", tmp_path / "t.json")
    assert table.exit_code == 0, table.stderr
    stream = json.loads((tmp_path / "t.json").read_text())["stream"]
    k = table_cost("tent")
    assert stream["cost"] == pytest.approx(k) and stream["cost_from"] == "table"
    # 3 batches of 6 (18 images): the first adapted, the rest arrive while the step of k > 2 runs
    assert stream["adapted_share"] == pytest.approx(1 / 3) and "adapted on 33% of the batches" in table.stderr
    given = _adapt(setup, "--stream-rate", "1", "--step-cost", "tent=1,9", "--metrics-json", tmp_path / "g.json")
    assert given.exit_code == 0 and json.loads((tmp_path / "g.json").read_text())["stream"]["adapted_share"] == 1
    measured = _adapt(setup, "--stream-rate", "1", "--step-cost", "measured", "--metrics-json", tmp_path / "m.json")
    assert measured.exit_code == 0, measured.stderr
    stream = json.loads((tmp_path / "m.json").read_text())["stream"]
    assert stream["cost"] > 0 and stream["cost_from"].startswith("measured") and 0 < stream["adapted_share"] <= 1


def test_forgetting_reports_the_clean_error_after_each_domain_and_changes_no_prediction(setup, tmp_path):
    data = ["--data", setup["train"], "--data", setup["train"]]
    clean = write_folder(tmp_path / "clean", per_class=4, seed=1)
    plain = _adapt(setup, "--reset", "never", data=data)
    forgetting = _adapt(
        setup, "--reset", "never", "--forgetting", clean, "--metrics-json", tmp_path / "f.json", data=data
    )
    assert forgetting.exit_code == 0, forgetting.stderr
    assert forgetting.stdout == plain.stdout
    records = json.loads((tmp_path / "f.json").read_text())["forgetting"]
    assert [(r["round"], r["n"]) for r in records] == [
        (1, 12),
        (1, 12),
    ] and "forgetting, the error" in forgetting.stderr


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--stream-rate", "0"], "--stream-rate"),
        (["--stream-rate", "-1"], "--stream-rate"),
        (["--stream-rate", "nan"], "--stream-rate"),
        (["--rounds", "0"], "rounds"),
        (["--step-cost", "-3"], "--step-cost"),
    ],
)
def test_bad_protocol_values_are_one_line_errors(setup, extra, message):
    result = _adapt(setup, *extra)
    assert result.exit_code == 2 and message in result.stderr and "Traceback" not in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("rate", ["1e-310", "4.9e-324", "1e-7", "1/10000000"])
def test_a_rate_too_small_to_stream_is_refused_before_the_first_batch(setup, rate):
    """1e-310 passed and overflowed at the first batch (exit 1): every number a user writes
    lies within 0.000001 and 1,000,000."""
    result = _adapt(setup, "--stream-rate", rate)
    assert result.exit_code == 2 and "R from 0.000001 to 1,000,000" in result.stderr and result.stdout == ""
    assert "Traceback" not in result.stderr and "OverflowError" not in result.stderr


@pytest.mark.parametrize("cost", ["tnet=100", "TENT=4", "tent=4,cotta=10,tnet=3", "tent =4,bn-=2"])
def test_a_step_cost_for_no_method_is_refused_with_the_methods(setup, cost):
    """A misspelt METHOD=K pair was taken and never used: the table's cost stood in."""
    result = _adapt(setup, "--stream-rate", "1", "--step-cost", cost)
    assert result.exit_code == 2 and result.stdout == "", result.stderr
    assert "is no method; a METHOD=K pair names one of source, bn, pl, tent" in result.stderr


def test_a_bench_step_cost_for_no_row_is_refused_before_statistics(tmp_path, tiny_weights):
    domain = write_folder(tmp_path / "d", per_class=2)
    result = invoke(
        "bench", domain, "--model", TINY_NET, "--weights", tiny_weights, "--methods", "source,bn",
        "--stream-rate", "1", "--step-cost", "tent=4", "--workdir", tmp_path / "w",
    )  # fmt: skip
    assert result.exit_code == 2, result.stderr
    assert "--step-cost tent=4: no row runs the method tent (rows: bn, source)" in result.stderr
    assert not (tmp_path / "w").exists()


def test_a_forgetting_domain_that_is_also_a_test_domain_is_refused(setup):
    result = _adapt(setup, "--forgetting", f"{setup['train']}/")
    assert result.exit_code == 2 and "are images of the test domain" in result.stderr and result.stdout == ""


def test_bench_takes_rates_as_an_axis_and_reports_rounds_shares_and_forgetting(tmp_path, tiny_weights):
    """A rate axis gives each row a `rate R` twin whose share of adapted batches is reported;
    rounds give a table and a JSON list of the error by round (each round's error is the cell
    of `cafa adapt --rounds`), forgetting a clean error after each domain of each run."""
    from typer.testing import CliRunner

    from cafa_cli.cli.app import app

    mild = write_folder(tmp_path / "mild", per_class=6, seed=1, shift=0.2)
    harsh = write_folder(tmp_path / "harsh", per_class=6, seed=2, shift=0.7)
    clean = write_folder(tmp_path / "clean", per_class=4, seed=3)
    args = ["bench", str(harsh), str(mild), "--methods", "tent@0.05", "--model", TINY_NET, "--weights"]
    args += [str(tiny_weights), "--resize", "none", "--crop", "none", "--mean", "0", "--std", "1"]
    args += ["--channels", "1", "--batch-size", "6", "--workdir", str(tmp_path / "w"), "--reset", "never"]
    args += ["--stream-rates", "inf,1", "--rounds", "2", "--forgetting", str(clean), "--seeds", "0,1"]
    result = CliRunner().invoke(app, [*args, "--metrics-json", str(tmp_path / "b.json"), "--csv", str(tmp_path / "c")])
    assert result.exit_code == 0, result.stderr
    saved = json.loads((tmp_path / "b.json").read_text())
    assert [row["label"] for row in saved["rows"]] == ["tent@0.05, rate inf", "tent@0.05, rate 1"]
    assert [row["stream_rate"] for row in saved["rows"]] == ["inf", "1"]
    protocols = {(p["method"], p["seed"]): p for p in saved["protocols"]}
    paced = protocols[("tent@0.05, rate 1", 0)]
    # 12 batches in one continual stream, k = 4.2: batches 0, 5 and 10 adapted, busy across domains
    assert paced["stream"]["adapted_share"] == pytest.approx(3 / 12)
    assert "stream" not in protocols[("tent@0.05, rate inf", 0)]
    assert [r["round"] for r in paced["rounds"]] == [1, 2] and len(paced["forgetting"]) == 4
    assert [(f["round"], Path(f["after"]).name) for f in paced["forgetting"]] == [
        (1, "harsh"),
        (1, "mild"),
        (2, "harsh"),
        (2, "mild"),
    ]
    assert "| method | round 1 | round 2 |" in result.stdout and "| tent@0.05, rate 1 | 25.0 |" in result.stdout
    with open(tmp_path / "c") as f:
        assert next(csv.reader(f))[:3] == ["method", "order", "stream_rate"]
    # the table's cell is the error over both rounds: the mean of the two rounds' (equal sizes)
    cell = saved["table"][0]["mean"]["mean"]
    by_round = [
        sum(100 * protocols[("tent@0.05, rate inf", s)]["rounds"][k]["error"] for s in (0, 1)) / 2 for k in (0, 1)
    ]
    assert cell == pytest.approx(sum(by_round) / 2)


def test_bench_refuses_a_rate_and_a_rate_axis_together():
    from cafa_cli.jobs.config import BenchConfig

    with pytest.raises(UsageError, match="give one of them"):
        BenchConfig(data=["x"], stream_rate="1", stream_rates="inf,1")
    with pytest.raises(UsageError, match="twice"):
        BenchConfig(data=["x"], stream_rates="1,1/1")


def test_a_table_whose_rows_ran_at_different_batch_sizes_or_optimisers_says_so():
    from cafa_cli.jobs.bench.tables import differing_settings

    same = {"tent": {"batch_size": 200, "optimizer": "adam"}, "cafa": {"batch_size": 200, "optimizer": "adam"}}
    assert differing_settings(same) == ""
    mixed = {**same, "rotta": {"batch_size": 64, "optimizer": "adam"}, "sar": {"batch_size": 200, "optimizer": "sgd"}}
    assert differing_settings(mixed) == (
        "Rows differ in batch_size: 200 (tent, cafa, sar); 64 (rotta).\n"
        "Rows differ in optimizer: adam (tent, cafa, rotta); sgd (sar)."
    )
