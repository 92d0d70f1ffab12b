"""The low-rank artifact at ImageNet scale: C = 1000 classes, d = 2048 (ResNet-50),
64 samples per class (5% of ImageNet), with synthetic features through the library.

Three parts, each in its own process so that its peak RSS (resource.getrusage) is its own:
  stats  ClassMoments.update on synthetic features in mixed-class batches, estimate
         (--covariance auto, which must pick lowrank), write_artifact; peak RSS and
         the artifact's size on disk (target ≤ 1 GB; the dense form would be 4·C·d² B);
  adapt  read_artifact, ClassDistances, then the CAFA loss on a batch of 64 and its
         backward pass to the features: time per forward + backward, peak RSS above
         the process's RSS after `import torch` (target ≤ 2 GB), and the distances of
         a few classes against a float64 dense reference built from the same rows
         (target: 1e-4 relative).

    python benchmarks/lowrank_scale.py                      # C=1000, d=2048, 64/class
    python benchmarks/lowrank_scale.py --classes 50 --dim 256 --per-class 16   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def reset_high_water_mark() -> bool:
    """Linux: make VmHWM the current RSS, so that a later VmHWM is one phase's peak."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def high_water_mark_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def class_rows(c: int, n: int, d: int, seed: int, draw: int = 0):
    """n synthetic post-ReLU features of class c: a class mean plus noise with per-unit
    scales shared by all classes; deterministic in (seed, c, draw), so the adapt part can
    rebuild a class's rows for the dense reference."""
    import torch

    shared = torch.Generator().manual_seed(seed)
    scales = 0.2 + 0.3 * torch.randn(d, generator=shared).abs()
    g = torch.Generator().manual_seed(seed * 1_000_003 + c * 7 + draw)
    mean = 0.5 * torch.randn(d, generator=g).abs() + 0.3
    return (mean + torch.randn(n, d, generator=g) * scales).clamp_min(0)


def stats_part(args) -> dict:
    import torch

    from cafa_cli.api import ClassMoments, ModelSpec, Preprocessing, estimate, write_artifact

    torch.set_num_threads(args.threads)
    base = rss_bytes()
    C, d, n = args.classes, args.dim, args.per_class
    moments = ClassMoments(C, d)
    start, cpu = time.perf_counter(), cpu_seconds()
    group = max(1, 256 // n)  # mixed-class batches of about 256 rows, like a shuffled loader
    for first in range(0, C, group):
        classes = range(first, min(C, first + group))
        rows = torch.cat([class_rows(c, n, d, args.seed) for c in classes])
        labels = torch.cat([torch.full((n,), c) for c in classes])
        order = torch.randperm(len(labels))
        moments.update(rows[order], labels[order])
    fed, fed_cpu = time.perf_counter() - start, cpu_seconds() - cpu
    start, cpu = time.perf_counter(), cpu_seconds()
    gaussians = estimate(moments, "auto", "auto", [f"n{c:08d}" for c in range(C)])
    estimated, estimated_cpu = time.perf_counter() - start, cpu_seconds() - cpu
    del moments
    start = time.perf_counter()
    spec = ModelSpec("resnet50", None, None, C, "fc")
    no_model = "0" * 64  # synthetic features: no parameters to fingerprint
    write_artifact(
        args.artifact,
        gaussians,
        [f"n{c:08d}" for c in range(C)],
        spec,
        Preprocessing(),
        {"data": "synthetic", "per_class": n},
        no_model,
    )
    written = time.perf_counter() - start
    return {
        "covariance": gaussians.covariance,
        "rank": int(gaussians.factors.shape[1]) if gaussians.covariance == "lowrank" else None,
        "shrinkage_mean": float(gaussians.shrinkage.mean()),
        "feed_s": round(fed, 2),
        "feed_cpu_s": round(fed_cpu, 2),
        "estimate_s": round(estimated, 2),
        "estimate_cpu_s": round(estimated_cpu, 2),
        "write_s": round(written, 2),
        "rss_after_import_mb": base / 2**20,
        "peak_rss_mb": peak_rss_bytes() / 2**20,
        "artifact_mb": Path(args.artifact).stat().st_size / 2**20,
        "dense_full_factors_mb": 4 * C * d * d / 2**20,
    }


def adapt_part(args) -> dict:
    import torch

    from cafa_cli.api import ClassDistances, losses, read_artifact

    torch.set_num_threads(args.threads)
    base = rss_bytes()
    start = time.perf_counter()
    artifact = read_artifact(args.artifact)
    loaded = time.perf_counter() - start
    g = artifact.gaussians
    distances = ClassDistances(g)
    resident = rss_bytes() - base
    C, d = g.means.shape

    # test features: fresh draws of random classes (not the training rows)
    picks = torch.randint(0, C, (args.batch,), generator=torch.Generator().manual_seed(1))
    z0 = torch.stack([class_rows(int(c), 1, d, args.seed, draw=1 + i)[0] for i, c in enumerate(picks)])
    peak_load = peak_rss_bytes() - base  # the reset below also resets ru_maxrss on Linux
    steps_hwm = reset_high_water_mark()
    times = []
    for _ in range(args.repeats + 1):
        z = z0.clone().requires_grad_(True)
        t0 = time.perf_counter()
        dist = distances(z)
        loss = losses.cafa(dist, dist.detach().argmin(1))  # pseudo labels: nearest class
        loss.backward()
        times.append(time.perf_counter() - t0)
    step = sorted(times[1:])[len(times[1:]) // 2]
    peak_steps = high_water_mark_bytes() - base if steps_hwm else None
    k = g.factors.shape[1] if g.covariance == "lowrank" else d
    flops = 2 * 2 * args.batch * d * C * k  # the z·Qᵀ GEMM forward and its transpose backward

    # exactness: a few classes against the dense shrunk covariance in float64, at the
    # batch, at fresh draws of those classes, and at their own training rows (inside
    # the span of the basis: the case where float32 could cancel)
    checked = torch.linspace(0, C - 1, args.check_classes).long().tolist()
    near = [class_rows(c, 8, d, args.seed, draw=10_000 + c) for c in checked]
    own = [class_rows(c, args.per_class, d, args.seed)[:4] for c in checked]
    z_check = torch.cat([z0, *near, *own])
    with torch.no_grad():
        got = distances(z_check).double()
    worst = 0.0
    for c in checked:
        rows = class_rows(c, args.per_class, d, args.seed).double()
        mean = rows.mean(0)
        centred = rows - mean
        s = centred.T @ centred / len(rows)
        lam = float(g.shrinkage[c])
        cov = (1 - lam) * s + lam * torch.trace(s) / d * torch.eye(d, dtype=torch.float64)
        diff = z_check.double() - mean
        expected = (diff * torch.linalg.solve(cov, diff.T).T).sum(1)
        worst = max(worst, float(((got[:, c] - expected) / expected).abs().max()))
    return {
        "covariance": g.covariance,
        "read_s": round(loaded, 2),
        "resident_after_load_mb": resident / 2**20,
        "peak_rss_loading_above_import_mb": peak_load / 2**20,
        "peak_rss_steps_above_import_mb": None if peak_steps is None else peak_steps / 2**20,
        "peak_rss_above_import_mb": max(peak_load, peak_rss_bytes() - base) / 2**20,
        "peak_rss_mb": max(peak_load + base, peak_rss_bytes()) / 2**20,
        "step_ms": 1000 * step,
        "step_ms_all": [round(1000 * t, 1) for t in times],
        "gflops": flops / step / 1e9,
        "max_rel_error_vs_dense": worst,
        "classes_checked": args.check_classes,
        "points_checked": len(z_check),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--per-class", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--check-classes", type=int, default=4)
    parser.add_argument("--threads", type=int, default=torch_threads_default())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--artifact", default=None, help="where to write the artifact (default: a temporary folder)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--part", choices=["stats", "adapt"], default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.part:
        result = stats_part(args) if args.part == "stats" else adapt_part(args)
        print(json.dumps(result))
        return

    with tempfile.TemporaryDirectory() as tmp:
        artifact = args.artifact or str(Path(tmp) / "lowrank.safetensors")
        # the parent's options again (as parsed: no stray value of --artifact), then the part's own
        forwarded = [
            word
            for key, value in vars(args).items()
            if key not in ("part", "artifact", "json")
            for word in (f"--{key.replace('_', '-')}", str(value))
        ]
        results = {"settings": {k: v for k, v in vars(args).items() if k not in ("part", "json")}}
        for part in ("stats", "adapt"):
            command = [sys.executable, __file__, *forwarded, "--artifact", artifact, "--part", part]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"the {part} part failed:\n{done.stderr.strip()}")
            results[part] = json.loads(done.stdout.strip().splitlines()[-1])
    s, a = results["stats"], results["adapt"]
    print(
        f"C={args.classes} d={args.dim} {args.per_class}/class, batch {args.batch}, {args.threads} threads, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"stats:  covariance {s['covariance']} (rank {s['rank']}, mean λ {s['shrinkage_mean']:.3f}); "
        f"feed {s['feed_s']} s, estimate {s['estimate_s']} s (CPU {s['feed_cpu_s']} s, {s['estimate_cpu_s']} s), "
        f"write {s['write_s']} s; peak RSS {s['peak_rss_mb']:.0f} MB"
    )
    print(
        f"        artifact {s['artifact_mb']:.0f} MB on disk (dense full factors would be {s['dense_full_factors_mb']:.0f} MB)"
    )
    steps = a["peak_rss_steps_above_import_mb"]
    during_steps = (
        f", peak +{steps:.0f} MB during the steps" if steps is not None else ""
    )  # None where RSS peaks cannot be reset
    print(
        f"adapt:  read {a['read_s']} s; RSS above the process after import: +{a['resident_after_load_mb']:.0f} MB "
        f"after load, peak +{a['peak_rss_loading_above_import_mb']:.0f} MB while loading (validation reads the "
        f"file through mmap){during_steps}"
    )
    print(f"        peak RSS of the whole process {a['peak_rss_mb']:.0f} MB")
    print(
        f"        distances + CAFA loss + backward, batch {args.batch}: {a['step_ms']:.0f} ms ({a['gflops']:.0f} GFLOP/s in the basis GEMMs)"
    )
    print(
        f"        max relative error vs float64 dense, {a['classes_checked']} classes × {a['points_checked']} points: "
        f"{a['max_rel_error_vs_dense']:.2e}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


def torch_threads_default() -> int:
    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    main()
