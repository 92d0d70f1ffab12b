"""The libraries' models as one: the weights a name means, from the local cache, and the
preprocessing a model declares, for timm (model/hub.py), torchvision (model/hub.py) and open_clip
(model/openclip.py), which each build on hub's checks."""

from __future__ import annotations

from cafa_cli.model import hub, openclip
from cafa_cli.model.hub import CachedWeights
from cafa_cli.model.zoo import robustbench


def cached_weights(model: str, weights: str) -> CachedWeights:
    """`weights` by name for `model` (timm:NAME, openclip:NAME, torchvision:NAME or a
    torchvision name), from the local cache."""
    library, name = hub.library_of(model)
    if library == "timm":
        return hub.cached_timm_weights(name, weights)
    if library == "openclip":
        return openclip.cached_weights(name, weights)
    return hub.cached_torchvision_weights(hub.torchvision_weights(name, weights))


def declared_preprocessing(model: str | None, weights: str | None, kwargs: dict) -> dict | None:
    """The preprocessing the model declares: a timm model's pretrained config (with or
    without weights: it is the architecture's), an open_clip model's (its config's, its
    pretrained tag's), torchvision weights named by enum, a `robustbench:` model's own
    (model/zoo/robustbench.py); else None."""
    if robustbench.is_robustbench(model):
        return dict(robustbench.lookup(model).preprocessing)
    library, name = hub.library_of(model or "")
    named = weights is not None and hub.is_weights_name(weights)
    if library == "timm":
        return hub.timm_preprocessing(name, weights if named else None, kwargs)
    if library == "openclip":
        return openclip.preprocessing(name, weights if named else None, kwargs)
    if named and model and (library == "torchvision" or (":" not in model and name in hub.torchvision_names())):
        return hub.torchvision_preprocessing(hub.torchvision_weights(name, weights))
    return None
