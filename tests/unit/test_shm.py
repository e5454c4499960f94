"""`utils.shm`: which /dev/shm files a process holds, and the sweep that removes the files a killed process left
and keeps those a live process still uses (what `VLLMEngine.shutdown` does after vLLM kills a slow worker)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

import pytest

from openppo.utils import shm

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc (Linux)")

# maps the file at argv[1] (its fd stays open too), says so, and waits to be killed
HOLDER = """
import mmap, sys, time
f = open(sys.argv[1], "r+b")
m = mmap.mmap(f.fileno(), 0)
print("holding", flush=True)
time.sleep(600)
"""


def _hold(path: str) -> subprocess.Popen:
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, path], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "holding\n"
    return proc


def test_the_files_a_killed_process_left_are_removed_and_a_live_ones_kept():
    name = f"{shm.SHM_DIR}openppo-test-{uuid.uuid4().hex}"
    killed, live, never = f"{name}-killed", f"{name}-live", f"{name}-never"
    procs = [_hold(killed), _hold(live)]
    try:
        assert shm.held_by(procs[0].pid) == {killed} and shm.held_by(procs[1].pid) == {live}
        tree = shm.held_by_descendants()
        assert {p.pid: tree[p] for p in tree if p.pid in (procs[0].pid, procs[1].pid)} == {
            procs[0].pid: {killed},
            procs[1].pid: {live},
        }
        assert shm.orphans([killed, live, never]) == set()  # both are held
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(timeout=30)
        assert shm.held_by(procs[0].pid) == set()
        assert shm.orphans([killed, live, never]) == {killed}
        assert shm.remove_orphans([killed, live, never]) == {killed: 4096}
        assert not os.path.exists(killed) and os.path.exists(live)
        assert shm.remove_orphans([killed, live]) == {}
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=30)
        for path in (killed, live):
            if os.path.exists(path):
                os.unlink(path)
