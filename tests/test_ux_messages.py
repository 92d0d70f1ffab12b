"""Messages a new user met walking through the README and the usage guide (then docs/usage.md) on the demo data:
each names the mistake and the way out."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import write_folder
from typer.testing import CliRunner

from cafa_cli.cli.app import app
from cafa_cli.core.errors import InputError
from cafa_cli.data.domain import Domain, relabel
from cafa_cli.data.sources import gradual_stages

runner = CliRunner()


def test_gradual_names_the_missing_severities_as_folders_and_how_to_build_them_at_once(tmp_path):
    (tmp_path / "fog" / "3").mkdir(parents=True)
    with pytest.raises(InputError) as raised:
        gradual_stages(str(tmp_path / "fog"))
    message = str(raised.value)
    assert f"{tmp_path / 'fog' / '5'} are not folders" in message
    assert "cafa demo --data-only --severities 1,2,3,4,5" in message


def test_one_missing_severity_is_still_a_folder(tmp_path):
    for severity in (1, 2, 3, 5):
        (tmp_path / "fog" / str(severity)).mkdir(parents=True)
    with pytest.raises(InputError, match="fog/4 is not a folder;"):
        gradual_stages(str(tmp_path / "fog"))


def _domain(class_names: list[str]) -> Domain:
    labels = np.arange(len(class_names), dtype=np.int64)
    return Domain("X/fog", [f"{name}/0.png" for name in class_names], labels, class_names, lambda i: None)


def test_a_corruption_folder_given_for_one_of_its_severities_says_to_pick_one():
    """`cafa adapt ROOT/fog` where ROOT/fog holds 3/ (the demo's layout): its severity
    folders are read as class folders, and '3 not in the class list' alone leaves the user
    guessing."""
    with pytest.raises(InputError) as raised:
        relabel(_domain(["3", "5"]), ["bag", "coat"])
    message = str(raised.value)
    assert "class folder(s) 3, 5 not in the model's class list" in message
    assert "they look like severity folders: give one of them (X/fog/3), or `gradual` to visit them all" in message


def test_unknown_class_folders_that_are_not_severities_get_no_severity_hint():
    with pytest.raises(InputError) as raised:
        relabel(_domain(["zebra", "3"]), ["bag", "coat"])
    assert "severity" not in str(raised.value)


def test_the_cli_says_so_for_the_demo_layout(tmp_path):
    fog = tmp_path / "fashion-mnist-c-2" / "fog"
    write_folder(fog / "3", per_class=2, classes=("bag", "coat"), size=28)
    result = runner.invoke(app, ["adapt", str(fog), "--model", "fmnist-resnet", "--method", "source"])
    assert result.exit_code == 3, result.stderr
    assert f"give one of them ({fog}/3), or --gradual to visit them all" in result.stderr


@pytest.mark.parametrize(
    "args, why",
    [
        (
            ["--model", "fmnist-resnet", "--method", "tent", "--norm", "class-balanced"],
            "create one with cafa stats --norm-moments, or give the path of one with --stats "
            "(--norm class-balanced needs the class moments it records)",
        ),
        (
            ["--model", "fmnist-resnet", "--method", "cafa"],
            "create one with cafa stats, or give the path of one with --stats (--method cafa needs its class statistics)",
        ),
    ],
)
def test_a_missing_default_artifact_says_what_needs_it(tmp_path, monkeypatch, args, why):
    """With --model and no --stats, a user does not expect an artifact to be read; the error
    said only 'cafa-stats.safetensors: no such artifact'."""
    monkeypatch.chdir(tmp_path)
    data = write_folder(tmp_path / "test", per_class=2, classes=("bag", "coat"), size=28)
    result = runner.invoke(app, ["adapt", str(data), *args])
    assert result.exit_code == 3, result.stderr
    assert f"cafa-stats.safetensors: no such artifact; {why}" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
