"""Where the low-rank distances' time goes, and ways to compute their two GEMMs, timed
side by side in one process (median of --repeats after warm-up; forward and backward
to the features).

At C = 1000, k = 63, d = 2048, N = 64 the distances are dominated by t = z·Bᵀ against
the [C·k, d] basis B and its backward dz = dt·B: an output of only 64 × 2048 summed
over K = 63,000, which a GEMM kernel must split along K to fill a GPU. On an H100
(2026-11-26) low-rank CAFA cost ~10 ms a step more than TENT, where these two GEMMs
(33 GFLOP) should take about 1 ms. The variants:

  distances    ClassDistances (the real path: both GEMMs, the expanded norms, the refinement check)
  gemms        the two GEMMs alone, B used through its transposed view (as the real path does)
  transposed   the same with Bᵀ stored contiguous
  split-k      the backward GEMM as S batched partial products summed (a split-K by hand)
  tf32         `gemms` with TF32 matrix products allowed (for scale only: TF32 rounds to
               about 3 decimal digits, which the expanded distance cannot afford)

Each variant's t and dz are checked against float64 (relative error printed).

    python benchmarks/lowrank_gemm.py --classes 1000 --json lowrank-gemm.json
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

from cafa_cli.api import ClassDistances, pick_device


class SplitKProjection(torch.autograd.Function):
    """t = z·Bᵀ, with dz = dt·B computed as `splits` partial products over slices of B's rows."""

    @staticmethod
    def forward(ctx, z, basis, splits):
        ctx.save_for_backward(basis)
        ctx.splits = splits
        return z @ basis.T

    @staticmethod
    def backward(ctx, grad_t):
        (basis,) = ctx.saved_tensors
        rows, d = basis.shape
        parts = grad_t.view(len(grad_t), ctx.splits, rows // ctx.splits).transpose(0, 1)  # [S, N, rows/S]
        return torch.bmm(parts, basis.view(ctx.splits, rows // ctx.splits, d)).sum(0), None, None


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median milliseconds of fn() (CUDA events on a GPU)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - begin))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--rank", type=int, default=63)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument(
        "--splits", type=int, default=0, help="split-k slices (default: the largest divisor of C·k up to 63)"
    )
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json")
    args = parser.parse_args()
    device = pick_device(args.device)
    C, k, d, n = args.classes, args.rank, args.dim, args.batch
    gaussians = synthetic_gaussians(C, d, "lowrank", rank=k)
    distances = ClassDistances(gaussians, device)
    basis = distances.basis.reshape(C * k, d)
    transposed = basis.T.contiguous()
    splits = args.splits or max(s for s in range(1, 64) if (C * k) % s == 0)
    g = torch.Generator().manual_seed(1)
    z0 = torch.randn(n, d, generator=g).abs().to(device)  # post-ReLU-like features
    weights = torch.randn(n, C * k, generator=g).to(device)  # a fixed upstream gradient for t

    def projection(kind: str):
        def run():
            z = z0.clone().requires_grad_(True)
            if kind == "transposed":
                t = z @ transposed
            elif kind == "split-k":
                t = SplitKProjection.apply(z, basis, splits)
            else:
                t = z @ basis.T
            (t * weights).sum().backward()
            return t, z.grad

        return run

    def real_distances():
        z = z0.clone().requires_grad_(True)
        distances(z).sum().backward()

    # float64 reference for t and dz = weights·B
    t_ref = z0.double() @ basis.double().T
    dz_ref = weights.double() @ basis.double()
    result = {
        "C": C,
        "k": k,
        "d": d,
        "N": n,
        "splits": splits,
        "device": str(device),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "gemm_gflop": 2 * 2 * n * d * C * k / 1e9,
        "ms": {},
        "relative_error": {},
    }
    result["ms"]["distances"] = timed(real_distances, device, args.repeats)
    for kind in ("gemms", "transposed", "split-k", "tf32"):
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = kind == "tf32"
        try:
            run = projection(kind)
            result["ms"][kind] = timed(run, device, args.repeats)
            t, dz = run()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
        result["relative_error"][kind] = {
            "t": float((t.detach().double() - t_ref).norm() / t_ref.norm()),
            "dz": float((dz.double() - dz_ref).norm() / dz_ref.norm()),
        }
    for kind, ms in result["ms"].items():
        error = result["relative_error"].get(kind)
        accuracy = f"  rel. error t {error['t']:.1e}, dz {error['dz']:.1e}" if error else ""
        print(
            f"{kind:11s} {ms:8.2f} ms  ({result['gemm_gflop'] / ms:.1f} TFLOP/s in the two GEMMs){accuracy}", flush=True
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
