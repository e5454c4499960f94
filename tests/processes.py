"""Process helpers for the tests that kill a run: find everything a driver started, and make sure it is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


def tagged_pids(tag: str) -> list[int]:
    """Processes whose environment carries `tag` ("NAME=value"): the driver and everything it started (Ray's head
    processes, workers and engines inherit the driver's environment)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if tag.encode() in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def kill_tree(proc: subprocess.Popen, tag: str) -> None:
    """SIGKILL the driver's session, then any process it started that left it; wait until all are gone."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)
    deadline = time.monotonic() + 60
    while pids := tagged_pids(tag):
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert time.monotonic() < deadline, f"processes of the killed run still alive: {pids}"
        time.sleep(0.2)
