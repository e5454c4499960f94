"""Importing a user's .py file (reward function, agent environment) by path."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from openppo.errors import UserError


def import_file(path: Path, flag: str, prefix: str) -> ModuleType:
    """Import `path` as a module of its own; a failing import is a one-line UserError naming `flag`.

    The module name is `prefix` + a hash of the resolved path, so two files both called reward.py coexist.
    """
    name = prefix + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling (Ray) look the module up here while it runs
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        sys.modules.pop(name, None)
        raise UserError(f"{flag}: importing {path} failed: {type(err).__name__}: {err}; fix the file") from err
    return module
