"""Recipes (recipes/*.toml) and the methods' own options: every shipped recipe is valid for
its method; `--recipe` resolves (a family, auto, a file), explicit options win one by one,
and the metrics and bench JSON record what ran; `--method-option`; `cafa methods`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import invoke
from helpers import adapt_args, bench, bench_args, fails
from test_cli_adapt import setup  # noqa: F401  (the module's trained net and artifact)
from typer.testing import CliRunner

from cafa_cli.cli.app import app, command_options
from cafa_cli.cli.completion import complete_method, complete_methods, complete_recipe
from cafa_cli.cli.defaults import read_defaults
from cafa_cli.core.errors import UsageError
from cafa_cli.engine.options import resolve_options
from cafa_cli.methods import REGISTRY, method_class
from cafa_cli.methods.recipes import (
    BENCHMARK_FAMILIES,
    CLIP_FAMILY,
    SETTINGS,
    description,
    family_for,
    read_file,
    recipe_for,
    shipped,
    shipped_families,
)

NAMES = tuple(REGISTRY)


@pytest.mark.parametrize("name", NAMES)
def test_every_method_ships_a_valid_recipe_for_every_family(name):
    method = method_class(name)
    about = description(name)
    assert about["summary"] and about["paper"] and about["adapts"]
    # a CLIP method ships the `clip` family alone, every other method each benchmark family
    assert shipped_families(name) == ((CLIP_FAMILY,) if method.needs_clip else BENCHMARK_FAMILIES)
    for family in shipped_families(name):
        recipe = shipped(name, family)
        assert recipe is not None and recipe.source, (name, family)
        assert set(recipe.settings) <= set(SETTINGS)
        resolve_options(name, method.options, recipe.options)  # each option declared and valid
        if method.trains:
            assert {"optimizer", "lr", "batch_size", "params"} <= set(recipe.settings), (name, family)


def test_the_published_values_the_methods_issue_names():
    assert shipped("eata", "cifar10-c").options["redundancy_margin"] == 0.4
    with pytest.raises(UsageError, match="no recipe family 'cifar10c'; the families: imagenet-c, cifar10-c"):
        shipped("eata", "cifar10c")  # a typo is not "no recipe shipped" (None), which a plug-in has
    assert shipped("eata", "cifar100-c").options["redundancy_margin"] == 0.1
    assert shipped("eata", "cifar10-c").options["fisher_alpha"] == 1.0
    assert shipped("eata", "imagenet-c").settings == {
        "optimizer": "sgd",
        "lr": 0.00025,
        "momentum": 0.9,
        "batch_size": 64,
        "params": "norm",
        "fisher_samples": 2000,
    }
    assert shipped("sar", "imagenet-c").options["frozen"][0] == "layer4"
    assert shipped("sar", "cifar10-c").settings["optimizer"] == "sgd"  # SAM over SGD, whatever the yaml says
    assert shipped("lame", "cifar10-c").options["affinity"] == "rbf"
    assert shipped("cotta", "cifar10-c").settings["params"] == "all"
    assert shipped("cotta", "imagenet-c").options["loss"] == "sce"
    assert shipped("cafa", "imagenet-c").settings["lr"] == 0.0025


def test_auto_takes_the_named_benchmarks_family_else_the_class_counts():
    assert family_for(["imagenet-c:/data/ImageNet-C/fog"], 10) == "imagenet-c"
    assert family_for(["folder"], 100) == "cifar100-c"
    assert family_for(["folder"], 10) == "cifar10-c"
    assert family_for(["folder"], 3) is None
    assert recipe_for("auto", "tent", ["folder"], 3) is None  # no family: the settings' defaults
    assert recipe_for("none", "tent", ["folder"], 1000) is None
    assert recipe_for("auto", "plug.py:make", ["folder"], 10) is None  # a plug-in brings its own
    with pytest.raises(UsageError, match="has no shipped `recipe` cifar10-c"):
        recipe_for("cifar10-c", "plug.py:make", ["folder"], 10)


def adapt(setup, *args):  # noqa: F811
    metrics = setup["root"] / "recipe-metrics.json"
    result = invoke(*adapt_args(setup["test"], stats=setup["artifact"], quiet=True, metrics_json=metrics), *args)
    assert result.exit_code == 0, result.stderr
    return json.loads(metrics.read_text())["settings"]


def test_a_recipe_sets_what_the_user_did_not_and_the_metrics_record_it(setup):  # noqa: F811
    settings = adapt(setup, "--method", "eata", "--recipe", "cifar10-c")
    assert (settings["optimizer"], settings["lr"], settings["batch_size"]) == ("adam", 0.001, 200)
    assert settings["method_options"] == {
        "entropy_margin": 0.4,
        "redundancy_margin": 0.4,
        "fisher_alpha": 1.0,
        "keep_mean_on_reset": False,
        "entropy": "shannon",
    }
    assert settings["recipe"]["requested"] == "cifar10-c" and settings["recipe"]["name"] == "cifar10-c"
    assert "cifar10_c/eata.yaml" in settings["recipe"]["source"]
    # the user's options win, one by one; the rest stay the recipe's
    settings = adapt(
        setup,
        "--method",
        "eata",
        "--recipe",
        "imagenet-c",
        "--lr",
        "0.01",
        "--batch-size",
        "30",
        "--method-option",
        "redundancy_margin=0.3",
    )
    assert (settings["optimizer"], settings["lr"], settings["momentum"], settings["batch_size"]) == (
        "sgd",
        0.01,
        0.9,
        30,
    )
    assert settings["method_options"] == {
        "entropy_margin": 0.4,
        "redundancy_margin": 0.3,
        "fisher_alpha": 2000.0,
        "keep_mean_on_reset": True,  # the authors' reset()
        "entropy": "shannon",
    }


def test_the_recipe_line_marks_the_users_values_with_the_recipes(setup):  # noqa: F811
    """A typed value is not the published one: the line says whose it is. SGD's momentum is shown
    where the user's SGD replaced the recipe's Adam, since the recipe says nothing of it."""
    result = invoke(
        *adapt_args(
            setup["test"],
            stats=setup["artifact"],
            method="eata",
            recipe="cifar10-c",
            optimizer="sgd",
            lr="0.001",
            method_option="redundancy_margin=0.3",
        )
    )
    assert result.exit_code == 0, result.stderr
    line = next(line for line in result.stderr.splitlines() if line.startswith("recipe "))
    assert line == (
        "recipe cifar10-c for eata: optimizer sgd (yours; the recipe's adam), lr 0.001, momentum 0.9, "
        "batch_size 200, params norm, fisher_samples 2000; entropy_margin 0.4, redundancy_margin 0.3 (yours; the "
        "recipe's 0.4), fisher_alpha 1.0, keep_mean_on_reset false, entropy shannon"
    )  # lr typed as published: no mark
    # a setting only some recipes set is shown where one does, and marked when typed over it
    result = invoke(
        *adapt_args(setup["test"], stats=setup["artifact"], method="rdumb", recipe="cifar10-c", reset="never")
    )
    assert result.exit_code == 0, result.stderr
    line = next(line for line in result.stderr.splitlines() if line.startswith("recipe "))
    assert "params norm, reset never (yours; the recipe's every:1000); entropy_margin" in line


def test_a_value_from_the_defaults_file_counts_as_chosen(setup, tmp_path):  # noqa: F811
    (tmp_path / "cafa.toml").write_text('[adapt]\nrecipe = "imagenet-c"\nlr = 0.02\n')
    defaults = read_defaults(tmp_path, command_options())
    metrics = tmp_path / "m.json"
    result = CliRunner().invoke(
        app,
        adapt_args(setup["test"], stats=setup["artifact"], method="tent", quiet=True, metrics_json=metrics),
        default_map=defaults,
    )
    assert result.exit_code == 0, result.stderr
    settings = json.loads(metrics.read_text())["settings"]
    assert (settings["optimizer"], settings["lr"], settings["batch_size"]) == ("nesterov", 0.02, 64)


def test_a_printed_recipe_read_back_runs_the_same_settings(setup, tmp_path):  # noqa: F811
    printed = invoke("methods", "sar", "--recipe", "cifar10-c")
    assert printed.exit_code == 0, printed.stderr
    mine = tmp_path / "my.toml"
    mine.write_text(printed.stdout)
    assert read_file(str(mine))["sar"].options["frozen"] == ["layer4", "blocks.9", "blocks.10", "blocks.11", "norm"]
    shipped_run = adapt(setup, "--method", "sar", "--recipe", "cifar10-c")
    file_run = adapt(setup, "--method", "sar", "--recipe", str(mine))
    keys = ("optimizer", "lr", "momentum", "batch_size", "steps", "params", "method_options")
    assert {k: file_run[k] for k in keys} == {k: shipped_run[k] for k in keys}
    assert file_run["recipe"]["origin"] == str(mine)


def test_without_a_family_the_defaults_run_and_the_line_says_so(setup):  # noqa: F811
    result = invoke(*adapt_args(setup["test"], stats=setup["artifact"]), "--method", "lame")
    assert result.exit_code == 0, result.stderr
    assert "no recipe for lame (no family for this model's class count): batch_size 200; affinity rbf" in result.stderr
    assert "optimizer" not in result.stderr  # lame trains nothing


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--method", "eata", "--method-option", "epsilon=0.4"],
            "the method eata has no option epsilon (its options: entropy_margin, redundancy_margin, fisher_alpha, "
            "keep_mean_on_reset, entropy)",
        ),
        (
            ["--method", "eata", "--method-option", "redundancy_margin=lots"],
            "eata's option redundancy_margin must be a number from 0 to 1,000,000, not 'lots'",
        ),
        (["--method", "lame", "--method-option", "affinity=cosine"], "lame's option affinity must be rbf, knn, linear"),
        (
            ["--method", "t3a", "--method-option", "filter_k=0"],
            "t3a's option filter_k must be a whole number from 1 to 10,000, or all",
        ),
        (
            ["--method", "tent", "--method-option", "eata.fisher_alpha=1"],
            "is for the method eata, and --method is tent",
        ),
        (["--method", "tent", "--method-option", "=1"], "expected NAME=VALUE"),
        (["--method", "tent", "--recipe", "cifar11-c"], "--recipe must be one of auto, none, imagenet-c"),
    ],
)
def test_a_bad_recipe_or_method_option_is_one_line_naming_what_is_valid(setup, args, message):  # noqa: F811
    result = invoke(*adapt_args(setup["test"], stats=setup["artifact"]), *args)
    fails(result, 2, message)


def test_a_recipe_file_with_an_unknown_setting_or_option_is_named(setup, tmp_path):  # noqa: F811
    bad = tmp_path / "bad.toml"
    bad.write_text("[eata]\nlearning_rate = 0.1\n")
    result = invoke(*adapt_args(setup["test"], stats=setup["artifact"]), "--method", "eata", "--recipe", str(bad))
    fails(result, 3, "no setting 'learning_rate'; a recipe sets optimizer, lr")
    bad.write_text("[eata]\noptions = { margin = 0.1 }\n")
    result = invoke(*adapt_args(setup["test"], stats=setup["artifact"]), "--method", "eata", "--recipe", str(bad))
    fails(result, 3, "the method eata has no option margin")
    assert f"(in the recipe {bad})" in result.stderr  # the file to fix, not the command line
    result = invoke(*adapt_args(setup["test"], stats=setup["artifact"]), "--method", "tent", "--recipe", str(bad))
    fails(result, 2, "has no table for the method tent (it has eata)")


def test_bench_rows_take_their_own_recipes_and_scoped_options(setup, tmp_path):  # noqa: F811
    report = tmp_path / "b.json"
    result = bench(
        setup["test"],
        methods="eta,lame,eata",
        weights=setup["weights"],
        train=setup["train"],
        recipe="cifar100-c",
        batch_size=45,
        method_option=["lame.affinity=knn", "entropy_margin=0.5"],
        workdir=tmp_path / "w",
        metrics_json=report,
        quiet=True,
    )
    assert result.exit_code == 0, result.stderr
    rows = {row["label"]: row for row in json.loads(report.read_text())["rows"]}
    assert (rows["eta"]["optimizer"], rows["eta"]["batch_size"]) == ("adam", 45)  # --batch-size chosen: it wins
    assert rows["eta"]["method_options"] == {
        "entropy_margin": 0.5,
        "redundancy_margin": 0.1,
        "keep_mean_on_reset": False,
        "entropy": "shannon",
    }
    assert rows["lame"]["method_options"]["affinity"] == "knn" and rows["lame"]["recipe"]["name"] == "cifar100-c"
    # EATA's Fisher images are the training data unless given; the JSON says which (ETA takes none)
    assert rows["eata"]["source_data"] == str(setup["train"].resolve()) and rows["eta"]["source_data"] is None
    kept = [run.get("kept_samples") for run in json.loads(report.read_text())["runs"]]
    assert kept[0] is not None and kept[1] is None  # eta filters samples; lame keeps none out


@pytest.mark.parametrize("axis", [[], ["--orders", "iid,label-shift:1.0"], ["--stream-rates", "inf,1"]])
def test_a_grid_axis_keeps_each_rows_recipe_batch_size(setup, tmp_path, axis):  # noqa: F811
    """An order or rate axis is not a batch size: RoTTA's and T3A's recipes run them at 64 beside
    TENT's 200 (every grid row once ran at the bench's --batch-size default)."""
    report = tmp_path / "b.json"
    args = bench_args(
        setup["test"],
        methods="tent,rotta,t3a",
        weights=setup["weights"],
        train=setup["train"],
        recipe="cifar10-c",
        workdir=tmp_path / "w",
        metrics_json=report,
        quiet=True,
    )
    result = invoke(*args, *axis)
    assert result.exit_code == 0, result.stderr
    rows = json.loads(report.read_text())["rows"]
    assert {row["label"].partition(",")[0]: row["batch_size"] for row in rows} == {"tent": 200, "rotta": 64, "t3a": 64}


def test_a_bench_option_no_row_takes_is_named(setup, tmp_path):  # noqa: F811
    args = bench_args(setup["test"], preprocessing=(), methods="tent,bn", weights=setup["weights"])
    result = invoke(*args, "--method-option", "rho=0.1", "--workdir", tmp_path / "w")
    fails(result, 2, "--method-option rho=0.1: no row's method takes the option rho")
    result = invoke(*args, "--method-option", "sar.rho=0.1", "--workdir", tmp_path / "w")
    fails(result, 2, "no row runs the method sar")


def test_cafa_methods_lists_every_method_and_prints_a_recipe():
    listed = invoke("methods", "--json")
    assert listed.exit_code == 0, listed.stderr
    rows = {row["method"]: row for row in json.loads(listed.stdout)}
    assert list(rows) == list(NAMES)
    assert rows["cafa"]["artifact"] is True and rows["tent"]["artifact"] is False
    assert rows["tent"]["cost"] == 1.0 and "layer4" in rows["sar"]["adapts"]
    table = invoke("methods").stdout
    assert table.count("\n") == len(NAMES) + 2 and "| cotta |" in table
    printed = invoke("methods", "eata", "--recipe", "cifar10-c").stdout
    assert "redundancy_margin = 0.4  # ε: a sample is redundant" in printed and "(default 0.05)" in printed
    assert 'optimizer = "adam"' in printed and "fisher_samples = 2000" in printed
    fails(invoke("methods", "nope"), 2, "no method 'nope'; the methods: source, bn")
    fails(invoke("methods", "eata", "--recipe", "auto"), 2, "name one: imagenet-c, cifar10-c, cifar100-c")


def test_method_and_recipe_names_complete(tmp_path, monkeypatch):
    assert complete_method("e") == ["euclidean", "eta", "eata"]
    assert complete_methods("tent,ca") == ["tent,cafa", "tent,cafa-eata", "tent,cafa-robust"]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.toml").write_text("")
    assert complete_recipe("ci") == ["cifar10-c", "cifar100-c"]
    assert complete_recipe("mi") == ["mine.toml"]


def test_the_shell_completes_method_and_recipe_names_through_the_commands():
    """As bash asks the installed `cafa` (what --install-completion sets up)."""
    cafa = Path(sys.executable).parent / "cafa"
    if not cafa.exists():
        pytest.skip("no installed cafa script beside this Python")

    def values(line: str) -> list[str]:
        words = line.split(" ")
        env = {**os.environ, "_CAFA_COMPLETE": "complete_bash", "COMP_WORDS": line, "COMP_CWORD": str(len(words) - 1)}
        return subprocess.run([str(cafa)], env=env, capture_output=True, text=True, timeout=60).stdout.split()

    assert values("cafa adapt --method e") == ["euclidean", "eta", "eata"]
    assert sorted(values("cafa bench --methods tent,r")) == sorted(f"tent,{n}" for n in NAMES if n.startswith("r"))
    assert values("cafa bench --recipe image") == ["imagenet-c"]
    assert values("cafa methods co") == ["cotta"]


def test_a_recipes_adapter_settings_are_the_adapters_keywords_and_build_one():
    """`Adapter(model, method, **recipe.adapter_settings())`, as docs/reference/python-api.md says: an
    AdapterSettings, the recipe's values in place of the defaults; the settings left out are the
    stream's batch size and reset schedule, and EATA's Fisher images."""
    from dataclasses import fields

    import tiny_net

    from cafa_cli.engine.adapter import Adapter
    from cafa_cli.engine.options import AdapterSettings, Norm
    from cafa_cli.methods import create
    from cafa_cli.methods.recipes import ADAPTER_SETTINGS
    from cafa_cli.model.features import FeatureClassifier

    keywords = {f.name for f in fields(AdapterSettings)}
    assert set(ADAPTER_SETTINGS) == set(SETTINGS) & keywords
    assert set(SETTINGS) - set(ADAPTER_SETTINGS) == {"batch_size", "fisher_samples", "reset"}  # norm is the Adapter's
    recipe = shipped("tent", "cifar10-c")
    with pytest.raises(TypeError, match="batch_size"):  # why the method exists
        Adapter(FeatureClassifier(tiny_net.build()), create("tent"), **recipe.settings)
    adapter = Adapter(FeatureClassifier(tiny_net.build()), create("tent"), **recipe.adapter_settings())
    assert adapter.optimizer.param_groups[0]["lr"] == recipe.settings["lr"]
    assert adapter.settings == recipe.adapter_settings() and recipe.adapter_settings().precision == "fp32"
    assert shipped("memo", "imagenet-c").adapter_settings().norm == Norm("prior", 16.0)  # its text, parsed
    assert "batch_size" in recipe.settings and "batch_size" not in recipe.adapter_settings()
    for name in NAMES:
        for family in shipped_families(name):
            settings = shipped(name, family).adapter_settings()
            assert set(settings) <= keywords, (name, family)
            # the keywords are the method's whatever it is; tent takes every optimiser and parameter set
            Adapter(FeatureClassifier(tiny_net.build()), create("tent"), **settings)
    eata = shipped("eata", "cifar10-c")
    assert "fisher_samples" in eata.settings and "fisher_samples" not in eata.adapter_settings()


def test_auto_says_how_it_chose_the_family():
    """§7 of issue 40: `auto` took the family from the class count without saying so."""
    from cafa_cli.jobs.shared.what_runs import recipe_line
    from cafa_cli.methods.recipes import recipe_for

    assert recipe_for("auto", "tent", ["some/folder"], 10).chosen_by == "the model's 10 classes"
    assert recipe_for("auto", "tent", ["imagenet-c:/data/in-c"], 10).chosen_by == "the named benchmark"
    assert recipe_for("cifar10-c", "tent", ["some/folder"], 10).chosen_by == ""  # the user's choice: nothing to say
    recorded = {"recipe": {"requested": "auto", **recipe_for("auto", "tent", [], 10).record()}, "method_options": {}}
    recorded.update(optimizer="adam", lr=0.001, momentum=0.9, batch_size=200, params="norm")
    assert recipe_line("tent", recorded).startswith("recipe cifar10-c (auto, from the model's 10 classes) for tent:")
