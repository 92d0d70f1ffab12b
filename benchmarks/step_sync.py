"""Today's adaptation step, counted and timed: TENT and CAFA (each covariance asked for),
optionally side by side with the step of an earlier commit in one process.

For each row: the median of --rounds rounds of --repeats steps (after two warm-up steps),
ms per step, of wall time and of the process's CPU time (all threads: with one thread,
OMP_NUM_THREADS=1, the steadier figure on a shared machine, since it leaves out waiting
for a core); then one more step, counted: the aten operators it dispatches (on a GPU,
about its kernel launches) and its reads of a device value (item, bool, nonzero: each a
wait for the GPU; tests/test_host_sync.py checks the full list), not counting torch's
unfused Adam reading its step counts, which it keeps on the host. Each CAFA row's
`after_over_tent` is its median over TENT's.

"Before" (optional): the whole `cafa_cli` package of an earlier commit, loaded beside
today's under the name `cafa_before` (its own imports rewritten to it), so that its
Adapter, methods, model code and distances agree with each other; only the synthetic
statistics are made by today's code and handed over field by field. --against REV takes
the package from git; --before DIR from a folder holding it as DIR/cafa_cli (a lent GPU
machine has no git history: `git archive REV src/cafa_cli | tar -x -C DIR
--strip-components=1` first). The two steps alternate in each round: before, after, then
after, before. Loading only the earlier adapter.py and distances.py on today's package
(this script's first form) broke as soon as today's modules changed an interface that
the old adapter called (issue 33: it passed `bn_prior` to today's option check).

    python benchmarks/step_sync.py --model resnet50 --classes 1000 --batch 64 --covariances lowrank
    python benchmarks/step_sync.py --against ffa188e --model resnet50 --classes 200 --batch 8 --covariances lowrank,tied
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))
from perf import model_arguments, sync, synthetic_gaussians, timing_model  # noqa: E402

from cafa_cli.api import Adapter, create, pick_device  # noqa: E402

BEFORE = "cafa_before"  # the earlier package's name in this process
# where step() finds what it needs, in the package layout of issue 61 and in the one before it
LAYOUTS = (
    {"adapter": "engine.adapter", "methods": "methods", "models": "model.loading", "gaussians": "statistics.gaussians"},
    {"adapter": "method.adapter", "methods": "method.methods", "models": "models", "gaussians": "method.gaussians"},
)


class Counted(TorchDispatchMode):
    """The aten operators dispatched, and the host's reads of a value among them."""

    READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default)

    def __init__(self, host: set[int]):
        super().__init__()
        self.host, self.ops, self.reads = host, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.reads += func in self.READS and args[0].data_ptr() not in self.host
        return func(*args, **(kwargs or {}))


def timed(step, device, repeats: int, warmup: int) -> tuple[float, float]:
    """ms per step: wall time, and the process's CPU time."""
    for _ in range(warmup):
        step()
    sync(device)
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(repeats):
        step()
    sync(device)
    return 1000 * (time.perf_counter() - wall) / repeats, 1000 * (time.process_time() - cpu) / repeats


def counted_step(adapter, images) -> dict:
    optimizer = adapter.optimizer
    host = set()
    if optimizer is not None and not optimizer.defaults.get("fused"):
        host = {s["step"].data_ptr() for s in optimizer.state.values() if "step" in s}
    with Counted(host) as counted:
        adapter.step(images)
    return {"ops": counted.ops, "reads": counted.reads}


def before_package(against: str | None, folder: str | None):
    """The earlier package, imported as `cafa_before` beside today's `cafa_cli`: the modules
    step() needs (its Adapter, methods, models, gaussians), or None when there is no before."""
    if against is None and folder is None:
        return None
    copy = Path(tempfile.mkdtemp(prefix="step-before-"))
    if folder is None:
        root = Path(__file__).resolve().parent.parent
        archive = subprocess.run(
            ["git", "-C", str(root), "archive", against, "src/cafa_cli"], check=True, capture_output=True
        ).stdout
        with tarfile.open(fileobj=BytesIO(archive)) as tar:
            tar.extractall(copy / "git", filter="data")
        source = copy / "git" / "src" / "cafa_cli"
    else:
        source = Path(folder) / "cafa_cli"
        if not any((source / layout["adapter"].replace(".", "/")).with_suffix(".py").is_file() for layout in LAYOUTS):
            raise SystemExit(
                f"--before {folder}: no cafa_cli/engine/adapter.py (or method/adapter.py) in it; it should hold the earlier commit's "
                "package as FOLDER/cafa_cli (git archive REV src/cafa_cli | tar -x -C FOLDER --strip-components=1)"
            )
    shutil.copytree(source, copy / BEFORE)
    # two versions of one package in one process need two top-level names: every mention of
    # cafa_cli in the copy (imports, importlib.resources' package names) becomes cafa_before
    for path in (copy / BEFORE).rglob("*.py"):
        path.write_text(re.sub(r"\bcafa_cli\b", BEFORE, path.read_text()))
    sys.path.insert(0, str(copy))
    names = next(n for n in LAYOUTS if (copy / BEFORE / n["adapter"].replace(".", "/")).with_suffix(".py").is_file())
    return {key: importlib.import_module(f"{BEFORE}.{name}") for key, name in names.items()}


def as_before(gaussians, before):
    """Today's synthetic statistics as the earlier package's ClassGaussians (the fields it has)."""
    cls = before["gaussians"].ClassGaussians
    return cls(**{f.name: getattr(gaussians, f.name) for f in dataclasses.fields(cls) if hasattr(gaussians, f.name)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--against", help="also time the step of this commit (needs git)")
    source.add_argument("--before", help="also time the step of the package in FOLDER/cafa_cli (an earlier commit's)")
    model_arguments(parser)
    parser.add_argument("--covariances", default="lowrank")
    parser.add_argument("--repeats", type=int, default=3, help="steps a round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    before = before_package(args.against, args.before)
    sides = ("before", "after") if before else ("after",)
    device = pick_device(args.device)
    torch.manual_seed(0)
    images = torch.randn(args.batch, args.channels, args.size, args.size).to(device)
    num_classes = None if args.model == "fmnist-resnet" else args.classes
    probe = timing_model(args.model, num_classes)
    C, d = probe.num_classes, probe.feature_dim
    result = {
        "model": args.model,
        "C": C,
        "d": d,
        "batch": args.batch,
        "device": str(device),
        "precision": args.precision,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "against": args.against or args.before,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "rows": {},
    }

    def adapter(which: str, method: str, gaussians):
        if which == "after":
            model = timing_model(args.model, num_classes)
            return Adapter(model, create(method, gaussians, device), device, precision=args.precision)
        model, _ = before["models"].resolve(args.model, num_classes=num_classes)
        made = before["methods"].create(method, None if gaussians is None else as_before(gaussians, before), device)
        return before["adapter"].Adapter(model, made, device, precision=args.precision)

    rows = [("tent", None)] + [(f"cafa-{c}", synthetic_gaussians(C, d, c)) for c in args.covariances.split(",")]
    for name, gaussians in rows:
        method = name.split("-")[0]
        pair = {which: adapter(which, method, gaussians) for which in sides}
        rounds, cpu = {which: [] for which in sides}, {which: [] for which in sides}
        for r in range(args.rounds):
            for which in sides if r % 2 == 0 else sides[::-1]:
                step = pair[which].step
                wall_ms, cpu_ms = timed(lambda: step(images), device, args.repeats, warmup=2 if r == 0 else 0)
                rounds[which].append(wall_ms)
                cpu[which].append(cpu_ms)
        row = {which: statistics.median(ms) for which, ms in rounds.items()}
        row.update({f"{which}_cpu": statistics.median(ms) for which, ms in cpu.items()})
        row["rounds"], row["cpu_rounds"] = rounds, cpu
        row["counted"] = {which: counted_step(pair[which], images) for which in pair}
        ops = row["counted"]
        if before:
            row["after_over_before"] = row["after"] / row["before"]
            print(
                f"{name:14s} before {row['before']:9.1f} ms/step   after {row['after']:9.1f} ms/step   "
                f"after/before {row['after_over_before']:.3f}   (CPU time {row['before_cpu']:.1f} -> {row['after_cpu']:.1f} ms)   "
                f"operators {ops['before']['ops']} -> {ops['after']['ops']}, host reads {ops['before']['reads']} -> {ops['after']['reads']}",
                flush=True,
            )
        else:
            print(
                f"{name:14s} {row['after']:9.1f} ms/step   (CPU time {row['after_cpu']:.1f} ms)   operators {ops['after']['ops']}, "
                f"host reads {ops['after']['reads']}",
                flush=True,
            )
        result["rows"][name] = row
        del pair
    for name, row in result["rows"].items():
        if name != "tent":
            for which in sides:
                row[f"{which}_over_tent"] = row[which] / result["rows"]["tent"][which]
            print(
                f"{name:14s} / tent: {row['after_over_tent']:.3f}"
                + (f" (before: {row['before_over_tent']:.3f})" if before else "")
            )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
