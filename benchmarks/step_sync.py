"""One adaptation step as it is now against the step as it was before it stopped waiting
for the device (issue 22), side by side in one process.

"Before" is adapter.py and distances.py of an earlier commit: --against REV takes them
from git, --before DIR from a folder holding the two files (a lent GPU machine has no git
history: extract them first, `git show REV:src/cafa_cli/method/adapter.py >
DIR/adapter.py`, likewise distances.py). Everything else (model, methods, losses) is
today's code. For TENT and CAFA with each covariance asked for: both Adapters on the
same synthetic images and statistics (perf.py's), timed in alternating rounds of
--repeats steps after two warm-up steps each; the median of the rounds, ms per step, of
wall time and of the process's CPU time (all threads: with one thread, OMP_NUM_THREADS=1,
the steadier figure on a shared machine, since it leaves out waiting for a core).
Then one more step of each, counted: the aten operators it dispatches (on a GPU, about
its kernel launches) and its reads of a device value (item, bool, nonzero: each a wait
for the GPU; tests/test_host_sync.py checks the full list), not counting torch's
unfused Adam reading its step counts, which it keeps on the host.

    python benchmarks/step_sync.py --against 7b0b7e2 --model resnet50 --classes 200 --batch 8 --covariances lowrank,tied
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))
from perf import model_arguments, sync, synthetic_gaussians  # noqa: E402

from cafa_cli.devices import pick_device  # noqa: E402
from cafa_cli.method.adapter import Adapter  # noqa: E402
from cafa_cli.method.methods import create  # noqa: E402
from cafa_cli.models import resolve  # noqa: E402

FILES = ("adapter", "distances")


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


def before_modules(against: str | None, folder: str | None) -> dict:
    """The two modules as they were, imported under other names beside today's package."""
    if folder is None:
        folder = tempfile.mkdtemp(prefix="step-before-")
        root = Path(__file__).resolve().parent.parent
        for name in FILES:
            text = subprocess.run(["git", "-C", str(root), "show", f"{against}:src/cafa_cli/method/{name}.py"],
                                  check=True, capture_output=True, text=True).stdout
            (Path(folder) / f"{name}.py").write_text(text)
    modules = {}
    for name in FILES:
        spec = importlib.util.spec_from_file_location(f"cafa_before_{name}", Path(folder) / f"{name}.py")
        modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(modules[name])
    return modules


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--against", help="the commit whose step is 'before' (needs git)")
    source.add_argument("--before", help="a folder with that commit's adapter.py and distances.py")
    model_arguments(parser)
    parser.add_argument("--covariances", default="lowrank")
    parser.add_argument("--repeats", type=int, default=3, help="steps a round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    before = before_modules(args.against, args.before)
    device = pick_device(args.device)
    torch.manual_seed(0)
    images = torch.randn(args.batch, args.channels, args.size, args.size).to(device)
    num_classes = None if args.model == "fmnist-resnet" else args.classes
    probe, _ = resolve(args.model, num_classes=num_classes)
    C, d = probe.num_classes, probe.feature_dim
    result = {"model": args.model, "C": C, "d": d, "batch": args.batch, "device": str(device), "precision": args.precision,
              "torch": torch.__version__, "threads": torch.get_num_threads(), "against": args.against or args.before,
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None, "rows": {}}

    def adapter(which: str, method: str, gaussians):
        model, _ = resolve(args.model, num_classes=num_classes)
        made = create(method, gaussians, device)
        if which == "after":
            return Adapter(model, made, device, precision=args.precision)
        if gaussians is not None:  # the distances of the same commit as the Adapter
            made.distances = before["distances"].ClassDistances(gaussians, device)
        return before["adapter"].Adapter(model, made, device, precision=args.precision)

    rows = [("tent", None)] + [(f"cafa-{c}", synthetic_gaussians(C, d, c)) for c in args.covariances.split(",")]
    for name, gaussians in rows:
        method = name.split("-")[0]
        pair = {which: adapter(which, method, gaussians) for which in ("before", "after")}
        rounds, cpu = {"before": [], "after": []}, {"before": [], "after": []}
        for r in range(args.rounds):
            for which in (("before", "after") if r % 2 == 0 else ("after", "before")):
                step = pair[which].step
                wall_ms, cpu_ms = timed(lambda: step(images), device, args.repeats, warmup=2 if r == 0 else 0)
                rounds[which].append(wall_ms)
                cpu[which].append(cpu_ms)
        row = {which: statistics.median(ms) for which, ms in rounds.items()}
        row.update({f"{which}_cpu": statistics.median(ms) for which, ms in cpu.items()})
        row["rounds"], row["cpu_rounds"] = rounds, cpu
        row["counted"] = {which: counted_step(pair[which], images) for which in pair}
        row["after_over_before"] = row["after"] / row["before"]
        result["rows"][name] = row
        ops = row["counted"]
        print(f"{name:14s} before {row['before']:9.1f} ms/step   after {row['after']:9.1f} ms/step   "
              f"after/before {row['after_over_before']:.3f}   (CPU time {row['before_cpu']:.1f} -> {row['after_cpu']:.1f} ms)   operators {ops['before']['ops']} -> {ops['after']['ops']}, "
              f"host reads {ops['before']['reads']} -> {ops['after']['reads']}", flush=True)
        del pair
    for name, row in result["rows"].items():
        if name != "tent":
            for which in ("before", "after"):
                row[f"{which}_over_tent"] = row[which] / result["rows"]["tent"][which]
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
