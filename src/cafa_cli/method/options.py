"""The method's options by name: the Adapter's keywords and their checks, and the
covariance forms of the statistics. Torch-free: the settings (jobs/config.py) check the
same values with these, and `--help` lists these choices."""

from __future__ import annotations

import math

from cafa_cli.errors import UsageError

PARAM_SETS = ("norm", "all")
OPTIMIZERS = ("adam", "sgd", "nesterov")  # nesterov: SGD with Nesterov momentum, as TENT's reference code
PRECISIONS = ("fp32", "bf16", "fp16")
COVARIANCE_MODES = ("full", "tied", "diag", "lowrank")  # what an artifact can hold
COVARIANCE_CHOICES = ("auto", *COVARIANCE_MODES)  # what `covariance` accepts
# Gradient steps on each batch. TENT and CAFA take 1, and the methods that take more take a
# handful; past 1000 a batch is only overfit, and a mistyped 1000000000 would run for ever on
# a one-batch domain with no output.
MAX_STEPS = 1000
NORM_FORMS = "batch, prior:N (N ≥ 0), source, ema:M (M in (0, 1]) or class-balanced"  # the statistics BatchNorms use (norms.py)


def check_adapter_options(params: str = "norm", optimizer: str = "adam", lr: float = 1e-3, momentum: float = 0.9, steps: int = 1,
                          norm: str = "batch", precision: str = "fp32", compile: bool = False) -> None:
    """Each of the Adapter's keyword options, checked before it changes anything."""
    parse_norm(norm)
    numbers = {"`lr`": lr, "`momentum`": momentum}
    for option, value in numbers.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UsageError(f"{option} must be a number, not {value!r}")
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise UsageError(f"`steps` must be a whole number, not {steps!r}")
    choices = {"`params`": (params, PARAM_SETS), "`optimizer`": (optimizer, OPTIMIZERS), "`precision`": (precision, PRECISIONS)}
    for option, (value, allowed) in choices.items():
        if value not in allowed:
            raise UsageError(f"{option} must be one of {', '.join(allowed)}, not {value}")
    if not 1 <= steps <= MAX_STEPS:
        raise UsageError(f"`steps` must be from 1 to {MAX_STEPS} (gradient steps on each batch), not {steps}")
    if not 0 < lr < math.inf:
        raise UsageError(f"`lr` must be a positive number, not {lr}")
    if not 0 <= momentum < 1:
        raise UsageError(f"`momentum` must be in [0, 1), not {momentum}")
    if optimizer == "nesterov" and momentum == 0:
        raise UsageError("`optimizer` nesterov needs a momentum above 0, not 0 (`momentum`); for plain SGD use `optimizer` sgd")


def parse_norm(text: str) -> tuple[str, float | None]:
    """'batch' -> ('batch', None); 'prior:16' -> ('prior', 16.0); 'ema:0.05' -> ('ema', 0.05)."""
    kind, colon, value_text = str(text).strip().partition(":")
    if kind in ("batch", "source", "class-balanced") and not colon:
        return kind, None
    try:
        value = float(value_text) if kind in ("prior", "ema") and colon else math.nan
    except ValueError:
        value = math.nan
    if kind == "prior" and 0 <= value < math.inf or kind == "ema" and 0 < value <= 1:
        return kind, value
    raise UsageError(f"`norm` must be {NORM_FORMS}, not {text!r}")


def check_precision(precision: str, device_type: str) -> None:
    if precision != "fp32" and device_type != "cuda":
        raise UsageError(f"`precision` {precision} is for CUDA; on the CPU use fp32")


# --- a method's own options (create(name, **options)) ---------------------------------


def check_fraction(method: str, name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise UsageError(f"{method}'s `{name}` must be a number in [0, 1], not {value!r}")


def check_count(method: str, name: str, value: int, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise UsageError(f"{method}'s `{name}` must be a whole number, {least} or more, not {value!r}")


def check_weight(method: str, name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise UsageError(f"{method}'s `{name}` must be a number, 0 or more, not {value!r}")
