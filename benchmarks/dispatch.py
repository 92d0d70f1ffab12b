"""Aten operators dispatched per steady-state adaptation step, for every method and
`--norm` setting: on a GPU each is about one kernel launch, and when the host needs
longer to launch a step's kernels than the device needs to run them (issue 33: TENT's
step on an H200, ~25 ms of host against ~18 ms of device time), the count, not the
arithmetic, sets the pace. Counting is deterministic, so unlike a timing it can be
measured on a busy CPU and compared across commits.

Each row: an Adapter on synthetic images (and synthetic class statistics where the
method or norm needs them, perf.py's), warmed up, then the operators of --steps steps
counted and divided by --steps (RoTTA, cafa-robust: whole cycles of its bank's schedule, so that its
training steps are in the count), with the ratio to TENT's count under `--norm batch`.
Two columns: the step as it runs on the CPU, and as it runs on CUDA, where the optimiser
is torch's fused one (one operator for all the parameters, and a skipped update left out
by its found-inf flag instead of undone tensor by tensor): the CPU's per-parameter
optimiser, ~1,700 of TENT's ResNet-50 count, would hide what the rest of a step costs.
--top N also lists the N most dispatched operators of each row (CPU column).

    python benchmarks/dispatch.py --model resnet50 --classes 1000 --batch 64 --size 64 --json dispatch.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))
from perf import synthetic_gaussians, synthetic_norm_moments, timing_model, whole_cycles  # noqa: E402

from cafa_cli.api import REGISTRY, Adapter, create, method_class  # noqa: E402

NORMS = ("batch", "prior:4", "source", "ema:0.05", "class-balanced")
NORM_ROWS = ("tent", "cafa")  # the methods timed under every norm; the others under their own


class Dispatched(TorchDispatchMode):
    """Counts the aten operators dispatched while it is active, by name."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def count_steps(adapter: Adapter, images: torch.Tensor, steps: int, warmup: int = 3) -> Counter:
    for _ in range(warmup):
        adapter.step(images)
    with Dispatched() as counted:
        for _ in range(steps):
            adapter.step(images)
    return counted.ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--classes", type=int, default=1000, help="C (the model's outputs)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--size", type=int, default=64, help="input height = width (the count does not depend on it)")
    parser.add_argument("--channels", type=int, default=3)
    parser.add_argument("--methods", default="all", help="comma-separated, or all")
    parser.add_argument(
        "--norms", default=",".join(NORMS), help=f"the norms tent and cafa are counted under ({', '.join(NORM_ROWS)})"
    )
    parser.add_argument("--steps", type=int, default=4, help="steps counted per row (after 3 warm-up steps)")
    parser.add_argument("--top", type=int, default=0, help="also list each row's N most dispatched operators")
    parser.add_argument("--json", help="also write the counts here")
    args = parser.parse_args()

    torch.manual_seed(0)
    images = torch.randn(args.batch, args.channels, args.size, args.size)
    num_classes = None if args.model == "fmnist-resnet" else args.classes
    probe = timing_model(args.model, num_classes)
    C, d = probe.num_classes, probe.feature_dim
    methods = list(REGISTRY) if args.methods == "all" else args.methods.split(",")
    # TENT under `--norm batch` is counted whatever is asked: it is the ratios' denominator
    rows = [("tent", "batch")] + [(method, "batch") for method in methods if method != "tent"]
    rows += [
        (method, norm)
        for norm in args.norms.split(",")
        if norm and norm != "batch"
        for method in NORM_ROWS
        if method in methods
    ]
    result = {"model": args.model, "C": C, "d": d, "batch": args.batch, "torch": torch.__version__, "rows": {}}
    tent_ops = None
    for method, norm in rows:
        model = timing_model(args.model, num_classes)
        gaussians = synthetic_gaussians(C, d, "lowrank") if method_class(method).needs_statistics else None
        moments = synthetic_norm_moments(model.model, C) if norm == "class-balanced" else None
        counts = {}
        for optimiser in ("cpu", "fused"):
            adapter = Adapter(copy.deepcopy(model), create(method, gaussians), "cpu", norm=norm, class_moments=moments)
            if optimiser == "fused" and adapter.optimizer is not None:
                adapter._fused = True  # as on CUDA (Adapter.__init__)
                adapter.optimizer = adapter._new_optimizer()
            steps = whole_cycles(adapter, args.steps, args.batch)
            counts[optimiser] = count_steps(adapter, images, steps)
        per_step = {optimiser: sum(ops.values()) / steps for optimiser, ops in counts.items()}
        tent_ops = tent_ops or per_step
        name = method if norm == "batch" else f"{method} --norm {norm}"
        row = result["rows"][name] = {
            "ops_per_step": per_step["cpu"],
            "ratio_to_tent": per_step["cpu"] / tent_ops["cpu"],
            "fused_ops_per_step": per_step["fused"],
            "fused_ratio_to_tent": per_step["fused"] / tent_ops["fused"],
            "steps": steps,
        }
        if args.top:
            row["top"] = {op: n / steps for op, n in counts["cpu"].most_common(args.top)}
        print(
            f"{name:32s} {per_step['cpu']:8.0f} ops/step  ×{row['ratio_to_tent']:.2f} TENT    fused optimiser: "
            f"{per_step['fused']:6.0f}  ×{row['fused_ratio_to_tent']:.2f}",
            flush=True,
        )
        for op, n in row.get("top", {}).items():
            print(f"    {op:28s} {n:8.1f}", flush=True)
        if args.json:  # after every row: a run cut off keeps what it counted
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
