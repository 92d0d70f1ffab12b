"""jobs/outputs.py through the CLI: empty paths, and outputs that are an input or another output."""

from __future__ import annotations

import os
from pathlib import Path

from conftest import PLAIN, TINY_NET, invoke
from helpers import adapt, fails, stats


def test_an_empty_path_is_a_usage_error_not_the_working_directory(setup, tmp_path, monkeypatch):
    """An unset shell variable ($DATA, $STATS) must not adapt or summarise whatever is in the cwd."""
    monkeypatch.chdir(setup["train"] / "a")
    fails(invoke("adapt", "--stats", setup["artifact"], ""), 2, "--data is given an empty path (an unset shell variable?)")
    fails(invoke("adapt", "--stats", "", "--model", TINY_NET, setup["train"]), 2, "--stats is given an empty path")
    fails(invoke("stats", "--model", TINY_NET, "--weights", setup["weights"], "--data", "", *PLAIN, "--out", tmp_path / "s.st"), 2,
          "--data is given an empty path")
    fails(adapt(setup, setup["train"], "--predictions", " "), 2, "--predictions is given an empty path")


def test_an_output_that_is_an_input_or_another_output_is_refused_and_nothing_is_touched(setup, tmp_path):
    weights = tmp_path / "w.pt"
    weights.write_bytes(Path(setup["weights"]).read_bytes())
    result = invoke("stats", "--model", TINY_NET, "--weights", weights, "--data", setup["train"], *PLAIN, "--fraction", "1", "--out", weights)
    fails(result, 2, f"--out {weights} is also the --weights file")
    assert weights.read_bytes() == Path(setup["weights"]).read_bytes()
    artifact = tmp_path / "s.safetensors"
    artifact.write_bytes(Path(setup["artifact"]).read_bytes())
    before = artifact.read_bytes()
    fails(invoke("adapt", "--stats", artifact, "--model", TINY_NET, "--data", setup["train"], "--metrics-json", artifact), 2,
          f"--metrics-json {artifact} is also the --stats file")
    fails(adapt(setup, setup["train"], "--predictions", tmp_path / "p.csv", "--metrics-json", tmp_path / "p.csv"), 2,
          "--metrics-json", "is also the --predictions file")
    assert artifact.read_bytes() == before and not (tmp_path / "p.csv").exists()
    linked = tmp_path / "linked.csv"
    os.link(artifact, linked)  # another name for the same file
    fails(invoke("adapt", "--stats", artifact, "--model", TINY_NET, "--data", setup["train"], "--predictions", linked), 2,
          f"--predictions {linked} is also the --stats file")
    assert artifact.read_bytes() == before
    image = next((Path(setup["train"]) / "a").glob("*.png"))
    fails(adapt(setup, setup["train"], "--predictions", image), 2, f"--predictions {image} is a file inside an input folder")
    # a new file too, when the next run would take it for an image of the data
    new_image = Path(setup["train"]) / "a" / "predictions.png"
    fails(adapt(setup, setup["train"], "--predictions", new_image), 2, f"--predictions {new_image} would be read as an image of --data next time")
    assert not new_image.exists()
    # `-` is standard output for the records only: elsewhere it is refused, not made a file named "-"
    for option in ("--metrics-json", "--predictions"):
        result = adapt(setup, setup["train"], "--quiet", option, "-")
        if option == "--predictions":
            assert result.exit_code == 0 and result.stdout.startswith("path,"), result.stderr
        else:
            fails(result, 2, "--metrics-json -: only the records of cafa adapt (--predictions) go to standard output")
    fails(invoke("stats", "--model", TINY_NET, "--weights", weights, "--data", setup["train"], *PLAIN, "--out", "-"), 2, "--out -: only the records")


def test_outputs_inside_a_cifar_root_or_named_on_stdin_are_refused(setup, tmp_path):
    """The output checks cover every input, not only --data folders."""
    from helpers import make_cifar10

    make_cifar10(tmp_path / "cifar")
    batch = tmp_path / "cifar" / "cifar-10-batches-py" / "data_batch_1"
    before = batch.read_bytes()
    fails(stats(setup, f"cifar10:{tmp_path / 'cifar'}", "--out", batch), 2, f"--out {batch} is a file inside an input folder")
    image = next((Path(setup["train"]) / "a").glob("*.png"))
    copy = tmp_path / "x.png"
    copy.write_bytes(image.read_bytes())
    result = adapt(setup, "-", "--predictions", copy, "--bn-prior", "16", input=f"{image}\n{copy}\n")
    fails(result, 2, f"--predictions {copy} is also the --data - file")
    assert batch.read_bytes() == before and copy.read_bytes() == image.read_bytes()
    fails(adapt(setup, "-", "--data", "-", input=f"{image}\n"), 2, "--data - (image paths on stdin) is given more than once")
