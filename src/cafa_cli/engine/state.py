"""An adaptation's state as plain data, and back: what `Adapter.state_dict()` saves of a
method (its moving means, banks, teachers), so that a stream can stop and go on later,
in another process, bit for bit.

`snapshot(value)` turns tensors, Python scalars, lists, tuples, dicts, modules (their state
dicts) and a method's own objects (their attributes) into nested dicts, lists and tensors
that `torch.save` writes and `torch.load(weights_only=True)` reads back: no pickled code.

`restore(target, saved, where)` pours a snapshot into `target`, an object the Adapter and
the method have already built, which is the schema the file must fit. A saved file is
untrusted input (weights_only=True only protects the unpickling; whatever is re-created
after it is this module's responsibility), so restoring constructs nothing from a name in
the file and calls nothing the file chooses: a tensor is copied into a tensor, a module
loads a state dict of its own keys and shapes, an object gets the attributes its class
has, and an entry the target has no place for, or of another kind, is refused with an
InputError naming where it sits. Where the target is still empty (None: a bank not yet
filled) only plain data is accepted: tensors, numbers, strings and lists or dicts of them.
"""

from __future__ import annotations

import hashlib
import keyword
import sys
from dataclasses import fields, is_dataclass

import torch

from cafa_cli.core.errors import InputError

MODULE, OBJECT = "__module_state__", "__object__"  # the markers of a module's and an object's snapshot
SCALARS = (bool, int, float, str)


def snapshot(value, seen: frozenset = frozenset()):
    """`value` as plain data (module docstring). Objects reached twice on one path (a cycle)
    are refused: a method's state is a tree."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if value is None or isinstance(value, SCALARS):
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
    return {OBJECT: class_name(value), "attributes": snapshot(vars(value), seen)}


def class_name(value) -> str:
    """The class a snapshot records: its name alone, so that a state outlives a module's move
    (only an object of the class already built in that place is ever restored)."""
    return type(value).__qualname__


def names_class_of(saved: dict, target) -> bool:
    """Whether a snapshot is of the target's class; states saved by earlier versions
    recorded `module:name`."""
    return str(saved.get(OBJECT, "")).rpartition(":")[2] == class_name(target)


def refused(where: str, why: str) -> InputError:
    return InputError(f"the saved state's {where} {why}: not a state of this adaptation")


def restore(target, saved, where: str):
    """`saved` (a snapshot) poured into `target`, which it returns or replaces (module
    docstring); `where` names the entry in errors."""
    if target is None:
        return plain_data(saved, where)
    if saved is None and isinstance(target, (torch.Tensor, *SCALARS, list, tuple, dict)):
        return None  # data a reset empties (a bank, a moving mean)
    if isinstance(target, torch.Tensor):
        if (
            not isinstance(saved, torch.Tensor)
            or saved.layout != torch.strided
            or saved.dtype != target.dtype
            or saved.dim() != target.dim()
        ):
            raise refused(where, f"is {kind_of(saved)}, not a {target.dim()}-d {target.dtype} tensor")
        if target.shape == saved.shape:
            with torch.no_grad():
                target.copy_(saved)
            return target
        return saved.to(target.device)  # a bank that has grown since it was made
    if isinstance(target, torch.nn.Module):
        if not isinstance(saved, dict) or set(saved) != {MODULE}:
            raise refused(where, f"is {kind_of(saved)}, not a network's weights")
        load_module(target, saved[MODULE], where)
        return target
    if isinstance(target, (bool, str)):
        if type(saved) is not type(target):
            raise refused(where, f"is {kind_of(saved)}, not a {type(target).__name__}")
        return saved
    if type(target) in (int, float):
        if type(saved) not in (int, float):
            raise refused(where, f"is {kind_of(saved)}, not a number")
        return saved
    if isinstance(target, (list, tuple)):
        if not isinstance(saved, (list, tuple)):
            raise refused(where, f"is {kind_of(saved)}, not a list")
        known = list(target) + [None] * (len(saved) - len(target))
        items = [restore(old, item, f"{where}[{i}]") for i, (old, item) in enumerate(zip(known, saved))]
        if isinstance(target, list):
            target[:] = items  # the same list: what refers to it sees the restored items
            return target
        return tuple(items)
    if isinstance(target, dict):
        if not isinstance(saved, dict) or MODULE in saved or OBJECT in saved:
            raise refused(where, f"is {kind_of(saved)}, not a dict")
        return {key: restore(target.get(key), item, f"{where}[{key!r}]") for key, item in saved.items()}
    if type(target).__module__.startswith("cafa_cli.") and hasattr(target, "__dict__"):
        if not isinstance(saved, dict) or not names_class_of(saved, target):
            raise refused(where, f"is {kind_of(saved)}, not the {type(target).__qualname__} this method keeps")
        if set(saved) != {OBJECT, "attributes"} or not isinstance(saved["attributes"], dict):
            raise refused(where, "is not an object's attributes")
        restore_attributes(target, saved["attributes"], where)
        return target
    raise refused(where, f"replaces a {type(target).__name__}, which a state does not hold")


def restore_attributes(target, saved: dict, where: str, left_out: frozenset = frozenset()) -> None:
    """Each saved attribute poured into the one `target` has: an attribute its class
    declares or its constructor made, never a method, property or private name, nor one
    of `left_out` (what is made once from the inputs, or an option typed anew)."""
    had = set(vars(target))
    try:
        for key, item in saved.items():
            if not is_state_attribute(target, key) or key in left_out:
                raise refused(f"{where}.{key}" if isinstance(key, str) else where, "is no state this method keeps")
            setattr(target, key, restore(getattr(target, key, None), item, f"{where}.{key}"))
    except Exception:
        for key in set(vars(target)) - had:  # the caller puts back the values of the others
            delattr(target, key)
        raise


def is_state_attribute(target, key) -> bool:
    if not isinstance(key, str) or not key.isidentifier() or keyword.iskeyword(key) or key.startswith("__"):
        return False
    declared = getattr(type(target), key, None)
    if callable(declared) or isinstance(declared, (property, staticmethod, classmethod)):
        return False
    return key in vars(target) or hasattr(type(target), key)


def plain_data(saved, where: str):
    """What an empty place (None) may receive: tensors, None, numbers, strings, and lists,
    tuples and dicts of them, never a network's or an object's snapshot."""
    if isinstance(saved, torch.Tensor) and saved.layout != torch.strided:
        raise refused(where, f"is a {saved.layout} tensor, which a method does not keep")
    if saved is None or isinstance(saved, (*SCALARS, torch.Tensor)):
        return saved
    if isinstance(saved, (list, tuple)):
        items = [plain_data(item, f"{where}[{i}]") for i, item in enumerate(saved)]
        return items if isinstance(saved, list) else tuple(items)
    if isinstance(saved, dict) and MODULE not in saved and OBJECT not in saved:
        return {key: plain_data(item, f"{where}[{key!r}]") for key, item in saved.items()}
    raise refused(where, f"is {kind_of(saved)} where this method keeps nothing yet")


def load_module(module: torch.nn.Module, saved, where: str) -> None:
    """A module's state dict, checked key by key against its own (names, shapes, dtypes)
    before anything is loaded, so that a foreign one changes nothing."""
    check_tensors(module.state_dict(), saved, where)
    module.load_state_dict(saved)


def check_tensors(own: dict, saved, where: str) -> None:
    """`saved` holds exactly `own`'s tensors: the same names, shapes and dtypes."""
    if not isinstance(saved, dict):
        raise refused(where, f"is {kind_of(saved)}, not a network's weights")
    missing, extra = [k for k in own if k not in saved], [k for k in saved if k not in own]
    if missing or extra:
        named = (["lacks " + ", ".join(map(str, missing[:3]))] if missing else []) + (
            ["has " + ", ".join(map(str, extra[:3])) + " in addition"] if extra else []
        )
        raise refused(where, " and ".join(named) + " (another model's weights?)")
    for key, tensor in own.items():
        theirs = saved[key]
        if not isinstance(tensor, torch.Tensor):
            continue  # a module's extra state is its own to check
        if not isinstance(theirs, torch.Tensor) or theirs.shape != tensor.shape or theirs.dtype != tensor.dtype:
            raise refused(f"{where}.{key}", f"is {kind_of(theirs)}, not a {list(tensor.shape)} {tensor.dtype} tensor")


def kind_of(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {list(value.shape)} {value.dtype} tensor"
    if isinstance(value, dict) and OBJECT in value:
        return f"a snapshot of {value[OBJECT]}"
    if isinstance(value, dict) and MODULE in value:
        return "a network's weights"
    return "None" if value is None else f"a {type(value).__name__}"


def tensors_sha256(value) -> str:
    """A fingerprint of the tensors in `value` (tensors; lists, tuples, dicts and dataclasses of
    them; anything else by its repr), their order, dtypes, shapes and bytes: what a saved state
    records of the data an adaptation was built from (weights, statistics, a Fisher)."""
    digest = hashlib.sha256()

    def walk(item, path: str) -> None:
        if isinstance(item, torch.Tensor):
            digest.update(f"{path} {item.dtype} {list(item.shape)}\n".encode())
            data = item.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            if sys.byteorder == "big" and item.element_size() > 1:  # the bytes as a little-endian machine holds them
                data = data.reshape(-1, item.element_size()).flip(1).reshape(-1)
            digest.update(data.numpy().tobytes())
        elif isinstance(item, dict):
            for key in sorted(item, key=str):
                walk(item[key], f"{path}.{key}")
        elif isinstance(item, (list, tuple)):
            for i, element in enumerate(item):
                walk(element, f"{path}[{i}]")
        elif is_dataclass(item) and not isinstance(item, type):
            for field in fields(item):
                walk(getattr(item, field.name), f"{path}.{field.name}")
        else:
            digest.update(f"{path} {item!r}\n".encode())

    walk(value, "")
    return digest.hexdigest()
