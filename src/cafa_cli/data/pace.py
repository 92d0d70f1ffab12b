"""A stream that does not wait for the method (Alfarra et al., Evaluation of Test-Time
Adaptation Under Computational Time Constraints, ICML 2024).

The stream reveals a batch every R source-model forward passes (`stream_rate` R; `inf`,
the default, is a stream that waits, as every table before this protocol assumed). A method
whose step costs k forward passes is busy for k / R batch intervals after it starts one, so
the next ceil(k / R) - 1 batches arrive while it works: they are predicted by its latest
model without adapting, and the batch after them is adapted on. Their `eta` is 1 / R.

k comes from the method's `cost` in `cafa methods` (its step ÷ TENT's on the CPU) divided
by the source model's (a forward pass ÷ TENT's step): reproducible across machines; or is
`measured` in the run itself, each adapted batch's step time over a forward pass of the same
batch, as the authors' code does (real hardware, not reproducible); or is given. Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction

from cafa_cli.core.errors import UsageError
from cafa_cli.core.numbers import LEAST_POSITIVE, MOST_NUMBER

WAITS = math.inf
# a batch every million forward passes is a stream that waits (above it, say inf); one every
# millionth of one is a stream no method keeps up with, and below it k / R overflows
LEAST_RATE, MAX_RATE = LEAST_POSITIVE, MOST_NUMBER
MAX_COST = MOST_NUMBER  # a step of a million forward passes: far beyond any method (memo is ~240)
STEP_COST_FORMS = "table, measured, a number K, or METHOD=K pairs (e.g. cotta=100,tent=4; the rest: K or the table)"
# ceil(k / R) of two decimals that should divide exactly (0.3 / 0.1) must not round up a batch
_EXACT = 1e-9


def parse_stream_rate(text: str | float, name: str = "stream_rate") -> float:
    """'inf' -> inf (the stream waits); '1', '0.5', '1/4' -> that R, a batch every R forward passes."""
    raw = str(text).strip()
    if raw.lower() in ("inf", "infinity"):
        return WAITS
    try:
        rate = float(Fraction(raw)) if "/" in raw else float(raw)
    except (ValueError, ZeroDivisionError, OverflowError):
        rate = math.nan
    if not LEAST_RATE <= rate <= MAX_RATE:  # NaN fails too
        raise UsageError(
            f"`{name}` must be a number of forward passes between two batches, R from 0.000001 to 1,000,000 (e.g. "
            f"1, 1/2, 0.25), or inf for a stream that waits; not {text!r}"
        )
    return rate


def parse_stream_rates(text: str, name: str = "stream_rates") -> list[float]:
    """A bench axis: '1,1/2,inf' -> [1.0, 0.5, inf], each once."""
    rates = [parse_stream_rate(part, name) for part in str(text).split(",")]
    if len(set(rates)) < len(rates):
        raise UsageError(f"`{name}` {text!r} gives a rate twice; give each once")
    return rates


def rate_label(rate: float) -> str:
    """How a table and the JSON name a rate: inf, 1, 1/2, 0.3."""
    if rate == WAITS:
        return "inf"
    exact = Fraction(rate).limit_denominator(64)
    return str(exact) if abs(float(exact) - rate) < 1e-12 else f"{rate:g}"


def parse_step_cost(text: str, name: str = "step_cost") -> tuple[str, dict[str | None, float]]:
    """'table' -> ('table', {}); 'measured' -> ('measured', {}); '3' -> ('given', {None: 3.0});
    'cotta=100,4' -> ('given', {'cotta': 100.0, None: 4.0}): None is every other method's (else the table's)."""
    raw = str(text).strip()
    if raw in ("table", "measured"):
        return raw, {}
    given: dict[str | None, float] = {}
    for part in raw.split(","):
        method, equals, number = part.strip().rpartition("=")
        if equals and not method.strip():
            break
        key = method.strip() if equals else None
        try:
            cost = float(number)
        except ValueError:
            break
        if not LEAST_POSITIVE <= cost <= MAX_COST or key in given:
            break
        given[key] = cost
    else:
        return "given", given
    raise UsageError(
        f"`{name}` must be {STEP_COST_FORMS} (K in forward passes of the source model, from 0.000001 to "
        f"1,000,000, each method once), not {text!r}"
    )


@dataclass
class Pace:
    """Which batches a method adapts on in a stream at `rate` (module docstring). `cost`:
    k for every step, or None to measure each step's (`step_done(k)`)."""

    rate: float = WAITS
    cost: float | None = None
    cost_from: str = "table"  # where `cost` came from: table or given (None: measured)
    busy: int = 0  # batches still to come while the method works on the last one
    costs: list[float] = field(default_factory=list)  # k of each adapted batch
    twin: object = None  # `measured`: the copy of the network a forward pass is timed on (the stream makes it)

    @property
    def waits(self) -> bool:
        return self.rate == WAITS

    def adapts(self) -> bool:
        """Whether the method is free when this batch arrives; if not, it counts the batch as
        arrived while busy (predict it without adapting)."""
        if self.busy == 0:
            return True
        self.busy -= 1
        return False

    def step_done(self, measured: float | None = None) -> None:
        """The method started a step when its batch arrived: it is busy for ceil(k / R) - 1 more batches."""
        k = self.cost if measured is None else measured
        self.costs.append(k)
        self.busy = max(0, math.ceil(k / self.rate - _EXACT) - 1)

    def restart(self) -> None:
        """A new stream (the model back at the source at a domain's start): the method is free."""
        self.busy = 0

    def cost_source(self) -> str:
        return "measured (the mean over the adapted batches)" if self.cost is None else self.cost_from

    def mean_cost(self) -> float | None:
        return sum(self.costs) / len(self.costs) if self.costs else None
