"""Code named on the command line: a model factory (`--model file.py:build`) or a method
plug-in (`--method module:build`), imported by one function. Torch-free and below every
layer that takes such a name."""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

from cafa_cli.core.errors import InputError, UsageError, repeated
from cafa_cli.core.files import reading

# `--model timm:NAME` / `torchvision:NAME` / `robustbench:DATASET/NAME` / `openclip:ARCH`: a model
# built by name (an open_clip config file is data), not code to import
HUB_PREFIXES = ("timm:", "torchvision:", "robustbench:", "openclip:")


def is_factory(model: str | None) -> bool:
    """Whether `model` names code to import (`file.py:fn`, `package.module:fn`): not a
    bundled or torchvision name, nor a `timm:` / `torchvision:` name."""
    return bool(model) and ":" in model and not model.startswith(HUB_PREFIXES)


def code_file(spec: str | None) -> str | None:
    """The file a factory or plug-in name resolves to, found without running it (a dotted
    module's parent packages are imported to find it), as import_factory would import it:
    `file.py:fn` its file, `module:fn` the module's file on the import path, then in the
    working folder; None for a name that is no code, or a module not found."""
    if not is_factory(spec):
        return None
    location = spec.rpartition(":")[0]
    if location.endswith(".py"):
        return location
    try:
        if "." in location:
            found = importlib.util.find_spec(location)
        else:
            found = importlib.machinery.PathFinder.find_spec(location, [*sys.path, os.getcwd()])
    except (ImportError, ValueError, AttributeError):
        return None
    return found.origin if found is not None and found.has_location else None


def parse_model_args(texts: list[str] | tuple[str, ...] | None, option: str = "`model_arg`") -> dict:
    """['image_size=64', 'drop_rate=0.1', 'act=gelu'] -> {'image_size': 64, 'drop_rate': 0.1, 'act': 'gelu'}:
    each value a Python literal (numbers, True, None, tuples, quoted strings), else the text itself.
    Literals only (ast.literal_eval): a value never runs code."""
    pairs = []
    for text in texts or ():
        key, equals, value = str(text).partition("=")
        key = key.strip()
        if not equals or not key.isidentifier():
            raise UsageError(
                f"{option} {text!r}: expected KEY=VALUE with KEY a keyword argument name (e.g. image_size=64)"
            )
        try:
            parsed = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            parsed = value.strip()  # a bare word: the string (act=gelu)
        pairs.append((key, parsed))
    twice = repeated([key for key, _ in pairs])
    if twice:
        raise UsageError(f"{option} gives {twice[0]} twice; give each keyword once")
    return dict(pairs)


def import_factory(spec: str, option: str, what: str = "function"):
    """The callable that `spec` names, 'path/to/file.py:NAME' or 'package.module:NAME',
    imported (its code runs: only for a spec given on the command line), and NAME; each
    failure in one line that names `option`."""
    location, _, function = spec.rpartition(":")
    if not function.isidentifier():
        raise UsageError(f"{option} {spec}: expected 'path/to/file.py:{what}' or 'package.module:{what}'")
    if not location.endswith(".py") and ("/" in location or os.sep in location or location.startswith((".", "~"))):
        # a path, and no module name: importlib would fail with a TypeError about relative imports
        path = Path(location)
        kind = "a folder" if path.is_dir() else "not a .py file" if path.exists() else "no such file"
        raise InputError(
            f"{option} {spec}: {location} is {kind}; give 'path/to/file.py:{what}' or 'package.module:{what}'"
        )
    try:
        if location.endswith(".py"):
            path = Path(location)
            if not path.is_file():
                raise InputError(f"{option} {spec}: no such file {location}")
            reading(path, option)
            module_spec = importlib.util.spec_from_file_location(f"cafa_user_model_{path.stem}", path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            # as `python -m` would find it: a module in the working folder (mymodels.py), last,
            # so that it never shadows an installed package of the same name
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.append(os.getcwd())
            module = importlib.import_module(location)
            reading(getattr(module, "__file__", None), option)  # the file `location` resolved to
    except (InputError, UsageError):
        raise
    except SystemExit as error:  # a script's argparse or sys.exit: exit 0 here would tell CI the run succeeded
        raise InputError(
            f"{option} {spec}: importing {location} called sys.exit({error.code!r}) (argparse or a script's main "
            f"at import?); keep it under if __name__ == '__main__':"
        ) from None
    except Exception as error:  # a user's file can fail in any way; report it on one line
        raise InputError(f"{option} {spec}: could not import {location} ({type(error).__name__}: {error})") from None
    factory = getattr(module, function, None)
    if not callable(factory):
        raise InputError(f"{option} {spec}: {location} has no {what} {function}")
    return factory, function
