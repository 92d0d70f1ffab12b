"""FOA's and DPCore's steps beside TENT's on a small timm ViT: time and peak memory, each method in
a process of its own (so that one's allocations never count toward the other's peak).

DPCore runs its recipe's optimiser (AdamW, lr 0.1) and --dpcore-steps steps for a new domain;
its warm-up step is a new domain's batch (timed on its own: `first_ms`), the timed steps, of
the same images, a known domain's (`coreset` says how many entries the coreset ended with: 1).
The test images are the source's noise shifted (×1.5 + 0.3), a gap the prompts can close.

Peak memory is taken over a warm-up step (FOA's first step also makes its source
statistics) and --steps steps, from the Adapter as built: on the CPU the peak RSS (VmHWM,
reset through /proc/self/clear_refs as perf.py does) minus the RSS before the first step
(memory a step frees stays in the process, so a peak reset after a warm-up step misses
it); on CUDA torch.cuda.max_memory_allocated minus the memory allocated then. Time is over
the --steps steps after the warm-up. Random weights and
synthetic images (memory and time do not depend on them).

    python benchmarks/foa_memory.py --batch 64 --json foa-memory.json
    python benchmarks/foa_memory.py --batch 64 --methods tent,dpcore --json dpcore.json
    python benchmarks/foa_memory.py --img 224 --patch 16 --depth 12 --dim 192 --heads 3 --batch 16
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from perf import peak_bytes, reset_peak, sync  # noqa: E402

from cafa_cli.api import Adapter, FeatureClassifier, create, pick_device  # noqa: E402


def current_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.memory_allocated()
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def vit(args) -> torch.nn.Module:
    """The ViT of these figures (by default the tiny one of FOA's and DPCore's fidelity tests), random weights."""
    import timm

    shape = dict(img_size=args.img, patch_size=args.patch, depth=args.depth, embed_dim=args.dim, num_heads=args.heads)
    return timm.create_model("vit_tiny_patch16_224", num_classes=args.classes, **shape).eval()


def vit_setting(args, method: str, device: torch.device) -> tuple[dict, dict]:
    """The method's options and Adapter settings here: FOA's and DPCore's source images (two
    batches of the source's noise) and DPCore's recipe optimiser; every other method lr 0.001."""
    source = [torch.randn(args.batch, 3, args.img, args.img, device=device) for _ in range(2)]
    if method == "foa":
        return {"statistics_batches": source, "population": args.population}, {"lr": 0.001}
    if method == "dpcore":  # random weights: every source image counts as confident
        settings = {"optimizer": "adamw", "lr": 0.1, "steps": args.dpcore_steps}
        return {"statistics_batches": source, "source_margin": 1.0}, settings
    return {}, {"lr": 0.001}


def measure(args, method: str) -> dict:
    device = pick_device(args.device)
    torch.manual_seed(0)
    model = vit(args)
    # shifted from the source images, so that DPCore's prompts close a gap and its later steps are a known domain's
    images = torch.randn(args.batch, 3, args.img, args.img, device=device) * 1.5 + 0.3
    options, settings = vit_setting(args, method, device)
    made = create(method, None, device, **options)
    adapter = Adapter(FeatureClassifier(model), made, device, **settings)
    sync(device)
    reset_peak(device)
    before = current_bytes(device)
    start = time.perf_counter()
    adapter.step(images)  # warm-up (FOA, DPCore: their source statistics too), in the peak: memory freed after
    # a step stays in the process (the allocator keeps it), so a peak taken after it would miss it
    sync(device)
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(args.steps):
        adapter.step(images)
    sync(device)
    seconds = (time.perf_counter() - start) / args.steps
    row = {"method": method, "ms": 1000 * seconds, "first_ms": 1000 * first, "base": before}
    row["peak_delta_bytes"] = peak_bytes(device) - before
    if method == "dpcore":
        row["coreset"] = len(made.coreset_means)
    return row


def vit_arguments(parser: argparse.ArgumentParser) -> None:
    """The ViT's shape and FOA's and DPCore's settings (method_memory.py takes them too)."""
    parser.add_argument("--img", type=int, default=32)
    parser.add_argument("--patch", type=int, default=8)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--population", type=int, default=27, help="FOA's K (the authors' 27)")
    parser.add_argument("--dpcore-steps", type=int, default=50, help="DPCore's steps on a new domain (recipe: 50)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    vit_arguments(parser)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--methods", default="tent,foa")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args, args.child)))
        return
    passed = [a for a in sys.argv[1:] if a != "--json" and not a.endswith(".json")]
    rows = []
    for method in args.methods.split(","):
        out = subprocess.run([sys.executable, __file__, *passed, "--child", method], capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"{method}: {out.stderr.strip().splitlines()[-1]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    tent = next((row for row in rows if row["method"] == "tent"), None)
    for row in rows:
        ratio = f"{row['ms'] / tent['ms']:.2f}x TENT" if tent else ""
        first = f"first step {row['first_ms'] / tent['ms']:.2f}x TENT" if tent else ""
        print(
            f"{row['method']:6s} {row['ms']:9.1f} ms/step {ratio:>12s}  peak +{row['peak_delta_bytes'] / 2**20:8.1f} MiB"
            f"  {first}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
