"""The continual methods on one CCC-style stream (`--ccc`) made from Fashion-MNIST's test images with the
bundled fmnist-resnet (docs/results/ccc.md): every method in one process, so that each pair's grid of
source accuracies is measured once (jobs/adapt/prepare.ccc_streams), each method under its recipe (one
domain: continual; rdumb resets every N updates). Prints the error of every CHUNK images and of the whole
stream, and writes each method's per-image correctness to OUT/METHOD.npy (`--table OUT CHUNK METHOD...`
prints the table again from those, by other windows).

    OMP_NUM_THREADS=1 PYTHONPATH=src nice python benchmarks/ccc_table.py OUT IMAGES SPEED ACCURACY STATS METHOD...

STATS: the class statistics of the methods that read them (`cafa stats --model fmnist-resnet`, or the
`stats-auto.safetensors` a bench on the bundled model leaves in its workdir).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from cafa_cli.api import AdaptConfig, method_class
from cafa_cli.jobs.adapt.prepare import prepare_adaptation

CHUNK = 1000


def wrong_by_image(method: str, images: int, speed: int, accuracy: float, stats: str) -> np.ndarray:
    config = AdaptConfig(
        data=["fashion-mnist-test"],
        model="fmnist-resnet",
        method=method,
        ccc=images,
        ccc_speed=speed,
        ccc_accuracy=accuracy,
        batch_size=50,
        seed=0,
        device="cpu",
        stats=stats if method_class(method).needs_statistics else None,
    )
    wrong: list[bool] = []
    job = prepare_adaptation(config)
    job.run(on_records=lambda records: wrong.extend(r.prediction != r.label for r in records))
    return np.array(wrong)


def table(out: str, methods: list[str], chunk: int) -> str:
    """The error % of every `chunk` images and of the whole stream, a line per method, from OUT/METHOD.npy."""
    rows = {}
    for method in methods:
        wrong = np.load(Path(out) / f"{method}.npy")
        rows[method] = [100 * wrong[k : k + chunk].mean() for k in range(0, len(wrong), chunk)] + [100 * wrong.mean()]
    n = len(next(iter(rows.values()))) - 1
    shown = (lambda k: f"{k + 1}k") if chunk == 1000 else (lambda k: f"{k * chunk // 1000}-{(k + 1) * chunk // 1000}k")
    lines = ["| method | " + " | ".join(shown(k) for k in range(n)) + " | all |", "|---|" + "---:|" * (n + 1)]
    lines += [f"| {method} | " + " | ".join(f"{e:.1f}" for e in errors) + " |" for method, errors in rows.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1] == "--table":  # again from the saved runs, by windows of CHUNK images: --table OUT CHUNK METHOD...
        print(table(sys.argv[2], sys.argv[4:], int(sys.argv[3])))
        sys.exit()
    out, images, speed, accuracy, stats, *methods = sys.argv[1:]
    Path(out).mkdir(parents=True, exist_ok=True)
    for method in methods:
        started = time.perf_counter()
        wrong = wrong_by_image(method, int(images), int(speed), float(accuracy), stats)
        np.save(Path(out) / f"{method}.npy", wrong)
        print(f"{method} done in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    print(table(out, methods, CHUNK))
