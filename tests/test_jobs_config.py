"""jobs/config.py: the settings objects are the single source of the options, their
defaults and their checks; the command line is generated from them."""

from __future__ import annotations

import subprocess
import sys
import typing
from dataclasses import MISSING, fields

import pytest
import typer
from typer.testing import CliRunner

from cafa_cli.cli.app import app
from cafa_cli.core.errors import UsageError
from cafa_cli.jobs.config import AdaptConfig, BenchConfig, DemoConfig, FeaturesPlotConfig, StatsConfig

runner = CliRunner()
COMMANDS = {"stats": StatsConfig, "adapt": AdaptConfig, "bench": BenchConfig, "demo": DemoConfig}


@pytest.mark.parametrize("config_type", [*COMMANDS.values(), FeaturesPlotConfig])
def test_every_setting_is_recorded_as_given_or_says_why_not(config_type):
    from cafa_cli.jobs.config.settings import recorded_as_given

    for f in fields(config_type):
        recorded = f.metadata.get("recorded")
        assert recorded is True or (isinstance(recorded, str) and recorded.strip()), f"{config_type.__name__}.{f.name}"
    assert set(recorded_as_given(config_type)) == {
        f.name for f in fields(config_type) if f.metadata["recorded"] is True
    }


@pytest.mark.parametrize("name", COMMANDS)
def test_every_setting_is_an_option_with_its_default(name):
    command = typer.main.get_command(app).commands[name]
    options = {p.name: p for p in command.params}
    settings = [f for f in fields(COMMANDS[name]) if f.metadata.get("option", True)]  # `given`: the command fills it
    for f in settings:
        assert f.name in options, f"{name}: no option for the setting {f.name}"
        if f.default is not MISSING:
            assert options[f.name].default == f.default, (name, f.name)
    assert set(options) - {f.name for f in settings} <= {"quiet", "domains"}


def _choices(command) -> dict[str, tuple]:
    """Each option's choices, as typer offers them (from the setting's Literal type)."""
    return {
        p.name: typing.get_args(p.type_descriptor.annotation)
        for p in command.params
        if typing.get_origin(getattr(getattr(p, "type_descriptor", None), "annotation", None)) is typing.Literal
    }


def test_choices_are_the_librarys():
    from cafa_cli.engine import adapter, options
    from cafa_cli.jobs.config import settings
    from cafa_cli.methods import REGISTRY as NAMES
    from cafa_cli.statistics import gaussians

    hints = {f.name: f.type for f in fields(AdaptConfig)}
    assert hints  # the Literal types, as typer lists them in --help
    command = typer.main.get_command(app).commands["adapt"]
    choices = _choices(command)
    assert "method" not in choices  # a name or a plug-in (module:factory): the settings check it
    method_help = command.params[[p.name for p in command.params].index("method")].help
    # cafa methods lists the names, with what each does: the help points there rather than repeat 27 of them
    assert "cafa methods" in method_help and f"the {len(NAMES)} " in method_help
    assert not [name for name in NAMES if f" {name}," in method_help], method_help
    assert choices["optimizer"] == options.OPTIMIZERS and choices["params"] == options.PARAM_SETS
    assert (
        choices["precision"] == options.PRECISIONS == tuple(adapter.DTYPES) and "reset" not in choices
    )  # reset takes every:N too: parse_reset checks it
    assert choices["format"] == settings.RECORD_FORMATS
    stats_choices = _choices(typer.main.get_command(app).commands["stats"])
    assert stats_choices["covariance"] == gaussians.COVARIANCE_CHOICES


def test_help_lists_choices_conventional_metavars_and_panels():
    text = runner.invoke(app, ["adapt", "--help"], terminal_width=200).stdout
    assert "--optimizer [adam|sgd|nesterov|adamw]" in text or "--optimizer <adam|sgd|nesterov|adamw>" in text
    assert "--lr LR" in text and "--batch-size N" in text and "--stats PATH" in text
    panels = ("Method:", "Data:", "Model:", "Stream:", "Output:", "Runtime:", "Adaptation (a recipe sets", "Examples:")
    assert [text.index(panel) for panel in panels] == sorted(text.index(panel) for panel in panels)  # as a user decides
    options = [line.split()[0] for line in text.splitlines() if line.startswith("  -")]
    assert "--method" in options[:10], options[:10]
    assert "[default: the recipe's, else 0.001]" in " ".join(text.split())  # not a plain default the recipe replaces
    assert "<str>" not in text and "<int>" not in text and "<float>" not in text
    for command in ("adapt", "bench"):  # the domains as a person reads them, not a Python type
        text = runner.invoke(app, [command, "--help"], terminal_width=200).stdout
        assert "  DOMAIN...  Test domains" in text and "list[str]" not in text
        # the settings name each other in the library's words (`reset`); a help names the flag
        assert "`" not in text and "with --reset never, the persistent setting" in " ".join(text.split())


def test_help_does_not_import_torch():
    code = "import sys; from cafa_cli.cli.app import app; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_settings_are_checked_in_library_words_and_named_as_flags_on_the_command_line(tmp_path):
    with pytest.raises(UsageError, match=r"^`lr` must be a positive number, not -1"):
        AdaptConfig(lr=-1)
    with pytest.raises(UsageError, match=r"`momentum` must be in \[0, 1\)"):
        BenchConfig(momentum=1.5)
    with pytest.raises(UsageError, match=r"`fraction` and `per_class` both"):
        StatsConfig(data="x", fraction=0.1, per_class=3)
    result = runner.invoke(app, ["adapt", "--data", str(tmp_path), "--lr", "-1"])
    assert result.exit_code == 2 and result.stderr.strip() == "cafa: error: --lr must be a positive number, not -1.0"


def test_the_adaptation_settings_are_the_adapters_one_to_one():
    """AdaptationOptions' fields are AdapterSettings' with its defaults (written there once), and
    a config gives the Adapter one AdapterSettings, its `norm` parsed when the config was made."""
    from dataclasses import fields

    from cafa_cli.engine.options import AdapterSettings, Norm
    from cafa_cli.jobs.config.settings import AdaptationOptions

    assert {f.name: f.default for f in fields(AdaptationOptions)} == {
        f.name: f.default for f in fields(AdapterSettings)
    }
    config = AdaptConfig(norm="prior:16", lr=0.01)
    assert config.norm == Norm("prior", 16.0) and config.adapter_settings().norm is config.norm
    assert config.adapter_settings() == AdapterSettings(norm="prior:16", lr=0.01)
    assert dict(**config.adapter_settings())["lr"] == 0.01  # the Adapter's keywords: Adapter(..., **settings)


@pytest.mark.parametrize(
    "command", [[], ["stats"], ["adapt"], ["bench"], ["inspect"], ["methods"], ["demo"], ["plot"], ["plot", "features"]]
)
def test_dash_h_is_help_on_every_command(command):
    short, long = runner.invoke(app, [*command, "-h"]), runner.invoke(app, [*command, "--help"])
    assert short.exit_code == long.exit_code == 0 and "Usage: cafa" in short.stdout
    # git's and ripgrep's way: -h fits a screen, --help is the whole of it
    assert len(short.stdout.splitlines()) <= 60 and len(short.stdout.splitlines()) <= len(long.stdout.splitlines())
    assert short.stdout.splitlines()[0] == long.stdout.splitlines()[0]
    if short.stdout != long.stdout:  # what -h leaves out: it says so last, and where the rest is
        *_, rest, reference = short.stdout.splitlines()
        assert rest.endswith(f"; all: cafa {' '.join(command)} --help")
        assert reference.strip() == f"Reference: docs/reference/cli/{command[0]}.md"


@pytest.mark.parametrize("command", ["stats", "adapt", "bench", "demo", "plot features"])
def test_the_short_help_shows_the_settings_marked_brief_and_the_long_every_option(command):
    from cafa_cli.cli.options import brief_parameters

    click_command = typer.main.get_command(app)
    for name in command.split():
        click_command = click_command.commands[name]
    short = runner.invoke(app, [*command.split(), "-h"], terminal_width=80).stdout.partition("Examples:")[0].split()
    long = runner.invoke(app, [*command.split(), "--help"], terminal_width=80).stdout.split()
    brief = brief_parameters(click_command)
    flags = {p.name: max(p.opts, key=len) for p in click_command.params if p.param_type_name == "option"}
    assert all(flag in long for flag in flags.values())
    assert [name for name, flag in flags.items() if flag in short] == [name for name in flags if name in brief]
    assert {"data", "model", "method", "methods", "out", "workdir"} & brief and "device" not in brief


def test_a_list_setting_given_one_path_or_string_is_its_one_item_list():
    """AdaptConfig(data="x-y/3") was read character by character (its "-" then as stdin)."""
    from pathlib import Path

    config = AdaptConfig(data="fashion-mnist-c-20/fog/3", method="eata", method_option="redundancy_margin=0.4")
    assert config.data == ["fashion-mnist-c-20/fog/3"] and config.method_option == ["redundancy_margin=0.4"]
    assert AdaptConfig(data=Path("a") / "b").data == [str(Path("a") / "b")]
    assert AdaptConfig(data=["a", "b"]).data == ["a", "b"]
