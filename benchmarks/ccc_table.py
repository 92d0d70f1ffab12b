"""The continual methods on one CCC-style stream (`--ccc`) made from Fashion-MNIST's test images with the
bundled fmnist-resnet (docs/results/ccc.md): every method in one process, so that each pair's grid of
source accuracies is measured once (jobs/adapt/prepare.ccc_streams), each method under its recipe (one
domain: continual; rdumb resets every N updates). Prints the error of every CHUNK images and of the whole
stream, and writes each method's per-image correctness to OUT/METHOD.npy.

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


if __name__ == "__main__":
    out, images, speed, accuracy, stats, *methods = sys.argv[1:]
    Path(out).mkdir(parents=True, exist_ok=True)
    rows = {}
    for method in methods:
        started = time.perf_counter()
        wrong = wrong_by_image(method, int(images), int(speed), float(accuracy), stats)
        np.save(Path(out) / f"{method}.npy", wrong)
        rows[method] = [100 * wrong[k : k + CHUNK].mean() for k in range(0, len(wrong), CHUNK)] + [100 * wrong.mean()]
        print(f"{method} done in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    n = len(next(iter(rows.values()))) - 1
    print("| method | " + " | ".join(f"{k + 1}k" for k in range(n)) + " | all |")
    print("|---|" + "---:|" * (n + 1))
    for method, errors in rows.items():
        print(f"| {method} | " + " | ".join(f"{e:.1f}" for e in errors) + " |")
