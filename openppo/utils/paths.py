"""Checks on the paths a run will write to, made before anything is written.

A save path that is an existing file, or that lies under one, fails only when the run first writes there (after
the data is loaded and the workers are up) and with a bare OSError; these checks turn it into one line naming
the flag at start-up. Nothing is created here.
"""

from __future__ import annotations

import os
from pathlib import Path

from openppo.errors import UserError, require


def _creatable(path: Path, shown: str, flag: str) -> None:
    """The nearest existing ancestor of `path` must be a writable folder (so the missing part can be created)."""
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UserError(f"{flag}: {shown} lies under the file {parent}; pass a path below a folder")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise UserError(f"{flag}: cannot create {shown}: {parent} is not writable; pass a writable location")
            return


def check_output_dir(path: str, flag: str) -> None:
    """`path` is an existing folder or one that can be created; UserError naming `flag` otherwise."""
    require(bool(path), f"{flag} is empty; pass the folder to write to")
    p = Path(path).expanduser()
    if p.exists():
        require(p.is_dir(), f"{flag}: {path} is an existing file, not a folder; pass a folder path")
        require(os.access(p, os.W_OK | os.X_OK), f"{flag}: {path} is not writable; pass a writable folder")
        return
    _creatable(p, path, flag)


def check_output_file(path: str, flag: str) -> None:
    """`path` can be written as a file (missing parent folders are created); UserError naming `flag` otherwise."""
    require(bool(path), f"{flag} is empty; pass the file to write")
    p = Path(path).expanduser()
    if p.exists():
        require(not p.is_dir(), f"{flag}: {path} is a folder; pass a file path inside it")
        require(os.access(p, os.W_OK), f"{flag}: {path} is not writable; pass another file")
        return
    _creatable(p, path, flag)
