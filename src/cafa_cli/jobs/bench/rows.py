"""The rows of a bench table: a method, a covariance variant or a method at its own
learning rate (with `oracle`, each class-aware row's CAFA-Oracle twin after it), each under
every condition of the grid's axes (stream order, batch size, severity), or, on a
fraction sweep, each row with statistics at every training fraction."""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import product

from cafa_cli.core.errors import UsageError, repeated
from cafa_cli.jobs.config import BenchConfig
from cafa_cli.jobs.config.settings import oracle_methods
from cafa_cli.methods import REGISTRY, is_plugin, method_class

# Bench rows beyond the plain methods, as (method, covariance, params): the paper's
# ablations CAFA-Tied, CAFA-Diag (its "variance") and CAFA-Full (every feature-extractor
# parameter updated), and CAFA with the dense or low-rank form forced. The plain
# methods that need statistics use `auto`, as `cafa stats` does by default.
VARIANTS = {
    "cafa-tied": ("cafa", "tied", None),
    "cafa-diag": ("cafa", "diag", None),
    "cafa-full": ("cafa", "auto", "all"),
    "cafa-dense": ("cafa", "full", None),
    "cafa-lowrank": ("cafa", "lowrank", None),
}


@dataclass(frozen=True)
class Row:
    label: str  # as shown in the table
    method: str  # passed to cafa adapt --method
    covariance: str | None  # artifact needed, or None
    lr: float | None = None  # this row's learning rate, when it differs from --lr
    params: str | None = None  # this row's --params, when it differs from the bench's
    order: str | None = None  # this row's --order, on a grid with an order axis
    stream_rate: str | None = None  # this row's --stream-rate, on a grid with a stream-rate axis
    batch_size: int | None = None  # this row's --batch-size, on a grid with a batch-size axis
    severity: int | None = None  # this row's --severity, on a grid with a severity axis
    outlier_share: float | None = None  # this row's share of --outliers, on a grid with an outlier-share axis
    condition: str = (
        ""  # its order, batch size and severity as the table names them ("label-shift:0.5, batch 8"), on such a grid
    )
    oracle: bool = False  # CAFA-Oracle: the true labels in the class-aware loss
    fraction: float | None = None  # the training fraction of its statistics, on a fraction sweep
    option: str | None = None  # a method option of its own, NAME=VALUE, under `select` of a method option
    candidate_of: str | None = None  # under `select`: the row it is a candidate value of (`tent`)
    candidate: float | None = None  # and the value it runs at

    def lr_of(self, config: BenchConfig) -> float:
        return self.lr or config.lr

    def params_of(self, config: BenchConfig) -> str:
        return self.params or config.params

    def order_of(self, config: BenchConfig) -> str:
        return self.order or config.order

    def stream_rate_of(self, config: BenchConfig) -> str:
        return self.stream_rate or config.stream_rate

    def batch_size_of(self, config: BenchConfig) -> int:
        return self.batch_size or config.batch_size

    def severity_of(self, config: BenchConfig) -> int | None:
        return self.severity or config.severity

    def outliers_of(self, config: BenchConfig) -> str | None:
        """Its `outliers`: the bench's, at this row's share on an outlier-share axis."""
        if self.outlier_share is None:
            return config.outliers
        return f"{config.outlier_source()[0]}:{self.outlier_share!r}"

    @property
    def statistics(self) -> tuple[str, float | None] | None:
        """The artifact it reads, as (covariance, training fraction on a sweep); None: none."""
        return (self.covariance, self.fraction) if self.covariance else None

    @property
    def name(self) -> str:
        """The --methods entry the row runs, without its condition."""
        return self.label[: -len(self.condition) - 2] if self.condition else self.label


def grid_rows(config: BenchConfig, rows: list[Row]) -> list[Row]:
    """Every method row under every (order, stream rate, batch size, outlier share, severity) of the
    grid's axes, condition by condition: `tent, batch 8`, `tent, rate 1/2`, `tent, outliers 0.2`.
    Without axes, the rows as they are."""
    if not config.grid_axes():
        return rows
    grid = []
    for order, rate, batch_size, share, severity in product(
        config.order_list(),
        config.stream_rate_list(),
        config.batch_size_list(),
        config.outlier_share_list(),
        config.severity_list(),
    ):
        named = (
            [order] * (config.orders is not None)
            + [f"rate {rate}"] * (config.stream_rates is not None)
            + [f"batch {batch_size}"] * (config.batch_sizes is not None)
            + [f"outliers {share}"] * (config.outlier_shares is not None)
            + [f"severity {severity}"] * (config.severities is not None)
        )
        condition = ", ".join(named)
        grid += [
            replace(
                row,
                label=f"{row.label}, {condition}",
                order=order,
                stream_rate=rate if config.stream_rates is not None else None,
                # only an axis is the row's own choice: else the row's recipe sizes its batches
                batch_size=batch_size if config.batch_sizes is not None else None,
                outlier_share=share if config.outlier_shares is not None else None,
                severity=severity if config.severities is not None else None,
                condition=condition,
            )
            for row in rows
        ]
    return grid


def with_fractions(config: BenchConfig, rows: list[Row]) -> list[Row]:
    """On a fraction sweep, each row that reads statistics at every fraction, fraction by
    fraction (`cafa, fraction 0.01`, then `cafa-oracle, fraction 0.01`); a row without
    statistics once, in its place in the first fraction's rows: its error does not
    depend on the fraction. Without a sweep, the rows as they are."""
    if config.fractions is None:
        return rows
    if not any(row.covariance for row in rows):
        raise UsageError(
            f"`fractions` computes the statistics at each fraction, and no row of `methods` {config.methods} reads "
            f"them; add a row that does (cafa, intra, ...)"
        )
    swept = []
    for k, fraction in enumerate(config.fraction_list()):
        condition = f"fraction {fraction}"  # as Python writes it: two fractions never share a name
        swept += [
            replace(row, label=f"{row.label}, {condition}", fraction=fraction, condition=condition)
            if row.covariance
            else row
            for row in rows
            if row.covariance or k == 0
        ]
    return swept


def with_oracle(config: BenchConfig, rows: list[Row]) -> list[Row]:
    """Under `oracle`, each row whose method's loss uses the predicted class followed by its
    CAFA-Oracle twin (`cafa-oracle`, `cafa-tied-oracle@0.01`), so that one table compares
    them; refused when no row has one. A plug-in's row gets none (its method is known
    only when it is made)."""
    if not config.oracle:
        return rows
    takers = oracle_methods()
    takes = [row for row in rows if row.method in takers]
    if not takes:
        raise UsageError(
            f"`oracle` adds a CAFA-Oracle row after each row whose loss uses the predicted class "
            f"({', '.join(takers)}, and cafa's variants); `methods` {config.methods} has none"
        )
    twins = []
    for row in rows:
        twins.append(row)
        if row in takes:
            name, at, lr = row.label.partition("@")
            twins.append(replace(row, label=f"{name}-oracle{at}{lr}", oracle=True))
    return twins


def with_norm_statistics(config: BenchConfig, rows: list[Row]) -> list[Row]:
    """Under `norm` class-balanced every row reads the class moments of the BatchNorms' inputs
    from an artifact: a row without statistics of its own takes the `auto` one."""
    if not config.norm.class_balanced:
        return rows
    return [row if row.covariance else replace(row, covariance="auto") for row in rows]


def parse_methods(text: str) -> list[Row]:
    """`tent,cafa-tied,cafa@0.01`: a method, a covariance variant or a plug-in
    (`file.py:factory`, given the statistics as `cafa adapt` gives them), optionally `@lr`;
    `all`: every method that runs on any classifier, and every variant (those also named, e.g.
    `all,tent@0.01`, keep their place); the CLIP methods and those that need a ViT's tokens (foa),
    which refuse other models, by name."""
    rows = []
    labels = [m.strip() for m in text.split(",") if m.strip()]
    if "all" in labels:  # every method, then every variant, in place of `all`
        at = labels.index("all")
        named = {label.partition("@")[0] for label in labels}
        everything = [name for name in REGISTRY if method_class(name).on_any_classifier()] + list(VARIANTS)
        labels[at : at + 1] = [name for name in everything if name not in named]
    for label in labels:
        name, at, lr_text = label.rpartition("@") if "@" in label else (label, "", "")  # a plug-in's path may hold an @
        if at and not lr_text:
            raise UsageError(f"`methods`: {label!r}: give the learning rate after @ (e.g. {name}@0.001), or drop the @")
        if name in VARIANTS:
            method, covariance, params = VARIANTS[name]
        elif name in REGISTRY:
            method, covariance, params = name, "auto" if method_class(name).needs_statistics else None, None
        elif is_plugin(name):
            method, covariance, params = name, "auto", None
        else:
            raise UsageError(
                f"`methods`: unknown method {name!r}; choose from {', '.join((*REGISTRY, *VARIANTS))}, "
                f"or give a plug-in 'file.py:factory'"
            )
        try:
            lr = float(lr_text) if lr_text else None
        except ValueError:
            raise UsageError(f"`methods`: {label!r}: the learning rate after @ is not a number") from None
        if lr is not None and not 0 < lr < float("inf"):
            raise UsageError(f"`methods`: {label!r}: the learning rate after @ must be a positive number")
        rows.append(Row(label, method, covariance, lr, params))
    if not rows:
        raise UsageError("`methods` names no method")
    twice = repeated([row.label for row in rows])
    if twice:  # the same row twice would be run twice and fill one line of the table
        raise UsageError(f"`methods` names {twice[0]} twice; give each row once")
    return rows
