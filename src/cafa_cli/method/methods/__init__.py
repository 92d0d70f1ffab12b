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


NAMES = ("source", "bn", "pl", "tent", "cafa", "global-fa", "intra", "euclidean", "eta", "eata", "cafa-eata", "sar", "t3a", "lame", "cotta", "rotta")


NEEDS_STATISTICS = ("cafa", "global-fa", "intra", "euclidean", "cafa-eata")  # class Gaussians from cafa stats

# methods whose prediction for a batch is the plain forward pass before their update, so on
# a stream of one batch they predict exactly as bn (t3a, lame, cotta and rotta change the
# prediction itself: prototypes, Laplacian assignment, a teacher, robust normalisation)
PREDICT_AS_BN_BEFORE_UPDATING = ("pl", "tent", "cafa", "global-fa", "intra", "euclidean", "eta", "eata", "cafa-eata", "sar")

# the keyword options each method takes beyond gaussians and device (create(name, ..., **options))
OPTIONS = {"eata": ("fisher_batches", "fisher_alpha"), "sar": ("rho", "reset_below"), "t3a": ("filter_k",),
           "lame": ("knn", "bound_lambda", "max_steps"),
           "cotta": ("teacher_momentum", "restore_probability", "confidence_threshold", "augmentations"),
           "rotta": ("memory_size", "update_every", "teacher_momentum", "bn_momentum", "lambda_t", "lambda_u")}

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
}


def create(name: str, gaussians: ClassGaussians | None = None, device="cpu", **options) -> Method:
    """The method called `name`, ready for an Adapter. Those in NEEDS_STATISTICS take the
    class Gaussians (an artifact's `.gaussians`, or `estimate(moments)`) and keep what they
    need of them on `device`, which must be the Adapter's. `options` are the method's own
    (OPTIONS: eata's `fisher_batches`, normalised source images for its Fisher term).
    `name` may also be a plug-in, 'package.module:factory' or 'path/file.py:factory':
    its module is imported (its code runs) and `factory(gaussians, device)` must return
    a Method (base.py); give such a name only from the command line or your own code."""
    from cafa_cli.errors import UsageError

    if is_plugin(name):
        return _plugin(name, gaussians, device, options)
    if name not in NAMES:
        raise UsageError(f"`method` must be one of {', '.join(NAMES)}, or a plug-in module:factory, not {name}")
    if name in NEEDS_STATISTICS and gaussians is None:
        raise UsageError(f"the method {name} needs class statistics: give it the gaussians of an artifact made by "
                         f"cafa stats (read_artifact(path).gaussians), or estimate(moments) of the source features")
    unknown = sorted(set(options) - set(OPTIONS.get(name, ())))
    if unknown:
        raise UsageError(f"the method {name} takes no option {', '.join(unknown)}"
                         + (f" (its options: {', '.join(OPTIONS[name])})" if name in OPTIONS else ""))
    module, cls = _CLASSES[name]
    method = getattr(importlib.import_module(f"{__name__}.{module}"), cls)
    if name in NEEDS_STATISTICS:
        return method(gaussians, device, **options)
    return method(device, **options) if name in _ON_DEVICE else method(**options)


def is_plugin(name: str) -> bool:
    """'package.module:factory' or 'file.py:factory': a method written against the protocol."""
    return ":" in name


def _plugin(spec: str, gaussians, device, options: dict) -> Method:
    from cafa_cli.errors import InputError, UsageError
    from cafa_cli.method.methods.base import Method
    from cafa_cli.factories import import_factory

    if options:
        raise UsageError(f"the plug-in method {spec} takes no option {', '.join(sorted(options))}")
    factory, function = import_factory(spec, "`method`", "factory")
    try:
        method = factory(gaussians, device)
    except (Exception, SystemExit) as error:  # a user's code can fail in any way; one line
        raise InputError(f"`method` {spec}: {function}(gaussians, device) failed ({type(error).__name__}: {error})") from None
    if not isinstance(method, Method):
        raise InputError(f"`method` {spec}: {function}() returned {type(method).__name__}, not a Method "
                         f"(subclass cafa_cli.method.methods.base.Method)")
    if method.needs_statistics and gaussians is None:
        raise UsageError(f"the plug-in method {spec} needs class statistics: give --stats (an artifact of cafa stats)")
    return method
