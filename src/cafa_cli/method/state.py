"""An adaptation's state as plain data, and back: what `Adapter.state_dict()` saves of a
method (its moving means, banks, teachers), so that a stream can stop and go on later,
in another process, bit for bit.

`snapshot(value)` turns tensors, Python scalars, lists, tuples, dicts, modules (their state
dicts) and a method's own objects (their attributes) into nested dicts, lists and tensors
that `torch.save` writes and `torch.load(weights_only=True)` reads back: no pickled code.
`restore(target, saved)` puts a snapshot back into `target`, in place where it can (a
tensor of the same shape is copied into, a module loads its state dict, an object gets
its attributes), so that what holds a reference to them sees the new values.
"""

from __future__ import annotations

import importlib

import torch

from cafa_cli.errors import InputError

MODULE, OBJECT = "__module_state__", "__object__"  # the markers of a module's and an object's snapshot


def snapshot(value, seen: frozenset = frozenset()):
    """`value` as plain data (module docstring). Objects reached twice on one path (a cycle)
    are refused: a method's state is a tree."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if id(value) in seen:
        raise ValueError(f"the state holds a cycle through a {type(value).__name__}")
    seen = seen | {id(value)}
    if isinstance(value, torch.nn.Module):
        return {MODULE: value.state_dict()}
    if isinstance(value, (list, tuple)):
        items = [snapshot(item, seen) for item in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        return {key: snapshot(item, seen) for key, item in value.items()}
    kind = type(value)
    if not kind.__module__.startswith("cafa_cli.") or not hasattr(value, "__dict__"):
        raise ValueError(f"the state holds a {kind.__module__}.{kind.__qualname__}, which cannot be saved")
    return {OBJECT: f"{kind.__module__}:{kind.__qualname__}", "attributes": snapshot(vars(value), seen)}


def restore(target, saved):
    """`saved` (a snapshot) put back into `target`, which it returns or replaces."""
    if isinstance(saved, torch.Tensor):
        if isinstance(target, torch.Tensor) and target.shape == saved.shape and target.dtype == saved.dtype:
            with torch.no_grad():
                target.copy_(saved)
            return target
        return saved.to(target.device) if isinstance(target, torch.Tensor) else saved
    if isinstance(saved, dict) and MODULE in saved:
        if not isinstance(target, torch.nn.Module):
            raise InputError("the saved state holds a network where this Adapter's method has none: another method")
        target.load_state_dict(saved[MODULE])
        return target
    if isinstance(saved, dict) and OBJECT in saved:
        if target is None or f"{type(target).__module__}:{type(target).__qualname__}" != saved[OBJECT]:
            target = _blank(saved[OBJECT])
        for key, item in saved["attributes"].items():
            setattr(target, key, restore(getattr(target, key, None), item))
        return target
    if isinstance(saved, dict):
        known = target if isinstance(target, dict) else {}
        return {key: restore(known.get(key), item) for key, item in saved.items()}
    if isinstance(saved, (list, tuple)):
        known = list(target) if isinstance(target, (list, tuple)) and len(target) == len(saved) else [None] * len(saved)
        items = [restore(old, item) for old, item in zip(known, saved)]
        if isinstance(target, list) and len(target) == len(items):
            target[:] = items  # the same list: what refers to it sees the restored items
            return target
        return items if isinstance(saved, list) else tuple(items)
    return saved


def _blank(name: str):
    """An object of the cafa_cli class `name` ('module:qualname'), its attributes to be set."""
    module, _, qualname = name.partition(":")
    if not module.startswith("cafa_cli."):
        raise InputError(f"the saved state names the class {name}, which is not cafa's: not a state cafa saved")
    kind = importlib.import_module(module)
    for part in qualname.split("."):
        kind = getattr(kind, part)
    return kind.__new__(kind)
