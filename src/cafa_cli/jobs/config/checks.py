"""The checks and parsers the settings share: each raises a UsageError naming the setting in
backticks (`lr`), which the command line shows as --lr. Torch-free."""

from __future__ import annotations

import os
from dataclasses import fields
from typing import Literal

from cafa_cli.core.errors import UsageError, repeated
from cafa_cli.core.factories import code_file
from cafa_cli.engine.options import OPTIMIZERS, PARAM_SETS, PRECISIONS

Optimizer = Literal[OPTIMIZERS]  # type: ignore[valid-type]  (the Adapter's names)
ParamSet = Literal[PARAM_SETS]  # type: ignore[valid-type]
Precision = Literal[PRECISIONS]  # type: ignore[valid-type]


def factory_file(spec: str | None) -> str | None:
    """The file of a `file.py:function` or `module:function` model or plug-in, else None:
    code the command reads and runs."""
    return code_file(spec)


def at_least(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise UsageError(f"`{name}` must be a whole number, not {value!r}")
    if value < low:
        raise UsageError(
            f"`{name}` must be at least {low}, not {value}" if low else f"`{name}` must be 0 or more, not {value}"
        )


def parse_shrinkage(value: float | str) -> float | str:
    if value == "auto":
        return value
    try:
        lam = float(value)
    except (TypeError, ValueError):
        lam = float("nan")
    if not 0.0 <= lam <= 1.0:
        raise UsageError(f"`shrinkage` must be 'auto' or a number in [0, 1], not {value!r}")
    return lam


def _axis(text: str, name: str, what: str) -> list[str]:
    """A comma-separated grid axis: its values, each once."""
    values = [value.strip() for value in text.split(",") if value.strip()]
    if not values:
        raise UsageError(f"`{name}` names no value; give {what}, or leave `{name}` out")
    twice = repeated(values)
    if twice:
        raise UsageError(f"`{name}` names {twice[0]} twice; give each once")
    return values


def parse_severities(text: str, name: str) -> list[int]:
    """Comma-separated corruption severities, each 1-5 and once."""
    try:
        severities = [int(value) for value in _axis(text, name, "a severity")]
    except ValueError:
        raise UsageError(f"`{name}` takes comma-separated whole numbers 1-5, not {text!r}") from None
    wrong = [s for s in severities if not 1 <= s <= 5]
    if wrong:
        raise UsageError(f"`{name}`: a severity is 1-5, not {wrong[0]}")
    if len(set(severities)) < len(severities):
        raise UsageError(f"`{name}` names a severity twice: {text}")
    return severities


def check_gradual_severity(config) -> None:
    if config.gradual and config.severity is not None:
        raise UsageError(
            f"`severity` {config.severity} picks one severity, and `gradual` visits all five; give one of them"
        )


def check_seed(name: str, seed: int) -> None:
    if not 0 <= seed < 2**63:  # torch's and numpy's generators take 64-bit seeds
        raise UsageError(f"`{name}` must be 0 or more and below 2**63, not {seed}")


def check_covariance(covariance: str, shrinkage: float | str) -> None:
    if shrinkage == 0 and covariance == "lowrank":
        raise UsageError(
            "`covariance` lowrank needs shrinkage: with `shrinkage` 0 the isotropic part a = λ·tr(S)/d is 0 "
            "and the covariance is singular; use `shrinkage` auto (or a value > 0), or `covariance` full"
        )


def check_max_error(value: float | None) -> None:
    """`max_error` is a percentage, as the summary and the bench table show the error (NaN compares with nothing)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 100:
        raise UsageError(f"`max_error` must be a percentage in [0, 100], not {value!r}")


def check(config) -> None:
    """Every group's own check, in field order: the first wrong value is the one named. A
    list setting given one path (AdaptConfig(data="fog/3")) is that path's list: read as a
    string, it was its characters."""
    for f in fields(config):
        value = getattr(config, f.name)
        if str(f.type).startswith("list[") and isinstance(value, (str, os.PathLike)):
            setattr(config, f.name, [os.fspath(value)])
    for group in type(config).__mro__:
        for name, method in vars(group).items():
            if name.startswith("_check_"):
                method(config)


def command_line_only(config_type) -> set[str]:
    return {f.name for f in fields(config_type) if f.metadata.get("command_line_only")}


def names_code(config_type) -> set[str]:
    return {f.name for f in fields(config_type) if f.metadata.get("names_code")}
