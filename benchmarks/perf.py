"""Step time, throughput and memory of stats and adapt, measured side by side.

For one model, batch, class count C and device, in one process:
  - ms per adaptation step and images/s for source, bn, tent and cafa (each
    covariance mode asked for), and the CAFA / TENT step-time ratio;
  - the same for every other method (--methods; those that need class statistics get
    synthetic full ones), each timed in alternating rounds with TENT (--rounds; medians)
    and given the ratio of the two. RoTTA trains on its memory bank every 64 samples, so
    its rounds time a whole number of those cycles (the bank's steps are in them); eata
    has no source images here, so it is eta's step;
  - `cafa stats` feature accumulation images/s next to forward-only images/s;
  - peak memory of each (CPU: peak RSS, reset between runs through
    /proc/self/clear_refs; CUDA: torch.cuda.max_memory_allocated);
  - artifact size; on CUDA, the step time next to the memory-bandwidth floor of
    reading the precision factors twice (forward and backward).
With --compile, tent and every cafa row are timed again through torch.compile; with
--cudnn-benchmark, again with cuDNN choosing its convolution algorithms by timing them
(torch.backends.cudnn.benchmark; cafa leaves it off); with --eager, again with every step
run eagerly (--no-cuda-graph: on CUDA the plain rows replay a captured step where the
method allows, adapter.py). Each such row's `ratio_to_tent` is to the TENT row of the same
variant. Every step row records `step_runner`: `graph`, or `eager: why`.
Each cafa row also times its loss alone (distances, forward and backward, on fixed
features: `loss_ms`), which tells the loss's share of the step from the network's; with
--trace FILE, torch.profiler's table of the busiest operators (device and host time) of
a few tent and cafa steps is written there, to see where a step's time goes.
The pseudo-covariance `full-recompute` is the dense form with its chunks recomputed
in the backward pass (distances.KEEP_BYTES = 0), as it runs past that memory budget.
Synthetic images and class statistics, real model code paths.

History. By default every row runs in one process, one after another, and a row's cost
can depend on the rows before it (on an H100, CAFA low-rank / TENT measured 1.03x in a
process of its own and 1.37x after other methods' rows; issue 33). --fresh times each
row in a process of its own (this script again, with --rows naming that row alone) and
gathers the rows; a row that fails there is reported and the others still run. In one
process, --between-rows clean undoes what it can between rows (garbage collection,
torch.cuda.empty_cache, cudnn.benchmark off, torch._dynamo reset), and --tent-again
times TENT once more just before the cafa rows, after the same history as they. Every
step row records `state`: the process's state as the row began (cuDNN and TF32
switches, Adapters still alive, global module hooks; on CUDA the allocator's pool and
counters) and, on CUDA, the allocator's cudaMalloc/cudaFree calls and retries during
its timed steps. --rows picks rows by name. `ratio_to_tent` of a cafa row is over the
TENT row of the same run (in --fresh, TENT's own process).

    python benchmarks/perf.py --model resnet50 --classes 10 --batch 8 --json perf.json
    python benchmarks/perf.py --model resnet50 --classes 1000 --batch 64 --fresh --rows tent,cafa-lowrank --covariances lowrank
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from cafa_cli.api import (
    REGISTRY,
    Adapter,
    ClassGaussians,
    FeatureClassifier,
    ModelSpec,
    Preprocessing,
    create,
    method_class,
    pick_device,
    read_artifact,
    shipped,
    write_artifact,
)

# Internal, the machinery timed here (tests/test_api.py lists these): the batches and the
# feature pass of `cafa stats`, the step graph's warm-up, the distances' memory budget, and
# `resolve`, which builds an architecture without weights (load_model refuses one: its
# predictions would be random; its step time is the same)
from cafa_cli.data.loading import Batch
from cafa_cli.engine.step_graph import WARMUP as STEP_GRAPH_WARMUP
from cafa_cli.model.loading import resolve
from cafa_cli.statistics import distances
from cafa_cli.statistics.moments import accumulate_features

KEEP_BYTES = distances.KEEP_BYTES
HBM_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12}


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated()
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync(device)
    return (time.perf_counter() - start) / repeats


def whole_cycles(adapter: Adapter, steps: int, batch: int) -> int:
    """`steps`, or for a method with a memory bank (rotta, cafa-robust) whole cycles of its
    bank's schedule (each holds the same number of training steps)."""
    if not hasattr(adapter.method, "update_every"):
        return steps
    cycle = adapter.method.update_every // math.gcd(adapter.method.update_every, batch)
    return cycle * math.ceil(steps / cycle)


# Random images are confident to no gate: SoTTA and STAMP step only on the samples their memory
# admits (confidence above 0.99, entropy below 0.4·ln C), and on perf's images none entered it, so
# their figures were a prediction's, not a step's. Measured with the gate open (every sample
# admitted; STAMP's α 2 is above ln C, the most an entropy can be), their steps run every batch.
GATE_OPEN = {"sotta": {"threshold": 0.0}, "stamp": {"alpha": 2.0}}


def with_gate_open(method: str, options: dict) -> dict:
    """`options` with the method's memory gate open (GATE_OPEN), so a measured step steps."""
    return {**options, **GATE_OPEN.get(method, {})}


def timing_model(name: str, num_classes: int | None) -> FeatureClassifier:
    """The model a timing steps, wrapped, in eval mode on the CPU: load_model's, or, for an
    architecture without weights, an untrained one."""
    return resolve(name, num_classes=num_classes)[0]


def synthetic_gaussians(C: int, d: int, covariance: str, rank: int = 63) -> ClassGaussians:
    """Random but valid statistics (well-conditioned lower-triangular factors; for
    lowrank, orthonormal bases of `rank` directions, as 64 samples per class give)."""
    g = torch.Generator().manual_seed(0)
    extra = {}
    if covariance == "lowrank":
        basis = torch.linalg.qr(torch.randn(C, d, rank, generator=g)).Q.transpose(1, 2).contiguous()
        extra = {"isotropic": torch.rand(C, generator=g) + 0.1, "spectrum": torch.rand(C, rank, generator=g) * 10}
        return ClassGaussians(
            torch.randn(C, d, generator=g),
            basis,
            torch.full((C,), rank + 1, dtype=torch.int64),
            torch.full((C,), 0.1, dtype=torch.float64),
            "lowrank",
            torch.zeros(d),
            torch.eye(d),
            **extra,
        )
    shape = {"full": (C, d, d), "tied": (1, d, d), "diag": (C, d)}[covariance]
    if covariance == "diag":
        factors = torch.rand(shape, generator=g) + 0.5
    else:
        factors = torch.tril(torch.randn(shape, generator=g) * 0.01) + torch.eye(d)
    return ClassGaussians(
        means=torch.randn(C, d, generator=g),
        factors=factors,
        counts=torch.full((C,), 64, dtype=torch.int64),
        shrinkage=torch.full((C if covariance != "tied" else 1,), 0.1, dtype=torch.float64),
        covariance=covariance,
        global_mean=torch.zeros(d),
        global_covariance=torch.eye(d),
    )


def synthetic_norm_moments(net: torch.nn.Module, classes: int) -> dict:
    """Class moments of every BatchNorm's input, random but valid, for `norm` class-balanced."""
    g = torch.Generator().manual_seed(0)
    return {
        name: (
            torch.randn(classes, m.num_features, generator=g),
            torch.rand(classes, m.num_features, generator=g) + 0.5,
        )
        for name, m in net.named_modules()
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
    }


def model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, its inputs, device and precision (step_sync.py takes them too)."""
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--classes", type=int, default=10, help="C (the model's outputs)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224, help="input height = width")
    parser.add_argument("--channels", type=int, default=3)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--precision", default="fp32")


def process_state(device: torch.device) -> dict:
    """What a process carries from one row to the next that could change a step's cost: the
    cuDNN and TF32 switches, Adapters still alive (and the memory they hold), global module
    hooks, and on CUDA the caching allocator's pool and its counters (a cudaMalloc or a
    freeing retry inside timed steps is a synchronisation and a slow path)."""
    from torch.nn.modules import module

    hooks = (
        "_global_forward_hooks",
        "_global_forward_pre_hooks",
        "_global_backward_hooks",
        "_global_backward_pre_hooks",
    )
    state = {
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "live_adapters": sum(
            issubclass(type(o), Adapter) for o in gc.get_objects()
        ),  # type(): isinstance reads __class__, which some lazy objects warn on
        "global_module_hooks": sum(len(getattr(module, name, {})) for name in hooks),
    }
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        state.update(
            {
                "allocated_bytes": stats.get("allocated_bytes.all.current", 0),
                "reserved_bytes": stats.get("reserved_bytes.all.current", 0),
                "segments": stats.get("segment.all.current", 0),
                **allocator_counters(device),
            }
        )
    return state


def allocator_counters(device: torch.device) -> dict:
    """The CUDA caching allocator's calls to cudaMalloc and cudaFree and its retries after
    freeing its pool (none on the CPU)."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {k: stats.get(k, 0) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")}


def timed_counting(fn, device, repeats: int, warmup: int = 2) -> tuple[float, dict]:
    """timed(), and on CUDA what the allocator did during the timed steps (after the warm-up)."""
    for _ in range(warmup):
        fn()
    sync(device)
    before = allocator_counters(device)
    seconds = timed(fn, device, repeats, warmup=0)
    return seconds, {f"{k}_in_timed_steps": v - before[k] for k, v in allocator_counters(device).items()}


def clean_state(device: torch.device) -> None:
    """--between-rows clean: what one process can undo of an earlier row (a fresh process,
    --fresh, undoes everything, the GPU's clocks and temperature aside)."""
    gc.collect()  # adapters kept alive by reference cycles (hooks, closures) until the collector runs
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the caching allocator's pool, as an earlier row left it
    torch.backends.cudnn.benchmark = False
    if "torch._dynamo" in sys.modules:  # compiled graphs and their guards (counted against recompile limits)
        sys.modules["torch._dynamo"].reset()


def add_ratios(steps: dict) -> None:
    """Each cafa-<covariance> row (and its +variant rows) over TENT timed the same way, and over
    tent-again where it was timed. Rows timed beside TENT (tent_ms) carry their own ratio."""
    for name, row in steps.items():
        if not name.startswith("cafa-") or "tent_ms" in row:
            continue
        _, plus, variant = name.partition("+")
        against = [(f"tent{plus}{variant}", "ratio_to_tent")] + (
            [("tent-again", "ratio_to_tent_again")] if not plus else []
        )
        for tent, key in against:
            if tent in steps:
                row[key] = row["ms"] / steps[tent]["ms"]


def describe(name: str, row: dict) -> str:
    """The row's printed line."""
    line = f"{name:12s} {row['ms']:9.1f} ms/step"
    if "tent_ms" in row:  # timed beside TENT, in alternating rounds
        return f"{name:12s} {row['ms']:9.1f} ms/step  ×{row['ratio_to_tent']:.2f} TENT ({row['tent_ms']:.1f} ms, alternating)"
    if "ratio_to_tent" in row:
        line += f"  ×{row['ratio_to_tent']:.2f} TENT" + (f"+{name.partition('+')[2]}" if "+" in name else "")
    if "ratio_to_tent_again" in row:
        line += f" (×{row['ratio_to_tent_again']:.2f} tent-again)"
    if "artifact_bytes" in row:
        line += f"  artifact {row['artifact_bytes'] / 1e6:.1f} MB  loss alone {row['loss_ms']:.1f} ms"
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arguments(parser)
    parser.add_argument("--covariances", default="full,tied,diag,lowrank")
    parser.add_argument(
        "--methods",
        default="all",
        help="the other methods timed next to TENT: all (every method "
        "but source, bn, tent and cafa, which have their own rows), none, or a comma-separated list",
    )
    parser.add_argument(
        "--norms",
        default="",
        help="BatchNorm statistics settings (--norm) to time tent and cafa "
        "with, beside TENT with batch statistics: e.g. ema:0.05,class-balanced (synthetic class moments)",
    )
    parser.add_argument(
        "--statistics",
        default="full",
        choices=("full", "tied", "diag", "lowrank"),
        help="the covariance form of the synthetic class statistics that --methods and --norms rows get "
        "(at C = 1000, full is 16.8 GB made on the host: lowrank is the form ImageNet's artifact has)",
    )
    parser.add_argument(
        "--recipe",
        default=None,
        help="time each --methods row with the options of its shipped recipe for this family (cifar10-c: "
        "cafa-robust's update_every 32 steps twice a batch of 64); default: the methods' own defaults",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of TENT and each --methods row")
    # 5 and 10 batches on an H100 gave 0.97x and 0.77x for the same code: too few to say anything
    parser.add_argument("--stats-batches", type=int, default=40, help="batches in the stats vs forward comparison")
    parser.add_argument("--compile", action="store_true", help="also time tent and each cafa row with torch.compile")
    parser.add_argument(
        "--cudnn-benchmark", action="store_true", help="also time tent and each cafa row with cudnn.benchmark on"
    )
    parser.add_argument(
        "--eager",
        action="store_true",
        help="also time tent and each cafa row with every step eager "
        "(--no-cuda-graph; the plain rows replay a CUDA graph where they can)",
    )
    parser.add_argument(
        "--tent-again",
        action="store_true",
        help="time TENT once more just before the cafa rows (row "
        "tent-again; each cafa row gets ratio_to_tent_again): TENT and CAFA after the same history",
    )
    parser.add_argument(
        "--rows",
        help="only these rows, comma-separated, by their names in the JSON (tent, cafa-lowrank, "
        "tent+compile, lame, 'tent --norm class-balanced', stats, ...)",
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="time each row in a process of its own (this script again, "
        "for that row alone), so that no row's cost depends on the rows before it",
    )
    parser.add_argument(
        "--between-rows",
        choices=("keep", "clean"),
        default="keep",
        help="in one process, between rows: keep the state an earlier row left, or clean it (garbage "
        "collection, torch.cuda.empty_cache, cudnn.benchmark off, torch._dynamo reset)",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # --fresh's process for one row
    parser.add_argument("--trace", help="write torch.profiler tables of tent and each cafa row's steps here")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    device = pick_device(args.device)
    torch.manual_seed(0)
    x = torch.randn(args.batch, args.channels, args.size, args.size)
    num_classes = None if args.model == "fmnist-resnet" else args.classes
    probe = timing_model(args.model, num_classes)
    C, d = probe.num_classes, probe.feature_dim
    del probe
    result = {
        "model": args.model,
        "C": C,
        "d": d,
        "batch": args.batch,
        "size": args.size,
        "device": str(device),
        "precision": args.precision,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "steps": {},
        "fresh": args.fresh,
        "between_rows": args.between_rows,
    }

    def save() -> None:  # after every row: a run cut off by a time limit keeps what it measured
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")

    variants = [
        name
        for name, wanted in (
            ("compile", args.compile),
            ("cudnn-benchmark", args.cudnn_benchmark),
            ("eager", args.eager),
        )
        if wanted
    ]

    def recipe_options(method: str) -> dict:
        """The method options of its shipped recipe for --recipe (none without one), its gate open."""
        recipe = shipped(method, args.recipe) if args.recipe else None
        return with_gate_open(method, dict(recipe.options) if recipe else {})

    def adapter_for(method: str, gaussians=None, variant: str = "", norm: str = "batch") -> Adapter:
        model = timing_model(args.model, num_classes)
        moments = synthetic_norm_moments(model.model, C) if norm == "class-balanced" else None
        return Adapter(
            model,
            create(method, gaussians, device, **recipe_options(method)),
            device,
            precision=args.precision,
            compile=variant == "compile",
            cuda_graph=variant != "eager",
            norm=norm,
            class_moments=moments,
        )

    def warmup_of(adapter: Adapter) -> int:
        """2 steps, and with a CUDA graph its warm-up and its checked capture too: replays only are timed."""
        return 2 + (STEP_GRAPH_WARMUP + 1 if adapter.graph is not None else 0)

    def repeats_of(adapter: Adapter) -> int:
        return whole_cycles(adapter, args.repeats, args.batch)

    def measure_step(method: str, gaussians=None, variant: str = "", name: str | None = None) -> dict:
        state = process_state(device)  # before this row's adapter exists: what earlier rows left
        adapter = adapter_for(method, gaussians, variant)
        images = x.to(device)
        repeats = repeats_of(adapter)
        reset_peak(device)
        torch.backends.cudnn.benchmark = variant == "cudnn-benchmark"
        try:
            seconds, counted = timed_counting(lambda: adapter.step(images), device, repeats, warmup=warmup_of(adapter))
        finally:
            torch.backends.cudnn.benchmark = False
        state.update(counted)
        row = {
            "ms": 1000 * seconds,
            "images_per_s": args.batch / seconds,
            "peak_bytes": peak_bytes(device),
            "repeats": repeats,
            "state": state,
            "step_runner": adapter.step_runner,
        }
        if args.trace and method not in ("source", "bn"):
            trace(name or method, lambda: adapter.step(images))
        if gaussians is not None and not variant:  # the loss itself is neither compiled nor convolved
            row["loss_ms"] = 1000 * time_loss(adapter.method.loss)
        return row

    def measure_beside_tent(method: str, gaussians=None, norm: str = "batch") -> dict:
        """The method and TENT in alternating rounds, each round --repeats steps of each (after
        2 warm-up steps each); the medians over the rounds and their ratio. On a shared
        machine the load drifts during a run: a TENT row timed minutes earlier would measure
        the drift as much as the method. Peak memory is not taken (both adapters are alive)."""
        state = process_state(device)
        images = x.to(device)
        tent, other = adapter_for("tent"), adapter_for(method, gaussians, norm=norm)
        repeats = repeats_of(other)
        for adapter in (tent, other):
            timed(lambda: adapter.step(images), device, warmup_of(adapter), warmup=0)
        rounds: dict[str, list[float]] = {"tent": [], "row": []}  # "row": the method (tent too, under another --norm)
        for _ in range(args.rounds):
            rounds["tent"].append(timed(lambda: tent.step(images), device, args.repeats, warmup=0))
            rounds["row"].append(timed(lambda: other.step(images), device, repeats, warmup=0))
        seconds, tent_seconds = statistics.median(rounds["row"]), statistics.median(rounds["tent"])
        row = {
            "ms": 1000 * seconds,
            "images_per_s": args.batch / seconds,
            "tent_ms": 1000 * tent_seconds,
            "ratio_to_tent": seconds / tent_seconds,
            "rounds": args.rounds,
            "repeats": repeats,
            "state": state,
            "step_runner": other.step_runner,
            "tent_step_runner": tent.step_runner,
        }
        if args.trace:
            trace(method, lambda: other.step(images))
        return row

    def time_loss(loss) -> float:
        """The loss alone, forward and backward, on fixed features and logits."""
        features = torch.randn(args.batch, d, device=device, requires_grad=True)
        logits = torch.randn(args.batch, C, device=device)
        return timed(lambda: loss(logits, features).backward(), device, args.repeats)

    def trace(title: str, step) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        step()
        with profile(activities=activities) as profiler:
            for _ in range(3):
                step()
            sync(device)
        table = profiler.key_averages().table
        with open(args.trace, "a") as out:
            if device.type == "cuda":  # the kernels, then the host: launches, and waits in synchronisations
                out.write(
                    f"== {title}: 3 steps, by device time\n{table(sort_by='self_device_time_total', row_limit=20)}\n"
                )
            out.write(f"== {title}: 3 steps, by host time\n{table(sort_by='self_cpu_time_total', row_limit=15)}\n")

    artifacts: dict = {}  # the last covariance's statistics read back from an artifact, and its size

    def artifact_gaussians(covariance: str):
        if covariance not in artifacts:
            artifacts.clear()  # a dense C = 1000 form is 16.8 GB: one at a time
            gaussians = synthetic_gaussians(C, d, covariance)
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "a.safetensors"
                no_model = "0" * 64  # synthetic statistics, read back for their size: no parameters to fingerprint
                write_artifact(
                    path, gaussians, [str(c) for c in range(C)], ModelSpec(args.model), Preprocessing(), {}, no_model
                )
                artifacts[covariance] = read_artifact(path).gaussians, path.stat().st_size
        return artifacts[covariance]

    def cafa_row(key: str, variant: str = "") -> dict:
        covariance, _, form = key.partition("-")
        distances.KEEP_BYTES = 0 if form == "recompute" else KEEP_BYTES
        try:
            gaussians, size = artifact_gaussians(covariance)
            if variant:
                return measure_step("cafa", gaussians, variant=variant, name=f"cafa-{key}+{variant}")
            row = {**measure_step("cafa", gaussians, name=f"cafa-{key}"), "artifact_bytes": size}
        finally:
            distances.KEEP_BYTES = KEEP_BYTES
        card = next((k for k in HBM_BYTES_PER_S if k in (result["gpu"] or "")), None)
        if card:
            # every factor is read in the forward and the backward pass, and once more if recomputed
            reads = 3 if form == "recompute" else 2
            row["bandwidth_floor_ms"] = (
                1000 * reads * gaussians.factors.numel() * 4 / HBM_BYTES_PER_S[card]
            )  # the basis, for lowrank
        return row

    def stats_row() -> dict:
        """The real `cafa stats` loop over the same batches, against plain no-grad inference."""
        artifacts.clear()
        model = timing_model(args.model, num_classes)
        model = model.to(device).eval()
        images = x.to(device)
        stream = [Batch(images, [i % C for i in range(args.batch)], [])] * args.stats_batches
        labels = torch.arange(C)

        def forward():
            with torch.no_grad():
                for batch in stream:
                    model(batch.images)

        def accumulate():
            accumulate_features(model, stream, labels, C, d, device)

        reset_peak(device)
        forward_s = timed(forward, device, 1, warmup=1) / args.stats_batches
        forward_peak = peak_bytes(device)
        reset_peak(device)
        stats_s = timed(accumulate, device, 1, warmup=1) / args.stats_batches
        return {
            "forward_images_per_s": args.batch / forward_s,
            "stats_images_per_s": args.batch / stats_s,
            "stats_over_forward": forward_s / stats_s,
            "forward_peak_bytes": forward_peak,
            "stats_peak_bytes": peak_bytes(device),
        }

    def statistics_for(method: str):
        return synthetic_gaussians(C, d, args.statistics) if method_class(method).needs_statistics else None

    # every row by its name in the JSON, in the order a run in one process times them
    plan: list[tuple[str, object]] = [(m, lambda m=m: measure_step(m)) for m in ("source", "bn", "tent")]
    plan += [(f"tent+{v}", lambda v=v: measure_step("tent", variant=v, name=f"tent+{v}")) for v in variants]
    own_rows = ("source", "bn", "tent", "cafa")
    others = {"all": [m for m in REGISTRY if m not in own_rows], "none": []}.get(args.methods, args.methods.split(","))
    plan += [(m, lambda m=m: measure_beside_tent(m, statistics_for(m))) for m in others]
    plan += [
        (f"{m} --norm {norm}", lambda m=m, norm=norm: measure_beside_tent(m, statistics_for(m), norm))
        for norm in filter(None, args.norms.split(","))
        for m in ("tent", "cafa")
    ]
    if args.tent_again:
        plan.append(("tent-again", lambda: measure_step("tent", name="tent-again")))
    for key in args.covariances.split(","):
        plan.append((f"cafa-{key}", lambda key=key: cafa_row(key)))
        plan += [(f"cafa-{key}+{v}", lambda key=key, v=v: cafa_row(key, v)) for v in variants]
    plan.append(("stats", stats_row))
    if args.rows:
        wanted = args.rows.split(",")
        unknown = [name for name in wanted if name not in dict(plan)]
        if unknown:
            raise SystemExit(
                f"--rows: no row {', '.join(unknown)} with these arguments; the rows are {', '.join(n for n, _ in plan)}"
            )
        plan = [(name, run) for name, run in plan if name in wanted]

    if args.trace and not args.child:
        Path(args.trace).write_text("")  # this run's tables only (a --fresh row's process adds its own)
    failed = {}
    for name, run in plan:
        if args.fresh and not args.child:
            with tempfile.TemporaryDirectory() as tmp:
                # the same arguments, and then this row alone into a file of its own (argparse takes the last of each)
                command = [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    *sys.argv[1:],
                    "--child",
                    "--rows",
                    name,
                    "--json",
                    f"{tmp}/row.json",
                ]
                done = subprocess.run(command, capture_output=True, text=True)
                if done.returncode:
                    failed[name] = done.stderr[-3000:]
                    print(
                        f"{name}: failed in its own process (exit {done.returncode}): "
                        f"{(done.stderr.strip().splitlines() or ['no message'])[-1]}",
                        flush=True,
                    )
                    continue
                child = json.loads(Path(f"{tmp}/row.json").read_text())
            row = child["stats"] if name == "stats" else child["steps"][name]
        else:
            row = run()
        if name == "stats":
            result["stats"] = row
            print(
                f"stats {row['stats_images_per_s']:.1f} img/s vs forward {row['forward_images_per_s']:.1f} img/s "
                f"(×{row['stats_over_forward']:.2f})",
                flush=True,
            )
        else:
            result["steps"][name] = row
            add_ratios(result["steps"])
            print(describe(name, row), flush=True)
        if args.between_rows == "clean" and not args.fresh:
            clean_state(device)
        if failed:
            result["failed"] = failed
        save()
    print(json.dumps(result, indent=2))
    if failed:
        raise SystemExit(f"rows that failed: {', '.join(failed)}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
