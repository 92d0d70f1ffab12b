"""Messages a new user met walking through the README and docs/usage.md on the demo data:
each names the mistake and the way out."""

from __future__ import annotations

import pytest

from cafa_cli.data.sources import gradual_stages
from cafa_cli.errors import InputError


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
