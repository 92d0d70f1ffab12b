"""`cafa demo`: CAFA on real images with nothing but this package and Debian's
Fashion-MNIST — build the data, compute statistics, adapt, print a table.

It runs `cafa stats` and `cafa adapt` through the same functions as the CLI and
prints their command lines, so every number can be reproduced by hand.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from cafa_cli.jobs.bench import BenchPlan, Sampling, artifact_path, covariances_needed, parse_methods, run_bench
from cafa_cli.jobs.tables import markdown, summarise
from cafa_cli.data.fashion_mnist import check_installed
from cafa_cli.data.fmnist_c import build_corrupted, build_training_subset, check_corruptions
from cafa_cli.files import make_workdir
from cafa_cli.jobs.adapt import AdaptSettings
from cafa_cli.jobs.inputs import DataChoice, ModelChoice
from cafa_cli.jobs.monitor import Monitor


MODEL = "fmnist-resnet"


@dataclass(frozen=True)
class DemoPlan:
    # one corruption of each ImageNet-C family: noise, blur, weather, digital
    corruptions: tuple[str, ...] = ("gaussian_noise", "defocus_blur", "frost", "contrast")
    severity: int = 3
    train_per_class: int = 300
    test_per_class: int | None = 300
    methods: str = "source,bn,tent,cafa"
    batch_size: int = 200
    lr: float = 1e-3
    seed: int = 0


def command_line(*words) -> str:
    return " ".join(shlex.quote(str(w)) for w in words)


def run_demo(workdir: str | Path, plan: DemoPlan = DemoPlan(), root: str | None = None, monitor: Monitor | None = None, echo=print) -> str:
    """Returns the results table (markdown); `echo` receives the command lines run."""
    monitor = monitor or Monitor()
    rows = parse_methods(plan.methods)
    check_corruptions(list(plan.corruptions), plan.severity, plan.test_per_class)
    check_installed(root)
    workdir = make_workdir(workdir)
    monitor.info(f"building data in {workdir} (re-used when already there)")
    train = build_training_subset(workdir, plan.train_per_class, plan.seed, root)
    domains = [
        str(p)
        for p in build_corrupted(workdir, list(plan.corruptions), plan.severity, plan.test_per_class, plan.seed, root,
                                 on_domain=lambda name: monitor.info(f"corrupting test images: {name}"))
    ]
    for covariance in covariances_needed(rows):
        echo(command_line("cafa", "stats", "--model", MODEL, "--data", train, "--fraction", 1, "--seed", plan.seed,
                          "--covariance", covariance, "--out", artifact_path(workdir, covariance)))
    settings = AdaptSettings(batch_size=plan.batch_size, lr=plan.lr, seed=plan.seed)
    data_args = [w for d in domains for w in ("--data", d)]
    for row in rows:
        stats_args = ["--stats", artifact_path(workdir, row.covariance)] if row.covariance else ["--model", MODEL]
        echo(command_line("cafa", "adapt", *stats_args, *data_args, *row.settings(settings).options()))
    bench = BenchPlan(rows, domains, [plan.seed], settings, ModelChoice(MODEL), str(train), DataChoice(), DataChoice(),
                      Sampling(fraction=1.0, seed=plan.seed), workdir)
    results = run_bench(bench, monitor)
    return markdown(summarise(results, rows, domains, [plan.seed]), domains, [plan.seed])
