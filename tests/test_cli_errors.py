"""The CLI's error reporting end to end (docs/reference/errors.md): one `cafa: error:` or `warning:` line, the documented exit code, no traceback."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import tiny_net
import torch
from conftest import PLAIN, TINY_NET, invoke, write_folder
from helpers import _bad_image, _jpeg, adapt, factory, fails, no_traceback, rows, stats, stats_with_model
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file
from test_artifact import corrupt

from cafa_cli.core.errors import UsageError
from cafa_cli.data.folders import read_image
from cafa_cli.jobs.config import StatsConfig

# --- paths -------------------------------------------------------------------------


ROOT = os.geteuid() == 0 if hasattr(os, "geteuid") else False


def test_empty_stdin(setup):
    fails(adapt(setup, "-", input=""), 3, "--data -: stdin held no image paths")


def test_stdin_path_that_does_not_exist_is_skipped(setup, tmp_path):
    good = sorted((setup["train"] / "a").glob("*.png"))[:3]
    missing = tmp_path / "gone.png"
    result = adapt(setup, "-", "--no-shuffle", input="\n".join(map(str, [good[0], missing, *good[1:]])) + "\n")
    assert result.exit_code == 0, result.stderr
    no_traceback(result)
    assert [r["path"] for r in rows(result)] == [str(p) for p in good]
    assert f"warning: skipped unreadable image {missing}" in result.stderr


def test_a_domain_with_no_readable_image_is_an_input_error(setup, tmp_path):
    bad = tmp_path / "bad"
    (bad / "a").mkdir(parents=True)
    (bad / "a" / "empty.png").write_bytes(b"")
    (bad / "a" / "text.png").write_text("not an image")
    result = adapt(setup, bad)
    assert result.exit_code == 3 and "none of its 2 image(s) could be read" in result.stderr, result.stderr
    no_traceback(result)


@pytest.mark.skipif(ROOT, reason="root can read a chmod 000 file")
def test_unreadable_image_is_skipped(setup, tmp_path):
    data = write_folder(tmp_path / "d", per_class=2)
    locked = data / "b" / "0001.png"
    locked.chmod(0)
    try:
        result = adapt(setup, data)
    finally:
        locked.chmod(0o644)
    assert result.exit_code == 0, result.stderr
    assert f"warning: skipped unreadable image {locked}" in result.stderr and len(rows(result)) == 5


def test_warnings_print_paths_with_brackets_as_they_are(setup, tmp_path):
    data = write_folder(tmp_path / "runs [/x] [bold]", per_class=2)
    broken = data / "b" / "0001.png"
    broken.write_bytes(b"not a png")
    result = adapt(setup, data)
    assert result.exit_code == 0, result.stderr
    assert f"warning: skipped unreadable image {broken}" in result.stderr
    assert "runs [/x] [bold]" in result.stderr  # the summary table's domain cell
    data = write_folder(tmp_path / "named", per_class=3, classes=("[red]a", "[bold]b", "c"))
    artifact = tmp_path / "named.safetensors"
    assert stats(setup, data, "--out", artifact).exit_code == 0
    shown = invoke("inspect", artifact)
    assert shown.exit_code == 0 and "[red]a" in shown.stdout and "[bold]b" in shown.stdout, shown.stdout + shown.stderr


@pytest.mark.skipif(ROOT, reason="root can read a chmod 000 file")
def test_unreadable_artifact(setup, tmp_path):
    locked = tmp_path / "s.safetensors"
    shutil.copy(setup["artifact"], locked)
    locked.chmod(0)
    try:
        fails(invoke("inspect", locked), 3, str(locked), "Permission denied")
    finally:
        locked.chmod(0o644)


# --- images ------------------------------------------------------------------------


BAD_IMAGES = {
    "truncated-png": "truncated",
    "truncated-jpeg": "Truncated",
    "zero-byte": "empty file (0 bytes)",
    "not-an-image": "not an image in a format cafa reads",
    "postscript": "not an image in a format cafa reads",
}


@pytest.mark.parametrize("kind", sorted(BAD_IMAGES))
def test_bad_image_is_skipped_with_one_warning_and_counted(setup, tmp_path, kind):
    data = write_folder(tmp_path / "d", per_class=4, seed=2)
    bad = _bad_image(data, kind)
    metrics = tmp_path / "m.json"
    result = adapt(setup, data, "--batch-size", "5", "--metrics-json", metrics)  # 13 images: no lone last one
    assert result.exit_code == 0, result.stderr
    no_traceback(result)
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and str(bad) in warnings[0] and BAD_IMAGES[kind] in warnings[0], result.stderr
    assert len(rows(result)) == 12 and str(bad) not in result.stdout  # the stream went on
    report = json.loads(metrics.read_text())
    assert report["skipped_images"] == 1 and report["domains"][0]["skipped_images"] == 1 and report["n"] == 12


def test_stats_skips_bad_images_too(setup, tmp_path):
    data = write_folder(tmp_path / "d", per_class=4, seed=2)
    bad = _bad_image(data, "zero-byte")
    out = tmp_path / "s.safetensors"
    result = stats(setup, data, "--out", out)
    assert result.exit_code == 0, result.stderr
    assert f"warning: skipped unreadable image {bad}" in result.stderr and "12 images" in result.stderr


@pytest.mark.parametrize("command", ["adapt", "stats"])
def test_strict_makes_the_first_bad_image_fatal(setup, tmp_path, command):
    data = write_folder(tmp_path / "d", per_class=4, seed=2)
    bad = _bad_image(data, "truncated-png")
    out = tmp_path / "s.safetensors"
    result = adapt(setup, data, "--strict") if command == "adapt" else stats(setup, data, "--strict", "--out", out)
    fails(result, 3, str(bad), "unreadable image", "--strict")
    assert not out.exists()


def _odd_image(folder: Path, kind: str) -> Path:
    pixels = np.asarray(Image.open(folder / "a" / "0000.png"))
    path = folder / "c" / f"{kind}.png"
    if kind == "jpeg-named-png":
        path.write_bytes(_jpeg(pixels))
    elif kind == "rgb":
        Image.fromarray(np.stack([pixels] * 3, -1)).save(path)
    elif kind == "rgba":
        Image.fromarray(np.stack([pixels] * 3 + [np.full_like(pixels, 128)], -1)).save(path)
    elif kind == "palette":
        Image.fromarray(pixels).convert("P").save(path)
    elif kind == "16-bit":
        Image.fromarray(pixels.astype(np.uint16) * 257).save(path)
    return path


@pytest.mark.parametrize("kind", ["jpeg-named-png", "rgb", "rgba", "palette", "16-bit"])
def test_other_formats_and_modes_just_work(setup, tmp_path, kind):
    data = write_folder(tmp_path / "d", per_class=2, seed=2)
    odd = _odd_image(data, kind)
    result = adapt(setup, data, "--metrics-json", tmp_path / "m.json")
    assert result.exit_code == 0, result.stderr
    no_traceback(result)
    assert "warning" not in result.stderr
    assert str(odd) in [r["path"] for r in rows(result)] and len(rows(result)) == 7
    assert json.loads((tmp_path / "m.json").read_text())["skipped_images"] == 0


# --- artifacts (the rest are in test_cli_stats.py::test_inspect_bad_artifact_is_one_line_exit_3) ---


def _damaged(setup, tmp_path, damage: str) -> Path:
    source, target = setup["artifact"], tmp_path / f"{damage}.safetensors"
    if damage == "format-version":
        return corrupt(source, target, {"format_version": "7"})
    from cafa_cli.artifact.store import read_artifact

    g = read_artifact(source).gaussians
    if damage == "nan":
        means = g.means.clone()
        means[0, 0] = float("nan")
        return corrupt(source, target, means=means)
    if damage == "inf":
        return corrupt(source, target, factors=lambda f: f[1, 2].__setitem__(0, float("inf")))
    if damage == "shape":
        return corrupt(source, target, {"feature_dim": "8"})
    if damage == "upper-triangle":
        return corrupt(source, target, factors=lambda f: f[0, 0].__setitem__(5, 0.5))
    if damage == "diagonal":
        return corrupt(source, target, factors=lambda f: f[2, 3].__setitem__(3, -0.1))
    if damage == "global-negative":  # global-fa ran on these
        return corrupt(source, target, global_covariance=-g.global_covariance)
    if damage == "global-asymmetric":
        asymmetric = g.global_covariance.clone()
        asymmetric[0, 1] += 1.0
        return corrupt(source, target, global_covariance=asymmetric)
    if damage == "global-indefinite":  # symmetric, a positive diagonal, one negative eigenvalue
        values, vectors = torch.linalg.eigh(g.global_covariance.double())
        values[0] = -values[-1]
        return corrupt(source, target, global_covariance=(vectors @ torch.diag(values) @ vectors.T).float())
    raise ValueError(damage)


@pytest.mark.parametrize(
    "damage, needle",
    [
        ("format-version", "format version '7' is not supported"),
        ("nan", "'means' holds NaN or inf"),
        ("inf", "precision factors hold NaN or inf"),
        ("shape", "has shape (3, 6), metadata implies (3, 8)"),
        ("upper-triangle", "not lower-triangular"),
        ("diagonal", "non-positive diagonal"),
        ("global-negative", "'global_covariance' is not positive semi-definite"),
        ("global-asymmetric", "'global_covariance' is not symmetric"),
        ("global-indefinite", "'global_covariance' is not positive semi-definite"),
    ],
)
def test_bad_artifact(setup, tmp_path, damage, needle):
    path = _damaged(setup, tmp_path, damage)
    fails(invoke("inspect", path), 3, str(path), needle)


def test_inspect_json_is_standard_json_whatever_the_artifact_holds(setup, tmp_path):
    """Python's json writes NaN and Infinity, which jq and most parsers reject."""
    odd = corrupt(setup["artifact"], tmp_path / "nan.safetensors", {"sampling": json.dumps({"fraction": float("nan")})})
    result = invoke("inspect", odd, "--json")
    assert result.exit_code == 0, result.stderr

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    assert json.loads(result.stdout, parse_constant=refuse)["sampling"] == {"fraction": None}
    shrink = json.dumps({"method": "oas", "min": float("nan"), "mean": 0.1, "max": float("inf")})
    fails(
        invoke("inspect", corrupt(setup["artifact"], tmp_path / "s.safetensors", {"shrinkage": shrink})), 3, "in [0, 1]"
    )


def test_bad_artifact_given_to_adapt(setup, tmp_path):
    path = _damaged(setup, tmp_path, "diagonal")
    result = invoke("adapt", "--stats", path, "--model", TINY_NET, "--data", setup["train"])
    fails(result, 3, str(path), "non-positive diagonal")
    assert result.stdout == ""


# --- models ------------------------------------------------------------------------


def test_unknown_architecture(setup, tmp_path):
    fails(
        invoke("stats", "--model", "resnet5000", "--data", setup["train"], "--out", tmp_path / "s.safetensors"),
        2,
        "--model resnet5000: unknown architecture",
    )


def test_an_unknown_architecture_named_by_the_artifact_says_so(setup, tmp_path):
    recorded = corrupt(setup["artifact"], tmp_path / "s.safetensors", {"model": json.dumps({"model": "resnet5000"})})
    fails(
        invoke("adapt", "--stats", recorded, "--data", setup["train"]),
        3,
        f"the model recorded in {recorded}: --model resnet5000: unknown architecture",
    )


@pytest.mark.parametrize(
    "conversion, kind", [(".half()", "float16"), (".double()", "float64"), ('.to("meta")', "meta")]
)
def test_a_factory_model_that_is_not_float32_is_named_for_that(setup, tmp_path, conversion, kind):
    """It met float32 images and failed with advice about --channels and --resize."""
    spec = factory(tmp_path, f"def build():\n    return tiny_net.build(){conversion}")
    fails(
        stats_with_model(setup, tmp_path, spec), 3, f"the model's parameters are {kind}, not float32", "model.float()"
    )


@pytest.mark.parametrize(
    "failure",
    [
        "raise torch.cuda.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')",
        "raise MemoryError()",
        "return torch.empty(1 << 50, dtype=torch.uint8)",
    ],
)  # torch's CPU allocator: a RuntimeError
def test_out_of_memory_on_the_gpu_or_the_host_gets_the_memory_advice(setup, tmp_path, failure):
    """A GPU's OutOfMemoryError is a RuntimeError: it was reported as images the model cannot
    take; so was the CPU allocator's "[enforce fail at alloc_cpu.cpp] ... can't allocate memory"."""
    body = f"def fail(x):\n    {failure}\n\ndef build():\n    net = tiny_net.build()\n    net.forward = fail\n    return net"
    fails(stats_with_model(setup, tmp_path, factory(tmp_path, body)), 1, "out of memory; lower --batch-size")


def test_model_without_a_linear_classifier(setup, tmp_path):
    spec = factory(
        tmp_path, "def build():\n    return nn.Sequential(nn.Conv2d(1, 3, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten())"
    )
    fails(stats_with_model(setup, tmp_path, spec), 3, "no nn.Linear classifier")


def test_feature_dimension_disagrees_with_the_artifact(setup, tmp_path):
    spec = factory(tmp_path, "def build():\n    return tiny_net.TinyNet(feature_dim=5)")
    fails(
        invoke("adapt", "--stats", setup["artifact"], "--model", spec, "--data", setup["train"]),
        3,
        "features have 5 dimensions",
        "made for 6",
    )


def test_class_count_disagrees_with_the_artifact(setup, tmp_path):
    # the artifact's own weights (3 classes) are refused by a 4-class model...
    result = invoke(
        "adapt", "--stats", setup["artifact"], "--model", TINY_NET, "--num-classes", "4", "--data", setup["train"]
    )
    fails(result, 3, "shapes do not match the model", "head.3.weight (3, 6) vs (4, 6)")
    # ...and a 4-class model with its own weights is refused by the 3-class artifact
    net = tmp_path / "four.safetensors"
    save_file(tiny_net.build(num_classes=4).state_dict(), str(net))
    result = invoke(
        "adapt",
        "--stats",
        setup["artifact"],
        "--model",
        TINY_NET,
        "--num-classes",
        "4",
        "--weights",
        net,
        "--data",
        setup["train"],
    )
    fails(
        result,
        3,
        "has 3 classes but the model's classifier has 4 outputs; check --model and --num-classes, or compute statistics",
    )


# --- option values (fraction and more in test_cli_stats.py::test_bad_options_exit_2 and
# --- test_fraction_out_of_range_is_a_usage_error) ---------------------------------


@pytest.mark.parametrize("command", ["stats", "adapt"])
def test_batch_size_below_one(setup, tmp_path, command):
    if command == "stats":
        result = stats(setup, setup["train"], "--batch-size", "0", "--out", tmp_path / "s.safetensors")
    else:
        result = adapt(setup, setup["train"], "--batch-size", "0")
    fails(result, 2, "--batch-size must be a whole number, at least 1 and below 2**31, not 0")
    assert result.stdout == "", "no CSV header before the options are checked"


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--seed", "-1"], "--seed must be 0 or more and below 2**63, not -1"),
        (["--seed", str(2**64)], "--seed must be 0 or more and below 2**63"),
        (["--lr", "nan"], "--lr must be a positive number, not nan"),
        (["--lr", "inf"], "--lr must be a positive number, not inf"),
        (["--norm", "prior:nan"], "--norm must be batch, prior:N"),
        (["--momentum", "5"], "--momentum must be in [0, 1), not 5.0"),
    ],
    ids=["seed", "seed-huge", "lr-nan", "lr-inf", "norm-prior-nan", "momentum"],
)
def test_adapt_option_values_checked_before_any_output(setup, args, needle):
    result = adapt(setup, setup["train"], *args)
    fails(result, 2, needle)
    assert result.stdout == "", "no CSV header before the options are checked"


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--format", "xml"], "Invalid value for '--format': 'xml' is not one of 'csv', 'jsonl'"),
        (
            ["--optimizer", "lbfgs"],
            "Invalid value for '--optimizer': 'lbfgs' is not one of 'adam', 'sgd', 'nesterov', 'adamw'",
        ),
        (["--params", "some"], "Invalid value for '--params': 'some' is not one of 'norm', 'all'"),
        (["--precision", "fp8"], "Invalid value for '--precision': 'fp8' is not one of 'fp32', 'bf16', 'fp16'"),
        (["--steps", "0"], "--steps must be from 1 to 1000 (gradient steps on each batch), not 0"),
        (
            ["--steps", "1000000000"],
            "--steps must be from 1 to 1000 (gradient steps on each batch), not 1000000000",
        ),  # ran for ever
    ],
    ids=["format", "optimizer", "params", "precision", "steps", "steps-huge"],
)
def test_adapt_option_values_checked_before_the_model_is_loaded(setup, tmp_path, args, needle):
    missing = tmp_path / "no-such-weights.pt"  # loading the model would fail on it
    fails(invoke("adapt", "--model", TINY_NET, "--weights", missing, "--data", setup["train"], *args), 2, needle)


def test_bench_checks_adapt_options_before_computing_statistics(setup, tmp_path):
    workdir = tmp_path / "work"
    result = invoke(
        "bench",
        setup["train"],
        "--model",
        TINY_NET,
        "--weights",
        setup["weights"],
        "--train",
        setup["train"],
        *PLAIN,
        "--methods",
        "source,cafa",
        "--optimizer",
        "lbfgs",
        "--workdir",
        workdir,
    )
    fails(result, 2, "Invalid value for '--optimizer'", "'lbfgs' is not one of 'adam', 'sgd', 'nesterov', 'adamw'")
    assert not list(workdir.glob("*.safetensors"))


def test_stats_negative_seed(setup, tmp_path):
    fails(
        stats(setup, setup["train"], "--seed", "-1", "--out", tmp_path / "s.safetensors"),
        2,
        "--seed must be 0 or more and below 2**63, not -1",
    )


def test_unknown_method(setup):
    # a plug-in (module:factory) is a method too, so the settings check the name, not click's choices
    fails(
        adapt(setup, setup["train"], "--method", "magic"),
        2,
        "--method must be one of source, bn,",
        "plug-in",
        "not magic",
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_without_cuda(setup, device):
    fails(
        adapt(setup, setup["train"], "--device", device), 2, f"--device {device}: CUDA is not available", "--device cpu"
    )


def test_unknown_format(setup):
    fails(
        adapt(setup, setup["train"], "--format", "xml"),
        2,
        "Invalid value for '--format'",
        "'xml' is not one of 'csv', 'jsonl'",
    )


def test_unknown_reset_policy(setup):
    result = adapt(setup, setup["train"], "--reset", "sometimes")
    fails(result, 2, "--reset must be domain, episodic, never or every:N", "not 'sometimes'")
    assert result.stdout == ""


def test_missing_required_option(setup, tmp_path):
    fails(
        invoke("stats", "--model", TINY_NET, "--out", tmp_path / "s.safetensors"),
        2,
        "--data is missing: give the training images (or --from-text for a CLIP model)",
    )
    fails(
        invoke("adapt", "--stats", setup["artifact"]),
        2,
        "give the test domains: cafa adapt DOMAIN... (or --data DOMAIN, repeated)",
    )


def test_a_method_without_statistics_and_no_artifact_asks_for_the_model(setup, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no cafa-stats.safetensors here
    fails(
        invoke("adapt", setup["train"], "--method", "tent"),
        2,
        "give the model with --model (and --weights): --method tent needs no statistics, and there is no cafa-stats.safetensors",
    )
    fails(invoke("adapt", setup["train"]), 3, "cafa-stats.safetensors: no such artifact; create one with cafa stats")


def test_adapt_takes_domains_as_arguments_as_well_as_with_data(setup):
    as_options = adapt(setup, setup["train"], "--quiet", "--no-shuffle", "--data", setup["train"])
    as_arguments = invoke(
        "adapt",
        "--stats",
        setup["artifact"],
        "--model",
        TINY_NET,
        "--batch-size",
        "4",
        "--quiet",
        "--no-shuffle",
        setup["train"],
        setup["train"],
    )
    assert as_options.exit_code == 0, as_options.stderr
    assert as_arguments.stdout == as_options.stdout and as_options.stdout.count("\n") > 2


def test_option_value_of_the_wrong_type(setup):
    fails(adapt(setup, setup["train"], "--lr", "fast"), 2, "Invalid value for '--lr'")


def test_unknown_option_suggests_the_right_one(setup):
    fails(invoke("stats", "--data", setup["train"], "--fractoin", "1"), 2, "No such option: --fractoin", "--fraction")


def test_debug_shows_the_tools_own_error_not_a_crash_of_the_error_handler(setup):
    from cafa_cli.core.errors import UsageError

    result = invoke("--debug", "stats", "--data", setup["train"], "--fraction", "2", "--model", TINY_NET)
    assert isinstance(result.exception, UsageError) and "`fraction`" in str(result.exception)  # the library's words
    fails(invoke("--debug", "stats", "--data", setup["train"], "--fractoin", "1"), 2, "No such option: --fractoin")


# --- security: --data - only reads, and writes go only where the options point -------


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}  # fmt: skip


def test_stdin_paths_are_only_read_and_outputs_go_where_asked(setup, tmp_path, monkeypatch):
    inputs = write_folder(tmp_path / "inputs", per_class=3, seed=5)
    before = _snapshot(inputs)
    cwd, out = tmp_path / "cwd", tmp_path / "out"
    cwd.mkdir()
    out.mkdir()
    monkeypatch.chdir(cwd)
    paths = "\n".join(str(p) for p in sorted(inputs.rglob("*.png"))) + "\n"
    result = adapt(setup, "-", "--predictions", out / "p.csv", "--metrics-json", out / "m.json", input=paths)
    assert result.exit_code == 0, result.stderr
    assert _snapshot(inputs) == before, "an input file changed"
    assert sorted(os.listdir(cwd)) == [], "a file appeared in the working folder"
    assert sorted(os.listdir(out)) == ["m.json", "p.csv"]
    assert len((out / "p.csv").read_text().splitlines()) == 10


# --- the rest ----------------------------------------------------------------------


def test_a_reader_that_goes_away_ends_the_run_quietly(setup, tmp_path):
    """`cafa adapt ... | head -1`: no traceback, no error line, exit 141 like SIGPIPE."""
    import subprocess
    import sys

    data = write_folder(tmp_path / "many", per_class=300)
    command = [
        sys.executable,
        "-m",
        "cafa_cli",
        "adapt",
        "--stats",
        str(setup["artifact"]),
        "--model",
        TINY_NET,
        "--data",
        str(data),
        "--batch-size",
        "2",
        "--method",
        "source",
        "--quiet",
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout.readline().startswith(b"path,")
    process.stdout.close()
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 141, stderr
    assert stderr == b""


def test_stats_counts_skipped_images_in_the_artifact(setup, tmp_path):
    data = write_folder(tmp_path / "train", per_class=6)
    (data / "a" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    out = tmp_path / "s.safetensors"
    result = stats(setup, data, "--out", out)
    assert result.exit_code == 0, result.stderr
    assert "broken.png" in result.stderr and "1 unreadable image skipped" in result.stderr
    from cafa_cli.artifact.store import read_artifact

    assert read_artifact(out, load_tensors=False).sampling["skipped_images"] == 1


@pytest.mark.parametrize("command", ["adapt", "stats"])
def test_images_the_model_cannot_take(setup, tmp_path, command):
    """Three channels into a one-channel network: named, not a torch traceback."""
    if command == "adapt":
        result = adapt(setup, setup["train"], "--channels", "3", "--mean", "0", "--std", "1")
    else:
        result = stats(
            setup, setup["train"], "--channels", "3", "--mean", "0", "--std", "1", "--out", tmp_path / "s.safetensors"
        )
    fails(
        result,
        3,
        "the model cannot take these images (a batch of shape [",
        ", 3, 16, 16])",
        "check --channels, --resize and --crop",
    )
    assert not (tmp_path / "s.safetensors").exists()
    assert result.stdout == "", "not even a CSV header before the first prediction"


def test_a_model_that_asserts_its_image_size_gets_the_same_message(setup, tmp_path):
    """torchvision's ViT checks its input size with an assertion, not a RuntimeError."""
    body = (
        "class Sized(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.net = tiny_net.build()\n"
        "    def forward(self, x):\n        torch._assert(x.shape[-1] == 224, 'Wrong image width! Expected 224')\n"
        "        return self.net(x)\n\ndef build():\n    return Sized()"
    )
    result = invoke(
        "stats",
        "--model",
        factory(tmp_path, body),
        "--data",
        setup["train"],
        *PLAIN,
        "--fraction",
        "1",
        "--out",
        tmp_path / "s.safetensors",
    )
    fails(
        result,
        3,
        "the model cannot take these images",
        "Wrong image width! Expected 224",
        "check --channels, --resize and --crop",
    )


def test_a_run_that_fails_before_its_first_prediction_keeps_the_old_predictions_file(setup, tmp_path):
    previous = tmp_path / "p.csv"
    previous.write_text("path,prediction,label,confidence\nold,a,a,1.0\n")
    fails(
        adapt(setup, setup["train"], "--channels", "3", "--predictions", previous),
        3,
        "the model cannot take these images",
    )
    assert previous.read_text() == "path,prediction,label,confidence\nold,a,a,1.0\n"
    unreadable = tmp_path / "unreadable"
    unreadable.mkdir()
    for name in ("a.png", "b.png"):
        (unreadable / name).write_text("not an image")
    fails(adapt(setup, unreadable, "--predictions", previous), 3, "none of its 2 image(s) could be read")
    assert previous.read_text() == "path,prediction,label,confidence\nold,a,a,1.0\n"
    assert adapt(setup, unreadable).stdout == ""  # nor a header on stdout
    assert adapt(setup, setup["train"], "--predictions", previous, "--quiet").exit_code == 0
    assert (
        previous.read_text().startswith("path,prediction,label,confidence\n") and previous.read_text().count("\n") == 19
    )


def test_features_or_outputs_out_of_float32s_range_are_refused_and_the_old_artifact_kept(setup, tmp_path):
    """A --std of 1e-30 makes the features huge (their covariance overflows float32), 1e-46
    is 0 in float32 (inf, then NaN); both once reached the artifact or the predictions."""
    kept = tmp_path / "kept.safetensors"
    shutil.copy(setup["artifact"], kept)
    before = kept.read_bytes()
    for std in ("1e-30", "1e-46"):
        fails(
            stats(setup, setup["train"], "--std", std, "--out", kept),
            3,
            "features hold NaN, infinite or huge values",
            "--std",
        )
        assert kept.read_bytes() == before
    fails(
        adapt(setup, setup["train"], "--std", "1e-46", "--method", "source"),
        3,
        "the model's outputs are NaN or infinite",
    )


def test_a_masked_class_with_minus_infinite_logits_is_not_refused(setup, tmp_path):
    """-inf is how a model leaves a class out (evaluation on a subset); only NaN, +inf or a
    row without any finite logit mean broken outputs."""
    body = (
        "class Masked(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.net = tiny_net.build()\n\n"
        "    def forward(self, x):\n        logits = self.net(x).clone()\n        logits[:, 2] = float('-inf')\n        return logits\n\n"
        "def build():\n    return Masked()"
    )
    spec = factory(tmp_path, body)
    weights = tmp_path / "masked.pt"
    torch.save({f"net.{k}": v for k, v in torch.load(setup["weights"]).items()}, weights)
    result = invoke(
        "adapt",
        "--model",
        spec,
        "--weights",
        weights,
        "--data",
        setup["train"],
        *PLAIN,
        "--method",
        "bn",
        "--classes",
        _class_list(tmp_path),
    )
    assert result.exit_code == 0, result.stderr
    assert {row["prediction"] for row in rows(result)} <= {"a", "b"}


def _class_list(tmp_path: Path) -> Path:
    path = tmp_path / "classes.txt"
    path.write_text("a\nb\nc\n")
    return path


def test_a_class_name_that_would_break_the_records_is_refused_before_the_feature_pass(setup, tmp_path):
    data = write_folder(tmp_path / "d", per_class=2, classes=("a", " ", "c"))
    fails(
        stats(setup, data, "--out", tmp_path / "s.safetensors"), 3, "class name(s) ' ' cannot go into the predictions"
    )


def test_per_class_above_what_a_class_has_is_a_warning(setup, tmp_path):
    args = [
        "stats",
        "--model",
        TINY_NET,
        "--weights",
        setup["weights"],
        "--data",
        setup["train"],
        *PLAIN,
        "--out",
        tmp_path / "s.safetensors",
    ]
    result = invoke(*args, "--per-class", "10")
    assert result.exit_code == 0, result.stderr
    assert "warning: --per-class 10: fewer images in a (6), b (6), c (6); all of theirs are used" in result.stderr
    # both would choose the images: neither silently wins
    fails(
        invoke(*args, "--per-class", "10", "--fraction", "0.5"),
        2,
        "--fraction and --per-class both say how many training images to use",
    )
    fails(
        invoke("bench", setup["train"], "--per-class", "10", "--fraction", "0.5"), 2, "--fraction and --per-class both"
    )
    with pytest.raises(UsageError, match="give one of them"):  # the Python API too: it dropped the fraction
        StatsConfig(data=str(setup["train"]), out=str(tmp_path / "api.safetensors"), fraction=0.5, per_class=10)


@pytest.mark.parametrize("command", ["stats", "adapt"])
def test_a_torchvision_architecture_without_weights_is_refused(setup, tmp_path, command):
    extra = ["--out", tmp_path / "s.safetensors"] if command == "stats" else ["--method", "bn"]
    result = invoke(command, "--model", "resnet18", "--num-classes", "3", "--data", setup["train"], *extra)
    fails(
        result,
        2,
        "--model resnet18 without --weights is an untrained network with random weights",
        "give --weights FILE",
    )


def test_weights_and_artifact_swapped_are_named_for_what_they_are(setup, tmp_path):
    fails(
        invoke("adapt", "--stats", setup["weights"], "--model", TINY_NET, "--data", setup["train"]),
        3,
        "this is a torch checkpoint, not a cafa artifact: give it as --weights",
    )
    legacy = tmp_path / "legacy.pth"
    torch.save(torch.load(setup["weights"]), legacy, _use_new_zipfile_serialization=False)
    fails(invoke("inspect", legacy), 3, "this is a torch checkpoint")
    fails(
        invoke(
            "adapt",
            "--stats",
            setup["artifact"],
            "--model",
            TINY_NET,
            "--weights",
            setup["artifact"],
            "--data",
            setup["train"],
        ),
        3,
        "this is a cafa statistics artifact, not model weights (cafa adapt takes it as --stats)",
    )


def test_an_option_at_odds_with_the_artifacts_preprocessing_says_where_the_rest_came_from(setup):
    fails(
        adapt(setup, setup["train"], "--channels", "3", "--mean", "0.1,0.2"),
        2,
        "--mean needs 1 or 3 values for 3 channels, got 2",
    )
    fails(
        adapt(setup, setup["train"], "--channels", "3", "--std", "0.1,0.2,0.3,0.4"),
        2,
        f"(the options not given come from {setup['artifact']}: give them too)",
    )
    # a value wrong by itself is just that: the other options have nothing to do with it
    assert fails(adapt(setup, setup["train"], "--std", "0"), 2) == "cafa: error: --std values must be positive"


def test_updates_skipped_for_a_non_finite_loss_are_a_warning(setup, tmp_path):
    """Finite but huge source statistics make Global FA's loss inf: every update is skipped,
    and the run is bn's under another name unless someone says so."""
    with safe_open(str(setup["artifact"]), "pt") as f:
        d = f.get_tensor("global_covariance").shape[0]
    huge = corrupt(setup["artifact"], tmp_path / "huge.safetensors", global_covariance=torch.full((d, d), 3e38))
    result = invoke(
        "adapt",
        "--stats",
        huge,
        "--model",
        TINY_NET,
        "--data",
        setup["train"],
        "--batch-size",
        "4",
        "--method",
        "global-fa",
    )
    assert result.exit_code == 0, result.stderr
    assert (
        "update(s) skipped because the loss or its gradients were not finite; check the statistics (cafa inspect)"
        in result.stderr
    )
    assert "skipped because" not in adapt(setup, setup["train"], "--method", "global-fa").stderr


def test_bn_on_a_model_without_batch_norm_is_a_warning(setup, tmp_path):
    mlp = factory(
        tmp_path, "def build():\n    return nn.Sequential(nn.Flatten(), nn.Linear(256, 8), nn.ReLU(), nn.Linear(8, 3))"
    )
    result = invoke("adapt", "--model", mlp, "--data", setup["train"], *PLAIN, "--method", "bn")
    assert result.exit_code == 0, result.stderr
    assert (
        "warning: the model has no BatchNorm layers, so --method bn gives the same predictions as source"
        in result.stderr
    )


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_help_into_a_full_disk_is_one_line_not_a_traceback():
    import subprocess
    import sys

    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-m", "cafa_cli", "--help"], stdout=full, stderr=subprocess.PIPE, text=True, timeout=120
        )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip() == "cafa: error: cannot write the output: No space left on device"


def test_index_labels_take_the_class_count_from_the_model(setup, tmp_path):
    """An array's labels are output indices: a test set without the last class is still 3 classes."""
    images = np.stack([np.asarray(read_image(p).convert("L")) for p in sorted(Path(setup["train"]).glob("[ab]/*.png"))])
    np.save(tmp_path / "x.npy", images)
    np.save(tmp_path / "y.npy", np.repeat([0, 1], len(images) // 2))
    args = [
        "--model",
        TINY_NET,
        "--weights",
        setup["weights"],
        *PLAIN,
        "--data",
        tmp_path / "x.npy",
        "--labels",
        tmp_path / "y.npy",
    ]
    result = invoke("adapt", *args, "--method", "bn", "--quiet", "--metrics-json", tmp_path / "m.json")
    assert result.exit_code == 0, result.stderr
    assert json.loads((tmp_path / "m.json").read_text())["labelled"] == len(images)
    fails(invoke("stats", *args, "--fraction", "1", "--out", tmp_path / "s.safetensors"), 3, "no images of class 2")
    np.save(tmp_path / "y.npy", np.repeat([0, 3], len(images) // 2))
    fails(invoke("adapt", *args, "--method", "bn"), 3, "label 3 is out of range for 3 classes")


def test_control_characters_never_reach_the_terminal(setup, tmp_path):
    """An artifact's metadata and file names are shown escaped: no cursor moves, colours or clearing."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(setup["artifact"]), "pt") as f:
        metadata, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    metadata["created"] = "\x1b]0;pwned\x07\x1b[2J\x1b[31mRED"
    metadata["class_names"] = json.dumps(["a", "b\x1b[2J", "c"])
    hostile = tmp_path / "hostile.safetensors"
    save_file(tensors, str(hostile), metadata=metadata)
    shown = invoke("inspect", hostile)
    assert shown.exit_code == 0 and "\x1b" not in shown.stdout
    assert "\\x1b[2J\\x1b[31mRED" in shown.stdout and "b\\x1b[2J" in shown.stdout
    odd = tmp_path / "a\x1b[31m\nb"
    fails(
        invoke("adapt", "--stats", setup["artifact"], "--model", TINY_NET, "--data", odd),
        3,
        "a\\x1b[31m\\nb: no such file",
    )


def test_a_file_name_that_is_not_utf8_is_written_as_its_own_bytes(setup, tmp_path):
    flat = tmp_path / "flat"
    flat.mkdir()
    image = next((Path(setup["train"]) / "a").glob("*.png"))
    name = flat / os.fsdecode(b"caf\xe9.png")
    name.write_bytes(image.read_bytes())
    out = tmp_path / "p.csv"
    result = adapt(setup, flat, "--quiet", "--norm", "prior:16", "--predictions", out)
    assert result.exit_code == 0, result.stderr
    assert os.fsencode(name) in out.read_bytes()
    result = adapt(setup, flat, "--quiet", "--norm", "prior:16")  # stdout is strict UTF-8 here, as in a UTF-8 locale
    assert result.exit_code == 0, result.stderr
    assert os.fsencode(name) in result.stdout_bytes
    # JSON has no way to hold bytes that are not UTF-8: JSONL and the metrics JSON write them as the text \xNN
    metrics = tmp_path / "m.json"
    result = adapt(setup, flat, "--quiet", "--norm", "prior:16", "--format", "jsonl", "--metrics-json", metrics)
    assert result.exit_code == 0, result.stderr
    record = json.loads(result.stdout_bytes.decode("utf-8"))  # strict UTF-8: a lone surrogate would not decode
    assert record["path"] == str(flat / "caf\\xe9.png")
    assert str(flat).encode() in metrics.read_bytes() and "\\ud" not in metrics.read_text(encoding="utf-8")
    metrics.read_bytes().decode("utf-8")


def test_a_class_list_of_the_wrong_length_is_named_as_the_culprit(setup, tmp_path):
    two = tmp_path / "two.txt"
    two.write_text("a\nb\n")
    ab = write_folder(tmp_path / "ab", per_class=2, classes=("a", "b"))
    result = invoke(
        "adapt",
        "--model",
        TINY_NET,
        "--weights",
        setup["weights"],
        *PLAIN,
        "--classes",
        two,
        "--data",
        ab,
        "--method",
        "bn",
    )
    fails(result, 3, f"the class list {two} has 2 classes but the model's classifier has 3 outputs")
    # cafa stats too, before its folders are named against the list (all three classes' folders: not the folders' fault)
    abc = write_folder(tmp_path / "abc", per_class=2)
    result = invoke(
        "stats", "--model", TINY_NET, "--weights", setup["weights"], *PLAIN, "--classes", two, "--data", abc
    )
    assert "--data" not in fails(result, 3, f"the class list {two} has 2 classes", "a name a line for every output")


def test_weights_holding_nan_are_refused_before_any_prediction(setup, tmp_path):
    """Every prediction would be NaN, and the run would exit 0."""
    state = torch.load(setup["weights"])
    name = next(k for k, v in state.items() if v.is_floating_point())
    state[name].view(-1)[0] = float("nan")
    broken = tmp_path / "nan.pt"
    torch.save(state, broken)
    for command in ("stats", "adapt"):
        extra = ["--out", tmp_path / "s.safetensors", "--fraction", "1"] if command == "stats" else ["--method", "bn"]
        result = invoke(command, "--model", TINY_NET, "--weights", broken, "--data", setup["train"], *PLAIN, *extra)
        fails(result, 3, f"the model's weights hold NaN or infinite values in {name}")
        assert result.stdout == ""


def test_a_negative_batchnorm_running_variance_is_named_not_blamed_on_mean_and_std(setup, tmp_path):
    state = torch.load(setup["weights"])
    name = next(k for k in state if k.endswith("running_var"))
    state[name].view(-1)[0] = -1.0
    broken = tmp_path / "negvar.pt"
    torch.save(state, broken)
    for method in ("source", "lame"):  # methods that normalise with the source statistics
        result = invoke(
            "adapt", "--model", TINY_NET, "--weights", broken, "--data", setup["train"], *PLAIN, "--method", method
        )
        fails(result, 3, f"BatchNorm running variances are negative in {name.removesuffix('.running_var')}")
        assert "--mean" not in result.stderr and result.stdout == ""


def _entry_point(*args, shell_redirect: str = "", env: dict | None = None):
    """The real `python -m cafa_cli`, with a shell redirection such as `>&-`."""
    import subprocess
    import sys

    command = " ".join(["exec", '"$0"', "-m", "cafa_cli", *(f'"${i + 1}"' for i in range(len(args))), shell_redirect])
    return subprocess.run(
        ["sh", "-c", command, sys.executable, *map(str, args)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


@pytest.mark.parametrize(
    "args", [("adapt", "--bogus"), ("inspect", "/nonexistent.safetensors"), ("bench",), ("methods", "nope")]
)
def test_python_m_and_the_cafa_script_behave_alike(args):
    """Same exit code, stdout and stderr; the only difference is the program the usage
    and the help hint name, the one the user typed."""
    import subprocess
    import sys

    script = Path(sys.executable).parent / "cafa"
    if not script.exists():
        pytest.skip("the cafa script is not installed beside this Python")
    by_module = _entry_point(*args)
    by_script = subprocess.run([str(script), *args], capture_output=True, text=True, timeout=300)
    assert by_module.returncode == by_script.returncode != 0
    assert by_module.stdout == by_script.stdout
    assert by_module.stderr.replace("python -m cafa_cli", "cafa") == by_script.stderr
    assert by_script.stderr.startswith("cafa: error:") or by_script.stderr.startswith("Usage: cafa"), by_script.stderr


def test_debug_through_the_entry_point_shows_the_traceback_of_a_cafa_error(tmp_path):
    """The real entry point, not only the command: main() must not turn the error that
    --debug re-raises back into one line."""
    missing = tmp_path / "nonexistent"
    plain = _entry_point("adapt", missing, "--method", "source", "--model", "fmnist-resnet")
    assert plain.returncode == 3 and "Traceback" not in plain.stderr
    shown = _entry_point("--debug", "adapt", missing, "--method", "source", "--model", "fmnist-resnet")
    assert shown.returncode == 1 and "Traceback (most recent call last)" in shown.stderr
    assert shown.stderr.splitlines()[-1].startswith("cafa_cli.core.errors.InputError: ")
    assert f"{missing}: no such file or folder" in shown.stderr.splitlines()[-1]


def test_a_closed_stdout_is_an_error_for_commands_that_write_there(setup):
    """Python sets sys.stdout to None under `>&-` and print() then drops everything. bench
    prints its table at the end: it must fail before the work (its domain is not even read)."""
    for args in (
        ("inspect", setup["artifact"]),
        ("--help",),
        ("bench", "/nonexistent-domain"),
        ("adapt", "/nonexistent-domain"),
    ):
        done = _entry_point(*args, shell_redirect=">&-")
        assert done.returncode == 2, done.stderr
        assert (
            done.stderr.strip()
            == "cafa: error: standard output is closed (>&-); redirect it to a file, or to /dev/null to discard it"
        )


def test_an_output_encoding_without_the_characters_gets_escapes_not_a_crash(setup, tmp_path):
    folder = write_folder(tmp_path / "d", per_class=2, classes=("café", "naïve", "λ"))
    artifact = tmp_path / "s.safetensors"
    assert stats(setup, folder, "--out", artifact, "--quiet").exit_code == 0
    ascii_only = {"PYTHONIOENCODING": "ascii"}
    done = _entry_point("adapt", "--stats", artifact, "--model", TINY_NET, folder, "--quiet", env=ascii_only)
    assert done.returncode == 0, done.stderr
    escaped = {"caf\\xe9", "na\\xefve", "\\u03bb"}  # each name as Python's backslashreplace writes it
    assert done.stdout.isascii() and {row["label"] for row in rows(done)} == escaped
    shown = _entry_point("inspect", artifact, env=ascii_only)
    assert shown.returncode == 0, shown.stderr
    assert (
        shown.stdout.isascii() and {line.split()[0] for line in shown.stdout.splitlines()[-3:]} == escaped
    )  # the per-class table


def test_a_bundled_model_s_class_names_in_another_order_are_refused(setup, tmp_path):
    """Every output would be labelled as another class, silently."""
    from cafa_cli.model.zoo import BUNDLED

    names = list(BUNDLED["fmnist-resnet"].class_names)
    reversed_list = tmp_path / "reversed.txt"
    reversed_list.write_text("\n".join(reversed(names)) + "\n")
    result = invoke(
        "stats",
        "--model",
        "fmnist-resnet",
        "--classes",
        reversed_list,
        "--data",
        setup["train"],
        "--out",
        tmp_path / "s.st",
    )
    fails(
        result,
        3,
        f"the class list {reversed_list} holds fmnist-resnet's class names in another order",
        "leave out --classes",
    )
    renamed = tmp_path / "renamed.txt"  # other names are the user's own labelling: allowed
    renamed.write_text("\n".join(f"c{i}" for i in range(len(names))) + "\n")
    result = invoke(
        "stats", "--model", "fmnist-resnet", "--classes", renamed, "--data", setup["train"], "--out", tmp_path / "s.st"
    )
    assert "another order" not in result.stderr


@pytest.mark.parametrize(
    "depth", ["16-bit png", "32-bit tiff of 0..255", "32-bit tiff of 0..65535", "32-bit tiff, full range"]
)
def test_an_integer_image_predicts_as_the_8_bit_picture_it_holds(setup, tmp_path, depth):
    """Every integer image was divided by 256: a 32-bit TIFF holding 0..255 turned black."""
    eight = write_folder(tmp_path / "eight", per_class=2, seed=2)
    wide = tmp_path / "wide"
    shutil.copytree(eight, wide)
    for path in sorted(wide.rglob("*.png")):
        pixels = np.asarray(Image.open(path).convert("L")).astype(np.int64)
        scale = {
            "16-bit png": 257,
            "32-bit tiff of 0..255": 1,
            "32-bit tiff of 0..65535": 257,
            "32-bit tiff, full range": 8421504,
        }[depth]
        if depth == "16-bit png":
            Image.fromarray((pixels * scale).astype(np.uint16)).save(path)
        else:
            path.unlink()
            Image.fromarray((pixels * scale).astype(np.int32)).save(path.with_suffix(".tif"))
    eight_rows, wide_rows = (
        rows(adapt(setup, eight, "--method", "source")),
        rows(adapt(setup, wide, "--method", "source")),
    )
    assert len(eight_rows) == len(wide_rows) == 6
    assert [(r["prediction"], r["confidence"]) for r in eight_rows] == [
        (r["prediction"], r["confidence"]) for r in wide_rows
    ]


def test_a_domain_whose_only_image_is_unreadable_gets_its_error_without_batch_warnings(setup, tmp_path):
    """The batch-size cautions (a last batch of one image, one batch) are said at the first batch read: none here."""
    data = tmp_path / "d" / "a"
    data.mkdir(parents=True)
    (data / "x.png").write_text("not an image")
    result = adapt(setup, data.parent, "--method", "tent", "--batch-size", "200")
    fails(result, 3, "none of its 1 image(s) could be read")
    assert "holds 1 image" not in result.stderr and "fits in one batch" not in result.stderr
