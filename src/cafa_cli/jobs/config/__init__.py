"""One settings object per job: every option, its default, its help, and its check.

`StatsConfig`, `AdaptConfig`, `BenchConfig` and `DemoConfig` are the single source of
defaults. The command line generates its options from their fields (cli/options.py),
cafa.toml sets the same names, and the Python API builds them directly:

    AdaptConfig(data=["ImageNet-C/fog/5"], lr=0.0025, optimizer="sgd", batch_size=64)

Construction checks every value that can be checked without a model or data, and
names a wrong one in backticks (`lr`), which the command line shows as `--lr`.
An option is its field, in the command's module (stats.py, adapt.py, bench.py, demo.py,
plot.py) or in an option group several share (settings.py, data.py), with its help, panel
and what the run's JSON records of it in the field's metadata; and the code that uses it.
checks.py has the checks they share.

This package imports neither torch nor the jobs, so that `cafa --help` stays fast.
"""

from cafa_cli.jobs.config.adapt import AdaptConfig
from cafa_cli.jobs.config.bench import BenchConfig
from cafa_cli.jobs.config.checks import command_line_only, names_code
from cafa_cli.jobs.config.demo import DemoConfig
from cafa_cli.jobs.config.plot import FeaturesPlotConfig
from cafa_cli.jobs.config.stats import StatsConfig

__all__ = [
    "AdaptConfig",
    "BenchConfig",
    "DemoConfig",
    "FeaturesPlotConfig",
    "StatsConfig",
    "command_line_only",
    "names_code",
]
