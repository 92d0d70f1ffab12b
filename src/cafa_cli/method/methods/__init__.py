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


NAMES = ("source", "bn", "pl", "tent", "cafa", "global-fa", "intra", "euclidean")


NEEDS_STATISTICS = ("cafa", "global-fa", "intra", "euclidean")  # class Gaussians from cafa stats


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
}


def create(name: str, gaussians: ClassGaussians | None = None, device="cpu") -> Method:
    """The method called `name`, ready for an Adapter. Those in NEEDS_STATISTICS take the
    class Gaussians (an artifact's `.gaussians`, or `estimate(moments)`) and keep what they
    need of them on `device`, which must be the Adapter's."""
    from cafa_cli.errors import UsageError

    if name not in NAMES:
        raise UsageError(f"`method` must be one of {', '.join(NAMES)}, not {name}")
    if name in NEEDS_STATISTICS and gaussians is None:
        raise UsageError(f"the method {name} needs class statistics: give it the gaussians of an artifact made by "
                         f"cafa stats (read_artifact(path).gaussians), or estimate(moments) of the source features")
    module, cls = _CLASSES[name]
    method = getattr(importlib.import_module(f"{__name__}.{module}"), cls)
    return method(gaussians, device) if name in NEEDS_STATISTICS else method()
