"""The dense per-class distance, forward + backward, with its chunks kept for the
backward pass (two reads of the factors) against recomputed in it (three reads).

The two variants alternate, round after round, in one process, and the medians are
compared, so that drift in a shared machine's speed hits both alike.

    python benchmarks/dense_distance.py --classes 200 --dim 2048 --batch 8 --rounds 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from perf import synthetic_gaussians  # noqa: E402

from cafa_cli.api import ClassDistances  # noqa: E402

# Internal, the knob this measures (tests/test_api.py lists it): the distances' memory budget
from cafa_cli.statistics import distances  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--classes", type=int, default=200)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.manual_seed(0)
    measure = ClassDistances(synthetic_gaussians(args.classes, args.dim, "full"))
    z = torch.randn(args.batch, args.dim)
    weights = torch.rand(args.batch, args.classes)
    keep = distances.KEEP_BYTES

    def step() -> float:
        features = z.clone().requires_grad_(True)
        start = time.perf_counter()
        (measure(features) * weights).sum().backward()
        return time.perf_counter() - start

    times = {"kept": [], "recomputed": []}
    step()  # warm-up: first touch of the factors
    for _ in range(args.rounds):
        for variant in times:
            distances.KEEP_BYTES = keep if variant == "kept" else 0
            times[variant].append(step())
    distances.KEEP_BYTES = keep
    result = {
        "C": args.classes,
        "d": args.dim,
        "N": args.batch,
        "rounds": args.rounds,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "ms": {k: 1000 * statistics.median(v) for k, v in times.items()},
        "all_ms": {k: [round(1000 * t, 1) for t in v] for k, v in times.items()},
    }
    result["recomputed_over_kept"] = result["ms"]["recomputed"] / result["ms"]["kept"]
    print(
        f"C={args.classes} d={args.dim} N={args.batch}: kept {result['ms']['kept']:.1f} ms, "
        f"recomputed {result['ms']['recomputed']:.1f} ms (×{result['recomputed_over_kept']:.2f})"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
