"""`cafa adapt` through the CLI: output records, metrics JSON, determinism, inputs."""

from __future__ import annotations

import csv
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import tiny_net
import torch
from conftest import TINY_NET, invoke, write_folder
from helpers import adapt_args, fails, options, stats_args, unless_given

from cafa_cli.artifact.store import read_artifact
from cafa_cli.jobs import adapt as adapt_job
from cafa_cli.methods import method_class


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny net trained briefly on generated images, its artifact, and a shifted test folder."""
    root = tmp_path_factory.mktemp("adapt")
    train = write_folder(root / "train", per_class=40)
    test = write_folder(root / "test", per_class=30, seed=3, shift=0.35)
    torch.manual_seed(0)
    net = tiny_net.build()
    from cafa_cli.data.loading import batches
    from cafa_cli.data.preprocessing import Preprocessing
    from cafa_cli.data.sources import open_domain

    prep = Preprocessing(None, None, (0.0,), (255.0 / 255,), 1)
    domain = open_domain(str(train))
    optimizer = torch.optim.Adam(net.parameters(), 1e-2)
    for _ in range(8):
        for batch in batches(domain, prep, 30, np.random.default_rng(_).permutation(len(domain))):
            optimizer.zero_grad()
            labels = torch.as_tensor(domain.labels[batch.indices])
            torch.nn.functional.cross_entropy(net(prep.normalize(batch.images)), labels).backward()
            optimizer.step()
    weights = root / "net.pt"
    torch.save(net.state_dict(), weights)
    artifact = root / "s.safetensors"
    result = invoke(*stats_args(train, weights=weights, fraction=1, out=artifact))
    assert result.exit_code == 0, result.stderr
    return {"root": root, "train": train, "test": test, "weights": weights, "artifact": artifact}


def adapt(setup, *args):
    return invoke(
        *adapt_args(setup["test"], stats=setup["artifact"]), *unless_given(["--batch-size", "30"], args), *args
    )


def test_csv_has_a_header_and_one_line_per_image_with_class_names(setup):
    result = adapt(setup, "--quiet")
    assert result.exit_code == 0, result.stderr
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert len(rows) == 90
    assert list(rows[0]) == ["path", "prediction", "label", "confidence"]
    assert {r["label"] for r in rows} == {"a", "b", "c"}
    assert {r["prediction"] for r in rows} <= {"a", "b", "c"}
    assert all(0 < float(r["confidence"]) <= 1 for r in rows)
    assert len({r["path"] for r in rows}) == 90


def test_metrics_json_schema_and_error_agree_with_the_records(setup, tmp_path):
    metrics = tmp_path / "m.json"
    result = adapt(setup, "--quiet", "--metrics-json", str(metrics))
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    report = json.loads(metrics.read_text())
    wrong = sum(r["prediction"] != r["label"] for r in rows)
    assert report["method"] == "cafa" and report["n"] == 90
    assert report["error"] == pytest.approx(wrong / 90)
    assert report["domains"][0]["data"] == str(setup["test"]) and report["domains"][0]["n"] == 90
    assert 0 <= report["domains"][0]["error"] <= 1
    assert report["settings"]["batch_size"] == 30 and report["settings"]["covariance"] == "full"
    # what rebuilds the model, as resolved from the artifact: enough to reproduce the run
    recorded = read_artifact(setup["artifact"], load_tensors=False).model
    assert {k: report["settings"][k] for k in ("model", "weights", "weights_sha256", "num_classes", "classifier")} == {
        "model": recorded.model,
        "weights": recorded.weights,
        "weights_sha256": recorded.weights_sha256,
        "num_classes": recorded.num_classes,
        "classifier": recorded.classifier,
    }
    assert report["settings"]["classifier"] and (report["settings"]["classes"], report["settings"]["labels"]) == (
        None,
        None,
    )
    # which statistics (a path can be overwritten later) and which software made the numbers
    made = read_artifact(setup["artifact"], load_tensors=False).metadata["created"]
    assert (report["settings"]["stats"], report["settings"]["stats_created"]) == (
        str(Path(setup["artifact"]).resolve()),
        made,
    )
    assert {"cafa", "python", "torch", "torch_cuda", "torchvision", "threads", "device", "deterministic"} <= set(
        report["environment"]
    )  # each field's truth: tests/test_environment.py


def test_the_metrics_json_records_every_setting_its_field_says_it_records(setup, tmp_path):
    """An option is its field: a new field is recorded as given unless its metadata says why not."""
    from cafa_cli.jobs.config import AdaptConfig
    from cafa_cli.jobs.config.settings import recorded_as_given, recorded_values

    metrics = tmp_path / "m.json"
    result = adapt(
        setup,
        "--quiet",
        "--metrics-json",
        str(metrics),
        "--method",
        "eata",
        "--lr",
        "0.01",
        "--steps",
        "2",
        "--method-option",
        "redundancy_margin=0.3",
    )
    settings = json.loads(metrics.read_text())["settings"]
    given = AdaptConfig(
        data=["x"], method="eata", lr=0.01, steps=2, batch_size=30, method_option=["redundancy_margin=0.3"]
    )
    resolved = ("device", "num_workers", "recipe")  # as given, then replaced by what the run resolved
    assert {name: settings[name] for name in recorded_as_given(AdaptConfig) if name not in resolved} == {
        name: value for name, value in recorded_values(given).items() if name not in resolved
    }, result.stderr
    assert settings["norm"] == "batch"  # the Norm the settings hold, recorded as its text
    assert settings["recipe"]["requested"] == "auto" and settings["device"] == "cpu"


def test_cafa_beats_source_on_the_shifted_folder(setup, tmp_path):
    errors = {}
    for method in ("source", "cafa"):
        result = adapt(
            setup, "--quiet", "--method", method, "--lr", "0.01", "--metrics-json", str(tmp_path / f"{method}.json")
        )
        assert result.exit_code == 0, result.stderr
        errors[method] = json.loads((tmp_path / f"{method}.json").read_text())["error"]
    assert errors["cafa"] < errors["source"], errors


@pytest.mark.parametrize("method", ["bn", "pl", "tent", "global-fa", "intra", "euclidean"])
def test_every_method_runs_on_the_same_data(setup, method, monkeypatch):
    reads = []

    def recording(path, load_tensors=True):
        reads.append(load_tensors)
        return read_artifact(path, load_tensors)

    monkeypatch.setattr(adapt_job.prepare, "read_artifact", recording)
    result = adapt(setup, "--quiet", "--method", method)
    assert result.exit_code == 0, result.stderr
    assert len(result.stdout.splitlines()) == 91
    # the artifact's tensors (GBs on ImageNet) are loaded only by the methods that use them
    assert reads == [method_class(method).needs_statistics]


def test_same_seed_gives_byte_identical_predictions(setup):
    first, second = adapt(setup, "--quiet", "--seed", "3"), adapt(setup, "--quiet", "--seed", "3")
    assert first.stdout == second.stdout
    other = adapt(setup, "--quiet", "--seed", "4")
    assert other.stdout != first.stdout  # the seed does change the stream order


@pytest.mark.parametrize("method", ["rmt", "santa", "adacontrast"])
def test_same_seed_repeats_a_method_that_draws_as_it_is_built(setup, method):
    """RMT's and SANTA's projector and AdaContrast's key queue were drawn from torch's generator
    before --seed set it: two runs of one command predicted differently."""
    first, second = (adapt(setup, "--quiet", "--seed", "3", "--method", method, "--recipe", "cifar10-c") for _ in "12")
    assert first.exit_code == 0, first.stderr
    assert first.stdout == second.stdout


def test_jsonl_format_and_predictions_file(setup, tmp_path):
    out = tmp_path / "p.jsonl"
    result = adapt(setup, "--quiet", "--format", "jsonl", "--predictions", str(out))
    assert result.exit_code == 0 and result.stdout == ""
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 90 and set(records[0]) == {"path", "prediction", "label", "confidence"}


def test_no_shuffle_keeps_folder_order(setup):
    result = adapt(setup, "--quiet", "--no-shuffle")
    assert result.exit_code == 0, result.stderr
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    # every image once, class folder by class folder, each folder's files in name order (an empty output matched before)
    assert [r["path"] for r in rows] == [str(path) for path in sorted(Path(setup["test"]).glob("*/*.png"))]
    assert len(rows) == 90


def test_unlabelled_folder_and_stdin_paths(setup, tmp_path):
    flat = tmp_path / "flat"
    flat.mkdir()
    paths = sorted((setup["test"] / "a").glob("*.png"))[:7]
    for p in paths:
        (flat / p.name).write_bytes(p.read_bytes())
    metrics = tmp_path / "m.json"
    result = invoke(*adapt_args(flat, stats=setup["artifact"], quiet=True, metrics_json=metrics))
    assert result.exit_code == 0, result.stderr
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert len(rows) == 7 and all(r["label"] == "" for r in rows)
    assert json.loads(metrics.read_text())["error"] is None
    result = invoke(*adapt_args(flat, stats=setup["artifact"], quiet=True, format="jsonl"))
    assert [json.loads(line)["label"] for line in result.stdout.splitlines()] == [None] * 7  # JSON's own "no value"
    stdin = "\n".join(str(p) for p in paths) + "\n"
    result = invoke(*adapt_args("-", stats=setup["artifact"], quiet=True, no_shuffle=True), input=stdin)
    assert result.exit_code == 0, result.stderr
    assert [r["path"] for r in csv.DictReader(io.StringIO(result.stdout))] == [str(p) for p in paths]


def test_several_domains_reset_per_domain_and_summary(setup, tmp_path):
    metrics = tmp_path / "m.json"
    result = invoke(
        *adapt_args(setup["test"], setup["train"], stats=setup["artifact"], batch_size=30, metrics_json=metrics)
    )
    assert result.exit_code == 0, result.stderr
    report = json.loads(metrics.read_text())
    assert [d["n"] for d in report["domains"]] == [90, 120] and report["n"] == 210
    assert "error %" in result.stderr  # the summary table goes to stderr, never stdout
    assert "error %" not in result.stdout


def test_a_test_class_the_artifact_does_not_know_is_an_error(setup, tmp_path):
    odd = write_folder(tmp_path / "odd", per_class=2, classes=("a", "zebra"))
    result = invoke(*adapt_args(odd, stats=setup["artifact"]))
    assert result.exit_code == 3
    assert "zebra" in result.stderr and "Traceback" not in result.stderr
    odd = write_folder(tmp_path / "case", per_class=2, classes=("a", "B"))
    result = invoke(*adapt_args(odd, stats=setup["artifact"]))
    assert (
        result.exit_code == 3
        and "class folder(s) B not in the model's class list (3 classes) (did you mean b for B?)" in result.stderr
    )


def test_changed_weights_are_refused_unless_allowed(setup, tmp_path):
    import shutil

    moved = dict(setup)
    weights = tmp_path / "net.pt"
    shutil.copy(setup["weights"], weights)
    artifact = tmp_path / "s.safetensors"
    result = invoke(*stats_args(setup["train"], weights=weights, fraction=1, out=artifact, quiet=True))
    assert result.exit_code == 0, result.stderr
    torch.manual_seed(1)
    torch.save(tiny_net.build().state_dict(), weights)
    moved["artifact"] = artifact
    result = adapt(moved, "--quiet")
    assert (
        result.exit_code == 3 and "has changed since the statistics were computed (parameters differ)" in result.stderr
    )
    assert adapt(moved, "--quiet", "--allow-weights-mismatch").exit_code == 0
    # naming the changed file with --weights does not skip the check
    result = adapt(moved, "--quiet", "--weights", str(weights))
    assert result.exit_code == 3 and f"{weights} has changed since the statistics were computed" in result.stderr


def test_other_weights_or_another_model_than_the_artifacts_are_refused_unless_allowed(setup, tmp_path):
    import shutil

    other = tmp_path / "other.pt"
    torch.manual_seed(7)
    torch.save(tiny_net.build().state_dict(), other)
    result = adapt(setup, "--quiet", "--weights", str(other))
    assert result.exit_code == 3, result.stderr
    assert f"with {Path(setup['weights']).resolve()}, not with {other} (parameters differ)" in result.stderr
    assert adapt(setup, "--quiet", "--weights", str(other), "--allow-weights-mismatch").exit_code == 0
    same = tmp_path / "copy.pt"
    shutil.copy(setup["weights"], same)  # the same weights under another name are the same model
    assert adapt(setup, "--quiet", "--weights", str(same)).exit_code == 0

    factory = tmp_path / "other_net.py"
    factory.write_text(
        f"import sys\nsys.path.insert(0, {str(Path(TINY_NET.split(':')[0]).parent)!r})\nimport tiny_net\n\ndef build():\n    return tiny_net.build()\n"
    )
    args = adapt_args(setup["test"], stats=setup["artifact"], model=f"{factory}:build")
    result = invoke(*args, "--weights", other, "--quiet")  # another factory, other weights
    assert (
        result.exit_code == 3 and f"holds statistics of the model {TINY_NET}, not of {factory}:build" in result.stderr
    )
    assert invoke(*args, "--weights", other, "--quiet", "--allow-weights-mismatch").exit_code == 0
    # with the same weights too: other code may compute other features from the same parameters
    result = invoke(*args, "--weights", setup["weights"], "--quiet")
    assert (
        result.exit_code == 3 and f"holds statistics of the model {TINY_NET}, not of {factory}:build" in result.stderr
    )


def test_a_factory_file_edited_since_the_statistics_is_refused(setup, tmp_path):
    """The same parameters through edited code can give other features."""
    factory = tmp_path / "net_copy.py"
    factory.write_bytes(Path(TINY_NET.split(":")[0]).read_bytes())
    artifact = tmp_path / "s.safetensors"
    made = invoke(
        *stats_args(setup["train"], model=f"{factory}:build", weights=setup["weights"], fraction=1, out=artifact)
    )
    assert made.exit_code == 0, made.stderr
    args = adapt_args(setup["test"], stats=artifact, model=f"{factory}:build", quiet=True)
    assert invoke(*args).exit_code == 0
    factory.write_text(factory.read_text().replace("return self.head(", "return -self.head("))
    result = invoke(*args)
    assert (
        result.exit_code == 3
        and f"{factory} has changed since the statistics in {artifact} were computed" in result.stderr
    )
    assert invoke(*args, "--allow-weights-mismatch").exit_code == 0


def test_a_factory_file_copied_elsewhere_is_the_same_model(setup, tmp_path):
    """Another checkout or machine: the same function in a file with the same bytes."""
    moved = tmp_path / "elsewhere" / "tiny_net.py"
    moved.parent.mkdir()
    moved.write_bytes(Path(TINY_NET.split(":")[0]).read_bytes())
    args = adapt_args(
        setup["test"], stats=setup["artifact"], model=f"{moved}:build", weights=setup["weights"], quiet=True
    )
    result = invoke(*args)
    assert result.exit_code == 0, result.stderr
    moved.write_text(
        moved.read_text().replace("return self.head(", "return -self.head(")
    )  # other code, same parameters
    result = invoke(*args)
    assert result.exit_code == 3 and f"holds statistics of the model {TINY_NET}, not of {moved}:build" in result.stderr


def test_the_same_parameters_in_another_file_are_the_same_model(setup, tmp_path):
    """Re-saving or converting the weights changes the file's bytes, not the features."""
    from safetensors.torch import save_file

    state = torch.load(setup["weights"], weights_only=True)
    resaved = tmp_path / "resaved.pt"
    torch.save({"state_dict": {f"module.{k}": v for k, v in state.items()}}, resaved)
    converted = tmp_path / "converted.safetensors"
    save_file({k: v.contiguous() for k, v in state.items() if not k.endswith("num_batches_tracked")}, converted)
    for weights in (resaved, converted):
        result = adapt(setup, "--weights", str(weights))
        assert result.exit_code == 0, result.stderr
        assert "warning" not in result.stderr
    changed = tmp_path / "changed.safetensors"
    first = next(k for k, v in state.items() if v.is_floating_point())
    save_file({**{k: v.contiguous() for k, v in state.items()}, first: state[first] + 1e-3}, changed)
    result = adapt(setup, "--quiet", "--weights", str(changed))
    assert result.exit_code == 3 and "(parameters differ)" in result.stderr


def test_a_factory_that_draws_its_parameters_at_random_is_refused(setup, tmp_path):
    """Without --weights a factory's own initialisation is the model: a random one differs per process."""
    artifact = tmp_path / "s.safetensors"
    torch.manual_seed(11)
    result = invoke(*stats_args(setup["train"], fraction=1, out=artifact, quiet=True))
    assert result.exit_code == 0, result.stderr
    args = adapt_args(setup["test"], stats=artifact, quiet=True)
    torch.manual_seed(11)
    assert invoke(*args).exit_code == 0  # the same draw: the same model
    torch.manual_seed(12)
    result = invoke(*args)
    assert (
        result.exit_code == 3
        and "initialised its parameters differently" in result.stderr
        and "give --weights" in result.stderr
    )


def test_a_factory_named_by_the_artifact_runs_only_when_the_user_names_it(setup):
    """An artifact points at model code; it must not run on the artifact's word alone."""
    result = invoke(*adapt_args(setup["test"], stats=setup["artifact"], model=None, quiet=True))
    assert result.exit_code == 3 and result.stdout == ""
    assert "names the model factory" in result.stderr and f"--model {TINY_NET}" in result.stderr
    trusted = invoke(
        *adapt_args(
            setup["test"], stats=setup["artifact"], model=None, batch_size=30, quiet=True, trust_checkpoint=True
        )
    )
    assert trusted.exit_code == 0 and trusted.stdout == adapt(setup, "--quiet").stdout  # same weights as with --model


def test_a_relative_factory_path_names_the_artifacts_model_and_weights(setup, monkeypatch):
    """`cafa adapt --model assets/tiny_net.py:build` from another folder is the artifact's
    model: it gets the artifact's verified weights, not a random initialisation."""
    from conftest import ASSETS

    monkeypatch.chdir(ASSETS.parent)
    relative = invoke(
        *adapt_args(setup["test"], stats=setup["artifact"], model="assets/tiny_net.py:build", batch_size=30, quiet=True)
    )
    assert relative.exit_code == 0, relative.stderr
    assert relative.stdout == adapt(setup, "--quiet").stdout


def test_settings_that_quietly_hurt_get_one_warning_each(setup):
    plain = adapt(setup, "--method", "bn")
    assert plain.exit_code == 0 and "warning:" not in plain.stderr
    result = adapt(setup, "--method", "bn", "--batch-size", "1", "--resize", "20", "--crop", "16")
    assert result.exit_code == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 2, result.stderr
    assert "--batch-size 1" in warnings[0] and "--norm prior:16" in warnings[0]
    assert "resize 20, crop 16 differ from the statistics' (resize none, crop none)" in warnings[1]
    assert "warning:" not in adapt(setup, "--method", "bn", "--batch-size", "1", "--norm", "prior:16").stderr
    result = adapt(setup, "--method", "bn", "--batch-size", "89", "--mean", "0.5")  # 90 images: 89 + 1
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert result.exit_code == 0 and len(warnings) == 2, result.stderr
    # the settings' warnings first; the batch caution at the first batch read
    assert "--mean/--std/--channels differ from the statistics' (mean [0.0], std [1.0], 1 channel(s))" in warnings[0]
    assert "the last batch of test holds 1 image" in warnings[1]


def test_a_batch_of_one_image_with_1x1_feature_maps_uses_the_source_statistics():
    from cafa_cli.engine.norms import BatchStatisticsNorm

    bn = torch.nn.BatchNorm2d(3).eval()
    bn.running_mean.fill_(2.0)
    bn.running_var.fill_(4.0)
    x = torch.full((1, 3, 1, 1), 4.0)
    torch.testing.assert_close(BatchStatisticsNorm(bn)(x), bn(x))  # (4 − 2) / 2 = 1, not a ValueError


def test_summary_keeps_a_long_path_whole_off_a_terminal(setup, tmp_path):
    deep = tmp_path / ("a-rather-long-folder-name-" * 3) / "fashion-mnist-c" / "gaussian_noise" / "3"
    shutil.copytree(setup["test"], deep)
    result = invoke(*adapt_args(deep, stats=setup["artifact"], method="bn"))
    assert result.exit_code == 0, result.stderr
    first_cells = [line.split("│")[1].strip() for line in result.stderr.splitlines() if line.startswith("│")]
    assert str(deep) in "".join(first_cells)  # folded over several lines, but whole


def test_quiet_also_silences_the_warnings_torch_logs_itself(capfd):
    import logging

    from cafa_cli.cli.streams import stderr as _stderr
    from cafa_cli.jobs.shared.monitor import Monitor

    torch_logger = logging.getLogger("torch")
    before = torch_logger.level
    torch_logger.setLevel(logging.NOTSET)  # an earlier --quiet run in this process may have raised it
    try:
        logging.getLogger("torch.utils.cpp_extension").warning(
            "No CUDA runtime is found"
        )  # as torch.compile's set-up may
        assert "No CUDA runtime" in capfd.readouterr().err
        Monitor()  # a silent monitor, as the Python API makes, leaves the process's logging alone
        assert torch_logger.level == logging.NOTSET
        _stderr(quiet=True)
        logging.getLogger("torch.utils.cpp_extension").warning("No CUDA runtime is found")
        logging.getLogger("torch.utils.cpp_extension").error("a real error still shows")
        err = capfd.readouterr().err
        assert "No CUDA runtime" not in err and "a real error still shows" in err
    finally:
        torch_logger.setLevel(before)


def test_the_demos_adapt_words_are_the_adapt_command_line_that_gives_them(monkeypatch):
    """The demo prints each run as `cafa adapt ... <adapt_words()>`: parsed back, they are the settings."""
    from dataclasses import replace

    from cafa_cli.core.errors import UsageError
    from cafa_cli.jobs import adapt as adapt_job
    from cafa_cli.jobs.config import AdaptConfig
    from cafa_cli.jobs.config.settings import recorded_as_given
    from cafa_cli.jobs.demo import adapt_words

    wanted = AdaptConfig(
        data=["x"],
        method="tent",
        batch_size=7,
        optimizer="sgd",
        lr=0.25,
        momentum=0.5,
        steps=2,
        params="all",
        norm="prior:4",
        reset="episodic",
        shuffle=False,
        seed=3,
        mix_domains=True,
        device="cpu",
        precision="bf16",
        num_workers=1,
        strict=True,
        compile=True,
        cuda_graph=False,
        allow_weights_mismatch=True,
    )
    # the stream settings that cannot go with those (--no-shuffle, --mix-domains) in a second run
    streams = AdaptConfig(
        data=["x"],
        method="cafa",
        order="label-shift:0.5",
        gradual=True,
        oracle=True,
        fisher_samples=9,
        reset="never",
        state="s.pt",
        rounds=3,
        stream_rate="1/2",
        step_cost="measured",
    )
    # a CCC stream, whose walk is its order (no --order, --gradual or --mix-domains beside it)
    ccc = AdaptConfig(data=["x"], method="tent", ccc=100, ccc_speed=10, ccc_accuracy=30.0)
    defaults = AdaptConfig()
    written_apart = ("method", "recipe", "method_option")  # adapt_words writes them first, in their own way
    assert all(
        any(getattr(config, name) != getattr(defaults, name) for config in (wanted, streams, ccc))
        for name in recorded_as_given(AdaptConfig)
        if name not in written_apart
    )  # every option is exercised
    seen = []

    def capture(config, monitor=None):
        seen.append(config)
        raise UsageError("captured")

    monkeypatch.setattr(adapt_job, "prepare_adaptation", capture)
    recipe = AdaptConfig(data=["x"], method="eata", recipe="imagenet-c", method_option=["redundancy_margin=0.2"])
    invoke("adapt", "--data", "x", *adapt_words(wanted))
    invoke("adapt", "--data", "x", *adapt_words(streams))
    invoke("adapt", "--data", "x", *adapt_words(recipe))
    invoke("adapt", "--data", "x", *adapt_words(ccc))
    assert [replace(config, given=None) for config in seen] == [wanted, streams, recipe, ccc]  # `given`: typed
    assert adapt_words(AdaptConfig()) == ["--method", "cafa"]


def test_a_domain_of_one_batch_is_flagged_for_gradient_methods(setup):
    """Each batch is predicted before its update: a domain that fits in one batch cannot show adaptation."""
    caution = "fits in one batch of --batch-size 90, predicted before any update: tent cannot differ from bn there"
    assert caution in adapt(setup, "--method", "tent", "--batch-size", "90").stderr
    assert "fits in one batch" not in adapt(setup, "--method", "tent").stderr  # 3 batches of 30
    assert "fits in one batch" not in adapt(setup, "--method", "bn", "--batch-size", "90").stderr
    # lame changes the prediction itself (no update needed): nothing to flag
    assert "fits in one batch" not in adapt(setup, "--method", "lame", "--batch-size", "90").stderr


def test_an_unshuffled_stream_of_class_folders_is_flagged(setup):
    caution = "--no-shuffle streams"
    assert caution in adapt(setup, "--method", "bn", "--no-shuffle").stderr
    assert caution not in adapt(setup, "--method", "bn").stderr
    assert caution not in adapt(setup, "--method", "source", "--no-shuffle").stderr  # no batch statistics, no updates


def test_class_runs_are_recognised_in_any_class_order():
    """Fashion-MNIST's folders sort as ankle_boot, bag, ... against the model's tshirt_top,
    trouser, ...: the runs come in another order than the classes', and are runs all the same."""
    from cafa_cli.jobs.adapt.job import _one_class_after_another

    assert _one_class_after_another(np.array([9, 9, 8, 8, 0, 0, 4]))
    assert not _one_class_after_another(np.array([0, 1, 0, 1]))
    assert not _one_class_after_another(np.array([3, 3, 3]))


def test_a_baseline_with_model_beside_an_unread_default_artifact_says_so(setup, tmp_path, monkeypatch):
    """cafa adapt --model M --method bn reads no artifact: beside cafa-stats.safetensors the run
    would otherwise silently take the default preprocessing and class names, not the artifact's."""
    monkeypatch.chdir(tmp_path)
    base = adapt_args(setup["test"], weights=setup["weights"], method="bn")
    assert "is here but not read" not in invoke(*base).stderr
    shutil.copy(setup["artifact"], tmp_path / "cafa-stats.safetensors")
    result = invoke(*base)
    assert result.exit_code == 0, result.stderr
    assert (
        "warning: cafa-stats.safetensors is here but not read (with --model, a method that needs no statistics"
        in result.stderr
    )
    assert "pass --stats cafa-stats.safetensors" in result.stderr
    named = invoke(*base, "--stats", "cafa-stats.safetensors")
    assert named.exit_code == 0 and "not read" not in named.stderr


def test_weights_an_artifact_names_that_need_unpickling_are_named_without_inviting_trust(setup, tmp_path):
    """The user gave no --weights: the error names the artifact and does not suggest
    trusting a file the artifact chose; typing --trust-checkpoint is still the user's call."""
    import argparse

    weights = tmp_path / "objects.pt"
    torch.save({"state_dict": torch.load(setup["weights"]), "args": argparse.Namespace(lr=0.1)}, weights)
    artifact = tmp_path / "s.safetensors"
    made = invoke(
        *stats_args(setup["train"], weights=weights, trust_checkpoint=True, fraction=1, out=artifact, quiet=True)
    )
    assert made.exit_code == 0, made.stderr
    args = adapt_args(setup["test"], stats=artifact, quiet=True)
    result = invoke(*args)
    assert result.exit_code == 3
    assert f"{artifact} names the weights {weights}, which hold Python objects beyond tensors" in result.stderr
    assert "--trust-checkpoint" not in result.stderr and "re-save them as a state dict" in result.stderr
    assert invoke(*args, "--trust-checkpoint").exit_code == 0


# --- stream settings: --order, --mix-domains, --gradual ------------------------------------


def labels_per_batch(stdout: str, batch_size: int) -> list[set[str]]:
    rows = list(csv.DictReader(io.StringIO(stdout)))
    return [{row["label"] for row in rows[i : i + batch_size]} for i in range(0, len(rows), batch_size)]


def test_label_shift_and_dirichlet_orders_give_batches_of_one_class_in_the_predictions(setup, tmp_path):
    iid = adapt(setup, "--quiet", "--batch-size", "10")
    assert iid.exit_code == 0, iid.stderr
    assert (
        sum(len(labels) == 1 for labels in labels_per_batch(iid.stdout, 10)) < 3
    )  # an i.i.d. batch of 10 from 3 classes
    for order, single in (("label-shift:1.0", 9), ("dirichlet:0.01", 6)):
        metrics = tmp_path / f"{order}.json"
        result = adapt(setup, "--quiet", "--batch-size", "10", "--order", order, "--metrics-json", str(metrics))
        assert result.exit_code == 0, result.stderr
        assert sum(len(labels) == 1 for labels in labels_per_batch(result.stdout, 10)) >= single, order
        saved = json.loads(metrics.read_text())
        assert saved["settings"]["order"] == order and saved["n"] == 90
        again = adapt(setup, "--quiet", "--batch-size", "10", "--order", order)
        assert again.stdout == result.stdout  # the seed decides the order


def test_orders_by_class_need_labels(setup, tmp_path):
    flat = tmp_path / "flat"
    flat.mkdir()
    for p in sorted(Path(setup["test"]).rglob("*.png"))[:20]:
        (flat / f"{p.parent.name}-{p.name}").write_bytes(p.read_bytes())
    result = invoke(*adapt_args(flat, stats=setup["artifact"], order="label-shift:1.0"))
    assert result.exit_code == 3 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"cafa: error: {flat} has no labels, and --order label-shift:1.0 orders the stream by class; give labelled data (one "
        f"folder per class, or an array with --labels), or use --order iid"
    ]


@pytest.mark.parametrize(
    "args, needle",
    [
        (
            ["--order", "sorted"],
            "--order must be iid, label-shift:S (S 0 or from 0.000001 to 1) or dirichlet:D (D from 0.000001 to 1,000,000), "
            "not 'sorted'",
        ),
        (["--order", "label-shift:2"], "--order must be iid, label-shift:S"),
        (["--order", "dirichlet:0.1", "--no-shuffle"], "--order dirichlet:0.1 shuffles in its own way"),
        (["--mix-domains", "--gradual"], "--mix-domains and --gradual are two ways"),
    ],
)
def test_stream_settings_that_cannot_be_are_usage_errors(setup, args, needle):
    result = adapt(setup, *args)
    assert result.exit_code == 2 and needle in result.stderr and len(result.stderr.strip().splitlines()) == 1, (
        result.stderr
    )


def test_mixed_domains_interleave_and_report_each_domains_error(setup, tmp_path):
    other = write_folder(tmp_path / "other", per_class=10, seed=9, shift=0.6)
    both = ["--data", str(other), "--method", "source", "--quiet"]
    apart, mixed = tmp_path / "apart.json", tmp_path / "mixed.json"
    assert adapt(setup, *both, "--metrics-json", str(apart)).exit_code == 0
    result = adapt(setup, *both, "--mix-domains", "--metrics-json", str(mixed))
    assert result.exit_code == 0, result.stderr
    first_batch = [row["path"] for row in list(csv.DictReader(io.StringIO(result.stdout)))[:30]]
    assert any(str(other) in path for path in first_batch) and any(str(setup["test"]) in path for path in first_batch)
    per_domain = [(d["data"], d["n"], d["error"]) for d in json.loads(mixed.read_text())["domains"]]
    assert per_domain == [(d["data"], d["n"], d["error"]) for d in json.loads(apart.read_text())["domains"]]
    assert [n for _, n, _ in per_domain] == [90, 30]
    assert json.loads(mixed.read_text())["settings"]["mix_domains"] is True


def test_gradual_visits_the_severities_of_each_corruption_up_and_down(setup, tmp_path):
    corruption = tmp_path / "fog"
    for severity in range(1, 6):
        write_folder(corruption / str(severity), per_class=4, seed=severity, shift=0.1 * severity)
    metrics = tmp_path / "m.json"
    result = invoke(
        *adapt_args(stats=setup["artifact"]),
        corruption / "3",
        *options(gradual=True, batch_size=6, quiet=True, metrics_json=metrics),
    )
    assert result.exit_code == 0, result.stderr
    visited = [Path(d["data"]).name for d in json.loads(metrics.read_text())["domains"]]
    assert visited == ["1", "2", "3", "4", "5", "4", "3", "2", "1"]
    assert len(result.stdout.splitlines()) == 1 + 9 * 12
    shutil.rmtree(corruption / "4")
    missing = invoke(*adapt_args(stats=setup["artifact"]), corruption, "--gradual")
    assert missing.exit_code == 3 and "--gradual visits severities 1-5 of a corruption" in missing.stderr
    assert f"{corruption / '4'} is not a folder" in missing.stderr


@pytest.mark.parametrize("spellings", [("{t}", "{t}"), ("{t}", "{t}/"), ("{t}", "./{rel}")])
def test_mixing_a_domain_with_itself_is_refused(setup, spellings, monkeypatch):
    """Interleaved with itself, every image was read and predicted twice."""
    monkeypatch.chdir(setup["test"].parent)
    given = [s.format(t=setup["test"], rel=setup["test"].name) for s in spellings]
    result = invoke(*adapt_args(stats=setup["artifact"]), *given, "--mix-domains")
    fails(result, 2, "--mix-domains: the domain", "is given twice")
