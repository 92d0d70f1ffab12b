"""jobs/outputs.py through the CLI: empty paths, and outputs that are an input or another output."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from conftest import PLAIN, TINY_NET, invoke
from helpers import adapt, fails, stats


def test_an_empty_path_is_a_usage_error_not_the_working_directory(setup, tmp_path, monkeypatch):
    """An unset shell variable ($DATA, $STATS) must not adapt or summarise whatever is in the cwd."""
    monkeypatch.chdir(setup["train"] / "a")
    fails(
        invoke("adapt", "--stats", setup["artifact"], ""), 2, "--data is given an empty path (an unset shell variable?)"
    )
    fails(invoke("adapt", "--stats", "", "--model", TINY_NET, setup["train"]), 2, "--stats is given an empty path")
    fails(
        invoke(
            "stats",
            "--model",
            TINY_NET,
            "--weights",
            setup["weights"],
            "--data",
            "",
            *PLAIN,
            "--out",
            tmp_path / "s.st",
        ),
        2,
        "--data is given an empty path",
    )
    fails(adapt(setup, setup["train"], "--predictions", " "), 2, "--predictions is given an empty path")


def test_an_output_that_is_an_input_or_another_output_is_refused_and_nothing_is_touched(setup, tmp_path):
    weights = tmp_path / "w.pt"
    weights.write_bytes(Path(setup["weights"]).read_bytes())
    result = invoke(
        "stats",
        "--model",
        TINY_NET,
        "--weights",
        weights,
        "--data",
        setup["train"],
        *PLAIN,
        "--fraction",
        "1",
        "--out",
        weights,
    )
    fails(result, 2, f"--out {weights} is also the --weights file")
    assert weights.read_bytes() == Path(setup["weights"]).read_bytes()
    artifact = tmp_path / "s.safetensors"
    artifact.write_bytes(Path(setup["artifact"]).read_bytes())
    before = artifact.read_bytes()
    fails(
        invoke("adapt", "--stats", artifact, "--model", TINY_NET, "--data", setup["train"], "--metrics-json", artifact),
        2,
        f"--metrics-json {artifact} is also the --stats file",
    )
    fails(
        adapt(setup, setup["train"], "--predictions", tmp_path / "p.csv", "--metrics-json", tmp_path / "p.csv"),
        2,
        "--metrics-json",
        "is also the --predictions file",
    )
    assert artifact.read_bytes() == before and not (tmp_path / "p.csv").exists()
    linked = tmp_path / "linked.csv"
    os.link(artifact, linked)  # another name for the same file
    fails(
        invoke("adapt", "--stats", artifact, "--model", TINY_NET, "--data", setup["train"], "--predictions", linked),
        2,
        f"--predictions {linked} is also the --stats file",
    )
    assert artifact.read_bytes() == before
    image = next((Path(setup["train"]) / "a").glob("*.png"))
    fails(
        adapt(setup, setup["train"], "--predictions", image),
        2,
        f"--predictions {image} is a file inside an input folder",
    )
    # a new file too, when the next run would take it for an image of the data
    new_image = Path(setup["train"]) / "a" / "predictions.png"
    fails(
        adapt(setup, setup["train"], "--predictions", new_image),
        2,
        f"--predictions {new_image} would be read as an image of --data next time",
    )
    assert not new_image.exists()
    # `-` is standard output for the records only: elsewhere it is refused, not made a file named "-"
    for option in ("--metrics-json", "--predictions"):
        result = adapt(setup, setup["train"], "--quiet", option, "-")
        if option == "--predictions":
            assert result.exit_code == 0 and result.stdout.startswith("path,"), result.stderr
        else:
            fails(result, 2, "--metrics-json -: only the records of cafa adapt (--predictions) go to standard output")
    fails(
        invoke("stats", "--model", TINY_NET, "--weights", weights, "--data", setup["train"], *PLAIN, "--out", "-"),
        2,
        "--out -: only the records",
    )


def test_outputs_inside_a_cifar_root_or_named_on_stdin_are_refused(setup, tmp_path):
    """The output checks cover every input, not only --data folders."""
    from helpers import make_cifar10

    make_cifar10(tmp_path / "cifar")
    batch = tmp_path / "cifar" / "cifar-10-batches-py" / "data_batch_1"
    before = batch.read_bytes()
    fails(
        stats(setup, f"cifar10:{tmp_path / 'cifar'}", "--out", batch),
        2,
        f"--out {batch} is a file inside an input folder",
    )
    image = next((Path(setup["train"]) / "a").glob("*.png"))
    copy = tmp_path / "x.png"
    copy.write_bytes(image.read_bytes())
    result = adapt(setup, "-", "--predictions", copy, "--norm", "prior:16", input=f"{image}\n{copy}\n")
    fails(result, 2, f"--predictions {copy} is also the image {copy} of --data -")
    assert batch.read_bytes() == before and copy.read_bytes() == image.read_bytes()
    fails(
        adapt(setup, "-", "--data", "-", input=f"{image}\n"),
        2,
        "--data - (image paths on stdin) is given more than once",
    )


def _copies(setup, tmp_path) -> dict[str, Path]:
    """A private copy of every kind of input file a command reads."""
    files = {
        "factory": tmp_path / "fac.py",
        "weights": tmp_path / "w.pt",
        "artifact": tmp_path / "s.safetensors",
        "classes": tmp_path / "classes.txt",
    }
    files["factory"].write_text(
        f"import sys\nsys.path.insert(0, {str(Path(TINY_NET.rpartition(':')[0]).parent)!r})\n"
        f"from tiny_net import build\n"
    )
    files["weights"].write_bytes(Path(setup["weights"]).read_bytes())
    files["artifact"].write_bytes(Path(setup["artifact"]).read_bytes())
    files["classes"].write_text("a\nb\nc\n")
    return files


@pytest.mark.parametrize("output", ["--out", "--predictions", "--metrics-json", "--csv", "bench --metrics-json"])
@pytest.mark.parametrize("input_kind", ["factory", "weights", "artifact", "classes", "labels"])
def test_no_output_may_replace_any_input_of_its_command(setup, tmp_path, output, input_kind):
    """Each output flag against each kind of input: refused before any work, the input byte-identical."""
    files = _copies(setup, tmp_path)
    model = f"{files['factory']}:build"
    if input_kind == "labels":  # an array of images and its labels
        images = tmp_path / "x.npy"
        np.save(images, np.zeros((3, 16, 16), dtype=np.uint8))
        files["labels"] = tmp_path / "y.npy"
        np.save(files["labels"], np.arange(3))
    data = (
        ["--data", str(images), "--labels", str(files["labels"])]
        if input_kind == "labels"
        else ["--data", str(setup["train"])]
    )
    classes = ["--classes", str(files["classes"])] if input_kind == "classes" else []
    target = str(files[input_kind])
    command, _, output = output.rpartition(" ")
    if output == "--out":
        args = ["stats", "--model", model, "--weights", files["weights"], *data, *classes, *PLAIN, "--fraction", "1"]
        if input_kind == "artifact":
            pytest.skip("cafa stats reads no artifact")
    elif output in ("--predictions", "--metrics-json") and command != "bench":
        args = ["adapt", "--stats", files["artifact"], "--model", model, "--weights", files["weights"], *data]
        if input_kind == "classes":
            pytest.skip("cafa adapt takes its classes from the artifact")
    else:
        args = [
            "bench",
            "--model",
            model,
            "--weights",
            files["weights"],
            "--train",
            str(setup["train"]),
            *data,
            *classes,
            *PLAIN,
            "--workdir",
            str(tmp_path / "bench"),
            "--methods",
            "source",
        ]
        if input_kind == "artifact":
            pytest.skip("cafa bench makes its own artifacts")
    before = Path(target).read_bytes()
    fails(
        invoke(*args, output, target),
        2,
        f"{output} {target} is also the --{'model' if input_kind == 'factory' else input_kind.replace('artifact', 'stats')} file",
    )
    assert Path(target).read_bytes() == before


def test_the_model_files_an_artifact_names_are_inputs_too(setup, tmp_path):
    """With no --model, adapt reads the factory and weights the artifact records: no output may replace them."""
    files = _copies(setup, tmp_path)
    model = f"{files['factory']}:build"
    artifact = tmp_path / "own.safetensors"
    made = invoke(
        "stats",
        "--model",
        model,
        "--weights",
        files["weights"],
        "--data",
        setup["train"],
        *PLAIN,
        "--fraction",
        "1",
        "--out",
        artifact,
        "--quiet",
    )
    assert made.exit_code == 0, made.stderr
    for named, kind in ((files["weights"], "weights"), (files["factory"], "model")):
        before = named.read_bytes()
        fails(
            invoke(
                "adapt", "--stats", artifact, "--trust-checkpoint", "--data", setup["train"], "--predictions", named
            ),
            2,
            f"--predictions {named} is also --{kind}'s file {named}, which this command reads",
        )
        assert named.read_bytes() == before


@pytest.mark.parametrize("config_file", ["cafa.toml", "pyproject.toml"])
def test_no_output_may_replace_the_config_file_it_read(setup, tmp_path, monkeypatch, config_file):
    monkeypatch.chdir(tmp_path)
    text = (
        "[adapt]\nbatch-size = 4\n"
        if config_file == "cafa.toml"
        else "[project]\nname = 'x'\n\n[tool.cafa.adapt]\nbatch-size = 4\n"
    )
    Path(config_file).write_text(text)
    for args in (
        [
            "stats",
            "--model",
            TINY_NET,
            "--weights",
            setup["weights"],
            "--data",
            setup["train"],
            *PLAIN,
            "--fraction",
            "1",
            "--out",
            config_file,
        ],
        [
            "adapt",
            "--stats",
            setup["artifact"],
            "--model",
            TINY_NET,
            "--data",
            setup["train"],
            "--metrics-json",
            config_file,
        ],
        [
            "bench",
            "--model",
            TINY_NET,
            "--weights",
            setup["weights"],
            "--train",
            setup["train"],
            "--data",
            setup["train"],
            *PLAIN,
            "--methods",
            "source",
            "--csv",
            config_file,
        ],
    ):
        fails(invoke(*args), 2, f"{config_file} is also the config file")
        assert Path(config_file).read_text() == text


# --- every file a command reads, as it opens it (issue 31, class 2) ------------------------

PLUGIN = "from cafa_cli.methods.tent import Tent\ndef build(gaussians, device):\n    return Tent()\n"


def _module_factory(folder: Path, name: str) -> str:
    (folder / f"{name}.py").write_text(
        f"import sys\nsys.path.insert(0, {str(Path(TINY_NET.rpartition(':')[0]).parent)!r})\n"
        f"from tiny_net import build\n"
    )
    return f"{name}:build"


@pytest.mark.parametrize("spelling", ["same", "relative", "symlink", "hardlink"])
def test_no_output_replaces_a_module_factory_or_a_plugin_source(setup, tmp_path, monkeypatch, spelling):
    """The files a module:fn or file.py:fn name resolves to: a factory (stats --out), a plug-in (adapt --metrics-json,
    bench --csv / --json), by their own name, relative, through a symlink or a hard link."""
    monkeypatch.chdir(tmp_path)
    netmod, plugm = f"netmod_{spelling}", f"plugm_{spelling}"  # one name a case: this process keeps imported modules
    model = _module_factory(tmp_path, netmod)
    (tmp_path / f"{plugm}.py").write_text(PLUGIN)
    (tmp_path / "plug.py").write_text(PLUGIN)

    def output_for(source: str) -> Path:
        if spelling == "same":
            return tmp_path / source
        if spelling == "relative":
            return Path(source)
        other = tmp_path / f"other-{source}"
        (other.symlink_to if spelling == "symlink" else other.hardlink_to)(tmp_path / source)
        return other

    cases = [
        (
            [
                "stats",
                "--model",
                model,
                "--weights",
                setup["weights"],
                "--data",
                setup["train"],
                *PLAIN,
                "--fraction",
                "1",
                "--out",
            ],
            f"{netmod}.py",
        ),
        (
            [
                "adapt",
                "--stats",
                setup["artifact"],
                "--model",
                TINY_NET,
                "--data",
                setup["train"],
                "--method",
                f"{plugm}:build",
                "--metrics-json",
            ],
            f"{plugm}.py",
        ),
        (
            [
                "adapt",
                "--stats",
                setup["artifact"],
                "--model",
                TINY_NET,
                "--data",
                setup["train"],
                "--method",
                "./plug.py:build",
                "--predictions",
            ],
            "plug.py",
        ),
        (
            [
                "bench",
                setup["train"],
                "--methods",
                f"bn,{plugm}:build",
                "--model",
                TINY_NET,
                "--weights",
                setup["weights"],
                *PLAIN,
                "--train",
                setup["train"],
                "--fraction",
                "1",
                "--workdir",
                tmp_path / "w",
                "--csv",
            ],
            f"{plugm}.py",
        ),
    ]
    for args, source in cases:
        before = (tmp_path / source).read_bytes()
        output = output_for(source)
        result = invoke(*args, output)
        fails(result, 2, f"{output} is also", "writing it would destroy that")
        assert (tmp_path / source).read_bytes() == before, args[0]
        if output.is_symlink() or spelling == "hardlink":
            output.unlink()


def test_no_output_replaces_eatas_fisher_images(setup, tmp_path):
    fish = tmp_path / "fish.npy"
    np.save(fish, np.zeros((4, 16, 16), dtype=np.uint8))
    linked = tmp_path / "fish-link.npy"
    os.link(fish, linked)
    before = fish.read_bytes()
    for output in (fish, linked):
        result = invoke(
            "adapt",
            "--stats",
            setup["artifact"],
            "--model",
            TINY_NET,
            "--data",
            setup["train"],
            "--method",
            "eata",
            "--fisher-data",
            fish,
            "--metrics-json",
            output,
        )
        fails(result, 2, f"--metrics-json {output} is also", "writing it would destroy that")
    assert fish.read_bytes() == before


@pytest.mark.skipif(
    not Path("/usr/share/datasets/fashion-mnist/train-labels-idx1-ubyte.gz").is_file(),
    reason="Debian's dataset-fashion-mnist is not installed",
)
def test_no_output_replaces_a_data_set_found_through_its_environment_variable(setup, tmp_path, monkeypatch):
    """CAFA_FASHION_MNIST=/x cafa stats --data fashion-mnist --out /x/train-labels-idx1-ubyte.gz"""
    root = tmp_path / "fm"
    root.mkdir()
    for name in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"):
        (root / name).symlink_to(Path("/usr/share/datasets/fashion-mnist") / name)
    monkeypatch.setenv("CAFA_FASHION_MNIST", str(root))
    target = root / "train-labels-idx1-ubyte.gz"
    before = target.read_bytes()
    result = invoke("stats", "--model", "fmnist-resnet", "--data", "fashion-mnist", "--per-class", "2", "--out", target)
    fails(result, 2, f"--out {target} is also a data set's file", "which this command reads")
    assert target.is_symlink() and target.read_bytes() == before
