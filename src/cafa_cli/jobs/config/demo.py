"""`cafa demo`'s settings: the Fashion-MNIST-C it builds and what it runs on it."""

from __future__ import annotations

from dataclasses import dataclass

from cafa_cli.core.errors import UsageError
from cafa_cli.engine.options import AdapterSettings
from cafa_cli.jobs.config.checks import parse_severities
from cafa_cli.jobs.config.settings import ADAPTATION, DATA, DEMO_CORRUPTIONS, METHOD, OUTPUT, setting

# why the run's JSON does not keep `max_error` (the exit code, 4, is cli/errors.EXIT_ABOVE_MAX_ERROR)


@dataclass(kw_only=True)
class DemoConfig:
    """`cafa demo`: Fashion-MNIST-C built from Debian's package, then stats, adapt and a table."""

    workdir: str = setting(
        "cafa-demo",
        "Where the data and artifacts go (re-used on a second run).",
        metavar="DIR",
        panel=OUTPUT,
        brief=True,
        recorded="where the statistics are kept, by content",
    )
    corruptions: str = setting(
        DEMO_CORRUPTIONS,
        "Comma-separated corrupt-tta corruptions, or 'all' (the 15 of ImageNet-C).",
        metavar="NAME,...",
        panel=DATA,
        brief=True,
    )
    severity: int = setting(
        3,
        "Corruption severity 1-5.",
        metavar="N",
        panel=DATA,
        brief=True,
        recorded="resolved: with the named benchmarks' default filled in",
    )
    severities: str | None = setting(
        None,
        "With --data-only: build each of these severities, comma-separated (1,2,3,4,5 "
        "for cafa bench --severities), in place of --severity.",
        metavar="N,...",
        panel=DATA,
        show_default=False,
    )
    train_per_class: int = setting(300, "Training images per class for the statistics.", metavar="N", panel=DATA)
    test_per_class: int = setting(300, "Test images per class and domain (0: all 1,000).", metavar="N", panel=DATA)
    methods: str = setting(
        "source,bn,tent,cafa",
        "Methods to compare.",
        metavar="M,...",
        panel=METHOD,
        brief=True,
        names_code=True,
        recorded="resolved: the rows, each with its method and settings",
    )
    batch_size: int = setting(200, "Images per adaptation batch.", metavar="N", panel=ADAPTATION)
    lr: float = setting(AdapterSettings.lr, "Learning rate.", metavar="LR", panel=ADAPTATION)
    seed: int = setting(0, "Seed of the data, the subset and the stream.", metavar="N", panel=ADAPTATION)
    data_only: bool = setting(
        False, "Only build the image folders (e.g. the full set for cafa bench).", panel=OUTPUT, brief=True
    )
    fashion_mnist: str | None = setting(
        None,
        "Folder with the Fashion-MNIST idx files (default: $CAFA_FASHION_MNIST, "
        "else /usr/share/datasets/fashion-mnist).",
        metavar="DIR",
        panel=DATA,
    )

    def severity_list(self) -> list[int]:
        """The severities to build: `severities` (with `data_only`), else `severity` alone."""
        if self.severities is None:
            return [self.severity]
        if not self.data_only:
            raise UsageError(
                f"`severities` builds the test folders of several severities, with `data_only`; then compare "
                f"them with cafa bench fashion-mnist-c:{self.workdir}/fashion-mnist-c-N --severities "
                f"{self.severities}"
            )
        return parse_severities(self.severities, "severities")
