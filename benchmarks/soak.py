"""Soak test: continual CAFA adaptation (`--reset never`) over a long stream of domains,
watching the process's resident memory (RSS).

The bundled fmnist-resnet adapts over `--domains` shifted copies of the Fashion-MNIST
test images (Gaussian noise, contrast and brightness changing with every domain,
computed on the fly so the data's memory stays constant), through the same code as
`cafa adapt`: Domain -> DataLoader -> Adapter -> records. It prints the RSS at the
start, after the first domain (the first batches allocate autograd buffers and the
allocator's pools), every 10 domains and at the end, with the error since the last row.

    .venv/bin/python benchmarks/soak.py --domains 100 --images 500

Needs the Fashion-MNIST files (Debian package dataset-fashion-mnist, or CAFA_FASHION_MNIST).
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from cafa_cli.api import (
    FASHION_MNIST_CLASSES,
    Adapter,
    StatsConfig,
    compute_statistics,
    create,
    load_fashion_mnist,
    load_model,
    read_artifact,
)

# Internal, what this soaks (tests/test_api.py lists these): cafa adapt's stream loop, given
# domains whose images are corrupted as they are read
from cafa_cli.data.domain import Domain
from cafa_cli.jobs.adapt.stream import StreamEvents, adapt_domains
from cafa_cli.jobs.config.settings import StreamSettings


def rss_mib() -> float:
    """Resident memory now, from /proc (Linux); the peak from getrusage elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return peak_mib()


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def shifted_domain(k: int, images: np.ndarray, labels: np.ndarray) -> Domain:
    """Domain k: noise σ, contrast and brightness cycle with different periods, so no two
    neighbouring domains are alike. Each image is corrupted when it is read."""
    sigma = 10 + 50 * (k % 5) / 4
    contrast = 1.0 - 0.5 * (k % 3) / 2
    brightness = 40 * ((k % 7) / 6 - 0.5)
    refs = [f"domain{k:03d}#{i}" for i in range(len(images))]

    def read(i: int) -> Image.Image:
        rng = np.random.default_rng((k, i))
        pixels = images[i].astype(np.float32)
        pixels = (pixels - 128) * contrast + 128 + brightness + rng.normal(0, sigma, pixels.shape)
        return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))

    return Domain(f"domain{k:03d}", refs, labels.astype(np.int64), list(FASHION_MNIST_CLASSES), read)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--domains", type=int, default=100)
    parser.add_argument("--images", type=int, default=500, help="test images per domain")
    parser.add_argument("--batch-size", type=int, default=200)
    parser.add_argument("--method", default="cafa")
    parser.add_argument("--per-class", type=int, default=200, help="training images per class for the statistics")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "stats.safetensors")
        compute_statistics(
            StatsConfig(data="fashion-mnist", model="fmnist-resnet", per_class=args.per_class, covariance="full",
                        device="cpu", out=path)
        )  # fmt: skip
        artifact = read_artifact(path)
    adapter = Adapter(load_model("fmnist-resnet"), create(args.method, artifact.gaussians), torch.device("cpu"))
    images, labels = load_fashion_mnist(None, "test")
    rows = np.random.default_rng(0).permutation(len(images))[: args.images]
    images, labels = images[rows], labels[rows]
    preprocess = artifact.preprocessing  # the bundled model's, as cafa stats recorded it
    domains = [shifted_domain(k, images, labels) for k in range(args.domains)]

    print(f"soak: {args.method}, reset never, {args.domains} domains x {args.images} images, batch {args.batch_size}, "
          f"{torch.get_num_threads()} torch threads, torch {torch.__version__}, pid {os.getpid()}")  # fmt: skip
    print()
    print("| after domain | RSS MiB | peak MiB | error % since last row | skipped steps | seconds |")
    print("|---:|---:|---:|---:|---:|---:|")
    gc.collect()
    start_rss, started = rss_mib(), time.perf_counter()
    print(f"| 0 (start) | {start_rss:.1f} | {peak_mib():.1f} | | 0 | 0 |")
    block = {"errors": 0, "n": 0}

    def on_records(records, so_far):
        block["n"] += len(records)
        block["errors"] += sum(r.prediction != r.label for r in records)

    def report(done: int) -> None:
        gc.collect()
        error = 100 * block["errors"] / block["n"] if block["n"] else float("nan")
        print(
            f"| {done} | {rss_mib():.1f} | {peak_mib():.1f} | {error:.1f} | {adapter.skipped_steps} | {time.perf_counter() - started:.0f} |",
            flush=True,
        )
        block.update(errors=0, n=0)

    def on_domain(domain: Domain) -> None:
        k = int(domain.name.removeprefix("domain"))
        if k == 1 or (k and k % 10 == 0):  # after the first domain: the warm-up is over
            report(k)

    settings = StreamSettings(batch_size=args.batch_size, reset="never", shuffle=True, seed=0)
    results = adapt_domains(adapter, domains, preprocess, settings,
                            events=StreamEvents(on_records=on_records, on_domain=on_domain))  # fmt: skip
    report(args.domains)
    end_rss = rss_mib()
    weights_finite = all(torch.isfinite(p).all() for p in adapter.model.parameters())
    print()
    print(f"RSS start {start_rss:.1f} MiB, end {end_rss:.1f} MiB ({end_rss - start_rss:+.1f} MiB), peak {peak_mib():.1f} MiB; "
          f"{sum(r.n for r in results)} images, {adapter.skipped_steps} skipped steps, weights finite: {weights_finite}")  # fmt: skip


if __name__ == "__main__":
    main()
