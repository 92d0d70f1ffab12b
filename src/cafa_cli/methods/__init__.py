"""The test-time adaptation methods, one file each, behind one small protocol (engine/method.py),
and the one table that names them (REGISTRY).

    from cafa_cli.methods import create
    adapter = Adapter(model, create("cafa", gaussians, device), device)

A built-in method is its file (a Method subclass), its recipe (recipes/NAME.toml) and
one Entry below; what several methods share is in shared/. Everything else that lists
methods reads this table: the command line's choices and completion, `cafa methods`,
bench's rows, and `create`.

Importing this package does not import torch (the command line lists the names in its
help and must start fast): each method's module is imported when it is first created.
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
    """A built-in method: where its class is, and what must be known of it before its
    module (and torch) is imported."""

    module: str  # its module: a name in this package, or a full dotted path
    cls: str  # its Method subclass in that module
    # it takes class Gaussians (cafa stats) as its first argument, and the device
    needs_statistics: bool = False
    on_device: bool = False  # without statistics, its constructor still takes the device
    # its prediction for a batch is the plain forward pass before its update, so on a
    # stream of one batch it predicts exactly as bn (t3a, lame, cotta and rotta change the
    # prediction itself: prototypes, Laplacian assignment, a teacher, robust normalisation)
    predicts_as_bn: bool = False
    # it takes clean source images (`source_data`, as eata's `fisher_batches`); without them it
    # runs as this says (a warning); None: it takes none
    without_source_images: str | None = None
    # its recipe file, "package:file.toml"; None: this tool's recipes/NAME.toml
    recipe: str | None = None

    def module_path(self) -> str:
        return self.module if "." in self.module else f"{__name__}.{self.module}"


# the ablations intra and euclidean are CAFA with another loss or metric; eta is EATA without its Fisher term
REGISTRY: dict[str, Entry] = {
    "source": Entry("source", "Source"),
    "bn": Entry("bn", "BatchNormOnly"),
    "pl": Entry("pl", "PseudoLabel", predicts_as_bn=True),
    "tent": Entry("tent", "Tent", predicts_as_bn=True),
    "cafa": Entry("cafa", "Cafa", needs_statistics=True, predicts_as_bn=True),
    "global-fa": Entry("global_fa", "GlobalFA", needs_statistics=True, predicts_as_bn=True),
    "intra": Entry("cafa", "IntraOnly", needs_statistics=True, predicts_as_bn=True),
    "euclidean": Entry("cafa", "Euclidean", needs_statistics=True, predicts_as_bn=True),
    "eta": Entry("eata", "Eta", on_device=True, predicts_as_bn=True),
    "eata": Entry(
        "eata",
        "Eata",
        on_device=True,
        predicts_as_bn=True,
        without_source_images="runs as eta: its Fisher anti-forgetting term needs clean source images",
    ),
    "cafa-eata": Entry("cafa_eata", "CafaEata", needs_statistics=True, predicts_as_bn=True),
    "sar": Entry("sar", "Sar", on_device=True, predicts_as_bn=True),
    "deyo": Entry("deyo", "DeYO", predicts_as_bn=True),
    "rdumb": Entry("rdumb", "RDumb", on_device=True, predicts_as_bn=True),  # eta under its recipe's reset every:1000
    "rpl": Entry("rpl", "Rpl", predicts_as_bn=True),
    "memo": Entry("memo", "Memo"),  # predicts each image after its own update
    "ttaug": Entry("ttaug", "TTAug"),  # the mean over augmented views, not the plain pass
    "t3a": Entry("t3a", "T3A"),
    "lame": Entry("lame", "Lame"),
    "cotta": Entry("cotta", "CoTTA"),
    "rotta": Entry("rotta", "RoTTA"),
    "rmt": Entry(
        "rmt",
        "Rmt",
        needs_statistics=True,
        without_source_images="runs as its authors' source-free variant: no warm-up and no source replay",
    ),
    "roid": Entry("roid", "Roid", on_device=True),  # not predicts_as_bn: its prior correction rescales the logits
    "cmf": Entry("cmf", "CMF"),  # not predicts_as_bn: its prior correction rescales the logits
    "adacontrast": Entry("adacontrast", "AdaContrast", on_device=True),  # predicts after its update
    "santa": Entry("santa", "Santa", needs_statistics=True, predicts_as_bn=True),
    "cafa-robust": Entry("cafa_robust", "CafaRobust", needs_statistics=True),
}


PLUGIN = Entry("", "")  # what is known of a plug-in before it is made: nothing


def entry_of(name: str) -> Entry:
    """The registry's entry for `name`; a plug-in's is PLUGIN (it says what it needs when made)."""
    return REGISTRY.get(name, PLUGIN)


def create(name: str, gaussians: ClassGaussians | None = None, device="cpu", **options) -> Method:
    """The method called `name`, ready for an Adapter. Those that need statistics take the
    class Gaussians (an artifact's `.gaussians`, or `estimate(moments)`) and keep what they
    need of them on `device`, which must be the Adapter's. `options` are the method's own
    (options_of(name): eata's `redundancy_margin`, lame's `affinity`, ...; text values
    are converted), and the data some take (eata's `fisher_batches`, normalised source
    images for its Fisher term). `name` may also be a plug-in, 'package.module:factory'
    or 'path/file.py:factory': its module is imported (its code runs) and
    `factory(gaussians, device, **options)` must return a Method (base.py), the options
    those its `options` attribute declares as a Method's are; give such a name only from
    the command line or your own code."""
    from cafa_cli.core.errors import UsageError
    from cafa_cli.engine.options import resolve_options

    if is_plugin(name):
        return _plugin(name, gaussians, device, options)
    if name not in REGISTRY:
        raise UsageError(f"`method` must be one of {', '.join(REGISTRY)}, or a plug-in module:factory, not {name}")
    entry = REGISTRY[name]
    if entry.needs_statistics and hasattr(gaussians, "gaussians"):  # an Artifact where its statistics go
        raise UsageError(
            f"the method {name} takes the artifact's class statistics: create({name!r}, artifact.gaussians)"
        )
    if entry.needs_statistics and gaussians is None:
        raise UsageError(
            f"the method {name} needs class statistics: give it the gaussians of an artifact made by "
            f"cafa stats (read_artifact(path).gaussians), or estimate(moments) of the source features"
        )
    method = method_class(name)
    inputs = {key: options.pop(key) for key in method.inputs if key in options}
    options = {**resolve_options(name, method.options, options), **inputs}
    if entry.needs_statistics:
        return method(gaussians, device, **options)
    return method(device, **options) if entry.on_device else method(**options)


def method_class(name: str) -> type[Method]:
    """The class of a built-in method (its module imported: this imports torch)."""
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
    from cafa_cli.core.errors import InputError, UsageError
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
