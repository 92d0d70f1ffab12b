"""Recipes: each method's published setting for a benchmark family, as data.

One TOML file per method (recipes/<method>.toml): a `[method]` table that describes it
(summary, paper, what it adapts, its step cost ÷ TENT's on the CPU from benchmarks/perf.py,
its peak memory in MiB above the loaded model on the CPU from benchmarks/method_memory.py, or
"—" where it is not measured, and, in markdown, `notes` on how it is run and its `deviations` from its authors' code),
then one table per family (imagenet-c, cifar10-c, cifar100-c) holding `source` (where the
values come from), the settings the method was run with (SETTINGS: optimiser, learning
rate, momentum, batch size, steps, which parameters adapt, the normalisation, EATA's Fisher
images, a reset schedule) and its own options (`options`, as the method declares them:
engine/method.py).

A user's recipe file (`--recipe my.toml`) has one table per method, named by the method,
with the same keys; `cafa methods NAME --recipe R` prints one to start from.

`auto` picks the family from a named benchmark among the test domains (imagenet-c:ROOT),
else from the model's class count (10, 100, 1000), and `clip` for a method that ships no
other (the CLIP methods, whose authors' settings do not depend on the benchmark); `none`
uses no recipe (the settings' own defaults). Settings the user chose (on the command line or in cafa.toml) win over a
recipe's, one by one.

Each family also names the model its published tables were made with (STANDARD_MODELS,
RobustBench's corruption-benchmark checkpoints): `cafa bench` runs a named benchmark
of the family on it when no `model` is chosen. Torch-free.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field, fields, replace
from importlib import resources

from cafa_cli.core.errors import InputError, UsageError
from cafa_cli.core.files import read_small_text, reading, toml_problem
from cafa_cli.engine.options import AdapterSettings

# the corruption benchmarks' families, which `auto` takes from a named benchmark or a class count
BENCHMARK_FAMILIES = ("imagenet-c", "cifar10-c", "cifar100-c")
# `clip`: the CLIP test-time methods' (TPT, ZERO, TDA, DMN-ZS, BoostAdapter), their authors' settings
# for ImageNet and its variants on CLIP, whatever the benchmark; the only family those methods ship,
# so `auto` takes it for them (recipe_for)
CLIP_FAMILY = "clip"
FAMILIES = (*BENCHMARK_FAMILIES, CLIP_FAMILY)
NAMES = ("auto", "none", *FAMILIES)  # or a .toml file
# The most a user's recipe file may hold: every shipped recipe together is under 20 KB, so a
# file over 1 MiB is no recipe (a link to /dev/zero, a sparse file), and is refused unread.
RECIPE_LIMIT = 1 << 20
# what a recipe may set; `reset` is a method's own only where it is its schedule (rdumb's every:N),
# `norm` where its authors normalised otherwise than with the test batch (memo's prior, ttaug's α-BN)
SETTINGS = ("optimizer", "lr", "momentum", "batch_size", "steps", "params", "norm", "fisher_samples", "reset")
# those of SETTINGS that are the Adapter's (AdapterSettings' fields; the others are the stream's batch_size
# and reset, and EATA's fisher_samples)
ADAPTER_SETTINGS = tuple(key for key in SETTINGS if key in {f.name for f in fields(AdapterSettings)})
FAMILY_BY_CLASSES = {10: "cifar10-c", 100: "cifar100-c", 1000: "imagenet-c"}
# the [method] table; notes and deviations are markdown, for the site's methods reference alone
DESCRIPTION = ("summary", "paper", "adapts", "cost", "memory_mib", "notes", "deviations")
# the model of each family's tables in the papers (TENT's, CoTTA's and those after them)
STANDARD_MODELS = {
    "imagenet-c": "robustbench:imagenet/Standard_R50",
    "cifar10-c": "robustbench:cifar10/Standard",
    "cifar100-c": "robustbench:cifar100/Hendrycks2020AugMix_ResNeXt",
}


@dataclass(frozen=True)
class Recipe:
    """One method's setting: the settings and options it gives, and where they come from."""

    method: str
    family: str | None  # None for a user's table that names none
    source: str
    settings: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict)
    origin: str = "shipped"  # or the user's file
    chosen_by: str = ""  # how `auto` chose the family: "the named benchmark", "the model's 10 classes"

    def adapter_settings(self) -> AdapterSettings:
        """The Adapter's settings, those the recipe gives (optimizer, lr, momentum, steps, params,
        norm) in place of the defaults: `Adapter(model, method, **recipe.adapter_settings())`. The
        others are not the Adapter's: `batch_size` and `reset` are the stream's, `fisher_samples`
        the number of clean images EATA's Fisher term is computed from."""
        return AdapterSettings(**{key: value for key, value in self.settings.items() if key in ADAPTER_SETTINGS})

    def record(self) -> dict:
        """What the metrics and bench JSON keep of it."""
        return {
            "name": self.family,
            "origin": self.origin,
            "source": self.source,
            "settings": dict(self.settings),
            "options": dict(self.options),
            **({"chosen_by": self.chosen_by} if self.chosen_by else {}),
        }


def description(method: str) -> dict:
    """A built-in method's [method] table: DESCRIPTION's keys (absent ones: None)."""
    table = _shipped_file(method).get("method", {})
    return {key: table.get(key) for key in DESCRIPTION}


def shipped(method: str, family: str) -> Recipe | None:
    """The recipe the tool ships for `method` on `family`; None when it ships none (a plug-in's)."""
    if family not in FAMILIES:  # a misspelt family would read as "none shipped"
        raise UsageError(f"no recipe family {family!r}; the families: {', '.join(FAMILIES)}")
    table = _shipped_file(method).get(family)
    return None if table is None else _recipe(method, family, table, "shipped", f"{_shipped_name(method)} [{family}]")


def check_name(name: str) -> None:
    """A `recipe` value: a name of NAMES, or a readable TOML file of method tables."""
    if name in NAMES:
        return
    if not str(name).endswith(".toml"):
        raise UsageError(f"`recipe` must be one of {', '.join(NAMES)}, or a .toml file of method tables, not {name!r}")
    read_file(name)


def read_file(path: str) -> dict[str, Recipe]:
    """A user's recipe file: {method: Recipe}, each table checked for its keys."""
    reading(path, "`recipe`")
    text = read_small_text(
        path,
        "`recipe`",
        RECIPE_LIMIT,
        "give a UTF-8 TOML file of method tables (cafa methods NAME --recipe cifar10-c prints one)",
    )
    try:
        document = tomllib.loads(text)
    except ValueError as error:  # TOMLDecodeError, or an integer past Python's 4,300 digits
        raise InputError(f"`recipe` {path}: not valid TOML ({toml_problem(error)})") from None
    if not document:
        raise InputError(
            f"`recipe` {path}: holds no method table; write one per method, e.g. [eata] (cafa methods eata "
            f"--recipe cifar10-c prints one)"
        )
    recipes = {}
    for method, table in document.items():
        if not isinstance(table, dict):
            raise InputError(f"`recipe` {path}: {method} = {table!r} must be a table of settings, e.g. [{method}]")
        family = table.get("family")
        if family is not None and family not in FAMILIES:
            raise InputError(f"`recipe` {path}: [{method}] family {family!r} must be one of {', '.join(FAMILIES)}")
        recipes[method] = _recipe(method, family, table, str(path), f"{path} [{method}]", extra=("family",))
    return recipes


def family_for(data: list[str], num_classes: int | None) -> str | None:
    """`auto`'s family for a method of the benchmark families: that of the named benchmarks among
    `data` (one kind), else the class count's."""
    return benchmark_family(data) or FAMILY_BY_CLASSES.get(num_classes)


def benchmark_family(data: list[str]) -> str | None:
    """The family of the named benchmarks among `data` (cifar10-c:ROOT), when they are of one kind."""
    kinds = {
        spec.partition(":")[0]
        for spec in data
        if spec.partition(":")[0] in BENCHMARK_FAMILIES and spec.partition(":")[2]
    }
    return kinds.pop() if len(kinds) == 1 else None


def standard_model(data: list[str]) -> tuple[str, str] | None:
    """(family, model) for a run on `data` that names a family's benchmark: the model the
    family's published tables were made with; None for other data (the bundled demo's
    fashion-mnist-c:ROOT, folders, arrays), whatever recipe is chosen."""
    family = benchmark_family(data)
    return None if family is None else (family, STANDARD_MODELS[family])


def recipe_for(name: str, method: str, data: list[str], num_classes: int | None) -> Recipe | None:
    """The recipe `name` (NAMES, or a file) gives `method`, for a run on `data` with a model of
    `num_classes` outputs; None where it gives none (`none`, `auto` without a family, a
    plug-in under a shipped family). A named family or file without the method is an error."""
    if name == "none":
        return None
    if name.endswith(".toml"):
        recipes = read_file(name)
        if method not in recipes:
            raise UsageError(
                f"`recipe` {name} has no table for the method {method} (it has {', '.join(recipes)}); add "
                f"[{method}], or choose another `recipe`"
            )
        return recipes[method]
    only_clip = name == "auto" and shipped_families(method) == (CLIP_FAMILY,)
    family = (CLIP_FAMILY if only_clip else family_for(data, num_classes)) if name == "auto" else name
    if family is None or ":" in method:  # a plug-in brings no shipped recipe
        if ":" in method and name != "auto":
            raise UsageError(
                f"the plug-in method {method} has no shipped `recipe` {name}; give its settings as options, "
                f"or a recipe file with a [{method!r}] table"
            )
        return None
    recipe = shipped(method, family)
    if recipe is None:
        raise UsageError(f"the method {method} has no recipe for {family}; choose `recipe` none")
    if name == "auto":
        by = (
            "the CLIP method's one family"
            if only_clip
            else "the named benchmark"
            if benchmark_family(data)
            else f"the model's {num_classes} classes"
        )
        recipe = replace(recipe, chosen_by=by)
    return recipe


def to_toml(
    method: str,
    settings: dict,
    options: dict,
    *,
    family: str | None = None,
    source: str | None = None,
    comments: dict[str, str] | None = None,
) -> str:
    """A recipe as the TOML a user's file holds (`--recipe FILE` reads it back), an option's
    help from `comments` after it."""
    table = _key(method)
    lines = [f"[{table}]"]
    lines += [f"family = {_value(family)}"] if family else []
    lines += [f"source = {_value(source)}"] if source else []
    lines += [f"{key} = {_value(settings[key])}" for key in SETTINGS if key in settings]
    if options:
        lines += ["", f"[{table}.options]"]
        for key, value in options.items():
            note = (comments or {}).get(key)
            lines.append(f"{key} = {_value(value)}" + (f"  # {note}" if note else ""))
    return "\n".join(lines) + "\n"


def _recipe(
    method: str, family: str | None, table: dict, origin: str, where: str, extra: tuple[str, ...] = ()
) -> Recipe:
    allowed = (*SETTINGS, "source", "options", *extra)
    unknown = [key for key in table if key not in allowed]
    if unknown:
        raise InputError(
            f"recipe {where}: no setting {', '.join(map(repr, unknown))}; a recipe sets {', '.join(allowed)}"
        )
    options = table.get("options", {})
    if not isinstance(options, dict):
        raise InputError(f"recipe {where}: options must be a table (options = {{ name = value }}), not {options!r}")
    settings = {key: table[key] for key in SETTINGS if key in table}
    return Recipe(method, family, str(table.get("source", "")), settings, dict(options), origin)


def shipped_families(method: str) -> tuple[str, ...]:
    """The families a built-in method ships recipes for, in FAMILIES' order."""
    file = _shipped_file(method)
    return tuple(family for family in FAMILIES if family in file)


def _shipped_file(method: str) -> dict:
    """The recipe file the method registry names for `method` (a plug-in has none)."""
    from cafa_cli.methods import REGISTRY

    entry = REGISTRY.get(method)
    if entry is None:
        return {}
    package, _, name = (entry.recipe or f"{__name__}:{method}.toml").partition(":")
    path = resources.files(package) / name
    if not path.is_file():
        return {}
    return tomllib.loads(path.read_text(encoding="utf-8"))


def _shipped_name(method: str) -> str:
    """How the JSON and `cafa methods` name a shipped recipe file: recipes/NAME.toml for this tool's."""
    from cafa_cli.methods import REGISTRY

    recipe = REGISTRY[method].recipe
    return recipe if recipe else f"recipes/{method}.toml"


def _key(name: str) -> str:
    return name if name.replace("-", "").replace("_", "").isalnum() else _value(name)


def _value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value) if math.isfinite(value) else _value(str(value))
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(item) for item in value) + "]"
    text = str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    # a control character (ESC from a file's `source`) as TOML's escape: never raw to a terminal
    text = "".join(f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch for ch in text)
    return f'"{text}"'


def table_cost(method: str) -> float | None:
    """k of a built-in method from `cafa methods`' cost column: its step over a forward pass
    of the source model, both ÷ TENT's step on the CPU; None for a method without one."""
    method_cost, source_cost = description(method)["cost"], description("source")["cost"]
    return None if method_cost is None else float(method_cost) / float(source_cost)
