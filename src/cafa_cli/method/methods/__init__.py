"""The test-time adaptation methods, one file each, behind one small protocol (base.py).

    from cafa_cli.method.methods import create
    adapter = Adapter(model, create("cafa", gaussians, device), device)

Importing this package does not import torch (the command line lists NAMES in its help
and must start fast): each method's module is imported when it is first created.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cafa_cli.method.gaussians import ClassGaussians
    from cafa_cli.method.methods.base import Method


NAMES = ("source", "bn", "pl", "tent", "cafa", "global-fa", "intra", "euclidean", "eta", "eata", "cafa-eata", "sar", "t3a", "lame", "cotta", "rotta", "cafa-robust")


NEEDS_STATISTICS = ("cafa", "global-fa", "intra", "euclidean", "cafa-eata", "cafa-robust")  # class Gaussians from cafa stats

# methods whose prediction for a batch is the plain forward pass before their update, so on
# a stream of one batch they predict exactly as bn (t3a, lame, cotta and rotta change the
# prediction itself: prototypes, Laplacian assignment, a teacher, robust normalisation)
PREDICT_AS_BN_BEFORE_UPDATING = ("pl", "tent", "cafa", "global-fa", "intra", "euclidean", "eta", "eata", "cafa-eata", "sar")

# methods whose constructor takes the device although they need no statistics
_ON_DEVICE = ("eta", "eata", "sar")


# name -> (module, class); the ablations intra and euclidean are CAFA with another loss or metric
_CLASSES = {
    "source": ("source", "Source"),
    "bn": ("bn", "BatchNormOnly"),
    "pl": ("pl", "PseudoLabel"),
    "tent": ("tent", "Tent"),
    "cafa": ("cafa", "Cafa"),
    "global-fa": ("global_fa", "GlobalFA"),
    "intra": ("cafa", "IntraOnly"),
    "euclidean": ("cafa", "Euclidean"),
    "eta": ("eata", "Eta"),
    "eata": ("eata", "Eata"),
    "cafa-eata": ("cafa_eata", "CafaEata"),
    "sar": ("sar", "Sar"),
    "t3a": ("t3a", "T3A"),
    "lame": ("lame", "Lame"),
    "cotta": ("cotta", "CoTTA"),
    "rotta": ("rotta", "RoTTA"),
    "cafa-robust": ("cafa_robust", "CafaRobust"),
}


def create(name: str, gaussians: ClassGaussians | None = None, device="cpu", **options) -> Method:
    """The method called `name`, ready for an Adapter. Those in NEEDS_STATISTICS take the
    class Gaussians (an artifact's `.gaussians`, or `estimate(moments)`) and keep what they
    need of them on `device`, which must be the Adapter's. `options` are the method's own
    (options_of(name): eata's `redundancy_margin`, lame's `affinity`, ...; text values
    are converted), and the data some take (eata's `fisher_batches`, normalised source
    images for its Fisher term). `name` may also be a plug-in, 'package.module:factory'
    or 'path/file.py:factory': its module is imported (its code runs) and
    `factory(gaussians, device, **options)` must return a Method (base.py), the options
    those its `options` attribute declares as a Method's are; give such a name only from
    the command line or your own code."""
    from cafa_cli.errors import UsageError
    from cafa_cli.method.options import resolve_options

    if is_plugin(name):
        return _plugin(name, gaussians, device, options)
    if name not in NAMES:
        raise UsageError(f"`method` must be one of {', '.join(NAMES)}, or a plug-in module:factory, not {name}")
    if name in NEEDS_STATISTICS and gaussians is None:
        raise UsageError(f"the method {name} needs class statistics: give it the gaussians of an artifact made by "
                         f"cafa stats (read_artifact(path).gaussians), or estimate(moments) of the source features")
    method = method_class(name)
    inputs = {key: options.pop(key) for key in method.inputs if key in options}
    options = {**resolve_options(name, method.options, options), **inputs}
    if name in NEEDS_STATISTICS:
        return method(gaussians, device, **options)
    return method(device, **options) if name in _ON_DEVICE else method(**options)


def method_class(name: str) -> type[Method]:
    """The class of a built-in method (its module imported: this imports torch)."""
    module, cls = _CLASSES[name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def options_of(name: str) -> tuple:
    """The options.Option tuple a built-in method declares (its own options, with defaults)."""
    return method_class(name).options


def is_plugin(name: str) -> bool:
    """'package.module:factory' or 'file.py:factory': a method written against the protocol."""
    return ":" in name


def _plugin(spec: str, gaussians, device, options: dict) -> Method:
    from cafa_cli.errors import InputError, UsageError
    from cafa_cli.method.methods.base import Method
    from cafa_cli.method.options import Option, resolve_options
    from cafa_cli.factories import import_factory

    factory, function = import_factory(spec, "`method`", "factory")
    declared = getattr(factory, "options", ())
    if not isinstance(declared, tuple) or not all(isinstance(option, Option) for option in declared):
        raise InputError(f"`method` {spec}: {function}.options must be a tuple of cafa_cli.method.options.Option")
    options = resolve_options(spec, declared, options)
    try:
        method = factory(gaussians, device, **options)
    except (Exception, SystemExit) as error:  # a user's code can fail in any way; one line
        raise InputError(f"`method` {spec}: {function}(gaussians, device) failed ({type(error).__name__}: {error})") from None
    if not isinstance(method, Method):
        raise InputError(f"`method` {spec}: {function}() returned {type(method).__name__}, not a Method "
                         f"(subclass cafa_cli.method.methods.base.Method)")
    if method.needs_statistics and gaussians is None:
        raise UsageError(f"the plug-in method {spec} needs class statistics: give --stats (an artifact of cafa stats)")
    return method
