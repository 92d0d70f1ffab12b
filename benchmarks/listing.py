"""How long `cafa` takes to list an image folder: `open_domain` on an ImageNet-C-shaped
tree of empty .JPEG files (1000 class folders; listing reads no pixels), best of
--repeats runs.

    python benchmarks/listing.py --images 50000
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from cafa_cli.api import open_domain


def build(root: Path, images: int, classes: int = 1000) -> None:
    for c in range(classes):
        folder = root / f"n{c:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(images // classes):
            (folder / f"{i:03d}.JPEG").touch()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=50000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--root", default="/tmp/cafa-listing-bench")
    args = parser.parse_args()
    root = Path(args.root) / str(args.images)
    if not root.is_dir():
        build(root, args.images)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        domain = open_domain(str(root))
        times.append(time.perf_counter() - start)
    print(f"listed {len(domain)} images: best {min(times):.3f} s, median {sorted(times)[len(times) // 2]:.3f} s")


if __name__ == "__main__":
    main()
