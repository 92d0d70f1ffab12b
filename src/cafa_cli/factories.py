"""Code named on the command line: a model factory (`--model file.py:build`) or a method
plug-in (`--method module:build`), imported by one function. Torch-free and below every
layer that takes such a name."""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path

from cafa_cli.errors import InputError, UsageError


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
        raise InputError(f"{option} {spec}: {location} is {kind}; give 'path/to/file.py:{what}' or 'package.module:{what}'")
    try:
        if location.endswith(".py"):
            path = Path(location)
            if not path.is_file():
                raise InputError(f"{option} {spec}: no such file {location}")
            module_spec = importlib.util.spec_from_file_location(f"cafa_user_model_{path.stem}", path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(location)
    except InputError:
        raise
    except SystemExit as error:  # a script's argparse or sys.exit: exit 0 here would tell CI the run succeeded
        raise InputError(f"{option} {spec}: importing {location} called sys.exit({error.code!r}) (argparse or a script's main "
                         f"at import?); keep it under if __name__ == '__main__':") from None
    except Exception as error:  # a user's file can fail in any way; report it on one line
        raise InputError(f"{option} {spec}: could not import {location} ({type(error).__name__}: {error})") from None
    factory = getattr(module, function, None)
    if not callable(factory):
        raise InputError(f"{option} {spec}: {location} has no {what} {function}")
    return factory, function
