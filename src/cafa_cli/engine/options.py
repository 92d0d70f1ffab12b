"""The Adapter's settings (AdapterSettings, and `norm` parsed as a Norm) and their checks, and
the options a method declares. Torch-free: the command line's settings (jobs/config/) are
checked with these, and `--help` lists these choices."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from cafa_cli.core.errors import UsageError
from cafa_cli.core.numbers import LEAST_POSITIVE, MOST_NUMBER, read_whole, sane

PARAM_SETS = ("norm", "all")
OPTIMIZERS = ("adam", "sgd", "nesterov", "adamw")  # nesterov: SGD with Nesterov momentum, as TENT's reference code;
# adamw: torch's AdamW and its weight decay 0.01, as TPT's prompt tuning
PRECISIONS = ("fp32", "bf16", "fp16")
# Gradient steps on each batch. TENT and CAFA take 1, and the methods that take more take a
# handful; past 1000 a batch is only overfit, and a mistyped 1000000000 would run for ever on
# a one-batch domain with no output.
MAX_STEPS = 1000
MAX_PRIOR = 1e9  # prior:N beyond this is the source statistics alone (use `source`), and N·μ would overflow float32
# the statistics BatchNorms use (norms.py)
MAX_COMPONENTS = 1024  # unmix:K beyond this holds K·channels statistics a layer for nothing (authors: 16, 128)
NORM_FORMS = (
    "batch, prior:N (N 0 or from 0.000001 to 1e9), source, ema:M (M from 0.000001 to 1), class-balanced, "
    "alpha:A (A 0 or from 0.000001 to 1) "
    f"or unmix:K (K a whole number from 2 to {MAX_COMPONENTS})"
)
RUNNING = ("ema", "class-balanced", "unmix")  # the settings that keep statistics from batch to batch
HOW_IT_RUNS = ("compile", "cuda_graph")  # the Adapter's settings that change how a step runs, not what it computes


@dataclass(frozen=True)
class Norm:
    """Which statistics the BatchNorms normalise with (`norm`, engine/norms.py): its `kind`
    and its number (prior's N, ema's M, alpha's A, unmix's K), or None. Parsed once from its
    text where the text enters (`Norm.parse("prior:16")`: the settings, the Adapter's
    keywords, a recipe) and passed down as this; `str()` gives the text back, as the records keep it."""

    kind: str = "batch"
    value: float | None = None

    @classmethod
    def parse(cls, text: str | Norm) -> Norm:
        """'batch' -> Norm('batch'); 'prior:16' -> Norm('prior', 16.0); 'ema:0.05', 'alpha:0.1',
        'unmix:16' likewise; a Norm as it is. A UsageError that lists the forms otherwise."""
        if isinstance(text, Norm):
            return text
        kind, colon, value_text = str(text).strip().partition(":")
        if kind in ("batch", "source", "class-balanced") and not colon:
            return cls(kind)
        try:
            value = float(value_text) if kind in ("prior", "ema", "alpha", "unmix") and colon else math.nan
        except ValueError:
            value = math.nan
        allowed = {
            "prior": sane(value, MAX_PRIOR, zero=True),
            "ema": sane(value, 1),
            "alpha": sane(value, 1, zero=True),
            "unmix": 1 <= value <= MAX_COMPONENTS and value.is_integer(),
        }
        if allowed.get(kind, False):
            if kind == "unmix" and value == 1:
                # the softmax over one component is 1: every sample takes its own statistics alone
                raise UsageError(
                    f"`norm` {text}: one component normalises each image by its own statistics alone (instance "
                    f"normalisation; the authors' code does the same), which loses what sets images apart; give "
                    f"unmix:K with K from 2 to {MAX_COMPONENTS} (the authors use 16)"
                )
            return cls(kind, value)
        raise UsageError(f"`norm` must be {NORM_FORMS}, not {text!r}")

    def __str__(self) -> str:
        if self.value is None:
            return self.kind
        return f"{self.kind}:{int(self.value) if self.value.is_integer() else self.value}"

    @property
    def class_balanced(self) -> bool:
        """It corrects each batch's statistics for its class mix, with the source's class moments."""
        return self.kind == "class-balanced"

    @property
    def running(self) -> bool:
        """It keeps statistics from batch to batch, which a method that resets them cannot take."""
        return self.kind in RUNNING

    @property
    def batch_alone(self) -> bool:
        """Each batch is normalised by its own statistics (class-balanced: corrected, but its own),
        which a batch of one image cannot give."""
        return self.kind in ("batch", "class-balanced") or (self.kind, self.value) in (("prior", 0.0), ("alpha", 1.0))


@dataclass(frozen=True, kw_only=True)
class AdapterSettings:
    """How an Adapter adapts: its keyword arguments and their defaults, written here once (the
    command line's settings, the recipes and the Adapter take them from here), each checked
    when made; `norm` may be given as its text. `Adapter(model, method, lr=1e-3, norm="prior:16")`
    makes one from its keywords, and one made here unpacks into them: `Adapter(model, method, **settings)`."""

    params: str = "norm"
    optimizer: str = "adam"
    lr: float = 1e-3
    momentum: float = 0.9
    steps: int = 1
    norm: Norm = Norm()
    precision: str = "fp32"
    compile: bool = False
    cuda_graph: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "norm", Norm.parse(self.norm))
        for option, value in {"`compile`": self.compile, "`cuda_graph`": self.cuda_graph}.items():
            if not isinstance(value, bool):
                raise UsageError(f"{option} must be true or false, not {value!r}")
        for option, value in {"`lr`": self.lr, "`momentum`": self.momentum}.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise UsageError(f"{option} must be a number, not {value!r}")
        steps, lr, momentum = self.steps, self.lr, self.momentum
        if isinstance(steps, bool) or not isinstance(steps, int):
            raise UsageError(f"`steps` must be a whole number, not {steps!r}")
        choices = {
            "`params`": (self.params, PARAM_SETS),
            "`optimizer`": (self.optimizer, OPTIMIZERS),
            "`precision`": (self.precision, PRECISIONS),
        }
        for option, (value, allowed) in choices.items():
            if value not in allowed:
                raise UsageError(f"{option} must be one of {', '.join(allowed)}, not {value}")
        if not 1 <= steps <= MAX_STEPS:
            raise UsageError(f"`steps` must be from 1 to {MAX_STEPS} (gradient steps on each batch), not {steps}")
        if not 0 < lr < math.inf:
            raise UsageError(f"`lr` must be a positive number, not {lr}")
        if not 0 <= momentum < 1:
            raise UsageError(f"`momentum` must be in [0, 1), not {momentum}")
        if self.optimizer == "nesterov" and momentum == 0:
            raise UsageError(
                "`optimizer` nesterov needs a momentum above 0, not 0 (`momentum`); for plain SGD use `optimizer` sgd"
            )

    # a mapping of the Adapter's keywords to their values, so that `**settings` gives them
    def keys(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self))

    def __iter__(self):
        return iter(self.keys())

    def __getitem__(self, name: str):
        return getattr(self, name)

    def record(self) -> dict:
        """The settings that shape what the adaptation computes (all but HOW_IT_RUNS), as plain
        data (`norm` as its text): what a saved state must have been made with."""
        shaping = [name for name in self.keys() if name not in HOW_IT_RUNS]
        return {name: str(self.norm) if name == "norm" else self[name] for name in shaping}


def check_precision(precision: str, device_type: str) -> None:
    if precision != "fp32" and device_type != "cuda":
        raise UsageError(f"`precision` {precision} is for CUDA; on the CPU use fp32")


# --- a method's own options, declared by the method and set by a recipe or the user ---


@dataclass(frozen=True)
class Option:
    """One of a method's own options: its name (a constructor keyword), default, one line
    of help, and what it accepts (`kind`, see OPTION_KINDS). A method lists its options in
    `Method.options`; recipes and `--method-option NAME=VALUE` set them by name."""

    name: str
    default: object
    help: str
    kind: str  # a key of OPTION_KINDS
    choices: tuple[str, ...] = ()  # for kind "choice"
    most: int = 0  # for the whole-number kinds: the largest value (0: MOST_COUNT), so that memory and time stay sane

    def accepts(self) -> str:
        if self.kind == "choice":
            return ", ".join(self.choices)
        if self.kind.startswith("count"):
            least = 0 if self.kind == "count0" else 1
            return f"a whole number from {least} to {self.largest():,}" + (
                ", or all" if self.kind.endswith("all") else ""
            )
        return OPTION_KINDS[self.kind]

    def largest(self) -> int:
        return self.most or MOST_COUNT

    def value(self, method: str, value):
        """`value` (from TOML, or the text after NAME= on the command line) as the method
        takes it; a UsageError naming the method, the option and what it accepts."""
        converted = _CONVERT[self.kind](value, self.choices)
        if isinstance(converted, int) and not isinstance(converted, bool) and self.kind.startswith("count"):
            converted = converted if converted <= self.largest() else _INVALID
        if converted is _INVALID:
            raise UsageError(f"{method}'s option {self.name} must be {self.accepts()}, not {value!r}")
        return converted


# the largest whole-number option a method takes unless it says less (Option.most): a count beyond
# it (a bank of 10^20 samples, 10^12 iterations) would exhaust memory or never finish
MOST_COUNT = 1_000_000
OPTION_KINDS = {
    "fraction": "a number in [0, 1]",
    "weight": "a number from 0 to 1,000,000",
    "positive": "a number from 0.000001 to 1,000,000",
    "count": "a whole number, 1 or more",
    "count0": "a whole number, 0 or more",
    "count_or_all": "a whole number, 1 or more, or all",
    "positive_or_auto": "a number from 0.000001 to 1,000,000, or auto",
    "flag": "true or false",
    "names": "module names, comma-separated (or a TOML list)",
    "choice": "one of the choices",
}
_INVALID = object()


def _number(value):
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            return _INVALID
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return _INVALID
    return value


def _whole(value, least: int):
    if isinstance(value, str):
        value = read_whole(value)
        if value is None:
            return _INVALID
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        return _INVALID
    return value


def _in_range(value, low: float, high: float):
    value = _number(value)
    if value is _INVALID or value < low or value > high:
        return _INVALID
    return value


def _flag(value):
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    return {"true": True, "false": False, "1": True, "0": False}.get(text, _INVALID)


def _names(value):
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(item, str) for item in items):
        return _INVALID
    names = tuple(item.strip() for item in items if item.strip())
    return (
        names
        if all(all(part.isidentifier() or part.isdigit() for part in name.split(".")) for name in names)
        else _INVALID
    )


_CONVERT = {
    "fraction": lambda v, _: _in_range(v, 0, 1),
    "weight": lambda v, _: _in_range(v, 0, MOST_NUMBER),
    "positive": lambda v, _: _in_range(v, LEAST_POSITIVE, MOST_NUMBER),
    "count": lambda v, _: _whole(v, 1),
    "count0": lambda v, _: _whole(v, 0),
    "count_or_all": lambda v, _: "all" if str(v).strip() == "all" else _whole(v, 1),
    "positive_or_auto": lambda v, _: "auto" if str(v).strip() == "auto" else _in_range(v, LEAST_POSITIVE, MOST_NUMBER),
    "flag": lambda v, _: _flag(v),
    "names": lambda v, _: _names(v),
    "choice": lambda v, choices: str(v).strip() if str(v).strip() in choices else _INVALID,
}


def shown(value) -> str:
    """An option's value as the command line writes it: `layer4,blocks.9`, `false`."""
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value).lower() if isinstance(value, bool) else str(value)


def resolve_options(method: str, declared: tuple[Option, ...], given: dict) -> dict:
    """Every option of `method`: its default, replaced by those `given` (each checked); an
    option it does not take is a UsageError that lists those it does."""
    known = {option.name: option for option in declared}
    unknown = sorted(set(given) - set(known))
    if unknown:
        takes = f"its options: {', '.join(known)}" if known else "it takes none"
        raise UsageError(f"the method {method} has no option {', '.join(unknown)} ({takes})")
    return {
        name: option.value(method, given[name]) if name in given else option.default for name, option in known.items()
    }
