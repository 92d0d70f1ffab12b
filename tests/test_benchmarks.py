"""The benchmark scripts a lent GPU machine runs unattended: what they print and write
must be right the first time, since a device session rarely gets a second call."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from cafa_cli.data.fashion_mnist import DEFAULT_ROOT, FASHION_MNIST_CLASSES, load_fashion_mnist
from cafa_cli.data.fmnist_c import build_corrupted, corrupted_as_built, stratified_rows

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
from held_out_transforms import EXTREME, FILTERS, TRANSFORMS  # noqa: E402
from imagenet_c_speed import domain_copies  # noqa: E402
from lowrank_gemm import SplitKProjection  # noqa: E402


def run(script: str, *args) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), *map(str, args)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done


def test_split_k_projection_gives_the_gradient_of_z_times_basis_transposed():
    g = torch.Generator().manual_seed(0)
    basis = torch.randn(12, 5, generator=g, dtype=torch.float64)
    z = torch.randn(3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda z: SplitKProjection.apply(z, basis, 4), (z,))
    upstream = torch.randn(3, 12, generator=g, dtype=torch.float64)
    (SplitKProjection.apply(z, basis, 3) * upstream).sum().backward()
    assert torch.allclose(z.grad, upstream @ basis)


def test_lowrank_gemm_variants_agree_with_float64(tmp_path):
    out = tmp_path / "gemm.json"
    run(
        "lowrank_gemm.py",
        "--classes",
        20,
        "--rank",
        7,
        "--dim",
        64,
        "--batch",
        8,
        "--repeats",
        2,
        "--device",
        "cpu",
        "--json",
        out,
    )
    result = json.loads(out.read_text())
    assert result["splits"] == 35 and set(result["ms"]) == {"distances", "gemms", "transposed", "split-k", "tf32"}
    assert all(ms > 0 for ms in result["ms"].values())
    for kind, error in result["relative_error"].items():
        assert error["t"] < 1e-5 and error["dz"] < 1e-5, kind


def test_perf_rows_ratios_losses_and_trace_tables(tmp_path):
    out, trace = tmp_path / "perf.json", tmp_path / "trace.txt"
    printed = run(
        "perf.py",
        "--model",
        "fmnist-resnet",
        "--batch",
        4,
        "--size",
        28,
        "--channels",
        1,
        "--repeats",
        1,
        "--stats-batches",
        2,
        "--covariances",
        "diag,lowrank",
        "--cudnn-benchmark",
        "--device",
        "cpu",
        "--methods",
        "cotta,rotta,intra",
        "--rounds",
        2,
        "--trace",
        trace,
        "--json",
        out,
    ).stdout
    steps = json.loads(out.read_text())["steps"]
    assert list(steps) == [
        "source",
        "bn",
        "tent",
        "tent+cudnn-benchmark",
        "cotta",
        "rotta",
        "intra",
        "cafa-diag",
        "cafa-diag+cudnn-benchmark",
        "cafa-lowrank",
        "cafa-lowrank+cudnn-benchmark",
    ]
    for method in ("cotta", "rotta", "intra"):  # the other methods, each in rounds alternating with TENT's
        assert abs(steps[method]["ratio_to_tent"] - steps[method]["ms"] / steps[method]["tent_ms"]) < 1e-9
        assert steps[method]["rounds"] == 2 and f"{method} " in printed
    assert steps["rotta"]["repeats"] == 16  # a whole cycle of its bank's steps: 64 samples in batches of 4
    for key in ("cafa-diag", "cafa-lowrank"):
        assert abs(steps[key]["ratio_to_tent"] - steps[key]["ms"] / steps["tent"]["ms"]) < 1e-9
        variant = steps[f"{key}+cudnn-benchmark"]  # against TENT timed the same way
        assert abs(variant["ratio_to_tent"] - variant["ms"] / steps["tent+cudnn-benchmark"]["ms"]) < 1e-9
        assert steps[key]["loss_ms"] > 0 and steps[key]["artifact_bytes"] > 0
        assert f"{key} " in printed and "loss alone" in printed
    assert "loss_ms" not in steps["tent"]
    titles = [line.split(":")[0] for line in trace.read_text().splitlines() if line.startswith("== ")]
    assert titles == ["== " + key for key in steps if key not in ("source", "bn")]


def test_perf_times_rows_in_fresh_processes_or_after_a_cleaned_history(tmp_path):
    out = tmp_path / "perf.json"
    common = (
        "--model",
        "fmnist-resnet",
        "--batch",
        4,
        "--size",
        28,
        "--channels",
        1,
        "--repeats",
        1,
        "--covariances",
        "diag",
        "--methods",
        "none",
        "--device",
        "cpu",
        "--json",
        out,
    )
    printed = run("perf.py", *common, "--fresh", "--rows", "tent,cafa-diag").stdout  # each row in a process of its own
    result = json.loads(out.read_text())
    steps = result["steps"]
    assert list(steps) == ["tent", "cafa-diag"] and "stats" not in result and result["fresh"]
    assert abs(steps["cafa-diag"]["ratio_to_tent"] - steps["cafa-diag"]["ms"] / steps["tent"]["ms"]) < 1e-9
    assert "cafa-diag " in printed and "×" in printed and "loss alone" in printed
    assert all(row["state"]["live_adapters"] == 0 for row in steps.values())  # nothing before them in their processes
    run("perf.py", *common, "--tent-again", "--between-rows", "clean", "--rows", "tent,tent-again,cafa-diag")
    steps = json.loads(out.read_text())["steps"]
    assert list(steps) == ["tent", "tent-again", "cafa-diag"]
    assert abs(steps["cafa-diag"]["ratio_to_tent_again"] - steps["cafa-diag"]["ms"] / steps["tent-again"]["ms"]) < 1e-9
    assert steps["cafa-diag"]["state"]["live_adapters"] == 0  # the earlier rows' adapters were collected
    wrong = subprocess.run(
        [sys.executable, str(BENCHMARKS / "perf.py"), *map(str, common), "--rows", "tent,cafa-full"],
        capture_output=True,
        text=True,
    )
    assert wrong.returncode != 0 and "no row cafa-full" in wrong.stderr


def test_imagenet_c_speed_times_the_real_command_and_profiles_it(tmp_path):
    """Its CPU path end to end on a tiny domain: 3 classes, 2 JPEGs each, ResNet-50."""
    out = tmp_path / "speed.json"
    printed = run(
        "imagenet_c_speed.py",
        "--classes",
        3,
        "--images",
        6,
        "--workers",
        0,
        "--precisions",
        "fp32",
        "--no-decode",
        "--root",
        tmp_path / "domain",
        "--torch-profile",
        tmp_path,
        "--json",
        out,
    ).stdout
    assert "building 6 JPEGs (one class folder each of 3)" in printed and "writing a synthetic 3-class" in printed
    (row,) = json.loads(out.read_text())["adapt"]
    assert row["images"] == 6 and abs(row["outside_loop_s"] - (row["wall_s"] - row["loop_s"])) < 1e-9
    tables = (tmp_path / "adapt-fp32-torch.txt").read_text()
    assert "== by host time" in tables and "aten::convolution_backward" in tables
    # another --classes: the domain and its artifact are made again, not timed as they were
    printed = run(
        "imagenet_c_speed.py",
        "--classes",
        2,
        "--images",
        6,
        "--workers",
        0,
        "--precisions",
        "fp32",
        "--no-decode",
        "--root",
        tmp_path / "domain",
        "--json",
        out,
    ).stdout
    assert "rebuilding" in printed and "writing a synthetic 2-class" in printed
    assert json.loads(out.read_text())["adapt"][0]["images"] == 6


def test_imagenet_c_speed_copies_the_domain_as_hard_links_and_makes_stale_copies_again(tmp_path):
    domain = tmp_path / "fog" / "5"
    for c in ("n0", "n1"):
        (domain / c).mkdir(parents=True)
        (domain / c / "0.JPEG").write_bytes(c.encode())
    copies = domain_copies(domain, 2)
    assert [c.relative_to(tmp_path).as_posix() for c in copies] == ["snow/5", "frost/5"]
    assert all((c / "n1" / "0.JPEG").samefile(domain / "n1" / "0.JPEG") for c in copies)
    for c in ("n0", "n1"):  # the domain built again (another --images): its copies follow
        (domain / c / "0.JPEG").unlink()
        (domain / c / "1.JPEG").write_bytes(c.encode())
    (copy,) = domain_copies(domain, 1)
    assert sorted(p.name for p in copy.rglob("*.JPEG")) == ["1.JPEG", "1.JPEG"]
    assert (copy / "n0" / "1.JPEG").samefile(domain / "n0" / "1.JPEG")


def test_step_sync_times_the_step_before_and_after_side_by_side(tmp_path):
    """Here 'before' is a copy of today's package: only the script's mechanics are checked
    (the copy is imported as a second package, beside today's). Then today's step alone."""
    shutil.copytree(BENCHMARKS.parent / "src" / "cafa_cli", tmp_path / "before" / "cafa_cli")
    out = tmp_path / "sync.json"
    common = (
        "--model",
        "fmnist-resnet",
        "--batch",
        4,
        "--size",
        28,
        "--channels",
        1,
        "--covariances",
        "diag",
        "--repeats",
        1,
        "--rounds",
        2,
        "--device",
        "cpu",
        "--json",
        out,
    )
    printed = run("step_sync.py", "--before", tmp_path / "before", *common).stdout
    rows = json.loads(out.read_text())["rows"]
    assert list(rows) == ["tent", "cafa-diag"] and "after/before" in printed
    assert all(len(row["rounds"]["before"]) == len(row["rounds"]["after"]) == 2 for row in rows.values())
    assert all(
        row["counted"][which]["reads"] == 0 < row["counted"][which]["ops"]
        for row in rows.values()
        for which in row["counted"]
    )
    assert all(
        row["counted"]["before"] == row["counted"]["after"] for row in rows.values()
    )  # the same code, both sides
    assert abs(rows["cafa-diag"]["after_over_tent"] - rows["cafa-diag"]["after"] / rows["tent"]["after"]) < 1e-9
    run("step_sync.py", *common)  # no earlier commit: today's step, counted
    rows = json.loads(out.read_text())["rows"]
    assert set(rows["tent"]["counted"]) == {"after"} and "before" not in rows["cafa-diag"]["rounds"]
    assert abs(rows["cafa-diag"]["after_over_tent"] - rows["cafa-diag"]["after"] / rows["tent"]["after"]) < 1e-9


def test_combine_tables_puts_each_bench_condition_in_its_own_column_and_pools_seeds(tmp_path):
    def report(rows, errors, **settings):
        """A bench JSON: `errors` {(label, seed): [error % of domain a, of domain b]}."""
        runs = [
            {"method": label, "seed": seed, "data": domain, "error": e / 100}
            for (label, seed), values in errors.items()
            for domain, e in zip("ab", values)
        ]
        return {
            "settings": {"order": "iid", "reset": "domain", "batch_sizes": None, **settings},
            "rows": rows,
            "runs": runs,
        }

    def row(label, order="iid"):
        return {"label": label, "order": order, "batch_size": 200}

    orders = report(
        [row("tent, iid"), row("tent, label-shift:1.0", "label-shift:1.0"), row("lame, iid")],
        {("tent, iid", 0): [26, 28], ("tent, label-shift:1.0", 0): [70, 75], ("lame, iid", 0): [40, 42.8]},
        orders="iid,label-shift:1.0",
    )
    more_seeds = report(
        [row("tent, label-shift:1.0", "label-shift:1.0")],
        {("tent, label-shift:1.0", 1): [72, 75], ("tent, label-shift:1.0", 2): [74, 75]},
        orders="label-shift:1.0",
    )
    continual = report([row("tent")], {("tent", 0): [30, 31], ("tent", 1): [31, 32]}, reset="never")
    balanced = report([row("tent")], {("tent", 0): [25, 27]}, norm="class-balanced")
    paths = []
    for k, saved in enumerate((orders, more_seeds, continual, balanced)):
        paths.append(tmp_path / f"{k}.json")
        paths[-1].write_text(json.dumps(saved))
    assert run("combine_tables.py", *paths).stdout.splitlines() == [
        "| method | iid | label-shift:1.0 | iid, continual |",
        "|---|---:|---:|---:|",
        "| tent | 27.00 | 73.50 ± 1.00 | 31.00 ± 0.71 |",  # label shift: seeds 0, 1, 2 from two files (72.5, 73.5, 74.5)
        "| lame | 41.40 | — | — |",
        "| tent --norm class-balanced | 26.00 | — | — |",
    ]
    assert (
        run("combine_tables.py", *paths, paths[1]).stdout == run("combine_tables.py", *paths).stdout
    )  # the same runs again
    other = tmp_path / "other.json"
    other.write_text(
        json.dumps(
            report(
                [row("tent, label-shift:1.0", "label-shift:1.0")],
                {("tent, label-shift:1.0", 1): [71, 75]},
                orders="label-shift:1.0",
            )
        )
    )
    twice = subprocess.run(
        [sys.executable, str(BENCHMARKS / "combine_tables.py"), paths[1], other], capture_output=True, text=True
    )
    assert twice.returncode != 0 and "seed 1, a: given twice, with errors 72.00 and 71.00" in twice.stderr


def test_held_out_transforms_of_a_corruption_start_from_the_bytes_the_demo_writes(tmp_path):
    """`--of speckle_noise/3` transforms the very images `cafa demo --data-only` writes for
    that random corruption (its rows and its seed), not a fresh draw of it."""
    pytest.importorskip("corrupt_tta")
    if not DEFAULT_ROOT.is_dir():
        pytest.skip("Debian's dataset-fashion-mnist is not installed")
    images, labels = load_fashion_mnist(split="test")
    rows = stratified_rows(labels, 2, seed=0)
    (folder,) = build_corrupted(tmp_path, ["speckle_noise"], 3, per_class=2)
    ours = corrupted_as_built(images[rows], "speckle_noise", 3)
    written = [
        np.array(Image.open(folder / FASHION_MNIST_CLASSES[c] / f"{i:05d}.png")) for i, c in enumerate(labels[rows])
    ]
    assert np.array_equal(np.stack(written), ours)
    assert not np.array_equal(ours, corrupted_as_built(images[rows], "speckle_noise", 3, seed=1))


def test_held_out_transforms_change_an_image_the_same_way_for_the_same_seed():
    """Each of the twenty-eight transforms keeps a 28x28 uint8 image's shape and type, changes it, and
    draws its randomness (rotate, shear, cutout) from the generator alone."""
    x = torch.zeros(1, 28, 28, dtype=torch.uint8)
    x[:, 6:22, 9:19] = torch.arange(16, dtype=torch.uint8)[:, None] * 15 + 20  # a garment-like bright shape
    for name, transform in {**TRANSFORMS, **EXTREME, **FILTERS}.items():
        torch.manual_seed(0)  # torch's global generator differs between the two calls
        first = transform(x.clone(), torch.Generator().manual_seed(3))
        torch.manual_seed(1)
        again = transform(x.clone(), torch.Generator().manual_seed(3))
        assert first.shape == x.shape and first.dtype == torch.uint8, name
        assert not torch.equal(first, x) and torch.equal(first, again), name
