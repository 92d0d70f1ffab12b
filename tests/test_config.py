"""cafa.toml / [tool.cafa] defaults: read, checked, and overridden by flags."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import PLAIN, TINY_NET, write_folder
from typer.testing import CliRunner

from cafa_cli.cli.app import app
from cafa_cli.cli.app import command_options as _command_options
from cafa_cli.cli.defaults import read_defaults
from cafa_cli.core.errors import UsageError


def test_cafa_toml_maps_option_names_to_parameters(tmp_path):
    (tmp_path / "cafa.toml").write_text('[adapt]\nbatch-size = 64\noptimizer = "sgd"\n[stats]\nfraction = 0.1\n')
    assert read_defaults(tmp_path, _command_options()) == {
        "adapt": {"batch_size": 64, "optimizer": "sgd"},
        "stats": {"fraction": 0.1},
    }


def test_keys_are_the_long_options_even_where_the_parameter_is_named_otherwise(tmp_path):
    (tmp_path / "cafa.toml").write_text(
        '[adapt]\nformat = "jsonl"\ncompile = true\n[bench]\ncsv = "r.csv"\n[inspect]\njson = true\n'
    )
    assert read_defaults(tmp_path, _command_options()) == {
        "adapt": {"format": "jsonl", "compile": True},
        "bench": {"csv": "r.csv"},
        "inspect": {"as_json": True},
    }
    (tmp_path / "cafa.toml").write_text('[adapt]\nfmt = "jsonl"\n')  # the Python name is not an option
    with pytest.raises(UsageError, match="has no option 'fmt'"):
        read_defaults(tmp_path, _command_options())
    (tmp_path / "cafa.toml").write_text("[adapt]\nbach-size = 8\n")  # a typo is answered as on the command line
    with pytest.raises(UsageError, match=r"\[adapt\] has no option 'bach-size' \(did you mean batch-size\?\)$"):
        read_defaults(tmp_path, _command_options())
    (tmp_path / "cafa.toml").write_text("[adapt]\nbatch-size = 8\nbatch_size = 16\n")
    with pytest.raises(UsageError, match="sets 'batch_size' twice"):
        read_defaults(tmp_path, _command_options())


def test_a_pyproject_whose_tool_is_not_a_table_is_an_error_or_ignored(tmp_path):
    (tmp_path / "pyproject.toml").write_text("tool = 5\n")
    assert read_defaults(tmp_path, _command_options()) == {}
    (tmp_path / "pyproject.toml").write_text('[tool]\ncafa = "x"\n')
    with pytest.raises(UsageError, match=r"\[tool\.cafa\] must be a table of commands"):
        read_defaults(tmp_path, _command_options())


def test_pyproject_tool_cafa_is_read_when_there_is_no_cafa_toml(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n[tool.cafa.adapt]\nlr = 0.0025\n')
    assert read_defaults(tmp_path, _command_options()) == {"adapt": {"lr": 0.0025}}
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n[tool.cafa.adapt]\nspeed = 3\n')
    with pytest.raises(
        UsageError, match=r"\[tool\.cafa\.adapt\] has no option 'speed'"
    ):  # the section as written there
        read_defaults(tmp_path, _command_options())
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n')
    assert read_defaults(tmp_path, _command_options()) == {}


def test_one_string_for_a_repeatable_option_is_a_list_of_one(tmp_path):
    (tmp_path / "cafa.toml").write_text(
        '[adapt]\ndata = "ImageNet-C/fog/5"\n[bench]\ndata = ["a", "b"]\nseeds = "0,1"\n'
    )
    defaults = read_defaults(tmp_path, _command_options())
    assert defaults == {"adapt": {"data": ["ImageNet-C/fog/5"]}, "bench": {"data": ["a", "b"], "seeds": "0,1"}}


def test_a_toml_array_for_a_comma_separated_option_is_joined(tmp_path):
    (tmp_path / "cafa.toml").write_text(
        '[bench]\nseeds = [0, 1, 2]\nmethods = ["source", "cafa@0.01"]\nmean = [0.5, 0.25, 0.125]\n'
    )
    defaults = read_defaults(tmp_path, _command_options())
    assert defaults == {"bench": {"seeds": "0,1,2", "methods": "source,cafa@0.01", "mean": "0.5,0.25,0.125"}}


@pytest.mark.parametrize(
    "text,match",
    [
        ("[adapt]\nbatchsize = 3\n", "no option 'batchsize'"),
        ("[train]\nlr = 1\n", r"\[train\] is not a cafa command"),
        ("[adapt\n", "not valid TOML"),
        ("adapt = 3\n", r"adapt = 3 must be a table of its options, e.g. \[adapt\]"),
        # click would take true as the number 1: a batch size of 1, a learning rate of 1.0
        ("[adapt]\nbatch-size = true\n", r"\[adapt\] batch-size = true: batch-size takes a value, not true or false"),
        ("[bench]\nlr = false\n", "lr takes a value, not true or false"),
    ],
)
def test_mistakes_in_the_file_are_usage_errors(tmp_path, text, match):
    (tmp_path / "cafa.toml").write_text(text)
    with pytest.raises(UsageError, match=match):
        read_defaults(tmp_path, _command_options())


def test_switches_take_true_and_false(tmp_path):
    (tmp_path / "cafa.toml").write_text("[adapt]\nshuffle = false\nquiet = true\n")
    assert read_defaults(tmp_path, _command_options()) == {"adapt": {"shuffle": False, "quiet": True}}


@pytest.mark.parametrize("typed", [["--data"], []])
def test_domains_on_the_command_line_replace_the_files(tmp_path, tiny_weights, typed):
    """As any option typed replaces the file's value: not A and B when the file says A and the line B."""
    listed, typed_domain = (write_folder(tmp_path / name, per_class=2) for name in ("listed", "typed"))
    (tmp_path / "cafa.toml").write_text(f'[adapt]\ndata = ["{listed}"]\n')
    defaults = read_defaults(tmp_path, _command_options())
    metrics = tmp_path / "m.json"
    base = [
        "adapt",
        "--model",
        TINY_NET,
        "--weights",
        str(tiny_weights),
        "--method",
        "source",
        *PLAIN,
        "--quiet",
        "--metrics-json",
        str(metrics),
    ]
    result = CliRunner().invoke(app, [*base, *typed, str(typed_domain)], default_map=defaults)
    assert result.exit_code == 0, result.stderr
    assert [d["data"] for d in json.loads(metrics.read_text())["domains"]] == [str(typed_domain)]
    assert CliRunner().invoke(app, base, default_map=defaults).exit_code == 0  # without any: the file's
    assert [d["data"] for d in json.loads(metrics.read_text())["domains"]] == [str(listed)]


def test_file_defaults_apply_and_flags_win(tmp_path, tiny_weights):
    train = write_folder(tmp_path / "train", per_class=6)
    artifact = tmp_path / "s.safetensors"
    runner = CliRunner()
    made = runner.invoke(
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
            str(artifact),
            "--quiet",
        ],
    )
    assert made.exit_code == 0, made.stderr
    (tmp_path / "cafa.toml").write_text('[adapt]\nbatch-size = 5\nmethod = "tent"\n')
    defaults = read_defaults(tmp_path, _command_options())
    metrics = tmp_path / "m.json"
    base = [
        "adapt",
        "--stats",
        str(artifact),
        "--model",
        TINY_NET,
        "--data",
        str(train),
        "--quiet",
        "--metrics-json",
        str(metrics),
    ]
    assert runner.invoke(app, base, default_map=defaults).exit_code == 0
    settings = json.loads(metrics.read_text())["settings"]
    assert (settings["batch_size"], settings["method"]) == (5, "tent")
    assert runner.invoke(app, [*base, "--batch-size", "9"], default_map=defaults).exit_code == 0
    assert json.loads(metrics.read_text())["settings"]["batch_size"] == 9


def test_the_real_entry_point_reports_a_bad_config_in_one_line(tmp_path):
    (tmp_path / "cafa.toml").write_text("[adapt]\nseeds = 3\n")
    done = subprocess.run(
        [sys.executable, "-m", "cafa_cli", "adapt", "--data", "x"], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        == f"cafa: error: {tmp_path / 'cafa.toml'}: [adapt] has no option 'seeds' (did you mean seed?)"
    )


def test_a_value_of_the_wrong_type_in_the_file_names_the_file_not_the_help(tmp_path):
    """The user typed no --batch-size: the error says where the value came from."""
    (tmp_path / "cafa.toml").write_text('[adapt]\nbatch-size = "abc"\n')
    done = subprocess.run(
        [sys.executable, "-m", "cafa_cli", "adapt", "--data", "x"], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 2
    assert done.stderr.startswith("cafa: error: Invalid value for '--batch-size'") and done.stderr.strip().endswith(
        "(set in cafa.toml)"
    )
    typed = subprocess.run(
        [sys.executable, "-m", "cafa_cli", "adapt", "--data", "x", "--lr", "fast"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert "Invalid value for '--lr'" in typed.stderr and "adapt --help')" in typed.stderr


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_and_version_still_work_with_a_bad_config(tmp_path, flag):
    (tmp_path / "cafa.toml").write_text("[adapt]\nspeed = 3\n")
    done = subprocess.run([sys.executable, "-m", "cafa_cli", flag], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert ("Usage" in done.stdout) if flag == "--help" else done.stdout.strip().startswith("cafa")


def test_a_value_from_the_file_that_cafa_refuses_says_where_it_was_set(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where the file is looked for, as the entry point reads it
    (tmp_path / "cafa.toml").write_text("[adapt]\nbatch-size = 0\n[stats]\nfraction = 2\n")
    defaults = read_defaults(tmp_path, _command_options())
    runner = CliRunner()
    from_file = runner.invoke(app, ["adapt", "x"], default_map=defaults)
    assert from_file.exit_code == 2 and from_file.stderr.strip().endswith("not 0 (--batch-size set in cafa.toml)"), (
        from_file.stderr
    )
    typed = runner.invoke(app, ["adapt", "x", "--batch-size", "0"], default_map=defaults)
    assert typed.exit_code == 2 and "set in" not in typed.stderr
    stats = runner.invoke(app, ["stats", "--data", "x"], default_map=defaults)
    assert stats.exit_code == 2 and "(--fraction set in cafa.toml)" in stats.stderr


@pytest.mark.parametrize("where", ["cafa.toml", "pyproject.toml"])
@pytest.mark.parametrize(
    "command, key",
    [
        ("adapt", "trust-checkpoint"),
        ("stats", "trust_checkpoint"),
        ("bench", "trust-checkpoint"),
        ("adapt", "allow-weights-mismatch"),
    ],
)
def test_a_config_file_cannot_lift_a_safety_check(tmp_path, where, command, key):
    """A cloned repository's cafa.toml must not make cafa unpickle a checkpoint or run a factory."""
    table = f"[tool.cafa.{command}]" if where == "pyproject.toml" else f"[{command}]"
    (tmp_path / where).write_text(f"{table}\n{key} = true\n")
    with pytest.raises(
        UsageError,
        match=rf"sets '{key}', which lets code run or lifts a safety check; .*give --{key.replace('_', '-')} on the command line",
    ):
        read_defaults(tmp_path, _command_options())


# --- code is named on the command line only (issue 31, class 1) --------------------------

EVIL = "import pathlib\npathlib.Path(__file__).with_name('RAN').write_text('imported')\ndef build(*a, **k):\n    raise SystemExit(9)\n"


@pytest.mark.parametrize(
    "table, key, value",
    [
        ("adapt", "method", '["evilm:build"]'),  # a TOML array, joined after the check before
        ("adapt", "method", '"evil.py:build"'),
        ("bench", "methods", '["tent", "evilm:build"]'),
        ("bench", "methods", '"tent,evilm:build@0.01"'),
        ("demo", "methods", '["tent", "evil.py:build"]'),  # [demo] was not checked at all
        ("stats", "model", '"./evil.py:build"'),
        ("adapt", "model", '"evilm:build"'),
        ("bench", "model", '["evil.py:build"]'),
        ("adapt", "method", '{ a = "evilm:build" }'),
    ],
)
@pytest.mark.parametrize("where", ["cafa.toml", "pyproject.toml"])
def test_a_config_file_naming_code_is_refused_in_any_spelling(tmp_path, table, key, value, where):
    (tmp_path / "evil.py").write_text(EVIL)
    (tmp_path / "evilm.py").write_text(EVIL)
    header = f"[{table}]" if where == "cafa.toml" else f"[tool.cafa.{table}]"
    (tmp_path / where).write_text(f"{header}\n{key} = {value}\n")
    with pytest.raises(UsageError, match="names code to run, which a config file may not"):
        read_defaults(tmp_path, _command_options())


@pytest.mark.parametrize("value", ['"timm:resnet50"', '"torchvision:resnet18"', '"resnet50"'])
def test_a_config_file_may_name_a_model_that_is_no_code(tmp_path, value):
    (tmp_path / "cafa.toml").write_text(f"[stats]\nmodel = {value}\n")
    assert read_defaults(tmp_path, _command_options())["stats"]["model"] == value.strip('"')


@pytest.mark.parametrize("config", ['[adapt]\nmethod = ["evilm:build"]\n', '[stats]\nmodel = "evilm:build"\n'])
def test_the_command_refuses_it_before_importing_anything(tmp_path, config):
    (tmp_path / "evilm.py").write_text(EVIL)
    (tmp_path / "cafa.toml").write_text(config)
    command = "adapt" if "adapt" in config else "stats"
    result = subprocess.run(
        [sys.executable, "-m", "cafa_cli", command, "--data", "x"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "names code to run" in result.stderr, result.stderr
    assert not (tmp_path / "RAN").exists()


def test_python_m_cafa_cli_does_not_import_modules_from_the_working_folder(tmp_path):
    """`python -m` puts the working folder first on the path: a timm.py there must not stand in for timm."""
    for name in ("timm", "torchvision", "safetensors"):
        (tmp_path / f"{name}.py").write_text(EVIL)
    result = subprocess.run(
        [sys.executable, "-m", "cafa_cli", "adapt", "--model", "timm:resnet18", "--method", "source", "--data", "x"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0  # x is no data; what matters is what ran before
    assert not (tmp_path / "RAN").exists(), result.stderr
