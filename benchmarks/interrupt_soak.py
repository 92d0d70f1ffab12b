"""Soak test for interruptions: `cafa adapt` with loader processes, signalled as a
terminal's Ctrl-C or a CI timeout would (SIGTERM/SIGINT to the whole process group)
once a few records are out, many times over. Every run must exit 130, end stderr with
"cafa: interrupted" and print no traceback. A race shows up once in dozens of runs,
which tests/test_interrupt.py (one run per case) would only catch now and then.

    .venv/bin/python benchmarks/interrupt_soak.py --runs 40 [--signal SIGINT]

Prints each failing run's exit code and stderr, then the count.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "assets")]

import tiny_net  # noqa: E402
import torch  # noqa: E402
from conftest import PLAIN, write_folder  # noqa: E402
from test_interrupt import SLOW_NET  # noqa: E402


def one_run(root: Path, folder: Path, sig: signal.Signals) -> tuple[int, str]:
    folder.mkdir()
    env = {**os.environ, "CAFA_TEST_MARKER": str(folder / "marker"), "CAFA_TEST_SLEEP": "0.4", "OMP_NUM_THREADS": "1"}
    args = [
        "adapt",
        "--model",
        f"{root / 'slow.py'}:build",
        "--weights",
        str(root / "net.pt"),
        *PLAIN,
        "--method",
        "tent",
        "--data",
        str(root / "train"),
        "--batch-size",
        "2",
        "--no-shuffle",
        "--num-workers",
        "2",
    ]
    with open(folder / "out", "wb") as out, open(folder / "err", "wb") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "cafa_cli", *args],
            stdout=out,
            stderr=err,
            env=env,
            cwd=folder,
            start_new_session=True,
        )
    while process.poll() is None:
        if (folder / "out").read_bytes().count(b"\n") >= 4:  # the header and three records
            os.killpg(process.pid, sig)
            break
        time.sleep(0.05)
    process.wait()
    return process.returncode, (folder / "err").read_text()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--signal", default="SIGTERM", choices=["SIGTERM", "SIGINT"])
    options = parser.parse_args()
    sig = signal.Signals[options.signal]
    with tempfile.TemporaryDirectory(prefix="cafa-interrupt-soak-") as tmp:
        root = Path(tmp)
        write_folder(root / "train", per_class=6)
        torch.manual_seed(0)
        torch.save(tiny_net.build().state_dict(), root / "net.pt")
        (root / "slow.py").write_text(SLOW_NET.format(assets=str(TESTS / "assets")))
        failed = 0
        for run in range(options.runs):
            code, stderr = one_run(root, root / f"run{run}", sig)
            if code != 130 or "Traceback" in stderr or not stderr.strip().endswith("cafa: interrupted"):
                failed += 1
                print(f"run {run}: exit {code}\n{stderr[-2000:]}")
        print(f"{failed} of {options.runs} runs failed ({options.signal} to the process group)")


if __name__ == "__main__":
    main()
