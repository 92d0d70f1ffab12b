"""`cafa bench --fractions`: the statistics at each training fraction, the rows that read
them run at each, the others once; a methods × fractions table, its CSV, JSON and plot."""

from __future__ import annotations

import csv
import json
import re
import sys
import xml.etree.ElementTree as ElementTree

import pytest
import torch
from conftest import PLAIN, TINY_NET, invoke, write_folder
from helpers import fails

from cafa_cli.core.errors import UsageError
from cafa_cli.jobs.bench import tables
from cafa_cli.jobs.bench.rows import parse_methods, with_fractions, with_oracle
from cafa_cli.jobs.bench.statistics import artifact_path, statistics_needed
from cafa_cli.jobs.config import BenchConfig

PNG = b"\x89PNG\r\n\x1a\n"


def swept(methods: str, fractions: str = "0.01,0.1", **options) -> list:
    config = BenchConfig(methods=methods, fractions=fractions, **options)
    return with_fractions(config, with_oracle(config, parse_methods(methods)))


def test_rows_with_statistics_run_at_each_fraction_and_the_others_once():
    rows = swept("source,cafa,tent,intra@0.01", oracle=True)
    assert [r.label for r in rows] == [
        "source",
        "cafa, fraction 0.01",
        "cafa-oracle, fraction 0.01",
        "tent",
        "intra@0.01, fraction 0.01",
        "intra-oracle@0.01, fraction 0.01",
        "cafa, fraction 0.1",
        "cafa-oracle, fraction 0.1",
        "intra@0.01, fraction 0.1",
        "intra-oracle@0.01, fraction 0.1",
    ]
    assert [(r.name, r.fraction) for r in rows[:3]] == [("source", None), ("cafa", 0.01), ("cafa-oracle", 0.01)]
    # one artifact a fraction, which every row at that fraction reads; none for source and tent
    assert statistics_needed(rows) == [("auto", 0.01), ("auto", 0.1)]
    assert statistics_needed(swept("cafa-tied,cafa", "0.5")) == [("auto", 0.5), ("tied", 0.5)]
    plain = parse_methods("source,cafa")
    assert with_fractions(BenchConfig(methods="source,cafa"), plain) == plain  # no sweep: the rows of earlier versions


def test_each_fraction_has_its_own_artifact_in_the_workdir(tmp_path):
    assert artifact_path(tmp_path, "auto").name == "stats-auto.safetensors"  # without a sweep, as before
    assert artifact_path(tmp_path, "auto", 0.01).name == "stats-auto-fraction0.01.safetensors"
    assert artifact_path(tmp_path, "auto", 0.01) != artifact_path(tmp_path, "auto", 0.1)


@pytest.mark.parametrize(
    "options, needle",
    [
        ({"fraction": 0.05}, "`fraction` 0.05 and `fractions` 0.01,0.1 both say how many training images"),
        ({"per_class": 30}, "`per_class` 30 and `fractions` 0.01,0.1 both say"),
        (
            {"batch_sizes": "8,1"},
            "`fractions` makes a table of its own (methods × fractions), and so does `batch_sizes`",
        ),
        ({"orders": "iid"}, "and so does `orders`"),
        ({"severities": "3"}, "and so does `severities`"),
        ({"fractions": "0.01,x"}, "`fractions` takes comma-separated numbers in (0, 1], not '0.01,x'"),
        ({"fractions": "0,0.1"}, "`fractions`: a fraction is in (0, 1], not 0"),
        ({"fractions": "0.5,1.5"}, "a fraction is in (0, 1], not 1.5"),
        ({"fractions": "0.1,0.10"}, "`fractions` names 0.1 twice (0.1,0.10)"),
        ({"fractions": " , "}, "`fractions` names no value"),
    ],
)
def test_bad_fraction_sweeps_are_usage_errors(options, needle):
    with pytest.raises(UsageError, match=re.escape(needle)):
        BenchConfig(**{"fractions": "0.01,0.1", **options})


def test_a_sweep_with_no_row_that_reads_statistics_is_refused():
    with pytest.raises(
        UsageError,
        match=re.escape(
            "`fractions` computes the statistics at each fraction, and no row of `methods` source,tent reads them"
        ),
    ):
        swept("source,tent")


# --- the table, CSV and plot, from a made-up sweep -----------------------------------------


def sweep_table(seeds: int = 1):
    """Rows source, cafa, cafa-oracle at fractions 0.01 and 0.1, with their errors over 'a' and 'b'."""
    rows = swept("source,cafa", oracle=True)
    error = {
        "source": 0.5,
        "cafa, fraction 0.01": 0.3,
        "cafa-oracle, fraction 0.01": 0.25,
        "cafa, fraction 0.1": 0.2,
        "cafa-oracle, fraction 0.1": 0.22,
    }
    from cafa_cli.jobs.shared.results import DomainResult

    results = {}
    for row in rows:
        for domain in ("a", "b"):
            for seed in range(seeds):
                result = DomainResult(domain)
                result.labelled, result.errors = 100, round(100 * error[row.label]) + seed + (domain == "b")
                results[(row.label, domain, seed)] = result
    return tables.summarise(results, rows, ["a", "b"], list(range(seeds))), rows


def test_the_fraction_table_is_methods_by_fractions_with_a_flat_row_for_source():
    table, rows = sweep_table()
    text = tables.markdown_by_fraction(table, rows, [0])
    assert text.splitlines() == [
        "| method / fraction | 0.01 | 0.1 |",
        "|---|---:|---:|",
        "| source | 50.50 | 50.50 |",  # run once: the same error under each fraction
        "| cafa | 30.50 | **20.50** |",
        "| cafa-oracle | **25.50** | 22.50 |",
        "",
        "(source: no statistics, so not run per fraction; the same error stands under every fraction.)",
    ]
    table, rows = sweep_table(seeds=2)
    assert "| cafa | 31.00 ± 0.71 | **21.00 ± 0.71** |" in tables.markdown_by_fraction(table, rows, [0, 1])


def test_the_csv_gives_each_row_its_fraction(tmp_path):
    table, rows = sweep_table()
    tables.write_csv(tmp_path / "r.csv", {"error": table}, ["a", "b"], rows)
    lines = list(csv.DictReader((tmp_path / "r.csv").open()))
    assert list(lines[0]) == ["method", "fraction", "domain", "error_mean_percent", "error_std_percent"]
    means = {
        (line["method"], line["fraction"]): line["error_mean_percent"] for line in lines if line["domain"] == "mean"
    }
    assert means == {
        ("source", ""): "50.5000",
        ("cafa", "0.01"): "30.5000",
        ("cafa-oracle", "0.01"): "25.5000",
        ("cafa", "0.1"): "20.5000",
        ("cafa-oracle", "0.1"): "22.5000",
    }


def test_the_plot_is_a_png_or_an_svg_by_extension_with_the_same_bytes_each_time(tmp_path):
    pytest.importorskip("matplotlib")
    table, rows = sweep_table(seeds=2)
    tables.plot_fractions(tmp_path / "f.png", table, rows)
    assert (tmp_path / "f.png").read_bytes()[:8] == PNG
    for name in ("f.svg", "g.svg"):
        tables.plot_fractions(tmp_path / name, table, rows)
    svg = (tmp_path / "f.svg").read_bytes()
    assert svg == (tmp_path / "g.svg").read_bytes()  # no date, no random element ids
    root = ElementTree.fromstring(svg)
    assert root.tag == "{http://www.w3.org/2000/svg}svg" and b"<dc:date>" not in svg
    legend = re.findall(r"<!-- (.+?) -->", svg.decode())
    assert legend[-3:] == ["source (no statistics)", "cafa", "cafa-oracle"]  # in the table's order
    assert svg.count(b"stroke-dasharray: 5.55") >= 2  # the oracle's line dashed, in the axes and the legend


def test_a_plot_without_matplotlib_is_one_line_before_any_run(tmp_path, monkeypatch):
    table, rows = sweep_table()
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(UsageError, match=re.escape("`plot` needs matplotlib: pip install 'cafa-cli[demo]'")):
        tables.plot_fractions(tmp_path / "f.png", table, rows)
    assert not (tmp_path / "f.png").exists()
    test = write_folder(tmp_path / "test", per_class=2)
    fails(
        invoke(
            "bench",
            test,
            "--model",
            TINY_NET,
            *PLAIN,
            "--fractions",
            "0.5",
            "--methods",
            "cafa",
            "--workdir",
            tmp_path / "w",
            "--plot",
            tmp_path / "f.svg",
        ),
        2,
        "--plot needs matplotlib",
    )
    assert not (tmp_path / "w").exists()  # said before the statistics and the runs


# --- one real sweep on the tiny net --------------------------------------------------------


def test_bench_sweeps_the_fractions_computing_each_artifact_once(tmp_path, trained):
    pytest.importorskip("matplotlib")
    weights = tmp_path / "trained.pt"
    torch.save(trained[0].model.state_dict(), weights)
    train = write_folder(tmp_path / "train", per_class=8, seed=3)
    test = write_folder(tmp_path / "test", per_class=6, seed=1, shift=0.3)
    out = {k: tmp_path / f"r.{k}" for k in ("csv", "json", "png")}
    base = [
        "bench",
        test,
        "--model",
        TINY_NET,
        "--weights",
        weights,
        "--train",
        train,
        *PLAIN,
        "--batch-size",
        "6",
        "--methods",
        "source,cafa",
        "--oracle",
        "--fractions",
        "0.25,1",
        "--workdir",
        tmp_path / "w",
    ]
    result = invoke(*base, "--csv", out["csv"], "--json", out["json"], "--plot", out["png"])
    assert result.exit_code == 0, result.stderr
    assert result.stderr.count("computing statistics") == 2
    assert "computing statistics (--covariance auto, --fraction 0.25)" in result.stderr
    long_table, by_fraction = result.stdout.strip().split("\n\n", 1)
    assert [line.split(" | ")[0] for line in long_table.splitlines()[2:]] == [
        "| source",
        "| cafa, fraction 0.25",
        "| cafa-oracle, fraction 0.25",
        "| cafa, fraction 1.0",
        "| cafa-oracle, fraction 1.0",
    ]
    assert by_fraction.splitlines()[0] == "| method / fraction | 0.25 | 1.0 |"
    assert [line.split(" | ")[0] for line in by_fraction.splitlines()[2:5]] == ["| source", "| cafa", "| cafa-oracle"]
    report = json.loads(out["json"].read_text())
    assert [(r["label"], r["fraction"], r["oracle"]) for r in report["rows"]] == [
        ("source", None, False),
        ("cafa, fraction 0.25", 0.25, False),
        ("cafa-oracle, fraction 0.25", 0.25, True),
        ("cafa, fraction 1.0", 1.0, False),
        ("cafa-oracle, fraction 1.0", 1.0, True),
    ]
    assert [run["method"] for run in report["runs"]].count("source") == 1  # source ran once
    assert report["settings"]["fractions"] == "0.25,1" and report["settings"]["fraction"] is None
    assert {key: a["fraction"] for key, a in report["artifacts"].items()} == {
        "auto, fraction 0.25": 0.25,
        "auto, fraction 1.0": 1.0,
    }
    assert report["artifacts"]["auto, fraction 0.25"]["sha256"] != report["artifacts"]["auto, fraction 1.0"]["sha256"]
    assert out["png"].read_bytes()[:8] == PNG
    assert {line["fraction"] for line in csv.DictReader(out["csv"].open())} == {"", "0.25", "1.0"}
    # a second sweep re-uses both artifacts; a third with one more fraction computes that one only
    again = invoke(*base)
    assert again.exit_code == 0, again.stderr
    assert "computing statistics" not in again.stderr and again.stdout == result.stdout
    more = invoke(*base[:-4], "--fractions", "0.25,0.5,1", "--workdir", tmp_path / "w")
    assert more.exit_code == 0, more.stderr
    assert re.findall(r"computing statistics \(.*\)", more.stderr) == [
        "computing statistics (--covariance auto, --fraction 0.5)"
    ]


def test_bench_refuses_a_sweep_with_one_fraction_setting_too_many_in_one_line(tmp_path):
    fails(
        invoke("bench", tmp_path, "--fractions", "0.01,0.1", "--fraction", "0.05"),
        2,
        "--fraction 0.05 and --fractions 0.01,0.1 both say how many training images the statistics take; give one of them",
    )
    fails(
        invoke("bench", tmp_path, "--fractions", "0.01,0.1", "--methods", "source,bn", "--workdir", tmp_path / "w"),
        2,
        "--fractions computes the statistics at each fraction, and no row of --methods source,bn reads them",
    )
    assert not (tmp_path / "w").exists()  # refused before any statistics
