"""End-to-end speed of `cafa adapt` on an ImageNet-C-shaped domain, and JPEG decoding
on the CPU (loader workers, PIL) against batched GPU decoding (nvjpeg).

Builds a synthetic domain in the ImageNet-C layout — 1000 class folders of 224x224
JPEGs at quality 85 (random smooth images; the real data is not available here) —
and a synthetic low-rank artifact for a ResNet-50 with 1000 classes, then times the
real command, `python -m cafa_cli adapt ...`, as a subprocess (start-up included).

With --domains K, one `cafa adapt` process adapts K domains one after another (each from
the source model: --reset domain), the first one and K - 1 copies of it made of hard
links (other names, the same files: warm in the page cache, as a domain read twice is).
Each domain's loop time comes from --metrics-json; the marginal domain time is the
median of the domains after the first (what one more domain adds to a run, between-domain
resets aside, which count as outside the loop), and `imagenet_c_estimate_s` is what the
whole ImageNet-C (75 domains) would take at that rate: outside + first + 74 x marginal.

    python benchmarks/imagenet_c_speed.py --images 50000 --workers 14 --json speed.json
    python benchmarks/imagenet_c_speed.py --images 50000 --workers 14 --domains 3 --json speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))
from perf import synthetic_gaussians  # noqa: E402

from cafa_cli.api import Preprocessing, load_model, model_spec, parameters_sha256, write_artifact  # noqa: E402


def _write_class(args) -> int:
    root, c, per_class = args
    rng = np.random.default_rng(c)
    folder = Path(root) / f"n{c:08d}"
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(per_class):
        small = rng.integers(0, 255, size=(14, 14, 3), dtype=np.uint8)  # upsampled: JPEG-like content
        Image.fromarray(small).resize((224, 224), Image.BILINEAR).save(folder / f"{i:03d}.JPEG", quality=85)
    return per_class


def build_domain(root: Path, images: int, workers: int, classes: int) -> float:
    start = time.perf_counter()
    per_class = max(1, images // classes)
    with ProcessPoolExecutor(max(1, workers)) as pool:  # --workers 0 means no loader processes, not none to build
        list(pool.map(_write_class, [(str(root), c, per_class) for c in range(classes)]))
    return time.perf_counter() - start


# `cafa adapt` in-process under torch.profiler: argv is (this code, output file, the CLI's arguments)
TORCH_PROFILED = """
import runpy
import sys
import torch
from torch.profiler import ProfilerActivity, profile
out = sys.argv.pop(1)
activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
code = 0
with profile(activities=activities) as profiler:
    try:
        runpy.run_module("cafa_cli", run_name="__main__")  # python -m cafa_cli
    except SystemExit as done:
        code = done.code
table = profiler.key_averages().table
with open(out, "w") as f:
    if torch.cuda.is_available():
        f.write("== by device time\\n" + table(sort_by="self_device_time_total", row_limit=25) + "\\n")
    f.write("== by host time\\n" + table(sort_by="self_cpu_time_total", row_limit=25) + "\\n")
sys.exit(code)
"""


# other corruptions' names for the copies of the domain (--domains)
CORRUPTIONS = (
    "snow",
    "frost",
    "contrast",
    "brightness",
    "elastic_transform",
    "pixelate",
    "jpeg_compression",
    "gaussian_noise",
    "shot_noise",
    "impulse_noise",
    "defocus_blur",
    "glass_blur",
    "motion_blur",
    "zoom_blur",
)


def domain_copies(domain: Path, count: int) -> list[Path]:
    """`count` copies of the domain beside it (ROOT/<corruption>/5), of hard links: made in a
    second or two, no disk, and a copy left by an earlier run of another domain is made again."""
    if count > len(CORRUPTIONS):
        raise SystemExit(f"--domains: at most {len(CORRUPTIONS) + 1}")
    images = sorted(p.relative_to(domain) for p in domain.rglob("*.JPEG"))
    copies = []
    for name in CORRUPTIONS[:count]:
        copy = domain.parent.parent / name / domain.name
        if (
            not copy.is_dir()
            or sorted(p.relative_to(copy) for p in copy.rglob("*.JPEG")) != images
            or any(not (copy / i).samefile(domain / i) for i in images[:1])
        ):
            shutil.rmtree(copy, ignore_errors=True)
            shutil.copytree(domain, copy, copy_function=os.link)
        copies.append(copy)
    return copies


def timed_adapt(
    artifact: Path,
    domains: list[Path],
    workers: int,
    precision: str,
    batch: int,
    profile: Path | None = None,
    torch_profile: Path | None = None,
    cuda_graph: bool = True,
) -> dict:
    # under cProfile the main process's time splits into start-up, waiting on the loader
    # and waiting on the GPU (the loader processes are not profiled); torch.profiler
    # gives the kernels and the host's time per operator, synchronisations included
    if torch_profile:
        program = ["-c", TORCH_PROFILED, str(torch_profile / f"adapt-{precision}-torch.txt")]
    else:
        program = [
            *(["-m", "cProfile", "-o", str(profile / f"adapt-{precision}.prof")] if profile else []),
            "-m",
            "cafa_cli",
        ]
    metrics_json = domains[0].parent / f"m-{precision}-{'graph' if cuda_graph else 'eager'}.json"
    command = [
        sys.executable,
        *program,
        "adapt",
        "--stats",
        str(artifact),
        *(a for d in domains for a in ("--data", str(d))),
        "--batch-size",
        str(batch),
        "--optimizer",
        "sgd",
        "--lr",
        "0.0025",
        "--num-workers",
        str(workers),
        "--precision",
        precision,
        "--cuda-graph" if cuda_graph else "--no-cuda-graph",  # named either way: the figure says which ran
        "--quiet",
        "--metrics-json",
        str(metrics_json),
    ]
    start = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(done.stderr)
    metrics = json.loads(metrics_json.read_text())
    # outside the loop: start-up (imports, CUDA, model, artifact, listing the folder), shut-down,
    # and with several domains what lies between them (resetting the model, listing the next)
    row = {
        "precision": precision,
        "wall_s": wall,
        "images": metrics["n"],
        "loop_s": metrics["seconds"],
        "outside_loop_s": wall - metrics["seconds"],
        "images_per_s_wall": metrics["n"] / wall,
        "images_per_s_loop": metrics["n"] / metrics["seconds"],
        "domains": len(domains),
        "step_runner": metrics["settings"].get("step_runner"),
    }
    if len(domains) > 1:
        loops = [record["seconds"] for record in metrics["domains"]]
        row["domain_loop_s"] = loops
        row["marginal_domain_s"] = statistics.median(loops[1:])
        row["imagenet_c_estimate_s"] = row["outside_loop_s"] + loops[0] + 74 * row["marginal_domain_s"]
    return row


def decode_speed(domain: Path, workers: int, limit: int = 6400, batch: int = 64) -> dict:
    """Images/s: PIL in DataLoader workers (decode + to tensor, stacked into one batch as
    `cafa_cli.data` does) vs nvjpeg on the GPU (the workers only read the files' bytes).

    Each worker returns one tensor or plain bytes per batch: a list of 64 tensors would
    pass 64 file descriptors per batch between processes, which ran out of them on an H100
    machine (OSError: Bad file descriptor) and hung the loader."""
    from torch.utils.data import DataLoader
    from torchvision.io import decode_jpeg
    from torchvision.transforms.functional import pil_to_tensor

    paths = sorted(domain.rglob("*.JPEG"))[:limit]

    class PilImages(torch.utils.data.Dataset):
        def __len__(self):
            return len(paths)

        def __getitem__(self, i):
            with Image.open(paths[i]) as image:
                return pil_to_tensor(image.convert("RGB"))

    class RawBytes(PilImages):
        def __getitem__(self, i):
            return paths[i].read_bytes()

    def run(dataset, collate, decode):
        loader = DataLoader(dataset, batch_size=batch, num_workers=workers, collate_fn=collate, pin_memory=True)
        start = time.perf_counter()
        count = 0
        for items in loader:
            count += len(decode(items))
        torch.cuda.synchronize()
        return count / (time.perf_counter() - start)

    def nvjpeg(items):
        encoded = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in items]
        return torch.stack(decode_jpeg(encoded, device="cuda"))

    cpu = run(PilImages(), torch.stack, lambda images: images.cuda(non_blocking=True))
    # nvjpeg's first call sets up its handles and buffers: not part of the decoding rate
    nvjpeg([paths[0].read_bytes()])
    torch.cuda.synchronize()
    gpu = run(RawBytes(), list, nvjpeg)
    return {
        "cpu_pil_workers_images_per_s": cpu,
        "gpu_nvjpeg_images_per_s": gpu,
        "workers": workers,
        "images": len(paths),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=50000)
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--classes", type=int, default=1000, help="class folders (ImageNet-C: 1000)")
    parser.add_argument(
        "--precisions",
        default="fp32,bf16",
        help="one adapt run each, stepped by a CUDA graph; PRECISION+eager (bf16+eager) steps eagerly",
    )
    parser.add_argument(
        "--domains",
        type=int,
        default=1,
        help="domains adapted in one process (the first and copies of it): the marginal domain time",
    )
    parser.add_argument("--root", default="/tmp/imagenet-c-synthetic")
    parser.add_argument("--profile", type=Path, help="run each adapt under cProfile, writing adapt-PRECISION.prof here")
    parser.add_argument(
        "--torch-profile",
        type=Path,
        help="run each adapt under torch.profiler, writing its tables to adapt-PRECISION-torch.txt here",
    )
    parser.add_argument("--no-decode", action="store_true", help="skip the PIL vs nvjpeg comparison")
    parser.add_argument("--json")
    args = parser.parse_args()
    root = Path(args.root)
    domain = root / "fog" / "5"
    result = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "torch": torch.__version__}
    classes = args.classes
    wanted = max(1, args.images // classes) * classes
    if domain.is_dir() and (
        sum(1 for _ in domain.rglob("*.JPEG")) != wanted or sum(1 for _ in domain.iterdir()) != classes
    ):
        # built by an earlier run with another --images or --classes: timing it would time the wrong thing
        print(
            f"rebuilding {domain}: it holds another number of images than {wanted} or of classes than {classes}",
            flush=True,
        )
        shutil.rmtree(domain)
    if not domain.is_dir():
        print(
            f"building {wanted} JPEGs (one class folder each of {classes}) in {domain} with {args.workers} processes",
            flush=True,
        )
        result["build_s"] = build_domain(domain, args.images, args.workers, classes)
        print(f"built them in {result['build_s']:.1f} s", flush=True)
    artifact = root / "stats.safetensors"
    if not artifact.is_file() or "build_s" in result:  # a new domain may have other classes
        print(f"writing a synthetic {classes}-class low-rank artifact", flush=True)
        names = sorted(p.name for p in domain.iterdir())
        import torchvision
        from safetensors.torch import save_file

        weights = root / "resnet50-random.safetensors"
        net = torchvision.models.resnet50(num_classes=classes)
        save_file(net.state_dict(), str(weights))
        model = load_model("resnet50", str(weights), num_classes=classes)
        write_artifact(
            artifact,
            synthetic_gaussians(classes, 2048, "lowrank"),
            names,
            model_spec(model, "resnet50", str(weights), num_classes=classes),  # as cafa stats records it
            Preprocessing(None, None),
            {"synthetic": True},
            parameters_sha256(net),
        )
    domains = [domain, *domain_copies(domain, args.domains - 1)]
    result["adapt"] = []
    for run in args.precisions.split(","):
        precision, _, runner = run.partition("+")  # bf16+eager: the same, every step eager
        # a line before each stage, so that a run cut off by a time limit shows where it was
        print(f"adapt {run}: running cafa adapt over {len(domains)} domain(s) ...", flush=True)
        row = timed_adapt(
            artifact, domains, args.workers, precision, args.batch, args.profile, args.torch_profile, runner != "eager"
        )
        row["run"] = run
        result["adapt"].append(row)
        print(
            f"adapt {run}: {row['images']} images in {row['wall_s']:.1f} s wall "
            f"({row['loop_s']:.1f} s in the loop, {row['outside_loop_s']:.1f} s outside it; {row['images_per_s_wall']:.0f} img/s)",
            flush=True,
        )
        if "marginal_domain_s" in row:
            print(
                f"adapt {run}: each domain's loop {', '.join(f'{s:.1f}' for s in row['domain_loop_s'])} s; "
                f"marginal domain {row['marginal_domain_s']:.1f} s; 75 domains ~{row['imagenet_c_estimate_s']:.0f} s",
                flush=True,
            )
        if args.json:  # what is measured so far survives a later stage's time-out
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if torch.cuda.is_available() and not args.no_decode:
        print("decode: PIL in loader workers vs nvjpeg ...", flush=True)
        result["decode"] = decode_speed(domain, args.workers)
        print(
            f"decode: PIL in {args.workers} workers {result['decode']['cpu_pil_workers_images_per_s']:.0f} img/s, "
            f"nvjpeg {result['decode']['gpu_nvjpeg_images_per_s']:.0f} img/s",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
