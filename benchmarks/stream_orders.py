"""What the stream orders of --order cost next to adaptation.

1. Building each order alone (data/orders.py), for a demo domain (3,000 images, 10
   classes), a full Fashion-MNIST-C domain (10,000, 10) and an ImageNet-C domain
   (50,000, 1,000 classes): the best of 5 runs, and the memory of the arrays it makes.
2. With --domain and --stats: a whole `cafa adapt` of that domain under each order
   (one run each, in turn, in this process), its seconds and images/s, and the order's
   share of it.

    python benchmarks/stream_orders.py --domain cafa-demo/fashion-mnist-c-300/frost/3 \
        --stats cafa-demo/stats-auto.safetensors
"""

from __future__ import annotations

import argparse
import os
import platform
import time
import tracemalloc

import numpy as np

# Internal, what this times (tests/test_api.py lists it): the stream orders of --order, alone
from cafa_cli.data.orders import stream_order

ORDERS = ("iid", "label-shift:0.5", "label-shift:1.0", "dirichlet:1.0", "dirichlet:0.01")
SIZES = ((3_000, 10), (10_000, 10), (50_000, 1_000))


def order_seconds(labels: np.ndarray, order: str, repeats: int = 5) -> tuple[float, float]:
    """(best seconds, peak MiB allocated) of building one order."""
    best = float("inf")
    for seed in range(repeats):
        start = time.perf_counter()
        stream_order(labels, order, seed=seed)
        best = min(best, time.perf_counter() - start)
    tracemalloc.start()
    stream_order(labels, order, seed=0)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return best, peak / 2**20


def adapt_seconds(domain: str, stats: str, order: str) -> tuple[float, int]:
    from cafa_cli.api import AdaptConfig, Monitor, run_adapt

    config = AdaptConfig(data=[domain], stats=stats, order=order, device="cpu", predictions=os.devnull)
    start = time.perf_counter()
    results = run_adapt(config, Monitor())
    return time.perf_counter() - start, sum(r.n for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--domain", help="a labelled test domain for a whole cafa adapt run per order")
    parser.add_argument("--stats", help="the artifact for --domain")
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPU(s), {platform.processor() or platform.platform()}")
    print("\nbuilding the order alone (best of 5):")
    print(f"{'images':>8} {'classes':>8} {'order':<16} {'ms':>8} {'peak MiB':>9}")
    for n, c in SIZES:
        labels = np.random.default_rng(0).permutation(np.arange(n) % c)
        for order in ORDERS:
            seconds, mib = order_seconds(labels, order)
            print(f"{n:>8} {c:>8} {order:<16} {1000 * seconds:>8.2f} {mib:>9.2f}")
    if not args.domain:
        return
    from cafa_cli.api import open_domain

    labels = open_domain(args.domain).labels
    print(f"\ncafa adapt --method cafa --batch-size 200 on {args.domain} ({len(labels)} images), CPU:")
    print(f"{'order':<16} {'adapt s':>8} {'img/s':>7} {'order ms':>9} {'share':>8}")
    for order in ORDERS:
        seconds, n = adapt_seconds(args.domain, args.stats, order)
        building, _ = order_seconds(labels, order)
        print(f"{order:<16} {seconds:>8.2f} {n / seconds:>7.0f} {1000 * building:>9.2f} {building / seconds:>8.2%}")


if __name__ == "__main__":
    main()
