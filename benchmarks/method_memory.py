"""Each method's peak memory, the figure `cafa methods` shows beside its cost (`memory_mib` in
its recipe file's [method] table).

The figure is the memory a method takes beyond the model as loaded: the peak from building its
Adapter (the source weights every Adapter keeps, a method's copies of the model, its banks and
optimiser state) through a warm-up step and --steps steps, over the memory just before that
build. Before it, the model and the batch (and the method's data: synthetic class statistics, as
perf.py's, for a method that needs them; FOA's and DPCore's source images) are made, and a
throwaway Adapter of the same method on a copy of the model takes one step, so that the imports
a first step makes (torch._dynamo's, about 120 MiB, at an optimiser's first step; cma's), the
libraries' first-call allocations and autograd's threads count toward no method. On the CPU the
heap's free pages are then handed back (malloc_trim), so that a step cannot hide in pages the
throwaway left resident. CPU: peak RSS (VmHWM, reset through /proc/self/clear_refs, perf.py's)
minus RSS; CUDA: torch.cuda.max_memory_allocated minus memory_allocated. So `source`'s figure is
its forward pass's (and the source weights' copy), and a method's figure less source's is what
adapting adds to inference.

Each method runs in a process of its own (nothing another left counts toward it), --runs times;
the figure is the median, in MiB. Methods run with their own defaults (perf.py's cost does too);
eata without source images is eta's step, as in the cost.

--model names the model: an architecture perf.py times (fmnist-resnet, the cost's model:
--size 28 --channels 1), `tiny-vit` (foa_memory.py's ViT, on which FOA's and DPCore's costs are
measured; its shape from foa_memory.py's options) or `tiny-clip` (the tests' open_clip model:
two layers, 16 x 16 input, random weights). --methods all is every registered method that runs
on it and is measured there: on a CNN those that run on any classifier, on tiny-vit those that
need a ViT's tokens, on tiny-clip the CLIP methods; name others (source, tent) beside them.

    python benchmarks/method_memory.py --runs 3 --json memory.json
    python benchmarks/method_memory.py --model tiny-vit --methods source,tent,all --runs 3
    python benchmarks/method_memory.py --model tiny-clip --methods source,all --runs 3
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from foa_memory import current_bytes, vit, vit_arguments, vit_setting  # noqa: E402
from perf import (  # noqa: E402
    model_arguments,
    peak_bytes,
    reset_peak,
    sync,
    synthetic_gaussians,
    timing_model,
    whole_cycles,
    with_gate_open,
)

from cafa_cli.api import REGISTRY, Adapter, FeatureClassifier, create, method_class, pick_device  # noqa: E402

MODELS_OF_THEIR_OWN = {"tiny-vit": "needs_tokens", "tiny-clip": "needs_clip"}  # the methods measured on each


def measured_here(model: str, method: str) -> bool:
    """Whether `method`'s figure is measured on `model` (--methods all)."""
    kind = MODELS_OF_THEIR_OWN.get(model)
    return getattr(method_class(method), kind) if kind else method_class(method).on_any_classifier()


def tiny_clip(classes: int) -> torch.nn.Module:
    """The tests' tiny open_clip model (tests/helpers.py tiny_clip) as a zero-shot classifier of `classes`."""
    import open_clip

    # internal: the zero-shot head cafa builds for a CLIP model (load_model's, which needs a checkpoint)
    from cafa_cli.model.clip import ClassTexts, zero_shot_classifier

    clip = open_clip.CLIP(
        embed_dim=16,
        vision_cfg=dict(image_size=16, layers=2, width=32, patch_size=8, head_width=16),
        text_cfg=dict(context_length=16, vocab_size=49408, width=32, heads=2, layers=2),
    ).eval()
    texts = ClassTexts(clip, open_clip.get_tokenizer("ViT-B-32", context_length=16), tuple(map(str, range(classes))))
    return zero_shot_classifier(clip, texts)


def hand_back_free_heap() -> None:
    """glibc keeps freed small blocks resident; return them, so that the peak counts what a step touches."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the figure may then read low by what the forward pass left
        pass


def measure(args, method: str) -> int:
    """`method`'s peak bytes above the loaded model (the module docstring)."""
    device = pick_device(args.device)
    torch.manual_seed(0)
    options, settings = {}, {"precision": args.precision}
    if args.model == "tiny-vit":
        model, size, channels = FeatureClassifier(vit(args)), args.img, 3
        options, given = vit_setting(args, method, device)  # FOA's and DPCore's source images: data, as a model is
        settings.update(given)
    elif args.model == "tiny-clip":
        model, size, channels = FeatureClassifier(tiny_clip(args.classes)), 16, 3
    else:
        num_classes = None if args.model == "fmnist-resnet" else args.classes
        model, size, channels = timing_model(args.model, num_classes), args.size, args.channels
    model = model.to(device)
    images = torch.randn(args.batch, channels, size, size, device=device)
    needs = method_class(method).needs_statistics
    gaussians = synthetic_gaussians(model.num_classes, model.feature_dim, "full") if needs else None
    # a throwaway Adapter of the method on a copy, one step: the imports it makes (cma, augmentations),
    # the libraries' first-call allocations and autograd's threads, which count toward no figure
    warm = Adapter(
        copy.deepcopy(model), create(method, gaussians, device, **with_gate_open(method, options)), device, **settings
    )
    warm.step(images)
    del warm
    gc.collect()
    hand_back_free_heap()
    sync(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    reset_peak(device)
    before = current_bytes(device)
    adapter = Adapter(model, create(method, gaussians, device, **with_gate_open(method, options)), device, **settings)
    for _ in range(1 + whole_cycles(adapter, args.steps, args.batch)):  # a warm-up step, then --steps
        adapter.step(images)
    sync(device)
    return peak_bytes(device) - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arguments(parser)
    vit_arguments(parser)
    parser.set_defaults(model="fmnist-resnet", batch=64, size=28, channels=1, device="cpu")
    parser.add_argument("--methods", default="all", help="comma-separated; `all` (see above) may be one of them")
    parser.add_argument("--steps", type=int, default=3, help="steps after the warm-up step")
    parser.add_argument("--runs", type=int, default=3, help="processes per method; the figure is their median")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    if args.child:
        print(measure(args, args.child))
        return
    methods = []
    for name in args.methods.split(","):
        methods += [m for m in REGISTRY if measured_here(args.model, m)] if name == "all" else [name]
    passed = [a for a in sys.argv[1:] if a != "--json" and not a.endswith(".json")]
    here = Path(__file__).parent
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True).stdout.strip()
    rows = {}
    for method in dict.fromkeys(methods):
        runs = []
        for _ in range(args.runs):
            done = subprocess.run(
                [sys.executable, __file__, *passed, "--child", method], capture_output=True, text=True
            )
            if done.returncode:
                sys.exit(f"{method}: {(done.stderr.strip().splitlines() or ['no message'])[-1]}")
            runs.append(int(done.stdout.strip().splitlines()[-1]) / 2**20)
        rows[method] = {"mib": statistics.median(runs), "runs": runs}
        print(f"{method:14s} {rows[method]['mib']:8.1f} MiB   runs {', '.join(f'{r:.1f}' for r in runs)}", flush=True)
        if args.json:  # after every method: a run cut off keeps what it measured
            settings = {k: v for k, v in vars(args).items() if k not in ("child", "json")}
            record = {"settings": settings, "commit": commit, "torch": torch.__version__}
            record["threads"] = torch.get_num_threads()
            Path(args.json).write_text(json.dumps({**record, "methods": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
