"""data/sources.py: what kind of --data value is opened, and the options only some kinds take."""

from __future__ import annotations

import io

import numpy as np
import pytest
from conftest import write_folder
from helpers import adapt, fails

from cafa_cli.core.errors import InputError, UsageError
from cafa_cli.data.sources import open_domain


def test_missing_path_and_unknown_file_type(tmp_path):
    with pytest.raises(InputError, match="no such file or folder"):
        open_domain(str(tmp_path / "absent"))
    (tmp_path / "x.csv").write_text("1,2")
    with pytest.raises(InputError, match="expected an image folder"):
        open_domain(str(tmp_path / "x.csv"))


@pytest.mark.parametrize("spec", ["folder", "fashion-mnist", "-"])
def test_severity_without_a_stacked_array_is_a_usage_error(tmp_path, spec):
    """Ignoring it would adapt on every severity while the user believes in one."""
    write_folder(tmp_path / "folder", per_class=2)
    with pytest.raises(UsageError) as info:
        open_domain(str(tmp_path / spec) if spec == "folder" else spec, severity=3, stdin=io.StringIO("a.png\n"))
    assert str(info.value) == (
        "`severity` is only for .npy arrays that stack 5 severities (CIFAR-10-C) and the named benchmarks (imagenet-c:ROOT, "
        "cifar10-c:ROOT); for an image folder, give the folder of one severity as `data`"
    )
    np.save(tmp_path / "cut.npy", np.zeros((10, 10), dtype=np.uint8))
    (tmp_path / "cut.npy").write_bytes((tmp_path / "cut.npy").read_bytes()[:100])
    with pytest.raises(InputError, match=r"`data` .*cut\.npy: not a readable \.npy array \(EOF"):
        open_domain(str(tmp_path / "cut.npy"))


@pytest.mark.parametrize("option, method", [("--clean", "eata"), ("--source-data", "eata"), ("--forgetting", "cafa")])
def test_a_missing_path_of_another_option_is_named_by_that_option(setup, tmp_path, option, method):
    """Not blamed on --data, which the user gave right."""
    missing = tmp_path / "absent"
    result = adapt(setup, setup["train"], "--method", method, option, missing)
    assert "--data" not in fails(result, 3, f"{option} {missing}: no such file or folder")


def test_data_that_is_a_file_not_a_folder(setup, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a folder")
    fails(adapt(setup, notes), 3, str(notes), "expected an image folder")


def test_classes_with_an_artifact_says_why_it_is_refused(setup, tmp_path):
    """Not "--classes is for cafa stats": cafa adapt takes it too, for a model run without statistics."""
    names = tmp_path / "classes.txt"
    names.write_text("a\nb\nc\n")
    fails(adapt(setup, setup["train"], "--classes", names), 2, "with an artifact, cafa adapt takes its class list")
