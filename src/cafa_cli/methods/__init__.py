"""The test-time adaptation methods, one file each, behind one small protocol (engine/method.py),
and the one table that names them (REGISTRY).

    from cafa_cli.methods import create
    adapter = Adapter(model, create("cafa", gaussians, device), device)

A built-in method is its file (a Method subclass), its recipe (recipes/NAME.toml) and
one Entry below; what several methods share is in shared/. Everything else that lists
methods reads this table: the command line's choices and completion, `cafa methods`,
bench's rows, and `create`.

Importing this package does not import torch (the command line lists the names in its
help and must start fast): each method's module is imported when its class is first asked
for (method_class), to make it or to read what it needs and does from its attributes.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cafa_cli.engine.method import Method
    from cafa_cli.statistics.gaussians import ClassGaussians


@dataclass(frozen=True)
class Entry:
    """A built-in method: where its class is, and where its recipe is. What the rest of the
    tool must know of it is on the class (engine/method.py)."""

    module: str  # its module: a name in this package, or a full dotted path
    cls: str  # its Method subclass in that module
    # its recipe file, "package:file.toml"; None: this tool's recipes/NAME.toml
    recipe: str | None = None

    def module_path(self) -> str:
        return self.module if "." in self.module else f"{__name__}.{self.module}"


# the ablations intra and euclidean are CAFA with another loss or metric; eta is EATA without its Fisher term,
# rdumb is eta under its recipe's reset every:1000
REGISTRY: dict[str, Entry] = {
    "source": Entry("source", "Source"),
    "bn": Entry("bn", "BatchNormOnly"),
    "pl": Entry("pl", "PseudoLabel"),
    "tent": Entry("tent", "Tent"),
    "cafa": Entry("cafa", "Cafa"),
    "global-fa": Entry("global_fa", "GlobalFA"),
    "intra": Entry("cafa", "IntraOnly"),
    "euclidean": Entry("cafa", "Euclidean"),
    "eta": Entry("eata", "Eta"),
    "eata": Entry("eata", "Eata"),
    "cafa-eata": Entry("cafa_eata", "CafaEata"),
    "sar": Entry("sar", "Sar"),
    "deyo": Entry("deyo", "DeYO"),
    "rdumb": Entry("rdumb", "RDumb"),
    "rpl": Entry("rpl", "Rpl"),
    "shot-im": Entry("shot", "ShotIM"),
    "shot": Entry("shot", "Shot"),
    "memo": Entry("memo", "Memo"),
    "ttaug": Entry("ttaug", "TTAug"),
    "t3a": Entry("t3a", "T3A"),
    "lame": Entry("lame", "Lame"),
    "neo": Entry("neo", "Neo"),
    "foa": Entry("foa", "Foa"),  # needs_tokens: a ViT's
    "dpcore": Entry("dpcore", "DPCore"),  # needs_tokens: a ViT's
    "spa": Entry("spa", "Spa"),
    "cotta": Entry("cotta", "CoTTA"),
    "rotta": Entry("rotta", "RoTTA"),
    "rmt": Entry("rmt", "Rmt"),
    "roid": Entry("roid", "Roid"),
    "cmf": Entry("cmf", "CMF"),
    "adacontrast": Entry("adacontrast", "AdaContrast"),
    "santa": Entry("santa", "Santa"),
    "cafa-robust": Entry("cafa_robust", "CafaRobust"),
    # for streams with outliers (images from outside the label set)
    "sotta": Entry("sotta", "SoTTA"),
    "stamp": Entry("stamp", "Stamp"),
    "owttt": Entry("owttt", "Owttt"),
    # the CLIP test-time methods (needs_clip): a CLIP model's zero-shot classifier only
    "tpt": Entry("tpt", "Tpt"),
    "zero": Entry("zero", "Zero"),
    "tda": Entry("tda", "Tda"),
    "dmn-zs": Entry("dmn", "DmnZs"),
    "boostadapter": Entry("boostadapter", "BoostAdapter"),
}
"""The built-in methods by name (`cafa adapt --method NAME`): where each one's class and recipe are."""


def create(name: str, gaussians: ClassGaussians | None = None, device="cpu", **options) -> Method:
    """The method called `name`, ready for an Adapter: its class (or a plug-in's factory)
    called as `(gaussians, device, **options)`. Those that need statistics take the class
    Gaussians (an artifact's `.gaussians`, or `estimate(moments)`) and keep what they need of
    them on `device`, which must be the Adapter's. `options` are the method's own
    (options_of(name): eata's `redundancy_margin`, lame's `affinity`, ...; text values are
    converted), and the data some take (eata's `fisher_batches`, normalised source images for
    its Fisher term). `name` may also be a plug-in, 'package.module:factory' or
    'path/file.py:factory': its module is imported (its code runs) and the factory, a Method
    subclass or a function of the same arguments, must return a Method, the options those its
    `options` attribute declares as a Method's are; give such a name only from the command
    line or your own code."""
    if is_plugin(name):
        return _plugin(name, gaussians, device, options)
    return method_class(name)(gaussians, device, **options)


def method_class(name: str) -> type[Method]:
    """The class of the method called `name`, whose attributes say what it needs and does (its
    module imported: this imports torch). A plug-in's is Method itself: what is known of it
    before it is made, since its module is imported only to make it."""
    from cafa_cli.engine.method import Method

    if is_plugin(name):
        return Method
    if name not in REGISTRY:
        from cafa_cli.core.errors import UsageError

        raise UsageError(f"`method` must be one of {', '.join(REGISTRY)}, or a plug-in module:factory, not {name}")
    entry = REGISTRY[name]
    return getattr(importlib.import_module(entry.module_path()), entry.cls)


def options_of(name: str) -> tuple:
    """The options.Option tuple a built-in method declares (its own options, with defaults)."""
    if name not in REGISTRY:
        from cafa_cli.core.errors import UsageError

        raise UsageError(f"no built-in method {name!r}; the methods: {', '.join(REGISTRY)}")
    return method_class(name).options


def is_plugin(name: str) -> bool:
    """'package.module:factory' or 'file.py:factory': a method written against the protocol."""
    return ":" in name


def _plugin(spec: str, gaussians, device, options: dict) -> Method:
    from cafa_cli.core.errors import CafaError, InputError, UsageError
    from cafa_cli.core.factories import import_factory
    from cafa_cli.engine.method import Method
    from cafa_cli.engine.options import Option, resolve_options

    factory, function = import_factory(spec, "`method`", "factory")
    declared = getattr(factory, "options", ())
    if not isinstance(declared, tuple) or not all(isinstance(option, Option) for option in declared):
        raise InputError(f"`method` {spec}: {function}.options must be a tuple of cafa_cli.engine.options.Option")
    options = resolve_options(spec, declared, options)
    try:
        method = factory(gaussians, device, **options)
    except CafaError:  # already one line: a Method's own refusal (statistics it needs and was not given)
        raise
    except (Exception, SystemExit) as error:  # a user's code can fail in any way; one line
        raise InputError(
            f"`method` {spec}: {function}(gaussians, device) failed ({type(error).__name__}: {error})"
        ) from None
    if not isinstance(method, Method):
        raise InputError(
            f"`method` {spec}: {function}() returned {type(method).__name__}, not a Method "
            f"(subclass cafa_cli.engine.method.Method)"
        )
    if method.needs_statistics and gaussians is None:
        raise UsageError(f"the plug-in method {spec} needs class statistics: give --stats (an artifact of cafa stats)")
    return method
